"""Classification files in the layouts they are published in: where the texts and the label are, how labels read.

`RecordFormat` says which columns hold the first text, the second, the label and the example's id, and
`read_records` turns a `.jsonl`, `.tsv`, `.csv` or `.parquet` file into the records `finetune.classify` encodes:
`{"text", "text_b"?, "label"?, "index"?}` (multiple-choice JSONL records pass through as they are).

GLUE (`glue_task`): the TSV files of GLUE's download script, read with quoting off (GLUE's texts hold bare
quotes; a row with the wrong number of fields, as a few of QQP's have, is skipped and counted, as BERT's
processors skip them), CoLA's train/dev files without a header row included; or Hugging Face `glue` exports
(`.parquet`, `.jsonl`) with their column names and integer labels, mapped to the label names of GLUE's TSVs (those
its leaderboard takes), so both layouts train the same classes. A label of -1 (the test splits) is no label.
Each task brings its metric (GLUE's: MCC for CoLA, F1 of "1" for MRPC and QQP, Pearson for STS-B, accuracy for the
rest) and STS-B is regression.
"""
from __future__ import annotations

import csv
import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .task_files import read_jsonl_numbered

INDEX_COLUMNS = ("index", "idx", "id")
"""Where GLUE's TSVs (`index`, QQP's `id`) and Hugging Face exports (`idx`) keep an example's id."""


@dataclass(frozen=True)
class RecordFormat:
    """The columns of a classification file (each: the names it may have, the first present wins) and how its
    labels read."""

    text: tuple[str, ...] = ("text",)
    text_b: tuple[str, ...] = ("text_b",)
    label: tuple[str, ...] = ("label",)
    index: tuple[str, ...] = INDEX_COLUMNS
    label_names: tuple[str, ...] = ()
    """Integer labels are positions in this list (Hugging Face `ClassLabel` ids); empty: labels as written."""
    headerless: tuple[str, ...] = ()
    """Column names of a TSV that has no header row (GLUE's CoLA train/dev), recognised by its field count."""
    regression: bool | None = None
    """None: numbers written as floats are regression, integers and strings are classes (`LabelSpace`)."""
    metric: str | None = None
    positive_label: str | None = None
    glue: bool = False
    """A GLUE task's files: a label of -1 is no label (Hugging Face's test splits)."""


def _glue(text: tuple[str, ...], text_b: tuple[str, ...], label: tuple[str, ...] = ("label",),
          **rest: Any) -> RecordFormat:
    return RecordFormat(text=text, text_b=text_b, label=label, glue=True, **rest)


ZERO_ONE = ("0", "1")
NLI = ("entailment", "neutral", "contradiction")
GLUE_TASKS: dict[str, RecordFormat] = {
    "cola": _glue(("sentence",), (), label_names=ZERO_ONE, metric="mcc",
                  headerless=("source", "label", "original_label", "sentence")),
    "sst2": _glue(("sentence",), (), label_names=ZERO_ONE, metric="accuracy"),
    "mrpc": _glue(("#1 String", "sentence1"), ("#2 String", "sentence2"), ("Quality", "label"), label_names=ZERO_ONE,
                  metric="f1", positive_label="1"),
    "stsb": _glue(("sentence1",), ("sentence2",), ("score", "label"), regression=True, metric="pearson"),
    "qqp": _glue(("question1",), ("question2",), ("is_duplicate", "label"), label_names=ZERO_ONE, metric="f1",
                 positive_label="1"),
    "mnli": _glue(("sentence1", "premise"), ("sentence2", "hypothesis"), ("gold_label", "label"), label_names=NLI,
                  metric="accuracy"),
    "qnli": _glue(("question",), ("sentence",), label_names=("entailment", "not_entailment"), metric="accuracy"),
    "rte": _glue(("sentence1",), ("sentence2",), label_names=("entailment", "not_entailment"), metric="accuracy"),
    "wnli": _glue(("sentence1",), ("sentence2",), label_names=ZERO_ONE, metric="accuracy"),
    "ax": _glue(("sentence1", "premise"), ("sentence2", "hypothesis"), label_names=NLI, metric="mcc"),
}
"""GLUE's tasks: the columns of their TSVs and of Hugging Face `glue`, and the labels GLUE's TSVs (and its
leaderboard) use. AX, the diagnostic set, is MNLI's format with test examples only (predicted by an MNLI model)."""


def record_format(settings: Mapping[str, Any]) -> RecordFormat:
    """The format a run's settings (`FinetuneConfig` keys, or a fine-tuned model's saved settings) name: a GLUE
    task's, else `text_field`, `text_b_field`, `label_field` and `regression`."""
    task = settings.get("glue_task")
    if task is not None:
        if task not in GLUE_TASKS:
            raise ValueError(f"glue_task={task!r} is not a GLUE task; choose one of {', '.join(GLUE_TASKS)}")
        return GLUE_TASKS[task]
    return RecordFormat(text=(settings.get("text_field", "text"),), text_b=(settings.get("text_b_field", "text_b"),),
                        label=(settings.get("label_field", "label"),), regression=settings.get("regression"))


