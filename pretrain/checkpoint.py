"""Checkpoint bookkeeping around DeepSpeed's ``save_checkpoint`` / ``load_checkpoint``.

Layout of ``out_dir/checkpoints/``::

    global_step{N}/               DeepSpeed's files for step N (model states, per-rank ZeRO optimizer shards)
    global_step{N}/complete.json  our marker: written by rank 0 after every rank saved and passed a barrier;
                                  lists every file with its size and sha256, plus the run metadata (format
                                  version, step, consumed_samples, world size, ZeRO stage, model config, run
                                  config, manifest and vocab hashes, code version)
    global_step{N}_universal/     DeepSpeed universal checkpoint, made on demand when the world size changes
    global_step{N}/model_weights.safetensors
                                  the module's full fp32 weights (gathered from every ZeRO partition), the only
                                  file read outside a resume: exports and fine-tuning's ``--init`` load it after
                                  the marker's hashes check out, and never unpickle anything
    latest                        tag of the checkpoint to resume; we write it atomically after the marker
                                  (DeepSpeed's own ``latest`` update is switched off)
    out_dir/run.lock              held (``flock``) by the run's rank 0 while it runs: pid, host, start time

One validity test, ``verify_tag`` (every file's size and sha256 against the marker), decides resume, ``latest``
and pruning. A tag without a valid marker (a rank died mid-save, a file was truncated or its bytes changed after
the save) is never resumed from, exported or loaded; auto-resume says which tag it skips and why.

Which checkpoint auto-resume takes (``choose_resume_tag``): the one ``latest`` names, when valid — or a valid
checkpoint saved right after it whose ``latest`` update a crash cut off (its marker names ``latest``'s save as
its parent). If ``latest`` is missing or invalid: the newest valid checkpoint. Valid checkpoints newer than the
one chosen belong to an abandoned history (a run rolled back with ``train.resume=DIR/TAG``): they are named,
kept, and never picked silently. Pruning (``prune``) keeps the checkpoint just written, everything newer than it,
and the ``keep_last - 1`` newest valid ones before it; it deletes only older ones.

Every file, the marker and ``latest`` are fsync'ed (with their directories) before the next step counts on them,
so a power loss leaves either a complete checkpoint or one that is detected and skipped.

DeepSpeed does not save RNG states: ``client_state["rng_states"]`` holds every rank's torch, numpy and Python
states and, on GPUs, the CUDA generator of the rank's device (gathered), so resuming on the same world size
continues every rank's dropout stream (on CPUs: reproduces the uninterrupted losses bit for bit).

One procedure serves pre-training and fine-tuning: `save` (stale marker removed, DeepSpeed's files and the
safetensors weights, fsync, marker, ``latest``, prune; a full disk becomes `CheckpointWriteError`),
`find_resume_point` (``choose_resume_tag``'s checkpoint, hash-verified and checked against this run; converted to
a universal checkpoint when the world size or ZeRO stage changed) and `load`. RNG capture and restore are
``pretrain.engine``'s.
"""
from __future__ import annotations

import dataclasses
import errno
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
import torch.distributed as torch_dist
from deepspeed.utils import safe_get_full_fp32_param
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from common import locks
from common.files import PARTIAL_MARK, fsync_tree, sha256_file, write_atomically, write_text_atomically
from pretrain.engine import (RunStopped, first_error, gather_objects, portable_rng_state, resume_rng,
                             seed_everything)
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
            for p in sorted(tag_dir.rglob("*")) if p.is_file() and p.name != MARKER and PARTIAL_MARK not in p.name}


def write_marker(tag_dir: Path, meta: dict[str, Any]) -> str:
    """Record every file of a finished save with its size and sha256; call on one rank after all ranks saved
    (and fsync'ed) and passed a barrier. ``meta["parent_save_id"]`` names the save this run continued from (None
    for a fresh run); returns this save's id (random, unique), which its successor records as its parent."""
    files = _listing(tag_dir)
    if not files:
        raise RuntimeError(f"{tag_dir}: no files to vouch for; the save wrote nothing")
    record = dict(meta, format_version=FORMAT_VERSION, save_id=meta.get("save_id") or uuid.uuid4().hex, files=files,
                  sha256={name: sha256_file(tag_dir / name) for name in files})
    fsync_tree(tag_dir)
    write_text_atomically(tag_dir / MARKER, json.dumps(record, indent=1, default=str))
    return record["save_id"]


class CheckpointPathError(ValueError):
    """A ``latest`` or tag path that points outside its checkpoint directory (the message names it)."""


