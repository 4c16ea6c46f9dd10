"""Fine-tuning and decoding on a CUDA GPU (`pytest -m gpu`): `python -m finetune.run` in a child process on
DeepSpeed's CUDA accelerator picks its GPU engine config by itself (bf16 ZeRO-2 where the GPU has bf16), trains a
few seq2seq steps, and its model decodes on the GPU with the key/value cache exactly as without it. A classifier
run stopped and rerun continues like the uninterrupted one (the CUDA generator is in its checkpoint).
`python -m finetune.decode --dtype bf16|fp16` decodes on the GPU in that precision."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import GPU_ENV, ROOT, subprocess_env
from finetune.beam import DecodeConfig, SpecialIds, beam_search, generate
from finetune.decode import DTYPES
from finetune.generation import pack_source
from finetune.model_io import load_finetuned

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
COMMON = ["--batch-size", "8", "--micro-batch-size", "4", "--lr", "1e-3", "--seed", "3"]


def finetune(*args: str) -> subprocess.CompletedProcess:
    process = subprocess.run([sys.executable, "-m", "finetune.run", *args], cwd=ROOT, env=subprocess_env(**GPU_ENV),
                             capture_output=True, text=True, timeout=420)
    assert process.returncode == 0, process.stdout[-3000:] + process.stderr[-5000:]
    return process


def step_losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_seq2seq_fine_tuning_on_the_gpu_then_beam_decoding_with_and_without_cache(small_tasks, tiny_init, tmp_path):
    out = tmp_path / "model"
    process = finetune("--task", "seq2seq", "--train", str(small_tasks["bbc_headline.train"]), "--dev",
                       str(small_tasks["bbc_headline.dev"]), "--init", str(tiny_init), "--out", str(out),
                       "--epochs", "1", "--max-src-len", "96", "--max-tgt-len", "16", *COMMON)
    precision = "bf16" if torch.cuda.get_device_capability()[0] >= 8 else "fp16"  # native bf16: Ampere on
    assert f"ds_configs/zero2_{precision}.json" in process.stdout  # the GPU default, not the CPU fp32 config
    assert len(step_losses(out)) == 3 and all(loss == loss for loss in step_losses(out))
    assert {"rouge1", "rougeL", "dev_loss"} <= set(json.loads((out / "summary.json").read_text())["best"])

    finetuned = load_finetuned(out, expect_task="seq2seq")
    model = finetuned.model.cuda()
    records = [json.loads(line) for line in Path(small_tasks["bbc_headline.dev"]).read_text().splitlines()]
    sources = [pack_source(finetuned.tokenizer, r["src"], 96)[0] for r in records]
    outputs = {}
    for use_cache in (True, False):
        config = DecodeConfig(beam_size=3, max_tgt_len=12, use_cache=use_cache)
        outputs[use_cache] = generate(model, sources, SpecialIds.of(finetuned.tokenizer), config)
    assert [h.tokens for h in outputs[True]] == [h.tokens for h in outputs[False]]
    for cached, full in zip(outputs[True], outputs[False]):
        assert cached.score == pytest.approx(full.score, rel=1e-4, abs=1e-4)
    assert next(model.parameters()).device.type == "cuda"


def test_a_stopped_gpu_classifier_run_continues_like_the_uninterrupted_one(small_tasks, tiny_init, tmp_path):
    def args(out: Path, *extra: str) -> list[str]:
        return ["--task", "classify", "--train", str(small_tasks["bbc_topic.train"]), "--dev",
                str(small_tasks["bbc_topic.dev"]), "--init", str(tiny_init), "--out", str(out), "--max-seq-len", "64",
                "--epochs", "2", *COMMON, *extra]

    first, second, stopped = tmp_path / "first", tmp_path / "second", tmp_path / "stopped"
    finetune(*args(first))
    finetune(*args(second))
    finetune(*args(stopped, "--set", "exit_at_step=3"))
    assert len(step_losses(stopped)) == 3
    finetune(*args(stopped, "--set", "exit_at_step=3"))
    # tolerance measured as in tests/pretrain/test_gpu.py: two uninterrupted GPU runs against each other
    noise = max(abs(a - b) for a, b in zip(step_losses(first), step_losses(second)))
    gap = max(abs(a - b) for a, b in zip(step_losses(first), step_losses(stopped)))
    assert len(step_losses(stopped)) == len(step_losses(first)) == 10
    assert gap <= 4 * noise + 1e-6 * max(step_losses(first)), (gap, noise)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_decoding_in_half_precision_on_the_gpu(small_tasks, tiny_init, tmp_path, dtype):
    """The model runs in `dtype` on the GPU (its n-best lists sorted, their scores finite), and the command writes
    one prediction and one n-best list per input there."""
    finetuned = load_finetuned(tiny_init)
    model = finetuned.model.to(device="cuda", dtype=DTYPES[dtype])
    records = [json.loads(line) for line in Path(small_tasks["bbc_headline.dev"]).read_text().splitlines()]
    sources = [pack_source(finetuned.tokenizer, r["src"], 96)[0] for r in records]
    special = SpecialIds.of(finetuned.tokenizer)
    for use_cache in (True, False):
        lists = beam_search(model, sources, special, DecodeConfig(beam_size=3, max_tgt_len=8, use_cache=use_cache),
                            n_best=3)
        for hypotheses in lists:
            scores = [h.score for h in hypotheses]
            assert scores == sorted(scores, reverse=True) and all(score > -float("inf") for score in scores)
    assert next(model.parameters()).dtype == DTYPES[dtype]

    output = tmp_path / "out.jsonl"
    process = subprocess.run([sys.executable, "-m", "finetune.decode", "--model", str(tiny_init), "--input",
                              str(small_tasks["bbc_headline.dev"]), "--output", str(output), "--beam-size", "3",
                              "--max-tgt-len", "8", "--n-best", "2", "--dtype", dtype], cwd=ROOT,
                             env=subprocess_env(**GPU_ENV), capture_output=True, text=True, timeout=420)
    assert process.returncode == 0, process.stdout[-3000:] + process.stderr[-5000:]
    predictions = [json.loads(line)["prediction"] for line in output.read_text().splitlines()]
    lists = [json.loads(line)["hyps"] for line in (tmp_path / "out.nbest.jsonl").read_text().splitlines()]
    assert len(predictions) == len(lists) == len(records)
    assert [hyps[0]["text"] for hyps in lists] == predictions
