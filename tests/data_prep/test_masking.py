"""Property test of the vectorised masking on random sample layouts."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from data_prep.instances import MaskingConfig, mask_samples, masking_budget, random_draws_needed

CLS, SEP, MASK = 2, 3, 4


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 60), st.integers(0, 60)), min_size=1, max_size=8), st.integers(0, 2**31))
def test_mask_samples_invariants(segments, seed):
    cfg = MaskingConfig(max_predictions=12)
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
    assert num_masked.sum() == len(positions) == len(labels)
    starts = np.cumsum(num_masked) - num_masked
    for s, (start, total, segment_a_length) in enumerate(rows):
        pos = positions[starts[s]:starts[s] + num_masked[s]]
        assert np.all(np.diff(pos) > 0) and pos.min() >= 1 and pos.max() <= total - 2
        assert segment_a_length - 1 not in pos
        np.testing.assert_array_equal(labels[starts[s]:starts[s] + num_masked[s]], original[start + pos])
    changed = np.flatnonzero(tokens != original)
    assert set(changed.tolist()) <= set((offset.repeat(num_masked) + positions).tolist())
