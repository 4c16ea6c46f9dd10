"""Which files an ``--input`` names: file types by name (``file_type``, ``SUPPORTED``), the early check of an
input (``check_input``), and directory inputs: a Hugging Face dataset folder, or an ordinary one read file by file
(``directory_files``), of one split when its names name splits.

A directory is a Hugging Face dataset folder only when it has the marks of one (``is_dataset_folder``):
``dataset_dict.json``, ``dataset_info.json``, ``state.json`` or ``*.arrow`` files (``save_to_disk``), a
``README.md`` whose YAML header declares ``configs:`` (a hub snapshot), or data files that are all tables
(``*.parquet``, ``*.csv``, ``*.tsv``; other files such as a LICENSE aside). Any other directory is read file
by file; its files of other types are not read, and ``directory_files`` names them so the build can warn. Its
files are split only when ``datasets`` would split them (``split_layout``: it chooses, from the names, which
files belong to which split), so a held-out split is never pre-trained on unless asked for; the files left out
are named as well.
Hidden files and folders, ``*.md`` files and shard builds (a folder holding ``manifest.json`` or
``shard-*.bin``, e.g. an ``--out`` inside the input directory) are never read.
"""
from __future__ import annotations

import functools
import itertools
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from data_prep.records import SourceError
from data_prep.shard_format import MANIFEST_NAME, SHARD_GLOB

FILE_SUFFIXES = (".xml", ".xml.bz2", ".jsonl", ".json", ".parquet", ".txt")
_WIKIEXTRACTOR = re.compile(r"^wiki_\d+(\.bz2)?$")  # text/AA/wiki_00 (wiki_00.bz2 with --compress)
WIKIEXTRACTOR = "wiki_NN"
"""the file type of WikiExtractor's output files, which have no suffix"""
COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst")
"""what a .jsonl, .json or .txt file may be compressed with (gzip, bzip2, xz: the standard library; zstandard:
pyarrow's codec, which ``datasets`` brings)"""
_COMPRESSIBLE = (".jsonl", ".json", ".txt")
SUPPORTED = (f"{', '.join(FILE_SUFFIXES)} ({', '.join(_COMPRESSIBLE)} also compressed: "
             f"{', '.join(COMPRESSIONS)}), WikiExtractor's {WIKIEXTRACTOR}[.bz2]")
"""every file type read here, for messages"""
_DUMP_PIECE = re.compile(r"\.xml-p\d+p\d+\.bz2$")  # enwiki-20231101-pages-articles1.xml-p1p41242.bz2
DATASET_FOLDER_FILES = ("dataset_dict.json", "dataset_info.json", "state.json")
"""files that ``Dataset.save_to_disk`` writes: a folder holding one is read with ``datasets``"""
TABLE_SUFFIXES = (".parquet", ".csv", ".tsv")
"""a folder whose data files are all tables is read with ``datasets``, which knows their splits"""


def file_type(path: Path) -> str:
    """The file type (one of ``FILE_SUFFIXES``) a name says, whether or not compressed (``_compression``), or ""
    when it names none."""
    name = path.name.lower()
    if _DUMP_PIECE.search(name):
        return ".xml.bz2"
    if _WIKIEXTRACTOR.match(name):
        return WIKIEXTRACTOR
    if found := next((s for s in sorted(FILE_SUFFIXES, key=len, reverse=True) if name.endswith(s)), ""):
        return found
    stem = name.removesuffix(compression_suffix(path))
    return next((s for s in _COMPRESSIBLE if stem != name and stem.endswith(s)), "")


def compression_suffix(path: Path) -> str:
    """The compression suffix of a compressed .jsonl/.json/.txt file name (``COMPRESSIONS``), else ""."""
    name = path.name.lower()
    if name.endswith(".xml.bz2") or _DUMP_PIECE.search(name):
        return ""  # a Wikipedia dump: its reader decompresses it
    return next((c for c in COMPRESSIONS if name.endswith(c)), "")



