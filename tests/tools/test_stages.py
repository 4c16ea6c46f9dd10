"""The drivers' command runner (`tools.stages`): a Ctrl-C or SIGTERM while a command runs lets the command finish
its save and print its last lines, then stops the driver with a message instead of a traceback."""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from tools.stages import Stages

# stands for a training run: on SIGTERM or Ctrl-C it "saves", says so and exits 1, as DeepSpeed's launcher does
CHILD = r"""
import signal, sys, time
heard = []
signal.signal(signal.SIGTERM, lambda n, f: heard.append("SIGTERM"))
signal.signal(signal.SIGINT, lambda n, f: heard.append("SIGINT"))
print("ready", flush=True)
deadline = time.monotonic() + 20
while not heard and time.monotonic() < deadline:
    time.sleep(0.05)
time.sleep(0.5)  # the save
print(f"saved after {heard[0] if heard else 'nothing'}", flush=True)
sys.exit(1 if heard else 3)
"""


def signal_this_process_once_ready(log: Path, signum: int, times: int = 1) -> threading.Thread:
    """Sends ``signum`` to this process (``times`` times) once the child has printed "ready" to ``log``."""
    def send() -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and "ready" not in (log.read_text() if log.exists() else ""):
            time.sleep(0.05)
        for _ in range(times):
            os.kill(os.getpid(), signum)
            time.sleep(0.1)
    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


def test_sigterm_is_passed_on_and_the_driver_stops_after_the_commands_last_lines(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    stages, log = Stages(tmp_path, "probe"), tmp_path / "child.log"
    sender = signal_this_process_once_ready(log, signal.SIGTERM)
    before = signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a SIGTERM the driver does not take fails the test
    try:
        with pytest.raises(SystemExit) as stopped:
            stages.command([sys.executable, "-c", CHILD], log)
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    finally:
        sender.join()
        signal.signal(signal.SIGTERM, before)
    assert stopped.value.code == 0
    assert "saved after SIGTERM" in log.read_text()  # passed on to the command, whose last line was still read
    out = capsys.readouterr().out
    assert "[probe] stopped by SIGTERM (exit code 1)" in out and "rerun the same command to continue" in out


def test_a_ctrl_c_waits_for_the_command_which_the_terminal_reached_and_a_second_stops_at_once(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    stages, log = Stages(tmp_path, "probe"), tmp_path / "child.log"
    sender = signal_this_process_once_ready(log, signal.SIGINT)
    with pytest.raises(SystemExit) as stopped:
        # the terminal's Ctrl-C does not reach this command (no terminal here): it ends on its own, unsaved
        stages.command([sys.executable, "-c", CHILD.replace("20", "1")], log)
    assert stopped.value.code == 0 and "saved after nothing" in log.read_text()
    assert "[probe] stopped by SIGINT (exit code 3)" in capsys.readouterr().out
    sender.join()

    log.unlink()
    before = signal.getsignal(signal.SIGINT)  # ignored where the tests run as a background job
    sender = signal_this_process_once_ready(log, signal.SIGINT, times=2)
    started = time.monotonic()
    with pytest.raises(SystemExit) as stopped:
        stages.command([sys.executable, "-c", CHILD.replace("20", "10")], log)
    assert "SIGINT again: stopped at once" in str(stopped.value.code) and time.monotonic() - started < 8
    assert signal.getsignal(signal.SIGINT) is before
    sender.join()


def test_a_command_without_signals_fails_the_driver_on_its_exit_code(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as failed:
        Stages(tmp_path, "probe").command([sys.executable, "-c", "import sys; print('x'); sys.exit(5)"])
    assert "[probe] failed (exit code 5)" in str(failed.value.code)
