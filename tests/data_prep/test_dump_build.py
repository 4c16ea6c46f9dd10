"""A Wikipedia dump in the shard build: one unit per byte range (``data_prep.wiki_units``), read where a unit is read,
and the same shards for any number of workers and builders; on the real excerpt and on a multistream dump made
from it. A parquet file is cut the same way, into ranges of row groups (``data_prep.parquet_units``)."""
from __future__ import annotations

from pathlib import Path

import pytest

from data_prep import build, wiki_units
from data_prep.records import Skipped
from data_prep.sources import Unit, input_units, read_unit
from data_prep.wiki_dump import Wikitext
from data_prep.wikitext import iter_pages
from shard_builds import build_three_ways, run_build
from tests.data_prep.test_wiki_units import make_multistream

UNIT_BYTES = 400_000
"""about four units of the 1.7 MB excerpt (its bzip2 blocks are ~250 kB), a few streams each of the multistream one"""


@pytest.fixture(scope="module")
def dump(samples_dir) -> Path:
    return samples_dir / "wiki/enwiki-excerpt.xml.bz2"


@pytest.fixture(scope="module")
def multistream(dump, tmp_path_factory) -> Path:
    return make_multistream(dump, tmp_path_factory.mktemp("multistream"))


def records_of(unit: Unit) -> list[tuple[str, str]]:
    """(``Skipped`` reason or "text", its text or where) of each record of a unit, comparable across readers."""
    return [(r.reason, r.where) if isinstance(r, Skipped) else ("text", str(r)) for r in read_unit(unit)]


def test_the_excerpt_at_the_default_unit_size_is_one_unit_of_the_pages_one_reader_reads(dump):
    assert input_units(str(dump)) == [Unit(str(dump))]
    expected = [("wiki_redirect", f"{dump}: {title}") if redirect else
                ("wiki_not_an_article", f"{dump}: {title}") if namespace != 0 else ("text", text)
                for title, namespace, redirect, text in iter_pages(dump)]
    assert records_of(Unit(str(dump))) == expected
    pages = [r for r in read_unit(Unit(str(dump))) if not isinstance(r, Skipped)]
    assert pages and all(isinstance(r, Wikitext) and r.dump == str(dump) for r in pages)


@pytest.mark.parametrize("which", ["excerpt", "multistream"])
def test_a_dump_is_one_unit_per_range_and_the_ranges_read_every_page_once_in_order(which, dump, multistream):
    path = dump if which == "excerpt" else multistream
    units = input_units(str(path), UNIT_BYTES)
    assert len(units) >= 3
    assert [(u.start, u.stop) for u in units[:1]] == [(0, units[1].start)] and units[-1].stop == path.stat().st_size
    assert all(a.stop == b.start for a, b in zip(units, units[1:]))
    whole = records_of(Unit(str(path)))
    assert [record for unit in units for record in records_of(unit)] == whole
    # a range may own no page (no bzip2 block begins in it), but the pages are spread over the ranges
    assert sum(1 for unit in units if records_of(unit)) >= 3


@pytest.mark.slow
@pytest.mark.parametrize("which, unit_bytes", [("excerpt", UNIT_BYTES), ("multistream", UNIT_BYTES),
                                               ("excerpt", 1_100_000)])  # its first range read by reader processes
def test_dump_units_build_the_same_shards_for_any_workers_or_builders(which, unit_bytes, dump, multistream,
                                                                        vocab_file, tmp_path):
    assert 1_100_000 >= wiki_units.PARALLEL_MIN_BYTES
    path = dump if which == "excerpt" else multistream
    common = ["--input", path, "--vocab", vocab_file, "--max-seq-len", 64, "--seed", 3, "--dupe-factor", 1,
              "--chunk-chars", 300_000, "--samples-per-shard", 2000, "--set", f"unit_bytes={unit_bytes}"]
    one = build_three_ways(common, tmp_path)
    assert len(one["shards"]) >= 2 and one["documents"]["read"] > 0


def test_a_parquet_file_is_one_unit_per_range_of_row_groups(samples_dir, tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    news = (samples_dir / "news/lee.txt").read_text(encoding="utf-8").split("\n\n")
    texts: list[str | None] = [*news[:60], None, *news[60:]]  # row 60: not a string, skipped by its row number
    path = tmp_path / "news.parquet"
    pq.write_table(pa.table({"text": texts}), path, row_group_size=25)
    assert input_units(str(path)) == [Unit(str(path))]
    units = input_units(str(path), path.stat().st_size // 5)
    assert len(units) >= 4 and all(a.stop == b.start for a, b in zip(units, units[1:]))
    whole = records_of(Unit(str(path)))
    assert [record for unit in units for record in records_of(unit)] == whole
    assert [text for kind, text in whole if kind == "text"] == news
    assert [where for kind, where in whole if kind != "text"] == [f"{path} row 60 ('text' is null, not a string)"]


def test_a_build_with_workers_hands_out_where_pages_are_and_deletes_their_files_as_it_goes(dump, vocab_file,
                                                                                         tmp_path, monkeypatch):
    assert dump.stat().st_size >= wiki_units.PARALLEL_MIN_BYTES  # read by reader processes, which spill the pages
    deleted: list[str] = []
    done = build._SpillFiles.done

    def recording(self, chunk):
        before = set(self.pending)
        done(self, chunk)
        deleted.extend(before - set(self.pending))

    monkeypatch.setattr(build._SpillFiles, "done", recording)
    common = ["--input", dump, "--vocab", vocab_file, "--max-seq-len", 64, "--seed", 3, "--chunk-chars", 200_000]
    run_build(*common, "--workers", 2, "--out", tmp_path / "two")
    run_build(*common, "--workers", 1, "--out", tmp_path / "one")
    assert deleted and not any(Path(name).exists() for name in deleted)  # deleted before the build ended
    assert not list(tmp_path.rglob(".pages-*"))
    assert {p.name: p.read_bytes() for p in sorted((tmp_path / "two").iterdir())} == \
        {p.name: p.read_bytes() for p in sorted((tmp_path / "one").iterdir())}