def check_input(spec: str) -> None:
    """Fail early for a path-like input that does not exist or has an unsupported suffix."""
    path = Path(spec)
    if path.is_dir():
        return
    if path.exists():
        if not file_type(path):
            raise SourceError(f"--input {spec}: unsupported file type; use one of {SUPPORTED} "
                              "(or a Wikipedia dump piece *.xml-p<first>p<last>.bz2), or a Hugging Face dataset name")
        return
    folder = Path(spec.split(":", 1)[0])
    if ":" in spec and folder.is_dir():  # FOLDER[:config][:split]
        if not is_dataset_folder(folder):
            directory_files(*folder_split(spec))  # FOLDER::SPLIT of a folder whose file names name splits
        return
    if file_type(path) or spec.endswith((*COMPRESSIONS, ".csv", ".tsv")) or spec.startswith((".", "/", "~")):
        raise SourceError(f"--input {spec}: file not found")


def is_dataset_input(spec: str) -> bool:
    path = Path(spec)
    return not path.exists() or (path.is_dir() and is_dataset_folder(path))


def _visible_files(directory: Path) -> list[Path]:
    """Files under a directory, sorted by path, without hidden files and folders (a build's ``.NAME.partial``
    staging among them) and without shard builds (folders holding a manifest or shards: a build's own output)."""
    found: list[Path] = []
    for root, folders, files in os.walk(directory):
        if MANIFEST_NAME in files or any(Path(f).match(SHARD_GLOB) for f in files):
            folders[:] = []
            continue
        folders[:] = [f for f in folders if not f.startswith(".")]
        found.extend(Path(root) / f for f in files if not f.startswith(".") and (Path(root) / f).is_file())
    return sorted(found)


def _declares_configs(readme: Path) -> bool:
    """A hub dataset card: a README.md whose YAML header (between the first two ``---`` lines) has ``configs:``."""
    if not readme.is_file():
        return False
    with open(readme, encoding="utf-8", errors="replace") as f:
        if f.readline().strip() != "---":
            return False
        for line in itertools.islice(f, 10_000):
            if line.strip() == "---":
                return False
            if line.startswith("configs:"):
                return True
    return False


def is_dataset_folder(directory: Path) -> bool:
    """Whether a directory is read with ``datasets`` (the marks are listed in the module docstring)."""
    files = _visible_files(directory)
    if any(p.name in DATASET_FOLDER_FILES or p.suffix == ".arrow" for p in files):
        return True
    if _declares_configs(directory / "README.md"):
        return True
    data = [p for p in files if file_type(p) or p.suffix.lower() in TABLE_SUFFIXES]
    return bool(data) and all(p.suffix.lower() in TABLE_SUFFIXES for p in data)


ALL_FILES = "all"
"""``FOLDER::all``: every file of a directory whose names name splits (the union ``datasets`` calls ``all``, plus
the files whose names name none)"""


def split_layout(files: list[Path], directory: Path) -> dict[str, list[Path]]:
    """``files`` (of ``directory``) by split, as ``datasets`` assigns files to splits by their names and folders
    (``train.jsonl``, ``data/validation-00000.jsonl``, ``test/part-1.txt``; ``datasets.data_files``): split ->
    its files, in order. Empty when no name names a split: then the directory is not split. Worked out once per
    directory and listing in a process (``datasets`` globs the whole tree once per pattern)."""
    return _split_layout(str(directory), tuple(map(str, files)))


