"""Which vocabulary and casing a `--vocab` / model directory means, decided once (`data_prep.vocab`) for shard
building, fine-tuning and `model.init_from`: real HF layouts (transformers 5 saves tokenizer.json alone), a bare
vocab.txt, a shard directory; the exported tokenizer config HF truncates by."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from data_prep.vocab import (
    VocabError,
    load_vocab,
    resolve_casing,
    resolve_vocab_source,
    vocab_is_uncased,
    write_hf_tokenizer,
)
from finetune.tokenizer import load_tokenizer
from pretrain.setup_checks import check_init_vocabulary


def casing(path) -> bool:
    return resolve_casing(resolve_vocab_source(path), None)


def test_a_real_uncased_vocabulary_is_uncased_without_its_config(minilm_dir, vocab_file, tmp_path):
    """bert-base-uncased's vocabulary (MiniLM's) holds 'ℝ', upper-case with no lower-case form: it does not make
    the vocabulary cased. Beside its tokenizer_config.json or alone, it lowercases in both shard building and
    fine-tuning; a cased vocabulary stays cased."""
    tokens = load_vocab(minilm_dir / "vocab.txt").tokens
    assert "ℝ" in tokens and vocab_is_uncased(tokens)
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(minilm_dir / "vocab.txt", bare / "vocab.txt")
    for path in (minilm_dir, minilm_dir / "vocab.txt", bare, bare / "vocab.txt"):
        assert casing(path) is True, path
        tokenizer = load_tokenizer(path)
        assert tokenizer.lowercase and tokenizer.unk_id not in tokenizer.encode("Prime Minister Tony Blair")
    assert casing(vocab_file) is False and not load_tokenizer(vocab_file).lowercase
    assert resolve_casing(resolve_vocab_source(bare / "vocab.txt"), False) is False  # a flag decides if nothing states


def test_a_shard_directory_states_its_casing(minilm_dir, tmp_path):
    """`--vocab SHARDS/vocab.txt` (fine-tuning a pre-training checkpoint) follows the shards' manifest."""
    shards = tmp_path / "shards"
    shards.mkdir()
    shutil.copy(minilm_dir / "vocab.txt", shards / "vocab.txt")
    (shards / "manifest.json").write_text(json.dumps({"vocab": {"file": "vocab.txt", "uncased": False}}))
    assert casing(shards / "vocab.txt") is False and not load_tokenizer(shards / "vocab.txt").lowercase
    assert casing(shards) is False


def test_transformers_5_tokenizer_directory_fine_tunes_and_exports_a_vocab_txt(minilm_dir, tmp_path):
    """transformers 5 saves a BERT tokenizer as tokenizer.json + tokenizer_config.json, no vocab.txt (4.x also wrote
    a vocab.txt; it is removed here to make the same directory)."""
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(str(minilm_dir))
    hf.save_pretrained(str(tmp_path / "saved"))
    (tmp_path / "saved" / "vocab.txt").unlink(missing_ok=True)
    assert {p.name for p in (tmp_path / "saved").iterdir()} >= {"tokenizer.json", "tokenizer_config.json"}
    tokenizer = load_tokenizer(tmp_path / "saved")
    text = "Prime Minister Tony Blair's café, 北京 and naïve résumés."
    assert tokenizer.encode(text) == hf(text, add_special_tokens=False)["input_ids"]
    write_hf_tokenizer(tokenizer.vocab, tokenizer.lowercase, tmp_path / "out", model_max_length=512)
    assert (tmp_path / "out" / "vocab.txt").read_bytes() == (minilm_dir / "vocab.txt").read_bytes()


