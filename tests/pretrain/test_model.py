"""The shared Transformer: config, presets, context visibility per objective, losses, tying, KV cache."""
from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pretrain.model as model_module
from data_prep.shard_format import Sample, ShardDataset
from pretrain.data import collate
from pretrain.kernels import CPU_LINEAR_VARIABLE, cpu_linear_backend
from pretrain.masks import (
    BIDIRECTIONAL,
    LEFT_TO_RIGHT,
    RIGHT_TO_LEFT,
    SEQ2SEQ,
    build_attention_mask,
    build_segment_ids,
)
from pretrain.model import IGNORE_INDEX, PretrainOutput, build_model, preset, training_flops

OBJECTIVES = (BIDIRECTIONAL, LEFT_TO_RIGHT, RIGHT_TO_LEFT, SEQ2SEQ)
NAMES = {BIDIRECTIONAL: "bidirectional_mlm", LEFT_TO_RIGHT: "left_to_right", RIGHT_TO_LEFT: "right_to_left",
         SEQ2SEQ: "seq2seq"}
TINY = dataclasses.replace(preset("tiny"), vocab_size=97, max_position_embeddings=32)


def tiny_model(**overrides) -> model_module.UniLMModel:
    torch.manual_seed(0)
    return build_model(dataclasses.replace(TINY, **overrides))


def make_batch(seed: int = 0, max_len: int = 12) -> dict[str, torch.Tensor]:
    """Five samples, every objective, NSP on one, padding and padded masked positions."""
    g = torch.Generator().manual_seed(seed)
    objective = torch.tensor([BIDIRECTIONAL, LEFT_TO_RIGHT, RIGHT_TO_LEFT, SEQ2SEQ, BIDIRECTIONAL])
    len_a = torch.tensor([5, 9, 12, 4, 6])
    length = torch.tensor([10, 9, 12, 8, 11])
    input_ids = torch.randint(5, TINY.vocab_size, (5, max_len), generator=g)
    input_ids = input_ids.masked_fill(torch.arange(max_len) >= length.unsqueeze(1), 0)
    masked_positions = torch.tensor([[1, 6, 0], [3, 0, 0], [2, 10, 11], [5, 6, 0], [2, 8, 0]])
    masked_labels = torch.randint(5, TINY.vocab_size, (5, 3), generator=g)
    masked_labels = masked_labels.masked_fill(torch.tensor([[0, 0, 1], [0, 1, 1], [0, 0, 0], [0, 0, 1],
                                                            [0, 0, 1]], dtype=torch.bool), IGNORE_INDEX)
    return dict(input_ids=input_ids, objective=objective, len_a=len_a, length=length,
                is_random_next=torch.tensor([1, -1, -1, -1, 0]), masked_positions=masked_positions,
                masked_labels=masked_labels)


# ------------------------------------------------------------------------------------------- config
def test_config_is_frozen_and_validated():
    cfg = preset("tiny")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.hidden_size = 128
    with pytest.raises(ValueError, match="divisible"):
        dataclasses.replace(cfg, num_heads=3)
    with pytest.raises(ValueError, match="hidden_dropout"):
        dataclasses.replace(cfg, hidden_dropout=1.5)
    with pytest.raises(ValueError, match="num_layers"):
        dataclasses.replace(cfg, num_layers=0)
    with pytest.raises(ValueError, match="unknown model preset"):
        preset("bert-huge")
    assert cfg.head_size == 16 and cfg.num_segment_types == 6


@pytest.mark.parametrize("name, low, high", [
    ("unilm-large", 334.5e6, 340e6), ("bert-large", 334.5e6, 340e6), ("bert-base", 109e6, 111e6),
    ("gpt", 116e6, 118e6),
])
def test_preset_parameter_counts(name, low, high):
    with torch.device("meta"):
        model = build_model(preset(name))
    assert low <= model.num_parameters() <= high
    assert preset(name).causal_lm == (name == "gpt")


def test_unilm_large_shape():
    cfg = preset("unilm-large")
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.intermediate_size, cfg.vocab_size,
            cfg.max_position_embeddings) == (24, 1024, 16, 4096, 28996, 512)


