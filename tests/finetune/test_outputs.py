"""Outputs appear complete or not at all and never replace an input: decoding, exports, fine-tuning outputs."""
from __future__ import annotations

import dataclasses
import json
import os
import signal
from pathlib import Path

import pytest
import torch

from finetune import decode, generation, predict, run
from finetune.model_io import load_finetuned, save_finetuned
from finetune.task_files import read_jsonl, write_jsonl
from finetune.tokenizer import load_tokenizer
from pretrain import checkpoint as ckpt
from pretrain.hf import load_hf_bert
from pretrain.model import build_model


@pytest.fixture
def sources(tmp_path: Path) -> Path:
    path = tmp_path / "sources.jsonl"
    write_jsonl([{"src": f"the minister said on day {i} that talks would go on"} for i in range(5)], path)
    return path


def decode_args(model: Path, source: Path, output: Path, *extra: str) -> list[str]:
    return ["--model", str(model), "--input", str(source), "--output", str(output), "--beam-size", "1",
            "--max-tgt-len", "3", *extra]


@pytest.mark.parametrize("option, value, minimum", [("--batch-size", "-1", 1), ("--batch-size", "0", 1),
                                                   ("--no-repeat-ngram", "-1", 0), ("--beam-size", "0", 1),
                                                   ("--max-tgt-len", "0", 1), ("--max-src-len", "0", 1),
                                                   ("--min-tgt-len", "-1", 0)])
def test_decode_refuses_a_count_below_its_minimum_and_writes_nothing(tiny_init, sources, tmp_path, option, value,
                                                                     minimum, capsys):
    output = tmp_path / "out.jsonl"
    with pytest.raises(SystemExit) as exit_info:
        decode.main(decode_args(tiny_init, sources, output, option, value))
    error = capsys.readouterr().err
    assert exit_info.value.code == 2 and option in error and f"must be >= {minimum}, got {value}" in error
    assert not output.exists()


@pytest.mark.parametrize("option, value, minimum", [("--batch-size", "0", 1), ("--max-seq-len", "2", 3)])
def test_predict_refuses_a_count_below_its_minimum_and_writes_nothing(tiny_init, sources, tmp_path, option, value,
                                                                      minimum, capsys):
    output = tmp_path / "predictions.tsv"
    with pytest.raises(SystemExit) as exit_info:
        predict.main(["--model", str(tiny_init), "--input", str(sources), "--output", str(output), option, value])
    error = capsys.readouterr().err
    assert exit_info.value.code == 2 and option in error and f"must be >= {minimum}, got {value}" in error
    assert not output.exists()


@pytest.mark.parametrize("variable", ["WORLD_SIZE", "OMPI_COMM_WORLD_SIZE"])
def test_predict_refuses_a_distributed_launch(tiny_init, sources, tmp_path, variable, monkeypatch, capsys):
    """Under torchrun every rank would predict everything and all but the first would fail on the written output
    (`finetune.decode` runs data-parallel instead: tests/finetune/test_decode_ranks.py)."""
    monkeypatch.setenv(variable, "2")
    with pytest.raises(SystemExit) as exit_info:
        predict.main(["--model", str(tiny_init), "--input", str(sources), "--output", str(tmp_path / "out.jsonl")])
    assert exit_info.value.code == 2
    assert f"a launcher started 2 ranks ({variable}=2): run it as `python -m finetune.predict ...` itself" \
        in capsys.readouterr().err
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize("tool", ["decode", "predict"])
def test_a_device_this_machine_lacks_is_refused_naming_the_choices(tool, tiny_init, sources, tmp_path, capsys):
    missing = f"cuda:{torch.cuda.device_count() if torch.cuda.is_available() else 0}"
    for device, message in (("gpu", "--device gpu: not a torch device; use cpu, cuda or cuda:N"),
                            (missing, f"--device {missing}: this machine has")):
        args = ["--model", str(tiny_init), "--input", str(sources), "--output", str(tmp_path / "out.jsonl"),
                "--device", device]
        with pytest.raises(SystemExit) as exit_info:
            (decode if tool == "decode" else predict).main(args)
        assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "out.jsonl").exists()


def test_a_length_penalty_that_is_not_a_number_is_refused(tiny_init, sources, tmp_path, capsys):
    for value in ("nan", "inf"):
        with pytest.raises(SystemExit) as exit_info:
            decode.main(decode_args(tiny_init, sources, tmp_path / "out.jsonl", "--length-penalty", value))
        assert exit_info.value.code == 2 and f"must be a finite number, got {value}" in capsys.readouterr().err


