"""Exports carry their tokenizer: `transformers.AutoTokenizer` on an export tokenizes exactly as the shards were
tokenized (a cased vocabulary, where a default BERT tokenizer would lowercase)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from data_prep.shard_format import ShardDataset
from data_prep.sources import read_documents
from data_prep.vocab import load_encoder, load_vocab
from finetune.model_io import save_finetuned
from finetune.tokenizer import load_tokenizer as load_finetune_tokenizer
from pretrain import checkpoint as ckpt
from pretrain.export import shard_vocabulary
from pretrain.model import ModelConfig, build_model


def real_text(samples_dir: Path) -> list[str]:
    wiki = [d for _, d in zip(range(30), read_documents(str(samples_dir / "wiki/enwiki-excerpt.xml.bz2")))
            if isinstance(d, str)]
    news = (samples_dir / "news/lee.txt").read_text().split("\n\n")[:100]
    return [t for t in wiki + news if t.strip()] + ["Café Müller in ZÜRICH said \u4e2d\u6587 naïve résumé."]


def assert_same_ids(export_dir: Path, shards: Path, texts: list[str]) -> None:
    manifest = ShardDataset(shards).manifest
    vocab = load_vocab(shards / "vocab.txt")
    ours = load_encoder(str(vocab.path), vocab.sha256, manifest["vocab"]["uncased"])
    hf = AutoTokenizer.from_pretrained(export_dir)
    assert hf.do_lower_case is manifest["vocab"]["uncased"] is False
    for text in texts:
        assert hf(text, add_special_tokens=False)["input_ids"] == ours.encode(text, add_special_tokens=False).ids
    assert hf.convert_tokens_to_ids([hf.cls_token, hf.sep_token, hf.mask_token, hf.pad_token, hf.unk_token]) == \
        [manifest["vocab"]["special_tokens"][k] for k in ("cls", "sep", "mask", "pad", "unk")]
    assert json.loads((export_dir / "special_tokens_map.json").read_text())["mask_token"] == "[MASK]"


def fake_checkpoint(directory: Path, shards: Path) -> Path:
    """A checkpoint marker as the trainer writes it (run config and vocab hash; the weights do not matter here)."""
    tag = directory / "global_step1"
    tag.mkdir(parents=True)
    ckpt.write_weights(tag, {"unused": torch.zeros(1)})  # a marker must vouch for at least one file
    ckpt.write_marker(tag, {"run_config": {"data": {"shards": str(shards)}},
                            "vocab_hash": ShardDataset(shards).manifest["vocab"]["sha256"]})
    ckpt.update_latest(directory, "global_step1")
    return directory


def test_export_finds_the_vocabulary_through_the_run_shards(unilm_shards, samples_dir, tmp_path):
    from data_prep.vocab import write_hf_tokenizer

    checkpoints = fake_checkpoint(tmp_path / "checkpoints", unilm_shards)
    vocab, uncased = shard_vocabulary(checkpoints)
    assert vocab == unilm_shards / "vocab.txt" and uncased is False
    write_hf_tokenizer(vocab, uncased, tmp_path / "export")
    assert_same_ids(tmp_path / "export", unilm_shards, real_text(samples_dir))
    hf = AutoTokenizer.from_pretrained(tmp_path / "export")
    assert hf.tokenize("Apple") != hf.tokenize("apple")  # cased: a lowercasing tokenizer would make them equal


def test_export_refuses_shards_with_another_vocabulary(unilm_shards, tmp_path):
    checkpoints = fake_checkpoint(tmp_path / "checkpoints", unilm_shards)
    marker = json.loads((checkpoints / "global_step1" / ckpt.MARKER).read_text())
    marker["vocab_hash"] = "0" * 64
    (checkpoints / "global_step1" / ckpt.MARKER).write_text(json.dumps(marker))
    with pytest.raises(ValueError, match="not the vocabulary the checkpoint .* was trained with"):
        shard_vocabulary(checkpoints)
    with pytest.raises(ValueError, match="no manifest"):
        shard_vocabulary(checkpoints, shards=tmp_path / "moved")


def test_finetuning_output_loads_in_auto_tokenizer(unilm_shards, samples_dir, tmp_path):
    tokenizer = load_finetune_tokenizer(unilm_shards / "vocab.txt")  # the cased vocab: no upper-case-free pieces
    assert tokenizer.lowercase is False
    model = build_model(ModelConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_layers=1, num_heads=4,
                                    intermediate_size=64, max_position_embeddings=64))
    out = save_finetuned(tmp_path / "ft", model, torch.nn.Linear(32, 2), tokenizer, "classify", {})
    assert_same_ids(out, unilm_shards, real_text(samples_dir))
