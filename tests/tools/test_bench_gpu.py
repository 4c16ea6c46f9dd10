"""The GPU benchmark's code run where CI runs: the model-step measurement and the training-step throughput on the
CPU with the tiny model, the streaming command runner, and the GPU section's part-by-part bookkeeping."""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import pytest

from pretrain.model import UniLMModel
from tests.conftest import DISTRIBUTED_VARIABLES
from tools import bench_all
from tools.bench_model import GPU_VARIANTS, measure_gpu, report_gpu
from tools.bench_train import train_step_throughput
from tools.stages import stream


def test_model_step_measurement_runs_every_variant_on_the_cpu() -> None:
    result = measure_gpu("tiny", batch_size=4, seq_len=64, predictions=8, steps=1, dtypes=("bf16",), device="cpu")
    assert set(result["rows"]) == {f"bf16_{variant}" for variant in GPU_VARIANTS}
    peak = result["peak_tflops"]["bf16"]
    for row in result["rows"].values():
        assert row["step_s"] > 0 and abs(row["samples_per_s"] - 4 / row["step_s"]) < 1e-9
        # no upper bound: on a shared CPU the peak probe and the step may see different loads
        assert abs(row["mfu"] - row["tflops"] / peak) < 1e-12 and row["mfu"] > 0
    assert "x transformers" in report_gpu(result)


def test_a_variant_that_fails_is_named_and_the_others_are_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(self: UniLMModel) -> None:
        raise RuntimeError("compiler failed")

    monkeypatch.setattr(UniLMModel, "compile_blocks", broken)
    result = measure_gpu("tiny", batch_size=2, seq_len=32, predictions=4, steps=1, dtypes=("bf16",), device="cpu")
    assert set(result["rows"]) == {"bf16_eager", "bf16_chunked_loss", "bf16_transformers"}
    assert result["errors"] == {"bf16_compiled": "RuntimeError: compiler failed",
                                "bf16_fast": "RuntimeError: compiler failed"}
    assert "bf16_fast FAILED: RuntimeError: compiler failed" in report_gpu(result)
    rows = bench_all.table_rows({"gpu": {"device": "cpu", "model": result}})
    assert len(rows) == 3 and not any("vs transformers" in r["benchmark"] for r in rows)


@pytest.mark.slow
def test_training_step_throughput_is_read_from_the_runs_metrics(unilm_shards: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    for name in DISTRIBUTED_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    result = train_step_throughput(str(unilm_shards), tmp_path, "bf16", steps=3, skipped=1, overrides=(
        "model.preset=tiny", "deepspeed_config=ds_configs/zero2_bf16_cpu.json", "train.global_batch_size=8",
        "train.micro_batch_size=4"))
    run_dir = tmp_path / f"train_bf16_{unilm_shards.name}"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert set(result) == {"samples_per_s", "tokens_per_s", "tflops", "mfu", "peak_tflops", "step_time_s"}
    assert result["samples_per_s"] == statistics.median(r["samples_per_s"] for r in records[1:])
    assert not (run_dir / "checkpoints").exists()
    assert "[exit] exit_at_step" in (tmp_path / f"{run_dir.name}.log").read_text()


def test_stream_returns_and_logs_the_output_as_the_command_prints_it(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "logs" / "child.log"
    code = "import sys; print('one', flush=True); print('two', file=sys.stderr, flush=True); sys.exit(3)"
    returncode, output = stream([sys.executable, "-c", code], log)
    assert returncode == 3 and output.split() == ["one", "two"]
    assert log.read_text() == output and capsys.readouterr().out == output
    stream([sys.executable, "-c", "print('three')"], log)
    assert log.read_text().split() == ["one", "two", "three"]  # appended


def test_the_gpu_section_keeps_the_parts_that_ran_when_one_fails(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    model = {"peak_tflops": {"bf16": 700.0}, "rows": {}, "errors": {"bf16_fast": "RuntimeError: compiler failed"}}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "GPU")
    monkeypatch.setattr(bench_all, "_shards", lambda args, seq_len=128: f"shards-{seq_len}")
    monkeypatch.setattr(bench_all, "_run", lambda command: Path(command[-1]).write_text(json.dumps(model)))
    partial_after: list[dict] = []

    def training(shards: str, out: Path, precision: str, overrides: tuple[str, ...] = (),
                 label: str = "") -> dict[str, float]:
        partial_after.append(json.loads((tmp_path / "gpu_partial.json").read_text()))
        if precision == "fp16":
            raise RuntimeError("training run failed (exit 1)")
        if overrides:
            assert overrides == ("train.pack_samples=false",) and label == "unpacked" and shards == "shards-512"
            return {"samples_per_s": 380.0}
        return {"samples_per_s": 400.0 if shards == "shards-512" else 1500.0}

    monkeypatch.setattr("tools.bench_train.train_step_throughput", training)
    result = bench_all.bench_gpu(argparse.Namespace(out=tmp_path, work=tmp_path / "work"))
    assert result["model"] == model and result["device"] == "GPU"
    assert result["train"] == {"bf16": {512: {"samples_per_s": 400.0}, 128: {"samples_per_s": 1500.0}}}
    assert result["train_unpacked"] == {"bf16": {512: {"samples_per_s": 380.0}}}
    assert list(result["errors"]) == ["model step: bf16_fast", "train fp16 512"]
    assert "exit 1" in result["errors"]["train fp16 512"]
    assert partial_after[0]["model"] == model and partial_after[0]["train"] == {}  # written after each part
    final = json.loads((tmp_path / "gpu_partial.json").read_text())
    assert final["train"]["bf16"] == {"512": {"samples_per_s": 400.0}, "128": {"samples_per_s": 1500.0}}


def test_gpu_speed_refuses_a_machine_without_a_cuda_gpu_and_writes_nothing(tmp_path: Path) -> None:
    import os
    import subprocess

    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    script = Path(__file__).resolve().parents[2] / "tools" / "gpu_speed.sh"
    done = subprocess.run([str(script), str(tmp_path / "out"), "bench"], capture_output=True, text=True,
                          env=dict(os.environ, PYTHON=sys.executable), timeout=120)
    assert done.returncode == 2 and "needs a CUDA GPU, and torch sees none here (torch " in done.stderr
    assert "the CPU figures are make bench" in done.stderr and not (tmp_path / "out").exists()
