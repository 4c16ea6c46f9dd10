"""Whole-word masking: masked spans cover every word piece of each word they touch (``mask_whole_words``).

A word is a piece and the ``##`` continuations after it (``continuation_table``); the pre-tokenizer splits the
characters of scripts written without spaces (CJK) into words of their own, so each such character is a word.
A piece that opens a segment is a word start even when it is a continuation (its start was cut off). The budget
is counted in tokens as for token masking (``masking_budget``): words are visited in a random order, as in BERT's
``create_pretraining_data``, and a word (or span of words) that would overshoot the budget is shortened to the
words that fit or skipped in favour of a later one. Span lengths (UniLM's bigrams and trigrams) count words, and
spans of several words keep an unmasked word between them. The 80/10/10 replacement is drawn once per word, so
all pieces of a word are [MASK], all random or all kept. [CLS]/[SEP] are never masked.
"""
from __future__ import annotations

import numpy as np

from data_prep.instances import MaskingConfig, masking_budget, replace_masked

CONTINUATION = "##"


def continuation_table(tokens: tuple[str, ...]) -> np.ndarray:
    """bool [vocab size]: which ids are ``##`` continuation pieces."""
    return np.array([t.startswith(CONTINUATION) for t in tokens], dtype=bool)


def mask_whole_words(tokens: np.ndarray, token_offset: np.ndarray, length: np.ndarray,
                     segment_a_length: np.ndarray, rngs: list[np.random.Generator], cfg: MaskingConfig,
                     mask_id: int, random_ids: np.ndarray,
                     continuation: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mask S packed samples by whole words, in place in ``tokens``; sample s draws from ``rngs[s]``.

    The words of every sample are found at once; each sample then draws one block of uniforms (word order keys,
    span lengths and replacements per word, random tokens per position) and picks its words in a plain loop.
    Returns (num_masked [S], masked_positions [K] ascending within each sample, masked_labels [K]), as
    ``instances.mask_samples`` does."""
    if cfg.span_length_probs is None:
        raise ValueError("mask_whole_words needs the span lengths: MaskingConfig.resolved(recipe, max_seq_len)")
    num_samples = len(length)
    offset = token_offset.astype(np.int64)
    size = length.astype(np.int64)
    len_a = segment_a_length.astype(np.int64)
    pair = len_a < size
    stop = int((offset + size).max()) if num_samples else 0
    maskable = np.ones(stop, bool)
    maskable[offset] = False
    maskable[offset + size - 1] = False
    maskable[(offset + len_a - 1)[pair]] = False
    opens = np.zeros(stop, bool)
    opens[offset + 1] = True
    opens[(offset + len_a)[pair]] = True
    starts = maskable & (opens | ~continuation[tokens[:stop]])
    boundaries = np.flatnonzero(starts | ~maskable)
    word_start = np.flatnonzero(starts)
    word_size = boundaries[np.searchsorted(boundaries, word_start, side="right")] - word_start
    word_sample = np.searchsorted(offset, word_start, side="right") - 1
    words = np.bincount(word_sample, minlength=num_samples)
    first_word = np.cumsum(words) - words
    budget = masking_budget(size - np.where(pair, 3, 2), cfg)
    block = 3 * words + size
    block_start = np.cumsum(block) - block
    uniforms = _draw(rngs, block)
    local = np.arange(len(word_start)) - first_word[word_sample]  # a word's index in its sample
    keys = uniforms[block_start[word_sample] + local]
    order = np.lexsort((keys, word_sample))  # by sample, then by its random key
    order_in_sample = (order - first_word[word_sample[order]]).tolist()
    cumulative = np.cumsum(cfg.span_length_probs)[:-1]
    spans = (1 + np.searchsorted(cumulative, uniforms[block_start[word_sample] + words[word_sample] + local],
                                 side="right")).tolist()
    apart = len(cfg.span_length_probs) > 1
    sizes = word_size.tolist()
    chosen: list[int] = []
    for count, first, tokens_left in zip(words.tolist(), first_word.tolist(), budget.tolist()):
        if count:
            chosen += _choose(sizes[first:first + count], order_in_sample[first:first + count],
                              spans[first:first + count], tokens_left, apart, first)
    picked = np.sort(np.array(chosen, dtype=np.int64))
    piece_count = word_size[picked]
    sample_of_word = np.searchsorted(first_word, picked, side="right") - 1
    # first_word repeats where samples have no words: searchsorted right gives the last sample starting there
    absolute = np.repeat(word_start[picked], piece_count) + (
        np.arange(int(piece_count.sum())) - np.repeat(np.cumsum(piece_count) - piece_count, piece_count))
    sample_of = np.repeat(sample_of_word, piece_count)
    num_masked = np.bincount(sample_of, minlength=num_samples).astype(np.int64)
    positions = absolute - offset[sample_of]
    u_replace = np.repeat(uniforms[block_start[sample_of_word] + 2 * words[sample_of_word]
                                   + (picked - first_word[sample_of_word])], piece_count)  # one draw per word
    u_token = uniforms[block_start[sample_of] + 3 * words[sample_of] + positions]
    return num_masked, positions, replace_masked(tokens, absolute, u_replace, u_token, cfg, mask_id, random_ids)


def _draw(rngs: list[np.random.Generator], block: np.ndarray) -> np.ndarray:
    """``block[s]`` uniforms for each sample s from ``rngs[s]``, samples in order; consecutive samples of one
    generator (a document's) are drawn in one call, which gives the numbers of drawing them one by one."""
    parts = []
    i = 0
    while i < len(rngs):
        j = i + 1
        while j < len(rngs) and rngs[j] is rngs[i]:
            j += 1
        parts.append(rngs[i].random(int(block[i:j].sum())))
        i = j
    return np.concatenate(parts) if parts else np.zeros(0)


def _choose(sizes: list[int], order: list[int], spans: list[int], budget: int, apart: bool, first: int) -> list[int]:
    """The words (indices plus ``first``) masked in one sample: spans of whole words, at most ``budget`` tokens."""
    num_words = len(sizes)
    taken = bytearray(num_words)
    chosen: list[int] = []
    count = 0
    for start, span in zip(order, spans):
        if count >= budget:
            break
        stop = min(start + span, num_words)
        if any(taken[max(start - 1, 0):stop + 1] if apart else taken[start:stop]):
            continue
        tokens = 0
        fit = start
        while fit < stop and count + tokens + sizes[fit] <= budget:
            tokens += sizes[fit]
            fit += 1
        if fit == start:
            continue  # its first word would overshoot the budget: a later, shorter one may fit
        taken[start:fit] = b"\x01" * (fit - start)
        chosen.extend(range(first + start, first + fit))
        count += tokens
    return chosen


def word_breaks(tokens: np.ndarray, token_offset: np.ndarray, length: np.ndarray, segment_a_length: np.ndarray,
                num_masked: np.ndarray, positions: np.ndarray, labels: np.ndarray,
                continuation: np.ndarray) -> np.ndarray:
    """int [S]: per sample, the continuation pieces masked apart from their word (a masked continuation whose
    word start is unmasked, or an unmasked continuation of a masked word). Whole-word masking makes none."""
    if len(length) == 0:
        return np.zeros(0, np.int64)
    first, stop = int(token_offset.min()), int((token_offset + length).max())
    original = np.array(tokens[first:stop], dtype=np.int64)
    starts = token_offset.astype(np.int64) - first
    absolute = np.repeat(starts, num_masked) + positions
    original[absolute] = labels
    masked = np.zeros(len(original), bool)
    masked[absolute] = True
    inside = continuation[original]
    inside[starts] = False
    inside[np.minimum(starts + 1, len(original) - 1)] = False  # a segment's first piece starts a word
    pair = segment_a_length < length
    inside[starts[pair] + segment_a_length[pair].astype(np.int64)] = False
    broken = np.zeros(len(original), bool)
    broken[1:] = inside[1:] & (masked[1:] != masked[:-1])
    sample_of = np.searchsorted(starts, np.flatnonzero(broken), side="right") - 1
    return np.bincount(sample_of, minlength=len(length)).astype(np.int64)
