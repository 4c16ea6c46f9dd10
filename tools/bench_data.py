"""``make bench-data``: shard-build throughput against raw ``tokenizers`` encoding of the same text.

One run, same text for every measurement: the sample corpora (Wikipedia excerpt, Shakespeare, news) are
read once, and
  raw      — ``Tokenizer.encode_batch`` over the documents' sentences in chunk-sized batches, ids read out
             (what any consumer of the tokenizer must do), one thread; also ``encode_batch_fast``, the
             offset-free variant the builder calls, so the cost on top of the builder's own tokenization shows;
  build    — the full ``data_prep.build`` pipeline from a JSONL of the same documents (read, clean, split,
             encode, instances, masking, packing, writing shards + manifest) with 1 and with 2 workers;
  whole    — the same 1-worker build with whole-word masking (``--whole-word-mask``), beside the default one:
             the ratio of their speeds is the cost of masking whole words (goal: within 10 %);
  wiki     — the build straight from the Wikipedia dump (``.xml.bz2``: decompression and XML parsing in the
             main process, markup clean-up and everything after it in the workers) with 1 and with 2 workers,
             measured side by side, so the 1 → 2 worker ratio shows what the workers take over;
  dump     — the excerpt's pages repeated ``--dump-copies`` times into one bigger dump, read side by side:
             CPU seconds per MB of compressed dump of the main process reading it through ``read_pages`` (its
             reader processes counted apart), of the main process of a 2-worker build of it (while it feeds the
             workers, and finalizing after them), and of a worker's per-chunk work (``process_chunk``, timed
             here); the worker's over the feeding main process's is the number of workers one main process can
             feed (goal ≥ 64), and the worker's tokens/s against raw ``encode_batch`` of the same
             sentences, by CPU time, is the dump build's ratio (goal ≥ 0.8; the worker also strips the markup).
Tokens/s counts the same corpus tokens for both, so ratio = raw time / build time (target ≥ 0.8). Each
measurement is repeated (interleaved) and the fastest run kept, because the machine may be shared; the
ratio is also given by CPU time of the process, which other load barely disturbs. Tokenizer threads are
off (``TOKENIZERS_PARALLELISM=false``) so 1 worker compares with 1 core; the 2-worker run shows scaling.
"""
from __future__ import annotations

import argparse
import bz2
import dataclasses
import json
import os
import resource
import tempfile
import time
from pathlib import Path

from data_prep.build import build, build_units, run_builder
from data_prep.chunks import iter_chunks
from data_prep.config import BuildConfig
from data_prep.instances import InstanceConfig, MaskingConfig
from data_prep.output import claim_output, finalize
from data_prep.packing import process_chunk, uses_nsp
from data_prep.sources import ReadOptions, Unit, read_documents
from data_prep.text import clean_document, split_sentences
from data_prep.vocab import load_encoder, load_vocab, train_vocab
from data_prep.wiki_dump import document_text
from data_prep.wiki_units import read_pages

DEFAULT_INPUTS = ["data/samples/wiki/enwiki-excerpt.xml.bz2", "data/samples/books.jsonl", "data/samples/news/lee.txt"]


def _timed(function) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    function()
    return time.perf_counter() - wall, time.process_time() - cpu


def repeated_dump(excerpt: Path, copies: int, out: Path) -> Path:
    """A single-stream ``.xml.bz2`` dump of the excerpt's pages ``copies`` times over (its site info once), so the
    reader has several pieces to share out."""
    with bz2.open(excerpt, "rb") as f:
        xml = f.read()
    first, last = xml.index(b"<page>"), xml.rindex(b"</page>") + len(b"</page>")
    with bz2.open(out, "wb") as f:
        f.write(xml[:first] + xml[first:last] * copies + xml[last:])
    return out


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _timed_build(cfg: BuildConfig, out: Path) -> tuple[float, float]:
    """CPU seconds of this process in a 2-worker build of ``cfg``: (while it feeds the workers: reading, chunking,
    handing chunks out, collecting results; the whole build, finalizing included, which runs once they are done)."""
    start = time.process_time()
    with claim_output(out) as lock:
        run_builder(cfg, out, workers=2, overwrite=True, progress=False, lock=lock)
        feed = time.process_time() - start
        finalize(out, lock)
    return feed, time.process_time() - start


