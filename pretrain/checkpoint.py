"""Checkpoint bookkeeping around DeepSpeed's ``save_checkpoint`` / ``load_checkpoint``.

Layout of ``out_dir/checkpoints/``::

    global_step{N}/               DeepSpeed's files for step N (model states, per-rank ZeRO optimizer shards)
    global_step{N}/complete.json  our marker: written by rank 0 after every rank saved and passed a barrier;
                                  lists every file with its size and sha256, plus the run metadata (format
                                  version, step, consumed_samples, world size, ZeRO stage, model config, run
                                  config, manifest and vocab hashes, code version)
    global_step{N}_universal/     DeepSpeed universal checkpoint, made on demand when the world size changes
    latest                        tag of the newest complete checkpoint; we write it atomically after the
                                  marker (DeepSpeed's own ``latest`` update is switched off)

A tag without a valid marker (a rank died mid-save, a file was truncated or its bytes changed after the save)
is never resumed from; auto-resume says which tag it skips and why. Every file, the marker and ``latest`` are
fsync'ed (with their directories) before the next step counts on them, so a power loss leaves either a complete
checkpoint or one that is detected and skipped.

DeepSpeed does not save RNG states: ``client_state["rng_states"]`` holds every rank's torch, numpy and Python
states and, on GPUs, the CUDA generator of the rank's device (gathered), so resuming on the same world size
continues every rank's dropout stream (on CPUs: reproduces the uninterrupted losses bit for bit).

Test hook (fault injection, used by ``tests/pretrain/test_survival.py``): ``UNILM_TEST_FAULT=POINT@STEP`` or
``POINT@STEP@RANK`` SIGKILLs the process at that point (``step``: start of a step; ``save_begin``;
``after:FILE`` after DeepSpeed wrote FILE; ``before_marker``; ``before_latest``), or with POINT ``inf_grad``
turns one gradient of that step to inf. Unset, it costs one dictionary lookup per step.
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
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
FAULT_ENV = "UNILM_TEST_FAULT"


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


def _accelerator_generator() -> tuple[Any, str, int] | None:
    """(DeepSpeed accelerator, its device type, the current device index) when the process runs on an accelerator
    with its own generators (CUDA), else None (the CPU generator is torch's)."""
    from deepspeed.accelerator import get_accelerator
    accelerator = get_accelerator()
    name = accelerator.device_name()
    if name == "cpu" or not accelerator.is_available():
        return None
    return accelerator, name, int(accelerator.current_device())


def rng_state() -> dict[str, Any]:
    """This process's torch, numpy and Python RNG states, and on an accelerator the generator of its current device
    (``"accelerator": {"device": "cuda", "state": ByteTensor}``: dropout on a GPU draws from it)."""
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    found = _accelerator_generator()
    if found is not None:
        accelerator, name, index = found
        state["accelerator"] = {"device": name, "state": accelerator.get_rng_state(index)}
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore ``rng_state()``'s values. The accelerator generator is restored when the state has one for this
    process's device type; a state without one (saved before it was recorded, or on a CPU) leaves it as seeded."""
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    saved, found = state.get("accelerator"), _accelerator_generator()
    if saved is not None and found is not None and saved["device"] == found[1]:
        accelerator, _, index = found
        accelerator.set_rng_state(saved["state"].cpu(), index)


def seed_everything(seed: int) -> None:
    """Seed Python, numpy and torch; ``torch.manual_seed`` seeds every accelerator device's generator too (CUDA),
    so a per-rank seed gives each rank its own dropout stream on GPUs as on CPUs."""
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


# --- fault injection (tests only) ---------------------------------------------------------------------------

def fault_injected(point: str, step: int, rank: int) -> bool:
    """Whether ``UNILM_TEST_FAULT`` asks for a fault at ``point`` of ``step`` on this rank (see the module doc)."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return False
    wanted = spec.split("@")
    return wanted[0] == point and int(wanted[1]) == step and (len(wanted) < 3 or int(wanted[2]) == rank)


def fault_point(point: str, step: int, rank: int) -> None:
    """SIGKILL this process here if the test hook asks for it (no cleanup, no flush: a crash)."""
    if fault_injected(point, step, rank):
        print(f"[fault] {FAULT_ENV}: SIGKILL at {point} of step {step} on rank {rank}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


# --- completeness -----------------------------------------------------------------------------------------

def _listing(tag_dir: Path) -> dict[str, int]:
    return {str(p.relative_to(tag_dir)): p.stat().st_size
            for p in sorted(tag_dir.rglob("*")) if p.is_file() and p.name != MARKER and not p.name.endswith(".tmp")}


def _fsync(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def fsync_tree(directory: Path) -> None:
    """Flush every file under ``directory`` and the directories themselves (names are data too) to disk."""
    for path in sorted(directory.rglob("*")):
        _fsync(path)
    _fsync(directory)
    _fsync(directory.parent)


def _write_durably(path: Path, text: str) -> None:
    """Write ``path`` so that after a crash it holds either its old or its new content."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    _fsync(path.parent)


def write_marker(tag_dir: Path, meta: dict[str, Any]) -> None:
    """Record every file of a finished save with its size and sha256; call on one rank after all ranks saved
    (and fsync'ed) and passed a barrier."""
    from data_prep.shard_format import sha256_file

    files = _listing(tag_dir)
    record = dict(meta, format_version=FORMAT_VERSION, files=files,
                  sha256={name: sha256_file(tag_dir / name) for name in files})
    fsync_tree(tag_dir)
    _write_durably(tag_dir / MARKER, json.dumps(record, indent=1, default=str))


def verify_tag(tag_dir: Path, hashes: bool = False) -> tuple[dict[str, Any] | None, str | None]:
    """``(marker, None)`` for a complete checkpoint, else ``(None, why not)``. Sizes are always checked against
    the marker; with ``hashes`` the sha256 recorded at save time too (reads every byte)."""
    try:
        record = json.loads((tag_dir / MARKER).read_text())
    except FileNotFoundError:
        return None, f"no {MARKER} (the save did not finish)"
    except (OSError, ValueError) as error:
        return None, f"unreadable {MARKER} ({error})"
    if record.get("format_version") != FORMAT_VERSION:
        raise CheckpointMismatchError(
            f"{tag_dir}: checkpoint format_version {record.get('format_version')} != {FORMAT_VERSION}")
    for name, size in record.get("files", {}).items():
        path = tag_dir / name
        if not path.is_file():
            return None, f"{name} is missing"
        actual = path.stat().st_size
        if actual != size:
            return None, (f"{name} has {actual} bytes, the marker recorded {size} "
                          + ("(truncated)" if actual < size else "(rewritten)"))
    if hashes:
        from data_prep.shard_format import sha256_file
        for name, digest in record.get("sha256", {}).items():
            if sha256_file(tag_dir / name) != digest:
                return None, f"{name} does not match the sha256 recorded at save time (corrupted)"
    return record, None


def read_marker(tag_dir: Path, hashes: bool = False) -> dict[str, Any] | None:
    """The marker of a complete checkpoint, or None if it is missing, unreadable or files differ from it."""
    return verify_tag(tag_dir, hashes)[0]


def update_latest(checkpoint_dir: Path, tag: str) -> None:
    """Atomically and durably point ``latest`` at ``tag``."""
    _write_durably(checkpoint_dir / LATEST, tag)


def _tags(checkpoint_dir: Path) -> list[str]:
    if not checkpoint_dir.is_dir():
        return []
    return sorted((p.name for p in checkpoint_dir.iterdir() if p.is_dir() and step_of_tag(p.name) is not None),
                  key=step_of_tag)


def complete_tags(checkpoint_dir: Path) -> list[str]:
    """Tags with a valid marker (sizes checked), oldest first."""
    return [t for t in _tags(checkpoint_dir) if read_marker(checkpoint_dir / t) is not None]


def newest_complete_tag(checkpoint_dir: Path, hashes: bool = False, report: Any = None) -> str | None:
    """The newest tag with a valid marker (with ``hashes``: whose bytes match it too); ``report(line)`` is told
    which newer tags were skipped and why."""
    for tag in reversed(_tags(checkpoint_dir)):
        _, problem = verify_tag(checkpoint_dir / tag, hashes)
        if problem is None:
            return tag
        if report is not None:
            report(f"[resume] skipping {checkpoint_dir / tag}: {problem}")
    return None


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
    fsync_tree(target)
    _write_durably(target / MARKER, json.dumps({"source": tag}))
    return universal
