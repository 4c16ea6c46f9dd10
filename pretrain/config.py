"""The pre-training run config: ``RunConfig`` and its sections, loaded by the project's one typed loader
(`common.config_loader`).

One ``RunConfig`` describes a run completely (together with the model config it resolves to and the DeepSpeed
JSON it names). ``train.max_steps`` alone defines the run — the LR schedule and the data order; when a process
stops (``train.exit_at_step``, ``train.exit_after_minutes``) is separate, so a run stopped early and resumed is
the same run.

    cfg = load_config("pretrain/configs/tiny.yaml", ["train.max_steps=50", "out_dir=runs/a"])

Batch sizes live here only: the DeepSpeed JSON holds engine settings and gets them injected
(see ``pretrain.batch_plan``).
"""
from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from common.config_loader import check_field_types, config_error, load_dataclass, reference_rows
from common.paths import REPO_ROOT
from pretrain.model import ModelConfig, preset
from pretrain.warm_start import check_same_architecture, init_model_config, is_checkpoint

REPLACED_KEYS = {"train.eval_batches": "train.eval_samples (held-out samples per evaluation, each counted once; "
                                       "null: all of them)"}
"""Keys earlier versions read, with what replaced them."""


@dataclass(frozen=True)
class DataConfig:
    shards: str = ""
    """Directory of a shard set (``manifest.json`` + shards written by ``data_prep``)."""
    eval_shards: str | None = None
    """Optional held-out shard set; gives per-objective eval loss every ``train.eval_interval`` steps."""
    prefetch_steps: int = 4
    """Optimizer steps of collated batches the background thread keeps ready per rank."""
    max_seq_len: int | None = None
    """Longest sequence accepted; default: the model's ``max_position_embeddings``."""
    verify: bool = True
    """Check every shard's sha256 against the manifest before training (one read of the shard set, shared by the
    ranks: each hashes every world-size-th shard) so a flipped byte never trains silently; opening always checks
    sizes, headers and the vocab."""

    def __post_init__(self) -> None:
        check_field_types(self, "data.")
        if not self.shards:
            raise ValueError("data.shards is required (a directory with manifest.json)")
        if self.prefetch_steps < 1:
            raise ValueError(f"data.prefetch_steps must be >= 1, got {self.prefetch_steps}")
        if self.max_seq_len is not None and self.max_seq_len < 1:
            raise ValueError(f"data.max_seq_len must be >= 1 (or null: the model's max_position_embeddings), "
                             f"got {self.max_seq_len}")


