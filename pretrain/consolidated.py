"""A training checkpoint's consolidated fp32 weights as a model, and the vocabulary it was trained with.

Shared by export (`python -m pretrain.export`), fine-tuning's `--init` and pre-training's ``model.init_from``: each
reads only the checkpoint's ``model_weights.safetensors`` after its completion marker's sizes and sha256 check out
(`pretrain.checkpoint.load_weights`), rebuilds the model from the model config the marker records, and finds the
tokenizer through the run config's shard directory, whose vocabulary must hash to the one the checkpoint recorded.
"""
from __future__ import annotations

from pathlib import Path

from common.files import sha256_file
from data_prep.shard_format import read_manifest
from pretrain import checkpoint as ckpt
from pretrain.model import ModelConfig, UniLMModel, build_model


def resolve_checkpoint(path: str | Path) -> tuple[Path, str]:
    """(checkpoints directory, tag) for a checkpoints directory (its ``latest``) or a tag directory."""
    return ckpt.resolve_tag_dir(path)


def load_consolidated(path: str | Path) -> UniLMModel:
    """The model of a valid checkpoint with its full fp32 weights (``pretrain.checkpoint.load_weights``)."""
    meta, state = ckpt.load_weights(path)
    model = build_model(ModelConfig.from_dict(meta["model_config"]))
    model.load_state_dict(state)
    return model


def shard_vocabulary(checkpoint: str | Path, shards: str | Path | None = None) -> tuple[Path, bool]:
    """(vocab.txt, uncased) of the shards a checkpoint was trained on, checked against its recorded vocab hash.
    Reads the marker (file sizes checked); the weights' sha256 are checked where they are read (`load_consolidated`)."""

    directory, tag = resolve_checkpoint(checkpoint)
    meta, problem = ckpt.verify_tag(directory / tag, hashes=False)
    if meta is None:
        raise FileNotFoundError(f"{directory / tag} is not a valid checkpoint: {problem}")
    recorded = None
    if shards is None:
        recorded = meta.get("run_config", {}).get("data", {}).get("shards")
        if recorded is None:
            raise ValueError(f"{directory / tag}: its marker records no run config naming the shards it was trained "
                             "on; pass --shards DIR (the shard directory whose vocabulary the model uses)")
        shards = recorded
    shards = Path(shards)
    try:
        manifest = read_manifest(shards)
    except (OSError, ValueError) as error:
        if recorded is None:
            raise
        raise type(error)(f"{error}; the run's shards were at {shards} when it trained: if they moved, pass "
                          "--shards DIR (the shard directory whose vocabulary the model uses)") from error
    vocab = shards / manifest["vocab"]["file"]
    digest = sha256_file(vocab) if vocab.is_file() else None
    if digest is None or digest != meta.get("vocab_hash", digest):
        raise ValueError(f"{vocab}: {'missing' if digest is None else 'not the vocabulary'} the checkpoint "
                         f"{directory / tag} was trained with (sha256 {str(meta.get('vocab_hash'))[:12]}…); "
                         "pass --shards DIR for the shard directory of that run")
    return vocab, bool(manifest["vocab"].get("uncased", False))
