"""The repository root: where the presets, DeepSpeed JSON and docs a run names by relative path are found."""
from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
