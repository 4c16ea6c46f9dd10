"""Shard format: round trips, balanced shards, and readers that refuse bad files by name."""
from __future__ import annotations

import json
import shutil
import struct

import numpy as np
import pytest

from data_prep.shard_format import (
    FORMAT_VERSION,
    INDEX_DTYPE,
    MAGIC,
    ShardArrays,
    ShardDataset,
    ShardError,
    ShardFile,
    token_dtype,
    write_shard,
)


def _arrays(dtype: np.dtype, rng: np.random.Generator, num_samples: int = 5) -> ShardArrays:
    lengths = rng.integers(4, 20, num_samples)
    masked = rng.integers(0, 3, num_samples)
    index = np.zeros(num_samples, INDEX_DTYPE)
    index["length"], index["num_masked"] = lengths, masked
    index["segment_a_length"] = lengths // 2
    index["objective"] = np.arange(num_samples) % 4
    index["is_random_next"] = [1, 0, -1, -1, 0][:num_samples]
    index["token_offset"] = np.cumsum(lengths) - lengths
    index["mask_offset"] = np.cumsum(masked) - masked
    high = np.iinfo(dtype).max
    return ShardArrays(index, rng.integers(0, high, lengths.sum()).astype(dtype),
                       rng.integers(0, 4, masked.sum()).astype("<u2"),
                       rng.integers(0, high, masked.sum()).astype(dtype))


@pytest.mark.parametrize("vocab_size", [30522, 70000])
def test_write_read_round_trip(tmp_path, vocab_size):
    dtype = token_dtype(vocab_size)
    assert dtype == (np.uint16 if vocab_size < 65536 else np.uint32)
    arrays = _arrays(dtype, np.random.default_rng(0))
    write_shard(tmp_path / "s.bin", arrays)
    shard = ShardFile(tmp_path / "s.bin")
    assert shard.token_dtype == dtype and len(shard) == 5
    assert not list(tmp_path.glob("*.tmp*")), "temporary file left behind"
    for i, sample in enumerate(shard):
        row = arrays.index[i]
        t0, m0 = int(row["token_offset"]), int(row["mask_offset"])
        np.testing.assert_array_equal(sample.input_ids, arrays.tokens[t0:t0 + row["length"]])
        np.testing.assert_array_equal(sample.masked_labels, arrays.masked_labels[m0:m0 + row["num_masked"]])
        assert sample.input_ids.dtype == np.int64 and sample.masked_positions.dtype == np.int64
        assert (sample.objective, sample.is_random_next, sample.length) == (i % 4, row["is_random_next"], row["length"])


def test_select_and_concatenate_are_inverse(tmp_path):
    arrays = _arrays(np.dtype("<u2"), np.random.default_rng(1))
    joined = ShardArrays.concatenate([arrays.select(0, 2), arrays.select(2, 5)], np.dtype("<u2"))
    for field in ("index", "tokens", "masked_positions", "masked_labels"):
        np.testing.assert_array_equal(getattr(joined, field), getattr(arrays, field))


def test_dataset_over_fixture_shards_is_balanced(unilm_shards):
    ds = ShardDataset(unilm_shards)
    sizes = [len(s) for s in ds.shards]
    assert len(sizes) >= 2 and max(sizes) - min(sizes) <= 1
    assert len(ds) == sum(sizes) == ds.manifest["num_samples"]
    last_of_first = ds.shards[0][sizes[0] - 1]
    np.testing.assert_array_equal(ds[sizes[0] - 1].input_ids, last_of_first.input_ids)
    np.testing.assert_array_equal(ds[sizes[0]].input_ids, ds.shards[1][0].input_ids)
    np.testing.assert_array_equal(ds[-1].input_ids, ds.shards[-1][sizes[-1] - 1].input_ids)
    assert set(ds.special_tokens) == {"pad", "unk", "cls", "sep", "mask"}
    ds.verify()


@pytest.fixture
def shard_copy(unilm_shards, tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(unilm_shards, out)
    return out


def test_wrong_magic_is_named(shard_copy):
    path = shard_copy / "shard-00000.bin"
    data = bytearray(path.read_bytes())
    data[:8] = b"NOTSHARD"
    path.write_bytes(bytes(data))
    with pytest.raises(ShardError, match="shard-00000.bin: not a shard"):
        ShardFile(path)


def test_unknown_version_is_refused(shard_copy):
    path = shard_copy / "shard-00001.bin"
    data = bytearray(path.read_bytes())
    data[8:12] = struct.pack("<I", FORMAT_VERSION + 1)
    path.write_bytes(bytes(data))
    with pytest.raises(ShardError, match=rf"shard-00001.bin: shard format version {FORMAT_VERSION + 1}"):
        ShardDataset(shard_copy)


def test_manifest_of_other_version_is_refused(shard_copy):
    manifest = json.loads((shard_copy / "manifest.json").read_text())
    manifest["format_version"] = 99
    (shard_copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ShardError, match="manifest.json: shard format version 99"):
        ShardDataset(shard_copy)


def test_truncated_shard_is_named(shard_copy):
    path = shard_copy / "shard-00001.bin"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ShardError, match="shard-00001.bin: .*truncated"):
        ShardDataset(shard_copy)
    with pytest.raises(ShardError, match="shard-00001.bin: .*truncated"):
        ShardFile(path)


def test_modified_shard_fails_verify_by_name(shard_copy):
    path = shard_copy / "shard-00000.bin"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    ds = ShardDataset(shard_copy)  # same size: only the hash can tell
    with pytest.raises(ShardError, match="sha256 mismatch.*shard-00000.bin"):
        ds.verify()


def test_missing_shard_and_missing_manifest(shard_copy, tmp_path):
    (shard_copy / "shard-00001.bin").unlink()
    with pytest.raises(ShardError, match="shard-00001.bin: shard listed in the manifest is missing"):
        ShardDataset(shard_copy)
    with pytest.raises(ShardError, match="no manifest"):
        ShardDataset(tmp_path)


def test_file_is_not_pickle(unilm_shards):
    head = (unilm_shards / "shard-00000.bin").read_bytes()[:8]
    assert head == MAGIC
