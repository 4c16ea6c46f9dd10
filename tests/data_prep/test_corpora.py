"""Corpora as they come: sentence-per-row rows, other text fields, masking at 512, HF tokenizers as --vocab,
builders that read disjoint inputs, and rebuilds that never cost the previous build."""
from __future__ import annotations

import dataclasses
import itertools
import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv
import pyarrow.parquet as pq
import pytest

from data_prep import build, chunks
from data_prep.config import BuildConfig
from data_prep.inspect import shard_statistics
from data_prep.shard_format import ShardDataset
from data_prep.sources import ReadOptions, read_documents
from data_prep.text import clean_document, split_sentences
from shard_builds import build_error, logged, run_build


def directory_bytes(directory: Path) -> dict[str, bytes | None]:
    """Every file's bytes by name (None for a subdirectory)."""
    return {p.name: p.read_bytes() if p.is_file() else None for p in sorted(directory.iterdir())}


@pytest.fixture(scope="module")
def books(samples_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Eight Gutenberg plays twice: one document per play, and one sentence per row (as BookCorpus on the hub)."""
    out = tmp_path_factory.mktemp("books")
    texts = [d for d in itertools.islice(read_documents(str(samples_dir / "books.jsonl")), 8)]
    with open(out / "whole.jsonl", "w") as whole, open(out / "rows.jsonl", "w") as rows:
        for text in texts:
            whole.write(json.dumps({"text": text}) + "\n")
            for sentence in split_sentences(clean_document(text)):
                rows.write(json.dumps({"text": sentence}) + "\n")
    return {"whole": out / "whole.jsonl", "rows": out / "rows.jsonl"}


@pytest.mark.parametrize("max_seq_len", [128, 512])
def test_sentence_rows_yield_the_tokens_of_whole_texts(books, vocab_file, tmp_path, max_seq_len):
    common = ["--vocab", vocab_file, "--max-seq-len", max_seq_len]
    run_build("--input", books["whole"], *common, "--out", tmp_path / "whole")
    run_build("--input", books["rows"], "--rows-as-sentences", *common, "--out", tmp_path / "rows")
    whole = shard_statistics(ShardDataset(tmp_path / "whole"))
    rows = shard_statistics(ShardDataset(tmp_path / "rows"))
    assert sum(1 for _ in open(books["rows"])) > 15_000
    assert rows["num_tokens"] >= 0.9 * whole["num_tokens"]
    assert abs(rows["padding_fraction"] - whole["padding_fraction"]) <= 0.05
    assert rows["documents"]["skipped"] == 0
    error = build_error("--input", books["rows"], *common, "--out", tmp_path / "no_flag")  # one sentence a document
    assert "no samples" in error and "--rows-as-sentences" in error
    assert not (tmp_path / "no_flag").exists()


def test_skipped_documents_warn_and_the_flag_applies_to_named_inputs(books, vocab_file, tmp_path, caplog):
    args = ["--input", books["whole"], books["rows"], "--vocab", vocab_file, "--max-seq-len", 128]
    manifest = run_build(*args, "--out", tmp_path / "mixed")
    err = logged(caplog)
    assert "[build] warning:" in err and "too_few_sentences" in err and "--rows-as-sentences" in err
    assert manifest["documents"]["skipped"] > 0.9 * manifest["documents"]["read"]
    manifest = run_build(*args, "--rows-as-sentences", books["rows"], "--out", tmp_path / "fixed")
    assert "warning" not in logged(caplog)
    assert manifest["reading"]["rows_as_sentences"] == [str(books["rows"])]
    assert manifest["documents"]["skipped"] == 0 and manifest["documents"]["read"] > 8
    assert "not among the --input sources" in build_error(*args, "--rows-as-sentences", tmp_path / "x.jsonl",
                                                           "--out", tmp_path / "bad")


def test_rows_per_document_and_empty_rows_end_documents(tmp_path, vocab_file):
    lines = [f"Sentence number {i} of the running text." for i in range(30)]
    (tmp_path / "lines.txt").write_text("\n".join(lines[:20]) + "\n\n" + "\n".join(lines[20:]) + "\n")
    records = list(read_documents(str(tmp_path / "lines.txt"),
                                  ReadOptions(rows_as_sentences=True, rows_per_document=8)))
    assert [len(split_sentences(clean_document(r))) for r in records] == [8, 8, 4, 8, 2]
    assert records[0].split("\n\n") == lines[:8]
    manifest = run_build("--input", tmp_path / "lines.txt", "--rows-as-sentences", "--rows-per-document", 8,
                         "--vocab", vocab_file, "--out", tmp_path / "out")
    assert {k: manifest["documents"][k] for k in ("read", "skipped", "skip_reasons")} == \
        {"read": 5, "skipped": 0, "skip_reasons": {}}
    assert "--rows-per-document 1 must be at least 2" in build_error(
        "--input", tmp_path / "lines.txt", "--rows-per-document", 1, "--vocab", vocab_file, "--out", tmp_path / "o")


def test_text_field_picks_the_column_and_a_missing_one_names_those_there_are(books, vocab_file, tmp_path, caplog):
    sentences = [json.loads(line)["text"] for line in itertools.islice(open(books["rows"]), 3000)]
    pq.write_table(pa.table({"id": list(range(len(sentences))), "sentence": sentences}), tmp_path / "rows.parquet")
    args = ["--input", tmp_path / "rows.parquet", "--vocab", vocab_file, "--rows-as-sentences"]
    error = build_error(*args, "--out", tmp_path / "o")
    assert "rows.parquet: no 'text' column (columns: ['id', 'sentence'])" in error and "--text-field" in error
    manifest = run_build(*args, "--text-field", "sentence", "--out", tmp_path / "parquet")
    assert manifest["num_samples"] > 100 and manifest["reading"]["text_field"] == "sentence"
    with open(tmp_path / "rows.jsonl", "w") as f:  # JSON lines: the records without the field are counted
        for sentence in sentences:
            f.write(json.dumps({"sentence": sentence}) + "\n")
    error = build_error("--input", tmp_path / "rows.jsonl", "--vocab", vocab_file, "--rows-as-sentences",
                        "--out", tmp_path / "o")
    assert "missing_text_field" in error and "fields: ['sentence']" in error and "--text-field" in error
    same = run_build("--input", tmp_path / "rows.jsonl", "--vocab", vocab_file, "--rows-as-sentences",
                     "--text-field", "sentence", "--out", tmp_path / "jsonl")
    assert directory_bytes(tmp_path / "jsonl")["shard-00000.bin"] == \
        directory_bytes(tmp_path / "parquet")["shard-00000.bin"]
    assert same["num_samples"] == manifest["num_samples"]


def test_max_predictions_follows_the_length_and_masks_15_percent_at_512(small_corpus, vocab_file, tmp_path, caplog):
    manifest = run_build("--input", small_corpus, "--vocab", vocab_file, "--max-seq-len", 512, "--out", tmp_path / "a")
    assert manifest["masking"]["max_predictions"] == 77
    stats = shard_statistics(ShardDataset(tmp_path / "a"))
    assert stats["masked_fraction"] == pytest.approx(0.15, abs=0.01)
    assert set(stats["masked_fraction_by_objective"]) == {"bidirectional", "left_to_right", "right_to_left", "seq2seq"}
    for fraction in stats["masked_fraction_by_objective"].values():
        assert fraction == pytest.approx(0.15, abs=0.01)
    assert stats["max_predictions"] == 77 and stats["cap_bound"]["samples"] == 0
    assert np.mean([s.length for s in ShardDataset(tmp_path / "a")]) > 400  # long samples: a cap of 20 would bind
    caplog.clear()
    run_build("--input", small_corpus, "--vocab", vocab_file, "--max-seq-len", 512, "--max-predictions", 20,
              "--out", tmp_path / "capped")
    assert "--max-predictions 20 caps masking" in logged(caplog)
    capped = shard_statistics(ShardDataset(tmp_path / "capped"))
    assert capped["masked_fraction"] < 0.07 and capped["cap_bound"]["fraction"] > 0.5
    assert json.loads((tmp_path / "capped" / "manifest.json").read_text())["masking"]["max_predictions"] == 20


def test_dupe_copies_are_deterministic_from_the_seed(samples_dir, vocab_file, tmp_path):
    args = ["--input", samples_dir / "news/lee.txt", "--vocab", vocab_file, "--recipe", "bert", "--dupe-factor", 3]
    run_build(*args, "--out", tmp_path / "a")
    run_build(*args, "--out", tmp_path / "b")
    assert directory_bytes(tmp_path / "a") == directory_bytes(tmp_path / "b")
    ds = ShardDataset(tmp_path / "a")
    third = len(ds) // 3
    masks = [tuple(ds[i + copy * third].masked_positions.tolist()) for i in range(50) for copy in range(3)]
    assert sum(len({masks[3 * i], masks[3 * i + 1], masks[3 * i + 2]}) == 3 for i in range(50)) > 40


def test_hf_tokenizer_directory_and_tokenizer_json_as_vocab(minilm_dir, samples_dir, vocab_file, tmp_path):
    """MiniLM's uncased BERT tokenizer, as its model directory, as tokenizer.json alone, and as vocab.txt."""
    args = ["--input", samples_dir / "news/lee.txt", "--max-seq-len", 64]
    directory = run_build(*args, "--vocab", minilm_dir, "--out", tmp_path / "directory")
    assert directory["vocab"]["uncased"] is True and directory["vocab"]["size"] == 30522
    run_build(*args, "--vocab", minilm_dir / "vocab.txt", "--uncased", "--out", tmp_path / "vocab_txt")
    assert directory_bytes(tmp_path / "directory") == directory_bytes(tmp_path / "vocab_txt")
    (tmp_path / "tok").mkdir()
    shutil.copy(minilm_dir / "tokenizer.json", tmp_path / "tok" / "tokenizer.json")
    run_build(*args, "--vocab", tmp_path / "tok" / "tokenizer.json", "--out", tmp_path / "tokenizer_json")
    assert directory_bytes(tmp_path / "tokenizer_json") == directory_bytes(tmp_path / "vocab_txt")
    run_build(*args, "--vocab", tmp_path / "tok", "--out", tmp_path / "tokenizer_dir")
    assert directory_bytes(tmp_path / "tokenizer_dir") == directory_bytes(tmp_path / "vocab_txt")
    error = build_error(*args, "--vocab", minilm_dir, "--cased", "--out", tmp_path / "o")
    assert "--cased contradicts --vocab" in error and "tokenizer_config.json lowercases" in error
    assert run_build(*args, "--vocab", vocab_file, "--out", tmp_path / "bare")["vocab"]["uncased"] is False
    (tmp_path / "bpe.json").write_text(json.dumps({"model": {"type": "BPE", "vocab": {}}}))
    assert "a BPE tokenizer; only BERT WordPiece" in build_error(*args, "--vocab", tmp_path / "bpe.json",
                                                                 "--out", tmp_path / "o")


def test_builders_read_disjoint_inputs_and_join_to_one_builders_bytes(samples_dir, vocab_file, tmp_path,
                                                                      monkeypatch):
    files = sorted((samples_dir / "bbc/tech").glob("*.txt"))[:40]
    inputs = [tmp_path / "bbc", samples_dir / "wiki/enwiki-excerpt.xml.bz2", tmp_path / "dataset"]
    (tmp_path / "bbc").mkdir()
    for i, path in enumerate(files):  # a directory of files: each file is a unit
        shutil.copy(path, tmp_path / "bbc" / f"{i // 10}-{path.name}")
    (tmp_path / "dataset").mkdir()  # a Hugging Face dataset folder of 3 csv files: each dataset shard is a unit
    news = (samples_dir / "news/lee.txt").read_text().split("\n\n")
    for shard in range(3):
        pa.csv.write_csv(pa.table({"text": news[shard * 40:(shard + 1) * 40]}), tmp_path / "dataset" / f"{shard}.csv")
    common = ["--input", *inputs, "--vocab", vocab_file, "--max-seq-len", 64, "--chunk-chars", 20_000]
    one = run_build(*common, "--workers", 2, "--out", tmp_path / "one")
    assert one["documents"]["read"] > 150

    read: dict[int, list[str]] = {}
    original = chunks.read_unit

    def recording(unit, options):
        read.setdefault(builder, []).append(str(unit))
        return original(unit, options)

    monkeypatch.setattr(chunks, "read_unit", recording)
    for builder in (2, 0, 1):
        build.main([str(a) for a in common] + ["--num-builders", "3", "--builder-index", str(builder),
                                                "--out", str(tmp_path / "split"), "--quiet"])
    build.main(["--finalize", "--out", str(tmp_path / "split")])
    assert directory_bytes(tmp_path / "split") == directory_bytes(tmp_path / "one")
    units = [u for b in sorted(read) for u in read[b]]
    assert len(units) == len(set(units)) == 40 + 1 + 3  # every unit read once, by one builder
    assert all(len(read[b]) >= 14 for b in range(3))
    assert any("dataset shard 1/3" in u for u in units)


def test_a_failed_rebuild_leaves_the_previous_build_intact(samples_dir, vocab_file, tmp_path):
    out = tmp_path / "shards"
    args = ["--vocab", vocab_file, "--max-seq-len", 64, "--out", out]
    run_build("--input", samples_dir / "news/lee.txt", *args)
    before = directory_bytes(out)
    (tmp_path / "broken.xml").write_text("<mediawiki><page><title>A</title><ns>0</ns><revision><text>Hi")
    error = build_error("--input", samples_dir / "news/lee.txt", tmp_path / "broken.xml", *args, "--overwrite")
    assert "broken.xml: not a readable Wikipedia XML dump" in error
    assert directory_bytes(out) == before
    error = build_error("--input", tmp_path / "typo.jsonl", *args, "--overwrite")
    assert "typo.jsonl: file not found" in error and directory_bytes(out) == before
    manifest = run_build("--input", samples_dir / "news/lee.txt", *args[:3], 32, *args[4:], "--overwrite")
    assert manifest["max_seq_len"] == 32 and ShardDataset(out).manifest == manifest
    # nothing left beside it but the (empty) lock file
    assert sorted(p.name for p in tmp_path.iterdir()) == [".shards.lock", "broken.xml", "shards"]
    assert (tmp_path / ".shards.lock").read_text() == ""
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "mine.txt").write_text("not a build")
    error = build_error("--input", samples_dir / "news/lee.txt", *args[:-1], tmp_path / "notes", "--overwrite")
    assert "holds files that are not part of a shard build (mine.txt)" in error
    assert (tmp_path / "notes" / "mine.txt").read_text() == "not a build"


