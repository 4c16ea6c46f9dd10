"""Statistics, sample dumps and integrity checks of a shard build: ``python -m data_prep.inspect DIR``.

``--json`` prints one JSON object (``num_samples``, ``objective_counts``, ``masked_fraction`` = masked /
maskable tokens over all samples, ``masked_fraction_by_objective``, ``max_predictions`` and ``cap_bound``
(samples whose masking the ``max_predictions`` cap cut below ``mask_prob``: count and fraction),
``replacement`` fractions, ``span_lengths``, ``documents``, ``padding_fraction``, ``whole_word_mask`` and
``word_breaks``: continuation pieces masked apart from their word, none under whole-word masking …);
``--dump N`` prints the first N samples as JSON lines with tokens as strings (and each one's ``word_breaks``);
``--verify`` checks every shard against the manifest sha256, and that a whole-word build breaks no word.
All statistics are computed shard by shard on the memory-mapped arrays.
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from data_prep.shard_format import VOCAB_NAME, Objective, ShardArrays, ShardDataset, ShardError
from data_prep.whole_words import continuation_table, word_breaks


def shard_statistics(ds: ShardDataset) -> dict[str, Any]:
    """Corpus-level statistics of a build (see the module docstring for the keys)."""
    special = ds.special_tokens
    # structure tokens that masking must never pick ([UNK] is text: a masked [UNK] predicts [UNK])
    special_ids = np.array(sorted(i for name, i in special.items() if name != "unk"))
    objectives: collections.Counter = collections.Counter()
    random_next: collections.Counter = collections.Counter()
    spans: collections.Counter = collections.Counter()
    totals: collections.Counter = collections.Counter()
    masked_by_objective: collections.Counter = collections.Counter()
    maskable_by_objective: collections.Counter = collections.Counter()
    masking = ds.manifest.get("masking")
    continuation = _continuations(ds)
    for shard in ds.shards:
        a: ShardArrays = shard.arrays
        index = np.asarray(a.index)
        objectives.update(index["objective"].tolist())
        random_next.update(index["is_random_next"].tolist())
        length = index["length"].astype(np.int64)
        single = index["segment_a_length"] == index["length"]
        num_masked = index["num_masked"].astype(np.int64)
        totals["tokens"] += int(length.sum())
        totals["maskable"] += int((length - np.where(single, 2, 3)).sum())
        totals["masked"] += int(num_masked.sum())
        maskable = length - np.where(single, 2, 3)
        objective = index["objective"].astype(np.int64)
        masked_by_objective.update(_sum_by(objective, num_masked))
        maskable_by_objective.update(_sum_by(objective, maskable))
        if masking:  # the cap bound where 15% of the maskable tokens (rounded) is more than it allows
            wanted = np.rint(maskable * masking["mask_prob"]).astype(np.int64)
            totals["cap_bound"] += int((wanted > masking["max_predictions"]).sum())
        if not num_masked.sum():
            continue
        positions = np.asarray(a.masked_positions).astype(np.int64)
        labels = np.asarray(a.masked_labels).astype(np.int64)
        totals["word_breaks"] += int(word_breaks(a.tokens, index["token_offset"], index["length"],
                                                 index["segment_a_length"], num_masked, positions, labels,
                                                 continuation).sum())
        shown = np.asarray(a.tokens)[np.repeat(index["token_offset"].astype(np.int64), num_masked) + positions]
        totals["mask"] += int((shown == special["mask"]).sum())
        totals["keep"] += int((shown == labels).sum())
        totals["special_masked"] += int(np.isin(labels, special_ids).sum())
        sample = np.repeat(np.arange(len(index)), num_masked)
        new_run = np.ones(len(positions), bool)
        new_run[1:] = (np.diff(positions) != 1) | (np.diff(sample) != 0)
        run_lengths = np.diff(np.append(np.flatnonzero(new_run), len(positions)))
        spans.update(run_lengths.tolist())
    masked = max(totals["masked"], 1)
    num_samples = len(ds)
    max_len = ds.manifest["max_seq_len"]
    return {
        "num_samples": num_samples,
        "num_tokens": totals["tokens"],
        "num_shards": len(ds.shards),
        "shard_samples": [len(s) for s in ds.shards],
        "recipe": ds.manifest["recipe"],
        "max_seq_len": max_len,
        "objective_counts": {o.key: objectives.get(int(o), 0) for o in Objective},
        "nsp": {"random_next": random_next.get(1, 0), "true_next": random_next.get(0, 0)},
        "masked_tokens": totals["masked"],
        "masked_fraction": totals["masked"] / max(totals["maskable"], 1),
        "masked_fraction_by_objective": {o.key: masked_by_objective[int(o)] / maskable_by_objective[int(o)]
                                         for o in Objective if maskable_by_objective[int(o)]},
        "max_predictions": masking["max_predictions"] if masking else None,
        "cap_bound": {"samples": totals["cap_bound"], "fraction": totals["cap_bound"] / max(num_samples, 1)},
        "replacement": {"mask": totals["mask"] / masked,
                        "random": (totals["masked"] - totals["mask"] - totals["keep"]) / masked,
                        "keep": totals["keep"] / masked},
        "span_lengths": {str(k): spans[k] for k in sorted(spans)},
        "special_tokens_masked": totals["special_masked"],
        "documents": {k: ds.manifest["documents"][k] for k in ("read", "skipped", "skip_reasons")},
        "padding_fraction": 1 - totals["tokens"] / max(num_samples * max_len, 1),
        "whole_word_mask": bool(masking and masking.get("whole_word_mask", False)),
        "word_breaks": totals["word_breaks"],
    }


def _continuations(ds: ShardDataset) -> np.ndarray:
    vocab = (ds.directory / VOCAB_NAME).read_text(encoding="utf-8").split("\n")
    return continuation_table(tuple(vocab))


def _sum_by(keys: np.ndarray, values: np.ndarray) -> dict[int, int]:
    """{key: sum of values with that key}."""
    unique, inverse = np.unique(keys, return_inverse=True)
    sums = np.bincount(inverse, weights=values, minlength=len(unique)).astype(np.int64)
    return dict(zip(unique.tolist(), sums.tolist()))


def dump_samples(ds: ShardDataset, count: int) -> Iterator[dict[str, Any]]:
    """The first ``count`` samples with token strings (masking applied) and original tokens at masked positions."""
    vocab = (ds.directory / VOCAB_NAME).read_text(encoding="utf-8").split("\n")
    continuation = continuation_table(tuple(vocab))
    for i in range(min(count, len(ds))):
        sample = ds[i]
        breaks = word_breaks(sample.input_ids, np.zeros(1, np.int64), np.array([sample.length]),
                             np.array([sample.segment_a_length]), np.array([len(sample.masked_positions)]),
                             sample.masked_positions.astype(np.int64), sample.masked_labels.astype(np.int64),
                             continuation)
        yield {"index": i, "objective": Objective(sample.objective).key,
               "tokens": [vocab[t] for t in sample.input_ids.tolist()],
               "segment_a_length": sample.segment_a_length, "length": sample.length,
               "masked_positions": sample.masked_positions.tolist(),
               "masked_labels": [vocab[t] for t in sample.masked_labels.tolist()],
               "is_random_next": sample.is_random_next, "word_breaks": int(breaks[0])}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m data_prep.inspect", description=__doc__.split("\n")[0])
    p.add_argument("directory", type=Path)
    p.add_argument("--json", action="store_true", help="print statistics as one JSON object")
    p.add_argument("--dump", type=int, default=0, metavar="N", help="print the first N samples as JSON lines")
    p.add_argument("--verify", action="store_true", help="check every shard's sha256 against the manifest")
    args = p.parse_args(argv)
    if args.dump < 0:
        p.error(f"--dump N: the number of samples to print, >= 0 (got {args.dump})")
    try:
        ds = ShardDataset(args.directory)
        if args.verify:
            ds.verify()
            masking = ds.manifest.get("masking") or {}
            if masking.get("whole_word_mask") and (breaks := shard_statistics(ds)["word_breaks"]):
                raise ShardError(f"{args.directory}: a whole-word build with {breaks} piece(s) masked apart from "
                                 "their word")
            print(f"[inspect] verified {len(ds.shards)} shard(s) in {args.directory}", file=sys.stderr)
        if args.dump:
            for record in dump_samples(ds, args.dump):
                print(json.dumps(record, ensure_ascii=False))
            return
        stats = shard_statistics(ds)
        if args.json:
            print(json.dumps(stats))
        else:
            for key, value in stats.items():
                print(f"{key:>22}: {json.dumps(value)}")
    except ShardError as err:
        sys.exit(f"data_prep.inspect: error: {err}")


if __name__ == "__main__":
    main()