def test_decode_refuses_settings_and_inputs_it_cannot_decode_before_decoding_any(tiny_init, sources, tmp_path,
                                                                                 capsys):
    output = tmp_path / "out.jsonl"
    for extra, message in ((["--min-tgt-len", "5"], "--min-tgt-len 5 exceeds the longest target, 3 word pieces"),
                           (["--beam-size", "40000"], "--beam-size 40000: more beams than the")):
        with pytest.raises(SystemExit) as exit_info:
            decode.main(decode_args(tiny_init, sources, output, *extra))
        assert exit_info.value.code == 2 and message in capsys.readouterr().err
    records = [json.loads(line) for line in sources.read_text().splitlines()] + [{"text": "a classify record"}]
    write_jsonl(records, tmp_path / "mixed.jsonl")
    with pytest.raises(SystemExit) as exit_info:
        decode.main(decode_args(tiny_init, tmp_path / "mixed.jsonl", output))
    assert exit_info.value.code == 2 and "record 6 has no 'src' text" in capsys.readouterr().err
    assert not output.exists()
    (tmp_path / "bom.jsonl").write_text("\ufeff" + sources.read_text(), encoding="utf-8")  # as Windows editors save
    decode.main(decode_args(tiny_init, tmp_path / "bom.jsonl", output))
    assert len(output.read_text().splitlines()) == 5


def test_a_line_file_with_blank_lines_and_crlf_decodes_one_line_per_input(tiny_init, tmp_path, capsys):
    """UniLM's decoder decodes every line of its input, a blank one from [CLS] [SEP] alone; line ends may be CRLF
    (a Windows editor's) or a lone CR, and are not part of the text."""
    (tmp_path / "test.src").write_bytes(b"the minister said talks would go on\r\n\r\nthe talks went on\r"
                                        b"   \r\nthe end\r\n")
    decode.main(decode_args(tiny_init, tmp_path / "test.src", tmp_path / "out.jsonl"))
    records = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["src"] for r in records] == ["the minister said talks would go on", "", "the talks went on", "   ",
                                           "the end"]
    assert all(isinstance(r["prediction"], str) for r in records)
    assert "2 empty source(s) (record 2, 4) decoded from [CLS] [SEP] alone" in capsys.readouterr().out
    decode.main(decode_args(tiny_init, tmp_path / "test.src", tmp_path / "out.txt"))
    assert len((tmp_path / "out.txt").read_text().split("\n")) == 5 + 1  # a line per input, each ended


def test_decode_reports_the_source_cut_it_applies_and_refuses_what_leaves_no_source(tiny_init, sources, tmp_path,
                                                                                       capsys):
    # 256 positions: a target of up to 200 word pieces leaves 256 - 200 - 3 = 53 for the source, not 448
    output = tmp_path / "out.jsonl"
    decode.main(["--model", str(tiny_init), "--input", str(sources), "--output", str(output), "--beam-size", "1",
                 "--max-tgt-len", "200", "--max-src-len", "448"])
    assert "(0 sources truncated to 53 word pieces)" in capsys.readouterr().out
    for option, value, message in (("--max-tgt-len", "253", "lower it to at most 252"),
                                   ("--no-repeat-ignore", ".|[EOS]", "['[EOS]'] not in the vocabulary")):
        with pytest.raises(SystemExit) as exit_info:
            decode.main(decode_args(tiny_init, sources, tmp_path / "refused.jsonl", option, value))
        error = capsys.readouterr().err
        assert exit_info.value.code == 2 and option in error and message in error, error
    assert not (tmp_path / "refused.jsonl").exists()


def test_decode_refuses_an_output_equal_to_its_input_and_keeps_the_input(tiny_init, sources, capsys):
    before = sources.read_bytes()
    with pytest.raises(SystemExit):
        decode.main(decode_args(tiny_init, sources, sources))
    assert "is (or contains) the input" in capsys.readouterr().err
    assert sources.read_bytes() == before


def test_decode_writes_one_prediction_per_record_and_replaces_output_only_with_force(tiny_init, sources, tmp_path,
                                                                                    capsys, monkeypatch):
    output = tmp_path / "out.jsonl"
    decode.main(decode_args(tiny_init, sources, output, "--batch-size", "2"))
    assert [json.loads(line)["src"] for line in output.read_text().splitlines()] == \
        [json.loads(line)["src"] for line in sources.read_text().splitlines()]
    first = output.read_bytes()
    with pytest.raises(SystemExit):
        decode.main(decode_args(tiny_init, sources, output))
    assert "exists and is not empty; pass --force" in capsys.readouterr().err

    real = decode.decode_records

    def one_lost(*args, **kwargs):
        decoded = real(*args, **kwargs)
        return dataclasses.replace(decoded, predictions=decoded.predictions[:-1])
    monkeypatch.setattr(decode, "decode_records", one_lost)
    with pytest.raises(RuntimeError, match="4 predictions for 5 input records; nothing written"):
        decode.main(decode_args(tiny_init, sources, output, "--force"))
    assert output.read_bytes() == first and [p.name for p in tmp_path.glob(".*partial*")] == []


