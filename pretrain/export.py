"""Export a training checkpoint to a Hugging Face BERT directory.

    python -m pretrain.export runs/tiny/checkpoints OUT            # the checkpoint `latest` names
    python -m pretrain.export runs/tiny/checkpoints/global_step40 OUT

Reads only the checkpoint's ``model_weights.safetensors`` (the full fp32 weights written at save time), after
its completion marker's sizes and sha256 check out; DeepSpeed's pickled files are never loaded. Rebuilds the
model from the model config recorded in the checkpoint and writes it through ``pretrain.hf.save_hf_bert`` into a
new directory beside OUT, renamed into place when complete. An existing non-empty OUT is refused without
``--force``; with it, OUT is replaced whole (no file of it survives).
"""
from __future__ import annotations

import argparse
from pathlib import Path

from pretrain import checkpoint as ckpt
from pretrain.model import ModelConfig, UniLMModel, build_model
from pretrain.outputs import check_output, replace_directory


def resolve_checkpoint(path: str | Path) -> tuple[Path, str]:
    """(checkpoints directory, tag) for a checkpoints directory (its ``latest``) or a tag directory."""
    return ckpt.resolve_tag_dir(path)


def load_consolidated(path: str | Path) -> UniLMModel:
    """The model of a valid checkpoint with its full fp32 weights (``pretrain.checkpoint.load_weights``)."""
    meta, state = ckpt.load_weights(path)
    model = build_model(ModelConfig(**meta["model_config"]))
    model.load_state_dict(state)
    return model


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="checkpoints directory (uses latest) or one global_stepN directory")
    parser.add_argument("out", help="output Hugging Face directory")
    parser.add_argument("--architecture", default="BertForPreTraining",
                        choices=["BertForPreTraining", "BertForMaskedLM", "BertModel"])
    parser.add_argument("--force", action="store_true", help="replace an existing non-empty OUT entirely")
    args = parser.parse_args(argv)
    from pretrain.hf import save_hf_bert
    try:
        out = check_output(args.out, inputs=[args.checkpoint], force=args.force, replaced_whole=True)
    except (ValueError, FileExistsError) as error:
        parser.error(str(error))
    model = load_consolidated(args.checkpoint)
    print(replace_directory(out, lambda tmp: save_hf_bert(model, tmp, architecture=args.architecture)))


if __name__ == "__main__":
    main()
