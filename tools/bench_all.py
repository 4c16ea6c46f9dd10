"""`make bench`: every benchmark of the project in one run, one table of ratios, ``bench_out/results.json``.

    python -m tools.bench_all [--out bench_out] [--only data model train decode]

Runs, one after the other on the same machine (so the ratios are measured side by side):
  data    ``tools.bench_data``           shard build vs raw ``tokenizers`` encoding of the same corpus
  model   ``tools.bench_model``      training step vs ``transformers.BertForPreTraining``; FLOP/s vs matmul peak
  train   ``tools.bench_train``      loader vs model consumption, data-wait share, ZeRO-1/2/3 memory per rank
  decode  ``tools.bench_decode``     beam search with vs without the key/value cache
  gpu     (CUDA machines only)      ``tools.bench_model --gpu`` (UniLM-large model step, bf16/fp16, eager / fast
                                    paths / transformers, MFU) and ``pretrain.train`` at 512 and 128 tokens
Each measurement is one row: what was measured, against what, the ratio, the target. A benchmark that fails
is reported as such and the others still run. The machine (CPU model, cores, memory, library versions) is
recorded beside the numbers.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tools.stages import driver_environment, stream

SECTIONS = ("data", "model", "train", "decode", "gpu")


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    import deepspeed
    import tokenizers
    import torch
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        memory_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        memory_gb = None
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": memory_gb, "torch_threads": torch.get_num_threads(),
            "load_average": os.getloadavg(), "python": platform.python_version(), "torch": torch.__version__,
            "deepspeed": deepspeed.__version__, "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
            "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}


# -------------------------------------------------------------------------------------------- sections
def bench_data(args: argparse.Namespace) -> dict[str, Any]:
    from tools.bench_data import measure
    return measure(repeat=args.repeat)


def bench_model(args: argparse.Namespace) -> dict[str, Any]:
    """``tools.bench_model`` in its own process (its threads and allocator settings stay its own); its
    measurement comes back as JSON."""
    out = args.out / "model.json"
    _run([sys.executable, "-m", "tools.bench_model", "--json", str(out)])
    return json.loads(out.read_text())


def bench_train(args: argparse.Namespace) -> dict[str, Any]:
    from tools.bench_train import measure
    return measure(_shards(args), args.work / "train")


def bench_decode(args: argparse.Namespace) -> dict[str, Any]:
    out = args.out / "decode.json"
    _run([sys.executable, "-m", "tools.bench_decode", "--out", str(out)])
    return json.loads(out.read_text())


GPU_TRAIN_RUNS = (("bf16", 512), ("fp16", 512), ("bf16", 128))
"""The full training step's (precision, tokens) runs, most important first."""


def bench_gpu(args: argparse.Namespace) -> dict[str, Any]:
    """On CUDA: the model step (``tools.bench_model --gpu`` in its own process: bf16/fp16 matmul peaks, UniLM-large
    32 × 512 eager, with each fast path and both, vs transformers) and the full training step
    (``tools.bench_train.train_step_throughput``: pretrain.train, ZeRO-2, batch 330 = 33 × 10) in bf16 and fp16 at
    512 tokens, in bf16 at 128 tokens, and the first of these again with one sample per row
    (``train.pack_samples=false``). Each part is measured on its own: one that fails is recorded under
    ``errors`` and the others still run; after each part ``OUT/gpu_partial.json`` holds what is measured so far
    (a run stopped by a time limit keeps it)."""
    import torch
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device"}
    from tools.bench_train import train_step_throughput

    result: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "train": {}, "errors": {}}

    def part(name: str, keys: tuple[Any, ...], measure: Callable[[], Any]) -> None:
        """Measure one part and keep its value at ``result[keys[0]][keys[1]]…``, or its error."""
        print(f"[bench] gpu {name} ...", flush=True)
        began = time.monotonic()
        try:
            value = measure()
        except Exception as error:  # one failed part must not lose the others' numbers
            traceback.print_exc()
            result["errors"][name] = f"{type(error).__name__}: {error}"
        else:
            *parents, last = keys
            node = result
            for key in parents:
                node = node.setdefault(key, {})
            node[last] = value
            for inner, message in (value.get("errors", {}) if isinstance(value, dict) else {}).items():
                result["errors"][f"{name}: {inner}"] = message
            print(f"[bench] gpu {name}: {json.dumps(value, default=str)}", flush=True)
        print(f"[bench] gpu {name}: {time.monotonic() - began:.0f} s", flush=True)
        (args.out / "gpu_partial.json").write_text(json.dumps(result, indent=1, default=str) + "\n")

    def model_step() -> dict[str, Any]:
        out = args.out / "gpu_model.json"
        _run([sys.executable, "-m", "tools.bench_model", "--gpu", "--json", str(out)])
        return json.loads(out.read_text())

    part("model step", ("model",), model_step)
    for precision, seq_len in GPU_TRAIN_RUNS:  # part() calls each lambda at once, inside this loop step (B023)
        part(f"train {precision} {seq_len}", ("train", precision, seq_len),
             lambda: train_step_throughput(_shards(args, seq_len), args.work / "gpu_train", precision))  # noqa: B023
    # what packing rows gives: the first run again with one sample per row
    precision, seq_len = GPU_TRAIN_RUNS[0]
    part(f"train {precision} {seq_len} one sample per row", ("train_unpacked", precision, seq_len),
         lambda: train_step_throughput(_shards(args, seq_len), args.work / "gpu_train", precision,
                                       overrides=("train.pack_samples=false",), label="unpacked"))
    return result


