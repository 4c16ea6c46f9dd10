"""Task files: read the fine-tuning JSONL formats, and convert the real sample corpora into them.

Formats (one JSON object per line):
- classify: `{"text", "text_b"?, "label"}` (label a string, or a number for regression), or multiple choice
  `{"context", "choices": [...], "label": index}`;
- seq2seq: `{"src", "tgt"}`, or UniLM's line files: `NAME.src` with `NAME.tgt` beside it, one example per line;
- qa: SQuAD 1.1/2.0 JSON (not JSONL), read by `finetune.qa`.

Converters (`python -m finetune.task_files --samples data/samples --out data/finetune`):
- BBC News (`bbc/<topic>/NNN.txt`, line 1 = headline): `bbc_topic` (article body → topic) and
  `bbc_headline` (body → headline);
- Rotten Tomatoes (`rotten.csv.bz2`, `fresh`/`rotten` snippets; the `plot` rows are not reviews): `rotten`;
- the SQuAD sample (`squad.json`) is copied as is (too few questions to split: train = dev, smoke only).

Splits are deterministic and independent of file order: an example goes to dev when a hash of its text (the
article body, the review) falls below `dev_fraction`, to test (only with `--test-fraction` > 0: a held-out split
for final numbers, never used for choices) when it falls in the next `test_fraction`; repeated texts are dropped
(counted) so none leaks between splits. Dev is the same set with or without a test split. Each split is written
in an order given by another hash of its texts, so its first N examples are a fair sample of its classes (the BBC
articles come sorted by topic).
"""
from __future__ import annotations

import argparse
import bz2
import csv
import hashlib
import json
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path


def read_jsonl(path: str | Path) -> list[dict]:
    """Every record of a JSONL file; a line that is not a JSON object fails with its file and line number."""
    return [record for _, record in read_jsonl_numbered(path)]


def read_jsonl_numbered(path: str | Path) -> list[tuple[int, dict]]:
    """(line number, record) of every record of a JSONL file (blank lines hold none), as `read_jsonl` reads them."""
    records: list[tuple[int, dict]] = []
    with open(path, "rb") as f:
        for line_number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(f"{path}:{line_number}: not UTF-8 text (byte {raw[err.start]:#04x} at column "
                                 f"{err.start + 1}); re-encode the file as UTF-8") from None
            if line_number == 1:
                line = line.removeprefix("\ufeff")  # a byte-order mark, as Windows editors write
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                problem = None if isinstance(record, dict) else \
                    f"{path}:{line_number}: expected a JSON object, got {type(record).__name__}"
            except json.JSONDecodeError as err:
                record, problem = None, f"{path}:{line_number}: not valid JSON ({err.msg})"
            if not records and (problem is not None or _is_squad(record)):
                _refuse_json_document(path)  # a whole JSON document is named as such
            if problem is not None:
                raise ValueError(problem)
            records.append((line_number, record))
    if not records:
        raise ValueError(f"{path}: no records")
    return records


def _is_squad(record: dict) -> bool:
    return isinstance(record.get("data"), list) and all(isinstance(a, dict) and "paragraphs" in a
                                                        for a in record["data"][:1])


def _refuse_json_document(path: str | Path) -> None:
    """Name the mistake when a whole JSON document (a SQuAD file, a JSON array) is given where JSON lines belong;
    returns when the file is not one JSON document, so the caller reports its own line."""
    try:
        with open(path, encoding="utf-8-sig") as f:
            document = json.load(f)
    except (ValueError, OSError):
        return
    if isinstance(document, dict) and _is_squad(document):
        raise ValueError(f"{path} is a SQuAD JSON file: SQuAD is read by the qa task (task: qa), not as JSON lines")
    kind = "an array" if isinstance(document, list) else type(document).__name__
    raise ValueError(f"{path} is one JSON document ({kind}), not JSON lines: write one JSON object per line "
                     "(e.g. `jq -c '.[]' FILE > FILE.jsonl` for an array of objects)")


def read_seq2seq(path: str | Path, targets: bool = True) -> list[dict]:
    """`{"src", "tgt"}` records of a JSONL file, or of UniLM's line files: ``NAME.src`` (the path given) and
    ``NAME.tgt`` beside it, line i of each one example (``targets=False``: the ``.tgt`` file may be absent, as
    for decoding)."""
    path = Path(path)
    if path.suffix != ".src":
        return read_jsonl(path)
    paired = path.with_suffix(".tgt")
    sources = _lines(path)
    if not paired.exists():
        if targets:
            raise ValueError(f"{path}: a .src line file needs its targets beside it in {paired.name}")
        return [{"src": line} for line in sources]
    references = _lines(paired)
    if len(references) != len(sources):
        raise ValueError(f"{path} has {len(sources)} lines and {paired} {len(references)}: line i of each is one "
                         "example")
    return [{"src": src, "tgt": tgt} for src, tgt in zip(sources, references)]


