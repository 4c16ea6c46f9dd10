"""Which checkpoint a run resumes, and whether it may: the choice of auto-resume, the hash-verified resume point
checked against this run (model, data, seed, ZeRO stage), loading it, and the lock that keeps one run per
directory.

Which checkpoint auto-resume takes (``choose_resume_tag``): the one ``latest`` names, when valid — or a valid
checkpoint saved right after it whose ``latest`` update a crash cut off (its marker names ``latest``'s save as
its parent). If ``latest`` is missing or invalid: the newest valid checkpoint. Valid checkpoints newer than the
one chosen belong to an abandoned history (a run rolled back with ``train.resume=DIR/TAG``): they are named,
kept, and never picked silently; auto-resume says which tag it skips and why.

One procedure serves pre-training and fine-tuning: `find_resume_point` (``choose_resume_tag``'s checkpoint,
hash-verified and checked against this run; converted to a universal checkpoint, ``pretrain.convert``, when the
world size or ZeRO stage changed) and `load_or_seed`. RNG capture and restore are ``pretrain.rng``'s.
"""
from __future__ import annotations

import dataclasses
import logging
import socket
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as torch_dist

from common import locks
from pretrain.checkpoint import (
    LATEST,
    CheckpointMismatchError,
    CheckpointPathError,
    Saved,
    all_tags,
    complete_tags,
    read_latest,
    read_marker,
    resolve_tag_dir,
    tag_step,
    update_latest,
    verify_tag,
)
from pretrain.convert import to_universal
from pretrain.distributed import RunStopped, first_error, gather_objects
from pretrain.model import RETIRED_FIELDS
from pretrain.rng import resume_rng, seed_everything

log = logging.getLogger(__name__)


def choose_resume_tag(checkpoint_dir: Path, report: Any = None) -> str | None:
    """The checkpoint auto-resume continues from (the rule is in the module docstring), or None.

    ``report(line)`` is told which tags were skipped and why, and which valid newer tags are left alone."""
    say = report or (lambda line: None)
    tags = all_tags(checkpoint_dir)
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
    if latest is not None and latest_meta is not None:
        chosen = latest
        # a save whose marker was written but whose `latest` update a crash cut off continues latest's history
        for tag in reversed(tags):
            if tag_step(tag) <= tag_step(latest):
                break
            meta = valid(tag)
            parent = meta.get("parent_save_id", latest_meta.get("save_id")) if meta is not None else None
            if meta is not None and parent == latest_meta.get("save_id"):
                chosen = tag
                break
    else:
        chosen = next((tag for tag in reversed(tags) if valid(tag) is not None), None)
    if chosen is not None:
        abandoned = [t for t in tags if tag_step(t) > tag_step(chosen) and t not in skipped
                     and read_marker(checkpoint_dir / t, hashes=False) is not None]
        if abandoned:
            say(f"[resume] not resuming {', '.join(abandoned)} in {checkpoint_dir}: newer than {chosen} but not "
                f"its continuation (`{LATEST}` names {latest}); they come from an abandoned run history and are "
                "kept (resume one explicitly with train.resume=DIR/TAG, or delete them)")
    return chosen



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
    def acquire(cls, out_dir: str | Path, report: Callable[[str], None] = log.warning) -> RunLock:
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


WHEN_TO_STOP = ("exit_at_step", "exit_after_minutes", "resume", "save_interval", "keep_last", "verify",
                "on_world_change", "collective_timeout_s")
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


def report_changed_settings(resume: ResumePoint | None, current: dict[str, Any], report: Any) -> None:
    """Say which settings differ from those the resumed checkpoint was saved under: the run continues with the
    new ones (the learning-rate schedule, say, from this step on)."""
    if resume is None:
        return
    saved = resume.meta.get("run_config") or {}
    changes = changed_settings(saved, current) if saved else []
    if changes:
        report(f"[resume] settings changed since {resume.tag}, the run continues with the new ones from step "
               f"{resume.meta.get('step')}: {'; '.join(changes)}")



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
                      restart: str = PRETRAINING_RESTART,
                      check_world: Callable[[int], Any] | None = None) -> ResumePoint | None:
    """The checkpoint to resume (a collective: rank 0 reads and hash-verifies it, once, and every other rank checks
    that it sees the same save, by its marker).

    ``resume``: ``auto`` (`choose_resume_tag`'s checkpoint of ``checkpoint_dir``, ``latest`` repaired to name
    it; ``report(line)`` hears which tags were skipped and why), ``never``, or a tag directory. The choice is
    checked against ``identity`` (`check_compatible`) and converted to a universal checkpoint when the world
    size or the ZeRO stage changed (rank 0 converts, the others wait); a stage change DeepSpeed cannot make is
    refused (`check_stage_change`). ``check_world(saved world size)``, called before converting when the world size
    changed, refuses the change by raising a ValueError (pre-training's ``train.on_world_change``).
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
        if check_world is not None and meta["world_size"] != world_size:
            check_world(meta["world_size"])
    except (ValueError, OSError) as problem_found:
        refusal = problem_found
    refusal = first_error(refusal)
    if refusal is not None:
        raise refusal
    load_tag = tag
    if (meta["world_size"] != world_size or meta["zero_stage"] != zero_stage) and meta["zero_stage"] > 0:
        failure = None
        if torch_dist.get_rank() == 0:
            log.info(f"[resume] {tag}: world size {meta['world_size']} -> {world_size}, ZeRO stage "
                     f"{meta['zero_stage']} -> {zero_stage}: converting to a universal checkpoint")
            try:
                to_universal(directory, tag, meta.get("save_id"))
            except (OSError, subprocess.CalledProcessError) as exc:
                failure = f"converting {directory / tag} to a universal checkpoint failed on rank 0: {exc}"
        failure = first_error(failure)  # the others wait for the conversion here
        if failure is not None:
            raise RuntimeError(failure)
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


def load_or_seed(engine: Any, resume: ResumePoint | None, seed: int, rank: int,
                 world_size: int) -> dict[str, Any] | None:
    """Load ``resume`` and continue its RNG streams (returns its client state), or, for a fresh run, seed this
    rank's own dropout streams (returns None)."""
    if resume is None:
        seed_everything(seed + rank)
        return None
    state = load(engine, resume)
    resume_rng(state["rng_states"], seed, state["step"], rank, world_size)
    return state