class UnvouchedCheckpointError(ValueError):
    """A checkpoint whose weights cannot be read without unpickling (no marker-listed safetensors file)."""


def _file_problem(tag_dir: Path, name: str) -> str | None:
    """Why the marker's file entry ``name`` cannot be trusted (a path leaving the tag directory, a link)."""
    relative = Path(name)
    if relative.is_absolute() or ".." in relative.parts or not relative.parts:
        return f"the marker lists {name!r}, a path outside the checkpoint"
    path = tag_dir / relative
    if path.is_symlink():
        return f"{name} is a symbolic link"
    return None


def verify_tag(tag_dir: Path, hashes: bool = True) -> tuple[dict[str, Any] | None, str | None]:
    """``(marker, None)`` for a valid checkpoint, else ``(None, why not)``: the marker lists at least one file,
    each is a plain file inside the tag directory with the size and sha256 recorded at save time. This one test
    decides resume, ``latest``, pruning and loading. ``hashes=False`` (sizes only) is for quick listings."""
    try:
        record = json.loads((tag_dir / MARKER).read_text())
    except FileNotFoundError:
        return None, f"no {MARKER} (the save did not finish)"
    except (OSError, ValueError) as error:
        return None, f"unreadable {MARKER} ({error})"
    if not isinstance(record, dict):
        return None, f"{MARKER} is not a JSON object"
    if record.get("format_version") != FORMAT_VERSION:
        version = record.get("format_version")
        newer = isinstance(version, int) and version > FORMAT_VERSION
        raise CheckpointMismatchError(
            f"{tag_dir}: checkpoint format_version {version}, this code reads {FORMAT_VERSION}: it was written by "
            f"{'a newer' if newer else 'another'} version of this project; resume it with that version, or give "
            "this run another out_dir")
    files, digests = record.get("files"), record.get("sha256")
    if not isinstance(files, dict) or not files:
        return None, f"{MARKER} lists no files (a marker must vouch for every file of the save)"
    if not isinstance(digests, dict) or set(digests) != set(files):
        return None, f"{MARKER} does not record a sha256 for every file it lists"
    for name, size in files.items():
        problem = _file_problem(tag_dir, name)
        if problem is not None:
            return None, problem
        path = tag_dir / name
        if not path.is_file():
            return None, f"{name} is missing"
        actual = path.stat().st_size
        if actual != size:
            return None, (f"{name} has {actual} bytes, the marker recorded {size} "
                          + ("(truncated)" if actual < size else "(rewritten)"))
    if hashes:
        for name, digest in digests.items():
            if sha256_file(tag_dir / name) != digest:
                return None, f"{name} does not match the sha256 recorded at save time (corrupted)"
    return record, None


def read_marker(tag_dir: Path, hashes: bool = True) -> dict[str, Any] | None:
    """The marker of a valid checkpoint (``verify_tag``), or None."""
    return verify_tag(tag_dir, hashes)[0]


def update_latest(checkpoint_dir: Path, tag: str) -> None:
    """Atomically and durably point ``latest`` at ``tag``."""
    write_text_atomically(checkpoint_dir / LATEST, tag)


def read_latest(checkpoint_dir: Path) -> str | None:
    """The tag ``latest`` names (None without a ``latest``); refuses anything but a ``global_stepN`` name, so
    ``latest`` can never lead outside ``checkpoint_dir`` (an absolute path, ``..``, a sub-path)."""
    path = checkpoint_dir / LATEST
    if not path.is_file():
        return None
    tag = path.read_text().strip()
    if step_of_tag(tag) is None:
        raise CheckpointPathError(f"{path} names {tag!r}, not a tag (global_stepN) inside {checkpoint_dir}; "
                                  "refusing to follow it (fix or delete the file)")
    return tag


def resolve_tag_dir(path: str | Path) -> tuple[Path, str]:
    """(checkpoints directory, tag) for a checkpoints directory (its ``latest``) or one tag directory, refusing
    a ``latest`` or a tag that is not a ``global_stepN`` entry of the checkpoints directory itself."""
    path = Path(path)
    if (path / LATEST).is_file():
        directory, tag = path, read_latest(path)
    else:
        directory, tag = path.parent, path.name
        if step_of_tag(tag) is None:
            raise CheckpointPathError(f"{path} is neither a checkpoints directory (with {LATEST}) nor a tag "
                                      "directory (global_stepN)")
    if (directory / tag).resolve().parent != directory.resolve():
        raise CheckpointPathError(f"{directory / tag} resolves to {(directory / tag).resolve()}, outside "
                                  f"{directory}; refusing it")
    return directory, tag


