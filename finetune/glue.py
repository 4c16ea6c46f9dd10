"""Classification files in the layouts they are published in: where the texts and the label are, how labels read.

`RecordFormat` says which columns hold the first text, the second, the label and the example's id, and
`read_records` turns a `.jsonl`, `.tsv`, `.csv` or `.parquet` file into the records `finetune.classify` encodes:
`{"text", "text_b"?, "label"?, "index"?}` (multiple-choice JSONL records pass through as they are).

GLUE (`glue_task`): the TSV files of GLUE's download script, read with quoting off (GLUE's texts hold bare
quotes; a row with the wrong number of fields, as a few of QQP's have, is skipped and counted, as BERT's
processors skip them, but refused in a file to predict, whose submission needs a line per row), CoLA's train/dev
files without a header row included; or Hugging Face `glue` exports
(`.parquet`, `.jsonl`) with their column names and integer labels, mapped to the label names of GLUE's TSVs (those
its leaderboard takes), so both layouts train the same classes. A label of -1 (the test splits) is no label.
Each task brings its metric (GLUE's: MCC for CoLA, F1 of "1" for MRPC and QQP, Pearson for STS-B, accuracy for the
rest) and STS-B is regression. A model predicts a GLUE task's files only when it was fine-tuned on that task (AX:
on MNLI) with the task's classes (`check_model_task`).
"""
from __future__ import annotations

import csv
import logging
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .task_files import read_jsonl_numbered

log = logging.getLogger(__name__)

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

PREDICTED_BY = {"ax": "mnli"}
"""GLUE tasks without training data of their own, and the task whose model predicts them."""

GLUE_DIRECTORIES = {**{task: task for task in GLUE_TASKS}, "diagnostic": "ax", "mnlimatched": "mnli",
                    "mnlimismatched": "mnli"}
"""The directories GLUE's download script (`glue_data/SST-2`, `glue_data/diagnostic`) and Hugging Face `glue`
(`sst2`, `mnli_matched`) keep a task's files in, lower-cased without `-` and `_`, and their tasks."""


def task_of_path(path: str | Path) -> str | None:
    """The GLUE task whose files `path` is among, by the name of its directory (`GLUE_DIRECTORIES`), else None."""
    name = Path(path).resolve().parent.name.lower().replace("-", "").replace("_", "")
    return GLUE_DIRECTORIES.get(name)


def _predicted(classes: Sequence[str], regression: bool) -> str:
    if regression:
        return "scores (regression)"
    return f"the classes {', '.join(classes)}" if classes else "choice indices (multiple choice)"


def check_model_task(task: str, model_task: str | None, classes: Sequence[str], regression: bool) -> None:
    """Refuse a classifier for GLUE `task`'s files unless it was fine-tuned on that task (`model_task`, the run's
    `glue_task`, None for other files; AX's is MNLI) and predicts the task's labels: its `classes` in any order,
    or `regression` for STS-B. Its predictions would otherwise fill the submission with another task's labels."""
    fmt = GLUE_TASKS[task]
    trained_on = PREDICTED_BY.get(task, task)
    if model_task is not None and model_task != trained_on:
        raise ValueError(f"the model was fine-tuned on GLUE's {model_task}, not {task}; predict {task}'s files "
                         f"with a model fine-tuned on {trained_on}")
    fits = regression if fmt.regression else not regression and set(classes) == set(fmt.label_names)
    if not fits:
        raise ValueError(f"the model predicts {_predicted(classes, regression)}, but {task}'s files take "
                         f"{_predicted(fmt.label_names, bool(fmt.regression))}")


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


