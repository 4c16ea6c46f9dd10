"""`make ops` (tools.ops): DeepSpeed's ops built or loaded as a run loads them, into the checkout's op folder, each
op's outcome on a line; an op that cannot be built is named with DeepSpeed's reason; `make test` builds the suite's
ops in the background while it lints."""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from conftest import ROOT
from tools import ops


def test_the_all_reduce_op_is_loaded_from_the_folder_every_deepspeed_start_reads(capsys) -> None:
    """The shared-memory all-reduce every DeepSpeed start on CPUs loads (make test builds it before the suite; a
    checkout without it builds it here, ~40 s of g++)."""
    from deepspeed.ops import op_builder

    assert ops.main(["shm_comm"]) == 0
    said = capsys.readouterr().out
    assert re.fullmatch(rf"\[ops\] shm_comm: ready in {re.escape(os.environ['TORCH_EXTENSIONS_DIR'])} \(\d+ s\)\n",
                        said), said
    builder = op_builder.ShareMemCommBuilder()
    built = Path(os.environ["TORCH_EXTENSIONS_DIR"]) / builder.name
    assert any(built.glob(f"{builder.name}*.so")), sorted(built.iterdir())  # where DeepSpeed's next load finds it


def test_an_op_that_cannot_be_built_is_named_with_the_reason_and_the_exit_code_is_1(monkeypatch, capsys) -> None:
    import pretrain.accelerator

    reasons = {"FusedAdamBuilder": "RuntimeError: Error building extension 'fused_adam': c++: not found"}
    monkeypatch.setattr(pretrain.accelerator, "op_failure", lambda builder: reasons.get(builder))
    assert ops.main(["shm_comm", "fused_adam"]) == 1
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert lines[0].startswith("[ops] shm_comm: ready in ")
    assert lines[1] == "[ops] fused_adam: cannot be built here: " + reasons["FusedAdamBuilder"]
    assert err == f"[ops] fused_adam (FusedAdamBuilder): {reasons['FusedAdamBuilder']}\n"


def test_the_default_ops_are_those_a_run_on_this_machine_loads(monkeypatch) -> None:
    assert ops.default_ops(gpu=True) == ["fused_adam"] and ops.default_ops(gpu=False) == ["shm_comm"]
    built = []
    monkeypatch.setattr(ops, "build", lambda names: built.extend(names) or [])
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    assert ops.main([]) == 0 and built == ["shm_comm"]


def test_an_unknown_op_is_refused_naming_the_ops(capsys) -> None:
    with pytest.raises(SystemExit) as refused:
        ops.main(["fused_adam", "cpu_adamw"])
    assert refused.value.code == 2
    assert "unknown op 'cpu_adamw'; the ops: shm_comm, fused_adam" in capsys.readouterr().err


def test_make_test_builds_the_ops_in_the_background_while_it_installs_the_rest_and_lints() -> None:
    """`make -n` prints the recipes in order: in a fresh venv, torch, then DeepSpeed at pyproject's pin; the build
    goes to the background, on the CPU accelerator the suite uses, before the rest is installed, the sample corpora
    fetched and the code linted; the suite runs after them."""
    build = "DS_ACCELERATOR=cpu .venv/bin/python -m tools.ops shm_comm fused_adam > .cache/ops.log 2>&1 &"
    pin = next(line.strip().strip('",') for line in (ROOT / "pyproject.toml").read_text().splitlines()
               if line.strip().startswith('"deepspeed=='))
    lint, coverage = ".venv/bin/mypy", "rm -rf .coverage_data"
    for goal, then in (("test", lint), ("test-fast", lint), ("coverage", coverage)):
        recipe = subprocess.run(["make", "-n", "--no-print-directory", "-W", "pyproject.toml", goal, "PYTEST=pytest"],
                                cwd=ROOT, capture_output=True, text=True, check=True).stdout.splitlines()
        torch = next(i for i, line in enumerate(recipe) if "pip install -q torch==" in line)
        assert torch < recipe.index(f".venv/bin/python -m pip install -q '{pin}'") < recipe.index(build) \
            < recipe.index(".venv/bin/python -m pip install -q -e '.[dev]'") \
            < recipe.index(".venv/bin/python -m data_prep.samples --out data/samples") \
            < recipe.index(then) < next(i for i, line in enumerate(recipe) if line.startswith("pytest ")), goal
