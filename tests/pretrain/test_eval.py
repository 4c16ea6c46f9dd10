"""The held-out loss (`pretrain.trainer.EvalSet`): each sample of the evaluated set counted once over the ranks,
and the loss the training objective over that whole set, whatever the world size and micro-batch size."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from common.paths import REPO_ROOT
from data_prep.shard_format import ShardDataset
from pretrain.batch_plan import plan_batch
from pretrain.config import load_config
from pretrain.data import collate
from pretrain.model import build_model, preset
from pretrain.trainer import EvalSet, eval_passes


@pytest.mark.parametrize("count", [1, 7, 13, 40])
@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("micro", [1, 2, 4])
def test_every_held_out_sample_is_counted_once_over_the_ranks(count: int, world_size: int, micro: int) -> None:
    indices = np.random.default_rng(count).permutation(100)[:count]
    passes = [eval_passes(indices, rank, world_size, micro) for rank in range(world_size)]
    assert len({len(p) for p in passes}) == 1  # as many forward passes on every rank (ZeRO-3's collectives)
    counted = [int(i) for rank_passes in passes for chunk, used in rank_passes if used for i in chunk]
    assert sorted(counted) == sorted(indices.tolist())
    assert all(0 < len(chunk) <= micro for rank_passes in passes for chunk, _ in rank_passes)


class Engine:
    """What `EvalSet.evaluate` uses of a DeepSpeed engine, around a plain model."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.module, self.device = model, torch.device("cpu")

    def eval(self) -> None:
        self.module.eval()

    def __call__(self, **batch: torch.Tensor):
        return self.module(**batch)


def test_the_held_out_loss_is_the_objective_over_the_whole_set_for_any_micro_batch(unilm_shards, tmp_path,
                                                                                  one_rank_group) -> None:
    """13 held-out samples in passes of 2, 3 or 5 give the loss of one batch of all 13 (mean over their predicted
    tokens plus mean NSP loss over their NSP samples), where a mean of per-pass means did not."""
    torch.manual_seed(0)
    model = build_model(dataclasses.replace(preset("tiny"), vocab_size=4000, max_position_embeddings=64))
    engine = Engine(model)
    dataset = ShardDataset(unilm_shards)
    losses = {}
    for micro in (2, 3, 5):
        cfg = load_config(REPO_ROOT / "pretrain/configs/tiny.yaml",
                          [f"data.shards={unilm_shards}", f"data.eval_shards={unilm_shards}", f"out_dir={tmp_path}",
                           "train.eval_samples=13", f"train.micro_batch_size={micro}",
                           f"train.global_batch_size={micro}"])
        eval_set = EvalSet(cfg, plan_batch(micro, micro, 1), 0, 1, pad_id=0, max_len=64)
        losses[micro] = eval_set.evaluate(engine)
        evaluated = [int(i) for chunk, _ in eval_set.passes for i in chunk]
    with torch.no_grad():
        whole = model(**collate([dataset[i] for i in evaluated], 0, 64))
    assert len(evaluated) == 13
    for micro, scores in losses.items():
        assert scores["eval_loss"] == pytest.approx(float(whole.loss), rel=1e-5), micro
        for name, value in whole.objective_losses.items():
            assert scores[f"eval_loss_{name}"] == pytest.approx(float(value), rel=1e-5), (micro, name)
