"""Where fine-tuning models come from and go to.

A fine-tuning output directory is a Hugging Face BERT directory plus what HF BERT cannot hold:

    config.json, model.safetensors   `pretrain.hf.save_hf_bert`: loads in `transformers` as the task's class with
                                     its trained head (`hf_task_class`: BertForSequenceClassification with the
                                     labels as `id2label`, BertForMultipleChoice, BertForQuestionAnswering), so
                                     its pipelines run it; else (seq2seq, GPT heads) as the backbone:
                                     BertForPreTraining, a causal LM's BertLMHeadModel (is_decoder)
    vocab.txt, tokenizer_config.json the vocabulary it was trained with and its casing, and
    special_tokens_map.json          (`data_prep.vocab.write_hf_tokenizer`: `AutoTokenizer` loads them)
    finetune_extra.safetensors       the task head (`head.*`), all 6 segment rows (`embeddings.segment.weight`:
                                     HF keeps only 2, seq2seq uses rows 4/5) and the backbone's heads the HF
                                     class has no place for (MLM, NSP; the pooler for QA)
    finetune.json                    format version, task, labels, model config, run settings, and the sha256
                                     of every file above (written last: it vouches for a complete set)

Saving writes the files beside their names and renames them into place, `finetune.json` last (removed first),
so an interrupted save is detected on load instead of mixing an old head with new weights: `load_finetuned` and
`load_init` check every hash `finetune.json` records, and refuse a `finetune_extra.safetensors` without it.

`load_init` accepts that, a plain HF BERT directory (microsoft/unilm's layouts too: UniLM v1's `.bin` given by
name beside its BERT config, s2s-ft's UniLM and MiniLM directories; `pretrain.unilm_layouts`), or a pre-training
checkpoint (a DeepSpeed tag directory
with our `complete.json` marker, or its parent `checkpoints/` directory; its `model_weights.safetensors` is read
after the marker's hashes check out, by `pretrain.consolidated.load_consolidated`; its tokenizer is its shards'
vocabulary and casing, found through the run config it records, or `--vocab` when the shards moved, checked against the
vocabulary hash it records). Nothing is unpickled.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from common.files import sha256_file
from data_prep.vocab import write_hf_tokenizer
from pretrain import checkpoint as ckpt
from pretrain.consolidated import load_consolidated, resolve_checkpoint, shard_vocabulary
from pretrain.hf import HF_TASK_ARCHITECTURES, hf_config_file, load_hf_bert, save_hf_bert, to_hf_name, with_positions
from pretrain.model import UniLMModel
from pretrain.unilm_layouts import TASK_DEFAULT, TASK_SEQ2SEQ
from pretrain.weight_files import WEIGHT_FILE_SUFFIXES, git_lfs_pointer, read_weight_file

from .tokenizer import Tokenizer, load_tokenizer

FORMAT_VERSION = 1
META_FILE = "finetune.json"
EXTRA_FILE = "finetune_extra.safetensors"
SEGMENT_WEIGHT = "embeddings.segment.weight"


@dataclass
class Finetuned:
    """A loaded fine-tuning output (or plain HF BERT directory: task None, no head)."""

    model: UniLMModel
    tokenizer: Tokenizer
    task: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    head_state: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def run_settings(self) -> dict[str, Any]:
        return self.meta.get("settings", {})


def _read_meta(directory: Path, expect_task: str | None = None) -> dict[str, Any]:
    """The `finetune.json` of a fine-tuning output once every file it lists has the sha256 it records; {} for a
    plain HF BERT directory. A `finetune_extra.safetensors` without `finetune.json` is a save that stopped half-way
    (saving removes `finetune.json` first and writes it last): its files may be two models', so it is refused."""
    if not (directory / META_FILE).is_file():
        if (directory / EXTRA_FILE).is_file():
            raise ValueError(f"{directory}: {EXTRA_FILE} without {META_FILE}: the save of this fine-tuning output "
                             "was interrupted, and its files may belong to two models; re-run the fine-tuning, or "
                             "use an earlier output")
        return {}
    meta = json.loads((directory / META_FILE).read_text())
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{directory / META_FILE}: format_version {meta.get('format_version')!r}, "
                         f"this code reads {FORMAT_VERSION}")
    if expect_task and meta.get("task") != expect_task:
        raise ValueError(f"{directory} was fine-tuned for {meta.get('task')!r}, not {expect_task!r}")
    check_complete(directory, meta)
    return meta


