"""Outputs that appear complete or not at all, and never over an input or someone's results by accident.

Every file or directory a command produces is written beside its final name and renamed into place, so a kill
leaves the old output (or none), never half of the new one. ``check_output`` is the one refusal rule: an output
path equal to an input is refused, an existing non-empty output needs ``--force``, and a file's path
(``file``) must not be a directory.
"""
from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path


class OutputExistsError(FileExistsError):
    """The output exists and is not empty; the caller did not pass ``--force``."""


def _same(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve() or (a.exists() and b.exists() and os.path.samefile(a, b))
    except OSError:
        return False


def check_output(output: str | Path, inputs: Iterable[str | Path | None] = (), force: bool = False,
                 flag: str = "--force", replaced_whole: bool = False, file: bool = False) -> Path:
    """Refuse ``output`` if it is one of ``inputs`` (with ``replaced_whole``: or a directory holding one, which
    replacing would delete), if it exists non-empty without ``force``, or (with ``file``: the output is one file)
    if it is a directory, which the finished file could not be renamed onto; returns it as a Path."""
    output = Path(output)
    if file and output.is_dir():
        raise ValueError(f"output {output} is a directory; name a file to write")
    for source in inputs:
        if source is None:
            continue
        source = Path(source)
        inside = replaced_whole and source.resolve().is_relative_to(output.resolve())
        if _same(output, source) or inside:
            raise ValueError(f"output {output} is (or contains) the input {source}; choose another output path")
    non_empty = output.is_file() and output.stat().st_size > 0 or output.is_dir() and any(output.iterdir())
    if non_empty and not force:
        raise OutputExistsError(f"{output} exists and is not empty; pass {flag} to replace it")
    return output


def replace_directory(path: str | Path, write: Callable[[Path], object]) -> Path:
    """Call ``write(temporary_directory)``, then put that directory at ``path``: nothing of an old ``path``
    survives (the caller checked ``force``). Between the two renames ``path`` is briefly absent, never mixed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
    old = path.with_name(f".{path.name}.old-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        write(tmp)
        if path.exists():
            os.replace(path, old)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(old, ignore_errors=True)
    return path
