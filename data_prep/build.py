"""Build packed training shards from raw corpora: ``python -m data_prep.build --input ... --out DIR``.

Pipeline: every ``--input`` is split into units (a file, or a shard of a Hugging Face dataset:
``data_prep.sources.input_units``); each unit's documents are streamed and grouped into chunks of about
``chunk_chars`` characters (``data_prep.chunks``: a chunk boundary depends only on the input, never on workers).
In a worker process each chunk becomes a part file in the shard format (``data_prep.packing``); ``finalize``
(``data_prep.output``) joins the parts in (unit, chunk) order into balanced shards and writes ``manifest.json``
last. Hence the output is byte-identical for any ``--workers`` and any ``--num-builders`` split: builder i of K
reads only units i, i+K, …, and ``--finalize`` (run once after all builders) assembles the shards. Memory is
bounded by a few chunks. The build is assembled beside ``--out`` and renamed into place when complete, under a
lock on ``--out`` (``data_prep.output``).

Settings (``data_prep.config.BuildSettings``) come from the dataclass defaults, then ``--config YAML``, then the
flags given (each an alias of its key: ``--max-seq-len`` is ``instances.max_seq_len``), then ``--set KEY=VALUE``
overrides; ``--help`` lists every key.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import logging
import multiprocessing
import multiprocessing.pool
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict
from pathlib import Path

import yaml
from tqdm import tqdm

from common import signals
from common.config_loader import add_field_flags, config_error, given_fields, keys_help
from data_prep.chunks import Chunk, iter_chunks
from data_prep.config import BuildConfig, BuildSettings, load_settings
from data_prep.inputs import ALL_FILES, SUPPORTED, check_input, directory_files, folder_split, is_plain_folder
from data_prep.instances import RECIPES, InstanceConfig, MaskingConfig, default_max_predictions, parse_objective_mix
from data_prep.output import (
    PARTS_DIR,
    OutputLock,
    builder_path,
    check_build_output,
    claim_output,
    finalize,
    holding,
    part_path,
    prepare_staging,
    staging_dir,
)
from data_prep.packing import process_chunk, uses_nsp
from data_prep.report import DocumentStats, nothing_kept, random_next_warning, skip_warning, unk_warning
from data_prep.shard_format import VOCAB_NAME, write_json
from data_prep.sources import (
    ROWS_PER_DOCUMENT,
    TEXT_FIELD,
    TXT_DOCUMENTS,
    ReadOptions,
    Skipped,
    SourceError,
    Unit,
    input_units,
    read_documents,
)
from data_prep.text import clean_document, sentence_boundaries
from data_prep.vocab import HF_TOKENIZER_CONFIG, load_vocab, resolve_casing, resolve_vocab_source, train_vocab
from data_prep.wiki_dump import SpilledPage

log = logging.getLogger(__name__)


def build_units(cfg: BuildConfig) -> list[tuple[Unit, ReadOptions]]:
    """Every unit of every input, in input order, with the way its records become documents. A file reached
    twice (given twice, or also through its directory) is read once, where it comes first; that, and the files
    of a directory input that are not read, are warned about (logged)."""
    units: list[tuple[Unit, ReadOptions]] = []
    first_spec: dict[tuple, str] = {}
    for spec in cfg.inputs:
        if is_plain_folder(spec):
            _warn_left_out(spec)
        twice: list[Unit] = []
        earlier: set[str] = set()
        for unit in input_units(spec, cfg.unit_bytes, cfg.txt_documents):
            path = Path(unit.spec)
            key = (os.path.realpath(path) if path.is_file() else unit.spec, unit.shard, unit.start, unit.stop)
            if key in first_spec:
                twice.append(unit)
                earlier.add(first_spec[key])
                continue
            first_spec[key] = spec
            units.append((unit, cfg.read_options(spec)))
        if twice:
            names = ", ".join(str(u) for u in twice[:5]) + (", …" if len(twice) > 5 else "")
            log.warning(f"[build] warning: --input {spec}: {len(twice)} unit(s) come also from --input "
                        f"{' '.join(sorted(earlier))} and are read once, from there: {names}")
    return units


def _warn_left_out(spec: str) -> None:
    """Name (logged) the files of a directory input that are not read: other types, other splits."""
    folder, split = folder_split(spec)
    listed = directory_files(folder, split)

    def names(files: list[Path]) -> str:
        return ", ".join(str(p.relative_to(folder)) for p in files[:5]) + (", …" if len(files) > 5 else "")

    if listed.other_types:
        log.warning(f"[build] warning: --input {spec}: {len(listed.other_types)} file(s) of other types are not "
                    f"read: {names(listed.other_types)} (read here: {SUPPORTED}; convert a file to one of them to "
                    "include it)")
    if listed.split:
        left = "; ".join(f"{f'split {name}' if name else 'no split named'}: {names(files)}"
                         for name, files in listed.other_splits.items())
        log.info(f"[build] --input {spec}: the file names here name splits, as Hugging Face datasets reads them; "
                 f"reading split {listed.split} ({len(listed.read)} file(s): {names(listed.read)})"
                 + (f". Not read: {left}" if left else "")
                 + f". Name another split as {folder}::SPLIT, or read every file as {folder}::{ALL_FILES}")



def _start_worker() -> None:
    # worker processes already give the parallelism; tokenizers' own thread pool would oversubscribe the cores
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    # a Ctrl-C reaches the whole process group: the main process stops the pool (SIGTERM, which ends a worker
    # quietly) instead of each worker printing its own traceback
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _process_chunk_task(cfg: BuildConfig, chunk: Chunk, out_path: Path) -> tuple[int, int, DocumentStats, int]:
    stats, samples = process_chunk(cfg, chunk, out_path)
    return chunk.index, len(chunk.records), stats, samples


class _SpillFiles:
    """The files a Wikipedia dump's reader processes write articles to (``data_prep.wiki_units.spill_piece``), so
    the main process hands workers where a page is rather than its text: each file is deleted once the chunks
    that read from it are done and no later chunk can (they come in file order), the folder at the end."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.pending: collections.Counter = collections.Counter()  # file -> chunks handed out, not done
        self.order: dict[str, int] = {}  # file -> its place in reading order
        self.open_from = 0  # files from this place on may still be read by a later chunk

    @staticmethod
    def files(chunk: Chunk) -> list[str]:
        return list(dict.fromkeys(r.text.path for r, _ in chunk.records if isinstance(r, SpilledPage)))

    def handed_out(self, chunk: Chunk) -> None:
        files = self.files(chunk)
        for name in files:
            self.pending[name] += 1
            self.order.setdefault(name, len(self.order))
        if files:
            self.open_from = self.order[files[-1]]

    def done(self, chunk: Chunk) -> None:
        for name in self.files(chunk):
            self.pending[name] -= 1
        for name in [n for n, count in self.pending.items() if count == 0 and self.order[n] < self.open_from]:
            os.remove(name)
            del self.pending[name], self.order[name]



