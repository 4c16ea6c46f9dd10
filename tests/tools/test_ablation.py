"""`make ablation` (tools.ablation): the three arms start from the very same BERT tensors, the statistics follow the
stated criterion, the held-out scoring (per-sample losses, bootstrap interval, unigram loss, records, table and
sentence) measures what it says, and the whole driver runs its stages on a few steps."""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, subprocess_env
from data_prep.shard_format import Objective, Sample
from finetune.model_io import load_init
from pretrain.config import load_config, resolve_model_config
from pretrain.data import collate
from pretrain.hf import load_hf_bert
from pretrain.model import REPORTED_OBJECTIVES, build_model, preset
from pretrain.rng import seed_everything
from tools import ablation


def make_ablation(out: Path, samples_dir: Path, **extra) -> ablation.Ablation:
    args = dict(out=str(out), samples=str(samples_dir), bert=None, steps=3, finetune_steps=2, seeds=[42, 43],
                test_limit=4, held_out_samples=None, keep_checkpoints=False) | extra
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



def test_on_a_gpu_each_arm_pre_trains_on_one_gpu_in_one_micro_batch_of_the_same_global_batch(
        samples_dir: Path, tmp_path: Path) -> None:
    """The GPU path (docs/ablation.md): bf16 ZeRO-2, 2,000 steps, batch 32 as one micro-batch, no compiling."""
    driver = make_ablation(tmp_path / "out", samples_dir, steps=None)
    driver.gpus = 1  # what a machine with a CUDA GPU reports
    driver.steps = ablation.GPU_STEPS
    command = driver.pretrain_command("bert+unilm")
    assert command[:2] == [driver.python, "pretrain/train.py"]  # one rank, no launcher
    overrides = [a for a in command if "=" in a and not a.startswith("--")]
    assert {"train.max_steps=2000", "train.micro_batch_size=32", "train.compile=false",
            "deepspeed_config=ds_configs/zero2_bf16.json"} <= set(overrides)
    cfg = load_config(ROOT / ablation.PRETRAIN_CONFIG, overrides)
    assert cfg.train.global_batch_size == cfg.train.micro_batch_size == 32 and cfg.train.compile is False

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



# ------------------------------------------------------------------------------------------------ held-out scoring
CLS, SEP, PAD, MASK = 1, 2, 0, 3


def _sample(tokens: list[int], objective: Objective, len_a: int, masked: dict[int, int],
            is_random_next: int = -1) -> Sample:
    """A shard sample: ``tokens`` as stored (masking applied), ``masked`` position → original token."""
    positions = sorted(masked)
    return Sample(input_ids=np.array(tokens, dtype=np.int64), objective=int(objective), segment_a_length=len_a,
                  is_random_next=is_random_next, masked_positions=np.array(positions, dtype=np.int64),
                  masked_labels=np.array([masked[p] for p in positions], dtype=np.int64))


def _held_out_samples() -> list[Sample]:
    rng = np.random.default_rng(0)
    samples = []
    for i, objective in enumerate([Objective.BIDIRECTIONAL, Objective.LEFT_TO_RIGHT, Objective.BIDIRECTIONAL,
                                   Objective.RIGHT_TO_LEFT, Objective.SEQ2SEQ, Objective.SEQ2SEQ]):
        a, b = rng.integers(4, 50, size=5 + i).tolist(), rng.integers(4, 50, size=3 + i % 3).tolist()
        two_segments = objective in (Objective.BIDIRECTIONAL, Objective.SEQ2SEQ)
        tokens = [CLS, *a, SEP, *b, SEP] if two_segments else [CLS, *a, SEP]
        masked = {2: tokens[2], len(a): tokens[len(a)]} if i % 2 else {3: tokens[3]}
        for position in masked:
            tokens[position] = MASK
        samples.append(_sample(tokens, objective, len(a) + 2, masked,
                               is_random_next=i % 2 if objective == Objective.BIDIRECTIONAL else -1))
    return samples


