"""A chunk's documents into instances, masked, packed as one part file in the shard format (``process_chunk``).

In a worker process each chunk is cleaned (Wikipedia markup too), sentence-split, batch-encoded with
``tokenizers``, turned into instances (``data_prep.instances``) and masked, with randomness seeded by (seed, unit,
document index in the unit, copy), so the bytes never depend on which worker or builder did the work.
"""
from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

from data_prep.chunks import Chunk
from data_prep.config import BuildConfig
from data_prep.instances import Instance, Uniforms, document_instances, mask_samples, masking_budget
from data_prep.records import RepairedText, Skipped
from data_prep.report import DocumentStats
from data_prep.shard_format import INDEX_DTYPE, Objective, ShardArrays, token_dtype, write_shard
from data_prep.text import clean_document, split_sentences
from data_prep.vocab import Vocab, VocabError, load_encoder, load_vocab
from data_prep.whole_words import continuation_table, mask_whole_words
from data_prep.wiki_dump import SpilledPage, document_text

ENCODE_BATCH = 4096
"""sentences encoded at once: bounds the memory of one huge document (tokenizers' Encoding objects are large)"""


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
        if isinstance(record, SpilledPage):  # its text, which a reader wrote to a file, is read back here
            record = record.load()
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


@functools.lru_cache(maxsize=4)
def _continuations(tokens: tuple[str, ...]) -> np.ndarray:
    return continuation_table(tokens)


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
            a_length = len(flat) - start
            if inst.tokens_b is not None:
                flat.extend(inst.tokens_b)
                flat.append(sep)
            rows.append((len(flat) - start, a_length, int(inst.objective), inst.is_random_next))
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
        if cfg.instances.masked and cfg.masking.whole_word_mask:
            per_sample = [rng for doc, samples in zip(doc_indices, samples_per_doc)  # a document's generator
                          for rng in [np.random.default_rng([cfg.seed, unit, doc, copy + 1])] * samples]
            num_masked, positions, labels = mask_whole_words(tokens, offset, length, len_a, per_sample, cfg.masking,
                                                             special["mask"], random_ids,
                                                             _continuations(vocab.tokens))
        elif cfg.instances.masked:
            maskable = length - np.where(len_a == length, 2, 3)
            need = np.add.reduceat(3 * masking_budget(maskable, cfg.masking) + maskable,
                                   np.cumsum([0] + samples_per_doc[:-1]))
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

