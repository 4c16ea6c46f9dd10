"""Predict with a fine-tuned classifier: `python -m finetune.predict --model OUT --input FILE --output PRED.tsv`.

FILE is read as the model's training files were (the `glue_task`, columns and label rule saved with the model;
`--glue-task` reads another GLUE layout, e.g. AX's with an MNLI model). PRED.tsv holds one line per example under
the header `index<TAB>prediction`, GLUE's submission format: the file's own ids (its `index`, `idx` or `id`
column) or else 0, 1, ...; class names (for GLUE files, the labels GLUE's TSVs use), scores for regression,
choice indices for multiple choice. When every example has a label, the fine-tuning dev scores of the
predictions go to PRED.metrics.json too, so a second dev set (MNLI mismatched) is scored the same way. The output
is written beside its name and renamed into place, or not at all. Seq2seq models decode with `finetune.decode`.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from pretrain.accelerator import default_device
from pretrain.outputs import check_output, write_file_atomically

from . import classify
from .glue import GLUE_TASKS, read_records, record_format
from .model_io import load_finetuned


def metrics_path(output: str | Path) -> Path:
    """`pred.tsv` → `pred.metrics.json` (beside the output)."""
    output = Path(output)
    return output.with_name(output.name.removesuffix(output.suffix) + ".metrics.json")


def format_prediction(value: int | float, labels: classify.LabelSpace) -> str:
    if labels.regression:
        return f"{value:.4f}"
    return str(value) if labels.multiple_choice else labels.classes[value]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m finetune.predict",
                                     description="Predict with a fine-tuned classifier; score a labelled input. "
                                                 "Writes index<TAB>prediction lines (GLUE's submission format).",
                                     epilog="Input formats and GLUE's layouts: docs/finetuning.md")
    parser.add_argument("--model", required=True, help="a classify fine-tuning output directory")
    parser.add_argument("--input", required=True, help="examples: .jsonl, .tsv, .csv or .parquet, as in training")
    parser.add_argument("--output", required=True, help="predictions, index<TAB>prediction per line (GLUE's format)")
    parser.add_argument("--glue-task", choices=sorted(GLUE_TASKS), default=None,
                        help="read --input as this GLUE task's files (default: as the model's training files)")
    parser.add_argument("--max-seq-len", type=int, default=None, help="default: the fine-tuning run's")
    parser.add_argument("--batch-size", type=int, default=64, help="examples per forward pass (default 64)")
    parser.add_argument("--device", default=None,
                        help="torch device (default: this process's GPU when there is one, else cpu)")
    parser.add_argument("--force", action="store_true", help="replace an existing non-empty --output")
    args = parser.parse_args(argv)
    if args.batch_size < 1 or (args.max_seq_len is not None and args.max_seq_len < 3):
        parser.error("need --batch-size >= 1 and --max-seq-len >= 3")
    try:
        check_output(args.output, [args.input, args.model], force=args.force)
        finetuned = load_finetuned(args.model, expect_task="classify")
    except (ValueError, OSError) as error:
        parser.error(str(error))
    settings = dict(finetuned.run_settings)
    if args.glue_task is not None:
        settings["glue_task"] = args.glue_task
    labels = classify.LabelSpace.of_model(finetuned.meta)
    max_seq_len = args.max_seq_len or settings.get("max_seq_len", 128)
    if max_seq_len > finetuned.model.cfg.max_position_embeddings:
        parser.error(f"--max-seq-len {max_seq_len} exceeds the model's {finetuned.model.cfg.max_position_embeddings} "
                     "positions")
    try:
        records = read_records(args.input, record_format(settings))
        labelled = all("label" in r for r in records)
        examples, truncated = classify.encode_examples(records, finetuned.tokenizer, labels, max_seq_len,
                                                       bool(settings.get("similarity")), where=args.input,
                                                       labelled=labelled)
    except (ValueError, FileNotFoundError) as error:
        parser.error(str(error))
    model = classify.ClassifierModel(finetuned.model, labels, dropout=0.0)
    model.head.load_state_dict(finetuned.head_state)
    model.to(torch.device(args.device) if args.device else default_device())
    began = time.perf_counter()
    predictions = classify.predict(model, examples, finetuned.tokenizer.pad_id, args.batch_size)
    seconds = time.perf_counter() - began
    ids = [r.get("index", number) for number, r in enumerate(records)]
    lines = ["index\tprediction"] + [f"{i}\t{format_prediction(p, labels)}" for i, p in zip(ids, predictions)]
    write_file_atomically(args.output, lambda tmp: tmp.write_text("\n".join(lines) + "\n", encoding="utf-8"))
    print(f"[predict] {len(records)} examples in {seconds:.1f}s ({truncated} inputs cut to {max_seq_len} word "
          f"pieces) → {args.output}", flush=True)
    result: dict = {"predictions": len(predictions)}
    if labelled:
        positive_label = finetuned.meta.get("positive_label")
        positive = labels.classes.index(positive_label) if positive_label in labels.classes else None
        result = classify.scores(predictions, [e.label for e in examples], labels, positive)
        write_file_atomically(metrics_path(args.output),
                              lambda tmp: tmp.write_text(json.dumps(result, indent=2) + "\n"))
        print("[predict] " + "  ".join(f"{k} {v:.4f}" for k, v in result.items()) + f" → {metrics_path(args.output)}")
    else:
        unlabelled = sum("label" not in r for r in records)
        print(f"[predict] {unlabelled} of {len(records)} examples have no label: not scored")
    return result


if __name__ == "__main__":
    main()