def test_per_sample_losses_add_up_to_the_models_own_loss_of_the_batch() -> None:
    """`sample_losses` reads the model's own per-objective sums one sample at a time: added up they are the batch's
    per-objective loss (what training and `pretrain.trainer.EvalSet` report), not a second loss computation."""
    torch.manual_seed(0)
    model = build_model(dataclasses.replace(preset("tiny"), vocab_size=50, max_position_embeddings=64)).eval()
    samples = _held_out_samples()
    sums, counts = ablation.sample_losses(model, samples, PAD, 64)
    assert sums.shape == counts.shape == (len(samples), len(REPORTED_OBJECTIVES))
    with torch.no_grad():
        whole = model(**collate(samples, PAD, 64))
    np.testing.assert_allclose(sums.sum(axis=0), whole.objective_sums.double().numpy(), rtol=1e-5)
    np.testing.assert_array_equal(counts.sum(axis=0), whole.objective_counts.double().numpy())
    summary = ablation.held_out_summary(sums, counts)
    assert list(summary) == ["bidirectional_mlm", "nsp", "left_to_right", "right_to_left", "seq2seq"]
    for name, value in whole.objective_losses.items():
        assert summary[name]["mean"] == pytest.approx(float(value), rel=1e-5), name
    assert {name: r["samples"] for name, r in summary.items()} == {
        "bidirectional_mlm": 2, "nsp": 2, "left_to_right": 1, "right_to_left": 1, "seq2seq": 2}


def test_the_bootstrap_interval_is_seeded_and_as_wide_as_the_samples_spread() -> None:
    rng = np.random.default_rng(1)
    losses = rng.normal(6.0, 1.0, size=400)  # one prediction per sample: the interval of a plain mean
    ones = np.ones_like(losses)
    low, high = ablation.bootstrap_interval(losses, ones, seed=7)
    assert (low, high) == ablation.bootstrap_interval(losses, ones, seed=7)  # same seed and inputs, same numbers
    assert (low, high) != ablation.bootstrap_interval(losses, ones, seed=8)
    assert low < losses.mean() < high
    assert high - low == pytest.approx(2 * 1.96 * losses.std() / math.sqrt(len(losses)), rel=0.15)
    quarter_low, quarter_high = ablation.bootstrap_interval(losses[:100], ones[:100], seed=7)
    assert quarter_high - quarter_low == pytest.approx(2 * (high - low), rel=0.25)  # 1/sqrt(n)
    # a loss per prediction, samples weighted by their predictions: every token at 5 nats whatever the counts
    counts = rng.integers(1, 10, size=50).astype(float)
    assert ablation.bootstrap_interval(5.0 * counts, counts) == pytest.approx((5.0, 5.0))
    with pytest.raises(ValueError, match="at least one sample"):
        ablation.bootstrap_interval(np.zeros(0), np.zeros(0))


def test_the_unigram_loss_scores_each_predicted_token_by_its_held_out_frequency() -> None:
    """Text tokens (masked positions restored, special tokens out): 5 5 6 | 7 5 | 8 9 → p(5) = 3/7, p(7) = 1/7."""
    samples = [_sample([CLS, 5, MASK, SEP, 6, SEP], Objective.BIDIRECTIONAL, 3, {2: 5}, is_random_next=0),
               _sample([CLS, 7, 5, SEP], Objective.LEFT_TO_RIGHT, 4, {1: 7}),
               _sample([CLS, 8, SEP, 9, SEP], Objective.BIDIRECTIONAL, 3, {}, is_random_next=1)]
    sums, counts = ablation.unigram_losses(samples, [CLS, SEP, PAD, MASK])
    summary = ablation.held_out_summary(sums, counts)
    assert summary["bidirectional_mlm"]["mean"] == pytest.approx(-math.log(3 / 7))
    assert summary["bidirectional_mlm"]["samples"] == 1  # the sample without a prediction predicts nothing
    assert summary["left_to_right"]["mean"] == pytest.approx(-math.log(1 / 7))
    assert summary["nsp"]["mean"] == pytest.approx(math.log(2)) and summary["nsp"]["samples"] == 2  # labels 50/50
    assert "seq2seq" not in summary  # no seq2seq sample: no record rather than a 0/0


