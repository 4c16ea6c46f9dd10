"""Hostile corpora: random bytes, huge lines, deep wiki markup, mixed encodings, NULs, empty and broken
files in every input format. The build completes, counts every skip, and every shard it writes is valid.

A whole-document input that cannot be parsed at all (a truncated or malformed ``.xml``/``.xml.bz2`` dump, a
broken ``.json`` array) is refused as a whole with a ``SourceError`` naming the file, by design
(``data_prep.sources``): training on the first half of a dump should not pass as a finished build.
"""
from __future__ import annotations

import bz2
import codecs
import json
import re
import shutil
import tempfile
from pathlib import Path
from xml.sax.saxutils import escape

import numpy as np
import pytest
from hypothesis import HealthCheck, event, example, given, settings, strategies as st

from common.files import sha256_file
from data_prep.build import build
from data_prep.config import BuildConfig
from data_prep.instances import InstanceConfig, MaskingConfig, masking_budget
from data_prep.records import Skipped, SourceError
from data_prep.shard_format import MANIFEST_NAME, Objective, ShardArrays, ShardDataset, ShardFile, write_shard
from data_prep.sources import read_documents
from data_prep.vocab import load_vocab
from data_prep.wikitext import wikitext_to_text


def assert_valid_build(out: Path) -> dict:
    """Every shard verifies and every sample keeps the format's invariants (vectorised per shard); returns the manifest.

    Samples lie back to back; each is ``[CLS] A [SEP] (B [SEP])`` within max_seq_len, its layout fits its objective;
    masked positions ascend, avoid [CLS]/[SEP] and number exactly the masking budget; putting the labels back
    gives text without special tokens; shown tokens are [MASK], the label (kept) or a random non-special id.
    """
    ds = ShardDataset(out)
    ds.verify()
    manifest = ds.manifest
    special = ds.special_tokens
    structural_ids = [special[k] for k in ("pad", "cls", "sep", "mask")]
    masking = manifest["masking"]
    shown_mask = shown_label = total_masked = 0
    for shard in ds.shards:
        index = np.asarray(shard.arrays.index)
        tokens = np.asarray(shard.arrays.tokens).astype(np.int64)
        positions = np.asarray(shard.arrays.masked_positions).astype(np.int64)
        labels = np.asarray(shard.arrays.masked_labels).astype(np.int64)
        length, len_a = index["length"].astype(np.int64), index["segment_a_length"].astype(np.int64)
        offset, num_masked = index["token_offset"].astype(np.int64), index["num_masked"].astype(np.int64)
        objective, random_next = index["objective"], index["is_random_next"]
        assert shard.token_dtype == np.dtype(manifest["token_dtype"]) and not index["reserved"].any()
        np.testing.assert_array_equal(offset, np.cumsum(length) - length)
        np.testing.assert_array_equal(index["mask_offset"], np.cumsum(num_masked) - num_masked)
        assert length.sum() == len(tokens) and num_masked.sum() == len(positions) == len(labels)
        assert len(tokens) == 0 or tokens.max() < manifest["vocab"]["size"]

        pair = np.isin(objective, [Objective.BIDIRECTIONAL, Objective.SEQ2SEQ])
        assert np.isin(objective, list(Objective)).all()
        assert ((length >= 3) & (length <= manifest["max_seq_len"])).all()
        assert np.array_equal(len_a < length, pair) and ((len_a >= 3) & (len_a <= length - 2))[pair].all()
        nsp = objective == Objective.BIDIRECTIONAL
        assert np.isin(random_next[nsp], [0, 1]).all() and (random_next[~nsp] == -1).all()
        assert (tokens[offset] == special["cls"]).all() and (tokens[offset + len_a - 1] == special["sep"]).all()
        assert (tokens[offset + length - 1] == special["sep"]).all()
        if masking is None:
            assert len(positions) == 0
        else:
            cfg = MaskingConfig(mask_prob=masking["mask_prob"], max_predictions=masking["max_predictions"])
            np.testing.assert_array_equal(num_masked, masking_budget(length - np.where(pair, 3, 2), cfg))
            assert (num_masked >= 1).all()
        sample = np.repeat(np.arange(len(index)), num_masked)
        assert ((positions >= 1) & (positions <= length[sample] - 2) & (positions != len_a[sample] - 1)).all()
        assert (np.diff(positions)[np.diff(sample) == 0] > 0).all()

        structural = np.zeros(len(tokens), bool)
        structural[np.concatenate([offset, offset + len_a - 1, offset + length - 1])] = True
        at = offset[sample] + positions
        original = tokens.copy()
        original[at] = labels
        assert not np.isin(original[~structural], structural_ids).any()  # text never yields special tokens
        unmasked = ~structural
        unmasked[at] = False
        assert not np.isin(tokens[unmasked], structural_ids).any()
        shown = tokens[at]
        assert not np.isin(shown, [special["pad"], special["cls"], special["sep"]]).any()
        shown_mask += int((shown == special["mask"]).sum())
        shown_label += int((shown == labels).sum())
        total_masked += len(positions)
    if total_masked >= 2000:  # the 80/10/10 rule, where there are enough masked tokens to measure it
        assert shown_mask / total_masked == pytest.approx(masking["replace_mask"], abs=0.04)
        assert shown_label / total_masked == pytest.approx(1 - masking["replace_mask"] - masking["replace_random"],
                                                           abs=0.04)
    documents = manifest["documents"]
    assert documents["skipped"] == sum(documents["skip_reasons"].values())
    assert set(documents["skip_examples"]) == set(documents["skip_reasons"])
    return manifest


