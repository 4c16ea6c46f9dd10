"""Hugging Face BERT weights in and out, with `transformers` as the peer (the real 6-layer MiniLM BERT)."""
from __future__ import annotations

import dataclasses
import json
import logging
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pretrain.data import synthetic_batch
from pretrain.hf import (
    SEGMENT_ROWS_FROM_HF,
    config_from_hf,
    hf_config,
    hf_model_config,
    hf_pretraining_inputs,
    load_hf_bert,
    save_hf_bert,
    to_hf_name,
)
from pretrain.masks import BIDIRECTIONAL, LEFT_TO_RIGHT, build_attention_mask, build_segment_ids
from pretrain.model import build_model, preset

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


@pytest.fixture(scope="module")
def minilm(minilm_dir: Path):
    return load_hf_bert(minilm_dir).eval()


@pytest.fixture(scope="module")
def bidirectional_batch():
    """Two real-vocab sequences, [CLS] A [SEP] B [SEP], the second padded."""
    torch.manual_seed(0)
    length, len_a, max_len = torch.tensor([16, 11]), torch.tensor([7, 5]), 16
    input_ids = torch.randint(1000, 30000, (2, max_len))
    input_ids[:, 0] = 101
    for b in range(2):
        input_ids[b, int(len_a[b]) - 1] = input_ids[b, int(length[b]) - 1] = 102
        input_ids[b, int(length[b]):] = 0
    objective = torch.full((2,), BIDIRECTIONAL)
    return dict(
        input_ids=input_ids,
        segment_ids=build_segment_ids(objective, len_a, length, max_len),
        mask=build_attention_mask(objective, len_a, length, max_len),
        padding=(torch.arange(max_len) < length.unsqueeze(1)).long(),
    )


def ours_and_theirs(model, hf_model, batch):
    with torch.no_grad():
        hidden = model.encode(batch["input_ids"], batch["segment_ids"], batch["mask"])
        theirs = hf_model(input_ids=batch["input_ids"], token_type_ids=batch["segment_ids"],
                          attention_mask=batch["padding"])
    return hidden, theirs


def test_import_matches_transformers_bert_model(minilm, minilm_dir, bidirectional_batch):
    hf_model = transformers.BertModel.from_pretrained(minilm_dir).eval()
    hidden, theirs = ours_and_theirs(minilm, hf_model, bidirectional_batch)
    real = bidirectional_batch["padding"].bool()
    torch.testing.assert_close(hidden[real], theirs.last_hidden_state[real], atol=1e-5, rtol=0)
    torch.testing.assert_close(minilm.pooled(hidden), theirs.pooler_output, atol=1e-5, rtol=0)


def test_import_says_which_heads_were_initialised(minilm_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="pretrain.hf"):
        load_hf_bert(minilm_dir)
    assert "mlm_head" in caplog.text and "nsp_head" in caplog.text and "freshly initialised" in caplog.text
    assert "pooler" not in caplog.text  # MiniLM ships a pooler


def test_a_missing_mlm_transform_starts_at_the_identity_and_reads_back_the_input_tokens(minilm, minilm_dir,
                                                                                         bidirectional_batch, caplog):
    head = minilm.mlm_head
    torch.testing.assert_close(head.dense.weight, torch.eye(minilm.cfg.hidden_size), atol=0, rtol=0)
    assert not head.dense.bias.any() and not head.decoder.bias.any()
    assert head.decoder.weight is minilm.embeddings.token.weight  # tied, so the head reads in embedding space
    # the encoder's last state still carries each token: through the identity head many come back out
    # (through a random transform, essentially none)
    batch = bidirectional_batch
    real = batch["padding"].bool()
    with torch.no_grad():
        hidden = minilm.encode(batch["input_ids"], batch["segment_ids"], batch["mask"])
        read_back = (minilm.mlm_logits(hidden).argmax(-1) == batch["input_ids"])[real].float().mean()
        torch.manual_seed(0)
        random_dense = torch.nn.init.normal_(torch.empty_like(head.dense.weight), std=0.02)
        scrambled = head.decoder(head.norm(torch.nn.functional.gelu(hidden @ random_dense.T)))
        random_read_back = (scrambled.argmax(-1) == batch["input_ids"])[real].float().mean()
    assert read_back > 0.3 and random_read_back < 0.05, (read_back, random_read_back)
    with caplog.at_level(logging.WARNING, logger="pretrain.hf"):
        load_hf_bert(minilm_dir)
    assert "MLM transform at the identity" in caplog.text


