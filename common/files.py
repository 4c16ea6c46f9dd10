"""Files on disk: content hashes, fsync of files and directories, and the one atomic write every format uses.

An atomic write puts the new content beside its final name and renames it into place, so a reader (or a crash)
sees the old file or the whole new one, never a part. A durable one also flushes the file before the rename and
the directory after it (a rename is an entry of its directory: without that flush a crash may undo it).
"""
from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path

PARTIAL_MARK = ".partial-"
"""What the name of a file still being written contains (``.NAME.partial-PID``); listings of finished outputs
skip such names."""


def sha256_file(path: str | Path) -> str:
    """Hex SHA-256 of a file's bytes, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fsync_path(path: str | Path) -> None:
    """Flush one file or directory (its entries) to disk."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def fsync_tree(directory: Path) -> None:
    """Flush every file under ``directory``, the directory itself and its parent (names are data too).

    Several processes may write into one directory at once, so a file listed here may be renamed away before its
    flush (another rank's temporary file becoming its final name): it is skipped, its writer flushes it under its
    final name."""
    for path in sorted(directory.rglob("*")):
        try:
            fsync_path(path)
        except FileNotFoundError:
            continue
    fsync_path(directory)
    fsync_path(directory.parent)


def write_atomically(path: str | Path, write: Callable[[Path], object], durable: bool = True) -> Path:
    """Call ``write(temporary_path)`` and rename the result to ``path``; with ``durable`` (the default) the file is
    fsync'ed before the rename and its directory after it. ``durable=False`` is for intermediate files that a crash
    makes the caller rebuild anyway. The temporary file never outlives a failure. Returns ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}{PARTIAL_MARK}{os.getpid()}")
    try:
        write(tmp)
        if durable:
            fsync_path(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    if durable:
        fsync_path(path.parent)
    return path


def write_bytes_atomically(path: str | Path, chunks: list[bytes | memoryview], durable: bool = True) -> Path:
    """`write_atomically` for content given as byte chunks, written in order."""
    def write(tmp: Path) -> None:
        with open(tmp, "wb") as handle:
            for chunk in chunks:
                handle.write(chunk)
    return write_atomically(path, write, durable)


def write_text_atomically(path: str | Path, text: str, durable: bool = True) -> Path:
    """`write_atomically` for UTF-8 text."""
    return write_atomically(path, lambda tmp: tmp.write_text(text, encoding="utf-8"), durable)
