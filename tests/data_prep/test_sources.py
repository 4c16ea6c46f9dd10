"""Every input kind reads real or crafted documents; unusable records are counted skips, unusable inputs errors."""
from __future__ import annotations

import bz2
import gzip
import json
import logging
import lzma
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data_prep.inputs import check_input, directory_files, is_dataset_folder
from data_prep.records import RepairedText, Skipped, SourceError
from data_prep.sources import ReadOptions, input_units, read_documents
from shard_builds import logged


def _reasons(records) -> list[str]:
    return [r.reason for r in records if isinstance(r, Skipped)]


def test_txt_blank_line_separated_news(samples_dir):
    records = list(read_documents(str(samples_dir / "news/lee.txt")))
    assert len(records) == 300 and all(isinstance(r, str) for r in records)
    assert records[0].startswith("Hundreds of people have been forced")


def test_jsonl_books(samples_dir):
    records = list(read_documents(str(samples_dir / "books.jsonl")))
    assert len(records) == 42 and all(isinstance(r, str) and len(r) > 1_000 for r in records)


# the fastest level of each: the reader meets the same format, and lzma's default level took 16 s on these files
COMPRESSORS = {".gz": lambda data: gzip.compress(data, 1), ".bz2": lambda data: bz2.compress(data, 1),
               ".xz": lambda data: lzma.compress(data, preset=0),
               ".zst": lambda data: pa.Codec("zstd").compress(data, asbytes=True)}


@pytest.mark.parametrize("compression", list(COMPRESSORS))
def test_compressed_inputs_read_as_their_uncompressed_selves(samples_dir, tmp_path, compression):
    """C4 ships .json.gz (JSON lines), the Pile and SlimPajama .jsonl.zst: the same documents, in order, as the
    uncompressed files, with the same skips, and one unit per file (a compressed file has no byte ranges)."""
    compress = COMPRESSORS[compression]
    books, news = samples_dir / "books.jsonl", samples_dir / "news/lee.txt"
    hostile = books.read_bytes()[:20_000] + b"\n{not json}\n" + b'{"text": 3}\n\xff\xfe\n'
    for source, name in ((books, "books.jsonl"), (books, "c4-style.json"), (news, "lee.txt")):
        (tmp_path / (name + compression)).write_bytes(compress(source.read_bytes()))
        expected = list(read_documents(str(source)))
        assert list(read_documents(str(tmp_path / (name + compression)))) == expected, name
    (tmp_path / "plain.jsonl").write_bytes(hostile)
    (tmp_path / ("hostile.jsonl" + compression)).write_bytes(compress(hostile))
    expected = [r if isinstance(r, str) else (r.reason, r.chars)
                for r in read_documents(str(tmp_path / "plain.jsonl"))]
    got = [r if isinstance(r, str) else (r.reason, r.chars)
           for r in read_documents(str(tmp_path / ("hostile.jsonl" + compression)))]
    assert got == expected
    assert {r[0] for r in got if isinstance(r, tuple)} == {"malformed_json", "text_not_a_string", "invalid_utf8"}
    assert len(input_units(str(tmp_path / ("books.jsonl" + compression)), unit_bytes=1000)) == 1
    rows = list(read_documents(str(tmp_path / ("lee.txt" + compression)), ReadOptions(rows_as_sentences=True)))
    assert rows == list(read_documents(str(news), ReadOptions(rows_as_sentences=True)))
    cut = tmp_path / ("cut.jsonl" + compression)  # a download cut short
    cut.write_bytes(compress(books.read_bytes())[:5_000])
    with pytest.raises(SourceError, match=rf"cut.jsonl{compression}: not a readable {compression[1:]} file .*"
                                          "fetch it again"):
        list(read_documents(str(cut)))


def test_a_c4_style_folder_reads_its_compressed_train_files(tmp_path):
    c4 = tmp_path / "c4" / "en"
    c4.mkdir(parents=True)
    for split, shards in (("train", 2), ("validation", 1)):
        for shard in range(shards):
            record = {"text": f"A {split} page {shard}. Two sentences.", "url": "https://example.org"}
            (c4 / f"c4-{split}.{shard:05d}-of-{shards:05d}.json.gz").write_bytes(
                gzip.compress((json.dumps(record) + "\n").encode()))
    assert list(read_documents(str(c4))) == ["A train page 0. Two sentences.", "A train page 1. Two sentences."]
    assert list(read_documents(f"{c4}::validation")) == ["A validation page 0. Two sentences."]


