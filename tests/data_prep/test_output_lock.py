"""One build per --out at a time (the lock beside it), and what a killed build leaves is cleared by the next."""
from __future__ import annotations

import errno
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from common import signals
from conftest import ROOT, subprocess_env
from data_prep import build, output
from data_prep.shard_format import ShardDataset
from shard_builds import build_error, logged, run_build

HOLD_LOCK = ("import sys, time; from pathlib import Path; from data_prep.output import OutputLock; "
             "lock = OutputLock.acquire(Path(sys.argv[1])); print('held', flush=True); time.sleep(600)")
# data_prep.build, SIGKILLed at the moment named by argv[1] (what kill -9, the OOM killer or a reboot does there)
KILLED_BUILD = """
import os, shutil, signal, sys
import data_prep.build as b
moment, args = sys.argv[1], sys.argv[2:]
def kill():
    os.kill(os.getpid(), signal.SIGKILL)
real_fsync, real_rmtree, real_rename = os.fsync, shutil.rmtree, os.rename
def fsync(fd):  # while the first final shard is written: between its temporary file and the rename
    name = os.readlink(f"/proc/self/fd/{fd}")
    if moment == "finalize" and "/.shard-" in name and ".partial-" in name:
        kill()
    real_fsync(fd)
def rmtree(path, *a, **k):  # while the replaced build is deleted (--overwrite)
    if moment == "delete_previous" and ".previous-" in str(path):
        kill()
    real_rmtree(path, *a, **k)
def rename(src, dst):  # between the two renames that put the new build in place of the old one
    if moment == "install" and str(src).endswith(".partial"):
        kill()
    real_rename(src, dst)
os.fsync, b.shutil.rmtree, b.os.rename = fsync, rmtree, rename
b.main(args)
"""

# data_prep.build on 2 workers, signalled by argv[1] (SIGTERM: to the main process, as `kill` or a scheduler sends
# it; SIGINT: to the whole process group, as a terminal's Ctrl-C) once a worker has built its first chunk
SIGNALLED_BUILD = """
import os, signal, sys, time
import data_prep.build as b
name, args = sys.argv[1], sys.argv[2:]
signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal (a background job starts with it ignored)
real_process_chunk = b.process_chunk
def process_chunk(*a, **k):
    result = real_process_chunk(*a, **k)
    if name == "SIGTERM":
        os.kill(os.getppid(), signal.SIGTERM)
    else:
        os.killpg(0, signal.SIGINT)
    time.sleep(5)  # still working when the main process stops the pool
    return result
b.process_chunk = process_chunk
b.main(args)
"""


def directory_bytes(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def killed_build(moment: str, *args: object) -> None:
    result = subprocess.run([sys.executable, "-c", KILLED_BUILD, moment, *map(str, args), "--quiet"], cwd=ROOT,
                            env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == -signal.SIGKILL, result.stderr


@pytest.fixture
def lock_holder(tmp_path):
    """Start a process that holds the lock of an --out: returns a function of the --out giving the process."""
    holders = []

    def hold(out: Path) -> subprocess.Popen:
        holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(out)], cwd=ROOT, env=subprocess_env(),
                                  stdout=subprocess.PIPE, text=True)
        holders.append(holder)
        assert holder.stdout.readline().strip() == "held"
        return holder

    yield hold
    for holder in holders:
        holder.kill()
        holder.wait()


def test_a_second_build_of_the_same_out_is_refused_naming_the_first(samples_dir, vocab_file, tmp_path, lock_holder,
                                                                      caplog):
    out = tmp_path / "shards"
    args = ["--input", samples_dir / "news/lee.txt", "--vocab", vocab_file, "--max-seq-len", 32, "--out", out]
    holder = lock_holder(out)
    error = build_error(*args)
    assert f"--out {out}: another build of it is running (pid {holder.pid} on {socket.gethostname()}" in error
    assert "wait for it to end or stop it, or choose another --out" in error
    assert not out.exists() and not output.staging_dir(out).exists()  # the refused build touched nothing
    holder.kill()  # kill -9: the kernel drops the lock; the record it left is reported, the next build runs
    holder.wait()
    manifest = run_build(*args)
    assert f"the previous build (pid {holder.pid} on" in logged(caplog)
    assert ShardDataset(out).manifest == manifest
    assert (tmp_path / ".shards.lock").read_text() == ""  # a finished build leaves the lock file empty


def test_split_builders_share_the_lock_and_finalize_waits_for_them(samples_dir, vocab_file, tmp_path):
    out = tmp_path / "shards"
    common = ["--input", samples_dir / "news/lee.txt", samples_dir / "wiki/enwiki-excerpt.xml.bz2",
              "--vocab", vocab_file, "--max-seq-len", 32, "--num-builders", 2]

    def builder(index: int) -> list[str]:
        return [str(a) for a in common] + ["--builder-index", str(index), "--out", str(out), "--quiet"]

    with output.claim_output(out, builder_index=0, num_builders=2):  # builder 0 is running
        build.main(builder(1))  # builder 1 runs beside it
        assert f"--out {out}: builder 0 of it is already running (pid {os.getpid()}" in build_error(*builder(0)[:-1])
        error = build_error("--finalize", "--out", out)
        assert f"another build of it is running (builders of a split build: pid {os.getpid()}" in error
        assert "another build of it is running" in build_error(*[str(a) for a in common[:7]], "--out", out)
    build.main(builder(0))
    build.main(["--finalize", "--out", str(out)])
    assert ShardDataset(out).manifest["documents"]["read"] > 300


