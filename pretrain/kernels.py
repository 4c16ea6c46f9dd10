"""Fast paths for the shared model: same parameters, same semantics, less time per training step.

Any device: `chunked_cross_entropy`, the MLM/LM loss over chunks of rows, so that the vocabulary logits of all
predicted rows never exist at once in fp32 (under bf16/fp16 the plain path casts them all to fp32 for the loss:
rows × vocab × 4 bytes written and read several times, e.g. 286 MB per 32 × 77 masked positions at UniLM's
28,996 tokens, plus their gradient). On by default under bf16/fp16 (``train.chunked_loss``).

On the CPU in fp32 (compiled blocks take torch's ops instead, which the compiler fuses), two things dominate a
training step besides the matrix multiplies' arithmetic itself, and torch's defaults leave speed on the table for
both (numbers: BERT-base, micro-batch 8 × 128, 2 cores, `make bench-model`):

- `Linear`: an `nn.Linear` (same `weight`/`bias` names, so checkpoints and Hugging Face export do not change)
  whose fp32 CPU forward and input-gradient GEMMs run through oneDNN (`torch.ops.mkldnn._linear_pointwise`, the
  kernel torch's own compiler uses for CPU linears) instead of MKL's sgemm, which `F.linear` calls — on CPUs
  whose vendor is not Intel. MKL picks its fastest kernels on Intel CPUs alone: on an AMD EPYC (AVX-512)
  oneDNN's JIT kernels run the model's shapes at 190–215 GFLOP/s where MKL gets 80–190 (worst: the MLM decoder,
  few rows × 30k columns), while on an Intel Xeon (Sapphire Rapids) MKL runs them at 330–400 and oneDNN's input
  gradients at 180–360, so there `F.linear` stays except for linears of fewer than `FEW_ROWS` rows (a beam
  search step), where oneDNN is faster there too (`cpu_linear_backend`; ``UNILM_CPU_LINEAR=onednn|torch``
  overrides the choice). Results agree with `F.linear` to fp32 rounding (a different summation order). Anything
  else — GPU tensors, bf16/fp16, CPU autocast, ZeRO-3-partitioned weights (DeepSpeed gathers those around
  `F.linear`), a torch without the op — takes `F.linear`. The op is checked once against `F.linear` before first
  use; on any disagreement it is not used.
- `dropout_add`: torch's CPU dropout draws each element's mask through a serial double-precision Bernoulli
  sampler (about 6 ns per element, 6 % of a step). This draws one 63-bit random word per *four* elements from
  the same default generator (so seeding, checkpointed RNG state and activation-checkpoint recompute behave
  as with torch's dropout) and keeps an element when its 16-bit share clears a threshold: p is
  rounded to a multiple of 1/32768 (0.1 → 0.1000061) and kept values are scaled by exactly 1/(1 - that p),
  so the expectation is unchanged. The residual add is fused into the same pass. GPU tensors (and CPU
  tensors in other dtypes) use torch's dropout. `attention` draws attention dropout with the same mask: with
  dropout torch's CPU SDPA takes its math path, which samples through the serial Bernoulli (5 % of a step).

And one process setting, `retain_freed_memory`: glibc's malloc hands large freed blocks back to the kernel,
so every step page-faults its activations and gradients in again (about 150–200k faults, 0.35 CPU-seconds per
BERT-base step); keeping them in the process makes the step about 5 % faster (the same reason torch's CPU
launcher, `torch.backends.xeon.run_cpu`, preloads jemalloc or tcmalloc). Resident memory then stays at its
high-water mark (measured: +5–20 %). CPU training processes call it at start-up.
"""
from __future__ import annotations

import ctypes
import functools
import os
import platform
import sys
import warnings

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Linear", "attention", "chunked_cross_entropy", "cpu_linear_backend", "dropout_add", "onednn_linear",
           "onednn_linear_available", "retain_freed_memory"]


# ------------------------------------------------------------------------------------------------ Linear
def _onednn_op():
    """`torch.ops.mkldnn._linear_pointwise` (x, weight, bias, "none", [], "") → x @ weightᵀ + bias, or None."""
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._linear_pointwise
    except (AttributeError, RuntimeError):
        return None


_ONEDNN = _onednn_op()


