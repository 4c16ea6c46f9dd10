"""Streaming loader on real shards: collate, world-size-independent order, per-batch objective mix, resume."""
from pathlib import Path

import numpy as np
import pytest
import torch

from data_prep.shard_format import Objective, ShardDataset
from pretrain.batch_plan import plan_batch
from pretrain.data import PretrainLoader, SampleOrder, collate, pack_rows, sample_objectives
from pretrain.model import IGNORE_INDEX


@pytest.fixture(scope="module")
def dataset(unilm_shards: Path) -> ShardDataset:
    return ShardDataset(unilm_shards)


def test_collate_matches_the_architecture_contract(dataset: ShardDataset) -> None:
    samples = [dataset[i] for i in range(6)]
    pad_id = dataset.special_tokens["pad"]
    batch = collate(samples, pad_id, max_len=64)
    lengths = [s.length for s in samples]
    assert batch["input_ids"].shape == (6, max(lengths)) and batch["input_ids"].dtype == torch.long
    for row, sample in enumerate(samples):
        assert batch["input_ids"][row, :sample.length].tolist() == sample.input_ids.tolist()
        assert (batch["input_ids"][row, sample.length:] == pad_id).all()
        count = len(sample.masked_positions)
        assert batch["masked_positions"][row, :count].tolist() == sample.masked_positions.tolist()
        assert batch["masked_labels"][row, :count].tolist() == sample.masked_labels.tolist()
        assert (batch["masked_labels"][row, count:] == IGNORE_INDEX).all()
        assert (batch["masked_positions"][row, count:] == 0).all()
    assert batch["objective"].tolist() == [s.objective for s in samples]
    assert batch["len_a"].tolist() == [s.segment_a_length for s in samples]
    assert batch["length"].tolist() == lengths
    assert batch["is_random_next"].tolist() == [s.is_random_next for s in samples]
    assert set(batch) == {"input_ids", "objective", "len_a", "length", "is_random_next", "masked_positions",
                          "masked_labels"}
    with pytest.raises(ValueError, match="exceeds max_len"):
        collate(samples, pad_id, max_len=max(lengths) - 1)


