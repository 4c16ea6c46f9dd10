"""The shard format: magic bytes, version, writer and reader side by side (spec: ``docs/shard_format.md``).

A build directory holds ``manifest.json``, ``vocab.txt`` and ``shard-00000.bin`` … Each shard is one flat
little-endian file, read through ``numpy.memmap`` (a shard is never loaded whole, and nothing is pickled)::

    header   64 bytes   MAGIC, FORMAT_VERSION, token width (2 or 4 bytes), num_samples, num_tokens, num_masked
    index    num_samples × INDEX_DTYPE (32 bytes): token_offset, mask_offset, length, segment_a_length,
                                                   num_masked, objective, is_random_next
    tokens   num_tokens × uint16|uint32            input ids, masking already applied
    masked_positions  num_masked × uint16          ascending within a sample
    masked_labels     num_masked × uint16|uint32   original ids at those positions

Sections start on 8-byte boundaries. Token ids are uint16 when the vocab has < 65,536 entries, else uint32.
Files are written to a temporary name, fsynced and renamed, so a shard that exists is complete; the
manifest is written last and records a sha256 per shard, which ``ShardDataset.verify`` checks.
"""
from __future__ import annotations

import enum
import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from common.files import sha256_file, write_bytes_atomically, write_text_atomically

MAGIC = b"ULMSHARD"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
VOCAB_NAME = "vocab.txt"
SHARD_GLOB = "shard-*.bin"
MAX_SEQ_LEN_LIMIT = 65535  # masked positions are stored as uint16

_HEADER = struct.Struct("<8sIIQQQ")
HEADER_BYTES = 64

INDEX_DTYPE = np.dtype([
    ("token_offset", "<u8"),      # first token of the sample in the shard's token section
    ("mask_offset", "<u8"),       # first masked entry of the sample
    ("length", "<u4"),
    ("segment_a_length", "<u4"),  # [CLS] A [SEP], = length for single-segment samples
    ("num_masked", "<u4"),
    ("objective", "u1"),
    ("is_random_next", "i1"),     # 1 random B, 0 true continuation, -1 not applicable
    ("reserved", "<u2"),
])
assert INDEX_DTYPE.itemsize == 32


class Objective(enum.IntEnum):
    """Training objective of a sample; the ids are part of the shard format."""

    BIDIRECTIONAL = 0
    LEFT_TO_RIGHT = 1
    RIGHT_TO_LEFT = 2
    SEQ2SEQ = 3

    @property
    def key(self) -> str:
        """The name used in manifests, CLI mixes and inspection output (``bidirectional``, ``seq2seq`` …)."""
        return self.name.lower()


class ShardError(ValueError):
    """A shard, manifest or build directory that cannot be read as this format; the message names the file."""


@dataclass(frozen=True)
class Sample:
    """One training sequence as stored in a shard.

    input_ids: int64 [length], masking applied, ``[CLS] A [SEP]`` or ``[CLS] A [SEP] B [SEP]``.
    masked_positions / masked_labels: int64 [P], ascending positions and the original ids there.
    """

    input_ids: np.ndarray
    objective: int
    segment_a_length: int
    is_random_next: int
    masked_positions: np.ndarray
    masked_labels: np.ndarray

    @property
    def length(self) -> int:
        return int(len(self.input_ids))


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits, else uint32."""
    return np.dtype("<u2") if vocab_size <= 65536 else np.dtype("<u4")


def _align8(n: int) -> int:
    return (n + 7) // 8 * 8


@dataclass(frozen=True)
class ShardArrays:
    """The four sections of a shard as arrays (in memory while building, memmapped views when reading)."""

    index: np.ndarray             # INDEX_DTYPE [N]
    tokens: np.ndarray            # uint16|uint32 [T]
    masked_positions: np.ndarray  # uint16 [M]
    masked_labels: np.ndarray     # uint16|uint32 [M]

    def __len__(self) -> int:
        return len(self.index)

    @staticmethod
    def empty(dtype: np.dtype) -> ShardArrays:
        return ShardArrays(np.zeros(0, INDEX_DTYPE), np.zeros(0, dtype), np.zeros(0, "<u2"), np.zeros(0, dtype))

    @staticmethod
    def concatenate(parts: list[ShardArrays], dtype: np.dtype) -> ShardArrays:
        """Join parts in order, rebasing offsets; each part's offsets must start at 0."""
        parts = [p for p in parts if len(p)]
        if not parts:
            return ShardArrays.empty(dtype)
        index = np.concatenate([p.index for p in parts])
        token_base = np.cumsum([0] + [len(p.tokens) for p in parts[:-1]], dtype=np.uint64)
        mask_base = np.cumsum([0] + [len(p.masked_positions) for p in parts[:-1]], dtype=np.uint64)
        counts = [len(p) for p in parts]
        index["token_offset"] += np.repeat(token_base, counts)
        index["mask_offset"] += np.repeat(mask_base, counts)
        return ShardArrays(index,
                           np.concatenate([p.tokens for p in parts]).astype(dtype, copy=False),
                           np.concatenate([p.masked_positions for p in parts]).astype("<u2", copy=False),
                           np.concatenate([p.masked_labels for p in parts]).astype(dtype, copy=False))

    def select(self, start: int, stop: int) -> ShardArrays:
        """Samples [start, stop) as a self-contained copy with offsets rebased to 0."""
        index = np.array(self.index[start:stop])
        if len(index) == 0:
            return ShardArrays.empty(self.tokens.dtype)
        t0, m0 = int(index["token_offset"][0]), int(index["mask_offset"][0])
        last = index[-1]
        t1 = int(last["token_offset"]) + int(last["length"])
        m1 = int(last["mask_offset"]) + int(last["num_masked"])
        index["token_offset"] -= t0
        index["mask_offset"] -= m0
        return ShardArrays(index, np.array(self.tokens[t0:t1]), np.array(self.masked_positions[m0:m1]),
                           np.array(self.masked_labels[m0:m1]))


