"""Document sources for ``--input``: local files by suffix, or a Hugging Face ``datasets`` name.

=====================================  ===========================================================
``*.xml`` / ``*.xml.bz2``               Wikipedia dump; one document per article (namespace 0, no redirects);
``*.xml-p<first>p<last>.bz2``           also the pieces a dump comes in (``…pages-articles1.xml-p1p41242.bz2``)
``*.jsonl``                             one JSON object per line with a ``text`` field
``*.json``                              a JSON array of objects with ``text`` (else read as JSON lines)
``*.parquet``                           a ``text`` column, read in record batches
``*.txt``                               documents separated by blank lines (lines may end in LF, CRLF or a lone CR);
                                        with ``txt_documents`` "line" one document per line, with "file" one per
                                        file (its blank lines then separate paragraphs)
``*.jsonl.gz``, ``*.txt.zst``, …        the same, compressed: ``.gz``, ``.bz2``, ``.xz`` or ``.zst`` after ``.jsonl``,
                                        ``.json`` or ``.txt`` (C4 ships ``.json.gz``, the Pile ``.jsonl.zst``)
``wiki_NN`` / ``wiki_NN.bz2``           WikiExtractor output (NVIDIA's BERT and Megatron's Wikipedia step): one
                                        document per ``<doc …>`` … ``</doc>``, its title line dropped and each
                                        line a paragraph; or, written with ``--json``, JSON lines (``text``)
a directory of such files               every such file, in sorted path order (``directory_files``); where
                                        file or folder names name splits the way ``datasets`` reads them
                                        (``train.jsonl``, ``valid-0.txt``, ``test/``) only split ``train``,
                                        or the one named as ``FOLDER::SPLIT`` (``FOLDER::all``: every file)
a Hugging Face dataset folder, or       ``datasets.load_dataset(name, config, split=split, streaming=True)``,
``name[:config][:split]``               field ``text`` (e.g. ``wikimedia/wikipedia:20231101.en:train``); split
                                        ``train`` unless named (a folder's: ``FOLDER::validation``)
=====================================  ===========================================================

Directories are resolved to files in ``data_prep.inputs``; a Wikipedia dump is read by ``data_prep.wiki_dump``.


``read_documents`` streams ``str`` documents (raw; clean-up happens later) and ``Skipped`` records for input
it cannot use — a JSON line that is not UTF-8 or not JSON, a record without a string ``text`` — so every skip
is counted with its reason and size. In ``.txt`` files bytes that are not UTF-8 become U+FFFD (which the
tokenizer drops), so one bad byte costs a character, not the document; such a document comes as
``RepairedText`` saying how many of its lines were repaired. A UTF-8 byte-order mark at the start of a file is
ignored; a ``.txt`` or WikiExtractor file that starts with a UTF-16 byte-order mark (Windows Notepad's "Unicode")
or a UTF-32 one is decoded as such, streamed; a JSON file that does is refused (re-encode it as UTF-8). Problems
with the input as a whole (missing file, unknown suffix, a parquet file or dataset without the text column) raise
``SourceError`` naming the input and the fix. ``--text-field NAME`` picks another column than ``text``.

Work is split into units (``input_units``): one per local file, one per ``unit_bytes`` byte range of a large
uncompressed ``.jsonl`` file (a range holds the lines that start in it) or ``.txt`` file (cut at its documents'
boundaries, unless a document is the whole file: ``data_prep.text_files``), of a large Wikipedia dump (the pages that
begin in it: ``data_prep.wiki_units``) or of a large parquet file (the row groups that begin in it:
``data_prep.parquet_units``), one per shard of a Hugging Face dataset (``IterableDataset.shard``), so several
builders read disjoint parts of the inputs. Wikipedia pages come out as raw ``Wikitext``; ``document_text`` turns
them into prose in the worker that processes them.

Sentence-per-row corpora (BookCorpus on the hub is one sentence per row) use ``group_rows``: consecutive rows
become the sentences of one document of at most ``rows_per_document`` rows; an empty row ends a document early.
For ``.txt`` inputs a row is a line.
"""
from __future__ import annotations

