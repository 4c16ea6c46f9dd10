"""Build packed training shards from raw corpora: ``python -m data_prep.build --input ... --out DIR``.

Pipeline: every ``--input`` is split into units (a file, or a shard of a Hugging Face dataset:
``data_prep.sources.input_units``); each unit's documents are streamed and grouped into chunks of about
``--chunk-chars`` characters (a chunk boundary depends only on the input, never on workers). In a worker
process each chunk is cleaned (Wikipedia markup too), sentence-split, batch-encoded with ``tokenizers``,
turned into instances (``data_prep.instances``) and masked, with randomness seeded by (seed, unit, document
index in the unit); it is written as a part file in the shard format. ``finalize`` joins the parts in
(unit, chunk) order into shards of balanced size (their sample counts differ by at most one) and writes
``manifest.json`` last. Hence the output is byte-identical for any ``--workers`` and any ``--num-builders``
split: builder i of K reads only units i, i+K, …, and ``--finalize`` (run once after all builders)
assembles the shards. Memory is bounded by a few chunks.

A build is assembled beside ``--out`` (in ``.NAME.partial`` in the same parent directory) and renamed into
place when complete, so a failed or interrupted build never costs the previous one, even with ``--overwrite``.
"""
from __future__ import annotations

import argparse
import collections
import functools
import hashlib
import json
import multiprocessing
import os
import shutil
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
from tqdm import tqdm

from data_prep.instances import (RECIPES, Instance, InstanceConfig, MaskingConfig, Uniforms, default_max_predictions,
                                 document_instances, masking_budget, mask_samples, parse_objective_mix)
from data_prep.shard_format import (INDEX_DTYPE, MANIFEST_NAME, SHARD_GLOB, VOCAB_NAME, Objective,
                                    ShardArrays, ShardError, ShardFile, manifest_dict, read_manifest,
                                    sha256_file, token_dtype, write_json, write_shard)
from data_prep.sources import (ROWS_PER_DOCUMENT, TEXT_FIELD, UNIT_BYTES, ReadOptions, Skipped, Unit, check_input,
                               document_text, input_units, read_documents, read_unit)
from data_prep.text import clean_document, split_sentences
from data_prep.vocab import (Vocab, VocabError, load_encoder, load_vocab, resolve_casing, resolve_vocab_source,
                             train_vocab)

PARTS_DIR = "parts"
SKIP_EXAMPLES = 3
SKIP_WARNING_FRACTION = 0.05
EXPECTED_SKIPS = ("wiki_redirect", "wiki_not_an_article")  # a dump's redirects are not documents; no warning
BUILD_FILES = (MANIFEST_NAME, VOCAB_NAME, PARTS_DIR)  # with shard-*.bin: what --overwrite may replace