@dataclass(frozen=True)
class ModelSection:
    preset: str | None = "tiny"
    """A ``pretrain.model.preset`` name: unilm-large, bert-large, bert-base, gpt, tiny."""
    init_from: str | None = None
    """What to initialise from, overriding ``preset``: a Hugging Face BERT directory (UniLM starts from BERT-large:
    ``config.json`` and its weights, in one file or in shards; a fine-tuned BERT's task head is left out), a
    weights file beside its config (UniLM v1's released ``unilm1-large-cased.bin`` with BERT-large cased's
    config.json and vocab.txt; s2s-ft's UniLM and MiniLM directories load as directories), or a checkpoint of this
    pipeline (phase 2 from phase 1: its checkpoints directory, whose ``latest`` it takes, or one ``global_stepN``
    directory), whose hash-checked fp32 weights and architecture are taken exactly (``model.overrides`` may change
    the dropout and lengthen ``max_position_embeddings``; see ``train.init_optimizer``)."""
    check_init_vocab: bool = True
    """With ``init_from``: refuse shards not tokenized with its vocabulary (``vocab.txt`` or ``tokenizer.json``;
    a checkpoint's: the vocabulary hash it recorded) and casing, whose ids would not mean what its embeddings
    learned."""
    overrides: dict[str, Any] = field(default_factory=dict, metadata={"schema": ModelConfig})
    """``ModelConfig`` fields replaced on top of the preset, e.g. ``{hidden_dropout: 0.0}``; with
    ``preset: null`` and no ``init_from``, the complete model config."""

    def __post_init__(self) -> None:
        check_field_types(self, "model.")
        if not self.preset and not self.init_from and not self.overrides:
            raise ValueError("set model.preset, model.init_from, or a full model config in model.overrides")
        if not self.init_from:  # init_from's config is a file, read where the model is built
            self.model_config()

    def model_config(self, init_config: ModelConfig | None = None) -> ModelConfig:
        """The architecture this section names: ``overrides`` applied to ``init_config`` (``init_from``'s, which the
        caller reads: `pretrain.hf.hf_model_config`), else to the preset, else ``overrides`` alone. An error names the
        key that sets the value (``model.overrides.hidden_dropout``, not the ``ModelConfig`` field)."""
        if init_config is None and self.preset:
            try:
                init_config = preset(self.preset)
            except ValueError as error:
                raise ValueError(f"model.preset: {error}") from None
        if init_config is None:
            missing = [f.name for f in dataclasses.fields(ModelConfig)
                       if f.default is dataclasses.MISSING and f.name not in self.overrides]
            if missing:
                raise ValueError(f"model.overrides needs {', '.join(missing)} when model.preset is null")
        try:
            if init_config is None:
                return ModelConfig(**self.overrides)
            return dataclasses.replace(init_config, **self.overrides)
        except ValueError as error:  # ModelConfig names its own fields; a run sets them as model.overrides.*
            raise ValueError(str(error).replace("ModelConfig.", "model.overrides.")) from None


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 3e-5
    """Peak learning rate (UniLM: 3e-5)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam betas."""
    eps: float = 1e-6
    """Adam epsilon."""
    weight_decay: float = 0.01
    """Decoupled weight decay; never applied to biases and LayerNorm weights."""
    warmup_steps: int = 40_000
    """Linear warm-up steps, then the ``schedule``'s decay to ``min_lr`` at ``train.max_steps``. DeepSpeed's schedulers
    warm up over at least 2 steps: 1 behaves as 2."""
    schedule: str = "linear"
    """Decay after the warm-up: ``linear`` (BERT, UniLM; DeepSpeed WarmupDecayLR) or ``cosine`` (GPT-1; DeepSpeed
    WarmupCosineLR)."""
    min_lr: float = 0.0
    """Learning rate at step 0 and at the end of the decay."""
    grad_clip: float = 1.0
    """Global gradient-norm clipping (DeepSpeed ``gradient_clipping``); 0 disables."""

    def __post_init__(self) -> None:
        check_field_types(self, "optim.")
        if self.eps <= 0:
            raise ValueError(f"optim.eps must be > 0, got {self.eps}")
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ValueError(f"need 0 <= optim.min_lr <= optim.lr and lr > 0, got lr={self.lr} min_lr={self.min_lr}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"optim.betas must be two numbers in [0, 1), got {self.betas}")
        if self.weight_decay < 0 or self.grad_clip < 0:
            raise ValueError("optim.weight_decay and optim.grad_clip must be >= 0")
        if self.warmup_steps < 1:
            raise ValueError(f"optim.warmup_steps must be >= 1 (DeepSpeed's warm-up), got {self.warmup_steps}")
        if self.schedule not in ("linear", "cosine"):
            raise ValueError(f"optim.schedule must be linear or cosine, got {self.schedule!r}")


WORLD_CHANGE_POLICIES = ("keep_global_batch", "nearest_batch", "stop")
"""The choices of ``train.on_world_change`` (`pretrain.batch_plan.plan_for_world`)."""


@dataclass(frozen=True)
class TrainConfig:
    global_batch_size: int = 330
    """Sequences per optimizer step over all ranks (= micro × accumulation × data-parallel)."""
    micro_batch_size: int = 1
    """Sequences per rank per forward pass."""
    max_steps: int = 770_000
    """Optimizer steps of the whole run; defines the LR schedule and the data order."""
    save_interval: int = 1000
    """Save a checkpoint every this many optimizer steps (and at the end / on early exit)."""
    keep_last: int = 3
    """Complete checkpoints kept; older ones are deleted after a newer one is complete."""
    seed: int = 1234
    """Seeds the data order (per epoch) and the model initialisation / dropout RNGs."""
    resume: str = "auto"
    """``auto`` (newest complete checkpoint in out_dir, if any), ``never``, or a checkpoint tag directory."""
    exit_at_step: int | None = None
    """Save and exit cleanly after this step (the run stays defined by max_steps)."""
    exit_after_minutes: float | None = None
    """Save and exit cleanly once this much wall time has passed (time-limited allocations)."""
    eval_interval: int = 0
    """Evaluate on ``data.eval_shards`` every this many steps; 0 disables."""
    eval_samples: int | None = None
    """Held-out samples per evaluation: the first this many of ``data.eval_shards``' fixed order, each once, spread
    over the ranks (the same set and loss at any world size and micro-batch size). Null: all of them."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in backward (less memory, about one extra forward of compute); may
    change when resuming."""
    compile: bool | None = None
    """`torch.compile` each Transformer block (fuses dropout, residual adds, LayerNorm and gelu; same parameters and
    checkpoints). Null: on when training on CUDA with ZeRO 0-2 and torch.compile works there (else off, with a
    note), off on the CPU (where it was measured slower) and under ZeRO-3."""
    chunked_loss: bool | None = None
    """Compute the MLM/LM loss in chunks of rows, logits in the training dtype and never all in fp32
    (``pretrain.kernels.chunked_cross_entropy``). Null: on under bf16/fp16, off in fp32 (nothing to save there)."""
    pack_samples: bool | None = None
    """Pack each micro-batch's samples into as few rows as fit, each as long as the micro-batch's longest sample
    (several short samples per row, each seeing only itself: the same loss, less padding). Null: on, except for a
    causal LM (GPT), whose samples are full-length blocks."""
    init_optimizer: bool = False
    """With ``model.init_from`` a checkpoint of this pipeline: also take over its Adam moments (``exp_avg``,
    ``exp_avg_sq`` per parameter, by name, fp32) and step count, so Adam goes on where it was (ZeRO 0-2, not ZeRO-0
    fp16). The learning-rate schedule, batch sizes and data stay this run's own; its consumed samples start at 0."""
    peak_tflops: float | None = None
    """Dense matmul peak of one rank's device in the training dtype, TFLOP/s: the denominator of the ``mfu`` metric
    (e.g. 989 for an H100 SXM in bf16). Null: measured once at start, by every rank at once (a short matmul on
    its device), the median over the ranks; on a shared CPU this varies from run to run, so set one to compare.
    Either way, a step faster than the peak has it re-measured and raised (its record says ``peak_remeasured``), so
    no MFU exceeds 100 %."""

    on_world_change: str = "keep_global_batch"
    """What a run resumed on another number of ranks (a node lost and the run restarted on the hosts left, or a
    resume by hand) does with its batch: ``keep_global_batch`` (the same global batch through more or less
    accumulation when it splits over the new world size; otherwise stop, naming the nearest feasible batches),
    ``nearest_batch`` (go on with the nearest feasible global batch at this micro-batch size, said in the log and
    in ``restarts.jsonl``) or ``stop`` (refuse any change of world size)."""
    collective_timeout_s: float = 120.0
    """Seconds a collective may wait for a rank during the training steps and saves before the run stops as hung
    (torch's process-group timeout; NCCL's watchdog aborts the group): the message names the step and the ranks
    that stopped answering, the exit is non-zero, and an elastic launch (``make pretrain MAX_RESTARTS=N``) restarts
    on the ranks left. Longer than the slowest legitimate wait (rank 0 writing a checkpoint's full weights while the
    others wait); the setup before the first step (checkpoint conversion and load) keeps DeepSpeed's default
    (``DEEPSPEED_TIMEOUT`` minutes, 10)."""

    def __post_init__(self) -> None:
        check_field_types(self, "train.")
        if self.on_world_change not in WORLD_CHANGE_POLICIES:
            raise ValueError(f"train.on_world_change must be one of {', '.join(WORLD_CHANGE_POLICIES)}, got "
                             f"{self.on_world_change!r}")
        if self.collective_timeout_s <= 0:
            raise ValueError(f"train.collective_timeout_s must be > 0, got {self.collective_timeout_s}")
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            raise ValueError(f"train.peak_tflops must be > 0 (or null: measured at start), got {self.peak_tflops}")
        if self.seed < 0:
            raise ValueError(f"train.seed must be >= 0, got {self.seed}")
        for name in ("global_batch_size", "micro_batch_size", "max_steps", "save_interval", "keep_last"):
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name} must be >= 1, got {getattr(self, name)}")
        if self.exit_at_step is not None and not 1 <= self.exit_at_step <= self.max_steps:
            raise ValueError(f"train.exit_at_step must be in [1, max_steps={self.max_steps}], got {self.exit_at_step}")
        if self.exit_after_minutes is not None and self.exit_after_minutes <= 0:
            raise ValueError(f"train.exit_after_minutes must be > 0, got {self.exit_after_minutes}")
        if self.eval_interval < 0:
            raise ValueError(f"train.eval_interval must be >= 0, got {self.eval_interval}")
        if self.eval_samples is not None and self.eval_samples < 1:
            raise ValueError(f"train.eval_samples must be >= 1 (or null: the whole held-out set), got "
                             f"{self.eval_samples}")