import functools
import json
import lzma
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from data_prep.inputs import (
    SUPPORTED,
    WIKIEXTRACTOR,
    check_input,
    compression_suffix,
    directory_files,
    file_type,
    folder_split,
    is_dataset_input,
    is_plain_folder,
)
from data_prep.parquet_units import parquet_units, row_groups_in
from data_prep.records import RepairedText, Skipped, SourceError
from data_prep.text_files import (
    BOM,
    TXT_DOCUMENTS,
    LineNumber,
    decode,
    line_ranges,
    lines_from,
    open_binary,
    read_txt,
    read_txt_lines,
    txt_lines,
    wide_encoding,
)
from data_prep.wiki_dump import SpilledPage, document_text, read_wiki_dump
from data_prep.wiki_units import dump_units

TEXT_FIELD = "text"
ROWS_PER_DOCUMENT = 1000
"""default --rows-per-document: ~70k characters of book sentences, ~30 samples of 512 tokens, so the one short
sample at each document's end costs little padding (NSP's random next segments of such documents come from
far away in the text, `data_prep.chunks.iter_chunks`)"""
UNIT_BYTES = 1 << 28
"""a .jsonl or .txt file, Wikipedia dump or parquet file larger than this is read as several units (byte ranges), so
several builders can share it"""


@dataclass(frozen=True)
class Unit:
    """The part of one ``--input`` a builder reads on its own: a whole file, or shard ``shard`` of a dataset."""

    spec: str
    shard: int = 0
    num_shards: int = 1
    start: int = 0
    """byte range [start, stop) of a file: the lines, dump pages or parquet row groups that start in it (stop -1: to
    the end)"""
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
    txt_documents: str = TXT_DOCUMENTS[0]
    """what a document of a ``.txt`` file is: ``TXT_DOCUMENTS``"""

    def __post_init__(self) -> None:
        if not self.text_field:
            raise ValueError("--text-field must name a field")
        if self.txt_documents not in TXT_DOCUMENTS:
            raise ValueError(f"--txt-documents {self.txt_documents!r}: choose one of {', '.join(TXT_DOCUMENTS)}")
        if self.rows_per_document < 2:
            raise ValueError(f"--rows-per-document {self.rows_per_document} must be at least 2 "
                             "(a sample pairs sentences)")


def _decompressed(records: Iterator[str | Skipped], path: Path) -> Iterator[str | Skipped]:
    """``records`` of a compressed file; a damaged or truncated stream stops the build naming the file."""
    try:
        yield from records
    except (OSError, EOFError, zlib.error, lzma.LZMAError) as err:  # pyarrow's errors are OSErrors too
        raise SourceError(f"--input {path}: not a readable {compression_suffix(path)[1:]} file ({err}); the download "
                          "may have been cut short: fetch it again, or check it with the matching tool "
                          "(gzip -t, bzip2 -t, xz -t, zstd -t)") from None

def input_units(spec: str, unit_bytes: int = UNIT_BYTES, txt_documents: str = TXT_DOCUMENTS[0]) -> list[Unit]:
    """The units of one ``--input``: the file itself (or byte ranges of a large one; a ``.txt`` file's depend on
    what its documents are, ``txt_documents``), each file of a directory (of its split, when the names name
    splits), or every dataset shard."""
    check_input(spec)
    if is_plain_folder(spec):
        listed = directory_files(*folder_split(spec))
        if not listed.read:
            held = f" (it holds {', '.join(p.name for p in listed.other_types[:5])})" if listed.other_types else ""
            raise SourceError(f"--input {spec}: no file in this directory is of a type read here{held}; supported: "
                              f"{SUPPORTED} (hidden files, *.md and shard builds are never read)")
        return [unit for p in listed.read for unit in _file_units(p, unit_bytes, txt_documents)]
    if not is_dataset_input(spec):
        return _file_units(Path(spec), unit_bytes, txt_documents)
    num_shards = _load_hf(spec).num_shards
    return [Unit(spec, shard, num_shards) for shard in range(num_shards)]