def write_shard(path: Path, arrays: ShardArrays, durable: bool = True) -> None:
    """Write one shard file atomically. Token width follows ``arrays.tokens.dtype`` (uint16 or uint32).

    ``durable=False`` skips the fsync, for intermediate files that a crash would make us rebuild anyway.
    """
    width = arrays.tokens.dtype.itemsize
    if width not in (2, 4) or arrays.masked_labels.dtype.itemsize != width:
        raise ValueError(f"token arrays must be uint16 or uint32 with matching labels, got {arrays.tokens.dtype}")
    header = _HEADER.pack(MAGIC, FORMAT_VERSION, width, len(arrays.index), len(arrays.tokens),
                          len(arrays.masked_positions))
    sections = [np.ascontiguousarray(arrays.index, INDEX_DTYPE),
                np.ascontiguousarray(arrays.tokens, f"<u{width}"),
                np.ascontiguousarray(arrays.masked_positions, "<u2"),
                np.ascontiguousarray(arrays.masked_labels, f"<u{width}")]
    chunks: list[bytes | memoryview] = [header.ljust(HEADER_BYTES, b"\0")]
    for section in sections:
        data = section.tobytes()
        chunks.append(data + b"\0" * (_align8(len(data)) - len(data)))
    write_bytes_atomically(path, chunks, durable)


