"""Document clean-up and rule-based sentence splitting (no model download).

``clean_document`` normalises line ends, drops control characters and lone surrogates, and turns every whitespace
run inside a line into one space; paragraphs (blank-line separated) stay separate. Inside a paragraph a line break
ends a paragraph too (one sentence or paragraph per line: BERT's pre-training text format, a heading line before its
text), unless the paragraph is hard-wrapped running text — some line that ends no sentence is followed by one that
starts in lower case (Project Gutenberg's 70-column lines) — whose lines are joined.
``split_sentences`` cuts each paragraph after ``.``/``!``/``?`` (plus closing quotes or brackets) followed by
whitespace and a capital letter (any script: ``str.isupper``), a letter of a script without case (Unicode category
Lo: Arabic, Hebrew, Hangul, Thai, Devanagari, CJK, …; so a Latin acronym in Arabic prose leaves its sentences
split), digit or opening quote, except after common abbreviations and initials; and after the terminators of
scripts that do not use ``.`` (plus closing quotes or brackets), with or without whitespace after them: the
full-width ``。！？．`` of Chinese and Japanese, the Devanagari ``।``/``॥`` (Hindi, Marathi, Nepali; Bengali uses
the same), the Arabic ``؟`` and Urdu ``۔``, the Ethiopic ``።``/``፧``, the Armenian ``։`` and the Myanmar ``။``.
A document of at least ``UNCASED_MIN_CHARS`` characters with no capital letter at all (lower-casing changes nothing
in it: lowercased prose, as uncased corpora ship; scripts without case) is cut after ``.``/``!``/``?`` followed by
whitespace and any letter or digit instead, with the same exceptions lowercased; a shorter one may be a fragment of
cased text, so the cased rule stays. Text with neither capitals nor terminators stays one sentence per paragraph.
Sentences longer than ``MAX_SENTENCE_CHARS`` are cut at whitespace so one huge line cannot become one unbounded
sequence.
"""
from __future__ import annotations

import functools
import re
import sys
import unicodedata

MAX_SENTENCE_CHARS = 2000
UNCASED_MIN_CHARS = 200
"""a document this long without a single capital letter is taken as lowercased text (cased prose of this length
has capitals: every sentence starts with one); shorter ones, a line or a quote, are not"""

# lone surrogates (JSON allows "\ud800") are dropped too: they are not text, and tokenizers refuses them
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ud800-\udfff\ufeff\ufffe\uffff]")
_PARAGRAPH_BREAK = re.compile(r"\n\s*\n")
_ABBREVIATIONS = ("Mr Mrs Ms Dr Prof Sr Jr St Mt Gen Col Capt Lt Sgt Rev Gov Sen Rep Hon vs etc No Vol pp "
                  "Fig Inc Ltd Co Corp Jan Feb Mar Apr Jun Jul Aug Sep Sept Oct Nov Dec approx ca cf e.g i.e").split()


def _character_class(predicate) -> str:
    """A regex character class (without brackets) of every code point for which ``predicate`` holds, as ranges."""
    points = [c for c in range(sys.maxunicode + 1) if predicate(chr(c))]
    ranges: list[list[int]] = []
    for c in points:
        if ranges and ranges[-1][1] == c - 1:
            ranges[-1][1] = c
        else:
            ranges.append([c, c])
    return "".join(re.escape(chr(a)) if a == b else f"{re.escape(chr(a))}-{re.escape(chr(b))}" for a, b in ranges)


_CLOSERS = "\"')\\]\u201d\u2019\u00bb"                # " ' ) ] ” ’ »
_OPENERS = "\"'(\\[\u201c\u2018\u00ab\u201e\u00bf\u00a1"  # " ' ( [ “ ‘ « „ ¿ ¡
_TERMINATORS = ("\u3002\uff01\uff1f\uff0e"  # 。！？． (Chinese, Japanese)
                "\u0964\u0965"              # । ॥ (Devanagari and Bengali danda)
                "\u061f\u06d4"              # ؟ ۔ (Arabic question mark, Urdu full stop)
                "\u1362\u1367"              # ። ፧ (Ethiopic full stop and question mark)
                "\u0589\u104b")             # ։ ။ (Armenian full stop, Myanmar section mark)
_TERMINATOR_CLOSERS = _CLOSERS + "\u300d\u300f\uff09\u3009\u300b\u3011\u3015"  # and 」』）〉》】〕


def _boundary(abbreviations: list[str], initial: str, starter: str) -> re.Pattern:
    """Group 1 ends a sentence: . ! ? (with an optional closing quote or bracket) that does not end one of the
    ``abbreviations`` or an initial (a letter of class ``initial``), when whitespace, opening quotes and a letter of
    class ``starter`` follow; or a run of the other scripts' terminators with their closing brackets, whatever
    follows. The whitespace after it is dropped. Each alternative starts with its punctuation class, so the
    fixed-width lookbehinds only run at candidate boundaries: one per length of abbreviation (the same test as
    one per abbreviation, in a fifth of the lookbehinds)."""
    by_length: dict[int, list[str]] = {}
    for abbreviation in abbreviations:
        by_length.setdefault(len(abbreviation), []).append(re.escape(abbreviation))
    return re.compile(
        r"([.!?]" + "".join(rf"(?<!\b(?:{'|'.join(same)})\.)" for _, same in sorted(by_length.items()))
        + rf"(?<!\b[{initial}]\.)[{_CLOSERS}]?(?=\s+[{_OPENERS}]*[{starter}])"
        + rf"|[{_TERMINATORS}]+[{_TERMINATOR_CLOSERS}]*)\s*")


