"""Training-engine benchmark (``make bench-train``).

1. Loader vs model: samples/s one rank's prefetching loader delivers (read + collate from the mmapped shards)
   against the samples/s the model consumes (forward + backward + AdamW, one process) at the ``tiny`` and
   ``bert-base`` presets.
2. Data-wait share: a real 2-rank DeepSpeed run (tiny, ZeRO-2) — time the trainer blocked on the loader over
   total step time, from its metrics.jsonl (target < 1 %).
3. Per-rank memory of ZeRO-1/2/3 (bf16, 2 ranks, bert-base shape): bytes of all live tensors on each rank after
   one optimizer step (communication buckets sized to 1e7 elements), against the budgets 16·P (no ZeRO: 2 weights
   + 2 grads + 12 fp32 master/Adam moments) and 4·P + 12·P/N (ZeRO-2), and 16·P/N plus the 20 MB
   parameter-prefetch bucket (ZeRO-3; parameters smaller than DeepSpeed's persistence threshold also stay whole
   on every rank, well under 0.1 % here).

All three run on the CPU, the 2-rank ones on CPU ranks (gloo), a GPU machine included: two ranks then need no
second GPU, and the rows compare across machines.
Writes ``OUT/bench_train.json`` and ``OUT/bench_train.md``. The GPU figures (the full training step on one GPU,
`train_step_throughput`, beside the model step) are ``python -m tools.bench_all --only gpu`` (``make gpu-speed``).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from common.paths import REPO_ROOT
from pretrain.batch_plan import plan_batch
from pretrain.distributed import close_distributed
from tools.stages import stream

DEFAULT_SHARDS = "data/shards/unilm-128"
BUCKET = 10_000_000  # elements per ZeRO communication bucket in the memory measurement
CPU_RANKS = {"DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
"""The environment of the 2-rank runs: CPU ranks on gloo, one thread each, on any machine."""


def loader_samples_per_s(shards: str, micro: int, steps: int = 30) -> float:
    from data_prep.shard_format import ShardDataset
    from pretrain.data import PretrainLoader, SampleOrder, sample_objectives

    dataset = ShardDataset(shards)
    plan = plan_batch(micro * 4, micro, 1)
    loader = PretrainLoader(dataset, SampleOrder(sample_objectives(dataset), 1), plan, 0, 0,
                            dataset.special_tokens["pad"], 512, prefetch_steps=2)
    try:
        loader.next_step()  # thread started, first step ready
        started = time.perf_counter()
        for _ in range(steps):
            loader.next_step()
        return steps * plan.global_batch_size / (time.perf_counter() - started)
    finally:
        loader.close()


def model_samples_per_s(shards: str, preset_name: str, micro: int, steps: int) -> float:
    from data_prep.shard_format import ShardDataset
    from pretrain.data import collate
    from pretrain.model import build_model, preset

    dataset = ShardDataset(shards)
    batch = collate([dataset[i] for i in range(micro)], dataset.special_tokens["pad"], 512)
    model = build_model(preset(preset_name))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for index in range(steps + 1):
        if index == 1:
            started = time.perf_counter()
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return steps * micro / (time.perf_counter() - started)


def data_wait_share(shards: str, out: Path) -> dict[str, float]:
    run_dir = out / "wait_run"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
               "pretrain.train", "--config", "pretrain/configs/tiny.yaml", f"data.shards={shards}",
               f"out_dir={run_dir}", "train.max_steps=30", "train.save_interval=1000", "train.resume=never"]
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, env=dict(os.environ, **CPU_RANKS))
    if done.returncode:
        raise RuntimeError(f"the 2-rank data-wait run failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][1:]
    wait, total = sum(r["data_wait_s"] for r in records), sum(r["step_time_s"] for r in records)
    return {"data_wait_share": wait / total, "step_time_s": total / len(records),
            "samples_per_s": sum(r["samples_per_s"] for r in records) / len(records)}


STEP_RATES = ("samples_per_s", "tokens_per_s", "tflops", "mfu", "peak_tflops", "step_time_s")
"""The throughput fields of a ``metrics.jsonl`` record that `step_medians` summarises."""


def large_run_command(shards: str, run_dir: Path, precision: str, overrides: Sequence[str] = ()) -> list[str]:
    """``pretrain.train`` on this machine's GPU with ``unilm-large.yaml`` under ZeRO-2 in ``precision``
    (``ds_configs/zero2_PRECISION.json``), global batch 330 = 33 × 10, writing ``run_dir``; the shards' hashes are
    not re-verified (they were just built). ``overrides`` come last. One rank, without a launcher (the trainer makes
    its own 1-rank group): the process started is the trainer itself, which a kill then reaches (torchrun would
    start it in a session of its own, where a kill of the launcher's process group leaves it running)."""
    return [sys.executable, "-m", "pretrain.train", "--config", "pretrain/configs/unilm-large.yaml",
            f"deepspeed_config=ds_configs/zero2_{precision}.json", f"data.shards={shards}", "data.verify=false",
            f"out_dir={run_dir}", "train.global_batch_size=330", "train.micro_batch_size=33",
            "optim.warmup_steps=100", *overrides]


def step_medians(records: Sequence[dict[str, Any]]) -> dict[str, float]:
    """The median of each `STEP_RATES` field over ``records`` (``metrics.jsonl`` records of measured steps)."""
    if not records:
        raise ValueError("no measured steps: the run logged no step after its warm-up")
    return {key: statistics.median(r[key] for r in records) for key in STEP_RATES}


def train_step_throughput(shards: str, out: Path, precision: str = "bf16", steps: int = 12, skipped: int = 4,
                          overrides: tuple[str, ...] = (), label: str = "") -> dict[str, float]:
    """The full training step on this machine's GPU (`large_run_command`) for ``steps`` steps; the medians of its
    ``metrics.jsonl`` after the first ``skipped`` steps (compilation and warm-up, `step_medians`). The process saves
    a checkpoint when it stops, after the measured steps (then deleted); its output is streamed as it runs and kept
    in ``OUT/train_PRECISION_SHARDS[_LABEL].log`` (``label`` tells runs with other ``overrides`` apart)."""
    run_dir = out / f"train_{precision}_{Path(shards).name}{'_' + label if label else ''}"
    command = large_run_command(shards, run_dir, precision, ("train.resume=never", f"train.exit_at_step={steps}",
                                                             "train.save_interval=1000000", *overrides))
    log = out / f"{run_dir.name}.log"
    log.unlink(missing_ok=True)
    returncode, output = stream(command, log)
    if returncode:
        raise RuntimeError(f"training run failed (exit {returncode}, log {log}):\n{output[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][skipped:]
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # 4 GB of weights and optimizer state
    return step_medians(records)


def memory_worker(stage: int, preset_name: str, result: str) -> None:
    """Run inside a 2-rank torchrun: one bf16 ZeRO step, then count live tensor bytes on this rank."""
    import deepspeed
    import torch.distributed as dist

    from pretrain.accelerator import bind_local_device, collective_device
    from pretrain.data import to_device
    from pretrain.engine import parameter_groups
    from pretrain.model import build_model, preset

    bind_local_device()
    deepspeed.init_distributed(verbose=False)
    model = build_model(preset(preset_name))
    parameters = model.num_parameters()
    config = {"train_batch_size": 2 * dist.get_world_size(), "train_micro_batch_size_per_gpu": 2,
              "bf16": {"enabled": True},
              # communication buckets are fixed-size buffers (DeepSpeed's defaults hold 5e8 elements, ~1 GB in
              # bf16, more than bert-base itself); sized down so the P-proportional terms are what is measured
              "zero_optimization": {"stage": stage, "reduce_bucket_size": BUCKET, "allgather_bucket_size": BUCKET,
                                    "stage3_prefetch_bucket_size": BUCKET},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}, "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=parameter_groups(model, 0.01), config=config)
    del model
    length = torch.full((2,), 64)
    batch = {"input_ids": torch.randint(5, 1000, (2, 64)), "objective": torch.zeros(2, dtype=torch.long),
             "len_a": torch.full((2,), 32), "length": length, "is_random_next": torch.zeros(2, dtype=torch.long),
             "masked_positions": torch.arange(1, 11).repeat(2, 1), "masked_labels": torch.randint(5, 1000, (2, 10))}
    engine.backward(engine(**to_device(batch, engine.device)).loss)
    engine.step()
    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and not obj.is_meta:
                storage = obj.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        except Exception:  # some tensor subclasses / freed storages refuse; they hold nothing we count
            continue
    measured = torch.tensor([float(sum(storages.values()))], device=collective_device())
    gathered = [torch.zeros_like(measured) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, measured)
    if dist.get_rank() == 0:
        Path(result).write_text(json.dumps({"parameters": parameters, "bytes_per_rank": [g.item() for g in gathered]}))


def zero_memory(preset_name: str, out: Path) -> list[dict[str, float]]:
    rows = []
    for stage in (1, 2, 3):
        result = out / f"memory_zero{stage}.json"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
                   "tools.bench_train", "--memory-worker", str(stage), "--preset", preset_name,
                   "--result", str(result)]
        for attempt in (1, 2):  # once more on failure: on a shared machine a 2-rank launch can lose its rendezvous
            done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True,
                                  env=dict(os.environ, **CPU_RANKS))
            if done.returncode == 0:
                break
            print(f"[bench-train] ZeRO-{stage} memory run failed (attempt {attempt}):\n{done.stderr[-3000:]}",
                  file=sys.stderr, flush=True)
        if done.returncode:
            raise RuntimeError(f"ZeRO-{stage} memory measurement failed twice (exit {done.returncode}); see above")
        data = json.loads(result.read_text())
        p, n = data["parameters"], 2
        rows.append({"stage": stage, "parameters": p, "measured_gb_per_rank": max(data["bytes_per_rank"]) / 1e9,
                     "no_zero_16P_gb": 16 * p / 1e9, "zero2_4P_12P_N_gb": (4 * p + 12 * p / n) / 1e9,
                     "zero3_16P_N_gb": 16 * p / n / 1e9,
                     # ZeRO-3 also holds its parameter-prefetch bucket (BUCKET bf16 elements) in full on every rank
                     "zero3_16P_N_plus_prefetch_gb": (16 * p / n + 2 * BUCKET) / 1e9})
    return rows


