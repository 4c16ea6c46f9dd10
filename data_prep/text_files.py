"""Line-based text files (``.jsonl``, ``.txt``): opened as their names say, cut into byte ranges, read by line.

A byte range ``[start, stop)`` of a file owns the lines that start in it (``lines_from`` gives the lines from the
first one that starts at or after ``start``; the reader stops where its own rule says). A ``.jsonl`` range and a
``.txt`` range of one document per line hold those lines; a ``.txt`` range of blank-line separated documents
holds the documents whose preceding blank line begins in it (the first range also the file's first document), so
no document is cut in two and the documents of consecutive ranges, in order, are the file's, however it is cut.
A line here is what ends in LF; a ``.txt`` line that holds lone CRs (old Mac files) is split at them too and its
pieces belong where it starts. Compressed files and files in UTF-16 or UTF-32 (their byte-order mark) are read
whole. Bytes that are not UTF-8 become U+FFFD (``decode``; a ``RepairedText`` counts the lines).
"""
from __future__ import annotations

import bz2
import codecs
import functools
import gzip
import io
import itertools
import lzma
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO, cast

from data_prep.inputs import compression_suffix
from data_prep.records import RepairedText

BOM = b"\xef\xbb\xbf"
_WIDE_BOMS = ((codecs.BOM_UTF32_LE, "UTF-32"), (codecs.BOM_UTF32_BE, "UTF-32"),  # before UTF-16 LE: FF FE 00 00
              (codecs.BOM_UTF16_LE, "UTF-16"), (codecs.BOM_UTF16_BE, "UTF-16"))
TXT_DOCUMENTS = ("blank-line", "line", "file")
"""a ``.txt`` file's documents: separated by blank lines (BERT's convention), one per line, or the whole file"""


def open_binary(path: Path) -> BinaryIO:
    """A file opened for reading bytes, decompressed as its name says."""
    compression = compression_suffix(path)
    if compression == ".zst":
        import pyarrow  # optional: only .zst inputs need it

        return io.BufferedReader(pyarrow.input_stream(str(path), compression="zstd"))
    openers: dict[str, Callable[..., Any]] = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}
    return openers.get(compression, open)(path, "rb")


def wide_encoding(head: bytes) -> str:
    """The encoding ("UTF-16", "UTF-32") whose byte-order mark ``head``, a file's first bytes, starts with; else ""."""
    return next((encoding for bom, encoding in _WIDE_BOMS if head.startswith(bom)), "")


def line_ranges(path: Path, unit_bytes: int) -> list[tuple[int, int]]:
    """Byte ranges of ``unit_bytes`` of a file read by line; ``[(0, -1)]`` (the whole file) when it is no larger,
    compressed or in UTF-16 / UTF-32 (a byte offset there is not a place in the text)."""
    size = path.stat().st_size
    if size <= unit_bytes or compression_suffix(path):
        return [(0, -1)]
    with open(path, "rb") as f:
        if wide_encoding(f.read(4)):
            return [(0, -1)]
    return [(start, min(start + unit_bytes, size)) for start in range(0, size, unit_bytes)]


def lines_from(f: BinaryIO, start: int) -> Iterator[tuple[int, bytes]]:
    """(byte offset, line with its LF) of each line of ``f`` from the first one that starts at or after ``start``."""
    position = start
    if start:
        f.seek(start - 1)
        position += len(f.readline()) - 1  # the rest of a line that started before `start`
    for raw in f:  # a binary file splits after b"\n" only
        yield position, raw
        position += len(raw)


def _pieces(raw: bytes) -> tuple[bytes, ...]:
    """A line split at lone CRs too (LF, CRLF and CR each end a line)."""
    return tuple(raw.splitlines(keepends=True)) if b"\r" in raw.rstrip(b"\r\n") else (raw,)


