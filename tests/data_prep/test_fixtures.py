"""The shared shard fixtures open as ShardDataset and match the architecture's interface."""
from __future__ import annotations

import numpy as np

from data_prep.shard_format import Objective, ShardDataset


def test_fixture_shards_open(unilm_shards, bert_shards, gpt_shards):
    for directory, objectives in [(unilm_shards, set(Objective)), (bert_shards, {Objective.BIDIRECTIONAL}),
                                  (gpt_shards, {Objective.LEFT_TO_RIGHT})]:
        ds = ShardDataset(directory)
        assert len(ds) > 500
        assert {ds[i].objective for i in range(len(ds))} == objectives
        sample = ds[len(ds) - 1]
        assert sample.input_ids.dtype == np.int64 and sample.length <= 64
        assert sample.input_ids[0] == ds.special_tokens["cls"] and sample.input_ids[-1] == ds.special_tokens["sep"]
