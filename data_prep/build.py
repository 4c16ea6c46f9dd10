"""Build packed training shards from raw corpora: ``python -m data_prep.build --input ... --out DIR``.

Pipeline: every ``--input`` is split into units (a file, or a shard of a Hugging Face dataset:
``data_prep.sources.input_units``); each unit's documents are streamed and grouped into chunks of about
``--chunk-chars`` characters (a chunk boundary depends only on the input, never on workers). In a worker
process each chunk is cleaned (Wikipedia markup too), sentence-split, batch-encoded with ``tokenizers``,
turned into instances (``data_prep.instances``) and masked, with randomness seeded by (seed, unit, document
index in the unit); it is written as a part file in the shard format. NSP draws its random next segments from the
chunk's other documents; a chunk whose documents cannot serve (a single document: a book longer than
``--chunk-chars``, a unit's last document; pieces of one running text under ``--rows-as-sentences``) also
carries text from elsewhere: a neighbouring or a far chunk of its unit, or the next unit (``iter_chunks``).
``finalize`` joins the parts in (unit, chunk) order into shards of balanced size (their sample counts differ by
at most one) and writes ``manifest.json`` last. Hence the output is byte-identical for any ``--workers`` and any ``--num-builders``
split: builder i of K reads only units i, i+K, …, and ``--finalize`` (run once after all builders)
assembles the shards. Memory is bounded by a few chunks.

A build is assembled beside ``--out`` (in ``.NAME.partial`` in the same parent directory) and renamed into
place when complete, so a failed or interrupted build never costs the previous one, even with ``--overwrite``.
It holds an exclusive ``flock`` on ``.NAME.lock`` beside ``--out`` from its start until the build is in place
(``OutputLock``): a second build of the same ``--out`` is refused at once, naming the first. Builders of a
split build (``--num-builders``) share that lock and each holds ``.NAME.builder-I.lock``; ``--finalize`` takes
it exclusively. Whoever takes the lock exclusively first clears what a killed build left behind.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import functools
import hashlib
import itertools
import json
import multiprocessing
import os
import re
import shutil
import signal
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Iterator, Sequence

import numpy as np
from tqdm import tqdm

from common import locks, signals
from data_prep.instances import (RECIPES, Instance, InstanceConfig, MaskingConfig, Uniforms, default_max_predictions,
                                 document_instances, masking_budget, mask_samples, parse_objective_mix)
from data_prep.shard_format import (INDEX_DTYPE, MANIFEST_NAME, SHARD_GLOB, VOCAB_NAME, Objective,
                                    ShardArrays, ShardError, ShardFile, manifest_dict, read_manifest,
                                    sha256_file, token_dtype, write_json, write_shard)
from data_prep.sources import (ALL_FILES, ROWS_PER_DOCUMENT, SUPPORTED, TEXT_FIELD, TXT_DOCUMENTS, UNIT_BYTES,
                               ReadOptions, RepairedText, Skipped, SourceError, Unit, Wikitext, check_input,
                               directory_files, document_text, folder_split, input_units, is_plain_folder,
                               read_documents, read_unit)
from data_prep.text import clean_document, split_sentences
from data_prep.vocab import (HF_TOKENIZER_CONFIG, Vocab, VocabError, load_encoder, load_vocab, resolve_casing,
                             resolve_vocab_source, train_vocab)

PARTS_DIR = "parts"
SKIP_EXAMPLES = 3
SKIP_WARNING_FRACTION = 0.05
"""skipped characters (of all read) above which the build warns"""
EXPECTED_SKIPS = ("wiki_redirect", "wiki_not_an_article")  # a dump's redirects are not documents; no warning
BUILD_FILES = (MANIFEST_NAME, VOCAB_NAME, PARTS_DIR)  # with shard-*.bin: what --overwrite may replace
_LEFTOVER = re.compile(r"(shard-\d+\.bin|manifest\.json|vocab\.txt)\.tmp\d+")  # a killed write's temporary file
ONE_SENTENCE_CHARS = 400
"""documents skipped as single sentences that average more characters than this are text the sentence
splitter cannot cut (no sentence ends it knows), not one sentence per row"""
UNK_WARNING_FRACTION = 0.005
"""[UNK] share of the word pieces above which the build warns (a vocab of the wrong casing gives ~13 %)"""
RANDOM_NEXT_WARNING = 0.4
"""share of NSP pairs with a random next segment (the aim is 1/2) below which the build warns"""
ENCODE_BATCH = 4096
"""sentences encoded at once: bounds the memory of one huge document (tokenizers' Encoding objects are large)"""
DONOR_CHARS = 20_000
"""at least this many characters of text from elsewhere go with a chunk that draws NSP random B segments from it"""
FAR_CHUNKS = 4
"""the documents of a running text (``--rows-as-sentences``: consecutive pieces of one text, likely of one book)
take their NSP random B segments from text at least this many chunks away in their unit (2M characters at the
default ``chunk_chars``, several books), not from their own chunk's documents"""


@dataclass(frozen=True)
class BuildConfig:
    """Everything that determines the bytes of a build (recorded in the manifest)."""

    inputs: tuple[str, ...]
    vocab_path: str
    vocab_sha256: str
    uncased: bool = False
    instances: InstanceConfig = field(default_factory=InstanceConfig)
    masking: MaskingConfig | None = None
    """None: the recipe's (``MaskingConfig.for_recipe``: UniLM's spans, BERT's single tokens)"""
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
    txt_documents: str = TXT_DOCUMENTS[0]
    """what a document of a .txt input is (``sources.TXT_DOCUMENTS``)"""
    unit_bytes: int = UNIT_BYTES
    """a .jsonl file larger than this is split into byte ranges that different builders read"""

    def __post_init__(self) -> None:
        if self.masking is None:
            object.__setattr__(self, "masking", MaskingConfig.for_recipe(self.instances.recipe))
        if not self.inputs:
            raise ValueError("no --input given")
        if self.seed < 0:
            raise ValueError(f"--seed {self.seed} must be 0 or more (it seeds numpy's random generators)")
        strays = [s for s in self.sentence_inputs if s not in self.inputs]
        if strays:
            raise ValueError(f"--rows-as-sentences {' '.join(strays)}: not among the --input sources; name inputs "
                             "exactly as given to --input, or give the flag alone to apply it to every input")
        if self.sentence_inputs and self.txt_documents != TXT_DOCUMENTS[0]:
            raise ValueError(f"--txt-documents {self.txt_documents} and --rows-as-sentences both say what a document "
                             "of a .txt input is; give one of them")
        self.read_options(self.inputs[0])  # validates text_field, rows_per_document and txt_documents
        if self.dupe_factor < 1:
            raise ValueError(f"--dupe-factor {self.dupe_factor} must be at least 1")
        if self.dupe_factor > 1 and not self.instances.masked:
            raise ValueError("--dupe-factor applies to masked recipes; gpt has no masking, copies would be identical")
        if self.samples_per_shard < 1 or self.chunk_chars < 1 or self.unit_bytes < 1:
            raise ValueError("--samples-per-shard, --chunk-chars and unit_bytes must be positive")

    def read_options(self, spec: str) -> ReadOptions:
        return ReadOptions(self.text_field, spec in self.sentence_inputs, self.rows_per_document, self.txt_documents)

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
    """Per-build accounting of documents and their text: nothing is dropped without a counted reason, and the
    characters of what is dropped are counted too, so one dropped book weighs as much as it is long."""

    read: int = 0
    skipped: int = 0
    skip_reasons: dict[str, int] = field(default_factory=dict)
    skip_examples: dict[str, list[str]] = field(default_factory=dict)
    characters: int = 0
    """characters of every record read (raw: Wikipedia markup counts; bytes for an undecodable line)"""
    skip_characters: dict[str, int] = field(default_factory=dict)
    repaired_lines: int = 0
    """lines of .txt inputs with bytes that are not UTF-8 (replaced by U+FFFD, which the tokenizer drops)"""
    repair_examples: list[str] = field(default_factory=list)
    wordpieces: int = 0
    """word pieces the kept documents encode to, and how many of them are [UNK]"""
    unk_wordpieces: int = 0

    def skip(self, reason: str, where: str, characters: int = 0) -> None:
        self.skipped += 1
        self.skip_reasons[reason] = self.skip_reasons.get(reason, 0) + 1
        self.skip_characters[reason] = self.skip_characters.get(reason, 0) + characters
        examples = self.skip_examples.setdefault(reason, [])
        if len(examples) < SKIP_EXAMPLES:
            examples.append(where)

    def repaired(self, lines: int, where: str) -> None:
        self.repaired_lines += lines
        if len(self.repair_examples) < SKIP_EXAMPLES:
            self.repair_examples.append(where)

    def add(self, other: "DocumentStats") -> None:
        self.read += other.read
        self.characters += other.characters
        self.wordpieces += other.wordpieces
        self.unk_wordpieces += other.unk_wordpieces
        for reason, count in sorted(other.skip_reasons.items()):
            self.skipped += count
            self.skip_reasons[reason] = self.skip_reasons.get(reason, 0) + count
            self.skip_characters[reason] = (self.skip_characters.get(reason, 0)
                                            + other.skip_characters.get(reason, 0))
            examples = self.skip_examples.setdefault(reason, [])
            examples.extend(other.skip_examples.get(reason, [])[: SKIP_EXAMPLES - len(examples)])
        self.repaired_lines += other.repaired_lines
        self.repair_examples.extend(other.repair_examples[: SKIP_EXAMPLES - len(self.repair_examples)])


@dataclass(frozen=True)
class Chunk:
    """Consecutive records of one unit; ``first_document`` is the index of ``records[0]`` within the unit."""

    unit: int
    index: int
    first_document: int
    records: list[tuple[str | Skipped, str]]  # (document or skip, where)
    donor: tuple[str, ...] = ()
    """text from elsewhere (`iter_chunks`) where NSP draws random next segments for a chunk whose documents cannot
    give each other any: a single document, or pieces of one running text"""


def iter_chunks(unit_index: int, unit: Unit, options: ReadOptions, chunk_chars: int,
                elsewhere: tuple[Unit, ReadOptions] | None = None, donors: bool = True) -> Iterator[Chunk]:
    """Stream one unit as chunks of about ``chunk_chars`` characters (raw; Wikipedia markup counts) and at least
    one chunk; only the input decides boundaries. With ``donors`` (NSP is drawn) a chunk whose documents cannot
    give each other random next segments gets text from elsewhere as its ``donor``:

    * a running text's chunk (``rows_as_sentences``): text of the chunk at least `FAR_CHUNKS` chunks ahead in the
      unit, else behind it (so up to that many chunks are read ahead); in a unit shorter than that, text of
      ``elsewhere`` (another unit of the build), else the unit's farthest chunk;
    * a chunk of a single document: text of the next chunk of the unit, else the previous one, else of
      ``elsewhere``.

    ``elsewhere``'s text is handed out in consecutive pieces, from its start, so the donors depend on the inputs
    alone, never on the builders or workers."""
    chunks = _read_chunks(unit_index, unit, options, chunk_chars)
    text_elsewhere = _TextElsewhere(*elsewhere) if elsewhere is not None and donors else None
    if not donors:
        yield from chunks
    elif options.rows_as_sentences:
        yield from _with_far_donors(chunks, FAR_CHUNKS * chunk_chars, text_elsewhere)
    else:
        yield from _with_neighbour_donors(chunks, text_elsewhere)


def _characters(chunk: Chunk) -> int:
    return sum(len(r) for r, _ in chunk.records if isinstance(r, str))


def _budget(characters: int) -> int:
    """Donor characters for a chunk of ``characters``: a quarter, at least `DONOR_CHARS` (NSP draws B for about a
    sixth of the samples, each about half a sample long)."""
    return max(characters // 4, DONOR_CHARS)


def _with_neighbour_donors(chunks: Iterator[Chunk], elsewhere: _TextElsewhere | None) -> Iterator[Chunk]:
    previous, current = None, next(chunks)
    for following in itertools.chain(chunks, [None]):
        neighbour = following if following is not None else previous
        texts = [r for r, _ in current.records if isinstance(r, str) and r.strip()]
        if len(texts) == 1:
            budget = _budget(len(texts[0]))
            donor = _donor(neighbour, budget) if neighbour is not None else \
                elsewhere.take(budget) if elsewhere is not None else ()
            current = dataclasses.replace(current, donor=donor)
        yield current
        previous, current = current, following


def _with_far_donors(chunks: Iterator[Chunk], far: int, elsewhere: _TextElsewhere | None) -> Iterator[Chunk]:
    window: list[tuple[int, Chunk]] = []  # (first character in the unit, chunk): from the farthest behind to ahead
    read_to, ended, k = 0, False, 0
    while True:
        while not ended and (k >= len(window) or window[-1][0] - window[k][0] < far):
            chunk = next(chunks, None)
            if chunk is None:
                ended = True
            else:
                window.append((read_to, chunk))
                read_to += _characters(chunk)
        if k >= len(window):
            return
        start, chunk = window[k]
        source = next((c for s, c in window[k + 1:] if s - start >= far), None) or \
            next((c for s, c in reversed(window[:k]) if start - s >= far), None)
        budget = _budget(_characters(chunk))
        if source is not None:
            donor = _donor(source, budget)
        elif elsewhere is not None:
            donor = elsewhere.take(budget)
        else:  # a lone unit shorter than `far`, all of it in the window: its farthest chunk
            ends = [(abs(s - start), i) for i, (s, _) in ((0, window[0]), (len(window) - 1, window[-1])) if i != k]
            donor = _donor(window[max(ends)[1]][1], budget) if ends else ()
        yield dataclasses.replace(chunk, donor=donor)
        k += 1
        # chunks before the last one `far` behind the next chunk can serve no later chunk
        if k < len(window):
            behind = [i for i, (s, _) in enumerate(window[:k]) if window[k][0] - s >= far]
            if behind:
                del window[:behind[-1]]
                k -= behind[-1]


class _TextElsewhere:
    """The documents of another unit, handed out in consecutive pieces (from its start again once all is given)."""

    def __init__(self, unit: Unit, options: ReadOptions):
        self.unit, self.options = unit, options
        self.records: Iterator[str | Skipped] | None = None
        self.next: str | None = None  # a document read but left for the next piece (longer than what was left)

    def take(self, budget: int) -> tuple[str, ...]:
        """Whole documents up to ``budget`` characters, or the middle of one longer than that."""
        texts: list[str] = []
        for _ in range(2):  # on to the unit's end, then once more from its start
            if self.records is None:
                self.records = read_unit(self.unit, self.options)
            while (record := self.next or next(self.records, None)) is not None:
                self.next = None
                if not (isinstance(record, str) and record.strip()):
                    continue
                if texts and len(record) > budget:
                    self.next = record
                    return tuple(texts)
                texts.append(_middle(record, budget))
                budget -= len(texts[-1])
                if budget <= 0:
                    return tuple(texts)
            self.records = None
            if texts:
                break
        return tuple(texts)


def _middle(record: str, budget: int) -> str:
    """``record``, or its middle ``budget`` characters when longer: its whole paragraphs there when it has any,
    so that a Wikipedia page (which stays `Wikitext`) is not cut inside a template, link or table."""
    if len(record) <= budget:
        return record
    start = (len(record) - budget) // 2
    stop = start + budget
    first, last = record.find("\n\n", start, stop), record.rfind("\n\n", start, stop)
    if 0 <= first < last:
        start, stop = first + 2, last
    return Wikitext.of(record[start:stop], record.dump) if isinstance(record, Wikitext) else record[start:stop]


def _donor(neighbour: Chunk, budget: int) -> tuple[str, ...]:
    """Up to ``budget`` characters of the documents of ``neighbour``, whole, or the middle of a longer one."""
    texts: list[str] = []
    for record, _ in neighbour.records:
        if budget <= 0:
            break
        if isinstance(record, str) and record.strip():
            texts.append(_middle(record, budget))
            budget -= len(texts[-1])
    return tuple(texts)


def _read_chunks(unit_index: int, unit: Unit, options: ReadOptions, chunk_chars: int) -> Iterator[Chunk]:
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
    """Every unit of every input, in input order, with the way its records become documents. A file reached
    twice (given twice, or also through its directory) is read once, where it comes first; that, and the files
    of a directory input that are not read, are warned about on stderr."""
    units: list[tuple[Unit, ReadOptions]] = []
    first_spec: dict[tuple, str] = {}
    for spec in cfg.inputs:
        if is_plain_folder(spec):
            _warn_left_out(spec)
        twice: list[Unit] = []
        earlier: set[str] = set()
        for unit in input_units(spec, cfg.unit_bytes):
            path = Path(unit.spec)
            key = (os.path.realpath(path) if path.is_file() else unit.spec, unit.shard, unit.start, unit.stop)
            if key in first_spec:
                twice.append(unit)
                earlier.add(first_spec[key])
                continue
            first_spec[key] = spec
            units.append((unit, cfg.read_options(spec)))
        if twice:
            names = ", ".join(str(u) for u in twice[:5]) + (", …" if len(twice) > 5 else "")
            print(f"[build] warning: --input {spec}: {len(twice)} unit(s) come also from --input "
                  f"{' '.join(sorted(earlier))} and are read once, from there: {names}", file=sys.stderr)
    return units


def _warn_left_out(spec: str) -> None:
    """Name, on stderr, the files of a directory input that are not read: other types, other splits."""
    folder, split = folder_split(spec)
    listed = directory_files(folder, split)

    def names(files: list[Path]) -> str:
        return ", ".join(str(p.relative_to(folder)) for p in files[:5]) + (", …" if len(files) > 5 else "")

    if listed.other_types:
        print(f"[build] warning: --input {spec}: {len(listed.other_types)} file(s) of other types are not read: "
              f"{names(listed.other_types)} (read here: {SUPPORTED}; convert a file "
              "to one of them to include it)", file=sys.stderr)
    if listed.split:
        left = "; ".join(f"{f'split {name}' if name else 'no split named'}: {names(files)}"
                         for name, files in listed.other_splits.items())
        print(f"[build] --input {spec}: the file names here name splits, as Hugging Face datasets reads them; "
              f"reading split {listed.split} ({len(listed.read)} file(s): {names(listed.read)})"
              + (f". Not read: {left}" if left else "")
              + f". Name another split as {folder}::SPLIT, or read every file as {folder}::{ALL_FILES}",
              file=sys.stderr)


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


def _encode(tokenizer, sentences: list[str]) -> list[list[int]]:
    """Token ids per sentence, encoded ``ENCODE_BATCH`` sentences at a time so that tokenizers' per-sentence
    ``Encoding`` objects (tokens, offsets, masks: ~50 bytes a token) never exist for a whole huge document."""
    # encode_batch_fast: same ids as encode_batch without tracking character offsets, ~15% less work
    return [e.ids for start in range(0, len(sentences), ENCODE_BATCH)
            for e in tokenizer.encode_batch_fast(sentences[start:start + ENCODE_BATCH], add_special_tokens=False)]


def uses_nsp(cfg: BuildConfig) -> bool:
    """Whether the build draws NSP pairs (bidirectional samples), which may take random next segments."""
    return cfg.instances.mix.get(Objective.BIDIRECTIONAL, 0) > 0


def process_chunk(cfg: BuildConfig, chunk: Chunk, out_path: Path) -> tuple[DocumentStats, int]:
    """Chunk → part file in shard format. Returns its document stats and sample count."""
    stats = DocumentStats(read=len(chunk.records))
    vocab, random_ids = _cached_vocab(cfg.vocab_path, cfg.vocab_sha256)
    tokenizer = load_encoder(cfg.vocab_path, vocab.sha256, cfg.uncased)
    kept: list[tuple[int, str, list[str], int]] = []  # (document index, where, sentences, characters)
    for offset, (record, where) in enumerate(chunk.records):
        if isinstance(record, Skipped):
            stats.characters += record.chars
            stats.skip(record.reason, where, record.chars)
            continue
        stats.characters += len(record)
        if isinstance(record, RepairedText):
            stats.repaired(record.lines, record.where)
        text = clean_document(document_text(record))  # Wikipedia clean-up happens here, in the worker
        if not text:
            stats.skip("empty", where, len(record))
            continue
        sentences = split_sentences(text)
        if len(sentences) < cfg.instances.min_sentences:
            stats.skip("too_few_sentences", where, len(record))
            continue
        kept.append((chunk.first_document + offset, where, sentences, len(record)))

    encoded = _encode(tokenizer, [s for _, _, sentences, _ in kept for s in sentences])
    unk = vocab.special_ids["unk"]
    stats.wordpieces += sum(map(len, encoded))
    stats.unk_wordpieces += sum(ids.count(unk) for ids in encoded)
    kept_documents: list[list[list[int]]] = []
    kept_indices: list[int] = []
    cursor = 0
    for doc_index, where, sentences, characters in kept:
        ids = [s for s in encoded[cursor:cursor + len(sentences)] if s]  # a sentence of only dropped characters
        cursor += len(sentences)
        if len(ids) < cfg.instances.min_sentences:
            stats.skip("too_few_sentences", where, characters)
        else:
            kept_documents.append(ids)
            kept_indices.append(doc_index)
    del encoded

    donors: list[list[list[int]]] = []  # random next segments from text elsewhere (`iter_chunks`)
    if kept_documents and uses_nsp(cfg):
        for text in chunk.donor:
            sentences = split_sentences(clean_document(document_text(text)))
            if ids := [s for s in _encode(tokenizer, sentences) if s]:
                donors.append(ids)
    per_document = [document_instances(ids, donors or (_OtherDocuments(kept_documents, own)
                                                       if len(kept_documents) > 1 else []), cfg.instances,
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


def _start_worker() -> None:
    # worker processes already give the parallelism; tokenizers' own thread pool would oversubscribe the cores
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    # a Ctrl-C reaches the whole process group: the main process stops the pool (SIGTERM, which ends a worker
    # quietly) instead of each worker printing its own traceback
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _process_chunk_task(cfg: BuildConfig, chunk: Chunk, out_path: Path) -> tuple[int, int, DocumentStats, int]:
    stats, samples = process_chunk(cfg, chunk, out_path)
    return chunk.index, len(chunk.records), stats, samples


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
                exclusive: bool | None = None) -> "OutputLock":
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
            print(f"[build] --out {out}: the previous build ({locks.holder_text(lock.stale)}) ended without finishing "
                  f"(killed or crashed){'; clearing what it left' if lock.exclusive else ''}", file=sys.stderr)
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
            print(f"[build] {out}: restored the previous build from {previous.name} (a build was killed while "
                  "putting its output in place)", file=sys.stderr)
        else:
            shutil.rmtree(previous)
    staging = staging_dir(out)
    if staging.is_dir():
        for leftover in staging.iterdir():
            if _LEFTOVER.fullmatch(leftover.name):
                leftover.unlink()


def _holding(out: Path, lock: OutputLock | None, builder_index: int, num_builders: int,
             exclusive: bool | None = None) -> contextlib.AbstractContextManager:
    """The caller's lock (checked to be of ``out``), or a new one held for the ``with`` block."""
    if lock is None:
        return claim_output(out, builder_index, num_builders, exclusive)
    if lock.out != out.absolute() or (exclusive and not lock.exclusive):
        raise ValueError(f"{out}: the lock passed is {'exclusive' if lock.exclusive else 'shared'} on {lock.out}; "
                         f"this needs {'an exclusive' if exclusive else 'a'} lock on {out.absolute()}")
    return contextlib.nullcontext(lock)


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


def run_builder(cfg: BuildConfig, out: Path, workers: int = 1, builder_index: int = 0, num_builders: int = 1,
                overwrite: bool = False, progress: bool = True, lock: OutputLock | None = None) -> DocumentStats:
    """Process this builder's units (unit % num_builders == builder_index) into part files beside ``out``,
    holding ``lock`` (taken here when None: exclusive for one builder, shared for a split build's)."""
    if not 0 <= builder_index < num_builders:
        raise ValueError(f"--builder-index {builder_index} must be in [0, --num-builders {num_builders})")
    with _holding(out, lock, builder_index, num_builders):
        return _run_builder(cfg, out, workers, builder_index, num_builders, overwrite, progress)


def _run_builder(cfg: BuildConfig, out: Path, workers: int, builder_index: int, num_builders: int,
                 overwrite: bool, progress: bool) -> DocumentStats:
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
            if unit_index % num_builders == builder_index:  # other builders' units are read only for NSP donors
                elsewhere = units[(unit_index + 1) % len(units)] if len(units) > 1 else None
                for chunk in iter_chunks(unit_index, unit, options, cfg.chunk_chars, elsewhere, uses_nsp(cfg)):
                    unit_chunks[unit_index] = chunk.index + 1
                    yield chunk

    if workers <= 1:
        for chunk in chunks():
            collect(_process_chunk_task(cfg, chunk, _part_path(staging, chunk.unit, chunk.index)))
    else:
        # fork starts workers in milliseconds (spawn re-imports numpy and tokenizers: ~1 s); workers only run
        # process_chunk, and tokenizers disables its thread pool in a forked child by itself
        method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
        with multiprocessing.get_context(method).Pool(workers, initializer=_start_worker) as pool:
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


def finalize(out: Path, lock: OutputLock | None = None) -> dict:
    """Join all builders' parts into balanced shards, write the manifest, then put the build in place of ``out``,
    holding ``lock`` (an exclusive one; taken here when None). Returns the manifest.
    """
    with _holding(out, lock, 0, 1, exclusive=True):
        return _finalize(out)


def _finalize(out: Path) -> dict:
    staging = staging_dir(out)
    for stale in [*staging.glob(SHARD_GLOB), staging / MANIFEST_NAME]:  # of a finalize that was killed
        stale.unlink(missing_ok=True)
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
        raise ShardError(nothing_kept("samples", cfg.inputs, stats)
                         + _one_sentence_hint(asdict(stats), set(cfg.sentence_inputs) == set(cfg.inputs)))
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
                 "rows_per_document": cfg.rows_per_document, "txt_documents": cfg.txt_documents},
        chunk_chars=cfg.chunk_chars,
        num_samples=total,
        num_tokens=num_tokens,
        objective_counts={o.key: objective_counts.get(int(o), 0) for o in Objective},
        nsp_counts={"random_next": random_next.get(1, 0), "true_next": random_next.get(0, 0)},
        documents={"read": stats.read, "skipped": stats.skipped, "skip_reasons": dict(sorted(stats.skip_reasons.items())),
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


def nothing_kept(what: str, inputs: Sequence[str], stats: DocumentStats) -> str:
    """Why ``inputs`` gave no ``what``: they hold no text, or every document was skipped (the reasons counted, with
    an example of each, which names the fix: a missing text field lists the record's fields and ``--text-field``)."""
    if not stats.read and not stats.skipped:
        return f"no {what} from {list(inputs)}: they hold no text (empty or whitespace-only files?); check the inputs"
    examples = "; ".join(f"{reason}: {where[0]}" for reason, where in sorted(stats.skip_examples.items()) if where)
    return (f"no {what} from {list(inputs)}: {stats.read} documents read, {stats.skipped} skipped "
            f"{stats.skip_reasons} (e.g. {examples}); check the inputs")


def _one_sentence_hint(documents: dict, every_input_is_rows: bool) -> str:
    """Advice when most documents are single sentences, by their size: short ones are probably one sentence
    per row; long ones are text in which the sentence splitter finds no sentence end."""
    single = documents["skip_reasons"].get("too_few_sentences", 0)
    read = documents["read"]
    if not read or single <= read / 2:
        return ""
    characters = documents.get("skip_characters", {}).get("too_few_sentences", 0)
    if characters > ONE_SENTENCE_CHARS * single:
        return (f"; {single} of {read} documents are single sentences of {characters // single} characters on "
                "average: the sentence splitter found no sentence end in them (it ends sentences at . ! ? "
                "followed by a space and a capital letter or digit, or in text without capitals any letter, and "
                "at 。！？); for text without these, give one sentence per line with --rows-as-sentences, or use "
                "--recipe gpt, which needs no sentences")
    if every_input_is_rows:
        return ""
    return (f"; {single} of {read} documents are single sentences: if the input has one sentence per row "
            "(as BookCorpus on the Hugging Face hub), pass --rows-as-sentences")


def skip_warning(manifest: dict) -> str | None:
    """A warning when more than 5% of the text read was skipped (by characters, so one dropped book counts as
    much as it is long; by documents for manifests without character counts), naming the reasons (None
    otherwise). Wikipedia redirects and non-article pages do not count: a dump is full of them by design."""
    docs = manifest["documents"]
    expected = sum(docs["skip_reasons"].get(r, 0) for r in EXPECTED_SKIPS)
    skipped, read = docs["skipped"] - expected, docs["read"] - expected
    if "characters" in docs:
        skipped_chars = sum(c for r, c in docs["skip_characters"].items() if r not in EXPECTED_SKIPS)
        read_chars = docs["characters"] - sum(docs["skip_characters"].get(r, 0) for r in EXPECTED_SKIPS)
        if skipped_chars <= SKIP_WARNING_FRACTION * read_chars:
            return None
        share = f"{skipped_chars / read_chars:.0%} of the characters read"
    elif skipped <= SKIP_WARNING_FRACTION * read:
        return None
    else:
        share = f"{skipped / read:.0%}"
    rows = set(manifest.get("reading", {}).get("rows_as_sentences", []))
    examples = "; ".join(f"{reason}: {where[0]}" for reason, where in sorted(docs.get("skip_examples", {}).items())
                         if where)
    return (f"[build] warning: {skipped} of {read} documents ({share}) were skipped: {docs['skip_reasons']} (e.g. {examples}; more in manifest.json documents.skip_examples)"
            + _one_sentence_hint(docs, rows == set(manifest["inputs"])))


def random_next_warning(manifest: dict) -> str | None:
    """A warning when NSP pairs have a random next segment far less often than half the time (None otherwise)."""
    counts = manifest.get("nsp_counts", {})
    pairs = counts.get("random_next", 0) + counts.get("true_next", 0)
    if pairs < 100 or counts["random_next"] >= RANDOM_NEXT_WARNING * pairs:
        return None
    return (f"[build] warning: only {counts['random_next'] / pairs:.1%} of the {pairs} NSP pairs have a random next "
            "segment (the aim is 50 %): a pair draws one from another document of its chunk or the neighbouring "
            "chunk, else from its own document away from A, and these inputs offer neither (documents of a few "
            "sentences, each alone in its file?)")


def unk_warning(manifest: dict, vocab_name: str, casing_from: str | None = None) -> str | None:
    """A warning when more than 0.5 % of the word pieces are [UNK], naming the vocab and its casing; the other
    casing is suggested only when no file beside the vocab (``casing_from``) states it."""
    pieces = manifest.get("wordpieces", {})
    if not pieces.get("total") or pieces["unk"] <= UNK_WARNING_FRACTION * pieces["total"]:
        return None
    uncased = manifest["vocab"]["uncased"]
    casing = "uncased" if uncased else "cased"
    fix = "use a vocab made for this text (--train-vocab SIZE --vocab-out PATH)"
    if casing_from is None:
        fix = (f"a vocab read with the wrong casing does this: pass {'--cased' if uncased else '--uncased'} if the "
               f"vocab is {'cased' if uncased else 'uncased'}; else {fix}")
    else:
        casing += f", as {casing_from} states"
    return (f"[build] warning: {pieces['unk'] / pieces['total']:.1%} of the word pieces are [UNK]: vocab "
            f"{vocab_name} ({casing}) does not cover this text; {fix}")


def build(cfg: BuildConfig, out: Path, workers: int = 1, overwrite: bool = False, progress: bool = True) -> dict:
    """Single-machine build: one builder, then finalize, under one exclusive lock. Returns the manifest."""
    with claim_output(out) as lock:
        run_builder(cfg, out, workers=workers, overwrite=overwrite, progress=progress, lock=lock)
        return finalize(out, lock)


def training_documents(inputs: Sequence[str], cfg: BuildConfig | None = None) -> Iterator[str]:
    """Cleaned documents of the inputs, streamed (what --train-vocab learns from); ``cfg`` says how to read them.

    Inputs that yield no text at all raise ``SourceError`` once read, as the shard build refuses them
    (``nothing_kept``): the vocabulary trainer reads the documents before it writes anything, so a vocabulary of
    only the special tokens is never written."""
    stats = DocumentStats()
    for spec in inputs:
        options = cfg.read_options(spec) if cfg else ReadOptions()
        for number, record in enumerate(read_documents(spec, options)):
            stats.read += 1
            if isinstance(record, Skipped):
                stats.skip(record.reason, record.where, record.chars)
            elif text := clean_document(record):
                yield text
            else:
                stats.skip("empty", f"{spec} document {number}", len(record))
    if stats.read == stats.skipped:
        raise SourceError(nothing_kept("text to train a vocabulary on", inputs, stats))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m data_prep.build", description=__doc__.split("\n")[0])
    p.add_argument("--input", nargs="+", action="extend", default=[], metavar="SRC",
                   help="file (.xml[.bz2] .jsonl .json .parquet .txt; .jsonl .json .txt also .gz .bz2 .xz .zst; "
                        "WikiExtractor's wiki_NN), "
                        "directory (files named by split: split train, or DIR::SPLIT), or HF dataset "
                        "name[:config][:split]; repeatable")
    p.add_argument("--text-field", default=TEXT_FIELD, metavar="NAME",
                   help="field / column of JSON, parquet and dataset records that holds the text "
                        f"(default {TEXT_FIELD})")
    p.add_argument("--rows-as-sentences", nargs="*", metavar="SRC",
                   help="rows are sentences of a running text (BookCorpus on the hub): consecutive rows form one "
                        "document; alone it applies to every --input, else to the inputs named (.txt: a row is a line)")
    p.add_argument("--rows-per-document", type=int, default=ROWS_PER_DOCUMENT, metavar="N",
                   help=f"with --rows-as-sentences: rows per document (default {ROWS_PER_DOCUMENT}; an empty row "
                        "ends a document early)")
    p.add_argument("--txt-documents", choices=TXT_DOCUMENTS, default=TXT_DOCUMENTS[0],
                   help="what a document of a .txt input is: blank-line (documents separated by blank lines, BERT's "
                        "convention; the default), line (one document per line), file (the whole file, its blank "
                        "lines ending paragraphs: a directory of articles or books)")
    p.add_argument("--vocab", type=Path, help="BERT vocab.txt, a Hugging Face model/tokenizer directory, or a "
                                              "tokenizer.json (WordPiece); casing is read from its tokenizer config")
    casing = p.add_mutually_exclusive_group()
    casing.add_argument("--uncased", action="store_const", const=True, dest="uncased",
                        help="lowercase and strip accents (default: what --vocab's tokenizer config says, else the "
                             "vocab's own word pieces: uncased when none changes under lower-casing)")
    casing.add_argument("--cased", action="store_const", const=False, dest="uncased",
                        help="keep case; refused if --vocab's tokenizer config lowercases")
    p.add_argument("--train-vocab", type=int, metavar="SIZE", help="train a WordPiece vocab of SIZE on the inputs")
    p.add_argument("--vocab-out", type=Path, help="where --train-vocab writes the vocab; a tokenizer_config.json "
                                                  "beside it states its casing (an existing one: --overwrite)")
    p.add_argument("--recipe", default="unilm", help=f"one of {', '.join(RECIPES)} (default unilm)")
    p.add_argument("--objective-mix", default="", help="unilm only: e.g. bidirectional=0.5,seq2seq=0.5")
    p.add_argument("--max-seq-len", type=int, default=128, help="tokens per sample, [CLS]/[SEP] included (default 128)")
    p.add_argument("--short-seq-prob", type=float, default=0.1,
                   help="share of samples (every objective) built to a random shorter length, as BERT's "
                        "short_seq_prob (default 0.1)")
    p.add_argument("--mask-prob", type=float, default=0.15, help="share of tokens masked (default 0.15)")
    p.add_argument("--max-predictions", type=int,
                   help="cap on masked tokens per sample (default round(--mask-prob x --max-seq-len): 19 at 128, 77 at "
                        "512 with 0.15)")
    p.add_argument("--dupe-factor", type=int, default=1,
                   help="differently-masked copies of each instance (BERT: 10; see docs/shard_format.md)")
    p.add_argument("--seed", type=int, default=1, help="seeds every random choice of the build (default 1)")
    p.add_argument("--workers", type=int, default=1, help="processes on this machine (output is identical; default 1)")
    p.add_argument("--num-builders", type=int, default=1,
                   help="split the work across K machines: each reads only its units (files, 256 MiB ranges of "
                        ".jsonl files, dataset shards)")
    p.add_argument("--builder-index", type=int, default=0, help="this machine's share, 0..K-1")
    p.add_argument("--finalize", action="store_true", help="after all builders: write shards + manifest in --out")
    p.add_argument("--samples-per-shard", type=int, default=65536, help="upper bound per shard file (default 65536)")
    p.add_argument("--chunk-chars", type=int, default=500_000,
                   help="characters per work unit (affects output; default 500000)")
    p.add_argument("--out", type=Path, help="output directory (assembled beside it, renamed into place when done)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing build in --out (it stays until the new one is complete) and an "
                        "existing --vocab-out")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def _resolve_vocab(args: argparse.Namespace) -> tuple[Path, bool]:
    """(vocab.txt, uncased) for --vocab; a tokenizer.json's vocabulary is written beside the output first."""
    source = resolve_vocab_source(args.vocab)
    source.load()  # a vocabulary that cannot be used is named as given, before anything is written
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
              f"the default is {default_max_predictions(max_seq_len, masking.mask_prob)}", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with signals.stop_once():
        _main(args)


def _main(args: argparse.Namespace) -> None:
    try:
        if args.finalize:
            if args.out is None:
                raise ValueError("--finalize needs --out DIR")
            _report(finalize(args.out), args.out, str(args.out / VOCAB_NAME))
            return
        if not args.input:
            raise ValueError("give at least one --input")
        for spec in args.input:
            check_input(spec)
        if args.workers < 1:
            raise ValueError(f"--workers {args.workers}: give at least 1 (processes on this machine)")
        if not 0 <= args.builder_index < args.num_builders:
            raise ValueError(f"--builder-index {args.builder_index} must be in [0, --num-builders {args.num_builders})")
        if not 0 < args.mask_prob < 1:  # NaN fails too (before the default --max-predictions is worked out of it)
            raise ValueError(f"--mask-prob {args.mask_prob} must be a probability in (0, 1)")
        sentence_inputs = tuple(args.input if args.rows_as_sentences == [] else args.rows_as_sentences or ())
        max_predictions = default_max_predictions(args.max_seq_len, args.mask_prob) if args.max_predictions is None \
            else args.max_predictions
        # every setting is checked before any work (--train-vocab reads the inputs with the reading settings)
        settings = BuildConfig(
            inputs=tuple(args.input), vocab_path="", vocab_sha256="",
            instances=InstanceConfig(recipe=args.recipe, max_seq_len=args.max_seq_len,
                                     short_seq_prob=args.short_seq_prob,
                                     objective_mix=parse_objective_mix(args.objective_mix)),
            masking=MaskingConfig.for_recipe(args.recipe, mask_prob=args.mask_prob, max_predictions=max_predictions),
            seed=args.seed,
            dupe_factor=args.dupe_factor, samples_per_shard=args.samples_per_shard, chunk_chars=args.chunk_chars,
            text_field=args.text_field, sentence_inputs=sentence_inputs, rows_per_document=args.rows_per_document,
            txt_documents=args.txt_documents)
        if args.max_predictions is not None:
            _warn_low_cap(settings.masking, args.max_seq_len)
        if args.train_vocab is not None:
            if args.vocab_out is None:
                raise ValueError("--train-vocab needs --vocab-out PATH")
            _check_vocab_out(args.vocab_out, args.overwrite)
            args.uncased = bool(args.uncased)  # the build below encodes as the vocab was trained
            vocab = train_vocab(lambda: training_documents(args.input, settings), args.train_vocab, args.vocab_out,
                                args.uncased)
            print(f"[build] trained a {vocab.size}-entry {'uncased' if args.uncased else 'cased'} WordPiece vocab "
                  f"-> {args.vocab_out} (its casing in {args.vocab_out.parent / HF_TOKENIZER_CONFIG})")
            if vocab.size < args.train_vocab:
                print(f"[build] note: --train-vocab {args.train_vocab} asked for more entries than these inputs "
                      f"yield: every word piece seen is in the {vocab.size}", file=sys.stderr)
            if args.out is None:
                return
            args.vocab = args.vocab_out
        if args.vocab is None or args.out is None:
            raise ValueError("give --vocab VOCAB (or --train-vocab SIZE --vocab-out PATH) and --out DIR")
        with claim_output(args.out, args.builder_index, args.num_builders) as lock:
            vocab_path, uncased = _resolve_vocab(args)
            cfg = dataclasses.replace(settings, vocab_path=str(vocab_path), vocab_sha256=load_vocab(vocab_path).sha256,
                                      uncased=uncased)
            stats = run_builder(cfg, args.out, workers=args.workers, builder_index=args.builder_index,
                                num_builders=args.num_builders, overwrite=args.overwrite, progress=not args.quiet,
                                lock=lock)
            if args.num_builders == 1:
                manifest = finalize(args.out, lock)
        if args.num_builders == 1:
            _report(manifest, args.out, str(args.vocab), resolve_vocab_source(args.vocab).casing_from)
        else:
            print(f"[build] builder {args.builder_index}/{args.num_builders}: {stats.read} documents read; "
                  f"when all builders are done run: python -m data_prep.build --finalize --out {args.out}")
    except (ValueError, OSError) as err:  # our errors are ValueError subclasses that name the file and the fix
        sys.exit(f"data_prep.build: error: {err}")
    except KeyboardInterrupt as stop:  # a build replaces --out only once complete; the next run clears the staging
        said, code = signals.describe(stop)
        print(f"data_prep.build: {said}" + (f"; {args.out} holds what it held before this run, and a rerun clears "
                                           "the half-built leftovers" if args.out else ""), file=sys.stderr)
        sys.exit(code)


def _check_vocab_out(vocab_out: Path, overwrite: bool) -> None:
    """Refuse to replace an existing vocab, or the tokenizer config beside it, unless ``--overwrite``."""
    existing = [p for p in (vocab_out, vocab_out.parent / HF_TOKENIZER_CONFIG) if p.exists()]
    if existing and not overwrite:
        raise ValueError(f"--vocab-out {vocab_out}: {' and '.join(map(str, existing))} exist(s), and --train-vocab "
                         f"writes both; pass --overwrite to replace them (shards built on the old vocab keep their "
                         "copy), or choose another --vocab-out")


def _report(manifest: dict, out: Path, vocab_name: str, casing_from: str | None = None) -> None:
    docs = manifest["documents"]
    print(f"[build] {manifest['num_samples']} samples, {manifest['num_tokens']} tokens in {len(manifest['shards'])} "
          f"shard(s) -> {out}; documents read {docs['read']}, skipped {docs['skipped']} {docs['skip_reasons']}")
    if docs.get("repaired_lines"):
        print(f"[build] {docs['repaired_lines']} line(s) of text inputs held bytes that are not UTF-8, replaced by "
              f"U+FFFD (e.g. {docs['repair_examples'][0]}; more in manifest.json documents.repair_examples)",
              file=sys.stderr)
    for warning in (skip_warning(manifest), random_next_warning(manifest),
                    unk_warning(manifest, vocab_name, casing_from)):
        if warning:
            print(warning, file=sys.stderr)


if __name__ == "__main__":
    main()
