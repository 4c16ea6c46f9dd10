"""microsoft/unilm's released layouts load (`pretrain.unilm_layouts`) for pre-training's ``model.init_from`` and
fine-tuning's ``--init``: files built here in those exact layouts (tensor names and shapes as unilm-v1's
`src/pytorch_pretrained_bert/modeling.py` and s2s-ft's `s2s_ft/convert_state_dict.py` store them) give, through our
model, the logits that transformers' `BertForMaskedLM` gives for the same weights under the same seq2seq mask."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from finetune.model_io import load_init
from pretrain.config import config_from_dict, resolve_model_config
from pretrain.hf import hf_model_config, load_hf_bert
from pretrain.masks import (
    BIDIRECTIONAL,
    LEFT_TO_RIGHT,
    RIGHT_TO_LEFT,
    SEQ2SEQ,
    build_attention_mask,
    build_segment_ids,
)
from pretrain.unilm_layouts import TASK_DEFAULT, TASK_SEQ2SEQ, V1_TASK_IDX, seq2seq_type_ids
from pretrain.warm_start import load_initial_model

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

VOCAB, HIDDEN, POSITIONS = 120, 32, 40
# BERT's bert_config.json as pytorch-pretrained-bert ships it beside the weights: no layer_norm_eps, 2 token types
BERT_CONFIG = {"vocab_size": VOCAB, "hidden_size": HIDDEN, "num_hidden_layers": 2, "num_attention_heads": 4,
               "intermediate_size": 64, "hidden_act": "gelu", "hidden_dropout_prob": 0.1,
               "attention_probs_dropout_prob": 0.1, "max_position_embeddings": POSITIONS, "type_vocab_size": 2,
               "initializer_range": 0.02}


def reference(seed: int, eps: float = 1e-5, key_bias: bool = True):
    """transformers' BertForMaskedLM with six token types and every tensor random (LayerNorms and biases too, so
    that a tensor loaded into the wrong place shows); ``key_bias`` False: zero key biases, as fast QKV stores none."""
    torch.manual_seed(seed)
    config = transformers.BertConfig(**{**BERT_CONFIG, "type_vocab_size": 6}, layer_norm_eps=eps)
    model = transformers.BertForMaskedLM(config).eval()
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            tensor.copy_(torch.randn_like(tensor) * (0.2 if tensor.dim() > 1 else 0.5)
                         + (1.0 if "LayerNorm.weight" in name else 0.0))
            if not key_bias and name.endswith("attention.self.key.bias"):
                tensor.zero_()
    return model


def v1_state(model) -> dict[str, torch.Tensor]:
    """``model``'s weights as UniLM v1's `BertForPreTrainingLossMask` state dict holds them: `bert.*` and `cls.*`
    names, the decoder weight stored beside the word embeddings it is tied to, no decoder bias, the pooler and the
    NSP head (`cls.seq_relationship`)."""
    torch.manual_seed(99)
    state = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()
             if name.startswith(("bert.embeddings.", "bert.encoder.", "cls.predictions.transform."))
             and not name.endswith(("position_ids", "token_type_ids"))}
    state["cls.predictions.decoder.weight"] = state["bert.embeddings.word_embeddings.weight"]
    state["cls.predictions.bias"] = model.cls.predictions.bias.detach().clone()
    state["bert.pooler.dense.weight"] = torch.randn(HIDDEN, HIDDEN)
    state["bert.pooler.dense.bias"] = torch.randn(HIDDEN)
    state["cls.seq_relationship.weight"], state["cls.seq_relationship.bias"] = torch.randn(2, HIDDEN), torch.randn(2)
    return state


def beside_bert_config(directory: Path, state: dict[str, torch.Tensor], name: str = "unilm1-base-cased.bin",
                       config_name: str = "bert_config.json", legacy: bool = True) -> Path:
    """``state`` saved as v1's release is (`torch.save`, before torch 1.6's zip format by default) in ``directory``
    beside BERT's config and a vocab.txt; returns the weights file."""
    directory.mkdir(parents=True, exist_ok=True)
    torch.save(state, directory / name, _use_new_zipfile_serialization=not legacy)
    (directory / config_name).write_text(json.dumps(BERT_CONFIG))
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    (directory / "vocab.txt").write_text("\n".join(specials + [f"w{i}" for i in range(VOCAB - 5)]) + "\n")
    return directory / name


