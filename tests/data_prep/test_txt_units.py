"""A big ``.txt`` file in the shard build: one unit per byte range, cut at document boundaries (blank lines, or
line ends with one document per line; ``data_prep.text_files``), so the ranges' documents, in order, are a
one-unit read's, and the shards are the same for any number of workers and builders."""
from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from data_prep.records import RepairedText
from data_prep.sources import ReadOptions, Unit, input_units, read_unit
from shard_builds import build_three_ways

PARAGRAPHS = ["The first document starts the file.\nIts second line goes on.",
              "   \t", "A one-line document.", "", "",
              "Three blank lines came before this one.\nIt has\nthree lines.",
              "Bytes that are not UTF-8 here: \xff\xfe, and on.", "",
              "A much longer document " + "with many words in it, " * 40 + "ends here.",
              "Then another one.", "", "And the last, without a final line end"]
"""lines of a .txt file (str: each line; "\\xff" stands for a byte that is not UTF-8), blank ones among them"""


def write_txt(path: Path, newline: str = "\n", final_newline: bool = False, repeat: int = 6) -> Path:
    """The lines of `PARAGRAPHS`, ``repeat`` times (blank lines between the copies), with ``newline`` ends (and
    the LFs inside two of them: with ``newline`` CR, a file of lines some of which hold lone CRs)."""
    lines = [line for _ in range(repeat) for line in [*PARAGRAPHS, ""]][:-1]
    data = newline.join(lines) + (newline if final_newline else "")
    path.write_bytes(data.encode("utf-8").replace("\xff".encode(), b"\xff").replace("\xfe".encode(), b"\xfe"))
    return path


def records(units: list[Unit], options: ReadOptions) -> list[tuple[str, str]]:
    """(text, where a repaired one names its first repaired line) of each document of the units, in order."""
    return [(str(r), r.where if isinstance(r, RepairedText) else "") for u in units for r in read_unit(u, options)]


@pytest.mark.parametrize("newline, final_newline", [("\n", True), ("\r\n", True), ("\n", False), ("\r\n", False),
                                                    ("\r", True)])
@pytest.mark.parametrize("mode", ["blank-line", "line", "rows"])
def test_the_ranges_of_a_txt_file_hold_a_one_unit_reads_documents_each_once_in_order(mode, newline, final_newline,
                                                                                    tmp_path):
    path = write_txt(tmp_path / "corpus.txt", newline, final_newline)
    options = ReadOptions(rows_as_sentences=True) if mode == "rows" else ReadOptions(txt_documents=mode)
    whole = records([Unit(str(path))], options)
    assert input_units(str(path), txt_documents=options.txt_documents) == [Unit(str(path))]
    assert len(whole) >= 6 * (3 if mode == "blank-line" else 8 if mode == "line" else 1)
    assert sum(1 for _, where in whole if where) == 6  # a repaired document names its line: the same in a range
    size = path.stat().st_size
    for unit_bytes in (1, 7, 40, 97, 500, size - 1):
        units = input_units(str(path), unit_bytes, options.txt_documents)
        assert len(units) == -(-size // unit_bytes) and all(a.stop == b.start for a, b in zip(units, units[1:]))
        got = records(units, options)
        if mode == "rows":  # the same rows, in order; a range groups its own rows into documents
            assert [row for text, _ in got for row in text.split("\n\n")] == \
                [row for text, _ in whole for row in text.split("\n\n")], unit_bytes
        else:
            assert got == whole, unit_bytes


def test_blank_line_documents_of_the_ranges_are_the_blocks_between_blank_lines(tmp_path):
    path = write_txt(tmp_path / "corpus.txt", "\r\n", repeat=2)
    units = input_units(str(path), 20)
    texts = [r for u in units for r in read_unit(u)]
    assert texts[:2] == ["The first document starts the file.\nIts second line goes on.\r\n",
                         "A one-line document.\r\n"]
    assert texts[2] == "Three blank lines came before this one.\nIt has\nthree lines.\r\nBytes that are not " \
                       "UTF-8 here: \ufffd\ufffd, and on.\r\n"
    assert len(texts) == 10 and texts[4] == "And the last, without a final line end\r\n" and texts[5] == texts[0]
    assert texts[-1] == "And the last, without a final line end"
    assert isinstance(texts[2], RepairedText) and texts[2].where == f"{path}:10"
    assert isinstance(texts[7], RepairedText) and texts[7].where == f"{path}:26"  # line numbers across ranges


def test_a_file_document_a_small_file_a_compressed_or_utf16_file_stay_one_unit(tmp_path):
    path = write_txt(tmp_path / "corpus.txt")
    assert input_units(str(path), 50, "file") == [Unit(str(path))]
    assert input_units(str(path), path.stat().st_size) == [Unit(str(path))]
    packed = tmp_path / "corpus.txt.gz"
    packed.write_bytes(gzip.compress(path.read_bytes()))
    assert input_units(str(packed), 50) == [Unit(str(packed))]
    wide = tmp_path / "wide.txt"
    wide.write_bytes(path.read_text(encoding="utf-8", errors="replace").encode("utf-16"))
    assert input_units(str(wide), 50) == [Unit(str(wide))]
    assert len(input_units(str(path), 50)) > 1


@pytest.mark.parametrize("mode", ["blank-line", "line"])
def test_txt_units_build_the_same_shards_for_any_workers_or_builders(mode, samples_dir, vocab_file, tmp_path):
    news = (samples_dir / "news/lee.txt").read_bytes()[:120_000]
    path = tmp_path / "news.txt"
    path.write_bytes(news.replace(b"\n", b"\r\n"))
    unit_bytes = 15_000
    assert len(input_units(str(path), unit_bytes, mode)) == 9  # its last line without a line end
    common = ["--input", path, "--vocab", vocab_file, "--max-seq-len", 64, "--seed", 3, "--dupe-factor", 1,
              "--chunk-chars", 20_000, "--samples-per-shard", 500, "--txt-documents", mode,
              "--set", f"unit_bytes={unit_bytes}"]
    one = build_three_ways(common, tmp_path)
    whole = [r for r in read_unit(Unit(str(path)), ReadOptions(txt_documents=mode)) if str(r).strip()]
    assert len(one["shards"]) >= 2 and one["documents"]["read"] == len(whole)
