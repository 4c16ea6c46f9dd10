"""Extractive question answering (SQuAD 1.1 / 2.0): start/end span heads over sliding context windows.

Each question becomes one window per stretch of its context: `[CLS] question [SEP] context_window [SEP]`
(bidirectional, segments 0/1), windows `doc_stride` word pieces apart so every context token sits in some
window with room around it. A question's word pieces and their character offsets are held once (`Pieces`,
int32 arrays) and its windows refer to them, so SQuAD's 88k training questions take a few hundred MB of host
memory per rank, not gigabytes. Training targets the answer's first/last word piece when the answer lies inside
the window, else [CLS] (position 0: "no answer here" — SQuAD 2.0's unanswerable questions always).
Prediction takes the best-scoring span (start ≤ end, at most `max_answer_len` word pieces, inside the context)
over all windows, a span starting only in the window where its first word piece has the most context around it
(BERT's rule for overlapping windows), mapped back to the context's characters through the tokenizer's offsets;
for SQuAD 2.0 it answers "" when the lowest [CLS] score (start + end at position 0) beats the span's by more than
`null_score_diff_threshold` (BERT's setting, default 0). Metrics: `finetune.metrics.squad_metrics`, for SQuAD 2.0
also over the answerable and unanswerable questions apart and at the threshold that would have been best
(`squad2_breakdown`, the official evaluation's HasAns / NoAns / best_f1 figures).
"""
from __future__ import annotations

import json
import math
import unicodedata
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pretrain.masks import BIDIRECTIONAL
from pretrain.model import UniLMModel

from .metrics import squad_metrics, squad_scores
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
    labelled: bool = True
    """Whether the file gives its answers (or marks it unanswerable); only `read_squad(..., labelled=False)` reads
    questions without."""


def read_squad(path: str | Path, labelled: bool = True) -> tuple[list[Question], bool]:
    """Questions of a SQuAD JSON file and whether it is SQuAD 2.0 (has `is_impossible` questions).

    A gold answer whose text is not in its context fails with the question id; so does a question with no answers
    that is not marked unanswerable, unless `labelled` is false (a file to predict, not to train or score on).
    """
    layout = ('a SQuAD JSON file: {"data": [{"paragraphs": [{"context": ..., "qas": [{"id", "question", '
              '"answers": [{"text", "answer_start"}], "is_impossible"?}]}]}]}')
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not JSON ({error}); extractive QA reads {layout}") from None
    if not isinstance(data, dict) or "data" not in data:
        raise ValueError(f"{path}: not a SQuAD file (no top-level 'data'); extractive QA reads {layout}")
    questions, version_2 = [], False
    where = f"{path}"
    try:
        for article_index, article in enumerate(data["data"]):
            for paragraph_index, paragraph in enumerate(article["paragraphs"]):
                where = f"{path}: data[{article_index}].paragraphs[{paragraph_index}]"
                context = paragraph["context"]
                for qa in paragraph["qas"]:
                    where = f"{path}: question {qa.get('id', '(no id)')}"
                    impossible = bool(qa.get("is_impossible", False))
                    version_2 |= "is_impossible" in qa
                    answers = [] if impossible else qa.get("answers", [])
                    start = None
                    if answers:
                        text, start = answers[0]["text"], answers[0].get("answer_start")
                        if start is None or context[start: start + len(text)] != text:  # the nearest occurrence
                            found = [i for i in range(len(context)) if context.startswith(text, i)]
                            if not found:
                                raise ValueError(f"{where}: answer {text!r} is not in its context")
                            start = min(found, key=lambda i: abs(i - (start or 0)))
                    elif not impossible and labelled:
                        raise ValueError(f"{where} has no answers and is not marked is_impossible")
                    questions.append(Question(qa["id"], qa["question"], context, tuple(a["text"] for a in answers),
                                              start, labelled=bool(answers) or impossible))
    except (KeyError, TypeError, AttributeError) as error:
        raise ValueError(f"{where}: no {error} where {layout} has one" if isinstance(error, KeyError) else
                         f"{where}: not laid out as {layout} ({error})") from None
    if not questions:
        raise ValueError(f"{path}: no questions")
    return questions, version_2


