"""``python -m tools.bench_text``: our sentence splitter and wikitext clean-up against blingfire and mwparserfromhell.

On the sample corpora (``make sample-corpus``: the Wikipedia excerpt, Shakespeare's books, the news articles), in
one run on one machine:

  splitting — ``data_prep.text.split_sentences`` against blingfire's ``text_to_sentences`` (the splitter NVIDIA's
              BERT data pipeline uses), both on the same cleaned documents (``clean_document``), blingfire given one
              paragraph at a time (a paragraph end ends a sentence for both): sentences/s and characters/s, and how
              far they agree — precision, recall and F1 of our sentence boundaries against blingfire's (a boundary
              is a position in the document's non-space characters), and the share of our sentences that blingfire
              gives exactly (spaces normalised);
  clean-up  — ``data_prep.wikitext.wikitext_to_text`` against ``mwparserfromhell.parse(page).strip_code()`` (its
              paragraphs: non-blank lines that are not headings, lists, indented lines or table rows and have
              more than three words or end a sentence, as ours keeps them), on the excerpt's articles: pages/s,
              characters/s, and the similarity of the two texts (F1 of their word multisets; 1.0 = the same
              words as often).

Each timing is the fastest of ``--repeat`` runs (the machine may be shared). ``measure`` returns a
dict; ``main`` writes it as JSON (``--out``) and prints a short table of ratios (ours / library).
"""
from __future__ import annotations

import argparse
import collections
import itertools
import json
import os
import platform
import re
import time
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any

from data_prep.sources import Unit, read_documents, read_unit
from data_prep.text import clean_document, ends_a_sentence, split_sentences
from data_prep.wikitext import wikitext_to_text

WIKI = "data/samples/wiki/enwiki-excerpt.xml.bz2"
CORPORA = {"wiki": WIKI, "books": "data/samples/books.jsonl", "news": "data/samples/news/lee.txt"}
EXAMPLES = 5
"""sentences of each splitter that the other does not give, kept in the result"""
_NON_PROSE_LINE = re.compile(r"^\s*(?:=.*=|[*#:;!|{}]|----)")  # what neither clean-up keeps as prose


def _fastest(function: Callable[[], Any], repeat: int) -> tuple[float, Any]:
    best, result = float("inf"), None
    for _ in range(repeat):
        start = time.perf_counter()
        result = function()
        best = min(best, time.perf_counter() - start)
    return best, result


def _boundaries(sentences: list[str]) -> set[int]:
    """Where sentences end, counted in non-space characters from the document start (the last end left out)."""
    ends, position = set(), 0
    for sentence in sentences:
        position += len("".join(sentence.split()))
        ends.add(position)
    ends.discard(position)
    return ends


def _blingfire_sentences(document: str) -> list[str]:
    import blingfire

    return [s for paragraph in document.split("\n\n") if paragraph.strip()
            for s in blingfire.text_to_sentences(paragraph).split("\n") if s.strip()]


def splitting(documents: list[str], repeat: int) -> dict[str, Any]:
    """Our splitter against blingfire's on cleaned ``documents``: speed and agreement."""
    documents = [d for d in (clean_document(text) for text in documents) if d]
    characters = sum(map(len, documents))
    ours_s, ours = _fastest(lambda: [split_sentences(d) for d in documents], repeat)
    theirs_s, theirs = _fastest(lambda: [_blingfire_sentences(d) for d in documents], repeat)
    agreed = ours_only = theirs_only = same_sentences = 0
    examples: dict[str, list[str]] = {"ours": [], "blingfire": []}  # sentences the other splits differently
    for mine, other in zip(ours, theirs):
        a, b = _boundaries(mine), _boundaries(other)
        agreed, ours_only, theirs_only = agreed + len(a & b), ours_only + len(a - b), theirs_only + len(b - a)
        counts = {name: collections.Counter(" ".join(s.split()) for s in sentences)
                  for name, sentences in (("ours", mine), ("blingfire", other))}
        same_sentences += sum((counts["ours"] & counts["blingfire"]).values())
        for name, other_name in (("ours", "blingfire"), ("blingfire", "ours")):
            differ = [s[:200] for s in counts[name] - counts[other_name]]
            examples[name].extend(differ[:EXAMPLES - len(examples[name])])
    precision = agreed / max(1, agreed + ours_only)
    recall = agreed / max(1, agreed + theirs_only)
    num_ours, num_theirs = sum(map(len, ours)), sum(map(len, theirs))
    return {"documents": len(documents), "characters": characters,
            "sentences": {"ours": num_ours, "blingfire": num_theirs},
            "seconds": {"ours": ours_s, "blingfire": theirs_s},
            "sentences_per_s": {"ours": num_ours / ours_s, "blingfire": num_theirs / theirs_s},
            "chars_per_s": {"ours": characters / ours_s, "blingfire": characters / theirs_s},
            "speed_ratio": theirs_s / ours_s,
            "boundary_precision": precision, "boundary_recall": recall,
            "boundary_f1": 2 * precision * recall / max(1e-12, precision + recall),
            "identical_sentences": same_sentences / max(1, num_ours), "differing_sentences": examples}


