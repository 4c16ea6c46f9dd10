"""Saving a checkpoint and telling a complete one from the rest: DeepSpeed's files plus the fp32 weights, fsync'ed,
vouched for by a marker that hashes every file, ``latest`` moved, old ones pruned; `verify_tag` checks them.

Layout of ``out_dir/checkpoints/``::

    global_step{N}/               DeepSpeed's files for step N (model states, per-rank ZeRO optimizer shards)
    global_step{N}/complete.json  our marker: written by rank 0 after every rank saved and passed a barrier;
                                  lists every file with its size and sha256, plus the run metadata (format
                                  version, step, consumed_samples, world size, ZeRO stage, model config, run
                                  config, manifest and vocab hashes, code version)
    global_step{N}_universal/     DeepSpeed universal checkpoint, made on demand when the world size changes
                                  (``pretrain.convert``)
    global_step{N}/model_weights.safetensors
                                  the module's full fp32 weights (gathered from every ZeRO partition), read
                                  outside a resume (with the moments below): exports, fine-tuning's
                                  ``--init`` and a new run's ``model.init_from`` load it after the
                                  marker's hashes check out, and never unpickle anything
    global_step{N}/adam_moments.safetensors
                                  every parameter's Adam moments (fp32, by name) and the step count
                                  (``pretrain.moments``; ZeRO 0-2 except ZeRO-0 fp16): what a new run's
                                  ``train.init_optimizer`` takes over
    latest                        tag of the checkpoint to resume; we write it atomically after the marker
                                  (DeepSpeed's own ``latest`` update is switched off)
    out_dir/run.lock              held (``flock``) by the run's rank 0 while it runs: pid, host, start time
                                  (``pretrain.resume.RunLock``)

One validity test, ``verify_tag`` (every file's size and sha256 against the marker), decides resume, ``latest``
and pruning. A tag without a valid marker (a rank died mid-save, a file was truncated or its bytes changed after
the save) is never resumed from, exported or loaded. Which checkpoint a run resumes is ``pretrain.resume``'s.
Pruning (``prune``) keeps the checkpoint just written, everything newer than it, and the ``keep_last - 1`` newest
valid ones before it; it deletes only older ones.

Every file, the marker and ``latest`` are fsync'ed (with their directories) before the next step counts on them,
so a power loss leaves either a complete checkpoint or one that is detected and skipped.

DeepSpeed does not save RNG states: ``client_state["rng_states"]`` holds every rank's torch, numpy and Python
states and, on GPUs, the CUDA generator of the rank's device (gathered, ``pretrain.rng``), so resuming on the same
world size continues every rank's dropout stream (on CPUs: reproduces the uninterrupted losses bit for bit).

One procedure serves pre-training and fine-tuning: `save` (stale marker removed, DeepSpeed's files and the
safetensors weights, fsync, marker, ``latest``, prune; a full disk becomes `CheckpointWriteError`).
"""
from __future__ import annotations

import dataclasses
import errno
import json
import logging
import re
import shutil
import subprocess
import time
import uuid
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
import torch.distributed as torch_dist
from deepspeed.utils import safe_get_full_fp32_param
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from common.files import PARTIAL_MARK, fsync_tree, sha256_file, write_atomically, write_text_atomically
from pretrain.distributed import RunStopped, first_error, gather_objects
from pretrain.moments import gather_moments, write_moments
from pretrain.rng import portable_rng_state

log = logging.getLogger(__name__)

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
    """The N of a ``global_stepN`` tag; None for any other name."""
    match = _TAG.match(tag)
    return int(match.group(1)) if match else None


def tag_step(tag: str) -> int:
    """The step of a name already known to be a tag (listed by `all_tags`, or read by `read_latest`)."""
    step = step_of_tag(tag)
    if step is None:
        raise CheckpointPathError(f"{tag!r} is not a checkpoint tag (global_stepN)")
    return step


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
    latest = read_latest(path) if (path / LATEST).is_file() else None
    if latest is not None:
        directory, tag = path, latest
    else:
        directory, tag = path.parent, path.name
        if step_of_tag(tag) is None:
            raise CheckpointPathError(f"{path} is neither a checkpoints directory (with {LATEST}) nor a tag "
                                      "directory (global_stepN)")
    if (directory / tag).resolve().parent != directory.resolve():
        raise CheckpointPathError(f"{directory / tag} resolves to {(directory / tag).resolve()}, outside "
                                  f"{directory}; refusing it")
    return directory, tag


def all_tags(checkpoint_dir: Path) -> list[str]:
    if not checkpoint_dir.is_dir():
        return []
    return sorted((p.name for p in checkpoint_dir.iterdir() if p.is_dir() and step_of_tag(p.name) is not None),
                  key=tag_step)


def complete_tags(checkpoint_dir: Path, hashes: bool = True) -> list[str]:
    """Valid tags (``verify_tag``), oldest first."""
    return [t for t in all_tags(checkpoint_dir) if read_marker(checkpoint_dir / t, hashes) is not None]


def newest_complete_tag(checkpoint_dir: Path, hashes: bool = True, report: Any = None) -> str | None:
    """The newest valid tag; ``report(line)`` is told which newer tags were skipped and why."""
    for tag in reversed(all_tags(checkpoint_dir)):
        _, problem = verify_tag(checkpoint_dir / tag, hashes)
        if problem is None:
            return tag
        if report is not None:
            report(f"[resume] skipping {checkpoint_dir / tag}: {problem}")
    return None



def prune(checkpoint_dir: Path, keep_last: int, just_written: str | None = None) -> list[str]:
    """Delete old checkpoints and return their tags, oldest first.

    Kept: ``just_written`` (default: the newest valid tag), every tag newer than it (a valid one may be the
    abandoned history a rolled-back run keeps; an invalid one may be a save in progress), and the
    ``keep_last - 1`` newest valid tags older than it. Deleted: every other older tag, valid or not."""
    tags = all_tags(checkpoint_dir)
    anchor = just_written or newest_complete_tag(checkpoint_dir)
    if anchor is None:
        return []
    kept_before = 0
    doomed = []
    for tag in reversed([t for t in tags if tag_step(t) < tag_step(anchor)]):
        if kept_before < keep_last - 1 and read_marker(checkpoint_dir / tag) is not None:
            kept_before += 1
        else:
            doomed.append(tag)
    for tag in doomed:
        shutil.rmtree(checkpoint_dir / tag, ignore_errors=True)
        shutil.rmtree(checkpoint_dir / f"{tag}_universal", ignore_errors=True)
    return sorted(doomed, key=tag_step)


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
            gathered = safe_get_full_fp32_param(parameter) if parameter.requires_grad else None
            master = parameter.detach() if gathered is None else gathered
            full[id(parameter)] = master.detach().float().cpu().clone() if keep else None
        kept = full[id(parameter)]
        if kept is not None:
            state[name] = kept
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
        moments = gather_moments(engine, keep=rank == 0)  # collective under ZeRO
        if rank == 0:
            write_weights(tag_dir, weights)
            if moments is not None:
                write_moments(tag_dir, moments)
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
        log.info(f"[save] {tag_dir} in {time.monotonic() - began:.1f} s")
    return saved
