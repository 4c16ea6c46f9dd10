"""The training-engine benchmark's 2-rank measurements (`tools.bench_train`)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools.bench_train import data_wait_share


@pytest.mark.slow
def test_the_data_wait_run_uses_cpu_ranks_even_where_deepspeed_would_pick_a_gpu(
        unilm_shards: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a one-GPU machine's environment: DeepSpeed's CUDA accelerator, one device for two ranks
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    share = data_wait_share(str(unilm_shards), tmp_path)
    records = [json.loads(line) for line in (tmp_path / "wait_run" / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 30 and {r["step"] for r in records} == set(range(1, 31))
    assert 0 <= share["data_wait_share"] < 1 and share["samples_per_s"] > 0
    assert share["step_time_s"] == pytest.approx(sum(r["step_time_s"] for r in records[1:]) / 29)
