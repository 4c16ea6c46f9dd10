"""Wikipedia XML dumps (``.xml``, ``.xml.bz2``, the ``…xml-p<first>p<last>.bz2`` pieces a dump comes in) as
records: one raw ``Wikitext`` per article (namespace 0), a ``Skipped`` record per redirect or other page.

The reader only parses the XML of a byte range of the dump (``data_prep.wiki_units.read_pages``, in reader
processes, which in a build write the articles' texts to files: a ``SpilledPage`` says where one is);
``document_text`` turns a page into prose later, in the worker that processes it, with the namespaces the dump's
site info names.
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from data_prep.records import Skipped, SourceError
from data_prep.wiki_units import SpilledText, read_pages
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


class SpilledPage:
    """An article whose wikitext a reader process wrote to a file (``data_prep.wiki_units.spill_piece``): the
    build's main process hands out where it is, and the worker that processes it reads it back (``load``)."""

    __slots__ = ("text", "dump")

    def __init__(self, text: SpilledText, dump: str):
        self.text, self.dump = text, dump

    def load(self) -> Wikitext:
        return Wikitext.of(self.text.read(), self.dump)


def characters(record: str | SpilledPage | Skipped) -> int:
    """The characters of a document (raw: Wikipedia markup counts), spilled or not; 0 for a skip."""
    return len(record) if isinstance(record, str) else record.text.chars if isinstance(record, SpilledPage) else 0


def has_text(record: str | SpilledPage | Skipped) -> bool:
    """Whether a record is a document with more than whitespace."""
    return bool(record.strip()) if isinstance(record, str) else isinstance(record, SpilledPage) and \
        not record.text.blank


def document_text(record: str) -> str:
    """Plain text of a record: Wikipedia markup stripped, anything else unchanged."""
    if not isinstance(record, Wikitext):
        return record
    return wikitext_to_text(record, link_namespaces(record.dump)) if record.dump else wikitext_to_text(record)



def read_wiki_dump(path: Path, start: int = 0, stop: int = -1,
                   spill: str | None = None) -> Iterator[str | Skipped | SpilledPage]:
    """The pages that bytes ``[start, stop)`` of a dump own (``data_prep.wiki_units``; stop -1: to the end). The
    piece at the start of the file also checks that it is a dump (``data_prep.wiki_units.check_dump_head``). With
    ``spill`` (a folder) the articles that reader processes read come as `SpilledPage`."""
    try:
        for title, namespace, redirect, wikitext in read_pages(path, start, stop, spill=spill):
            if redirect:
                yield Skipped("wiki_redirect", f"{path}: {title}")
            elif namespace != 0:
                yield Skipped("wiki_not_an_article", f"{path}: {title}")
            elif isinstance(wikitext, SpilledText):
                yield SpilledPage(wikitext, str(path))
            else:
                yield Wikitext.of(wikitext, str(path))
    # ET.ParseError is a SyntaxError; bz2 raises OSError or EOFError; an index that names no streams, ValueError
    except (OSError, EOFError, SyntaxError, ValueError) as err:
        raise SourceError(f"--input {path}: not a readable Wikipedia XML dump ({err}); "
                          "pass a complete pages-articles .xml or .xml.bz2 file") from None