@functools.lru_cache(maxsize=16)
def _split_layout(directory_name: str, names: tuple[str, ...]) -> dict[str, list[Path]]:
    import datasets.data_files as hf_files  # slow to import: only directory inputs need it

    directory, files = Path(directory_name), [Path(name) for name in names]
    keywords = [word for words in hf_files.SPLIT_KEYWORDS.values() for word in words]
    if not any(word in str(p.relative_to(directory)) for p in files for word in keywords):
        return {}  # no name holds a split's name: no need for datasets' globbing over the whole tree
    try:
        patterns = hf_files.get_data_patterns(str(directory))
    except hf_files.EmptyDatasetError:
        return {}
    if patterns == hf_files.DEFAULT_PATTERNS_ALL:
        return {}
    found = hf_files.DataFilesDict.from_patterns(patterns, base_path=str(directory))
    real = [(p, os.path.realpath(p)) for p in files]
    layout = {}
    for split, in_split in found.items():
        in_split = {os.path.realpath(f) for f in in_split}
        if chosen := [p for p, path in real if path in in_split]:
            layout[str(split)] = chosen
    return layout


@dataclass(frozen=True)
class DirectoryFiles:
    """What an ordinary directory input reads, and what it leaves out, each in sorted path order."""

    read: list[Path]
    other_types: list[Path]
    """files of types not read here (``*.md`` files, READMEs, are not listed)"""
    split: str = ""
    """the split read, when the names name splits (``split_layout``); "" when the directory is not split"""
    other_splits: dict[str, list[Path]] = field(default_factory=dict)
    """readable files left out: split -> files ("": files whose names name no split)"""


def directory_files(directory: Path, split: str = "") -> DirectoryFiles:
    """The files an ordinary directory input reads: every file of a type read here or, when the names name
    splits, those of ``split`` (default ``train``). A split that is not there is a ``SourceError``."""
    files = [p for p in _visible_files(directory) if not p.name.lower().endswith(".md")]
    readable, other_types = [p for p in files if file_type(p)], [p for p in files if not file_type(p)]
    if split == ALL_FILES:
        return DirectoryFiles(readable, other_types)
    splits = split_layout(readable, directory) if readable else {}
    if not splits:
        if split:
            raise SourceError(f"--input {directory}::{split}: no file or folder name in {directory} names a split "
                              "(train, validation, test, as Hugging Face datasets name them), so it has none; "
                              "pass the folder alone")
        return DirectoryFiles(readable, other_types)
    split = split or "train"
    if split not in splits:
        named = ", ".join(f"{name} ({', '.join(str(p.relative_to(directory)) for p in found[:3])}"
                          f"{', …' if len(found) > 3 else ''})" for name, found in splits.items())
        raise SourceError(f"--input {directory}{'::' + split if split != 'train' else ''}: the file names here "
                          f"name splits, as Hugging Face datasets reads them: {named}, and none is {split!r}; "
                          f"name one as {directory}::SPLIT, or read every file as {directory}::{ALL_FILES}")
    read, in_splits = set(splits[split]), {p for found in splits.values() for p in found}
    others = {name: [p for p in found if p not in read] for name, found in splits.items() if name != split}
    others = {name: found for name, found in ({**others, "": [p for p in readable if p not in in_splits]}).items()
              if found}
    return DirectoryFiles([p for p in readable if p in read], other_types, split, others)


def folder_split(spec: str) -> tuple[Path, str]:
    """(directory, split) of an ordinary directory input: ``FOLDER`` or ``FOLDER::SPLIT`` (no configs)."""
    if Path(spec).is_dir():
        return Path(spec), ""
    folder, config, split = (spec.split(":") + ["", ""])[:3]
    if config or not split:
        raise SourceError(f"--input {spec}: {folder} is not a Hugging Face dataset folder, so it has no configs; "
                          f"pass the folder alone, or name a split of its files as {folder}::SPLIT")
    return Path(folder), split


def is_plain_folder(spec: str) -> bool:
    """Whether an input is an ordinary directory (read file by file), alone or as ``FOLDER::SPLIT``."""
    folder = Path(spec) if Path(spec).is_dir() else Path(spec.split(":", 1)[0])
    return folder.is_dir() and not is_dataset_folder(folder)