def read_rows(path: str | Path, headerless: tuple[str, ...] = ()) -> tuple[list[dict], list[int], list[int]]:
    """The rows of a `.jsonl`/`.json` (one object per line), `.tsv`, `.csv` or `.parquet` file as dicts, the
    line numbers of the delimited rows skipped for a wrong number of fields, and each row's line number (a parquet
    row's: its position from 1). A TSV is read with quoting off (GLUE's); a file whose first line has as many
    fields as `headerless` and none of its names is read with those."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix in (".tsv", ".csv"):
        try:
            with open(path, encoding="utf-8-sig", newline="") as f:  # a byte-order mark (MRPC's header has one)
                reader = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE) if suffix == ".tsv" else csv.reader(f)
                lines = list(reader)
        except UnicodeDecodeError as error:
            raise ValueError(f"{path}: not UTF-8 text (byte {error.object[error.start]:#04x} at offset {error.start}); "
                             "re-encode the file as UTF-8") from None
        if not lines:
            raise ValueError(f"{path}: no records")
        header, first_row = lines[0], 1
        if headerless and len(header) == len(headerless) and not set(header) & set(headerless):
            header, first_row = list(headerless), 0
        rows, skipped, numbers = [], [], []
        for number, fields in enumerate(lines[first_row:], first_row + 1):
            if len(fields) != len(header):
                if fields:  # a blank line is no row
                    skipped.append(number)
                continue
            rows.append(dict(zip(header, fields)))
            numbers.append(number)
        if not rows:
            raise ValueError(f"{path}: no records under its header row {header}")
        return rows, skipped, numbers
    if suffix == ".parquet":
        import pyarrow.parquet as pq  # `datasets` brings pyarrow

        rows = pq.read_table(path).to_pylist()
        if not rows:
            raise ValueError(f"{path}: no records")
        return rows, [], list(range(1, len(rows) + 1))
    numbered = read_jsonl_numbered(path)
    return [row for _, row in numbered], [], [number for number, _ in numbered]


def typed(text: str) -> str | int | float:
    """A label read from a delimited file as what it is written as: an integer ("1"), a float ("3.800", a score),
    else the text ("entailment"), as pandas types the column transformers' run_glue reads."""
    for kind in (int, float):
        try:
            value = kind(text)
        except ValueError:
            continue
        return value if math.isfinite(value) else text
    return text


def _column(columns: set[str], names: tuple[str, ...]) -> str | None:
    return next((name for name in names if name in columns), None)


def read_records(path: str | Path, fmt: RecordFormat) -> list[dict]:
    """`path`'s examples as classify records `{"text", "text_b"?, "label"?, "index"?}`; multiple-choice records
    (`choices`) as they are. A file without the text column is refused, naming its columns and the settings that
    choose others. Rows skipped for a wrong number of fields are reported on stderr."""
    where = str(path)
    rows, skipped, numbers = read_rows(path, fmt.headerless)
    if skipped:
        print(f"[classify] {where}: skipped {len(skipped)} row(s) with a wrong number of fields (lines "
              f"{', '.join(map(str, skipped[:5]))}{', ...' if len(skipped) > 5 else ''})", file=sys.stderr)
    if "choices" in rows[0]:
        return rows
    delimited = Path(path).suffix.lower() in (".tsv", ".csv")
    columns = set().union(*rows)  # JSONL records may leave out an optional field
    text = _column(columns, fmt.text)
    if text is None:
        raise ValueError(f"{where}: no {' or '.join(map(repr, fmt.text))} column (its columns: "
                         f"{', '.join(sorted(columns))}); name the file's columns with text_field, text_b_field and "
                         f"label_field, or set glue_task for a GLUE file")
    text_b, label, index = (_column(columns, names) for names in (fmt.text_b, fmt.label, fmt.index))
    records = []
    for number, row in zip(numbers, rows):
        record = {"text": row.get(text)}
        if text_b is not None and row.get(text_b) is not None:
            record["text_b"] = row[text_b]
        if label is not None and row.get(label) is not None:
            value = typed(row[label]) if delimited else row[label]
            if fmt.glue and value == -1:  # Hugging Face's "no label" (its test splits; STS-B's is -1.0)
                value = None
            elif fmt.label_names and isinstance(value, int) and not isinstance(value, bool):
                if not 0 <= value < len(fmt.label_names):
                    raise ValueError(f"{where}:{number}: label {value} is not a class id of "
                                     f"{list(fmt.label_names)} (or -1: none)")
                value = fmt.label_names[value]
            elif fmt.label_names and isinstance(value, str) and value not in fmt.label_names:
                raise ValueError(f"{where}:{number}: label {value!r} is not one of the task's labels "
                                 f"{list(fmt.label_names)}")
            if value is not None:
                record["label"] = value
        if index is not None and row.get(index) is not None:
            record["index"] = row[index]
        records.append(record)
    return records