def onednn_linear(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """a @ bᵀ (+ bias) through oneDNN, where `onednn_linear_available()`; a: Float[M, K], b: Float[N, K]
    (b may be a transposed view)."""
    return _ONEDNN(a, b, bias, "none", [], "")


@functools.cache
def onednn_linear_available() -> bool:
    """Whether `Linear` uses oneDNN here: the op exists and matches F.linear (checked once per process)."""
    if _ONEDNN is None:
        return False
    generator = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(shape, generator=generator) for shape in ((37, 24), (19, 24), (19,)))
    g = torch.randn(37, 19, generator=generator)
    try:
        pairs = [(onednn_linear(x, w, b), F.linear(x, w, b)), (onednn_linear(g, w.t()), g @ w)]
    except RuntimeError as error:
        warnings.warn(f"oneDNN linear unavailable ({error}); using torch.nn.functional.linear", stacklevel=2)
        return False
    if not all(ours.shape == ref.shape and torch.allclose(ours, ref, rtol=1e-5, atol=1e-5) for ours, ref in pairs):
        warnings.warn("oneDNN linear disagrees with torch.nn.functional.linear on this torch build; "
                      "using torch.nn.functional.linear", stacklevel=2)
        return False
    return True


CPU_LINEAR_VARIABLE = "UNILM_CPU_LINEAR"
"""Environment variable choosing `Linear`'s fp32 CPU GEMMs: ``auto`` (default), ``onednn`` or ``torch``."""

FEW_ROWS = 16
"""On Intel CPUs (``auto``), a linear of fewer rows than this still runs on oneDNN: at 10 rows (a beam search
step's vocabulary projection) oneDNN is 1.5–1.7× MKL there, from 20 rows on MKL is as fast or faster."""


def choose_cpu_linear(setting: str | None, vendor: str | None, onednn_available: bool) -> str:
    """`Linear`'s fp32 CPU GEMMs: ``"onednn"``, ``"torch"`` (`F.linear`, MKL) or ``"few-rows-onednn"`` (oneDNN
    below `FEW_ROWS` rows, `F.linear` from there). ``setting`` (the environment variable): ``auto``/None (oneDNN
    where it works, except on Intel CPUs, where MKL's own kernels are at least as fast but for the fewest rows),
    ``onednn`` (where it works) or ``torch``. ``vendor``: the CPU's vendor id (``GenuineIntel``, ``AuthenticAMD``,
    …) or None where unknown."""
    setting = (setting or "auto").strip().lower()
    if setting not in ("auto", "onednn", "torch"):
        raise ValueError(f"{CPU_LINEAR_VARIABLE}={setting!r}: expected auto, onednn or torch")
    if setting == "torch" or not onednn_available:
        return "torch"
    return "few-rows-onednn" if setting == "auto" and vendor == "GenuineIntel" else "onednn"


def cpu_vendor() -> str | None:
    """The CPU's vendor id from /proc/cpuinfo (``GenuineIntel``, ``AuthenticAMD``, …), None where unknown."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("vendor_id")), None)
    except OSError:
        return None


@functools.cache
def cpu_linear_backend() -> str:
    """`Linear`'s backend for fp32 CPU GEMMs in this process (`choose_cpu_linear` of ``UNILM_CPU_LINEAR``, this
    CPU's vendor and `onednn_linear_available`)."""
    return choose_cpu_linear(os.environ.get(CPU_LINEAR_VARIABLE), cpu_vendor(), onednn_linear_available())


class _OneDNNLinear(torch.autograd.Function):
    """x @ weightᵀ + bias: the forward and input-gradient GEMMs on oneDNN, the weight gradient on MKL."""

    @staticmethod
    def forward(ctx, x, weight, bias):  # x: Float[M, in]
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return onednn_linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):  # grad: Float[M, out]
        x, weight = ctx.saved_tensors
        need_x, need_weight, need_bias = ctx.needs_input_grad
        grad_x = onednn_linear(grad, weight.t()) if need_x else None  # grad @ weight
        # gradᵀ @ x on MKL: oneDNN would first copy both transposed operands, and gains nothing on this shape
        grad_weight = grad.t().mm(x) if need_weight else None  # contiguous [out, in], like the weight
        grad_bias = grad.sum(0) if ctx.has_bias and need_bias else None
        return grad_x, grad_weight, grad_bias