def run_builder(cfg: BuildConfig, out: Path, workers: int = 1, builder_index: int = 0, num_builders: int = 1,
                overwrite: bool = False, progress: bool = True, lock: OutputLock | None = None) -> DocumentStats:
    """Process this builder's units (unit % num_builders == builder_index) into part files beside ``out``,
    holding ``lock`` (taken here when None: exclusive for one builder, shared for a split build's)."""
    if not 0 <= builder_index < num_builders:
        raise ValueError(f"--builder-index {builder_index} must be in [0, --num-builders {num_builders})")
    with holding(out, lock, builder_index, num_builders):
        return _run_builder(cfg, out, workers, builder_index, num_builders, overwrite, progress)


def _run_builder(cfg: BuildConfig, out: Path, workers: int, builder_index: int, num_builders: int,
                 overwrite: bool, progress: bool) -> DocumentStats:
    vocab = load_vocab(cfg.vocab_path)
    check_build_output(out, vocab, overwrite)
    units = build_units(cfg)  # opens every input: a mistyped one fails here, before any work
    staging = staging_dir(out)
    prepare_staging(staging, cfg, num_builders)
    if vocab.path.absolute() != (staging / VOCAB_NAME).absolute():
        copy = staging / f"{VOCAB_NAME}.tmp{builder_index}"  # every builder writes the same bytes, atomically
        shutil.copyfile(vocab.path, copy)
        os.replace(copy, staging / VOCAB_NAME)
    stats = DocumentStats()
    unit_chunks: dict[int, int] = {}
    total_samples = 0
    bar = tqdm(desc=f"building {out.name}", unit="doc", disable=not progress, file=sys.stderr)

    def collect(result: tuple[int, int, DocumentStats, int]) -> None:
        nonlocal total_samples
        _, records, chunk_stats, samples = result
        stats.add(chunk_stats)
        total_samples += samples
        bar.update(records)
        bar.set_postfix(samples=total_samples, skipped=stats.skipped)

    def chunks(spill: str | None) -> Iterator[Chunk]:
        for unit_index, (unit, options) in enumerate(units):
            if unit_index % num_builders == builder_index:  # other builders' units are read only for NSP donors
                elsewhere = units[(unit_index + 1) % len(units)] if len(units) > 1 else None
                for chunk in iter_chunks(unit_index, unit, options, cfg.chunk_chars, elsewhere, uses_nsp(cfg),
                                         spill):
                    unit_chunks[unit_index] = chunk.index + 1
                    yield chunk

    if workers <= 1:
        for chunk in chunks(None):
            collect(_process_chunk_task(cfg, chunk, part_path(staging, chunk.unit, chunk.index)))
    else:
        spill = _SpillFiles(Path(tempfile.mkdtemp(prefix=f".pages-{builder_index}-", dir=staging / PARTS_DIR)))
        try:
            _run_pool(cfg, workers, chunks(str(spill.folder)), staging, collect, spill)
        finally:
            shutil.rmtree(spill.folder, ignore_errors=True)
    bar.close()
    write_json(builder_path(staging, builder_index, num_builders), {
        "fingerprint": cfg.fingerprint, "config": cfg.to_json(), "builder_index": builder_index,
        "num_builders": num_builders, "num_units": len(units),
        "unit_chunks": {str(u): n for u, n in sorted(unit_chunks.items())}, "documents": asdict(stats)})
    return stats