RUNNERS = {"data": bench_data, "model": bench_model, "train": bench_train, "decode": bench_decode, "gpu": bench_gpu}


def _run(command: list[str]) -> str:
    """Run ``command`` in the repository, its output streamed as it comes (`tools.stages.stream`); raises with
    the end of the output when it fails."""
    print(f"[bench]   $ {' '.join(Path(command[0]).name if i == 0 else c for i, c in enumerate(command))}",
          flush=True)
    returncode, output = stream(command)
    if returncode:
        raise RuntimeError(f"{' '.join(command[1:])} exited {returncode}:\n{output[-2000:]}")
    return output


def _shards(args: argparse.Namespace, seq_len: int = 128) -> str:
    """The training benchmarks read real shards: ``--shards`` (at 128 tokens), else a build of the sample corpus
    (`sample_shards`)."""
    if seq_len == 128 and args.shards and Path(args.shards, "manifest.json").is_file():
        return args.shards
    shards, builds = sample_shards(args.work / "data", seq_len)
    for command in builds:
        _run(command)
    return shards


SAMPLE_INPUTS = ("wiki/enwiki-excerpt.xml.bz2", "books.jsonl")
"""The sample corpora (in ``make sample-corpus``'s folder) the benchmarks' shards are built from."""


def sample_shards(data: Path, seq_len: int, samples: Path = Path("data/samples")) -> tuple[str, list[list[str]]]:
    """Shards of the sample corpus (Wikipedia excerpt + books, `SAMPLE_INPUTS`) at ``seq_len`` tokens with an
    8,000-token vocabulary trained on it, in ``data``: their directory, and the ``data_prep.build`` commands still
    to run to make them (none where an earlier run built them)."""
    inputs = [str(samples / name) for name in SAMPLE_INPUTS]
    shards = data / ("shards" if seq_len == 128 else f"shards-{seq_len}")
    builds = []
    if not (data / "vocab.txt").is_file():
        builds.append([sys.executable, "-m", "data_prep.build", "--input", *inputs, "--train-vocab", "8000",
                       "--vocab-out", str(data / "vocab.txt"), "--quiet"])
    if not (shards / "manifest.json").is_file():
        builds.append([sys.executable, "-m", "data_prep.build", "--input", *inputs, "--vocab", str(data / "vocab.txt"),
                       "--max-seq-len", str(seq_len), "--workers", str(max(2, min(8, os.cpu_count() or 1))),
                       "--out", str(shards), "--overwrite", "--quiet"])
    return str(shards), builds


