"""Named stages of a long driver run (`tools.demo`, `tools.ablation`): run in order, each printed with its
number, its commands and its wall time; a finished stage leaves ``OUT/stages/NAME.json`` (its result dict plus
``wall_s``) and is skipped when the driver runs again; ``redo_from`` redoes a stage and every later one.
"""
from __future__ import annotations

import json
import os
import platform
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from common.paths import REPO_ROOT
from pretrain.accelerator import choose_ds_accelerator, local_launch_arguments
from tools.torch_extensions import default_extensions_dir


class Stages:
    """Output directory, stage markers and the command runner shared by the stages of one driver."""

    def __init__(self, out: Path, tag: str) -> None:
        self.out = Path(out)
        self.tag = tag
        self.python = sys.executable
        self.deepspeed = str(Path(sys.executable).parent / "deepspeed")

    def marker(self, stage: str) -> Path:
        return self.out / "stages" / f"{stage}.json"

    def done(self, stage: str) -> dict[str, Any] | None:
        path = self.marker(stage)
        return json.loads(path.read_text()) if path.is_file() else None

    def say(self, text: str) -> None:
        print(f"[{self.tag}] {text}", flush=True)

    def command(self, argv: list[str], log: Path | None = None, env: dict[str, str] | None = None) -> str:
        """Run one command, its output streamed to the terminal (and to ``log``); fail the driver if it fails.
        Returns the output."""
        shown = " ".join(Path(a).name if a in (self.python, self.deepspeed) else a for a in argv)
        self.say(f"  $ {shown}")
        signals: list[str] = []
        returncode, output = stream(argv, log, env, signals)
        if signals:  # the command heard it too, and a training run has saved its step (the launcher exits 1 anyway)
            self.say(f"stopped by {signals[0]} (exit code {returncode}): {shown}; what it saved is kept: rerun the "
                     "same command to continue")
            raise SystemExit(0)
        if returncode:
            raise SystemExit(f"[{self.tag}] failed (exit code {returncode}): {shown}"
                             + (f" (log: {log})" if log else ""))
        return output

    def stop_short(self, run: str, reached: int, target: int, rerun: str) -> None:
        """Stop the driver (exit 0) when a pre-training launch ended at step ``reached`` < ``target``: `pretrain.train`
        saves its step and exits 0 on SIGTERM, Ctrl-C or a time limit, and a stage recorded as done from such a run
        would go on with a half-trained model. ``rerun`` tells what running the driver again does."""
        if reached < target:
            self.say(f"stopped: {run} saved step {reached} of {target} and exited (SIGTERM, Ctrl-C or a time "
                     f"limit); {rerun}")
            raise SystemExit(0)

    def launcher(self, max_gpus: int | None = None) -> list[str]:
        """The DeepSpeed launcher on this machine alone (no ssh): the localhost hostfile's two ranks on a CPU, one
        rank per GPU (at most ``max_gpus``) on a GPU machine; with a free rendezvous port, as other DeepSpeed jobs on
        the machine may hold 29500."""
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        return [self.deepspeed, *local_launch_arguments(max_gpus=max_gpus), "--master_port", str(port)]

    def run(self, runners: dict[str, Callable[[], dict[str, Any]]], redo_from: str | None = None,
            always: Sequence[str] = ("report",), stale: Callable[[str, dict[str, Any]], bool] | None = None) -> float:
        """Run the stages of ``runners`` in order, skipping those with a marker (unless in ``always`` or
        ``stale(name, marker)`` says so); returns the wall time of this invocation."""
        names = list(runners)
        if redo_from:
            for name in names[names.index(redo_from):]:
                self.marker(name).unlink(missing_ok=True)
        started = time.monotonic()
        for number, name in enumerate(names, 1):
            previous = self.done(name)
            if previous is not None and name not in always and not (stale and stale(name, previous)):
                self.say(f"({number}/{len(names)}) {name}: done earlier ({duration(previous['wall_s'])}), skipped")
                continue
            self.say(f"({number}/{len(names)}) {name} ...")
            stage_started = time.monotonic()
            result = runners[name]()
            result["wall_s"] = time.monotonic() - stage_started
            self.marker(name).parent.mkdir(parents=True, exist_ok=True)
            self.marker(name).write_text(json.dumps(result, indent=1) + "\n")
            self.say(f"({number}/{len(names)}) {name}: done in {duration(result['wall_s'])}")
        return time.monotonic() - started


