"""Wikipedia XML dumps (``.xml``, ``.xml.bz2``, the ``…xml-p<first>p<last>.bz2`` pieces a dump comes in) as
records: one raw ``Wikitext`` per article (namespace 0), a ``Skipped`` record per redirect or other page.

The reader only parses the XML of a byte range of the dump (``data_prep.wiki_units.read_pages``, in reader
processes); ``document_text`` turns a page into prose later, in the worker that processes it, with the namespaces
the dump's site info names.
"""
from __future__ import annotations

import bz2
from collections.abc import Iterator
from pathlib import Path

from data_prep.records import Skipped, SourceError
from data_prep.wiki_units import read_pages
from data_prep.wikitext import link_namespaces, wikitext_to_text


class Wikitext(str):
    """A Wikipedia page's raw wikitext and the dump it is from (whose site info names the wiki's namespaces, so
    ``Kategorie:`` links are dropped on the German Wikipedia); ``document_text`` cleans it (in a worker process, not
    the reader)."""

    dump: str | None = None

    @staticmethod
    def of(text: str, dump: str | None) -> Wikitext:
        page = Wikitext(text)
        page.dump = dump
        return page



def document_text(record: str) -> str:
    """Plain text of a record: Wikipedia markup stripped, anything else unchanged."""
    if not isinstance(record, Wikitext):
        return record
    return wikitext_to_text(record, link_namespaces(record.dump)) if record.dump else wikitext_to_text(record)



HEAD_BYTES = 1 << 16
"""How far into a dump its ``<mediawiki`` root element must begin (after the XML declaration)."""


def check_dump_head(path: Path) -> None:
    """Refuse a file whose first (decompressed) bytes hold no ``<mediawiki`` root: an empty or foreign file owns no
    page in any byte range, so without this check it would be read as a dump without articles."""
    with (bz2.open(path, "rb") if path.suffix == ".bz2" else open(path, "rb")) as f:
        head = f.read(HEAD_BYTES)
    if b"<mediawiki" not in head:
        raise ValueError(f"no <mediawiki> root element in its first {HEAD_BYTES} bytes")


def read_wiki_dump(path: Path, start: int = 0, stop: int = -1) -> Iterator[str | Skipped]:
    """The pages that bytes ``[start, stop)`` of a dump own (``data_prep.wiki_units``; stop -1: to the end). The
    unit at the start of the file also checks that it is a dump (`check_dump_head`)."""
    try:
        if start == 0:
            check_dump_head(path)
        for title, namespace, redirect, wikitext in read_pages(path, start, stop):
            if redirect:
                yield Skipped("wiki_redirect", f"{path}: {title}")
            elif namespace != 0:
                yield Skipped("wiki_not_an_article", f"{path}: {title}")
            else:
                yield Wikitext.of(wikitext, str(path))
    # ET.ParseError is a SyntaxError; bz2 raises OSError or EOFError; an index that names no streams, ValueError
    except (OSError, EOFError, SyntaxError, ValueError) as err:
        raise SourceError(f"--input {path}: not a readable Wikipedia XML dump ({err}); "
                          "pass a complete pages-articles .xml or .xml.bz2 file") from None
