"""Where a build writes: the lock on ``--out``, the staging directory beside it, and the finalize step that joins
the builders' part files into shards and a manifest and puts the build in place of ``--out``.

A build is assembled beside ``--out`` (in ``.NAME.partial`` in the same parent directory) and renamed into
place when complete, so a failed or interrupted build never costs the previous one, even with ``--overwrite``.
It holds an exclusive ``flock`` on ``.NAME.lock`` beside ``--out`` from its start until the build is in place
(``OutputLock``): a second build of the same ``--out`` is refused at once, naming the first. Builders of a
split build (``--num-builders``) share that lock and each holds ``.NAME.builder-I.lock``; ``--finalize`` takes
it exclusively. Whoever takes the lock exclusively first clears what a killed build left behind.
``finalize`` joins the parts in (unit, chunk) order into shards of balanced size (their sample counts differ by
at most one) and writes ``manifest.json`` last.
"""
from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import re
import shutil
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import IO

import numpy as np

from common import locks
from common.files import sha256_file
from data_prep.config import BuildConfig
from data_prep.report import DocumentStats, nothing_kept, one_sentence_hint
from data_prep.shard_format import (
    MANIFEST_NAME,
    SHARD_GLOB,
    VOCAB_NAME,
    Objective,
    ShardArrays,
    ShardError,
    ShardFile,
    manifest_dict,
    read_manifest,
    token_dtype,
    write_json,
    write_shard,
)
from data_prep.vocab import Vocab, load_vocab

log = logging.getLogger(__name__)

PARTS_DIR = "parts"
BUILD_FILES = (MANIFEST_NAME, VOCAB_NAME, PARTS_DIR)  # with shard-*.bin: what --overwrite may replace
_LEFTOVER = re.compile(r"\.?(shard-\d+\.bin|manifest\.json|vocab\.txt)(\.tmp\d+|\.partial-\d+)")
"""a killed write's temporary file: ``common.files.write_atomically``'s ``.NAME.partial-PID``, or an older
version's ``NAME.tmpPID``"""


def staging_dir(out: Path) -> Path:
    """Where a build of ``out`` is assembled: beside it, on the same file system, so the final rename is cheap."""
    out = out.absolute()
    return out.parent / f".{out.name}.partial"


def lock_path(out: Path, builder_index: int | None = None) -> Path:
    """``.NAME.lock`` beside ``out`` (``.NAME.builder-I.lock``: builder I of a split build)."""
    out = out.absolute()
    return out.parent / (f".{out.name}.lock" if builder_index is None else f".{out.name}.builder-{builder_index}.lock")


class OutputLock:
    """The ``flock`` (``common.locks``) a build holds on ``.NAME.lock`` beside ``--out`` while it works on
    ``.NAME.partial`` and ``NAME``: exclusive for a single build and for ``--finalize``; shared by the builders of a
    split build, each of which also holds ``.NAME.builder-I.lock`` exclusively (so builder I cannot run twice at
    once). (``pretrain.checkpoint.RunLock`` locks a training run's directory the same way.)"""

    def __init__(self, out: Path, exclusive: bool, handles: list[IO[str]], stale: dict | None):
        self.out, self.exclusive, self.handles = out.absolute(), exclusive, handles
        self.stale = stale
        """the record a killed holder left, or None"""

    @classmethod
    def acquire(cls, out: Path, builder_index: int = 0, num_builders: int = 1,
                exclusive: bool | None = None) -> OutputLock:
        """Take the lock of ``out`` (exclusive unless a split build's builder) or raise ``ShardError`` naming
        the build that holds it."""
        exclusive = num_builders == 1 if exclusive is None else exclusive
        handles = [locks.open_lock(lock_path(out))]
        try:
            if not _try_lock(handles[0], lock_path(out), shared=not exclusive):
                raise ShardError(f"--out {out}: another build of it is running ({_holders(out, handles[0])}); "
                                 "wait for it to end or stop it, or choose another --out")
            if not exclusive:
                handles.append(locks.open_lock(lock_path(out, builder_index)))
                if not _try_lock(handles[1], lock_path(out, builder_index)):
                    raise ShardError(f"--out {out}: builder {builder_index} of it is already running "
                                     f"({locks.holder_text(locks.read_holder(handles[1]), held=True)}); wait for it "
                                     "to end or stop it")
        except BaseException:
            for handle in handles:
                handle.close()
            raise
        stale = locks.record_holder(handles[-1])
        return cls(out, exclusive, handles, stale or None)

    def release(self) -> None:
        """Empty the record (a clean end) and drop the lock."""
        for handle in reversed(self.handles):
            locks.release(handle)