def test_a_checkpoint_with_its_mlm_head_keeps_it(tmp_path):
    torch.manual_seed(0)
    model = build_model(preset("tiny"))
    save_hf_bert(model, tmp_path)
    again = load_hf_bert(tmp_path)
    torch.testing.assert_close(again.mlm_head.dense.weight, model.mlm_head.dense.weight, atol=0, rtol=0)


def test_segment_types_extend_from_two_to_six(minilm, minilm_dir):
    hf_types = load_file(minilm_dir / "model.safetensors")["embeddings.token_type_embeddings.weight"]
    assert SEGMENT_ROWS_FROM_HF == (0, 1, 0, 0, 0, 1)
    ours = minilm.embeddings.segment.weight.detach()
    for row, source in enumerate(SEGMENT_ROWS_FROM_HF):
        assert torch.equal(ours[row], hf_types[source])


@pytest.mark.parametrize("architecture", ["BertForPreTraining", "BertForMaskedLM", "BertModel"])
def test_export_loads_in_transformers_without_missing_or_unexpected_keys(architecture, tmp_path, caplog,
                                                                         bidirectional_batch):
    torch.manual_seed(1)  # random heads, so the MLM and NSP outputs are really compared
    model = build_model(dataclasses.replace(preset("tiny"), vocab_size=30522)).eval()
    with caplog.at_level(logging.WARNING, logger="pretrain.hf"):
        save_hf_bert(model, tmp_path, architecture=architecture)
    assert "dropped rows 2-5" in caplog.text
    hf_class = getattr(transformers, architecture)
    hf_model, info = hf_class.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    hf_model.eval()
    real = bidirectional_batch["padding"].bool()
    with torch.no_grad():
        hidden = model.encode(bidirectional_batch["input_ids"], bidirectional_batch["segment_ids"],
                              bidirectional_batch["mask"])
        theirs = hf_model(input_ids=bidirectional_batch["input_ids"],
                          token_type_ids=bidirectional_batch["segment_ids"],
                          attention_mask=bidirectional_batch["padding"], output_hidden_states=True)
        torch.testing.assert_close(hidden[real], theirs.hidden_states[-1][real], atol=1e-5, rtol=0)
        if architecture == "BertForPreTraining":
            torch.testing.assert_close(model.mlm_logits(hidden)[real], theirs.prediction_logits[real],
                                       atol=1e-5, rtol=0)
            torch.testing.assert_close(model.nsp_head(model.pooled(hidden)), theirs.seq_relationship_logits,
                                       atol=1e-5, rtol=0)
        if architecture == "BertForMaskedLM":
            torch.testing.assert_close(model.mlm_logits(hidden)[real], theirs.logits[real], atol=1e-5, rtol=0)
        if architecture == "BertModel":
            torch.testing.assert_close(model.pooled(hidden), theirs.pooler_output, atol=1e-5, rtol=0)


def test_real_bert_round_trip_through_transformers(minilm, tmp_path, bidirectional_batch):
    """MiniLM → ours → export → transformers.BertModel: the same hidden states as the original again."""
    save_hf_bert(minilm, tmp_path, architecture="BertModel")
    hf_model = transformers.BertModel.from_pretrained(tmp_path).eval()
    hidden, theirs = ours_and_theirs(minilm, hf_model, bidirectional_batch)
    real = bidirectional_batch["padding"].bool()
    torch.testing.assert_close(hidden[real], theirs.last_hidden_state[real], atol=1e-5, rtol=0)


