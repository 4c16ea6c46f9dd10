"""Benchmark decoding: beam search with the incremental key/value cache vs recomputing everything (`--no-cache`),
and `finetune.decode`'s data-parallel ranks: records/s on 1 and 2 CPU ranks over the same inputs.

    python -m tools.bench_decode [--model data/samples/minilm] [--sources 2] [--max-src-len 128] [--ranks 1 2]

Cache: decodes real BBC article openings (body → headline sources) with beam 5 and exactly `--tgt-len` (64) target
word pieces (min = max length, so both runs do the same number of steps), once per mode, checks that the
outputs are identical, and reports wall time, the speed ratio (target ≥ 10×) and generated tokens/s (best
hypotheses; × beam for all hypotheses). Default model: the real 6-layer MiniLM BERT from the sample data (its
MLM head is freshly initialised — irrelevant to speed).

Ranks: `--records` (16) articles in batches of `--batch-size` (4), `--rank-tgt-len` (32) word pieces each, decoded by
`finetune.generation.decode_records` under `torchrun --nproc_per_node N` for each N of `--ranks` (gloo, one torch
thread per rank, each rank a batch per round, rank 0 gathering them in input order); each run times the decode
alone (after the model is loaded), the outputs must be those of the first N, and the report gives records/s per N
and each N's ratio to the first. Results go to `--out` as JSON, and `main` returns them.

Both modes run on one torch thread by default: a cached step is many small ops, and on a busy 2-core machine
OpenMP spin-waiting made them ~10x slower with 2 threads (measured: 3.2 s → 39 s for the cached run), which
says nothing about the cache. `--threads 0` keeps torch's default.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from finetune.beam import DecodeConfig, SpecialIds, generate
from finetune.generation import decode_records, pack_source
from finetune.model_io import load_finetuned
from finetune.task_files import convert_samples, read_jsonl
from pretrain.distributed import close_distributed, init_distributed


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m tools.bench_decode", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="data/samples/minilm", help="fine-tuning output or HF BERT directory")
    parser.add_argument("--samples", default="data/samples")
    parser.add_argument("--sources", type=int, default=2, help="articles decoded in one batch")
    parser.add_argument("--max-src-len", type=int, default=128)
    parser.add_argument("--tgt-len", type=int, default=64)
    parser.add_argument("--beam-size", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads for both modes (0: torch's choice)")
    parser.add_argument("--records", type=int, default=16, help="articles the rank runs decode")
    parser.add_argument("--batch-size", type=int, default=4, help="rank runs: sources decoded together")
    parser.add_argument("--rank-tgt-len", type=int, default=32, help="rank runs: target word pieces per article")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2], help="rank counts compared (CPU, gloo)")
    parser.add_argument("--out", default="bench_out/decode.json")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # one rank run's JSON (under torchrun)
    args = parser.parse_args(argv)
    if args.worker:
        return rank_worker(args)
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
    print(f"[bench-decode] identical outputs: {identical}; cache speed-up {ratio:.1f}x (target >= 10x)", flush=True)
    report["ranks"] = bench_ranks(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"[bench-decode] → {out}")
    if not identical:
        raise SystemExit("cache and no-cache outputs differ")
    if not report["ranks"]["identical_outputs"]:
        raise SystemExit(f"the outputs of {args.ranks} ranks differ")
    return report


def bench_ranks(args: argparse.Namespace) -> dict[str, Any]:
    """Records/s of `decode_records` on each of `args.ranks` CPU ranks (torchrun, one thread each), the same
    inputs and settings, one run after the other; whether every run's predictions are the first's."""
    runs, predictions = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for ranks in args.ranks:
            result = Path(tmp) / f"ranks{ranks}.json"
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
                       "-m", "tools.bench_decode", "--worker", str(result), "--model", args.model, "--samples",
                       args.samples, "--records", str(args.records), "--batch-size", str(args.batch_size),
                       "--max-src-len", str(args.max_src_len), "--rank-tgt-len", str(args.rank_tgt_len),
                       "--beam-size", str(args.beam_size)]
            env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu"))
            subprocess.run(command, env=env, check=True)
            measured = json.loads(result.read_text())
            predictions[ranks] = measured.pop("predictions")
            runs[str(ranks)] = measured
    first = str(args.ranks[0])
    for ranks, run in runs.items():
        run["ratio_to_first"] = run["records_per_s"] / runs[first]["records_per_s"]
        print(f"[bench-decode] {ranks} rank(s): {run['records_per_s']:.2f} records/s ({run['seconds']:.2f} s), "
              f"{run['ratio_to_first']:.2f}x {first} rank(s)", flush=True)
    identical = all(p == predictions[args.ranks[0]] for p in predictions.values())
    return {"records": args.records, "batch_size": args.batch_size, "target_length": args.rank_tgt_len,
            "beam_size": args.beam_size, "identical_outputs": identical, "runs": runs}


def rank_worker(args: argparse.Namespace) -> dict[str, Any]:
    """One rank of a `bench_ranks` run: decode the articles data-parallel; rank 0 writes the time taken and the
    predictions to `args.worker`."""
    rank, world_size = init_distributed()
    torch.set_num_threads(1)
    finetuned = load_finetuned(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        convert_samples(args.samples, tmp)
        records = read_jsonl(Path(tmp) / "bbc_headline.dev.jsonl")[: args.records]
    config = DecodeConfig(beam_size=args.beam_size, max_tgt_len=args.rank_tgt_len, min_tgt_len=args.rank_tgt_len)
    torch.distributed.barrier()  # every rank loaded: the clock times the decoding alone
    began = time.perf_counter()
    decoded = decode_records(finetuned.model.eval(), finetuned.tokenizer, records, config, args.max_src_len,
                             args.batch_size, rank=rank, world_size=world_size)
    seconds = time.perf_counter() - began  # rank 0 has gathered every batch
    result = {"world_size": world_size, "seconds": seconds, "records_per_s": len(records) / seconds,
              "predictions": decoded.predictions}
    if rank == 0:
        Path(args.worker).write_text(json.dumps(result) + "\n")
    close_distributed()
    return result


if __name__ == "__main__":
    main()
