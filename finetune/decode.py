"""Decode a seq2seq model's inputs from the command line: `python -m finetune.decode --model DIR --input FILE.jsonl
--output FILE.jsonl [--beam-size 5] ...` (beam search: `finetune.beam`).

Inputs are JSONL records with `src` (or UniLM's line files: `--input NAME.src`); `--output NAME.jsonl` gets the
records with their `prediction`, any other name one prediction per line, tokenised as UniLM writes it: "the u . s .
?". When every record has a `tgt` (or `NAME.tgt` is beside `NAME.src`), ROUGE and BLEU against it go to
`FILE.metrics.json` (`finetune.generation.score_predictions`). Finished batches are kept in `FILE.partial.jsonl`
until the output is written, so a decode that is stopped continues after them (`finetune.journal`); a second
decode of the same output while one runs is refused, naming the first (`lock_output`).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, NoReturn

import torch

from common import locks
from common.files import sha256_file, write_atomically
from common.signals import describe, stop_once
from pretrain.console import configure_console
from pretrain.distributed import SetupError, close_distributed, init_distributed, on_every_rank
from pretrain.outputs import check_output

from .beam import DecodeConfig
from .cli import beside, device_of, finite_float, int_at_least
from .generation import NO_REPEAT_IGNORE, decode_records, ignore_ids, score_predictions
from .journal import Decoded, PredictionJournal
from .model_io import Finetuned, load_finetuned
from .seq2seq import source_budget
from .task_files import read_seq2seq, write_jsonl

log = logging.getLogger(__name__)


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""What `--dtype` names: the model's parameters and activations while decoding (the log-probabilities and beam
scores stay fp32)."""


def metrics_path(output: str | Path) -> Path:
    """`out.jsonl` (or `out.txt`, ...) → `out.metrics.json` (beside the output)."""
    return beside(output, ".metrics.json")


def n_best_path(output: str | Path) -> Path:
    """`out.jsonl` (or `out.txt`, ...) → `out.nbest.jsonl` (beside the output): `write_n_best`'s file."""
    return beside(output, ".nbest.jsonl")


def writes_lines(output: Path) -> bool:
    """Whether predictions go to `output` one per line, in UniLM's tokenised form (`write_predictions`)."""
    return output.suffix != ".jsonl"


def write_predictions(output: Path, records: list[dict], predictions: list[str]) -> None:
    """`output.jsonl`: the input records with their `prediction`; any other name: one prediction per line, in input
    order (UniLM's decoding output, what files2rouge and the question-generation scripts read beside the
    references; `decode_records(spaced=True)` gives its tokenised form)."""
    if not writes_lines(output):
        write_atomically(output, lambda tmp: write_jsonl(
            ({**record, "prediction": p} for record, p in zip(records, predictions)), tmp))
    else:
        write_atomically(output, lambda tmp: tmp.write_text(
            "".join(" ".join(p.split()) + "\n" for p in predictions), encoding="utf-8"))