def test_export_then_import_restores_every_tensor(tmp_path):
    torch.manual_seed(2)
    model = build_model(preset("tiny"))
    save_hf_bert(model, tmp_path)
    back = load_hf_bert(tmp_path)
    assert back.cfg == model.cfg
    ours, theirs = model.state_dict(), back.state_dict()
    for name, tensor in ours.items():
        if name == "embeddings.segment.weight":  # rows 2..5 are re-derived from HF types 0/1
            torch.testing.assert_close(theirs[name], tensor[list(SEGMENT_ROWS_FROM_HF)])
        else:
            assert torch.equal(theirs[name], tensor), name
    assert back.mlm_head.decoder.weight is back.embeddings.token.weight


def test_pytorch_model_bin_without_prefix_and_with_tf_layer_norm_names(minilm, minilm_dir, tmp_path):
    state = load_file(minilm_dir / "model.safetensors")
    legacy = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
              for k, v in state.items()}
    torch.save(legacy, tmp_path / "pytorch_model.bin")
    (tmp_path / "config.json").write_text((minilm_dir / "config.json").read_text())
    loaded = load_hf_bert(tmp_path)
    for name, tensor in minilm.state_dict().items():
        if not name.startswith(("mlm_head.", "nsp_head.")):
            assert torch.equal(loaded.state_dict()[name], tensor), name


