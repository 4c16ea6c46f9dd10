"""`make demo`'s orchestration: stage markers make reruns skip finished work, and the report renders from them."""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import DISTRIBUTED_VARIABLES, subprocess_env
from pretrain import checkpoint as ckpt
from tools import demo as demo_module
from training_runs import train_command


def make_demo(out: Path) -> demo_module.Demo:
    return demo_module.Demo(argparse.Namespace(out=str(out), samples="data/samples", steps=40, vocab_size=8000,
                                               ablation_out=str(out / "ablation")))


def test_finished_stages_are_skipped_and_from_redoes_the_rest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    for method in ("corpus", "vocab_stage", "shards_stage", "pretrain_stage", "resume", "plot", "export",
                   "finetune", "headlines", "report"):
        monkeypatch.setattr(demo_module.Demo, method, lambda self, m=method: calls.append(m) or {"available": True})
    argv = ["--out", str(tmp_path)]
    demo_module.main(argv)
    assert len(calls) == 10
    assert json.loads((tmp_path / "stages" / "plot.json").read_text())["wall_s"] >= 0
    calls.clear()
    demo_module.main(argv)
    assert calls == ["report"]  # the report is always rewritten
    calls.clear()
    demo_module.main(argv + ["--from", "export"])
    assert calls == ["export", "finetune", "headlines", "report"]