@dataclass(frozen=True)
class Pieces:
    """One question's word pieces, shared by its windows."""

    framed_question: np.ndarray
    """int32: [CLS] question [SEP]."""
    context_ids: np.ndarray
    """int32 word pieces of the whole context."""
    offsets: np.ndarray
    """int32 [n, 2]: character span in the context of each context word piece."""


@dataclass(frozen=True)
class Window:
    question_index: int
    pieces: Pieces
    context_start: int
    context_stop: int
    """The window holds context word pieces [context_start, context_stop)."""
    start_position: int
    end_position: int
    """Training targets (0, 0 = [CLS] when the answer is not inside)."""

    @property
    def len_a(self) -> int:
        """[CLS] question [SEP]: the context starts here."""
        return len(self.pieces.framed_question)

    @property
    def input_ids(self) -> np.ndarray:
        context = self.pieces.context_ids[self.context_start: self.context_stop]
        return np.concatenate([self.pieces.framed_question, context, self.pieces.framed_question[-1:]])

    @property
    def offsets(self) -> np.ndarray:
        """int32 [n, 2]: character span in the context of each of the window's context word pieces."""
        return self.pieces.offsets[self.context_start: self.context_stop]

    def max_context(self, windows: list[Window]) -> np.ndarray:
        """Bool per window context word piece: whether this window, of the question's `windows`, gives it the most
        context (BERT: the larger of min(pieces left, pieces right) + 0.01 · window length; the first on ties)."""
        def score(window: Window, positions: np.ndarray) -> np.ndarray:
            left, right = positions - window.context_start, window.context_stop - 1 - positions
            inside = (left >= 0) & (right >= 0)
            return np.where(inside, np.minimum(left, right) + 0.01 * (window.context_stop - window.context_start),
                            -np.inf)
        positions = np.arange(self.context_start, self.context_stop)
        first_best = np.argmax([score(w, positions) for w in windows], axis=0)  # the first of equal maxima
        return np.asarray([windows[i] is self for i in first_best], dtype=bool)


def make_windows(questions: list[Question], tokenizer: Tokenizer, max_seq_len: int, doc_stride: int,
                 max_query_len: int) -> list[Window]:
    windows = []
    for index, q in enumerate(questions):
        question_ids = tokenizer.encode(q.question)[:max_query_len]
        context_ids, offsets = tokenizer.encode_with_offsets(q.context)
        pieces = Pieces(np.asarray([tokenizer.cls_id, *question_ids, tokenizer.sep_id], dtype=np.int32),
                        np.asarray(context_ids, dtype=np.int32), np.asarray(offsets, dtype=np.int32).reshape(-1, 2))
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
            windows.append(Window(index, pieces, start, stop, *target))
            if stop >= len(context_ids):
                break
            start += min(doc_stride, room)  # a longer stride would skip context tokens no window then holds
    return windows


