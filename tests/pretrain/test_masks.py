"""UniLM attention masks and segment ids against hand-written expectations."""
from __future__ import annotations

import torch

from data_prep.shard_format import Objective
from pretrain.masks import (
    BIDIRECTIONAL,
    LEFT_TO_RIGHT,
    NUM_SEGMENT_TYPES,
    RIGHT_TO_LEFT,
    SEQ2SEQ,
    build_attention_mask,
    build_packed_attention_mask,
    build_packed_segment_ids,
    build_segment_ids,
)


def one(objective: int, len_a: int, length: int, max_len: int) -> torch.Tensor:
    t = lambda v: torch.tensor([v])  # noqa: E731
    return build_attention_mask(t(objective), t(len_a), t(length), max_len)[0]


def grid(rows: list[str]) -> torch.Tensor:
    return torch.tensor([[c == "1" for c in row] for row in rows])


def test_constants_are_the_shard_format_ids():
    assert (BIDIRECTIONAL, LEFT_TO_RIGHT, RIGHT_TO_LEFT, SEQ2SEQ) == (0, 1, 2, 3)
    assert [int(o) for o in Objective] == [BIDIRECTIONAL, LEFT_TO_RIGHT, RIGHT_TO_LEFT, SEQ2SEQ]


def test_bidirectional_with_padding():
    # length 4 of 6: real queries see the 4 real keys; pad queries see only themselves
    assert torch.equal(one(BIDIRECTIONAL, 2, 4, 6), grid([
        "111100", "111100", "111100", "111100", "000010", "000001"]))


def test_left_to_right_with_padding():
    assert torch.equal(one(LEFT_TO_RIGHT, 4, 4, 6), grid([
        "100000", "110000", "111000", "111100", "000010", "000001"]))


def test_right_to_left_with_padding():
    assert torch.equal(one(RIGHT_TO_LEFT, 4, 4, 6), grid([
        "111100", "011100", "001100", "000100", "000010", "000001"]))


def test_seq2seq_with_padding():
    # source = positions 0..2, target = 3..4, pad = 5
    assert torch.equal(one(SEQ2SEQ, 3, 5, 6), grid([
        "111000", "111000", "111000", "111100", "111110", "000001"]))


def test_seq2seq_paper_example():
    # [SOS] t1 t2 [EOS] t3 t4 t5 [EOS]: t1, t2 see the first four tokens; t4 sees the first six
    mask = one(SEQ2SEQ, 4, 8, 8)
    for t1_or_t2 in (1, 2):
        assert mask[t1_or_t2].tolist() == [True] * 4 + [False] * 4
    assert mask[5].tolist() == [True] * 6 + [False] * 2
    assert mask[7].all()  # the final [EOS] sees everything


def test_batch_mixes_objectives_and_every_row_has_a_key():
    objective = torch.tensor([BIDIRECTIONAL, LEFT_TO_RIGHT, RIGHT_TO_LEFT, SEQ2SEQ, SEQ2SEQ])
    len_a = torch.tensor([3, 5, 2, 4, 2])
    length = torch.tensor([7, 5, 2, 8, 6])
    batch = build_attention_mask(objective, len_a, length, 8)
    assert batch.shape == (5, 8, 8) and batch.dtype == torch.bool
    for b in range(5):
        assert torch.equal(batch[b], one(int(objective[b]), int(len_a[b]), int(length[b]), 8))
    assert batch.any(-1).all()
    assert not batch[:, :, 8:].any()
    # keys at positions >= length never attended by real queries
    for b in range(5):
        n = int(length[b])
        assert not batch[b, :n, n:].any()


def test_segment_ids():
    objective = torch.tensor([BIDIRECTIONAL, LEFT_TO_RIGHT, RIGHT_TO_LEFT, SEQ2SEQ])
    len_a = torch.tensor([2, 4, 3, 3])
    length = torch.tensor([5, 4, 3, 5])
    segments = build_segment_ids(objective, len_a, length, 6)
    assert segments.tolist() == [
        [0, 0, 1, 1, 1, 0],
        [2, 2, 2, 2, 0, 0],
        [3, 3, 3, 0, 0, 0],
        [4, 4, 4, 5, 5, 0],
    ]
    assert segments.max() < NUM_SEGMENT_TYPES


def test_packed_rows_give_each_sample_its_own_mask_and_segments_and_nothing_of_the_others():
    """Row 0: samples 0 (seq2seq, 5 tokens), 1 (left-to-right, 3), padding 2; row 1: sample 2 (bidirectional, 6),
    sample 3 (right-to-left, 4); row 2: sample 4 (bidirectional, 7), padding 3."""
    objective = torch.tensor([SEQ2SEQ, LEFT_TO_RIGHT, BIDIRECTIONAL, RIGHT_TO_LEFT, BIDIRECTIONAL])
    len_a = torch.tensor([3, 3, 2, 4, 4])
    length = torch.tensor([5, 3, 6, 4, 7])
    rows, width = [[0, 1], [2, 3], [4]], 10
    token_sample = torch.full((3, width), -1)
    position_ids = torch.zeros((3, width), dtype=torch.long)
    starts = {}
    for r, row in enumerate(rows):
        offset = 0
        for sample in row:
            n = int(length[sample])
            token_sample[r, offset:offset + n] = sample
            position_ids[r, offset:offset + n] = torch.arange(n)
            starts[sample] = (r, offset)
            offset += n
    mask = build_packed_attention_mask(token_sample, position_ids, objective, len_a)
    segments = build_packed_segment_ids(token_sample, position_ids, objective, len_a)
    assert mask.shape == (3, width, width) and mask.dtype == torch.bool and mask.any(-1).all()
    alone_mask = build_attention_mask(objective, len_a, length, width)
    alone_segments = build_segment_ids(objective, len_a, length, width)
    for sample, (r, offset) in starts.items():
        n = int(length[sample])
        block = slice(offset, offset + n)
        assert torch.equal(mask[r, block, block], alone_mask[sample, :n, :n]), sample
        assert not mask[r, block, :offset].any() and not mask[r, block, offset + n:].any(), sample
        assert torch.equal(segments[r, block], alone_segments[sample, :n]), sample
    padded = token_sample < 0
    assert torch.equal(mask[padded], torch.eye(width, dtype=torch.bool).expand(3, -1, -1)[padded])
    assert (segments[padded] == 0).all()