@dataclass(frozen=True)
class RunConfig:
    out_dir: str
    """Run directory: checkpoints/, metrics.jsonl, monitor/ (DeepSpeed CSV/TensorBoard), loss.png."""
    deepspeed_config: str
    """DeepSpeed JSON with engine settings only (ZeRO stage, precision, offload, optimizer/scheduler types)."""
    data: DataConfig
    """Shards and loader settings."""
    model: ModelSection = field(default_factory=ModelSection)
    """Which model to build."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and LR-schedule hyper-parameters (applied through DeepSpeed's optimizer and scheduler)."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Batch sizes, run length, checkpointing, resume and early exit."""

    def __post_init__(self) -> None:
        check_field_types(self)
        if not self.out_dir:
            raise ValueError("out_dir is required")
        if self.train.init_optimizer and not self.model.init_from:
            raise ValueError("train.init_optimizer=true needs model.init_from (a checkpoint of this pipeline)")
        if self.train.eval_interval and not self.data.eval_shards:
            raise ValueError("train.eval_interval > 0 needs data.eval_shards")
        if self.optim.warmup_steps >= self.train.max_steps:
            raise ValueError(
                f"optim.warmup_steps={self.optim.warmup_steps} must be < train.max_steps={self.train.max_steps} "
                "(the schedule decays over max_steps - warmup_steps)")

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.out_dir) / "checkpoints"

    @property
    def deepspeed_config_path(self) -> Path:
        """The JSON path as given, else relative to the repository (so configs work from any directory)."""
        path = Path(self.deepspeed_config)
        return path if path.exists() or path.is_absolute() else REPO_ROOT / path

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def config_from_dict(values: dict[str, Any]) -> RunConfig:
    return load_dataclass(RunConfig, None, values=values, replaced_keys=REPLACED_KEYS)


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> RunConfig:
    """Read a run YAML, apply dotted overrides, validate."""
    return load_dataclass(RunConfig, path, overrides, replaced_keys=REPLACED_KEYS)