def _tags(checkpoint_dir: Path) -> list[str]:
    if not checkpoint_dir.is_dir():
        return []
    return sorted((p.name for p in checkpoint_dir.iterdir() if p.is_dir() and step_of_tag(p.name) is not None),
                  key=step_of_tag)


def complete_tags(checkpoint_dir: Path, hashes: bool = True) -> list[str]:
    """Valid tags (``verify_tag``), oldest first."""
    return [t for t in _tags(checkpoint_dir) if read_marker(checkpoint_dir / t, hashes) is not None]


def newest_complete_tag(checkpoint_dir: Path, hashes: bool = True, report: Any = None) -> str | None:
    """The newest valid tag; ``report(line)`` is told which newer tags were skipped and why."""
    for tag in reversed(_tags(checkpoint_dir)):
        _, problem = verify_tag(checkpoint_dir / tag, hashes)
        if problem is None:
            return tag
        if report is not None:
            report(f"[resume] skipping {checkpoint_dir / tag}: {problem}")
    return None


def choose_resume_tag(checkpoint_dir: Path, report: Any = None) -> str | None:
    """The checkpoint auto-resume continues from (the rule is in the module docstring), or None.

    ``report(line)`` is told which tags were skipped and why, and which valid newer tags are left alone."""
    say = report or (lambda line: None)
    tags = _tags(checkpoint_dir)
    latest = read_latest(checkpoint_dir)
    skipped: set[str] = set()

    def valid(tag: str) -> dict[str, Any] | None:
        meta, problem = verify_tag(checkpoint_dir / tag)
        if problem is not None and tag not in skipped:
            say(f"[resume] skipping {checkpoint_dir / tag}: {problem}")
            skipped.add(tag)
        return meta

    chosen = None
    latest_meta = valid(latest) if latest in tags else None
    if latest is not None and latest not in tags:
        say(f"[resume] {checkpoint_dir / LATEST} names {latest}, which does not exist")
    if latest_meta is not None:
        chosen = latest
        # a save whose marker was written but whose `latest` update a crash cut off continues latest's history
        for tag in reversed(tags):
            if step_of_tag(tag) <= step_of_tag(latest):
                break
            meta = valid(tag)
            parent = meta.get("parent_save_id", latest_meta.get("save_id")) if meta is not None else None
            if meta is not None and parent == latest_meta.get("save_id"):
                chosen = tag
                break
    else:
        chosen = next((tag for tag in reversed(tags) if valid(tag) is not None), None)
    if chosen is not None:
        abandoned = [t for t in tags if step_of_tag(t) > step_of_tag(chosen) and t not in skipped
                     and read_marker(checkpoint_dir / t, hashes=False) is not None]
        if abandoned:
            say(f"[resume] not resuming {', '.join(abandoned)} in {checkpoint_dir}: newer than {chosen} but not "
                f"its continuation (`{LATEST}` names {latest}); they come from an abandoned run history and are "
                "kept (resume one explicitly with train.resume=DIR/TAG, or delete them)")
    return chosen


def prune(checkpoint_dir: Path, keep_last: int, just_written: str | None = None) -> list[str]:
    """Delete old checkpoints and return their tags, oldest first.

    Kept: ``just_written`` (default: the newest valid tag), every tag newer than it (a valid one may be the
    abandoned history a rolled-back run keeps; an invalid one may be a save in progress), and the
    ``keep_last - 1`` newest valid tags older than it. Deleted: every other older tag, valid or not."""
    tags = _tags(checkpoint_dir)
    anchor = just_written or newest_complete_tag(checkpoint_dir)
    if anchor is None:
        return []
    kept_before = 0
    doomed = []
    for tag in reversed([t for t in tags if step_of_tag(t) < step_of_tag(anchor)]):
        if kept_before < keep_last - 1 and read_marker(checkpoint_dir / tag) is not None:
            kept_before += 1
        else:
            doomed.append(tag)
    for tag in doomed:
        shutil.rmtree(checkpoint_dir / tag, ignore_errors=True)
        shutil.rmtree(checkpoint_dir / f"{tag}_universal", ignore_errors=True)
    return sorted(doomed, key=step_of_tag)


# --- model weights outside DeepSpeed's pickles ---------------------------------------------------------------

WEIGHTS = "model_weights.safetensors"


