"""`finetune.predict` refuses, before predicting, what would make a submission file invalid: a GLUE task whose
labels the model does not predict, a pair model's input without its second text, a test file's malformed rows,
and an `--input` or `--output` that is a directory; for SQuAD 2.0 it says how to score the null odds."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from finetune import predict
from finetune.model_io import save_finetuned
from finetune.task_files import write_jsonl
from finetune.tokenizer import load_tokenizer
from pretrain.hf import load_hf_bert
from pretrain.outputs import check_output

PAIRS = [("a man is playing a guitar", "a person plays music"), ("the minister said talks would go on", "nobody spoke"),
         ("rain fell all day", "the ground is dry")]


def fine_tuned(tiny_init: Path, out: Path, labels: list[str], regression: bool = False, task: str = "classify",
               **meta) -> Path:
    """A fine-tuning output with a random head, as `finetune.run` saves one (no training: the checks come first)."""
    outputs = 2 if task == "qa" else 1 if regression else len(labels)
    settings = {"max_seq_len": 64, **meta.pop("settings", {})}
    save_finetuned(out, load_hf_bert(tiny_init), torch.nn.Linear(32, outputs), load_tokenizer(tiny_init), task=task,
                   extra_meta={"settings": settings, "labels": labels, "regression": regression,
                               "multiple_choice": False, **meta})
    return out


def glue_test_file(path: Path, header: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [[i, a, b][: len(header)] for i, (a, b) in enumerate(PAIRS)]
    path.write_text("".join("\t".join(map(str, row)) + "\n" for row in [header, *rows]), encoding="utf-8")
    return path


def refusal(capsys, *args: str | Path) -> str:
    with pytest.raises(SystemExit) as exit_info:
        predict.main([str(arg) for arg in args])
    assert exit_info.value.code == 2
    return capsys.readouterr().err


NLI = ["entailment", "neutral", "contradiction"]
BINARY_NLI = ["entailment", "not_entailment"]


def test_a_glue_task_is_predicted_only_by_a_model_fine_tuned_on_it_with_its_classes(tiny_init, tmp_path, capsys):
    rte = fine_tuned(tiny_init, tmp_path / "rte", BINARY_NLI, settings={"glue_task": "rte"})
    mnli = fine_tuned(tiny_init, tmp_path / "mnli", NLI, settings={"glue_task": "mnli"})
    stsb = fine_tuned(tiny_init, tmp_path / "stsb", [], regression=True, settings={"glue_task": "stsb"})
    qnli = fine_tuned(tiny_init, tmp_path / "qnli", BINARY_NLI, settings={"glue_task": "qnli"})
    topics = fine_tuned(tiny_init, tmp_path / "topics", ["business", "sport"],
                        settings={"text_field": "sentence1", "text_b_field": "sentence2"})
    glue = tmp_path / "glue_data"
    header = ["index", "sentence1", "sentence2"]
    diagnostic = glue_test_file(glue / "diagnostic" / "diagnostic.tsv", header)
    rte_test = glue_test_file(glue / "RTE" / "test.tsv", header)
    wnli_test = glue_test_file(glue / "WNLI" / "test.tsv", header)
    qnli_test = glue_test_file(glue / "QNLI" / "test.tsv", ["index", "question", "sentence"])
    output = tmp_path / "pred.tsv"

    for model, task, test, message in (
            (rte, "ax", diagnostic, "--glue-task ax: --model {model}: the model was fine-tuned on GLUE's rte, not ax; "
                                    "predict ax's files with a model fine-tuned on mnli"),
            (mnli, "qnli", qnli_test, "--glue-task qnli: --model {model}: the model was fine-tuned on GLUE's mnli, "
                                      "not qnli"),
            (qnli, "rte", rte_test, "the model was fine-tuned on GLUE's qnli, not rte"),  # the same class names
            (topics, "rte", rte_test, "--glue-task rte: --model {model}: the model predicts the classes business, "
                                      "sport, but rte's files take the classes entailment, not_entailment")):
        error = refusal(capsys, "--model", model, "--glue-task", task, "--input", test, "--output", output)
        assert message.format(model=model) in error, error
    # no --glue-task: a file in another task's directory of GLUE's layout is that task's
    for model, test, message in (
            (rte, wnli_test, f"--input {wnli_test} is among GLUE's wnli files (by its directory), but --model {rte}: "
                             "the model was fine-tuned on GLUE's rte, not wnli; predict wnli's files with a model "
                             "fine-tuned on wnli (or pass --glue-task rte to read it as rte's)"),
            (stsb, rte_test, "the model was fine-tuned on GLUE's stsb, not rte")):
        error = refusal(capsys, "--model", model, "--input", test, "--output", output)
        assert message in error, error
    assert not output.exists()

    predict.main(["--model", str(mnli), "--glue-task", "ax", "--input", str(diagnostic), "--output", str(output)])
    assert {line.split("\t")[1] for line in output.read_text().splitlines()[1:]} <= set(NLI)
    predict.main(["--model", str(mnli), "--input", str(diagnostic), "--output", str(output), "--force"])  # AX: MNLI's
    predict.main(["--model", str(stsb), "--glue-task", "stsb", "--input", str(rte_test), "--output", str(output),
                  "--force"])  # said outright: read as STS-B's
    scores = [float(line.split("\t")[1]) for line in output.read_text().splitlines()[1:]]
    assert len(scores) == len(PAIRS)


def test_a_pair_model_refuses_an_input_without_the_second_text(tiny_init, tmp_path, capsys):
    mnli = fine_tuned(tiny_init, tmp_path / "mnli", NLI, settings={"glue_task": "mnli"})
    single = glue_test_file(tmp_path / "single.tsv", ["index", "sentence1"])
    error = refusal(capsys, "--model", mnli, "--input", single, "--output", tmp_path / "pred.tsv")
    assert (f"{single}: no 'sentence2' or 'hypothesis' column (its columns: index, sentence1); the model was "
            "fine-tuned on text pairs") in error, error
    # other files: the run records whether it trained on pairs; an output without the record is not checked
    texts = tmp_path / "texts.jsonl"
    write_jsonl([{"text": a} for a, _ in PAIRS], texts)
    pairs = fine_tuned(tiny_init, tmp_path / "pairs", ["no", "yes"], pairs=True)
    error = refusal(capsys, "--model", pairs, "--input", texts, "--output", tmp_path / "pred.tsv")
    assert f"{texts}: no 'text_b' column (its columns: text); the model was fine-tuned on text pairs" in error, error
    assert not (tmp_path / "pred.tsv").exists()
    for meta in ({"pairs": False}, {}):
        model = fine_tuned(tiny_init, tmp_path / f"model{len(meta)}", ["no", "yes"], **meta)
        predict.main(["--model", str(model), "--input", str(texts), "--output", str(tmp_path / "pred.tsv"), "--force"])
        assert len((tmp_path / "pred.tsv").read_text().splitlines()) == len(PAIRS) + 1


def test_a_test_files_malformed_rows_are_refused_by_line_not_dropped(tiny_init, tmp_path, capsys):
    rte = fine_tuned(tiny_init, tmp_path / "rte", BINARY_NLI, settings={"glue_task": "rte"})
    test = tmp_path / "test.tsv"
    test.write_text("index\tsentence1\tsentence2\n0\tA man\tA person\n1\tcut short\n2\tRain\tSun\textra\n3\tA\tB\n")
    error = refusal(capsys, "--model", rte, "--input", test, "--output", tmp_path / "RTE.tsv")
    assert (f"{test}: 2 malformed row(s) (line 3: 2 fields, not 3; line 4: 4 fields, not 3); each row needs its "
            "prediction") in error, error
    assert not (tmp_path / "RTE.tsv").exists()
    # a labelled file is scored as fine-tuning's dev set: its malformed rows skipped and counted
    dev = tmp_path / "dev.tsv"
    dev.write_text("index\tsentence1\tsentence2\tlabel\n0\tA man\tA person\tentailment\n1\tcut short\n"
                   "2\tRain\tSun\tnot_entailment\n")
    predict.main(["--model", str(rte), "--input", str(dev), "--output", str(tmp_path / "dev_pred.tsv")])
    assert f"{dev}: skipped 1 malformed row(s) (line 3: 2 fields, not 4)" in capsys.readouterr().err
    assert len((tmp_path / "dev_pred.tsv").read_text().splitlines()) == 3


def test_a_test_files_empty_text_is_predicted_not_refused(tiny_init, tmp_path):
    """A test row whose sentence is empty still needs its prediction (a submission has a row per test row): it is
    predicted from [CLS] [SEP] (and the empty second text likewise)."""
    rte = fine_tuned(tiny_init, tmp_path / "rte", BINARY_NLI, settings={"glue_task": "rte"})
    test = tmp_path / "test.tsv"
    test.write_text("index\tsentence1\tsentence2\n0\tA man\tA person\n1\t\tA person\n2\tRain\t\n3\t \t \n")
    predict.main(["--model", str(rte), "--input", str(test), "--output", str(tmp_path / "RTE.tsv")])
    rows = [line.split("\t") for line in (tmp_path / "RTE.tsv").read_text().splitlines()]
    assert [row[0] for row in rows] == ["index", "0", "1", "2", "3"]
    assert all(row[1] in BINARY_NLI for row in rows[1:])


def test_a_directory_as_input_or_output_is_refused_before_the_model_loads(tiny_init, tmp_path, capsys, monkeypatch):
    model = fine_tuned(tiny_init, tmp_path / "model", ["no", "yes"])
    texts = tmp_path / "texts.jsonl"
    write_jsonl([{"text": a} for a, _ in PAIRS], texts)
    monkeypatch.setattr(predict, "load_finetuned", lambda *a, **k: pytest.fail("the model was loaded"))
    (tmp_path / "empty").mkdir()
    for args, message in ((["--input", texts, "--output", tmp_path / "model"], f"output {tmp_path / 'model'} is"),
                          (["--input", texts, "--output", tmp_path / "empty"],
                           f"output {tmp_path / 'empty'} is a directory; name a file to write"),
                          (["--input", texts, "--output", tmp_path / "empty", "--force"],
                           f"output {tmp_path / 'empty'} is a directory; name a file to write"),
                          (["--input", tmp_path / "empty", "--output", tmp_path / "pred.tsv"],
                           f"--input {tmp_path / 'empty'} is a directory; name a file")):
        assert message in refusal(capsys, "--model", model, *args)
    assert not (tmp_path / "pred.tsv").exists()
    # the rule is check_output's: a command writing one file says so, one writing a directory may replace one
    with pytest.raises(ValueError, match="is a directory; name a file to write"):
        check_output(tmp_path / "empty", file=True)
    assert check_output(tmp_path / "empty") == tmp_path / "empty"


def test_squad_2_null_odds_come_with_the_threshold_to_score_them_by(tiny_init, small_tasks, tmp_path, capsys):
    assert "--na-prob-thresh" in predict.__doc__ and "null_score_diff_threshold" in predict.__doc__
    model = fine_tuned(tiny_init, tmp_path / "v2", [], task="qa", version_2=True,
                       settings={"max_seq_len": 96, "doc_stride": 48, "null_score_diff_threshold": -0.75})
    output = tmp_path / "p.json"
    predict.main(["--model", str(model), "--input", str(small_tasks["squad"]), "--output", str(output)])
    assert (f"evaluate-v2.0.py as `--na-prob-file {tmp_path / 'p.null_odds.json'} --na-prob-thresh -0.75`: the run's "
            "null_score_diff_threshold") in capsys.readouterr().out
    assert json.loads((tmp_path / "p.null_odds.json").read_text())


def test_a_classify_run_records_whether_it_trained_on_pairs(tiny_init, tmp_path):
    from finetune import run
    for pairs in (True, False):
        data = tmp_path / f"pairs-{pairs}.jsonl"
        write_jsonl([{"text": a, **({"text_b": b} if pairs else {}), "label": label}
                     for (a, b), label in zip(PAIRS * 2, ["no", "yes"] * 3)], data)
        out = tmp_path / f"run-{pairs}"
        run.main(["--task", "classify", "--train", str(data), "--dev", str(data), "--init", str(tiny_init),
                  "--out", str(out), "--batch-size", "2", "--micro-batch-size", "2", "--max-steps", "1",
                  "--max-seq-len", "32"])
        assert json.loads((out / "finetune.json").read_text())["pairs"] is pairs