def collate(windows: list[Window], pad_id: int) -> dict[str, torch.Tensor]:
    rows = [w.input_ids for w in windows]
    input_ids = torch.full((len(windows), max(map(len, rows))), pad_id, dtype=torch.long)
    for row, ids in enumerate(rows):
        input_ids[row, : len(ids)] = torch.from_numpy(ids)
    return {
        "input_ids": input_ids,
        "len_a": torch.tensor([w.len_a for w in windows]),
        "length": torch.tensor([len(ids) for ids in rows]),
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


@dataclass(frozen=True)
class Prediction:
    text: str
    """The best span's text ("" when no window offered one)."""
    null_margin: float
    """The lowest [CLS] score (start + end) minus the best span's score (inf without a span): SQuAD 2.0 answers ""
    when it exceeds the threshold."""


@torch.no_grad()  # not inference_mode: run mid-training, ZeRO-3 may keep parameters it gathers here
def predict_spans(model: SpanModel, questions: list[Question], windows: list[Window], pad_id: int,
                  max_answer_len: int, batch_size: int = 32, top_k: int = 20) -> list[Prediction]:
    """Per question, its best span over all its windows (a span starts only in the window that gives its first
    word piece the most context) and the [CLS] score's margin over it."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    siblings: dict[int, list[Window]] = {}
    for window in windows:
        siblings.setdefault(window.question_index, []).append(window)
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
            max_context = window.max_context(siblings[q]) if len(siblings[q]) > 1 else None
            context_starts = start_logits[first: last + 1].topk(min(top_k, last - first + 1)).indices + first
            context_ends = end_logits[first: last + 1].topk(min(top_k, last - first + 1)).indices + first
            for s in context_starts.tolist():
                if max_context is not None and not max_context[s - first]:
                    continue
                for e in context_ends.tolist():
                    if e < s or e - s + 1 > max_answer_len:
                        continue
                    score = float(start_logits[s] + end_logits[e])
                    if q not in best or score > best[q][0]:
                        context = questions[q].context
                        char_start, char_end = window.offsets[s - first][0], window.offsets[e - first][1]
                        best[q] = (score, context[char_start:_past_combining_marks(context, char_end)])
    model.train(was_training)
    # a question no window offered a span for answers "" at any threshold
    return [Prediction(best[i][1], null[i] - best[i][0]) if i in best else Prediction("", float("inf"))
            for i in range(len(questions))]


def _past_combining_marks(text: str, end: int) -> int:
    """``end`` moved past the combining marks that follow it: an uncased tokenizer strips a decomposed accent
    (e + U+0301), so its word piece's offsets stop before the mark, which belongs to the answer's last letter."""
    while end < len(text) and unicodedata.category(text[end]) in ("Mn", "Mc", "Me"):
        end += 1
    return end


def answers_of(predictions: list[Prediction], questions: list[Question], version_2: bool,
               null_score_diff_threshold: float = 0.0) -> dict[str, str]:
    """Answer text per question id: the span, or "" (SQuAD 2.0 only) when the [CLS] score beats the span's by more
    than the threshold."""
    return {q.qid: "" if version_2 and p.null_margin > null_score_diff_threshold else p.text
            for q, p in zip(questions, predictions)}


def _null_scores(question: Question) -> tuple[float, float]:
    """(EM, F1) of leaving a question unanswered, as evaluate-v2.0.py's `apply_no_ans_threshold` and
    `find_best_thresh` score it: 1 when it is unanswerable, 0 when it is not, even when all its gold answers
    normalise to nothing ("the", "."), which an answer "" would otherwise match."""
    return (float(not question.answers),) * 2


def _written_scores(predictions: list[Prediction], questions: list[Question],
                    null_score_diff_threshold: float) -> list[tuple[float, float]]:
    """(EM, F1) per question of the answers `answers_of` writes for SQuAD 2.0, scored as the official script
    scores them with the null margins as its --na-prob-file and the threshold as --na-prob-thresh."""
    return [_null_scores(q) if p.null_margin > null_score_diff_threshold else squad_scores(p.text, q.answers)
            for p, q in zip(predictions, questions)]


def squad2_breakdown(predictions: list[Prediction], questions: list[Question],
                     null_score_diff_threshold: float = 0.0) -> dict[str, float]:
    """The official SQuAD 2.0 evaluation's further figures, in percent, of the answers at the threshold (what
    `answers_of` writes, with the null margins as its `--na-prob-file`): EM/F1 over the answerable (`has_ans_*`) and
    the unanswerable (`no_ans_*`) questions, and `best_exact` / `best_f1` with `best_exact_threshold` /
    `best_f1_threshold`, computed as evaluate-v2.0.py's `find_best_thresh` computes them. As there, those answers
    are fixed: a question answered "" stays unanswered at every threshold, so thresholds above this one are never
    tried. `span_best_exact` / `span_best_f1` (with `span_best_*_threshold`) search every threshold with each
    question's best span in hand: the value to set `null_score_diff_threshold` to."""
    answerable = [bool(q.answers) for q in questions]
    margins = [p.null_margin for p in predictions]
    span_scores = [squad_scores(p.text, q.answers) for p, q in zip(predictions, questions)]  # answering with the span
    null_scores = [_null_scores(q) for q in questions]  # answering ""
    unanswered = [m > null_score_diff_threshold for m in margins]
    written = _written_scores(predictions, questions, null_score_diff_threshold)
    # find_best_thresh scores the written answers unthresholded: "" against gold answers that all normalise to
    # nothing counts 1 there, as in its raw scores
    raw = [squad_scores("" if off else p.text, q.answers) for p, q, off in zip(predictions, questions, unanswered)]
    result = {}
    for group, wanted in (("has_ans", True), ("no_ans", False)):
        members = [i for i, a in enumerate(answerable) if a == wanted]
        if members:
            result[f"{group}_exact"] = 100.0 * sum(written[i][0] for i in members) / len(members)
            result[f"{group}_f1"] = 100.0 * sum(written[i][1] for i in members) / len(members)
    order = sorted(range(len(questions)), key=lambda i: margins[i])  # stable: ties in question order, as there
    for metric, k in (("exact", 0), ("f1", 1)):
        # evaluate-v2.0.py: start from "" everywhere at threshold 0.0; switch on each question in margin order, an
        # unanswerable one costing 1 if it was answered; keep the first strict best
        total = best_total = float(sum(not a for a in answerable))
        best_threshold = 0.0
        for i in order:
            total += raw[i][k] if answerable[i] else -float(not unanswered[i] and bool(predictions[i].text))
            if total > best_total:
                best_total, best_threshold = total, margins[i]
        result[f"best_{metric}"] = 100.0 * best_total / len(questions)
        result[f"best_{metric}_threshold"] = best_threshold
        # every threshold, each question answering its span where null_margin <= t ("" below every margin); ties
        # switch together
        total = float(sum(score[k] for score in null_scores))
        best_total = total
        best_threshold = min((m for m in margins if math.isfinite(m)), default=0.0) - 1.0
        for rank, i in enumerate(order):
            total += span_scores[i][k] - null_scores[i][k]
            last_of_tie = rank + 1 == len(order) or margins[order[rank + 1]] > margins[i]
            if last_of_tie and total > best_total:
                best_total, best_threshold = total, margins[i]
        result[f"span_best_{metric}"] = 100.0 * best_total / len(questions)
        result[f"span_best_{metric}_threshold"] = best_threshold
    return result