def write_n_best(output: Path, n_best: list[list[dict]]) -> Path:
    """`--n-best K`'s file beside `output` (`n_best_path`): one JSON object per input record, in input order,
    `{"index": i, "hyps": [{"text": ..., "score": ...}, ...]}` with up to K hypotheses best first (`index`: the
    record's 0-based place in the input; `text` in the output's form, so the first is the output's prediction;
    `score`: summed log-probability / GNMT length penalty, what the search ranks by)."""
    path = n_best_path(output)
    write_atomically(path, lambda tmp: write_jsonl(({"index": i, "hyps": hyps} for i, hyps in enumerate(n_best)),
                                                   tmp))
    return path


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m finetune.decode",
                                     description="UniLM seq2seq decoding (greedy / beam search with a KV cache)")
    parser.add_argument("--model", required=True, help="a fine-tuning output directory (or an HF BERT directory)")
    parser.add_argument("--input", required=True, help="JSONL with `src` (and optionally `tgt` references), or "
                        "UniLM's line files: NAME.src (and NAME.tgt beside it)")
    parser.add_argument("--output", required=True,
                        help="NAME.jsonl: the input records with their `prediction`; any other name: one "
                             "prediction per line, words and punctuation split by spaces (as UniLM's decoding "
                             "writes, for files2rouge and its question-generation scoring)")
    parser.add_argument("--beam-size", type=int_at_least(1), default=5,
                        help="1: greedy, no length penalty (default 5)")
    parser.add_argument("--max-tgt-len", type=int_at_least(1), default=None,
                        help="longest target in word pieces (default: the fine-tuning run's eval_max_tgt_len, else its "
                             "max_tgt_len, else 64)")
    parser.add_argument("--min-tgt-len", type=int_at_least(0), default=1,
                        help="shortest target in word pieces (default 1; at most --max-tgt-len)")
    parser.add_argument("--max-src-len", type=int_at_least(1), default=None,
                        help="default: the fine-tuning run's, else 448")
    parser.add_argument("--length-penalty", type=finite_float, default=None,
                        help="GNMT alpha (default: the fine-tuning run's eval_length_penalty, e.g. 1.0 for CNN/DM, "
                             "else 0: none)")
    parser.add_argument("--no-repeat-ngram", type=int_at_least(0), default=None, metavar="N",
                        help="forbid repeating an n-gram of N word pieces (3: trigram blocking, the paper's; "
                             "1: no word piece twice, for headlines; 0: off; default: the fine-tuning run's "
                             "eval_no_repeat_ngram, else 3)")
    parser.add_argument("--no-repeat-ignore", default=None, metavar="TOKENS",
                        help="word pieces the blocking exempts, separated by | ('.', UniLM's: nothing is blocked "
                             "after one, and it is never blocked; '' for none; default: the fine-tuning run's "
                             "eval_no_repeat_ignore, else '.')")
    parser.add_argument("--no-cache", action="store_true", help="recompute everything each step (proves the cache)")
    parser.add_argument("--batch-size", type=int_at_least(1), default=8, help="sources decoded together (>= 1)")
    parser.add_argument("--device", default=None,
                        help="torch device to decode on (default: this process's GPU when there is one, else cpu)")
    parser.add_argument("--force", action="store_true", help="replace an existing non-empty --output")
    parser.add_argument("--n-best", type=int_at_least(1), default=1, metavar="K",
                        help="also write the K best hypotheses of each input with their scores to NAME.nbest.jsonl "
                             "beside the output (K <= --beam-size; default 1: the output only)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32",
                        help="the model's precision while decoding (default fp32; fp16 on CUDA only)")
    parser.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)  # the deepspeed launcher passes it
    return parser


def main(argv: list[str] | None = None) -> None:
    """Decode `--input` on every rank of the launch (plain `python`: one rank); rank 0 writes the output."""
    parser = build_parser()
    args = parser.parse_args(argv)
    rank, world_size = init_distributed()
    configure_console(logging.INFO if rank == 0 else logging.WARNING)  # one rank speaks for all
    try:  # the output's lock is rank 0's, taken once for the whole launch
        handle = on_every_rank(lambda: lock_output(args.output) if rank == 0 else None)
    except SetupError as error:
        refuse(parser, rank, str(error))
    try:
        _decode(parser, args, rank, world_size)
    finally:
        if handle is not None:
            locks.release(handle)


def refuse(parser: argparse.ArgumentParser, rank: int, message: str) -> NoReturn:
    """Stop every rank with a usage error, said once (by rank 0)."""
    if rank == 0:
        parser.error(message)
    sys.exit(2)


def lock_output(output: str) -> IO[str]:
    """The lock (``common.locks``) a decode holds on ``.NAME.decode.lock`` beside its output from start to end,
    so that a second decode of the same output (which would share its `PredictionJournal`) is refused
    (ValueError), naming the first; returns the handle that holds it."""
    path = beside(output, ".decode.lock")
    path = path.with_name("." + path.name)
    try:
        handle, previous = locks.take(path)
    except locks.Held as held:
        raise ValueError(f"--output {output}: another decode of it is running ({held}); wait for it to end or stop "
                         "it, or choose another --output") from None
    except OSError as error:
        raise ValueError(f"--output {output}: cannot lock {path} ({error})"
                         + (f"; put the output on {locks.NO_LOCKS_HINT}" if locks.cannot_lock(error) else "")) from None
    if previous:
        log.warning("[decode] an earlier decode of %s ended without releasing %s (killed): %s", output, path,
                    locks.holder_text(previous))
    return handle


