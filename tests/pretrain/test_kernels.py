"""pretrain.kernels: the CPU fast paths compute what torch's own ops compute. (What retaining freed memory saves in
page faults is measured by `make bench-model`.)"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close
from torch.utils.checkpoint import checkpoint

from pretrain import kernels
from pretrain.kernels import Linear, _scaled_keep_mask, dropout_add, onednn_linear_available


# ------------------------------------------------------------------------------------------------ Linear
def test_onednn_is_used_where_torch_has_it():
    assert onednn_linear_available() == torch.backends.mkldnn.is_available()


@pytest.mark.parametrize("setting, vendor, available, chosen", [
    (None, "AuthenticAMD", True, "onednn"),  # MKL's slower code path on non-Intel CPUs
    ("auto", None, True, "onednn"),
    (None, "GenuineIntel", True, "few-rows-onednn"),  # MKL's own kernels, at least as fast there but for few rows
    ("onednn", "GenuineIntel", True, "onednn"),
    ("torch", "GenuineIntel", True, "torch"),
    ("onednn", "AuthenticAMD", False, "torch"),  # not usable here
    (" Torch ", "AuthenticAMD", True, "torch"),
])
def test_cpu_linear_backend_by_vendor_and_setting(setting, vendor, available, chosen):
    assert kernels.choose_cpu_linear(setting, vendor, available) == chosen


def test_few_rows_run_on_onednn_and_more_on_torchs_linear(monkeypatch):
    if not onednn_linear_available():
        pytest.skip("torch has no oneDNN linear here")
    monkeypatch.setattr(kernels, "cpu_linear_backend", lambda: "few-rows-onednn")
    calls = []
    monkeypatch.setattr(kernels, "_ONEDNN", lambda *args: calls.append(args[0].shape[0]) or F.linear(*args[:3]))
    layer = Linear(8, 5)
    for rows in (1, kernels.FEW_ROWS - 1, kernels.FEW_ROWS, 64):
        layer(torch.randn(rows, 8, requires_grad=True)).sum().backward()
    assert calls == [1, 1, kernels.FEW_ROWS - 1, kernels.FEW_ROWS - 1]  # forward and input gradient each


def test_cpu_linear_setting_must_be_known():
    with pytest.raises(ValueError, match="UNILM_CPU_LINEAR='mkl': expected auto, onednn or torch"):
        kernels.choose_cpu_linear("mkl", "GenuineIntel", True)


@pytest.fixture(params=["onednn", "torch", "few-rows-onednn"])
def cpu_linear(request, monkeypatch):
    """Each `Linear` test runs on every CPU backend choice, whichever this machine's CPU would make."""
    if request.param == "onednn" and not onednn_linear_available():
        pytest.skip("torch has no oneDNN linear here")
    monkeypatch.setattr(kernels, "cpu_linear_backend", lambda: request.param)
    return request.param


def test_linear_keeps_nn_linear_parameters_and_names():
    layer = Linear(6, 4)
    assert isinstance(layer, nn.Linear)
    assert list(layer.state_dict()) == ["weight", "bias"]
    assert list(Linear(6, 4, bias=False).state_dict()) == ["weight"]


@pytest.mark.parametrize("shape, bias", [((7, 24), True), ((3, 5, 24), False), ((2, 3, 4, 24), True)])
def test_linear_matches_torch_forward_and_backward(shape, bias, cpu_linear):
    torch.manual_seed(0)
    ours, reference = Linear(24, 40, bias=bias), nn.Linear(24, 40, bias=bias)
    reference.load_state_dict(ours.state_dict())
    x = torch.randn(shape, requires_grad=True)
    x_reference = x.detach().clone().requires_grad_()
    grad = torch.randn(*shape[:-1], 40)
    out, out_reference = ours(x), reference(x_reference)
    out.backward(grad)
    out_reference.backward(grad)
    assert out.shape == out_reference.shape
    assert_close(out, out_reference, rtol=1e-5, atol=1e-5)
    assert_close(x.grad, x_reference.grad, rtol=1e-5, atol=1e-5)
    assert_close(ours.weight.grad, reference.weight.grad, rtol=1e-5, atol=1e-5)
    assert ours.weight.grad.is_contiguous()  # same layout as the parameter: accumulation needs no copy
    if bias:
        assert_close(ours.bias.grad, reference.bias.grad, rtol=1e-5, atol=1e-5)


def test_linear_is_as_accurate_as_torch_against_float64(cpu_linear):
    torch.manual_seed(1)
    layer = Linear(768, 3072)
    x = torch.randn(64, 768)
    exact = F.linear(x.double(), layer.weight.double(), layer.bias.double())
    ours_error = (layer(x).double() - exact).abs().max().item()
    torch_error = (F.linear(x, layer.weight, layer.bias).double() - exact).abs().max().item()
    assert ours_error <= 4 * torch_error + 1e-6