def test_non_utf8_bytes_are_counted_with_file_and_line_in_every_text_input(vocab_file, samples_dir, tmp_path):
    news = (samples_dir / "news/lee.txt").read_text().split("\n\n")[:30]
    (tmp_path / "dir").mkdir()
    with open(tmp_path / "dir" / "a.jsonl", "wb") as f:
        for i, text in enumerate(news):
            f.write(json.dumps({"text": text}).encode() + b"\n")
            if i == 4:
                f.write(b'{"text": "caf\xe9 au lait. Deux."}\n')  # latin-1, line 6
    with open(tmp_path / "rows.txt", "wb") as f:
        f.write(b"First sentence here.\nSecond \xff sentence.\nThird one.\n")
    manifest = run_build("--input", tmp_path / "dir", tmp_path / "rows.txt", "--rows-as-sentences",
                         tmp_path / "rows.txt", "--vocab", vocab_file, "--out", tmp_path / "out")
    assert manifest["documents"]["skip_reasons"] == {"invalid_utf8": 1}  # a JSON line is dropped whole
    assert manifest["documents"]["skip_examples"]["invalid_utf8"] == [f"{tmp_path / 'dir' / 'a.jsonl'}:6"]
    # a text line keeps its good bytes: the bad one becomes U+FFFD, counted with its file and line
    assert manifest["documents"]["repaired_lines"] == 1
    assert manifest["documents"]["repair_examples"] == [f"{tmp_path / 'rows.txt'}:2"]
    (tmp_path / "array.json").write_bytes(b'[\n{"text": "A. B."},\n{"text": "caf\xe9"}\n]\n')
    error = build_error("--input", tmp_path / "array.json", "--vocab", vocab_file, "--out", tmp_path / "o")
    assert f"{tmp_path / 'array.json'}: not valid UTF-8 JSON at line 3" in error