@dataclass(frozen=True)
class Setup:
    """What a decode runs with, read and checked alike on every rank (`prepare`)."""

    finetuned: Finetuned
    config: DecodeConfig
    max_src_len: int
    records: list[dict]
    journal: PredictionJournal | None
    """Rank 0's; None on the others."""


def prepare(args: argparse.Namespace, rank: int) -> Setup:
    """The model, settings and records of this decode, or a ValueError naming the flag or file at fault."""
    paired_references = Path(args.input).with_suffix(".tgt") if Path(args.input).suffix == ".src" else None
    try:
        check_output(args.output, [args.input, paired_references, args.model], force=args.force, file=True)
        # the predictions so far, kept beside the output until it is written (`PredictionJournal`)
        check_output(beside(args.output, ".partial.jsonl"), [args.input, paired_references], force=True, file=True)
        if args.n_best > 1:
            check_output(n_best_path(args.output), [args.input, paired_references], force=args.force, file=True)
    except FileExistsError as error:
        raise ValueError(str(error)) from None
    device = device_of(args.device)
    if args.dtype == "fp16" and device.type != "cuda":
        raise ValueError(f"--dtype fp16: half precision decodes on CUDA devices only, and this decode runs on "
                         f"{device}; use --dtype bf16 or fp32")
    if args.n_best > args.beam_size:
        raise ValueError(f"--n-best {args.n_best}: a beam search of --beam-size {args.beam_size} keeps at most "
                         f"{args.beam_size} hypotheses per input")
    try:
        finetuned = load_finetuned(args.model, expect_task="seq2seq")
    except (ValueError, OSError) as error:
        raise ValueError(f"--model {args.model}: {error}") from None
    finetuned.model.to(device=device, dtype=DTYPES[args.dtype])
    config, max_src_len = decoding_settings(args, finetuned)
    try:
        records = read_seq2seq(args.input, targets=False)
    except (ValueError, OSError) as error:
        raise ValueError(f"--input {args.input}: {error.strerror if isinstance(error, OSError) else error}") from None
    journal = None
    if rank == 0:
        model_files = finetuned.meta.get("files") or {path.name: sha256_file(path)
                                                      for path in sorted(Path(args.model).iterdir()) if path.is_file()}
        journal = PredictionJournal(beside(args.output, ".partial.jsonl"), PredictionJournal.fingerprint_of(
            model_files, records, dict(dataclasses.asdict(config), max_src_len=max_src_len,
                                       batch_size=args.batch_size, spaced=writes_lines(Path(args.output)),
                                       **({"n_best": args.n_best} if args.n_best > 1 else {}),
                                       **({"dtype": args.dtype} if args.dtype != "fp32" else {}))))
        found = journal.open()
        if found:  # what an earlier decode left is used, or replaced
            log.warning("[decode] %s", found)
    return Setup(finetuned, config, max_src_len, records, journal)


def decoding_settings(args: argparse.Namespace, finetuned: Finetuned) -> tuple[DecodeConfig, int]:
    """The search and the source budget: the flags, and where a flag is not given what the fine-tuning run
    evaluated with (its `eval_*` settings and lengths)."""
    run = finetuned.run_settings
    max_tgt_len = args.max_tgt_len if args.max_tgt_len is not None else \
        run.get("eval_max_tgt_len") or run.get("max_tgt_len", 64)
    if args.beam_size > finetuned.tokenizer.vocab_size:
        raise ValueError(f"--beam-size {args.beam_size}: more beams than the {finetuned.tokenizer.vocab_size} word "
                         "pieces a step can choose from")
    if args.min_tgt_len > max_tgt_len:
        raise ValueError(f"--min-tgt-len {args.min_tgt_len} exceeds the longest target, {max_tgt_len} word pieces "
                         "(--max-tgt-len, default the fine-tuning run's eval_max_tgt_len or max_tgt_len)")
    length_penalty = args.length_penalty if args.length_penalty is not None else run.get("eval_length_penalty", 0.0)
    no_repeat_ngram = args.no_repeat_ngram if args.no_repeat_ngram is not None else run.get("eval_no_repeat_ngram", 3)
    no_repeat_ignore = args.no_repeat_ignore if args.no_repeat_ignore is not None else \
        run.get("eval_no_repeat_ignore", NO_REPEAT_IGNORE)
    ignore = ignore_ids(finetuned.tokenizer, no_repeat_ignore, "--no-repeat-ignore")
    config = DecodeConfig(args.beam_size, max_tgt_len, args.min_tgt_len, length_penalty, no_repeat_ngram, ignore,
                          not args.no_cache)
    try:
        max_src_len = source_budget(finetuned.model.cfg.max_position_embeddings,
                                    args.max_src_len if args.max_src_len is not None else
                                    run.get("max_src_len", 448), max_tgt_len)
    except ValueError as error:
        raise ValueError(f"--max-tgt-len: {error}") from None
    return config, max_src_len