@dataclass(frozen=True)
class BuildConfig:
    """Everything that determines the bytes of a build (recorded in the manifest)."""

    inputs: tuple[str, ...]
    vocab_path: str
    vocab_sha256: str
    uncased: bool = False
    instances: InstanceConfig = field(default_factory=InstanceConfig)
    masking: MaskingConfig = field(default_factory=MaskingConfig)
    seed: int = 1
    dupe_factor: int = 1
    """differently-masked copies of every instance"""
    samples_per_shard: int = 65536
    """upper bound; shards are balanced, so actual sizes are total / ceil(total / this)"""
    chunk_chars: int = 500_000
    """documents are processed in chunks of about this many characters (part of the output's identity)"""
    text_field: str = TEXT_FIELD
    """the field (column) of JSON / parquet / dataset records that holds the text"""
    sentence_inputs: tuple[str, ...] = ()
    """inputs whose rows are sentences: consecutive rows form documents of ``rows_per_document`` rows"""
    rows_per_document: int = ROWS_PER_DOCUMENT
    unit_bytes: int = UNIT_BYTES
    """a .jsonl file larger than this is split into byte ranges that different builders read"""

    def __post_init__(self) -> None:
        if not self.inputs:
            raise ValueError("no --input given")
        strays = [s for s in self.sentence_inputs if s not in self.inputs]
        if strays:
            raise ValueError(f"--rows-as-sentences {' '.join(strays)}: not among the --input sources; name inputs "
                             "exactly as given to --input, or give the flag alone to apply it to every input")
        self.read_options(self.inputs[0])  # validates text_field and rows_per_document
        if self.dupe_factor < 1:
            raise ValueError(f"--dupe-factor {self.dupe_factor} must be at least 1")
        if self.dupe_factor > 1 and not self.instances.masked:
            raise ValueError("--dupe-factor applies to masked recipes; gpt has no masking, copies would be identical")
        if self.samples_per_shard < 1 or self.chunk_chars < 1 or self.unit_bytes < 1:
            raise ValueError("--samples-per-shard, --chunk-chars and unit_bytes must be positive")

    def read_options(self, spec: str) -> ReadOptions:
        return ReadOptions(self.text_field, spec in self.sentence_inputs, self.rows_per_document)

    def to_json(self) -> dict:
        return json.loads(json.dumps(asdict(self)))

    @property
    def fingerprint(self) -> str:
        """Identity of the output; the vocab counts by content, so builders may keep it at different paths."""
        identity = {k: v for k, v in self.to_json().items() if k != "vocab_path"}
        return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()

    @staticmethod
    def from_json(payload: dict) -> "BuildConfig":
        payload = dict(payload)
        masking = dict(payload.pop("masking"))
        masking["span_length_probs"] = tuple(masking["span_length_probs"])
        return BuildConfig(inputs=tuple(payload.pop("inputs")), instances=InstanceConfig(**payload.pop("instances")),
                           sentence_inputs=tuple(payload.pop("sentence_inputs")), masking=MaskingConfig(**masking),
                           **payload)


@dataclass
class DocumentStats:
    """Per-build document accounting: nothing is dropped without a counted reason."""

    read: int = 0
    skipped: int = 0
    skip_reasons: dict[str, int] = field(default_factory=dict)
    skip_examples: dict[str, list[str]] = field(default_factory=dict)

    def skip(self, reason: str, where: str) -> None:
        self.skipped += 1
        self.skip_reasons[reason] = self.skip_reasons.get(reason, 0) + 1
        examples = self.skip_examples.setdefault(reason, [])
        if len(examples) < SKIP_EXAMPLES:
            examples.append(where)

    def add(self, other: "DocumentStats") -> None:
        self.read += other.read
        for reason, count in sorted(other.skip_reasons.items()):
            self.skipped += count
            self.skip_reasons[reason] = self.skip_reasons.get(reason, 0) + count
            examples = self.skip_examples.setdefault(reason, [])
            examples.extend(other.skip_examples.get(reason, [])[: SKIP_EXAMPLES - len(examples)])


@dataclass(frozen=True)
class Chunk:
    """Consecutive records of one unit; ``first_document`` is the index of ``records[0]`` within the unit."""

    unit: int
    index: int
    first_document: int
    records: list[tuple[str | Skipped, str]]  # (document or skip, where)


def iter_chunks(unit_index: int, unit: Unit, options: ReadOptions, chunk_chars: int) -> Iterator[Chunk]:
    """Stream one unit as chunks of about ``chunk_chars`` characters (raw; Wikipedia markup counts) and at least
    one chunk; only the input decides boundaries."""
    records: list[tuple[str | Skipped, str]] = []
    chars, index, first = 0, 0, 0
    for number, record in enumerate(read_unit(unit, options)):
        records.append((record, record.where if isinstance(record, Skipped) else f"{unit} document {number}"))
        chars += len(record) if isinstance(record, str) else 0
        if chars >= chunk_chars:
            yield Chunk(unit_index, index, first, records)
            index, first, records, chars = index + 1, first + len(records), [], 0
    if records or index == 0:
        yield Chunk(unit_index, index, first, records)


def build_units(cfg: BuildConfig) -> list[tuple[Unit, ReadOptions]]:
    """Every unit of every input, in input order, with the way its records become documents."""
    return [(unit, cfg.read_options(spec)) for spec in cfg.inputs for unit in input_units(spec, cfg.unit_bytes)]