class ShardFile:
    """A memory-mapped shard; checks the whole header, the file size and the index on open (objective ids,
    lengths: one vectorised pass over the index, never the tokens) and each sample's token ids and
    masked positions when it is read (ids below ``vocab_size`` when given, positions inside the sample)."""

    def __init__(self, path: Path | str, vocab_size: int | None = None, max_seq_len: int | None = None):
        self.path = Path(path)
        self.vocab_size = vocab_size
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            raise ShardError(f"{self.path}: shard file is missing") from None
        if size < HEADER_BYTES:
            raise ShardError(f"{self.path}: {size} bytes is shorter than the {HEADER_BYTES}-byte header "
                             "(truncated file?); rebuild the shards")
        with open(self.path, "rb") as f:
            header = f.read(HEADER_BYTES)
        magic, version, width, num_samples, num_tokens, num_masked = _HEADER.unpack_from(header)
        if magic != MAGIC:
            raise ShardError(f"{self.path}: not a shard of this project (magic {magic!r}, expected {MAGIC!r})")
        if version != FORMAT_VERSION:
            raise ShardError(f"{self.path}: shard format version {version}, this code reads version "
                             f"{FORMAT_VERSION}; rebuild the shards with this version of data_prep")
        if width not in (2, 4) or any(header[_HEADER.size:]):
            raise ShardError(f"{self.path}: corrupt header (token width {width}, padding "
                             f"{header[_HEADER.size:].hex()}); rebuild the shards")
        dtype = np.dtype(f"<u{width}")
        sizes = [num_samples * INDEX_DTYPE.itemsize, num_tokens * width, num_masked * 2, num_masked * width]
        expected = HEADER_BYTES + sum(_align8(s) for s in sizes)
        if size != expected:
            raise ShardError(f"{self.path}: {size} bytes but its header describes {expected} "
                             "(truncated or appended to); rebuild the shards")
        mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        offset = HEADER_BYTES
        views = []
        for nbytes, view_dtype in zip(sizes, [INDEX_DTYPE, dtype, np.dtype("<u2"), dtype]):
            views.append(mm[offset:offset + nbytes].view(view_dtype))
            offset += _align8(nbytes)
        self.arrays = ShardArrays(*views)
        self.token_dtype = dtype
        self._check_index(max_seq_len)
        self._bad_samples: set[int] | range | None = None  # found on the first read

    def _check_index(self, max_seq_len: int | None) -> None:
        """Refuse an index whose samples could not be valid, naming the first bad sample (offsets are checked
        when a sample is read: one bad offset leaves the other samples readable)."""
        index = self.arrays.index
        if not len(index):
            return
        length = index["length"].astype(np.int64)
        problems = [
            (~np.isin(index["objective"], [int(o) for o in Objective]), "objective id is not one of "
             f"{[int(o) for o in Objective]}"),
            (length < 1, "length is 0"),
            (index["segment_a_length"] > index["length"], "segment_a_length exceeds its length"),
            (index["num_masked"] > index["length"], "more masked positions than tokens"),
        ]
        if max_seq_len is not None:
            problems.append((length > max_seq_len, f"length exceeds the manifest's max_seq_len {max_seq_len}"))
        for bad, what in problems:
            if bad.any():
                sample = int(np.argmax(bad))
                raise ShardError(f"{self.path}: sample {sample}: {what} ({int(bad.sum())} such sample(s); corrupt "
                                 "or hand-made shard); rebuild the shards")

    def __len__(self) -> int:
        return len(self.arrays.index)

    def __getitem__(self, i: int) -> Sample:
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range for {self.path} ({len(self)} samples)")
        row = self.arrays.index[i]
        t0, m0 = int(row["token_offset"]), int(row["mask_offset"])
        length, num_masked = int(row["length"]), int(row["num_masked"])
        if t0 + length > len(self.arrays.tokens) or m0 + num_masked > len(self.arrays.masked_positions):
            raise ShardError(f"{self.path}: sample {i} points outside the file (corrupt index); rebuild the shards")
        sample = Sample(input_ids=self.arrays.tokens[t0:t0 + length].astype(np.int64),
                        objective=int(row["objective"]),
                        segment_a_length=int(row["segment_a_length"]),
                        is_random_next=int(row["is_random_next"]),
                        masked_positions=self.arrays.masked_positions[m0:m0 + num_masked].astype(np.int64),
                        masked_labels=self.arrays.masked_labels[m0:m0 + num_masked].astype(np.int64))
        if self._bad_samples is None:
            self._bad_samples = self._find_bad_samples()
        if i in self._bad_samples:
            self._check_sample(i, sample)
        return sample

    def _find_bad_samples(self) -> set[int] | range:
        """Samples whose token ids or masked entries are out of range, found in one vectorised pass over this
        shard's sections (on its first read; a few ms per 10 MB). Shards whose samples do not tile their sections
        in order (never written by ``write_shard``) get every sample checked one by one instead."""
        index, arrays = self.arrays.index, self.arrays
        length = index["length"].astype(np.int64)
        num_masked = index["num_masked"].astype(np.int64)
        token_ends, mask_ends = np.cumsum(length), np.cumsum(num_masked)
        tiled = (np.array_equal(index["token_offset"].astype(np.int64), token_ends - length)
                 and np.array_equal(index["mask_offset"].astype(np.int64), mask_ends - num_masked)
                 and (not len(index) or (token_ends[-1] == len(arrays.tokens)
                                         and mask_ends[-1] == len(arrays.masked_positions))))
        if not tiled:
            return range(len(self))
        bad: set[int] = set()
        limit = self.vocab_size
        if limit is not None and len(arrays.tokens) and int(arrays.tokens.max()) >= limit:
            positions = np.flatnonzero(arrays.tokens >= limit)
            bad.update(np.searchsorted(token_ends, positions, side="right").tolist())
        if len(arrays.masked_positions):
            owner_length = np.repeat(length, num_masked)
            wrong = arrays.masked_positions >= owner_length
            if limit is not None:
                wrong |= arrays.masked_labels >= limit
            if wrong.any():
                bad.update(np.searchsorted(mask_ends, np.flatnonzero(wrong), side="right").tolist())
        return bad

    def _check_sample(self, i: int, sample: Sample) -> None:
        """Token ids inside the vocabulary, masked positions inside the sample (a few comparisons per sample)."""
        if self.vocab_size is not None:
            for name in ("input_ids", "masked_labels"):
                ids = getattr(sample, name)
                if len(ids) and int(ids.max()) >= self.vocab_size:
                    raise ShardError(f"{self.path}: sample {i}: {name} holds id {int(ids.max())}, not below the "
                                     f"vocabulary size {self.vocab_size}; rebuild the shards")
        positions = sample.masked_positions
        if len(positions) and int(positions.max()) >= sample.length:
            raise ShardError(f"{self.path}: sample {i}: masked position {int(positions.max())} is not inside its "
                             f"{sample.length} tokens; rebuild the shards")

    def __iter__(self) -> Iterator[Sample]:
        return (self[i] for i in range(len(self)))


