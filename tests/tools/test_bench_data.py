"""tools.bench_data's dump section on the sample excerpt: the reading and per-chunk costs per MB, the workers one
main process feeds (the feeding apart from the finalizing after it) and the worker's tokens/s against raw
``tokenizers``, each a positive number."""
from __future__ import annotations

import bz2
import json
import math

from data_prep.config import BuildConfig
from data_prep.instances import InstanceConfig
from data_prep.vocab import load_vocab
from data_prep.wiki_units import read_pages
from tools import bench_data


def test_repeated_dump_holds_the_excerpt_pages_that_many_times(samples_dir, tmp_path):
    excerpt = samples_dir / "wiki/enwiki-excerpt.xml.bz2"
    dump = bench_data.repeated_dump(excerpt, 2, tmp_path / "dump.xml.bz2")
    once = list(read_pages(excerpt, readers=1))
    assert list(read_pages(dump, readers=1)) == once * 2
    assert bz2.open(dump).read().count(b"<siteinfo>") == 1


def test_dump_section_gives_positive_costs_and_ratios(samples_dir, vocab_file, tmp_path):
    dump = bench_data.repeated_dump(samples_dir / "wiki/enwiki-excerpt.xml.bz2", 1, tmp_path / "dump.xml.bz2")
    cfg = BuildConfig(inputs=(str(dump),), vocab_path=str(vocab_file), vocab_sha256=load_vocab(vocab_file).sha256,
                      instances=InstanceConfig(recipe="unilm", max_seq_len=64), chunk_chars=200_000)
    result = bench_data.measure_dump(dump, cfg, tmp_path, repeat=1)
    numbers = ("main_read_cpu_s_per_mb", "readers_cpu_s_per_mb", "main_build_cpu_s_per_mb", "main_feed_cpu_s_per_mb",
               "finalize_cpu_s_per_mb", "worker_cpu_s_per_mb", "workers_fed", "workers_fed_by_read",
               "workers_fed_whole_build", "worker_tokens_per_s", "raw_tokens_per_s",
               "ratio_worker_vs_raw")
    for key in numbers:
        assert isinstance(result[key], float) and math.isfinite(result[key]) and result[key] > 0, key
    assert (result["workers_fed_goal"], result["ratio_worker_vs_raw_goal"]) == (64.0, 0.8)
    assert result["dump_bytes"] == dump.stat().st_size and result["pages"] > 100 and result["chunks"] > 1
    assert result["tokens"] > 0 and result["readers_cpu_s_per_mb"] > result["main_read_cpu_s_per_mb"]
    assert math.isclose(result["workers_fed"], result["worker_cpu_s_per_mb"] / result["main_feed_cpu_s_per_mb"])
    assert math.isclose(result["workers_fed_whole_build"],
                        result["worker_cpu_s_per_mb"] / result["main_build_cpu_s_per_mb"])
    assert math.isclose(result["main_feed_cpu_s_per_mb"] + result["finalize_cpu_s_per_mb"],
                        result["main_build_cpu_s_per_mb"])
    json.dumps(result)


def test_the_margin_is_the_feeding_cost_per_mb_between_a_dump_and_a_smaller_one(tmp_path):
    smaller = tmp_path / "smaller.xml.bz2"
    smaller.write_bytes(b"x" * 1_000_000)
    margin = bench_data._margin({"feed_main": 0.5, "feed_smaller": 0.2}, 4.0, smaller, worker_per_mb=0.9)
    assert math.isclose(margin["main_feed_margin_cpu_s_per_mb"], 0.1)
    assert math.isclose(margin["workers_fed_at_margin"], 9.0)
    assert bench_data._margin({}, 4.0, None, 0.9) == {}