# ----------------------------------------------------------------------------------------------- table
def table_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per measured ratio: benchmark, measured value, reference value, ratio, target, met."""
    rows = []

    def row(name: str, measured: str, reference: str, ratio: float, target: str, met: bool | None) -> None:
        rows.append({"benchmark": name, "measured": measured, "reference": reference, "ratio": ratio,
                     "target": target, "met": met})

    data = results.get("data", {})
    if "tokens_per_s" in data:
        rate = data["tokens_per_s"]
        row("shard build (1 worker) vs raw tokenizers encode_batch, tokens/s", f"{rate['build_1']:,.0f}",
            f"{rate['raw']:,.0f}", data["ratio_build_vs_raw"], ">= 0.80", data["ratio_build_vs_raw"] >= 0.8)
        row("  same, by process CPU time (robust to other load)", "", "", data["ratio_build_vs_raw_cpu"], ">= 0.80",
            data["ratio_build_vs_raw_cpu"] >= 0.8)
        row("shard build 2 workers vs 1 worker, tokens/s", f"{rate['build_2']:,.0f}", f"{rate['build_1']:,.0f}",
            data["speedup_2_workers"], "> 1 (identical bytes)",
            data["speedup_2_workers"] > 1 and data["identical_bytes_1_vs_2_workers"])
    model = results.get("model", {})
    if "rows" in model:
        for clock in ("wall", "cpu"):
            ours, theirs = model["rows"][f"{clock}_ours"], model["rows"][f"{clock}_transformers"]
            row(f"train step ours vs transformers BertForPreTraining (bert-base fp32), tokens/s, {clock} clock",
                f"{ours['tokens_per_s']:,.0f}", f"{theirs['tokens_per_s']:,.0f}",
                theirs["step_s"] / ours["step_s"], ">= 1.3", theirs["step_s"] / ours["step_s"] >= 1.3)
            row(f"useful FLOP/s vs best fp32 GEMM peak (oneDNN or torch.matmul), {clock} clock",
                f"{ours['useful_gflops']:.1f} GFLOP/s",
                f"{model['matmul_peak_gflops'][clock]:.1f} GFLOP/s", ours["percent_of_peak"] / 100, ">= 0.80",
                ours["percent_of_peak"] >= 80)
    train = results.get("train", {})
    if "model_samples_per_s" in train:
        loader = train["loader_samples_per_s_per_rank"]
        for name, rate in train["model_samples_per_s"].items():
            row(f"loader vs model consumption ({name}, 1 rank), samples/s", f"{loader:,.0f}", f"{rate:,.1f}",
                loader / rate, "> 1", loader > rate)
        wait = train["data_wait"]
        row("data-wait share of step time (tiny, 2 ranks, ZeRO-2)", f"{1000 * wait['step_time_s']:.0f} ms/step", "",
            wait["data_wait_share"], "< 0.01", wait["data_wait_share"] < 0.01)
        for memory in train["zero_memory"]:
            stage = memory["stage"]
            if stage == 3:  # 16·P/N + the prefetch bucket; small parameters kept whole get 0.1 % of slack
                budget, formula, limit = memory["zero3_16P_N_plus_prefetch_gb"], "16·P/N + prefetch bucket", 1.001
            else:
                budget, formula, limit = memory["zero2_4P_12P_N_gb"], "4·P+12·P/N", 1.0
            ratio = memory["measured_gb_per_rank"] / budget
            row(f"ZeRO-{stage} memory per rank vs budget {formula} (bert-base bf16, 2 ranks)",
                f"{memory['measured_gb_per_rank']:.3f} GB", f"{budget:.3f} GB", ratio, f"<= {limit:g}",
                ratio <= limit)
    decode = results.get("decode", {})
    if "speedup" in decode:
        row(f"beam-{decode['beam_size']} decoding with vs without KV cache ({decode['target_length']} tokens)",
            f"{decode['cache']['seconds']:.2f} s", f"{decode['no_cache']['seconds']:.2f} s", decode["speedup"],
            ">= 10 (same outputs)", decode["speedup"] >= 10 and decode["identical_outputs"])
    gpu = results.get("gpu", {})
    model = gpu.get("model", {}).get("rows", {})
    for dtype, peak in gpu.get("model", {}).get("peak_tflops", {}).items():
        for variant in ("eager", "chunked_loss", "compiled", "fast", "transformers"):
            step = model.get(f"{dtype}_{variant}")
            if step is None:  # it failed (named in the errors)
                continue
            target = ">= 0.60" if variant == "fast" else ""
            row(f"model step {variant} {dtype} (unilm-large 32 x 512) on {gpu['device']}, MFU",
                f"{step['tflops']:.0f} TFLOP/s", f"{peak:.0f} TFLOP/s peak", step["mfu"], target,
                step["mfu"] >= 0.6 if target else None)
        fast, theirs = model.get(f"{dtype}_fast"), model.get(f"{dtype}_transformers")
        if fast and theirs:
            row(f"model step ours (fast paths) vs transformers BertForPreTraining {dtype}, samples/s",
                f"{fast['samples_per_s']:.0f}", f"{theirs['samples_per_s']:.0f}",
                fast["samples_per_s"] / theirs["samples_per_s"], ">= 1.3",
                fast["samples_per_s"] / theirs["samples_per_s"] >= 1.3)
    for precision, by_length in gpu.get("train", {}).items():
        for seq_len, train in by_length.items():
            fast = model.get(f"{precision}_fast")
            train_rows(row, precision, int(seq_len), train, fast["samples_per_s"] if fast else None)
    for precision, by_length in gpu.get("train_unpacked", {}).items():
        for seq_len, unpacked in by_length.items():
            packed = gpu.get("train", {}).get(precision, {}).get(seq_len)
            if packed:
                ratio = packed["samples_per_s"] / unpacked["samples_per_s"]
                row(f"pretrain.train step {precision} x {seq_len}: packed rows vs one sample per row, samples/s",
                    f"{packed['samples_per_s']:.0f}", f"{unpacked['samples_per_s']:.0f}", ratio, "> 1", ratio > 1)
    return rows


def train_rows(row: Callable[..., None], precision: str, seq_len: int, train: dict[str, float],
               model_rate: float | None) -> None:
    """The full training step's rows: at 512 tokens against the model step of its dtype (when it was measured) and
    against 420 samples/s; its MFU as ``metrics.jsonl`` records it."""
    name = f"pretrain.train step {precision} ZeRO-2, batch 330 x {seq_len} tokens"
    if seq_len == 512:
        if model_rate is not None:
            row(f"{name} vs the model step, samples/s", f"{train['samples_per_s']:.0f}", f"{model_rate:.0f}",
                train["samples_per_s"] / model_rate, ">= 0.90", train["samples_per_s"] >= 0.9 * model_rate)
        row(f"{name}, samples/s vs 420", f"{train['samples_per_s']:.0f}", "420",
            train["samples_per_s"] / 420, ">= 1", train["samples_per_s"] >= 420)
    row(f"{name}, MFU (metrics.jsonl)", f"{train['tflops']:.0f} TFLOP/s",
        f"{train['peak_tflops']:.0f} TFLOP/s peak", train["mfu"], "", None)


def render_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| benchmark | measured | reference | ratio | target | |", "|---|---:|---:|---:|---|---|"]
    for r in rows:
        verdict = "" if r["met"] is None else "met" if r["met"] else "NOT met"
        lines.append(f"| {r['benchmark']} | {r['measured']} | {r['reference']} | {r['ratio']:.3g} | {r['target']} "
                     f"| {verdict} |")
    return "\n".join(lines)


def describe(info: dict[str, Any]) -> str:
    gpus = f", GPUs: {', '.join(info['gpus'])}" if info["gpus"] else ", no GPU"
    memory = f"{info['memory_gib']:.0f} GiB" if info.get("memory_gib") else "? GiB"
    return (f"{info['cpu']}, {info['cores']} cores, {memory}{gpus}; torch {info['torch']}, deepspeed "
            f"{info['deepspeed']}, transformers {info['transformers']}, tokenizers {info['tokenizers']}, Python "
            f"{info['python']}; load average at start {info['load_average'][0]:.1f}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m tools.bench_all", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench_out"), help="the reports: results.md, results.json, "
                        "each benchmark's JSON")
    parser.add_argument("--work", type=Path, default=None, help="what the benchmarks build and run: shards, "
                        "training runs and their logs (default: --out)")
    parser.add_argument("--only", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--shards", default="data/shards/unilm-128", help="shards for the training benchmark")
    parser.add_argument("--repeat", type=int, default=3, help="repeats of the data benchmark (best kept)")
    args = parser.parse_args(argv)
    driver_environment()
    args.work = args.work or args.out
    args.out.mkdir(parents=True, exist_ok=True)
    info = machine()
    print(f"[bench] machine: {describe(info)}", flush=True)
    results: dict[str, Any] = {}
    errors: dict[str, str] = {}
    timings: dict[str, float] = {}
    for name in args.only:
        print(f"[bench] {name} ...", flush=True)
        began = time.monotonic()
        try:
            results[name] = RUNNERS[name](args)
        except Exception as error:  # one broken benchmark must not hide the others
            traceback.print_exc()
            errors[name] = f"{type(error).__name__}: {error}"
        for part, message in (results.get(name) or {}).get("errors", {}).items():
            errors[f"{name} {part}"] = message
        timings[name] = time.monotonic() - began
        print(f"[bench] {name}: {timings[name]:.0f} s", flush=True)
    rows = table_rows(results)
    table = render_table(rows)
    report = {"date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": info,
              "machine_description": describe(info), "table": rows, "results": results, "errors": errors,
              "seconds": timings}
    (args.out / "results.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (args.out / "results.md").write_text(f"Measured {report['date_utc']} on {describe(info)}.\n\n{table}\n")
    print(f"\n[bench] {describe(info)}\n\n{table}\n", flush=True)
    for name, message in errors.items():
        print(f"[bench] {name} FAILED: {message.splitlines()[0]}", flush=True)
    skipped = {k: v["skipped"] for k, v in results.items() if isinstance(v, dict) and "skipped" in v}
    for name, why in skipped.items():
        print(f"[bench] {name} skipped: {why}", flush=True)
    print(f"[bench] wrote {args.out / 'results.json'}", flush=True)
    if errors:
        sys.exit(1)
    return report


if __name__ == "__main__":
    main()
