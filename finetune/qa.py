"""Extractive question answering (SQuAD 1.1 / 2.0): start/end span heads over sliding context windows.

Each question becomes one window per stretch of its context: `[CLS] question [SEP] context_window [SEP]`
(bidirectional, segments 0/1), windows `doc_stride` word pieces apart so every context token sits in some
window with room around it. Training targets the answer's first/last word piece when the answer lies inside
the window, else [CLS] (position 0: "no answer here" — SQuAD 2.0's unanswerable questions always).
Prediction takes the best-scoring span (start ≤ end, at most `max_answer_len` word pieces, inside the context)
over all windows, mapped back to the context's characters through the tokenizer's offsets; for SQuAD 2.0 it
answers "" when the best [CLS] score (start + end at position 0) beats it. Metrics: `finetune.metrics.squad_metrics`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from pretrain.masks import BIDIRECTIONAL
from pretrain.model import UniLMModel

from .metrics import squad_metrics
from .tokenizer import Tokenizer


@dataclass(frozen=True)
class Question:
    qid: str
    question: str
    context: str
    answers: tuple[str, ...]
    """Gold answer texts (empty for an unanswerable question)."""
    answer_start: int | None
    """Character offset of the first gold answer (training target), None when unanswerable."""


def read_squad(path: str | Path) -> tuple[list[Question], bool]:
    """Questions of a SQuAD JSON file and whether it is SQuAD 2.0 (has `is_impossible` questions).

    A gold answer whose text is not in its context fails with the question id.
    """
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(data, dict) or "data" not in data:
        raise ValueError(f"{path}: not a SQuAD file (no top-level 'data')")
    questions, version_2 = [], False
    for article in data["data"]:
        for paragraph in article["paragraphs"]:
            context = paragraph["context"]
            for qa in paragraph["qas"]:
                impossible = bool(qa.get("is_impossible", False))
                version_2 |= "is_impossible" in qa
                answers = [] if impossible else qa.get("answers", [])
                start = None
                if answers:
                    text, start = answers[0]["text"], answers[0]["answer_start"]
                    if context[start: start + len(text)] != text:
                        start = context.find(text)
                        if start < 0:
                            raise ValueError(f"{path}: question {qa['id']}: answer {text!r} is not in its context")
                elif not impossible:
                    raise ValueError(f"{path}: question {qa['id']} has no answers and is not marked is_impossible")
                questions.append(Question(qa["id"], qa["question"], context,
                                          tuple(a["text"] for a in answers), start))
    if not questions:
        raise ValueError(f"{path}: no questions")
    return questions, version_2


@dataclass(frozen=True)
class Window:
    question_index: int
    input_ids: tuple[int, ...]
    len_a: int
    """[CLS] question [SEP]: the context starts here."""
    offsets: tuple[tuple[int, int], ...]
    """Character span in the context of each window context token."""
    start_position: int
    end_position: int
    """Training targets (0, 0 = [CLS] when the answer is not inside)."""


def make_windows(questions: list[Question], tokenizer: Tokenizer, max_seq_len: int, doc_stride: int,
                 max_query_len: int) -> list[Window]:
    windows = []
    for index, q in enumerate(questions):
        question_ids = tokenizer.encode(q.question)[:max_query_len]
        context_ids, offsets = tokenizer.encode_with_offsets(q.context)
        room = max_seq_len - len(question_ids) - 3
        if room < 1:
            raise ValueError(f"max_seq_len={max_seq_len} leaves no room for context after question {q.qid}")
        answer_span = None
        if q.answer_start is not None:
            answer_end = q.answer_start + len(q.answers[0])
            inside = [i for i, (s, e) in enumerate(offsets) if s < answer_end and e > q.answer_start]
            if inside:
                answer_span = (inside[0], inside[-1])
        start = 0
        while True:
            stop = min(start + room, len(context_ids))
            target = (0, 0)
            len_a = len(question_ids) + 2
            if answer_span and start <= answer_span[0] and answer_span[1] < stop:
                target = (len_a + answer_span[0] - start, len_a + answer_span[1] - start)
            ids = [tokenizer.cls_id, *question_ids, tokenizer.sep_id, *context_ids[start:stop], tokenizer.sep_id]
            windows.append(Window(index, tuple(ids), len_a, tuple(offsets[start:stop]), *target))
            if stop >= len(context_ids):
                break
            start += min(doc_stride, room)  # a longer stride would skip context tokens no window then holds
    return windows


def collate(windows: list[Window], pad_id: int) -> dict[str, torch.Tensor]:
    max_len = max(len(w.input_ids) for w in windows)
    input_ids = torch.full((len(windows), max_len), pad_id, dtype=torch.long)
    for row, window in enumerate(windows):
        input_ids[row, : len(window.input_ids)] = torch.tensor(window.input_ids)
    return {
        "input_ids": input_ids,
        "len_a": torch.tensor([w.len_a for w in windows]),
        "length": torch.tensor([len(w.input_ids) for w in windows]),
        "start_positions": torch.tensor([w.start_position for w in windows]),
        "end_positions": torch.tensor([w.end_position for w in windows]),
    }


class SpanModel(nn.Module):
    """Backbone + a linear layer giving each token a start and an end score."""

    def __init__(self, backbone: UniLMModel):
        super().__init__()
        self.backbone = backbone
        self.head = nn.Linear(backbone.cfg.hidden_size, 2)
        nn.init.normal_(self.head.weight, std=backbone.cfg.initializer_range)
        nn.init.zeros_(self.head.bias)

    def span_logits(self, input_ids, len_a, length) -> tuple[torch.Tensor, torch.Tensor]:
        """Float[B, L] start and end logits (padding at -inf)."""
        max_len = input_ids.shape[1]
        hidden = self.backbone.encode_objective(input_ids, BIDIRECTIONAL, len_a, length)
        logits = self.head(hidden).float()
        padding = torch.arange(max_len, device=input_ids.device) >= length.unsqueeze(1)
        logits = logits.masked_fill(padding.unsqueeze(-1), float("-inf"))
        return logits[..., 0], logits[..., 1]

    def forward(self, input_ids, len_a, length, start_positions, end_positions):
        start_logits, end_logits = self.span_logits(input_ids, len_a, length)
        return (F.cross_entropy(start_logits, start_positions) + F.cross_entropy(end_logits, end_positions)) / 2


@torch.no_grad()  # not inference_mode: run mid-training, ZeRO-3 may keep parameters it gathers here
def predict(model: SpanModel, questions: list[Question], windows: list[Window], pad_id: int,
            max_answer_len: int, version_2: bool, batch_size: int = 32, top_k: int = 20) -> dict[str, str]:
    """Predicted answer text per question id ("" = no answer, SQuAD 2.0 only)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    best: dict[int, tuple[float, str]] = {}
    null: dict[int, float] = {}
    for begin in range(0, len(windows), batch_size):
        chunk = windows[begin: begin + batch_size]
        batch = collate(chunk, pad_id)
        starts, ends = model.span_logits(*(batch[k].to(device) for k in ("input_ids", "len_a", "length")))
        for window, start_logits, end_logits in zip(chunk, starts.cpu(), ends.cpu()):
            q = window.question_index
            null[q] = min(null.get(q, float("inf")), float(start_logits[0] + end_logits[0]))
            first, last = window.len_a, window.len_a + len(window.offsets) - 1  # context positions
            context_starts = start_logits[first: last + 1].topk(min(top_k, last - first + 1)).indices + first
            context_ends = end_logits[first: last + 1].topk(min(top_k, last - first + 1)).indices + first
            for s in context_starts.tolist():
                for e in context_ends.tolist():
                    if e < s or e - s + 1 > max_answer_len:
                        continue
                    score = float(start_logits[s] + end_logits[e])
                    if q not in best or score > best[q][0]:
                        char_start, char_end = window.offsets[s - first][0], window.offsets[e - first][1]
                        best[q] = (score, questions[q].context[char_start:char_end])
    model.train(was_training)
    answers = {}
    for index, question in enumerate(questions):
        score, text = best.get(index, (float("-inf"), ""))
        answers[question.qid] = "" if version_2 and null.get(index, float("-inf")) > score else text
    return answers


def evaluate(model: SpanModel, questions: list[Question], windows: list[Window], pad_id: int, max_answer_len: int,
             version_2: bool) -> dict[str, float]:
    predictions = predict(model, questions, windows, pad_id, max_answer_len, version_2)
    return squad_metrics(predictions, {q.qid: list(q.answers) for q in questions})
