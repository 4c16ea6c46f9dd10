"""Document sources for ``--input``: local files by suffix, or a Hugging Face ``datasets`` name.

=====================================  ===========================================================
``*.xml`` / ``*.xml.bz2``               Wikipedia dump; one document per article (namespace 0, no redirects)
``*.jsonl``                             one JSON object per line with a ``text`` field
``*.json``                              a JSON array of objects with ``text`` (else read as JSON lines)
``*.parquet``                           a ``text`` column, read in record batches
``*.txt``                               documents separated by blank lines
a directory of such files               every file, in sorted path order (hidden files and ``*.md`` ignored)
another directory, or                   ``datasets.load_dataset(name, config, split=split, streaming=True)``,
``name[:config][:split]``               field ``text`` (e.g. ``wikimedia/wikipedia:20231101.en:train``)
=====================================  ===========================================================

``read_documents`` streams ``str`` documents (raw; clean-up happens later) and ``Skipped`` records for input
it cannot use — a line that is not UTF-8 or not JSON, a record without a string ``text`` — so every skip is
counted with its reason. Problems with the input as a whole (missing file, unknown suffix, a parquet file or
dataset without the text column) raise ``SourceError`` naming the input and the fix. ``--text-field NAME`` picks
another column than ``text``.

Work is split into units (``input_units``): one per local file, one per ``unit_bytes`` byte range of a large
``.jsonl`` file (a range holds the lines that start in it), one per shard of a Hugging Face dataset
(``IterableDataset.shard``), so several builders read disjoint parts of the inputs. Wikipedia pages come out
as raw ``Wikitext``; ``document_text`` turns them into prose in the worker that processes them.

Sentence-per-row corpora (BookCorpus on the hub is one sentence per row) use ``group_rows``: consecutive rows
become the sentences of one document of at most ``rows_per_document`` rows; an empty row ends a document early.
For ``.txt`` inputs a row is a line.
"""
from __future__ import annotations

import functools
import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from data_prep.wikitext import iter_pages, wikitext_to_text

FILE_SUFFIXES = (".xml", ".xml.bz2", ".jsonl", ".json", ".parquet", ".txt")
TEXT_FIELD = "text"
ROWS_PER_DOCUMENT = 1000
"""default --rows-per-document: ~70k characters of book sentences, ~30 samples of 512 tokens, so the one short
sample at each document's end costs little padding, and a 500k-character chunk still holds several documents
for NSP's random next segments"""
UNIT_BYTES = 1 << 28
"""a .jsonl file larger than this is read as several units (byte ranges), so several builders can share it"""


class SourceError(ValueError):
    """An ``--input`` that cannot be read at all; the message names it and says what to do."""


@dataclass(frozen=True)
class Skipped:
    """A document that was dropped, with the reason counted in the manifest (``documents.skip_reasons``)."""

    reason: str
    where: str


class Wikitext(str):
    """A Wikipedia page's raw wikitext; ``document_text`` cleans it (in a worker process, not the reader)."""


def document_text(record: str) -> str:
    """Plain text of a record: Wikipedia markup stripped, anything else unchanged."""
    return wikitext_to_text(record) if isinstance(record, Wikitext) else record


@dataclass(frozen=True)
class Unit:
    """The part of one ``--input`` a builder reads on its own: a whole file, or shard ``shard`` of a dataset."""

    spec: str
    shard: int = 0
    num_shards: int = 1
    start: int = 0
    """byte range [start, stop) of a file: the lines that start in it (stop -1: to the end)"""
    stop: int = -1

    def __str__(self) -> str:
        if self.num_shards > 1:
            return f"{self.spec} shard {self.shard}/{self.num_shards}"
        return self.spec if (self.start, self.stop) == (0, -1) else f"{self.spec} bytes {self.start}-{self.stop}"


@dataclass(frozen=True)
class ReadOptions:
    """How records become documents (part of a build's identity)."""

    text_field: str = TEXT_FIELD
    rows_as_sentences: bool = False
    rows_per_document: int = ROWS_PER_DOCUMENT

    def __post_init__(self) -> None:
        if not self.text_field:
            raise ValueError("--text-field must name a field")
        if self.rows_per_document < 2:
            raise ValueError(f"--rows-per-document {self.rows_per_document} must be at least 2 "
                             "(a sample pairs sentences)")


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


def _is_hf(spec: str) -> bool:
    path = Path(spec)
    return not path.exists() or (path.is_dir() and _local_files(path) is None)


def _local_files(directory: Path) -> list[Path] | None:
    """The files of a directory that holds only files this module reads (so each is read here, naming its
    lines in every skip or error), else None: a Hugging Face dataset folder."""
    files = sorted(p for p in directory.rglob("*") if p.is_file() and not p.name.startswith(".")
                   and not any(part.startswith(".") for part in p.relative_to(directory).parts)
                   and not p.name.lower().endswith(".md"))
    if not files or not all(_suffix(p) for p in files):
        return None
    return files