def _read_extra(directory: Path) -> dict[str, torch.Tensor]:
    """What a fine-tuning output keeps beside its HF file (all six segment rows, heads; our names), {} if none."""
    extra = directory / EXTRA_FILE
    return read_weight_file(extra) if extra.is_file() else {}


def _load_model_dir(directory: Path, extra: dict[str, torch.Tensor], task: str | None = None) -> UniLMModel:
    if hf_config_file(directory) is None:
        raise ValueError(f"{directory} is not a model directory: no config.json (expected a fine-tuning output "
                         "directory or a Hugging Face BERT export)")
    try:
        supplement = {k: v for k, v in extra.items() if not k.startswith("head.")} if extra else None
        return load_hf_bert(directory, supplement=supplement,
                            task=TASK_SEQ2SEQ if task == "seq2seq" else TASK_DEFAULT)
    except (ValueError, KeyError, FileNotFoundError, OSError) as err:
        raise ValueError(f"{directory} is not a loadable BERT model: {err}") from err


def load_init(path: str | Path, vocab: str | Path | None = None, task: str | None = None,
              max_positions: int | None = None) -> tuple[UniLMModel, Tokenizer]:
    """The backbone and tokenizer to fine-tune ``task`` from (see the module docstring for what `path` may be); a
    UniLM v1 checkpoint's per-task blocks give their seq2seq block to a seq2seq task (`pretrain.unilm_layouts`).
    ``max_positions`` beyond the model's extends its position table (`pretrain.hf.with_positions`)."""
    directory = Path(path)
    if directory.is_file() and directory.suffix not in WEIGHT_FILE_SUFFIXES:
        raise ValueError(f"--init {directory}: a file; give a model directory (config.json with its weights, as "
                         "transformers saves one), a weights file beside its config "
                         f"({', '.join(WEIGHT_FILE_SUFFIXES)}), a fine-tuning output or a pre-training checkpoints "
                         "directory")
    if not directory.exists():
        raise FileNotFoundError(f"--init {directory}: no such directory")
    if directory.is_file():  # a weights file beside its config and vocabulary (UniLM v1's release)
        model = _load_model_dir(directory, {}, task)
        tokenizer = load_tokenizer(vocab or directory.parent)
    elif hf_config_file(directory) is not None:
        _read_meta(directory)  # a fine-tuning output: refused unless its files are the ones its save wrote
        model = _load_model_dir(directory, _read_extra(directory), task)
        tokenizer = load_tokenizer(vocab or directory)
    elif (directory / ckpt.MARKER).is_file() or (directory / ckpt.LATEST).is_file():
        tokenizer = checkpoint_tokenizer(directory, vocab)
        model = load_consolidated(directory)
    else:
        raise ValueError(f"--init {directory}: neither a model directory (config.json) nor a pre-training "
                         f"checkpoint ({ckpt.MARKER} or {ckpt.LATEST})")
    check_vocab(model, tokenizer)
    if max_positions is not None:
        try:
            model = with_positions(model, max_positions)
        except ValueError as error:
            raise ValueError(f"max_position_embeddings: {error} (--init {directory})") from None
    return model, tokenizer


