"""`make bench-model`: one training step (forward + backward) of our model vs `transformers.BertForPreTraining`.

Same config (BERT-base size by default), same batch, same masked positions, both in train mode (dropout on),
fp32 on the CPU. Steps of the two models are interleaved and the fastest of each is reported (on a shared
machine other work only ever slows a step down); the matmul peak is sampled before every step and the best
sample kept. Everything is timed twice: wall-clock (the number that matters on a quiet machine) and process CPU
time (robust when other processes share the cores). `measure` returns, `main` prints (and with --json writes):
  - tokens/s of each model and the ratio (target >= 1.3x);
  - useful FLOP/s of each vs the torch matmul peak measured in the same run (target >= 80% for ours). The
    peak is the best of torch's fp32 GEMM backends here (`torch.matmul` = MKL, and oneDNN, which our model's
    linears use on the CPU, and the faster one on the benchmark machine), so using the faster backend raises no one's
    percentage by itself; both backends' peaks are printed.
With --gpu (CUDA), `measure_gpu` instead: UniLM-large 32 x 512 in bf16 and fp16, our model eager, with each fast path
(compiled blocks, chunked loss) and both, vs transformers, as MFU against the dense matmul peak in that dtype.
Useful FLOPs of one step = 6 x encoder-block parameters x tokens (forward 2, backward 4 per multiply-add)
+ attention scores and context (3 x 4 x L^2 x hidden per layer and sample) + 6 x MLM-head and NSP parameters
x predicted tokens (masked positions only; the embedding lookups are not counted). Work a model does beyond
that (e.g. vocabulary logits at unmasked positions) is not useful and lowers its percentage.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import textwrap
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import transformers  # the peer; an optional dependency (extras), which this benchmark needs

from pretrain.data import synthetic_batch as make_batch
from pretrain.hf import hf_config, hf_pretraining_inputs as hf_inputs
from pretrain.kernels import onednn_linear, onednn_linear_available, retain_freed_memory
from pretrain.model import ModelConfig, build_model, preset, training_flops


def useful_flops(cfg: ModelConfig, batch_size: int, seq_len: int, predictions: int) -> float:
    """Useful FLOPs of one forward + backward step of full-length samples (`pretrain.model.training_flops`)."""
    return training_flops(cfg, batch_size * seq_len, batch_size * seq_len**2, batch_size * predictions, batch_size)


class Clock:
    """Wall-clock and process-CPU seconds of a piece of work. On a quiet machine CPU = threads × wall; on a
    shared one the CPU clock stops while other processes hold the cores, so it still sees the work's own cost."""

    def __enter__(self) -> Clock:
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        self.wall, self.cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu


def matmul_peak(seconds: float = 1.5) -> dict[str, tuple[float, float]]:
    """Best fp32 FLOP per wall-second and per CPU-second of plain matrix multiplies over shapes like the model's,
    for each GEMM backend torch has here: `torch.matmul` (MKL on x86) and, when present, oneDNN (the kernel
    our model's `pretrain.kernels.Linear` uses). The peak a model is measured against is the best of them."""
    backends = {"torch.matmul": lambda a, b_t: a @ b_t.t()}
    if onednn_linear_available():
        backends["oneDNN"] = onednn_linear
    peaks = {}
    shapes = [(1024, 768, 3072), (1024, 3072, 768), (2048, 2048, 2048)]
    for name, multiply in backends.items():
        best_wall = best_cpu = 0.0
        for m, k, n in shapes:
            a, b_t = torch.randn(m, k), torch.randn(n, k)
            multiply(a, b_t)  # warm-up
            repeats, deadline = 0, time.perf_counter() + seconds / len(shapes) / len(backends)
            with Clock() as clock:
                while time.perf_counter() < deadline:
                    multiply(a, b_t)
                    repeats += 1
            best_wall = max(best_wall, 2 * m * k * n * repeats / clock.wall)
            best_cpu = max(best_cpu, 2 * m * k * n * repeats / max(clock.cpu, 1e-9))
        peaks[name] = (best_wall, best_cpu)
    return peaks


_PAGE_FAULTS = textwrap.dedent("""
    import resource, sys, torch
    from pretrain.kernels import retain_freed_memory
    if sys.argv[1] == "retain":
        assert retain_freed_memory()
    faults = []
    for _ in range(10):  # like training steps: activations of several sizes, made and freed again
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        blocks = [torch.ones(mib * 2**20 // 4) for mib in (3, 12, 3, 6, 12, 40, 3)]
        del blocks
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(sum(faults[-3:]))  # once the heap has settled
""")