def test_export_into_a_finetuning_directory_needs_force_and_leaves_no_old_head(tiny_init, unilm_shards, tmp_path,
                                                                               capsys):
    from pretrain import export

    model = load_hf_bert(tiny_init)
    finetuned = tmp_path / "finetuned"
    save_finetuned(finetuned, model, torch.nn.Linear(32, 5), load_tokenizer(tiny_init), task="classify",
                   extra_meta={"labels": list("abcde")})
    checkpoints = tmp_path / "checkpoints"
    (checkpoints / "global_step4").mkdir(parents=True)
    torch.manual_seed(1)
    ckpt.write_weights(checkpoints / "global_step4", build_model(model.cfg).state_dict())
    ckpt.write_marker(checkpoints / "global_step4", {"step": 4, "model_config": dataclasses.asdict(model.cfg)})
    ckpt.update_latest(checkpoints, "global_step4")
    with pytest.raises(SystemExit):
        export.main([str(checkpoints), str(finetuned), "--shards", str(unilm_shards)])
    assert "pass --force" in capsys.readouterr().err
    assert load_finetuned(finetuned).task == "classify"  # untouched
    export.main([str(checkpoints), str(finetuned), "--force", "--shards", str(unilm_shards)])
    assert sorted(p.name for p in finetuned.iterdir()) == [
        "config.json", "model.safetensors", "special_tokens_map.json", "tokenizer_config.json", "vocab.txt"]
    with pytest.raises(SystemExit):  # replacing the run directory would delete the checkpoint exported
        export.main([str(checkpoints / "global_step4"), str(tmp_path), "--force", "--shards", str(unilm_shards)])
    assert "is (or contains) the input" in capsys.readouterr().err


def test_a_finetuning_directory_with_mixed_files_is_refused(tiny_init, tmp_path):
    model = load_hf_bert(tiny_init)
    out = tmp_path / "finetuned"
    save_finetuned(out, model, torch.nn.Linear(32, 5), load_tokenizer(tiny_init), task="classify", extra_meta={})
    torch.manual_seed(5)
    other = tmp_path / "other"
    from pretrain.hf import save_hf_bert
    save_hf_bert(build_model(model.cfg), other)
    (other / "model.safetensors").replace(out / "model.safetensors")  # what an export over it used to leave
    with pytest.raises(ValueError, match="model.safetensors is missing or is not the file finetune.json records"):
        load_finetuned(out)


def test_finetuning_refuses_an_output_that_is_an_input_or_holds_other_files(small_tasks, tiny_init, tmp_path):
    args = ["--task", "classify", "--train", str(small_tasks["bbc_topic.train"]), "--dev",
            str(small_tasks["bbc_topic.dev"]), "--init", str(tiny_init), "--batch-size", "8", "--epochs", "1"]
    with pytest.raises(ValueError, match="is \\(or contains\\) the input"):
        run.main(args + ["--out", str(tiny_init)])
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(run.InputError, match="pass --force"):  # one line from the command, not a traceback
        run.main(args + ["--out", str(tmp_path)])
    with pytest.raises(ValueError, match="max_steps must be >= 1"):
        run.main(args + ["--out", str(tmp_path / "new"), "--max-steps", "-5"])


def test_a_non_utf8_byte_names_the_file_and_line(tmp_path):
    from finetune.task_files import read_jsonl

    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"src": "fine"}\n{"src": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=rf"{path}:2: not UTF-8 text \(byte 0xe9 at column 13\)"):
        read_jsonl(path)


