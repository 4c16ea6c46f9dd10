"""Wikipedia dumps cut into byte ranges: every page read once, in order, however the dump is cut, on the real
excerpt (one bzip2 stream) and on a multistream dump with its index made from it."""
from __future__ import annotations

import bz2
import re
from pathlib import Path

import pytest

from data_prep import wiki_units
from data_prep.wiki_units import Piece, dump_units, multistream_index, read_pages, read_piece, stream_offsets
from data_prep.wikitext import iter_pages


@pytest.fixture(scope="module")
def dump(samples_dir) -> Path:
    return samples_dir / "wiki/enwiki-excerpt.xml.bz2"


@pytest.fixture(scope="module")
def pages(dump) -> list:
    return list(iter_pages(dump))


def make_multistream(dump: Path, out: Path, pages_per_stream: int = 20) -> Path:
    """A multistream dump as Wikimedia writes one: the header (site info) as stream 0, then streams of
    ``pages_per_stream`` pages, then ``</mediawiki>``; and its index (``offset:page_id:title`` per page)."""
    xml = bz2.decompress(dump.read_bytes())
    starts = [m.start() for m in re.finditer(rb"  <page>", xml)]
    end = xml.rindex(b"</mediawiki>")
    header, bodies = xml[:starts[0]], [xml[a:b] for a, b in zip(starts, starts[1:] + [end])]
    path = out / "enwiki-test-pages-articles-multistream.xml.bz2"
    index_lines, offset = [], 0
    with open(path, "wb") as f:
        for group in [[header]] + [bodies[i:i + pages_per_stream] for i in range(0, len(bodies), pages_per_stream)] \
                + [[xml[end:]]]:
            if group[0] is not header and b"<page>" in group[0]:
                for body in group:
                    page_id = re.search(rb"<id>(\d+)</id>", body).group(1).decode()
                    title = re.search(rb"<title>(.*?)</title>", body).group(1).decode()
                    index_lines.append(f"{offset}:{page_id}:{title}")
            data = bz2.compress(b"".join(group))
            f.write(data)
            offset += len(data)
    with bz2.open(path.with_name(path.name.replace(".xml.bz2", "-index.txt.bz2")), "wt") as f:
        f.write("\n".join(index_lines) + "\n")
    return path


@pytest.fixture(scope="module")
def multistream(dump, tmp_path_factory) -> Path:
    return make_multistream(dump, tmp_path_factory.mktemp("multistream"))


def test_the_excerpt_cut_anywhere_gives_every_page_once_in_order(dump, pages):
    size = dump.stat().st_size
    for step in (size, 700_000, 250_000, 97_531):  # cuts inside blocks, several cuts in one block, ranges of none
        cuts = [*range(0, size, step), size]
        got = [page for a, b in zip(cuts, cuts[1:]) for page in read_piece(Piece(str(dump), a, b, "blocks"))]
        assert got == pages, step
    assert len(pages) == 206


def test_an_uncompressed_dump_cut_anywhere_gives_every_page_once(dump, pages, tmp_path):
    xml = tmp_path / "enwiki-excerpt.xml"
    xml.write_bytes(bz2.decompress(dump.read_bytes()))
    units = dump_units(xml, 1_000_000)
    assert len(units) == 7 and all(part.kind == "xml" for part in wiki_units.pieces(xml, *units[0], readers=1))
    assert [page for start, stop in units for page in read_pages(xml, start, stop, readers=1)] == pages
    assert list(read_pages(xml, readers=2)) == pages


def test_units_of_a_single_stream_dump_hold_every_page(dump, pages):
    assert dump_units(dump, 10**9) == [(0, -1)]
    units = dump_units(dump, 400_000)
    assert len(units) == 5 and units[0][0] == 0 and units[-1][1] == dump.stat().st_size
    assert [page for start, stop in units for page in read_pages(dump, start, stop, readers=1)] == pages


def test_reader_processes_give_what_one_process_reads(dump, pages):
    assert list(read_pages(dump, readers=2)) == pages
    start, stop = dump_units(dump, 800_000)[1]
    assert list(read_pages(dump, start, stop, readers=3)) == list(read_pages(dump, start, stop, readers=1))


def test_a_multistream_dump_is_cut_at_its_streams(multistream, pages):
    index = multistream_index(multistream)
    assert index is not None and index.name.endswith("-multistream-index.txt.bz2")
    offsets = stream_offsets(str(index))
    assert len(offsets) == 11  # 206 pages, 20 a stream
    assert list(iter_pages(multistream)) == pages  # the same dump: bz2 reads concatenated streams
    units = dump_units(multistream, 150_000)
    assert len(units) > 3 and all(start in offsets for start, _ in units[1:])
    assert [page for start, stop in units for page in read_pages(multistream, start, stop, readers=1)] == pages
    assert all(part.kind == "streams" for part in wiki_units.pieces(multistream, *units[1], readers=4))
    assert list(read_pages(multistream, readers=2)) == pages


def test_a_multistream_dump_without_its_index_is_read_by_blocks(multistream, pages, tmp_path):
    alone = tmp_path / multistream.name
    alone.write_bytes(multistream.read_bytes())
    assert multistream_index(alone) is None
    assert all(part.kind == "blocks" for part in wiki_units.pieces(alone, 0, -1, readers=4))
    assert [page for start, stop in dump_units(alone, 150_000)
            for page in read_pages(alone, start, stop, readers=1)] == pages


def test_a_dump_cut_short_is_an_error_not_fewer_pages(dump, tmp_path):
    cut = tmp_path / "enwiki-cut.xml.bz2"
    cut.write_bytes(dump.read_bytes()[:1_000_000])
    with pytest.raises((EOFError, OSError)):
        list(read_pages(cut, readers=1))
