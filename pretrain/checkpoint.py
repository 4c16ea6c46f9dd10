"""Checkpoint bookkeeping around DeepSpeed's ``save_checkpoint`` / ``load_checkpoint``.

Layout of ``out_dir/checkpoints/``::

    global_step{N}/               DeepSpeed's files for step N (model states, per-rank ZeRO optimizer shards)
    global_step{N}/complete.json  our marker: written by rank 0 after every rank saved and passed a barrier;
                                  lists every file with its size, plus the run metadata (format version, step,
                                  consumed_samples, world size, ZeRO stage, model config, run config, manifest
                                  and vocab hashes, code version)
    global_step{N}_universal/     DeepSpeed universal checkpoint, made on demand when the world size changes
    latest                        tag of the newest complete checkpoint; we write it atomically after the
                                  marker (DeepSpeed's own ``latest`` update is switched off)

A tag without a valid marker (a rank died mid-save, a file was truncated) is never resumed from.
DeepSpeed does not save RNG states: ``client_state["rng_states"]`` holds every rank's torch, numpy and Python
states (gathered), so resuming on the same world size reproduces the uninterrupted losses bit for bit.
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import torch

FORMAT_VERSION = 1
MARKER = "complete.json"
LATEST = "latest"
_TAG = re.compile(r"^global_step(\d+)$")


class CheckpointMismatchError(ValueError):
    """The checkpoint belongs to another model, vocabulary, shard set or seed (the message names the field)."""


def tag_for_step(step: int) -> str:
    return f"global_step{step}"


def step_of_tag(tag: str) -> int | None:
    match = _TAG.match(tag)
    return int(match.group(1)) if match else None


def code_version() -> str:
    """``git describe`` of the checkout (``-dirty`` if modified), else the installed package version."""
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty", "--tags"], cwd=Path(__file__).parent,
                             capture_output=True, text=True, timeout=10)
        if out.returncode == 0 and out.stdout.strip():
            return "git:" + out.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    try:
        return "pkg:" + metadata.version("unilm-pretrain")
    except metadata.PackageNotFoundError:
        return "unknown"


def rng_state() -> dict[str, Any]:
    """This process's torch, numpy and Python RNG states."""
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


# --- completeness -----------------------------------------------------------------------------------------

def _listing(tag_dir: Path) -> dict[str, int]:
    return {str(p.relative_to(tag_dir)): p.stat().st_size
            for p in sorted(tag_dir.rglob("*")) if p.is_file() and p.name != MARKER}


def write_marker(tag_dir: Path, meta: dict[str, Any]) -> None:
    """Record every file of a finished save with its size; call on one rank after all ranks saved."""
    record = dict(meta, format_version=FORMAT_VERSION, files=_listing(tag_dir))
    tmp = tag_dir / (MARKER + ".tmp")
    tmp.write_text(json.dumps(record, indent=1, default=str))
    os.replace(tmp, tag_dir / MARKER)


def read_marker(tag_dir: Path) -> dict[str, Any] | None:
    """The marker of a complete checkpoint, or None if it is missing, unreadable or files differ from it."""
    try:
        record = json.loads((tag_dir / MARKER).read_text())
    except (OSError, ValueError):
        return None
    if record.get("format_version") != FORMAT_VERSION:
        raise CheckpointMismatchError(
            f"{tag_dir}: checkpoint format_version {record.get('format_version')} != {FORMAT_VERSION}")
    for name, size in record.get("files", {}).items():
        path = tag_dir / name
        if not path.is_file() or path.stat().st_size != size:
            return None
    return record


def update_latest(checkpoint_dir: Path, tag: str) -> None:
    """Atomically point ``latest`` at ``tag``."""
    tmp = checkpoint_dir / (LATEST + ".tmp")
    tmp.write_text(tag)
    os.replace(tmp, checkpoint_dir / LATEST)


def complete_tags(checkpoint_dir: Path) -> list[str]:
    """Tags with a valid marker, oldest first."""
    if not checkpoint_dir.is_dir():
        return []
    tags = sorted((p.name for p in checkpoint_dir.iterdir() if p.is_dir() and step_of_tag(p.name) is not None),
                  key=step_of_tag)
    return [t for t in tags if read_marker(checkpoint_dir / t) is not None]


def newest_complete_tag(checkpoint_dir: Path) -> str | None:
    tags = complete_tags(checkpoint_dir)
    return tags[-1] if tags else None


def prune(checkpoint_dir: Path, keep_last: int) -> list[str]:
    """Delete all but the newest ``keep_last`` complete checkpoints, and incomplete ones older than the
    newest complete one (never a save that may still be in progress). Returns the deleted tags."""
    complete = complete_tags(checkpoint_dir)
    if not complete:
        return []
    newest_step = step_of_tag(complete[-1])
    doomed = set(complete[:-keep_last])
    for path in checkpoint_dir.iterdir():
        step = step_of_tag(path.name)
        if path.is_dir() and step is not None and step < newest_step and path.name not in complete:
            doomed.add(path.name)
    for tag in doomed:
        shutil.rmtree(checkpoint_dir / tag, ignore_errors=True)
        shutil.rmtree(checkpoint_dir / f"{tag}_universal", ignore_errors=True)
    return sorted(doomed, key=step_of_tag)


# --- compatibility ----------------------------------------------------------------------------------------

def check_compatible(saved: dict[str, Any], current: dict[str, Any], where: str) -> None:
    """Refuse to resume a checkpoint made for another model, vocabulary, shard set or seed.

    ``saved`` / ``current`` carry ``model_config`` (dict), ``vocab_hash``, ``manifest_hash`` and ``seed``.
    """
    saved_model, current_model = saved.get("model_config", {}), current["model_config"]
    for name in sorted(set(saved_model) | set(current_model)):
        if saved_model.get(name) != current_model.get(name):
            raise CheckpointMismatchError(
                f"{where} was trained with model.{name}={saved_model.get(name)!r}, this run has "
                f"model.{name}={current_model.get(name)!r}; refusing to resume (use another out_dir or "
                "train.resume=never)")
    for name in ("vocab_hash", "manifest_hash", "seed"):
        if saved.get(name) != current.get(name):
            raise CheckpointMismatchError(
                f"{where} was trained with {name}={saved.get(name)!r}, this run has {name}={current.get(name)!r}; "
                "refusing to resume (use another out_dir or train.resume=never)")


# --- world-size change --------------------------------------------------------------------------------------

def to_universal(checkpoint_dir: Path, tag: str) -> str:
    """Convert ``tag`` to a DeepSpeed universal checkpoint (once; reused later) and return the universal tag.

    Runs DeepSpeed's own converter: ``python -m deepspeed.checkpoint.ds_to_universal --inject_missing_state``.
    """
    universal = f"{tag}_universal"
    target = checkpoint_dir / universal
    if (target / MARKER).is_file():
        return universal
    shutil.rmtree(target, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
                    "--input_folder", str(checkpoint_dir / tag), "--output_folder", str(target),
                    "--inject_missing_state", "--num_extract_workers", "1", "--num_merge_workers", "1"],
                   check=True)
    (target / MARKER).write_text(json.dumps({"source": tag}))
    return universal
