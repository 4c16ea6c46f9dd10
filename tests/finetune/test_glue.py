"""Classification files as they are published: GLUE's TSVs and Hugging Face `glue` exports read as the same
examples, the label rule (floats are regression, integers and strings classes), BERT's pair truncation, and
`finetune.predict` writing GLUE's submission format and scoring a labelled file as fine-tuning's dev evaluation."""
from __future__ import annotations

import json

import pytest

from finetune import classify, predict, run
from finetune.glue import GLUE_TASKS, read_records, record_format
from finetune.task_files import read_jsonl, write_jsonl
from finetune.tokenizer import load_tokenizer


def rotten(small_tasks, split: str) -> list[dict]:
    """Real review snippets, tabs and line breaks flattened (a GLUE TSV row is one line)."""
    return [{"text": " ".join(r["text"].split()), "label": r["label"]}
            for r in read_jsonl(small_tasks[f"rotten.{split}"])]


def write_tsv(path, header: list[str] | None, rows: list[list]) -> None:
    lines = ([header] if header else []) + rows
    path.write_text("".join("\t".join(map(str, row)) + "\n" for row in lines), encoding="utf-8")


def test_glue_tsvs_and_hugging_face_exports_read_as_the_same_examples(small_tasks, tmp_path, caplog):
    import pyarrow as pa
    import pyarrow.parquet as pq

    reviews = rotten(small_tasks, "train")[:12]
    reviews[0]["text"] = 'He said "it works and then " left'  # GLUE's texts hold bare quotes: read as they are
    first, second = [r["text"] for r in reviews[:6]], [r["text"] for r in reviews[6:12]]
    binary = [int(r["label"] == "fresh") for r in reviews[:6]]
    nli = ["entailment", "neutral", "contradiction", "neutral", "entailment", "contradiction"]

    # GLUE's TSVs: CoLA train/dev have no header row; MRPC's own column names; MNLI's parses and annotator labels
    write_tsv(tmp_path / "cola.tsv", None, [["gj04", y, "", t] for y, t in zip(binary, first)])
    write_tsv(tmp_path / "mrpc.tsv", ["\ufeffQuality", "#1 ID", "#2 ID", "#1 String", "#2 String"],  # a BOM, as MRPC's
              [[y, 10 + i, 20 + i, a, b] for i, (y, a, b) in enumerate(zip(binary, first, second))])
    write_tsv(tmp_path / "mnli.tsv", ["index", "promptID", "pairID", "genre", "sentence1_binary_parse",
                                      "sentence2_binary_parse", "sentence1_parse", "sentence2_parse", "sentence1",
                                      "sentence2", "label1", "gold_label"],
              [[i, 0, 0, "fiction", "( x )", "( y )", "(ROOT x)", "(ROOT y)", a, b, y, y]
               for i, (a, b, y) in enumerate(zip(first, second, nli))])
    qqp_rows = [[i, 1, 2, a, b, y] for i, (a, b, y) in enumerate(zip(first, second, binary))]
    write_tsv(tmp_path / "qqp.tsv", ["id", "qid1", "qid2", "question1", "question2", "is_duplicate"],
              qqp_rows[:3] + [[99, 1, 2, "a question cut short"]] + qqp_rows[3:])  # as a few of QQP's rows are
    write_tsv(tmp_path / "stsb.tsv", ["index", "genre", "filename", "year", "old_index", "source1", "source2",
                                      "sentence1", "sentence2", "score"],
              [[i, "g", "f", "y", i, "s", "s", a, b, f"{i * 0.8:.3f}"] for i, (a, b) in enumerate(zip(first, second))])
    # Hugging Face `glue`: its column names, integer ClassLabel ids (mnli: entailment 0, neutral 1, contradiction 2)
    hf = {
        "cola": [{"sentence": t, "label": y, "idx": i} for i, (t, y) in enumerate(zip(first, binary))],
        "mrpc": [{"sentence1": a, "sentence2": b, "label": y, "idx": i}
                 for i, (a, b, y) in enumerate(zip(first, second, binary))],
        "mnli": [{"premise": a, "hypothesis": b, "label": ("entailment", "neutral", "contradiction").index(y),
                  "idx": i} for i, (a, b, y) in enumerate(zip(first, second, nli))],
        "qqp": [{"question1": a, "question2": b, "label": y, "idx": i}
                for i, (a, b, y) in enumerate(zip(first, second, binary))],
        "stsb": [{"sentence1": a, "sentence2": b, "label": i * 0.8, "idx": i}
                 for i, (a, b) in enumerate(zip(first, second))],
    }
    for task, rows in hf.items():
        pq.write_table(pa.Table.from_pylist(rows), tmp_path / f"{task}.parquet")
    write_jsonl(hf["mnli"], tmp_path / "mnli.jsonl")

    for task in hf:
        fmt = GLUE_TASKS[task]
        from_tsv = read_records(tmp_path / f"{task}.tsv", fmt)
        from_hf = read_records(tmp_path / f"{task}.parquet", fmt)
        texts = [{k: v for k, v in r.items() if k in ("text", "text_b")} for r in from_tsv]
        assert len(from_tsv) == 6 and texts == [{k: v for k, v in r.items() if k in ("text", "text_b")}
                                                for r in from_hf], task
        if task != "stsb":
            assert [r["label"] for r in from_tsv] == [r["label"] for r in from_hf], task
        assert [r["text"] for r in from_tsv] == first
        if task != "cola":
            assert [r["text_b"] for r in from_tsv] == second
        labels = classify.LabelSpace.from_records(from_tsv, task, fmt.regression)
        assert labels.regression == (task == "stsb"), task
        if task == "stsb":
            assert [float(r["label"]) for r in from_tsv] == pytest.approx([r["label"] for r in from_hf])
        else:  # the label names GLUE's TSVs (and its leaderboard) use, whichever layout was read
            assert [r["label"] for r in from_tsv] == ([str(y) for y in binary] if task != "mnli" else nli)
    assert read_records(tmp_path / "mnli.jsonl", GLUE_TASKS["mnli"]) == read_records(tmp_path / "mnli.parquet",
                                                                                      GLUE_TASKS["mnli"])
    assert "qqp.tsv: skipped 1 malformed row(s) (line 5: 4 fields, not 6)" in caplog.text  # a warning
    # Hugging Face's test splits carry label -1: no label
    pq.write_table(pa.Table.from_pylist([{"sentence": "a", "label": -1, "idx": 7}]), tmp_path / "test.parquet")
    assert read_records(tmp_path / "test.parquet", GLUE_TASKS["sst2"]) == [{"text": "a", "index": 7}]
    with pytest.raises(ValueError, match=r"cola.parquet: no 'text' column \(its columns: idx, label, sentence\); "
                                         "name the file's columns with text_field"):
        read_records(tmp_path / "cola.parquet", record_format({}))
    named = record_format({"text_field": "sentence1", "text_b_field": "sentence2"})
    assert read_records(tmp_path / "mrpc.parquet", named)[1] == {"text": first[1], "text_b": second[1],
                                                                "label": binary[1], "index": 1}
    assert read_records(tmp_path / "mnli.tsv", GLUE_TASKS["mnli"])[2]["index"] == "2"  # GLUE's own ids