class _Pool(multiprocessing.pool.Pool):
    """multiprocessing's pool, whose worker handler thread wakes when a worker exits or the pool changes, not at
    every result: woken by a result, it spins until the result thread has read it (~1 ms of the main process's
    CPU per chunk, a third of what it spends feeding the workers of a dump build). Workers never retire on their
    own here (no ``maxtasksperchild``), which is what waking at results serves."""

    def _get_sentinels(self) -> list:
        return [self._change_notifier._reader]  # type: ignore[attr-defined]


def _run_pool(cfg: BuildConfig, workers: int, chunks: Iterator[Chunk], staging: Path,
              collect: Callable[[tuple[int, int, DocumentStats, int]], None], spill: _SpillFiles) -> None:
    """Process ``chunks`` in ``workers`` processes, a few chunks ahead of the results, collected in order."""
    # fork starts workers in milliseconds (spawn re-imports numpy and tokenizers: ~1 s); workers only run
    # process_chunk, and tokenizers disables its thread pool in a forked child by itself
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    sentence_boundaries()  # built once here and inherited by the forked workers
    with _Pool(workers, initializer=_start_worker, context=multiprocessing.get_context(method)) as pool:
        pending: collections.deque = collections.deque()

        def collect_next() -> None:
            chunk, result = pending.popleft()
            collect(result.get())
            spill.done(chunk)

        for chunk in chunks:
            spill.handed_out(chunk)
            pending.append((chunk, pool.apply_async(_process_chunk_task,
                                                    (cfg, chunk, part_path(staging, chunk.unit, chunk.index)))))
            while len(pending) > 2 * workers:  # bounded memory: never queue the whole corpus
                collect_next()
        while pending:
            collect_next()


def build(cfg: BuildConfig, out: Path, workers: int = 1, overwrite: bool = False, progress: bool = True) -> dict:
    """Single-machine build: one builder, then finalize, under one exclusive lock. Returns the manifest."""
    with claim_output(out) as lock:
        run_builder(cfg, out, workers=workers, overwrite=overwrite, progress=progress, lock=lock)
        return finalize(out, lock)


def training_documents(inputs: Sequence[str], cfg: BuildConfig | None = None) -> Iterator[str]:
    """Cleaned documents of the inputs, streamed (what --train-vocab learns from); ``cfg`` says how to read them.

    Inputs that yield no text at all raise ``SourceError`` once read, as the shard build refuses them
    (``nothing_kept``): the vocabulary trainer reads the documents before it writes anything, so a vocabulary of
    only the special tokens is never written."""
    stats = DocumentStats()
    for spec in inputs:
        options = cfg.read_options(spec) if cfg else ReadOptions()
        for number, record in enumerate(read_documents(spec, options)):
            stats.read += 1
            if isinstance(record, Skipped):
                stats.skip(record.reason, record.where, record.chars)
            elif text := clean_document(record):
                yield text
            else:
                stats.skip("empty", f"{spec} document {number}", len(record))
    if stats.read == stats.skipped:
        raise SourceError(nothing_kept("text to train a vocabulary on", inputs, stats))


