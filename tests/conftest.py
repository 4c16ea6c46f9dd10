"""Shared fixtures: the real sample corpora fetched by `make sample-corpus` (see data_prep/samples.py)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = Path(os.environ.get("UNILM_SAMPLES", ROOT / "data" / "samples"))

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))


@pytest.fixture(scope="session")
def samples_dir() -> Path:
    """Folder of real corpora; `make test` fetches it first (`make sample-corpus`)."""
    if not (SAMPLES / "wiki").is_dir():
        pytest.fail(f"sample corpora missing in {SAMPLES}: run `make sample-corpus` (make test does it for you)")
    return SAMPLES


@pytest.fixture(scope="session")
def minilm_dir(samples_dir: Path) -> Path:
    """A real 6-layer HF BERT (all-MiniLM-L6-v2): config.json, model.safetensors, uncased vocab.txt."""
    return samples_dir / "minilm"
