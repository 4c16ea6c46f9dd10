"""Wikipedia dumps (``.xml.bz2``, ``.xml``) split into byte ranges that separate processes decompress and parse.

A range ``[start, stop)`` of a dump's compressed bytes owns the pages whose ``<page>`` tag begins in the
decompressed data of the bzip2 blocks that begin in it (a block begins where its 48-bit magic begins, at any bit).
Every page has one owner, so the pages of consecutive ranges, in order, are the pages of the dump, whichever way
it is cut; the owner of a page that runs on into later blocks decompresses those too. Two kinds of dump:

* a multistream dump (``…-multistream.xml.bz2``) with its index beside it (``…-multistream-index.txt.bz2``, lines
  ``offset:page_id:title``): the index gives the byte offsets of its bzip2 streams (~100 pages each); ranges are
  cut at stream starts, so each range is whole streams, decompressed with ``bz2.decompress``;
* any other ``.xml.bz2`` (a single stream, or a multistream dump without its index): ranges are cut anywhere;
  the blocks in a range are found by their magic (the bit pattern ``0x314159265359``, and ``0x177245385090`` that
  ends a stream), and each block is decompressed on its own as a one-block stream rebuilt around it (its CRC
  closes the stream), as ``lbzip2`` and ``pbzip2`` do. The magic may also occur inside compressed data (about
  once per 30 TB): a "block" that does not decompress is joined to the one before it, and a range whose first
  candidate is such a false one starts at the next;
* an uncompressed ``.xml`` dump: ranges are cut anywhere, and own the pages whose ``<page>`` tag begins in them.

``dump_units`` cuts a dump into ranges of about ``unit_bytes`` for the builders (one range when the dump is not
larger); ``read_pages`` yields a range's pages in order, decompressing and parsing pieces of it (``PIECE_BYTES``)
in reader processes when it is large enough to share, so the main process of a build only receives pages. Given a
``spill`` folder, a reader writes the articles' texts to a file there and sends only where each is
(``SpilledText``): the build's main process then hands that to the worker that reads it back, and never holds
or copies the text itself (a build moves ~3.4 MB of text per MB of compressed dump).
The pieces never change what is read, only who reads it.
"""
from __future__ import annotations

import bisect
import bz2
import collections
import concurrent.futures
import functools
import multiprocessing
import os
import re
import signal
import tempfile
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

Page = tuple[str, int, bool, str]
"""(title, namespace, is_redirect, wikitext), as ``data_prep.wikitext.iter_pages`` gives them"""

MULTISTREAM_INDEX_SUFFIX = "-index.txt.bz2"
"""``enwiki-…-multistream.xml.bz2`` has its index in ``enwiki-…-multistream-index.txt.bz2``"""
PIECE_BYTES = 4 << 20
"""compressed bytes a reader process decompresses and parses at a time (about 16 MB of XML); smaller for a
range that would otherwise give its readers fewer than four pieces each, never under `MIN_PIECE_BYTES`"""
MIN_PIECE_BYTES = 1 << 20
"""a piece decompresses the block after it too (where its last page ends): ~5 % more work at this size"""
PARALLEL_MIN_BYTES = 1 << 20
"""a range smaller than this is read in the calling process: starting reader processes would cost more"""
MAX_READERS = 16
"""reader processes per range read; about one reader keeps up with five build workers"""

_BLOCK_MAGIC, _END_MAGIC = 0x314159265359, 0x177245385090
_PAGE, _PAGE_END = b"<page>", b"</page>"
_BLOCK_READ = 1 << 20  # bytes read at a time while looking for the blocks that follow


def multistream_index(path: Path) -> Path | None:
    """The index beside a multistream dump (``X-multistream.xml.bz2`` → ``X-multistream-index.txt.bz2``), if
    there is one."""
    name = path.name
    if not name.lower().endswith(".xml.bz2"):
        return None
    index = path.with_name(name[: -len(".xml.bz2")] + MULTISTREAM_INDEX_SUFFIX)
    return index if index.is_file() else None


