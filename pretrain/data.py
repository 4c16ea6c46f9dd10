"""Streaming pre-training data: global sample order, per-rank slices, background prefetch, collate.

Sample order (independent of world size)
    Global position ``p`` of the run maps to sample ``epoch_order(p // N)[p % N]`` of the manifest's ``N``
    samples. Each epoch's order is a seeded permutation that keeps the manifest's objective proportions in every
    window: every objective is permuted on its own (seed, epoch, objective), and its k-th sample gets the ideal
    fractional position (k + ½) / n_objective; merging the objectives by that position interleaves them evenly,
    so each global batch holds each objective within ±2 of its share (UniLM: 1/3, 1/3, 1/6, 1/6): the merge
    bounds the error by 1 + share·(K − 2) for K objectives, 1.67 for a share of 1/3, an epoch boundary
    included.

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


def collate(samples: Sequence[Any], pad_id: int, max_len: int, pack: bool = False) -> dict[str, torch.Tensor]:
    """Pad ``data_prep.shard_format.Sample`` objects into the batch dict of docs/architecture.md.

    Returns ``objective``, ``len_a``, ``length``, ``is_random_next`` Long[S] per sample and ``masked_labels``
    Long[S, P] (padded with ``IGNORE_INDEX``), P = most masked positions of a sample (at least 1), and:
    - ``pack=False``: ``input_ids`` Long[S, L], one sample per row (L = longest sample, padded with ``pad_id``),
      ``masked_positions`` Long[S, P] within each row (padded with 0);
    - ``pack=True``: the samples packed into as few rows of the longest sample's length as `pack_rows` finds,
      ``input_ids`` Long[R, L] (L = that length), ``masked_positions`` Long[S, P] into the flattened R × L
      tokens, and ``position_ids`` (each token's position in its sample), ``token_sample`` (its sample's index, -1
      at padding) Long[R, L] and ``sample_starts`` Long[S] (each sample's first token, flattened) for the model's
      packed path.
    """
    if not samples:
        raise ValueError("collate needs at least one sample")
    lengths = [len(s.input_ids) for s in samples]
    if max(lengths) > max_len:
        raise ValueError(f"sample of length {max(lengths)} exceeds max_len {max_len}")
    # Rows as long as the longest sample: never wider than one sample per row, so attention costs no more per row.
    rows = pack_rows(lengths, max(lengths)) if pack else [[index] for index in range(len(samples))]
    seq_len = max(sum(lengths[index] for index in row) for row in rows)
    num_masked = max(1, max(len(s.masked_positions) for s in samples))
    input_ids = torch.full((len(rows), seq_len), pad_id, dtype=torch.long)
    masked_positions = torch.zeros((len(samples), num_masked), dtype=torch.long)
    masked_labels = torch.full((len(samples), num_masked), IGNORE_INDEX, dtype=torch.long)
    if pack:
        position_ids = torch.zeros((len(rows), seq_len), dtype=torch.long)
        token_sample = torch.full((len(rows), seq_len), -1, dtype=torch.long)
        sample_starts = torch.zeros(len(samples), dtype=torch.long)
    for row_index, row in enumerate(rows):
        offset = 0
        for index in row:
            sample, end = samples[index], offset + lengths[index]
            input_ids[row_index, offset:end] = torch.from_numpy(np.asarray(sample.input_ids, dtype=np.int64))
            count = len(sample.masked_positions)
            positions = torch.from_numpy(np.asarray(sample.masked_positions, dtype=np.int64))
            masked_labels[index, :count] = torch.from_numpy(np.asarray(sample.masked_labels, dtype=np.int64))
            if pack:  # positions index the flattened rows
                position_ids[row_index, offset:end] = torch.arange(lengths[index])
                token_sample[row_index, offset:end] = index
                sample_starts[index] = row_index * seq_len + offset
                positions = positions + sample_starts[index]
            masked_positions[index, :count] = positions
            offset = end
    batch = {
        "input_ids": input_ids,
        "objective": torch.tensor([int(s.objective) for s in samples], dtype=torch.long),
        "len_a": torch.tensor([int(s.segment_a_length) for s in samples], dtype=torch.long),
        "length": torch.tensor(lengths, dtype=torch.long),
        "is_random_next": torch.tensor([int(s.is_random_next) for s in samples], dtype=torch.long),
        "masked_positions": masked_positions,
        "masked_labels": masked_labels,
    }
    if pack:
        batch.update(position_ids=position_ids, token_sample=token_sample, sample_starts=sample_starts)
    return batch


def pack_rows(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Sample indices grouped into rows of at most ``capacity`` tokens: first-fit over the samples from longest to
    shortest (ties in sample order). Deterministic; a row lists its samples longest first. Samples of full length
    get a row each, in their order."""
    rows: list[list[int]] = []
    free: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        row = next((r for r, room in enumerate(free) if room >= lengths[index]), None)
        if row is None:
            rows.append([])
            free.append(capacity)
            row = len(rows) - 1
        rows[row].append(index)
        free[row] -= lengths[index]
    return rows


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


def to_device(batch: dict[str, torch.Tensor], device: torch.device | str | None) -> dict[str, torch.Tensor]:
    """``batch`` on ``device``. CPU (or None): the same tensors, no copy. An accelerator: each tensor through pinned
    (page-locked) host memory and a ``non_blocking`` copy, ordered on the current stream of ``device`` — the
    consumer must not read the result on another stream without waiting for this one (`PretrainLoader` does)."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cpu":
        return batch
    # torch's own pinning: its caching host allocator recycles these per-step buffers once their copy is done
    # (DeepSpeed's accelerator.pin_memory adds every call to a never-decreasing process-wide tally)
    return {name: tensor.pin_memory().to(device, non_blocking=True) for name, tensor in batch.items()}


class _DeviceFeed:
    """Issues a step's host→device copies on a side stream of the rank's device from the loader thread, so they
    overlap the compute of earlier steps; ``receive`` (trainer thread) makes the compute stream wait for them."""

    def __init__(self, device: torch.device) -> None:
        from deepspeed.accelerator import get_accelerator
        self.accelerator = get_accelerator()
        index = device.index if device.index is not None else self.accelerator.current_device()
        self.device = torch.device(device.type, index)
        self.stream = None

    def send(self, micro_batches: list[dict[str, torch.Tensor]]) -> tuple[list[dict[str, torch.Tensor]], Any]:
        """In the loader thread: (batches on the device, the event that marks their copies done)."""
        if self.stream is None:  # the CUDA current device is per thread: bind this one too
            self.accelerator.set_device(self.device.index)
            self.stream = self.accelerator.Stream(device=self.device)
        with self.accelerator.stream(self.stream):
            moved = [to_device(batch, self.device) for batch in micro_batches]
            copied = self.accelerator.Event()
            copied.record(self.stream)
        return moved, copied

    def receive(self, micro_batches: list[dict[str, torch.Tensor]], copied: Any) -> list[dict[str, torch.Tensor]]:
        """In the trainer thread: the compute stream waits for the copies; the caching allocator learns that the
        tensors are used there (else it could hand their memory to the side stream again too early)."""
        compute = self.accelerator.current_stream(self.device.index)
        compute.wait_event(copied)
        for batch in micro_batches:
            for tensor in batch.values():
                tensor.record_stream(compute)
        return micro_batches


def step_normalizers(dataset: Any, indices: np.ndarray, plan: BatchPlan, causal_lm: bool) -> dict[str, torch.Tensor]:
    """The model's ``token_normalizer`` and ``nsp_normalizer`` for every micro-batch of the global batch of
    ``indices``: its predicted tokens (masked positions; a causal LM's next tokens) and NSP samples, each divided by
    the step's number of micro-batches over all ranks (`BatchPlan.per_micro_batch`): the step then minimises the
    mean loss over the global batch's tokens plus the mean NSP loss over its NSP samples, as one batch would, where
    a mean per micro-batch weighs a token by its micro-batch's count, and NSP by how many micro-batches happen to
    hold an NSP sample. Read from the shard index, on every rank alike: no
    collective."""
    rows = dataset.index_rows(indices)
    if causal_lm:  # position t predicts token t + 1 of the sample
        tokens, nsp = int(rows["length"].astype(np.int64).sum()) - len(rows), 0
    else:
        tokens = int(rows["num_masked"].astype(np.int64).sum())
        nsp = int(((rows["objective"] == BIDIRECTIONAL) & (rows["is_random_next"] >= 0)).sum())
    return {name: torch.tensor(plan.per_micro_batch(count), dtype=torch.float32)
            for name, count in (("token_normalizer", tokens), ("nsp_normalizer", nsp))}


class PretrainLoader:
    """Yields, per optimizer step, this rank's list of collated micro-batches on ``device``; a daemon thread reads,
    collates and (on an accelerator) copies ``prefetch_steps`` steps ahead: pinned host memory, ``non_blocking``
    copies on a side stream, so the transfers overlap compute. On the CPU batches are handed over as collated (no
    copy). ``pack``: several samples per row (`collate`). ``wait_seconds`` accumulates the time the trainer spent
    blocked."""

    def __init__(self, dataset: Any, order: SampleOrder, plan: BatchPlan, rank: int, consumed_samples: int,
                 pad_id: int, max_len: int, prefetch_steps: int = 4, device: torch.device | str | None = None,
                 pack: bool = False, causal_lm: bool = False) -> None:
        self.dataset, self.order, self.plan, self.rank, self.causal_lm = dataset, order, plan, rank, causal_lm
        self.pad_id, self.max_len, self.pack = pad_id, max_len, pack
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._feed = _DeviceFeed(self.device) if self.device.type != "cpu" else None
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
                normalizers = step_normalizers(self.dataset, self.order.indices(consumed, self.plan.global_batch_size),
                                               self.plan, self.causal_lm)
                micro_batches = [dict(collate([self.dataset[int(i)] for i in indices], self.pad_id, self.max_len,
                                              self.pack), **normalizers)
                                 for indices in self.order.rank_step_indices(consumed, self.plan, self.rank)]
                copied = None
                if self._feed is not None:
                    micro_batches, copied = self._feed.send(micro_batches)
                consumed += self.plan.global_batch_size
                item: Any = (consumed, micro_batches, copied)
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
        except BaseException as error:  # surfaced in the trainer's thread by next_step
            self._queue.put((None, error, None))

    def next_step(self) -> list[dict[str, torch.Tensor]]:
        """This rank's micro-batches for the next optimizer step; advances ``consumed_samples``."""
        started = time.perf_counter()
        consumed, payload, copied = self._queue.get()
        self.wait_seconds += time.perf_counter() - started
        if consumed is None:
            raise RuntimeError("data loader thread failed") from payload
        self.consumed_samples = consumed
        if self._feed is not None:
            payload = self._feed.receive(payload, copied)
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
