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
states (gathered), so resuming on the same world size reproduces the uninterrupted losses bit for bit.

One procedure serves pre-training and fine-tuning: `save` (stale marker removed, DeepSpeed's files, fsync,
marker, ``latest``, prune; a full disk becomes `CheckpointWriteError`), `find_resume_point` (the newest
complete checkpoint, hash-verified and checked against this run; converted to a universal checkpoint when
the world size or ZeRO stage changed) and `load`.
"""
from __future__ import annotations

import dataclasses
import errno
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import torch.distributed as torch_dist

from data_prep.shard_format import sha256_file
from pretrain.engine import RunStopped, gather_objects, portable_rng_state
from pretrain.model import RETIRED_FIELDS

FORMAT_VERSION = 1
MARKER = "complete.json"
LATEST = "latest"
_TAG = re.compile(r"^global_step(\d+)$")


class CheckpointMismatchError(ValueError):
    """The checkpoint belongs to another model, vocabulary, shard set or seed (the message names the field)."""


class CheckpointWriteError(RunStopped):
    """A checkpoint could not be written (disk full, I/O error); the previous complete one is intact."""
    exit_code = 4


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
    saved_model = {k: v for k, v in saved_model.items() if k not in RETIRED_FIELDS}  # training settings now
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


# --- the procedure both training loops call -------------------------------------------------------------------

def save(engine: Any, checkpoint_dir: Path, step: int, meta: dict[str, Any], client_state: dict[str, Any],
         keep_last: int, previous: str | None) -> str:
    """Save a complete checkpoint of ``step`` on every rank (a collective) and return its tag.

    ``meta`` (run metadata and progress such as ``consumed_samples``) goes into the marker and the client
    state; ``client_state`` only into the latter, with every rank's RNG states. Rank 0 removes a marker left by
    an earlier save of this tag (it must not vouch for the files now rewritten); each rank's files are
    fsync'ed before the barrier, then rank 0 writes the marker, moves ``latest`` and prunes to ``keep_last``.
    A full disk or an I/O error removes the partial tag and raises `CheckpointWriteError`, naming ``previous``
    (the last complete checkpoint, still intact).
    """
    rank = torch_dist.get_rank()
    tag = tag_for_step(step)
    tag_dir = checkpoint_dir / tag
    state = dict(meta, step=step, rng_states=gather_objects(portable_rng_state()), **client_state)
    if rank == 0:
        (tag_dir / MARKER).unlink(missing_ok=True)
    try:
        engine.save_checkpoint(str(checkpoint_dir), tag=tag, client_state=state, save_latest=False)
        fsync_tree(tag_dir)  # this rank's files are on disk before they count
    except (OSError, RuntimeError) as error:  # a full disk surfaces as OSError or as torch's RuntimeError
        free = shutil.disk_usage(checkpoint_dir).free
        # torch.save reports a full disk as "PytorchStreamWriter failed writing file", without the errno
        # (https://github.com/pytorch/pytorch/issues/76108): the free space tells
        full = getattr(error, "errno", None) == errno.ENOSPC or free < 2**20
        if not (full or isinstance(error, OSError)):
            raise  # not the disk (e.g. a peer died in DeepSpeed's barrier): a crash, not a diagnosis
        shutil.rmtree(tag_dir, ignore_errors=True)  # never resumed from; frees what it took
        raise CheckpointWriteError(
            f"rank {rank} could not write checkpoint {tag_dir}: "
            f"{'No space left on device' if full else 'I/O error'} ({free / 2**20:.1f} MiB free there; {error}). "
            f"The last complete checkpoint ({previous or 'none'}) is intact: free disk space (make preflight "
            "estimates what a run needs) and rerun the same command to continue from it") from error
    torch_dist.barrier()  # every rank's files are written before the marker
    if rank == 0:
        write_marker(tag_dir, dict(meta, step=step))
        update_latest(checkpoint_dir, tag)
        prune(checkpoint_dir, keep_last)
    torch_dist.barrier()
    return tag


@dataclasses.dataclass(frozen=True)
class ResumePoint:
    directory: Path
    """The checkpoints directory."""
    tag: str
    """The complete checkpoint resumed from."""
    load_tag: str
    """What DeepSpeed loads: ``tag``, or its universal conversion after a world-size / ZeRO-stage change."""
    meta: dict[str, Any]
    """Its marker (run metadata)."""

    @property
    def universal(self) -> bool:
        return self.load_tag != self.tag


def find_resume_point(checkpoint_dir: Path, resume: str, identity: dict[str, Any], world_size: int,
                      zero_stage: int, report: Callable[[str], None] | None = None) -> ResumePoint | None:
    """The checkpoint to resume (a collective when a conversion is needed).

    ``resume``: ``auto`` (the newest complete checkpoint of ``checkpoint_dir`` whose bytes match its marker;
    ``report(line)`` hears which newer tags were skipped and why), ``never``, or a tag directory. The choice is
    checked against ``identity`` (`check_compatible`) and converted to a universal checkpoint when the world
    size or the ZeRO stage changed (rank 0 converts, the others wait).
    """
    if resume == "never":
        return None
    if resume == "auto":
        directory = Path(checkpoint_dir)
        tag = newest_complete_tag(directory, hashes=True, report=report)
        if tag is None:
            return None
    else:
        path = Path(resume)
        directory, tag = path.parent, path.name
    meta, problem = verify_tag(directory / tag, hashes=True)
    if meta is None:
        raise FileNotFoundError(f"{directory / tag} is not a complete checkpoint: {problem}")
    check_compatible(meta, identity, str(directory / tag))
    load_tag = tag
    if (meta["world_size"] != world_size or meta["zero_stage"] != zero_stage) and meta["zero_stage"] > 0:
        if torch_dist.get_rank() == 0:
            print(f"[resume] {tag}: world size {meta['world_size']} -> {world_size}, ZeRO stage "
                  f"{meta['zero_stage']} -> {zero_stage}: converting to a universal checkpoint", flush=True)
            to_universal(directory, tag)
        torch_dist.barrier()
        load_tag = f"{tag}_universal"
    return ResumePoint(directory=directory, tag=tag, load_tag=load_tag, meta=meta)


def load(engine: Any, resume: ResumePoint) -> dict[str, Any]:
    """Load ``resume`` into ``engine`` (every rank); returns the client state saved by `save`."""
    load_path, client_state = engine.load_checkpoint(str(resume.directory), tag=resume.load_tag)
    if load_path is None:
        raise RuntimeError(f"DeepSpeed could not load {resume.directory / resume.load_tag}")
    return client_state
