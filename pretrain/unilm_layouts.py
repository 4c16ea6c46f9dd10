"""microsoft/unilm's released weight layouts brought to Hugging Face BERT's names and shapes, before `pretrain.hf`
maps them onto ours.

What its public code stores that a HF BERT does not (unilm-v1 `src/pytorch_pretrained_bert/modeling.py`, s2s-ft
`s2s_ft/modeling.py`, `s2s_ft/convert_state_dict.py`, `s2s_ft/configuration_unilm.py`):

    relax_projection   the MLM head's transform stored once per UniLM task: `cls.predictions.transform.dense`
                       weight Float[k·H, H], bias and `transform.LayerNorm` weight/bias Float[k·H] (v1's
                       `BertPredictionHeadTransform`, k = 4), its forward taking block ``task_idx`` of the k
    new_pos_ids        the position table stored once per task: `bert.embeddings.position_embeddings.weight`
                       Float[P, 4·H] (v1's `BertEmbeddings`), block ``task_idx`` read
    fast QKV           s2s-ft's `unilm` checkpoints (`unilm_to_hf_bert`): `attention.self.qkv_linear.weight`
                       Float[3·H, H] (query, key, value stacked), `attention.self.q_bias` and `v_bias` Float[H],
                       no key bias (zero)
    type ids           s2s-ft's config.json `source_type_id` / `target_type_id`: the segment rows its seq2seq
                       fine-tuning embeds source and target with (UniLM's own seq2seq rows are 4 and 5); absent from
                       an s2s-ft config (`model_type` unilm or minilm), s2s-ft's defaults 0 and 1 (`UnilmConfig`,
                       `MinilmConfig`, `BertForSeq2SeqConfig`)
    relative positions UniLM v2's `rel_pos_bias` (config `rel_pos_bins`): a bias on the attention scores that our
                       model has no place for; refused by name

A per-task tensor holds one block per v1 ``task_idx``, and v1's code says which objective each is
(`BertForPreTrainingLossMask.forward`, which builds a task's attention mask and token types from ``task_idx``): 0
bidirectional, 1 left-to-right, 2 right-to-left, 3 seq2seq (`V1_TASK_IDX`); its seq2seq fine-tuning and decoding pass
``task_idx=3`` (`biunilm/seq2seq_loader.py`), and its `from_pretrained` keeps block ``task_idx`` when it loads such a
checkpoint into a model without the variant, 0 when none is given. Our model has one head and one position table
for all objectives, so a load takes one block: `TASK_SEQ2SEQ` for seq2seq fine-tuning, `TASK_DEFAULT` (the
bidirectional block) for everything else, as v1 does.
"""
from __future__ import annotations

import logging
import re
from typing import Any

import torch

from pretrain.masks import BIDIRECTIONAL, LEFT_TO_RIGHT, RIGHT_TO_LEFT, SEQ2SEQ

log = logging.getLogger(__name__)

V1_TASK_IDX = {BIDIRECTIONAL: 0, LEFT_TO_RIGHT: 1, RIGHT_TO_LEFT: 2, SEQ2SEQ: 3}
"""unilm-v1's ``task_idx`` of each of our objectives: the index its `BertForPreTrainingLossMask` builds that
objective's attention mask and token types from, and the block of a per-task tensor it reads for it."""
TASK_DEFAULT = V1_TASK_IDX[BIDIRECTIONAL]
"""The block v1's `from_pretrained` keeps when no ``task_idx`` is given (the bidirectional one); ours for everything
but seq2seq."""
TASK_SEQ2SEQ = V1_TASK_IDX[SEQ2SEQ]
"""The block v1's seq2seq fine-tuning and decoding use (``task_idx=3``)."""
UNILM_SEQ2SEQ_ROWS = (4, 5)
"""UniLM's segment rows of a seq2seq source and target (v1 `--new_segment_ids`; ours)."""
S2S_FT_MODEL_TYPES = ("unilm", "minilm")
"""The config.json ``model_type`` of s2s-ft's own checkpoints (`UnilmConfig`, `MinilmConfig`)."""
S2S_FT_DEFAULT_ROWS = (0, 1)
"""The ``source_type_id`` / ``target_type_id`` s2s-ft's configs take when their config.json has none."""

_HEAD_TRANSFORM = ("cls.predictions.transform.dense.weight", "cls.predictions.transform.dense.bias",
                   "cls.predictions.transform.LayerNorm.weight", "cls.predictions.transform.LayerNorm.bias",
                   "cls.predictions.transform.LayerNorm.gamma", "cls.predictions.transform.LayerNorm.beta")
_POSITIONS = "embeddings.position_embeddings.weight"
_SEGMENTS = "embeddings.token_type_embeddings.weight"
_FUSED_QKV = re.compile(r"^(.*attention\.self\.)(qkv_linear\.weight|q_bias|v_bias)$")
_RELATIVE_POSITIONS = re.compile(r"(^|\.)rel_pos_bias\.weight$")