def test_a_checkpoint_saved_in_shards_loads_like_one_file(minilm, minilm_dir, tmp_path):
    """transformers' `save_pretrained(max_shard_size=...)` layout (safetensors), and the same split as .bin files."""
    hf_model = transformers.BertModel.from_pretrained(minilm_dir)
    hf_model.save_pretrained(tmp_path / "safetensors", max_shard_size="10MB")
    assert len(list((tmp_path / "safetensors").glob("model-*.safetensors"))) > 1
    state = load_file(minilm_dir / "model.safetensors")
    names = sorted(state)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "config.json").write_text((minilm_dir / "config.json").read_text())
    weight_map = {}
    for part, chunk in enumerate((names[:len(names) // 2], names[len(names) // 2:]), start=1):
        torch.save({k: state[k] for k in chunk}, bin_dir / f"pytorch_model-0000{part}-of-00002.bin")
        weight_map.update({k: f"pytorch_model-0000{part}-of-00002.bin" for k in chunk})
    (bin_dir / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for directory in (tmp_path / "safetensors", bin_dir):
        loaded = load_hf_bert(directory).state_dict()
        for name, tensor in minilm.state_dict().items():
            if not name.startswith(("mlm_head.", "nsp_head.")):
                assert torch.equal(loaded[name], tensor), (directory.name, name)

    (bin_dir / "pytorch_model-00002-of-00002.bin").unlink()
    with pytest.raises(FileNotFoundError, match="pytorch_model-00002-of-00002.bin"):
        load_hf_bert(bin_dir)
    (bin_dir / "pytorch_model.bin.index.json").write_text(json.dumps({"files": []}))
    with pytest.raises(ValueError, match="weight_map"):
        load_hf_bert(bin_dir)


def test_an_mlm_bias_stored_under_the_decoder_only_is_loaded(tmp_path, caplog):
    """transformers reads the MLM output bias from `cls.predictions.decoder.bias` when `cls.predictions.bias` is
    absent; so does the import (it is not reported as freshly initialised)."""
    model = build_model(preset("tiny"))
    with torch.no_grad():
        model.mlm_head.decoder.bias.normal_()
    save_hf_bert(model, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["cls.predictions.decoder.bias"] = tensors.pop("cls.predictions.bias")
    save_file(tensors, tmp_path / "model.safetensors")
    with caplog.at_level(logging.WARNING, logger="pretrain.hf"):
        again = load_hf_bert(tmp_path)
    torch.testing.assert_close(again.mlm_head.decoder.bias, model.mlm_head.decoder.bias, atol=0, rtol=0)
    assert "mlm_head" not in caplog.text


def test_an_is_decoder_config_imports_as_a_causal_lm(caplog):
    config = {"vocab_size": 100, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
              "intermediate_size": 64}
    with caplog.at_level(logging.WARNING, logger="pretrain.hf"):
        assert not config_from_hf(config).causal_lm
        assert config_from_hf({**config, "is_decoder": True}).causal_lm
    assert caplog.text == ""
    with pytest.raises(ValueError, match="add_cross_attention=true .* no place"):
        config_from_hf({**config, "is_decoder": True, "add_cross_attention": True})


def test_a_transformers_decoder_imports_as_our_causal_lm_with_its_logits(tmp_path, caplog):
    """transformers' own BertLMHeadModel (two different token types) → ours: the same next-token logits; its token
    type 1, which a causal LM has no row for, is named."""
    torch.manual_seed(5)
    config = transformers.BertConfig(vocab_size=500, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, is_decoder=True)
    transformers.BertLMHeadModel(config).save_pretrained(tmp_path)
    with caplog.at_level(logging.WARNING, logger="pretrain.hf"):
        model = load_hf_bert(tmp_path).eval()
    assert model.cfg.causal_lm and "token type 1 is dropped" in caplog.text
    assert "freshly initialised" not in caplog.text  # no pooler, no NSP head: a causal LM never trains them
    hf_model = transformers.BertLMHeadModel.from_pretrained(tmp_path).eval()
    input_ids, length = torch.randint(5, 500, (2, 12)), torch.tensor([12, 12])
    with torch.no_grad():
        ours = model.mlm_logits(model.encode_objective(input_ids, LEFT_TO_RIGHT, length, length))
        theirs = hf_model(input_ids=input_ids).logits
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)


def test_a_decoder_loaded_as_a_masked_lm_is_named_in_a_warning(tmp_path, caplog):
    torch.manual_seed(6)
    model = build_model(dataclasses.replace(preset("tiny"), causal_lm=True))
    save_hf_bert(model, tmp_path)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pretrain.hf"):
        load_hf_bert(tmp_path, dataclasses.replace(model.cfg, hidden_dropout=0.0))
        assert caplog.text == ""
        load_hf_bert(tmp_path, dataclasses.replace(model.cfg, causal_lm=False))
    assert "holds a causal LM (is_decoder), loaded here as a masked-LM model" in caplog.text


def test_an_untied_decoder_is_named_in_a_warning(tmp_path, caplog):
    model = build_model(preset("tiny"))
    save_hf_bert(model, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["cls.predictions.decoder.weight"] = model.embeddings.token.weight.detach().clone()
    save_file(tensors, tmp_path / "model.safetensors")
    with caplog.at_level(logging.WARNING, logger="pretrain.hf"):
        load_hf_bert(tmp_path)
    assert "untied" not in caplog.text
    tensors["cls.predictions.decoder.weight"] += 1
    save_file(tensors, tmp_path / "model.safetensors")
    with caplog.at_level(logging.WARNING, logger="pretrain.hf"):
        load_hf_bert(tmp_path)
    assert "untied" in caplog.text


def _tiny_hf_config(**settings):
    return transformers.BertConfig(vocab_size=101, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   intermediate_size=48, **settings)


def test_an_untied_checkpoint_predicts_with_its_decoder_bias(tmp_path, caplog):
    """transformers' untied BertForMaskedLM (tie_word_embeddings false) adds cls.predictions.decoder.bias, a
    tensor apart from cls.predictions.bias: the import takes the one the forward adds, so with the decoder weights
    equal to the embeddings the MLM logits are transformers' own; a decoder that differs is named."""
    torch.manual_seed(8)
    hf_model = transformers.BertForMaskedLM(_tiny_hf_config(tie_word_embeddings=False)).eval()
    with torch.no_grad():
        hf_model.cls.predictions.decoder.weight.copy_(hf_model.bert.embeddings.word_embeddings.weight)
        hf_model.cls.predictions.decoder.bias.normal_()
        hf_model.cls.predictions.bias.zero_()
    hf_model.save_pretrained(tmp_path)
    input_ids = torch.randint(5, 101, (2, 12))
    with caplog.at_level(logging.WARNING, logger="pretrain.hf"):
        model = load_hf_bert(tmp_path).eval()
    assert "tie_word_embeddings" not in caplog.text
    with torch.no_grad():
        ours = model.mlm_logits(model.encode_objective(input_ids, BIDIRECTIONAL, torch.tensor([6, 6]),
                                                       torch.tensor([12, 12])))
        theirs = hf_model(input_ids=input_ids, token_type_ids=(torch.arange(12) >= 6).long().expand(2, 12)).logits
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    with torch.no_grad():
        hf_model.cls.predictions.decoder.weight.normal_()
    hf_model.save_pretrained(tmp_path)
    with caplog.at_level(logging.WARNING, logger="pretrain.hf"):
        load_hf_bert(tmp_path)
    assert "untied checkpoint, tie_word_embeddings false" in caplog.text
    assert "its word predictions are not the checkpoint's" in caplog.text


def test_a_checkpoint_with_one_token_type_gives_it_to_every_segment(tmp_path):
    torch.manual_seed(9)
    hf_model = transformers.BertModel(_tiny_hf_config(type_vocab_size=1)).eval()
    hf_model.save_pretrained(tmp_path)
    model = load_hf_bert(tmp_path).eval()
    row = hf_model.embeddings.token_type_embeddings.weight[0]
    assert all(torch.equal(segment, row) for segment in model.embeddings.segment.weight)
    input_ids = torch.randint(5, 101, (2, 10))
    with torch.no_grad():  # a pair: its B segment reads the same row as A, as the checkpoint's every token did
        ours = model.encode_objective(input_ids, BIDIRECTIONAL, torch.tensor([4, 4]), torch.tensor([10, 10]))
        theirs = hf_model(input_ids=input_ids, token_type_ids=torch.zeros_like(input_ids)).last_hidden_state
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("head_class", ["BertForSequenceClassification", "BertForQuestionAnswering"])
def test_a_fine_tuned_bert_gives_its_encoder_and_its_task_head_is_named(minilm, minilm_dir, tmp_path, caplog,
                                                                        head_class):
    getattr(transformers, head_class).from_pretrained(minilm_dir).save_pretrained(tmp_path)
    with caplog.at_level(logging.WARNING, logger="pretrain.hf"):
        loaded = load_hf_bert(tmp_path).state_dict()
    assert "task head" in caplog.text and ("classifier.weight" in caplog.text or "qa_outputs.weight" in caplog.text)
    for name, tensor in minilm.state_dict().items():
        if name.startswith(("embeddings.", "layers.")):
            assert torch.equal(loaded[name], tensor), name


def test_model_config_comes_from_config_json_alone(minilm, minilm_dir, tmp_path):
    assert hf_model_config(minilm_dir) == minilm.cfg
    with pytest.raises(FileNotFoundError, match="no config.json"):
        hf_model_config(tmp_path)
    with pytest.raises(FileNotFoundError, match="no weights"):
        (tmp_path / "config.json").write_text((minilm_dir / "config.json").read_text())
        load_hf_bert(tmp_path)


def test_load_with_other_dropout_keeps_every_tensor_and_refuses_other_shapes(minilm, minilm_dir):
    """Same tensors as the checkpoint's own config gives, freshly initialised heads included (same seed)."""
    cfg = dataclasses.replace(minilm.cfg, hidden_dropout=0.0, attention_dropout=0.0)
    torch.manual_seed(5)
    model = load_hf_bert(minilm_dir, cfg)
    torch.manual_seed(5)
    own = load_hf_bert(minilm_dir)
    assert model.cfg == cfg and own.cfg != cfg
    for name, tensor in own.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name
    with pytest.raises(ValueError, match="position_embeddings"):  # fewer rows than the weights have
        load_hf_bert(minilm_dir, dataclasses.replace(minilm.cfg, max_position_embeddings=64))


def test_more_positions_repeat_the_learned_rows_and_leave_short_inputs_unchanged(minilm_dir):
    """microsoft/unilm's rule for CNN/DailyMail (unilm-v1 modeling.py, from_pretrained): row 512 + i = row i."""
    torch.manual_seed(0)
    own = load_hf_bert(minilm_dir).eval()
    longer = load_hf_bert(minilm_dir, dataclasses.replace(own.cfg, max_position_embeddings=768)).eval()
    table, rows = longer.embeddings.position.weight, own.cfg.max_position_embeddings
    assert table.shape[0] == 768 and torch.equal(table[:rows], own.embeddings.position.weight)
    assert torch.equal(table[rows:768], own.embeddings.position.weight[:768 - rows])
    input_ids = torch.randint(0, own.cfg.vocab_size, (2, 40))
    length = torch.tensor([40, 31])
    with torch.no_grad():
        expected = own.encode_objective(input_ids, BIDIRECTIONAL, length, length)
        assert torch.equal(longer.encode_objective(input_ids, BIDIRECTIONAL, length, length), expected)


def test_bad_checkpoints_fail_loudly(minilm_dir, tmp_path):
    config = json.loads((minilm_dir / "config.json").read_text())
    state = load_file(minilm_dir / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(config))
    torch.save({**state, "encoder.layer.0.attention.self.rotary.weight": torch.zeros(1)},
               tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="no place for"):
        load_hf_bert(tmp_path)
    torch.save({k: v for k, v in state.items() if "layer.3.output.dense" not in k}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="lacks"):
        load_hf_bert(tmp_path)
    for activation in ("relu", "gelu_new"):  # gelu_new: the tanh approximation
        (tmp_path / "config.json").write_text(json.dumps({**config, "hidden_act": activation}))
        with pytest.raises(ValueError, match=f"exact .erf. gelu.*hidden_act='{activation}'"):
            load_hf_bert(tmp_path)
    torch.save(state, tmp_path / "pytorch_model.bin")  # 6 layers, a config of 2: the usual way to a smaller model
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2}))
    with pytest.raises(ValueError, match=r"it has 6 layers \(0-5\), the config builds 2 .*\['encoder.layer.2.*"
                                         r"and \d+ more"):
        load_hf_bert(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"dim": 768, "n_layers": 6, "vocab_size": 30522}))
    with pytest.raises(ValueError, match=r"config.json: not a BERT config: no integer hidden_size, "
                                         r"num_hidden_layers, num_attention_heads, intermediate_size"):
        load_hf_bert(tmp_path)


