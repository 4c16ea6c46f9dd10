"""Benchmark: beam-search decoding with the incremental key/value cache vs recomputing everything (`--no-cache`).

    python -m tools.bench_decode [--model data/samples/minilm] [--sources 2] [--max-src-len 128]

Decodes real BBC article openings (body → headline sources) with beam 5 and exactly `--tgt-len` (64) target
word pieces (min = max length, so both runs do the same number of steps), once per mode, checks that the
outputs are identical, and reports wall time, the speed ratio (target ≥ 10×) and generated tokens/s (best
hypotheses; × beam for all hypotheses). Default model: the real 6-layer MiniLM BERT from the sample data (its
MLM head is freshly initialised — irrelevant to speed). Results go to `--out` as JSON.

Both modes run on one torch thread by default: a cached step is many small ops, and on a busy 2-core machine
OpenMP spin-waiting made them ~10x slower with 2 threads (measured: 3.2 s → 39 s for the cached run), which
says nothing about the cache. `--threads 0` keeps torch's default.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import tempfile
import time
from pathlib import Path

import torch

from finetune.beam import DecodeConfig, SpecialIds, generate
from finetune.generation import pack_source
from finetune.model_io import load_finetuned
from finetune.task_files import convert_samples, read_jsonl


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m tools.bench_decode", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="data/samples/minilm", help="fine-tuning output or HF BERT directory")
    parser.add_argument("--samples", default="data/samples")
    parser.add_argument("--sources", type=int, default=2, help="articles decoded in one batch")
    parser.add_argument("--max-src-len", type=int, default=128)
    parser.add_argument("--tgt-len", type=int, default=64)
    parser.add_argument("--beam-size", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads for both modes (0: torch's choice)")
    parser.add_argument("--out", default="bench_out/decode.json")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    finetuned = load_finetuned(args.model)
    model, tokenizer = finetuned.model.eval(), finetuned.tokenizer
    with tempfile.TemporaryDirectory() as tmp:
        convert_samples(args.samples, tmp)
        records = read_jsonl(Path(tmp) / "bbc_headline.dev.jsonl")[: args.sources]
    sources = [pack_source(tokenizer, r["src"], args.max_src_len)[0] for r in records]
    special = SpecialIds.of(tokenizer)

    results, outputs = {}, {}
    for mode, use_cache in (("cache", True), ("no_cache", False)):
        config = DecodeConfig(beam_size=args.beam_size, max_tgt_len=args.tgt_len, min_tgt_len=args.tgt_len,
                              use_cache=use_cache)
        began = time.perf_counter()
        hypotheses = generate(model, sources, special, config)
        seconds = time.perf_counter() - began
        outputs[mode] = [h.tokens for h in hypotheses]
        tokens = sum(len(t) for t in outputs[mode])
        results[mode] = {"seconds": seconds, "tokens_per_s": tokens / seconds,
                         "hypothesis_tokens_per_s": tokens * args.beam_size / seconds}
        print(f"[bench-decode] {mode:9s} {seconds:8.2f} s  {tokens / seconds:8.1f} tokens/s "
              f"({tokens * args.beam_size / seconds:.1f} incl. all {args.beam_size} beams)", flush=True)
    identical = outputs["cache"] == outputs["no_cache"]
    ratio = results["no_cache"]["seconds"] / results["cache"]["seconds"]
    report = {
        "model": args.model, "model_config": dataclasses.asdict(model.cfg),
        "sources": len(sources), "source_lengths": [len(s) for s in sources], "target_length": args.tgt_len,
        "beam_size": args.beam_size, "identical_outputs": identical, "speedup": ratio, **results,
        "machine": {"cpu": platform.processor() or platform.machine(), "torch_threads": torch.get_num_threads(),
                    "torch": torch.__version__},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"[bench-decode] identical outputs: {identical}; cache speed-up {ratio:.1f}x (target >= 10x) → {out}")
    if not identical:
        raise SystemExit("cache and no-cache outputs differ")
    return report


if __name__ == "__main__":
    main()