def test_linear_without_grad_frozen_weight_strided_input_and_empty_batch(cpu_linear):
    torch.manual_seed(2)
    layer = Linear(8, 5)
    x = torch.randn(8, 6).t()  # non-contiguous [6, 8]
    with torch.no_grad():
        assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    layer.weight.requires_grad_(False)
    x = torch.randn(3, 8, requires_grad=True)
    layer(x).sum().backward()
    assert layer.weight.grad is None and layer.bias.grad is not None
    assert_close(x.grad, layer.weight.sum(0).expand(3, 8), rtol=1e-5, atol=1e-5)
    assert layer(torch.zeros(0, 8)).shape == (0, 5)


def test_linear_in_bfloat16_or_under_autocast_is_torchs_linear():
    layer = Linear(8, 5).to(torch.bfloat16)
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    layer, x = Linear(8, 5), torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
        assert out.dtype == torch.bfloat16 and torch.equal(out, F.linear(x, layer.weight, layer.bias))


# ------------------------------------------------------------------------------------------------ dropout
def _effective_p(p: float) -> float:
    return round(p * 32768) / 32768


@pytest.mark.parametrize("p", [0.01, 0.1, 0.5, 0.9])
def test_dropout_mask_drops_p_of_elements_in_every_lane_with_exact_scale(p):
    torch.manual_seed(3)
    n = 2_000_003  # not a multiple of 4: the last word is only partly used
    mask = _scaled_keep_mask(torch.empty(n), p)
    q = _effective_p(p)
    kept = mask != 0
    assert torch.equal(mask[kept], torch.full((int(kept.sum()),), 1 / (1 - q)))
    # each element's 16 bits come from one of four lanes of a 64-bit word: all four must drop p of their elements
    for lane in range(4):
        dropped = (~kept[lane::4]).double()
        sigma = (q * (1 - q) / dropped.numel()) ** 0.5
        assert abs(dropped.mean().item() - q) < 5 * sigma, (lane, dropped.mean().item(), q)
    assert abs(mask.double().mean().item() - 1.0) < 5 * (q / (1 - q) / n) ** 0.5  # the expectation is kept
    # neighbours are independent: the lag-1 correlation of the keep indicators is noise
    a, b = kept[:-1].double(), kept[1:].double()
    correlation = ((a - a.mean()) * (b - b.mean())).mean() / (a.std() * b.std())
    assert abs(correlation.item()) < 5 / n ** 0.5


def test_dropout_add_forward_and_backward_use_one_mask():
    torch.manual_seed(4)
    x = (torch.rand(5, 7, 33) + 0.5).requires_grad_()
    residual = torch.randn(5, 7, 33, requires_grad=True)
    out = dropout_add(x, 0.3, training=True, residual=residual)
    grad = torch.randn_like(out)
    out.backward(grad)
    applied = (out - residual).detach() / x.detach()  # the scaled mask the forward used
    q = _effective_p(0.3)
    assert torch.allclose(applied[applied > 0.5], torch.tensor(1 / (1 - q)), rtol=1e-5)
    assert torch.allclose(applied[applied <= 0.5], torch.tensor(0.0), atol=1e-5)
    assert_close(x.grad, grad * applied, rtol=1e-5, atol=1e-5)
    assert torch.equal(residual.grad, grad)


def test_dropout_add_is_seeded_identity_when_off_and_torch_on_other_dtypes():
    x, residual = torch.randn(4, 9), torch.randn(4, 9)
    torch.manual_seed(5)
    first = dropout_add(x, 0.1, training=True)
    torch.manual_seed(5)
    assert torch.equal(dropout_add(x, 0.1, training=True), first)
    assert not torch.equal(dropout_add(x, 0.1, training=True), first)  # the generator moved on
    assert torch.equal(dropout_add(x, 0.1, training=False, residual=residual), residual + x)
    assert torch.equal(dropout_add(x, 0.0, training=True), x)
    torch.manual_seed(6)
    half = dropout_add(x.bfloat16(), 0.5, training=True)
    torch.manual_seed(6)
    assert torch.equal(half, F.dropout(x.bfloat16(), 0.5, training=True))
    assert dropout_add(torch.ones(1), 0.5, training=True).shape == (1,)


def test_dropout_add_replays_under_activation_checkpointing():
    torch.manual_seed(7)
    weight = torch.randn(16, 16, requires_grad=True)

    def block(x: torch.Tensor) -> torch.Tensor:
        return dropout_add(torch.tanh(x @ weight), 0.2, training=True, residual=x)

    x = torch.randn(6, 16)
    grads = []
    for recompute in (False, True):
        torch.manual_seed(8)
        out = checkpoint(block, x, use_reentrant=False) if recompute else block(x)
        (out ** 2).sum().backward()
        grads.append((out.detach(), weight.grad.clone()))
        weight.grad = None
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


