"""`make demo`'s orchestration: stage markers make reruns skip finished work, and the report renders from them."""
from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import DISTRIBUTED_VARIABLES, subprocess_env
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


def test_the_pretraining_command_is_the_cluster_command_on_the_localhost_hostfile(tmp_path: Path) -> None:
    command = make_demo(tmp_path).train_command("train.exit_at_step=20")
    assert command[1:6] == ["--hostfile", "hostfiles/localhost", "--no_ssh_check", "--master_addr", "127.0.0.1"]
    assert "pretrain/train.py" in command and "train.max_steps=40" in command and command[-1] == "train.exit_at_step=20"


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
