"""Chunks of a unit's documents, and the text from elsewhere that NSP draws random next segments from.

Each unit's documents are streamed and grouped into chunks of about ``chunk_chars`` characters (raw; Wikipedia
markup counts): a chunk boundary depends only on the input, never on workers or builders. NSP draws its random
next segments from the chunk's other documents; a chunk whose documents cannot serve (a single document: a book
longer than ``chunk_chars``, a unit's last document; pieces of one running text under ``--rows-as-sentences``)
also carries text from elsewhere (its ``donor``): a neighbouring or a far chunk of its unit, or the next unit
(``iter_chunks``).
"""
from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import cast

from data_prep.records import Skipped
from data_prep.sources import ReadOptions, Unit, read_unit, unit_records
from data_prep.wiki_dump import SpilledPage, Wikitext, characters, has_text

DONOR_CHARS = 20_000
"""at least this many characters of text from elsewhere go with a chunk that draws NSP random B segments from it"""
FAR_CHUNKS = 4
"""the documents of a running text (``--rows-as-sentences``: consecutive pieces of one text, likely of one book)
take their NSP random B segments from text at least this many chunks away in their unit (2M characters at the
default ``chunk_chars``, several books), not from their own chunk's documents"""


@dataclass(frozen=True)
class Chunk:
    """Consecutive records of one unit; ``first_document`` is the index of ``records[0]`` within the unit."""

    unit: int
    index: int
    first_document: int
    records: list[tuple[str | Skipped | SpilledPage, str]]  # (document or skip, where)
    donor: tuple[str, ...] = ()
    """text from elsewhere (`iter_chunks`) where NSP draws random next segments for a chunk whose documents cannot
    give each other any: a single document, or pieces of one running text"""


def iter_chunks(unit_index: int, unit: Unit, options: ReadOptions, chunk_chars: int,
                elsewhere: tuple[Unit, ReadOptions] | None = None, donors: bool = True,
                spill: str | None = None) -> Iterator[Chunk]:
    """Stream one unit as chunks of about ``chunk_chars`` characters (raw; Wikipedia markup counts) and at least
    one chunk; only the input decides boundaries. With ``donors`` (NSP is drawn) a chunk whose documents cannot
    give each other random next segments gets text from elsewhere as its ``donor``:

    * a running text's chunk (``rows_as_sentences``): text of the chunk at least `FAR_CHUNKS` chunks ahead in the
      unit, else behind it (so up to that many chunks are read ahead); in a unit shorter than that, text of
      ``elsewhere`` (another unit of the build), else the unit's farthest chunk;
    * a chunk of a single document: text of the next chunk of the unit, else the previous one, else of
      ``elsewhere``.

    ``elsewhere``'s text is handed out in consecutive pieces, from its start, so the donors depend on the inputs
    alone, never on the builders or workers. With ``spill`` (a folder) a Wikipedia dump's articles come as
    ``SpilledPage`` (``data_prep.sources.unit_records``): the chunk says where their text is."""
    chunks = _read_chunks(unit_index, unit, options, chunk_chars, spill)
    text_elsewhere = _TextElsewhere(*elsewhere) if elsewhere is not None and donors else None
    if not donors:
        yield from chunks
    elif options.rows_as_sentences:
        yield from _with_far_donors(chunks, FAR_CHUNKS * chunk_chars, text_elsewhere)
    else:
        yield from _with_neighbour_donors(chunks, text_elsewhere)


def _characters(chunk: Chunk) -> int:
    return sum(characters(r) for r, _ in chunk.records)


