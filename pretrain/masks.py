"""UniLM's self-attention masks and segment ids, built on the device from (objective, len_a, length).

Loaders never ship dense masks: a batch carries, per sample, its `objective`, `len_a` (tokens of the first
segment including its leading [CLS]/[SOS] and closing [SEP]/[EOS]) and `length` (unpadded tokens). These
pure functions turn them into the (B, L, L) boolean mask (`True` = the query may attend to the key) and the
(B, L) segment ids the model embeds. Definitions (UniLM paper, section 2.2):

    BIDIRECTIONAL  every real token sees every real token            (BERT MLM, + NSP)
    LEFT_TO_RIGHT  a token sees itself and the tokens to its left     (GPT)
    RIGHT_TO_LEFT  a token sees itself and the tokens to its right
    SEQ2SEQ        every token sees the whole source segment; source tokens never see the target;
                   target tokens also see the target up to and including themselves

Keys at positions >= length are never attended. A query row at a padded position (>= length) attends only
to itself: an all-False row would make softmax return NaN, and those outputs are ignored anyway.

Packed rows (several samples in one row, `pretrain.data.collate` with ``pack=True``) get the same masks and segment
ids per sample from `build_packed_attention_mask` / `build_packed_segment_ids`, which read each token's sample and
its position in it: a token sees only its own sample, exactly as in a row of its own.

Segment ids double as the objective identifier (the released UniLM checkpoints use this scheme):
0/1 bidirectional A/B, 2 left-to-right, 3 right-to-left, 4/5 seq2seq source/target.
"""
from __future__ import annotations

import torch

from data_prep.shard_format import Objective

BIDIRECTIONAL = int(Objective.BIDIRECTIONAL)
LEFT_TO_RIGHT = int(Objective.LEFT_TO_RIGHT)
RIGHT_TO_LEFT = int(Objective.RIGHT_TO_LEFT)
SEQ2SEQ = int(Objective.SEQ2SEQ)
NUM_OBJECTIVES = len(Objective)

# Segment types (rows of the segment embedding table).
SEGMENT_BIDIRECTIONAL_A = 0
SEGMENT_BIDIRECTIONAL_B = 1
SEGMENT_LEFT_TO_RIGHT = 2
SEGMENT_RIGHT_TO_LEFT = 3
SEGMENT_SEQ2SEQ_SOURCE = 4
SEGMENT_SEQ2SEQ_TARGET = 5
NUM_SEGMENT_TYPES = 6

__all__ = [
    "Objective", "BIDIRECTIONAL", "LEFT_TO_RIGHT", "RIGHT_TO_LEFT", "SEQ2SEQ", "NUM_OBJECTIVES",
    "NUM_SEGMENT_TYPES", "build_attention_mask", "build_segment_ids", "build_packed_attention_mask",
    "build_packed_segment_ids",
]


def build_attention_mask(
    objective: torch.Tensor, len_a: torch.Tensor, length: torch.Tensor, max_len: int
) -> torch.Tensor:
    """The per-sample self-attention mask of a batch.

    Args:
        objective: Long[B], one of BIDIRECTIONAL, LEFT_TO_RIGHT, RIGHT_TO_LEFT, SEQ2SEQ.
        len_a: Long[B], tokens of the first segment including [CLS] and its closing [SEP]
            (= length for single-segment objectives; only SEQ2SEQ reads it).
        length: Long[B], unpadded tokens (<= max_len).
        max_len: L, the padded length.

    Returns:
        Bool[B, L, L]; `mask[b, q, k]` is True when query q may attend to key k. All on `objective`'s device.

    Example (seq2seq, `[SOS] t1 t2 [EOS] t3 t4 t5 [EOS]`, len_a=4, length=8): t1 and t2 see positions 0..3,
    t4 (position 5) sees positions 0..5.
    """
    positions = torch.arange(max_len, device=objective.device)
    query = positions.view(1, max_len, 1)
    key = positions.view(1, 1, max_len)
    length = length.view(-1, 1, 1)
    allowed = _allowed(objective.view(-1, 1, 1), len_a.view(-1, 1, 1), query, key)
    real_query = query < length
    return torch.where(real_query, allowed & (key < length), key == query)


