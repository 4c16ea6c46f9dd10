"""Advisory ``flock`` locks that name their holder: a shard build's ``--out`` (``data_prep.build.OutputLock``) and a
training run's ``out_dir`` (``pretrain.checkpoint.RunLock``).

The kernel drops a ``flock`` when its process exits in any way (``kill -9`` included), so a lock never outlives its
holder. The locked file records the holder (pid, host, start time, command) for the message that refuses a second
process, and is emptied on a clean release: a record found by the next holder was left by one that was killed.
Beside those two, ``finetune.decode`` holds ``.NAME.decode.lock`` beside its output (`take`).
Across machines the lock holds where the shared filesystem supports ``flock`` (NFSv4 maps it to byte-range locks;
Lustre needs the ``flock`` mount option). Lock files stay after use: deleting one would let a waiting process lock
a file that is no longer there. Light on purpose (no torch): every shard build takes one.
"""
from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import socket
import sys
from pathlib import Path
from typing import IO, Any

NO_LOCKS_HINT = "a filesystem with flock support (a local disk, NFS with lockd, Lustre mounted with -o flock)"


def open_lock(path: Path) -> IO[str]:
    path.parent.mkdir(parents=True, exist_ok=True)
    return open(path, "a+", encoding="utf-8")


def try_lock(handle: IO[str], shared: bool = False) -> bool:
    """Take the lock without waiting: False when another process holds it. A filesystem that cannot lock raises
    its ``OSError`` (`cannot_lock` tells it apart)."""
    try:
        fcntl.flock(handle.fileno(), (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


class Held(Exception):
    """Another live process holds the lock; the message names it (`holder_text`)."""


def take(path: Path, sync: bool = False) -> tuple[IO[str], dict[str, Any]]:
    """Lock ``path`` exclusively without waiting and record this process as its holder (``sync``: fsync'ed).
    Returns the open handle (keep it for as long as the lock should hold; `release` ends it) and the record a
    holder that was killed left ({} after a clean release). Raises `Held` when another process holds the lock, and
    a filesystem's ``OSError`` when it cannot lock (`cannot_lock`)."""
    handle = open_lock(path)
    try:
        if not try_lock(handle):
            raise Held(holder_text(read_holder(handle), held=True))
    except BaseException:
        handle.close()
        raise
    return handle, record_holder(handle, sync)


def cannot_lock(error: OSError) -> bool:
    """Whether ``error`` says the filesystem has no locks (not that the file is held)."""
    return error.errno in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP)


def read_holder(handle: IO[str]) -> dict[str, Any]:
    """The holder record in a lock file ({} when empty: released cleanly or never held)."""
    handle.seek(0)
    text = handle.read()
    try:
        record = json.loads(text) if text.strip() else {}
    except ValueError:
        return {"pid": "?", "host": "?", "started": f"? (unreadable record {text[:80]!r})"}
    return record if isinstance(record, dict) else {}


def record_holder(handle: IO[str], sync: bool = False) -> dict[str, Any]:
    """Write this process as the holder of the lock it holds; returns the record found there before (a killed
    holder's, or {})."""
    previous = read_holder(handle)
    handle.seek(0)
    handle.truncate()
    handle.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                             "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                             "command": [Path(sys.argv[0]).name, *sys.argv[1:]]}) + "\n")
    handle.flush()
    if sync:
        os.fsync(handle.fileno())
    return previous


def release(handle: IO[str]) -> None:
    """Empty the holder record (a clean end) and drop the lock."""
    if handle.closed:
        return
    handle.seek(0)
    handle.truncate()
    handle.flush()
    handle.close()


def holder_text(record: dict[str, Any], held: bool = False) -> str:
    """``pid P on HOST, started T (command)``; of a lock ``held`` now, also when that pid no longer runs (a child
    it started holds the lock)."""
    if not record:
        return "holder unknown"
    text = (f"pid {record.get('pid')} on {record.get('host')}, started {record.get('started')}"
            + (f" ({' '.join(map(str, record['command']))})" if record.get("command") else ""))
    if held and record.get("host") == socket.gethostname() and not _pid_running(record.get("pid")):
        text += " — that pid is no longer running, so a process it started still holds the lock"
    return text


def _pid_running(pid: Any) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError, TypeError, OverflowError):
        return True
    return True
