"""Whole-word masking on real builds of the sample corpus: no word split, the token budget, one replacement per
word, determinism, the manifest and inspect fields, and unchanged default bytes."""
from __future__ import annotations

import json

import numpy as np
import pytest

from data_prep import inspect
from data_prep.inspect import shard_statistics
from data_prep.shard_format import ShardDataset
from data_prep.whole_words import continuation_table, word_breaks
from shard_builds import run_build


def directory_bytes(directory) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.name != "manifest.json"}


def build(samples_dir, vocab_file, out, *flags):
    return run_build("--input", samples_dir / "news/lee.txt", "--vocab", vocab_file, "--max-seq-len", 64,
                     *flags, "--out", out)


@pytest.mark.parametrize("recipe", ["unilm", "bert"])
def test_whole_words_are_masked_within_the_budget_one_choice_per_word(samples_dir, vocab_file, tmp_path, recipe):
    manifest = build(samples_dir, vocab_file, tmp_path / "ww", "--recipe", recipe, "--whole-word-mask")
    assert manifest["masking"]["whole_word_mask"] is True
    ds = ShardDataset(tmp_path / "ww")
    vocab = (tmp_path / "ww/vocab.txt").read_text(encoding="utf-8").split("\n")
    continuation = continuation_table(tuple(vocab))
    stats = shard_statistics(ds)
    assert stats["whole_word_mask"] is True and stats["word_breaks"] == 0 and stats["special_tokens_masked"] == 0
    words_of_two = 0
    for i in range(len(ds)):
        sample = ds[i]
        maskable = sample.length - (2 if sample.segment_a_length == sample.length else 3)
        assert 0 < len(sample.masked_positions) <= max(1, round(0.15 * maskable))
        original = sample.input_ids.copy()
        original[sample.masked_positions] = sample.masked_labels
        positions = sample.masked_positions.tolist()
        shown = sample.input_ids[positions].tolist()
        labels = sample.masked_labels.tolist()
        for j in range(1, len(positions)):  # a continuation shares its word start's treatment
            if positions[j] == positions[j - 1] + 1 and continuation[labels[j]] \
                    and positions[j] not in (1, sample.segment_a_length):
                words_of_two += 1
                mask_id = vocab.index("[MASK]")
                assert (shown[j] == mask_id) == (shown[j - 1] == mask_id)
                assert (shown[j] == labels[j]) == (shown[j - 1] == labels[j - 1])
    assert words_of_two > 0  # the corpus has words of several pieces, and some were masked
    masked = stats["masked_fraction"]
    assert 0.12 < masked <= 0.15


def test_the_default_build_splits_words_and_whole_word_builds_are_deterministic(samples_dir, vocab_file, tmp_path):
    default = build(samples_dir, vocab_file, tmp_path / "default")
    assert default["masking"]["whole_word_mask"] is False
    assert shard_statistics(ShardDataset(tmp_path / "default"))["word_breaks"] > 0
    build(samples_dir, vocab_file, tmp_path / "a", "--whole-word-mask")
    build(samples_dir, vocab_file, tmp_path / "b", "--set", "masking.whole_word_mask=true")
    assert directory_bytes(tmp_path / "a") == directory_bytes(tmp_path / "b")
    assert directory_bytes(tmp_path / "a") != directory_bytes(tmp_path / "default")


def test_default_builds_keep_their_bytes_without_the_key(samples_dir, vocab_file, tmp_path):
    build(samples_dir, vocab_file, tmp_path / "plain")
    build(samples_dir, vocab_file, tmp_path / "off", "--set", "masking.whole_word_mask=false")
    assert directory_bytes(tmp_path / "plain") == directory_bytes(tmp_path / "off")
    manifest = json.loads((tmp_path / "plain/manifest.json").read_text())
    del manifest["masking"]["whole_word_mask"]  # as an older build wrote it: reads as off
    (tmp_path / "plain/manifest.json").write_text(json.dumps(manifest))
    assert shard_statistics(ShardDataset(tmp_path / "plain"))["whole_word_mask"] is False


def test_inspect_dump_and_json_show_word_breaks(samples_dir, vocab_file, tmp_path, capsys):
    build(samples_dir, vocab_file, tmp_path / "ww", "--whole-word-mask")
    capsys.readouterr()
    inspect.main([str(tmp_path / "ww"), "--dump", "3"])
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(records) == 3 and all(r["word_breaks"] == 0 for r in records)
    inspect.main([str(tmp_path / "ww"), "--json", "--verify"])
    stats = json.loads(capsys.readouterr().out)
    assert stats["whole_word_mask"] is True and stats["word_breaks"] == 0


def test_word_breaks_counts_pieces_masked_apart_from_their_word():
    continuation = np.array([False] * 10 + [True] * 5)  # ids 10-14 are ## pieces
    tokens = np.array([2, 5, 10, 11, 6, 3], dtype=np.int64)  # [CLS] w ##a ##b v [SEP]
    args = (np.array([0]), np.array([6]), np.array([6]))
    whole = word_breaks(tokens, *args, np.array([3]), np.array([1, 2, 3]), np.array([5, 10, 11]), continuation)
    assert whole.tolist() == [0]
    start_only = word_breaks(tokens, *args, np.array([1]), np.array([1]), np.array([5]), continuation)
    assert start_only.tolist() == [1]
    middle = word_breaks(tokens, *args, np.array([1]), np.array([2]), np.array([10]), continuation)
    assert middle.tolist() == [2]
