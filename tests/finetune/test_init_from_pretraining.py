"""Does pre-training help? Fine-tuning must start from *all* the pre-trained weights and see its
inputs exactly as pre-training did. A silent re-initialisation (segment rows 4/5, the MLM head's bias) or a
different packing would make the pre-trained and the from-scratch run start alike, which is what a flat
"pre-trained vs scratch" headline row looks like; these tests rule both out."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from finetune import seq2seq
from finetune.model_io import load_init
from finetune.tokenizer import load_tokenizer
from pretrain import checkpoint as ckpt
from pretrain.masks import SEQ2SEQ
from pretrain.model import ModelConfig, build_model


def _pretraining_checkpoint(model: torch.nn.Module, out: Path) -> Path:
    """A ZeRO-0 pre-training checkpoint as `pretrain.trainer` lays it out (DeepSpeed's module state, the fp32
    weights as safetensors, marker, latest)."""
    tag_dir = out / "checkpoints" / ckpt.tag_for_step(7)
    tag_dir.mkdir(parents=True)
    torch.save({"module": model.state_dict()}, tag_dir / "mp_rank_00_model_states.pt")
    ckpt.write_weights(tag_dir, model.state_dict())
    ckpt.write_marker(tag_dir, {"step": 7, "zero_stage": 0, "model_config": dataclasses.asdict(model.cfg)})
    ckpt.update_latest(out / "checkpoints", tag_dir.name)
    return out / "checkpoints"


def _trained_looking_model(vocab_size: int) -> torch.nn.Module:
    """A tiny model whose every tensor differs from a fresh init (so a re-initialised one cannot pass)."""
    torch.manual_seed(1)
    model = build_model(ModelConfig(vocab_size=vocab_size, hidden_size=32, num_layers=2, num_heads=4,
                                    intermediate_size=64, max_position_embeddings=256))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.3)
    return model


def test_every_pretrained_tensor_reaches_fine_tuning(tiny_init, tmp_path):
    tokenizer = load_tokenizer(tiny_init)
    pretrained = _trained_looking_model(tokenizer.vocab_size)
    loaded, _ = load_init(_pretraining_checkpoint(pretrained, tmp_path), vocab=tiny_init / "vocab.txt")
    expected, got = pretrained.state_dict(), loaded.state_dict()
    assert set(got) == set(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=0, msg=name)
    # the rows seq2seq uses and the MLM bias explicitly (HF BERT keeps 2 segment rows; ours has 6)
    torch.testing.assert_close(loaded.embeddings.segment.weight[4:6], pretrained.embeddings.segment.weight[4:6])
    torch.testing.assert_close(loaded.mlm_head.decoder.bias, pretrained.mlm_head.decoder.bias)
    assert loaded.mlm_head.decoder.weight is loaded.embeddings.token.weight  # still tied after loading


def test_more_positions_extend_the_table_and_leave_the_outputs_on_shorter_inputs_as_they_were(tiny_init, tmp_path):
    """`max_position_embeddings` (``--set max_position_embeddings=600``) beyond the model's 256: rows 256.. repeat
    the learned ones (row 256 + i = row i, microsoft/unilm's rule), the first 256 and every other tensor exact, so a
    sequence within 256 positions gives the same logits; from a pre-training checkpoint and from a HF directory."""
    tokenizer = load_tokenizer(tiny_init)
    checkpoints = _pretraining_checkpoint(_trained_looking_model(tokenizer.vocab_size), tmp_path)
    torch.manual_seed(2)
    input_ids = torch.randint(5, tokenizer.vocab_size, (2, 200))
    len_a, length = torch.tensor([150, 90]), torch.tensor([200, 170])
    for init in (checkpoints, tiny_init):
        base, _ = load_init(init, vocab=tiny_init / "vocab.txt", task="seq2seq")
        longer, _ = load_init(init, vocab=tiny_init / "vocab.txt", task="seq2seq", max_positions=600)
        table, learned = longer.embeddings.position.weight, base.embeddings.position.weight
        assert longer.cfg == dataclasses.replace(base.cfg, max_position_embeddings=600) and table.shape[0] == 600
        assert torch.equal(table[:256], learned) and torch.equal(table[256:512], learned)
        assert torch.equal(table[512:], learned[:88])
        assert all(torch.equal(tensor, base.state_dict()[name]) for name, tensor in longer.state_dict().items()
                   if name != "embeddings.position.weight")
        with torch.no_grad():
            logits = [model.eval().mlm_logits(model.encode_objective(input_ids, SEQ2SEQ, len_a, length))
                      for model in (base, longer)]
        assert torch.equal(logits[0], logits[1])
    with pytest.raises(ValueError, match="max_position_embeddings: 100 is fewer than the model's 256 positions"):
        load_init(tiny_init, max_positions=100)


def test_fine_tuning_loss_is_the_pretraining_seq2seq_loss_on_the_same_input(tiny_init):
    """[CLS] src [SEP] tgt [SEP], segments 4/5 via len_a, default positions: the fine-tuning loss (no smoothing)
    equals the pre-training forward's loss for objective SEQ2SEQ on the same tokens, masks and labels."""
    tokenizer = load_tokenizer(tiny_init)
    model = _trained_looking_model(tokenizer.vocab_size).eval()
    records = [{"src": "Shares in the airline rose after record profits.", "tgt": "Airline profits soar"},
               {"src": "The central bank kept interest rates on hold on Thursday.", "tgt": "Rates held"}]
    examples, _ = seq2seq.encode_examples(records, tokenizer, 64, 16, 512)
    packed = [seq2seq.pack_and_mask(e, tokenizer, 0.7, np.random.default_rng([3, i])) for i, e in enumerate(examples)]
    batch = seq2seq.collate(packed, tokenizer.pad_id)
    with torch.no_grad():
        finetune_loss = seq2seq.seq2seq_loss(model, batch, label_smoothing=0.0)
        pretrain_out = model(input_ids=batch["input_ids"], objective=torch.full((2,), SEQ2SEQ),
                             len_a=batch["len_a"], length=batch["length"],
                             masked_positions=batch["masked_positions"], masked_labels=batch["masked_labels"])
    torch.testing.assert_close(finetune_loss, pretrain_out.objective_losses["seq2seq"])
    torch.testing.assert_close(finetune_loss, pretrain_out.loss)  # no NSP term for seq2seq samples
    # targets only, originals as labels, [MASK] in the input
    for row, p in enumerate(packed):
        assert (p["masked_positions"] >= p["len_a"]).all()
        assert (batch["input_ids"][row, p["masked_positions"]] == tokenizer.mask_id).all()


def test_a_checkpoint_brings_its_shards_tokenizer_and_refuses_another_vocab(unilm_shards, tiny_init, tmp_path):
    """No --vocab needed: the run config in the checkpoint's marker names its shards, whose vocab.txt (checked
    against the recorded sha256) and recorded casing fine-tuning uses; another --vocab is refused, and shards that
    moved are named with the fix."""
    from common.files import sha256_file
    from data_prep.shard_format import read_manifest
    manifest = read_manifest(unilm_shards)
    vocab = unilm_shards / manifest["vocab"]["file"]
    model = _trained_looking_model(manifest["vocab"]["size"])
    checkpoints = _pretraining_checkpoint(model, tmp_path)
    tag_dir = checkpoints / ckpt.tag_for_step(7)

    def mark(shards: Path) -> None:
        ckpt.write_marker(tag_dir, {"step": 7, "zero_stage": 0, "model_config": dataclasses.asdict(model.cfg),
                                    "vocab_hash": sha256_file(vocab), "run_config": {"data": {"shards": str(shards)}}})

    mark(unilm_shards)
    loaded, tokenizer = load_init(checkpoints)
    assert tokenizer.vocab.sha256 == sha256_file(vocab) and tokenizer.lowercase is manifest["vocab"]["uncased"]
    assert load_init(checkpoints, vocab=vocab)[1].vocab.sha256 == tokenizer.vocab.sha256
    with pytest.raises(ValueError, match=r"--vocab .*: not the vocabulary .* was trained with"):
        load_init(checkpoints, vocab=tiny_init / "vocab.txt")
    mark(tmp_path / "moved")
    with pytest.raises(ValueError, match=r"cannot find the vocabulary of the shards .*give --vocab SHARDS/vocab.txt"):
        load_init(checkpoints)
    assert load_init(checkpoints, vocab=vocab)[1].vocab.sha256 == tokenizer.vocab.sha256


def test_prediction_and_decoding_name_the_way_from_a_pretraining_checkpoint(tmp_path):
    """`finetune.predict` and `finetune.decode` read fine-tuning outputs and HF exports: a pre-training checkpoint
    (its checkpoints/ directory or one tag) is refused with the two commands that make one of it."""
    from finetune.model_io import load_finetuned

    checkpoints = _pretraining_checkpoint(_trained_looking_model(64), tmp_path)
    for given in (checkpoints, checkpoints / ckpt.tag_for_step(7)):
        with pytest.raises(ValueError, match=rf"^{given} is a pre-training checkpoint: fine-tune it first "
                                             rf"\(python -m finetune.run --init {given} ...\) .*"
                                             rf"python -m pretrain.export {given} OUT"):
            load_finetuned(given, expect_task="seq2seq")
    with pytest.raises(ValueError, match=rf"^{tmp_path / 'nope'}: no such directory$"):
        load_finetuned(tmp_path / "nope")
