"""Pre-training application: what ``model.init_from`` starts a run from — a Hugging Face BERT directory, or this
pipeline's own checkpoint (phase 2 from phase 1), whose weights, and with ``train.init_optimizer`` Adam moments, the
new run takes over exactly.

A checkpoint is named by its checkpoints directory (the tag its ``latest`` names) or one ``global_stepN`` directory.
Its ``model_weights.safetensors`` (fp32, all six segment rows) and ``adam_moments.safetensors`` are read only after
its marker's sizes and sha256 check out (`pretrain.checkpoint.verify_tag`); DeepSpeed's pickles are never read. The
architecture is the checkpoint's: ``model.overrides`` may change its dropout and lengthen its position table
(``max_position_embeddings``: rows past the checkpoint's repeat the learned ones, as microsoft/unilm extends BERT's
512 for CNN/DailyMail, and so do their Adam moments); any other field that differs is refused by name. What stays
the new run's own: its shards and sequence length (the checkpoint's ``max_position_embeddings`` must cover them),
its learning-rate schedule, its batch sizes, world size and ZeRO stage (0-2 for the moments); its consumed samples
start at 0.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from pretrain import checkpoint as ckpt
from pretrain.hf import extend_position_table, hf_model_config, load_hf_bert
from pretrain.model import ModelConfig, UniLMModel, build_model
from pretrain.moments import KEYS, MOMENTS, MomentsUnavailable, read_moments, set_moments

log = logging.getLogger(__name__)

POSITION_TABLE = "embeddings.position.weight"
TRAINING_FIELDS = ("hidden_dropout", "attention_dropout")
"""`ModelConfig` fields a run started from a checkpoint may set anew (``model.overrides``): they shape no weight."""


def is_checkpoint(init_from: str | Path) -> bool:
    """Whether ``init_from`` names this pipeline's checkpoint (a directory with ``latest``, a tag directory with a
    marker, or any ``global_stepN`` directory: an unfinished one is then refused, naming what is missing) rather
    than a Hugging Face directory."""
    path = Path(init_from)
    return (path / ckpt.LATEST).is_file() or (path / ckpt.MARKER).is_file() or ckpt.step_of_tag(path.name) is not None


def checkpoint_marker(init_from: str | Path, hashes: bool = False) -> tuple[Path, dict[str, Any]]:
    """(tag directory, marker) of a valid checkpoint; ``hashes``: every file's sha256 checked too (sizes always).
    A checkpoint that is not complete is refused naming the file at fault."""
    directory, tag = ckpt.resolve_tag_dir(init_from)
    meta, problem = ckpt.verify_tag(directory / tag, hashes=hashes)
    if meta is None:
        raise FileNotFoundError(f"{directory / tag} is not a valid checkpoint: {problem}")
    return directory / tag, meta


def init_model_config(init_from: str) -> ModelConfig:
    """The architecture ``model.init_from`` holds: its marker's model config, or the HF directory's config.json."""
    if not is_checkpoint(init_from):
        return hf_model_config(init_from)
    _, meta = checkpoint_marker(init_from)
    return ModelConfig.from_dict(meta["model_config"])


def check_same_architecture(saved: ModelConfig, model_cfg: ModelConfig, where: str) -> None:
    """Refuse a model config (``model.overrides`` on top of the checkpoint's) whose architecture differs from the
    checkpoint's, naming the first differing field: its weights would not fit, or not mean the same. A longer
    position table is allowed: its rows past the checkpoint's repeat the learned ones (`extend_position_table`)."""
    for name in ModelConfig.__dataclass_fields__:
        if name == "max_position_embeddings" and model_cfg.max_position_embeddings >= saved.max_position_embeddings:
            continue
        if name not in TRAINING_FIELDS and getattr(saved, name) != getattr(model_cfg, name):
            raise ValueError(f"model.init_from {where} was trained with {name}={getattr(saved, name)!r}, this run "
                             f"sets model.overrides.{name}={getattr(model_cfg, name)!r}: a run started from a "
                             "checkpoint keeps its architecture (only hidden_dropout and attention_dropout may "
                             "change, and max_position_embeddings grow); drop that override")


def _longer_positions(state: dict[str, torch.Tensor], rows: int, prefix: str = "") -> dict[str, torch.Tensor]:
    """``state`` with its position table (``prefix`` + `POSITION_TABLE`) extended to ``rows`` rows by microsoft/unilm's
    rule (`extend_position_table`); a table that has them already is left as it is."""
    name = prefix + POSITION_TABLE
    if name in state and state[name].shape[0] < rows:
        state = {**state, name: extend_position_table(state[name], rows)}
    return state


def load_initial_model(init_from: str, model_cfg: ModelConfig) -> UniLMModel:
    """The model ``model_cfg`` with ``init_from``'s weights: a checkpoint's fp32 weights exactly (hash-checked; a
    tensor missing, unknown or of another shape is refused naming the file), or an HF directory's
    (`pretrain.hf.load_hf_bert`)."""
    if not is_checkpoint(init_from):
        return load_hf_bert(init_from, model_cfg)
    _, state = ckpt.load_weights(init_from)
    state = _longer_positions(state, model_cfg.max_position_embeddings)
    model = build_model(model_cfg)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        directory, tag = ckpt.resolve_tag_dir(init_from)
        raise ValueError(f"{directory / tag / ckpt.WEIGHTS}: "
                         + (f"no tensor for {', '.join(missing[:3])}" if missing else
                            f"tensors this model does not have: {', '.join(unexpected[:3])}"))
    return model


def init_optimizer(engine: Any, init_from: str) -> int:
    """Set the Adam moments and step count ``init_from`` (a checkpoint) recorded into ``engine``'s optimizer, before
    its first step (every rank); returns the step count. A checkpoint without them, an HF directory, or a ZeRO
    layout they cannot be mapped into is refused naming why."""
    if not is_checkpoint(init_from):
        raise ValueError(f"train.init_optimizer=true needs model.init_from to be a checkpoint of this pipeline (a "
                         f"checkpoints or global_stepN directory); {init_from} is a Hugging Face directory, which "
                         "holds no optimizer state")
    tag_dir, meta = checkpoint_marker(init_from, hashes=True)
    if MOMENTS not in meta["files"]:
        raise ValueError(f"{tag_dir} holds no {MOMENTS} (a ZeRO-3 or ZeRO-0 fp16 run, or one saved by an older "
                         "version of this code): its Adam moments cannot be taken over; set train.init_optimizer=false "
                         "to start the optimizer afresh")
    moments = read_moments(tag_dir / MOMENTS)
    for key in KEYS:  # a longer position table's new rows take the moments of the rows they copy
        moments = _longer_positions(moments, engine.module.cfg.max_position_embeddings, f"{key}/")
    try:
        step = set_moments(engine, moments, str(tag_dir / MOMENTS))
    except MomentsUnavailable as error:
        raise ValueError(f"train.init_optimizer=true: this run's {error}; use ZeRO 0-2 (not ZeRO-0 fp16), or set "
                         "train.init_optimizer=false") from None
    return step
