"""`pretrain.metrics.Throughput`: a step's MFU over a matmul peak that a faster step has re-measured, so that a peak
measured under load never yields an MFU above 100 % in `metrics.jsonl` or on the console."""
from __future__ import annotations

import logging
import re
from types import SimpleNamespace

import pytest
import torch

from pretrain import metrics
from pretrain.metrics import Metrics, Throughput, build_throughput, read_metrics
from pretrain.model import preset, training_flops

CFG = preset("tiny")
# one step's global batch of 8 sequences of 128 tokens, 20 predicted each (`StepSums.reduce`'s keys)
SUMMARY = {"tokens": 8 * 128, "squared_lengths": 8 * 128**2, "predictions": 8 * 20}
SAMPLES = 8
STEP_FLOPS = training_flops(CFG, SUMMARY["tokens"], SUMMARY["squared_lengths"], SUMMARY["predictions"], SAMPLES)


def elapsed_at(tflops: float, world_size: int = 1) -> float:
    """The step time at which a step of `SUMMARY` runs at ``tflops`` per rank."""
    return STEP_FLOPS / world_size / (tflops * 1e12)


def test_a_peak_measured_under_load_is_remeasured_on_the_cpu_when_a_step_beats_it(monkeypatch, caplog):
    """The start-up probe reads low (another process held the cores: injected as its result); the first step that
    runs faster has the real CPU probe measure the peak again, and every MFU stays under 100 %."""
    loaded = 1e-6  # TFLOP/s: what a probe starved of the cores might read; any CPU's matmuls beat it
    real_probe = metrics.matmul_peak_tflops
    probes: list[float] = []

    def probe(device: torch.device, dtype: torch.dtype, seconds: float = 0.25) -> float:
        probes.append(loaded if not probes else real_probe(device, dtype, seconds=0.05))
        return probes[-1]

    monkeypatch.setattr(metrics, "matmul_peak_tflops", probe)
    engine = SimpleNamespace(device=torch.device("cpu"), fp16_enabled=lambda: False, bfloat16_enabled=lambda: False)
    throughput = build_throughput(CFG, 1, engine, rank=0, peak_tflops=None)
    assert throughput.peak_tflops == loaded and len(probes) == 1

    step = 1e-4  # TFLOP/s: 100 times the loaded peak, well under what the CPU's matmuls reach
    with caplog.at_level(logging.WARNING, logger="pretrain.metrics"):
        record = throughput.per_rank(SUMMARY, SAMPLES, elapsed_at(step))
    assert len(probes) == 2 and probes[1] > loaded, probes
    assert record["peak_remeasured"] is True and record["peak_tflops"] == max(probes[1], record["tflops"])
    assert record["tflops"] == pytest.approx(step) and record["mfu"] <= 1
    assert f"above the matmul peak of {loaded:.3g} TFLOP/s" in caplog.text and "peak re-measured" in caplog.text
    # the next step as fast: the peak holds, nothing is measured again
    again = throughput.per_rank(SUMMARY, SAMPLES, elapsed_at(step))
    assert len(probes) == 2 and "peak_remeasured" not in again and again["peak_tflops"] == record["peak_tflops"]


def test_no_recorded_or_printed_mfu_exceeds_100_percent_and_a_changed_peak_says_it_was_remeasured(tmp_path, caplog):
    """A busy machine: the probe reads low at start and again when re-measured (lower than the step that asked for
    it), steps speed up and slow down; the step's own rate bounds the peak, the record and the console line say so."""
    probes = iter([0.002, 0.05, 0.04])  # TFLOP/s, each re-measurement under load
    throughput = Throughput(CFG, 2, peak_tflops=0.001, probe=lambda: next(probes))
    path = tmp_path / "metrics.jsonl"
    written = Metrics(path, None, max_steps=70, enabled=True)
    rates = [0.0005, 0.003, 0.0025, 0.01, 0.004, 0.06, 0.03]  # TFLOP/s per rank, of steps 10, 20, ...
    with caplog.at_level(logging.INFO):
        for step, rate in enumerate(rates, 1):
            record = throughput.per_rank(SUMMARY, SAMPLES, elapsed_at(rate, world_size=2))
            written.write({"step": step * 10, "loss": 1.0, "lr": 1e-4, "samples_per_s": 1.0, **record})
            assert written.bar is not None and f"mfu={record['mfu']:.1%}" in str(written.bar.bar.postfix)
    written.close()
    records = read_metrics(path)
    assert [r["step"] for r in records] == [10, 20, 30, 40, 50, 60, 70]
    assert all(r["mfu"] <= 1 and r["mfu"] == r["tflops"] / r["peak_tflops"] for r in records)
    # the peak changes only where a step beat it, and that step's record says it was re-measured
    remeasured = [r["step"] for r in records if r.get("peak_remeasured")]
    assert remeasured == [20, 40, 60]
    assert all(after["peak_tflops"] == before["peak_tflops"] or after.get("peak_remeasured")
               for before, after in zip(records, records[1:]))
    peaks = [r["peak_tflops"] for r in records]
    assert peaks == sorted(peaks) and peaks[1] == pytest.approx(0.003) and peaks[3] == pytest.approx(0.05)
    assert records[3]["mfu"] == pytest.approx(0.2) and records[5]["mfu"] == pytest.approx(1.0)  # step 60's own rate
    assert caplog.text.count("peak re-measured") == 3
    printed = [float(mfu) for mfu in re.findall(r"MFU (\S+)%", caplog.text)]
    if not written.bar.bar.disable:  # a terminal shows the bar (its postfix, checked above) instead of step lines
        return
    assert len(printed) == len(rates) and max(printed) <= 100.0 and printed[5] == 100.0