def gather_full_weights(module: torch.nn.Module, keep: bool = True) -> dict[str, torch.Tensor]:
    """The module's full state dict on CPU, every parameter in fp32 from the optimizer's master copy where
    DeepSpeed keeps one (ZeRO-1/2/3, bf16) and gathered from every partition (ZeRO-3). Collective: every rank
    calls it, in the same order. Without a master copy (ZeRO-0 fp32, where the module holds fp32 weights, or
    ZeRO-0 fp16, whose fp32 copy DeepSpeed does not expose per parameter) the module's own values are taken.
    ``keep=False`` (the ranks that do not write it): takes part in the gathering and returns {}, holding no host
    copy of the model (an fp32 copy per rank is GBs of a node's memory for a large model)."""
    full: dict[int, torch.Tensor | None] = {}  # per distinct parameter (tied ones are gathered once, on every rank)
    state: dict[str, torch.Tensor] = {}
    for name, parameter in module.named_parameters(remove_duplicate=False):
        if id(parameter) not in full:
            master = safe_get_full_fp32_param(parameter) if parameter.requires_grad else None
            if master is None:
                master = parameter.detach()
            full[id(parameter)] = master.detach().float().cpu().clone() if keep else None
        if keep:
            state[name] = full[id(parameter)]
    if keep:
        for name, buffer in module.named_buffers():
            state[name] = buffer.detach().cpu().clone()
    return state


def write_weights(tag_dir: Path, state: dict[str, torch.Tensor]) -> None:
    """Write ``state`` as ``WEIGHTS`` into the tag directory (before its marker, which then lists and hashes it; the
    tag's `fsync_tree` flushes it)."""
    tensors, seen = {}, set()
    for name, tensor in state.items():  # tied weights share storage under two names: safetensors stores copies
        storage = tensor.untyped_storage().data_ptr()
        tensors[name] = tensor.clone() if storage in seen else tensor.contiguous()
        seen.add(storage)
    try:
        write_atomically(tag_dir / WEIGHTS, lambda tmp: save_file(tensors, str(tmp)), durable=False)
    except SafetensorError as error:  # safetensors reports a full disk as its own error type, the errno in words
        raise OSError(errno.ENOSPC if "No space left" in str(error) else errno.EIO, str(error)) from error