@functools.cache
def sentence_boundaries() -> tuple[re.Pattern, re.Pattern]:
    """The boundary patterns of cased and of uncased text, built at first use: their character classes scan every
    code point (~0.3 s), which a process that never splits sentences (a training rank) should not pay at import.
    A shard build calls it before it forks its workers, so they inherit the patterns instead of each building them.

    Cased text: a capital, a letter without case or a digit starts the next sentence. A document without capitals:
    any letter or digit, and the abbreviations and one-letter initials it must not end at are the lowercased ones."""
    upper = _character_class(str.isupper)  # A-Z, À-Þ, Α-Ω, А-Я, …: ~1,900 code points in ~650 ranges
    caseless = _character_class(lambda c: unicodedata.category(c) == "Lo")  # ا, א, 한, ก, क, 中, …: ~400 ranges
    return (_boundary(_ABBREVIATIONS, upper, f"{upper}{caseless}0-9"),
            _boundary(sorted({a.lower() for a in _ABBREVIATIONS}), r"^\W\d_", r"^\W_"))


_LINE_END = re.compile(rf"[.!?\u2026{_TERMINATORS}][{_TERMINATOR_CLOSERS}]*$")
_LONG_PIECE = re.compile(rf"\S.{{0,{MAX_SENTENCE_CHARS - 2}}}(?=\s|$)|\S{{{MAX_SENTENCE_CHARS}}}")


def replace_control_characters(text: str, replacement: str = "") -> str:
    """``text`` with its control characters, lone surrogates and non-characters replaced (dropped by default).
    Fine-tuning replaces them by U+FFFD, which BERT's normaliser drops, so offsets into ``text`` stay right."""
    return _CONTROL.sub(replacement, text)


def clean_document(text: str) -> str:
    """Normalised text: paragraphs separated by one blank line, each paragraph on one line, single spaces; the lines
    of a paragraph are paragraphs of their own unless it is hard-wrapped (`hard_wrapped`)."""
    text = replace_control_characters(text.replace("\r\n", "\n").replace("\r", "\n"))
    paragraphs: list[str] = []
    for block in _PARAGRAPH_BREAK.split(text):
        lines = block.strip().split("\n")
        if len(lines) > 1 and not hard_wrapped([line.strip() for line in lines]):
            paragraphs.extend(" ".join(line.split()) for line in lines)
        else:
            paragraphs.append(" ".join(block.split()))
    return "\n\n".join(p for p in paragraphs if p)


def hard_wrapped(lines: list[str]) -> bool:
    """Whether a paragraph's stripped lines are one running text cut at a width: some line that ends no sentence
    (no ``.``/``!``/``?``/``…`` or another script's terminator, closing quotes or brackets allowed) is followed by
    a line starting in lower case. Lines that each end a sentence, or start with a capital (verse, a heading, a
    list), are kept as lines: BERT's one-sentence-per-line text."""
    return any(line[:1].islower() and not ends_a_sentence(previous) for previous, line in zip(lines, lines[1:]))


def ends_a_sentence(text: str) -> bool:
    """Whether ``text`` ends with ``.``/``!``/``?``/``…`` or another script's terminator (``。``, ``।``, ``؟`` …),
    closing quotes or brackets allowed after it."""
    return _LINE_END.search(text) is not None


def split_sentences(document: str, uncased: bool | None = None) -> list[str]:
    """Sentences of a cleaned document, in order; never empty strings. ``uncased``: whether the document's
    sentences may start with a lowercase letter (None: when it is long enough to tell, `UNCASED_MIN_CHARS`, and
    has no capital; a lowercasing model's output, however short, is uncased)."""
    if uncased is None:
        uncased = len(document) >= UNCASED_MIN_CHARS and document == document.lower()  # no capital: ~1 GB/s
    cased_boundary, uncased_boundary = sentence_boundaries()
    boundary = uncased_boundary if uncased else cased_boundary
    parts = boundary.split(document)  # one regex pass per document; paragraph ends are handled below
    parts.append("")  # split alternates text and the punctuation that ends it
    sentences = [text + end for text, end in zip(parts[0::2], parts[1::2])]
    if "\n" in document:  # a paragraph end always ends a sentence, punctuated or not
        sentences = [piece for s in sentences for piece in s.split("\n\n")]
    if sentences and max(map(len, sentences)) > MAX_SENTENCE_CHARS:
        sentences = [piece for s in sentences for piece in _bounded(s)]
    return [s for s in sentences if s]


def _bounded(sentence: str) -> list[str]:
    if len(sentence) <= MAX_SENTENCE_CHARS:
        return [sentence]
    return [m.group(0).strip() for m in _LONG_PIECE.finditer(sentence)]