# ------------------------------------------------------------------------------------------------ attention
def _attention_inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 3, 5, 8, generator=g, requires_grad=True) for _ in range(3))
    allowed = torch.rand(2, 1, 5, 5, generator=g) < 0.6
    allowed |= torch.eye(5, dtype=torch.bool)  # every query sees a key
    mask = torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))
    return q, k, v, mask


def test_attention_without_dropout_is_sdpa_itself():
    q, k, v, mask = _attention_inputs()
    assert torch.equal(kernels.attention(q, k, v, mask, 0.0),
                       F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


def _strided_heads(batch: int, length: int, heads: int, head_size: int, generator: torch.Generator) -> torch.Tensor:
    """Float[B, heads, L, d] as the model's attention sees it: a view of a [B, L, heads·d] projection."""
    x = torch.randn(batch, length, heads * head_size, generator=generator, requires_grad=True)
    return x.view(batch, length, heads, head_size).transpose(1, 2)


@pytest.mark.parametrize("key_length", [5, 7])
@pytest.mark.parametrize("masked", [True, False])
def test_attention_dropout_on_the_cpu_is_softmax_then_dropout_adds_mask(key_length, masked):
    g = torch.Generator().manual_seed(1)
    q, k, v = (_strided_heads(2, length, 3, 8, g) for length in (5, key_length, key_length))
    mask = torch.zeros(2, 1, 5, key_length).masked_fill_(torch.rand(2, 1, 5, key_length, generator=g) > 0.6,
                                                          float("-inf")) if masked else None
    if masked:
        mask[..., 0] = 0.0  # every query sees a key
    weights = torch.linspace(-1, 1, 8)
    torch.manual_seed(3)
    out = kernels.attention(q, k, v, mask, 0.25)
    (out * weights).sum().backward(inputs=[q, k, v])
    ours = out.detach(), q.grad, k.grad, v.grad
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    torch.manual_seed(3)  # the same draw as dropout_add's
    scores = q @ k.transpose(-1, -2) / 8 ** 0.5
    probs = torch.softmax(scores if mask is None else scores + mask, dim=-1)
    reference = (probs * _scaled_keep_mask(probs, 0.25)) @ v
    (reference * weights).sum().backward()
    for a, b in zip(ours, (reference.detach(), q.grad, k.grad, v.grad)):
        assert_close(a, b, rtol=1e-5, atol=1e-6)
    dropped = (probs * _scaled_keep_mask(probs, 0.25) == 0) & (probs > 0)
    assert 0 < dropped.float().mean() < 0.5  # it did drop


def test_attention_dropout_backward_is_the_derivative_of_its_forward():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 2, length, 4, generator=g, dtype=torch.float64, requires_grad=True)
               for length in (3, 4, 4))
    mask = torch.zeros(2, 1, 3, 4, dtype=torch.float64)
    mask[0, 0, 1, 2:] = float("-inf")

    def seeded(q, k, v):  # one dropout mask for every evaluation gradcheck makes
        torch.manual_seed(4)
        return kernels._AttentionWithDropout.apply(q, k, v, mask, 0.3)

    assert torch.autograd.gradcheck(seeded, (q, k, v))


def test_attention_with_a_mask_that_needs_a_gradient_is_sdpa():
    q, k, v, mask = _attention_inputs()
    mask = mask.clamp(min=-1e4).requires_grad_()
    torch.manual_seed(5)
    kernels.attention(q, k, v, mask, 0.1).sum().backward()
    assert mask.grad is not None and mask.grad.abs().sum() > 0


def test_attention_dropout_keeps_sdpas_expectation_and_a_fully_masked_row_finite():
    q, k, v, mask = (t.detach() for t in _attention_inputs())
    torch.manual_seed(4)
    mean = torch.stack([kernels.attention(q, k, v, mask, 0.5) for _ in range(4000)]).mean(0)
    assert_close(mean, F.scaled_dot_product_attention(q, k, v, attn_mask=mask), rtol=0, atol=0.05)
    mask[0, 0, 2] = float("-inf")  # query 2 of example 0 sees nothing
    out = kernels.attention(q, k, v, mask, 0.1)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_chunked_cross_entropy_matches_torch_in_fp32(monkeypatch, label_smoothing):
    """Several chunks (the last one short), ignored rows, label smoothing: the per-row losses are torch's to fp32
    rounding (the same log-softmax per row; 1e-6 relative) and so are the gradients of x, weight and bias (backward
    writes softmax - target directly instead of going through log-softmax's backward: a different rounding order,
    well inside 1e-5 relative)."""
    monkeypatch.setattr(kernels, "LOSS_CHUNK_ELEMENTS", 7 * 50)  # 7 rows per chunk
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(23, 16, generator=generator, requires_grad=True)
    weight = torch.randn(50, 16, generator=generator, requires_grad=True)
    bias = torch.randn(50, generator=generator, requires_grad=True)
    labels = torch.randint(0, 50, (23,), generator=generator)
    labels[[2, 9, 22]] = -100
    row_grad = torch.rand(23, generator=generator)
    ours = kernels.chunked_cross_entropy(x, weight, bias, labels, -100, label_smoothing)
    theirs = F.cross_entropy(F.linear(x, weight, bias), labels, ignore_index=-100, label_smoothing=label_smoothing,
                             reduction="none")
    assert ours.dtype == torch.float32 and (ours[[2, 9, 22]] == 0).all()
    assert_close(ours, theirs, rtol=1e-6, atol=0)
    our_grads = torch.autograd.grad(ours, (x, weight, bias), row_grad)
    their_grads = torch.autograd.grad(theirs, (x, weight, bias), row_grad)
    for mine, reference in zip(our_grads, their_grads):
        assert_close(mine, reference, rtol=1e-5, atol=1e-7)