def _losses(means: dict[str, dict[str, float]], half_width: float) -> dict[str, dict[str, dict]]:
    return {arm: {objective: {"mean": mean, "ci95": [mean - half_width, mean + half_width], "samples": 400}
                  for objective, mean in objectives.items()} for arm, objectives in means.items()}


UNIGRAM_LOSSES = {"bidirectional_mlm": 6.85, "nsp": 0.693, "left_to_right": 6.88, "right_to_left": 6.91,
                  "seq2seq": 6.84}


def test_held_out_records_follow_the_published_schema() -> None:
    losses = _losses({arm: {o: 5.7 for o in ablation.HELD_OUT_OBJECTIVES} for arm in ablation.ARMS}, 0.05)
    losses[ablation.UNIGRAM] = _losses({"u": UNIGRAM_LOSSES}, 0.03)["u"]
    records = ablation.held_out_records(losses)
    assert len(records) == 4 * 5
    assert all(set(r) == {"arm", "task", "metric", "mean", "ci95", "samples"} and r["task"] == "held-out"
               for r in records)
    assert [r["arm"] for r in records[::5]] == [*ablation.ARMS, "unigram"]
    assert [r["metric"] for r in records[:5]] == ["loss_bidirectional_mlm", "loss_nsp", "loss_left_to_right",
                                                  "loss_right_to_left", "loss_seq2seq"]
    unigram = records[-1]
    assert unigram["mean"] == 6.84 and unigram["ci95"] == pytest.approx([6.81, 6.87]) and unigram["samples"] == 400
    # the fine-tuning table and its verdict ignore them
    assert ablation.result_table(records).count("\n") == 3 and "topic: not measured" in ablation.verdict(records)


def test_the_held_out_sentence_names_the_better_recipe_per_objective_where_the_intervals_part() -> None:
    means = {"bert": {o: 10.5 for o in ablation.HELD_OUT_OBJECTIVES} | {"nsp": 0.80},
             "bert+mlm": {"bidirectional_mlm": 4.9, "nsp": 0.60, "left_to_right": 6.2, "right_to_left": 6.3,
                          "seq2seq": 5.9},
             "bert+unilm": {"bidirectional_mlm": 5.3, "nsp": 0.61, "left_to_right": 4.1, "right_to_left": 4.2,
                            "seq2seq": 4.0}}
    losses = _losses(means, 0.05) | {"unigram": _losses({"u": UNIGRAM_LOSSES}, 0.03)["u"]}
    records = ablation.held_out_records(losses)
    table = ablation.held_out_table(records)
    assert table.splitlines()[0] == "| objective | samples | bert | bert+mlm | bert+unilm | unigram |"
    assert "| seq2seq | 400 | 10.500 [10.450, 10.550] | 5.900 [5.850, 5.950] | 4.000 [3.950, 4.050] | " \
           "6.840 [6.810, 6.870] |" in table
    sentence = ablation.held_out_verdict(records)
    assert sentence.startswith("On held-out text bert+mlm is lowest at bidirectional mlm, its 95 % interval below "
                               "the other arms', below the unigram loss too; ")
    assert "; bert+unilm is lowest at left to right, right to left, seq2seq, its 95 % interval below the other " \
           "arms', below the unigram loss too" in sentence
    # NSP: both continued arms below bert, but not apart from each other
    assert "; bert+mlm and bert+unilm are lower than bert at nsp, below the unigram loss, and not apart from each " \
           "other" in sentence
    assert "too close" not in sentence and sentence.endswith("(unigram loss: bidirectional mlm 6.85, nsp 0.69, "
                                                             "left to right 6.88, right to left 6.91, seq2seq 6.84).")
    # lower than bert but not below the unigram loss: the budget has not told the recipes apart there
    means["bert+mlm"]["left_to_right"], means["bert+unilm"]["left_to_right"] = 6.90, 6.88
    losses = _losses(means, 0.05) | {"unigram": _losses({"u": UNIGRAM_LOSSES}, 0.03)["u"]}
    sentence = ablation.held_out_verdict(ablation.held_out_records(losses))
    assert "; bert+mlm and bert+unilm are lower than bert at left to right, not apart from each other, and no lower " \
           "than the unigram loss: too close to it for this budget to tell the recipes apart; " in sentence
    assert "bert+unilm is lowest at right to left, seq2seq, its" in sentence