FLAG_KEYS = {"": ("seed", "dupe_factor", "samples_per_shard", "chunk_chars", "text_field", "rows_per_document",
                  "txt_documents"),
             "instances.": ("recipe", "max_seq_len", "short_seq_prob"),
             "masking.": ("mask_prob", "max_predictions", "whole_word_mask")}
"""the config keys with a flag of their own, by section (``--max-seq-len`` sets ``instances.max_seq_len``);
``--objective-mix`` sets ``instances.objective_mix``, ``--set KEY=VALUE`` any key"""
SECTIONS = {"": BuildSettings, "instances.": InstanceConfig, "masking.": MaskingConfig}
FLAG_HELP = {
    "text_field": f"field / column of JSON, parquet and dataset records that holds the text (default {TEXT_FIELD})",
    "rows_per_document": f"with --rows-as-sentences: rows per document (default {ROWS_PER_DOCUMENT}; an empty row "
                         "ends a document early)",
    "txt_documents": f"what a document of a .txt input is, one of {', '.join(TXT_DOCUMENTS)}: blank-line (documents "
                     "separated by blank lines, BERT's convention; the default), line (one document per line), file "
                     "(the whole file, its blank lines ending paragraphs: a directory of articles or books)",
    "recipe": f"one of {', '.join(RECIPES)} (default unilm)",
    "max_seq_len": "tokens per sample, [CLS]/[SEP] included (default 128)",
    "short_seq_prob": "share of samples (every objective) built to a random shorter length, as BERT's "
                      "short_seq_prob (default 0.1)",
    "mask_prob": "share of tokens masked (default 0.15)",
    "max_predictions": "cap on masked tokens per sample (default round(--mask-prob x --max-seq-len): 19 at 128, 77 "
                       "at 512 with 0.15)",
    "whole_word_mask": "mask whole words: all word pieces of each word a span touches, one replacement per word "
                       "(default off)",
    "dupe_factor": "differently-masked copies of each instance (BERT: 10; see docs/shard_format.md)",
    "seed": "seeds every random choice of the build (default 1)",
    "samples_per_shard": "upper bound per shard file (default 65536)",
    "chunk_chars": "characters per work unit (affects output; default 500000)",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m data_prep.build", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="config keys (--config YAML, their flags, or --set KEY=VALUE):\n"
                                       + keys_help(BuildSettings))
    p.add_argument("--config", metavar="YAML", help="build settings (data_prep/configs/*.yaml); the flags given "
                                                    "override it, and --set overrides both")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="any config key (listed below), e.g. --set masking.mask_prob=0.2; repeatable")
    p.add_argument("--input", nargs="+", action="extend", default=[], metavar="SRC",
                   help="file (.xml[.bz2] .jsonl .json .parquet .txt; .jsonl .json .txt also .gz .bz2 .xz .zst; "
                        "WikiExtractor's wiki_NN), "
                        "directory (files named by split: split train, or DIR::SPLIT), or HF dataset "
                        "name[:config][:split]; repeatable")
    p.add_argument("--rows-as-sentences", nargs="*", metavar="SRC",
                   help="rows are sentences of a running text (BookCorpus on the hub): consecutive rows form one "
                        "document; alone it applies to every --input, else to the inputs named (.txt: a row is a line)")
    p.add_argument("--vocab", type=Path, help="BERT vocab.txt, a Hugging Face model/tokenizer directory, or a "
                                              "tokenizer.json (WordPiece); casing is read from its tokenizer config")
    casing = p.add_mutually_exclusive_group()
    casing.add_argument("--uncased", action="store_const", const=True, dest="uncased",
                        help="lowercase and strip accents (default: what --vocab's tokenizer config says, else the "
                             "vocab's own word pieces: uncased when none changes under lower-casing)")
    casing.add_argument("--cased", action="store_const", const=False, dest="uncased",
                        help="keep case; refused if --vocab's tokenizer config lowercases")
    p.add_argument("--train-vocab", type=int, metavar="SIZE", help="train a WordPiece vocab of SIZE on the inputs")
    p.add_argument("--vocab-out", type=Path, help="where --train-vocab writes the vocab; a tokenizer_config.json "
                                                  "beside it states its casing (an existing one: --overwrite)")
    p.add_argument("--objective-mix", dest="objective_mix_text", metavar="MIX",
                   help="unilm only: e.g. bidirectional=0.5,seq2seq=0.5 (instances.objective_mix)")
    for prefix, names in FLAG_KEYS.items():
        add_field_flags(p, SECTIONS[prefix], names, FLAG_HELP)
    p.add_argument("--workers", type=int, default=1, help="processes on this machine (output is identical; default 1)")
    p.add_argument("--num-builders", type=int, default=1,
                   help="split the work across K machines: each reads only its units (files, 256 MiB ranges of "
                        ".jsonl files, Wikipedia dumps and parquet files, dataset shards)")
    p.add_argument("--builder-index", type=int, default=0, help="this machine's share, 0..K-1")
    p.add_argument("--finalize", action="store_true", help="after all builders: write shards + manifest in --out")
    p.add_argument("--out", type=Path, help="output directory (assembled beside it, renamed into place when done)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing build in --out (it stays until the new one is complete) and an "
                        "existing --vocab-out")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def _as_yaml(value: object) -> str:
    """``value`` written as YAML reads it back (a text that looks like a number stays a text, NaN a float)."""
    return yaml.safe_dump(value, default_flow_style=True).removesuffix("\n...\n").strip()