def to_bert_layout(stored: dict[str, torch.Tensor], config: dict[str, Any], task: int, where: str
                   ) -> dict[str, torch.Tensor]:
    """``stored`` (a checkpoint's tensors under its config.json ``config``) in HF BERT's layout: per-task blocks
    (relax_projection, new_pos_ids) reduced to block ``task``, a fused QKV split, s2s-ft's source/target segment
    rows moved to UniLM's 4 and 5 (module docstring). A HF BERT checkpoint comes back as it was. ``where`` names the
    checkpoint in messages."""
    hidden = config["hidden_size"]
    relative = [name for name in stored if _RELATIVE_POSITIONS.search(name)]
    if relative or config.get("rel_pos_bins"):
        raise ValueError(f"{where}: a relative position bias ({relative[0] if relative else 'rel_pos_bins'}; UniLM "
                         "v2's layout) adds to the attention scores, which our model's absolute positions cannot "
                         "express: its outputs would not be the checkpoint's. UniLM v1 checkpoints and s2s-ft's "
                         "without rel_pos_bins load")
    out = _split_fused_qkv(stored, where)
    for name in list(out):
        if name in _HEAD_TRANSFORM or name.endswith("." + _POSITIONS) or name == _POSITIONS:
            out[name] = _task_block(name, out[name], hidden, task, where)
    segments = next((name for name in out if name.endswith(_SEGMENTS)), None)
    if segments is not None:
        out[segments] = _seq2seq_rows(out[segments], config, where)
    return out


def _task_block(name: str, tensor: torch.Tensor, hidden: int, task: int, where: str) -> torch.Tensor:
    """A per-task tensor's block ``task``: the head transform's k·H rows (weight) or entries (bias, LayerNorm), the
    position table's k·H columns. A tensor of one block is returned as it is."""
    along = 1 if name.endswith(_POSITIONS) else 0
    size = tensor.shape[along]
    if size == hidden or size % hidden:
        return tensor  # one block, or a size the shape check then names
    blocks = size // hidden
    if not 0 <= task < blocks:
        raise ValueError(f"{where}: {name} holds {blocks} task blocks, block {task} was asked for")
    log.info(f"{where}: {name} holds {blocks} per-task blocks (UniLM v1's "
             f"{'new_pos_ids' if along else 'relax_projection'}); block {task} is loaded")
    shape = (tensor.shape[0], blocks, hidden) if along else (blocks, hidden, *tensor.shape[1:])
    return tensor.reshape(shape).select(along, task).clone()


def _split_fused_qkv(stored: dict[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    """s2s-ft's fast-QKV tensors as HF BERT's query/key/value weights and biases (the key bias zero, as it is
    stored nowhere); other tensors as they are."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in stored.items():
        match = _FUSED_QKV.match(name)
        if match is None:
            out[name] = tensor
            continue
        prefix, part = match.groups()
        if part == "qkv_linear.weight":
            if tensor.shape[0] % 3:
                raise ValueError(f"{where}: {name} has {tensor.shape[0]} rows, not query, key and value stacked "
                                 "(a multiple of 3)")
            for which, block in zip(("query", "key", "value"), tensor.chunk(3, dim=0)):
                out[f"{prefix}{which}.weight"] = block.clone()
        elif part == "q_bias":
            out[f"{prefix}query.bias"] = tensor.reshape(-1)
        else:
            out[f"{prefix}value.bias"] = tensor.reshape(-1)
            out[f"{prefix}key.bias"] = torch.zeros_like(tensor.reshape(-1))
    return out


def seq2seq_type_ids(config: dict[str, Any]) -> tuple[Any, Any]:
    """The token types a checkpoint's config.json ``config`` embeds a seq2seq source and target with: its
    ``source_type_id`` / ``target_type_id`` where present; where absent, s2s-ft's defaults 0 and 1 for s2s-ft's
    own configs (``model_type`` unilm or minilm: s2s-ft fine-tunes and decodes them with those rows), UniLM's 4 and 5
    for any other (v1's release, our `--format unilm` export). Values as the config has them (checked by the
    caller)."""
    default = S2S_FT_DEFAULT_ROWS if config.get("model_type") in S2S_FT_MODEL_TYPES else UNILM_SEQ2SEQ_ROWS
    return config.get("source_type_id", default[0]), config.get("target_type_id", default[1])


def _seq2seq_rows(table: torch.Tensor, config: dict[str, Any], where: str) -> torch.Tensor:
    """A six-row segment table Float[6, H] whose config embeds a seq2seq source and target with other rows
    (`seq2seq_type_ids`) with those rows copied into UniLM's 4 and 5, where our seq2seq reads them; rows 0-3 and a
    table of another size stay as they are."""
    rows = seq2seq_type_ids(config)
    if table.shape[0] != 6 or rows == UNILM_SEQ2SEQ_ROWS:
        return table
    if not all(isinstance(row, int) and 0 <= row < 6 for row in rows):
        raise ValueError(f"{where}: source_type_id / target_type_id {rows} are not rows of its 6 token types")
    named = "source_type_id / target_type_id" if "source_type_id" in config or "target_type_id" in config \
        else f"s2s-ft's default source_type_id / target_type_id for model_type {config.get('model_type')}"
    log.info(f"{where}: its config embeds a seq2seq source and target with token types {rows[0]} and {rows[1]} "
             f"({named}); those rows become our seq2seq rows 4 and 5")
    out = table.clone()
    out[list(UNILM_SEQ2SEQ_ROWS)] = table[list(rows)]
    return out