def test_gelu_python_is_the_exact_gelu(minilm_dir):
    config = json.loads((minilm_dir / "config.json").read_text())
    assert config_from_hf({**config, "hidden_act": "gelu_python"}) == config_from_hf(config)


def test_a_checkpoint_with_six_segment_types_loads_as_is(tmp_path, caplog):
    """Six stored segment rows load as they are. Under a config that says six token types and an eps (ours, s2s-ft's)
    that eps is followed; under one without the eps they are UniLM v1's release, which normalised with 1e-5."""
    torch.manual_seed(3)
    model = build_model(preset("tiny"))
    save_hf_bert(model, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["bert.embeddings.token_type_embeddings.weight"] = model.embeddings.segment.weight.detach().clone()
    save_file(tensors, tmp_path / "model.safetensors")
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "type_vocab_size": 6}))
    with caplog.at_level(logging.INFO, logger="pretrain.hf"):
        loaded = load_hf_bert(tmp_path)
    assert torch.equal(loaded.embeddings.segment.weight, model.embeddings.segment.weight)
    assert loaded.cfg.layer_norm_eps == 1e-12 and "layer_norm_eps" not in caplog.text
    del config["layer_norm_eps"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with caplog.at_level(logging.INFO, logger="pretrain.hf"):
        assert load_hf_bert(tmp_path).cfg.layer_norm_eps == 1e-5
    assert "layer_norm_eps unset): UniLM v1's released layout, loaded with its LayerNorm eps 1e-05" in caplog.text


def test_the_original_release_layout_loads(minilm_dir, tmp_path):
    """UniLM v1's released checkpoints as their fine-tuning code reads them: a pytorch-pretrained-bert state dict
    (`bert.`/`cls.` names, LayerNorm gamma/beta, the decoder stored beside the embeddings, 6 segment rows, half
    precision) as pytorch_model.bin beside BERT's `bert_config.json` (which says 2 segment types), with v1's LayerNorm
    eps 1e-5. Fine-tuning finds it too, with its vocab.txt."""
    from finetune.model_io import load_init

    torch.manual_seed(5)
    model = build_model(preset("tiny"))
    original = {}
    for name, tensor in model.state_dict().items():
        hf_name = to_hf_name(name) or "cls.predictions.decoder.weight"
        original[re.sub(r"LayerNorm\.weight$", "LayerNorm.gamma", re.sub(r"LayerNorm\.bias$", "LayerNorm.beta",
                                                                          hf_name))] = tensor.half()
    assert original["bert.embeddings.token_type_embeddings.weight"].shape[0] == 6
    torch.save(original, tmp_path / "pytorch_model.bin")
    (tmp_path / "bert_config.json").write_text(json.dumps(hf_config(model.cfg)))  # BERT's: type_vocab_size 2
    assert hf_model_config(tmp_path) == dataclasses.replace(model.cfg, layer_norm_eps=1e-5)  # v1's eps
    loaded = load_hf_bert(tmp_path).state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded[name], tensor.half().float()), name

    vocab = [line for line in (minilm_dir / "vocab.txt").read_text().splitlines()][:model.cfg.vocab_size]
    (tmp_path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    backbone, tokenizer = load_init(tmp_path)
    assert torch.equal(backbone.embeddings.segment.weight, loaded["embeddings.segment.weight"])
    assert tokenizer.vocab_size == model.cfg.vocab_size


def test_a_tensorflow_checkpoint_is_named_as_such(minilm_dir, tmp_path):
    (tmp_path / "bert_config.json").write_text((minilm_dir / "config.json").read_text())
    for name in ("bert_model.ckpt.index", "bert_model.ckpt.data-00000-of-00001"):
        (tmp_path / name).write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="bert_model.ckpt.index is a TensorFlow checkpoint"):
        load_hf_bert(tmp_path)


def test_training_loss_equals_bert_for_pretraining_on_the_bench_batch(tmp_path):
    """Our sparse MLM + NSP loss = HF's dense one on the same weights, batch and masked positions (the benchmark's
    premise: both models do the same job)."""
    torch.manual_seed(4)
    cfg = dataclasses.replace(preset("tiny"), vocab_size=2000)
    model = build_model(cfg).eval()
    save_hf_bert(model, tmp_path)
    hf_model = transformers.BertForPreTraining.from_pretrained(tmp_path).eval()
    batch = synthetic_batch(cfg, batch_size=3, seq_len=24, predictions=4)
    with torch.no_grad():
        ours = model(**batch)
        theirs = hf_model(**hf_pretraining_inputs(batch))
    torch.testing.assert_close(ours.loss, theirs.loss, atol=1e-5, rtol=1e-5)
    assert set(ours.objective_losses) == {"bidirectional_mlm", "nsp"}
