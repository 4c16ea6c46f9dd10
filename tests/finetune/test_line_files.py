"""UniLM's seq2seq line files (`NAME.src` + `NAME.tgt`, one example per line) read as the JSONL records."""
from __future__ import annotations

import json

import pytest

from finetune import decode, run
from finetune.config import FinetuneConfig
from finetune.generation import score_predictions
from finetune.seq2seq import encode_examples
from finetune.task_files import read_jsonl, read_seq2seq
from finetune.tokenizer import load_tokenizer


def as_line_files(records: list[dict], stem) -> None:
    stem.with_suffix(".src").write_text("".join(r["src"].replace("\n", " ") + "\n" for r in records))
    stem.with_suffix(".tgt").write_text("".join(r["tgt"].replace("\n", " ") + "\n" for r in records))


def test_line_files_are_the_records_and_their_mistakes_are_named(small_tasks, tmp_path):
    records = [{"src": r["src"].replace("\n", " "), "tgt": r["tgt"]}
               for r in read_jsonl(small_tasks["bbc_headline.train"])]
    as_line_files(records, tmp_path / "train")
    assert read_seq2seq(tmp_path / "train.src") == records
    (tmp_path / "short.src").write_text("one\ntwo\n")
    (tmp_path / "short.tgt").write_text("one\n")
    with pytest.raises(ValueError, match=r"short.src has 2 lines and .*short.tgt 1"):
        read_seq2seq(tmp_path / "short.src")
    (tmp_path / "alone.src").write_text("a source\n")
    with pytest.raises(ValueError, match=r"alone.src: a .src line file needs its targets beside it in alone.tgt"):
        read_seq2seq(tmp_path / "alone.src")
    assert read_seq2seq(tmp_path / "alone.src", targets=False) == [{"src": "a source"}]  # decoding's input
    with pytest.raises(ValueError, match="give NAME.src, with NAME.tgt beside it"):
        FinetuneConfig(task="seq2seq", train=str(tmp_path / "train.tgt"), dev=str(tmp_path / "train.src"),
                       out=str(tmp_path / "out"), init=str(tmp_path))


def test_records_with_other_field_names_are_told_which_they_have(tiny_init):
    tokenizer = load_tokenizer(tiny_init)
    with pytest.raises(ValueError, match=r"record 1 has an empty or missing 'src' \(its fields: article, "
                                         r"highlights; name them src and tgt\)"):
        encode_examples([{"article": "a", "highlights": "b"}], tokenizer, 32, 8, 64)


def test_a_run_and_its_decoding_read_line_files(small_tasks, tiny_init, tmp_path):
    for split in ("train", "dev"):
        as_line_files(read_jsonl(small_tasks[f"bbc_headline.{split}"]), tmp_path / split)
    out = tmp_path / "run"
    run.main(["--task", "seq2seq", "--train", str(tmp_path / "train.src"), "--dev", str(tmp_path / "dev.src"),
              "--init", str(tiny_init), "--out", str(out), "--max-src-len", "48", "--max-tgt-len", "8",
              "--batch-size", "8", "--max-steps", "1", "--set", "eval_max_examples=2"])
    assert json.loads((out / "summary.json").read_text())["finished"]
    common = ["--model", str(out), "--input", str(tmp_path / "dev.src"), "--beam-size", "1"]
    references = (tmp_path / "dev.tgt").read_bytes()
    with pytest.raises(SystemExit, match="2"):  # the references read beside the input are an input too
        decode.main([*common, "--output", str(tmp_path / "dev.tgt"), "--force"])
    with pytest.raises(SystemExit, match="2"):  # a directory: refused before decoding, not at the rename after it
        decode.main([*common, "--output", str(tmp_path / "run")])
    assert (tmp_path / "dev.tgt").read_bytes() == references
    decode.main([*common, "--output", str(tmp_path / "pred.jsonl")])
    records = [json.loads(line) for line in (tmp_path / "pred.jsonl").read_text().splitlines()]
    assert len(records) == len(read_jsonl(small_tasks["bbc_headline.dev"])) and "tgt" in records[0]
    decode.main([*common, "--output", str(tmp_path / "lines.txt")])  # UniLM's output: a prediction per line,
    tokenizer = load_tokenizer(tiny_init)  # tokenised as UniLM writes it ("the u . s . ?")
    lines = (tmp_path / "lines.txt").read_text().splitlines()
    assert lines == [tokenizer.words(r["prediction"]) for r in records]
    assert json.loads((tmp_path / "lines.metrics.json").read_text()) == \
        json.loads((tmp_path / "pred.metrics.json").read_text())
    (tmp_path / "dev.tgt").rename(tmp_path / "refs.tgt")  # sources alone: decoded, not scored
    decode.main([*common, "--output", str(tmp_path / "alone.jsonl")])
    assert [json.loads(line)["prediction"] for line in (tmp_path / "alone.jsonl").read_text().splitlines()] == \
        [r["prediction"] for r in records]
    assert not (tmp_path / "alone.metrics.json").exists()


def test_unilm_sentence_separators_split_summaries_for_rouge_lsum(minilm_dir):
    """UniLM's CNN/DM targets join a summary's sentences with " [X_SEP] ": they score as line breaks."""
    tokenizer = load_tokenizer(minilm_dir)
    lines = "Police arrested two men in London.\nThe men were charged with fraud on Monday"
    separated = "Police arrested two men in London . [X_SEP] The men were charged with fraud on Monday"
    prediction = "The men were charged with fraud on Monday. Police arrested two men in London."
    by_lines, by_separator = (score_predictions(tokenizer, [prediction], [reference])
                              for reference in (lines, separated))
    assert by_separator == pytest.approx(by_lines) and by_lines["rougeLsum"] == pytest.approx(100)
