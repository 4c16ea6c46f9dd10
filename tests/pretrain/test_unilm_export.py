"""`python -m pretrain.export --format unilm`: all six segment rows as token types 0..5, s2s-ft's source/target type
ids in config.json; transformers' `BertForMaskedLM` then gives our seq2seq logits under the 3-D seq2seq mask, and
the greedy decoding recipe of docs/finetuning.md decodes as `finetune.beam` does."""
from __future__ import annotations

import dataclasses
import json
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from data_prep.shard_format import ShardDataset
from finetune.beam import DecodeConfig, SpecialIds, generate
from finetune.generation import pack_source
from finetune.tokenizer import load_tokenizer
from pretrain import checkpoint as ckpt
from pretrain.export import main as export_main
from pretrain.hf import load_hf_bert
from pretrain.masks import SEQ2SEQ, build_attention_mask, build_segment_ids
from pretrain.model import build_model, preset

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


# docs/finetuning.md's recipe, as it is written there: greedy seq2seq decoding with plain transformers on a
# `--format unilm` export.
def hf_attention_mask(allowed):  # Bool[B, L, L], True: the query may attend to the key
    if int(transformers.__version__.split(".")[0]) < 5:
        return allowed.long()
    return torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min).unsqueeze(1)


def greedy_decode(model, tokenizer, source, max_tgt_len=128, min_tgt_len=1):
    source_ids = [tokenizer.cls_token_id, *tokenizer.encode(source, add_special_tokens=False), tokenizer.sep_token_id]
    banned = [tokenizer.convert_tokens_to_ids(t) for t in tokenizer.all_special_tokens if t != tokenizer.sep_token]
    banned += [i for t, i in tokenizer.get_vocab().items() if t.startswith("[unused")]
    target = []
    while len(target) < max_tgt_len:
        input_ids = torch.tensor([source_ids + target + [tokenizer.mask_token_id]])
        length, n_source = input_ids.shape[1], len(source_ids)
        query, key = torch.arange(length).view(-1, 1), torch.arange(length).view(1, -1)
        mask = hf_attention_mask(((key < n_source) | (key <= query)).unsqueeze(0))
        token_types = torch.tensor([[4] * n_source + [5] * (length - n_source)])  # source_type_id, target_type_id
        with torch.no_grad():
            logits = model(input_ids=input_ids, token_type_ids=token_types, attention_mask=mask).logits[0, -1]
        logits[banned] = float("-inf")  # as finetune.beam: [CLS] [MASK] [PAD] [UNK] [unused*] never generated
        if len(target) < min_tgt_len:
            logits[tokenizer.sep_token_id] = float("-inf")
        next_id = int(logits.argmax())
        if next_id == tokenizer.sep_token_id:
            break
        target.append(next_id)
    return target  # word-piece ids


def tiny_unilm(seed: int, vocab_size: int):
    """A tiny random masked-LM model in eval mode, its six segment rows made clearly different."""
    torch.manual_seed(seed)
    model = build_model(dataclasses.replace(preset("tiny"), vocab_size=vocab_size, layer_norm_eps=1e-5)).eval()
    with torch.no_grad():
        model.embeddings.segment.weight.mul_(torch.arange(1, 7).unsqueeze(1))
    return model


def fake_checkpoint(directory: Path, model, shards: Path) -> Path:
    """A checkpoint as the trainer writes one: weights, model config, run config, vocab hash."""
    tag = directory / "global_step1"
    tag.mkdir(parents=True)
    ckpt.write_weights(tag, model.state_dict())
    ckpt.write_marker(tag, {"model_config": dataclasses.asdict(model.cfg),
                            "run_config": {"data": {"shards": str(shards)}},
                            "vocab_hash": ShardDataset(shards).manifest["vocab"]["sha256"]})
    ckpt.update_latest(directory, "global_step1")
    return directory


@pytest.fixture(scope="module")
def unilm_export(unilm_shards: Path, tmp_path_factory: pytest.TempPathFactory):
    """(our model, the directory `--format unilm` wrote from its checkpoint)."""
    tmp = tmp_path_factory.mktemp("unilm_export")
    model = tiny_unilm(3, ShardDataset(unilm_shards).manifest["vocab"]["size"])
    export_main([str(fake_checkpoint(tmp / "checkpoints", model, unilm_shards)), str(tmp / "hf"), "--format", "unilm"])
    return model, tmp / "hf"


def test_the_unilm_export_loads_as_a_bert_masked_lm_with_all_six_segment_rows(unilm_export):
    model, out = unilm_export
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "bert" and config["architectures"] == ["BertForMaskedLM"]
    assert (config["type_vocab_size"], config["source_type_id"], config["target_type_id"]) == (6, 4, 5)
    hf_model, info = transformers.BertForMaskedLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert hf_model.config.type_vocab_size == 6 and hf_model.config.layer_norm_eps == 1e-5
    exported = hf_model.bert.embeddings.token_type_embeddings.weight
    assert exported.dtype == torch.float32 and torch.equal(exported, model.embeddings.segment.weight)
    assert transformers.AutoModelForMaskedLM.from_pretrained(out).config.source_type_id == 4
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert len(tokenizer) == model.cfg.vocab_size and tokenizer.mask_token == "[MASK]"
    assert (out / "vocab.txt").is_file() and (out / "tokenizer_config.json").is_file()
    back = load_hf_bert(out)  # and imports back: six rows as they are; BertForMaskedLM has no pooler, no NSP head
    assert back.cfg == model.cfg
    assert all(torch.equal(back.state_dict()[name], tensor) for name, tensor in model.state_dict().items()
               if not name.startswith(("pooler.", "nsp_head."))), "a tensor changed on the way out and back"