def load_weights(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(marker, fp32 state dict) of a checkpoint: a checkpoints directory (its ``latest``) or one tag directory.

    The weights come only from ``WEIGHTS`` after the marker's sizes and sha256 check out; DeepSpeed's pickled
    files are never read here. A checkpoint saved without ``WEIGHTS`` is refused with how to make one."""
    directory, tag = resolve_tag_dir(path)
    meta, problem = verify_tag(directory / tag)
    if meta is None:
        raise FileNotFoundError(f"{directory / tag} is not a valid checkpoint: {problem}")
    if WEIGHTS not in meta["files"]:
        raise UnvouchedCheckpointError(
            f"{directory / tag} has no {WEIGHTS} (it was saved by an older version of this code): its weights "
            "exist only in DeepSpeed's pickled files, which are never loaded outside a resume. Make a checkpoint "
            f"with {WEIGHTS} by resuming the run for one more save (the same command with "
            f"train.exit_at_step={meta.get('step', 'N') + 1 if isinstance(meta.get('step'), int) else 'N+1'})")
    return meta, load_file(directory / tag / WEIGHTS)


# --- one run per directory --------------------------------------------------------------------------------

LOCK_FILE = "run.lock"


class RunLockedError(RunStopped):
    """Another live process holds the run directory's lock (the message names it), or its filesystem cannot lock."""
    exit_code = 5


class RunLock:
    """An exclusive ``flock`` on ``out_dir/run.lock`` for as long as the run lives (``common.locks``: it never
    outlives its holder, names its holder to a second run, and reports a holder that died without releasing it);
    ``make preflight`` runs on every host."""

    def __init__(self, path: Path, handle: Any) -> None:
        self.path, self.handle = path, handle

    @classmethod
    def acquire(cls, out_dir: str | Path, report: Any = print) -> "RunLock":
        path = Path(out_dir) / LOCK_FILE
        try:
            handle, previous = locks.take(path, sync=True)
        except locks.Held as held:
            raise RunLockedError(f"{Path(out_dir)} is in use by another run: {held}. Wait for it to end (or stop "
                                 "it), or use another out_dir") from None
        if previous:
            report(f"[lock] {path}: the previous holder ({locks.holder_text(previous)}) ended without releasing it "
                   "(killed or crashed); taking it over")
        return cls(path, handle)

    def release(self) -> None:
        """Empty the record (a clean end) and drop the lock."""
        locks.release(self.handle)


def lock_run_directory(out_dir: str | Path, rank: int) -> RunLock | None:
    """Rank 0 takes the run lock of ``out_dir``; every rank raises ``RunLockedError`` if it is held elsewhere.
    Call after the process group exists and before anything is written under ``out_dir``."""
    lock, error = None, None
    if rank == 0:
        try:
            lock = RunLock.acquire(out_dir)
        except RunLockedError as exc:
            error = str(exc)
        except OSError as exc:  # stops every rank, not rank 0 alone
            error = f"{Path(out_dir) / LOCK_FILE}: cannot take the run lock ({exc})"
            if locks.cannot_lock(exc):
                error += f"; put out_dir on {locks.NO_LOCKS_HINT}"
    error = first_error(error)
    if error is not None:
        raise RunLockedError(error)
    return lock


# --- compatibility ----------------------------------------------------------------------------------------

PRETRAINING_RESTART = "another out_dir or train.resume=never"


def check_compatible(saved: dict[str, Any], current: dict[str, Any], where: str,
                     restart: str = PRETRAINING_RESTART) -> None:
    """Refuse to resume a checkpoint made for another model, vocabulary, shard set (a fine-tuning run's: training
    file), seed or, in fine-tuning, task and label space or initial weights (``--init``, ``--from-scratch``);
    ``restart`` says how to start a new run instead.

    ``saved`` / ``current`` carry ``model_config`` (dict), ``vocab_hash``, ``manifest_hash`` and ``seed``, and
    optionally ``task`` (a fine-tuning run's task and labels).
    """
    saved_model, current_model = saved.get("model_config", {}), current["model_config"]
    saved_model = {k: v for k, v in saved_model.items() if k not in RETIRED_FIELDS}  # training settings now
    for name in sorted(set(saved_model) | set(current_model)):
        if saved_model.get(name) != current_model.get(name):
            raise CheckpointMismatchError(
                f"{where} was trained with model.{name}={saved_model.get(name)!r}, this run has "
                f"model.{name}={current_model.get(name)!r}; refusing to resume ({restart})")
    if saved.get("manifest_hash") not in (None, current.get("manifest_hash")):
        if "task" in current:  # a fine-tuning run: the hash is its training file's
            raise CheckpointMismatchError(
                f"{where} was trained on another training file (sha256 {str(saved.get('manifest_hash'))[:12]}…, "
                f"this one's {str(current.get('manifest_hash'))[:12]}…); refusing to resume ({restart})")
        raise CheckpointMismatchError(
            f"{where} was trained on another build of its shards (manifest sha256 "
            f"{str(saved.get('manifest_hash'))[:12]}…, these shards' {str(current.get('manifest_hash'))[:12]}…"
            f"{_shards_named(saved, current)}): they were rebuilt (another seed, input or setting) or replaced since, "
            f"which is another data stream; point data.shards at the shards it was trained on, or start a new run "
            f"({restart})")
    for name in ("vocab_hash", "seed", "task", "init"):  # "task", "init": not in older fine-tuning markers
        if saved.get(name, current.get(name)) != current.get(name):
            raise CheckpointMismatchError(
                f"{where} was trained with {name}={saved.get(name)!r}, this run has {name}={current.get(name)!r}; "
                f"refusing to resume ({restart})")


def _shards_named(saved: dict[str, Any], current: dict[str, Any]) -> str:
    """"; trained on DIR, these are DIR" where the checkpoint's run config and this run name their shards."""
    then = (saved.get("run_config") or {}).get("data", {}).get("shards")
    now = current.get("shards")
    return f"; trained on {then}, these are {now}" if then and now else ""


WHEN_TO_STOP = ("exit_at_step", "exit_after_minutes", "resume", "save_interval", "keep_last", "verify")
"""Settings that only say when to stop or save, or what to check: a resumed run may change them unremarked."""


def changed_settings(saved: dict[str, Any], current: dict[str, Any], prefix: str = "") -> list[str]:
    """``key: old -> new`` for every setting of the run config ``current`` that differs from ``saved`` (the run
    config a checkpoint's marker records), nested keys dotted; those in ``WHEN_TO_STOP`` left out."""
    changes = []
    for key in sorted(set(saved) | set(current)):
        old, new = saved.get(key), current.get(key)
        if isinstance(new, tuple):  # a config's tuple comes back from the marker's JSON as a list
            new = list(new)
        if key in WHEN_TO_STOP or old == new:
            continue
        if isinstance(old, dict) and isinstance(new, dict):
            changes += changed_settings(old, new, f"{prefix}{key}.")
        else:
            changes.append(f"{prefix}{key}: {old!r} -> {new!r}")
    return changes


def report_changed_settings(resume: "ResumePoint | None", current: dict[str, Any], report: Any) -> None:
    """Say which settings differ from those the resumed checkpoint was saved under: the run continues with the
    new ones (the learning-rate schedule, say, from this step on)."""
    saved = (resume.meta.get("run_config") if resume is not None else None) or {}
    changes = changed_settings(saved, current) if saved else []
    if changes:
        report(f"[resume] settings changed since {resume.tag}, the run continues with the new ones from step "
               f"{resume.meta.get('step')}: {'; '.join(changes)}")


# --- world-size change --------------------------------------------------------------------------------------

def to_universal(checkpoint_dir: Path, tag: str, save_id: str | None = None) -> str:
    """Convert ``tag`` to a DeepSpeed universal checkpoint and return the universal tag. A conversion is reused
    while its marker names the save it came from (``save_id``, the tag's marker's): a later save of the same tag
    (a new run in the same directory) is converted afresh.

    Runs DeepSpeed's own converter: ``python -m deepspeed.checkpoint.ds_to_universal --inject_missing_state``.
    """
    universal = f"{tag}_universal"
    target = checkpoint_dir / universal
    if (target / MARKER).is_file():
        try:
            converted_from = json.loads((target / MARKER).read_text()).get("source_save_id")
        except (OSError, ValueError, AttributeError):
            converted_from = None
        if save_id is not None and converted_from == save_id:
            return universal
    shutil.rmtree(target, ignore_errors=True)
    # the other ranks wait in a collective meanwhile (DeepSpeed's timeout: DEEPSPEED_TIMEOUT minutes, default 10),
    # so the conversion uses the machine's cores: one process per rank file read, per parameter merged
    workers = str(max(1, min(8, os.cpu_count() or 1)))
    subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
                    "--input_folder", str(checkpoint_dir / tag), "--output_folder", str(target),
                    "--inject_missing_state", "--num_extract_workers", workers, "--num_merge_workers", workers],
                   check=True)
    fsync_tree(target)
    write_text_atomically(target / MARKER, json.dumps({"source": tag, "source_save_id": save_id}))
    return universal