class _OtherDocuments:
    """The documents of a chunk except one: candidates for an NSP random B, without copying the list."""

    def __init__(self, documents: list[list[list[int]]], own: int):
        self.documents, self.own = documents, own

    def __len__(self) -> int:
        return len(self.documents) - 1

    def __getitem__(self, i: int) -> list[list[int]]:
        return self.documents[i + (i >= self.own)]


@functools.lru_cache(maxsize=4)  # validated once per worker process, not once per chunk
def _cached_vocab(path: str, sha256: str) -> tuple[Vocab, np.ndarray]:
    """The vocab and its non-special ids (candidates for the 10% random replacement)."""
    vocab = load_vocab(path)
    if vocab.sha256 != sha256:
        raise VocabError(f"vocab {path} changed while building (sha256 {vocab.sha256[:12]}…, expected {sha256[:12]}…)")
    return vocab, np.setdiff1d(np.arange(vocab.size), np.array(sorted(vocab.special_ids.values())))


def process_chunk(cfg: BuildConfig, chunk: Chunk, out_path: Path) -> tuple[DocumentStats, int]:
    """Chunk → part file in shard format. Returns its document stats and sample count."""
    stats = DocumentStats(read=len(chunk.records))
    vocab, random_ids = _cached_vocab(cfg.vocab_path, cfg.vocab_sha256)
    tokenizer = load_encoder(cfg.vocab_path, vocab.sha256, cfg.uncased)
    kept: list[tuple[int, str, list[str]]] = []  # (document index, where, sentences)
    for offset, (record, where) in enumerate(chunk.records):
        if isinstance(record, Skipped):
            stats.skip(record.reason, where)
            continue
        text = clean_document(document_text(record))  # Wikipedia clean-up happens here, in the worker
        if not text:
            stats.skip("empty", where)
            continue
        sentences = split_sentences(text)
        if len(sentences) < cfg.instances.min_sentences:
            stats.skip("too_few_sentences", where)
            continue
        kept.append((chunk.first_document + offset, where, sentences))

    # encode_batch_fast: same ids as encode_batch without tracking character offsets, ~15% less work
    encodings = tokenizer.encode_batch_fast([s for _, _, sentences in kept for s in sentences],
                                            add_special_tokens=False)
    kept_documents: list[list[list[int]]] = []
    kept_indices: list[int] = []
    cursor = 0
    for doc_index, where, sentences in kept:
        ids = [e.ids for e in encodings[cursor:cursor + len(sentences)]]
        cursor += len(sentences)
        ids = [s for s in ids if s]  # a sentence of only characters the normaliser drops
        if len(ids) < cfg.instances.min_sentences:
            stats.skip("too_few_sentences", where)
        else:
            kept_documents.append(ids)
            kept_indices.append(doc_index)

    per_document = [document_instances(ids, _OtherDocuments(kept_documents, own), cfg.instances,
                                       Uniforms(np.random.default_rng([cfg.seed, chunk.unit, doc_index, 0])))
                    for own, (doc_index, ids) in enumerate(zip(kept_indices, kept_documents))]
    arrays = _pack(cfg, vocab, random_ids, chunk.unit, kept_indices, per_document)
    write_shard(out_path, arrays, durable=False)  # a part file; the final shards are fsynced
    return stats, len(arrays)


