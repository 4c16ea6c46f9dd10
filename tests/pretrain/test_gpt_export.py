"""A causal LM (`causal_lm`, the gpt preset) exports as transformers' `BertLMHeadModel` (`is_decoder: true`) and
imports back as a causal LM: same next-token logits under the left-to-right mask, the mask really causal in
transformers, every exported tensor back in place."""
from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest
import torch

from data_prep.shard_format import ShardDataset
from pretrain import checkpoint as ckpt
from pretrain.export import main as export_main
from pretrain.hf import check_architecture, load_hf_bert, save_hf_bert
from pretrain.masks import LEFT_TO_RIGHT, SEGMENT_LEFT_TO_RIGHT
from pretrain.model import IGNORE_INDEX, build_model, preset

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


def tiny_gpt(seed: int, vocab_size: int = 1000):
    """A tiny random causal LM in eval mode, its segment rows made clearly different from each other."""
    torch.manual_seed(seed)
    model = build_model(dataclasses.replace(preset("tiny"), vocab_size=vocab_size, causal_lm=True)).eval()
    with torch.no_grad():
        model.embeddings.segment.weight.mul_(torch.arange(1, 7).unsqueeze(1))
    return model


@pytest.fixture(scope="module")
def gpt_batch():
    """Two sequences, the second padded: input ids Long[2, 16], lengths Long[2], key-padding mask Long[2, 16]."""
    torch.manual_seed(0)
    length, max_len = torch.tensor([16, 11]), 16
    input_ids = torch.randint(5, 1000, (2, max_len))
    input_ids[1, 11:] = 0
    return dict(input_ids=input_ids, length=length,
                padding=(torch.arange(max_len) < length.unsqueeze(1)).long())


def our_logits(model, batch) -> torch.Tensor:
    """Float[B, L, vocab]: every position's next-token logits under the left-to-right mask."""
    with torch.no_grad():
        return model.mlm_logits(model.encode_objective(batch["input_ids"], LEFT_TO_RIGHT, batch["length"],
                                                       batch["length"]))


def test_a_causal_lm_exports_as_a_bert_lm_head_model_with_our_next_token_logits(tmp_path, gpt_batch, caplog):
    model = tiny_gpt(1)
    with caplog.at_level(logging.WARNING, logger="pretrain.hf"):
        save_hf_bert(model, tmp_path)
    assert "exported segment row 2" in caplog.text and "bidirectional A/B" not in caplog.text
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["BertLMHeadModel"] and config["is_decoder"] is True
    hf_model, info = transformers.BertLMHeadModel.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    hf_model.eval()
    real = gpt_batch["padding"].bool()
    ours = our_logits(model, gpt_batch)
    with torch.no_grad():
        for token_type in (0, 1):  # both HF types hold the row our causal LM embeds every token with
            theirs = hf_model(input_ids=gpt_batch["input_ids"], attention_mask=gpt_batch["padding"],
                              token_type_ids=torch.full_like(gpt_batch["input_ids"], token_type)).logits
            torch.testing.assert_close(ours[real], theirs[real], atol=1e-5, rtol=0)
        # the same next-token loss: ours shifts inside the model, transformers' inside its loss
        labels = gpt_batch["input_ids"].masked_fill(~real, IGNORE_INDEX)
        theirs = hf_model(input_ids=gpt_batch["input_ids"], attention_mask=gpt_batch["padding"], labels=labels)
        loss = model(input_ids=gpt_batch["input_ids"], objective=torch.full((2,), LEFT_TO_RIGHT),
                     len_a=gpt_batch["length"], length=gpt_batch["length"]).loss
    torch.testing.assert_close(loss, theirs.loss, atol=1e-5, rtol=1e-5)


def test_transformers_runs_the_export_left_to_right(tmp_path, gpt_batch):
    """Changing a later token leaves every earlier position's logits alone, in transformers as in ours."""
    model = tiny_gpt(2)
    save_hf_bert(model, tmp_path)
    hf_model = transformers.BertLMHeadModel.from_pretrained(tmp_path).eval()
    changed = gpt_batch["input_ids"][:1].clone()
    changed[0, 9] = (changed[0, 9] + 1) % 1000
    with torch.no_grad():
        before = hf_model(input_ids=gpt_batch["input_ids"][:1]).logits
        after = hf_model(input_ids=changed).logits
    assert torch.equal(before[0, :9], after[0, :9])
    assert not torch.allclose(before[0, 9:], after[0, 9:])
    ours = our_logits(model, dict(input_ids=changed, length=gpt_batch["length"][:1]))
    torch.testing.assert_close(ours, after, atol=1e-5, rtol=0)