def test_a_filesystem_without_locks_is_a_clear_error(samples_dir, vocab_file, tmp_path, monkeypatch):
    def no_locks(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    error = build_error("--input", samples_dir / "news/lee.txt", "--vocab", vocab_file, "--out", tmp_path / "shards")
    assert f"{tmp_path / '.shards.lock'}: cannot lock it ([Errno {errno.ENOLCK}] No locks available)" in error
    assert "put --out on a filesystem with flock support" in error


def test_what_a_killed_build_left_is_cleared_by_the_next(samples_dir, vocab_file, tmp_path, caplog):
    out = tmp_path / "shards"
    args = ["--input", samples_dir / "news/lee.txt", "--vocab", vocab_file, "--max-seq-len", 32, "--out", out]
    run_build(*args)
    killed_build("finalize", *args, "--overwrite", "--seed", 2)
    assert [p.name for p in output.staging_dir(out).glob(".shard-*.partial-*")]  # the temporary shard it was writing
    killed_build("delete_previous", *args, "--overwrite", "--seed", 3)
    assert list(tmp_path.glob(".shards.previous-*"))  # the replaced build it was deleting
    assert json.loads((out / "manifest.json").read_text())["seed"] == 3
    assert not [p.name for p in out.iterdir() if ".partial-" in p.name]  # no temporary file came along into place

    manifest = run_build(*args, "--overwrite", "--seed", 4)
    assert "ended without finishing (killed or crashed); clearing what it left" in logged(caplog)
    assert manifest["seed"] == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == [".shards.lock", "shards"]
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "shard-00000.bin", "vocab.txt"]

    before = directory_bytes(out)
    killed_build("install", *args, "--overwrite", "--seed", 5)  # between moving the old build aside and the new in
    assert not out.exists() and list(tmp_path.glob(".shards.previous-*"))
    error = build_error(*args)  # the previous build is moved back first: --out holds it again
    assert "already holds a finished build" in error
    assert directory_bytes(out) == before and not list(tmp_path.glob(".shards.previous-*"))


def test_tmp_files_an_older_version_put_into_out_do_not_block_overwrite(samples_dir, vocab_file, tmp_path):
    out = tmp_path / "shards"
    args = ["--input", samples_dir / "news/lee.txt", "--vocab", vocab_file, "--max-seq-len", 32, "--out", out]
    run_build(*args)
    (out / "shard-00000.bin.tmp4242").write_bytes(b"half a shard")
    assert run_build(*args, "--overwrite", "--seed", 2)["seed"] == 2
    assert not list(out.glob("*.tmp*"))


@pytest.mark.parametrize("name, code, said", [("SIGTERM", 128 + signal.SIGTERM, "stopped by SIGTERM"),
                                              ("SIGINT", 130, "interrupted")])
def test_a_signalled_build_stops_its_workers_says_so_once_and_keeps_the_previous_build(
        samples_dir, vocab_file, tmp_path, name, code, said):
    out = tmp_path / "shards"
    args = ["--input", samples_dir / "news/lee.txt", "--vocab", vocab_file, "--max-seq-len", 32, "--out", out]
    run_build(*args)
    before = directory_bytes(out)
    signalled = subprocess.Popen([sys.executable, "-c", SIGNALLED_BUILD, name, *map(str, args), "--overwrite",
                                  "--seed", "2", "--workers", "2", "--chunk-chars", "20000", "--quiet"],
                                 cwd=ROOT, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, start_new_session=True)
    _, stderr = signalled.communicate(timeout=300)
    assert signalled.returncode == code
    assert stderr.strip().splitlines() == [f"data_prep.build: {said}; {out} holds what it held before this run, and "
                                           "a rerun clears the half-built leftovers"]  # no worker's traceback
    left = subprocess.run(["pgrep", "-g", str(signalled.pid)], capture_output=True, text=True).stdout.split()
    assert left == []  # the workers ended with the build
    assert directory_bytes(out) == before
    assert run_build(*args, "--overwrite", "--seed", 3)["seed"] == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == [".shards.lock", "shards"]


@pytest.mark.parametrize("first, second, raised", [(signal.SIGINT, signal.SIGTERM, KeyboardInterrupt),
                                                   (signal.SIGTERM, signal.SIGINT, signals.Terminated)])
def test_a_command_stops_once_and_its_cleanup_is_not_cut_short_by_a_second_signal(first, second, raised):
    """Within `stop_once` the first signal raises; the next ones (Ctrl-C twice, several processes of the group
    signalling it) are ignored while the stop is handled; afterwards the handlers before the block are back."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler), signal.getsignal(signal.SIGTERM)
    stops, cleaned_up = [], False
    try:
        with signals.stop_once():
            try:
                signal.raise_signal(first)  # runs the handler, which raises, before it returns
                pytest.fail(f"{signal.Signals(first).name} did not stop the block")
            except KeyboardInterrupt as stop:
                stops.append(type(stop))
                for again in (first, second, first):
                    signal.raise_signal(again)  # handled (ignored) before it returns
                cleaned_up = True
        assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == \
            (signal.default_int_handler, before[1])
    except KeyboardInterrupt as escaped:  # not to pytest, which would end the session
        pytest.fail(f"a second signal raised {type(escaped).__name__} during the cleanup")
    finally:
        signal.signal(signal.SIGINT, before[0])
    assert stops == [raised] and cleaned_up


def test_a_command_that_ignores_ctrl_c_keeps_ignoring_it():
    """A background job starts with SIGINT ignored: `stop_once` leaves it so, and stops on SIGTERM."""
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with pytest.raises(signals.Terminated), signals.stop_once():
            signal.raise_signal(signal.SIGINT)  # ignored: handled before it returns
            signal.raise_signal(signal.SIGTERM)  # raises Terminated before it returns
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)