@pytest.mark.parametrize("stop, code", [("SIGTERM", 143), ("Ctrl-C", 130)])
def test_a_stopped_decode_keeps_its_predictions_and_the_same_command_continues_after_them(
        tiny_init, tmp_path, monkeypatch, capsys, stop, code):
    source = tmp_path / "sources.jsonl"
    write_jsonl([{"src": f"the minister said on day {i} that talks would go on", "tgt": "talks go on"}
                 for i in range(9)], source)
    whole = tmp_path / "whole.jsonl"
    decode.main(decode_args(tiny_init, source, whole, "--batch-size", "2"))
    output = tmp_path / "out.jsonl"
    journal = tmp_path / "out.partial.jsonl"
    real_generate, calls, stop_at = generation.beam_search, [], [3]

    def generate_then_stop(*args, **kwargs):  # the third batch is stopped: two are decoded and kept
        calls.append(1)
        if len(calls) in stop_at:
            if stop == "SIGTERM":
                os.kill(os.getpid(), signal.SIGTERM)
            raise KeyboardInterrupt
        return real_generate(*args, **kwargs)

    monkeypatch.setattr(generation, "beam_search", generate_then_stop)
    ignore = signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a SIGTERM decoding does not take fails the test below
    try:
        with pytest.raises(SystemExit) as stopped:
            decode.main(decode_args(tiny_init, source, output, "--batch-size", "2"))
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN  # its own handler is gone again
    finally:
        signal.signal(signal.SIGTERM, ignore)
    assert stopped.value.code == code and not output.exists()
    said = "stopped by SIGTERM" if stop == "SIGTERM" else "interrupted"
    assert f"[decode] {said}: 4 of 9 predictions are kept in {journal}" in capsys.readouterr().err
    with open(journal, "a") as handle:
        handle.write('{"start": 4, "predictions": ["half writ')  # a kill in the middle of a write

    calls.clear()
    stop_at.clear()
    decode.main(decode_args(tiny_init, source, output, "--batch-size", "2"))
    assert len(calls) == 3  # the batches from the fifth input on: 4-5, 6-7, 8
    assert f"continuing after the 4 predictions {journal} holds" in capsys.readouterr().err
    assert read_jsonl(output) == read_jsonl(whole) and not journal.exists()
    assert json.loads((tmp_path / "out.metrics.json").read_text()) == json.loads(
        (tmp_path / "whole.metrics.json").read_text())


def test_kept_predictions_of_other_settings_are_not_used(tiny_init, sources, tmp_path, monkeypatch, capsys):
    output, journal = tmp_path / "out.txt", tmp_path / "out.partial.jsonl"
    monkeypatch.setattr(generation, "beam_search", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(SystemExit):  # stopped at once: the journal holds its settings' fingerprint
        decode.main(decode_args(tiny_init, sources, output, "--batch-size", "1"))
    monkeypatch.undo()
    journal.write_text(journal.read_text().splitlines()[0] + "\n" + json.dumps(
        {"start": 0, "predictions": ["from", "elsewhere"], "truncated": 0}) + "\n")
    decode.main(decode_args(tiny_init, sources, output, "--batch-size", "1", "--max-tgt-len", "2"))
    assert "holds predictions of another model, input or settings; starting afresh" in capsys.readouterr().err
    assert "from" not in output.read_text().split() and len(output.read_text().splitlines()) == 5


def test_a_file_of_the_journals_name_that_is_not_one_is_refused_not_replaced(tiny_init, sources, tmp_path, capsys):
    mine = tmp_path / "out.partial.jsonl"
    mine.write_text('{"src": "my own records"}\n')
    with pytest.raises(SystemExit) as refused:
        decode.main(decode_args(tiny_init, sources, tmp_path / "out.jsonl"))
    assert refused.value.code == 2 and "is not the predictions an earlier decode kept there" in capsys.readouterr().err
    assert mine.read_text() == '{"src": "my own records"}\n' and not (tmp_path / "out.jsonl").exists()


def test_a_second_decode_of_the_same_output_is_refused_while_the_first_runs(tiny_init, sources, tmp_path,
                                                                              monkeypatch, capsys):
    first, second = tmp_path / "out.txt", tmp_path / "out.jsonl"  # both keep their predictions in out.partial.jsonl
    real_generate, refusals = generation.beam_search, []

    def generate_and_start_another(*args, **kwargs):
        if not refusals:
            with pytest.raises(SystemExit) as refused:
                decode.main(decode_args(tiny_init, sources, second))
            refusals.append((refused.value.code, capsys.readouterr().err))
        return real_generate(*args, **kwargs)

    monkeypatch.setattr(generation, "beam_search", generate_and_start_another)
    decode.main(decode_args(tiny_init, sources, first))
    code, said = refusals[0]
    assert code == 2 and f"--output {second}: another decode of it is running (pid {os.getpid()} on " in said
    assert len(first.read_text().splitlines()) == 5 and not second.exists()
    monkeypatch.undo()

    lock = tmp_path / ".out.decode.lock"
    assert lock.read_text() == ""  # released: the next decode takes it without a word
    lock.write_text(json.dumps({"pid": 1, "host": "elsewhere", "started": "then"}) + "\n")  # a killed decode's
    decode.main(decode_args(tiny_init, sources, second))
    assert f"an earlier decode of {second} ended without releasing {lock} (killed): pid 1 on elsewhere" in \
        capsys.readouterr().err
    assert len(read_jsonl(second)) == 5 and lock.read_text() == ""
