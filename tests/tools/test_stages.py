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

import tools.stages as stages_module
from tools.stages import Stages

# stands for a training run: on SIGTERM or Ctrl-C (waited for, at most 20 s) it "saves", says so and exits 1, as
# DeepSpeed's launcher does; with neither it exits 3
CHILD = r"""
import os, signal, sys, time
stops = {signal.SIGTERM, signal.SIGINT}
for number in stops:  # handled (a background job starts with SIGINT ignored, and an ignored signal is never pending)
    signal.signal(number, lambda n, f: None)
signal.pthread_sigmask(signal.SIG_BLOCK, stops)
print("ready", os.getpid(), flush=True)
got = signal.sigtimedwait(stops, 20)
time.sleep(0.5)  # the save takes a while: the driver reads the command's output to its end
print(f"saved after {signal.Signals(got.si_signo).name if got else 'nothing'}", flush=True)
sys.exit(1 if got else 3)
"""


class Sender(threading.Thread):
    """Sends ``signum`` to this process's main thread ``times`` times once the child has printed "ready" to
    ``log``, each one after the driver's handler has run for the one before; ``failure`` says what it waited for in
    vain."""

    def __init__(self, log: Path, signum: int, times: int, monkeypatch: pytest.MonkeyPatch) -> None:
        super().__init__(daemon=True)
        self.log, self.signum, self.times, self.failure = log, signum, times, ""
        self.handled = threading.Event()
        monkeypatch.setattr(stages_module, "signal", _Observed(self.handled))

    def run(self) -> None:
        deadline = time.monotonic() + 30
        while "ready" not in (self.log.read_text() if self.log.exists() else ""):
            if time.monotonic() > deadline:
                self.failure = f"the child did not print 'ready' to {self.log} within 30 s"
                return
            time.sleep(0.05)
        for sent in range(1, self.times + 1):
            self.handled.clear()
            signal.pthread_kill(threading.main_thread().ident, self.signum)
            if sent < self.times and not self.handled.wait(10):
                self.failure = f"the driver's handler did not run within 10 s of signal {sent}"
                return


class _Observed:
    """`tools.stages`'s view of the ``signal`` module: the handlers it installs set ``handled`` once they have run."""

    def __init__(self, handled: threading.Event) -> None:
        self.handled = handled

    def __getattr__(self, name: str) -> object:
        return getattr(signal, name)

    def signal(self, number: int, handler: object) -> object:
        if callable(handler) and getattr(handler, "__module__", None) == stages_module.__name__:
            def observed(signum: int, frame: object, run=handler) -> None:
                try:
                    run(signum, frame)
                finally:
                    self.handled.set()
            return signal.signal(number, observed)
        return signal.signal(number, handler)


def signal_this_process_once_ready(log: Path, signum: int, monkeypatch: pytest.MonkeyPatch,
                                   times: int = 1) -> Sender:
    sender = Sender(log, signum, times, monkeypatch)
    sender.start()
    return sender


def test_sigterm_is_passed_on_and_the_driver_stops_after_the_commands_last_lines(
        tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    stages, log = Stages(tmp_path, "probe"), tmp_path / "child.log"
    sender = signal_this_process_once_ready(log, signal.SIGTERM, monkeypatch)
    before = signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a SIGTERM the driver does not take fails the test
    try:
        with pytest.raises(SystemExit) as stopped:
            stages.command([sys.executable, "-c", CHILD], log)
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    finally:
        sender.join()
        signal.signal(signal.SIGTERM, before)
    assert not sender.failure, sender.failure
    assert stopped.value.code == 0
    assert "saved after SIGTERM" in log.read_text()  # passed on to the command, whose last line was still read
    out = capsys.readouterr().out
    assert "[probe] stopped by SIGTERM (exit code 1)" in out and "rerun the same command to continue" in out


def test_a_ctrl_c_waits_for_the_command_which_the_terminal_reached_and_a_second_stops_at_once(
        tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    stages, log = Stages(tmp_path, "probe"), tmp_path / "child.log"
    sender = signal_this_process_once_ready(log, signal.SIGINT, monkeypatch)
    with pytest.raises(SystemExit) as stopped:
        # the terminal's Ctrl-C does not reach this command (no terminal here): it ends on its own, unsaved
        stages.command([sys.executable, "-c", CHILD.replace("stops, 20)", "stops, 1)")], log)
    assert stopped.value.code == 0 and "saved after nothing" in log.read_text()
    assert "[probe] stopped by SIGINT (exit code 3)" in capsys.readouterr().out
    sender.join()
    assert not sender.failure, sender.failure

    log.unlink()
    before = signal.getsignal(signal.SIGINT)  # ignored where the tests run as a background job
    sender = signal_this_process_once_ready(log, signal.SIGINT, monkeypatch, times=2)
    with pytest.raises(SystemExit) as stopped:
        stages.command([sys.executable, "-c", CHILD.replace("stops, 20)", "stops, 120)")], log)
    sender.join()
    assert not sender.failure, sender.failure
    child = int(log.read_text().split("ready", 1)[1].split()[0])
    try:
        # the driver stopped while the command was still waiting, its last line not yet written
        assert "SIGINT again: stopped at once" in str(stopped.value.code)
        assert "saved after" not in log.read_text()
        os.kill(child, 0)  # still running: raises ProcessLookupError if the driver had waited for its end
    finally:
        os.kill(child, signal.SIGKILL)
    assert signal.getsignal(signal.SIGINT) is before


def test_a_command_without_signals_fails_the_driver_on_its_exit_code(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as failed:
        Stages(tmp_path, "probe").command([sys.executable, "-c", "import sys; print('x'); sys.exit(5)"])
    assert "[probe] failed (exit code 5)" in str(failed.value.code)