def test_the_held_out_sentence_says_when_the_arms_are_too_close_to_tell_apart() -> None:
    means = {arm: {o: 5.6 + 0.05 * i for o in ablation.HELD_OUT_OBJECTIVES} | {"nsp": 0.69}
             for i, arm in enumerate(ablation.ARMS)}  # 0.05 apart, intervals ± 0.08: all overlap
    losses = _losses(means, 0.08) | {"unigram": _losses({"u": UNIGRAM_LOSSES}, 0.03)["u"]}
    sentence = ablation.held_out_verdict(ablation.held_out_records(losses))
    assert sentence.startswith("On held-out text the arms (5.60–5.70 nats) are still too close")
    assert "unigram loss (bidirectional mlm 6.85, nsp 0.69" in sentence
    assert "on every objective their 95 % intervals overlap" in sentence
    # one objective apart is enough to name it, the others are listed as overlapping
    means["bert+unilm"]["seq2seq"] = 5.0
    sentence = ablation.held_out_verdict(ablation.held_out_records(_losses(means, 0.08)))
    assert sentence == ("On held-out text bert+unilm is lowest at seq2seq, its 95 % interval below the other arms'; "
                        "at bidirectional mlm, nsp, left to right, right to left the intervals overlap.")
    # an interval from a handful of samples (one sample: zero width) is not a comparison
    means["bert+unilm"] |= {"bidirectional_mlm": 4.0, "left_to_right": 4.0, "right_to_left": 4.0}
    few = ablation.held_out_records(_losses(means, 0.08))
    for r in few:
        r["samples"] = 29 if r["metric"] == "loss_right_to_left" else 30
    sentence = ablation.held_out_verdict(few)
    assert sentence == ("On held-out text bert+unilm is lowest at bidirectional mlm, left to right, seq2seq, its "
                        "95 % interval below the other arms'; at nsp the intervals overlap; right to left: fewer than "
                        "30 samples, not compared.")  # no unigram records: no unigram loss named
    assert ablation.held_out_verdict([]) == "Held-out text: not measured (the held-out stage did not run)."