def test_wikiextractor_output_reads_as_the_articles_it_holds(samples_dir, tmp_path):
    """NVIDIA's BERT and Megatron start from WikiExtractor's text/AA/wiki_00 files: `<doc>` blocks (title line,
    then a paragraph per line) or, with --json, JSON lines; with --compress, wiki_00.bz2."""
    articles = [d for d in read_documents(str(samples_dir / "wiki/enwiki-excerpt.xml.bz2")) if isinstance(d, str)][:6]
    paragraphs = [[" ".join(p.split()) for p in a.split("\n\n") if p.strip()] for a in articles]
    blocks = [f'<doc id="{i}" url="https://en.wikipedia.org/wiki?curid={i}" title="Title {i}">\nTitle {i}\n\n'
              + "\n".join(ps) + "\n</doc>\n" for i, ps in enumerate(paragraphs)]
    (tmp_path / "text" / "AA").mkdir(parents=True)
    (tmp_path / "text" / "AB").mkdir()
    (tmp_path / "text" / "AA" / "wiki_00").write_text("".join(blocks[:2]))
    (tmp_path / "text" / "AA" / "wiki_01").write_text("".join(
        json.dumps({"id": str(i), "url": "u", "title": f"Title {i}", "text": "\n".join(ps)}) + "\n"
        for i, ps in enumerate(paragraphs[2:4], start=2)))
    (tmp_path / "text" / "AB" / "wiki_00.bz2").write_bytes(bz2.compress("".join(blocks[4:]).encode()))
    documents = list(read_documents(str(tmp_path / "text")))
    assert [d.split("\n\n") for d in documents] == paragraphs  # title lines dropped, a paragraph per line kept
    (tmp_path / "cut").mkdir()  # a file cut off inside a document, a bad byte in a paragraph, an empty article
    (tmp_path / "cut" / "wiki_07").write_bytes(b'<doc id="1" title="A">\nA\nFirst para.\nSecond \xff para.\n</doc>\n'
                                               b'<doc id="2" title="B">\nB\n</doc>\n<doc id="3" title="C">\nC\nCut')
    first, empty, cut = read_documents(str(tmp_path / "cut" / "wiki_07"))
    assert isinstance(first, RepairedText) and first.where.endswith("wiki_07:4") and first.startswith("First para.")
    assert (empty, cut) == ("", "Cut")
    with pytest.raises(SourceError, match="--rows-as-sentences does not apply to Wikipedia articles"):
        list(read_documents(str(tmp_path / "cut" / "wiki_07"), ReadOptions(rows_as_sentences=True)))
    assert [u.spec for u in input_units(str(tmp_path / "text"))] == [
        str(tmp_path / "text" / name) for name in ("AA/wiki_00", "AA/wiki_01", "AB/wiki_00.bz2")]


def test_hostile_jsonl_lines_are_counted(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"text": "fine"}\n\xff\xfe{"text": "bad bytes"}\n{not json\n{"title": "no text"}\n'
                     b'{"text": 5}\n[1, 2]\n\n{"text": "also fine"}\n')
    records = list(read_documents(str(path)))
    assert [r for r in records if isinstance(r, str)] == ["fine", "also fine"]
    assert _reasons(records) == ["invalid_utf8", "malformed_json", "missing_text_field", "text_not_a_string",
                                 "not_an_object"]
    assert records[1].where == f"{path}:2"


def test_json_array_and_parquet(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps([{"text": "one"}, {"text": "two"}, {"x": 1}]))
    assert list(read_documents(str(tmp_path / "a.json")))[:2] == ["one", "two"]
    pq.write_table(pa.table({"text": ["p1", None, "p3"], "id": [1, 2, 3]}), tmp_path / "a.parquet")
    records = list(read_documents(str(tmp_path / "a.parquet")))
    assert records[0] == "p1" and records[2] == "p3" and _reasons(records) == ["text_not_a_string"]
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "b.parquet")
    with pytest.raises(SourceError, match=r"b.parquet: no 'text' column \(columns: \['body'\]\)"):
        list(read_documents(str(tmp_path / "b.parquet")))


def test_txt_with_non_utf8_bytes_keeps_the_document(tmp_path):
    path = tmp_path / "a.txt"
    path.write_bytes(b"Good one. Two.\n\nBad \xff\xfe bytes.\nFine line.\n\n\n\nLast doc.\r\n")
    records = list(read_documents(str(path)))
    assert records == ["Good one. Two.\n", "Bad \ufffd\ufffd bytes.\nFine line.\n", "Last doc.\r\n"]
    assert isinstance(records[1], RepairedText) and (records[1].lines, records[1].where) == (1, f"{path}:3")
    assert not isinstance(records[0], RepairedText)