def _budget(characters: int) -> int:
    """Donor characters for a chunk of ``characters``: a quarter, at least `DONOR_CHARS` (NSP draws B for about a
    sixth of the samples, each about half a sample long)."""
    return max(characters // 4, DONOR_CHARS)


def _with_neighbour_donors(chunks: Iterator[Chunk], elsewhere: _TextElsewhere | None) -> Iterator[Chunk]:
    previous, current = None, next(chunks)
    for following in itertools.chain(chunks, [None]):
        neighbour = following if following is not None else previous
        texts = [r for r, _ in current.records if has_text(r)]
        if len(texts) == 1:
            budget = _budget(characters(texts[0]))
            donor = _donor(neighbour, budget) if neighbour is not None else \
                elsewhere.take(budget) if elsewhere is not None else ()
            current = dataclasses.replace(current, donor=donor)
        yield current
        if following is None:
            return
        previous, current = current, following


def _with_far_donors(chunks: Iterator[Chunk], far: int, elsewhere: _TextElsewhere | None) -> Iterator[Chunk]:
    window: list[tuple[int, Chunk]] = []  # (first character in the unit, chunk): from the farthest behind to ahead
    read_to, ended, k = 0, False, 0
    while True:
        while not ended and (k >= len(window) or window[-1][0] - window[k][0] < far):
            chunk = next(chunks, None)
            if chunk is None:
                ended = True
            else:
                window.append((read_to, chunk))
                read_to += _characters(chunk)
        if k >= len(window):
            return
        start, chunk = window[k]
        source = next((c for s, c in window[k + 1:] if s - start >= far), None) or \
            next((c for s, c in reversed(window[:k]) if start - s >= far), None)
        budget = _budget(_characters(chunk))
        if source is not None:
            donor = _donor(source, budget)
        elif elsewhere is not None:
            donor = elsewhere.take(budget)
        else:  # a lone unit shorter than `far`, all of it in the window: its farthest chunk
            ends = [(abs(s - start), i) for i, (s, _) in ((0, window[0]), (len(window) - 1, window[-1])) if i != k]
            donor = _donor(window[max(ends)[1]][1], budget) if ends else ()
        yield dataclasses.replace(chunk, donor=donor)
        k += 1
        # chunks before the last one `far` behind the next chunk can serve no later chunk
        if k < len(window):
            behind = [i for i, (s, _) in enumerate(window[:k]) if window[k][0] - s >= far]
            if behind:
                del window[:behind[-1]]
                k -= behind[-1]


class _TextElsewhere:
    """The documents of another unit, handed out in consecutive pieces (from its start again once all is given)."""

    def __init__(self, unit: Unit, options: ReadOptions):
        self.unit, self.options = unit, options
        self.records: Iterator[str | Skipped] | None = None
        self.next: str | None = None  # a document read but left for the next piece (longer than what was left)

    def take(self, budget: int) -> tuple[str, ...]:
        """Whole documents up to ``budget`` characters, or the middle of one longer than that."""
        texts: list[str] = []
        for _ in range(2):  # on to the unit's end, then once more from its start
            if self.records is None:
                self.records = read_unit(self.unit, self.options)
            while (record := self.next or next(self.records, None)) is not None:
                self.next = None
                if not (isinstance(record, str) and record.strip()):
                    continue
                if texts and len(record) > budget:
                    self.next = record
                    return tuple(texts)
                texts.append(_middle(record, budget))
                budget -= len(texts[-1])
                if budget <= 0:
                    return tuple(texts)
            self.records = None
            if texts:
                break
        return tuple(texts)


def _middle(record: str, budget: int) -> str:
    """``record``, or its middle ``budget`` characters when longer: its whole paragraphs there when it has any,
    so that a Wikipedia page (which stays `Wikitext`) is not cut inside a template, link or table."""
    if len(record) <= budget:
        return record
    start = (len(record) - budget) // 2
    stop = start + budget
    first, last = record.find("\n\n", start, stop), record.rfind("\n\n", start, stop)
    if 0 <= first < last:
        start, stop = first + 2, last
    return Wikitext.of(record[start:stop], record.dump) if isinstance(record, Wikitext) else record[start:stop]


def _donor(neighbour: Chunk, budget: int) -> tuple[str, ...]:
    """Up to ``budget`` characters of the documents of ``neighbour``, whole, or the middle of a longer one."""
    texts: list[str] = []
    for record, _ in neighbour.records:
        if budget <= 0:
            break
        if has_text(record):  # a spilled page is read back here: only a chunk of a single document has donors
            texts.append(_middle(record.load() if isinstance(record, SpilledPage) else cast(str, record), budget))
            budget -= len(texts[-1])
    return tuple(texts)


def _read_chunks(unit_index: int, unit: Unit, options: ReadOptions, chunk_chars: int,
                 spill: str | None) -> Iterator[Chunk]:
    records: list[tuple[str | Skipped | SpilledPage, str]] = []
    chars, index, first = 0, 0, 0
    for number, record in enumerate(read_unit(unit, options) if spill is None else unit_records(unit, options, spill)):
        records.append((record, record.where if isinstance(record, Skipped) else f"{unit} document {number}"))
        chars += characters(record)
        if chars >= chunk_chars:
            yield Chunk(unit_index, index, first, records)
            index, first, records, chars = index + 1, first + len(records), [], 0
    if records or index == 0:
        yield Chunk(unit_index, index, first, records)