@pytest.mark.slow
def test_the_driver_runs_every_stage_on_a_few_steps_and_skips_them_on_a_rerun(samples_dir: Path, tiny_init: Path,
                                                                              tmp_path: Path, monkeypatch,
                                                                              capsys) -> None:
    """The driver end to end at its smallest, the only run of its stages on real data: a 2-layer BERT of 32 hidden
    units (`--bert`; the samples' MiniLM is what `test_the_three_arms_start_from_identical_bert_weights` loads), 2
    steps, 1 seed, 4 test examples, 24 held-out samples: ≈ 1 min on 2 cores (two 2-rank pre-trainings, 6
    fine-tunings and their scoring). Then, in this process, a rerun (every stage skipped) and one seed more, whose 6
    fine-tunings are stand-ins (copies of seed 42's real runs, resume state included) while everything after them is
    real: only the new seed's runs are trained, the rest is kept, and the new seed's models are decoded, scored and
    reported."""
    import shutil
    import subprocess
    import sys

    out = tmp_path / "ablation_out"
    args = ["--out", str(out), "--samples", str(samples_dir), "--bert", str(tiny_init), "--steps", "2",
            "--finetune-steps", "2", "--seeds", "42", "--test-limit", "4", "--held-out-samples", "24"]
    first = subprocess.run([sys.executable, "-m", "tools.ablation", *args], cwd=ROOT, env=subprocess_env(),
                           capture_output=True, text=True, timeout=3000)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    first_results = (out / "results.json").read_text()
    records = [r for r in json.loads(first_results) if r["task"] != "held-out"]
    assert {r["arm"] for r in records} == set(ablation.ARMS) and all(r["seed_ids"] == [42] for r in records)
    assert all(len(r["seeds"]) == 1 for r in records)
    # every arm and the unigram baseline scored per objective on the held-out text, before fine-tuning
    held_out = [r for r in json.loads(first_results) if r["task"] == "held-out"]
    assert {(r["arm"], r["metric"]) for r in held_out} == {
        (arm, f"loss_{objective}") for arm in (*ablation.ARMS, "unigram") for objective in ablation.HELD_OUT_OBJECTIVES}
    assert all(r["ci95"][0] <= r["mean"] <= r["ci95"][1] and 0 < r["samples"] <= 24 for r in held_out)
    assert first.stdout.index(") held-out ...") < first.stdout.index(") finetune-bert ...")
    assert (out / "held-out" / "plot-synopses.txt").read_text().count("\n\n") > 1000  # Rotten Tomatoes' plots
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
    assert "## Held-out text, before fine-tuning" in report and "| seq2seq | " in report
    assert "On held-out text" in report

    monkeypatch.chdir(ROOT)
    ablation.main(args)  # a rerun: every stage but the report was done
    assert capsys.readouterr().out.count("done earlier") == 10

    trained = []

    def stand_in_finetuning(argv: list[str], tag: str) -> dict:
        """Seed 42's run of the same arm and task, copied to the new run's directory with resume state beside it,
        as a finished fine-tuning leaves them."""
        run = Path(argv[argv.index("--out") + 1])
        trained.append((run.name, argv[argv.index("--seed") + 1]))
        shutil.copytree(run.with_name(run.name.replace("-seed43", "-seed42")), run)
        (run / "checkpoints" / "step2").mkdir(parents=True)
        (run / "checkpoints" / "step2" / "optim_states.pt").write_bytes(bytes(2**20))
        return json.loads((run / "summary.json").read_text())

    monkeypatch.setattr(ablation, "finetune_in_process", stand_in_finetuning)
    ablation.main(args[:args.index("--seeds") + 2] + ["43"] + args[args.index("--seeds") + 2:])
    more = capsys.readouterr().out
    assert sorted(trained) == sorted((run.name.replace("seed42", "seed43"), "43") for run in runs)
    assert more.count("done earlier") == 6 and more.count("MiB of resume state") == 6
    assert not any((run / "checkpoints").exists() for run in (out / "finetune").iterdir())
    assert "headline seed 43:" in more and "topic seed 43:" in more
    assert "headline seed 42:" not in more and "topic seed 42:" not in more
    records = json.loads((out / "results.json").read_text())
    finetuned = [r for r in records if r["task"] != "held-out"]
    assert all(r["seed_ids"] == [42, 43] and len(r["seeds"]) == 2 for r in finetuned)  # now with a spread
    first_records = json.loads(first_results)
    assert [r["seeds"][:1] for r in finetuned] == [r["seeds"] for r in first_records if r["task"] != "held-out"]
    assert all(r["seeds"][1] == r["seeds"][0] for r in finetuned)  # seed 43's models, copies of 42's, scored alike
    assert [r for r in records if r["task"] == "held-out"] == held_out  # scored once, kept
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
