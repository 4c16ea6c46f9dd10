"""Fine-tuning metrics: classification, regression, SQuAD EM/F1, ROUGE and BLEU.

Accuracy, macro-F1, Matthews correlation, binary F1 and the correlations are a few lines each (scikit-learn is
not a dependency); they follow scikit-learn's and scipy's definitions (GLUE reports Matthews correlation for
CoLA, F1 of the positive class for MRPC and QQP, Pearson/Spearman for STS-B).
SQuAD answer normalisation follows the rules of the official v1.1/v2.0 evaluation script: lower-case,
drop punctuation, drop the articles a/an/the, collapse whitespace; F1 is over the bag of normalised tokens,
and a question scores the maximum over its gold answers (those that normalise to nothing left out, as v2.0 does).
ROUGE and BLEU come from `rouge-score` and `sacrebleu` (libraries, not hand-written metrics); ROUGE's words
are Unicode letters and digits (rouge-score's default keeps ASCII only, scoring "Москва" or "société" as
nothing), identical to rouge-score's default tokenisation on ASCII text.
"""
from __future__ import annotations

import collections
import math
import re
import string
import unicodedata
from collections.abc import Sequence

import numpy as np


def accuracy(predictions: Sequence, labels: Sequence) -> float:
    """Share of exact matches between two equally long label sequences."""
    if len(predictions) != len(labels) or not labels:
        raise ValueError(f"accuracy needs equally long, non-empty sequences (got {len(predictions)} and {len(labels)})")
    return sum(p == g for p, g in zip(predictions, labels)) / len(labels)


def macro_f1(predictions: Sequence, labels: Sequence) -> float:
    """Unweighted mean over the classes present in `labels` or `predictions` of the per-class F1."""
    if len(predictions) != len(labels) or not labels:
        raise ValueError(f"macro_f1 needs equally long, non-empty sequences (got {len(predictions)} and {len(labels)})")
    scores = []
    for cls in sorted(set(labels) | set(predictions), key=str):
        true_pos = sum(p == cls and g == cls for p, g in zip(predictions, labels))
        predicted = sum(p == cls for p in predictions)
        actual = sum(g == cls for g in labels)
        scores.append(2 * true_pos / (predicted + actual) if predicted + actual else 0.0)
    return float(np.mean(scores))


def matthews_corrcoef(predictions: Sequence, labels: Sequence) -> float:
    """Matthews correlation coefficient, its multi-class form for more than two classes (as scikit-learn): 1 for
    perfect predictions, 0 for a constant prediction or chance, -1 at worst."""
    if len(predictions) != len(labels) or not labels:
        raise ValueError(f"matthews_corrcoef needs equally long, non-empty sequences (got {len(predictions)} and "
                         f"{len(labels)})")
    classes = sorted(set(labels) | set(predictions), key=str)
    true_counts = np.array([sum(g == c for g in labels) for c in classes], dtype=np.float64)
    predicted_counts = np.array([sum(p == c for p in predictions) for c in classes], dtype=np.float64)
    correct, total = float(sum(p == g for p, g in zip(predictions, labels))), float(len(labels))
    covariance = correct * total - predicted_counts @ true_counts
    variance = (total**2 - predicted_counts @ predicted_counts) * (total**2 - true_counts @ true_counts)
    return float(covariance / math.sqrt(variance)) if variance else 0.0


def binary_f1(predictions: Sequence, labels: Sequence, positive) -> float:
    """F1 of the class `positive` (0.0 when it is neither predicted nor present)."""
    if len(predictions) != len(labels) or not labels:
        raise ValueError(f"binary_f1 needs equally long, non-empty sequences (got {len(predictions)} and "
                         f"{len(labels)})")
    true_pos = sum(p == positive and g == positive for p, g in zip(predictions, labels))
    predicted, actual = sum(p == positive for p in predictions), sum(g == positive for g in labels)
    return 2 * true_pos / (predicted + actual) if predicted + actual else 0.0


def pearson(predictions: Sequence[float], labels: Sequence[float]) -> float:
    """Pearson correlation coefficient (0.0 when either side is constant, NaN when a value is not finite)."""
    x, y = np.asarray(predictions, dtype=np.float64), np.asarray(labels, dtype=np.float64)
    if not (np.isfinite(x).all() and np.isfinite(y).all()):
        return math.nan
    if x.std() == 0 or y.std() == 0:
        return 0.0
    return float(np.corrcoef(x, y)[0, 1])


def _average_ranks(values: np.ndarray) -> np.ndarray:
    """Ranks 1..n with ties given their average rank (as Spearman's rho needs)."""
    order = np.argsort(values, kind="stable")
    ranks = np.empty(len(values), dtype=np.float64)
    ranks[order] = np.arange(1, len(values) + 1)
    for value in np.unique(values):
        tied = values == value
        ranks[tied] = ranks[tied].mean()
    return ranks


def spearman(predictions: Sequence[float], labels: Sequence[float]) -> float:
    """Spearman rank correlation: Pearson over tie-averaged ranks (NaN when a value is not finite)."""
    x, y = np.asarray(predictions, dtype=np.float64), np.asarray(labels, dtype=np.float64)
    if not (np.isfinite(x).all() and np.isfinite(y).all()):
        return math.nan
    return pearson(_average_ranks(x).tolist(), _average_ranks(y).tolist())