# --- the procedure both training loops call -------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Saved:
    """A complete checkpoint of this run: the newest one resumed from or written."""

    tag: str
    save_id: str | None
    """Its marker's ``save_id`` (the next save records it as its parent; None for a checkpoint without one)."""


def save(engine: Any, checkpoint_dir: Path, step: int, meta: dict[str, Any], client_state: dict[str, Any],
         keep_last: int, previous: Saved | None) -> Saved:
    """Save a complete checkpoint of ``step`` on every rank (a collective) and return it.

    ``meta`` (run metadata and progress such as ``consumed_samples``) goes into the marker and the client
    state; ``client_state`` only into the latter, with every rank's RNG states. Rank 0 removes what an earlier
    save of this tag left (another run's, in the same directory: its marker must not vouch for the files now
    rewritten, files of ranks this run lacks must not stay, nor its universal conversion); DeepSpeed's files and
    the full fp32 weights (``WEIGHTS``, gathered from every partition) are fsync'ed on each rank before the
    barrier, then rank 0 writes the marker (whose parent is ``previous``), moves ``latest`` and prunes to
    ``keep_last``. A full disk or an I/O error removes the partial tag and raises `CheckpointWriteError`, naming
    ``previous`` (the last complete checkpoint, still intact).
    """
    rank = torch_dist.get_rank()
    tag = tag_for_step(step)
    tag_dir = checkpoint_dir / tag
    began = time.monotonic()
    state = dict(meta, step=step, rng_states=gather_objects(portable_rng_state()), **client_state)
    failure = None
    if rank == 0:
        try:
            for stale in (tag_dir, checkpoint_dir / f"{tag}_universal"):
                if stale.exists():
                    (stale / MARKER).unlink(missing_ok=True)  # first: an interrupted removal leaves no vouched tag
                    shutil.rmtree(stale)
        except OSError as error:
            failure = f"rank 0 could not remove what an earlier save left in {tag_dir}: {error}"
    failure = first_error(failure)  # also the barrier: no rank writes into the tag before it is gone
    if failure is not None:
        raise CheckpointWriteError(f"{failure}. The last complete checkpoint ({previous.tag if previous else 'none'}) "
                                   "is intact")
    try:
        engine.save_checkpoint(str(checkpoint_dir), tag=tag, client_state=state, save_latest=False)
        weights = gather_full_weights(engine.module, keep=rank == 0)  # collective under ZeRO
        if rank == 0:
            write_weights(tag_dir, weights)
        fsync_tree(tag_dir)  # this rank's files are on disk before they count
    except (OSError, RuntimeError) as error:  # a full disk surfaces as OSError or as torch's RuntimeError
        free = shutil.disk_usage(checkpoint_dir).free
        # torch.save reports a full disk as "PytorchStreamWriter failed writing file", without the errno
        # (https://github.com/pytorch/pytorch/issues/76108): the free space tells
        full = getattr(error, "errno", None) == errno.ENOSPC or free < 2**20
        if not (full or isinstance(error, OSError)):
            raise  # not the disk (e.g. a peer died in DeepSpeed's barrier): a crash, not a diagnosis
        failure = (f"rank {rank} could not write checkpoint {tag_dir}: "
                   f"{'No space left on device' if full else 'I/O error'} ({free / 2**20:.1f} MiB free there; "
                   f"{error})")
    failure = first_error(failure)  # every rank's files are written before the marker, or every rank stops
    if failure is not None:
        if rank == 0:
            shutil.rmtree(tag_dir, ignore_errors=True)  # never resumed from; frees what it took
        raise CheckpointWriteError(
            f"{failure}. The last complete checkpoint ({previous.tag if previous else 'none'}) is intact: free disk "
            "space (make preflight estimates what a run needs) and rerun the same command to continue from it")
    save_id = None
    if rank == 0:
        save_id = write_marker(tag_dir, dict(meta, step=step, parent_save_id=previous.save_id if previous else None))
        update_latest(checkpoint_dir, tag)
        prune(checkpoint_dir, keep_last, just_written=tag)
    saved = Saved(tag, gather_objects(save_id)[0])  # also the barrier: the save is complete on every rank
    if rank == 0:
        print(f"[save] {tag_dir} in {time.monotonic() - began:.1f} s", flush=True)
    return saved


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

    @property
    def saved(self) -> Saved:
        return Saved(self.tag, self.meta.get("save_id"))


