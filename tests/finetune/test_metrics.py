"""Metrics: classification, correlations, SQuAD normalisation / EM / F1, ROUGE and BLEU through the libraries."""
from __future__ import annotations

import pytest

from finetune.metrics import (
    accuracy, generation_metrics, macro_f1, normalize_answer, pearson, spearman, squad_exact_match, squad_f1,
    squad_metrics,
)


def test_accuracy_and_macro_f1():
    gold = ["a", "a", "b", "c"]
    predicted = ["a", "b", "b", "b"]
    assert accuracy(predicted, gold) == 0.5
    # per class F1: a 2·1/(1+2)=2/3, b 2·1/(3+1)=1/2, c 0 → mean 7/18
    assert macro_f1(predicted, gold) == pytest.approx(7 / 18)
    assert macro_f1(gold, gold) == 1.0
    with pytest.raises(ValueError):
        accuracy([1], [1, 2])


def test_correlations():
    assert pearson([1, 2, 3], [2, 4, 6]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [1, 4, 9, 100]) == pytest.approx(1.0)
    assert spearman([1, 2, 2, 3], [3, 2, 2, 1]) == pytest.approx(-1.0)  # ties get averaged ranks
    assert pearson([1, 1, 1], [1, 2, 3]) == 0.0


def test_squad_normalisation_follows_the_official_rules():
    assert normalize_answer("The  Eiffel-Tower!") == "eiffeltower"
    assert normalize_answer("an apple, a pear and the plum") == "apple pear and plum"
    assert squad_exact_match("the Virgin Mary", "Virgin Mary.") == 1.0
    assert squad_f1("Saint Bernadette", "Saint Bernadette Soubirous") == pytest.approx(2 * 1 * (2 / 3) / (1 + 2 / 3))
    assert squad_f1("", "") == 1.0 and squad_f1("x", "") == 0.0  # SQuAD 2.0 no-answer


def test_squad_metrics_take_the_best_gold_answer_and_count_missing_predictions():
    gold = {"q1": ["Denver Broncos", "The Broncos"], "q2": ["1858"], "q3": []}
    scores = squad_metrics({"q1": "broncos", "q3": ""}, gold)
    assert scores["exact_match"] == pytest.approx(100 * 2 / 3)
    assert scores["f1"] == pytest.approx(100 * 2 / 3)


def test_generation_metrics_use_rouge_score_and_sacrebleu():
    scores = generation_metrics(["the cat sat on the mat"], ["the cat sat on the mat"])
    assert scores["rouge1"] == pytest.approx(100.0) and scores["rougeL"] == pytest.approx(100.0)
    assert scores["bleu"] == pytest.approx(100.0)
    partial = generation_metrics(["sat cats"], ["the cat sat down"])
    assert 0 < partial["rouge1"] < 100 and partial["rouge2"] == 0.0