@pytest.mark.parametrize("tamper", ["mask_on_cls", "sep_inside_text", "id_beyond_vocab", "one_mask_dropped"])
def test_the_invariant_check_catches_invalid_shards(tamper, unilm_shards, tmp_path):
    """``assert_valid_build`` is not vacuous: a shard that is well-formed and hashed but breaks a rule fails it."""
    out = tmp_path / "copy"
    shutil.copytree(unilm_shards, out)
    assert_valid_build(out)
    path, manifest = out / "shard-00000.bin", json.loads((out / MANIFEST_NAME).read_text())
    arrays = ShardFile(path).arrays
    index, tokens, positions, labels = (np.array(x) for x in (arrays.index, arrays.tokens, arrays.masked_positions,
                                                                arrays.masked_labels))
    first_masked = set(positions[:index["num_masked"][0]].tolist())
    if tamper == "mask_on_cls":
        positions[0] = 0
    elif tamper == "sep_inside_text":
        tokens[next(p for p in range(1, index["length"][0] - 1) if p not in first_masked)] = \
            manifest["vocab"]["special_tokens"]["sep"]
    elif tamper == "id_beyond_vocab":
        tokens[1] = manifest["vocab"]["size"]
    else:
        last = int(index["num_masked"][0]) - 1
        positions, labels = np.delete(positions, last), np.delete(labels, last)
        index["num_masked"][0] -= 1
        index["mask_offset"][1:] -= 1
    write_shard(path, ShardArrays(index, tokens, positions, labels))
    entry = manifest["shards"][0]
    entry.update(bytes=path.stat().st_size, sha256=sha256_file(path))
    (out / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(AssertionError):
        assert_valid_build(out)


def expected_counts(inputs: list[Path]) -> tuple[int, dict[str, int]]:
    """Records the readers yield for these inputs and the source-level skips among them."""
    read, reasons = 0, {}
    for path in inputs:
        for record in read_documents(str(path)):
            read += 1
            if isinstance(record, Skipped):
                reasons[record.reason] = reasons.get(record.reason, 0) + 1
    return read, reasons


@pytest.fixture(scope="module")
def good_txt(samples_dir, tmp_path_factory) -> Path:
    """Twelve real news articles: every build has samples, so the hostile file's share can be checked."""
    path = tmp_path_factory.mktemp("good") / "good.txt"
    path.write_text("\n\n".join((samples_dir / "news/lee.txt").read_text().split("\n\n")[:12]) + "\n")
    return path


def run_build(inputs: list[Path], vocab: Path, out: Path, recipe: str = "unilm", max_seq_len: int = 64) -> dict:
    cfg = BuildConfig(inputs=tuple(str(p) for p in inputs), vocab_path=str(vocab),
                      vocab_sha256=load_vocab(vocab).sha256,
                      instances=InstanceConfig(recipe=recipe, max_seq_len=max_seq_len),
                      samples_per_shard=150, chunk_chars=50_000)
    return build(cfg, out, progress=False)


# --- deterministic hostile cases --------------------------------------------------------------------------------

LOREM = "Lorem ipsum dolor sit amet, consectetur adipiscing elit. "
PROSE = "The river rose in the spring. Farmers moved their herds to the hills. The water fell in May. "


def wiki_dump(pages: list[tuple[str, str, str]]) -> bytes:
    """A minimal pages-articles dump of (title, ns, wikitext) pages."""
    body = "".join(f"<page><title>{escape(t)}</title><ns>{ns}</ns><revision><text>{escape(text)}</text></revision>"
                   f"</page>\n" for t, ns, text in pages)
    return f'<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/">\n{body}</mediawiki>\n'.encode()


def _jsonl_lines(*lines: bytes) -> bytes:
    return b"\n".join(lines) + b"\n"


# name -> (file name, bytes, skip reasons the hostile file must add to the manifest)
HOSTILE_FILES: dict[str, tuple[str, bytes, dict[str, int]]] = {
    "random_bytes": ("noise.txt", np.random.default_rng(0).bytes(300_000), {}),  # reasons checked by count
    "huge_line_5mb": ("huge.txt", (LOREM * 90_000).encode(), {}),
    "huge_line_no_spaces": ("blob.txt", b"x" * 3_000_000 + b". Then a sentence. And another one.", {}),
    "nuls_and_controls": ("ctrl.txt", b"\x00\x01Ctrl\x07 chars\x1b[31m. Second\x00 sentence.\x7f\x85 Third.\n\n"
                          + b"\x00" * 5000 + b"\n\n\x0c\x0b\r\r\r\n\n" + (PROSE.encode() + b"\x00") * 3, {}),
    "latin1_cp1252_in_utf8": ("mixed.txt", PROSE.encode() + b"\n\ncaf\xe9 na\xefve \x93quoted\x94. Second one.\n\n"
                              + PROSE.encode(), {}),  # bad bytes become U+FFFD: documents.repaired_lines
    "utf16_with_bom": ("utf16.txt", PROSE.encode("utf-16"), {}),
    "utf16le_ascii_is_nul_soup": ("utf16le.txt", PROSE.encode("utf-16-le"), {}),
    "empty_txt": ("empty.txt", b"", {}),
    "blank_lines_only": ("blank.txt", b"\n\n  \n\t\n\r\n" * 1000, {}),
    "empty_jsonl": ("empty.jsonl", b"", {}),
    "empty_json": ("empty.json", b"", {}),
    "bad_jsonl": ("bad.jsonl", _jsonl_lines(
        json.dumps({"text": PROSE}).encode(),
        b'{"text": "unterminated', b"{not json}", b"\xff\xfe{\"text\": \"x\"}", b'{"title": "no text"}',
        b'{"text": null}', b'{"text": 5}', b'{"text": ["a", "b"]}', b'{"text": {"nested": "x"}}', b"[1, 2, 3]",
        b'"just a string"', b"42", b'{"text": "lone \\ud800 surrogate. Second \\udfff sentence here. Third."}',
        b'{"text": "NUL \\u0000 inside. Second sentence."}', b'{"text": ""}', b"\x00\x00\x00",
        json.dumps({"text": LOREM * 18_000}).encode()), {  # a 1 MB line (the .txt case has 5 MB)
        "invalid_utf8": 1, "malformed_json": 3, "missing_text_field": 1, "text_not_a_string": 4,
        "not_an_object": 3, "empty": 1}),
    "json_array_with_bad_records": ("array.json", json.dumps(
        [{"text": PROSE}, {"text": 3}, {"no": "text"}, "string", None, {"text": "\x00\x00"}]).encode(),
        {"text_not_a_string": 1, "missing_text_field": 1, "not_an_object": 2, "empty": 1}),
    "wiki_deep_and_unbalanced": ("wiki.xml", wiki_dump([
        ("Deep", "0", "{{" * 200_000 + "x" + "}}" * 200_000 + PROSE),
        ("Unterminated", "0", PROSE + "{{Infobox | a = [[b|c " + PROSE + "{| class=x\n| cell\n" + PROSE),
        ("Refs", "0", ("<ref>" + PROSE) * 2000 + "<ref name=a " * 2000 + PROSE),
        ("Soup", "0", "{{[[<ref>{|[http://a <!-- " * 40_000),
        ("Links", "0", "[[a|" * 100_000 + PROSE + "]]" * 100_000 + "[http://x.org " * 50_000 + PROSE),
        ("Bad namespace", "abc", PROSE), ("Talk", "1", PROSE), ("Empty", "0", ""),
    ]), {"wiki_not_an_article": 2}),
}


@pytest.mark.timeout(300)  # the old wikitext regexes took hours on the wiki case (quadratic in the page size)
@pytest.mark.parametrize("name", sorted(HOSTILE_FILES))
def test_hostile_file_builds_with_counted_skips(name, good_txt, vocab_file, tmp_path):
    file_name, data, reasons = HOSTILE_FILES[name]
    hostile = tmp_path / file_name
    hostile.write_bytes(data)
    read, source_skips = expected_counts([good_txt, hostile])
    out = tmp_path / "out"
    run_build([good_txt, hostile], vocab_file, out)
    manifest = assert_valid_build(out)
    documents = manifest["documents"]
    assert documents["read"] == read  # every record counted once: kept, or skipped with a reason
    for reason, count in {**source_skips, **reasons}.items():
        assert documents["skip_reasons"].get(reason) == count, (reason, documents["skip_reasons"])
    assert not list(out.glob("*.tmp*")) and not (out / "parts").exists()
    if name == "huge_line_5mb":
        assert manifest["num_samples"] > 1000  # the line became many bounded samples, not one or none


@pytest.mark.parametrize("name, data", [
    ("truncated.xml", wiki_dump([("A", "0", PROSE)] * 3)[:-40]),
    ("truncated.xml.bz2", bz2.compress(wiki_dump([("A", "0", PROSE)] * 50))[:-30]),
    ("garbage.xml.bz2", b"BZh91AY&SY" + np.random.default_rng(1).bytes(2000)),
    ("not_bz2.xml.bz2", wiki_dump([("A", "0", PROSE)])),
    ("empty.xml", b""),
    ("binary.xml", np.random.default_rng(2).bytes(5000)),
    ("control_chars.xml", wiki_dump([("A", "0", PROSE)]).replace(b"The river", b"The \x00\x01 river")),
    ("broken_array.json", b'[{"text": "a"}, {"text": '),
    ("latin1_array.json", b'[{"text": "caf\xe9"}]'),
])
def test_unparseable_whole_document_input_is_refused_by_name(name, data, good_txt, vocab_file, tmp_path):
    hostile = tmp_path / name
    hostile.write_bytes(data)
    with pytest.raises(SourceError, match=re.escape(f"--input {hostile}: not ")):
        run_build([good_txt, hostile], vocab_file, tmp_path / "out")
    assert not (tmp_path / "out/manifest.json").exists() and not list((tmp_path / "out").glob("shard-*.bin"))


# --- property-based: hypothesis writes the hostile files ----------------------------------------------------------

MARKUP = ["{{", "}}", "{{{", "}}}", "[[", "]]", "[", "]", "{|", "|}", "|-", "|", "||", "!", "<ref>", "</ref>",
          '<ref name="a"/>', "<ref name=a ", "<!--", "-->", "[http://example.org ", "[//x.org]", "'''", "''",
          "== H ==", "\n", "\n\n", "File:", "Category:", "fr:", "&amp;", "&#0;", "&lt;ref&gt;", "<math>", "</math>",
          "<nowiki>", "<b>", "<", ">", "__TOC__", "* ", "# ", ":", "\x00", "\u200b", "\ufeff",
          "The river rose. ", "Then it fell again. ", "Mr. Smith said so! ", "Über naïve façade. "]
wiki_markup = st.lists(st.sampled_from(MARKUP), max_size=300).map("".join)
encoded_text = st.tuples(st.text(max_size=300), st.sampled_from(["utf-8", "latin-1", "cp1252", "utf-16", "utf-16-le"])
                         ).map(lambda t: t[0].encode(t[1], errors="replace"))
hostile_bytes = st.one_of(
    st.binary(max_size=400),
    encoded_text,
    wiki_markup.map(str.encode),
    st.sampled_from([b"", b"\x00" * 300, b"\n\n\n", b"\r\r\r\r", b"\xef\xbb\xbf", b"\xff\xfe", b"a" * 20_000,
                     ("Word " * 4000).encode(), (PROSE * 20).encode()]),
)
WIDE_BOMS = (codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE, codecs.BOM_UTF32_LE, codecs.BOM_UTF32_BE)
JSONL_KINDS = ["text", "text_ascii", "raw", "missing_text", "non_string", "not_object"]


def _jsonl_line(kind: str, chunk: bytes) -> bytes:
    text = chunk.decode("utf-8", errors="replace")
    if kind in ("text", "text_ascii"):
        return json.dumps({"text": text}, ensure_ascii=kind == "text_ascii").encode()
    if kind == "raw":
        return chunk.replace(b"\n", b" ")
    if kind == "missing_text":
        return json.dumps({"body": text}).encode()
    if kind == "non_string":
        return json.dumps({"text": [text, len(chunk)]}).encode()
    return json.dumps([text]).encode()


def _xml_safe(text: str) -> str:
    """Drop the characters XML 1.0 forbids, so the page reaches the wikitext code instead of the parser's error."""
    return "".join(c for c in text if c in "\t\n\r" or "\x20" <= c <= "\ud7ff" or "\ue000" <= c <= "\ufffd"
                   or c >= "\U00010000")


@st.composite
def hostile_corpus(draw) -> tuple[str, bytes]:
    """(file name, bytes) of one hostile input file in a drawn format."""
    fmt = draw(st.sampled_from(["txt", "jsonl", "xml", "xml.bz2"]))
    chunks = draw(st.lists(hostile_bytes, min_size=1, max_size=8))
    if fmt == "txt":
        return "hostile.txt", b"\n\n".join(chunks)
    if fmt == "jsonl":
        kinds = draw(st.lists(st.sampled_from(JSONL_KINDS), min_size=len(chunks), max_size=len(chunks)))
        return "hostile.jsonl", b"\n".join(_jsonl_line(k, c) for k, c in zip(kinds, chunks))
    pages = [(f"P{i}", draw(st.sampled_from(["0", "0", "1", "x", ""])),
              _xml_safe(draw(wiki_markup) + chunk.decode("utf-8", errors="replace"))) for i, chunk in enumerate(chunks)]
    data = wiki_dump(pages)
    if draw(st.sampled_from([False, False, True])):  # sometimes truncated: then refused as a whole, by name
        data = data[:draw(st.integers(0, len(data) - 1))]
    return f"hostile.{fmt}", bz2.compress(data) if fmt == "xml.bz2" else data


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(corpus=hostile_corpus(), recipe=st.sampled_from(["unilm", "bert", "gpt"]),
       max_seq_len=st.sampled_from([8, 13, 64]))
@example(corpus=("hostile.jsonl", b"\xfe\xff"), recipe="unilm", max_seq_len=8)
@example(corpus=("hostile.txt", b"\xff\xfe\x00\x00\xff\xff\xff\xff\n\n\xff\xfe"), recipe="bert", max_seq_len=13)
def test_fuzzed_corpus_builds_valid_shards_or_is_refused_by_name(good_txt, vocab_file, corpus, recipe, max_seq_len):
    file_name, data = corpus
    with tempfile.TemporaryDirectory() as tmp:
        hostile = Path(tmp) / file_name
        hostile.write_bytes(data)
        try:
            run_build([good_txt, hostile], vocab_file, Path(tmp) / "out", recipe, max_seq_len)
        except SourceError as err:  # only a whole-document format or a JSON file in UTF-16/32, and only by name
            if file_name.endswith(".jsonl") and data.startswith(WIDE_BOMS):
                assert f"--input {hostile}: a UTF-" in str(err) and "iconv -f UTF-" in str(err)
            else:
                assert file_name.endswith((".xml", ".xml.bz2")) and f"--input {hostile}: not " in str(err)
            event(f"{file_name}: refused as a whole")
            return
        manifest = assert_valid_build(Path(tmp) / "out")
        event(f"{file_name}: built")
        read, source_skips = expected_counts([good_txt, hostile])
        assert manifest["documents"]["read"] == read
        for reason, count in source_skips.items():
            assert manifest["documents"]["skip_reasons"][reason] == count


@settings(max_examples=150, deadline=None)
@given(wiki_markup)
def test_wikitext_never_fails_and_leaves_no_tags_or_lists(wikitext):
    text = wikitext_to_text(wikitext)
    for paragraph in text.split("\n\n") if text else []:
        assert paragraph and paragraph == paragraph.strip()
        assert not paragraph.startswith(("=", "*", "#", ":", ";", "!", "|", "{", "}", "----"))