def load_build_settings(args: argparse.Namespace) -> BuildSettings:
    """The settings: dataclass defaults, then ``--config``, then the flags given, then ``--set`` overrides."""
    given = {f"{prefix}{name}": value for prefix, section in SECTIONS.items()
             for name, value in given_fields(args, section).items()}
    if args.objective_mix_text is not None:
        given["instances.objective_mix"] = parse_objective_mix(args.objective_mix_text)
    flags = [f"{key}={_as_yaml(value)}" for key, value in given.items()]  # before --set's overrides
    try:
        return load_settings(args.config, flags + args.set)
    except (ValueError, FileNotFoundError) as error:
        raise ValueError(config_error(args.config, error, args.set) if args.config else str(error)) from None


def _resolve_vocab(args: argparse.Namespace) -> tuple[Path, bool]:
    """(vocab.txt, uncased) for --vocab; a tokenizer.json's vocabulary is written beside the output first."""
    source = resolve_vocab_source(args.vocab)
    source.load()  # a vocabulary that cannot be used is named as given, before anything is written
    uncased = resolve_casing(source, args.uncased)
    if source.vocab_file is not None:
        return source.vocab_file, uncased
    staging = staging_dir(args.out)
    staging.mkdir(parents=True, exist_ok=True)
    path = staging / VOCAB_NAME
    if not path.is_file() or path.read_text(encoding="utf-8") != source.vocab_text:
        tmp = staging / f"{VOCAB_NAME}.tmp{os.getpid()}"
        tmp.write_text(source.vocab_text or "", encoding="utf-8")
        os.replace(tmp, path)
    return path, uncased


def _warn_low_cap(masking: MaskingConfig, max_seq_len: int) -> None:
    """Warn when ``masking.max_predictions`` masks full-length samples below ``mask_prob`` (never at its default)."""
    cap, rate = masking.max_predictions, masking.mask_prob
    if cap is not None and cap < round(rate * (max_seq_len - 3)):
        log.warning(f"[build] warning: --max-predictions {cap} caps masking below --mask-prob {rate} for samples "
                    f"longer than {int(cap / rate) + 3} tokens (a full {max_seq_len}-token sample masks "
                    f"{cap / (max_seq_len - 3):.1%}); the default is {default_max_predictions(max_seq_len, rate)}")


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(format="%(message)s")  # the build's warnings and notes on stderr, as plain lines
    logging.getLogger("data_prep").setLevel(logging.INFO)
    args = parse_args(argv)
    with signals.stop_once():
        _main(args)


