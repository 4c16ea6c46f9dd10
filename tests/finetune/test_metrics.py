"""Metrics: classification, correlations, SQuAD normalisation / EM / F1, ROUGE and BLEU through the libraries;
generated text scored in the model's word form."""
from __future__ import annotations

import math

import pytest

from finetune.generation import score_predictions
from finetune.metrics import (
    accuracy,
    binary_f1,
    classification_metrics,
    generation_metrics,
    macro_f1,
    matthews_corrcoef,
    normalize_answer,
    pearson,
    spearman,
    squad_exact_match,
    squad_f1,
    squad_metrics,
)
from finetune.tokenizer import load_tokenizer


def test_accuracy_and_macro_f1():
    gold = ["a", "a", "b", "c"]
    predicted = ["a", "b", "b", "b"]
    assert accuracy(predicted, gold) == 0.5
    # per class F1: a 2·1/(1+2)=2/3, b 2·1/(3+1)=1/2, c 0 → mean 7/18
    assert macro_f1(predicted, gold) == pytest.approx(7 / 18)
    assert macro_f1(gold, gold) == 1.0
    with pytest.raises(ValueError):
        accuracy([1], [1, 2])


def test_matthews_correlation_and_binary_f1_match_scikit_learn():
    # reference values: sklearn.metrics.matthews_corrcoef / f1_score(pos_label=1) on the same inputs
    assert matthews_corrcoef([1, 0, 1, 1], [1, 1, 1, 0]) == pytest.approx(-1 / 3)
    assert matthews_corrcoef(list("abbcabc"), list("aabccba")) == pytest.approx(0.375)  # multi-class
    assert binary_f1([1, 0, 0, 1, 1], [1, 1, 0, 1, 0], positive=1) == pytest.approx(2 / 3)
    # a constant prediction: high accuracy on skewed labels, Matthews correlation 0 (the reason CoLA uses it)
    gold = [1] * 7 + [0] * 3
    constant = classification_metrics([1] * 10, gold, positive=1)
    assert constant["accuracy"] == 0.7 and constant["mcc"] == 0.0 and constant["f1"] == pytest.approx(14 / 17)
    assert "f1" not in classification_metrics([1] * 10, gold)
    assert matthews_corrcoef(gold, gold) == 1.0 and binary_f1([0, 0], [0, 0], positive=1) == 0.0


def test_correlations():
    assert pearson([1, 2, 3], [2, 4, 6]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [1, 4, 9, 100]) == pytest.approx(1.0)
    assert spearman([1, 2, 2, 3], [3, 2, 2, 1]) == pytest.approx(-1.0)  # ties get averaged ranks
    assert pearson([1, 1, 1], [1, 2, 3]) == 0.0
    # a diverged regression head: no plausible-looking number
    assert math.isnan(spearman([math.nan, 1, 2, 3], [1, 2, 3, 4])) and math.isnan(pearson([math.inf, 1], [1, 2]))


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
    # gold answers that normalise to nothing are left out (official v2.0 script): "" does not match "the"
    assert squad_metrics({"q1": ""}, {"q1": ["Denver Broncos", "the"]}) == {"exact_match": 0.0, "f1": 0.0}
    assert squad_metrics({"q1": ""}, {"q1": ["the", "a"]})["exact_match"] == 100.0  # nothing left: no answer
    # v1.1's script scores every gold answer as it is, and its F1 is 0 when either side is empty
    assert squad_metrics({"q1": "the"}, {"q1": ["the", "cat"]}, version_2=False) == {"exact_match": 100.0, "f1": 0.0}
    assert squad_metrics({"q1": ""}, {"q1": ["the"]}, version_2=False) == {"exact_match": 100.0, "f1": 0.0}
    assert squad_metrics({"q1": ""}, {"q1": ["the"]}) == {"exact_match": 100.0, "f1": 100.0}


def test_generation_metrics_use_rouge_score_and_sacrebleu():
    scores = generation_metrics(["the cat sat on the mat"], ["the cat sat on the mat"])
    assert scores["rouge1"] == pytest.approx(100.0) and scores["rougeL"] == pytest.approx(100.0)
    assert scores["bleu"] == pytest.approx(100.0)
    # case-insensitive, as ROUGE (and question generation's BLEU-4, on lower-cased data): a cased model is not
    # scored on what an uncased one could not even produce
    assert generation_metrics(["The Cat sat on the mat"], ["the cat sat on the Mat"])["bleu"] == pytest.approx(100.0)
    partial = generation_metrics(["sat cats"], ["the cat sat down"])
    assert 0 < partial["rouge1"] < 100 and partial["rouge2"] == 0.0


