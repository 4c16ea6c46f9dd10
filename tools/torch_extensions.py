"""Where DeepSpeed's ops built on first use (FusedAdam, CPUAdam, the CPU shared-memory all-reduce) go when this
checkout chooses: ``.cache/torch_extensions/torch-<version>-py<major><minor>``, the version as torch names its
build (``2.11.0+cu130``, ``2.13.0+cpu``). torch keys its own default folder by Python and CUDA version only, and
reuses a library whose sources did not change, so a venv whose torch was upgraded, or a second venv on the same
checkout, would load a library built against another torch and fail with ``undefined symbol``. One folder per
torch build avoids that. A ``TORCH_EXTENSIONS_DIR`` the user set always wins.

``python -m tools.torch_extensions`` prints the folder (the Makefile exports it); it imports no torch.
"""
from __future__ import annotations

import importlib.util
import os
import re
import sys
from collections.abc import MutableMapping
from importlib import metadata
from pathlib import Path

CACHE = Path(__file__).resolve().parents[1] / ".cache" / "torch_extensions"
_VERSION = re.compile(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", re.MULTILINE)


def torch_build() -> str:
    """``torch.__version__`` read from ``torch/version.py`` without importing torch (a second or two); the
    distribution's version where that file cannot be read (PyPI's CUDA wheels leave the CUDA tag out of it)."""
    spec = importlib.util.find_spec("torch")
    origin = spec.origin if spec else None  # None: no spec, or a namespace or frozen package
    try:
        found = _VERSION.search((Path(origin).parent / "version.py").read_text(encoding="utf-8")) if origin else None
    except OSError:
        found = None
    return found.group(1) if found else metadata.version("torch")


def extensions_dir() -> Path:
    """This checkout's op folder for the installed torch build and the running Python."""
    return CACHE / f"torch-{torch_build()}-py{sys.version_info[0]}{sys.version_info[1]}"


def default_extensions_dir(environ: MutableMapping[str, str] = os.environ) -> str:
    """``TORCH_EXTENSIONS_DIR``: the one set, else ``extensions_dir()`` (set in ``environ`` for child processes)."""
    return environ.setdefault("TORCH_EXTENSIONS_DIR", str(extensions_dir()))


if __name__ == "__main__":
    print(extensions_dir())