def test_from_resume_redoes_the_pretraining_it_continues(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    for method in ("corpus", "vocab_stage", "shards_stage", "pretrain_stage", "resume", "plot", "export",
                   "finetune", "headlines", "report"):
        monkeypatch.setattr(demo_module.Demo, method, lambda self, m=method: calls.append(m) or {"available": True})
    demo_module.main(["--out", str(tmp_path)])
    (tmp_path / "pretrain" / "checkpoints").mkdir(parents=True)
    calls.clear()
    demo_module.main(["--out", str(tmp_path), "--from", "resume"])
    assert calls[:3] == ["pretrain_stage", "resume", "plot"]
    assert not (tmp_path / "pretrain").exists()  # a new run, not a continuation of the finished one


@pytest.mark.slow
def test_launches_stopped_short_stop_the_demo_and_a_rerun_checks_the_resume_it_makes(
        unilm_shards: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """A launch that saves and exits 0 before its steps (SIGTERM, Ctrl-C: here `train.exit_at_step` in its place)
    stops the demo unrecorded; running the stage again continues the run, and the resume check checks the resume
    from the step that stop saved. Real single-rank runs of the tiny preset on CPU."""
    for name in DISTRIBUTED_VARIABLES:  # an in-process group of an earlier test may have left its port here
        monkeypatch.delenv(name, raising=False)
    for name, value in subprocess_env().items():
        monkeypatch.setenv(name, value)
    demo = make_demo(tmp_path)
    demo.steps, demo.half, demo.warmup = 8, 4, 1
    demo.lose_rank = None  # one-rank runs: no rank to lose (the recovery: the stand-in test below)
    stop_at: list[str] = []
    monkeypatch.setattr(demo, "train_command", lambda *extra: train_command(
        [f"out_dir={demo.run_dir}", f"data.shards={unilm_shards}", "model.overrides.vocab_size=4000",
         "train.global_batch_size=8", "train.max_steps=8", "optim.warmup_steps=1", "train.save_interval=4",
         *extra, *stop_at]))

    def stopped_at_then_rerun(stage: str, run: Callable, step: int, message: str) -> dict:
        stop_at[:] = [f"train.exit_at_step={step}"]
        with pytest.raises(SystemExit) as stopped:
            demo.run({stage: run})
        assert stopped.value.code == 0 and not demo.marker(stage).exists()
        assert message in capsys.readouterr().out
        stop_at.clear()
        demo.run({stage: run})
        return demo.done(stage)

    # the first launch, stopped before its half-way stop; then the resumed launch, stopped in turn
    assert stopped_at_then_rerun("pretrain", demo.pretrain_stage, 2,
                                 "stopped: the first launch saved step 2 of 4")["exit_step"] == 4
    resumed = stopped_at_then_rerun("resume", demo.resume, 6, "stopped: the resumed launch saved step 6 of 8")
    assert resumed["resumed_step"] == 6 and resumed["resumed_line"].startswith("[resume] global_step6: step 6")
    assert all(resumed["checks"].values()) and "lr_schedule_continues" in resumed["checks"]
    assert [row["step"] for row in resumed["losses_after"]] == [7, 8]
    assert "was stopped in turn and saved step 6" in demo_module.render_report(demo)


def test_report_renders_before_anything_ran(tmp_path: Path) -> None:
    demo = make_demo(tmp_path)
    assert "Not run yet" in demo_module.render_report(demo)


def test_the_pretraining_command_is_the_cluster_command_with_recovery_on(tmp_path: Path) -> None:
    command = make_demo(tmp_path).train_command("train.exit_at_step=20")
    assert command[1:5] == ["-m", "pretrain.elastic", "--max-restarts", "2"]   # make pretrain MAX_RESTARTS=2
    assert command[command.index("--nproc-per-node") + 1] == "2"   # the localhost hostfile's two ranks
    assert command[command.index("--") + 1] == "pretrain/train.py" and "train.max_steps=40" in command
    assert "train.save_interval=10" in command and command[-1] == "train.exit_at_step=20"   # a save between 20 and 40


def test_the_resume_stage_kills_a_rank_after_the_next_checkpoint_and_checks_the_recovery(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The resume stage with a stand-in launch (no training): a process that is rank 1 of the run's first start by
    its environment and command line, the records of a run that resumed from step 4, saved global_step6, logged
    step 7, lost that rank, recovered from global_step6 (step 7 redone) and finished at step 8."""
    demo = make_demo(tmp_path)
    demo.steps, demo.half, demo.warmup, demo.save_interval = 8, 4, 1, 2
    checkpoints = demo.run_dir / "checkpoints"

    def save(step: int) -> None:
        (checkpoints / f"global_step{step}").mkdir(parents=True)
        (checkpoints / f"global_step{step}" / ckpt.MARKER).write_text(json.dumps(
            {"step": step, "consumed_samples": 8 * step, "world_size": 2, "zero_stage": 2}))

    def log_steps(*steps: int) -> None:
        with open(demo.run_dir / "metrics.jsonl", "a") as metrics:
            for step in steps:
                metrics.write(json.dumps({"step": step, "consumed_samples": 8 * step, "loss": 9.0 - step / 10,
                                          "lr": 1.0 - step / 10, "samples_per_s": 8.0, "tokens_per_s": 900.0,
                                          "step_time_s": 1.0, "tflops": 0.01, "mfu": 0.2, "data_wait_s": 0.0}) + "\n")

    save(4)
    log_steps(1, 2, 3, 4)
    (demo.run_dir / "run_config.json").write_text(json.dumps({"train": {"global_batch_size": 8}}))
    monkeypatch.setattr(demo_module, "choose_resume_tag", lambda _: "global_step4")

    def launch(argv: list[str], log: Path | None = None, env: dict | None = None) -> str:
        rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", f"out_dir={demo.run_dir}"],
                                env=dict(os.environ, RANK="1", TORCHELASTIC_RESTART_COUNT="0"))
        log_steps(5, 6)
        save(6)
        log_steps(7)
        assert rank.wait(timeout=60) == -signal.SIGKILL   # killed once global_step6 was complete and step 7 logged
        (demo.run_dir / "restarts.jsonl").write_text(json.dumps(
            {"restart": 1, "resumed_from": "global_step6", "resume_step": 6, "steps_redone": 1,
             "first_step_after": 7, "seconds_lost": 12.5}) + "\n")
        log_steps(7, 8)
        return "[resume] global_step4: step 4, consumed_samples 32\n"

    monkeypatch.setattr(demo, "command", launch)
    result = demo.resume()
    assert result["lost"]["after"] == "global_step6" and result["lost"]["rank"] == 1
    assert all(result["checks"].values()) and result["checks"]["recovered_by_itself"]
    assert [row["step"] for row in result["losses_after_recovery"]] == [5, 6, 7, 8]
    demo.marker("resume").parent.mkdir(parents=True)
    demo.marker("resume").write_text(json.dumps(result))
    demo.marker("pretrain").write_text(json.dumps({"exit_step": 4, "world_size": 2, "zero_stage": 2,
                                                   "losses_before": []}))
    report = demo_module.render_report(demo)
    assert "rank 1 was killed (SIGKILL) and the run recovered by itself" in report
    assert "1 step(s) redone, 12.5 s lost" in report and "| around recovery | 7 |" in report


def test_the_report_ends_on_the_real_bert_headlines_and_the_ablation_table(tmp_path: Path) -> None:
    demo = make_demo(tmp_path)
    assert "`make ablation` compares" in demo_module.render_report(demo)  # no ablation yet: says how to get one
    (tmp_path / "stages").mkdir()
    (tmp_path / "stages" / "headlines.json").write_text(json.dumps(
        {"bert": "data/samples/minilm", "best_dev": {"rouge1": 30.0, "rouge2": 12.0, "rougeL": 28.0},
         "samples": [{"tgt": "Wales win", "prediction": "wales beat england"}], "wall_s": 1.0}))
    (tmp_path / "ablation").mkdir()
    (tmp_path / "ablation" / "table.md").write_text(
        "| task | metric | bert |\n|---|---|---:|\n| BBC headline | rougeL | 1 |\n")
    report = demo_module.render_report(demo)
    generation = report.index("## Generation: a real BERT")
    assert generation > report.index("## Pipeline check: the tiny model")
    assert "| Wales win | wales beat england |" in report[generation:]
    assert "| BBC headline | rougeL | 1 |" in report[generation:]