def seq2seq_logits(ours, theirs) -> tuple[torch.Tensor, torch.Tensor]:
    """(our logits, the reference's) over the real tokens of two seq2seq samples, under one 3-D seq2seq mask."""
    torch.manual_seed(1)
    input_ids = torch.randint(5, VOCAB, (2, 18))
    len_a, length = torch.tensor([7, 5]), torch.tensor([18, 12])
    objective = torch.full((2,), SEQ2SEQ)
    segments = build_segment_ids(objective, len_a, length, 18)
    allowed = build_attention_mask(objective, len_a, length, 18)
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min).unsqueeze(1)
    with torch.no_grad():
        mine = ours.eval().mlm_logits(ours.encode(input_ids, segments, allowed))
        reference_logits = theirs(input_ids=input_ids, token_type_ids=segments, attention_mask=additive).logits
    real = torch.arange(18) < length.unsqueeze(1)
    return mine[real], reference_logits[real]


def assert_same_logits(ours, theirs) -> None:
    mine, reference_logits = seq2seq_logits(ours, theirs)
    torch.testing.assert_close(mine, reference_logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize(("legacy", "config_name", "bert_eps"),
                         [(True, "bert_config.json", None), (False, "config.json", 1e-12)],
                         ids=["torch-1.5-format-beside-bert_config.json", "zip-format-beside-hf-config.json"])
def test_a_v1_release_bin_given_by_name_beside_bert_config_loads_with_its_six_rows_and_eps(tmp_path, legacy, caplog,
                                                                                           config_name, bert_eps):
    """v1's `.bin` beside BERT's config: pytorch-pretrained-bert's bert_config.json (no eps) or the Hugging Face
    hub's config.json (eps 1e-12), both saying 2 token types; v1's code normalises with 1e-5 either way."""
    theirs = reference(1)
    weights = beside_bert_config(tmp_path / "unilm1", v1_state(theirs), legacy=legacy, config_name=config_name)
    if bert_eps is not None:
        (weights.parent / config_name).write_text(json.dumps({**BERT_CONFIG, "layer_norm_eps": bert_eps}))
    with caplog.at_level(logging.INFO, logger="pretrain.hf"):
        cfg = hf_model_config(weights)
    assert cfg.layer_norm_eps == 1e-5 and "UniLM v1's released layout" in caplog.text  # v1's BertLayerNorm
    ours = load_hf_bert(weights)
    assert torch.equal(ours.embeddings.segment.weight, theirs.bert.embeddings.token_type_embeddings.weight)
    assert_same_logits(ours, theirs)

    backbone, tokenizer = load_init(weights, task="seq2seq")  # fine-tuning: its vocab.txt is beside it
    assert tokenizer.vocab_size == VOCAB and backbone.cfg == cfg
    assert_same_logits(backbone, theirs)

    run = config_from_dict({"out_dir": str(tmp_path / "run"), "deepspeed_config": "ds_configs/zero0_fp32_cpu.json",
                            "data": {"shards": str(tmp_path / "shards")}, "model": {"init_from": str(weights)}})
    assert resolve_model_config(run) == cfg  # continued pre-training builds the same model
    assert_same_logits(load_initial_model(str(weights), cfg), theirs)


def test_relax_projection_and_new_pos_ids_load_the_seq2seq_block_for_seq2seq_and_block_0_otherwise(tmp_path):
    """v1's relax_projection (the head transform's dense [4H, H], its bias and LayerNorm [4H]) and new_pos_ids
    (the position table [P, 4H]): seq2seq fine-tuning takes block 3, as v1's seq2seq code (task_idx=3); anything
    else block 0, v1's `from_pretrained` default."""
    blocks = [reference(10 + block) for block in range(4)]  # block k: the weights of reference model k
    state = v1_state(blocks[0])
    for name in ("cls.predictions.transform.dense.weight", "cls.predictions.transform.dense.bias",
                 "cls.predictions.transform.LayerNorm.weight", "cls.predictions.transform.LayerNorm.bias"):
        state[name] = torch.cat([model.state_dict()[name] for model in blocks])  # v1's view(4, H, ...) order
    positions = "bert.embeddings.position_embeddings.weight"
    state[positions] = torch.cat([model.state_dict()[positions] for model in blocks], dim=1)  # [P, 4H]
    assert state[positions].shape == (POSITIONS, 4 * HIDDEN)
    assert state["cls.predictions.transform.dense.weight"].shape == (4 * HIDDEN, HIDDEN)
    weights = beside_bert_config(tmp_path / "relax", state, name="pytorch_model.bin")

    for task, block in (("seq2seq", 3), ("classify", 0)):
        expected = reference(10)  # block 0's model, with block k's head transform and position table
        expected.load_state_dict({name: tensor for name, tensor in blocks[block].state_dict().items()
                                  if name.startswith("cls.predictions.transform.") or name == positions},
                                 strict=False)
        backbone, _ = load_init(weights.parent, task=task)
        assert_same_logits(backbone, expected)
    assert_same_logits(load_hf_bert(weights.parent), expected)  # pre-training: block 0


def fast_qkv(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """s2s-ft's UniLM layout of a BERT state dict (the inverse of its `unilm_to_hf_bert`): query, key and value
    weights stacked as `qkv_linear.weight` [3H, H], `q_bias` and `v_bias`, no key bias."""
    out = {}
    for name, tensor in state.items():
        prefix, _, rest = name.partition("attention.self.")
        if not rest:
            out[name] = tensor
        elif rest == "query.weight":
            out[prefix + "attention.self.qkv_linear.weight"] = torch.cat(
                [state[prefix + f"attention.self.{part}.weight"] for part in ("query", "key", "value")])
        elif rest in ("query.bias", "value.bias"):
            out[prefix + f"attention.self.{rest[0]}_bias"] = tensor
    return out


def test_an_s2s_ft_unilm_directory_loads_fast_qkv_and_its_source_and_target_rows(tmp_path, caplog):
    theirs = reference(20, eps=1e-12, key_bias=False)
    directory = tmp_path / "unilm1.2-base-uncased"
    beside_bert_config(directory, fast_qkv(v1_state(theirs)), name="pytorch_model.bin", legacy=False)
    assert any(name.endswith("qkv_linear.weight") for name in torch.load(directory / "pytorch_model.bin"))
    # s2s-ft's UnilmConfig: BERT's keys, 6 types, the rows its seq2seq fine-tuning embeds source and target with
    unilm_config = {**BERT_CONFIG, "model_type": "unilm", "type_vocab_size": 6, "layer_norm_eps": 1e-12,
                    "source_type_id": 4, "target_type_id": 5}
    (directory / "config.json").write_text(json.dumps(unilm_config))
    assert_same_logits(load_hf_bert(directory), theirs)
    assert_same_logits(load_init(directory, task="seq2seq")[0], theirs)

    # another pair of rows: ours (4 and 5) are taken from them, the reference reading the same rows
    (directory / "config.json").write_text(json.dumps({**unilm_config, "source_type_id": 0, "target_type_id": 1}))
    with caplog.at_level(logging.INFO, logger="pretrain.unilm_layouts"):
        moved = load_hf_bert(directory)
    assert "token types 0 and 1" in caplog.text
    table = theirs.bert.embeddings.token_type_embeddings.weight
    assert torch.equal(moved.embeddings.segment.weight, table[[0, 1, 2, 3, 0, 1]])
    with torch.no_grad():
        table[4:] = table[:2].clone()
    assert_same_logits(moved, theirs)


@pytest.mark.parametrize("model_type", ["unilm", "minilm"])
def test_an_s2s_ft_config_without_type_ids_embeds_seq2seq_with_s2s_ft_defaults_0_and_1(tmp_path, caplog, model_type):
    """s2s-ft's `UnilmConfig`, `MinilmConfig` and `BertForSeq2SeqConfig` default ``source_type_id`` 0 and
    ``target_type_id`` 1: a model s2s-ft fine-tuned under a config without them embedded source and target with rows 0
    and 1, so ours reads those in its seq2seq rows 4 and 5; keys that are present win. UniLM's directories hold fast
    QKV, MiniLM's BERT's names (`hf_bert_to_hf_bert` keeps them)."""
    theirs = reference(30, eps=1e-12, key_bias=model_type != "unilm")
    state = v1_state(theirs)
    directory = tmp_path / f"{model_type}-uncased"
    beside_bert_config(directory, fast_qkv(state) if model_type == "unilm" else state, name="pytorch_model.bin",
                       legacy=False)
    s2s_ft_config = {**BERT_CONFIG, "model_type": model_type, "type_vocab_size": 6, "layer_norm_eps": 1e-12}
    (directory / "config.json").write_text(json.dumps(s2s_ft_config))
    table = theirs.bert.embeddings.token_type_embeddings.weight
    stored = table.detach().clone()
    with caplog.at_level(logging.INFO, logger="pretrain.unilm_layouts"):
        moved = load_hf_bert(directory)
    assert f"token types 0 and 1 (s2s-ft's default source_type_id / target_type_id for model_type {model_type})" \
        in caplog.text
    assert torch.equal(moved.embeddings.segment.weight, stored[[0, 1, 2, 3, 0, 1]])
    with torch.no_grad():
        table[4:] = table[:2].clone()  # the reference reads rows 0 and 1 where our seq2seq reads 4 and 5
    assert_same_logits(moved, theirs)
    assert_same_logits(load_init(directory, task="seq2seq")[0], theirs)

    (directory / "config.json").write_text(json.dumps({**s2s_ft_config, "source_type_id": 4, "target_type_id": 5}))
    assert torch.equal(load_hf_bert(directory).embeddings.segment.weight, stored)
    (directory / "config.json").write_text(json.dumps({**s2s_ft_config, "source_type_id": 2}))  # target: default 1
    assert torch.equal(load_hf_bert(directory).embeddings.segment.weight, stored[[0, 1, 2, 3, 2, 1]])


def test_a_bert_config_without_type_ids_keeps_unilm_seq2seq_rows_4_and_5():
    """Only s2s-ft's own model types take its defaults: six rows under any other config (v1's release beside BERT's
    config, a six-type BERT config) are UniLM's, seq2seq in rows 4 and 5."""
    for config in ({}, {"model_type": "bert", "type_vocab_size": 6}):
        assert seq2seq_type_ids(config) == (4, 5)
    assert seq2seq_type_ids({"model_type": "minilm"}) == seq2seq_type_ids({"model_type": "unilm"}) == (0, 1)
    assert seq2seq_type_ids({"model_type": "bert", "source_type_id": 0, "target_type_id": 1}) == (0, 1)


def v1_token_types_and_mask(task_idx: int, tokens_a: int, length: int, max_len: int
                            ) -> tuple[list[int], list[list[bool]]]:
    """unilm-v1's token types [L] and attention mask [L, L] of one sample of task ``task_idx`` (the rule its
    `BertForPreTrainingLossMask.forward` applies when given neither): types ``task_idx + 1``, plus 1 for seq2seq,
    less 1 inside segment A for bidirectional and seq2seq, 0 on padding; task 0 sees every real token, 1 the real
    keys at or before the query, 2 those at or after it, 3 segment A and the keys at or before the query."""
    types = [task_idx + 1 + (task_idx == 3) - (position < tokens_a and task_idx in (0, 3)) if position < length else 0
             for position in range(max_len)]
    sees = {0: lambda query, key: True, 1: lambda query, key: key <= query, 2: lambda query, key: key >= query,
            3: lambda query, key: key < tokens_a or key <= query}[task_idx]
    mask = [[query < length and key < length and sees(query, key) for key in range(max_len)]
            for query in range(max_len)]
    return types, mask


def test_our_objectives_are_v1s_task_idx_by_their_masks_and_token_types():
    """`V1_TASK_IDX` checked against v1's own definition of each task: the objective we give index k embeds and
    attends exactly as v1's task k does, so block k of a per-task tensor is the one trained for it."""
    assert sorted(V1_TASK_IDX) == [BIDIRECTIONAL, LEFT_TO_RIGHT, RIGHT_TO_LEFT, SEQ2SEQ]
    assert (TASK_DEFAULT, TASK_SEQ2SEQ) == (V1_TASK_IDX[BIDIRECTIONAL], 3)
    max_len, len_a, length = 12, torch.tensor([5]), torch.tensor([10])
    for objective, task_idx in V1_TASK_IDX.items():
        objectives = torch.tensor([objective])
        types, mask = v1_token_types_and_mask(task_idx, 5, 10, max_len)
        assert build_segment_ids(objectives, len_a, length, max_len)[0].tolist() == types, objective
        ours = build_attention_mask(objectives, len_a, length, max_len)[0]
        assert ours[:10].tolist() == mask[:10], objective  # padded query rows: ours see themselves, v1's nothing


def test_what_our_model_cannot_express_or_a_file_that_would_run_code_is_refused_by_name(tmp_path, capsys):
    state = v1_state(reference(40))
    relative = beside_bert_config(tmp_path / "v2", {**state, "bert.rel_pos_bias.weight": torch.randn(4, 32)},
                                  name="pytorch_model.bin")
    with pytest.raises(ValueError, match=r"relative position bias \(bert.rel_pos_bias.weight; UniLM v2"):
        load_hf_bert(relative.parent)

    lonely = tmp_path / "alone" / "unilm1-large-cased.bin"
    lonely.parent.mkdir()
    torch.save(state, lonely)
    with pytest.raises(FileNotFoundError, match="a weights file without a config.json .* BERT-large cased's"):
        load_hf_bert(lonely)

    class Runs:  # what a pickle that executes code on load looks like to the unpickler: a global to call
        def __reduce__(self):
            return (print, ("this ran",))

    hostile = beside_bert_config(tmp_path / "hostile", {**state, "x": Runs()}, name="unilm1-base-cased.bin")
    with pytest.raises(ValueError, match="it pickles print, which model weights do not hold"):
        load_hf_bert(hostile)
    assert "this ran" not in capsys.readouterr().out
    with pytest.raises(ValueError, match="--init .*notes.txt: a file"):
        (tmp_path / "notes.txt").write_text("x")
        load_init(tmp_path / "notes.txt")
