"""What a training step reports: its loss, token and per-objective sums reduced over the ranks in one transfer
(`StepSums`), its TFLOP/s and MFU (`Throughput`), and rank 0's ``metrics.jsonl`` and DeepSpeed monitor events."""
from __future__ import annotations

import json
import logging
import os
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as torch_dist

from common.files import write_atomically
from pretrain.accelerator import collective_device, matmul_peak_tflops
from pretrain.distributed import gather_objects
from pretrain.engine import precision
from pretrain.model import REPORTED_OBJECTIVES, ModelConfig, training_flops
from pretrain.progress import StepBar

log = logging.getLogger(__name__)


def read_metrics(path: Path, report: Callable[[str], None] = log.info) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl``; a line that is not a JSON object (a write cut short by a kill) is
    skipped and reported with its line number."""
    records = []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not isinstance(record, dict):
            report(f"[metrics] {path}:{number}: skipping a torn or unreadable line ({line[:60]!r})")
            continue
        records.append(record)
    return records


def prepare_metrics_file(path: Path, resumed_step: int | None,
                         report: Callable[[str], None] = log.info) -> None:
    """Make ``metrics.jsonl`` continue the run being started.

    Resumed at step N: records past N (steps being redone) and torn lines are dropped, by writing the kept
    records beside the file and renaming it over the old one, so a kill leaves the old or the new file. A fresh
    run (no checkpoint) never destroys an existing history: the old file is renamed ``metrics.N.jsonl``."""
    if not path.exists():
        return
    if resumed_step is None:
        number = 1
        while path.with_name(f"{path.stem}.{number}{path.suffix}").exists():
            number += 1
        kept = path.with_name(f"{path.stem}.{number}{path.suffix}")
        os.replace(path, kept)
        report(f"[metrics] {path} belongs to an earlier run this one does not resume (it left no checkpoint, or "
               f"train.resume=never); kept as {kept.name}")
        return
    records = read_metrics(path, report)
    kept_records = [r for r in records if r.get("step", 0) <= resumed_step]
    text = "".join(json.dumps(r) + "\n" for r in kept_records)
    if len(kept_records) == len(records) and path.read_text(errors="replace") == text:
        return
    write_atomically(path, lambda tmp: tmp.write_text(text))


class Metrics:
    """Rank 0's ``metrics.jsonl`` (one JSON object per optimizer step) and progress bar."""

    def __init__(self, path: Path, resumed_step: int | None, max_steps: int, enabled: bool) -> None:
        self.enabled = enabled
        self.path = path
        self.bar = None
        if not enabled:
            return
        prepare_metrics_file(path, resumed_step)
        self.bar = StepBar(max_steps, resumed_step or 0, "pretrain")

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as handle:
            handle.write(json.dumps(record) + "\n")
        if self.bar is not None and "loss" in record:
            self.bar.update(record["step"], record["loss"], record["lr"], record["samples_per_s"],
                            record.get("tflops"), record.get("mfu"))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class Throughput:
    """A step's model TFLOP/s per rank and its model FLOPs utilisation (MFU) over one rank's dense matmul peak.

    The peak is measured at start (`measured_peak_tflops`) or configured (``train.peak_tflops``). A probe that ran
    while something else loaded the device reads low, and a step then seems to beat the peak: an MFU over 100 %, which
    cannot be (a step's matmuls cannot outrun the device's). Such a step has the peak re-measured (``probe``, one rank's
    device, no collective) and raised to the best of the old peak, the new probe and the step's own TFLOP/s (the device
    just ran matmuls that fast, so its peak is no lower); its record says ``peak_remeasured: true`` and rank 0's log
    says from what to what. The peak is thus the best of every probe a faster step asked for, and no recorded or
    printed MFU exceeds 100 %."""

    def __init__(self, model_cfg: ModelConfig, world_size: int, peak_tflops: float, probe: Callable[[], float],
                 speak: bool = True) -> None:
        self.model_cfg = model_cfg
        self.world_size = world_size
        self.peak_tflops = peak_tflops
        """One rank's dense matmul peak in the training dtype, TFLOP/s: the configured or measured one, raised by any
        re-measurement."""
        self.probe = probe
        """Measures the peak again, TFLOP/s (`pretrain.accelerator.matmul_peak_tflops` on this rank's device)."""
        self.speak = speak
        """Whether this rank logs a re-measurement (rank 0, which records the metrics)."""

    def per_rank(self, summary: dict[str, Any], samples: int, elapsed: float) -> dict[str, Any]:
        """``tflops``: `pretrain.model.training_flops` of the step's global batch (``summary`` from
        `StepSums.reduce`, ``samples`` sequences) per second, divided by the world size; ``mfu``: that over the
        peak, re-measured first if the step beat it (class docstring), then ``peak_remeasured: true`` too;
        ``peak_tflops``."""
        flops = training_flops(self.model_cfg, summary["tokens"], summary["squared_lengths"], summary["predictions"],
                               samples)
        tflops = flops / self.world_size / elapsed / 1e12
        remeasured = tflops > self.peak_tflops
        if remeasured:
            before, probed = self.peak_tflops, self.probe()
            self.peak_tflops = max(before, probed, tflops)
            if self.speak:
                log.warning(f"[mfu] a step ran at {tflops:.3g} TFLOP/s per rank, above the matmul peak of "
                            f"{before:.3g} TFLOP/s (measured under load, or train.peak_tflops set too low): peak "
                            f"re-measured, {probed:.3g} TFLOP/s; MFU is now over {self.peak_tflops:.3g} TFLOP/s, the "
                            "best of the old peak, the new probe and this step")
        return {"tflops": tflops, "mfu": tflops / self.peak_tflops, "peak_tflops": self.peak_tflops,
                **({"peak_remeasured": True} if remeasured else {})}