class Linear(nn.Linear):
    """`nn.Linear` whose fp32 CPU GEMMs run on oneDNN where `cpu_linear_backend` says so (see the module docstring);
    F.linear everywhere else."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Float[..., in_features] → Float[..., out_features]."""
        weight, bias = self.weight, self.bias
        if (x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32
                or x.numel() == 0 or hasattr(weight, "ds_id") or torch.is_autocast_enabled("cpu")
                or torch.compiler.is_compiling() or not self._on_onednn(x.numel() // x.shape[-1])):
            return F.linear(x, weight, bias)
        flat = x.reshape(-1, x.shape[-1])
        if not flat.is_contiguous():
            flat = flat.contiguous()
        if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                        or (bias is not None and bias.requires_grad)):
            out = _OneDNNLinear.apply(flat, weight, bias)
        else:
            out = onednn_linear(flat, weight, bias)
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def _on_onednn(rows: int) -> bool:
        backend = cpu_linear_backend()
        return backend == "onednn" or (backend == "few-rows-onednn" and rows < FEW_ROWS)


# ------------------------------------------------------------------------------------------------ dropout
_DROP_STEPS = 32768


def _scaled_keep_mask(like: torch.Tensor, p: float) -> torch.Tensor:
    """Float tensor shaped like `like`: 0 where dropped, 1/(1-p') where kept, p' = round(p·32768)/32768."""
    drop = round(p * _DROP_STEPS)
    count = like.numel()
    words = torch.empty((count + 3) // 4, dtype=torch.int64, device=like.device).random_()  # [0, 2**63)
    # Read as four int16 each: the three low ones are uniform on [-32768, 32768), the top one on [0, 32768);
    # doubling the top one (int16 wrap-around) makes it uniform on the even values of [-32768, 32768), so
    # one threshold, a multiple of 2, drops every element with probability drop / 32768.
    quarters = words.view(torch.int16).view(-1, 4)
    top = 3 if sys.byteorder == "little" else 0
    quarters[:, top].mul_(2)
    # kept where share >= threshold: share - (threshold - 1) clamped to [0, 1] is exactly 0 or 1, in fp32 ops
    # (exact on 16-bit integers), which vectorise; comparing to a bool tensor and converting that took longer
    threshold = -_DROP_STEPS + 2 * drop
    keep = quarters.view(-1)[:count].to(torch.float32).sub_(threshold - 1).clamp_(0, 1)
    return keep.view(like.shape).mul_(_DROP_STEPS / (_DROP_STEPS - drop)).to(like.dtype)


class _DropoutAdd(torch.autograd.Function):
    """residual + x · mask (mask = `_scaled_keep_mask`); residual may be None."""

    @staticmethod
    def forward(ctx, residual, x, p):
        scaled_keep = _scaled_keep_mask(x, p)
        ctx.save_for_backward(scaled_keep)
        ctx.has_residual = residual is not None
        return x * scaled_keep if residual is None else torch.addcmul(residual, x, scaled_keep)

    @staticmethod
    def backward(ctx, grad):
        (scaled_keep,) = ctx.saved_tensors
        return (grad if ctx.has_residual else None), grad * scaled_keep, None


def dropout_add(x: torch.Tensor, p: float, training: bool, residual: torch.Tensor | None = None) -> torch.Tensor:
    """`residual + dropout(x, p)` (just `dropout(x, p)` without a residual), with a cheaper mask on the CPU.

    x, residual: Float[...] of one shape; p in [0, 1); training False (or p = 0) makes it the identity."""
    if not training or p == 0.0:
        return x if residual is None else residual + x
    # the mask's scale is exact only in fp32; compiled code gets torch's dropout, which the compiler fuses
    if x.device.type != "cpu" or x.dtype != torch.float32 or torch.compiler.is_compiling():
        dropped = F.dropout(x, p, training=True)
        return dropped if residual is None else residual + dropped
    return _DropoutAdd.apply(residual, x, p)


# ------------------------------------------------------------------------------------------------ attention
class _AttentionWithDropout(torch.autograd.Function):
    """dropout(softmax(q·kᵀ/√d + mask)) · v with `_scaled_keep_mask`, its backward written out. Autograd's
    version of the same ops ran the heads' strided views through its batched matmuls one matrix at a time and
    took ≈ 15 % longer; here q, k, v are reshaped once to [B·heads, L, d] and every product is one batched GEMM."""

    @staticmethod
    def forward(ctx, query, key, value, mask, p):
        batch, heads, query_length, head_size = query.shape
        q, k, v = (t.reshape(batch * heads, -1, head_size) for t in (query, key, value))
        scale = head_size ** -0.5
        scores = torch.bmm(q * scale, k.transpose(1, 2))
        if mask is not None:  # -inf → the lowest finite float: a fully masked row cannot turn into NaN
            scores.view(batch, heads, query_length, -1).add_(mask.clamp(min=torch.finfo(mask.dtype).min))
        probs = torch.softmax(scores, dim=-1)
        scaled_keep = _scaled_keep_mask(probs, p)
        dropped = probs * scaled_keep
        ctx.save_for_backward(q, k, v, probs, scaled_keep, dropped)
        ctx.scale, ctx.batch_and_heads = scale, (batch, heads)
        return torch.bmm(dropped, v).view(batch, heads, query_length, head_size)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, probs, scaled_keep, dropped = ctx.saved_tensors
        grad = grad.reshape(v.shape[0], -1, v.shape[2])
        grad_value = torch.bmm(dropped.transpose(1, 2), grad)
        grad_probs = torch.bmm(grad, v.transpose(1, 2)).mul_(scaled_keep)
        grad_scores = torch._softmax_backward_data(grad_probs, probs, -1, probs.dtype).mul_(ctx.scale)
        grad_query, grad_key = torch.bmm(grad_scores, k), torch.bmm(grad_scores.transpose(1, 2), q)
        return (*(g.view(*ctx.batch_and_heads, *g.shape[1:]) for g in (grad_query, grad_key, grad_value)), None, None)


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
              dropout_p: float) -> torch.Tensor:
    """``F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout_p)``, with a cheaper
    attention dropout on the CPU: there, with dropout, torch takes its math path, whose mask is drawn by the
    serial Bernoulli sampler (5 % of a BERT-base step); this computes the same softmax(q·kᵀ/√d + mask) · v with
    `dropout_add`'s mask and a hand-written backward (`_AttentionWithDropout`). Elsewhere (GPU, other dtypes, no
    dropout, compiled code, a mask that needs a gradient) it is SDPA itself.

    query Float[B, heads, Lq, d], key/value Float[B, heads, Lk, d], mask Float[B, 1, Lq, Lk] additive (0 or
    -inf) or None → Float[B, heads, Lq, d]. A row with every key masked gives the mean of the values, where SDPA
    gives 0 (nothing here builds such rows: their outputs would be ignored anyway)."""
    if (dropout_p == 0.0 or query.device.type != "cpu" or query.dtype != torch.float32
            or torch.compiler.is_compiling() or (mask is not None and mask.requires_grad)):
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout_p)
    return _AttentionWithDropout.apply(query, key, value, mask, dropout_p)