def allocator_page_faults() -> dict[str, int] | None:
    """Minor page faults of three settled rounds of training-like allocations (79 MiB each), with glibc's default
    malloc and with ``pretrain.kernels.retain_freed_memory``, each in a fresh process; None off glibc."""
    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        return None
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    return {mode: int(subprocess.run([sys.executable, "-c", _PAGE_FAULTS, mode], env=env, capture_output=True,
                                     text=True, check=True).stdout.split()[-1])
            for mode in ("default", "retain")}


def measure(preset_name: str = "bert-base", layers: int | None = None, batch_size: int = 8, seq_len: int = 128,
            predictions: int = 20, steps: int = 5, compile_blocks: bool = False) -> dict[str, Any]:
    """Best step times of both models under both clocks, with the matmul peaks they are judged against;
    ``compile_blocks``: our model with `UniLMModel.compile_blocks` (its first step, the compilation, is untimed).

    Returns ``rows`` (``{clock}_{model}`` → step_s, tokens_per_s, useful_gflops, percent_of_peak),
    ``matmul_peak_gflops`` (best backend, per clock), ``matmul_peak_gflops_per_backend``, ``useful_gflop_per_step``
    and ``setup`` (one line saying what ran)."""
    retain_freed_memory()  # as every CPU training process of ours does (both models run in this process)
    transformers.logging.set_verbosity_error()
    cfg = preset(preset_name)
    if layers:
        cfg = dataclasses.replace(cfg, num_layers=layers)
    torch.manual_seed(0)
    ours = build_model(cfg).train()
    if compile_blocks:
        ours.compile_blocks()
    theirs = transformers.BertForPreTraining(transformers.BertConfig(**hf_config(cfg))).train()
    batch = make_batch(cfg, batch_size, seq_len, predictions)
    their_batch = hf_inputs(batch)

    def our_step() -> None:
        ours(**batch).loss.backward()
        ours.zero_grad(set_to_none=True)

    def their_step() -> None:
        theirs(**their_batch).loss.backward()
        theirs.zero_grad(set_to_none=True)

    setup = (f"{preset_name} ({cfg.num_layers} layers, hidden {cfg.hidden_size}), batch {batch_size} x seq {seq_len}, "
             f"{predictions} masked positions/sample, fp32{', ours compiled' if compile_blocks else ''}, "
             f"{torch.get_num_threads()} threads, transformers "
             f"{transformers.__version__} attention={theirs.config._attn_implementation}")
    backend_peaks: dict[str, dict[str, float]] = {}
    times: dict[str, dict[str, list[float]]] = {name: {"wall": [], "cpu": []} for name in ("ours", "transformers")}
    for step in range(steps + 1):  # step 0 warms up both
        for name, run in (("ours", our_step), ("transformers", their_step)):
            # the peak is sampled next to every step, so a quiet moment is caught by both
            for backend, (wall, cpu) in matmul_peak().items():
                best = backend_peaks.setdefault(backend, {"wall": 0.0, "cpu": 0.0})
                backend_peaks[backend] = {"wall": max(best["wall"], wall), "cpu": max(best["cpu"], cpu)}
            with Clock() as clock:
                run()
            if step:
                times[name]["wall"].append(clock.wall)
                times[name]["cpu"].append(clock.cpu)

    flops = useful_flops(cfg, batch_size, seq_len, predictions)
    tokens = batch_size * seq_len
    peak = {clock: max(p[clock] for p in backend_peaks.values()) for clock in ("wall", "cpu")}
    rows = {}
    for clock_name in ("wall", "cpu"):
        for name, values in times.items():
            seconds = min(values[clock_name])
            rows[f"{clock_name}_{name}"] = {"step_s": seconds, "tokens_per_s": tokens / seconds,
                                            "useful_gflops": flops / seconds / 1e9,
                                            "percent_of_peak": 100 * flops / seconds / peak[clock_name]}
    return {"rows": rows, "matmul_peak_gflops": {clock: peak[clock] / 1e9 for clock in ("wall", "cpu")},
            "matmul_peak_gflops_per_backend": {name: {clock: p[clock] / 1e9 for clock in ("wall", "cpu")}
                                               for name, p in backend_peaks.items()},
            "useful_gflop_per_step": flops / 1e9, "setup": setup}


GPU_VARIANTS = {"eager": (False, False), "chunked_loss": (False, True), "compiled": (True, False),
                "fast": (True, True), "transformers": None}
"""On the GPU: our model as it is, with each fast path (train.compile, train.chunked_loss) and with both; and
transformers.BertForPreTraining (sdpa attention, logits at every position as its loss needs)."""