CONVERTIBLE_STAGES = (1, 2)
"""ZeRO stages a checkpoint moves between through DeepSpeed's universal checkpoint. Stage 0 keeps its optimizer
state in another layout that the conversion neither reads nor writes, and loading a universal checkpoint into
stage 3 from another stage (or the reverse) fails inside DeepSpeed (0.19)."""


def check_stage_change(saved: int, stage: int, where: Path) -> None:
    """Refuse, before anything is converted or loaded, a resume across ZeRO stages that DeepSpeed cannot do."""
    if saved == stage or (saved in CONVERTIBLE_STAGES and stage in CONVERTIBLE_STAGES):
        return
    raise ValueError(
        f"{where} was saved under ZeRO stage {saved} and this run's DeepSpeed config uses stage {stage}: a checkpoint "
        f"moves between stages {CONVERTIBLE_STAGES[0]} and {CONVERTIBLE_STAGES[1]} only (DeepSpeed's universal "
        f"checkpoint), at any world size. Resume with a stage-{saved} config, or start a new run from its weights "
        f"(pre-training: `python -m pretrain.export {where} HF_DIR`, then model.init_from=HF_DIR; fine-tuning: "
        f"--init {where})")


def _resume_decision(checkpoint_dir: Path, resume: str, report: Callable[[str], None] | None
                     ) -> tuple[str, dict[str, Any]] | None:
    """(tag, marker) of the hash-verified checkpoint ``resume`` names, or None when ``auto`` finds none; ``latest``
    is repaired to name an auto-resumed tag."""
    if resume == "auto":
        tag = choose_resume_tag(checkpoint_dir, report=report)  # hash-verifies the tag it returns
        if tag is None:
            return None
        if read_latest(checkpoint_dir) != tag:  # `latest` always names a valid checkpoint
            update_latest(checkpoint_dir, tag)
        directory, hashes = checkpoint_dir, False
    else:
        try:
            (directory, tag), hashes = resolve_tag_dir(resume), True
        except CheckpointPathError as error:  # only pre-training's train.resume names a directory
            raise CheckpointPathError(f"train.resume={resume}: {error}; use auto, never, or a checkpoints/tag "
                                      "directory") from None
        if not (directory / tag).is_dir():
            saved = complete_tags(directory, hashes=False)
            raise CheckpointPathError(f"train.resume={resume}: {directory / tag} does not exist; "
                                      + (f"complete checkpoints in {directory}: {', '.join(saved)}" if saved else
                                         f"{directory} holds no complete checkpoint"))
    meta, problem = verify_tag(directory / tag, hashes=hashes)
    if meta is None:
        raise FileNotFoundError(f"{directory / tag} is not a complete checkpoint: {problem}")
    return tag, meta


