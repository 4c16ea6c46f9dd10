"""Export a training checkpoint to a Hugging Face BERT directory.

    python -m pretrain.export runs/tiny/checkpoints OUT            # the checkpoint `latest` names
    python -m pretrain.export runs/tiny/checkpoints/global_step40 OUT
    python -m pretrain.export runs/gpt/checkpoints OUT --architecture BertModel
    python -m pretrain.export runs/unilm/checkpoints OUT --format unilm     # all 6 segment types, for seq2seq

The HF class follows the model (``pretrain.hf.hf_architectures``): a masked-LM model (unilm, bert) exports as
``BertForPreTraining`` (or ``--architecture BertForMaskedLM | BertModel``), a causal LM (``causal_lm``, the gpt
preset) as ``BertLMHeadModel`` with ``is_decoder: true``, so transformers applies the causal mask (or
``BertModel``); a class that cannot express the model is refused before anything is written.

``--format bert`` (the default) writes HF BERT's 2 token types (segment rows 0/1, bidirectional A/B).
``--format unilm`` writes all 6 segment rows as token types 0..5 (``type_vocab_size: 6``) and the fields
microsoft/unilm's s2s-ft reads, ``source_type_id: 4`` and ``target_type_id: 5`` (``pretrain.hf.UNILM_SEQ2SEQ_CONFIG``),
as ``BertForMaskedLM`` by default: given token types 4/5 and the seq2seq mask as a 3-D ``attention_mask``, it
predicts a seq2seq input's tokens as our model does (docs/finetuning.md has a greedy decoding recipe). The same
tensors also go to ``pytorch_model.bin`` (a plain state dict, torch's pre-1.6 format) and the config to
``bert_config.json``: what microsoft/unilm's own loaders (unilm-v1's and s2s-ft's ``from_pretrained``) open. It is for
a masked-LM model; a causal LM (which embeds only the left-to-right row) is refused.

Reads only the checkpoint's ``model_weights.safetensors`` (the full fp32 weights written at save time), after
its completion marker's sizes and sha256 check out; DeepSpeed's pickled files are never loaded. Rebuilds the
model from the model config recorded in the checkpoint and writes it through ``pretrain.hf.save_hf_bert`` into a
new directory beside OUT, renamed into place when complete. An existing non-empty OUT is refused without
``--force``; with it, OUT is replaced whole (no file of it survives).
The tokenizer comes along: the run config in the checkpoint names the shard directory (``data.shards``, or
``--shards DIR`` if it moved), whose manifest names the vocabulary and its casing; its hash must be the one the
checkpoint recorded. ``vocab.txt``, ``tokenizer_config.json`` and ``special_tokens_map.json`` make
``AutoTokenizer.from_pretrained(OUT)`` tokenize as the shards were tokenized.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from data_prep.vocab import write_hf_tokenizer
from pretrain.consolidated import load_consolidated, shard_vocabulary
from pretrain.hf import HF_ARCHITECTURES, check_architecture, save_hf_bert
from pretrain.outputs import check_output, replace_directory


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pretrain.export", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="checkpoints directory (uses latest) or one global_stepN directory")
    parser.add_argument("out", help="output Hugging Face directory")
    parser.add_argument("--architecture", choices=list(HF_ARCHITECTURES),
                        help="the transformers class to load it with (default: BertForPreTraining for a masked-LM "
                             "model, BertLMHeadModel for a causal LM)")
    parser.add_argument("--format", choices=("bert", "unilm"), default="bert",
                        help="bert: HF BERT's 2 token types (default); unilm: all 6 segment types, with s2s-ft's "
                             "source_type_id 4 / target_type_id 5, as BertForMaskedLM unless --architecture")
    parser.add_argument("--shards", help="the run's shard directory, if it is no longer at the run config's "
                                         "data.shards (the tokenizer comes from its manifest)")
    parser.add_argument("--force", action="store_true", help="replace an existing non-empty OUT entirely")
    args = parser.parse_args(argv)
    try:
        out = check_output(args.out, inputs=[args.checkpoint], force=args.force, replaced_whole=True)
        vocab, uncased = shard_vocabulary(args.checkpoint, args.shards)  # before writing anything
    except (ValueError, FileExistsError) as error:
        parser.error(str(error))
    try:
        model = load_consolidated(args.checkpoint)
    except (OSError, ValueError) as error:  # an incomplete or corrupted checkpoint: its marker's check names it
        parser.error(str(error))
    unilm = args.format == "unilm"
    if unilm and model.cfg.causal_lm:
        parser.error("--format unilm: this checkpoint is a causal LM (causal_lm=true), which embeds only the "
                     "left-to-right segment row; export it with --format bert")
    architecture = args.architecture or ("BertForMaskedLM" if unilm else None)
    if architecture is not None:  # before anything is written
        try:
            check_architecture(model.cfg, architecture)
        except ValueError as error:
            parser.error(f"--architecture: {error}")

    def write(directory: Path) -> Path:
        written = save_hf_bert(model, directory, architecture=architecture, all_segments=unilm)
        write_hf_tokenizer(vocab, uncased, directory, model.cfg.max_position_embeddings)
        return written
    print(replace_directory(out, write))


if __name__ == "__main__":
    main()