def test_rouge_words_keep_unicode_and_equal_rouge_score_on_ascii():
    from rouge_score import rouge_scorer

    from finetune.metrics import RougeWords
    default = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)
    ours = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], tokenizer=RougeWords())
    pairs = [("The cats were running, didn't they?", "the cat runs: did they not"),
             ("U.S. $280bn deal signed in 2019", "us deal of 280bn signed 2019")]
    for reference, prediction in pairs:
        assert ours.score(reference, prediction) == default.score(reference, prediction)
    # rouge-score's default keeps [a-z0-9] only: identical Russian text scores 0 there
    assert default.score("Москва открывает метро", "Москва открывает метро")["rouge1"].fmeasure == 0.0
    assert generation_metrics(["Москва открывает метро"], ["Москва открывает метро"])["rouge1"] == pytest.approx(100)
    assert generation_metrics(["société générale"], ["Société Générale"])["rougeL"] == pytest.approx(100)


def test_rouge_lsum_is_summary_level_rouge_l_over_sentences(minilm_dir):
    """rougeLsum equals rouge-score's on newline-split ASCII text; it scores each reference sentence against the
    whole prediction, so a summary with its sentences in another order keeps its score, where rougeL halves."""
    from rouge_score import rouge_scorer

    reference = "Police arrested two men in London.\nThe men were charged with fraud on Monday"
    prediction = "The two men were charged with fraud.\nPolice arrested them in London."
    ours = generation_metrics([prediction], [reference])["rougeLsum"]
    theirs = rouge_scorer.RougeScorer(["rougeLsum"], use_stemmer=True).score(reference, prediction)["rougeLsum"]
    assert ours == pytest.approx(100 * theirs.fmeasure) and 0 < ours < 100
    # scored in the model's word form, sentences split as shard building splits them (lines, then punctuation)
    tokenizer = load_tokenizer(minilm_dir)
    swapped = "The men were charged with fraud on Monday. Police arrested two men in London."
    scores = score_predictions(tokenizer, [swapped], [reference])
    assert scores["rougeLsum"] == pytest.approx(100) and scores["rougeL"] < 60
    assert scores["rouge1"] == pytest.approx(100)
    # an uncased model's output has no capitals, nor have lowercased tokenised references (CNN/DM's common
    # releases), short as they are: their sentences are split all the same
    lowercase = tokenizer.decode(tokenizer.encode(swapped))
    assert lowercase == lowercase.lower() and len(lowercase) < 200
    tokenised = "police arrested two men in london . the men were charged with fraud on monday ."
    scores = score_predictions(tokenizer, [lowercase], [tokenised])
    assert scores["rougeLsum"] == pytest.approx(100) and scores["rougeL"] < 60


def test_generated_text_is_scored_in_the_model_word_form(minilm_dir, samples_dir, caplog):
    """A perfect uncased model's output (its own decoding of the reference) scores 100 BLEU and ROUGE against the
    real cased references; the raw comparison would count case and the decoder's spacing as errors."""
    import json
    tokenizer = load_tokenizer(minilm_dir)  # uncased
    references = ["BA's $280bn five-year deal for 45,000 U.S. staff", "Café Société wins award"]
    articles = sorted((samples_dir / "bbc").rglob("*.txt"))[:30]
    references += [path.read_text(encoding="utf-8", errors="replace").splitlines()[0] for path in articles]
    perfect = [tokenizer.decode(tokenizer.encode(r)) for r in references]
    assert perfect[0] != references[0]  # lower-cased and re-spaced: "ba's $ 280bn five - year ..."
    raw = generation_metrics(perfect, references)
    scored = score_predictions(tokenizer, perfect, references)
    assert scored["bleu"] == pytest.approx(100) and scored["rougeL"] == pytest.approx(100), json.dumps(scored)
    assert scored["rougeLsum"] == pytest.approx(100), json.dumps(scored)
    generation_metrics(["the men were charged ."] * 100, ["the men were charged ."] * 100)
    assert "detokenize" not in caplog.text  # word form ends sentences in " ." on purpose: no warning at each scoring
    assert raw["bleu"] < 80
    assert tokenizer.words("BA's $280bn") == "ba ' s $ 280bn" == tokenizer.words("ba ' s $ 280bn")
