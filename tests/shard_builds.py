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