def test_model_losses_and_gradients_are_the_same_with_the_chunked_loss(monkeypatch):
    from pretrain.data import synthetic_batch
    from pretrain.model import build_model, preset

    monkeypatch.setattr(kernels, "LOSS_CHUNK_ELEMENTS", 5 * 1200)  # 5 rows per chunk
    cfg = dataclasses.replace(preset("tiny"), vocab_size=1200, hidden_dropout=0.0, attention_dropout=0.0)
    batch = synthetic_batch(cfg, batch_size=3, seq_len=16, predictions=4)
    batch["masked_labels"][1, 3] = -100
    outputs, gradients = [], []
    for chunked in (False, True):
        torch.manual_seed(0)
        model = build_model(cfg).train()
        model.chunked_loss = chunked
        outputs.append(model(**batch))
        outputs[-1].loss.backward()
        gradients.append({name: p.grad for name, p in model.named_parameters()})
    plain, chunked = outputs
    assert_close(chunked.loss, plain.loss, rtol=1e-6, atol=0)
    assert_close(chunked.objective_sums, plain.objective_sums, rtol=1e-6, atol=0)
    assert torch.equal(chunked.objective_counts, plain.objective_counts)
    for name, reference in gradients[0].items():
        assert_close(gradients[1][name], reference, rtol=1e-5, atol=1e-7, msg=name)


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    return ((value.double() - reference).norm() / reference.norm()).item()


def chunked_vs_plain_errors(device: str, dtype: torch.dtype) -> dict[str, tuple[float, float]]:
    """Per output (losses, grad of x, weight, bias): relative error of the chunked and of the plain path in ``dtype``
    against float64 on the same (``dtype``-rounded) inputs."""
    generator = torch.Generator(device=device).manual_seed(0)
    rows, hidden, vocab = 2464, 256, 28996  # UniLM-large's vocabulary, 32 samples x 77 masked positions
    inputs = [torch.randn(shape, generator=generator, device=device).to(dtype)
              for shape in ((rows, hidden), (vocab, hidden), (vocab,))]
    labels = torch.randint(0, vocab, (rows,), generator=generator, device=device)
    labels[::7] = -100
    row_grad = torch.rand(rows, generator=generator, device=device)
    results = {}
    for name, compute in (
            ("float64", lambda x, w, b: F.cross_entropy(F.linear(x, w, b), labels, ignore_index=-100,
                                                        reduction="none")),
            ("plain", lambda x, w, b: F.cross_entropy(F.linear(x, w, b).float(), labels, ignore_index=-100,
                                                      reduction="none")),
            ("chunked", lambda x, w, b: kernels.chunked_cross_entropy(x, w, b, labels, -100))):
        leaves = [t.double().requires_grad_() if name == "float64" else t.clone().requires_grad_() for t in inputs]
        losses = compute(*leaves)
        results[name] = [losses.detach(), *torch.autograd.grad(losses, leaves, row_grad.to(losses.dtype))]
    return {output: (relative_error(chunked, reference), relative_error(plain, reference))
            for output, chunked, plain, reference in zip(("losses", "grad_x", "grad_weight", "grad_bias"),
                                                         results["chunked"], results["plain"], results["float64"])}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_chunked_cross_entropy_in_half_precision_on_cuda_is_as_accurate_as_torch(dtype):
    """Against float64 on the same rounded inputs, the chunked loss and its gradients are at most 1.5x as far off
    as torch's plain path in the same dtype (+1e-4 for rounding noise of a different GEMM tiling): both round the
    logits to ``dtype`` once; the chunked path accumulates the weight gradient over chunks in fp32."""
    for output, (chunked, plain) in chunked_vs_plain_errors("cuda", dtype).items():
        assert chunked <= 1.5 * plain + 1e-4, (output, chunked, plain)
