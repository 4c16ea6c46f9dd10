"""What reading an ``--input`` yields besides plain documents: ``Skipped`` records (counted with their reason),
``RepairedText`` (a document whose bad bytes were replaced), and ``SourceError`` for an input that cannot be read.
"""
from __future__ import annotations

from dataclasses import dataclass


class SourceError(ValueError):
    """An ``--input`` that cannot be read at all; the message names it and says what to do."""


@dataclass(frozen=True)
class Skipped:
    """A document that was dropped, with the reason counted in the manifest (``documents.skip_reasons``)."""

    reason: str
    where: str
    chars: int = 0
    """size of what was dropped (characters, or bytes of an undecodable line): skips are weighed by it"""



class RepairedText(str):
    """A document in which bytes that are not UTF-8 were replaced by U+FFFD: ``lines`` of its lines, the first at
    ``where`` (counted in the manifest's ``documents.repaired_lines``)."""

    lines: int
    where: str

    @staticmethod
    def of(text: str, lines: int, where: str) -> RepairedText:
        repaired = RepairedText(text)
        repaired.lines, repaired.where = lines, where
        return repaired
