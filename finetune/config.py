"""The fine-tuning run config: one frozen dataclass, from YAML (`finetune/configs/`) plus CLI flags.

Precedence: dataclass defaults < `--config YAML` < explicit CLI flags (`--lr`, `--epochs`, ...) < dotted
`--set key=value` overrides. Loaded by the loader pre-training uses (`common.config_loader.load_dataclass`): values
are coerced to the field types (`--set lr=3e-5` is a float) and unknown keys are refused. Batch sizes live here
only; the DeepSpeed JSON holds engine settings.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.config_loader import check_field_types, load_dataclass
from common.paths import REPO_ROOT
from pretrain.accelerator import accelerator_name, native_bf16

TASKS = ("classify", "qa", "seq2seq")
TASK_METRICS = {"classify": ("accuracy", "macro_f1", "mcc", "f1", "pearson", "spearman"),
                "qa": ("f1", "exact_match"), "seq2seq": ("rougeL", "rouge1", "rouge2", "rougeLsum", "bleu")}
"""The dev scores a task can pick its best epoch by (the first is the default; regression's is pearson)."""
CPU_DEEPSPEED_CONFIG = "ds_configs/zero0_fp32_cpu.json"
GPU_DEEPSPEED_CONFIGS = {"bf16": "ds_configs/zero2_bf16.json", "fp16": "ds_configs/zero2_fp16.json"}


def default_deepspeed_config() -> str:
    """The engine JSON fine-tuning uses when none is named: on a GPU, ZeRO-2 in bf16 where the device computes it
    natively (`pretrain.accelerator.native_bf16`: Ampere on), else fp16 (dynamic loss scaling); on a CPU
    (DeepSpeed's CPU accelerator) fp32 ZeRO-0 (DeepSpeed trains fp16 on CPUs with oneDNN fp16 kernels only, and
    slowly)."""
    if accelerator_name() == "cpu":
        return CPU_DEEPSPEED_CONFIG
    return GPU_DEEPSPEED_CONFIGS["bf16" if native_bf16() else "fp16"]


@dataclass(frozen=True)
class FinetuneConfig:
    task: str
    """classify | qa | seq2seq."""
    train: str
    """Training file. classify: JSONL, TSV, CSV or parquet (GLUE's files: `glue_task`); qa: SQuAD JSON; seq2seq:
    JSONL or UniLM's line files, `NAME.src` with `NAME.tgt` beside it."""
    dev: str
    """Dev file, same format; evaluated after every epoch, the best epoch's model is kept."""
    init: str
    """An HF BERT directory (s2s-ft's UniLM and MiniLM directories too), a weights file beside its config (UniLM
    v1's released `unilm1-large-cased.bin` with BERT-large cased's config.json and vocab.txt), a fine-tuning output
    directory, or a pre-training checkpoint directory."""
    out: str
    """Output directory: the best model (HF export + head + vocab), metrics.jsonl (per step), summary.json,
    checkpoints/."""
    vocab: str | None = None
    """vocab.txt to tokenise with; default: `init`'s (a pre-training checkpoint's: the vocabulary of the shards its
    run config names; give it when those moved)."""
    from_scratch: bool = False
    """Use only `init`'s architecture (config) and start from random weights: the no-pre-training baseline."""
    max_position_embeddings: int | None = None
    """Positions of the fine-tuned model; more than `init` has extends its position table by repeating its learned
    rows (row P + i = row i, microsoft/unilm's rule for CNN/DailyMail's 768), the first P exact. None: `init`'s.
    seq2seq sources and decoding use them all; the fine-tuned model keeps them."""
    deepspeed_config: str | None = None
    """DeepSpeed JSON with engine settings only (ZeRO stage, precision); None picks one for the machine
    (`default_deepspeed_config`: bf16 or fp16 ZeRO-2 on GPUs, fp32 ZeRO-0 on CPUs)."""

    epochs: int = 3
    """Passes over the training set (the paper's GLUE setting: at most 5)."""
    max_steps: int | None = None
    """Cap on optimizer steps over the whole run (None: epochs decide)."""
    exit_at_step: int | None = None
    """Save a checkpoint and exit after this step; rerunning the command resumes (tests, preemption)."""
    exit_after_minutes: float | None = None
    """Save a checkpoint and exit after the first step past this wall time (a job's time limit); SIGTERM does the
    same at any time. Rerunning the command resumes."""
    save_interval: int | None = None
    """Also checkpoint every N optimizer steps (None: at epoch ends only), so a crash loses less than an epoch."""
    batch_size: int = 32
    """Global batch (= micro × accumulation × data-parallel ranks)."""
    micro_batch_size: int = 8
    """Examples per rank per forward pass."""
    optimizer: str = "adamw"
    """adamw (DeepSpeed's, from the JSON) or adamax (the UniLM paper's GLUE optimiser, torch.optim.Adamax)."""
    lr: float = 5e-5
    """Peak learning rate."""
    warmup_ratio: float = 0.1
    """Share of the steps spent in linear warm-up, then linear decay to 0. DeepSpeed's WarmupDecayLR warms up over
    at least 2 steps: a share that rounds to 0 or 1 step gives 2 (the first step at 0, the second at half the
    rate)."""
    weight_decay: float = 0.01
    """Weight decay, not on biases and LayerNorm weights: decoupled under adamw (AdamW's); under adamax torch's
    Adamax adds it to the gradient (an L2 penalty, as Adam's original weight decay)."""
    grad_clip: float = 1.0
    """Global gradient-norm clipping; 0 disables."""
    dropout: float = 0.1
    """Dropout before the task head."""
    seed: int = 42
    """Seeds the head initialisation, the example order per epoch and the target masking."""
    keep_last: int = 2
    """Complete checkpoints kept."""

    max_seq_len: int = 128
    """classify / qa: longest packed input (word pieces, specials included); longer inputs are cut and counted."""
    similarity: bool = False
    """classify pairs (GPT-1 similarity): encode both orders and sum the two final vectors."""
    aux_lm_weight: float = 0.0
    """classify: GPT-1's auxiliary language-model loss, L = L_task + weight · L_lm on the same inputs (GPT: 0.5)."""

    doc_stride: int = 128
    """qa: step between sliding windows over a long context, in context word pieces; capped at the context a
    window holds (max_seq_len - question - 3), so every context token is in some window."""
    max_query_len: int = 64
    """qa: question word pieces kept."""
    max_answer_len: int = 30
    """qa: longest predicted answer (word pieces)."""
    null_score_diff_threshold: float = 0.0
    """qa, SQuAD 2.0: answer "" when the [CLS] score beats the best span's by more than this (BERT's setting; the
    dev scores' `span_best_f1_threshold` is the value that would have been best on the dev questions)."""

    max_src_len: int = 448
    """seq2seq: source word-piece budget. Longer sources are cut and counted, and further where the pair would not
    fit the model's positions (UniLM's truncation: training cuts only as far as each target needs; decoding leaves
    room for a target of max_tgt_len)."""
    max_tgt_len: int = 64
    """seq2seq: target word-piece budget (training), and the decoding maximum unless `eval_max_tgt_len` sets one."""
    eval_max_tgt_len: int | None = None
    """seq2seq: longest target of the dev decoding, and `finetune.decode`'s default (None: max_tgt_len). UniLM v1's
    CNN/DailyMail trains targets of up to 200 word pieces and decodes at most 128."""
    mask_prob: float = 0.7
    """seq2seq: probability of masking each target token, the final [SEP] included (paper 0.7; QA/dialogue 0.5)."""
    label_smoothing: float = 0.1
    """seq2seq: label smoothing of the masked-token cross-entropy."""
    eval_beam_size: int = 1
    """seq2seq: beam size of the dev decoding after each epoch."""
    eval_length_penalty: float = 0.0
    """seq2seq: GNMT alpha of the dev decoding."""
    eval_no_repeat_ngram: int = 3
    """seq2seq: the dev decoding forbids repeating an n-gram of this many word pieces (0: off)."""
    eval_no_repeat_ignore: str = "."
    """seq2seq: word pieces that blocking exempts, separated by | (UniLM's forbid_ignore_word: nothing is blocked
    after one, and it is never blocked; "" for none)."""
    eval_max_examples: int | None = None
    """Evaluate on the first N dev examples only (None: all)."""
    metric: str | None = None
    """The dev score that picks the best epoch, higher is better: classify accuracy, macro_f1, mcc (Matthews
    correlation; GLUE's CoLA), f1 (F1 of `positive_label`; MRPC, QQP), regression pearson, spearman (STS-B); qa f1,
    exact_match; seq2seq rougeL, rouge1, rouge2, rougeLsum (summary-level, CNN/DM's), bleu (None: accuracy,
    pearson, f1, rougeL)."""
    glue_task: str | None = None
    """classify: read the files as GLUE task NAME ships them (cola, sst2, mrpc, stsb, qqp, mnli, qnli, rte, wnli;
    ax to predict) — GLUE's TSVs or Hugging Face `glue` exports — with its metric and, for stsb, regression
    (`finetune.glue`); the field settings below are then not used."""
    text_field: str = "text"
    """classify: the column (JSON key) holding the first text of `.jsonl`, `.tsv`, `.csv` and `.parquet` files."""
    text_b_field: str = "text_b"
    """classify: the column holding the second text of a pair (rows without it are single texts)."""
    label_field: str = "label"
    """classify: the column holding the label."""
    regression: bool | None = None
    """classify: true fits the labels as scores (numbers, or numbers written as strings), false as classes; None:
    labels written as floats are regression, integers and strings classes (transformers' run_glue rule)."""
    positive_label: str | None = None
    """classify: the class whose F1 is reported as `f1`; None: with two classes the second in sorted order ("1" of
    0/1, "true", "yes", "positive"), with more no `f1`."""

    @property
    def decode_max_tgt_len(self) -> int:
        """The longest target the dev decoding writes: `eval_max_tgt_len`, else `max_tgt_len`."""
        return self.eval_max_tgt_len or self.max_tgt_len

    def __post_init__(self) -> None:
        check_field_types(self)
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {', '.join(TASKS)}, got {self.task!r}")
        for name in ("epochs", "batch_size", "micro_batch_size", "max_seq_len", "max_src_len", "max_tgt_len",
                     "doc_stride", "max_query_len", "max_answer_len", "eval_beam_size", "keep_last"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.optimizer not in ("adamw", "adamax"):
            raise ValueError(f"optimizer must be adamw or adamax, got {self.optimizer!r}")
        for name, valid, rule in (("lr", self.lr > 0, "> 0"),
                                  ("warmup_ratio", 0 <= self.warmup_ratio < 1, "in [0, 1)"),
                                  ("mask_prob", 0 < self.mask_prob <= 1, "in (0, 1]"),
                                  ("label_smoothing", 0 <= self.label_smoothing < 1, "in [0, 1)"),
                                  ("aux_lm_weight", self.aux_lm_weight >= 0, ">= 0")):
            if not valid:
                raise ValueError(f"{name} must be {rule}, got {getattr(self, name)}")
        if self.eval_max_tgt_len is not None and self.eval_max_tgt_len < 1:
            raise ValueError(f"eval_max_tgt_len must be >= 1 (or null: max_tgt_len), got {self.eval_max_tgt_len}")
        if self.max_position_embeddings is not None and self.max_position_embeddings < 1:
            raise ValueError(f"max_position_embeddings must be >= 1 (or null: init's), got "
                             f"{self.max_position_embeddings}")
        if self.exit_after_minutes is not None and self.exit_after_minutes <= 0:
            raise ValueError(f"exit_after_minutes must be > 0 (or null), got {self.exit_after_minutes}")
        for name in ("max_steps", "exit_at_step", "eval_max_examples", "save_interval"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 (or null), got {getattr(self, name)}")
        for name in ("weight_decay", "grad_clip", "seed", "eval_no_repeat_ngram"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.metric is not None and self.metric not in TASK_METRICS[self.task]:
            raise ValueError(f"metric {self.metric!r} is not a {self.task} dev score; choose one of "
                             f"{', '.join(TASK_METRICS[self.task])}")
        if self.glue_task is not None:
            from .glue import GLUE_TASKS
            if self.task != "classify" or self.glue_task not in GLUE_TASKS:
                raise ValueError(f"glue_task={self.glue_task!r}: a classify setting, one of {', '.join(GLUE_TASKS)}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.task == "seq2seq":
            for path in (self.train, self.dev):
                if Path(path).suffix.lower() in (".tsv", ".csv", ".parquet", ".tgt"):
                    raise ValueError(f"{path}: seq2seq reads JSONL files, one {{\"src\": ..., \"tgt\": ...}} "
                                     "object per line, or UniLM's line files: give NAME.src, with NAME.tgt beside "
                                     "it")

    @property
    def deepspeed_config_path(self) -> Path:
        path = Path(self.deepspeed_config if self.deepspeed_config is not None else default_deepspeed_config())
        return path if path.exists() or path.is_absolute() else REPO_ROOT / path

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.out) / "checkpoints"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def load_config(yaml_path: str | Path | None, flags: dict[str, Any], overrides: Sequence[str] = ()) -> FinetuneConfig:
    """YAML values, then the CLI flags that were given (not None), then `key=value` overrides."""
    given = {k: v for k, v in flags.items() if v is not None}
    try:
        return load_dataclass(FinetuneConfig, yaml_path, overrides, given)
    except FileNotFoundError as error:  # the YAML itself
        raise ValueError(f"--config {yaml_path}: {error}") from None
    except ValueError as error:
        if str(error).startswith("missing required config key"):
            names = str(error).split(": ", 1)[1].split(", ")
            raise ValueError(f"missing required setting(s): {', '.join('--' + n for n in names)}") from None
        raise