def build_throughput(model_cfg: ModelConfig, world_size: int, engine: Any, rank: int,
                     peak_tflops: float | None) -> Throughput:
    """The `Throughput` of a training run: over ``peak_tflops`` (``train.peak_tflops``) when set, else over
    `measured_peak_tflops`; re-measured on this rank's device in the training dtype when a step beats it."""
    dtype = training_dtype(engine)

    def probe() -> float:
        return matmul_peak_tflops(engine.device, dtype)

    return Throughput(model_cfg, world_size, peak_tflops or measured_peak_tflops(engine, rank), probe,
                      speak=rank == 0)


def training_dtype(engine: Any) -> torch.dtype:
    """The dtype the engine's matmuls run in (`pretrain.engine.precision`)."""
    return {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[precision(engine)]


def measured_peak_tflops(engine: Any, rank: int) -> float:
    """`pretrain.accelerator.matmul_peak_tflops` on every rank's device in the engine's training dtype, measured by
    all ranks together (after a barrier, as they will train: ranks sharing a CPU share its cores) and agreed on as
    the median over the ranks, so every rank's MFU has one denominator and a rank slowed for a moment (the other
    ranks still starting up, another process) does not skew it."""
    dtype = training_dtype(engine)
    distributed = torch_dist.is_initialized() and torch_dist.get_world_size() > 1
    if distributed:
        torch_dist.barrier()
    peaks = sorted(gather_objects(matmul_peak_tflops(engine.device, dtype))) if distributed \
        else [matmul_peak_tflops(engine.device, dtype)]
    peak = statistics.median(peaks)
    if rank == 0:
        spread = f", median of {len(peaks)} ranks measured together: {peaks[0]:.3g}–{peaks[-1]:.3g}" \
            if len(peaks) > 1 else ""
        log.info(f"[mfu] measured {precision(engine)} matmul peak of {engine.device}: {peak:.3g} TFLOP/s{spread} "
                 "(set train.peak_tflops to use a fixed one)")
    return peak


def write_monitor(engine: Any, record: dict[str, Any]) -> None:
    """Every number of a step's ``metrics.jsonl`` record (losses, throughput, MFU, ...) as a DeepSpeed monitor event
    ``Train/Steps/<key>`` at x = the optimizer step (CSV files, and TensorBoard when installed; rank 0 writes)."""
    numbers = {key: value for key, value in record.items()
               if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)}
    if engine.monitor.enabled:
        engine.monitor.write_events([(f"Train/Steps/{key}", value, record["step"]) for key, value in numbers.items()])


class StepSums:
    """A step's (or an evaluation's) loss, tokens and per-objective loss sums on this rank, reduced over ranks.

    Everything stays a float64 tensor on the device until `reduce`, whose all-reduce and one transfer to the host
    are the step's only wait for the device. Layout of ``values``: ``_FIELDS`` then a (sum, count) pair per
    `REPORTED_OBJECTIVES` slot."""

    _FIELDS = ("loss", "micro_batches", "tokens", "squared_lengths", "stop")

    def __init__(self, device: torch.device | str) -> None:
        self.values = torch.zeros(len(self._FIELDS) + 2 * len(REPORTED_OBJECTIVES), dtype=torch.float64,
                                  device=device)

    def _field(self, name: str) -> torch.Tensor:
        return self.values[self._FIELDS.index(name)]

    def add(self, batch: dict[str, torch.Tensor], output: Any) -> None:
        """Count one micro-batch's ``pretrain.model.PretrainOutput``."""
        length = batch["length"].to(self.values.device, torch.float64)
        self._field("loss").add_(output.loss.detach().to(torch.float64))
        self._field("micro_batches").add_(1)
        self._field("tokens").add_(length.sum())
        self._field("squared_lengths").add_(length.square().sum())
        objectives = self.values[len(self._FIELDS):].view(-1, 2)
        objectives[:, 0].add_(output.objective_sums.to(torch.float64))
        objectives[:, 1].add_(output.objective_counts.to(torch.float64))

    def reduce(self, stop: bool) -> dict[str, Any]:
        """Sum over ranks in one all-reduce: mean loss per micro-batch, ``set_loss`` (the objective over every
        micro-batch added on every rank: mean loss per predicted token plus mean NSP loss per NSP sample), tokens
        (and the sum of squared sample lengths), per-objective mean losses, whether any rank asked to stop, and this
        rank's own loss sum."""
        self._field("stop").fill_(float(stop))
        reduced = self.values.to(collective_device(), copy=True)
        torch_dist.all_reduce(reduced)
        *values, local_loss = torch.cat([reduced, self._field("loss").view(1).to(reduced.device)]).tolist()
        totals = dict(zip(self._FIELDS, values))
        sums, counts = values[len(self._FIELDS)::2], values[len(self._FIELDS) + 1::2]  # per REPORTED_OBJECTIVES slot
        objectives = {name: sums[i] / counts[i] for i, name in enumerate(REPORTED_OBJECTIVES) if counts[i] > 0}
        nsp = REPORTED_OBJECTIVES.index("nsp")
        predictions = sum(counts) - counts[nsp]
        set_loss = (sum(sums) - sums[nsp]) / max(predictions, 1) + sums[nsp] / max(counts[nsp], 1)
        return {"loss": totals["loss"] / totals["micro_batches"], "set_loss": set_loss,
                "tokens": int(totals["tokens"]), "squared_lengths": totals["squared_lengths"],
                "predictions": predictions, "stop": totals["stop"] > 0, "objectives": objectives,
                "local_loss": local_loss}