def _decode(parser: argparse.ArgumentParser, args: argparse.Namespace, rank: int, world_size: int) -> None:
    try:
        setup = on_every_rank(lambda: prepare(args, rank))
    except SetupError as error:
        refuse(parser, rank, str(error))
    records, journal = setup.records, setup.journal
    kept = len(journal.predictions) if journal else 0
    began = time.perf_counter()
    with stop_once():  # its handling included: a second signal does not cut that short
        try:
            decoded = decode_records(setup.finetuned.model, setup.finetuned.tokenizer, records, setup.config,
                                     setup.max_src_len, args.batch_size, progress=True,
                                     spaced=writes_lines(Path(args.output)), journal=journal, n_best=args.n_best,
                                     rank=rank, world_size=world_size)
        except ValueError as error:  # a record it cannot decode, found before decoding any (alike on every rank)
            if journal:
                journal.remove()
            refuse(parser, rank, f"--input {args.input}: {error}")
        except KeyboardInterrupt as stop:
            said, code = describe(stop)
            if journal:  # rank 0's journal holds every round it gathered before the stop
                log.warning("\n[decode] %s: %d of %d predictions are kept in %s; the same command continues after "
                            "them", said, len(journal.predictions), len(records), journal.path)
            sys.exit(code)
    if rank == 0:
        finish(args, setup, decoded, kept, time.perf_counter() - began)


def finish(args: argparse.Namespace, setup: Setup, decoded: Decoded, kept: int, seconds: float) -> None:
    """Rank 0: write the output (and the n-best lists, the scores) once every record is decoded; say so."""
    records = setup.records
    empty = [number for number, record in enumerate(records, 1) if not record["src"].strip()]
    if empty:
        print(f"[decode] {len(empty)} empty source(s) (record {', '.join(map(str, empty[:5]))}"
              f"{' ...' if len(empty) > 5 else ''}) decoded from [CLS] [SEP] alone, as UniLM's decoder does: the "
              "output keeps one prediction per input")
    if len(decoded.predictions) != len(records):
        raise RuntimeError(f"{len(decoded.predictions)} predictions for {len(records)} input records; nothing written")
    write_predictions(Path(args.output), records, decoded.predictions)
    if args.n_best > 1:
        write_n_best(Path(args.output), decoded.n_best)
    if setup.journal:
        setup.journal.remove()
    before = f"{len(records) - kept} decoded now, {kept} kept from before; " if kept else ""
    print(f"[decode] {len(records)} inputs in {seconds:.1f}s ({before}{decoded.truncated} sources truncated to "
          f"{setup.max_src_len} word pieces) → {args.output}"
          + (f" (and {args.n_best}-best lists → {n_best_path(args.output)})" if args.n_best > 1 else ""))
    if all(isinstance(r.get("tgt"), str) for r in records):
        tokenizer = setup.finetuned.tokenizer
        scores = score_predictions(tokenizer, decoded.predictions, [r["tgt"] for r in records])
        write_atomically(metrics_path(args.output), lambda tmp: tmp.write_text(json.dumps(scores, indent=2) + "\n"))
        print("[decode] " + "  ".join(f"{k} {v:.2f}" for k, v in scores.items()) + f" → {metrics_path(args.output)}")


if __name__ == "__main__":
    main()
    close_distributed()
