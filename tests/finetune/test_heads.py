"""Task heads and losses on tiny models: classification (single, pair, similarity, multiple choice, regression,
GPT-1 auxiliary LM), extractive QA windows / targets / predictions, and bad-input messages."""
from __future__ import annotations

import dataclasses
import json
import math
import random

import numpy as np
import pytest
import torch

from finetune import classify, qa
from finetune.tokenizer import load_tokenizer
from pretrain.hf import load_hf_bert
from pretrain.model import build_model


@pytest.fixture()
def backbone(tiny_init):
    return load_hf_bert(tiny_init)


@pytest.fixture()
def tokenizer(tiny_init):
    return load_tokenizer(tiny_init)


def train_a_little(model, batch, steps=30, lr=3e-3) -> list[float]:
    torch.manual_seed(0)  # dropout masks: the same run every time
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        loss = model(**batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


RECORDS = [{"text": "shares fell on the stock market", "label": "business"},
           {"text": "the striker scored twice in the final", "label": "sport"},
           {"text": "profits rose at the bank", "label": "business"},
           {"text": "the team won the cup", "label": "sport"}]


def test_classification_learns_and_predicts_label_ids(backbone, tokenizer):
    labels = classify.LabelSpace.from_records(RECORDS, "train")
    assert labels.classes == ("business", "sport")
    examples, cut = classify.encode_examples(RECORDS, tokenizer, labels, 64, similarity=False, where="train")
    model = classify.ClassifierModel(backbone, labels, dropout=0.0)
    losses = train_a_little(model, classify.collate(examples, tokenizer.pad_id, False))
    assert losses[-1] < 0.5 * losses[0]
    assert classify.evaluate(model, examples, tokenizer.pad_id)["accuracy"] == 1.0


def test_pairs_are_truncated_longest_first_and_counted(tokenizer):
    packed, len_a, cut = classify.pack_views(tokenizer, [("a b c d e f g h", "x y")], max_seq_len=8)
    assert cut == 1 and len(packed[0]) == 8 and len_a[0] == 2 + 3  # a keeps 3 pieces, b keeps 2
    assert packed[0].count(tokenizer.sep_id) == 2


def test_unknown_dev_label_is_refused_and_mixed_labels_are_classes(tokenizer):
    labels = classify.LabelSpace.from_records(RECORDS, "train")
    with pytest.raises(ValueError, match=r"dev.jsonl: record 1 has label 'weather', unknown"):
        classify.encode_examples([{"text": "rain", "label": "weather"}], tokenizer, labels, 64, False, "dev.jsonl")
    mixed = [{"text": "a", "label": "x"}, {"text": "b", "label": 1}, {"text": "c", "label": 2.5}]
    assert classify.LabelSpace.from_records(mixed, "train").classes == ("1", "2.5", "x")
    with pytest.raises(ValueError, match=r"train: record 1 has label 'x', expected a number \(regression\)"):
        classify.LabelSpace.from_records(mixed, "train", regression=True)


def test_similarity_sums_both_orders(backbone, tokenizer):
    records = [{"text": "the cat sat", "text_b": "a dog ran", "label": "no"},
               {"text": "a dog ran", "text_b": "the cat sat", "label": "no"}]
    labels = classify.LabelSpace.from_records(records, "train")
    examples, _ = classify.encode_examples(records, tokenizer, labels, 32, similarity=True, where="train")
    assert len(examples[0].views) == 2 and examples[0].views == examples[1].views[::-1]
    model = classify.ClassifierModel(backbone, labels, dropout=0.0).eval()
    batch = classify.collate(examples, tokenizer.pad_id, False)
    logits, *_ = model.scores(batch["input_ids"], batch["len_a"], batch["length"])
    torch.testing.assert_close(logits[0], logits[1], atol=1e-5, rtol=1e-5)  # symmetric in the pair order


def test_multiple_choice_scores_each_choice_and_softmaxes_over_them(backbone, tokenizer):
    # the right choice is the same text at different indices: learnable only by scoring each choice's content
    records = [{"context": "the market", "choices": ["shares fell", "goal scored", "new phone"], "label": 0},
               {"context": "the match", "choices": ["goal scored", "shares fell", "new phone"], "label": 1}]
    labels = classify.LabelSpace.from_records(records, "train")
    assert labels.multiple_choice and labels.num_outputs == 1
    examples, _ = classify.encode_examples(records, tokenizer, labels, 32, False, "train")
    model = classify.ClassifierModel(backbone, labels, dropout=0.0)
    batch = classify.collate(examples, tokenizer.pad_id, False)
    logits, *_ = model.scores(batch["input_ids"], batch["len_a"], batch["length"])
    assert logits.shape == (2, 3)
    losses = train_a_little(model, batch, steps=40)
    assert losses[-1] < 0.5 * losses[0]
    assert classify.predict(model, examples, tokenizer.pad_id) == [0, 1]
    with pytest.raises(ValueError, match="expected a choice index"):
        classify.encode_examples([dict(records[0], label=3)], tokenizer, labels, 32, False, "train")


def test_regression_uses_mse_and_correlations(backbone, tokenizer):
    records = [{"text": "good", "label": 1.0}, {"text": "bad", "label": -1.0}, {"text": "fine", "label": 0.5}]
    labels = classify.LabelSpace.from_records(records, "train")
    assert labels.regression
    examples, _ = classify.encode_examples(records, tokenizer, labels, 16, False, "train")
    model = classify.ClassifierModel(backbone, labels, dropout=0.0)
    train_a_little(model, classify.collate(examples, tokenizer.pad_id, True), steps=60)
    assert set(classify.evaluate(model, examples, tokenizer.pad_id)) == {"pearson", "spearman"}
    assert classify.evaluate(model, examples, tokenizer.pad_id)["pearson"] > 0.9


@pytest.mark.parametrize("causal", [False, True])
def test_auxiliary_lm_loss_adds_weighted_next_token_loss(backbone, tokenizer, causal):
    if causal:  # a GPT-style model: final vector = last real token, one forward for both losses
        backbone = build_model(dataclasses.replace(backbone.cfg, causal_lm=True))
    labels = classify.LabelSpace.from_records(RECORDS, "train")
    examples, _ = classify.encode_examples(RECORDS, tokenizer, labels, 64, False, "train")
    batch = classify.collate(examples, tokenizer.pad_id, False)
    plain = classify.ClassifierModel(backbone, labels, dropout=0.0, aux_lm_weight=0.0)
    torch.manual_seed(0)
    with_lm = classify.ClassifierModel(backbone, labels, dropout=0.0, aux_lm_weight=0.5)
    with_lm.head.load_state_dict(plain.head.state_dict())
    plain.eval(), with_lm.eval()  # no dropout: the two forwards must see the same network
    flat_ids, flat_length = batch["input_ids"][:, 0], batch["length"][:, 0]
    lm = backbone.causal_lm_loss(flat_ids, flat_length)
    torch.testing.assert_close(with_lm(**batch), plain(**batch) + 0.5 * lm)
    assert 0.5 * lm.item() > 1.0  # the LM term is really there (≈ ln(vocab) on a random model)


def test_qa_windows_targets_and_predictions_round_trip(samples_dir, backbone, tokenizer):
    questions, version_2 = qa.read_squad(samples_dir / "squad.json")
    assert not version_2 and len(questions) >= 3
    windows = qa.make_windows(questions, tokenizer, max_seq_len=96, doc_stride=48, max_query_len=16)
    assert len(windows) > len(questions)  # long contexts became several overlapping windows
    for window in windows:
        assert len(window.input_ids) <= 96
        if window.start_position:  # the target span covers the gold answer (whole word pieces: the fixture's
            # "Father Julius Nieuwl" becomes "Father Julius Nieuwland")
            q = questions[window.question_index]
            first = window.len_a
            s, e = window.offsets[window.start_position - first][0], window.offsets[window.end_position - first][1]
            assert q.answers[0].lower() in q.context[s:e].lower() and e - s < len(q.answers[0]) + 8
    answered = {w.question_index for w in windows if w.start_position}
    assert answered == set(range(len(questions)))
    model = qa.SpanModel(backbone)
    batch = qa.collate(windows, tokenizer.pad_id)
    losses = train_a_little(model, batch, steps=40, lr=2e-3)
    assert losses[-1] < 0.5 * losses[0]
    predictions = qa.answers_of(qa.predict_spans(model, questions, windows, tokenizer.pad_id, max_answer_len=30),
                                questions, version_2=False)
    assert all(predictions[q.qid] and predictions[q.qid] in q.context for q in questions)
    # a 2-layer random model learns where answers sit in each context, not yet which question asks for which
    scores = qa.evaluate(model, questions, windows, tokenizer.pad_id, max_answer_len=30, version_2=False)
    assert scores["exact_match"] >= 20.0 and scores["f1"] >= scores["exact_match"], scores


def test_a_predicted_span_keeps_the_decomposed_accent_of_its_last_letter(backbone, tokenizer):
    """"José" written as e + U+0301: the uncased tokenizer strips the mark, so the piece's offsets end before it;
    the answer still takes it (it belongs to the letter), so it matches the gold answer."""
    context = "The owner Jose\u0301 left early."
    question = qa.Question("q", "Who left?", context, ("Jose\u0301",), context.index("Jose"))
    [window] = qa.make_windows([question], tokenizer, max_seq_len=32, doc_stride=16, max_query_len=8)
    offsets = window.offsets.tolist()
    first = next(i for i, (begin, _) in enumerate(offsets) if begin == context.index("Jose"))
    last = next(i for i, (_, end) in enumerate(offsets) if end == context.index("Jose") + 4)  # before the mark
    starts, ends = torch.full((2, 1, len(window.input_ids)), -10.0)
    starts[0, window.len_a + first] = ends[0, window.len_a + last] = 10.0
    model = qa.SpanModel(backbone)
    model.span_logits = lambda ids, len_a, length: (starts[:, : ids.shape[1]], ends[:, : ids.shape[1]])
    [prediction] = qa.predict_spans(model, [question], [window], tokenizer.pad_id, max_answer_len=30)
    assert prediction.text == "Jose\u0301"
    assert qa.scores([prediction], [question], version_2=False)["exact_match"] == 100.0


def test_positive_class_and_the_metric_that_picks_the_best_epoch():
    binary, topics = classify.LabelSpace(classes=("0", "1")), classify.LabelSpace(classes=("a", "b", "c"))
    assert classify.positive_class(binary, None, "t") == 1  # "1" of 0/1
    assert classify.positive_class(topics, None, "t") is None and classify.positive_class(topics, "c", "t") == 2
    with pytest.raises(ValueError, match=r"positive_label='yes' is not a class of t: \['0', '1'\]"):
        classify.positive_class(binary, "yes", "t")
    with pytest.raises(ValueError, match="has no classes"):
        classify.positive_class(classify.LabelSpace(regression=True), "1", "t")
    assert classify.metrics_of(binary, 1) == ("accuracy", "macro_f1", "mcc", "f1")
    assert classify.metrics_of(classify.LabelSpace(regression=True), None) == ("pearson", "spearman")


def test_qa_windows_cover_every_context_token_when_the_stride_exceeds_the_window(samples_dir, tokenizer):
    """doc_stride larger than the context a window holds (the defaults 128/128 with any question) is capped at
    that room: no context token falls between two windows."""
    questions, _ = qa.read_squad(samples_dir / "squad.json")
    for max_seq_len, doc_stride in ((64, 64), (128, 128), (48, 200)):
        windows = qa.make_windows(questions, tokenizer, max_seq_len, doc_stride, max_query_len=16)
        for index, q in enumerate(questions):
            _, offsets = tokenizer.encode_with_offsets(q.context)
            covered = {tuple(span) for w in windows if w.question_index == index for span in w.offsets.tolist()}
            assert covered == set(offsets), (max_seq_len, doc_stride, q.qid)


def test_qa_span_starts_only_in_the_window_giving_it_most_context(samples_dir, backbone, tokenizer):
    """BERT's rule for overlapping windows: each context word piece belongs to exactly one window, and a span may
    only start where it belongs. A piece scoring highest near the edge of another window loses to the best span
    its own window offers."""
    questions, _ = qa.read_squad(samples_dir / "squad.json")
    question = max(questions, key=lambda q: len(q.context))
    windows = qa.make_windows([question], tokenizer, max_seq_len=48, doc_stride=12, max_query_len=8)
    assert len(windows) >= 3
    owners = np.zeros(len(windows[0].pieces.context_ids), dtype=int)
    for window in windows:
        owners[window.context_start: window.context_stop] += window.max_context(windows)
    assert (owners == 1).all()
    # piece j: in windows 0 and 1, owned by window 1; window 0 scores it 10 + 10, window 1 scores piece k 3 + 3
    j = next(p for p in range(windows[1].context_start, windows[0].context_stop)
             if windows[1].max_context(windows)[p - windows[1].context_start])
    k = windows[1].context_stop - 1 if windows[1].max_context(windows)[-1] else j + 1
    logits = torch.full((len(windows), max(len(w.input_ids) for w in windows)), -10.0)
    logits[0, windows[0].len_a + j - windows[0].context_start] = 10.0
    logits[1, windows[1].len_a + k - windows[1].context_start] = 3.0
    model = qa.SpanModel(backbone)
    model.span_logits = lambda ids, len_a, length: (logits[:, : ids.shape[1]], logits[:, : ids.shape[1]])
    [prediction] = qa.predict_spans(model, [question], windows, tokenizer.pad_id, max_answer_len=30)
    begin, end = windows[0].pieces.offsets[k]
    assert prediction.text == question.context[begin:end] and k != j


def test_squad2_threshold_and_the_official_breakdown():
    """null_score_diff_threshold moves the line between span and "", and the breakdown reports EM/F1 over the
    answerable and unanswerable questions and at the threshold that would have been best (worked by hand)."""
    def question(qid, *answers):
        return qa.Question(qid, "?", "Paris London Berlin France Rome", answers, 0 if answers else None)
    questions = [question("q1", "Paris"), question("q2", "London"), question("q3"), question("q4")]
    predictions = [qa.Prediction("Paris", -2.0), qa.Prediction("Berlin", 1.0), qa.Prediction("France", 3.0),
                   qa.Prediction("Rome", -1.0)]
    assert qa.answers_of(predictions, questions, version_2=True) == {"q1": "Paris", "q2": "", "q3": "", "q4": "Rome"}
    assert qa.answers_of(predictions, questions, version_2=True, null_score_diff_threshold=-2.0)["q4"] == ""
    assert qa.answers_of(predictions, questions, version_2=False)["q3"] == "France"
    breakdown = qa.squad2_breakdown(predictions, questions)
    assert (breakdown["has_ans_exact"], breakdown["no_ans_exact"]) == (50.0, 50.0)
    # all "": q3, q4 right (2 of 4); from margin -2 on q1 answers Paris (3); from -1 q4 says Rome (2); ...
    assert (breakdown["best_exact"], breakdown["best_exact_threshold"]) == (75.0, -2.0)
    assert (breakdown["best_f1"], breakdown["best_f1_threshold"]) == (75.0, -2.0)
    # a question no window offered a span for is "" at every threshold, and every figure stays finite
    questions.append(question("q5"))
    predictions.append(qa.Prediction("", math.inf))
    assert qa.answers_of(predictions, questions, version_2=True, null_score_diff_threshold=1e9)["q5"] == ""
    breakdown = qa.squad2_breakdown(predictions, questions)
    assert (breakdown["best_exact"], breakdown["best_exact_threshold"]) == (80.0, -2.0)
    assert (breakdown["span_best_exact"], breakdown["span_best_exact_threshold"]) == (80.0, -2.0)
    assert all(math.isfinite(value) for value in breakdown.values())


def official_v2_best(answers: dict[str, str], na_probs: dict[str, float], gold: dict[str, list[str]]):
    """evaluate-v2.0.py's best_exact / best_f1 (and thresholds) of a predictions file and its na-prob file, written
    out from the script's published procedure: raw scores of the written answers, then `find_best_thresh`."""
    from finetune.metrics import squad_exact_match, squad_f1
    has_ans = {qid: bool(golds) for qid, golds in gold.items()}
    results = {}
    for name, score in (("exact", squad_exact_match), ("f1", squad_f1)):
        raw = {qid: max(score(answers[qid], a) for a in ([a for a in golds if normalize(a)] or [""]))
               for qid, golds in gold.items()}
        current = best = sum(not h for h in has_ans.values())
        threshold = 0.0
        for qid in sorted(na_probs, key=lambda k: na_probs[k]):
            current += raw[qid] if has_ans[qid] else (-1 if answers[qid] else 0)
            if current > best:
                best, threshold = current, na_probs[qid]
        results[f"best_{name}"], results[f"best_{name}_threshold"] = 100.0 * best / len(raw), threshold
    return results


def official_v2_headline(answers: dict[str, str], na_probs: dict[str, float], gold: dict[str, list[str]],
                         threshold: float) -> dict[str, float]:
    """evaluate-v2.0.py's exact / f1 and HasAns / NoAns figures with `--na-prob-thresh threshold`: raw scores, then
    `apply_no_ans_threshold` (a question whose na-prob is above the threshold scores `not has_ans`)."""
    from finetune.metrics import squad_exact_match, squad_f1
    results = {}
    for name, score in (("exact", squad_exact_match), ("f1", squad_f1)):
        scored = {qid: float(not golds) if na_probs[qid] > threshold
                  else max(score(answers[qid], a) for a in ([a for a in golds if normalize(a)] or [""]))
                  for qid, golds in gold.items()}
        results["exact_match" if name == "exact" else "f1"] = 100.0 * sum(scored.values()) / len(scored)
        for group, wanted in (("has_ans", True), ("no_ans", False)):
            members = [qid for qid, golds in gold.items() if bool(golds) == wanted]
            if members:
                results[f"{group}_{name}"] = 100.0 * sum(scored[qid] for qid in members) / len(members)
    return results


def normalize(text):
    from finetune.metrics import normalize_answer
    return normalize_answer(text)


def test_squad2_best_scores_are_the_official_scripts_on_the_written_files():
    """The official script sees the answers as written: a question answered "" at the run's threshold stays so.
    Here that hides q1's right span (margin 0.5 > 0): the official best is 66.7 at -1, while the span sweep, which
    has every span in hand, finds 100 at 0.5. On random questions both agree with the script's procedure."""
    def question(qid, *answers):
        return qa.Question(qid, "?", "Denver foo", answers, 0 if answers else None)
    questions = [question("q1", "Denver"), question("q2"), question("q3", "Denver")]
    predictions = [qa.Prediction("Denver", 0.5), qa.Prediction("foo", 2.0), qa.Prediction("Denver", -1.0)]
    breakdown = qa.squad2_breakdown(predictions, questions)
    assert (breakdown["best_exact"], breakdown["best_exact_threshold"]) == (pytest.approx(200 / 3), -1.0)
    assert (breakdown["span_best_exact"], breakdown["span_best_exact_threshold"]) == (100.0, 0.5)
    rng = random.Random(0)
    words = ["Denver", "the Broncos", "Paris", "a", "London bridge", "France", "the", "."]  # "a", "the", ".": nothing
    for case in range(300):
        questions = [question(f"q{i}", *rng.sample(words, rng.choice([0, 0, 1, 2]))) for i in range(rng.randint(1, 9))]
        predictions = [qa.Prediction(rng.choice(words), rng.choice([-2.0, -1.0, -0.5, 0.0, 0.5, 1.0, math.inf]))
                       for _ in questions]
        threshold = rng.choice([0.0, -1.0, 0.7])
        answers = qa.answers_of(predictions, questions, True, threshold)
        na_probs = {q.qid: p.null_margin for q, p in zip(questions, predictions)}
        expected = official_v2_best(answers, na_probs, {q.qid: list(q.answers) for q in questions})
        got = qa.squad2_breakdown(predictions, questions, threshold)
        assert {k: got[k] for k in expected} == pytest.approx(expected), case
        expected = official_v2_headline(answers, na_probs, {q.qid: list(q.answers) for q in questions}, threshold)
        got = qa.scores(predictions, questions, True, threshold)
        assert {k: got[k] for k in expected} == pytest.approx(expected), case


def test_an_answerable_question_left_unanswered_scores_0_and_the_file_sets_the_rules():
    """Gold answers that all normalise to nothing ("the"): left unanswered, the question still has answers, so the
    official script scores it 0 (an answer "" would match the nothing they normalise to). A 2.0 model's answers to
    a v1.1 file are scored by v1.1's rules, under which F1 of two answers that normalise to nothing is 0."""
    questions = [qa.Question("q1", "?", "the cat", ("the",), 0), qa.Question("q2", "?", "the cat", ("cat",), 4)]
    predictions = [qa.Prediction("cat", 2.0), qa.Prediction("cat", -1.0)]  # q1 left unanswered (2 > 0)
    scores = qa.scores(predictions, questions, True, 0.0)
    assert (scores["exact_match"], scores["f1"], scores["has_ans_exact"]) == (50.0, 50.0, 50.0)
    answered = [qa.Prediction("the", -1.0)]
    assert qa.scores(answered, questions[:1], True, 0.0)["f1"] == 100.0
    assert qa.scores(answered, questions[:1], True, 0.0, file_version_2=False) == {"exact_match": 100.0, "f1": 0.0}


def test_a_sloppy_answer_start_takes_the_nearest_occurrence(tmp_path):
    context = "In 1990 the firm was founded; it moved in 1990 to Paris."
    squad = {"data": [{"paragraphs": [{"context": context, "qas": [
        {"id": "q1", "question": "When did it move?", "answers": [{"text": "1990", "answer_start": 43}]}]}]}]}
    (tmp_path / "sloppy.json").write_text(json.dumps(squad))
    questions, _ = qa.read_squad(tmp_path / "sloppy.json")
    assert questions[0].answer_start == context.rindex("1990") == 42


def test_a_file_not_laid_out_as_squad_is_named_with_the_layout(tmp_path):
    (tmp_path / "records.jsonl").write_text('{"question": "Who?", "context": "Me.", "answers": {"text": ["Me"]}}\n'
                                            '{"question": "When?", "context": "Now.", "answers": {"text": ["Now"]}}\n')
    with pytest.raises(ValueError, match=r"records.jsonl: not JSON \(Extra data.*extractive QA reads a SQuAD JSON"):
        qa.read_squad(tmp_path / "records.jsonl")
    (tmp_path / "flat.json").write_text(json.dumps({"data": [{"question": "Who?", "context": "Me."}]}))
    with pytest.raises(ValueError, match=r"flat.json: no 'paragraphs' where a SQuAD JSON file"):
        qa.read_squad(tmp_path / "flat.json")
    unplaced = {"data": [{"paragraphs": [{"context": "It is Paris, not Lyon.", "qas": [
        {"id": "q1", "question": "Where?", "answers": [{"text": "Paris"}]},
        {"id": "q2", "question": "Which?", "answers": [{"answer_start": 0}]}]}]}]}
    (tmp_path / "unplaced.json").write_text(json.dumps(unplaced))
    with pytest.raises(ValueError, match=r"unplaced.json: question q2: no 'text' where"):
        qa.read_squad(tmp_path / "unplaced.json")
    del unplaced["data"][0]["paragraphs"][0]["qas"][1]  # an answer without answer_start: its first occurrence
    (tmp_path / "unplaced.json").write_text(json.dumps(unplaced))
    assert qa.read_squad(tmp_path / "unplaced.json")[0][0].answer_start == 6


def test_qa_answer_not_in_context_and_squad2_no_answer(tmp_path, backbone, tokenizer):
    bad = {"data": [{"paragraphs": [{"context": "Paris is in France.", "qas": [
        {"id": "q1", "question": "Where?", "answers": [{"text": "Berlin", "answer_start": 0}]}]}]}]}
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="question q1: answer 'Berlin' is not in its context"):
        qa.read_squad(tmp_path / "bad.json")
    v2 = {"data": [{"paragraphs": [{"context": "Paris is in France.", "qas": [
        {"id": "q2", "question": "Who?", "answers": [], "is_impossible": True}]}]}]}
    (tmp_path / "v2.json").write_text(json.dumps(v2))
    questions, version_2 = qa.read_squad(tmp_path / "v2.json")
    assert version_2 and questions[0].answers == ()
    windows = qa.make_windows(questions, tokenizer, 32, 16, 8)
    assert (windows[0].start_position, windows[0].end_position) == (0, 0)  # [CLS] = no answer
    model = qa.SpanModel(backbone)
    with torch.no_grad():  # make [CLS] win: the null answer must be predicted as ""
        model.head.bias.fill_(0.0)
        model.head.weight.zero_()
    def answers() -> dict[str, str]:
        return qa.answers_of(qa.predict_spans(model, questions, windows, tokenizer.pad_id, 30), questions, True)

    # every logit 0: [CLS] ties the best span, and as in the official script a tie answers with the span
    assert answers()["q2"] != ""
    model.span_logits = lambda ids, len_a, length: (torch.tensor([[5.0] + [0.0] * (ids.shape[1] - 1)]),) * 2
    assert answers() == {"q2": ""}