def measure_gpu(preset_name: str = "unilm-large", batch_size: int = 32, seq_len: int = 512, predictions: int = 77,
                steps: int = 10, dtypes: tuple[str, ...] = ("bf16", "fp16"),
                device: str | torch.device = "cuda", variants: tuple[str, ...] = tuple(GPU_VARIANTS)) -> dict[str, Any]:
    """On CUDA, one forward + backward (dropout on, weights in the dtype as under DeepSpeed's bf16/fp16, no
    optimizer) of each of ``variants`` (`GPU_VARIANTS` entries, in that order) in each dtype, on one batch; mean over
    ``steps`` after 3 warm-up steps (compilation happens there). Returns ``peak_tflops`` per dtype
    (`pretrain.accelerator.matmul_peak_tflops`, 1 s) and ``rows`` ``{dtype}_{variant}`` → step_s, samples_per_s,
    tflops (useful FLOPs), mfu; a variant that fails (a compiler error, out of memory) is left out of ``rows`` and
    named in ``errors``."""
    from pretrain.accelerator import matmul_peak_tflops

    transformers.logging.set_verbosity_error()
    device = torch.device(device)
    cfg = preset(preset_name)
    cpu_batch = make_batch(cfg, batch_size, seq_len, predictions)
    inputs = {"ours": {k: v.to(device) for k, v in cpu_batch.items()},
              "transformers": {k: v.to(device) for k, v in hf_inputs(cpu_batch).items()}}
    flops = useful_flops(cfg, batch_size, seq_len, predictions)
    result: dict[str, Any] = {"setup": f"{preset_name}, batch {batch_size} x seq {seq_len}, {predictions} masked "
                                       f"positions/sample, dropout on, {_device_name(device)}, torch "
                                       f"{torch.__version__}, transformers {transformers.__version__}",
                              "useful_tflop_per_step": flops / 1e12, "peak_tflops": {}, "rows": {}}
    for dtype_name in dtypes:
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
        peak = result["peak_tflops"][dtype_name] = matmul_peak_tflops(device, dtype, seconds=1.0)
        for variant in variants:
            switches = GPU_VARIANTS[variant]
            try:
                seconds = _step_seconds(cfg, switches, inputs, device, dtype, steps)
            except Exception as error:  # e.g. a compiler failure: the other variants are still measured
                traceback.print_exc()
                result.setdefault("errors", {})[f"{dtype_name}_{variant}"] = f"{type(error).__name__}: {error}"
                continue
            finally:
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            tflops = flops / seconds / 1e12
            result["rows"][f"{dtype_name}_{variant}"] = {"step_s": seconds, "samples_per_s": batch_size / seconds,
                                                         "tflops": tflops, "mfu": tflops / peak}
    return result


def _step_seconds(cfg: ModelConfig, switches: tuple[bool, bool] | None, inputs: dict[str, dict[str, torch.Tensor]],
                  device: torch.device, dtype: torch.dtype, steps: int) -> float:
    """Seconds per forward + backward of one `GPU_VARIANTS` entry (``switches`` None: transformers), the mean over
    ``steps`` after 3 warm-up steps."""
    from pretrain.accelerator import synchronize

    torch.manual_seed(0)
    if switches is None:
        model = transformers.BertForPreTraining(transformers.BertConfig(**hf_config(cfg), attn_implementation="sdpa"))
        batch = inputs["transformers"]
    else:
        model = build_model(cfg)
        if switches[0]:
            model.compile_blocks()
        model.chunked_loss = switches[1]
        batch = inputs["ours"]
    model = model.to(device, dtype).train()

    def step() -> None:
        model(**batch).loss.backward()
        model.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    synchronize(device)
    began = time.perf_counter()
    for _ in range(steps):
        step()
    synchronize(device)
    return (time.perf_counter() - began) / steps


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def report_gpu(result: dict[str, Any]) -> str:
    """The GPU measurement as text: one line per dtype and variant, then the model-step targets."""
    lines = [f"[bench-model] {result['setup']}; useful work per step {result['useful_tflop_per_step']:.2f} TFLOP",
             f"{'row':<24}{'step s':>9}{'samples/s':>11}{'TFLOP/s':>9}{'MFU':>8}"]
    for name, row in result["rows"].items():
        lines.append(f"{name:<24}{row['step_s']:>9.4f}{row['samples_per_s']:>11.1f}{row['tflops']:>9.1f}"
                     f"{100 * row['mfu']:>7.1f}%")
    for dtype, peak in result["peak_tflops"].items():
        fast, theirs = result["rows"].get(f"{dtype}_fast"), result["rows"].get(f"{dtype}_transformers")
        if fast and theirs:
            lines.append(f"{dtype}: matmul peak {peak:.0f} TFLOP/s; ours (fast paths) MFU {100 * fast['mfu']:.1f}% "
                         f"(target >= 60%), {theirs['step_s'] / fast['step_s']:.2f}x transformers (target >= 1.3x)")
    lines += [f"{name} FAILED: {error}" for name, error in result.get("errors", {}).items()]
    return "\n".join(lines)