# ------------------------------------------------------------------------------------------- structure
def test_decoder_is_tied_to_token_embeddings():
    model = tiny_model()
    assert model.mlm_head.decoder.weight is model.embeddings.token.weight
    assert sum(p is model.embeddings.token.weight for p in model.parameters()) == 1
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model(**make_batch()).loss.backward()
    assert model.embeddings.token.weight.grad.abs().sum() > 0
    optimizer.step()
    assert torch.equal(model.mlm_head.decoder.weight, model.embeddings.token.weight)
    hidden = torch.randn(2, TINY.hidden_size)
    head = model.mlm_head
    manual = head.norm(F.gelu(head.dense(hidden))) @ model.embeddings.token.weight.T + head.decoder.bias
    torch.testing.assert_close(model.mlm_logits(hidden), manual)


@pytest.mark.parametrize("training", [True, False])
def test_attention_gets_one_additive_mask(monkeypatch, training):
    calls = []
    real = model_module.attention

    def spy(query, key, value, mask, dropout_p):
        calls.append((mask, dropout_p))
        return real(query, key, value, mask, dropout_p)

    monkeypatch.setattr(model_module, "attention", spy)
    batch = make_batch()
    tiny_model().train(training)(**batch)
    expected = build_attention_mask(batch["objective"], batch["len_a"], batch["length"], 12).unsqueeze(1)
    assert len(calls) == TINY.num_layers
    for mask, dropout_p in calls:  # the boolean mask as one additive mask: 0 where allowed, -inf where blocked
        assert torch.equal(mask == 0, expected) and torch.isneginf(mask[~expected]).all()
        assert dropout_p == (TINY.attention_dropout if training else 0.0)


def test_attention_without_dropout_goes_through_sdpa(monkeypatch):
    calls = []
    real = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **k: calls.append(k) or real(*a, **k))
    tiny_model().eval()(**make_batch())
    assert len(calls) == TINY.num_layers and all(k["dropout_p"] == 0.0 for k in calls)


def test_mlm_head_runs_only_on_masked_positions():
    model = tiny_model()
    shapes = []
    model.mlm_head.register_forward_hook(lambda module, args, out: shapes.append(tuple(args[0].shape)))
    model(**make_batch())
    assert shapes == [(5, 3, TINY.hidden_size)]


# ------------------------------------------------------------------------------------------- visibility
def encode_batch(model, input_ids, objective, len_a, length):
    max_len = input_ids.shape[1]
    return model.encode(input_ids, build_segment_ids(objective, len_a, length, max_len),
                        build_attention_mask(objective, len_a, length, max_len))


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_each_position_sees_only_allowed_context(objective):
    """Perturb key k: the output at query q changes iff the mask lets q see k (masks are transitively closed,
    so with several layers the dependency set is the mask itself)."""
    model = tiny_model().eval()
    max_len, length, len_a = 10, 8, 4 if objective in (BIDIRECTIONAL, SEQ2SEQ) else 8
    args = (torch.tensor([objective]), torch.tensor([len_a]), torch.tensor([length]))
    input_ids = torch.randint(5, TINY.vocab_size, (1, max_len), generator=torch.Generator().manual_seed(1))
    mask = build_attention_mask(*args, max_len)[0]
    with torch.no_grad():
        base = encode_batch(model, input_ids, *args)[0]
        for key in range(max_len):
            perturbed = input_ids.clone()
            perturbed[0, key] = (perturbed[0, key] + 1) % TINY.vocab_size
            changed = (encode_batch(model, perturbed, *args)[0] - base).abs().amax(-1) > 1e-6
            assert torch.equal(changed[:length], mask[:length, key]), (objective, key)


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_loss_sees_only_allowed_context(objective):
    """Loss at one masked query: a token it may not see leaves the loss bit-identical, one it may see moves it."""
    model = tiny_model().eval()
    batch = make_batch()
    row = [int(o) for o in batch["objective"]].index(objective)
    batch = {k: v[row:row + 1] for k, v in batch.items()}
    query = int(batch["masked_positions"][0, 0])
    batch["masked_positions"], batch["masked_labels"] = batch["masked_positions"][:, :1], batch["masked_labels"][:, :1]
    batch["is_random_next"] = torch.tensor([-1])
    mask = build_attention_mask(batch["objective"], batch["len_a"], batch["length"], batch["input_ids"].shape[1])[0]
    with torch.no_grad():
        base = model(**batch).loss
        for key in range(int(batch["length"][0])):
            if key == query:
                continue
            perturbed = dict(batch, input_ids=batch["input_ids"].clone())
            perturbed["input_ids"][0, key] = (perturbed["input_ids"][0, key] + 1) % TINY.vocab_size
            moved = model(**perturbed).loss != base
            assert bool(moved) == bool(mask[query, key]), (objective, query, key)