def classification_metrics(predictions: Sequence, labels: Sequence, positive=None) -> dict[str, float]:
    """Accuracy, macro-F1 and Matthews correlation; with a `positive` class also its F1 (`f1`)."""
    scores = {"accuracy": accuracy(predictions, labels), "macro_f1": macro_f1(predictions, labels),
              "mcc": matthews_corrcoef(predictions, labels)}
    if positive is not None:
        scores["f1"] = binary_f1(predictions, labels, positive)
    return scores


def regression_metrics(predictions: Sequence[float], labels: Sequence[float]) -> dict[str, float]:
    return {"pearson": pearson(predictions, labels), "spearman": spearman(predictions, labels)}


# ---- SQuAD (rules of the official evaluation script) ----

_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_PUNCTUATION = set(string.punctuation)


def normalize_answer(text: str) -> str:
    """Lower-case, remove punctuation, articles and extra whitespace (SQuAD's `normalize_answer`)."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def squad_exact_match(prediction: str, gold: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(gold))


def squad_f1(prediction: str, gold: str, version_2: bool = True) -> float:
    """Token-bag F1 of normalised answers. SQuAD 2.0: an empty answer (no answer) only matches an empty one;
    v1.1's script gives 0 whenever either is empty."""
    pred_tokens, gold_tokens = normalize_answer(prediction).split(), normalize_answer(gold).split()
    if version_2 and (not pred_tokens or not gold_tokens):
        return float(pred_tokens == gold_tokens)
    common = collections.Counter(pred_tokens) & collections.Counter(gold_tokens)
    overlap = sum(common.values())
    if overlap == 0:
        return 0.0
    precision, recall = overlap / len(pred_tokens), overlap / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def squad_scores(prediction: str, answers: Sequence[str], version_2: bool = True) -> tuple[float, float]:
    """EM and F1 of one prediction against its gold answers, the best over them, by the rules of the official
    script of the version. SQuAD 2.0: gold answers that normalise to nothing are left out, and a question with none
    left (unanswerable) has the gold answer ""; v1.1 scores every gold answer as it is."""
    answers = ([a for a in answers if normalize_answer(a)] if version_2 else list(answers)) or [""]
    return (max(squad_exact_match(prediction, a) for a in answers),
            max(squad_f1(prediction, a, version_2) for a in answers))


def squad_metrics(predictions: dict[str, str], gold_answers: dict[str, list[str]],
                  version_2: bool = True) -> dict[str, float]:
    """EM and F1 in percent over every question of `gold_answers` (a missing prediction scores 0), each scored by
    `squad_scores`."""
    if not gold_answers:
        raise ValueError("squad_metrics: no gold questions")
    scored = [squad_scores(predictions[qid], answers, version_2) for qid, answers in gold_answers.items()
              if qid in predictions]
    return {"exact_match": 100.0 * sum(e for e, _ in scored) / len(gold_answers),
            "f1": 100.0 * sum(f for _, f in scored) / len(gold_answers)}


# ---- generation ----

class RougeWords:
    """rouge-score's tokenisation (lower-case, words of letters and digits, Porter stemming of words longer than
    three characters) with Unicode letters and digits kept: equal to rouge-score's default on ASCII text."""

    _WORD = re.compile(r"[^\W_]+")

    def __init__(self) -> None:
        from nltk.stem import porter  # a dependency of rouge-score
        self._stemmer = porter.PorterStemmer()

    def tokenize(self, text: str) -> list[str]:
        words = self._WORD.findall(unicodedata.normalize("NFC", text).lower())
        return [self._stemmer.stem(w) if len(w) > 3 and w.isascii() else w for w in words]


ROUGE_TYPES = ("rouge1", "rouge2", "rougeL", "rougeLsum")


def generation_metrics(predictions: Sequence[str], references: Sequence[str]) -> dict[str, float]:
    """ROUGE-1/2/L/Lsum F1 (rouge-score, with stemming, mean over examples, in percent; words as `RougeWords`) and
    corpus BLEU-4 (sacrebleu's defaults but case-insensitive, as ROUGE is, and as question generation's BLEU-4 is
    computed, on lower-cased data). `rougeL` is the LCS of the whole texts; `rougeLsum` is the
    summary-level ROUGE-L over their newline-separated sentences (the union LCS of each reference sentence
    against all predicted ones), the ROUGE-L that CNN/DailyMail results, UniLM's among them, report. Newlines
    matter to `rougeLsum` alone. The fine-tuning tasks score text in the model's word form on both sides, one
    sentence per line (`finetune.generation.score_predictions`)."""
    # optional (extras): only generation metrics need them
    import sacrebleu
    from rouge_score import rouge_scorer

    if len(predictions) != len(references) or not references:
        raise ValueError(f"generation_metrics needs equally long, non-empty lists "
                         f"({len(predictions)} predictions, {len(references)} references)")
    scorer = rouge_scorer.RougeScorer(list(ROUGE_TYPES), tokenizer=RougeWords())
    totals: collections.Counter[str] = collections.Counter()
    for prediction, reference in zip(predictions, references):
        for name, score in scorer.score(reference, prediction).items():
            totals[name] += score.fmeasure
    result = {name: 100.0 * totals[name] / len(references) for name in ROUGE_TYPES}
    one_line = [text.replace("\n", " ") for text in predictions], [[text.replace("\n", " ") for text in references]]
    # force: text in word form ends sentences in " ." on purpose, which sacrebleu would warn about at every scoring
    result["bleu"] = sacrebleu.corpus_bleu(*one_line, lowercase=True, force=True).score
    return result
