"""One-process runs started from a preloaded interpreter: the suite's cheapest way to launch ``python -m MODULE``.

Every ``python -m pretrain.train`` pays ~4 CPU-seconds before its first line runs: importing torch, torch._dynamo
(torch's optimizers import it) and torch._inductor (DeepSpeed's ZeRO start-up imports a module that decorates with
``torch.compile``), and DeepSpeed. The suite starts ~50 such one-process runs. A server process imports those once
(``PRELOAD``); each run is a fork of it that then does what ``python -m MODULE ARGS`` does: its own environment,
working directory, ``sys.path`` and ``sys.argv``, stdout and stderr to files, ``runpy`` as ``-m`` runs a module, and
the interpreter's exit up to its teardown (exit status, thread joins, atexit, flushed output). It is a real process:
its own pid, exit status (``-9`` when killed) and signals. Everything of the project's own code is imported afresh
in each run. The teardown of every module and object is left out: in a fork it would copy the server's memory page
by page (1.8 s, more than the whole run of a refused configuration), so a crash in a one-process run's teardown
would go unseen here; the multi-rank launches, where process groups are torn down (gloo aborts a process that
leaves one open), start as before.

The server serves only runs whose environment equals its own in the variables the preload may read
(``READ_AT_IMPORT``: torch and DeepSpeed read ``OMP_NUM_THREADS`` or ``DS_ACCELERATOR`` when imported). Any other
run, a run under coverage (which measures child processes from their interpreter's start), or any run where the
preload touched CUDA (a fork could not use the GPU) starts a plain ``python -m`` instead.
"""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PRELOAD = ("torch", "torch._dynamo", "torch._inductor.compile_fx", "deepspeed",
           "deepspeed.runtime.zero.muon.muon_optimizer")
# Variables that may be read while the preloaded modules are imported (thread runtimes, the loader, the interpreter,
# torch, DeepSpeed, CUDA, the temporary directory tempfile caches): a run whose value differs from the server's is
# not served. Any other variable is set in the run's os.environ before its own code reads it.
READ_AT_IMPORT = ("OMP_", "MKL_", "KMP_", "GOMP_", "LD_", "PYTHON", "DS_", "DEEPSPEED", "TORCH", "PYTORCH", "CUDA",
                  "NVIDIA", "NCCL", "TMP", "TEMP", "HOME")
READ_LATER = frozenset({
    "PYTHONPATH",  # the run's sys.path gets it here, as a starting interpreter's does
    # what torch.compile and process groups in the pytest process set for its child processes: read when compiling
    # or when a group is made
    "TORCHINDUCTOR_CACHE_DIR", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
})

_SERVER = r"""
import json, os, sys
started_with = dict(os.environ)
answers = os.fdopen(ANSWERS, "w")  # requests come on stdin; what the preload prints goes where stdout goes
def answer(**fields):
    answers.write(json.dumps(fields) + "\n")
    answers.flush()
for name in PRELOAD:
    __import__(name)
if "torch" in sys.modules and sys.modules["torch"].cuda.is_initialized():
    answer(ready=False)
    sys.exit(0)
answer(ready=True)
# what importing set in os.environ (a run that imports them itself sets it too), unless the run sets it
SET_BY_PRELOAD = {k: v for k, v in os.environ.items() if started_with.get(k) != v}
BASE_PATH = [p for p in sys.path if p]


def run(request):
    '''In the fork: become `python -m MODULE ARGS`, then exit as the interpreter does.'''
    answers.close()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    os.close(null)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update({**SET_BY_PRELOAD, **request["env"]})
    extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [request["cwd"], *extra, *BASE_PATH]
    sys.argv = [request["module"], *request["args"]]
    import runpy
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)


def run_and_exit(request):
    '''The run, then what the interpreter's exit does before it tears its objects down: its exit status (from
    SystemExit as the interpreter reads it, 1 after an uncaught exception it prints), the joins of non-daemon
    threads, atexit, the flush of stdout and stderr.'''
    import atexit, threading
    try:
        run(request)
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1
        if not isinstance(stop.code, (int, type(None))):
            print(stop.code, file=sys.stderr)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    return code


for line in sys.stdin:
    request = json.loads(line)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os._exit(run_and_exit(request))
    answer(pid=pid)
    _, status = os.waitpid(pid, 0)
    answer(exit=os.waitstatus_to_exitcode(status))
"""