def checkpoint_tokenizer(checkpoint: Path, vocab: str | Path | None) -> Tokenizer:
    """The tokenizer a pre-training checkpoint was trained with: its shards' vocabulary and casing, found from the
    run config its marker records; `vocab` (a vocab.txt, or a shard directory) when the shards moved, which must
    be the vocabulary whose sha256 the checkpoint records."""
    directory, tag = resolve_checkpoint(checkpoint)
    meta, problem = ckpt.verify_tag(directory / tag, hashes=False)
    if meta is None:
        raise ValueError(f"--init {checkpoint}: {directory / tag} is not a complete checkpoint: {problem}")
    if "task" in (meta.get("run_config") or {}):  # a fine-tuning run's: its weights are the task module's
        raise ValueError(f"--init {checkpoint}: a fine-tuning run's checkpoint (task {meta['run_config']['task']}); "
                         f"fine-tune from that run's output directory {directory.parent} (its best model), or "
                         "resume the run itself by rerunning its command")
    try:
        shard_vocab, uncased = shard_vocabulary(checkpoint)
    except (ValueError, OSError) as error:
        if vocab is None:
            raise ValueError(f"--init {checkpoint}: cannot find the vocabulary of the shards it was trained on "
                             f"({error}); give --vocab SHARDS/vocab.txt") from None
        shard_vocab, uncased = None, None
    vocab_file = vocab or shard_vocab
    assert vocab_file is not None  # a missing shard vocabulary without --vocab is refused above
    tokenizer = load_tokenizer(vocab_file, lowercase=uncased)
    recorded = meta.get("vocab_hash")
    if recorded is not None and tokenizer.vocab.sha256 != recorded:
        raise ValueError(f"--vocab {vocab}: not the vocabulary {directory / tag} was trained with (sha256 "
                         f"{tokenizer.vocab.sha256[:12]}…, the checkpoint's {recorded[:12]}…); give the vocab.txt of "
                         "its shards, or leave --vocab out to use the one its run config names")
    return tokenizer


def check_vocab(model: UniLMModel, tokenizer: Tokenizer) -> None:
    """A tokenizer whose ids the model has no embedding for is another model's vocabulary."""
    if tokenizer.vocab_size > model.cfg.vocab_size:
        raise ValueError(f"vocabulary mismatch: {tokenizer.vocab_path} has {tokenizer.vocab_size} word pieces but "
                         f"the model only {model.cfg.vocab_size} token embeddings (wrong vocab.txt for this model?)")