def test_pack_rows_fills_rows_first_fit_longest_first() -> None:
    assert pack_rows([64, 64, 64], 64) == [[0], [1], [2]]  # full-length samples: a row each, in order
    assert pack_rows([30, 64, 20, 40, 34], 64) == [[1], [3, 2], [4, 0]]
    rng = np.random.default_rng(0)
    for _ in range(50):
        lengths = rng.integers(1, 65, size=int(rng.integers(1, 40))).tolist()
        rows = pack_rows(lengths, 64)
        assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
        assert all(sum(lengths[i] for i in row) <= 64 for row in rows)
        assert len(rows) >= -(-sum(lengths) // 64)
        assert rows == pack_rows(lengths, 64)


def test_packed_collate_holds_every_sample_where_its_fields_say(dataset: ShardDataset) -> None:
    shortest = sorted(range(len(dataset)), key=lambda i: dataset[i].length)[:24]
    samples = [dataset[i] for i in sorted(shortest + list(range(24)))]  # mostly full-length, and short ones
    pad_id = dataset.special_tokens["pad"]
    plain, packed = collate(samples, pad_id, max_len=64), collate(samples, pad_id, max_len=64, pack=True)
    rows, width = packed["input_ids"].shape
    assert width == plain["input_ids"].shape[1]  # rows no wider than the longest sample
    assert rows < len(samples) - 12  # short samples share rows
    for key in ("objective", "len_a", "length", "is_random_next", "masked_labels"):
        assert torch.equal(packed[key], plain[key]), key
    flat_ids, flat_sample = packed["input_ids"].flatten(), packed["token_sample"].flatten()
    flat_positions = packed["position_ids"].flatten()
    for index, sample in enumerate(samples):
        tokens = slice(int(packed["sample_starts"][index]), int(packed["sample_starts"][index]) + sample.length)
        assert flat_ids[tokens].tolist() == sample.input_ids.tolist()
        assert (flat_sample[tokens] == index).all() and flat_positions[tokens].tolist() == list(range(sample.length))
        assert tokens.start // width == (tokens.stop - 1) // width  # a sample never spans two rows
        count = len(sample.masked_positions)
        assert torch.equal(flat_ids[packed["masked_positions"][index, :count]],
                           plain["input_ids"][index, plain["masked_positions"][index, :count]])
    assert (flat_ids[flat_sample < 0] == pad_id).all()
    assert int((flat_sample >= 0).sum()) == sum(s.length for s in samples)


def test_objectives_come_from_the_index(dataset: ShardDataset) -> None:
    objectives = sample_objectives(dataset)
    assert len(objectives) == len(dataset)
    assert [dataset[i].objective for i in range(0, len(dataset), 97)] == objectives[::97].tolist()


@pytest.mark.parametrize("world", [1, 2, 3])
def test_every_sample_once_per_epoch_at_any_world_size(dataset: ShardDataset, world: int) -> None:
    order = SampleOrder(sample_objectives(dataset), seed=7)
    plan = plan_batch(24, 4, world) if world != 3 else plan_batch(24, 2, 3)
    n = len(order)
    seen = []
    for consumed in range(0, 2 * n + plan.global_batch_size, plan.global_batch_size):
        step = [np.concatenate(order.rank_step_indices(consumed, plan, rank)) for rank in range(world)]
        # the ranks' slices tile the global batch, identical to the world-size-independent order
        assert np.concatenate(step).tolist() == order.indices(consumed, plan.global_batch_size).tolist()
        seen.extend(np.concatenate(step).tolist())
    assert sorted(seen[:n]) == list(range(n))          # epoch 0: every sample exactly once
    assert sorted(seen[n:2 * n]) == list(range(n))     # epoch 1 too
    assert seen[:n] != seen[n:2 * n]                   # and reshuffled


def test_order_depends_on_seed_only(dataset: ShardDataset) -> None:
    objectives = sample_objectives(dataset)
    a, b = SampleOrder(objectives, 3), SampleOrder(objectives, 3)
    assert a.indices(100, 500).tolist() == b.indices(100, 500).tolist()
    assert a.indices(0, 50).tolist() != SampleOrder(objectives, 4).indices(0, 50).tolist()


def test_objective_mix_holds_in_every_global_batch(dataset: ShardDataset) -> None:
    objectives = sample_objectives(dataset)
    share = np.bincount(objectives, minlength=len(Objective)) / len(objectives)
    assert share[Objective.BIDIRECTIONAL] == pytest.approx(1 / 3, abs=0.05)  # the unilm recipe's mix
    assert share[Objective.SEQ2SEQ] == pytest.approx(1 / 3, abs=0.05)
    order = SampleOrder(objectives, seed=1)
    for global_batch in (30, 330):
        for consumed in range(0, 3 * len(objectives), global_batch):
            counts = np.bincount(objectives[order.indices(consumed, global_batch)], minlength=len(Objective))
            # within ±2 of the share (±1 per epoch side when a batch straddles an epoch boundary)
            assert np.all(np.abs(counts - share * global_batch) <= 2), (consumed, counts, share * global_batch)


def test_prefetching_loader_streams_the_rank_slice_and_resumes(dataset: ShardDataset) -> None:
    order = SampleOrder(sample_objectives(dataset), seed=5)
    plan = plan_batch(12, 3, 2)
    pad_id = dataset.special_tokens["pad"]

    def stream(rank: int, consumed: int, steps: int) -> list[list[int]]:
        loader = PretrainLoader(dataset, order, plan, rank, consumed, pad_id, 64, prefetch_steps=2)
        try:
            out = []
            for _ in range(steps):
                micro_batches = loader.next_step()
                assert len(micro_batches) == plan.gradient_accumulation_steps
                out.append([row for batch in micro_batches for row in batch["input_ids"][:, 1].tolist()])
            assert loader.consumed_samples == consumed + steps * plan.global_batch_size
            return out
        finally:
            loader.close()

    full = stream(1, 0, 5)
    expected = [[int(dataset[int(i)].input_ids[1]) for i in np.concatenate(order.rank_step_indices(c, plan, 1))]
                for c in range(0, 60, 12)]
    assert full == expected
    assert stream(1, 36, 2) == full[3:]  # resume at consumed_samples: no replay, no gap


def test_on_the_cpu_batches_are_handed_over_without_a_copy(dataset: ShardDataset) -> None:
    from pretrain.data import to_device

    batch = collate([dataset[i] for i in range(4)], dataset.special_tokens["pad"], 64)
    for device in (None, "cpu", torch.device("cpu")):
        moved = to_device(batch, device)
        assert moved is batch  # zero-copy: the very tensors the collate made
    order, plan = SampleOrder(sample_objectives(dataset), seed=5), plan_batch(6, 3, 1)
    loader = PretrainLoader(dataset, order, plan, 0, 0, dataset.special_tokens["pad"], 64, prefetch_steps=1,
                            device="cpu")
    try:
        assert loader.device == torch.device("cpu") and loader._feed is None  # no side stream, no pinning
        for micro_batch, indices in zip(loader.next_step(), order.rank_step_indices(0, plan, 0)):
            expected = collate([dataset[int(i)] for i in indices], dataset.special_tokens["pad"], 64)
            assert all(torch.equal(micro_batch[k], expected[k]) and micro_batch[k].device.type == "cpu"
                       for k in expected)
    finally:
        loader.close()