def test_hf_dataset_code_path_on_a_local_dataset_folder(tmp_path):
    folder = tmp_path / "hf_dataset"
    folder.mkdir()
    pq.write_table(pa.table({"text": ["Doc one. Sentence two.", "Doc two. More."]}), folder / "train.parquet")
    assert list(read_documents(str(folder))) == ["Doc one. Sentence two.", "Doc two. More."]


def test_unreachable_hf_name_is_a_clear_error(monkeypatch):
    import datasets
    import huggingface_hub

    # offline mode fails at once instead of waiting for network timeouts (the error path is the same)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(SourceError,
                       match="could not load Hugging Face dataset 'no-such/dataset-xyz'.*split 'validation'"):
        list(read_documents("no-such/dataset-xyz:default:validation"))


def test_missing_file_unknown_suffix_and_broken_dump(tmp_path):
    with pytest.raises(SourceError, match="missing.jsonl: file not found"):
        list(read_documents(str(tmp_path / "missing.jsonl")))
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(SourceError, match="x.csv: unsupported file type"):
        list(read_documents(str(tmp_path / "x.csv")))
    (tmp_path / "x.parquet.gz").write_bytes(b"")  # parquet compresses inside; a compressed one is not read
    with pytest.raises(SourceError, match=r"x.parquet.gz: unsupported file type; use one of .*\(.jsonl, .json, .txt "
                                          r"also compressed: .gz, .bz2, .xz, .zst\)"):
        list(read_documents(str(tmp_path / "x.parquet.gz")))
    with pytest.raises(SourceError, match="missing.jsonl.zst: file not found"):
        list(read_documents(str(tmp_path / "missing.jsonl.zst")))
    (tmp_path / "dump.xml").write_text("<mediawiki><page><title>A</title><ns>0</ns><revision><text>Hi")
    with pytest.raises(SourceError, match="dump.xml: not a readable Wikipedia XML dump"):
        list(read_documents(str(tmp_path / "dump.xml")))


def test_wikipedia_dump_pieces_are_read_by_name_and_in_a_directory(samples_dir, tmp_path):
    dump = samples_dir / "wiki/enwiki-excerpt.xml.bz2"
    expected = list(read_documents(str(dump)))
    (tmp_path / "pieces").mkdir()
    piece = tmp_path / "pieces" / "enwiki-20231101-pages-articles1.xml-p1p41242.bz2"
    shutil.copy(dump, piece)
    (tmp_path / "pieces" / "enwiki-20231101-pages-articles-multistream-index1.txt-p1p41242.bz2").write_bytes(b"x")
    assert [str(r) if isinstance(r, str) else r.reason for r in read_documents(str(piece))] == \
        [str(r) if isinstance(r, str) else r.reason for r in expected]
    assert [u.spec for u in input_units(str(tmp_path / "pieces"))] == [str(piece)]  # the index is no dump
    assert (directory_files(tmp_path / "pieces").other_types[0].name
            .startswith("enwiki-20231101-pages-articles-multistream"))


def test_a_directory_is_a_dataset_folder_only_by_the_marks_of_one(tmp_path):
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "a.txt").write_text("One. Two.\n")
    for name in ("LICENSE", "README", "notes.csv", "README.md"):  # files of other types do not make it one
        (plain / name).write_text("Licensed under CC-BY 4.0.\n")
    assert not is_dataset_folder(plain)
    assert list(read_documents(str(plain))) == ["One. Two.\n"]
    assert [p.name for p in directory_files(plain).other_types] == ["LICENSE", "README", "notes.csv"]
    (plain / "shards").mkdir()  # a shard build inside the input directory is never read
    for name in ("manifest.json", "vocab.txt", "shard-00000.bin"):
        (plain / "shards" / name).write_text("build output\n")
    (plain / ".shards.partial").mkdir()
    (plain / ".shards.partial" / "vocab.txt").write_text("staging\n")
    assert list(read_documents(str(plain))) == ["One. Two.\n"]
    (plain / "README.md").write_text("---\nconfigs:\n- config_name: default\n---\n")  # a hub dataset card
    assert is_dataset_folder(plain)
    tables = tmp_path / "tables"
    tables.mkdir()
    (tables / "0.csv").write_text("text\nx\n")
    (tables / "LICENSE").write_text("MIT\n")
    assert is_dataset_folder(tables)  # data files that are all tables: datasets reads them, with their splits
    (tables / "more.jsonl").write_text('{"text": "y"}\n')
    assert not is_dataset_folder(tables)
    (tables / "data-00000-of-00001.arrow").write_bytes(b"")
    assert is_dataset_folder(tables)
    with pytest.raises(SourceError, match=r"empty: no file in this directory is of a type read here \(it holds "
                                          r"x.csv.gz, y.csv.gz\)"):
        (tmp_path / "empty").mkdir()
        (tmp_path / "empty" / "x.csv.gz").write_bytes(b"")
        (tmp_path / "empty" / "y.csv.gz").write_bytes(b"")
        list(read_documents(str(tmp_path / "empty")))


