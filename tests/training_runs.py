"""Launching `pretrain.train` from tests: the command, its child environment, and reading what a run wrote."""
from __future__ import annotations

import atexit
import functools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import ROOT, subprocess_env
from preloaded import PreloadedPython

TINY_CONFIG = "pretrain/configs/tiny.yaml"
TESTS = Path(__file__).resolve().parent


def train_command(overrides: list[str], nproc: int = 1, config: str = TINY_CONFIG,
                  module: str = "pretrain.train") -> list[str]:
    """pretrain.train (or ``module``, a test's wrapper of it) on 1 rank (plain python) or ``nproc`` ranks
    (torchrun)."""
    entry = ["-m", module, "--config", config, *overrides]
    return [sys.executable, *entry] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *entry]


def launch(overrides: list[str], nproc: int = 1, config: str = TINY_CONFIG, timeout: int = 300,
           extra_env: dict[str, str] | None = None, module: str = "pretrain.train") -> subprocess.CompletedProcess:
    """Run ``train_command`` to its end; returns the finished process. A ``module`` other than pretrain.train
    is looked up in ``tests/`` too."""
    env = subprocess_env(**(extra_env or {}))
    if module != "pretrain.train":
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH")]))
    command = train_command(overrides, nproc, config, module)
    server = _preloaded() if nproc == 1 else None
    if server is not None and server.serves(env):
        return server.run(command, module, command[3:], env, ROOT, timeout)
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


_SERVED_ENV = subprocess_env()  # as the suite starts, before any test changes os.environ


def under_coverage() -> bool:
    coverage = sys.modules.get("coverage")
    return coverage is not None and coverage.Coverage.current() is not None


@functools.cache
def _preloaded() -> PreloadedPython | None:
    """This process's server of one-process runs (``tests/preloaded.py``) in the suite's environment, started on
    first use; None under coverage, whose measurement of child processes starts with their interpreter."""
    if under_coverage():
        return None
    server = PreloadedPython(_SERVED_ENV, ROOT)
    atexit.register(server.close)
    return server


def check(process: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert process.returncode == 0, process.stdout[-3000:] + process.stderr[-6000:]
    return process


def metrics(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def losses(out_dir: Path) -> dict[int, float]:
    return {record["step"]: record["loss"] for record in metrics(out_dir) if "loss" in record}


def preempt(command: list[str], out_dir: Path, steps: int) -> subprocess.CompletedProcess:
    """Start ``command`` (a training run writing ``out_dir/metrics.jsonl``), send it SIGTERM once it has logged
    ``steps`` steps, as a cluster scheduler's preemption does, and wait for it to end."""
    process = subprocess.Popen(command, cwd=ROOT, env=subprocess_env(), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    def logged() -> int:
        return len(metrics(out_dir)) if (out_dir / "metrics.jsonl").exists() else 0
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and process.poll() is None and logged() < steps:
        time.sleep(0.1)
    process.send_signal(signal.SIGTERM)
    stdout, stderr = process.communicate(timeout=120)
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