# ------------------------------------------------------------------------------------------------ loss
LOSS_CHUNK_ELEMENTS = 2**25
"""Logits computed at once by `chunked_cross_entropy`: rows per chunk = this // vocabulary (1157 rows of a
28,996-token vocabulary, 128 MiB in fp32)."""


def _chunk_losses(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int,
                  label_smoothing: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row cross-entropy as ``F.cross_entropy(reduction="none")`` computes it (log-softmax, then the label's
    term and the smoothing term) and the log-probabilities: Float[rows, vocab] fp32, Long[rows] →
    (Float[rows], Float[rows, vocab])."""
    log_probs = torch.log_softmax(logits, dim=-1)
    ignored = labels == ignore_index
    nll = -log_probs.gather(1, labels.masked_fill(ignored, 0).unsqueeze(1)).squeeze(1)
    if label_smoothing:
        smooth = -log_probs.sum(-1)
        nll = (1 - label_smoothing) * nll + label_smoothing / logits.shape[-1] * smooth
    return nll.masked_fill(ignored, 0.0), log_probs


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Per-row cross-entropy of the logits x @ weightᵀ + bias, chunk by chunk; backward recomputes each chunk."""

    @staticmethod
    def _chunks(x, weight, bias, labels, ignore_index, label_smoothing, chunk_rows):
        """Per chunk of rows: (its slice, its losses Float[rows], its log-probabilities Float[rows, vocab])."""
        for start in range(0, x.shape[0], chunk_rows):
            rows = slice(start, start + chunk_rows)
            logits = F.linear(x[rows], weight, bias).float()
            yield rows, *_chunk_losses(logits, labels[rows], ignore_index, label_smoothing)

    @staticmethod
    def forward(ctx, x, weight, bias, labels, ignore_index, label_smoothing, chunk_rows):
        losses = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
        for rows, chunk_losses, _ in _ChunkedCrossEntropy._chunks(x, weight, bias, labels, ignore_index,
                                                                  label_smoothing, chunk_rows):
            losses[rows] = chunk_losses
        ctx.save_for_backward(x, weight, bias, labels)
        ctx.settings = ignore_index, label_smoothing, chunk_rows
        return losses

    @staticmethod
    def backward(ctx, grad_losses):  # grad_losses: Float[rows]
        x, weight, bias, labels = ctx.saved_tensors
        ignore_index, label_smoothing, chunk_rows = ctx.settings
        grad_x = torch.empty_like(x)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device)
        for rows, _, log_probs in _ChunkedCrossEntropy._chunks(x, weight, bias, labels, ignore_index,
                                                               label_smoothing, chunk_rows):
            # d loss / d logits = softmax - (1 - ε)·one_hot(label) - ε / vocab, scaled by the row's gradient
            ignored = labels[rows] == ignore_index
            grad_logits = log_probs.exp_().sub_(label_smoothing / log_probs.shape[-1])
            grad_logits.scatter_add_(1, labels[rows].masked_fill(ignored, 0).unsqueeze(1),
                                     grad_logits.new_full((grad_logits.shape[0], 1), label_smoothing - 1))
            grad_logits.mul_(grad_losses[rows].masked_fill(ignored, 0.0).unsqueeze(1))
            grad_logits = grad_logits.to(x.dtype)
            grad_x[rows] = grad_logits @ weight
            grad_weight.add_(grad_logits.t() @ x[rows])
            grad_bias.add_(grad_logits.sum(0, dtype=torch.float32))
        grad_bias = grad_bias.to(bias.dtype) if bias is not None else None
        return grad_x, grad_weight.to(weight.dtype), grad_bias, None, None, None, None


