"""Assemble a fine-tuning task: read and encode the data, wrap the backbone with its head, say how to batch
and how to evaluate. `finetune.engine.fit` trains whatever `build_task` returns."""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pretrain.model import UniLMModel

from . import classify, qa, seq2seq
from .beam import DecodeConfig
from .config import TASK_METRICS, FinetuneConfig
from .generation import decode_records, ignore_ids, score_predictions
from .glue import read_records, record_format
from .task_files import read_seq2seq
from .tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass
class TaskSetup:
    module: torch.nn.Module
    """Backbone + head; `module(**batch)` returns the scalar training loss. `module.backbone` is the encoder."""
    head: torch.nn.Module | None
    """The task layer saved beside the HF export (None for seq2seq: the MLM head is the backbone's)."""
    train_size: int
    """Training items (examples, or QA windows) the epoch order runs over."""
    make_batch: Callable[[list[int], int], dict[str, torch.Tensor]]
    """(item indices, epoch) → a batch for `module`."""
    evaluate: Callable[[Any], dict[str, float]]
    """The dev metrics of `module`, given as the engine holds it (`engine.module`: `module` itself, of the task's
    class); higher is better for `primary_metric`."""
    primary_metric: str
    meta: dict[str, Any] = field(default_factory=dict)
    """Saved into finetune.json: labels, counts of truncated inputs, ..."""
    predicted_count: Callable[[list[int], int], int] | None = None
    """(item indices, epoch) → the tokens a loss term that is a mean over tokens averages over (seq2seq's masked
    targets, the auxiliary LM's next tokens), so that a step's loss is the mean over its whole global batch
    (`finetune.engine.train_step`); None where the loss is a mean over examples, which micro-batches of equal size
    already weigh alike."""

    @property
    def backbone(self) -> UniLMModel:
        """The encoder inside `module` (what is exported)."""
        backbone = self.module.backbone
        assert isinstance(backbone, UniLMModel), type(backbone)
        return backbone


def _limit(items: list, count: int | None) -> list:
    return items if count is None else items[:count]


def _primary_metric(cfg: FinetuneConfig, available: tuple[str, ...], default: str | None = None) -> str:
    """`cfg.metric` when this task reports it, else `default` (a GLUE task's metric), else the first of
    `available`."""
    if cfg.metric is None:
        return default if default in available else available[0]
    if cfg.metric not in available:
        raise ValueError(f"metric={cfg.metric!r}: this {cfg.task} task reports {', '.join(available)} "
                         "(f1 needs two classes or positive_label; pearson and spearman need regression: float "
                         "labels or regression: true)")
    return cfg.metric


def check_positions(backbone: UniLMModel, length: int, setting: str) -> None:
    """An input of `length` tokens needs as many rows in the model's position table."""
    if length > backbone.cfg.max_position_embeddings:
        raise ValueError(f"{setting} = {length} exceeds the model's {backbone.cfg.max_position_embeddings} "
                         f"positions; lower it to at most {backbone.cfg.max_position_embeddings}")


def build_classify(cfg: FinetuneConfig, backbone: UniLMModel, tokenizer: Tokenizer) -> TaskSetup:
    check_positions(backbone, cfg.max_seq_len, "max_seq_len")
    fmt = record_format(cfg.to_dict())
    train_records = read_records(cfg.train, fmt)
    dev_records = _limit(read_records(cfg.dev, fmt), cfg.eval_max_examples)
    labels = classify.LabelSpace.from_records(train_records, cfg.train, fmt.regression, fmt.label_names)
    hint = labels.hint(train_records)
    if hint and (cfg.glue_task is None and cfg.regression is None):
        log.info("[classify] %s: %s", cfg.train, hint)
    positive = classify.positive_class(labels, cfg.positive_label or fmt.positive_label, cfg.train)
    settings = (tokenizer, labels, cfg.max_seq_len, cfg.similarity)
    train, train_cut = classify.encode_examples(train_records, *settings, where=cfg.train)
    dev, dev_cut = classify.encode_examples(dev_records, *settings, where=cfg.dev)
    module = classify.ClassifierModel(backbone, labels, cfg.dropout, cfg.aux_lm_weight)
    return TaskSetup(
        module=module, head=module.head, train_size=len(train),
        make_batch=lambda indices, epoch: classify.collate([train[i] for i in indices], tokenizer.pad_id,
                                                           labels.regression),
        evaluate=lambda m: classify.evaluate(m, dev, tokenizer.pad_id, positive),
        primary_metric=_primary_metric(cfg, classify.metrics_of(labels, positive), fmt.metric),
        meta={"labels": list(labels.classes), "positive_label": None if positive is None else labels.classes[positive],
              "regression": labels.regression, "multiple_choice": labels.multiple_choice,
              "pairs": any("text_b" in r for r in train_records), "truncated": {"train": train_cut, "dev": dev_cut}},
        predicted_count=(lambda indices, epoch: classify.lm_predictions([train[i] for i in indices]))
        if cfg.aux_lm_weight else None,
    )