def stream(argv: Sequence[str], log: Path | None = None, env: dict[str, str] | None = None,
           signals: list[str] | None = None) -> tuple[int, str]:
    """Run ``argv`` in the repository, its output (standard error merged in) passed to the terminal line by line
    as it comes and appended to ``log``: a log being written keeps the progress of a run that is stopped.
    Returns the exit code and the output.

    With a ``signals`` list, a first Ctrl-C or SIGTERM while the command runs is appended to it instead of
    stopping this process, which reads the command's output to its end: a training run's save and its last lines
    ("saved global_stepN …") still reach the terminal and the log. A terminal's Ctrl-C reaches the command by
    itself; a SIGTERM is passed on to it. A second one stops this process at once."""
    if log:
        log.parent.mkdir(parents=True, exist_ok=True)
    process = subprocess.Popen(argv, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, env=dict(os.environ, **(env or {})), bufsize=1)

    def heard(signum: int, _frame: Any) -> None:
        assert signals is not None  # installed only with a list
        name = signal.Signals(signum).name
        if signals:
            raise SystemExit(f"\n{name} again: stopped at once, without waiting for {argv[0]} to end")
        signals.append(name)
        if signum == signal.SIGTERM:
            process.send_signal(signal.SIGTERM)

    lines: list[str] = []
    sink = open(log, "a") if log else open(os.devnull, "w")  # closed by the thread that writes it

    def copy() -> None:  # the command's output, line by line, to the terminal, the log and ``lines``
        assert process.stdout is not None  # stdout=PIPE
        with sink:
            for line in process.stdout:
                sys.stdout.write(line)
                sys.stdout.flush()
                sink.write(line)
                sink.flush()  # `tail -f` of the log follows the run
                lines.append(line)

    # The output is read by a thread: this (main) thread only waits, in short joins, so a signal's handler runs
    # within a fraction of a second, even one that arrived while the handler for the one before was running (a
    # blocking read would hold such a signal until the command's next line).
    reader = threading.Thread(target=copy, name="command-output", daemon=True)
    previous = {s: signal.signal(s, heard) for s in (signal.SIGINT, signal.SIGTERM)} if signals is not None else {}
    try:
        reader.start()
        while reader.is_alive():
            reader.join(0.2)
        return process.wait(), "".join(lines)
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def finetune_in_process(argv: Sequence[str], tag: str) -> dict[str, Any]:
    """``python -m finetune.run ARGV`` in this process (no interpreter and DeepSpeed start-up per run); returns its
    summary. The run takes SIGTERM and a first Ctrl-C to save its step and return unfinished, as a scheduler's
    preemption wants; this driver then stops as well, with the run's exit code 0, instead of going on with the next
    run (the signal unheeded) and scoring a half-trained model. Rerunning the driver resumes the run."""
    from finetune import run
    summary = run.main(list(argv))
    if not summary.get("finished"):
        print(f"[{tag}] stopped: the fine-tuning run saved step {summary['steps']} of {summary['total_steps']} "
              "and returned unfinished (SIGTERM, Ctrl-C or a time limit); rerun the same command to continue it",
              flush=True)
        raise SystemExit(0)
    return summary


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def machine_line() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}"


def load_average() -> str:
    """The 1/5/15-minute load averages (how busy the machine was: timings depend on it)."""
    try:
        return " / ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


def driver_environment() -> None:
    """The environment every driver's commands need (set only where the user has not)."""
    choose_ds_accelerator()
    default_extensions_dir()
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
