"""Streaming pre-training data: global sample order, per-rank slices, background prefetch, collate.

Sample order (independent of world size)
    Global position ``p`` of the run maps to sample ``epoch_order(p // N)[p % N]`` of the manifest's ``N``
    samples. Each epoch's order is a seeded permutation that keeps the manifest's objective proportions in every
    window: every objective is permuted on its own (seed, epoch, objective), and its k-th sample gets the ideal
    fractional position (k + ½) / n_objective; merging the objectives by that position interleaves them evenly,
    so each global batch holds each objective within ±1 of its share (UniLM: 1/3, 1/3, 1/6, 1/6).

Per-rank slice
    Optimizer step s covers positions [s·G, (s+1)·G) for global batch G = micro × accumulation × dp. Rank r
    takes the contiguous positions [s·G + r·micro·accumulation, …) and cuts them into ``accumulation``
    micro-batches. A checkpoint stores ``consumed_samples`` (= s·G); resume restarts at exactly that position,
    on any number of ranks, with nothing replayed.

Shards are read through ``data_prep.shard_format.ShardDataset`` (memory-mapped); nothing loads a whole shard.
"""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from pretrain.batch_plan import BatchPlan
from pretrain.masks import BIDIRECTIONAL
from pretrain.model import IGNORE_INDEX, ModelConfig


def collate(samples: Sequence[Any], pad_id: int, max_len: int) -> dict[str, torch.Tensor]:
    """Pad ``data_prep.shard_format.Sample`` objects into the batch dict of docs/architecture.md.

    Returns ``input_ids`` Long[B, L] (L = longest sample, padded with ``pad_id``), ``objective``, ``len_a``,
    ``length``, ``is_random_next`` Long[B], ``masked_positions`` Long[B, P] (padded with 0) and
    ``masked_labels`` Long[B, P] (padded with ``IGNORE_INDEX``), P = most masked positions in the batch (at least 1).
    """
    if not samples:
        raise ValueError("collate needs at least one sample")
    lengths = [len(s.input_ids) for s in samples]
    if max(lengths) > max_len:
        raise ValueError(f"sample of length {max(lengths)} exceeds max_len {max_len}")
    batch_size, seq_len = len(samples), max(lengths)
    num_masked = max(1, max(len(s.masked_positions) for s in samples))
    input_ids = torch.full((batch_size, seq_len), pad_id, dtype=torch.long)
    masked_positions = torch.zeros((batch_size, num_masked), dtype=torch.long)
    masked_labels = torch.full((batch_size, num_masked), IGNORE_INDEX, dtype=torch.long)
    for row, sample in enumerate(samples):
        input_ids[row, :lengths[row]] = torch.from_numpy(np.asarray(sample.input_ids, dtype=np.int64))
        count = len(sample.masked_positions)
        masked_positions[row, :count] = torch.from_numpy(np.asarray(sample.masked_positions, dtype=np.int64))
        masked_labels[row, :count] = torch.from_numpy(np.asarray(sample.masked_labels, dtype=np.int64))
    return {
        "input_ids": input_ids,
        "objective": torch.tensor([int(s.objective) for s in samples], dtype=torch.long),
        "len_a": torch.tensor([int(s.segment_a_length) for s in samples], dtype=torch.long),
        "length": torch.tensor(lengths, dtype=torch.long),
        "is_random_next": torch.tensor([int(s.is_random_next) for s in samples], dtype=torch.long),
        "masked_positions": masked_positions,
        "masked_labels": masked_labels,
    }


def sample_objectives(dataset: Any) -> np.ndarray:
    """Objective id of every sample of a ``ShardDataset`` (int64 [N])."""
    shards = getattr(dataset, "shards", None)
    if shards is not None:  # read the objective column of each shard's index, not the samples' tokens
        return np.concatenate([np.asarray(s.arrays.index["objective"], dtype=np.int64) for s in shards])
    return np.fromiter((int(dataset[i].objective) for i in range(len(dataset))), dtype=np.int64,
                       count=len(dataset))