@functools.lru_cache(maxsize=8)
def stream_offsets(index: str) -> tuple[int, ...]:
    """The distinct byte offsets of the page streams an index names, in order (its lines: ``offset:id:title``)."""
    with bz2.open(index, "rb") as f:
        offsets = sorted({int(number) for number in re.findall(rb"^(\d+):", f.read(), re.M)})
    if not offsets:
        raise ValueError(f"{index}: not a multistream index (no offset:page_id:title lines)")
    return tuple(offsets)


PIECE_KINDS = ("streams", "blocks", "xml")


@dataclass(frozen=True)
class Piece:
    """Bytes ``[start, stop)`` of a dump, as ``kind`` says: whole bzip2 streams, the bzip2 blocks that begin there,
    or uncompressed XML (an ``.xml`` dump: the pages whose ``<page>`` tag begins there)."""

    path: str
    start: int
    stop: int
    kind: str


@dataclass(frozen=True)
class SpilledText:
    """A page's text that a reader wrote to a file: bytes ``[offset, offset + size)`` of ``path``, UTF-8, ``chars``
    characters; ``blank`` when they are only whitespace."""

    path: str
    offset: int
    size: int
    chars: int
    blank: bool

    def read(self) -> str:
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            return f.read(self.size).decode("utf-8", "surrogatepass")


def _cuts(start: int, stop: int, size: int, offsets: tuple[int, ...] | None) -> list[int]:
    """Boundaries ``start < … < stop`` about ``size`` bytes apart; at stream offsets when ``offsets`` are given."""
    cuts = [start]
    for target in range(start + size, stop, size):
        if offsets is None:
            cuts.append(target)
            continue
        at = offsets[min(bisect.bisect_left(offsets, target), len(offsets) - 1)]
        if cuts[-1] < at < stop:
            cuts.append(at)
    return [*dict.fromkeys(cuts), stop]


def _offsets(path: Path) -> tuple[int, ...] | None:
    index = multistream_index(path)
    return stream_offsets(str(index)) if index is not None else None


def dump_units(path: Path, unit_bytes: int) -> list[tuple[int, int]]:
    """Byte ranges of about ``unit_bytes`` that together hold every page of the dump; ``[(0, -1)]`` (the whole
    file) when it is no larger. A multistream dump's ranges start at its streams (its index)."""
    size = path.stat().st_size
    if size <= unit_bytes:
        return [(0, -1)]
    cuts = _cuts(0, size, unit_bytes, _offsets(path))
    return list(zip(cuts, cuts[1:]))