def _main(args: argparse.Namespace) -> None:
    try:
        if args.finalize:
            if args.out is None:
                raise ValueError("--finalize needs --out DIR")
            _report(finalize(args.out), args.out, str(args.out / VOCAB_NAME))
            return
        if not args.input:
            raise ValueError("give at least one --input")
        for spec in args.input:
            check_input(spec)
        if args.workers < 1:
            raise ValueError(f"--workers {args.workers}: give at least 1 (processes on this machine)")
        if not 0 <= args.builder_index < args.num_builders:
            raise ValueError(f"--builder-index {args.builder_index} must be in [0, --num-builders {args.num_builders})")
        sentence_inputs = args.input if args.rows_as_sentences == [] else args.rows_as_sentences or ()
        # every setting is checked before any work (--train-vocab reads the inputs with the reading settings)
        settings = BuildConfig.of(load_build_settings(args), args.input, sentence_inputs=sentence_inputs)
        _warn_low_cap(settings.masking, settings.instances.max_seq_len)
        if args.train_vocab is not None:
            if args.vocab_out is None:
                raise ValueError("--train-vocab needs --vocab-out PATH")
            _check_vocab_out(args.vocab_out, args.overwrite)
            args.uncased = bool(args.uncased)  # the build below encodes as the vocab was trained
            vocab = train_vocab(lambda: training_documents(args.input, settings), args.train_vocab, args.vocab_out,
                                args.uncased)
            print(f"[build] trained a {vocab.size}-entry {'uncased' if args.uncased else 'cased'} WordPiece vocab "
                  f"-> {args.vocab_out} (its casing in {args.vocab_out.parent / HF_TOKENIZER_CONFIG})")
            if vocab.size < args.train_vocab:
                log.info(f"[build] note: --train-vocab {args.train_vocab} asked for more entries than these inputs "
                         f"yield: every word piece seen is in the {vocab.size}")
            if args.out is None:
                return
            args.vocab = args.vocab_out
        if args.vocab is None or args.out is None:
            raise ValueError("give --vocab VOCAB (or --train-vocab SIZE --vocab-out PATH) and --out DIR")
        with claim_output(args.out, args.builder_index, args.num_builders) as lock:
            vocab_path, uncased = _resolve_vocab(args)
            cfg = dataclasses.replace(settings, vocab_path=str(vocab_path), vocab_sha256=load_vocab(vocab_path).sha256,
                                      uncased=uncased)
            stats = run_builder(cfg, args.out, workers=args.workers, builder_index=args.builder_index,
                                num_builders=args.num_builders, overwrite=args.overwrite, progress=not args.quiet,
                                lock=lock)
            if args.num_builders == 1:
                manifest = finalize(args.out, lock)
        if args.num_builders == 1:
            _report(manifest, args.out, str(args.vocab), resolve_vocab_source(args.vocab).casing_from)
        else:
            print(f"[build] builder {args.builder_index}/{args.num_builders}: {stats.read} documents read; "
                  f"when all builders are done run: python -m data_prep.build --finalize --out {args.out}")
    except (ValueError, OSError) as err:  # our errors are ValueError subclasses that name the file and the fix
        sys.exit(f"data_prep.build: error: {err}")
    except KeyboardInterrupt as stop:  # a build replaces --out only once complete; the next run clears the staging
        said, code = signals.describe(stop)
        print(f"data_prep.build: {said}" + (f"; {args.out} holds what it held before this run, and a rerun clears "
                                           "the half-built leftovers" if args.out else ""), file=sys.stderr)
        sys.exit(code)


def _check_vocab_out(vocab_out: Path, overwrite: bool) -> None:
    """Refuse to replace an existing vocab, or the tokenizer config beside it, unless ``--overwrite``."""
    existing = [p for p in (vocab_out, vocab_out.parent / HF_TOKENIZER_CONFIG) if p.exists()]
    if existing and not overwrite:
        raise ValueError(f"--vocab-out {vocab_out}: {' and '.join(map(str, existing))} exist(s), and --train-vocab "
                         f"writes both; pass --overwrite to replace them (shards built on the old vocab keep their "
                         "copy), or choose another --vocab-out")


def _report(manifest: dict, out: Path, vocab_name: str, casing_from: str | None = None) -> None:
    """The build's result on stdout; what the counts warn about logged (on stderr)."""
    docs = manifest["documents"]
    print(f"[build] {manifest['num_samples']} samples, {manifest['num_tokens']} tokens in {len(manifest['shards'])} "
          f"shard(s) -> {out}; documents read {docs['read']}, skipped {docs['skipped']} {docs['skip_reasons']}")
    if docs.get("repaired_lines"):
        log.warning(f"[build] {docs['repaired_lines']} line(s) of text inputs held bytes that are not UTF-8, replaced "
                    f"by U+FFFD (e.g. {docs['repair_examples'][0]}; more in manifest.json documents.repair_examples)")
    for warning in (skip_warning(manifest), random_next_warning(manifest),
                    unk_warning(manifest, vocab_name, casing_from)):
        if warning:
            log.warning(warning)


if __name__ == "__main__":
    main()