def _try_lock(handle: IO[str], path: Path, shared: bool = False) -> bool:
    """Whether the lock was taken (False: another process holds it); a filesystem without locks is an error."""
    try:
        return locks.try_lock(handle, shared)
    except OSError as err:
        if locks.cannot_lock(err):
            raise ShardError(f"{path}: cannot lock it ({err}), and without the lock two builds of one --out could "
                             f"mix their files; put --out on {locks.NO_LOCKS_HINT}") from None
        raise


def _holders(out: Path, main: IO[str]) -> str:
    """Who holds the lock of ``out``: the running builders of a split build, else the exclusive holder."""
    builders = []
    for path in sorted(lock_path(out).parent.glob(f".{out.absolute().name}.builder-*.lock")):
        with locks.open_lock(path) as handle:
            try:
                if not locks.try_lock(handle, shared=True):  # taken only where no builder holds it
                    builders.append(locks.holder_text(locks.read_holder(handle), held=True))
            except OSError:
                continue
    if builders:
        return f"builders of a split build: {'; '.join(builders)}"
    return locks.holder_text(locks.read_holder(main), held=True)


@contextlib.contextmanager
def claim_output(out: Path, builder_index: int = 0, num_builders: int = 1,
                 exclusive: bool | None = None) -> Iterator[OutputLock]:
    """Hold the lock of ``out`` (``OutputLock``) for the ``with`` block. An exclusive holder first removes what a
    killed build left: ``.NAME.previous-PID`` (moved back to ``NAME`` if the kill fell between the two renames of
    ``install_build``, when ``NAME`` is missing) and temporary files in ``.NAME.partial``."""
    lock = OutputLock.acquire(out, builder_index, num_builders, exclusive)
    try:
        if lock.stale:
            log.warning(f"[build] --out {out}: the previous build ({locks.holder_text(lock.stale)}) ended without "
                        f"finishing (killed or crashed){'; clearing what it left' if lock.exclusive else ''}")
        if lock.exclusive:
            _clear_leftovers(out)
        yield lock
    finally:
        lock.release()


def _clear_leftovers(out: Path) -> None:
    out = out.absolute()
    for previous in sorted(out.parent.glob(f".{out.name}.previous-*")):
        if not out.exists():
            os.rename(previous, out)
            log.warning(f"[build] {out}: restored the previous build from {previous.name} (a build was killed while "
                        "putting its output in place)")
        else:
            shutil.rmtree(previous)
    staging = staging_dir(out)
    if staging.is_dir():
        for leftover in staging.iterdir():
            if _LEFTOVER.fullmatch(leftover.name):
                leftover.unlink()


def holding(out: Path, lock: OutputLock | None, builder_index: int, num_builders: int,
             exclusive: bool | None = None) -> contextlib.AbstractContextManager:
    """The caller's lock (checked to be of ``out``), or a new one held for the ``with`` block."""
    if lock is None:
        return claim_output(out, builder_index, num_builders, exclusive)
    if lock.out != out.absolute() or (exclusive and not lock.exclusive):
        raise ValueError(f"{out}: the lock passed is {'exclusive' if lock.exclusive else 'shared'} on {lock.out}; "
                         f"this needs {'an exclusive' if exclusive else 'a'} lock on {out.absolute()}")
    return contextlib.nullcontext(lock)


def part_path(staging: Path, unit: int, chunk_index: int) -> Path:
    return staging / PARTS_DIR / f"unit-{unit:06d}-chunk-{chunk_index:07d}.bin"


def builder_path(staging: Path, builder_index: int, num_builders: int) -> Path:
    return staging / PARTS_DIR / f"builder-{builder_index}-of-{num_builders}.json"


