"""Every input kind reads real or crafted documents; unusable records are counted skips, unusable inputs errors."""
from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data_prep.sources import SourceError, Skipped, read_documents


def _reasons(records) -> list[str]:
    return [r.reason for r in records if isinstance(r, Skipped)]


def test_txt_blank_line_separated_news(samples_dir):
    records = list(read_documents(str(samples_dir / "news/lee.txt")))
    assert len(records) == 300 and all(isinstance(r, str) for r in records)
    assert records[0].startswith("Hundreds of people have been forced")


def test_jsonl_books(samples_dir):
    records = list(read_documents(str(samples_dir / "books.jsonl")))
    assert len(records) == 42 and all(isinstance(r, str) and len(r) > 1_000 for r in records)


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


def test_txt_with_non_utf8_document_is_skipped(tmp_path):
    path = tmp_path / "a.txt"
    path.write_bytes(b"Good one. Two.\n\nBad \xff\xfe bytes.\n\n\n\nLast doc.\r\n")
    records = list(read_documents(str(path)))
    assert records[0] == "Good one. Two.\n" and _reasons(records) == ["invalid_utf8"] and records[2] == "Last doc.\r\n"
    assert records[1].where == f"{path}:3"


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
    with pytest.raises(SourceError, match="could not load Hugging Face dataset 'no-such/dataset-xyz'.*split 'validation'"):
        list(read_documents("no-such/dataset-xyz:default:validation"))


def test_missing_file_unknown_suffix_and_broken_dump(tmp_path):
    with pytest.raises(SourceError, match="missing.jsonl: file not found"):
        list(read_documents(str(tmp_path / "missing.jsonl")))
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(SourceError, match="x.csv: unsupported file type"):
        list(read_documents(str(tmp_path / "x.csv")))
    (tmp_path / "dump.xml").write_text("<mediawiki><page><title>A</title><ns>0</ns><revision><text>Hi")
    with pytest.raises(SourceError, match="dump.xml: not a readable Wikipedia XML dump"):
        list(read_documents(str(tmp_path / "dump.xml")))