def test_a_hub_snapshot_folder_reads_its_train_split_unless_told(tmp_path):
    root = tmp_path / "hf_local"
    (root / "data").mkdir(parents=True)
    for split, n in (("train", 5), ("validation", 3), ("test", 3)):
        pq.write_table(pa.table({"text": [f"A {split} document {i}. Two sentences." for i in range(n)]}),
                       root / "data" / f"{split}-00000-of-00001.parquet")
    (root / "README.md").write_text(
        "---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n    path: data/train-*\n"
        "  - split: validation\n    path: data/validation-*\n  - split: test\n    path: data/test-*\n---\n")
    assert {d.split()[1] for d in read_documents(str(root))} == {"train"}
    assert len(list(read_documents(str(root)))) == 5
    assert {d.split()[1] for d in read_documents(f"{root}::validation")} == {"validation"}
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "a.txt").write_text("One. Two.\n")
    with pytest.raises(SourceError, match="no file or folder name in .*plain names a split"):
        check_input(f"{tmp_path / 'plain'}::test")
    with pytest.raises(SourceError, match="plain is not a Hugging Face dataset folder, so it has no configs"):
        check_input(f"{tmp_path / 'plain'}:default:train")


def test_a_folder_of_split_named_files_reads_its_train_split_unless_told(tmp_path, caplog):
    from data_prep.build import _warn_left_out

    root = tmp_path / "snapshot"  # a hub dataset cloned without a dataset card: splits named by file names only
    (root / "extra").mkdir(parents=True)
    for name in ("train.jsonl", "validation.jsonl", "test.jsonl", "notes.jsonl"):
        (root / name).write_text(f'{{"text": "From {name}. Two sentences."}}\n')
    (root / "extra" / "wiki-test-0.txt").write_text("From the extra test file. Two.\n")
    (root / "contest.txt").write_text("A contest is no test split. Two.\n")
    assert not is_dataset_folder(root)
    assert list(read_documents(str(root))) == ["From train.jsonl. Two sentences."]
    assert list(read_documents(f"{root}::validation")) == ["From validation.jsonl. Two sentences."]
    assert list(read_documents(f"{root}::test")) == ["From the extra test file. Two.\n",
                                                      "From test.jsonl. Two sentences."]
    listed = directory_files(root)
    assert listed.split == "train" and [p.name for p in listed.read] == ["train.jsonl"]
    assert {name: [p.name for p in files] for name, files in listed.other_splits.items()} == {
        "validation": ["validation.jsonl"], "test": ["wiki-test-0.txt", "test.jsonl"],
        "": ["contest.txt", "notes.jsonl"]}
    caplog.set_level(logging.INFO, logger="data_prep")  # a note, not a warning
    _warn_left_out(str(root))
    warned = logged(caplog)
    assert "reading split train (1 file(s): train.jsonl)" in warned
    assert "no split named: contest.txt, notes.jsonl" in warned and "split test: extra/wiki-test-0.txt" in warned
    with pytest.raises(SourceError, match=r"validation \(validation.jsonl\), test .* and none is 'dev'"):
        check_input(f"{root}::dev")
    assert len(list(read_documents(f"{root}::all"))) == 6  # every file, whatever its name says
    (root / "train.jsonl").unlink()  # named splits without a train split: the default has nothing to read
    with pytest.raises(SourceError, match="none is 'train'; name one as .*::SPLIT, or read every file as .*::all"):
        list(read_documents(str(root)))
    books = tmp_path / "books"  # names that name no split: every file is read, as before
    books.mkdir()
    for name in ("Testament.txt", "contest.txt", "trainspotting.txt"):
        (books / name).write_text(f"{name}. Two.\n")
    assert len(list(read_documents(str(books)))) == 3 and directory_files(books).split == ""