def pieces(path: Path, start: int, stop: int, readers: int) -> list[Piece]:
    """The pieces of bytes ``[start, stop)`` (stop -1: the end) that ``readers`` processes read in turn."""
    stop = path.stat().st_size if stop == -1 else stop
    offsets = _offsets(path)
    kind = "xml" if not path.name.lower().endswith(".bz2") else "streams" if offsets is not None else "blocks"
    size = max(MIN_PIECE_BYTES, min(PIECE_BYTES, (stop - start) // (4 * readers) + 1))
    if kind == "xml":
        size *= 4  # about as many pages as the compressed bytes of a piece of .bz2
    cuts = _cuts(start, stop, size, offsets)
    return [Piece(str(path), a, b, kind) for a, b in zip(cuts, cuts[1:])]


def default_readers() -> int:
    """Reader processes for one range: the cores this process may use, at most `MAX_READERS`."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cores, MAX_READERS))


def read_pages(path: Path, start: int = 0, stop: int = -1, readers: int | None = None,
               spill: str | None = None) -> Iterator[tuple[str, int, bool, str | SpilledText]]:
    """The pages that bytes ``[start, stop)`` of a dump own, in order. Pieces are read by ``readers`` processes
    (default `default_readers`; a few pieces ahead of the caller, so memory stays bounded), or here when the range
    is small, ``readers`` is 1, or this is a daemon process (a worker of a pool, which may not start processes).
    With ``spill`` (a folder) the readers write the articles' texts there (`spill_piece`): their pages come with
    a `SpilledText` instead (pages read here keep their text)."""
    readers = default_readers() if readers is None else readers
    parts = pieces(path, start, stop, readers)
    size = parts[-1].stop - parts[0].start
    if readers <= 1 or len(parts) == 1 or size < PARALLEL_MIN_BYTES or multiprocessing.current_process().daemon:
        for part in parts:
            yield from read_piece(part)
        return
    # fork, as the build's worker pool: readers start in milliseconds, and a script that reads a dump needs no
    # `if __name__ == "__main__"` guard (spawn would run it again in each reader)
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    context = multiprocessing.get_context(method)
    with concurrent.futures.ProcessPoolExecutor(min(readers, len(parts)), context, _start_reader) as pool:
        pending: collections.deque = collections.deque()
        try:
            for part in parts:
                pending.append(pool.submit(read_piece, part) if spill is None else
                               pool.submit(spill_piece, part, spill))
                if len(pending) > readers:  # each reader one piece ahead: ~16 MB of pages a reader
                    yield from pending.popleft().result()
            while pending:
                yield from pending.popleft().result()
        finally:  # a caller that stops early (a donor that took enough) leaves nothing running
            for future in pending:
                future.cancel()


def _start_reader() -> None:
    # a Ctrl-C reaches the whole process group: the build stops its readers, which print no traceback of their own
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def spill_piece(piece: Piece, folder: str) -> list[tuple[str, int, bool, str | SpilledText]]:
    """The pages a piece owns, the texts of its articles (namespace 0, not redirects) written to a new file in
    ``folder`` and given as `SpilledText`; other pages come without their text (it is never read)."""
    pages: list[tuple[str, int, bool, str | SpilledText]] = []
    f = None
    offset = 0
    try:
        for title, namespace, redirect, text in read_piece(piece):
            if redirect or namespace != 0:
                pages.append((title, namespace, redirect, ""))
                continue
            if f is None:
                f = tempfile.NamedTemporaryFile(dir=folder, suffix=".txt", delete=False)
            data = text.encode("utf-8", "surrogatepass")
            f.write(data)
            pages.append((title, namespace, redirect, SpilledText(f.name, offset, len(data), len(text),
                                                                  not text.strip())))
            offset += len(data)
    finally:
        if f is not None:
            f.close()
    return pages


HEAD_BYTES = 1 << 16
"""How far into a dump its ``<mediawiki`` root element must begin (after the XML declaration)."""


def check_dump_head(path: Path) -> None:
    """Refuse a file whose first (decompressed) bytes hold no ``<mediawiki`` root: an empty or foreign file owns no
    page in any byte range, so without this check it would be read as a dump without articles."""
    with (bz2.open(path, "rb") if path.suffix == ".bz2" else open(path, "rb")) as f:
        head = f.read(HEAD_BYTES)
    if b"<mediawiki" not in head:
        raise ValueError(f"no <mediawiki> root element in its first {HEAD_BYTES} bytes")


def read_piece(piece: Piece) -> list[Page]:
    """The pages a piece owns (see the module docstring), parsed; the piece at the start of the dump checks that
    it is one (`check_dump_head`), in the process that reads it."""
    if piece.start == 0:
        check_dump_head(Path(piece.path))
    with open(piece.path, "rb") as f:
        if piece.kind == "streams":
            f.seek(piece.start)
            xml = bz2.decompress(f.read(piece.stop - piece.start))
            first, last = xml.find(_PAGE), xml.rfind(_PAGE_END)
            if first == -1:
                return []
            if last < first or xml.find(_PAGE, xml.rfind(_PAGE)) > last:
                raise EOFError(f"a page in bytes {piece.start}-{piece.stop} does not end in its streams: "
                               "the index does not belong to this dump, or the dump is cut short")
            return _parse(xml[first:last + len(_PAGE_END)])
        if piece.kind == "blocks":
            return _parse(_owned_xml((bit < 8 * piece.stop, block) for bit, block in _blocks(f, piece.start)))
        return _parse(_owned_xml(_plain(f, piece.start, piece.stop)))


def _plain(f: BinaryIO, start: int, stop: int) -> Iterator[tuple[bool, bytes]]:
    """(in the range, bytes) of an uncompressed file from ``start`` on: bytes [start, stop), then what follows."""
    f.seek(start)
    position = start
    while part := f.read(min(_BLOCK_READ, stop - position) if position < stop else _BLOCK_READ):
        yield position < stop, part
        position += len(part)


def _owned_xml(parts: Iterator[tuple[bool, bytes]]) -> bytes:
    """The XML of the pages whose ``<page>`` tag begins in the parts in the range, from the first one's ``<page>``
    to the last one's ``</page>`` (reading on into the parts after the range as far as the last page runs)."""
    data = bytearray()
    owned = -1  # bytes of the parts in the range, once past it
    first = last_start = -1
    for in_range, block in parts:
        if owned == -1 and not in_range:
            owned = len(data)
            first = data.find(_PAGE)
            if first == -1 or first >= owned:
                return b""
        data += block
        if owned == -1:
            continue
        if last_start == -1 and len(data) >= owned + len(_PAGE):
            last_start = data.rfind(_PAGE, 0, owned + len(_PAGE) - 1)  # a tag that begins in the range
        if last_start != -1 and (end := data.find(_PAGE_END, last_start)) != -1:
            return bytes(data[first:end + len(_PAGE_END)])
    if owned == -1:  # the range runs to the end of the dump
        first, last = data.find(_PAGE), data.rfind(_PAGE_END)
        if first == -1:
            return b""
        if data.find(_PAGE, data.rfind(_PAGE)) > last:
            raise EOFError("the dump ends inside a page: it is cut short")
        return bytes(data[first:last + len(_PAGE_END)])
    raise EOFError("the dump ends inside a page: it is cut short")


def _parse(xml: bytes) -> list[Page]:
    """(title, namespace, is_redirect, wikitext) of consecutive ``<page>`` elements; the last ``<title>``,
    ``<ns>`` and ``<text>`` of a page count (``iter_pages`` reads them the same way)."""
    if not xml:
        return []
    pages = []
    for page in ET.fromstring(b"<pages>" + xml + b"</pages>"):
        title, namespace, redirect, text = "", 0, False, ""
        for element in page.iter():
            tag = element.tag
            if tag == "title":
                title = element.text or ""
            elif tag == "ns":
                ns = (element.text or "0").strip()
                namespace = int(ns) if ns.lstrip("-").isdigit() else -1  # malformed: not an article, skipped
            elif tag == "redirect":
                redirect = True
            elif tag == "text":
                text = element.text or ""
        pages.append((title, namespace, redirect, text))
    return pages


def _magic_patterns(magic: int) -> list[tuple[int, bytes]]:
    """(bit shift, the bytes a 48-bit magic fills entirely when it begins that many bits into a byte)."""
    found = []
    for shift in range(8):
        window = (magic << (8 - shift)).to_bytes(7, "big") if shift else magic.to_bytes(6, "big")
        found.append((shift, window[1:6] if shift else window))
    return found


_PATTERNS = [(kind, shift, re.compile(re.escape(pattern)))
             for kind, magic in (("block", _BLOCK_MAGIC), ("end", _END_MAGIC))
             for shift, pattern in _magic_patterns(magic)]


def _bits(data: bytes, bit: int, count: int) -> int:
    """``count`` bits of ``data`` from bit ``bit`` (most significant first)."""
    first, last = bit // 8, (bit + count + 7) // 8
    value = int.from_bytes(data[first:last], "big")
    return (value >> (8 * (last - first) - (bit - 8 * first) - count)) & ((1 << count) - 1)


def _markers(data: bytes, base_bit: int) -> list[tuple[int, str]]:
    """(bit offset in the file, "block" or "end") of every block magic and stream end in ``data``, whose first byte
    is at bit ``base_bit`` of the file, sorted."""
    found = set()
    for kind, shift, pattern in _PATTERNS:
        for match in pattern.finditer(data):
            bit = 8 * match.start() - (8 - shift if shift else 0)
            if bit >= 0 and bit + 48 <= 8 * len(data) and \
                    _bits(data, bit, 48) == (_BLOCK_MAGIC if kind == "block" else _END_MAGIC):
                found.add((base_bit + bit, kind))
    return sorted(found)


def _one_block_stream(data: bytes, bit: int, end: int) -> bytes:
    """A bzip2 stream of the single block at bits [bit, end) of ``data``: header, the block, the stream end and
    the combined CRC (for one block, the block's own CRC, stored right after its magic)."""
    length = end - bit
    block = _bits(data, bit, length)
    crc = (block >> (length - 80)) & 0xFFFFFFFF
    stream = (((block << 48) | _END_MAGIC) << 32) | crc
    padding = -(length + 80) % 8
    return b"BZh9" + (stream << padding).to_bytes((length + 80 + padding) // 8, "big")


class _Markers:
    """The block magics and stream ends of a dump from byte ``start`` on, read as they are needed."""

    def __init__(self, f: BinaryIO, start: int):
        f.seek(start)
        self.f, self.base, self.data, self.eof = f, start, b"", False  # data: the file from byte `base` on
        self.found: list[tuple[int, str]] = []  # (file bit offset, kind), sorted

    def _more(self) -> bool:
        chunk = self.f.read(_BLOCK_READ)
        if not chunk:
            self.eof = True
            return False
        rescan = max(0, len(self.data) - 6)  # a magic may straddle the old end
        self.data += chunk
        known = set(self.found)
        self.found += [m for m in _markers(self.data[rescan:], 8 * (self.base + rescan)) if m not in known]
        return True

    def after(self, bit: int, count: int, kind: str | None = None) -> list[int]:
        """Up to ``count`` markers (of ``kind``, or any) past bit ``bit``; fewer only at the end of the file."""
        while True:
            later = [m for m, k in self.found if m > bit and (kind is None or k == kind)][:count]
            if len(later) == count or not self._more():
                return later

    def block(self, bit: int, end: int) -> bytes | None:
        """Bits [bit, end) decompressed as one block, or None when they are not one."""
        try:
            return bz2.decompress(_one_block_stream(self.data, bit - 8 * self.base, end - 8 * self.base))
        except (OSError, EOFError):
            return None

    def drop_before(self, bit: int) -> None:
        keep = bit // 8 - self.base
        self.data, self.base = self.data[keep:], self.base + keep
        self.found = [m for m in self.found if m[0] >= bit]


def _blocks(f: BinaryIO, start: int) -> Iterator[tuple[int, bytes]]:
    """(bit offset, decompressed data) of each bzip2 block that begins at byte ``start`` or later, in order."""
    markers = _Markers(f, start)
    begins = markers.after(8 * start - 1, 1, "block")
    while begins:
        bit = begins[0]
        ends = markers.after(bit, 3)
        if not ends:
            raise EOFError("the dump ends inside a bzip2 block: it is cut short")
        decoded, end = next(((d, e) for e in ends if (d := markers.block(bit, e)) is not None), (None, 0))
        if decoded is None:  # a false magic where a block seemed to begin: its owner block runs across it
            begins = markers.after(bit, 1, "block")
            continue
        yield bit, decoded
        begins = markers.after(end - 1, 1, "block")
        markers.drop_before(begins[0] if begins else end)