def _lines(path: Path) -> list[str]:
    """The lines of a UTF-8 text file, without their line ends (LF, CRLF or a lone CR, as Python's text files read
    them; a final line end ends the last line)."""
    try:
        text = path.read_bytes().decode("utf-8").removeprefix("\ufeff").replace("\r\n", "\n").replace("\r", "\n")
    except UnicodeDecodeError as err:
        line = path.read_bytes()[:err.start].count(b"\n") + 1
        raise ValueError(f"{path}:{line}: not UTF-8 text; re-encode the file as UTF-8") from None
    return text.removesuffix("\n").split("\n") if text else []


def write_jsonl(records: Iterable[dict], path: str | Path) -> int:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    count = 0
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
            count += 1
    return count


def split_position(key: str) -> float:
    """A stable hash of `key` mapped to [0, 1)."""
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def is_dev(key: str, dev_fraction: float) -> bool:
    """Deterministic split: `split_position(key)` is below `dev_fraction`."""
    return split_position(key) < dev_fraction


def bbc_articles(samples_dir: str | Path) -> Iterator[tuple[str, str, str, str]]:
    """(key, topic, headline, body) of each BBC article, sorted by topic and file name."""
    root = Path(samples_dir) / "bbc"
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: BBC News samples missing (run `make sample-corpus`)")
    for path in sorted(root.glob("*/*.txt")):
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        headline = lines[0].strip() if lines else ""
        body = " ".join(line.strip() for line in lines[1:] if line.strip())
        if headline and body:
            yield f"bbc/{path.parent.name}/{path.stem}", path.parent.name, headline, body


def rotten_reviews(samples_dir: str | Path) -> Iterator[tuple[str, str, str]]:
    """(key, text, label) of each Rotten Tomatoes review snippet (labels `fresh`/`rotten`)."""
    path = Path(samples_dir) / "rotten.csv.bz2"
    with bz2.open(path, "rt", encoding="utf-8") as f:
        for row_number, row in enumerate(csv.DictReader(f)):
            if row["category"] in ("fresh", "rotten") and row["text"].strip():
                yield f"rotten/{row_number}", row["text"].strip(), row["category"]


def split(keyed: Iterable[tuple[str, dict]], dev_fraction: float,
          test_fraction: float = 0.0) -> tuple[list[dict], list[dict], list[dict], int]:
    """(train, dev, test, duplicates dropped). The split key is the record's text, so repeated texts (the BBC set
    has about a hundred repeated articles) cannot leak between splits; only the first copy is kept."""
    if dev_fraction < 0 or test_fraction < 0 or dev_fraction + test_fraction >= 1:
        raise ValueError(f"need dev_fraction >= 0, test_fraction >= 0 and their sum < 1, got {dev_fraction} "
                         f"and {test_fraction}")
    splits: tuple[list, list, list] = ([], [], [])
    seen, duplicates = set(), 0
    for text, record in keyed:
        if text in seen:
            duplicates += 1
            continue
        seen.add(text)
        position = split_position(text)
        which = 1 if position < dev_fraction else 2 if position < dev_fraction + test_fraction else 0
        splits[which].append((split_position("order/" + text), record))
    # each split in an order of its own hash, not the input's (the BBC articles come sorted by topic): the first N
    # dev examples (`eval_max_examples`) are then a fair sample of every class
    train, dev, test = ([record for _, record in sorted(items, key=lambda item: item[0])] for items in splits)
    return train, dev, test, duplicates


def convert_samples(samples_dir: str | Path, out_dir: str | Path, dev_fraction: float = 0.1,
                    test_fraction: float = 0.0) -> dict[str, int]:
    """Write `{bbc_topic,bbc_headline,rotten}.{train,dev}.jsonl` (and `.test.jsonl` when `test_fraction` > 0) and
    `squad.json` into `out_dir`; return counts."""
    out = Path(out_dir)
    articles = list(bbc_articles(samples_dir))
    tasks = {
        "bbc_topic": [(body, {"text": body, "label": topic}) for _, topic, _, body in articles],
        "bbc_headline": [(body, {"src": body, "tgt": headline}) for _, _, headline, body in articles],
        "rotten": [(text, {"text": text, "label": label}) for _, text, label in rotten_reviews(samples_dir)],
    }
    counts = {}
    for name, keyed in tasks.items():
        train, dev, test, counts[f"{name}.duplicates_dropped"] = split(keyed, dev_fraction, test_fraction)
        counts[f"{name}.train"] = write_jsonl(train, out / f"{name}.train.jsonl")
        counts[f"{name}.dev"] = write_jsonl(dev, out / f"{name}.dev.jsonl")
        if test_fraction > 0:
            counts[f"{name}.test"] = write_jsonl(test, out / f"{name}.test.jsonl")
    shutil.copyfile(Path(samples_dir) / "squad.json", out / "squad.json")
    return counts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m finetune.task_files", description=__doc__.split("\n")[0])
    parser.add_argument("--samples", default="data/samples", help="folder written by `make sample-corpus`")
    parser.add_argument("--out", default="data/finetune")
    parser.add_argument("--dev-fraction", type=float, default=0.1)
    parser.add_argument("--test-fraction", type=float, default=0.0,
                        help="also write a held-out *.test.jsonl split of this share (default: none)")
    args = parser.parse_args(argv)
    for name, count in convert_samples(args.samples, args.out, args.dev_fraction, args.test_fraction).items():
        print(f"[task_files] {name}: {count}")


if __name__ == "__main__":
    main()