def chunked_cross_entropy(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
                          ignore_index: int, label_smoothing: float = 0.0) -> torch.Tensor:
    """``F.cross_entropy(F.linear(x, weight, bias).float(), labels, reduction="none", ...)`` without the fp32 logits
    of all rows: logits are computed ``LOSS_CHUNK_ELEMENTS // vocab`` rows at a time in x's dtype, each chunk's loss
    in fp32, and backward recomputes the chunk's logits (one more vocabulary GEMM: 0.5 % of a UniLM-large step)
    instead of keeping any. Same semantics: 0 at ``ignore_index`` rows, label smoothing as torch's.

    x: Float[rows, H] (the compute dtype, e.g. bf16), weight: Float[vocab, H], bias: Float[vocab] or None,
    labels: Long[rows] → Float[rows] fp32. Under autocast the operands are cast to its dtype first."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        x, weight = x.to(dtype), weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
    chunk_rows = max(1, LOSS_CHUNK_ELEMENTS // weight.shape[0])
    with torch.autocast(device_type, enabled=False):
        return _ChunkedCrossEntropy.apply(x, weight, bias, labels, ignore_index, label_smoothing, chunk_rows)


# ------------------------------------------------------------------------------------------------ allocator
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # mallopt parameters (glibc malloc.h)


def retain_freed_memory() -> bool:
    """Make glibc malloc keep freed memory for reuse: no mmap'ed blocks (M_MMAP_MAX 0), no trimming of the
    heap top below 2 GiB free (M_TRIM_THRESHOLD). Returns whether it applied (False off glibc Linux).
    Same effect from outside: MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=2147483647 in the environment."""
    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
    except (OSError, AttributeError):
        return False