def test_integers_and_strings_are_classes_and_floats_are_regression(capsys):
    """transformers' run_glue rule: labels written as floats are regression, integers classes; `regression`
    decides otherwise. Classes sort numbers by value."""
    space = classify.LabelSpace.from_records
    ints = [{"text": "x", "label": y} for y in (0, 1, 10, 2, 1)]
    assert space(ints, "f") == classify.LabelSpace(classes=("0", "1", "2", "10"))
    assert "numbers written as integers: read as 4 classes (0, 1, 2, 10); set regression: true" in \
        space(ints, "f").hint(ints)
    floats = [{"text": "x", "label": y} for y in (0, 3.8, 5)]
    assert space(floats, "f").regression and space(floats, "f").label_id(floats[1], 2, "f") == 3.8
    assert space(floats, "f", regression=False).classes == ("0", "3.8", "5")
    strings = [{"text": "x", "label": y} for y in ("3.8", "1.25", "0")]
    assert space(strings, "f").classes == ("0", "1.25", "3.8")
    assert "numbers written as strings: read as 3 classes" in space(strings, "f").hint(strings)
    assert space(strings, "f", regression=True).label_id(strings[0], 1, "f") == 3.8
    assert space([{"text": "x", "label": "pos"}], "f").hint([{"label": "pos"}]) is None
    assert space(ints, "f").label_id({"label": 10}, 1, "f") == 3
    assert space(ints, "f").label_id({"label": "10"}, 1, "f") == 3
    with pytest.raises(ValueError, match="f: record 2 has label True; every training record needs a label"):
        space([{"text": "x", "label": 1}, {"text": "x", "label": True}], "f")
    with pytest.raises(ValueError, match="f: record 1 has no label; every training record needs one"):
        space([{"text": "x"}], "f")
    with pytest.raises(ValueError, match=r"f: record 2 has label 'high', expected a number \(regression\)"):
        space([{"text": "x", "label": "1.5"}, {"text": "x", "label": "high"}], "f", regression=True)