def _file_units(path: Path, unit_bytes: int, txt_documents: str) -> list[Unit]:
    if file_type(path) in (".xml", ".xml.bz2"):
        ranges = _dump_units(path, unit_bytes)
    elif file_type(path) == ".parquet":
        ranges = _parquet_units(path, unit_bytes)
    elif file_type(path) == ".jsonl" or (file_type(path) == ".txt" and txt_documents != "file"):
        ranges = line_ranges(path, unit_bytes)  # lines, or documents, that start in a range: data_prep.text_files
    else:
        return [Unit(str(path))]
    return [Unit(str(path), start=start, stop=stop) for start, stop in ranges]


def read_documents(spec: str, options: ReadOptions = ReadOptions()) -> Iterator[str | Skipped]:
    """Documents of one ``--input`` as plain text, streamed in a fixed order."""
    for unit in input_units(spec, txt_documents=options.txt_documents):
        for record in read_unit(unit, options):
            yield record if isinstance(record, Skipped) else document_text(record)


def read_unit(unit: Unit, options: ReadOptions = ReadOptions()) -> Iterator[str | Skipped]:
    """Records of one unit (Wikipedia pages as raw ``Wikitext``), rows grouped when ``rows_as_sentences``."""
    if not Path(unit.spec).is_file():  # input_units makes a unit of a directory only for a dataset folder
        records = _read_hf(unit, options.text_field)
    else:
        path = Path(unit.spec)
        suffix = file_type(path)
        if options.rows_as_sentences and suffix in (".xml", ".xml.bz2", WIKIEXTRACTOR):
            raise SourceError(f"--input {unit.spec}: --rows-as-sentences does not apply to Wikipedia articles (a dump "
                              "or WikiExtractor's output: its records are whole articles); name only the "
                              "sentence-per-row inputs after the flag")
        if suffix == ".txt" and options.rows_as_sentences:
            records = read_txt_lines(path, unit.start, unit.stop)
        elif suffix == ".txt":
            records = read_txt(path, options.txt_documents, unit.start, unit.stop)
        elif suffix in (".xml", ".xml.bz2"):
            records = cast(Iterator[str | Skipped], read_wiki_dump(path, unit.start, unit.stop))  # nothing spilled
        elif suffix == ".jsonl":
            records = _read_jsonl(path, options.text_field, unit.start, unit.stop)
        elif suffix == WIKIEXTRACTOR:
            records = _read_wikiextractor(path, options.text_field)
        elif suffix == ".parquet":
            records = _read_parquet(path, options.text_field, unit.start, unit.stop)
        else:
            records = _read_json(path, options.text_field)
        if compression_suffix(path):
            records = _decompressed(records, path)
    return group_rows(records, options.rows_per_document) if options.rows_as_sentences else records


def unit_records(unit: Unit, options: ReadOptions = ReadOptions(),
                 spill: str | None = None) -> Iterator[str | Skipped | SpilledPage]:
    """``read_unit``'s records; with ``spill`` (a folder) the articles of a Wikipedia dump that reader processes
    read come as ``SpilledPage`` (their text in a file there, read back by the build's worker)."""
    path = Path(unit.spec)
    if spill is not None and path.is_file() and file_type(path) in (".xml", ".xml.bz2") \
            and not options.rows_as_sentences:
        return read_wiki_dump(path, unit.start, unit.stop, spill)
    return read_unit(unit, options)


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
            yield _join_rows(rows_of_document)
            rows_of_document = []
    if rows_of_document:
        yield _join_rows(rows_of_document)


def _join_rows(rows: list[str]) -> str:
    text = "\n\n".join(rows)
    repaired = [row for row in rows if isinstance(row, RepairedText)]
    return RepairedText.of(text, sum(r.lines for r in repaired), repaired[0].where) if repaired else text