class SampleOrder:
    """Maps global positions of the run to sample indices; a pure function of (seed, objectives)."""

    def __init__(self, objectives: np.ndarray, seed: int) -> None:
        self.objectives = np.asarray(objectives, dtype=np.int64)
        if self.objectives.size == 0:
            raise ValueError("the shard set holds no samples")
        self.seed = seed
        self._cached: tuple[int, np.ndarray] | None = None

    def __len__(self) -> int:
        return len(self.objectives)

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Sample indices in the order epoch ``epoch`` visits them (a permutation of range(N))."""
        if self._cached is not None and self._cached[0] == epoch:
            return self._cached[1]
        indices, keys, tiebreak = [], [], []
        for objective in np.unique(self.objectives):
            members = np.flatnonzero(self.objectives == objective)
            rng = np.random.default_rng([self.seed, epoch, int(objective)])
            indices.append(rng.permutation(members))
            keys.append((np.arange(len(members)) + 0.5) / len(members))
            tiebreak.append(np.full(len(members), objective))
        merged = np.lexsort((np.concatenate(tiebreak), np.concatenate(keys)))
        order = np.concatenate(indices)[merged]
        self._cached = (epoch, order)
        return order

    def indices(self, start: int, count: int) -> np.ndarray:
        """Sample indices at global positions [start, start + count), crossing epochs as needed."""
        out = np.empty(count, dtype=np.int64)
        done = 0
        while done < count:
            epoch, offset = divmod(start + done, len(self))
            take = min(count - done, len(self) - offset)
            out[done:done + take] = self.epoch_order(epoch)[offset:offset + take]
            done += take
        return out

    def rank_step_indices(self, consumed_samples: int, plan: BatchPlan, rank: int) -> list[np.ndarray]:
        """The ``accumulation`` micro-batches of sample indices rank ``rank`` trains on in the global batch that
        starts at ``consumed_samples``."""
        start = consumed_samples + rank * plan.samples_per_rank
        flat = self.indices(start, plan.samples_per_rank)
        return [flat[i:i + plan.micro_batch_size] for i in range(0, len(flat), plan.micro_batch_size)]


class PretrainLoader:
    """Yields, per optimizer step, this rank's list of collated micro-batches; a daemon thread reads and
    collates ``prefetch_steps`` steps ahead. ``wait_seconds`` accumulates the time the trainer spent blocked."""

    def __init__(self, dataset: Any, order: SampleOrder, plan: BatchPlan, rank: int, consumed_samples: int,
                 pad_id: int, max_len: int, prefetch_steps: int = 4) -> None:
        self.dataset, self.order, self.plan, self.rank = dataset, order, plan, rank
        self.pad_id, self.max_len = pad_id, max_len
        self.consumed_samples = consumed_samples
        self.wait_seconds = 0.0
        self._queue: queue.Queue = queue.Queue(maxsize=prefetch_steps)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._produce, name="pretrain-prefetch", daemon=True)
        self._thread.start()

    def _produce(self) -> None:
        consumed = self.consumed_samples
        try:
            while not self._stop.is_set():
                micro_batches = [collate([self.dataset[int(i)] for i in indices], self.pad_id, self.max_len)
                                 for indices in self.order.rank_step_indices(consumed, self.plan, self.rank)]
                consumed += self.plan.global_batch_size
                item: Any = (consumed, micro_batches)
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
        except BaseException as error:  # surfaced in the trainer's thread by next_step
            self._queue.put((None, error))

    def next_step(self) -> list[dict[str, torch.Tensor]]:
        """This rank's micro-batches for the next optimizer step; advances ``consumed_samples``."""
        started = time.perf_counter()
        consumed, payload = self._queue.get()
        self.wait_seconds += time.perf_counter() - started
        if consumed is None:
            raise RuntimeError("data loader thread failed") from payload
        self.consumed_samples = consumed
        return payload

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def synthetic_batch(cfg: ModelConfig, batch_size: int, seq_len: int, predictions: int,
                    seed: int = 0) -> dict[str, torch.Tensor]:
    """A random full-length bidirectional batch in `collate`'s format with ``predictions`` masked positions per
    sample and NSP labels (for benchmarks and parity checks: real shards are not needed)."""
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