def save_finetuned(out_dir: str | Path, model: UniLMModel, head: torch.nn.Module | None, tokenizer: Tokenizer,
                   task: str, extra_meta: dict[str, Any], weights: dict[str, torch.Tensor] | None = None) -> Path:
    """Write the directory described in the module docstring (rank 0 only); other files in it are left alone.
    ``weights``: the task module's state under its names (``backbone.*``, ``head.*``) to write instead of what
    ``model`` and ``head`` hold — under DeepSpeed, the fp32 master copy from
    `pretrain.checkpoint.gather_full_weights` (the modules hold bf16/fp16 copies, or ZeRO-3 partitions)."""
    if weights is None:
        weights = {f"backbone.{k}": v for k, v in model.state_dict().items()}
        weights.update({f"head.{k}": v for k, v in (head.state_dict() if head is not None else {}).items()})
    backbone = {k.removeprefix("backbone."): v for k, v in weights.items() if k.startswith("backbone.")}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    staging = out / f".model.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    head_weights = {k: v for k, v in weights.items() if k.startswith("head.")}
    architecture = hf_task_class(task, model.cfg, extra_meta)
    try:
        if architecture is None:
            save_hf_bert(model, staging, state=backbone, quiet=True)
            kept: tuple[str, ...] = ("bert.", "cls.")
        else:
            prefix = "qa_outputs." if architecture == "BertForQuestionAnswering" else "classifier."
            save_hf_bert(model, staging, architecture, state=backbone, quiet=True,
                         task_head={prefix + k.removeprefix("head."): v for k, v in head_weights.items()},
                         task_config=hf_task_config(architecture, extra_meta))
            kept = HF_TASK_ARCHITECTURES[architecture]
        # beside the HF file: all six segment rows, the heads its class has no place for, the task head
        tensors = {SEGMENT_WEIGHT: backbone[SEGMENT_WEIGHT]}
        tensors.update({k: v for k, v in backbone.items()
                        if (to_hf_name(k) or "").startswith(("bert.", "cls."))
                        and not (to_hf_name(k) or "").startswith(kept)})
        tensors.update(head_weights)
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, staging / EXTRA_FILE)
        write_hf_tokenizer(tokenizer.vocab, tokenizer.lowercase, staging, model.cfg.max_position_embeddings)
        files = sorted(p.name for p in staging.iterdir())
        meta = {"format_version": FORMAT_VERSION, "task": task, "model_config": dataclasses.asdict(model.cfg),
                **extra_meta, "files": {name: sha256_file(staging / name) for name in files}}
        (staging / META_FILE).write_text(json.dumps(meta, indent=1, default=str) + "\n")
        for name in files + [META_FILE]:
            with open(staging / name, "rb") as handle:
                os.fsync(handle.fileno())
        (out / META_FILE).unlink(missing_ok=True)  # no longer vouches for files about to be replaced
        for name in files + [META_FILE]:
            os.replace(staging / name, out / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def hf_task_class(task: str, cfg: Any, meta: dict[str, Any]) -> str | None:
    """The transformers task class a fine-tuned model is written as, when one computes what our head does: a
    masked-LM backbone's classifier on the pooled [CLS] of one view (`BertForSequenceClassification`; one score per
    choice: `BertForMultipleChoice`), its span head (`BertForQuestionAnswering`). None (written as the
    backbone — `BertForPreTraining`, a causal LM's `BertLMHeadModel` —, the head beside it): seq2seq, a causal LM's
    head on the last token, GPT-1 similarity's
    two summed views."""
    if cfg.causal_lm:
        return None
    if task == "qa":
        return "BertForQuestionAnswering"
    if task == "classify" and not meta.get("settings", {}).get("similarity"):
        return "BertForMultipleChoice" if meta.get("multiple_choice") else "BertForSequenceClassification"
    return None


def hf_task_config(architecture: str, meta: dict[str, Any]) -> dict[str, Any]:
    """The config.json entries of a task class: the labels (`id2label`, so pipelines name them) and problem type
    of a classifier, its dropout."""
    config: dict[str, Any] = {"classifier_dropout": meta.get("settings", {}).get("dropout")}
    if architecture == "BertForSequenceClassification":
        labels = meta.get("labels") or []
        if meta.get("regression"):
            config.update(num_labels=1, problem_type="regression")
        else:
            config.update(id2label={str(i): label for i, label in enumerate(labels)},
                          label2id={label: i for i, label in enumerate(labels)},
                          problem_type="single_label_classification")
    return config


def check_complete(directory: Path, meta: dict[str, Any]) -> None:
    """Every file `finetune.json` lists has the sha256 it recorded (an interrupted save or a mixed directory
    is refused, naming the file)."""
    for name, digest in meta.get("files", {}).items():
        path = directory / name
        if Path(name).name != name or not path.is_file() or sha256_file(path) != digest:
            if path.is_file() and git_lfs_pointer(path):
                raise ValueError(f"{path} is a git-lfs pointer, not the file {META_FILE} records: run `git lfs "
                                 "pull` in the repository it was cloned from")
            raise ValueError(f"{directory}: {name} is missing or is not the file {META_FILE} records (an interrupted "
                             "save, or files from another model); re-run the fine-tuning or restore the directory")


def _not_a_model(directory: Path) -> str:
    """Why ``directory``, a checkpoints or tag directory, is not a model to predict or decode with, and what is."""
    try:
        checkpoints, tag = ckpt.resolve_tag_dir(directory)
        meta = ckpt.verify_tag(checkpoints / tag, hashes=False)[0] or {}
    except (ValueError, OSError):
        checkpoints, meta = directory, {}
    task = (meta.get("run_config") or {}).get("task")
    if task is not None:
        return (f"{directory} is a fine-tuning run's checkpoint (task {task}), kept to resume that run: give its "
                f"output directory {checkpoints.parent}, which holds its best model")
    return (f"{directory} is a pre-training checkpoint: fine-tune it first (python -m finetune.run --init "
            f"{directory} ...) and give that output, or export it to a Hugging Face BERT directory (python -m "
            f"pretrain.export {directory} OUT) and give OUT")


def load_finetuned(path: str | Path, expect_task: str | None = None) -> Finetuned:
    """A fine-tuning output directory (or a plain HF BERT directory with its vocab.txt)."""
    directory = Path(path)
    if not directory.is_dir():
        raise ValueError(f"{directory}: no such directory")
    if hf_config_file(directory) is None and any((directory / name).is_file() for name in (ckpt.MARKER, ckpt.LATEST)):
        raise ValueError(_not_a_model(directory))
    meta = _read_meta(directory, expect_task)
    extra = _read_extra(directory)
    model = _load_model_dir(directory, extra)
    tokenizer = load_tokenizer(directory)
    check_vocab(model, tokenizer)
    head_state = {k.removeprefix("head."): v for k, v in extra.items() if k.startswith("head.")}
    return Finetuned(model.eval(), tokenizer, meta.get("task"), meta, head_state)