def _pack(cfg: BuildConfig, vocab: Vocab, random_ids: np.ndarray, unit: int, doc_indices: list[int],
          per_document: list[list[Instance]]) -> ShardArrays:
    """Lay out ``[CLS] A [SEP] (B [SEP])`` back to back, mask each dupe copy (vectorised) and pack shard arrays."""
    special = vocab.special_ids
    cls, sep = special["cls"], special["sep"]
    flat: list[int] = []
    rows: list[tuple[int, int, int, int]] = []  # length, segment_a_length, objective, is_random_next
    for instances in per_document:
        for inst in instances:
            start = len(flat)
            flat.append(cls)
            flat.extend(inst.tokens_a)
            flat.append(sep)
            len_a = len(flat) - start
            if inst.tokens_b is not None:
                flat.extend(inst.tokens_b)
                flat.append(sep)
            rows.append((len(flat) - start, len_a, int(inst.objective), inst.is_random_next))
    dtype = token_dtype(vocab.size)
    if not rows:
        return ShardArrays.empty(dtype)
    base = np.array(flat, dtype=np.int64)
    table = np.array(rows, dtype=np.int64)
    length, len_a = table[:, 0], table[:, 1]
    offset = np.cumsum(length) - length
    samples_per_doc = [len(instances) for instances in per_document]
    copies = []
    for copy in range(cfg.dupe_factor):
        tokens = base.copy()
        if cfg.instances.masked:
            maskable = length - np.where(len_a == length, 2, 3)
            need = np.add.reduceat(3 * masking_budget(maskable, cfg.masking) + maskable,
                                   np.cumsum([0] + samples_per_doc[:-1])) if rows else []
            uniforms = np.concatenate([np.random.default_rng([cfg.seed, unit, doc, copy + 1]).random(int(count))
                                       for doc, count, samples in zip(doc_indices, need, samples_per_doc) if samples])
            num_masked, positions, labels = mask_samples(tokens, offset, length, len_a, uniforms, cfg.masking,
                                                         special["mask"], random_ids)
        else:
            num_masked, positions, labels = np.zeros(len(rows), np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)
        index = np.zeros(len(rows), INDEX_DTYPE)
        index["token_offset"], index["length"], index["segment_a_length"] = offset, length, len_a
        index["objective"], index["is_random_next"] = table[:, 2], table[:, 3]
        index["num_masked"] = num_masked
        index["mask_offset"] = np.cumsum(num_masked) - num_masked
        copies.append(ShardArrays(index, tokens.astype(dtype), positions.astype("<u2"), labels.astype(dtype)))
    return ShardArrays.concatenate(copies, dtype)


def _quiet_tokenizer_threads() -> None:
    # worker processes already give the parallelism; tokenizers' own thread pool would oversubscribe the cores
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def _process_chunk_task(cfg: BuildConfig, chunk: Chunk, out_path: Path) -> tuple[int, int, DocumentStats, int]:
    stats, samples = process_chunk(cfg, chunk, out_path)
    return chunk.index, len(chunk.records), stats, samples


def staging_dir(out: Path) -> Path:
    """Where a build of ``out`` is assembled: beside it, on the same file system, so the final rename is cheap."""
    out = out.absolute()
    return out.parent / f".{out.name}.partial"


def _part_path(staging: Path, unit: int, chunk_index: int) -> Path:
    return staging / PARTS_DIR / f"unit-{unit:06d}-chunk-{chunk_index:07d}.bin"


def _builder_path(staging: Path, builder_index: int, num_builders: int) -> Path:
    return staging / PARTS_DIR / f"builder-{builder_index}-of-{num_builders}.json"


def check_output(out: Path, vocab: Vocab, overwrite: bool) -> None:
    """Refuse an ``--out`` that holds another build (unless --overwrite) or anything that is not a build.

    Nothing is deleted here: the new build replaces ``out`` only once it is complete (``install_build``).
    """
    hint = "choose an empty --out directory, or pass --overwrite to replace it"
    if not out.exists():
        return
    if not out.is_dir():
        raise ShardError(f"--out {out} is a file, not a directory")
    foreign = sorted(p.name for p in out.iterdir() if p.name not in BUILD_FILES and not p.match(SHARD_GLOB))
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
    """Empty the staging directory of parts from other settings; with several builders, parts of this very
    build stay (another builder wrote them)."""
    parts = staging / PARTS_DIR
    if parts.is_dir():
        ours = all(json.loads(b.read_text())["fingerprint"] == cfg.fingerprint
                   for b in parts.glob("builder-*.json"))
        if num_builders == 1 or not ours:
            shutil.rmtree(parts)
    for stale in [staging / MANIFEST_NAME, *staging.glob(SHARD_GLOB)]:
        stale.unlink(missing_ok=True)
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


