"""Sentence(-pair) classification, regression and multiple choice on the final [CLS]/[SOS] vector.

Records (`finetune.glue.read_records`: JSONL, TSV, CSV or parquet, GLUE's files): `{"text", "text_b"?, "label"}` —
string and integer labels are classes (mapped to ids in sorted order, numbers by value, and saved with the model),
labels written as floats mean regression (MSE; Pearson/Spearman), as in transformers' `run_glue`; `regression`
true or false decides instead. Multiple choice: `{"context", "choices": [...], "label": index}`.

Every example is one or more *views*, each packed as `[CLS] a [SEP] (b [SEP])` and encoded alone:
- a single text or a pair (GPT-1 entailment `premise [SEP] hypothesis`): one view;
- `similarity` pairs (GPT-1): both orders, the two final vectors summed before the classifier;
- multiple choice (GPT-1): `context [SEP] choice_k` per choice, each scored by a linear layer, softmax over k.

The final vector of a bidirectional model (BERT, UniLM) is the pooled first token (`model.pooled`: BERT's
pooler, trained by NSP); a left-to-right model (`causal_lm`, GPT) reads the last real token under the
left-to-right mask, since the first one sees nothing. Then dropout → linear. GPT-1's auxiliary LM loss
(`aux_lm_weight` λ: L = L_task + λ·L_lm) predicts each next token of the same views under the left-to-right mask
(for a causal model from the same forward pass).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from pretrain.masks import BIDIRECTIONAL, LEFT_TO_RIGHT
from pretrain.model import UniLMModel

from .metrics import classification_metrics, regression_metrics
from .tokenizer import Tokenizer

if TYPE_CHECKING:
    from .model_io import Finetuned


@dataclass(frozen=True)
class LabelSpace:
    """Class names in id order, or regression (no classes), or multiple choice (label = choice index)."""

    classes: tuple[str, ...] = ()
    regression: bool = False
    multiple_choice: bool = False

    @classmethod
    def from_records(cls, records: list[dict], where: str, regression: bool | None = None,
                     classes: tuple[str, ...] = ()) -> LabelSpace:
        """The label space of training records: multiple choice when they have `choices`; else regression when
        `regression` is true, or (None) when every label is a number and some is written as a float; else
        `classes` when given (a GLUE task's, in its order: a training subset without one still has it), or the
        classes of the labels, sorted (numbers by value)."""
        if "choices" in records[0]:
            return cls(multiple_choice=True)
        for number, record in enumerate(records, 1):
            label = record.get("label")
            if label is None:
                raise ValueError(f"{where}: record {number} has no label; every training record needs one (set "
                                 "label_field to the file's label column, or glue_task for a GLUE file)")
            if not isinstance(label, (str, int, float)) or isinstance(label, bool) or label == "":
                raise ValueError(f"{where}: record {number} has label {label!r}; every training record needs a "
                                 "label: a string or an integer (a class) or a number (regression)")
        labels = [r["label"] for r in records]
        if regression is None:
            regression = all(not isinstance(x, str) for x in labels) and any(isinstance(x, float) for x in labels)
        if regression:
            for number, label in enumerate(labels, 1):
                _score(label, f"{where}: record {number}")
            return cls(regression=True)
        found = {class_name(x) for x in labels}
        if classes:
            unknown = sorted(found - set(classes))
            if unknown:
                raise ValueError(f"{where}: labels {unknown} are not among the task's classes {list(classes)}")
            return cls(classes=tuple(classes))
        return cls(classes=tuple(sorted(found, key=_class_order)))

    def hint(self, records: list[dict]) -> str | None:
        """A note when numbers were read as classes (integers, or numbers written as strings): they might be
        scores."""
        if self.regression or self.multiple_choice or not all(map(_is_number, self.classes)):
            return None
        written = "strings" if any(isinstance(r["label"], str) for r in records) else "integers"
        return (f"the labels are numbers written as {written}: read as {len(self.classes)} classes "
                f"({', '.join(self.classes[:6])}{', ...' if len(self.classes) > 6 else ''}); set regression: true "
                "to fit them as scores")

    @classmethod
    def of_model(cls, meta: dict) -> LabelSpace:
        """The label space a fine-tuned classifier was trained on (from its `finetune.json`)."""
        return cls(classes=tuple(meta.get("labels") or ()), regression=bool(meta.get("regression")),
                   multiple_choice=bool(meta.get("multiple_choice")))

    @property
    def num_outputs(self) -> int:
        return 1 if self.regression or self.multiple_choice else len(self.classes)

    def label_id(self, record: dict, number: int, where: str) -> float | int:
        label = record.get("label")
        if self.regression:
            return _score(label, f"{where}: record {number}")
        if self.multiple_choice:
            if not isinstance(label, int) or not 0 <= label < len(record["choices"]):
                raise ValueError(f"{where}: record {number} has label {label!r}, expected a choice index "
                                 f"in [0, {len(record['choices'])})")
            return label
        name = class_name(label) if isinstance(label, (str, int, float)) and not isinstance(label, bool) else None
        if name not in self.classes:
            raise ValueError(f"{where}: record {number} has label {label!r}, unknown to the training labels "
                             f"{list(self.classes)}")
        return self.classes.index(name)

    @property
    def no_label(self) -> float | int:
        """The label an example without one carries (never scored)."""
        return math.nan if self.regression else -1


def class_name(label: str | int | float) -> str:
    """A class label as the class's name: strings as they are, numbers in their shortest form (1 and 1.0: "1")."""
    if isinstance(label, str):
        return label
    return str(int(label)) if float(label).is_integer() else repr(float(label))


def _is_number(text: str) -> bool:
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False


def _class_order(name: str) -> tuple:
    return (0, float(name), name) if _is_number(name) else (1, 0.0, name)


def _score(label: Any, where: str) -> float:
    """A regression label: a number, or a number written as a string (a TSV's)."""
    if isinstance(label, str) and _is_number(label):
        return float(label)
    if not isinstance(label, (int, float)) or isinstance(label, bool) or not math.isfinite(label):
        raise ValueError(f"{where} has label {label!r}, expected a number (regression)")
    return float(label)


@dataclass(frozen=True)
class ClassifyExample:
    views: tuple[tuple[int, ...], ...]
    """Packed id sequences, one per view."""
    len_a: tuple[int, ...]
    """Length of the first segment `[CLS] a [SEP]` per view."""
    label: float | int


def pack_views(tokenizer: Tokenizer, pairs: list[tuple[str, str | None]],
               max_seq_len: int) -> tuple[list[list[int]], list[int], int]:
    """`[CLS] a [SEP] (b [SEP])` per pair, cutting the longer side first to `max_seq_len`; also #cut."""
    packed, len_a, truncated = [], [], 0
    for text_a, text_b in pairs:
        a = tokenizer.encode(text_a)
        b = tokenizer.encode(text_b) if text_b is not None else None
        budget = max_seq_len - (3 if b is not None else 2)
        cut = False
        while len(a) + (len(b) if b is not None else 0) > budget:
            cut = True
            if b is not None and len(b) >= len(a):  # BERT's _truncate_seq_pair: the longer, b on a tie
                b.pop()
            else:
                a.pop()
        truncated += cut
        ids = [tokenizer.cls_id, *a, tokenizer.sep_id] + ([*b, tokenizer.sep_id] if b is not None else [])
        packed.append(ids)
        len_a.append(len(a) + 2)
    return packed, len_a, truncated


def encode_examples(records: list[dict], tokenizer: Tokenizer, labels: LabelSpace, max_seq_len: int,
                    similarity: bool, where: str, labelled: bool = True) -> tuple[list[ClassifyExample], int]:
    """Examples of classify records and how many views were truncated; `labelled` false: the records' labels are
    not read (`LabelSpace.no_label`: test files)."""
    examples, truncated = [], 0
    num_choices = len(records[0]["choices"]) if labels.multiple_choice else None
    for number, record in enumerate(records, 1):
        if labels.multiple_choice:
            if not isinstance(record.get("context"), str) or not record.get("choices"):
                raise ValueError(f"{where}: record {number} needs 'context' and a non-empty 'choices' list")
            if len(record["choices"]) != num_choices:
                raise ValueError(f"{where}: record {number} has {len(record['choices'])} choices, the first "
                                 f"record {num_choices}; all records need the same number")
            pairs = [(record["context"], choice) for choice in record["choices"]]
        else:
            text, text_b = record.get("text"), record.get("text_b")
            # a test file's empty text is still predicted (from [CLS] [SEP]): a submission needs a row for each
            if not isinstance(text, str) or (labelled and not text.strip()):
                raise ValueError(f"{where}: record {number} has an empty or missing 'text'")
            if text_b is not None and not isinstance(text_b, str):
                raise ValueError(f"{where}: record {number} has a 'text_b' of type {type(text_b).__name__}; "
                                 "it must be a string (or left out)")
            if similarity and text_b is None:
                raise ValueError(f"{where}: record {number}: similarity needs 'text_b'")
            pairs = [(text, text_b), (text_b, text)] if similarity else [(text, text_b)]
        packed, len_a, cut = pack_views(tokenizer, pairs, max_seq_len)
        truncated += cut
        label = labels.label_id(record, number, where) if labelled else labels.no_label
        examples.append(ClassifyExample(tuple(map(tuple, packed)), tuple(len_a), label))
    return examples, truncated


def lm_predictions(examples: list[ClassifyExample]) -> int:
    """The next tokens the auxiliary LM loss predicts in `examples`: each view's length - 1."""
    return sum(len(view) - 1 for example in examples for view in example.views)


def collate(examples: list[ClassifyExample], pad_id: int, regression: bool) -> dict[str, torch.Tensor]:
    """input_ids Long[B, K, L], len_a / length Long[B, K] (K views), labels Long[B] or Float[B]."""
    views = len(examples[0].views)
    max_len = max(len(v) for e in examples for v in e.views)
    input_ids = torch.full((len(examples), views, max_len), pad_id, dtype=torch.long)
    for row, example in enumerate(examples):
        for view, ids in enumerate(example.views):
            input_ids[row, view, : len(ids)] = torch.tensor(ids)
    return {
        "input_ids": input_ids,
        "len_a": torch.tensor([e.len_a for e in examples]),
        "length": torch.tensor([[len(v) for v in e.views] for e in examples]),
        "labels": torch.tensor([e.label for e in examples], dtype=torch.float if regression else torch.long),
    }


class ClassifierModel(nn.Module):
    """Backbone + dropout + linear head; `forward(**batch)` returns the training loss."""

    def __init__(self, backbone: UniLMModel, labels: LabelSpace, dropout: float, aux_lm_weight: float = 0.0):
        super().__init__()
        self.backbone, self.labels, self.aux_lm_weight = backbone, labels, aux_lm_weight
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(backbone.cfg.hidden_size, labels.num_outputs)
        nn.init.normal_(self.head.weight, std=backbone.cfg.initializer_range)
        nn.init.zeros_(self.head.bias)

    @classmethod
    def from_finetuned(cls, finetuned: Finetuned) -> ClassifierModel:
        """The classifier a fine-tuning run saved (`model_io.load_finetuned`): its backbone, label space and
        trained head, no dropout."""
        model = cls(finetuned.model, LabelSpace.of_model(finetuned.meta), dropout=0.0)
        model.head.load_state_dict(finetuned.head_state)
        return model

    @property
    def causal(self) -> bool:
        return self.backbone.cfg.causal_lm

    def _encode_views(self, input_ids: torch.Tensor, len_a: torch.Tensor, length: torch.Tensor):
        """Flattened views Long[N, L] → (final vectors Float[N, H], hidden Float[N, L, H])."""
        if self.causal:
            len_a = length  # one left-to-right segment: `a [SEP] b [SEP]` is GPT-1's delimited input
        hidden = self.backbone.encode_objective(input_ids, LEFT_TO_RIGHT if self.causal else BIDIRECTIONAL,
                                                len_a, length)
        if self.causal:
            vector = hidden[torch.arange(hidden.shape[0], device=hidden.device), length - 1]
        else:
            vector = self.backbone.pooled(hidden)
        return vector, hidden

    def scores(self, input_ids: torch.Tensor, len_a: torch.Tensor, length: torch.Tensor):
        """Batch Long[B, K, L] → (logits Float[B, C] (or [B] regression), flattened hidden, flattened ids/length)."""
        batch, views, max_len = input_ids.shape
        flat_ids, flat_length = input_ids.view(-1, max_len), length.view(-1)
        vectors, hidden = self._encode_views(flat_ids, len_a.view(-1), flat_length)
        vectors = self.dropout(vectors).view(batch, views, -1)
        if self.labels.multiple_choice:
            logits = self.head(vectors).squeeze(-1)  # [B, K]: one score per choice
        else:
            logits = self.head(vectors.sum(dim=1))  # similarity: both orders summed; else one view
            if self.labels.regression:
                logits = logits.squeeze(-1)
        return logits, hidden, flat_ids, flat_length

    def forward(self, input_ids, len_a, length, labels, token_normalizer=None):
        """The task loss, a mean over the examples, plus ``aux_lm_weight`` × the LM loss, a mean over the
        predicted next tokens: this batch's, or its summed token loss over ``token_normalizer`` (a training step's
        count per micro-batch, `lm_predictions`)."""
        logits, hidden, flat_ids, flat_length = self.scores(input_ids, len_a, length)
        if self.labels.regression:
            loss = F.mse_loss(logits.float(), labels)
        else:
            loss = F.cross_entropy(logits.float(), labels)
        if self.aux_lm_weight:
            loss = loss + self.aux_lm_weight * self.backbone.causal_lm_loss(
                flat_ids, flat_length, hidden if self.causal else None, token_normalizer)
        return loss


@torch.no_grad()  # not inference_mode: run mid-training, ZeRO-3 may keep parameters it gathers here
def predict(model: ClassifierModel, examples: list[ClassifyExample], pad_id: int, batch_size: int = 32) -> list:
    """Class ids (or choice indices, or regression values) of `examples`."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    predictions = []
    for start in range(0, len(examples), batch_size):
        batch = collate(examples[start: start + batch_size], pad_id, model.labels.regression)
        logits, *_ = model.scores(*(batch[k].to(device) for k in ("input_ids", "len_a", "length")))
        predictions += logits.float().tolist() if model.labels.regression else logits.argmax(-1).tolist()
    model.train(was_training)
    return predictions


def evaluate(model: ClassifierModel, examples: list[ClassifyExample], pad_id: int,
             positive: int | None = None) -> dict[str, float]:
    """Dev scores of `examples` (`scores`)."""
    return scores(predict(model, examples, pad_id), [e.label for e in examples], model.labels, positive)


def scores(predictions: list, gold: list, labels: LabelSpace, positive: int | None = None) -> dict[str, float]:
    """Correlations for regression, else accuracy, macro-F1, Matthews correlation and, with a `positive` class
    id, that class's F1."""
    if labels.regression:
        return regression_metrics(predictions, gold)
    return classification_metrics(predictions, gold, positive)


def positive_class(labels: LabelSpace, positive_label: str | None, where: str) -> int | None:
    """The class id whose F1 is reported: `positive_label`'s, else with two classes the second's, else none."""
    if labels.regression or labels.multiple_choice:
        if positive_label is not None:
            raise ValueError(f"positive_label={positive_label!r}, but {where} has no classes (its labels are "
                             f"{'numbers' if labels.regression else 'choice indices'})")
        return None
    if positive_label is not None:
        if positive_label not in labels.classes:
            raise ValueError(f"positive_label={positive_label!r} is not a class of {where}: "
                             f"{list(labels.classes)}")
        return labels.classes.index(positive_label)
    return 1 if len(labels.classes) == 2 else None


def metrics_of(labels: LabelSpace, positive: int | None) -> tuple[str, ...]:
    """The names `evaluate` reports for this label space (the first is the default primary metric)."""
    if labels.regression:
        return ("pearson", "spearman")
    return ("accuracy", "macro_f1", "mcc", *(("f1",) if positive is not None else ()))
