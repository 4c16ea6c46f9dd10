"""``python -m data_prep.inspect``: the JSON statistics keys, sample dumps and --verify."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from data_prep import inspect as inspect_cli

ROOT_KEYS = {"num_samples", "objective_counts", "masked_fraction", "replacement", "span_lengths", "documents",
             "padding_fraction"}


def test_json_statistics(unilm_shards, capsys):
    inspect_cli.main([str(unilm_shards), "--json"])
    stats = json.loads(capsys.readouterr().out)
    assert ROOT_KEYS <= set(stats)
    assert set(stats["objective_counts"]) == {"bidirectional", "left_to_right", "right_to_left", "seq2seq"}
    assert set(stats["replacement"]) == {"mask", "random", "keep"}
    assert set(stats["documents"]) == {"read", "skipped", "skip_reasons"}
    assert sum(stats["objective_counts"].values()) == stats["num_samples"]
    assert 0 <= stats["padding_fraction"] < 0.5


def test_dump_samples(unilm_shards, capsys):
    inspect_cli.main([str(unilm_shards), "--dump", "3"])
    lines = capsys.readouterr().out.strip().split("\n")
    assert len(lines) == 3
    for line in lines:
        record = json.loads(line)
        assert {"objective", "tokens", "segment_a_length", "length", "masked_positions", "masked_labels",
                "is_random_next"} <= set(record)
        assert record["tokens"][0] == "[CLS]" and record["tokens"][record["segment_a_length"] - 1] == "[SEP]"
        assert len(record["tokens"]) == record["length"]
        assert len(record["masked_labels"]) == len(record["masked_positions"]) > 0
        assert all(record["tokens"][p] != "[SEP]" for p in record["masked_positions"])
    with pytest.raises(SystemExit) as refused:  # a negative count printed nothing and exited 0
        inspect_cli.main([str(unilm_shards), "--dump", "-5"])
    assert refused.value.code == 2 and "--dump N" in capsys.readouterr().err


def test_verify_names_the_bad_shard(unilm_shards, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(unilm_shards, copy)
    command = [sys.executable, "-m", "data_prep.inspect", str(copy), "--verify", "--json"]
    assert subprocess.run(command, capture_output=True).returncode == 0
    path = copy / "shard-00001.bin"
    data = bytearray(path.read_bytes())
    data[200] ^= 1
    path.write_bytes(bytes(data))
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode != 0 and "shard-00001.bin" in result.stderr and "sha256 mismatch" in result.stderr
    path.write_bytes(bytes(data[:-1]))
    with pytest.raises(SystemExit, match="shard-00001.bin"):
        inspect_cli.main([str(copy)])