def test_wikipedia_pages_leave_the_reader_raw_and_are_cleaned_in_the_worker(samples_dir):
    from data_prep.sources import Unit, read_unit
    from data_prep.wiki_dump import Wikitext, document_text

    dump = str(samples_dir / "wiki/enwiki-excerpt.xml.bz2")
    pages = [r for r in itertools.islice(read_unit(Unit(dump)), 60) if isinstance(r, str)]
    assert pages and all(isinstance(p, Wikitext) for p in pages)
    assert sum("[[" in p or "{{" in p for p in pages) > 0.9 * len(pages)  # markup still there: not cleaned yet
    cleaned = [document_text(p) for p in pages]
    assert not any("[[" in c or "{{" in c for c in cleaned)
    assert cleaned == [d for d in itertools.islice(read_documents(dump), 60) if isinstance(d, str)][:len(cleaned)]


def test_a_large_jsonl_is_split_into_byte_ranges_that_builders_share(samples_dir, vocab_file, tmp_path, monkeypatch):
    from data_prep.instances import InstanceConfig
    from data_prep.vocab import load_vocab

    news = (samples_dir / "news/lee.txt").read_text().split("\n\n")
    corpus = tmp_path / "news.jsonl"
    with open(corpus, "wb") as f:
        for i, text in enumerate(news):
            f.write(json.dumps({"text": text}).encode() + b"\n")
            if i in (3, 250):
                f.write(b'{"text": "caf\xe9 au lait. Deux."}\n')  # lines 5 and 253
    cfg = BuildConfig(inputs=(str(corpus),), vocab_path=str(vocab_file),
                            vocab_sha256=load_vocab(vocab_file).sha256, instances=InstanceConfig(max_seq_len=64),
                            chunk_chars=30_000, unit_bytes=40_000)
    whole = build.build(dataclasses.replace(cfg, unit_bytes=10**9), tmp_path / "whole", progress=False)
    one = build.build(cfg, tmp_path / "one", workers=2, progress=False)
    assert one["documents"]["read"] == whole["documents"]["read"] == len(news) + 2  # every line exactly once
    assert one["documents"]["skip_examples"]["invalid_utf8"] == [f"{corpus}:5", f"{corpus}:253"]
    assert one["num_tokens"] == pytest.approx(whole["num_tokens"], rel=0.02)

    read: dict[int, list[str]] = {}
    original = chunks.read_unit

    def recording(unit, options):
        read.setdefault(builder, []).append(str(unit))
        return original(unit, options)

    monkeypatch.setattr(chunks, "read_unit", recording)
    for builder in range(3):
        build.run_builder(cfg, tmp_path / "split", builder_index=builder, num_builders=3, progress=False)
    build.finalize(tmp_path / "split")
    assert directory_bytes(tmp_path / "split") == directory_bytes(tmp_path / "one")
    units = [u for b in sorted(read) for u in read[b]]
    assert len(read) == 3 and len(units) == len(set(units)) >= 6 and all(" bytes " in u for u in units)
