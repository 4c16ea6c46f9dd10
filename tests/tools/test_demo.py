"""`make demo`'s orchestration: stage markers make reruns skip finished work, and the report renders from them."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from tools import demo as demo_module


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
    (tmp_path / "ablation" / "table.md").write_text("| task | metric | bert |\n|---|---|---:|\n| BBC headline | rougeL | 1 |\n")
    report = demo_module.render_report(demo)
    generation = report.index("## Generation: a real BERT")
    assert generation > report.index("## Pipeline check: the tiny model")
    assert "| Wales win | wales beat england |" in report[generation:]
    assert "| BBC headline | rougeL | 1 |" in report[generation:]