# The keys s2s-ft's `BertForSeq2SeqConfig.from_exist_config` requires, then the ones it reads when present (and the
# `model_type` its `--model_type` names); unilm-v1's `BertConfig.from_json_file` takes every key it finds.
S2S_FT_CONFIG_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                      "hidden_act", "hidden_dropout_prob", "attention_probs_dropout_prob", "max_position_embeddings",
                      "type_vocab_size", "initializer_range", "layer_norm_eps", "model_type", "source_type_id",
                      "target_type_id")


def test_the_unilm_export_holds_what_microsoft_unilms_loaders_open(unilm_export):
    """unilm-v1's and s2s-ft's ``from_pretrained`` `torch.load` `pytorch_model.bin` (v1 beside `bert_config.json`,
    s2s-ft beside `config.json`) under torch 1.1 / 1.2, which read only torch's pre-1.6 (non-zip) format."""
    model, out = unilm_export
    weights = out / "pytorch_model.bin"
    assert not zipfile.is_zipfile(weights)  # the legacy format those torch versions read
    state = torch.load(weights, weights_only=True)
    safetensors = load_file(out / "model.safetensors")
    assert type(state) is dict and state.keys() == safetensors.keys()
    assert all(torch.equal(state[name], tensor) and state[name].dtype == tensor.dtype
               for name, tensor in safetensors.items())
    assert state["bert.embeddings.token_type_embeddings.weight"].shape[0] == 6
    config = json.loads((out / "config.json").read_text())
    assert json.loads((out / "bert_config.json").read_text()) == config
    assert all(key in config for key in S2S_FT_CONFIG_KEYS), set(S2S_FT_CONFIG_KEYS) - set(config)
    assert config["hidden_act"] == "gelu" and (config["source_type_id"], config["target_type_id"]) == (4, 5)
    # our own loader, given the .bin by name, reads the same model back
    back = load_hf_bert(weights)
    assert all(torch.equal(back.state_dict()[name], tensor) for name, tensor in model.state_dict().items()
               if not name.startswith(("pooler.", "nsp_head."))), "a tensor changed on the way out and back"


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_bert_masked_lm_gives_our_seq2seq_logits_under_the_seq2seq_mask(unilm_export, attention):
    model, out = unilm_export
    hf_model = transformers.BertForMaskedLM.from_pretrained(out, attn_implementation=attention).eval()
    torch.manual_seed(0)
    max_len = 20
    input_ids = torch.randint(5, model.cfg.vocab_size, (2, max_len))
    len_a, length = torch.tensor([8, 5]), torch.tensor([20, 13])
    input_ids[1, 13:] = 0
    objective = torch.full((2,), SEQ2SEQ)
    token_type_ids = build_segment_ids(objective, len_a, length, max_len)
    assert token_type_ids[0].tolist() == [4] * 8 + [5] * 12
    attention_mask = hf_attention_mask(build_attention_mask(objective, len_a, length, max_len))
    with torch.no_grad():
        ours = model.mlm_logits(model.encode_objective(input_ids, SEQ2SEQ, len_a, length))
        theirs = hf_model(input_ids=input_ids, token_type_ids=token_type_ids, attention_mask=attention_mask).logits
    real = torch.arange(max_len) < length.unsqueeze(1)
    torch.testing.assert_close(ours[real], theirs[real], atol=1e-5, rtol=0)


def test_the_greedy_recipe_decodes_as_our_greedy_search(unilm_export):
    model, out = unilm_export
    hf_model = transformers.BertForMaskedLM.from_pretrained(out).eval()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    ours_tokenizer = load_tokenizer(out)
    config = DecodeConfig(beam_size=1, max_tgt_len=12, min_tgt_len=1, no_repeat_ngram=0)
    for source in ("The river runs through the old town.", "She wrote two letters before the war ended."):
        packed, cut = pack_source(ours_tokenizer, source, max_src_len=40)
        assert not cut
        ours = generate(model, [packed], SpecialIds.of(ours_tokenizer), config)[0].tokens
        theirs = greedy_decode(hf_model, hf_tokenizer, source, max_tgt_len=12)
        assert theirs == ours and len(set(ours)) > 1, (source, theirs, ours)


def test_a_causal_lm_is_refused_in_the_unilm_format(gpt_shards: Path, tmp_path, capsys):
    torch.manual_seed(0)
    cfg = dataclasses.replace(preset("tiny"), vocab_size=ShardDataset(gpt_shards).manifest["vocab"]["size"],
                              causal_lm=True)
    checkpoints = fake_checkpoint(tmp_path / "checkpoints", build_model(cfg), gpt_shards)
    with pytest.raises(SystemExit) as exit_info:
        export_main([str(checkpoints), str(tmp_path / "hf"), "--format", "unilm"])
    assert exit_info.value.code == 2 and "--format unilm: this checkpoint is a causal LM" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()
