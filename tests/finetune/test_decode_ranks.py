"""Decoding at scale: n-best lists, the model's precision, and data-parallel ranks that write what one process
writes (tiny models, CPU; gloo ranks under torchrun)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, subprocess_env
from finetune import decode, generation
from finetune.beam import DecodeConfig, SpecialIds, beam_search, generate
from finetune.task_files import read_jsonl, write_jsonl
from pretrain.model import ModelConfig, build_model


@pytest.fixture
def sources(tmp_path: Path) -> Path:
    path = tmp_path / "sources.jsonl"
    write_jsonl([{"src": f"the minister said on day {i} that talks would go on", "tgt": "talks go on"}
                 for i in range(7)], path)
    return path


def decode_args(model: Path, source: Path, output: Path, *extra: str) -> list[str]:
    return ["--model", str(model), "--input", str(source), "--output", str(output), "--beam-size", "3",
            "--max-tgt-len", "4", "--batch-size", "2", *extra]


def test_n_best_lists_are_sorted_and_begin_with_the_one_best() -> None:
    torch.manual_seed(0)
    model = build_model(ModelConfig(vocab_size=40, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64,
                                    max_position_embeddings=64)).eval()
    special = SpecialIds(cls_id=2, sep_id=3, mask_id=4, pad_id=0)
    batch = [[2, 7, 8, 9, 3], [2, 11, 3], [2, 20, 21, 3]]
    for length_penalty in (0.0, 1.0):
        config = DecodeConfig(beam_size=4, max_tgt_len=6, length_penalty=length_penalty, no_repeat_ngram=0)
        lists = beam_search(model, batch, special, config, n_best=4)
        best = generate(model, batch, special, config)
        for hypotheses, one_best in zip(lists, best):
            scores = [h.score for h in hypotheses]
            assert len(hypotheses) == 4 and scores == sorted(scores, reverse=True)
            assert hypotheses[0] == one_best
            assert len({tuple(h.tokens) for h in hypotheses}) == 4  # different hypotheses, not one four times
    for n_best in (0, 5):
        with pytest.raises(ValueError, match=r"n_best must be in \[1, beam_size=4\]"):
            beam_search(model, batch, special, config, n_best=n_best)


def test_decode_writes_n_best_lists_beside_the_output(tiny_init, sources, tmp_path, capsys) -> None:
    """Over 30 s only on a clean checkout, where it is often its worker's first DeepSpeed start: DeepSpeed builds
    its CPU all-reduce op with g++ then (once, ~40 s), about a second afterwards."""
    one_best = tmp_path / "one.txt"
    decode.main(decode_args(tiny_init, sources, one_best))
    output = tmp_path / "out.txt"
    decode.main(decode_args(tiny_init, sources, output, "--n-best", "3"))
    assert "3-best lists" in capsys.readouterr().out
    lists = read_jsonl(tmp_path / "out.nbest.jsonl")
    predictions = output.read_text().splitlines()
    assert [entry["index"] for entry in lists] == list(range(7))
    assert output.read_text() == one_best.read_text()  # searching for 3 keeps the 1-best
    for entry, prediction in zip(lists, predictions):
        scores = [h["score"] for h in entry["hyps"]]
        assert 1 <= len(scores) <= 3 and scores == sorted(scores, reverse=True)
        assert entry["hyps"][0]["text"] == prediction  # the output's form (here UniLM's spaced lines)
    assert not (tmp_path / "one.nbest.jsonl").exists()  # written only when asked for

    with pytest.raises(SystemExit) as refused:
        decode.main(decode_args(tiny_init, sources, tmp_path / "refused.jsonl", "--n-best", "4"))
    assert refused.value.code == 2 and "--n-best 4: a beam search of --beam-size 3 keeps at most 3" in \
        capsys.readouterr().err
    assert not (tmp_path / "refused.jsonl").exists()


def test_bf16_decodes_on_cpu_and_fp16_is_refused_there(tiny_init, sources, tmp_path, capsys) -> None:
    output = tmp_path / "bf16.jsonl"
    decode.main(decode_args(tiny_init, sources, output, "--dtype", "bf16"))
    assert [r["src"] for r in read_jsonl(output)] == [r["src"] for r in read_jsonl(sources)]
    assert all(isinstance(r["prediction"], str) for r in read_jsonl(output))
    with pytest.raises(SystemExit) as refused:
        decode.main(decode_args(tiny_init, sources, tmp_path / "fp16.jsonl", "--dtype", "fp16", "--device", "cpu"))
    error = capsys.readouterr().err
    assert refused.value.code == 2 and "--dtype fp16: half precision decodes on CUDA devices only" in error
    assert "use --dtype bf16 or fp32" in error and not (tmp_path / "fp16.jsonl").exists()


def torchrun(ranks: int, *args: str) -> subprocess.CompletedProcess:
    """`python -m finetune.decode ARGS` on `ranks` gloo ranks under torchrun (one torch thread each)."""
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
                           "-m", "finetune.decode", *args], cwd=ROOT, env=subprocess_env(), capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return done


@pytest.mark.slow
def test_two_ranks_under_torchrun_write_what_one_process_writes(tiny_init, sources, tmp_path) -> None:
    """7 records in batches of 2: 4 batches, 2 rounds of 2 ranks, the second round's second rank idle at the
    end of the input; the output, its n-best lists and scores are byte for byte one process's."""
    alone, together = tmp_path / "alone", tmp_path / "together"
    for directory, ranks in ((alone, 1), (together, 2)):
        directory.mkdir()
        done = torchrun(ranks, *decode_args(tiny_init, sources, directory / "out.jsonl", "--n-best", "2"))
        assert done.stdout.count("[decode] 7 inputs in") == 1  # rank 0 reports, once
    for name in ("out.jsonl", "out.nbest.jsonl", "out.metrics.json"):
        assert (together / name).read_bytes() == (alone / name).read_bytes(), name
    assert sorted(p.name for p in together.iterdir()) == sorted(p.name for p in alone.iterdir())


@pytest.mark.slow
def test_a_decode_stopped_in_one_process_continues_on_two_ranks(tiny_init, sources, tmp_path, monkeypatch,
                                                                capsys) -> None:
    """The journal's batches are the same whatever the number of ranks: two ranks continue after what a stopped
    one-process decode kept, and the output is the uninterrupted one's."""
    whole = tmp_path / "whole.jsonl"
    decode.main(decode_args(tiny_init, sources, whole))
    output, journal = tmp_path / "out.jsonl", tmp_path / "out.partial.jsonl"
    real, calls = generation.beam_search, []

    def stop_at_the_third_batch(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(generation, "beam_search", stop_at_the_third_batch)
    with pytest.raises(SystemExit) as stopped:
        decode.main(decode_args(tiny_init, sources, output))
    assert stopped.value.code == 128 + signal.SIGINT and not output.exists()
    assert f"4 of 7 predictions are kept in {journal}" in capsys.readouterr().err
    monkeypatch.undo()

    done = torchrun(2, *decode_args(tiny_init, sources, output))
    assert f"continuing after the 4 predictions {journal} holds" in done.stderr
    assert "3 decoded now, 4 kept from before" in done.stdout
    assert output.read_bytes() == whole.read_bytes() and not journal.exists()
    assert not (tmp_path / ".out.decode.lock").exists() or os.path.getsize(tmp_path / ".out.decode.lock") == 0