def _allowed(objective: torch.Tensor, len_a: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """Whether a query at position ``query`` of a sample may attend to the key at position ``key`` of the same
    sample, under the sample's objective; all four arguments broadcast against each other."""
    left_to_right = key <= query
    return torch.where(
        objective == LEFT_TO_RIGHT, left_to_right,
        torch.where(
            objective == RIGHT_TO_LEFT, key >= query,
            # seq2seq: the whole source, plus the target to the left (a source query's left is all source)
            torch.where(objective == SEQ2SEQ, (key < len_a) | left_to_right, True),
        ),
    )


def _segment(objective: torch.Tensor, len_a: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """The segment id of the token at ``position`` of a sample (arguments broadcast; padding not handled)."""
    in_b = (position >= len_a).long()
    return torch.where(
        objective == BIDIRECTIONAL, in_b + SEGMENT_BIDIRECTIONAL_A,
        torch.where(
            objective == LEFT_TO_RIGHT, SEGMENT_LEFT_TO_RIGHT,
            torch.where(objective == RIGHT_TO_LEFT, SEGMENT_RIGHT_TO_LEFT, in_b + SEGMENT_SEQ2SEQ_SOURCE),
        ),
    )


def build_segment_ids(
    objective: torch.Tensor, len_a: torch.Tensor, length: torch.Tensor, max_len: int
) -> torch.Tensor:
    """Segment ids that tell the model which objective (and which segment) each token belongs to.

    Args: as `build_attention_mask`.

    Returns:
        Long[B, L]: BIDIRECTIONAL 0 for positions < len_a and 1 after; LEFT_TO_RIGHT 2; RIGHT_TO_LEFT 3;
        SEQ2SEQ 4 for the source (< len_a) and 5 for the target. Padded positions (>= length) get 0.
    """
    positions = torch.arange(max_len, device=objective.device).view(1, max_len)
    segment = _segment(objective.view(-1, 1), len_a.view(-1, 1), positions)
    return torch.where(positions < length.view(-1, 1), segment, 0)


def build_packed_attention_mask(
    token_sample: torch.Tensor, position_ids: torch.Tensor, objective: torch.Tensor, len_a: torch.Tensor
) -> torch.Tensor:
    """The mask of rows that hold several samples each (`pretrain.data.collate` with ``pack=True``): a query sees
    the keys of its own sample exactly as `build_attention_mask` would in a row of its own, and nothing of the
    other samples in its row.

    Args:
        token_sample: Long[R, L], which sample (index into the per-sample tensors) each token belongs to;
            -1 at padding.
        position_ids: Long[R, L], each token's position within its sample.
        objective, len_a: Long[S], per sample, as in `build_attention_mask`.

    Returns:
        Bool[R, L, L]. A padded query attends only to itself, as in `build_attention_mask`.
    """
    sample = token_sample.clamp(min=0)
    allowed = _allowed(objective[sample].unsqueeze(2), len_a[sample].unsqueeze(2),
                       position_ids.unsqueeze(2), position_ids.unsqueeze(1))
    same_sample = token_sample.unsqueeze(2) == token_sample.unsqueeze(1)
    itself = torch.eye(token_sample.shape[1], dtype=torch.bool, device=token_sample.device)
    return torch.where((token_sample >= 0).unsqueeze(2), allowed & same_sample, itself)


def build_packed_segment_ids(
    token_sample: torch.Tensor, position_ids: torch.Tensor, objective: torch.Tensor, len_a: torch.Tensor
) -> torch.Tensor:
    """Segment ids Long[R, L] of packed rows (arguments as `build_packed_attention_mask`): each token's as in a row
    of its own sample (`build_segment_ids`); padding 0."""
    sample = token_sample.clamp(min=0)
    return torch.where(token_sample >= 0, _segment(objective[sample], len_a[sample], position_ids), 0)
