"""The vectorised masking: a property test on random sample layouts, and each recipe's span lengths in real builds."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from data_prep.inspect import shard_statistics
from data_prep.instances import MaskingConfig, mask_samples, masking_budget, random_draws_needed
from data_prep.shard_format import ShardDataset
from shard_builds import run_build

CLS, SEP, MASK = 2, 3, 4
LAYOUTS = st.lists(st.tuples(st.integers(1, 60), st.integers(0, 60)), min_size=1, max_size=8)


def masked_layout(segments: list[tuple[int, int]], seed: int, cfg: MaskingConfig):
    """Samples ``[CLS] A [SEP]`` or ``[CLS] A [SEP] B [SEP]`` of the given segment lengths, back to back, masked:
    (original tokens, masked tokens, (offset, length, len_a) per sample, num_masked, positions, labels)."""
    rows, flat = [], []
    for len_a, len_b in segments:
        start = len(flat)
        flat += [CLS] + [100 + i for i in range(len_a)] + [SEP]
        segment_a_length = len(flat) - start
        if len_b:
            flat += [200 + i for i in range(len_b)] + [SEP]
        rows.append((start, len(flat) - start, segment_a_length))
    tokens = np.array(flat, dtype=np.int64)
    original = tokens.copy()
    offset, length, len_a = (np.array(c) for c in zip(*rows))
    maskable = length - np.where(len_a == length, 2, 3)
    uniforms = np.random.default_rng(seed).random(random_draws_needed(maskable, cfg))
    num_masked, positions, labels = mask_samples(tokens, offset, length, len_a, uniforms, cfg, MASK,
                                                 np.arange(5, 400))
    np.testing.assert_array_equal(num_masked, masking_budget(maskable, cfg))
    return original, tokens, rows, num_masked, positions, labels


@pytest.mark.parametrize("recipe", ["unilm", "bert"])
@settings(max_examples=60, deadline=None)
@given(LAYOUTS, st.integers(0, 2**31))
def test_mask_samples_invariants(recipe, segments, seed):
    original, tokens, rows, num_masked, positions, labels = masked_layout(
        segments, seed, MaskingConfig.for_recipe(recipe, max_predictions=12))
    assert num_masked.sum() == len(positions) == len(labels)
    starts = np.cumsum(num_masked) - num_masked
    for s, (start, total, segment_a_length) in enumerate(rows):
        pos = positions[starts[s]:starts[s] + num_masked[s]]
        assert np.all(np.diff(pos) > 0) and pos.min() >= 1 and pos.max() <= total - 2
        assert segment_a_length - 1 not in pos
        np.testing.assert_array_equal(labels[starts[s]:starts[s] + num_masked[s]], original[start + pos])
    offset = np.array([start for start, _, _ in rows])
    changed = np.flatnonzero(tokens != original)
    assert set(changed.tolist()) <= set((offset.repeat(num_masked) + positions).tolist())


def test_bert_masking_chooses_positions_uniformly_as_bert_does():
    """Single-token masking takes a uniform subset of the maskable positions, as BERT's shuffled candidates do:
    every position equally often, and neighbours masked together as often as chance says (they were kept apart
    once, which BERT never does); the same budget as span masking."""
    cfg = MaskingConfig.for_recipe("bert", max_predictions=12)
    assert cfg.span_length_probs == (1.0,)
    assert MaskingConfig.for_recipe("unilm", max_predictions=12) == MaskingConfig().resolved("unilm", 80)
    n, samples = 40, 4000
    _, _, rows, num_masked, positions, _ = masked_layout([(n, 0)] * samples, 7, cfg)
    k = round(0.15 * n)
    assert (num_masked == k).all()
    per_sample = positions.reshape(samples, k) - 1  # maskable coordinates
    frequency = np.bincount(per_sample.ravel(), minlength=n) / samples
    assert np.abs(frequency - k / n).max() < 0.03, frequency
    adjacent = (np.diff(per_sample, axis=1) == 1).sum(axis=1).mean()
    assert adjacent == pytest.approx(k * (k - 1) / n, abs=0.05)  # 0.75 neighbouring pairs per sample
    _, _, _, _, unilm, _ = masked_layout([(n, 0)] * 200, 7, MaskingConfig.for_recipe("unilm", max_predictions=12))
    runs = np.diff(np.flatnonzero(np.diff(unilm.reshape(200, k) - 1, axis=1, prepend=-2, append=n + 2) != 1))
    assert len(unilm) == 200 * k and runs.max() <= 3  # UniLM's spans stay apart: every run is one span


def test_bert_builds_mask_single_tokens_and_unilm_builds_keep_their_spans(samples_dir, minilm_dir, tmp_path):
    common = ["--input", samples_dir / "news/lee.txt", "--vocab", minilm_dir, "--max-seq-len", 128, "--seed", 3]
    for recipe, span_length_probs in (("bert", [1.0]), ("unilm", [0.8, 0.1, 0.1])):
        manifest = run_build(*common, "--recipe", recipe, "--out", tmp_path / recipe)
        assert manifest["masking"]["span_length_probs"] == span_length_probs
        stats = shard_statistics(ShardDataset(tmp_path / recipe))
        assert stats["masked_fraction"] == pytest.approx(0.15, abs=0.01)
        spans = {int(length): count for length, count in stats["span_lengths"].items()}
        if recipe == "bert":  # single tokens placed as BERT places them: neighbours now and then (runs of 2+)
            assert spans[1] / sum(spans.values()) > 0.8 and spans.get(2, 0) > 0, spans
        else:  # 80 % of the spans single tokens, the rest bigrams and trigrams
            assert set(spans) == {1, 2, 3} and spans[1] / sum(spans.values()) == pytest.approx(0.8, abs=0.03), spans


def test_a_bert_build_is_the_same_bytes_again_and_on_two_workers(samples_dir, minilm_dir, tmp_path):
    common = ["--input", samples_dir / "news/lee.txt", "--vocab", minilm_dir, "--recipe", "bert", "--max-seq-len",
              64, "--seed", 5, "--chunk-chars", 40_000, "--samples-per-shard", 500]
    for name, workers in (("one", 1), ("again", 1), ("two", 2)):
        run_build(*common, "--workers", workers, "--out", tmp_path / name)
    reference = {p.name: p.read_bytes() for p in sorted((tmp_path / "one").iterdir())}
    assert len(reference) >= 3  # manifest, vocab, shards
    for name in ("again", "two"):
        assert {p.name: p.read_bytes() for p in sorted((tmp_path / name).iterdir())} == reference, name
