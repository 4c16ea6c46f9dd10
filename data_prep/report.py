"""What a build read, kept and dropped (``DocumentStats``), and the warnings and refusals made of those counts.

Nothing is dropped without a counted reason, and the characters of what is dropped are counted too. The build
warns on stderr when the skipped documents hold more than 5 % of the characters read (Wikipedia redirects and
non-article pages aside), when more than 0.5 % of the word pieces are ``[UNK]`` and when fewer than 40 % of NSP
pairs have a random next segment; inputs that give no samples at all are refused (``nothing_kept``).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

SKIP_EXAMPLES = 3
SKIP_WARNING_FRACTION = 0.05
"""skipped characters (of all read) above which the build warns"""
EXPECTED_SKIPS = ("wiki_redirect", "wiki_not_an_article")  # a dump's redirects are not documents; no warning
ONE_SENTENCE_CHARS = 400
"""documents skipped as single sentences that average more characters than this are text the sentence
splitter cannot cut (no sentence ends it knows), not one sentence per row"""
UNK_WARNING_FRACTION = 0.005
"""[UNK] share of the word pieces above which the build warns (a vocab of the wrong casing gives ~13 %)"""
RANDOM_NEXT_WARNING = 0.4
"""share of NSP pairs with a random next segment (the aim is 1/2) below which the build warns"""


@dataclass
class DocumentStats:
    """Per-build accounting of documents and their text: nothing is dropped without a counted reason, and the
    characters of what is dropped are counted too, so one dropped book weighs as much as it is long."""

    read: int = 0
    skipped: int = 0
    skip_reasons: dict[str, int] = field(default_factory=dict)
    skip_examples: dict[str, list[str]] = field(default_factory=dict)
    characters: int = 0
    """characters of every record read (raw: Wikipedia markup counts; bytes for an undecodable line)"""
    skip_characters: dict[str, int] = field(default_factory=dict)
    repaired_lines: int = 0
    """lines of .txt inputs with bytes that are not UTF-8 (replaced by U+FFFD, which the tokenizer drops)"""
    repair_examples: list[str] = field(default_factory=list)
    wordpieces: int = 0
    """word pieces the kept documents encode to, and how many of them are [UNK]"""
    unk_wordpieces: int = 0

    def skip(self, reason: str, where: str, characters: int = 0) -> None:
        self.skipped += 1
        self.skip_reasons[reason] = self.skip_reasons.get(reason, 0) + 1
        self.skip_characters[reason] = self.skip_characters.get(reason, 0) + characters
        examples = self.skip_examples.setdefault(reason, [])
        if len(examples) < SKIP_EXAMPLES:
            examples.append(where)

    def repaired(self, lines: int, where: str) -> None:
        self.repaired_lines += lines
        if len(self.repair_examples) < SKIP_EXAMPLES:
            self.repair_examples.append(where)

    def add(self, other: DocumentStats) -> None:
        self.read += other.read
        self.characters += other.characters
        self.wordpieces += other.wordpieces
        self.unk_wordpieces += other.unk_wordpieces
        for reason, count in sorted(other.skip_reasons.items()):
            self.skipped += count
            self.skip_reasons[reason] = self.skip_reasons.get(reason, 0) + count
            self.skip_characters[reason] = (self.skip_characters.get(reason, 0)
                                            + other.skip_characters.get(reason, 0))
            examples = self.skip_examples.setdefault(reason, [])
            examples.extend(other.skip_examples.get(reason, [])[: SKIP_EXAMPLES - len(examples)])
        self.repaired_lines += other.repaired_lines
        self.repair_examples.extend(other.repair_examples[: SKIP_EXAMPLES - len(self.repair_examples)])



def nothing_kept(what: str, inputs: Sequence[str], stats: DocumentStats) -> str:
    """Why ``inputs`` gave no ``what``: they hold no text, or every document was skipped (the reasons counted, with
    an example of each, which names the fix: a missing text field lists the record's fields and ``--text-field``)."""
    if not stats.read and not stats.skipped:
        return f"no {what} from {list(inputs)}: they hold no text (empty or whitespace-only files?); check the inputs"
    examples = "; ".join(f"{reason}: {where[0]}" for reason, where in sorted(stats.skip_examples.items()) if where)
    return (f"no {what} from {list(inputs)}: {stats.read} documents read, {stats.skipped} skipped "
            f"{stats.skip_reasons} (e.g. {examples}); check the inputs")


def one_sentence_hint(documents: dict, every_input_is_rows: bool) -> str:
    """Advice when most documents are single sentences, by their size: short ones are probably one sentence
    per row; long ones are text in which the sentence splitter finds no sentence end."""
    single = documents["skip_reasons"].get("too_few_sentences", 0)
    read = documents["read"]
    if not read or single <= read / 2:
        return ""
    characters = documents.get("skip_characters", {}).get("too_few_sentences", 0)
    if characters > ONE_SENTENCE_CHARS * single:
        return (f"; {single} of {read} documents are single sentences of {characters // single} characters on "
                "average: the sentence splitter found no sentence end in them (it ends sentences at . ! ? "
                "followed by a space and a capital letter or digit, or in text without capitals any letter, and "
                "at 。！？); for text without these, give one sentence per line with --rows-as-sentences, or use "
                "--recipe gpt, which needs no sentences")
    if every_input_is_rows:
        return ""
    return (f"; {single} of {read} documents are single sentences: if the input has one sentence per row "
            "(as BookCorpus on the Hugging Face hub), pass --rows-as-sentences")


def skip_warning(manifest: dict) -> str | None:
    """A warning when more than 5% of the text read was skipped (by characters, so one dropped book counts as
    much as it is long; by documents for manifests without character counts), naming the reasons (None
    otherwise). Wikipedia redirects and non-article pages do not count: a dump is full of them by design."""
    docs = manifest["documents"]
    expected = sum(docs["skip_reasons"].get(r, 0) for r in EXPECTED_SKIPS)
    skipped, read = docs["skipped"] - expected, docs["read"] - expected
    if "characters" in docs:
        skipped_chars = sum(c for r, c in docs["skip_characters"].items() if r not in EXPECTED_SKIPS)
        read_chars = docs["characters"] - sum(docs["skip_characters"].get(r, 0) for r in EXPECTED_SKIPS)
        if skipped_chars <= SKIP_WARNING_FRACTION * read_chars:
            return None
        share = f"{skipped_chars / read_chars:.0%} of the characters read"
    elif skipped <= SKIP_WARNING_FRACTION * read:
        return None
    else:
        share = f"{skipped / read:.0%}"
    rows = set(manifest.get("reading", {}).get("rows_as_sentences", []))
    examples = "; ".join(f"{reason}: {where[0]}" for reason, where in sorted(docs.get("skip_examples", {}).items())
                         if where)
    return (f"[build] warning: {skipped} of {read} documents ({share}) were skipped: {docs['skip_reasons']} "
            f"(e.g. {examples}; more in manifest.json documents.skip_examples)"
            + one_sentence_hint(docs, rows == set(manifest["inputs"])))


def random_next_warning(manifest: dict) -> str | None:
    """A warning when NSP pairs have a random next segment far less often than half the time (None otherwise)."""
    counts = manifest.get("nsp_counts", {})
    pairs = counts.get("random_next", 0) + counts.get("true_next", 0)
    if pairs < 100 or counts["random_next"] >= RANDOM_NEXT_WARNING * pairs:
        return None
    return (f"[build] warning: only {counts['random_next'] / pairs:.1%} of the {pairs} NSP pairs have a random next "
            "segment (the aim is 50 %): a pair draws one from another document of its chunk or the neighbouring "
            "chunk, else from its own document away from A, and these inputs offer neither (documents of a few "
            "sentences, each alone in its file?)")


def unk_warning(manifest: dict, vocab_name: str, casing_from: str | None = None) -> str | None:
    """A warning when more than 0.5 % of the word pieces are [UNK], naming the vocab and its casing; the other
    casing is suggested only when no file beside the vocab (``casing_from``) states it."""
    pieces = manifest.get("wordpieces", {})
    if not pieces.get("total") or pieces["unk"] <= UNK_WARNING_FRACTION * pieces["total"]:
        return None
    uncased = manifest["vocab"]["uncased"]
    casing = "uncased" if uncased else "cased"
    fix = "use a vocab made for this text (--train-vocab SIZE --vocab-out PATH)"
    if casing_from is None:
        fix = (f"a vocab read with the wrong casing does this: pass {'--cased' if uncased else '--uncased'} if the "
               f"vocab is {'cased' if uncased else 'uncased'}; else {fix}")
    else:
        casing += f", as {casing_from} states"
    return (f"[build] warning: {pieces['unk'] / pieces['total']:.1%} of the word pieces are [UNK]: vocab "
            f"{vocab_name} ({casing}) does not cover this text; {fix}")