def _delimited_rows(text: str, suffix: str) -> Iterator[tuple[int, list[str] | str]]:
    r"""(line number, fields) for each row of a `.tsv` (quoting off, GLUE's) or `.csv` file's text, or (line
    number, what is wrong) for a row that cannot be read. Lines end at "\n" (or "\r\n") only, as GLUE's do: a
    bare "\r" inside a TSV's text stays in it (Python's csv would end the row there), and in a CSV it stays in a
    quoted field and makes an unquoted one's row unreadable, not two rows."""
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
    if suffix == ".tsv":
        for number, line in enumerate(lines, 1):
            line = line.removesuffix("\r")
            yield number, line.split("\t") if line else []
        return
    reader = csv.reader(line + "\n" for line in lines)
    while True:
        number = reader.line_num + 1
        try:
            fields = next(reader)
        except StopIteration:
            return
        except csv.Error as error:  # the reader goes on with the next line
            yield number, ("a bare carriage return (\\r) in an unquoted field" if "new-line" in str(error)
                           else str(error))
            continue
        yield number, fields


def read_rows(path: str | Path, headerless: tuple[str, ...] = ()) -> tuple[list[dict], list[tuple[int, str]],
                                                                         list[int]]:
    """The rows of a `.jsonl`/`.json` (one object per line), `.tsv`, `.csv` or `.parquet` file as dicts, the
    delimited rows skipped as malformed (line number, what is wrong: a wrong number of fields, or an unreadable
    row), and each row's line number (a parquet row's: its position from 1). A file whose first line has as many
    fields as `headerless` and none of its names is read with those."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix in (".tsv", ".csv"):
        try:
            with open(path, encoding="utf-8-sig", newline="") as f:  # a byte-order mark (MRPC's header has one)
                lines = list(_delimited_rows(f.read(), suffix))
        except UnicodeDecodeError as error:
            raise ValueError(f"{path}: not UTF-8 text (byte {error.object[error.start]:#04x} at offset {error.start}); "
                             "re-encode the file as UTF-8") from None
        if not lines:
            raise ValueError(f"{path}: no records")
        (header_line, header), first_row = lines[0], 1
        if isinstance(header, str):
            raise ValueError(f"{path}:{header_line}: header row: {header}")
        if headerless and len(header) == len(headerless) and not set(header) & set(headerless):
            header, first_row = list(headerless), 0
        rows, skipped, numbers = [], [], []
        for number, fields in lines[first_row:]:
            if isinstance(fields, str):
                skipped.append((number, fields))
            elif len(fields) != len(header):
                if fields:  # a blank line is no row
                    skipped.append((number, f"{len(fields)} field{'' if len(fields) == 1 else 's'}, not {len(header)}"))
            else:
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


def read_records(path: str | Path, fmt: RecordFormat, pairs: bool = False, predicting: bool = False) -> list[dict]:
    """`path`'s examples as classify records `{"text", "text_b"?, "label"?, "index"?}`; multiple-choice records
    (`choices`) as they are. A file without the text column is refused, naming its columns and the settings that
    choose others; with `pairs` (a model fine-tuned on text pairs) so is a file without the second text column.
    Malformed rows are skipped and reported on stderr, except in a file `predicting` reads that is not labelled
    throughout (a test file): its predictions need one line per row, so they are refused, naming the lines."""
    where = str(path)
    rows, skipped, numbers = read_rows(path, fmt.headerless)
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
    if pairs and text_b is None:
        raise ValueError(f"{where}: no {' or '.join(map(repr, fmt.text_b or ('text_b',)))} column (its columns: "
                         f"{', '.join(sorted(columns))}); the model was fine-tuned on text pairs and needs each "
                         "example's second text")
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
    if skipped:
        lines = "; ".join(f"line {number}: {wrong}" for number, wrong in skipped[:5]) + ("; ..." if len(skipped) > 5
                                                                                       else "")
        if predicting and not all("label" in r for r in records):
            raise ValueError(f"{where}: {len(skipped)} malformed row(s) ({lines}); each row needs its prediction "
                             "(GLUE refuses a submission with a row missing): mend the rows")
        log.warning("[classify] %s: skipped %d malformed row(s) (%s)", where, len(skipped), lines)
    return records
