"""The preloaded interpreter the suite starts its one-process runs from (tests/preloaded.py) behaves as
``python -m MODULE`` does: the same output, exit status, working directory, path, environment and exit."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import subprocess_env
from preloaded import PreloadedPython

PROBE = """
import atexit, os, sys, threading, time
print("argv", sys.argv, "cwd", os.getcwd(), "path", sys.path[:2], "variable", os.environ.get("UNILM_TEST_FAULT"),
      "main", __name__, "modules", "probe" in sys.modules)
print("on stderr", file=sys.stderr)
atexit.register(lambda: print("atexit ran", flush=True))
threading.Thread(target=lambda: (time.sleep(0.2), print("thread joined"))).start()
mode = sys.argv[1]
if mode == "exit":
    sys.exit(3)
if mode == "message":
    sys.exit("stopped with a message")
if mode == "raise":
    raise ValueError("raised in the run")
if mode == "kill":
    os.kill(os.getpid(), 9)
if mode == "hang":
    time.sleep(120)
"""


@pytest.fixture(scope="module")
def server():
    served = PreloadedPython(subprocess_env(), Path.cwd(), preload=("json",))
    assert served.ready
    yield served
    served.close()
    assert served.server.wait(timeout=30) == 0


def both(server: PreloadedPython, folder: Path, mode: str, timeout: float = 60) -> tuple:
    """The probe run as ``python -m probe MODE`` and through the server, with the probe on PYTHONPATH."""
    (folder / "probe.py").write_text(PROBE)
    env = subprocess_env(PYTHONPATH=str(folder), UNILM_TEST_FAULT="set for the run")
    command = [sys.executable, "-m", "probe", mode]
    plain = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=timeout)
    assert server.serves(env)
    return plain, server.run(command, "probe", [mode], env, folder, timeout)


@pytest.mark.parametrize("mode, status", [("end", 0), ("exit", 3), ("message", 1), ("raise", 1), ("kill", -9)])
def test_a_served_run_says_and_ends_as_python_m_does(server: PreloadedPython, tmp_path: Path, mode: str,
                                                     status: int) -> None:
    plain, served = both(server, tmp_path, mode)
    assert plain.returncode == served.returncode == status, (plain.stderr, served.stderr)
    assert f"cwd {tmp_path} path ['{tmp_path}', '{tmp_path}']" in plain.stdout  # -m: the directory, then PYTHONPATH
    assert "variable set for the run main __main__ modules False" in plain.stdout
    if mode == "raise":  # the same error; the frames above the module's own are the launcher's
        assert plain.stderr.splitlines()[-1] == served.stderr.splitlines()[-1] == "ValueError: raised in the run"
        assert plain.stdout == served.stdout
    else:
        assert (plain.stdout, plain.stderr) == (served.stdout, served.stderr)
    assert ("atexit ran" in served.stdout) is (mode != "kill") and ("thread joined" in served.stdout) is (
        mode != "kill")


def test_a_served_run_past_its_timeout_is_killed(server: PreloadedPython, tmp_path: Path) -> None:
    (tmp_path / "probe.py").write_text(PROBE)
    env = subprocess_env(PYTHONPATH=str(tmp_path))
    with pytest.raises(subprocess.TimeoutExpired) as expired:
        server.run(["probe"], "probe", ["hang"], env, tmp_path, timeout=2)
    assert "on stderr" in str(expired.value.stderr)
    assert server.run(["probe"], "probe", ["end"], env, tmp_path, timeout=60).returncode == 0  # it serves on


def test_a_run_interrupted_by_the_test_is_killed_and_the_server_serves_no_more(tmp_path: Path, monkeypatch) -> None:
    """A test's own timeout (or Ctrl-C) raised while a served run goes on: the run and the server are killed, so no
    later run reads the interrupted one's answers; later runs start plainly."""
    (tmp_path / "probe.py").write_text(PROBE)
    env = subprocess_env(PYTHONPATH=str(tmp_path))
    served = PreloadedPython(subprocess_env(), Path.cwd(), preload=("json",))
    reads = []

    def interrupted(timeout: float) -> dict | None:
        reads.append(PreloadedPython._read(served, timeout))
        if len(reads) == 2:
            raise KeyboardInterrupt
        return reads[-1]
    monkeypatch.setattr(served, "_read", interrupted)
    with pytest.raises(KeyboardInterrupt):
        served.run(["probe"], "probe", ["hang"], env, tmp_path, timeout=1)
    pid = reads[0]["pid"]
    assert served.server.poll() is not None and not served.serves(env)
    with pytest.raises(ProcessLookupError):  # killed and reaped (by the server's end: the run was its child)
        for _ in range(100):
            os.kill(pid, 0)
            time.sleep(0.1)
    served.close()


def test_only_runs_in_the_servers_environment_are_served(server: PreloadedPython) -> None:
    env = subprocess_env()
    assert server.serves(env) and server.serves({**env, "UNILM_TEST_FAULT": "step@3", "PYTHONPATH": "/x"})
    assert not server.serves({**env, "OMP_NUM_THREADS": "7"})  # torch and DeepSpeed read some when imported
    assert not server.serves({k: v for k, v in env.items() if k != "DS_ACCELERATOR"})
    assert not server.serves({**env, "TMPDIR": "/elsewhere"})  # tempfile caches it
    assert server.serves({**env, "MASTER_PORT": "29999"})  # read by the run's own code, after the server set it


def test_the_suites_one_process_training_runs_are_served() -> None:
    """`training_runs.launch` serves its one-process runs, a fault injected or not, from one preloaded server per
    pytest process (under coverage it starts them as before)."""
    import training_runs

    server = training_runs._preloaded()
    if training_runs.under_coverage():
        assert server is None
        return
    assert server is not None and server is training_runs._preloaded() and server.ready
    env = subprocess_env()
    assert server.serves(env), {k: (server.env.get(k), env.get(k)) for k in set(env) | set(server.env)
                                if server.env.get(k) != env.get(k)}
    assert server.serves(subprocess_env(UNILM_TEST_FAULT="step@5"))
