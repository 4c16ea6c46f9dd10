"""Running the shard builder in-process from tests: its manifest on success, its error message on refusal, and what
it logged (its warnings and notes, which the command line shows on stderr)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from data_prep import build


def run_build(*args: object) -> dict:
    """``data_prep.build`` with ``args`` (quiet); returns the manifest of its ``--out``."""
    build.main([str(a) for a in args] + ["--quiet"])
    out = Path(str(args[list(args).index("--out") + 1]))
    return json.loads((out / "manifest.json").read_text())


def directory_bytes(directory: Path) -> dict[str, bytes]:
    """Every file of a build's output directory, by name."""
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def build_three_ways(common: list[object], out: Path) -> dict:
    """``common``'s build with 1 worker (``out/one``), 2 workers (``out/two``) and 2 builders finished in reverse
    order then finalized (``out/split``); checks the three outputs are byte-identical and returns the manifest."""
    one = run_build(*common, "--workers", 1, "--out", out / "one")
    run_build(*common, "--workers", 2, "--out", out / "two")
    for index in (1, 0):  # builders may finish in any order
        build.main([str(a) for a in common] + ["--num-builders", "2", "--builder-index", str(index),
                                                "--out", str(out / "split"), "--quiet"])
    build.main(["--finalize", "--out", str(out / "split")])
    reference = directory_bytes(out / "one")
    for other in ("two", "split"):
        assert directory_bytes(out / other) == reference, f"{other} differs from the 1-worker build"
    return one


def build_error(*args: object) -> str:
    """The message ``data_prep.build`` exits with when it refuses ``args``."""
    with pytest.raises(SystemExit) as info:
        build.main([str(a) for a in args] + ["--quiet"])
    return str(info.value.code)


def logged(caplog: pytest.LogCaptureFixture) -> str:
    """The messages logged since the last call (as ``capsys.readouterr`` gives what was printed since the last)."""
    text = "\n".join(record.getMessage() for record in caplog.records)
    caplog.clear()
    return text