def bert_truncate_seq_pair(tokens_a: list, tokens_b: list, max_length: int) -> None:
    """google-research/bert run_classifier's rule, restated: pop from the end of the longer, of b on a tie."""
    while len(tokens_a) + len(tokens_b) > max_length:
        (tokens_a if len(tokens_a) > len(tokens_b) else tokens_b).pop()


def test_pairs_are_cut_as_bert_cuts_them_and_a_bad_text_b_is_named(tiny_init, small_tasks):
    tokenizer = load_tokenizer(tiny_init)
    texts = [r["text"] for r in rotten(small_tasks, "train")]
    checked = 0
    for a_text, b_text in zip(texts, texts[1:]):
        for max_seq_len in (11, 12, 16, 31):
            a, b = tokenizer.encode(a_text), tokenizer.encode(b_text)
            bert_truncate_seq_pair(a, b, max_seq_len - 3)
            (packed,), (len_a,), _ = classify.pack_views(tokenizer, [(a_text, b_text)], max_seq_len)
            assert packed == [tokenizer.cls_id, *a, tokenizer.sep_id, *b, tokenizer.sep_id] and len_a == len(a) + 2
            checked += 1
    assert checked > 100
    labels = classify.LabelSpace(classes=("0", "1"))
    with pytest.raises(ValueError, match="bad.jsonl: record 2 has a 'text_b' of type int; it must be a string"):
        classify.encode_examples([{"text": "a", "text_b": "b", "label": "0"}, {"text": "a", "text_b": 7, "label": "1"}],
                                 tokenizer, labels, 32, False, where="bad.jsonl")


