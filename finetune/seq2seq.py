"""Sequence-to-sequence fine-tuning the UniLM way: pack, mask target tokens, predict them.

An example is packed as `[CLS] src [SEP] tgt [SEP]` under the seq2seq attention mask (source tokens see the
whole source, target tokens see the source, the target to their left and themselves) with segment ids 4/5,
both built on the device by `pretrain.masks` from (objective, len_a, length) — exactly as in pre-training.
Each target token, the final [SEP] included, is replaced by [MASK] with probability `mask_prob` (paper: 0.7;
0.5 for generative QA and dialogue); at least one per example. The loss is cross-entropy with label smoothing
(0.1) at the masked positions only, a training step's mean over the masked targets of its whole global batch.
Decoding (`finetune.beam`) appends [MASK] and predicts it, so masked targets are always replaced by [MASK] here.
UniLM v1's fine-tuning code differs in two details the paper does not state: it masks exactly
round(0.7 · target length) positions per example, and replaces 10 % of them by a random token and 10 % by
themselves, as in pre-training; the expected number of masked positions is about the same.
Sources are cut only as far as `[CLS] src [SEP] tgt [SEP]` needs to fit the positions (`encode_examples`).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pretrain.masks import SEQ2SEQ
from pretrain.model import IGNORE_INDEX, UniLMModel

from .tokenizer import X_SEP, Tokenizer

HELD_OUT_MASKING = 1_000_000  # the "epoch" of a held-out set's fixed masking (no run has that many epochs)


@dataclass(frozen=True)
class Seq2SeqExample:
    """Word-piece ids of one source/target pair, already truncated (no special tokens)."""

    source_ids: list[int]
    target_ids: list[int]


@dataclass
class TruncationCounts:
    """How many inputs were cut to fit their budget (reported, never silent)."""

    sources: int = 0
    targets: int = 0


def source_budget(max_positions: int, max_src_len: int, max_tgt_len: int) -> int:
    """Source word pieces that fit beside a target of `max_tgt_len` in `max_positions` (`[CLS] src [SEP] tgt [SEP]`,
    or the [MASK] being predicted when decoding), at most `max_src_len`; an error when none do."""
    room = max_positions - max_tgt_len - 3
    if room < 1:
        raise ValueError(f"max_tgt_len {max_tgt_len} leaves no source word piece in the model's {max_positions} "
                         f"positions; lower it to at most {max_positions - 4}")
    return min(max_src_len, room)


def encode_examples(records: list[dict], tokenizer: Tokenizer, max_src_len: int, max_tgt_len: int,
                    max_positions: int, where: str = "input") -> tuple[list[Seq2SeqExample], TruncationCounts]:
    """Tokenise `{"src", "tgt"}` records. Targets are cut to `max_tgt_len` word pieces; sources to `max_src_len`,
    or further so that `[CLS] src [SEP] tgt [SEP]` fits `max_positions`: UniLM's truncation (`trunc_seg a`), which
    cuts the source only as far as the pair needs, so a short target leaves the source more room.

    An empty `src` or `tgt` fails with the record number; truncations are counted and returned.
    """
    for number, record in enumerate(records, 1):
        for field in ("src", "tgt"):
            if not isinstance(record.get(field), str) or not record[field].strip():
                fields = "" if field in record else f" (its fields: {', '.join(record)}; name them src and tgt)"
                raise ValueError(f"{where}: record {number} has an empty or missing {field!r}{fields}")
    sources = tokenizer.encode_batch([r["src"] for r in records])
    targets = tokenizer.encode_batch([r["tgt"] for r in records])
    source_budget(max_positions, max_src_len, max_tgt_len)  # a target of max_tgt_len leaves the source room
    targets_cut = [t[:max_tgt_len] for t in targets]
    room = [source_budget(max_positions, max_src_len, len(t)) for t in targets_cut]
    counts = TruncationCounts(sum(len(s) > r for s, r in zip(sources, room)),
                              sum(len(t) > max_tgt_len for t in targets))
    examples = [Seq2SeqExample(s[:r], t) for s, r, t in zip(sources, room, targets_cut)]
    return examples, counts


def x_sep_note(records: list[dict], tokenizer: Tokenizer) -> str | None:
    """What to tell when targets join sentences with UniLM's `[X_SEP]` and the vocabulary has no word piece for it
    (`Tokenizer.x_sep_id`): the model learns to write it as several word pieces."""
    if tokenizer.x_sep_id is not None or not any(X_SEP in record["tgt"] for record in records):
        return None
    return (f"targets hold UniLM's sentence separator {X_SEP}, and the vocabulary {tokenizer.vocab_path} has neither "
            f"{X_SEP} nor [unused1]: it is read as the words '[ X _ SEP ]' (BERT's vocabularies have [unused1], "
            "which reads it as one word piece)")


def masked_targets(length: int, mask_prob: float, rng: np.random.Generator) -> np.ndarray:
    """Bool[length]: which of a target's `length` tokens (final [SEP] included) are masked, each with probability
    `mask_prob`, at least one."""
    chosen = rng.random(length) < mask_prob
    if not chosen.any():
        chosen[rng.integers(length)] = True
    return chosen


def pack_and_mask(example: Seq2SeqExample, tokenizer: Tokenizer, mask_prob: float,
                  rng: np.random.Generator) -> dict[str, np.ndarray | int]:
    """`[CLS] src [SEP] tgt [SEP]` with target tokens (final [SEP] included) replaced by [MASK].

    Returns input_ids int64[length], len_a (= len(src) + 2), masked_positions int64[P] ascending and
    masked_labels int64[P] (the original ids), P ≥ 1.
    """
    source = [tokenizer.cls_id, *example.source_ids, tokenizer.sep_id]
    target = [*example.target_ids, tokenizer.sep_id]
    input_ids = np.asarray(source + target, dtype=np.int64)
    chosen = masked_targets(len(target), mask_prob, rng)
    masked_positions = len(source) + np.flatnonzero(chosen)
    masked_labels = input_ids[masked_positions].copy()
    input_ids[masked_positions] = tokenizer.mask_id
    return {"input_ids": input_ids, "len_a": len(source), "masked_positions": masked_positions,
            "masked_labels": masked_labels}


def masked_count(examples: list[Seq2SeqExample], mask_prob: float, rngs: list[np.random.Generator]) -> int:
    """How many target tokens `pack_and_mask` masks in `examples`, example i drawing from `rngs[i]` as it would:
    what a training step's loss is a mean over, known to every rank without packing the others' examples."""
    return sum(int(masked_targets(len(e.target_ids) + 1, mask_prob, rng).sum()) for e, rng in zip(examples, rngs))


def collate(packed: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Pad packed examples into a batch: input_ids Long[B, L], len_a/length Long[B],
    masked_positions Long[B, P] (padded with 0), masked_labels Long[B, P] (padded with `IGNORE_INDEX`)."""
    max_len = max(len(p["input_ids"]) for p in packed)
    max_masked = max(len(p["masked_positions"]) for p in packed)
    batch_size = len(packed)
    input_ids = torch.full((batch_size, max_len), pad_id, dtype=torch.long)
    masked_positions = torch.zeros((batch_size, max_masked), dtype=torch.long)
    masked_labels = torch.full((batch_size, max_masked), IGNORE_INDEX, dtype=torch.long)
    for row, p in enumerate(packed):
        input_ids[row, : len(p["input_ids"])] = torch.from_numpy(p["input_ids"])
        masked_positions[row, : len(p["masked_positions"])] = torch.from_numpy(p["masked_positions"])
        masked_labels[row, : len(p["masked_labels"])] = torch.from_numpy(p["masked_labels"])
    return {
        "input_ids": input_ids,
        "len_a": torch.tensor([p["len_a"] for p in packed]),
        "length": torch.tensor([len(p["input_ids"]) for p in packed]),
        "masked_positions": masked_positions,
        "masked_labels": masked_labels,
    }