def run_builder(cfg: BuildConfig, out: Path, workers: int = 1, builder_index: int = 0, num_builders: int = 1,
                overwrite: bool = False, progress: bool = True) -> DocumentStats:
    """Process this builder's units (unit % num_builders == builder_index) into part files beside ``out``."""
    if not 0 <= builder_index < num_builders:
        raise ValueError(f"--builder-index {builder_index} must be in [0, --num-builders {num_builders})")
    vocab = load_vocab(cfg.vocab_path)
    check_output(out, vocab, overwrite)
    units = build_units(cfg)  # opens every input: a mistyped one fails here, before any work
    staging = staging_dir(out)
    prepare_staging(staging, cfg, num_builders)
    if vocab.path.absolute() != (staging / VOCAB_NAME).absolute():
        copy = staging / f"{VOCAB_NAME}.tmp{builder_index}"  # every builder writes the same bytes, atomically
        shutil.copyfile(vocab.path, copy)
        os.replace(copy, staging / VOCAB_NAME)
    stats = DocumentStats()
    unit_chunks: dict[int, int] = {}
    total_samples = 0
    bar = tqdm(desc=f"building {out.name}", unit="doc", disable=not progress, file=sys.stderr)

    def collect(result: tuple[int, int, DocumentStats, int]) -> None:
        nonlocal total_samples
        _, records, chunk_stats, samples = result
        stats.add(chunk_stats)
        total_samples += samples
        bar.update(records)
        bar.set_postfix(samples=total_samples, skipped=stats.skipped)

    def chunks() -> Iterator[Chunk]:
        for unit_index, (unit, options) in enumerate(units):
            if unit_index % num_builders == builder_index:  # other builders' units are never read here
                for chunk in iter_chunks(unit_index, unit, options, cfg.chunk_chars):
                    unit_chunks[unit_index] = chunk.index + 1
                    yield chunk

    if workers <= 1:
        for chunk in chunks():
            collect(_process_chunk_task(cfg, chunk, _part_path(staging, chunk.unit, chunk.index)))
    else:
        # fork starts workers in milliseconds (spawn re-imports numpy and tokenizers: ~1 s); workers only run
        # process_chunk, and tokenizers disables its thread pool in a forked child by itself
        method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
        with multiprocessing.get_context(method).Pool(workers, initializer=_quiet_tokenizer_threads) as pool:
            pending: collections.deque = collections.deque()
            for chunk in chunks():
                pending.append(pool.apply_async(_process_chunk_task,
                                                (cfg, chunk, _part_path(staging, chunk.unit, chunk.index))))
                while len(pending) > 2 * workers:  # bounded memory: never queue the whole corpus
                    collect(pending.popleft().get())
            while pending:
                collect(pending.popleft().get())
    bar.close()
    write_json(_builder_path(staging, builder_index, num_builders), {
        "fingerprint": cfg.fingerprint, "config": cfg.to_json(), "builder_index": builder_index,
        "num_builders": num_builders, "num_units": len(units),
        "unit_chunks": {str(u): n for u, n in sorted(unit_chunks.items())}, "documents": asdict(stats)})
    return stats