def test_a_glue_run_then_predict_writes_the_submission_format_and_scores_as_fine_tuning_did(small_tasks, tiny_init,
                                                                                            tmp_path, capsys):
    """SST-2's layout (real review snippets, labels 0/1): fine-tune with glue_task, then `finetune.predict` on a
    labelled dev TSV gives the run's best dev scores, and on a test TSV (`index<TAB>sentence`) GLUE's
    `index<TAB>prediction` lines."""
    train, dev = rotten(small_tasks, "train"), rotten(small_tasks, "dev")
    sst = {"fresh": 1, "rotten": 0}
    write_tsv(tmp_path / "train.tsv", ["sentence", "label"], [[r["text"], sst[r["label"]]] for r in train])
    write_tsv(tmp_path / "dev.tsv", ["sentence", "label"], [[r["text"], sst[r["label"]]] for r in dev])
    write_tsv(tmp_path / "test.tsv", ["index", "sentence"], [[100 + i, r["text"]] for i, r in enumerate(dev)])
    out = tmp_path / "run"
    summary = run.main(["--config", "finetune/configs/glue-classify.yaml", "--set", "glue_task=sst2", "--train",
                        str(tmp_path / "train.tsv"), "--dev", str(tmp_path / "dev.tsv"), "--init", str(tiny_init),
                        "--out", str(out), "--epochs", "2", "--batch-size", "8", "--lr", "1e-3", "--seed", "3"])
    meta = json.loads((out / "finetune.json").read_text())
    assert meta["labels"] == ["0", "1"] and not meta["regression"] and summary["best"]["accuracy"] > 0
    assert "[classify]" not in capsys.readouterr().out  # a GLUE task's labels need no hint

    scores = predict.main(["--model", str(out), "--input", str(tmp_path / "dev.tsv"), "--output",
                           str(tmp_path / "dev_pred.tsv")])
    assert scores == pytest.approx({k: summary["best"][k] for k in scores}, abs=1e-9)
    assert json.loads((tmp_path / "dev_pred.metrics.json").read_text()) == scores
    predict.main(["--model", str(out), "--input", str(tmp_path / "test.tsv"), "--output", str(tmp_path / "SST-2.tsv")])
    lines = (tmp_path / "SST-2.tsv").read_text().splitlines()
    assert lines[0] == "index\tprediction" and len(lines) == len(dev) + 1
    assert [line.split("\t")[0] for line in lines[1:]] == [str(100 + i) for i in range(len(dev))]
    assert {line.split("\t")[1] for line in lines[1:]} <= {"0", "1"}
    assert "have no label: not scored" in capsys.readouterr().out
    dev_predictions = [line.split("\t")[1] for line in (tmp_path / "dev_pred.tsv").read_text().splitlines()[1:]]
    assert dev_predictions == [line.split("\t")[1] for line in lines[1:]]  # the same texts, the same predictions
    with pytest.raises(SystemExit):
        predict.main(["--model", str(out), "--input", str(tmp_path / "test.tsv"), "--output",
                      str(tmp_path / "SST-2.tsv")])  # exists: needs --force


def test_delimited_labels_read_as_written_and_hugging_face_csv_exports_map_to_glue_names(tmp_path):
    """TSV/CSV hold only text: `1` reads as an integer, `3.800` as a float (regression), as pandas types run_glue's
    CSVs; a Hugging Face GLUE export saved as CSV maps its integer labels to GLUE's names, -1 (STS-B: -1.0) is no
    label; a file that is not UTF-8 is named."""
    write_tsv(tmp_path / "scores.tsv", ["text", "label"], [["a", "3.800"], ["b", "1"], ["c", "0.5"]])
    records = read_records(tmp_path / "scores.tsv", record_format({}))
    assert [r["label"] for r in records] == [3.8, 1, 0.5]
    assert classify.LabelSpace.from_records(records, "scores.tsv").regression
    (tmp_path / "mnli.csv").write_text("premise,hypothesis,label,idx\nA man,A person,0,0\nA dog,A cat,2,1\n"
                                       "Rain,Sun,-1,2\n")
    assert read_records(tmp_path / "mnli.csv", GLUE_TASKS["mnli"]) == [
        {"text": "A man", "text_b": "A person", "label": "entailment", "index": "0"},
        {"text": "A dog", "text_b": "A cat", "label": "contradiction", "index": "1"},
        {"text": "Rain", "text_b": "Sun", "index": "2"}]
    (tmp_path / "stsb.csv").write_text("sentence1,sentence2,label,idx\nA,B,-1.0,0\n")
    assert read_records(tmp_path / "stsb.csv", GLUE_TASKS["stsb"]) == [{"text": "A", "text_b": "B", "index": "0"}]
    (tmp_path / "latin1.tsv").write_bytes("text\tlabel\ncaf\xe9\tpos\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1.tsv: not UTF-8 text \(byte 0xe9 at offset 14\)"):
        read_records(tmp_path / "latin1.tsv", record_format({}))