def test_a_saved_dataset_folder_reads_its_train_split_unless_told(tmp_path):
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["Train one. Two.", "Train two. Three."]}),
                          "test": datasets.Dataset.from_dict({"text": ["Test one. Two."]})}
                         ).save_to_disk(str(tmp_path / "saved"))
    assert list(read_documents(str(tmp_path / "saved"))) == ["Train one. Two.", "Train two. Three."]
    assert list(read_documents(f"{tmp_path / 'saved'}::test")) == ["Test one. Two."]
    with pytest.raises(SourceError, match=r"no split 'dev' in this saved dataset \(splits: \['test', 'train'\]\)"):
        list(read_documents(f"{tmp_path / 'saved'}::dev"))


def test_a_byte_order_mark_is_ignored_in_every_text_input(tmp_path):
    bom = b"\xef\xbb\xbf"
    docs = [{"text": f"Document {i} is here. It has a second sentence."} for i in range(3)]
    (tmp_path / "a.jsonl").write_bytes(bom + b"\n".join(json.dumps(r).encode() for r in docs) + b"\n")
    (tmp_path / "b.json").write_bytes(bom + json.dumps(docs, indent=2).encode())
    (tmp_path / "c.txt").write_bytes(bom + b"First doc. Second sentence.\n\nNext doc. More text.\n")
    texts = [d["text"] for d in docs]
    assert list(read_documents(str(tmp_path / "a.jsonl"))) == texts
    assert list(read_documents(str(tmp_path / "b.json"))) == texts
    assert list(read_documents(str(tmp_path / "c.txt"))) == ["First doc. Second sentence.\n", "Next doc. More text.\n"]


def test_a_utf16_txt_file_reads_as_its_utf8_self_and_utf16_json_is_refused_by_name(samples_dir, tmp_path):
    """Windows Notepad saves "Unicode" as UTF-16 LE with a byte-order mark and CRLF line ends."""
    news = samples_dir / "news/lee.txt"
    notepad = news.read_text(encoding="utf-8").replace("\n", "\r\n")
    (tmp_path / "le.txt").write_bytes(notepad.encode("utf-16"))  # byte-order mark + this machine's order (LE)
    (tmp_path / "be.txt.gz").write_bytes(gzip.compress(b"\xfe\xff" + notepad.encode("utf-16-be")))
    expected = [document.replace("\n", "\r\n") for document in read_documents(str(news))]
    for name in ("le.txt", "be.txt.gz"):
        records = list(read_documents(str(tmp_path / name)))
        assert records == expected and len(records) == 300, name
        assert not any(isinstance(r, RepairedText) for r in records), name
    rows = list(read_documents(str(tmp_path / "le.txt"), ReadOptions(rows_as_sentences=True)))
    assert [r.replace("\r", "") for r in rows] == list(read_documents(str(news), ReadOptions(rows_as_sentences=True)))
    docs = [{"text": "Première ligne. Deuxième phrase."}]
    (tmp_path / "a.jsonl").write_bytes("\n".join(json.dumps(r, ensure_ascii=False) for r in docs).encode("utf-16"))
    (tmp_path / "b.json").write_bytes(json.dumps(docs, ensure_ascii=False).encode("utf-16"))
    for name in ("a.jsonl", "b.json"):
        with pytest.raises(SourceError, match=rf"{name}: a UTF-16 file .*re-encode it \(iconv -f UTF-16 -t UTF-8"):
            list(read_documents(str(tmp_path / name)))


def test_a_record_whose_text_is_not_a_string_says_what_it_is(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": null}\n{"body": "x"}\n{"text": 3}\n{"text": ["a"]}\n[1]\n')
    records = list(read_documents(str(tmp_path / "a.jsonl")))
    assert [(r.reason, r.where.split(" ", 1)[1]) for r in records] == [
        ("text_not_a_string", "('text' is null, not a string)"),
        ("missing_text_field", "(no 'text'; fields: ['body']; pick one with --text-field NAME)"),
        ("text_not_a_string", "('text' is a number, not a string)"),
        ("text_not_a_string", "('text' is an array, not a string)"),
        ("not_an_object", "(an array, not an object)")]


def test_old_mac_line_ends_separate_lines_and_documents(tmp_path):
    (tmp_path / "mac.txt").write_bytes(b"First doc. Line two.\rStill first.\r\rSecond doc. More.\r\r\rThird. End.\r")
    records = list(read_documents(str(tmp_path / "mac.txt")))
    assert records == ["First doc. Line two.\rStill first.\r", "Second doc. More.\r", "Third. End.\r"]
    rows = list(read_documents(str(tmp_path / "mac.txt"), ReadOptions(rows_as_sentences=True, rows_per_document=10)))
    assert rows[0].split("\n\n") == ["First doc. Line two.", "Still first."]