def finalize(out: Path) -> dict:
    """Join all builders' parts into balanced shards, write the manifest, then put the build in place of ``out``.

    Returns the manifest.
    """
    staging = staging_dir(out)
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
    parts = [_part_path(staging, u, c) for u in sorted(unit_chunks) for c in range(unit_chunks[u])]
    absent = [p.name for p in parts if not p.exists()]
    if absent:
        raise ShardError(f"--finalize {out}: part files missing ({absent[:5]}); rerun the builders")
    opened = [ShardFile(p) for p in parts]
    vocab = load_vocab(staging / VOCAB_NAME)
    if vocab.sha256 != cfg.vocab_sha256:
        raise ShardError(f"{staging / VOCAB_NAME}: differs from the vocab the parts were built with")
    dtype = token_dtype(vocab.size)
    stats = DocumentStats()
    for r in records:
        stats.add(DocumentStats(**r["documents"]))

    ends = np.cumsum([len(p) for p in opened], dtype=np.int64)
    total = int(ends[-1]) if len(ends) else 0
    if total == 0:
        examples = "; ".join(f"{reason}: {where[0]}" for reason, where in sorted(stats.skip_examples.items()) if where)
        raise ShardError(f"no samples from {list(cfg.inputs)}: {stats.read} documents read, "
                         f"{stats.skipped} skipped {stats.skip_reasons} (e.g. {examples}); check the inputs"
                         + _rows_hint(stats.skip_reasons, stats.read, set(cfg.sentence_inputs) == set(cfg.inputs)))
    num_shards = -(-total // cfg.samples_per_shard)
    shard_entries, objective_counts, random_next = [], collections.Counter(), collections.Counter()
    num_tokens = 0
    for shard in range(num_shards):
        start, stop = total * shard // num_shards, total * (shard + 1) // num_shards
        pieces = []
        for part_index in range(int(np.searchsorted(ends, start, "right")), len(opened)):
            part_start = int(ends[part_index - 1]) if part_index else 0
            if part_start >= stop:
                break
            pieces.append(opened[part_index].arrays.select(max(start - part_start, 0), min(stop, int(ends[part_index])) - part_start))
        arrays = ShardArrays.concatenate(pieces, dtype)
        path = staging / f"shard-{shard:05d}.bin"
        write_shard(path, arrays)
        objective_counts.update(arrays.index["objective"].tolist())
        random_next.update(arrays.index["is_random_next"].tolist())
        num_tokens += len(arrays.tokens)
        shard_entries.append({"file": path.name, "num_samples": len(arrays), "bytes": path.stat().st_size,
                              "sha256": sha256_file(path)})
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
                 "rows_per_document": cfg.rows_per_document},
        chunk_chars=cfg.chunk_chars,
        num_samples=total,
        num_tokens=num_tokens,
        objective_counts={o.key: objective_counts.get(int(o), 0) for o in Objective},
        nsp_counts={"random_next": random_next.get(1, 0), "true_next": random_next.get(0, 0)},
        documents={"read": stats.read, "skipped": stats.skipped, "skip_reasons": dict(sorted(stats.skip_reasons.items())),
                   "skip_examples": dict(sorted(stats.skip_examples.items()))},
        shards=shard_entries,
    )
    write_json(staging / MANIFEST_NAME, manifest)
    del opened
    shutil.rmtree(staging / PARTS_DIR)
    install_build(staging, out)
    return manifest


def _rows_hint(skip_reasons: dict[str, int], read: int, every_input_is_rows: bool) -> str:
    """Advice when most documents are single sentences: the input is probably one sentence per row."""
    single = skip_reasons.get("too_few_sentences", 0)
    if not read or single <= read / 2 or every_input_is_rows:
        return ""
    return (f"; {single} of {read} documents are single sentences: if the input has one sentence per row "
            "(as BookCorpus on the Hugging Face hub), pass --rows-as-sentences")


def skip_warning(manifest: dict) -> str | None:
    """A warning when more than 5% of the documents were skipped, naming the reasons (None otherwise).

    Wikipedia redirects and non-article pages do not count: a dump is full of them by design."""
    docs = manifest["documents"]
    expected = sum(docs["skip_reasons"].get(r, 0) for r in EXPECTED_SKIPS)
    skipped, read = docs["skipped"] - expected, docs["read"] - expected
    if skipped <= SKIP_WARNING_FRACTION * read:
        return None
    rows = set(manifest.get("reading", {}).get("rows_as_sentences", []))
    examples = "; ".join(f"{reason}: {where[0]}" for reason, where in sorted(docs.get("skip_examples", {}).items())
                         if where)
    return (f"[build] warning: {skipped} of {read} documents ({skipped / read:.0%}) were skipped: {docs['skip_reasons']} (e.g. {examples}; more in manifest.json documents.skip_examples)"
            + _rows_hint(docs["skip_reasons"], docs["read"], rows == set(manifest["inputs"])))


def build(cfg: BuildConfig, out: Path, workers: int = 1, overwrite: bool = False, progress: bool = True) -> dict:
    """Single-machine build: one builder, then finalize. Returns the manifest."""
    run_builder(cfg, out, workers=workers, overwrite=overwrite, progress=progress)
    return finalize(out)