def resolve_model_config(cfg: RunConfig) -> ModelConfig:
    """The model config this run trains: ``model.init_from``'s (a Hugging Face directory's ``config.json``, or the
    model config the marker of this pipeline's checkpoint records) with ``model.overrides`` applied, else the
    preset's. A checkpoint's architecture stays as it was (`pretrain.warm_start.check_same_architecture`)."""
    if not cfg.model.init_from:
        return cfg.model.model_config()
    init_config = init_model_config(cfg.model.init_from)
    model_cfg = cfg.model.model_config(init_config)
    if is_checkpoint(cfg.model.init_from):
        check_same_architecture(init_config, model_cfg, cfg.model.init_from)
    return model_cfg


# ------------------------------------------------------------------------------- configuration reference
REFERENCE_HEADER = ["| key | type | default | meaning |", "|---|---|---|---|"]


def reference_markdown() -> list[str]:
    """The configuration reference of a pre-training run YAML, as Markdown lines: every key with its type, default
    and field docstring (`python -m pretrain.config --reference`; ``tools.config_reference`` puts it into
    docs/configuration.md together with fine-tuning's)."""
    parts = ["## Pre-training (`pretrain/configs/*.yaml`, `python -m pretrain.train --config YAML key=value`)", "",
             "Every key of a run YAML; any of them can be overridden on the command line as `key=value` (e.g. "
             "`train.max_steps=100`).", ""]
    for title, cls, prefix in (("Top level", RunConfig, ""), ("`data`", DataConfig, "data."),
                               ("`model`", ModelSection, "model."), ("`optim`", OptimConfig, "optim."),
                               ("`train`", TrainConfig, "train.")):
        parts += [f"### {title}", "", *REFERENCE_HEADER, *reference_rows(cls, prefix), ""]
    parts += ["### `model.overrides` (the architecture, `pretrain.model.ModelConfig`)", "",
              "Fields replaced on top of `model.preset` (e.g. `model.overrides.hidden_dropout=0.0`); keys without a "
              "default come from the preset.", "", *REFERENCE_HEADER,
              *reference_rows(ModelConfig, "model.overrides.", required="from preset"), ""]
    return parts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pretrain.config",
                                     description="Print a resolved run config, or the configuration reference.")
    parser.add_argument("config", nargs="?", help="run YAML to resolve and print (with overrides)")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    parser.add_argument("--reference", action="store_true",
                        help="print the Markdown reference of every pre-training key (docs/configuration.md has it "
                             "with fine-tuning's: python -m tools.config_reference)")
    args = parser.parse_args(argv)
    if args.reference:
        print("\n".join(reference_markdown()), end="")
    elif args.config:
        try:
            cfg = load_config(args.config, args.overrides)
            resolve_model_config(cfg)  # the model as training builds it: model.init_from's config.json read and checked
        except (ValueError, OSError) as error:  # a missing YAML is named here: its message leaves that to callers
            parser.exit(2, f"{parser.prog}: error: {config_error(args.config, error, args.overrides)}\n")
        print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
    else:
        parser.error("give a run YAML or --reference")


if __name__ == "__main__":
    main()