def find_resume_point(checkpoint_dir: Path, resume: str, identity: dict[str, Any], world_size: int,
                      zero_stage: int, report: Callable[[str], None] | None = None,
                      restart: str = PRETRAINING_RESTART) -> ResumePoint | None:
    """The checkpoint to resume (a collective: rank 0 reads and hash-verifies it, once, and every other rank checks
    that it sees the same save, by its marker).

    ``resume``: ``auto`` (`choose_resume_tag`'s checkpoint of ``checkpoint_dir``, ``latest`` repaired to name
    it; ``report(line)`` hears which tags were skipped and why), ``never``, or a tag directory. The choice is
    checked against ``identity`` (`check_compatible`) and converted to a universal checkpoint when the world
    size or the ZeRO stage changed (rank 0 converts, the others wait); a stage change DeepSpeed cannot make is
    refused (`check_stage_change`).
    """
    if resume == "never":
        return None
    rank = torch_dist.get_rank()
    # Rank 0 reads and hashes the checkpoint files once and decides (every rank doing so would read the whole
    # checkpoint world-size times from a shared filesystem); the others take its decision and check that they see
    # the same save there.
    decision: Any = None
    if rank == 0:
        try:
            decision = _resume_decision(Path(checkpoint_dir), resume, report)
        except (ValueError, OSError) as error:
            decision = error
    decision = gather_objects(decision)[0]
    if isinstance(decision, Exception):
        raise decision
    if decision is None:
        return None
    tag, meta = decision
    directory = Path(checkpoint_dir) if resume == "auto" else resolve_tag_dir(resume)[0]  # this rank's view of it
    refusal = None
    try:  # what this rank finds stops every rank together (first_error), not this one alone
        if rank != 0:
            mine, problem = verify_tag(directory / tag, hashes=False)
            if mine is None or mine.get("save_id") != meta.get("save_id"):
                raise FileNotFoundError(
                    f"rank {rank} on {socket.gethostname()} does not see the checkpoint rank 0 resumes, "
                    f"{directory / tag}, as rank 0 does ({problem or 'another save is there'}): out_dir must be one "
                    "shared directory, at the same path, on every node")
        check_compatible(meta, identity, str(directory / tag), restart)
        check_stage_change(meta["zero_stage"], zero_stage, directory / tag)
    except (ValueError, OSError) as error:
        refusal = error
    refusal = first_error(refusal)
    if refusal is not None:
        raise refusal
    load_tag = tag
    if (meta["world_size"] != world_size or meta["zero_stage"] != zero_stage) and meta["zero_stage"] > 0:
        error = None
        if torch_dist.get_rank() == 0:
            print(f"[resume] {tag}: world size {meta['world_size']} -> {world_size}, ZeRO stage "
                  f"{meta['zero_stage']} -> {zero_stage}: converting to a universal checkpoint", flush=True)
            try:
                to_universal(directory, tag, meta.get("save_id"))
            except (OSError, subprocess.CalledProcessError) as exc:
                error = f"converting {directory / tag} to a universal checkpoint failed on rank 0: {exc}"
        error = first_error(error)  # the others wait for the conversion here
        if error is not None:
            raise RuntimeError(error)
        load_tag = f"{tag}_universal"
    return ResumePoint(directory=directory, tag=tag, load_tag=load_tag, meta=meta)


def load(engine: Any, resume: ResumePoint) -> dict[str, Any]:
    """Load ``resume`` into ``engine`` (every rank); returns the client state saved by `save`."""
    load_path, client_state = engine.load_checkpoint(str(resume.directory), tag=resume.load_tag)
    if load_path is None:
        raise RuntimeError(f"DeepSpeed could not load {resume.directory / resume.load_tag}")
    scheduler = engine.lr_scheduler
    if scheduler is not None and hasattr(scheduler, "last_batch_iteration"):
        # the optimizer comes back with the rate it last applied and DeepSpeed's schedulers with their iteration
        # only: the rate this run's schedule gives that iteration (another lr or max_steps) applies from the first
        # step on, not from the second
        scheduler.step(scheduler.last_batch_iteration)
    return client_state


def load_or_seed(engine: Any, resume: ResumePoint | None, seed: int, rank: int, world_size: int) -> dict[str, Any] | None:
    """Load ``resume`` and continue its RNG streams (returns its client state), or, for a fresh run, seed this
    rank's own dropout streams (returns None)."""
    if resume is None:
        seed_everything(seed + rank)
        return None
    state = load(engine, resume)
    resume_rng(state["rng_states"], seed, state["step"], rank, world_size)
    return state
