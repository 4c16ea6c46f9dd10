"""Vocab validation, casing, training, and special tokens that text cannot inject."""
from __future__ import annotations

import pytest

from data_prep import build
from data_prep.vocab import VocabError, load_encoder, load_vocab, train_vocab
from shard_builds import build_error

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def _write(tmp_path, lines, name="vocab.txt") -> str:
    path = tmp_path / name
    path.write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
    return str(path)


def test_real_uncased_bert_vocab(minilm_dir):
    vocab = load_vocab(minilm_dir / "vocab.txt")
    assert vocab.size == 30522
    assert vocab.special_ids == {"pad": 0, "unk": 100, "cls": 101, "sep": 102, "mask": 103}


@pytest.mark.parametrize("lines, message", [
    ([], "empty"),
    (SPECIALS + ["the", "the"], "line 7 repeats 'the' \\(first at line 6\\)"),
    (["[PAD]", "[UNK]", "[CLS]", "the"], "missing special token\\(s\\) \\['\\[SEP\\]', '\\[MASK\\]'\\]"),
    (SPECIALS + ["", "x"], "line 6 is blank"),
])
def test_malformed_vocab_is_named(tmp_path, lines, message):
    with pytest.raises(VocabError, match=rf"vocab .*vocab.txt: {message}"):
        load_vocab(_write(tmp_path, lines))


def test_a_byte_order_mark_is_named(tmp_path):
    path = tmp_path / "vocab.txt"
    path.write_text("\ufeff" + "\n".join(SPECIALS + ["the"]) + "\n", encoding="utf-8")
    with pytest.raises(VocabError, match="starts with a UTF-8 byte-order mark .* without a BOM"):
        load_vocab(path)


def test_missing_and_binary_vocab(tmp_path):
    with pytest.raises(VocabError, match="nope.txt: file not found.*--train-vocab"):
        load_vocab(tmp_path / "nope.txt")
    (tmp_path / "bin.txt").write_bytes(b"[PAD]\n[UNK]\n\xff\xfe\x00\n")
    with pytest.raises(VocabError, match="bin.txt: line 3 is not UTF-8"):
        load_vocab(tmp_path / "bin.txt")


def test_cased_by_default_uncased_on_request(tmp_path):
    path = _write(tmp_path, SPECIALS + ["Hello", "hello", "cafe", "café", "world", "!", "##s"])
    vocab = load_vocab(path)
    cased = load_encoder(path, vocab.sha256, False)
    uncased = load_encoder(path, vocab.sha256, True)
    assert cased.encode("Hello café worlds!", add_special_tokens=False).tokens == ["Hello", "café", "world", "##s", "!"]
    assert uncased.encode("Hello Café", add_special_tokens=False).tokens == ["hello", "cafe"]


def test_literal_special_token_text_stays_ordinary_text(vocab_file):
    vocab = load_vocab(vocab_file)
    tokenizer = load_encoder(str(vocab_file), vocab.sha256, False)
    ids = tokenizer.encode("Before [SEP] and [MASK] or [CLS] [PAD] after", add_special_tokens=False).ids
    assert not set(ids) & {vocab.special_ids[k] for k in ("pad", "cls", "sep", "mask")}


def test_train_vocab_writes_a_valid_cased_vocab(tmp_path, samples_dir):
    text = (samples_dir / "news/lee.txt").read_text().split("\n\n")
    vocab = train_vocab(lambda: iter(text), 600, tmp_path / "v" / "vocab.txt", uncased=False)
    assert vocab.size == 600 and vocab.tokens[:5] == tuple(SPECIALS)
    assert "The" in vocab.tokens  # cased
    with pytest.raises(VocabError, match="too small"):
        train_vocab(lambda: iter(text), 10, tmp_path / "small.txt", uncased=False)


def test_training_a_vocab_twice_gives_the_same_file(tmp_path, samples_dir):
    """The trainer numbers the continuing pieces it meets in hash-map order, which differs between processes (and
    with it the choice between merges of equal counts): each training runs in a process of its own."""
    import subprocess
    import sys

    from conftest import ROOT, subprocess_env
    script = ("import sys; from pathlib import Path; from data_prep.build import training_documents; "
              "from data_prep.vocab import train_vocab; "
              f"train_vocab(lambda: training_documents([{str(samples_dir / 'news/lee.txt')!r}]), 2000, "
              "Path(sys.argv[1]), uncased=sys.argv[2] == 'uncased')")
    for casing in ("cased", "uncased"):
        files = [tmp_path / casing / str(run) / "vocab.txt" for run in range(3)]
        for path in files:
            subprocess.run([sys.executable, "-c", script, str(path), casing], check=True, cwd=ROOT,
                           env=subprocess_env(), timeout=300)
        assert len({path.read_bytes() for path in files}) == 1
        tokens = files[0].read_text().split("\n")
        assert len(tokens) == 2001 and "##s" in tokens and "##." not in tokens  # punctuation never continues


def test_training_on_inputs_without_text_is_refused_before_writing(tmp_path):
    """Records without the text field give no text: the vocab training refuses them as the shard build does, naming
    the fields the records have and --text-field, and leaves nothing at --vocab-out."""
    corpus = tmp_path / "body.jsonl"
    corpus.write_text('{"body": "Hello world. This is a test."}\n{"body": "Another document. With two sentences."}\n')
    vocab = tmp_path / "v" / "vocab.txt"
    error = build_error("--input", corpus, "--train-vocab", 100, "--vocab-out", vocab)
    assert f"no text to train a vocabulary on from ['{corpus}']: 2 documents read, 2 skipped" in error
    assert "missing_text_field" in error and "fields: ['body']" in error and "--text-field NAME" in error
    assert not vocab.parent.exists()
    build.main(["--input", str(corpus), "--train-vocab", "100", "--vocab-out", str(vocab), "--text-field", "body"])
    assert "Hello" in load_vocab(vocab).tokens