class _TextField:
    """Picks the text field of records; a record without it is skipped with the fields it has, so the summary
    and the warning show which ``--text-field`` was meant."""

    def __init__(self, name: str):
        self.name = name

    def __call__(self, record: object, where: str, chars: int = 0) -> str | Skipped:
        if not isinstance(record, dict):
            return Skipped("not_an_object", f"{where} ({json_type(record)}, not an object)", chars)
        if self.name not in record:
            return Skipped("missing_text_field", f"{where} (no '{self.name}'; fields: {sorted(record)[:10]}; "
                                                 "pick one with --text-field NAME)", chars)
        text = record[self.name]
        if not isinstance(text, str):
            return Skipped("text_not_a_string", f"{where} ('{self.name}' is {json_type(text)}, not a string)",
                           chars)
        return text


def json_type(value: object) -> str:
    """What a parsed JSON value is, for messages: ``null``, ``a number``, ``an array`` …"""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    return {int: "a number", float: "a number", str: "a string", list: "an array", dict: "an object"}.get(
        type(value), type(value).__name__)


def _read_jsonl(path: Path, text_field: str, start: int = 0, stop: int = -1) -> Iterator[str | Skipped]:
    """The lines that start in bytes [start, stop) (stop -1: to the end of the file)."""
    text_of = _TextField(text_field)
    with open_binary(path) as f:
        first_line = LineNumber(path, start)
        for number, (position, raw) in enumerate(lines_from(f, start)):
            if stop != -1 and position >= stop:
                return
            if position == 0 and (encoding := wide_encoding(raw)):
                raise SourceError(f"--input {path}: a {encoding} file (it starts with the {encoding} byte-order mark), "
                                  f"and JSON is read as UTF-8: re-encode it (iconv -f {encoding} -t UTF-8 OLD > NEW) "
                                  "and pass the new file")
            if position == 0:
                raw = raw.removeprefix(BOM)
            if not raw.strip():
                continue
            try:
                record = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError:
                yield Skipped("invalid_utf8", f"{path}:{first_line() + 1 + number}", len(raw))
                continue
            except json.JSONDecodeError:
                yield Skipped("malformed_json", f"{path}:{first_line() + 1 + number}", len(raw))
                continue
            if isinstance(record, dict) and isinstance(text := record.get(text_field), str):
                yield text
            else:
                yield text_of(record, f"{path}:{first_line() + 1 + number}", len(raw))


def _read_json(path: Path, text_field: str) -> Iterator[str | Skipped]:
    with open_binary(path) as f:
        head = f.read(4096)
    if not head.removeprefix(BOM).lstrip().startswith(b"["):
        yield from _read_jsonl(path, text_field)
        return
    with open_binary(path) as f:
        raw = f.read().removeprefix(BOM)
    try:
        records = json.loads(raw.decode("utf-8"))  # a JSON array has to be parsed whole
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        line = raw[:err.start].count(b"\n") + 1 if isinstance(err, UnicodeDecodeError) else err.lineno
        raise SourceError(f"--input {path}: not valid UTF-8 JSON at line {line} ({err}); fix the file or convert "
                          "it to .jsonl, where bad lines are skipped and counted") from None
    text_of = _TextField(text_field)
    for number, record in enumerate(records):
        if isinstance(record, dict) and isinstance(text := record.get(text_field), str):
            yield text
        else:
            yield text_of(record, f"{path}[{number}]", len(json.dumps(record, ensure_ascii=False)))


def _dump_units(path: Path, unit_bytes: int) -> list[tuple[int, int]]:
    try:
        return dump_units(path, unit_bytes)
    except (OSError, EOFError, ValueError) as err:  # a multistream index that is damaged or names no streams
        raise SourceError(f"--input {path}: its multistream index is not readable ({err}); fetch it again, or "
                          "move it away to read the dump by its bzip2 blocks") from None


def _parquet_units(path: Path, unit_bytes: int) -> list[tuple[int, int]]:
    try:
        return parquet_units(path, unit_bytes)
    except Exception as err:  # pyarrow raises several unrelated types for a damaged file
        raise SourceError(f"--input {path}: not a readable parquet file ({err})") from None