def test_padding_does_not_change_real_positions_and_stays_finite():
    model = tiny_model().eval()
    batch = make_batch()
    with torch.no_grad():
        padded = encode_batch(model, batch["input_ids"], batch["objective"], batch["len_a"], batch["length"])
        assert torch.isfinite(padded).all()
        for b in range(5):
            n = int(batch["length"][b])
            alone = encode_batch(model, batch["input_ids"][b:b + 1, :n], batch["objective"][b:b + 1],
                                 batch["len_a"][b:b + 1], batch["length"][b:b + 1])
            torch.testing.assert_close(padded[b, :n], alone[0], atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------- losses
def test_losses_match_a_manual_computation():
    model = tiny_model().eval()
    batch = make_batch()
    with torch.no_grad():
        out = model(**batch)
        hidden = encode_batch(model, batch["input_ids"], batch["objective"], batch["len_a"], batch["length"])
        per_objective: dict[str, list[torch.Tensor]] = {}
        for b in range(5):
            for position, label in zip(batch["masked_positions"][b], batch["masked_labels"][b]):
                if label == IGNORE_INDEX:
                    continue
                loss = F.cross_entropy(model.mlm_logits(hidden[b, position]), label)
                per_objective.setdefault(NAMES[int(batch["objective"][b])], []).append(loss)
        nsp_rows = [0, 4]  # bidirectional with is_random_next >= 0
        nsp_logits = model.nsp_head(model.pooled(hidden))
        nsp = F.cross_entropy(nsp_logits[nsp_rows], batch["is_random_next"][nsp_rows])
    assert isinstance(out, PretrainOutput)
    assert set(out.objective_losses) == set(per_objective) | {"nsp"}
    for name, losses in per_objective.items():
        torch.testing.assert_close(out.objective_losses[name], torch.stack(losses).mean())
        assert int(out.objective_tokens[name]) == len(losses)
    torch.testing.assert_close(out.objective_losses["nsp"], nsp)
    assert int(out.objective_tokens["nsp"]) == 2
    all_tokens = torch.cat([torch.stack(v) for v in per_objective.values()])
    torch.testing.assert_close(out.loss, all_tokens.mean() + nsp)
    assert not any(v.requires_grad for v in out.objective_losses.values())


def test_nsp_only_on_bidirectional_samples_with_a_label():
    model = tiny_model().eval()
    batch = make_batch()
    with torch.no_grad():
        base = model(**batch).loss
        # NSP labels on non-bidirectional samples are ignored
        ignored = dict(batch, is_random_next=torch.tensor([1, 1, 0, 1, 0]))
        assert model(**ignored).loss == base
        no_nsp = model(**dict(batch, is_random_next=torch.full((5,), -1)))
    assert "nsp" not in no_nsp.objective_losses


@pytest.mark.parametrize("causal_lm", [False, True])
def test_training_flops_are_torchs_count_of_a_forward_and_backward(causal_lm, monkeypatch, request):
    """MFU's numerator, `training_flops`, against torch's FLOP counter over a real training forward + backward (dropout
    on) of full-length samples of every objective: no padding or unused masked slot, the work it leaves out on
    purpose. torch's Linear, whose GEMMs the counter sees (it does not see oneDNN's); the one small matmul it adds
    is the per-objective loss report's."""
    from torch.utils.flop_counter import FlopCounterMode

    monkeypatch.setenv(CPU_LINEAR_VARIABLE, "torch")
    cpu_linear_backend.cache_clear()  # the process's choice, made by an earlier test: oneDNN on AMD CPUs
    request.addfinalizer(cpu_linear_backend.cache_clear)  # and this test's is not left to the next ones
    cfg = dataclasses.replace(preset("tiny"), causal_lm=causal_lm)
    torch.manual_seed(0)
    model = build_model(cfg)
    samples, seq_len, per_sample = 4, 32, 5
    g = torch.Generator().manual_seed(0)
    masked_positions = torch.stack([torch.randperm(seq_len - 2, generator=g)[:per_sample] + 1 for _ in range(samples)])
    batch = dict(input_ids=torch.randint(5, cfg.vocab_size, (samples, seq_len), generator=g),
                 objective=torch.tensor(OBJECTIVES), len_a=torch.tensor([12, seq_len, seq_len, 20]),
                 length=torch.full((samples,), seq_len), is_random_next=torch.tensor([1, -1, -1, -1]),
                 masked_positions=masked_positions,
                 masked_labels=torch.randint(5, cfg.vocab_size, (samples, per_sample), generator=g))
    with FlopCounterMode(display=False) as counter:
        model(**batch).loss.backward()
    predictions = samples * (seq_len - 1) if causal_lm else samples * per_sample
    expected = training_flops(cfg, samples * seq_len, samples * seq_len**2, predictions, samples)
    assert counter.get_total_flops() == pytest.approx(expected, rel=1e-3)


@pytest.mark.parametrize("causal_lm", [False, True])
def test_gradients_finite_for_every_objective(causal_lm):
    model = tiny_model(causal_lm=causal_lm).train()
    batch = make_batch()
    for objective in OBJECTIVES:
        model.zero_grad()
        out = model(**dict(batch, objective=torch.full((5,), objective)))
        out.loss.backward()
        assert torch.isfinite(out.loss)
        for name, parameter in model.named_parameters():
            assert parameter.grad is not None and torch.isfinite(parameter.grad).all(), (objective, name)


def test_causal_lm_predicts_every_next_token():
    model = tiny_model(causal_lm=True).eval()
    batch = make_batch()
    with torch.no_grad():
        out = model(**dict(batch, objective=torch.full((5,), SEQ2SEQ)))  # objective is forced to left-to-right
        l2r = torch.full((5,), LEFT_TO_RIGHT)
        hidden = encode_batch(model, batch["input_ids"], l2r, batch["length"], batch["length"])
        losses = []
        for b in range(5):
            n = int(batch["length"][b])
            losses.append(F.cross_entropy(model.mlm_logits(hidden[b, :n - 1]), batch["input_ids"][b, 1:n],
                                          reduction="none"))
    assert set(out.objective_losses) == {"causal_lm"}
    expected = torch.cat(losses)
    assert int(out.objective_tokens["causal_lm"]) == expected.numel()
    torch.testing.assert_close(out.loss, expected.mean())
    torch.testing.assert_close(out.objective_losses["causal_lm"], expected.mean())


# ------------------------------------------------------------------------------------------- speed switches
def test_activation_checkpointing_gives_the_same_loss_and_gradients():
    batch = make_batch()
    results = []
    for enabled in (False, True):
        model = tiny_model().train()
        model.activation_checkpointing = enabled
        torch.manual_seed(123)  # same dropout masks: non-reentrant checkpointing replays the RNG state
        out = model(**batch)
        out.loss.backward()
        results.append((out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    torch.testing.assert_close(results[0][0], results[1][0])
    for name, grad in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], grad, msg=name)


def test_activation_checkpointing_keeps_no_layer_keys_and_values_during_the_forward():
    """Under activation checkpointing autograd keeps only each block's input; the keys and values a block returns
    (for decoding's cache) are dropped as soon as the next block starts when no cache is asked for."""
    import weakref

    model = tiny_model(num_layers=3).train()
    model.activation_checkpointing = True
    keys, alive_at_last_layer = [], []
    for layer in model.layers:
        layer.register_forward_hook(lambda module, inputs, output: keys.append(weakref.ref(output[1][0])))
    last = model.layers[-1]
    last.register_forward_pre_hook(lambda module, inputs: alive_at_last_layer.append(
        [ref() is not None for ref in keys]))
    model(**make_batch()).loss.backward()
    # in the forward (the backward's recomputation calls the blocks again): the first block's are gone, the
    # second's go when the third block's replace them
    assert alive_at_last_layer[0] == [False, True]


@pytest.mark.parametrize("shards", ["unilm_shards", "bert_shards"])
def test_packed_rows_give_the_loss_and_gradients_of_one_sample_per_row(shards, request):
    """Real shard samples, the shortest ones packed two or more to a row; dropout off (its draws follow the layout).
    fp32 on the CPU: equal to 1e-5 relative (a row's masked-out keys add exactly 0 to its softmax)."""
    dataset = ShardDataset(request.getfixturevalue(shards))
    shortest = sorted(range(len(dataset)), key=lambda i: dataset[i].length)[:16]
    samples = [dataset[i] for i in shortest + list(range(16))]
    pad_id = dataset.special_tokens["pad"]
    plain, packed = collate(samples, pad_id, 64), collate(samples, pad_id, 64, pack=True)
    assert packed["input_ids"].shape[0] <= len(samples) - 8
    model = tiny_model(vocab_size=4000, max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0)
    outputs, gradients = [], []
    for batch in (plain, packed):
        model.zero_grad()
        output = model(**batch)
        output.loss.backward()
        outputs.append(output)
        gradients.append({name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None})
    torch.testing.assert_close(outputs[1].loss, outputs[0].loss, rtol=1e-5, atol=0)
    torch.testing.assert_close(outputs[1].objective_sums, outputs[0].objective_sums, rtol=1e-5, atol=1e-6)
    assert torch.equal(outputs[1].objective_counts, outputs[0].objective_counts)
    assert gradients[1].keys() == gradients[0].keys()
    for name, gradient in gradients[0].items():
        torch.testing.assert_close(gradients[1][name], gradient, rtol=1e-5, atol=1e-7, msg=name)


def test_packed_rows_are_refused_for_a_causal_lm():
    model = tiny_model(causal_lm=True)
    batch = make_batch()
    with pytest.raises(ValueError, match="packed rows"):
        model(**batch, position_ids=torch.zeros_like(batch["input_ids"]),
              token_sample=torch.zeros_like(batch["input_ids"]), sample_starts=torch.zeros(5, dtype=torch.long))


def test_layer_norm_is_apex_when_importable_else_torch():
    try:
        from apex.normalization import FusedLayerNorm
    except ImportError:
        assert model_module.LayerNorm is torch.nn.LayerNorm
    else:
        assert model_module.LayerNorm is FusedLayerNorm


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fused_layer_norm_matches_torch_on_gpu():
    fused = pytest.importorskip("apex.normalization").FusedLayerNorm(64, eps=1e-12).cuda()
    reference = torch.nn.LayerNorm(64, eps=1e-12).cuda()
    x = torch.randn(8, 16, 64, device="cuda")
    torch.testing.assert_close(fused(x), reference(x), atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------- KV cache
@pytest.mark.parametrize("objective, len_a, prefix, step", [
    (SEQ2SEQ, 4, 4, 1), (SEQ2SEQ, 4, 6, 3), (LEFT_TO_RIGHT, 10, 3, 2), (LEFT_TO_RIGHT, 10, 5, 1),
])
def test_incremental_encode_with_cache_equals_full_recompute(objective, len_a, prefix, step):
    """UniLM decoding: encode a prefix once, then feed `step` new positions at a time against the cache."""
    model = tiny_model().eval()
    length = 10
    args = (torch.tensor([objective, objective]), torch.tensor([len_a, len_a]), torch.tensor([length, length]))
    input_ids = torch.randint(5, TINY.vocab_size, (2, length), generator=torch.Generator().manual_seed(2))
    mask = build_attention_mask(*args, length)
    segments = build_segment_ids(*args, length)
    with torch.no_grad():
        full = model.encode(input_ids, segments, mask)
        pieces, cache = [], None
        hidden, cache = model.encode(input_ids[:, :prefix], segments[:, :prefix], mask[:, :prefix, :prefix],
                                     use_cache=True)
        pieces.append(hidden)
        for start in range(prefix, length, step):
            end = min(start + step, length)
            hidden, cache = model.encode(input_ids[:, start:end], segments[:, start:end], mask[:, start:end, :end],
                                         past_key_values=cache, use_cache=True)
            pieces.append(hidden)
    assert len(cache) == TINY.num_layers and cache[0][0].shape == (2, TINY.num_heads, length, TINY.head_size)
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-5, rtol=1e-5)


def test_cache_can_drop_a_placeholder_position():
    """UniLM's decoding step feeds [token, MASK], keeps the token's keys and drops the MASK's."""
    model = tiny_model().eval()
    objective, len_a, length = torch.tensor([SEQ2SEQ]), torch.tensor([4]), torch.tensor([6])
    input_ids = torch.randint(5, TINY.vocab_size, (1, 6), generator=torch.Generator().manual_seed(3))
    mask, segments = build_attention_mask(objective, len_a, length, 6), build_segment_ids(objective, len_a, length, 6)
    with torch.no_grad():
        full = model.encode(input_ids, segments, mask)
        _, cache = model.encode(input_ids[:, :5], segments[:, :5], mask[:, :5, :5], use_cache=True)
        placeholder = torch.tensor([[1]])
        _, with_placeholder = model.encode(placeholder, segments[:, 5:], mask[:, 5:, :6], past_key_values=cache,
                                           use_cache=True)
        trimmed = tuple((k[:, :, :5], v[:, :, :5]) for k, v in with_placeholder)
        last = model.encode(input_ids[:, 5:], segments[:, 5:], mask[:, 5:, :6], past_key_values=trimmed)
    torch.testing.assert_close(last, full[:, 5:], atol=1e-5, rtol=1e-5)


def test_training_forward_and_step_sums_never_read_the_device(monkeypatch, one_rank_group):
    """A forward + backward and `StepSums.add` per micro-batch never copy a value to the host (on a GPU each such
    read waits for every queued kernel); only `StepSums.reduce` does, once per step."""
    from pretrain.metrics import StepSums

    model = tiny_model().train()
    sums = StepSums("cpu")
    batches = [make_batch(seed) for seed in range(2)]

    def host_read(*_args, **_kwargs):
        raise AssertionError("a tensor value was read on the host")

    with monkeypatch.context() as patch:
        for name in ("item", "tolist", "__float__", "__int__", "__bool__"):
            patch.setattr(torch.Tensor, name, host_read)
        for batch in batches:
            out = model(**batch)
            out.loss.backward()
            sums.add(batch, out)
    reports = [model(**batch) for batch in batches]
    stats = sums.reduce(stop=False)
    assert stats["tokens"] == sum(int(batch["length"].sum()) for batch in batches)
    assert stats["objectives"].keys() == reports[0].objective_losses.keys() | reports[1].objective_losses.keys()


@pytest.mark.slow  # the compiler's first CPU build takes 20-40 s on 2 cores
def test_compiled_blocks_match_eager_in_fp32():
    """Same outputs, loss and gradients as the eager model (dropout off); the compiler reorders fp32 sums and fuses
    LayerNorm/gelu, so agreement is to 1e-5 relative, not bit for bit. Parameter names are unchanged."""
    cfg = dataclasses.replace(TINY, num_layers=1, hidden_dropout=0.0, attention_dropout=0.0)
    batch = make_batch()
    models = []
    for compiled in (False, True):
        torch.manual_seed(0)
        models.append(build_model(cfg).train())
        if compiled:
            models[-1].compile_blocks()
    eager, compiled = models
    assert list(compiled.state_dict()) == list(eager.state_dict())
    eager_out, compiled_out = eager(**batch), compiled(**batch)
    torch.testing.assert_close(compiled_out.loss, eager_out.loss, rtol=1e-5, atol=0)
    torch.testing.assert_close(compiled_out.objective_sums, eager_out.objective_sums, rtol=1e-5, atol=1e-6)
    eager_out.loss.backward()
    compiled_out.loss.backward()
    for (name, reference), mine in zip(eager.named_parameters(), compiled.parameters()):
        # atol: gradients that are 0 in exact arithmetic (the key bias: softmax ignores a per-row constant) are
        # rounding noise of ~1e-9 on both sides
        torch.testing.assert_close(mine.grad, reference.grad, rtol=1e-5, atol=1e-6, msg=name)


class ApexStyleLayerNorm(nn.Module):
    """apex.normalization.FusedLayerNorm's interface (apex is not on PyPI): its constructor and attributes, and on
    CPU tensors its computation, ``F.layer_norm``."""

    def __init__(self, normalized_shape: int, eps: float = 1e-5, elementwise_affine: bool = True) -> None:
        super().__init__()
        self.normalized_shape, self.eps, self.elementwise_affine = (normalized_shape,), eps, elementwise_affine
        self.weight = nn.Parameter(torch.ones(normalized_shape))
        self.bias = nn.Parameter(torch.zeros(normalized_shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


def test_compiled_blocks_take_torchs_layer_norm_with_the_same_parameters_when_apex_is_in_use(monkeypatch):
    monkeypatch.setattr(model_module, "LayerNorm", ApexStyleLayerNorm)
    torch.manual_seed(0)
    model = build_model(dataclasses.replace(TINY, hidden_dropout=0.0, attention_dropout=0.0))
    names, parameters = list(model.state_dict()), list(model.parameters())
    batch = make_batch()
    before = model(**batch)
    compiled = []
    monkeypatch.setattr(nn.Module, "compile", lambda module: compiled.append(module))  # the swap alone, eagerly
    model.compile_blocks()
    assert compiled == list(model.layers)
    norms = {name: type(module) for name, module in model.named_modules() if name.endswith("norm")}
    assert {name for name, kind in norms.items() if kind is nn.LayerNorm} == {
        f"layers.{index}.{norm}" for index in range(TINY.num_layers) for norm in ("attention_norm", "ffn_norm")}
    assert {kind for name, kind in norms.items() if not name.startswith("layers.")} == {ApexStyleLayerNorm}
    assert list(model.state_dict()) == names and all(a is b for a, b in zip(model.parameters(), parameters))
    assert model.layers[0].ffn_norm.eps == TINY.layer_norm_eps
    after = model(**batch)
    torch.testing.assert_close(after.loss, before.loss, rtol=0, atol=0)


def varied_samples(count: int, max_len: int, vocab_size: int, seed: int = 0) -> list[Sample]:
    """Samples of every objective and of lengths from 16 to ``max_len`` (a quarter of them full length), 15 %
    masked, NSP labels on the bidirectional ones."""
    g = np.random.default_rng(seed)
    samples = []
    for index in range(count):
        length = max_len if index % 4 == 0 else int(g.integers(16, max_len))
        objective = OBJECTIVES[index % len(OBJECTIVES)]
        positions = np.sort(g.choice(np.arange(1, length - 1), size=max(1, length * 15 // 100), replace=False))
        samples.append(Sample(input_ids=g.integers(5, vocab_size, length), objective=objective,
                              segment_a_length=int(g.integers(2, length - 1)),
                              is_random_next=int(g.integers(0, 2)) if objective == BIDIRECTIONAL else -1,
                              masked_positions=positions, masked_labels=g.integers(5, vocab_size, len(positions))))
    return samples


def fast_path_errors(device: str, dtype: torch.dtype) -> dict[str, tuple[float, float]]:
    """Loss and per-parameter gradients of the model in ``dtype``, eager and with all three fast paths (compiled
    blocks, chunked loss, packed rows), as relative errors against fp32 with the same (``dtype``-rounded) weights
    on the same samples, whose attention runs SDPA's math kernel (not a fused kernel the others may share);
    dropout off."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cfg = dataclasses.replace(preset("tiny"), vocab_size=4000, hidden_size=256, num_heads=4, intermediate_size=1024,
                              hidden_dropout=0.0, attention_dropout=0.0)
    torch.manual_seed(0)
    reference = build_model(cfg).to(device=device, dtype=dtype).float().train()
    samples = varied_samples(12, 128, cfg.vocab_size)
    batches = {packed: {k: v.to(device) for k, v in collate(samples, 0, 128, pack=packed).items()}
               for packed in (False, True)}
    assert batches[True]["input_ids"].shape[0] < len(samples)
    results = {}
    for name in ("fp32", "eager", "fast"):
        model = build_model(cfg).to(device).train()
        model.load_state_dict(reference.state_dict())
        if name != "fp32":
            model.to(dtype)
        if name == "fast":
            model.compile_blocks()
            model.chunked_loss = True
        with sdpa_kernel(SDPBackend.MATH) if name == "fp32" else contextlib.nullcontext():
            out = model(**batches[name == "fast"])
            out.loss.backward()
        results[name] = {"loss": out.loss.detach().double(),
                         **{n: p.grad.double() for n, p in model.named_parameters()}}

    def error(value: torch.Tensor, exact: torch.Tensor) -> float:
        return ((value - exact).norm() / exact.norm().clamp(min=1e-12)).item()

    return {key: (error(results["fast"][key], exact), error(results["eager"][key], exact))
            for key, exact in results["fp32"].items() if exact.norm() > 1e-6}  # not the key bias (0 exactly)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fast_paths_in_half_precision_on_cuda_are_as_accurate_as_eager(dtype):
    """Compiled blocks + chunked loss + packed rows against fp32 are at most 1.5x as far off as the eager model in
    the same dtype (+2e-3: the compiler keeps some fused intermediates in fp32 where eager rounds them, or the
    reverse); and eager itself within 25 % of fp32's math-kernel attention everywhere (half-precision rounding is
    far below that; an attention kernel fault that eager and fast share is not)."""
    for key, (fast, eager) in fast_path_errors("cuda", dtype).items():
        assert fast <= 1.5 * eager + 2e-3 and eager < 0.25, (key, fast, eager)
