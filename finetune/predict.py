"""Predict with a fine-tuned classifier or extractive QA model: `python -m finetune.predict --model OUT --input FILE
--output PRED`.

Classification: FILE is read as the model's training files were (the `glue_task`, columns and label rule saved
with the model; `--glue-task` reads another GLUE layout, e.g. AX's with an MNLI model). PRED holds one line per
example under the header `index<TAB>prediction`, GLUE's submission format: the file's own ids (its `index`, `idx`
or `id` column) or else 0, 1, ...; class names (for GLUE files, the labels GLUE's TSVs use), scores for
regression, choice indices for multiple choice. So that PRED is a valid submission, a GLUE task's files (by
`--glue-task`, the model's `glue_task`, or a file in another task's directory of GLUE's layout) are refused unless
the model was fine-tuned on that task (AX: on MNLI) with its classes; a pair model's input without the second text
column is refused; and so is an unlabelled file's malformed row, which would leave PRED a line short.

Extractive QA: FILE is a SQuAD JSON file (its questions may come without answers); PRED is `{question id: answer}`
as BERT's run_squad writes `predictions.json` and the official evaluation scripts read it ("" = no answer, SQuAD
2.0), and for SQuAD 2.0 `PRED.null_odds.json` beside it, each question's [CLS] score minus its best span's (the
v2.0 evaluation's `--na-prob-file`; pass the run's `null_score_diff_threshold` as its `--na-prob-thresh` too, whose
default 1.0 otherwise decides the headline EM/F1), with the fine-tuning run's windows and
`null_score_diff_threshold`.

When every example has a label (every question its answers), the fine-tuning dev scores of the predictions go to
`PRED.metrics.json` too, so a second dev set (MNLI mismatched) is scored the same way. Outputs are written beside
their names and renamed into place, or not at all. Seq2seq models decode with `finetune.decode`.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from common.files import write_atomically
from pretrain.console import configure_console
from pretrain.outputs import check_output

from . import classify, qa
from .cli import beside, device_argument, int_at_least, refuse_distributed_launch
from .glue import GLUE_TASKS, check_model_task, read_records, record_format, task_of_path
from .model_io import Finetuned, load_finetuned
from .tasks import check_positions


def format_prediction(value: int | float, labels: classify.LabelSpace) -> str:
    if labels.regression:
        return f"{value:.4f}"
    return str(value) if labels.multiple_choice else labels.classes[int(value)]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m finetune.predict",
                                     description="Predict with a fine-tuned classifier (GLUE's submission format) or "
                                                 "extractive QA model (SQuAD predictions.json); score labelled input.",
                                     epilog="Input formats and GLUE's layouts: docs/finetuning.md")
    parser.add_argument("--model", required=True, help="a classify or qa fine-tuning output directory")
    parser.add_argument("--input", required=True,
                        help="classify: .jsonl, .tsv, .csv or .parquet, as in training; qa: SQuAD JSON")
    parser.add_argument("--output", required=True,
                        help="classify: index<TAB>prediction per line (GLUE's format); qa: {id: answer} JSON")
    parser.add_argument("--glue-task", choices=sorted(GLUE_TASKS), default=None,
                        help="classify: read --input as this GLUE task's files (default: as the model's training "
                             "files)")
    parser.add_argument("--max-seq-len", type=int_at_least(3), default=None, help="default: the fine-tuning run's")
    parser.add_argument("--batch-size", type=int_at_least(1), default=64, help="inputs per forward pass (default 64)")
    parser.add_argument("--device", default=None,
                        help="torch device (default: this process's GPU when there is one, else cpu)")
    parser.add_argument("--force", action="store_true", help="replace an existing non-empty --output")
    args = parser.parse_args(argv)
    configure_console()
    refuse_distributed_launch(parser)
    if Path(args.input).is_dir():
        parser.error(f"--input {args.input} is a directory; name a file")
    device = device_argument(parser, args.device)
    try:
        check_output(args.output, [args.input, args.model], force=args.force, file=True)
        finetuned = load_finetuned(args.model)
    except (ValueError, OSError) as error:
        parser.error(str(error))
    if finetuned.task is None:
        parser.error(f"--model {args.model} is not a fine-tuning output (no finetune.json): finetune.predict runs the "
                     "classify and qa models `finetune.run` writes")
    if finetuned.task not in ("classify", "qa"):
        parser.error(f"--model {args.model} was fine-tuned for {finetuned.task!r}: finetune.predict runs classify and "
                     "qa models (seq2seq: finetune.decode)")
    if args.glue_task is not None and finetuned.task != "classify":
        parser.error("--glue-task goes with a classify model")
    settings = dict(finetuned.run_settings)
    max_seq_len = args.max_seq_len or settings.get("max_seq_len", 128)
    try:
        check_positions(finetuned.model, max_seq_len, "--max-seq-len")
    except ValueError as error:
        parser.error(str(error))
    run = predict_classify if finetuned.task == "classify" else predict_qa
    try:
        result, labelled = run(args, finetuned, settings, max_seq_len, device)
    except (ValueError, FileNotFoundError) as error:
        parser.error(str(error))
    if labelled:
        scores_file = beside(args.output, ".metrics.json")
        write_atomically(scores_file, lambda tmp: tmp.write_text(json.dumps(result, indent=2) + "\n"))
        print("[predict] " + "  ".join(f"{k} {v:.4f}" for k, v in result.items()) + f" → {scores_file}")
    return result


def check_glue_task(args: argparse.Namespace, finetuned: Finetuned) -> None:
    """Refuse a GLUE task's files the classifier cannot predict (`glue.check_model_task`): `--glue-task`'s, else
    those in another task's directory of GLUE's layout when the model was fine-tuned on a GLUE task, else its
    own task's."""
    model_task = finetuned.run_settings.get("glue_task")
    labels = classify.LabelSpace.of_model(finetuned.meta)
    task = args.glue_task or (task_of_path(args.input) if model_task is not None else None) or model_task
    if task is None:
        return
    try:
        check_model_task(task, model_task, labels.classes, labels.regression)
    except ValueError as error:
        if args.glue_task is not None:
            raise ValueError(f"--glue-task {task}: --model {args.model}: {error}") from None
        if task != model_task:
            raise ValueError(f"--input {args.input} is among GLUE's {task} files (by its directory), but --model "
                             f"{args.model}: {error} (or pass --glue-task {model_task} to read it as "
                             f"{model_task}'s)") from None
        raise ValueError(f"--model {args.model} (glue_task {task}): {error}") from None


