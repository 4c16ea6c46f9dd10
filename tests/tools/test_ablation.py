"""`make ablation` (tools.ablation): the three arms start from the very same BERT tensors, the statistics follow the
stated criterion, and the whole driver runs its stages on a few steps."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, subprocess_env
from finetune.model_io import load_init
from pretrain.config import load_config, resolve_model_config
from pretrain.hf import load_hf_bert
from pretrain.rng import seed_everything
from tools import ablation


def make_ablation(out: Path, samples_dir: Path, **extra) -> ablation.Ablation:
    args = dict(out=str(out), samples=str(samples_dir), bert=None, steps=3, finetune_steps=2, seeds=[42, 43],
                test_limit=4, keep_checkpoints=False) | extra
    return ablation.Ablation(argparse.Namespace(**args))


def test_the_three_arms_start_from_identical_bert_weights(samples_dir: Path, minilm_dir: Path, tmp_path: Path) -> None:
    driver = make_ablation(tmp_path / "out", samples_dir)
    assert driver.bert == minilm_dir  # found by looking for a BERT directory in the samples
    fingerprint = ablation.write_initial_model(minilm_dir, driver.init_dir)

    # arm bert: fine-tuning loads the directory the driver passes as --init
    argv = driver.finetune_argv("bert", "headline", 42)
    assert argv[argv.index("--init") + 1] == str(driver.init_dir)
    finetuned, _ = load_init(driver.init_dir)
    starts = {"bert": finetuned.state_dict()}
    # arms bert+mlm, bert+unilm: the trainer builds its model from model.init_from of the driver's command,
    # after seeding its RNGs with train.seed (varied here: the heads must come from the file, not the RNG)
    for seed, arm in zip((1234, 99), ("bert+mlm", "bert+unilm")):
        overrides = [a for a in driver.pretrain_command(arm) if "=" in a and not a.startswith("--")]
        assert f"model.init_from={driver.init_dir}" in overrides
        cfg = load_config(ROOT / ablation.PRETRAIN_CONFIG, overrides)
        seed_everything(seed)
        starts[arm] = load_hf_bert(cfg.model.init_from, resolve_model_config(cfg)).state_dict()

    names = sorted(starts["bert"])
    assert all(sorted(state) == names for state in starts.values())
    for name in names:
        assert torch.equal(starts["bert"][name], starts["bert+mlm"][name]), name
        assert torch.equal(starts["bert"][name], starts["bert+unilm"][name]), name
    assert ablation.state_fingerprint(starts["bert+unilm"]) == fingerprint
    # and they are the real BERT's tensors (HF token type 1 → our segment rows 1 and 5)
    original = load_file(minilm_dir / "model.safetensors")
    assert torch.equal(starts["bert"]["layers.3.ffn_in.weight"], original["encoder.layer.3.intermediate.dense.weight"])
    assert torch.equal(starts["bert+unilm"]["embeddings.segment.weight"][5],
                       original["embeddings.token_type_embeddings.weight"][1])
    assert torch.equal(starts["bert+mlm"]["embeddings.token.weight"], original["embeddings.word_embeddings.weight"])


def test_a_difference_is_real_only_beyond_twice_the_sd_of_the_per_seed_differences() -> None:
    steady = ablation.paired_differences([30.0, 31.0, 32.0], [28.0, 29.1, 29.9])  # +2.0, +1.9, +2.1
    assert steady["real"] and steady["mean"] == pytest.approx(2.0)
    noisy = ablation.paired_differences([30.0, 35.0, 28.0], [28.0, 29.0, 31.0])  # +2, +6, -3
    assert not noisy["real"] and noisy["sd"] == pytest.approx(4.5092, abs=1e-4)


def test_results_records_follow_the_published_schema() -> None:
    scores = {arm: {str(seed): {"headline": {"rougeL": 10.0 + i + seed - 42, "rouge1": 1.0, "rouge2": 1.0,
                                             "bleu": 1.0, "loss": 7.0 - 0.25 * i + 0.01 * (seed - 42)},
                                "topic": {"accuracy": 90.0, "macro_f1": 89.0}}
                    for seed in (42, 43, 44)} for i, arm in enumerate(ablation.ARMS)}
    records = ablation.results(scores, [42, 43, 44])
    assert {(r["arm"], r["task"]) for r in records} == {(a, t) for a in ablation.ARMS for t in ("headline", "topic")}
    unilm = next(r for r in records if (r["arm"], r["task"], r["metric"]) == ("bert+unilm", "headline", "rougeL"))
    assert set(unilm) == {"arm", "task", "metric", "mean", "sd", "seed_ids", "seeds"}
    assert unilm["seed_ids"] == [42, 43, 44] and unilm["seeds"] == [12.0, 13.0, 14.0] and unilm["mean"] == 13.0
    table = ablation.result_table(records)
    assert "| BBC headline | rougeL | 11.00 ± 1.00 (10.0, 11.0, 12.0)" in table
    assert "+2.00 **real**" in table  # identical per-seed differences: sd 0
    # a loss: lower is better, said in the row, with the precision its small differences need
    assert "| BBC headline | loss (lower is better) | 7.0100 ± 0.0100 (7.000, 7.010, 7.020)" in table
    assert "-0.5000 **real** (-0.500, -0.500, -0.500; 2·sd 0.0000)" in table
    header, rule, *rows = table.split("\n\n")[0].splitlines()
    assert header.endswith("| unilm − bert | unilm − mlm | mlm − bert |") and rule.count("---:") == 6
    assert rows[0].endswith("| +2.00 **real** (+2.0, +2.0, +2.0; 2·sd 0.00) | +1.00 **real** (+1.0, +1.0, +1.0; "
                            "2·sd 0.00) | +1.00 **real** (+1.0, +1.0, +1.0; 2·sd 0.00) |")  # mlm − bert last
    assert "headline loss: bert+unilm − bert = -0.50" in ablation.verdict(records)


@pytest.mark.slow
def test_the_driver_runs_every_stage_on_a_few_steps_and_skips_them_on_a_rerun(samples_dir: Path,
                                                                              tmp_path: Path) -> None:
    import subprocess
    import sys

    out = tmp_path / "ablation_out"
    argv = [sys.executable, "-m", "tools.ablation", "--out", str(out), "--samples", str(samples_dir), "--steps", "2",
            "--finetune-steps", "2", "--seeds", "42", "--test-limit", "4"]
    first = subprocess.run(argv, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=3000)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    first_results = (out / "results.json").read_text()
    records = json.loads(first_results)
    assert {r["arm"] for r in records} == set(ablation.ARMS) and all(r["seed_ids"] == [42] for r in records)
    assert all(len(r["seeds"]) == 1 for r in records)
    for recipe in ("bert", "unilm"):  # each continued pre-training ran its 2 steps on 2 ranks from the shared init
        metrics = [json.loads(line) for line in (out / f"pretrain-{recipe}" / "metrics.jsonl").read_text().splitlines()]
        assert [m["step"] for m in metrics if "loss" in m] == [1, 2]
        marker = json.loads((out / f"pretrain-{recipe}" / "checkpoints" / "global_step2" / "complete.json").read_text())
        assert marker["world_size"] == 2
    assert "loss_seq2seq" in metrics[0]  # the unilm recipe trains the seq2seq objective, the bert one does not
    runs = sorted((out / "finetune").iterdir())  # finished: the exported model stays, the resume state is gone
    assert len(runs) == 6 and first.stdout.count("MiB of resume state") == 6  # 3 arms × 2 tasks × 1 seed
    assert all((run / "model.safetensors").is_file() and not (run / "checkpoints").exists() for run in runs)
    report = (out / "REPORT.md").read_text()
    assert "| BBC headline | rougeL |" in report and "Quick check: only the first 4 test examples" in report
    again = subprocess.run(argv, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and again.stdout.count("done earlier") == 9, again.stdout[-3000:]
    # one more seed: only its 6 runs are trained, the others and the pre-training are kept
    more = subprocess.run(argv[:argv.index("--seeds") + 2] + ["43"] + argv[argv.index("--seeds") + 2:], cwd=ROOT,
                          env=subprocess_env(), capture_output=True, text=True, timeout=1200)
    assert more.returncode == 0, more.stdout[-3000:] + more.stderr[-3000:]
    assert more.stdout.count("done earlier") == 5 and more.stdout.count("MiB of resume state") == 6
    assert "headline seed 43:" in more.stdout and "topic seed 43:" in more.stdout
    assert "headline seed 42:" not in more.stdout and "topic seed 42:" not in more.stdout
    records = json.loads((out / "results.json").read_text())
    assert all(r["seed_ids"] == [42, 43] and len(r["seeds"]) == 2 for r in records)  # now with a spread
    assert [r["seeds"][:1] for r in records] == [r["seeds"] for r in json.loads(first_results)]
    assert "2·sd" in (out / "REPORT.md").read_text()


def test_a_missing_run_leaves_its_seed_out_for_every_arm_of_that_task() -> None:
    scores = {arm: {str(seed): {"headline": {"rougeL": 20.0 + seed - 42, "rouge1": 1.0, "rouge2": 1.0, "bleu": 1.0,
                                             "loss": 6.0}}
                    for seed in (42, 43, 44)} for arm in ablation.ARMS}
    del scores["bert+mlm"]["43"]["headline"]  # not fine-tuned
    records = ablation.results(scores, [42, 43, 44])
    assert {r["task"] for r in records} == {"headline"}  # no topic run at all: no topic records
    assert all(r["seed_ids"] == [42, 44] for r in records)
    assert _rougeL(records, "bert")["seeds"] == [20.0, 22.0]
    assert "topic: not measured" in ablation.verdict(records)


def test_a_pre_training_stopped_short_is_not_recorded_as_done(samples_dir: Path, tmp_path: Path, monkeypatch,
                                                               capsys) -> None:
    """`pretrain.train` saves and exits 0 when SIGTERM, Ctrl-C or a time limit stops it: the stage must not be
    recorded as N steps of pre-training (the arm would be fine-tuned and scored from a half-trained model)."""
    driver = make_ablation(tmp_path / "out", samples_dir, steps=100)

    def launch_stopped_at_51(argv, log=None, env=None) -> str:  # what pretrain.train leaves when stopped at step 51
        if "pretrain/train.py" in argv:
            run = driver.pretrain_dir("bert+mlm")
            run.mkdir(parents=True)
            (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 7.0, "step_time_s": 1.0}) + "\n"
                                                       for s in range(1, 52)))
        return ""

    monkeypatch.setattr(driver, "command", launch_stopped_at_51)
    with pytest.raises(SystemExit) as stopped:
        driver.run({"pretrain-bert": lambda: driver.pretrain_stage("bert+mlm")})
    assert stopped.value.code == 0 and not driver.marker("pretrain-bert").exists()
    assert "stopped: pre-training bert+mlm saved step 51 of 100" in capsys.readouterr().out


def _rougeL(records: list[dict], arm: str) -> dict:
    return next(r for r in records if (r["arm"], r["task"], r["metric"]) == (arm, "headline", "rougeL"))