def evaluate(model: SpanModel, questions: list[Question], windows: list[Window], pad_id: int, max_answer_len: int,
             version_2: bool, null_score_diff_threshold: float = 0.0) -> dict[str, float]:
    predictions = predict_spans(model, questions, windows, pad_id, max_answer_len)
    return scores(predictions, questions, version_2, null_score_diff_threshold)


def scores(predictions: list[Prediction], questions: list[Question], version_2: bool,
           null_score_diff_threshold: float = 0.0, file_version_2: bool | None = None) -> dict[str, float]:
    """The official evaluation's EM/F1 of `predictions` (and, for SQuAD 2.0, its breakdown). ``version_2``: the
    model's, which decides whether it may answer ""; ``file_version_2`` (default: the same): the questions' file's,
    whose official script scores them (a 2.0 model on v1.1's dev set is scored by v1.1's rules)."""
    file_version_2 = version_2 if file_version_2 is None else file_version_2
    if version_2 and file_version_2:
        written = _written_scores(predictions, questions, null_score_diff_threshold)
        metrics = {"exact_match": 100.0 * sum(e for e, _ in written) / len(written),
                   "f1": 100.0 * sum(f for _, f in written) / len(written)}
        metrics.update(squad2_breakdown(predictions, questions, null_score_diff_threshold))
        return metrics
    answers = answers_of(predictions, questions, version_2, null_score_diff_threshold)
    return squad_metrics(answers, {q.qid: list(q.answers) for q in questions}, file_version_2)