def predict_classify(args: argparse.Namespace, finetuned: Finetuned, settings: dict, max_seq_len: int,
                     device: torch.device) -> tuple[dict, bool]:
    """Write the classifier's predictions for `args.input`; (its scores, True) when every example is labelled."""
    check_glue_task(args, finetuned)
    if args.glue_task is not None:
        settings = dict(settings, glue_task=args.glue_task)
    model = classify.ClassifierModel.from_finetuned(finetuned).to(device)
    labels = model.labels
    fmt = record_format(settings)
    # a GLUE task's format says whether it reads pairs; other models' runs recorded whether they trained on any
    pairs = bool(fmt.text_b) if fmt.glue else bool(finetuned.meta.get("pairs"))
    records = read_records(args.input, fmt, pairs=pairs, predicting=True)
    labelled = all("label" in r for r in records)
    examples, truncated = classify.encode_examples(records, finetuned.tokenizer, labels, max_seq_len,
                                                   bool(settings.get("similarity")), where=args.input,
                                                   labelled=labelled)
    began = time.perf_counter()
    predictions = classify.predict(model, examples, finetuned.tokenizer.pad_id, args.batch_size)
    seconds = time.perf_counter() - began
    ids = [r.get("index", number) for number, r in enumerate(records)]
    lines = ["index\tprediction"] + [f"{i}\t{format_prediction(p, labels)}" for i, p in zip(ids, predictions)]
    write_atomically(args.output, lambda tmp: tmp.write_text("\n".join(lines) + "\n", encoding="utf-8"))
    print(f"[predict] {len(records)} examples in {seconds:.1f}s ({truncated} inputs cut to {max_seq_len} word "
          f"pieces) → {args.output}", flush=True)
    if not labelled:
        print(f"[predict] {sum('label' not in r for r in records)} of {len(records)} examples have no label: "
              "not scored")
        return {"predictions": len(predictions)}, False
    positive = classify.positive_class(labels, finetuned.meta.get("positive_label"), args.model)
    return classify.scores(predictions, [e.label for e in examples], labels, positive), True


def predict_qa(args: argparse.Namespace, finetuned: Finetuned, settings: dict, max_seq_len: int,
               device: torch.device) -> tuple[dict, bool]:
    """Write the span model's answers for `args.input` (and SQuAD 2.0's null odds); (its scores, True) when
    every question has its answers."""
    questions, file_version_2 = qa.read_squad(args.input, labelled=False)
    # SQuAD 2.0 or 1.1 is the model's: a 2.0 model may answer "" to bare questions, a 1.1 model always answers a span
    version_2 = bool(finetuned.meta.get("version_2"))
    windows = qa.make_windows(questions, finetuned.tokenizer, max_seq_len, settings.get("doc_stride", 128),
                              settings.get("max_query_len", 64))
    model = qa.SpanModel(finetuned.model)
    model.head.load_state_dict(finetuned.head_state)
    model.to(device)
    began = time.perf_counter()
    predictions = qa.predict_spans(model, questions, windows, finetuned.tokenizer.pad_id,
                                   settings.get("max_answer_len", 30), args.batch_size)
    seconds = time.perf_counter() - began
    threshold = settings.get("null_score_diff_threshold", 0.0)
    answers = qa.answers_of(predictions, questions, version_2, threshold)
    write_atomically(args.output, lambda tmp: tmp.write_text(json.dumps(answers, indent=1, ensure_ascii=False)
                                                                   + "\n", encoding="utf-8"))
    odds_file = beside(args.output, ".null_odds.json")
    if version_2:
        odds = {q.qid: p.null_margin for q, p in zip(questions, predictions)}  # inf: no span offered
        write_atomically(odds_file, lambda tmp: tmp.write_text(json.dumps(odds, indent=1) + "\n"))
    print(f"[predict] {len(questions)} questions ({len(windows)} windows) in {seconds:.1f}s → {args.output}"
          + (f" and {odds_file}" if version_2 else ""), flush=True)
    if version_2:
        print(f"[predict] score them with the official evaluate-v2.0.py as `--na-prob-file {odds_file} "
              f"--na-prob-thresh {threshold}`: the run's null_score_diff_threshold (the script's default, 1.0, "
              "would decide its headline EM/F1)", flush=True)
    if not all(q.labelled for q in questions):
        print(f"[predict] {sum(not q.labelled for q in questions)} of {len(questions)} questions have no answers: "
              "not scored")
        return {"predictions": len(questions)}, False
    return qa.scores(predictions, questions, version_2, threshold, file_version_2), True


if __name__ == "__main__":
    main()