def write_json(path: Path, payload: dict[str, Any]) -> None:
    """Atomic, deterministic JSON (sorted keys) — manifests must be byte-identical across rebuilds."""
    write_text_atomically(path, json.dumps(payload, indent=2, sort_keys=True) + "\n")


def read_manifest(directory: Path | str) -> dict[str, Any]:
    """Load and validate ``manifest.json``: refuses other format versions and missing fields, naming the file."""
    path = Path(directory) / MANIFEST_NAME
    if not path.is_file():
        raise ShardError(f"{path}: no manifest; {directory} is not a finished shard build "
                         "(build it: `make shards SHARDS=DIR RECIPE=...` or `python -m data_prep.build ... --out DIR`; "
                         "`--finalize` after multi-builder runs)")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ShardError(f"{path}: not valid JSON ({err}); rebuild the shards") from None
    if not isinstance(manifest, dict) or manifest.get("format") != "unilm-shards":
        raise ShardError(f"{path}: not a manifest of this project's shard format")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise ShardError(f"{path}: shard format version {version}, this code reads version {FORMAT_VERSION}; "
                         "rebuild the shards with this version of data_prep")
    missing = [k for k in ("shards", "vocab", "num_samples", "max_seq_len", "recipe", "token_dtype")
               if k not in manifest]
    if missing:
        raise ShardError(f"{path}: manifest lacks field(s) {missing}; rebuild the shards")
    # a hand-edited manifest must fail here, naming the file, not later as a KeyError deep in the trainer
    shards, vocab = manifest["shards"], manifest["vocab"]
    entry_fields = {"file": str, "num_samples": int, "bytes": int, "sha256": str}
    if not isinstance(shards, list) or not all(
            isinstance(e, dict) and all(isinstance(e.get(k), t) for k, t in entry_fields.items()) for e in shards):
        raise ShardError(f"{path}: 'shards' must list {{file, num_samples, bytes, sha256}} entries; rebuild the shards")
    names = [e["file"] for e in shards]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise ShardError(f"{path}: shard(s) {twice} listed more than once (their samples would be trained twice); "
                         "rebuild the shards")
    outside = [e["file"] for e in shards if Path(e["file"]).name != e["file"] or not e["file"].startswith("shard-")]
    if outside:
        raise ShardError(f"{path}: shard file(s) {outside} are not shard-*.bin names inside {directory}")
    if not isinstance(vocab, dict) or not isinstance(vocab.get("sha256"), str) or \
            not isinstance(vocab.get("special_tokens"), dict):
        raise ShardError(f"{path}: 'vocab' lacks sha256 or special_tokens; rebuild the shards")
    if sum(e["num_samples"] for e in shards) != manifest["num_samples"]:
        raise ShardError(f"{path}: num_samples {manifest['num_samples']} differs from the sum over its shards "
                         f"({sum(e['num_samples'] for e in shards)}); rebuild the shards")
    if manifest["token_dtype"] not in ("uint16", "uint32"):
        raise ShardError(f"{path}: token_dtype {manifest['token_dtype']!r} is not uint16 or uint32")
    return manifest