def measure(shards: str = DEFAULT_SHARDS, out: Path = Path("bench_out/train"),
            presets: Sequence[str] = ("tiny", "bert-base"), memory_preset: str = "bert-base", micro: int = 8) -> dict:
    """All three measurements; also written to ``OUT/bench_train.json`` (``tools.bench_all`` tabulates them)."""
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {"micro_batch_size": micro, "loader_samples_per_s_per_rank": loader_samples_per_s(shards, micro)}
    report["model_samples_per_s"] = {name: model_samples_per_s(shards, name, micro, 10 if name == "tiny" else 2)
                                     for name in presets}
    report["data_wait"] = data_wait_share(shards, Path(tempfile.mkdtemp(dir=out)))
    report["zero_memory"] = zero_memory(memory_preset, out)
    (out / "bench_train.json").write_text(json.dumps(report, indent=1))
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.bench_train", description=__doc__.splitlines()[0])
    parser.add_argument("--shards", default=DEFAULT_SHARDS)
    parser.add_argument("--out", default="bench_out/train")
    parser.add_argument("--presets", nargs="+", default=["tiny", "bert-base"])
    parser.add_argument("--memory-preset", default="bert-base")
    parser.add_argument("--memory-worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--preset", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.memory_worker is not None:
        memory_worker(args.memory_worker, args.preset, args.result)
        close_distributed()
        return
    out = Path(args.out)
    report = measure(args.shards, out, args.presets, args.memory_preset)
    micro = report["micro_batch_size"]
    lines = ["# Training-engine benchmark", "",
             f"Loader: {report['loader_samples_per_s_per_rank']:.0f} samples/s per rank (micro {micro}).", "",
             "| preset | model samples/s (1 process) | loader / model |", "|---|---|---|"]
    for name, rate in report["model_samples_per_s"].items():
        lines.append(f"| {name} | {rate:.1f} | {report['loader_samples_per_s_per_rank'] / rate:.0f}× |")
    wait = report["data_wait"]
    lines += ["", f"Data-wait share of step time (tiny, 2 ranks, ZeRO-2): {100 * wait['data_wait_share']:.3f} % "
              f"(step {wait['step_time_s'] * 1000:.0f} ms)", "",
              f"| ZeRO stage ({args.memory_preset}, bf16, 2 ranks, buckets {BUCKET:.0e}) | measured GB/rank "
              "| 16·P | 4·P+12·P/N | 16·P/N |",
              "|---|---|---|---|---|"]
    for row in report["zero_memory"]:
        lines.append(f"| {row['stage']} | {row['measured_gb_per_rank']:.3f} | {row['no_zero_16P_gb']:.3f} | "
                     f"{row['zero2_4P_12P_N_gb']:.3f} | {row['zero3_16P_N_gb']:.3f} |")
    (out / "bench_train.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