def test_a_glue_task_has_its_own_classes_and_a_label_outside_them_is_named_by_line(tmp_path):
    """A GLUE task's classes are the task's, in its order: a typo is refused at its line (it used to become a class
    of its own), a training subset without a class still has it, and an integer outside the ids is named too."""
    write_tsv(tmp_path / "rte.tsv", ["index", "sentence1", "sentence2", "label"],
              [[0, "A", "B", "entailment"], [1, "C"], [2, "E", "F", "entailmnet"]])  # line 3: a broken row
    with pytest.raises(ValueError, match=r"rte.tsv:4: label 'entailmnet' is not one of the task's labels "
                                         r"\['entailment', 'not_entailment'\]"):
        read_records(tmp_path / "rte.tsv", GLUE_TASKS["rte"])
    write_tsv(tmp_path / "mnli.tsv", ["index", "sentence1", "sentence2", "gold_label"],
              [[0, "A", "B", "neutral"], [1, "C", "D", "entailment"]])
    records = read_records(tmp_path / "mnli.tsv", GLUE_TASKS["mnli"])
    labels = classify.LabelSpace.from_records(records, "mnli.tsv", None, GLUE_TASKS["mnli"].label_names)
    assert labels.classes == ("entailment", "neutral", "contradiction")  # none of the subset's is contradiction
    assert classify.LabelSpace.from_records(records, "mnli.tsv").classes == ("entailment", "neutral")
    (tmp_path / "mnli.jsonl").write_text('{"premise": "A", "hypothesis": "B", "label": 1}\n\n'
                                         '{"premise": "C", "hypothesis": "D", "label": 3}\n')
    with pytest.raises(ValueError, match=r"mnli.jsonl:3: label 3 is not a class id of"):
        read_records(tmp_path / "mnli.jsonl", GLUE_TASKS["mnli"])


def test_a_carriage_return_stays_in_its_text_and_a_file_to_predict_keeps_every_row(tmp_path, capsys):
    """Lines end at "\\n" only: a bare "\\r" in a TSV text (Python's csv ended the row there) or a quoted CSV field
    stays in it; in an unquoted CSV field its row is malformed, not two rows. Training and dev files skip malformed
    rows as BERT's processors do; a file read for predictions that is not labelled throughout refuses them."""
    (tmp_path / "rte.tsv").write_bytes(b"index\tsentence1\tsentence2\r\n0\tA man\rin a hat\tA person\r\n"
                                       b"1\tRain\tSun\r\n")
    assert read_records(tmp_path / "rte.tsv", GLUE_TASKS["rte"]) == [
        {"text": "A man\rin a hat", "text_b": "A person", "index": "0"},
        {"text": "Rain", "text_b": "Sun", "index": "1"}]
    (tmp_path / "mnli.csv").write_text('premise,hypothesis,idx\n"A man\rin a hat",A person,0\nRain,Sun\rSnow,1\n'
                                       'A,B,2\n', newline="")
    assert read_records(tmp_path / "mnli.csv", GLUE_TASKS["mnli"]) == [
        {"text": "A man\rin a hat", "text_b": "A person", "index": "0"}, {"text": "A", "text_b": "B", "index": "2"}]
    assert "mnli.csv: skipped 1 malformed row(s) (line 3: a bare carriage return (\\r) in an unquoted field)" in \
        capsys.readouterr().err
    with pytest.raises(ValueError, match=r"mnli.csv: 1 malformed row\(s\) \(line 3: a bare carriage return"):
        read_records(tmp_path / "mnli.csv", GLUE_TASKS["mnli"], predicting=True)
    write_tsv(tmp_path / "test.tsv", ["index", "sentence"], [[0, "a"], [1, "b", "c"], [2, "d"], [3], [4, "e"]] +
              [[5 + i, "f", "g"] for i in range(5)])
    with pytest.raises(ValueError, match=r"test.tsv: 7 malformed row\(s\) \(line 3: 3 fields, not 2; line 5: 1 field, "
                                         r"not 2; line 7: 3 fields, not 2; .*; \.\.\.\); each row needs its "
                                         r"prediction"):
        read_records(tmp_path / "test.tsv", GLUE_TASKS["sst2"], predicting=True)
    assert len(read_records(tmp_path / "test.tsv", GLUE_TASKS["sst2"])) == 3  # a training or dev file skips them