def test_the_exported_causal_lm_imports_back_with_every_tensor(tmp_path, gpt_batch, caplog):
    model = tiny_gpt(3)
    save_hf_bert(model, tmp_path)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pretrain.hf"):
        back = load_hf_bert(tmp_path).eval()
    assert caplog.text == ""  # the pooler and NSP head a causal LM never trains are not reported missing
    assert back.cfg == model.cfg and back.cfg.causal_lm
    ours, theirs = model.state_dict(), back.state_dict()
    for name, tensor in ours.items():
        if name == "embeddings.segment.weight":  # the row it trains, now in every row (it reads row 2)
            assert torch.equal(theirs[name], tensor[SEGMENT_LEFT_TO_RIGHT].expand_as(tensor)), name
        elif not name.startswith(("pooler.", "nsp_head.")):  # not exported: a causal LM never trains them
            assert torch.equal(theirs[name], tensor), name
    assert back.mlm_head.decoder.weight is back.embeddings.token.weight
    real = gpt_batch["padding"].bool()  # a padded position embeds segment row 0, and no output reads it
    assert torch.equal(our_logits(back, gpt_batch)[real], our_logits(model, gpt_batch)[real])


def test_the_encoder_alone_exports_as_a_causal_bert_model(tmp_path, gpt_batch):
    model = tiny_gpt(4)
    save_hf_bert(model, tmp_path, architecture="BertModel")
    hf_model, info = transformers.BertModel.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert hf_model.config.is_decoder
    real = gpt_batch["padding"].bool()
    with torch.no_grad():
        ours = model.encode_objective(gpt_batch["input_ids"], LEFT_TO_RIGHT, gpt_batch["length"], gpt_batch["length"])
        theirs = hf_model.eval()(input_ids=gpt_batch["input_ids"], attention_mask=gpt_batch["padding"])
    torch.testing.assert_close(ours[real], theirs.last_hidden_state[real], atol=1e-5, rtol=0)
    assert load_hf_bert(tmp_path).cfg == model.cfg


@pytest.mark.parametrize("architecture", ["BertForPreTraining", "BertForMaskedLM"])
def test_masked_lm_classes_are_refused_for_a_causal_lm(architecture, tmp_path):
    with pytest.raises(ValueError, match=f"{architecture} is a masked-LM class.*causal LM.*BertLMHeadModel or "
                                         "BertModel"):
        save_hf_bert(tiny_gpt(5), tmp_path / "out", architecture=architecture)
    assert not (tmp_path / "out").exists()


def test_the_decoder_class_is_refused_for_a_masked_lm():
    with pytest.raises(ValueError, match="BertLMHeadModel is a left-to-right decoder.*masked LM"):
        check_architecture(preset("tiny"), "BertLMHeadModel")


def fake_gpt_checkpoint(directory: Path, model, shards: Path) -> Path:
    """A checkpoint as the trainer writes one of a causal LM: weights, model config, run config, vocab hash."""
    tag = directory / "global_step1"
    tag.mkdir(parents=True)
    ckpt.write_weights(tag, model.state_dict())
    ckpt.write_marker(tag, {"model_config": dataclasses.asdict(model.cfg),
                            "run_config": {"data": {"shards": str(shards)}},
                            "vocab_hash": ShardDataset(shards).manifest["vocab"]["sha256"]})
    ckpt.update_latest(directory, "global_step1")
    return directory


def test_export_of_a_gpt_checkpoint_writes_a_decoder_and_refuses_a_masked_lm_class(gpt_shards, tmp_path, capsys):
    model = tiny_gpt(6, vocab_size=ShardDataset(gpt_shards).manifest["vocab"]["size"])
    checkpoints = fake_gpt_checkpoint(tmp_path / "checkpoints", model, gpt_shards)
    export_main([str(checkpoints), str(tmp_path / "hf")])
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["BertLMHeadModel"] and config["is_decoder"] is True
    assert load_hf_bert(tmp_path / "hf").cfg == model.cfg
    with pytest.raises(SystemExit) as exit_info:
        export_main([str(checkpoints), str(tmp_path / "mlm"), "--architecture", "BertForMaskedLM"])
    assert exit_info.value.code == 2
    assert "--architecture: BertForMaskedLM is a masked-LM class" in capsys.readouterr().err
    assert not (tmp_path / "mlm").exists()
