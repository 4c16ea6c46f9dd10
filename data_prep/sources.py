"""Document sources for ``--input``: local files by suffix, or a Hugging Face ``datasets`` name.

=====================================  ===========================================================
``*.xml`` / ``*.xml.bz2``               Wikipedia dump; one document per article (namespace 0, no redirects)
``*.jsonl``                             one JSON object per line with a ``text`` field
``*.json``                              a JSON array of objects with ``text`` (else read as JSON lines)
``*.parquet``                           a ``text`` column, read in record batches
``*.txt``                               documents separated by blank lines
an existing directory, or               ``datasets.load_dataset(name, config, split=split, streaming=True)``,
``name[:config][:split]``               field ``text`` (e.g. ``wikimedia/wikipedia:20231101.en:train``)
=====================================  ===========================================================

``read_documents`` streams ``str`` documents (raw; clean-up happens later) and ``Skipped`` records for input
it cannot use — a line that is not UTF-8 or not JSON, a record without a string ``text`` — so every skip is
counted with its reason. Problems with the input as a whole (missing file, unknown suffix, a parquet file
without ``text``) raise ``SourceError`` naming the input and the fix.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from data_prep.wikitext import iter_pages, wikitext_to_text

FILE_SUFFIXES = (".xml", ".xml.bz2", ".jsonl", ".json", ".parquet", ".txt")
TEXT_FIELD = "text"


class SourceError(ValueError):
    """An ``--input`` that cannot be read at all; the message names it and says what to do."""


@dataclass(frozen=True)
class Skipped:
    """A document that was dropped, with the reason counted in the manifest (``documents.skip_reasons``)."""

    reason: str
    where: str


def _suffix(path: Path) -> str:
    name = path.name.lower()
    return next((s for s in sorted(FILE_SUFFIXES, key=len, reverse=True) if name.endswith(s)), "")


def check_input(spec: str) -> None:
    """Fail early for a path-like input that does not exist or has an unsupported suffix."""
    path = Path(spec)
    if path.is_dir():
        return
    if path.exists():
        if not _suffix(path):
            raise SourceError(f"--input {spec}: unsupported file type; use one of {', '.join(FILE_SUFFIXES)} "
                              "or a Hugging Face dataset name")
        return
    if _suffix(path) or spec.endswith((".bz2", ".gz", ".csv", ".tsv")) or spec.startswith((".", "/", "~")):
        raise SourceError(f"--input {spec}: file not found")


def read_documents(spec: str) -> Iterator[str | Skipped]:
    """Documents of one ``--input``, streamed in a fixed order."""
    check_input(spec)
    path = Path(spec)
    if not path.exists() or path.is_dir():
        yield from _read_hf(spec)
        return
    reader = {".xml": _read_wiki, ".xml.bz2": _read_wiki, ".jsonl": _read_jsonl, ".json": _read_json,
              ".parquet": _read_parquet, ".txt": _read_txt}[_suffix(path)]
    yield from reader(path)


def _text_of(record: object, where: str) -> str | Skipped:
    if not isinstance(record, dict):
        return Skipped("not_an_object", where)
    text = record.get(TEXT_FIELD)
    if text is None:
        return Skipped("missing_text_field", where)
    if not isinstance(text, str):
        return Skipped("text_not_a_string", where)
    return text


def _read_wiki(path: Path) -> Iterator[str | Skipped]:
    try:
        for title, namespace, redirect, wikitext in iter_pages(path):
            if redirect:
                yield Skipped("wiki_redirect", f"{path}: {title}")
            elif namespace != 0:
                yield Skipped("wiki_not_an_article", f"{path}: {title}")
            else:
                yield wikitext_to_text(wikitext)
    except (OSError, EOFError, SyntaxError) as err:  # ET.ParseError is a SyntaxError; bz2 raises OSError/EOFError
        raise SourceError(f"--input {path}: not a readable Wikipedia XML dump ({err}); "
                          "pass a complete pages-articles .xml or .xml.bz2 file") from None


def _read_jsonl(path: Path) -> Iterator[str | Skipped]:
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            where = f"{path}:{number}"
            if not raw.strip():
                continue
            try:
                record = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError:
                yield Skipped("invalid_utf8", where)
                continue
            except json.JSONDecodeError:
                yield Skipped("malformed_json", where)
                continue
            yield _text_of(record, where)


def _read_json(path: Path) -> Iterator[str | Skipped]:
    with open(path, "rb") as f:
        head = f.read(4096).lstrip()
    if not head.startswith(b"["):
        yield from _read_jsonl(path)
        return
    try:
        records = json.loads(path.read_bytes().decode("utf-8"))  # a JSON array has to be parsed whole
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise SourceError(f"--input {path}: not valid UTF-8 JSON ({err}); fix the file or convert it to .jsonl, "
                          "where bad lines are skipped and counted") from None
    for number, record in enumerate(records):
        yield _text_of(record, f"{path}[{number}]")


def _read_parquet(path: Path) -> Iterator[str | Skipped]:
    import pyarrow.parquet as pq  # optional: only parquet inputs need it

    try:
        parquet = pq.ParquetFile(path)
    except Exception as err:  # pyarrow raises several unrelated types for a damaged file
        raise SourceError(f"--input {path}: not a readable parquet file ({err})") from None
    columns = parquet.schema_arrow.names
    if TEXT_FIELD not in columns:
        raise SourceError(f"--input {path}: no '{TEXT_FIELD}' column (columns: {columns}); "
                          f"rename the document column to '{TEXT_FIELD}'")
    row = 0
    for batch in parquet.iter_batches(columns=[TEXT_FIELD], batch_size=1024):
        for text in batch.column(0).to_pylist():
            yield text if isinstance(text, str) else Skipped("text_not_a_string", f"{path} row {row}")
            row += 1


def _read_txt(path: Path) -> Iterator[str | Skipped]:
    lines: list[bytes] = []
    start = 1
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            if raw.strip():
                if not lines:
                    start = number
                lines.append(raw)
            elif lines:
                yield _decode(b"".join(lines), f"{path}:{start}")
                lines = []
        if lines:
            yield _decode(b"".join(lines), f"{path}:{start}")


def _decode(raw: bytes, where: str) -> str | Skipped:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return Skipped("invalid_utf8", where)


def _read_hf(spec: str) -> Iterator[str | Skipped]:
    """``name[:config][:split]`` (split defaults to ``train``), streamed so large corpora never sit in RAM."""
    import datasets  # optional and slow to import: only hub inputs need it

    name, config, split = (spec.split(":") + ["", ""])[:3] if not Path(spec).is_dir() else (spec, "", "")
    try:
        dataset = datasets.load_dataset(name, config or None, split=split or "train", streaming=True)
    except Exception as err:  # hub, network and builder errors have no common base class
        raise SourceError(f"--input {spec}: could not load Hugging Face dataset {name!r} "
                          f"(config {config or None!r}, split {split or 'train'!r}): {type(err).__name__}: {err}. "
                          "Check the name and network access, or pass local files") from None
    for number, record in enumerate(dataset):
        yield _text_of(record, f"{spec} record {number}")