def input_units(spec: str, unit_bytes: int = UNIT_BYTES) -> list[Unit]:
    """The units of one ``--input``: the file itself (or byte ranges of a large .jsonl), each file of a
    directory, or every dataset shard."""
    check_input(spec)
    if Path(spec).is_dir() and (files := _local_files(Path(spec))) is not None:
        return [unit for p in files for unit in _file_units(p, unit_bytes)]
    if not _is_hf(spec):
        return _file_units(Path(spec), unit_bytes)
    num_shards = _load_hf(spec).num_shards
    return [Unit(spec, shard, num_shards) for shard in range(num_shards)]


def _file_units(path: Path, unit_bytes: int) -> list[Unit]:
    size = path.stat().st_size
    if _suffix(path) != ".jsonl" or size <= unit_bytes:
        return [Unit(str(path))]
    starts = range(0, size, unit_bytes)
    return [Unit(str(path), start=start, stop=min(start + unit_bytes, size)) for start in starts]


def read_documents(spec: str, options: ReadOptions = ReadOptions()) -> Iterator[str | Skipped]:
    """Documents of one ``--input`` as plain text, streamed in a fixed order."""
    for unit in input_units(spec):
        for record in read_unit(unit, options):
            yield record if isinstance(record, Skipped) else document_text(record)


def read_unit(unit: Unit, options: ReadOptions = ReadOptions()) -> Iterator[str | Skipped]:
    """Records of one unit (Wikipedia pages as raw ``Wikitext``), rows grouped when ``rows_as_sentences``."""
    if _is_hf(unit.spec):
        records = _read_hf(unit, options.text_field)
    else:
        path = Path(unit.spec)
        suffix = _suffix(path)
        if options.rows_as_sentences and suffix in (".xml", ".xml.bz2"):
            raise SourceError(f"--input {unit.spec}: --rows-as-sentences does not apply to a Wikipedia dump (its "
                              "records are whole articles); name only the sentence-per-row inputs after the flag")
        if suffix == ".txt" and options.rows_as_sentences:
            records = _read_txt_lines(path)
        elif suffix in (".xml", ".xml.bz2", ".txt"):
            records = {".xml": _read_wiki, ".xml.bz2": _read_wiki, ".txt": _read_txt}[suffix](path)
        elif suffix == ".jsonl":
            records = _read_jsonl(path, options.text_field, unit.start, unit.stop)
        else:
            records = {".json": _read_json, ".parquet": _read_parquet}[suffix](path, options.text_field)
    return group_rows(records, options.rows_per_document) if options.rows_as_sentences else records


def group_rows(rows: Iterator[str | Skipped], rows_per_document: int) -> Iterator[str | Skipped]:
    """Consecutive rows as the sentences (paragraphs) of documents of at most ``rows_per_document`` rows.

    Rows are joined by blank lines, so each row ends at least one sentence; an empty row ends a document early.
    """
    rows_of_document: list[str] = []
    for row in rows:
        if isinstance(row, Skipped):
            yield row
            continue
        if row.strip():
            rows_of_document.append(row)
        if rows_of_document and (not row.strip() or len(rows_of_document) == rows_per_document):
            yield "\n\n".join(rows_of_document)
            rows_of_document = []
    if rows_of_document:
        yield "\n\n".join(rows_of_document)


class _TextField:
    """Picks the text field of records; a record without it is skipped with the fields it has, so the summary
    and the warning show which ``--text-field`` was meant."""

    def __init__(self, name: str):
        self.name = name

    def __call__(self, record: object, where: str) -> str | Skipped:
        if not isinstance(record, dict):
            return Skipped("not_an_object", where)
        text = record.get(self.name)
        if text is None:
            return Skipped("missing_text_field", f"{where} (no '{self.name}'; fields: {sorted(record)[:10]}; "
                                                 "pick one with --text-field NAME)")
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
                yield Wikitext(wikitext)
    except (OSError, EOFError, SyntaxError) as err:  # ET.ParseError is a SyntaxError; bz2 raises OSError/EOFError
        raise SourceError(f"--input {path}: not a readable Wikipedia XML dump ({err}); "
                          "pass a complete pages-articles .xml or .xml.bz2 file") from None


def _read_jsonl(path: Path, text_field: str, start: int = 0, stop: int = -1) -> Iterator[str | Skipped]:
    """The lines that start in bytes [start, stop) (stop -1: to the end of the file)."""
    text_of = _TextField(text_field)
    with open(path, "rb") as f:
        position = start
        if start:
            f.seek(start - 1)
            position += len(f.readline()) - 1  # the rest of a line that started before `start`
        first_line = _LineNumber(path, position)
        for number in itertools.count():
            if stop != -1 and position >= stop:
                return
            raw = f.readline()
            if not raw:
                return
            position += len(raw)
            if not raw.strip():
                continue
            try:
                record = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError:
                yield Skipped("invalid_utf8", f"{path}:{first_line() + number}")
                continue
            except json.JSONDecodeError:
                yield Skipped("malformed_json", f"{path}:{first_line() + number}")
                continue
            if isinstance(record, dict) and isinstance(text := record.get(text_field), str):
                yield text
            else:
                yield text_of(record, f"{path}:{first_line() + number}")