def _margin(cpu: dict, megabytes: float, smaller: Path | None, worker_per_mb: float) -> dict:
    if smaller is None:
        return {}
    per_mb = (cpu["feed_main"] - cpu["feed_smaller"]) / (megabytes - smaller.stat().st_size / 1e6)
    return {"main_feed_margin_cpu_s_per_mb": per_mb, "workers_fed_at_margin": worker_per_mb / per_mb}


def measure_dump(dump: Path, cfg: BuildConfig, work: Path, repeat: int = 1, smaller: Path | None = None) -> dict:
    """CPU seconds per MB of compressed dump: the main process reading it through ``read_pages`` (its readers
    apart), the main process of a 2-worker build of it (reading, chunking, handing chunks out, finalizing), and the
    per-chunk work of a worker (``process_chunk``: clean-up, splitting, encoding, masking, packing), timed in this
    process; hence how many workers one main process feeds. Also the worker's tokens/s against raw
    ``Tokenizer.encode_batch`` of the same sentences (by CPU time). Fastest of ``repeat`` runs of each. With
    ``smaller`` (a dump of fewer copies of the same pages) also the feeding's cost per MB at the margin: the
    difference of the two builds', which leaves out what a build spends once (starting processes, loading the
    vocabulary)."""
    megabytes = dump.stat().st_size / 1e6
    cfg = dataclasses.replace(cfg, inputs=(str(dump),))
    units = build_units(cfg)
    chunks = [chunk for index, (unit, options) in enumerate(units)
              for chunk in iter_chunks(index, unit, options, cfg.chunk_chars,
                                       units[(index + 1) % len(units)] if len(units) > 1 else None, uses_nsp(cfg))]
    batches = [[s for record, _where in chunk.records if isinstance(record, str)
                for s in split_sentences(clean_document(document_text(record)))] for chunk in chunks]
    tokenizer = load_encoder(cfg.vocab_path, cfg.vocab_sha256, cfg.uncased)
    cpu = {name: float("inf") for name in ("read_main", "read_readers", "build_main", "feed_main", "worker", "raw")}
    tokens = raw_tokens = 0
    for _ in range(repeat):
        children, start = _children_cpu(), time.process_time()
        pages = sum(1 for _page in read_pages(dump))
        cpu["read_main"] = min(cpu["read_main"], time.process_time() - start)
        cpu["read_readers"] = min(cpu["read_readers"], _children_cpu() - children)
        feed, whole = _timed_build(cfg, work / "dump2")
        cpu["build_main"], cpu["feed_main"] = min(cpu["build_main"], whole), min(cpu["feed_main"], feed)
        if smaller is not None:
            small_cfg = dataclasses.replace(cfg, inputs=(str(smaller),))
            cpu["feed_smaller"] = min(cpu.get("feed_smaller", float("inf")), _timed_build(small_cfg, work / "dump1")[0])
        start, tokens = time.process_time(), 0
        for chunk in chunks:
            tokens += process_chunk(cfg, chunk, work / "part.bin")[0].wordpieces
        cpu["worker"] = min(cpu["worker"], time.process_time() - start)
        start = time.process_time()
        raw_tokens = sum(len(e.ids) for batch in batches
                         for e in tokenizer.encode_batch(batch, add_special_tokens=False))
        cpu["raw"] = min(cpu["raw"], time.process_time() - start)
    per_mb = {name: seconds / megabytes for name, seconds in cpu.items()}
    worker_rate, raw_rate = tokens / cpu["worker"], raw_tokens / cpu["raw"]
    return {"dump_bytes": dump.stat().st_size, "pages": pages, "chunks": len(chunks), "tokens": tokens,
            "repeat": repeat, "cpu_s": cpu,
            "main_read_cpu_s_per_mb": per_mb["read_main"], "readers_cpu_s_per_mb": per_mb["read_readers"],
            "main_build_cpu_s_per_mb": per_mb["build_main"], "main_feed_cpu_s_per_mb": per_mb["feed_main"],
            "finalize_cpu_s_per_mb": per_mb["build_main"] - per_mb["feed_main"],
            "worker_cpu_s_per_mb": per_mb["worker"],
            "workers_fed_by_read": per_mb["worker"] / per_mb["read_main"],
            "workers_fed": per_mb["worker"] / per_mb["feed_main"], "workers_fed_goal": 64.0,
            "workers_fed_whole_build": per_mb["worker"] / per_mb["build_main"],
            **_margin(cpu, megabytes, smaller, per_mb["worker"]),
            "worker_tokens_per_s": worker_rate, "raw_tokens_per_s": raw_rate,
            "ratio_worker_vs_raw": worker_rate / raw_rate, "ratio_worker_vs_raw_goal": 0.8}