def seq2seq_loss(model: UniLMModel, batch: dict[str, torch.Tensor], label_smoothing: float = 0.1) -> torch.Tensor:
    """Mean label-smoothed cross-entropy over the masked target positions of a `collate` batch; with a
    ``token_normalizer`` in the batch (a training step's masked targets over its micro-batches, see
    `pretrain.batch_plan.BatchPlan.per_micro_batch`), the summed loss divided by it instead."""
    hidden = model.encode_objective(batch["input_ids"], SEQ2SEQ, batch["len_a"], batch["length"])
    return model.masked_lm_loss(hidden, batch["masked_positions"], batch["masked_labels"], label_smoothing,
                                batch.get("token_normalizer"))


@torch.no_grad()  # not inference_mode: run mid-training, ZeRO-3 may keep parameters it gathers here
def held_out_loss(model: UniLMModel, examples: list[Seq2SeqExample], tokenizer: Tokenizer, mask_prob: float,
                  masking_seed: int, batch_size: int) -> float:
    """Masked-target cross-entropy (no label smoothing) per predicted token over held-out examples, each masked
    by its own generator `(masking_seed, HELD_OUT_MASKING, i)`: the same masked inputs for every model scored with
    the same seed, so two models' losses compare directly (a smooth signal while generated text is still poor)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for begin in range(0, len(examples), batch_size):
        chunk = range(begin, min(begin + batch_size, len(examples)))
        packed = [pack_and_mask(examples[i], tokenizer, mask_prob,
                                np.random.default_rng([masking_seed, HELD_OUT_MASKING, i])) for i in chunk]
        batch = {k: v.to(device) for k, v in collate(packed, tokenizer.pad_id).items()}
        masked = int((batch["masked_labels"] != IGNORE_INDEX).sum())
        total += seq2seq_loss(model, batch, label_smoothing=0.0).item() * masked
        count += masked
    model.train(was_training)
    return total / count


class Seq2SeqModel(torch.nn.Module):
    """The backbone alone (its tied MLM head predicts the masked targets); `forward(**batch)` → loss."""

    def __init__(self, backbone: UniLMModel, label_smoothing: float = 0.1):
        super().__init__()
        self.backbone, self.label_smoothing = backbone, label_smoothing

    def forward(self, **batch: torch.Tensor) -> torch.Tensor:
        return seq2seq_loss(self.backbone, batch, self.label_smoothing)