def _strip_code_paragraphs(wikitext: str) -> str:
    import mwparserfromhell

    text = mwparserfromhell.parse(wikitext).strip_code(normalize=True, collapse=True)
    lines = [line.strip() for line in text.split("\n") if line.strip() and not _NON_PROSE_LINE.match(line)]
    return "\n\n".join(line for line in lines if len(line.split()) > 3 or ends_a_sentence(line))


def _word_f1(a: str, b: str) -> float:
    x, y = collections.Counter(a.split()), collections.Counter(b.split())
    common = sum((x & y).values())
    return 2 * common / max(1, sum(x.values()) + sum(y.values()))


def cleanup(pages: list[str], repeat: int) -> dict[str, Any]:
    """Our wikitext clean-up against mwparserfromhell's ``strip_code`` on raw ``pages``: speed and similarity."""
    characters = sum(map(len, pages))
    ours_s, ours = _fastest(lambda: [wikitext_to_text(p) for p in pages], repeat)
    theirs_s, theirs = _fastest(lambda: [_strip_code_paragraphs(p) for p in pages], repeat)
    similarity = [_word_f1(a, b) for a, b in zip(ours, theirs)]
    return {"pages": len(pages), "characters": characters,
            "output_characters": {"ours": sum(map(len, ours)), "mwparserfromhell": sum(map(len, theirs))},
            "seconds": {"ours": ours_s, "mwparserfromhell": theirs_s},
            "pages_per_s": {"ours": len(pages) / ours_s, "mwparserfromhell": len(pages) / theirs_s},
            "chars_per_s": {"ours": characters / ours_s, "mwparserfromhell": characters / theirs_s},
            "speed_ratio": theirs_s / ours_s,
            "word_f1_mean": sum(similarity) / max(1, len(similarity)),
            "word_f1_overall": _word_f1("\n".join(ours), "\n".join(theirs))}


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "load_average": os.getloadavg(), "python": platform.python_version(),
            "blingfire": version("blingfire"), "mwparserfromhell": version("mwparserfromhell")}


def measure(corpora: dict[str, str] | None = None, max_documents: int | None = None, repeat: int = 3) -> dict:
    """Splitting on each corpus and clean-up on the Wikipedia one (at most ``max_documents`` documents each)."""
    corpora = CORPORA if corpora is None else corpora
    result: dict[str, Any] = {"date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": machine(),
                              "repeat": repeat, "splitting": {}, "cleanup": {}}
    for name, spec in corpora.items():
        documents = [d for d in itertools.islice(read_documents(spec), max_documents) if isinstance(d, str)]
        result["splitting"][name] = splitting(documents, repeat)
        if spec.endswith(".xml.bz2"):
            pages = [r for r in itertools.islice(read_unit(Unit(spec)), max_documents) if isinstance(r, str)]
            result["cleanup"][name] = cleanup([str(p) for p in pages], repeat)
    return result


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m tools.bench_text", description=__doc__.split("\n")[0])
    p.add_argument("--max-documents", type=int, help="at most this many documents of each corpus")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path("bench_out/bench_text.json"))
    args = p.parse_args(argv)
    result = measure(max_documents=args.max_documents, repeat=args.repeat)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"[bench-text] {result['machine']['cpu']}, {result['machine']['cores']} cores; best of {args.repeat}")
    for name, split in result["splitting"].items():
        print(f"[bench-text] split {name:5s}: ours {split['chars_per_s']['ours'] / 1e6:6.2f} MB/s, blingfire "
              f"{split['chars_per_s']['blingfire'] / 1e6:6.2f} MB/s: speed ours/blingfire {split['speed_ratio']:.2f}; "
              f"boundaries F1 {split['boundary_f1']:.3f} (P {split['boundary_precision']:.3f}, "
              f"R {split['boundary_recall']:.3f}); identical sentences {split['identical_sentences']:.3f}")
    for name, clean in result["cleanup"].items():
        print(f"[bench-text] clean {name}: ours {clean['chars_per_s']['ours'] / 1e6:6.2f} MB/s, mwparserfromhell "
              f"{clean['chars_per_s']['mwparserfromhell'] / 1e6:6.2f} MB/s: speed ours/mwparserfromhell "
              f"{clean['speed_ratio']:.2f}; word F1 {clean['word_f1_overall']:.3f} (mean per page "
              f"{clean['word_f1_mean']:.3f})")
    print(f"[bench-text] -> {args.out}")
    return result


if __name__ == "__main__":
    main()
