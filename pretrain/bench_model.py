"""`make bench-model`: one training step (forward + backward) of our model vs `transformers.BertForPreTraining`.

Same config (BERT-base size by default), same batch, same masked positions, both in train mode (dropout on),
fp32 on the CPU. Steps of the two models are interleaved and the fastest of each is reported (on a shared
machine other work only ever slows a step down); the matmul peak is sampled before every step and the best
sample kept. Everything is timed twice: wall-clock (the number that matters on a quiet machine) and process CPU
time (robust when other processes share the cores). Prints:
  - tokens/s of each model and the ratio (target >= 1.3x);
  - useful FLOP/s of each vs the torch matmul peak measured in the same run (target >= 80% for ours). The
    peak is the best of torch's fp32 GEMM backends here (`torch.matmul` = MKL, and oneDNN, which our model's
    linears use on the CPU, and the faster one on the benchmark machine), so using the faster backend raises no one's
    percentage by itself; both backends' peaks are printed.
Useful FLOPs of one step = 6 x encoder-block parameters x tokens (forward 2, backward 4 per multiply-add)
+ attention scores and context (3 x 4 x L^2 x hidden per layer and sample) + 6 x MLM-head and NSP parameters
x predicted tokens (masked positions only; the embedding lookups are not counted). Work a model does beyond
that (e.g. vocabulary logits at unmasked positions) is not useful and lowers its percentage.
"""
from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from pretrain.hf import hf_config
from pretrain.masks import BIDIRECTIONAL
from pretrain.model import ModelConfig, build_model, preset


def make_batch(cfg: ModelConfig, batch_size: int, seq_len: int, predictions: int, seed: int = 0) -> dict:
    """A full-length bidirectional batch with `predictions` masked positions per sample and NSP labels."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1000, cfg.vocab_size, (batch_size, seq_len), generator=g)
    masked_positions = torch.stack([torch.randperm(seq_len - 2, generator=g)[:predictions].sort().values + 1
                                    for _ in range(batch_size)])
    return dict(
        input_ids=input_ids,
        objective=torch.full((batch_size,), BIDIRECTIONAL),
        len_a=torch.full((batch_size,), seq_len // 2),
        length=torch.full((batch_size,), seq_len),
        is_random_next=torch.randint(0, 2, (batch_size,), generator=g),
        masked_positions=masked_positions,
        masked_labels=torch.randint(1000, cfg.vocab_size, (batch_size, predictions), generator=g),
    )


def hf_inputs(batch: dict) -> dict:
    """The same batch in BertForPreTraining's terms (dense labels, key-padding mask, token types)."""
    batch_size, seq_len = batch["input_ids"].shape
    labels = torch.full_like(batch["input_ids"], -100).scatter(1, batch["masked_positions"], batch["masked_labels"])
    token_type_ids = (torch.arange(seq_len) >= batch["len_a"].unsqueeze(1)).long()
    return dict(input_ids=batch["input_ids"], token_type_ids=token_type_ids,
                attention_mask=torch.ones(batch_size, seq_len, dtype=torch.long), labels=labels,
                next_sentence_label=batch["is_random_next"])


def useful_flops(cfg: ModelConfig, batch_size: int, seq_len: int, predictions: int) -> float:
    """Useful FLOPs of one forward + backward step (see the module docstring)."""
    hidden, ffn = cfg.hidden_size, cfg.intermediate_size
    block_parameters = 4 * hidden * hidden + 2 * hidden * ffn  # the matmul weights of one block
    tokens = batch_size * seq_len
    encoder = 6 * cfg.num_layers * block_parameters * tokens
    attention = 3 * cfg.num_layers * 4 * seq_len * seq_len * hidden * batch_size
    head = 6 * (hidden * hidden + hidden * cfg.vocab_size) * batch_size * predictions
    nsp = 6 * (hidden * hidden + 2 * hidden) * batch_size
    return float(encoder + attention + head + nsp)


class Clock:
    """Wall-clock and process-CPU seconds of a piece of work. On a quiet machine CPU = threads × wall; on a
    shared one the CPU clock stops while other processes hold the cores, so it still sees the work's own cost."""

    def __enter__(self) -> "Clock":
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        self.wall, self.cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu


def matmul_peak(seconds: float = 1.5) -> dict[str, tuple[float, float]]:
    """Best fp32 FLOP per wall-second and per CPU-second of plain matrix multiplies over shapes like the model's,
    for each GEMM backend torch has here: `torch.matmul` (MKL on x86) and, when present, oneDNN (the kernel
    our model's `pretrain.kernels.Linear` uses). The peak a model is measured against is the best of them."""
    from pretrain.kernels import onednn_linear, onednn_linear_available

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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="bert-base", help="model preset (default: bert-base)")
    parser.add_argument("--layers", type=int, default=None, help="override the number of layers (faster run)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--predictions", type=int, default=20, help="masked positions per sample (15%% of 128)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per model, after one warm-up step")
    args = parser.parse_args(argv)

    import transformers  # the peer; an optional dependency (extras)

    from pretrain.kernels import retain_freed_memory

    retain_freed_memory()  # as every CPU training process of ours does (both models run in this process)

    transformers.logging.set_verbosity_error()
    cfg = preset(args.preset)
    if args.layers:
        cfg = dataclasses.replace(cfg, num_layers=args.layers)
    torch.manual_seed(0)
    ours = build_model(cfg).train()
    theirs = transformers.BertForPreTraining(transformers.BertConfig(**hf_config(cfg))).train()
    batch = make_batch(cfg, args.batch_size, args.seq_len, args.predictions)
    their_batch = hf_inputs(batch)

    def our_step() -> None:
        ours(**batch).loss.backward()
        ours.zero_grad(set_to_none=True)

    def their_step() -> None:
        theirs(**their_batch).loss.backward()
        theirs.zero_grad(set_to_none=True)

    print(f"[bench-model] {args.preset} ({cfg.num_layers} layers, hidden {cfg.hidden_size}), batch {args.batch_size}"
          f" x seq {args.seq_len}, {args.predictions} masked positions/sample, fp32, {torch.get_num_threads()} threads,"
          f" transformers {transformers.__version__} attention={theirs.config._attn_implementation}")
    backend_peaks: dict[str, dict[str, float]] = {}
    times: dict[str, dict[str, list[float]]] = {name: {"wall": [], "cpu": []} for name in ("ours", "transformers")}
    for step in range(args.steps + 1):  # step 0 warms up both
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

    flops = useful_flops(cfg, args.batch_size, args.seq_len, args.predictions)
    tokens = args.batch_size * args.seq_len
    peak = {clock: max(p[clock] for p in backend_peaks.values()) for clock in ("wall", "cpu")}
    print("fp32 GEMM peak per backend: " + "; ".join(
        f"{name} {p['wall'] / 1e9:.1f} GFLOP per wall-second, {p['cpu'] / 1e9:.1f} per CPU-second"
        for name, p in backend_peaks.items()))
    print(f"useful work per step: {flops / 1e9:.1f} GFLOP; torch fp32 matmul peak: {peak['wall'] / 1e9:.1f} GFLOP "
          f"per wall-second, {peak['cpu'] / 1e9:.1f} GFLOP per CPU-second (best backend)")
    print(f"{'clock':<6}{'model':<14}{'step s (best)':>15}{'tokens/s':>10}{'useful GFLOP/s':>16}{'% of peak':>11}")
    verdicts = []
    for clock_name in ("wall", "cpu"):
        best = {name: min(values[clock_name]) for name, values in times.items()}
        for name, seconds in best.items():
            print(f"{clock_name:<6}{name:<14}{seconds:>15.3f}{tokens / seconds:>10.0f}{flops / seconds / 1e9:>16.1f}"
                  f"{100 * flops / seconds / peak[clock_name]:>10.1f}%")
        ratio = best["transformers"] / best["ours"]
        utilisation = flops / best["ours"] / peak[clock_name]
        mkl = backend_peaks["torch.matmul"][clock_name]
        verdicts.append(f"{clock_name:<5} tokens/s ours / transformers {ratio:.2f}x (target >= 1.3x: "
                        f"{'met' if ratio >= 1.3 else 'NOT met'}); ours useful FLOP/s = {100 * utilisation:.1f}% "
                        f"of the best matmul peak (target >= 80%: {'met' if utilisation >= 0.8 else 'NOT met'}), "
                        f"{100 * flops / best['ours'] / mkl:.0f}% of torch.matmul's own; transformers "
                        f"{100 * flops / best['transformers'] / peak[clock_name]:.0f}% "
                        f"({100 * flops / best['transformers'] / mkl:.0f}%)")
    print("\n".join(verdicts))

if __name__ == "__main__":
    main()