class _LineNumber:
    """The line number at a byte offset, counted only when first asked (a skip to report), once per range."""

    def __init__(self, path: Path, offset: int):
        self.path, self.offset, self.line = path, offset, None if offset else 1

    def __call__(self) -> int:
        if self.line is None:
            newlines, remaining = 0, self.offset
            with open(self.path, "rb") as f:
                while remaining:
                    block = f.read(min(remaining, 1 << 20))
                    newlines, remaining = newlines + block.count(b"\n"), remaining - len(block)
            self.line = newlines + 1
        return self.line


def _read_json(path: Path, text_field: str) -> Iterator[str | Skipped]:
    with open(path, "rb") as f:
        head = f.read(4096).lstrip()
    if not head.startswith(b"["):
        yield from _read_jsonl(path, text_field)
        return
    raw = path.read_bytes()
    try:
        records = json.loads(raw.decode("utf-8"))  # a JSON array has to be parsed whole
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        line = raw[:err.start].count(b"\n") + 1 if isinstance(err, UnicodeDecodeError) else err.lineno
        raise SourceError(f"--input {path}: not valid UTF-8 JSON at line {line} ({err}); fix the file or convert "
                          "it to .jsonl, where bad lines are skipped and counted") from None
    text_of = _TextField(text_field)
    for number, record in enumerate(records):
        yield text_of(record, f"{path}[{number}]")


def _read_parquet(path: Path, text_field: str) -> Iterator[str | Skipped]:
    import pyarrow.parquet as pq  # optional: only parquet inputs need it

    try:
        parquet = pq.ParquetFile(path)
    except Exception as err:  # pyarrow raises several unrelated types for a damaged file
        raise SourceError(f"--input {path}: not a readable parquet file ({err})") from None
    columns = parquet.schema_arrow.names
    if text_field not in columns:
        raise SourceError(f"--input {path}: no '{text_field}' column (columns: {columns}); "
                          "pass --text-field NAME for the column that holds the text")
    row = 0
    for batch in parquet.iter_batches(columns=[text_field], batch_size=1024):
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


def _read_txt_lines(path: Path) -> Iterator[str | Skipped]:
    """Every line of a sentence-per-line text file as a row (blank lines as empty rows)."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            yield _decode(raw.rstrip(b"\r\n"), f"{path}:{number}")


def _decode(raw: bytes, where: str) -> str | Skipped:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return Skipped("invalid_utf8", where)


@functools.lru_cache(maxsize=8)  # one hub look-up per input, not one per shard
def _load_hf(spec: str):
    """``name[:config][:split]`` (split defaults to ``train``) or a local dataset folder, as a streaming dataset."""
    import datasets  # optional and slow to import: only hub inputs need it

    name, config, split = (spec.split(":") + ["", ""])[:3] if not Path(spec).is_dir() else (spec, "", "")
    try:
        return datasets.load_dataset(name, config or None, split=split or "train", streaming=True)
    except Exception as err:  # hub, network and builder errors have no common base class
        raise SourceError(f"--input {spec}: could not load Hugging Face dataset {name!r} "
                          f"(config {config or None!r}, split {split or 'train'!r}): {type(err).__name__}: {err}. "
                          "Check the name and network access, or pass local files") from None


def _read_hf(unit: Unit, text_field: str) -> Iterator[str | Skipped]:
    """One shard of a dataset, streamed so large corpora never sit in RAM."""
    dataset = _load_hf(unit.spec)
    if dataset.num_shards != unit.num_shards:
        raise SourceError(f"--input {unit.spec}: now has {dataset.num_shards} shards, {unit.num_shards} when the "
                          "build started; the dataset changed under the build")
    if unit.num_shards > 1:
        dataset = dataset.shard(num_shards=unit.num_shards, index=unit.shard)
    columns = dataset.column_names  # None when a streaming dataset does not declare its features
    if columns is not None and text_field not in columns:
        raise SourceError(f"--input {unit.spec}: no '{text_field}' column (columns: {columns}); "
                          "pass --text-field NAME for the column that holds the text")
    text_of = _TextField(text_field)
    records = iter(dataset)
    number = 0
    while True:
        try:
            record = next(records)
        except StopIteration:
            return
        except Exception as err:  # a damaged data file surfaces from the dataset's own reader
            raise SourceError(f"--input {unit}: record {number} could not be read ({type(err).__name__}: {err}); "
                              "fix or remove the file it comes from") from None
        yield text_of(record, f"{unit} record {number}")
        number += 1
