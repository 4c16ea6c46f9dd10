"""Export a training checkpoint to a Hugging Face BERT directory.

    python -m pretrain.export runs/tiny/checkpoints OUT            # newest complete checkpoint (`latest`)
    python -m pretrain.export runs/tiny/checkpoints/global_step40 OUT

Consolidates the (possibly ZeRO-partitioned) weights with DeepSpeed's zero_to_fp32, rebuilds the model from the
model config recorded in the checkpoint, and writes it through ``pretrain.hf.save_hf_bert``.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

from pretrain import checkpoint as ckpt
from pretrain.hf import save_hf_bert
from pretrain.model import ModelConfig, UniLMModel, build_model


def resolve_checkpoint(path: str | Path) -> tuple[Path, str]:
    """(checkpoints directory, tag) for a checkpoints directory (its ``latest``) or a tag directory."""
    path = Path(path)
    if (path / ckpt.LATEST).is_file():
        return path, (path / ckpt.LATEST).read_text().strip()
    return path.parent, path.name


def load_consolidated(path: str | Path) -> UniLMModel:
    """The model of a complete checkpoint with fp32 weights gathered from every ZeRO partition."""
    directory, tag = resolve_checkpoint(path)
    meta = ckpt.read_marker(directory / tag)
    if meta is None:
        raise FileNotFoundError(f"{directory / tag} is not a complete checkpoint (no valid {ckpt.MARKER})")
    model = build_model(ModelConfig.from_dict(meta["model_config"]))
    if meta["zero_stage"] == 0:  # no partitions: the module state is stored whole
        state = torch.load(directory / tag / "mp_rank_00_model_states.pt", map_location="cpu",
                           weights_only=False)["module"]
    else:
        state = get_fp32_state_dict_from_zero_checkpoint(str(directory), tag=tag)
    model.load_state_dict({k: v.float() for k, v in state.items()})
    return model


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="checkpoints directory (uses latest) or one global_stepN directory")
    parser.add_argument("out", help="output Hugging Face directory")
    parser.add_argument("--architecture", default="BertForPreTraining",
                        choices=["BertForPreTraining", "BertForMaskedLM", "BertModel"])
    args = parser.parse_args(argv)
    print(save_hf_bert(load_consolidated(args.checkpoint), args.out, architecture=args.architecture))


if __name__ == "__main__":
    main()