class PreloadedPython:
    """A server of forks for one environment (``env``); ``run`` returns what ``subprocess.run`` would."""

    def __init__(self, env: dict[str, str], cwd: Path, preload: tuple[str, ...] = PRELOAD) -> None:
        self.env = dict(env)
        read, write = os.pipe()
        self.answers, self.pending = read, b""
        self.server = subprocess.Popen(
            [sys.executable, "-c", f"PRELOAD, ANSWERS = {preload!r}, {write}\n{_SERVER}"], cwd=cwd, env=self.env,
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True, pass_fds=[write])
        os.close(write)
        try:
            answer = self._read(timeout=300)
        except RuntimeError:
            answer = None
        self.ready = bool(answer and answer.get("ready"))

    def serves(self, env: dict[str, str]) -> bool:
        if not self.ready or self.server.poll() is not None:
            return False
        return all(env.get(key) == self.env.get(key) for key in set(env) | set(self.env)
                   if key.startswith(READ_AT_IMPORT) and key not in READ_LATER)

    def _read(self, timeout: float) -> dict | None:
        """The server's next answer, or None when ``timeout`` seconds pass without one."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self.pending:
            ready, _, _ = select.select([self.answers], [], [], max(deadline - time.monotonic(), 0.0))
            if not ready:
                return None
            chunk = os.read(self.answers, 1 << 16)
            if not chunk:
                raise RuntimeError(f"the preloaded interpreter ended (exit {self.server.wait()})")
            self.pending += chunk
        line, _, self.pending = self.pending.partition(b"\n")
        return json.loads(line)

    def run(self, command: list[str], module: str, args: list[str], env: dict[str, str], cwd: Path,
            timeout: float) -> subprocess.CompletedProcess:
        """Run ``python -m module args`` as a fork; past ``timeout`` it is killed and TimeoutExpired raised, as
        ``subprocess.run`` does. A run interrupted otherwise (a test's own timeout, Ctrl-C) is killed too, and this
        server serves no more runs."""
        assert self.server.stdin is not None
        pid = None
        with tempfile.TemporaryDirectory(prefix="preloaded-") as folder:
            out, err = Path(folder) / "stdout", Path(folder) / "stderr"
            request = {"module": module, "args": args, "env": env, "cwd": str(cwd), "stdout": str(out),
                       "stderr": str(err)}
            try:
                self.server.stdin.write(json.dumps(request) + "\n")
                self.server.stdin.flush()
                started = self._read(timeout=60)
                if started is None:
                    raise RuntimeError("the preloaded interpreter did not start the run")
                pid = started["pid"]
                done = self._read(timeout=timeout)
                if done is None:
                    os.kill(pid, signal.SIGKILL)
                    if self._read(timeout=60) is None:
                        raise RuntimeError(f"the preloaded interpreter did not reap the killed run {pid}")
            except BaseException:
                self._abandon(pid)
                raise
            said = out.read_text(errors="replace"), err.read_text(errors="replace")
        if done is None:
            raise subprocess.TimeoutExpired(command, timeout, *said)
        return subprocess.CompletedProcess(command, done["exit"], *said)

    def _abandon(self, pid: int | None) -> None:
        """Out of step with the server: its run, if any, is killed, and so is the server."""
        self.ready = False
        for process in (pid, self.server.pid):
            if process is not None:
                try:
                    os.kill(process, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.server.wait(timeout=60)

    def close(self) -> None:
        if self.server.stdin is None or self.server.stdin.closed:
            return
        self.server.stdin.close()
        try:
            self.server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.server.kill()
        os.close(self.answers)
