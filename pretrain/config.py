"""The run configs' one loader (frozen dataclasses from YAML + dotted ``key=value`` overrides, coerced to the
field types and validated) and the pre-training run config.

`load_dataclass` serves every run config: pre-training's ``RunConfig`` here and fine-tuning's
``finetune.config.FinetuneConfig``. One ``RunConfig`` describes a run completely (together with the model config it resolves to and the DeepSpeed
JSON it names). ``train.max_steps`` alone defines the run — the LR schedule and the data order; when a process
stops (``train.exit_at_step``, ``train.exit_after_minutes``) is separate, so a run stopped early and resumed is
the same run.

    cfg = load_config("pretrain/configs/tiny.yaml", ["train.max_steps=50", "out_dir=runs/a"])

Batch sizes live here only: the DeepSpeed JSON holds engine settings and gets them injected
(see ``pretrain.batch_plan``).
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import inspect
import math
import re
import textwrap
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import yaml

from pretrain.model import ModelConfig, preset

REPO_ROOT = Path(__file__).resolve().parents[1]


def _has_type(option: Any, value: Any) -> bool:
    if option is type(None):
        return value is None
    if option is bool:
        return isinstance(value, bool)
    if option is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if option is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if option is str:
        return isinstance(value, str)
    if typing.get_origin(option) is tuple:
        return isinstance(value, (tuple, list)) and all(_has_type(float, v) for v in value)
    if typing.get_origin(option) is dict:
        return isinstance(value, dict)
    return True


def check_field_types(instance: Any, prefix: str = "") -> None:
    """Every field of dataclass ``instance`` holds a value of its annotated type (a bool is not a number, an int
    serves where a float is expected) and every number is finite; the error names the key. Config
    ``__post_init__`` methods call this before their range checks, so a config built from any source (YAML,
    CLI flags, code) is checked before anything is built from it."""
    hints = typing.get_type_hints(type(instance))
    for f in dataclasses.fields(instance):
        hint, value = hints[f.name], getattr(instance, f.name)
        if dataclasses.is_dataclass(hint):
            continue
        options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
        if not any(_has_type(option, value) for option in options):
            raise ValueError(f"{prefix}{f.name}={value!r} is not a valid {_type_name(hint)}")
        numbers = value if isinstance(value, (tuple, list)) else [value]
        if any(isinstance(v, float) and not math.isfinite(v) for v in numbers):
            raise ValueError(f"{prefix}{f.name}={value!r}: must be a finite number")


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
    """A Hugging Face BERT directory to initialise from (UniLM starts from BERT-large): ``config.json`` and its
    weights, in one file or in shards; a fine-tuned BERT's task head is left out. Overrides ``preset``."""
    check_init_vocab: bool = True
    """With ``init_from``: refuse shards not tokenized with its vocabulary (``vocab.txt`` or ``tokenizer.json``)
    and casing, whose ids would not mean what its embeddings learned."""
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
    (several short samples per row, each seeing only itself: the same loss, less padding). Null: on, except for a causal LM (GPT), whose samples
    are full-length blocks."""
    peak_tflops: float | None = None
    """Dense matmul peak of one rank's device in the training dtype, TFLOP/s: the denominator of the ``mfu`` metric
    (e.g. 989 for an H100 SXM in bf16). Null: measured once at start, by every rank at once (a short matmul on
    its device), the median over the ranks; on a shared CPU this varies from run to run, so set one to compare."""

    def __post_init__(self) -> None:
        check_field_types(self, "train.")
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


def _coerce(hint: Any, value: Any, name: str) -> Any:
    """Check a YAML value against the field type; numbers written as strings (YAML reads ``2e-3`` as a string)
    become numbers."""
    options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    if value is None and type(None) in options:
        return None
    for option in options:
        try:
            if option is float and isinstance(value, (int, float, str)) and not isinstance(value, bool):
                return float(value)
            if option is int and isinstance(value, (int, str)) and not isinstance(value, bool) \
                    and str(value).lstrip("-").isdigit():
                return int(value)
            if option is bool and isinstance(value, bool):
                return value
            if option is str and isinstance(value, str):
                return value
            if typing.get_origin(option) is tuple and isinstance(value, (list, tuple)):
                return tuple(float(v) for v in value)
            if typing.get_origin(option) is dict and isinstance(value, dict):
                return value
        except ValueError:
            continue
    raise ValueError(f"{name}={value!r} is not a valid {_type_name(hint)}")


def _type_name(hint: Any) -> str:
    """``int``, ``float | None``, ``tuple[float, float]``: a field type as it is written."""
    return hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")


def _build(cls: type, values: dict[str, Any], prefix: str) -> Any:
    """Build dataclass ``cls`` from a nested dict, refusing unknown keys by their dotted name, coercing values to
    the field types (a ``dict`` field with a ``schema`` dataclass in its metadata to that one's field types)."""
    if not isinstance(values, dict):
        raise ValueError(f"{prefix.rstrip('.') or 'config'} must be a mapping, got {values!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ValueError(f"unknown config key(s): {', '.join(_suggest(prefix, k, fields) for k in unknown)}")
    required = [name for name, f in fields.items()
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    missing = [name for name in required if name not in values and not dataclasses.is_dataclass(hints[name])]
    if missing:
        raise ValueError(f"missing required config key(s): {', '.join(prefix + m for m in missing)}")
    # an absent section is an empty one: its own checks name the keys it needs (data.shards)
    values = {**{name: {} for name in required if dataclasses.is_dataclass(hints[name])}, **values}
    kwargs = {}
    for name, value in values.items():
        hint = hints[name]
        schema = fields[name].metadata.get("schema")
        if dataclasses.is_dataclass(hint):
            value = _build(hint, value or {}, f"{prefix}{name}.")
        elif schema is not None and isinstance(value, dict):
            value = _coerce_to_schema(schema, value, f"{prefix}{name}.")
        else:
            value = _coerce(hint, value, prefix + name)
        kwargs[name] = value
    return cls(**kwargs)


REPLACED_KEYS = {"train.eval_batches": "train.eval_samples (held-out samples per evaluation, each counted once; "
                                       "null: all of them)"}
"""Keys earlier versions read, with what replaced them."""


def _suggest(prefix: str, key: str, known: Iterable[str]) -> str:
    """``prefix + key``, with what replaced it (`REPLACED_KEYS`) or the closest known key when one is close (a
    typo)."""
    if prefix + key in REPLACED_KEYS:
        return f"{prefix + key} (replaced by {REPLACED_KEYS[prefix + key]})"
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.75)
    return prefix + key + (f" (did you mean {prefix + close[0]}?)" if close else "")


def _coerce_to_schema(schema: type, values: dict[str, Any], prefix: str) -> dict[str, Any]:
    """A partial set of ``schema``'s fields (e.g. ``model.overrides``), each coerced to its field type."""
    hints = typing.get_type_hints(schema)
    unknown = sorted(set(values) - set(hints))
    if unknown:
        raise ValueError(f"unknown config key(s): {', '.join(_suggest(prefix, k, hints) for k in unknown)} "
                         f"({schema.__name__} has {', '.join(f.name for f in dataclasses.fields(schema))})")
    return {name: _coerce(hints[name], value, prefix + name) for name, value in values.items()}


def apply_overrides(values: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Return a copy of nested ``values`` with ``a.b.c=value`` overrides applied (values parsed as YAML)."""
    result = yaml.safe_load(yaml.safe_dump(values)) or {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"override {item!r} is not of the form key=value")
        node = result
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"override {item!r}: {part} is not a section")
        try:
            node[leaf] = yaml.safe_load(raw)
        except yaml.YAMLError as error:
            raise ValueError(f"override {item!r}: not valid YAML: {_yaml_problem(error)}") from None
    return result


def _yaml_problem(error: yaml.YAMLError) -> str:
    """What yaml found wrong, in one line: ``expected ',' or ']', but got '<stream end>' (while parsing a flow
    sequence)``."""
    problem, context = getattr(error, "problem", None), getattr(error, "context", None)
    if not problem:
        return " ".join(str(error).split())
    return f"{problem} ({context})" if context else problem


T = typing.TypeVar("T")


def _names_a_file(path: str | Path) -> bool:
    """Whether ``path`` is something a config can be read from: a file, or a pipe (``<(...)``), not a directory."""
    return Path(path).exists() and not Path(path).is_dir()


def config_error(path: str | Path, error: BaseException, overrides: Sequence[str] = ()) -> str:
    """One line for ``error`` from loading the config at ``path`` (with ``overrides``), naming the file once: a
    YAML error names it already, with the line; other messages (a missing file, a bad key or value) leave it out,
    and what may come from an override says so (not a missing file: ``error`` may have crossed ranks as a string,
    so this looks at the path, not the error's class)."""
    message = str(error)
    if message.startswith(f"{path}:"):
        return message
    from_overrides = overrides and _names_a_file(path)
    return f"{path}{' + overrides' if from_overrides else ''}: {message}"


def load_dataclass(cls: type[T], path: str | Path | None, overrides: list[str] = (),
                   values: dict[str, Any] | None = None) -> T:
    """The config ``cls`` from a YAML file (``path``, optional), then ``values`` (nested keys), then dotted
    ``key=value`` overrides; values are coerced to the field types and the dataclasses validate themselves."""
    if path and not _names_a_file(path):  # the callers name the path
        what = "a directory, not a config file" if Path(path).is_dir() else "no such config file"
        others = sorted(Path(path).parent.glob("*.yaml")) if Path(path).parent.is_dir() else []
        listed = f" ({Path(path).parent} has {', '.join(other.name for other in others)})" if others else ""
        raise FileNotFoundError(what + listed)
    try:
        loaded = (yaml.safe_load(Path(path).read_text()) or {}) if path else {}
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        raise ValueError(f"{where}: not valid YAML: {_yaml_problem(error)}") from None
    if not isinstance(loaded, dict):
        raise ValueError(f"{path}: expected a mapping of config keys")
    loaded.update(values or {})
    return _build(cls, apply_overrides(loaded, list(overrides)), "")


def config_from_dict(values: dict[str, Any]) -> RunConfig:
    return _build(RunConfig, values, "")


def load_config(path: str | Path, overrides: list[str] = ()) -> RunConfig:
    """Read a run YAML, apply dotted overrides, validate."""
    return load_dataclass(RunConfig, path, overrides)


# ------------------------------------------------------------------------------- configuration reference
def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of dataclass ``cls`` (the string literal after the field)."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    docs = {}
    for node, following in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)):
            docs[node.target.id] = " ".join(inspect.cleandoc(following.value.value).split())
    return docs


def _reference_rows(cls: type, prefix: str, required: str = "required") -> list[str]:
    docs = field_docs(cls)
    rows = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(typing.get_type_hints(cls)[f.name]):
            continue  # a section: documented by its own table
        if f.default is not dataclasses.MISSING:
            default = f"`{f.default!r}`" if f.default not in (None, "") else ("`null`" if f.default is None else "`''`")
        elif f.default_factory is not dataclasses.MISSING:
            default = f"`{f.default_factory()!r}`"
        else:
            default = required
        doc = docs.get(f.name)
        if doc is None:
            raise ValueError(f"{cls.__name__}.{f.name} has no docstring: every config key is documented")
        doc = doc.replace("``", "`").replace("|", "\\|")
        kind = str(f.type).replace("|", "\\|")
        rows.append(f"| `{prefix}{f.name}` | `{kind}` | {default} | {doc} |")
    return rows


def reference_markdown() -> str:
    """The configuration reference (docs/configuration.md): every key of a pre-training run YAML and of a fine-tuning
    config, from the dataclasses' field docstrings."""
    # imported here, not at the top: finetune.config imports this module, and pre-training needs nothing of it
    from finetune.config import FinetuneConfig

    header = ["| key | type | default | meaning |", "|---|---|---|---|"]
    parts = ["Generated by `python -m pretrain.config --reference` from the field docstrings in `pretrain/config.py`, "
             "`pretrain/model.py` and `finetune/config.py`; `tests/test_readme.py` keeps this section equal to it.", "",
             "## Pre-training (`pretrain/configs/*.yaml`, `python -m pretrain.train --config YAML key=value`)", "",
             "Every key of a run YAML; any of them can be overridden on the command line as `key=value` (e.g. "
             "`train.max_steps=100`).", ""]
    for title, cls, prefix in (("Top level", RunConfig, ""), ("`data`", DataConfig, "data."),
                               ("`model`", ModelSection, "model."), ("`optim`", OptimConfig, "optim."),
                               ("`train`", TrainConfig, "train.")):
        parts += [f"### {title}", "", *header, *_reference_rows(cls, prefix), ""]
    parts += ["### `model.overrides` (the architecture, `pretrain.model.ModelConfig`)", "",
              "Fields replaced on top of `model.preset` (e.g. `model.overrides.hidden_dropout=0.0`); keys without a "
              "default come from the preset.", "", *header,
              *_reference_rows(ModelConfig, "model.overrides.", required="from preset"), ""]
    parts += ["## Fine-tuning (`finetune/configs/*.yaml`, `python -m finetune.run --set key=value`)", "",
              "Every key of a fine-tuning config (`finetune.config.FinetuneConfig`): set in the YAML given as "
              "`--config`, by the flags of `python -m finetune.run` that carry its name (`--lr`, `--max-seq-len`, "
              "...) or as `--set key=value` (e.g. `--set eval_beam_size=5`), later ones winning; the required keys "
              "are usually given as `--task` (or the YAML's `task`), `--train`, `--dev`, `--init` and `--out`.", "",
              *header, *_reference_rows(FinetuneConfig, ""), ""]
    return "\n".join(parts)


def keys_help(cls: type, prefix: str = "") -> str:
    """One line per key of config dataclass ``cls`` (sections flattened to dotted keys): name, type, default and
    the first sentence of its docstring; the epilog of an entry point's ``--help``."""
    docs, hints, lines = field_docs(cls), typing.get_type_hints(cls), []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            lines.append(keys_help(hints[f.name], f"{prefix}{f.name}."))
            continue
        if f.default is not dataclasses.MISSING:
            default = repr(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            default = repr(f.default_factory())
        else:
            default = "required"
        doc = " ".join(docs.get(f.name, "").replace("``", "`").split())
        # sentences end at ". " before a capital (not after "e.g."); what null means is kept with the first
        sentences = re.split(r"(?<!e\.g\.)(?<!i\.e\.)(?<=\.)\s+(?=[A-Z`(])", doc)
        first = " ".join([sentences[0]] + [s for s in sentences[1:] if s.startswith(("Null:", "None:"))])
        lines.append(f"  {prefix}{f.name} ({str(f.type).replace(' ', '')}, {default}): {first}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pretrain.config",
                                     description="Print a resolved run config, or the configuration reference.")
    parser.add_argument("config", nargs="?", help="run YAML to resolve and print (with overrides)")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    parser.add_argument("--reference", action="store_true", help="print the Markdown reference of every key")
    parser.add_argument("--update-reference", action="store_true",
                        help="rewrite docs/configuration.md's reference section with the generated one")
    args = parser.parse_args(argv)
    if args.update_reference:
        readme = REPO_ROOT / "docs" / "configuration.md"
        start, end = "<!-- config-reference:start -->\n", "<!-- config-reference:end -->"
        text, count = re.subn(re.escape(start) + ".*?" + re.escape(end),
                              lambda _: start + reference_markdown() + "\n" + end, readme.read_text(), flags=re.S)
        if count != 1:
            parser.error(f"{readme} has no single config-reference section")
        readme.write_text(text)
        print(f"updated {readme}")
    elif args.reference:
        print(reference_markdown(), end="")
    elif args.config:
        # imported here, not at the top: pretrain.trainer imports this module
        from pretrain.trainer import resolve_model_config
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