def test_a_tokenizer_with_added_tokens_is_refused_naming_them(minilm_dir, tmp_path):
    """``tokenizer.add_tokens`` puts tokens beyond the WordPiece vocabulary; an encoder of the vocabulary alone would
    split them into word pieces, so such a tokenizer is refused wherever it is read, in every layout transformers
    writes. Its own special tokens, added tokens at their vocabulary ids, pass."""
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(str(minilm_dir))
    assert load_tokenizer(minilm_dir).encode("covid19") != []  # MiniLM's tokenizer.json lists its specials as added
    hf.add_tokens(["covid19", "brexit2020"])
    hf.save_pretrained(str(tmp_path / "added"))
    (tmp_path / "json_only").mkdir()
    shutil.copy(tmp_path / "added" / "tokenizer.json", tmp_path / "json_only" / "tokenizer.json")
    (tmp_path / "slow").mkdir()  # a slow tokenizer's layout: vocab.txt + added_tokens.json
    shutil.copy(minilm_dir / "vocab.txt", tmp_path / "slow" / "vocab.txt")
    (tmp_path / "slow" / "added_tokens.json").write_text(json.dumps({"covid19": 30522, "brexit2020": 30523}))
    for path in (tmp_path / "added", tmp_path / "json_only", tmp_path / "json_only" / "tokenizer.json",
                 tmp_path / "slow", tmp_path / "slow" / "vocab.txt"):
        with pytest.raises(VocabError, match=r"adds 2 token\(s\) its 30522-entry WordPiece vocabulary lacks: "
                                             r"'covid19' \(id 30522\), 'brexit2020' \(id 30523\)"):
            load_tokenizer(path)
    with pytest.raises(SystemExit, match="added_tokens.json: the tokenizer adds 2"):
        from data_prep import build
        build.main(["--input", str(tmp_path / "slow" / "vocab.txt"), "--vocab", str(tmp_path / "slow"),
                    "--out", str(tmp_path / "shards"), "--quiet"])
    assert not (tmp_path / "shards").exists() and not (tmp_path / ".shards.partial").exists()


def test_exported_tokenizer_truncates_to_the_model_positions(minilm_dir, tmp_path):
    from transformers import AutoTokenizer
    write_hf_tokenizer(minilm_dir / "vocab.txt", True, tmp_path, model_max_length=64)
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    assert hf.model_max_length == 64 and len(hf("word " * 200, truncation=True)["input_ids"]) == 64


def test_tokenizer_configs_this_encoder_cannot_follow_are_refused(minilm_dir, tmp_path):
    shutil.copy(minilm_dir / "vocab.txt", tmp_path / "vocab.txt")
    for settings, named in (({"do_lower_case": True, "strip_accents": False}, "strip_accents"),
                            ({"do_lower_case": True, "tokenize_chinese_chars": False}, "tokenize_chinese_chars")):
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(settings))
        for reader in (resolve_vocab_source, load_tokenizer):
            with pytest.raises(VocabError, match=named):
                reader(tmp_path)


def shards_with(vocab: Path, uncased: bool, tmp_path: Path) -> SimpleNamespace:
    directory = tmp_path / "shards"
    directory.mkdir(exist_ok=True)
    shutil.copy(vocab, directory / "vocab.txt")
    return SimpleNamespace(directory=directory, manifest={"vocab": {"file": "vocab.txt", "uncased": uncased}})


def test_init_from_refuses_shards_of_another_vocabulary_or_casing(minilm_dir, vocab_file, tmp_path):
    check_init_vocabulary(shards_with(minilm_dir / "vocab.txt", True, tmp_path), str(minilm_dir))  # its own: fine
    with pytest.raises(ValueError, match=r"another vocabulary than model.init_from .*ids name other word pieces "
                                         r"\(id 1: '\[UNK\]' in the shards.*--vocab .*model.check_init_vocab=false"):
        check_init_vocabulary(shards_with(vocab_file, False, tmp_path), str(minilm_dir))
    with pytest.raises(ValueError, match="tokenized cased, but model.init_from .* is uncased"):
        check_init_vocabulary(shards_with(minilm_dir / "vocab.txt", False, tmp_path), str(minilm_dir))
    extended = tmp_path / "extended.txt"  # the model's pieces first, new ones after: its ids keep their meaning
    extended.write_text((minilm_dir / "vocab.txt").read_text(encoding="utf-8") + "[NEW1]\n[NEW2]\n", encoding="utf-8")
    check_init_vocabulary(shards_with(extended, True, tmp_path), str(minilm_dir))
    reports = []
    no_vocab = tmp_path / "weights-only"
    no_vocab.mkdir()
    check_init_vocabulary(shards_with(vocab_file, False, tmp_path), str(no_vocab), report=reports.append)
    assert "cannot check" in reports[0]