def training_documents(inputs: Sequence[str], cfg: BuildConfig | None = None) -> Iterator[str]:
    """Cleaned documents of the inputs, streamed (what --train-vocab learns from); ``cfg`` says how to read them."""
    for spec in inputs:
        options = cfg.read_options(spec) if cfg else ReadOptions()
        for record in read_documents(spec, options):
            if isinstance(record, str) and (text := clean_document(record)):
                yield text


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m data_prep.build", description=__doc__.split("\n")[0])
    p.add_argument("--input", nargs="+", action="extend", default=[], metavar="SRC",
                   help="file (.xml[.bz2] .jsonl .json .parquet .txt), directory, or HF dataset name[:config][:split]; "
                        "repeatable")
    p.add_argument("--text-field", default=TEXT_FIELD, metavar="NAME",
                   help="field / column of JSON, parquet and dataset records that holds the text "
                        f"(default {TEXT_FIELD})")
    p.add_argument("--rows-as-sentences", nargs="*", metavar="SRC",
                   help="rows are sentences of a running text (BookCorpus on the hub): consecutive rows form one "
                        "document; alone it applies to every --input, else to the inputs named (.txt: a row is a line)")
    p.add_argument("--rows-per-document", type=int, default=ROWS_PER_DOCUMENT, metavar="N",
                   help=f"with --rows-as-sentences: rows per document (default {ROWS_PER_DOCUMENT}; an empty row "
                        "ends a document early)")
    p.add_argument("--vocab", type=Path, help="BERT vocab.txt, a Hugging Face model/tokenizer directory, or a "
                                              "tokenizer.json (WordPiece); casing is read from its tokenizer config")
    casing = p.add_mutually_exclusive_group()
    casing.add_argument("--uncased", action="store_const", const=True, dest="uncased",
                        help="lowercase and strip accents (default: what --vocab's tokenizer config says; a bare "
                             "vocab.txt is cased)")
    casing.add_argument("--cased", action="store_const", const=False, dest="uncased",
                        help="keep case; refused if --vocab's tokenizer config lowercases")
    p.add_argument("--train-vocab", type=int, metavar="SIZE", help="train a WordPiece vocab of SIZE on the inputs")
    p.add_argument("--vocab-out", type=Path, help="where --train-vocab writes the vocab")
    p.add_argument("--recipe", default="unilm", help=f"one of {', '.join(RECIPES)} (default unilm)")
    p.add_argument("--objective-mix", default="", help="unilm only: e.g. bidirectional=0.5,seq2seq=0.5")
    p.add_argument("--max-seq-len", type=int, default=128)
    p.add_argument("--short-seq-prob", type=float, default=0.1)
    p.add_argument("--mask-prob", type=float, default=0.15)
    p.add_argument("--max-predictions", type=int,
                   help="cap on masked tokens per sample (default round(0.15 x --max-seq-len): 19 at 128, 77 at 512)")
    p.add_argument("--dupe-factor", type=int, default=1,
                   help="differently-masked copies of each instance (BERT: 10; see docs/shard_format.md)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--workers", type=int, default=1, help="processes on this machine (output is identical)")
    p.add_argument("--num-builders", type=int, default=1,
                   help="split the work across K machines: each reads only its units (files, 256 MiB ranges of "
                        ".jsonl files, dataset shards)")
    p.add_argument("--builder-index", type=int, default=0, help="this machine's share, 0..K-1")
    p.add_argument("--finalize", action="store_true", help="after all builders: write shards + manifest in --out")
    p.add_argument("--samples-per-shard", type=int, default=65536)
    p.add_argument("--chunk-chars", type=int, default=500_000, help="characters per work unit (affects output)")
    p.add_argument("--out", type=Path, help="output directory (assembled beside it, renamed into place when done)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing build in --out (it stays until the new one is complete)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def _resolve_vocab(args: argparse.Namespace) -> tuple[Path, bool]:
    """(vocab.txt, uncased) for --vocab; a tokenizer.json's vocabulary is written beside the output first."""
    source = resolve_vocab_source(args.vocab)
    uncased = resolve_casing(source, args.uncased)
    if source.vocab_file is not None:
        return source.vocab_file, uncased
    staging = staging_dir(args.out)
    staging.mkdir(parents=True, exist_ok=True)
    path = staging / VOCAB_NAME
    if not path.is_file() or path.read_text(encoding="utf-8") != source.vocab_text:
        tmp = staging / f"{VOCAB_NAME}.tmp{os.getpid()}"
        tmp.write_text(source.vocab_text, encoding="utf-8")
        os.replace(tmp, path)
    return path, uncased


def _warn_low_cap(masking: MaskingConfig, max_seq_len: int) -> None:
    full = round(masking.mask_prob * (max_seq_len - 3))
    if masking.max_predictions < full:
        print(f"[build] warning: --max-predictions {masking.max_predictions} caps masking below --mask-prob "
              f"{masking.mask_prob} for samples longer than {int(masking.max_predictions / masking.mask_prob) + 3} "
              f"tokens (a full {max_seq_len}-token sample masks {masking.max_predictions / (max_seq_len - 3):.1%}); "
              f"the default is {default_max_predictions(max_seq_len)}", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        if args.finalize:
            if args.out is None:
                raise ValueError("--finalize needs --out DIR")
            _report(finalize(args.out), args.out)
            return
        if not args.input:
            raise ValueError("give at least one --input")
        for spec in args.input:
            check_input(spec)
        sentence_inputs = tuple(args.input if args.rows_as_sentences == [] else args.rows_as_sentences or ())
        # the reading settings, checked before any work (--train-vocab reads the inputs with them too)
        reading = BuildConfig(inputs=tuple(args.input), vocab_path="", vocab_sha256="", text_field=args.text_field,
                              sentence_inputs=sentence_inputs, rows_per_document=args.rows_per_document)
        if args.train_vocab is not None:
            if args.vocab_out is None:
                raise ValueError("--train-vocab needs --vocab-out PATH")
            vocab = train_vocab(training_documents(args.input, reading), args.train_vocab, args.vocab_out,
                                bool(args.uncased))
            print(f"[build] trained a {vocab.size}-entry WordPiece vocab -> {args.vocab_out}")
            if args.out is None:
                return
            args.vocab = args.vocab_out
        if args.vocab is None or args.out is None:
            raise ValueError("give --vocab VOCAB (or --train-vocab SIZE --vocab-out PATH) and --out DIR")
        vocab_path, uncased = _resolve_vocab(args)
        vocab = load_vocab(vocab_path)
        max_predictions = default_max_predictions(args.max_seq_len) if args.max_predictions is None \
            else args.max_predictions
        masking = MaskingConfig(mask_prob=args.mask_prob, max_predictions=max_predictions)
        if args.max_predictions is not None:
            _warn_low_cap(masking, args.max_seq_len)
        cfg = BuildConfig(
            inputs=tuple(args.input), vocab_path=str(vocab_path), vocab_sha256=vocab.sha256, uncased=uncased,
            instances=InstanceConfig(recipe=args.recipe, max_seq_len=args.max_seq_len,
                                     short_seq_prob=args.short_seq_prob,
                                     objective_mix=parse_objective_mix(args.objective_mix)),
            masking=masking, seed=args.seed, dupe_factor=args.dupe_factor, samples_per_shard=args.samples_per_shard,
            chunk_chars=args.chunk_chars, text_field=args.text_field, sentence_inputs=sentence_inputs,
            rows_per_document=args.rows_per_document)
        stats = run_builder(cfg, args.out, workers=args.workers, builder_index=args.builder_index,
                            num_builders=args.num_builders, overwrite=args.overwrite, progress=not args.quiet)
        if args.num_builders == 1:
            _report(finalize(args.out), args.out)
        else:
            print(f"[build] builder {args.builder_index}/{args.num_builders}: {stats.read} documents read; "
                  f"when all builders are done run: python -m data_prep.build --finalize --out {args.out}")
    except (ValueError, OSError) as err:  # our errors are ValueError subclasses that name the file and the fix
        sys.exit(f"data_prep.build: error: {err}")


def _report(manifest: dict, out: Path) -> None:
    docs = manifest["documents"]
    print(f"[build] {manifest['num_samples']} samples, {manifest['num_tokens']} tokens in {len(manifest['shards'])} "
          f"shard(s) -> {out}; documents read {docs['read']}, skipped {docs['skipped']} {docs['skip_reasons']}")
    warning = skip_warning(manifest)
    if warning:
        print(warning, file=sys.stderr)


if __name__ == "__main__":
    main()