def _read_parquet(path: Path, text_field: str, start: int = 0, stop: int = -1) -> Iterator[str | Skipped]:
    """The rows of the row groups that begin in bytes [start, stop) (``data_prep.parquet_units``)."""
    import pyarrow.parquet as pq  # optional: only parquet inputs need it

    try:
        parquet = pq.ParquetFile(path)
    except Exception as err:  # pyarrow raises several unrelated types for a damaged file
        raise SourceError(f"--input {path}: not a readable parquet file ({err})") from None
    columns = parquet.schema_arrow.names
    if text_field not in columns:
        raise SourceError(f"--input {path}: no '{text_field}' column (columns: {columns}); "
                          "pass --text-field NAME for the column that holds the text")
    groups, row = row_groups_in(path, start, stop)
    if not groups:
        return
    for batch in parquet.iter_batches(columns=[text_field], batch_size=1024, row_groups=groups):
        for text in batch.column(0).to_pylist():
            yield text if isinstance(text, str) else Skipped(
                "text_not_a_string", f"{path} row {row} ('{text_field}' is {json_type(text)}, not a string)")
            row += 1


def _read_wikiextractor(path: Path, text_field: str) -> Iterator[str | Skipped]:
    """WikiExtractor's output: ``<doc id=… url=… title=…>``, the title line, then one paragraph per line, up to
    ``</doc>``; a document becomes its paragraphs (blank lines between, so no sentence runs across two), without
    the title line. A file written with ``--json`` holds JSON lines, a paragraph per line of their text."""
    with open_binary(path) as f:
        first = next((line for line in f if line.strip()), b"")
    if first.lstrip().startswith(b"{"):
        for record in _read_jsonl(path, text_field):
            yield record.replace("\n", "\n\n") if isinstance(record, str) else record
        return
    lines: list[tuple[int, bytes]] | None = None  # (line number, paragraph) of the document being read

    def document(numbered: list[tuple[int, bytes]]) -> str:
        body = [paragraph for _, paragraph in numbered[1:]]  # numbered[0]: the title
        return decode([p + b"\n\n" for p in body[:-1]] + body[-1:], path, numbered[1][0]) if body else ""

    for number, _, raw in txt_lines(path):
        line = raw.strip()
        if line.startswith(b"<doc ") or line == b"<doc>":
            lines = []
        elif line == b"</doc>" and lines is not None:
            yield document(lines)
            lines = None
        elif line and lines is not None:
            lines.append((number, line))
    if lines:  # a file cut off inside its last document
        yield document(lines)


@functools.lru_cache(maxsize=8)  # one hub look-up per input, not one per shard
def _load_hf(spec: str):
    """``name[:config][:split]`` or ``FOLDER[:config][:split]`` (split defaults to ``train``) as a streaming
    dataset; a folder written by ``save_to_disk`` is memory-mapped with ``load_from_disk``."""
    import datasets  # optional and slow to import: only hub inputs need it

    name, config, split = (spec, "", "") if Path(spec).is_dir() else (spec.split(":") + ["", ""])[:3]
    split = split or "train"
    try:
        if Path(name).is_dir() and any((Path(name) / f).is_file() for f in ("state.json", "dataset_dict.json")):
            return _saved_dataset(datasets.load_from_disk(name), spec, split)
        return datasets.load_dataset(name, config or None, split=split, streaming=True)
    except SourceError:
        raise
    except Exception as err:  # hub, network and builder errors have no common base class
        raise SourceError(f"--input {spec}: could not load Hugging Face dataset {name!r} "
                          f"(config {config or None!r}, split {split!r}): {type(err).__name__}: {err}. "
                          "Check the name and network access, or pass local files") from None


def _saved_dataset(loaded, spec: str, split: str):
    """The split of a ``save_to_disk`` folder as an iterable dataset of one shard per arrow file."""
    import datasets

    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise SourceError(f"--input {spec}: no split {split!r} in this saved dataset (splits: {sorted(loaded)}); "
                              "name one as FOLDER::SPLIT")
        loaded = loaded[split]
    return loaded.to_iterable_dataset(num_shards=max(1, len(loaded.cache_files)))


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