class LineNumber:
    """The number of lines that begin before byte ``start`` (the lines of ``txt_lines`` with ``split_cr``, else
    LF-ended ones), counted only when first asked (a skip or a repair to report), once per range."""

    def __init__(self, path: Path, start: int, split_cr: bool = False):
        self.path, self.start, self.split_cr, self.count = path, start, split_cr, None if start else 0

    def __call__(self) -> int:
        if self.count is None:
            count = 0
            with open_binary(self.path) as f:
                if self.split_cr:
                    lines = itertools.takewhile(lambda line: line[0] < self.start, lines_from(f, 0))
                    count = sum(len(_pieces(raw)) for _, raw in lines)
                else:
                    remaining = self.start - 1  # a line begins after every LF before byte start - 1, and at 0
                    count = 1
                    while remaining > 0:
                        block = f.read(min(remaining, 1 << 20))
                        count, remaining = count + block.count(b"\n"), remaining - len(block)
            self.count = count
        return self.count

    def plus(self, lines: int) -> int:
        """The number of the line ``lines`` lines into the range (1: its first)."""
        return self() + lines


def _utf8_lines(f: BinaryIO, encoding: str) -> Iterator[bytes]:
    """The lines of a UTF-16 or UTF-32 file, streamed, as UTF-8 without the byte-order mark; code units that are not
    text (a lone surrogate, an odd last byte) become U+FFFD."""
    for line in io.TextIOWrapper(f, encoding=encoding, errors="replace", newline=""):  # ends kept: LF, CRLF, CR
        yield line.encode("utf-8")


def txt_lines(path: Path, start: int = 0) -> Iterator[tuple[int, int, bytes]]:
    """(line number from 1 at the range's first line, byte offset of the LF-ended line it is in, line with its
    end, UTF-8) of a text file from the first line that starts at or after ``start``. A line ends at LF, CRLF or
    a lone CR (old Mac files); a UTF-8 byte-order mark at the start is dropped; a file that starts with a UTF-16
    byte-order mark (Windows Notepad's "Unicode") or a UTF-32 one is decoded as such (read whole: offsets 0)."""
    number = 0
    with open_binary(path) as f:
        encoding = wide_encoding(cast(io.BufferedReader, f).peek(4)[:4]) if start == 0 else ""  # openers buffer
        lines = ((0, raw) for raw in _utf8_lines(f, encoding)) if encoding else lines_from(f, start)
        for offset, raw in lines:
            if offset == 0:
                raw = raw.removeprefix(BOM)
            for line in _pieces(raw):
                number += 1
                yield number, offset, line


def read_txt(path: Path, documents: str = TXT_DOCUMENTS[0], start: int = 0, stop: int = -1) -> Iterator[str]:
    """The documents of a text file (``TXT_DOCUMENTS``) that bytes ``[start, stop)`` own (module docstring; stop
    -1: to the end): its blank-line separated blocks, its non-blank lines, or the whole file (blank lines kept:
    they end paragraphs; read whole)."""
    lines: list[bytes] = []
    first = 1
    owned = start == 0 or documents == "line"  # blank-line: from the first blank line that begins in the range
    before = LineNumber(path, start, split_cr=True)

    def document() -> str:
        return decode(lines, path, functools.partial(before.plus, first))

    for number, offset, raw in txt_lines(path, start):
        past = stop != -1 and offset >= stop
        if raw.strip() or (documents == "file" and lines):
            if past and documents == "line":
                return
            if owned:
                first = number if not lines else first
                lines.append(raw)
            if documents == "line":
                yield document()
                lines = []
        else:
            if lines:
                yield document()
                lines = []
            if past:
                return
            owned = True
    if lines:
        yield document()


def read_txt_lines(path: Path, start: int = 0, stop: int = -1) -> Iterator[str]:
    """Every line of a sentence-per-line text file that starts in bytes ``[start, stop)`` as a row (blank lines as
    empty rows)."""
    before = LineNumber(path, start, split_cr=True)
    for number, offset, raw in txt_lines(path, start):
        if stop != -1 and offset >= stop:
            return
        yield decode([raw.rstrip(b"\r\n")], path, functools.partial(before.plus, number))


def decode(lines: list[bytes], path: Path, first_line: int | Callable[[], int]) -> str:
    """Consecutive lines as text; bytes that are not UTF-8 become U+FFFD (a ``RepairedText`` counts the lines and
    names the first repaired one: ``first_line`` is the number of ``lines[0]``, or gives it when asked)."""
    data = b"".join(lines)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        bad = [offset for offset, line in enumerate(lines) if not _is_utf8(line)]
        first = first_line() if callable(first_line) else first_line
        return RepairedText.of(data.decode("utf-8", errors="replace"), len(bad), f"{path}:{first + bad[0]}")


def _is_utf8(line: bytes) -> bool:
    try:
        line.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