def build_qa(cfg: FinetuneConfig, backbone: UniLMModel, tokenizer: Tokenizer) -> TaskSetup:
    check_positions(backbone, cfg.max_seq_len, "max_seq_len")
    train_questions, _ = qa.read_squad(cfg.train)
    dev_questions, version_2 = qa.read_squad(cfg.dev)
    dev_questions = _limit(dev_questions, cfg.eval_max_examples)
    settings = (tokenizer, cfg.max_seq_len, cfg.doc_stride, cfg.max_query_len)
    train, dev = qa.make_windows(train_questions, *settings), qa.make_windows(dev_questions, *settings)
    module = qa.SpanModel(backbone)
    return TaskSetup(
        module=module, head=module.head, train_size=len(train),
        make_batch=lambda indices, epoch: qa.collate([train[i] for i in indices], tokenizer.pad_id),
        evaluate=lambda m: qa.evaluate(m, dev_questions, dev, tokenizer.pad_id, cfg.max_answer_len, version_2,
                                       cfg.null_score_diff_threshold),
        primary_metric=_primary_metric(cfg, TASK_METRICS["qa"]),
        meta={"version_2": version_2, "windows": {"train": len(train), "dev": len(dev)}},
    )


def build_seq2seq(cfg: FinetuneConfig, backbone: UniLMModel, tokenizer: Tokenizer) -> TaskSetup:
    train_records, dev_records = read_seq2seq(cfg.train), _limit(read_seq2seq(cfg.dev), cfg.eval_max_examples)
    lengths = (cfg.max_src_len, cfg.max_tgt_len, backbone.cfg.max_position_embeddings)
    train, cut = seq2seq.encode_examples(train_records, tokenizer, *lengths, where=cfg.train)
    if note := seq2seq.x_sep_note(train_records, tokenizer):  # once the records are known to have targets
        log.info("[seq2seq] %s: %s", cfg.train, note)
    dev, _ = seq2seq.encode_examples(dev_records, tokenizer, *lengths, where=cfg.dev)
    module = seq2seq.Seq2SeqModel(backbone, cfg.label_smoothing)
    ignore = ignore_ids(tokenizer, cfg.eval_no_repeat_ignore, "eval_no_repeat_ignore")
    if cfg.eval_beam_size > tokenizer.vocab_size:
        raise ValueError(f"eval_beam_size = {cfg.eval_beam_size}: more beams than the {tokenizer.vocab_size} word "
                         "pieces a step can choose from (the paper's beam is 5)")
    decoding = DecodeConfig(beam_size=cfg.eval_beam_size, max_tgt_len=cfg.decode_max_tgt_len,
                            length_penalty=cfg.eval_length_penalty, no_repeat_ngram=cfg.eval_no_repeat_ngram,
                            no_repeat_ignore=ignore)

    def masking(epoch: int, index: int) -> np.random.Generator:
        # the masking of example i in epoch e depends on (seed, e, i) only: resume and world size keep it
        return np.random.default_rng([cfg.seed, epoch, index])

    def make_batch(indices: list[int], epoch: int) -> dict[str, torch.Tensor]:
        packed = [seq2seq.pack_and_mask(train[i], tokenizer, cfg.mask_prob, masking(epoch, i)) for i in indices]
        return seq2seq.collate(packed, tokenizer.pad_id)

    def predicted_count(indices: list[int], epoch: int) -> int:
        return seq2seq.masked_count([train[i] for i in indices], cfg.mask_prob, [masking(epoch, i) for i in indices])

    def evaluate(m: Any) -> dict[str, float]:
        predictions = decode_records(m.backbone, tokenizer, dev_records, decoding, cfg.max_src_len).predictions
        scores = score_predictions(tokenizer, predictions, [r["tgt"] for r in dev_records])
        return {**scores, "dev_loss": seq2seq.held_out_loss(m.backbone, dev, tokenizer, cfg.mask_prob, cfg.seed,
                                                             cfg.micro_batch_size)}

    return TaskSetup(module=module, head=None, train_size=len(train), make_batch=make_batch, evaluate=evaluate,
                     primary_metric=_primary_metric(cfg, TASK_METRICS["seq2seq"]),
                     meta={"truncated": {"sources": cut.sources, "targets": cut.targets}},
                     predicted_count=predicted_count)


def build_task(cfg: FinetuneConfig, backbone: UniLMModel, tokenizer: Tokenizer) -> TaskSetup:
    builders = {"classify": build_classify, "qa": build_qa, "seq2seq": build_seq2seq}
    return builders[cfg.task](cfg, backbone, tokenizer)