def _vocab_size(vocab: dict[str, Any]) -> int | None:
    size = vocab.get("size")
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None


class ShardDataset:
    """All shards of a build directory as one indexable sequence of ``Sample`` (shards in manifest order).

    Opening checks the manifest (version, fields, counts), the copied vocab's sha256 (a small file) and each
    shard's existence, size, magic, version, token width and sample count — everything short of reading the
    shards; ``verify()`` also compares every shard with its sha256 (bytes flipped inside a shard show up only
    there).
    """

    def __init__(self, directory: Path | str):
        self.directory = Path(directory)
        self.manifest = read_manifest(self.directory)
        vocab = self.directory / VOCAB_NAME
        if vocab.is_file() and sha256_file(vocab) != self.manifest["vocab"]["sha256"]:
            raise ShardError(f"{vocab}: not the vocab these shards were built with (sha256 differs from "
                             f"{self.directory / MANIFEST_NAME}); restore it or rebuild the shards")
        self.shards: list[ShardFile] = []
        for entry in self.manifest["shards"]:
            path = self.directory / entry["file"]
            if not path.is_file():
                raise ShardError(f"{path}: shard listed in the manifest is missing")
            if path.stat().st_size != entry["bytes"]:
                raise ShardError(f"{path}: {path.stat().st_size} bytes, the manifest records {entry['bytes']} "
                                 "(truncated or modified); rebuild the shards")
            shard = ShardFile(path, vocab_size=_vocab_size(self.manifest["vocab"]),
                              max_seq_len=self.manifest["max_seq_len"])
            if len(shard) != entry["num_samples"]:
                raise ShardError(f"{path}: {len(shard)} samples, the manifest records {entry['num_samples']}")
            if shard.token_dtype.name != self.manifest["token_dtype"]:
                raise ShardError(f"{path}: {shard.token_dtype.name} token ids, the manifest records "
                                 f"{self.manifest['token_dtype']} (a shard of a build with another vocab?)")
            self.shards.append(shard)
        self._ends = np.cumsum([len(s) for s in self.shards], dtype=np.int64)

    def __len__(self) -> int:
        return int(self._ends[-1]) if len(self._ends) else 0

    def __getitem__(self, i: int) -> Sample:
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range ({len(self)} samples in {self.directory})")
        shard = int(np.searchsorted(self._ends, i, side="right"))
        start = int(self._ends[shard - 1]) if shard else 0
        return self.shards[shard][i - start]

    def index_rows(self, indices: np.ndarray) -> np.ndarray:
        """The index records (``INDEX_DTYPE``: length, num_masked, objective, is_random_next, …) of the samples at
        global ``indices``, read without their tokens."""
        indices = np.asarray(indices, dtype=np.int64)
        shard_of = np.searchsorted(self._ends, indices, side="right")
        rows = np.empty(len(indices), dtype=INDEX_DTYPE)
        for shard in np.unique(shard_of):
            chosen = shard_of == shard
            start = int(self._ends[shard - 1]) if shard else 0
            rows[chosen] = self.shards[int(shard)].arrays.index[indices[chosen] - start]
        return rows

    def __iter__(self) -> Iterator[Sample]:
        for shard in self.shards:
            yield from shard

    @property
    def special_tokens(self) -> dict[str, int]:
        """``pad``, ``unk``, ``cls``, ``sep``, ``mask`` ids of the vocab the shards were built with."""
        return dict(self.manifest["vocab"]["special_tokens"])

    def verify(self, part: int = 0, parts: int = 1) -> None:
        """Check every shard against the manifest sha256 (the vocab was checked on open); raise naming bad files.
        ``part`` of ``parts``: only every ``parts``-th shard from ``part`` on (ranks sharing the work)."""
        bad = []
        for entry in self.manifest["shards"][part::parts]:
            if sha256_file(self.directory / entry["file"]) != entry["sha256"]:
                bad.append(str(self.directory / entry["file"]))
        if bad:
            raise ShardError(f"sha256 mismatch (modified or corrupt): {', '.join(bad)}; rebuild the shards")


def manifest_dict(**fields: Any) -> dict[str, Any]:
    """A manifest with the format fields set; callers pass the build description (see ``data_prep.build``)."""
    return {"format": "unilm-shards", "format_version": FORMAT_VERSION, **fields}