def check_build_output(out: Path, vocab: Vocab, overwrite: bool) -> None:
    """Refuse an ``--out`` that holds another build (unless --overwrite) or anything that is not a build.

    Nothing is deleted here: the new build replaces ``out`` only once it is complete (``install_build``).
    """
    hint = "choose an empty --out directory, or pass --overwrite to replace it"
    if not out.exists():
        return
    if not out.is_dir():
        raise ShardError(f"--out {out} is a file, not a directory")
    foreign = sorted(p.name for p in out.iterdir() if p.name not in BUILD_FILES and not p.match(SHARD_GLOB)
                     and not _LEFTOVER.fullmatch(p.name))
    if foreign:
        raise ShardError(f"--out {out} holds files that are not part of a shard build ({', '.join(foreign[:5])}); "
                         "choose a new or empty --out directory (a build replaces the whole directory)")
    if overwrite:
        return
    if (out / MANIFEST_NAME).exists():
        try:
            existing = read_manifest(out)
        except ShardError as err:
            raise ShardError(f"--out {out} holds a build this version cannot use ({err}); {hint}") from None
        if existing["vocab"]["sha256"] != vocab.sha256:
            raise ShardError(f"--out {out} holds shards built with another vocab "
                             f"(sha256 {existing['vocab']['sha256'][:12]}…, now {vocab.sha256[:12]}…); {hint}")
        raise ShardError(f"--out {out} already holds a finished build; {hint}")
    for shard in sorted(out.glob(SHARD_GLOB)):
        ShardFile(shard)  # names the file if it is of another format version
        raise ShardError(f"--out {out} holds shard files ({shard.name}) but no manifest; {hint}")


def prepare_staging(staging: Path, cfg: BuildConfig, num_builders: int) -> None:
    """Empty the staging directory of everything but the vocab; with several builders, parts of this very
    build (same settings, same ``--num-builders``) stay (another builder wrote them) and only what ``finalize``
    writes goes."""
    parts = staging / PARTS_DIR
    if parts.is_dir():
        records = [json.loads(b.read_text()) for b in parts.glob("builder-*.json")]
        ours = all(r["fingerprint"] == cfg.fingerprint and r["num_builders"] == num_builders for r in records)
        if num_builders == 1 or not ours:
            shutil.rmtree(parts)
    if staging.is_dir():
        for stale in staging.iterdir():
            if num_builders == 1 and stale.name not in (VOCAB_NAME, PARTS_DIR) or stale.name == MANIFEST_NAME \
                    or stale.match(SHARD_GLOB):
                shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
    parts.mkdir(parents=True, exist_ok=True)


def install_build(staging: Path, out: Path) -> None:
    """Move the finished build in ``staging`` to ``out``; a previous build there is deleted only afterwards."""
    if not out.exists():
        os.rename(staging, out)
        return
    previous = out.parent / f".{out.name}.previous-{os.getpid()}"
    os.rename(out, previous)  # between these two renames the old build still exists, as `previous`
    os.rename(staging, out)
    shutil.rmtree(previous)




def finalize(out: Path, lock: OutputLock | None = None) -> dict:
    """Join all builders' parts into balanced shards, write the manifest, then put the build in place of ``out``,
    holding ``lock`` (an exclusive one; taken here when None). Returns the manifest.
    """
    with holding(out, lock, 0, 1, exclusive=True):
        return _finalize(out)


def _finalize(out: Path) -> dict:
    staging = staging_dir(out)
    for stale in [*staging.glob(SHARD_GLOB), staging / MANIFEST_NAME]:  # of a finalize that was killed
        stale.unlink(missing_ok=True)
    records, cfg, parts = _builder_results(out, staging)
    opened = [ShardFile(p) for p in parts]
    vocab = load_vocab(staging / VOCAB_NAME)
    if vocab.sha256 != cfg.vocab_sha256:
        raise ShardError(f"{staging / VOCAB_NAME}: differs from the vocab the parts were built with")
    dtype = token_dtype(vocab.size)
    stats = DocumentStats()
    for r in records:
        stats.add(DocumentStats(**r["documents"]))
    total = sum(len(p) for p in opened)
    if total == 0:
        raise ShardError(nothing_kept("samples", cfg.inputs, stats)
                         + one_sentence_hint(asdict(stats), set(cfg.sentence_inputs) == set(cfg.inputs)))
    shard_entries, objective_counts, random_next, num_tokens = _write_shards(staging, opened, cfg, dtype)
    manifest = manifest_dict(
        recipe=cfg.instances.recipe,
        objective_mix={o.key: p for o, p in cfg.instances.mix.items()},
        max_seq_len=cfg.instances.max_seq_len,
        short_seq_prob=cfg.instances.short_seq_prob,
        seed=cfg.seed,
        dupe_factor=cfg.dupe_factor,
        masking=asdict(cfg.masking) if cfg.instances.masked else None,
        vocab={"file": VOCAB_NAME, "sha256": vocab.sha256, "size": vocab.size, "uncased": cfg.uncased,
               "special_tokens": vocab.special_ids},
        token_dtype=dtype.name,
        inputs=list(cfg.inputs),
        reading={"text_field": cfg.text_field, "rows_as_sentences": list(cfg.sentence_inputs),
                 "rows_per_document": cfg.rows_per_document, "txt_documents": cfg.txt_documents},
        chunk_chars=cfg.chunk_chars,
        num_samples=total,
        num_tokens=num_tokens,
        objective_counts={o.key: objective_counts.get(int(o), 0) for o in Objective},
        nsp_counts={"random_next": random_next.get(1, 0), "true_next": random_next.get(0, 0)},
        documents={"read": stats.read, "skipped": stats.skipped,
                   "skip_reasons": dict(sorted(stats.skip_reasons.items())),
                   "skip_examples": dict(sorted(stats.skip_examples.items())), "characters": stats.characters,
                   "skip_characters": dict(sorted(stats.skip_characters.items())),
                   "repaired_lines": stats.repaired_lines, "repair_examples": stats.repair_examples},
        wordpieces={"total": stats.wordpieces, "unk": stats.unk_wordpieces},
        shards=shard_entries,
    )
    write_json(staging / MANIFEST_NAME, manifest)
    del opened
    shutil.rmtree(staging / PARTS_DIR)
    install_build(staging, out)
    return manifest