def measure(inputs: list[str] = DEFAULT_INPUTS, vocab: Path | None = None, recipe: str = "unilm",
            max_seq_len: int = 128, chunk_chars: int = 500_000, repeat: int = 3,
            wiki_dump: str | None = DEFAULT_INPUTS[0], dump_copies: int = 4) -> dict:
    """Time raw tokenization and the shard build on the same corpus; returns the measurements (``main`` prints
    them, ``tools.bench_all`` tabulates them)."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # before the first encode: one thread, like one worker

    with tempfile.TemporaryDirectory(prefix="bench_data_") as tmp:
        work = Path(tmp)
        corpus = work / "corpus.jsonl"
        with open(corpus, "w", encoding="utf-8") as f:
            for spec in inputs:
                for record in read_documents(spec):
                    if isinstance(record, str):
                        f.write(json.dumps({"text": record}, ensure_ascii=False) + "\n")
        vocab_path = vocab or work / "vocab.txt"
        if vocab is None:
            train_vocab(lambda: (clean_document(json.loads(line)["text"]) for line in open(corpus, encoding="utf-8")),
                        8000, vocab_path, uncased=False)
        vocab_file = load_vocab(vocab_path)
        tokenizer = load_encoder(str(vocab_path), vocab_file.sha256, False)
        batches = [[s for record, _where in chunk.records if isinstance(record, str)
                    for s in split_sentences(clean_document(record))]
                   for chunk in iter_chunks(0, Unit(str(corpus)), ReadOptions(), chunk_chars)]
        num_tokens = sum(len(encoding.ids) for batch in batches
                         for encoding in tokenizer.encode_batch(batch, add_special_tokens=False))

        def raw() -> None:
            for batch in batches:
                [e.ids for e in tokenizer.encode_batch(batch, add_special_tokens=False)]

        def raw_fast() -> None:  # the call the builder uses: no character offsets
            for batch in batches:
                [e.ids for e in tokenizer.encode_batch_fast(batch, add_special_tokens=False)]

        cfg = BuildConfig(inputs=(str(corpus),), vocab_path=str(vocab_path), vocab_sha256=vocab_file.sha256,
                          instances=InstanceConfig(recipe=recipe, max_seq_len=max_seq_len),
                          chunk_chars=chunk_chars)
        runs = {"raw": raw, "raw_fast": raw_fast,
                "build_1": lambda: build(cfg, work / "shards1", workers=1, overwrite=True, progress=False),
                "build_2": lambda: build(cfg, work / "shards2", workers=2, overwrite=True, progress=False)}
        whole_cfg = dataclasses.replace(cfg, masking=MaskingConfig(whole_word_mask=True))
        if whole_cfg.instances.masked:
            runs["build_whole_word"] = lambda: build(whole_cfg, work / "whole", workers=1, overwrite=True,
                                                     progress=False)
        wiki_cfg = dataclasses.replace(cfg, inputs=(wiki_dump,), chunk_chars=chunk_chars // 4) if wiki_dump else None
        if wiki_cfg:  # smaller chunks: the excerpt is a few MB, and two workers need several chunks to share
            runs["wiki_1"] = lambda: build(wiki_cfg, work / "wiki1", workers=1, overwrite=True, progress=False)
            runs["wiki_2"] = lambda: build(wiki_cfg, work / "wiki2", workers=2, overwrite=True, progress=False)
        times = {name: float("inf") for name in runs}
        cpu = {name: float("inf") for name in runs}
        for _ in range(repeat):  # interleaved, so load from other processes hits all alike
            for name, run in runs.items():
                wall, used = _timed(run)
                times[name], cpu[name] = min(times[name], wall), min(cpu[name], used)
        same = (work / "shards1/shard-00000.bin").read_bytes() == (work / "shards2/shard-00000.bin").read_bytes()
        wiki = {}
        if wiki_cfg and wiki_dump:
            manifest = json.loads((work / "wiki1/manifest.json").read_text())
            wiki = {"wiki_dump": wiki_dump, "wiki_dump_bytes": Path(wiki_dump).stat().st_size,
                    "wiki_articles": manifest["documents"]["read"], "wiki_tokens": manifest["num_tokens"],
                    "wiki_tokens_per_s": {k: manifest["num_tokens"] / times[k] for k in ("wiki_1", "wiki_2")},
                    "wiki_speedup_2_workers": times["wiki_1"] / times["wiki_2"],
                    "wiki_identical_bytes_1_vs_2_workers": (work / "wiki1/shard-00000.bin").read_bytes()
                    == (work / "wiki2/shard-00000.bin").read_bytes()}
            if dump_copies > 0:
                dump = repeated_dump(Path(wiki_dump), dump_copies, work / "dump.xml.bz2")
                wiki["dump"] = measure_dump(dump, cfg, work, repeat,
                                            repeated_dump(Path(wiki_dump), 1, work / "dump-1.xml.bz2"))
    return {"inputs": list(inputs), "num_tokens": num_tokens, "recipe": recipe, "max_seq_len": max_seq_len,
            "repeat": repeat, "wall_s": times, "cpu_s": cpu, "identical_bytes_1_vs_2_workers": same, **wiki,
            "tokens_per_s": {name: num_tokens / seconds for name, seconds in times.items()
                             if not name.startswith("wiki")},
            "ratio_build_vs_raw": times["raw"] / times["build_1"],
            "ratio_build_vs_raw_cpu": cpu["raw"] / cpu["build_1"],
            "ratio_build_vs_raw_fast": times["raw_fast"] / times["build_1"],
            "speedup_2_workers": times["build_1"] / times["build_2"],
            "ratio_whole_word_vs_default": times["build_1"] / times.get("build_whole_word", float("nan")),
            "ratio_whole_word_vs_default_cpu": cpu["build_1"] / cpu.get("build_whole_word", float("nan"))}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tools.bench_data", description=__doc__.split("\n")[0])
    p.add_argument("--input", nargs="+", default=DEFAULT_INPUTS)
    p.add_argument("--vocab", type=Path, help="vocab.txt (default: train a cased 8,000-entry one on the input)")
    p.add_argument("--recipe", default="unilm")
    p.add_argument("--max-seq-len", type=int, default=128)
    p.add_argument("--chunk-chars", type=int, default=500_000)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--dump-copies", type=int, default=4,
                   help="the Wikipedia excerpt's pages this many times over, for the dump reading costs (0: skip)")
    args = p.parse_args(argv)
    result = measure(args.input, args.vocab, args.recipe, args.max_seq_len, args.chunk_chars, args.repeat,
                     dump_copies=args.dump_copies)
    times, cpu, num_tokens, same = result["wall_s"], result["cpu_s"], result["num_tokens"], \
        result["identical_bytes_1_vs_2_workers"]

    raw_rate, build_rate, build2_rate = (num_tokens / times[k] for k in ("raw", "build_1", "build_2"))
    print(f"[bench-data] corpus: {len(args.input)} inputs, {num_tokens:,} tokens, recipe {args.recipe}, "
          f"max_seq_len {args.max_seq_len}, best of {args.repeat}")
    print(f"[bench-data] raw tokenizers encode_batch (1 thread): {raw_rate:12,.0f} tokens/s  ({times['raw']:.2f} s)")
    print(f"[bench-data] raw encode_batch_fast (1 thread):   {num_tokens / times['raw_fast']:12,.0f} tokens/s  "
          f"({times['raw_fast']:.2f} s)")
    print(f"[bench-data] shard build, 1 worker:                  {build_rate:12,.0f} tokens/s  "
          f"({times['build_1']:.2f} s)")
    print(f"[bench-data] shard build, 2 workers:                 {build2_rate:12,.0f} tokens/s  "
          f"({times['build_2']:.2f} s)")
    ratio = build_rate / raw_rate
    print(f"[bench-data] ratio build/raw (1 worker): {ratio:.2f}  "
          f"(target >= 0.80: {'met' if ratio >= 0.8 else 'NOT met'}); "
          f"by CPU time, robust to other load: {cpu['raw'] / cpu['build_1']:.2f}")
    print("[bench-data] ratio build/raw encode_batch_fast (the builder's own call): "
          f"{times['raw_fast'] / times['build_1']:.2f} (CPU time {cpu['raw_fast'] / cpu['build_1']:.2f})")
    print(f"[bench-data] speed-up 1 -> 2 workers: {build2_rate / build_rate:.2f}x  (identical bytes: {same}; "
          f"{os.cpu_count()} CPUs)")
    if "build_whole_word" in times:
        print(f"[bench-data] whole-word masking vs default build (1 worker): speed ratio "
              f"{result['ratio_whole_word_vs_default']:.2f} (CPU time {result['ratio_whole_word_vs_default_cpu']:.2f}; "
              f"goal >= 0.90: {'met' if result['ratio_whole_word_vs_default'] >= 0.9 else 'NOT met'})")
    if "wiki_tokens" in result:
        rates = result["wiki_tokens_per_s"]
        print(f"[bench-data] Wikipedia dump {result['wiki_dump']} ({result['wiki_dump_bytes'] / 1e6:.1f} MB, "
              f"{result['wiki_articles']} pages, {result['wiki_tokens']:,} tokens): 1 worker {rates['wiki_1']:,.0f} "
              f"tokens/s, 2 workers {rates['wiki_2']:,.0f} tokens/s: {result['wiki_speedup_2_workers']:.2f}x "
              f"(identical bytes: {result['wiki_identical_bytes_1_vs_2_workers']})")
    if "dump" in result:
        d = result["dump"]
        print(f"[bench-data] dump ({d['dump_bytes'] / 1e6:.1f} MB) CPU s/MB: main reading "
              f"{d['main_read_cpu_s_per_mb']:.4f} (readers {d['readers_cpu_s_per_mb']:.2f}), main of a 2-worker "
              f"build {d['main_build_cpu_s_per_mb']:.4f} ({d['main_feed_cpu_s_per_mb']:.4f} feeding the workers, "
              f"{d['finalize_cpu_s_per_mb']:.4f} finalizing after them), worker {d['worker_cpu_s_per_mb']:.2f}: one "
              f"main feeds {d['workers_fed']:.0f} workers (goal >= 64; by reading alone "
              f"{d['workers_fed_by_read']:.0f}, counting finalizing too {d['workers_fed_whole_build']:.0f}, at the "
              f"margin {d.get('workers_fed_at_margin', float('nan')):.0f}); "
              f"worker/raw tokens/s {d['ratio_worker_vs_raw']:.2f} (goal >= 0.80)")


if __name__ == "__main__":
    main()
