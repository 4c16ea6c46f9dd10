"""The shared Transformer that every objective trains: UniLM (4 cloze objectives), BERT (MLM + NSP), GPT-1.

Reads top to bottom: config and presets → embeddings → attention → block → heads → the model → builder.

Differences from vanilla BERT (Devlin et al. 2019, google-research/bert `modeling.py`):
  1. Six segment types instead of two: 0/1 bidirectional A/B, 2 left-to-right, 3 right-to-left, 4/5 seq2seq
     source/target (the UniLM scheme). Segment ids and the (B, L, L) attention mask are derived on the device
     from (objective, len_a, length) by `pretrain.masks`; loaders never ship them.
  2. The attention mask is per example and arbitrary (Bool[B, Lq, Lk], `True` = may attend), not a key-padding
     mask. `encode` turns it once into an additive (0 / -inf) mask shared by all layers and passes that to
     `torch.nn.functional.scaled_dot_product_attention` (through `pretrain.kernels.attention`; with dropout,
     torch's math path would otherwise convert a boolean mask again in every layer).
  3. The training forward gathers the hidden states at the masked positions before the MLM head, so the
     vocabulary projection runs on P masked tokens, not all L (BERT computes logits everywhere).
  4. The NSP loss counts only bidirectional samples whose `is_random_next >= 0`; losses are also reported per
     objective (bidirectional_mlm, nsp, left_to_right, right_to_left, seq2seq; or causal_lm).
  5. `causal_lm=True` (the GPT preset) predicts every next token under the left-to-right mask, through the same
     tied MLM head (GPT-1 has no head transform; here one head serves both recipes).
  6. The training forward also takes packed rows, several samples in one row (`pretrain.data.collate`,
     ``pack=True``): each token keeps its own sample's position, segment and mask, and sees nothing of the other
     samples in its row, so the loss is that of one sample per row, with less padding.
  7. `encode` takes an optional per-layer key/value cache (`past_key_values`) for UniLM-style incremental
     decoding: several query positions at once, keys = cached positions + new ones.
  8. Optional speed-ups, same numerics: apex's FusedLayerNorm when importable (torch LayerNorm otherwise, and in
     compiled blocks, which fuse it: `torch_layer_norms`);
     training settings, not architecture, set by the run (``train.*``): activation checkpointing of each block
     (`torch.utils.checkpoint`, non-reentrant), `torch.compile` of each block (`compile_blocks`), and a token
     loss computed in chunks of rows without fp32 logits of all of them (`chunked_loss`,
     `pretrain.kernels.chunked_cross_entropy`); on the CPU in fp32, `pretrain.kernels`: linears on oneDNN (on
     non-Intel CPUs) and a cheaper dropout mask, fused with the residual add and also used for attention dropout
     (same parameters, same distribution; GPUs, other dtypes and compiled blocks take torch's own ops).
Unchanged: post-LayerNorm blocks, exact (erf) gelu, learned absolute positions, dropout 0.1, LayerNorm eps
1e-12, N(0, 0.02) init, the pooler (dense + tanh on the first token) under the NSP head, the MLM head (dense +
gelu + LayerNorm + decoder tied to the token embeddings + bias). Parameter names map one-to-one onto Hugging
Face BERT names (table in `pretrain.hf`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from pretrain.kernels import Linear, attention, chunked_cross_entropy, dropout_add
from pretrain.masks import (
    BIDIRECTIONAL,
    LEFT_TO_RIGHT,
    NUM_OBJECTIVES,
    NUM_SEGMENT_TYPES,
    RIGHT_TO_LEFT,
    SEQ2SEQ,
    build_attention_mask,
    build_packed_attention_mask,
    build_packed_segment_ids,
    build_segment_ids,
)

try:  # an optional accelerator, never a requirement (apex is not on PyPI); falls back to torch on CPU tensors
    from apex.normalization import FusedLayerNorm as LayerNorm
except ImportError:
    LayerNorm = nn.LayerNorm

IGNORE_INDEX = -100
"""Label of a position that has no prediction target (padding); ``F.cross_entropy`` skips it."""
RETIRED_FIELDS = ("activation_checkpointing",)
"""Keys older checkpoints store in their model config that are no longer architecture."""
KeyValueCache = tuple[tuple[torch.Tensor, torch.Tensor], ...]
"""Per layer, (keys, values), each Float[B, heads, past_length, head_size]."""


# ------------------------------------------------------------------------------------------------ config
@dataclass(frozen=True)
class ModelConfig:
    """Architecture of the shared Transformer (nothing about training, launchers or DeepSpeed)."""

    vocab_size: int
    """Rows of the token embedding (= columns of the tied MLM decoder)."""
    hidden_size: int
    """Width of every hidden state."""
    num_layers: int
    """Transformer blocks."""
    num_heads: int
    """Attention heads per block; must divide hidden_size."""
    intermediate_size: int
    """Width of the feed-forward inner layer (4 × hidden in all presets)."""
    max_position_embeddings: int = 512
    """Rows of the learned position embedding: the longest sequence the model accepts."""
    hidden_dropout: float = 0.1
    """Dropout on embeddings, attention output and feed-forward output."""
    attention_dropout: float = 0.1
    """Dropout on attention probabilities."""
    layer_norm_eps: float = 1e-12
    """LayerNorm epsilon (BERT's value, and that of the BERT checkpoints UniLM starts from; UniLM v1's own code
    uses 1e-5 in every LayerNorm: set it to continue from, or compare with, its released checkpoints)."""
    initializer_range: float = 0.02
    """Standard deviation of the normal init of weights and embeddings."""
    causal_lm: bool = False
    """GPT recipe: predict every next token under the left-to-right mask instead of masked positions."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size",
                     "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"ModelConfig.hidden_size={self.hidden_size} is not divisible by "
                             f"num_heads={self.num_heads}")
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"ModelConfig.{name} must be in [0, 1), got {getattr(self, name)!r}")
        if not (self.layer_norm_eps > 0 and self.initializer_range > 0) or \
                not all(map(math.isfinite, (self.layer_norm_eps, self.initializer_range))):
            raise ValueError("ModelConfig.layer_norm_eps and initializer_range must be finite and > 0")

    @classmethod
    def from_dict(cls, values: dict) -> ModelConfig:
        """A stored model config (a checkpoint's marker). Checkpoints written before activation checkpointing
        became a training setting (``train.activation_checkpointing``) store it here too; it is dropped."""
        return cls(**{k: v for k, v in values.items() if k not in RETIRED_FIELDS})

    @property
    def head_size(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def num_segment_types(self) -> int:
        return NUM_SEGMENT_TYPES


_PRESETS: dict[str, dict] = {
    # UniLM (Dong et al. 2019): BERT-large shape, cased WordPiece vocab; ≈335M parameters.
    "unilm-large": dict(vocab_size=28996, hidden_size=1024, num_layers=24, num_heads=16, intermediate_size=4096),
    "bert-large": dict(vocab_size=30522, hidden_size=1024, num_layers=24, num_heads=16, intermediate_size=4096),
    "bert-base": dict(vocab_size=30522, hidden_size=768, num_layers=12, num_heads=12, intermediate_size=3072),
    # GPT-1 (Radford et al. 2018): 12/768/12, 40,478 BPE tokens (any vocab works), left-to-right LM.
    "gpt": dict(vocab_size=40478, hidden_size=768, num_layers=12, num_heads=12, intermediate_size=3072,
                causal_lm=True),
    # Tests and the demo (vocab of `make vocab`'s default size).
    "tiny": dict(vocab_size=8000, hidden_size=64, num_layers=2, num_heads=4, intermediate_size=256),
}
PRESET_NAMES = tuple(_PRESETS)


def preset(name: str) -> ModelConfig:
    """The ModelConfig of a named preset (`unilm-large`, `bert-large`, `bert-base`, `gpt`, `tiny`).
    Change a field with `dataclasses.replace(preset(name), vocab_size=...)`."""
    if name not in _PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {', '.join(PRESET_NAMES)}")
    return ModelConfig(**_PRESETS[name])


# ------------------------------------------------------------------------------------------------ layers
class Embeddings(nn.Module):
    """token + learned position + segment embeddings → LayerNorm → dropout."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.token = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.segment = nn.Embedding(cfg.num_segment_types, cfg.hidden_size)
        self.norm = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.hidden_dropout = cfg.hidden_dropout

    def forward(self, input_ids: torch.Tensor, segment_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Long[B, L] ×3 → Float[B, L, H]."""
        x = self.token(input_ids) + self.position(position_ids) + self.segment(segment_ids)
        return dropout_add(self.norm(x), self.hidden_dropout, self.training)


class SelfAttention(nn.Module):
    """Multi-head self-attention under an arbitrary boolean mask, with an optional key/value cache."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.head_size = cfg.num_heads, cfg.head_size
        self.query = Linear(cfg.hidden_size, cfg.hidden_size)
        self.key = Linear(cfg.hidden_size, cfg.hidden_size)
        self.value = Linear(cfg.hidden_size, cfg.hidden_size)
        self.output = Linear(cfg.hidden_size, cfg.hidden_size)
        self.attention_dropout = cfg.attention_dropout

    def _heads(self, x: torch.Tensor) -> torch.Tensor:  # [B, L, H] → [B, heads, L, head_size]
        return x.view(x.shape[0], x.shape[1], self.num_heads, self.head_size).transpose(1, 2)

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor, past: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """x Float[B, Lq, H], mask Float[B, 1, Lq, Lk] additive (0 or -inf; Lk = past length + Lq) →
        (Float[B, Lq, H], (keys, values) Float[B, heads, Lk, head_size] each, the cache to pass on)."""
        query, key, value = self._heads(self.query(x)), self._heads(self.key(x)), self._heads(self.value(x))
        if past is not None:
            key, value = torch.cat([past[0], key], dim=2), torch.cat([past[1], value], dim=2)
        context = attention(query, key, value, mask, self.attention_dropout if self.training else 0.0)
        context = context.transpose(1, 2).reshape(x.shape)
        return self.output(context), (key, value)


class Block(nn.Module):
    """Post-LayerNorm Transformer block: x = LN(x + attention(x)); x = LN(x + FFN(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention = SelfAttention(cfg)
        self.attention_norm = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.ffn_in = Linear(cfg.hidden_size, cfg.intermediate_size)
        self.ffn_out = Linear(cfg.intermediate_size, cfg.hidden_size)
        self.ffn_norm = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.hidden_dropout = cfg.hidden_dropout

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor, past: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        attended, cache = self.attention(x, mask, past)
        x = self.attention_norm(dropout_add(attended, self.hidden_dropout, self.training, residual=x))
        transformed = self.ffn_out(F.gelu(self.ffn_in(x)))
        x = self.ffn_norm(dropout_add(transformed, self.hidden_dropout, self.training, residual=x))
        return x, cache


class MLMHead(nn.Module):
    """dense → gelu → LayerNorm → decoder whose weight *is* the token embedding (one Parameter, two owners;
    sharing the object rather than reading another module's weight keeps ZeRO-3 partitioning correct)."""

    def __init__(self, cfg: ModelConfig, token_embedding: nn.Embedding):
        super().__init__()
        self.dense = Linear(cfg.hidden_size, cfg.hidden_size)
        self.norm = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.decoder = Linear(cfg.hidden_size, cfg.vocab_size)
        self.decoder.weight = token_embedding.weight

    def transform(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float[..., H] → Float[..., H]: the decoder's input."""
        return self.norm(F.gelu(self.dense(hidden)))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float[..., H] → Float[..., vocab]."""
        return self.decoder(self.transform(hidden))


# ------------------------------------------------------------------------------------------------ model
_OBJECTIVE_LOSS_NAMES = {BIDIRECTIONAL: "bidirectional_mlm", LEFT_TO_RIGHT: "left_to_right",
                         RIGHT_TO_LEFT: "right_to_left", SEQ2SEQ: "seq2seq"}
REPORTED_OBJECTIVES = (*(_OBJECTIVE_LOSS_NAMES[i] for i in range(NUM_OBJECTIVES)), "nsp", "causal_lm")
"""The slots of `PretrainOutput.objective_sums` / `objective_counts`: one per objective id (slot = id), then nsp and
causal_lm. One fixed layout for every recipe, so a training step adds micro-batches' reports on the device and
moves them to the host once."""
_NSP_SLOT, _CAUSAL_LM_SLOT = NUM_OBJECTIVES, NUM_OBJECTIVES + 1


class PretrainOutput(NamedTuple):
    """What the training forward returns. The reports are device tensors: reading them never waits for the device
    until a caller asks for the dictionaries. A tuple, because DeepSpeed's engine looks for the loss among the
    tensors of a tuple, list or dict the module returns, to hook its backward: without that hook its ZeRO
    optimizer never learns that a backward began, and with optimizer offload and gradient accumulation it took
    the gradients of the wrong micro-batch."""

    loss: torch.Tensor
    """Scalar to backpropagate: mean token loss over all predicted tokens + mean NSP loss."""
    objective_sums: torch.Tensor
    """Float[len(REPORTED_OBJECTIVES)], detached: summed loss of each objective's predictions in the batch (0 for an
    objective not present)."""
    objective_counts: torch.Tensor
    """Float[len(REPORTED_OBJECTIVES)]: how many predictions each sum adds (tokens; samples for nsp)."""

    @property
    def objective_losses(self) -> dict[str, torch.Tensor]:
        """Mean loss per objective present in the batch: bidirectional_mlm, nsp, left_to_right, right_to_left,
        seq2seq (or causal_lm). Waits for the device (it reads which objectives are present)."""
        return {name: self.objective_sums[i] / self.objective_counts[i] for i, name in self._present()}

    @property
    def objective_tokens(self) -> dict[str, torch.Tensor]:
        """How many predictions each of `objective_losses` averages."""
        return {name: self.objective_counts[i] for i, name in self._present()}

    def _present(self) -> list[tuple[int, str]]:
        """(slot, name) of each objective with predictions in the batch (waits for the device)."""
        counts = self.objective_counts.tolist()
        return [(i, name) for i, name in enumerate(REPORTED_OBJECTIVES) if counts[i] > 0]


class UniLMModel(nn.Module):
    """Embeddings → blocks → (MLM head, pooler → NSP head)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embeddings = Embeddings(cfg)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.pooler = Linear(cfg.hidden_size, cfg.hidden_size)
        self.mlm_head = MLMHead(cfg, self.embeddings.token)
        self.nsp_head = Linear(cfg.hidden_size, 2)
        self.activation_checkpointing = False
        """Recompute each block's activations in backward (less memory, about one extra forward of compute): a
        training setting (``train.activation_checkpointing``), so not part of the ModelConfig."""
        self.chunked_loss = False
        """Token losses through `pretrain.kernels.chunked_cross_entropy` (no fp32 logits of all rows at once): a
        training setting (``train.chunked_loss``)."""
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=self.cfg.initializer_range)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
        if isinstance(module, (nn.LayerNorm, LayerNorm)):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)

    # -- public pieces (fine-tuning builds on these)
    def encode(
        self,
        input_ids: torch.Tensor,
        segment_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        past_key_values: KeyValueCache | None = None,
        use_cache: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, KeyValueCache]:
        """Final hidden states of the encoder.

        Args:
            input_ids, segment_ids: Long[B, Lq].
            attention_mask: Bool[B, Lq, Lk], True = query may attend to key; Lk = past length + Lq, keys ordered
                (cached positions, then these). Every row needs at least one True (`build_attention_mask`
                guarantees it) or that row's output is NaN.
            position_ids: Long[B, Lq]; default past length + arange(Lq).
            past_key_values: the cache returned by an earlier call with use_cache=True (a tuple of
                num_layers (keys, values) pairs, each Float[B, heads, past_length, head_size]).
            use_cache: also return the cache extended by these Lq positions (slice dim 2 to drop some,
                e.g. a [MASK] placeholder that will be replaced by the predicted token).

        Returns:
            Float[B, Lq, H], or (that, cache) when use_cache.
        """
        past_length = 0 if past_key_values is None else past_key_values[0][0].shape[2]
        if position_ids is None:
            position_ids = torch.arange(past_length, past_length + input_ids.shape[1], device=input_ids.device)
            position_ids = position_ids.unsqueeze(0).expand_as(input_ids)
        x = self.embeddings(input_ids, segment_ids, position_ids)
        additive_mask = torch.zeros(attention_mask.shape, dtype=x.dtype, device=x.device)
        additive_mask = additive_mask.masked_fill_(~attention_mask, float("-inf")).unsqueeze(1)
        recompute = self.activation_checkpointing and self.training and torch.is_grad_enabled()
        cache = []
        for index, layer in enumerate(self.layers):
            past = None if past_key_values is None else past_key_values[index]
            if recompute:
                x, layer_cache = checkpoint(layer, x, additive_mask, past, use_reentrant=False)
            else:
                x, layer_cache = layer(x, additive_mask, past)
            if use_cache:  # else dropped now: under activation checkpointing nothing else keeps them
                cache.append(layer_cache)
        return (x, tuple(cache)) if use_cache else x

    def encode_objective(self, input_ids: torch.Tensor, objective: torch.Tensor | int, len_a: torch.Tensor,
                         length: torch.Tensor) -> torch.Tensor:
        """Final hidden states Float[B, L, H] of padded Long[B, L] inputs under their objectives' attention masks
        and segment ids, built here from (objective, len_a, length) by `pretrain.masks` — the way pre-training
        encodes. ``objective``: Long[B] or one objective for the whole batch; len_a, length: Long[B]."""
        if isinstance(objective, int):
            objective = torch.full_like(length, objective)
        max_len = input_ids.shape[1]
        return cast(torch.Tensor, self.encode(input_ids, build_segment_ids(objective, len_a, length, max_len),
                                              build_attention_mask(objective, len_a, length, max_len)))

    def mlm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float[..., H] → Float[..., vocab] through the tied MLM head."""
        return self.mlm_head(hidden)

    def token_losses(self, hidden: torch.Tensor, labels: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
        """fp32 cross-entropy of the MLM head's prediction from each hidden state: Float[..., H], Long[...] labels →
        Float[N] (N = labels.numel(); 0 where the label is `IGNORE_INDEX`). With ``chunked_loss`` the decoder's
        logits are never all materialised (ZeRO-3-partitioned weights, which DeepSpeed gathers only inside the
        decoder's own forward, take the plain path)."""
        decoder = self.mlm_head.decoder
        if self.chunked_loss and not hasattr(decoder.weight, "ds_id"):
            return chunked_cross_entropy(self.mlm_head.transform(hidden).flatten(0, -2), decoder.weight, decoder.bias,
                                         labels.flatten(), IGNORE_INDEX, label_smoothing)
        return F.cross_entropy(self.mlm_logits(hidden).flatten(0, -2).float(), labels.flatten(),
                               ignore_index=IGNORE_INDEX, label_smoothing=label_smoothing, reduction="none")

    def mean_token_loss(self, hidden: torch.Tensor, labels: torch.Tensor, label_smoothing: float = 0.0,
                        normalizer: torch.Tensor | None = None) -> torch.Tensor:
        """`token_losses` averaged over the predicted tokens (labels other than `IGNORE_INDEX`); summed and divided
        by ``normalizer`` instead when given (a step's count over its micro-batches, as the forward's
        ``token_normalizer``)."""
        losses = self.token_losses(hidden, labels, label_smoothing)
        return losses.sum() / ((labels != IGNORE_INDEX).sum().clamp(min=1) if normalizer is None else normalizer)

    def masked_lm_loss(self, hidden: torch.Tensor, masked_positions: torch.Tensor, masked_labels: torch.Tensor,
                       label_smoothing: float = 0.0, normalizer: torch.Tensor | None = None) -> torch.Tensor:
        """Mean cross-entropy of the MLM head's predictions at the masked positions only (see `mean_token_loss`).

        hidden Float[B, L, H]; masked_positions Long[B, P] (padding positions arbitrary); masked_labels Long[B, P]
        (`IGNORE_INDEX` at padding)."""
        return self.mean_token_loss(gather_positions(hidden, masked_positions), masked_labels, label_smoothing,
                                    normalizer)

    def causal_lm_loss(self, input_ids: torch.Tensor, length: torch.Tensor, hidden: torch.Tensor | None = None,
                       normalizer: torch.Tensor | None = None) -> torch.Tensor:
        """Mean next-token cross-entropy of Long[B, L] sequences (Long[B] lengths) under the left-to-right mask;
        ``hidden``: that pass's Float[B, L, H] when the caller already ran it; ``normalizer``: see
        `mean_token_loss`."""
        if hidden is None:
            hidden = self.encode_objective(input_ids, LEFT_TO_RIGHT, length, length)
        # position t predicts token t + 1
        return self.mean_token_loss(hidden[:, :-1], causal_lm_labels(input_ids, length), normalizer=normalizer)

    def pooled(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float[B, L, H] → Float[B, H]: tanh(dense(first token)), BERT's pooler (the NSP head's input)."""
        return self.pool(hidden[:, 0])

    def pool(self, first_tokens: torch.Tensor) -> torch.Tensor:
        """Float[B, H] hidden states of the samples' first tokens → Float[B, H]: BERT's pooler, tanh(dense(·))."""
        return torch.tanh(self.pooler(first_tokens))

    # -- the training forward: inputs → encoder → losses → reports
    def forward(
        self,
        input_ids: torch.Tensor,
        objective: torch.Tensor,
        len_a: torch.Tensor,
        length: torch.Tensor,
        is_random_next: torch.Tensor | None = None,
        masked_positions: torch.Tensor | None = None,
        masked_labels: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        token_sample: torch.Tensor | None = None,
        sample_starts: torch.Tensor | None = None,
        token_normalizer: torch.Tensor | None = None,
        nsp_normalizer: torch.Tensor | None = None,
    ) -> PretrainOutput:
        """Loss of a collated batch (its keys are these arguments; see docs/architecture.md).

        Args:
            input_ids: Long[B, L], padded; objective, len_a, length, is_random_next: Long[B]
                (is_random_next: 1 random B, 0 true next, -1 no NSP loss; default all -1);
            masked_positions: Long[B, P] (padding positions arbitrary), masked_labels: Long[B, P] (`IGNORE_INDEX`
                at padding). Unused (may be None) when cfg.causal_lm.
            position_ids, token_sample: Long[R, L], sample_starts: Long[S]: packed rows, several samples per row
                (`pretrain.data.collate` with ``pack=True``); input_ids is then Long[R, L], the per-sample tensors
                have S rows and masked_positions index the flattened R × L tokens. Same loss as one sample per row.
            token_normalizer, nsp_normalizer: Float[] what the summed token and NSP losses are divided by; default
                this batch's predicted tokens and NSP samples (a mean over the batch). The trainer passes the whole
                step's counts divided by its number of micro-batches (`pretrain.data.PretrainLoader`), so that
                DeepSpeed's mean over micro-batches and ranks is the mean over the global batch, whatever its split.
        """
        packed = token_sample is not None
        if self.cfg.causal_lm:  # GPT: every sample is a left-to-right sample
            objective = torch.full_like(objective, LEFT_TO_RIGHT)
        if packed and (self.cfg.causal_lm or position_ids is None or sample_starts is None):
            raise ValueError("packed rows need position_ids, token_sample and sample_starts, and a masked-LM "
                             "model (cfg.causal_lm predicts every token of one sample per row)")
        if not self.cfg.causal_lm and (masked_positions is None or masked_labels is None):
            raise ValueError("masked_positions and masked_labels are required unless cfg.causal_lm")
        if is_random_next is None:
            is_random_next = torch.full_like(objective, -1)

        segment_ids, attention_mask = self._segments_and_mask(objective, len_a, length, input_ids.shape[1],
                                                              position_ids, token_sample)
        hidden = cast(torch.Tensor, self.encode(input_ids, segment_ids, attention_mask,
                                                position_ids if packed else None))
        first_tokens = hidden.flatten(0, 1)[sample_starts] if packed else hidden[:, 0]  # Float[B or S, H]

        predicting, labels, slots = self._prediction_targets(hidden, input_ids, objective, length, masked_positions,
                                                             masked_labels, packed)
        token_loss = self.token_losses(predicting, labels)  # Float[N]
        predicted = (labels.flatten() != IGNORE_INDEX).float()  # Float[N]
        # NSP on every sample, weighted to zero where it does not apply: the graph (and which parameters get
        # gradients) is the same for every batch, and no host sync is needed.
        nsp_loss = F.cross_entropy(self.nsp_head(self.pool(first_tokens)).float(), is_random_next.clamp(min=0),
                                   reduction="none")  # Float[B or S]
        nsp_weight = ((objective == BIDIRECTIONAL) & (is_random_next >= 0)).float()
        weighted_nsp_loss = nsp_loss * nsp_weight
        loss = _mean(token_loss.sum(), predicted.sum(), token_normalizer) + \
            _mean(weighted_nsp_loss.sum(), nsp_weight.sum(), nsp_normalizer)
        return PretrainOutput(loss, *_objective_reports(token_loss, predicted, slots, weighted_nsp_loss, nsp_weight))

    @staticmethod
    def _segments_and_mask(objective: torch.Tensor, len_a: torch.Tensor, length: torch.Tensor, max_len: int,
                           position_ids: torch.Tensor | None, token_sample: torch.Tensor | None,
                           ) -> tuple[torch.Tensor, torch.Tensor]:
        """Input preparation: segment ids Long[B, L] and attention mask Bool[B, L, L] from each sample's
        (objective, len_a, length) — or, for packed rows, from each token's sample and position (Long[R, L])."""
        if token_sample is None or position_ids is None:
            return (build_segment_ids(objective, len_a, length, max_len),
                    build_attention_mask(objective, len_a, length, max_len))
        return (build_packed_segment_ids(token_sample, position_ids, objective, len_a),
                build_packed_attention_mask(token_sample, position_ids, objective, len_a))

    def _prediction_targets(self, hidden: torch.Tensor, input_ids: torch.Tensor, objective: torch.Tensor,
                            length: torch.Tensor, masked_positions: torch.Tensor | None,
                            masked_labels: torch.Tensor | None, packed: bool,
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The hidden states that predict a token, their labels and each prediction's report slot.

        Masked LM: the states at the masked positions (Float[B, P, H], or Float[S, P, H] gathered from the flattened
        packed rows), labels Long[B, P], slot = the sample's objective. Causal LM: every position but the last
        (Float[B, L-1, H]) predicts the next token, slot `causal_lm`. Slots: Long[N], N = labels.numel()."""
        if self.cfg.causal_lm:
            labels = causal_lm_labels(input_ids, length)  # t predicts token t + 1
            return hidden[:, :-1], labels, torch.full_like(labels.flatten(), _CAUSAL_LM_SLOT)
        assert masked_positions is not None and masked_labels is not None  # forward checked them
        if packed:
            predicting = hidden.flatten(0, 1)[masked_positions]
        else:
            predicting = gather_positions(hidden, masked_positions)
        return predicting, masked_labels, objective.unsqueeze(1).expand_as(masked_labels).flatten()

    def compile_blocks(self) -> None:
        """`torch.compile` every Transformer block in place (``nn.Module.compile``: parameter names, checkpoints and
        activation checkpointing unchanged): the compiler fuses dropout, residual adds, LayerNorm and gelu around
        the matrix multiplies (apex's FusedLayerNorm, when in use, gives way to torch's there: `torch_layer_norms`).
        A training setting (``train.compile``)."""
        for layer in self.layers:
            torch_layer_norms(layer)
            layer.compile()

    def num_parameters(self, non_embedding: bool = False) -> int:
        """Distinct parameters (the tied decoder counted once); non_embedding drops the three embedding tables."""
        total = sum(p.numel() for p in self.parameters())
        if non_embedding:
            total -= sum(p.numel() for p in (self.embeddings.token.weight, self.embeddings.position.weight,
                                             self.embeddings.segment.weight))
        return total


def torch_layer_norms(module: nn.Module) -> None:
    """Replace each apex FusedLayerNorm under ``module`` (the `LayerNorm` in use when apex is importable) by torch's
    ``nn.LayerNorm`` holding the very same parameters, so names, checkpoints and optimizer state are unchanged. For
    compiled blocks: the compiler fuses torch's LayerNorm with the dropout and residual add before it, whereas
    apex's extension is an opaque call that splits the compiled graph (a graph break, on apex releases before its
    traceable op); the two compute the same normalisation."""
    for name, child in module.named_children():
        if LayerNorm is not nn.LayerNorm and type(child) is LayerNorm:
            fused = cast(nn.LayerNorm, child)  # apex's class has torch's attributes
            plain = nn.LayerNorm(fused.normalized_shape, eps=fused.eps, elementwise_affine=fused.elementwise_affine,
                                 device="meta")
            plain.weight, plain.bias = fused.weight, fused.bias
            setattr(module, name, plain)
        else:
            torch_layer_norms(child)


def training_flops(cfg: ModelConfig, tokens: float, squared_lengths: float, predictions: float,
                   samples: float) -> float:
    """Useful FLOPs of one forward + backward over a batch (the numerator of MFU): 6 × encoder-block matmul weights
    × tokens (forward 2, backward 4 per multiply-add), attention scores and context (3 × 4 × hidden × length² per
    layer and sample), 6 × MLM-head weights × predicted tokens and 6 × pooler/NSP weights × samples. Embedding
    lookups are not counted, nor work on padding or on positions without a prediction, so such work lowers MFU.

    tokens: Σ sample lengths; squared_lengths: Σ sample length²; predictions: predicted tokens."""
    hidden, ffn = cfg.hidden_size, cfg.intermediate_size
    block_weights = 4 * hidden * hidden + 2 * hidden * ffn
    encoder = 6 * cfg.num_layers * block_weights * tokens
    attention = 3 * cfg.num_layers * 4 * hidden * squared_lengths
    head = 6 * (hidden * hidden + hidden * cfg.vocab_size) * predictions
    nsp = 6 * (hidden * hidden + 2 * hidden) * samples
    return float(encoder + attention + head + nsp)


def gather_positions(hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The hidden states at some positions of each row: Float[B, L, H], Long[B, P] → Float[B, P, H]."""
    return hidden.gather(1, positions.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))


def causal_lm_labels(input_ids: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
    """Next-token targets Long[B, L-1] of Long[B, L] inputs (position t predicts token t + 1), `IGNORE_INDEX`
    past each row's ``length``."""
    positions = torch.arange(1, input_ids.shape[1], device=input_ids.device)
    return input_ids[:, 1:].masked_fill(positions >= length.unsqueeze(1), IGNORE_INDEX)


def _mean(total: torch.Tensor, count: torch.Tensor, normalizer: torch.Tensor | None) -> torch.Tensor:
    """``total`` divided by ``normalizer``, or by ``count`` (at least 1) when none is given."""
    return total / (count.clamp(min=1) if normalizer is None else normalizer)


@torch.no_grad()
def _objective_reports(token_loss: torch.Tensor, predicted: torch.Tensor, slots: torch.Tensor,
                       nsp_loss: torch.Tensor, nsp_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-objective (sums, counts), each Float[len(REPORTED_OBJECTIVES)], left on the device: token losses and
    predictions Float[N] added into their Long[N] slots, weighted NSP losses and weights Float[B] into nsp's."""
    sums = token_loss.new_zeros(len(REPORTED_OBJECTIVES)).index_add_(0, slots, token_loss)
    counts = predicted.new_zeros(len(REPORTED_OBJECTIVES)).index_add_(0, slots, predicted)
    sums[_NSP_SLOT] += nsp_loss.sum()
    counts[_NSP_SLOT] += nsp_weight.sum()
    return sums, counts


def build_model(cfg: ModelConfig) -> UniLMModel:
    """A freshly initialised model of this config (BERT init: N(0, initializer_range), zero biases)."""
    return UniLMModel(cfg)