def _builder_results(out: Path, staging: Path) -> tuple[list[dict], BuildConfig, list[Path]]:
    """(every builder's result record, the build config they share, the part files in unit order), refusing
    builders of other settings, missing builders, uncovered units and missing part files by name."""
    builders = sorted((staging / PARTS_DIR).glob("builder-*-of-*.json"))
    if not builders:
        raise ShardError(f"--finalize {out}: no builder results in {staging / PARTS_DIR}; run the builders first")
    records = [json.loads(p.read_text()) for p in builders]
    num_builders = records[0]["num_builders"]
    if {r["fingerprint"] for r in records} != {records[0]["fingerprint"]} or \
            {r["num_builders"] for r in records} != {num_builders}:
        raise ShardError(f"--finalize {out}: builder results come from different settings or --num-builders; "
                         "rerun all builders with the same arguments")
    missing = sorted(set(range(num_builders)) - {r["builder_index"] for r in records})
    if missing:
        raise ShardError(f"--finalize {out}: builder(s) {missing} of {num_builders} have not finished")
    cfg = BuildConfig.from_json(records[0]["config"])
    unit_chunks = {int(u): n for r in records for u, n in r["unit_chunks"].items()}
    if sorted(unit_chunks) != list(range(records[0]["num_units"])):
        raise ShardError(f"--finalize {out}: the builders did not cover every input unit; rerun the builders")
    parts = [part_path(staging, u, c) for u in sorted(unit_chunks) for c in range(unit_chunks[u])]
    absent = [p.name for p in parts if not p.exists()]
    if absent:
        raise ShardError(f"--finalize {out}: part files missing ({absent[:5]}); rerun the builders")
    return records, cfg, parts


def _write_shards(staging: Path, opened: list[ShardFile], cfg: BuildConfig, dtype: np.dtype
                  ) -> tuple[list[dict], collections.Counter, collections.Counter, int]:
    """The parts' samples, in order, as ``ceil(total / samples_per_shard)`` shards of near-equal size in
    ``staging``: (their manifest entries, samples per objective, per is_random_next, tokens)."""
    ends = np.cumsum([len(p) for p in opened], dtype=np.int64)
    total = int(ends[-1])
    num_shards = -(-total // cfg.samples_per_shard)
    shard_entries: list[dict] = []
    objective_counts: collections.Counter = collections.Counter()
    random_next: collections.Counter = collections.Counter()
    num_tokens = 0
    for shard in range(num_shards):
        start, stop = total * shard // num_shards, total * (shard + 1) // num_shards
        pieces = []
        for part_index in range(int(np.searchsorted(ends, start, "right")), len(opened)):
            part_start = int(ends[part_index - 1]) if part_index else 0
            if part_start >= stop:
                break
            pieces.append(opened[part_index].arrays.select(max(start - part_start, 0),
                                                           min(stop, int(ends[part_index])) - part_start))
        arrays = ShardArrays.concatenate(pieces, dtype)
        path = staging / f"shard-{shard:05d}.bin"
        write_shard(path, arrays)
        objective_counts.update(arrays.index["objective"].tolist())
        random_next.update(arrays.index["is_random_next"].tolist())
        num_tokens += len(arrays.tokens)
        shard_entries.append({"file": path.name, "num_samples": len(arrays), "bytes": path.stat().st_size,
                              "sha256": sha256_file(path)})
    return shard_entries, objective_counts, random_next, num_tokens