def report(result: dict[str, Any]) -> str:
    """The measurement as text: the per-backend peaks, a table per clock, and the verdict on both targets."""
    rows, peak, backends = result["rows"], result["matmul_peak_gflops"], result["matmul_peak_gflops_per_backend"]
    lines = [f"[bench-model] {result['setup']}",
             "fp32 GEMM peak per backend: " + "; ".join(
                 f"{name} {p['wall']:.1f} GFLOP per wall-second, {p['cpu']:.1f} per CPU-second"
                 for name, p in backends.items()),
             f"useful work per step: {result['useful_gflop_per_step']:.1f} GFLOP; torch fp32 matmul peak: "
             f"{peak['wall']:.1f} GFLOP per wall-second, {peak['cpu']:.1f} GFLOP per CPU-second (best backend)",
             f"{'clock':<6}{'model':<14}{'step s (best)':>15}{'tokens/s':>10}{'useful GFLOP/s':>16}{'% of peak':>11}"]
    verdicts = []
    for clock_name in ("wall", "cpu"):
        for name in ("ours", "transformers"):
            row = rows[f"{clock_name}_{name}"]
            lines.append(f"{clock_name:<6}{name:<14}{row['step_s']:>15.3f}{row['tokens_per_s']:>10.0f}"
                         f"{row['useful_gflops']:>16.1f}{row['percent_of_peak']:>10.1f}%")
        ours, theirs = rows[f"{clock_name}_ours"], rows[f"{clock_name}_transformers"]
        ratio = theirs["step_s"] / ours["step_s"]
        utilisation = ours["percent_of_peak"] / 100
        mkl = backends["torch.matmul"][clock_name]
        verdicts.append(f"{clock_name:<5} tokens/s ours / transformers {ratio:.2f}x (target >= 1.3x: "
                        f"{'met' if ratio >= 1.3 else 'NOT met'}); ours useful FLOP/s = {100 * utilisation:.1f}% "
                        f"of the best matmul peak (target >= 80%: {'met' if utilisation >= 0.8 else 'NOT met'}), "
                        f"{100 * ours['useful_gflops'] / mkl:.0f}% of torch.matmul's own; transformers "
                        f"{theirs['percent_of_peak']:.0f}% ({100 * theirs['useful_gflops'] / mkl:.0f}%)")
    return "\n".join(lines + verdicts)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m tools.bench_model", description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", action="store_true",
                        help="on CUDA: bf16 and fp16, ours eager / with each fast path / both vs transformers "
                             "(`measure_gpu`; defaults then unilm-large, batch 32 x 512, 77 masked positions, "
                             "10 steps)")
    parser.add_argument("--preset", default=None, help="model preset (default: bert-base; --gpu: unilm-large)")
    parser.add_argument("--layers", type=int, default=None, help="override the number of layers (faster run)")
    parser.add_argument("--batch-size", type=int, default=None, help="default 8; --gpu: 32")
    parser.add_argument("--seq-len", type=int, default=None, help="default 128; --gpu: 512")
    parser.add_argument("--predictions", type=int, default=None,
                        help="masked positions per sample (default 20, 15%% of 128; --gpu: 77)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per model (default 5; --gpu: 10)")
    parser.add_argument("--dtypes", nargs="+", choices=("bf16", "fp16"), default=None,
                        help="--gpu: the dtypes measured (default both)")
    parser.add_argument("--variants", nargs="+", choices=tuple(GPU_VARIANTS), default=None,
                        help="--gpu: the variants measured, in this order (default all)")
    parser.add_argument("--compile", action="store_true", help="compile our model's blocks (train.compile)")
    parser.add_argument("--json", type=Path, default=None, help="also write the measurement to this JSON file")
    args = parser.parse_args(argv)
    chosen = {name: value for name, value in (("preset_name", args.preset), ("batch_size", args.batch_size),
                                              ("seq_len", args.seq_len), ("predictions", args.predictions),
                                              ("steps", args.steps)) if value is not None}
    if args.gpu:
        subsets: dict[str, Any] = {name: tuple(value) for name, value in (("dtypes", args.dtypes),
                                                                          ("variants", args.variants)) if value}
        result = measure_gpu(**chosen, **subsets)
        print(report_gpu(result))
        _write_json(args.json, result)
        return result
    result = measure(layers=args.layers, compile_blocks=args.compile, **chosen)
    result["allocator_page_faults"] = allocator_page_faults()
    print(report(result))
    if result["allocator_page_faults"]:
        faults = result["allocator_page_faults"]
        print(f"[bench-model] minor page faults over 3 rounds of 79 MiB of allocations: glibc default "
              f"{faults['default']}, retained freed memory {faults['retain']} ({3 * 79 * 2**20 // 4096} pages)")
    _write_json(args.json, result)
    return result


def _write_json(path: Path | None, result: dict[str, Any]) -> None:
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
