"""The DeepSpeed engine both trainings run on: its JSON checked and completed with the run config's values, the
choice of Adam, the optimizer's parameter groups, the engine built, and the gradient norm of a step.

``pretrain.trainer`` (pre-training) and ``finetune.engine`` (fine-tuning) build on these; each adds only its
data, its model's loss and its bookkeeping. The process group is ``pretrain.distributed``'s, RNG state
``pretrain.rng``'s, checkpoints ``pretrain.checkpoint``'s and ``pretrain.resume``'s.

The DeepSpeed JSON holds engine settings only (ZeRO stage, precision, offload, optimizer/scheduler *types*):
batch sizes, clipping, optimizer hyper-parameters and the schedule come from the run config and are injected
by `engine_config`; a JSON that sets one of them is refused (`read_engine_json`), so a value is never defined
twice.
"""
from __future__ import annotations

import copy
import difflib
import json
import logging
import math
import warnings
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import deepspeed
import torch

from common.paths import REPO_ROOT
from data_prep.sources import json_type
from pretrain.accelerator import FUSED_ADAM_NEEDS, op_failure
from pretrain.batch_plan import BatchPlan
from pretrain.distributed import SetupError, first_error, say_once

if TYPE_CHECKING:
    from pretrain.resume import ResumePoint

# Hyper-parameters that come from the run config only; a DeepSpeed JSON that sets them is refused.
INJECTED_TOP = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                "gradient_clipping")
INJECTED_OPTIMIZER = ("lr", "betas", "eps", "weight_decay")
INJECTED_SCHEDULER = ("total_num_steps", "warmup_num_steps", "warmup_max_lr", "warmup_min_lr", "warmup_min_ratio",
                      "cos_min_ratio")
SCHEDULERS = {"linear": "WarmupDecayLR", "cosine": "WarmupCosineLR"}
"""DeepSpeed's scheduler for each `optim.schedule`: linear warm-up, then linear (BERT, UniLM) or cosine (GPT-1)
decay to the minimum at the last step."""
CONFIG_DIRECTORY = REPO_ROOT / "ds_configs"
"""The repository's DeepSpeed JSONs (one per ZeRO stage and precision; ``*_cpu.json`` for CPU-only machines)."""


# ----------------------------------------------------------------------------------------- DeepSpeed JSON
DEEPSPEED_KEYS = (
    "activation_checkpointing", "aio", "autotuning", "bf16", "bfloat16", "checkpoint", "comet", "comms_logger",
    "communication_data_type", "compile", "csv_monitor", "data_efficiency", "data_parallel_size", "data_types",
    "dataloader_drop_last", "datastates_ckpt", "disable_allgather", "disable_python_gc", "dump_state",
    "expert_parallel", "flops_profiler", "fp16", "gradient_accumulation_steps", "gradient_allreduce_op",
    "gradient_clipping", "gradient_predivide_factor", "hybrid_engine", "log_level", "managed_gradient_accumulation",
    "memory_breakdown", "optimizer", "pipeline", "prescale_gradients", "scheduler",
    "seq_parallel_communication_data_type", "sequence_parallel_size", "steps_per_print", "tensor_parallel",
    "tensorboard", "timers", "torch_autocast", "train_batch_size", "train_micro_batch_size_per_gpu",
    "use_data_before_expert_parallelism", "vocabulary_size", "wall_clock_breakdown", "wandb", "weight_quantization",
    "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "zero_optimization")
"""The top-level keys DeepSpeed 0.19.8 reads: those ``DeepSpeedConfig`` looks up in a config dict
(tests/pretrain/test_engine_json.py records them from the installed DeepSpeed) and the mesh sizes
``deepspeed.initialize`` reads (``data_parallel_size``, ``sequence_parallel_size``), less the blocks it refuses as
removed features (``nebula``, ``amp``, ``elasticity`` ...).
DeepSpeed ignores a key it does not read, and other parts of it read keys of their own, so this list is not
known to be complete: `read_engine_json` refuses only a key that is a close misspelling of one of these
(``zero_optimisation``, which DeepSpeed would ignore, training at ZeRO 0) and leaves other unknown keys alone."""
MISSPELLING_CUTOFF = 0.85
"""difflib's similarity ratio above which an unknown key counts as a misspelling of a known one."""
OBJECT_BLOCKS = ("optimizer", "scheduler", "zero_optimization", "fp16", "bf16", "bfloat16", "checkpoint")
"""Top-level keys whose value must be a JSON object: DeepSpeed and `engine_config` read keys inside them."""


def read_engine_json(path: Path, accelerator: Any | None = None) -> dict[str, Any]:
    """The DeepSpeed JSON at ``path``, refused (a ValueError naming the file and the key) where it sets a value
    that the run config injects, where DeepSpeed would ignore it (a misspelt top-level key) or stop later with a
    traceback (a block that is not an object, a scheduler the run config cannot drive, a ZeRO stage that does not
    exist, fp16 together with bf16). With ``accelerator`` (DeepSpeed's ``get_accelerator()`` of the process that
    trains), a precision it cannot train in is refused too, as ``deepspeed.initialize`` would refuse it."""
    try:
        engine = json.loads(Path(path).read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(engine, dict):
        raise ValueError(f"{path}: a DeepSpeed config is a JSON object, this holds a {type(engine).__name__}")
    _check_block_types(engine, path)
    _check_misspelt_keys(engine, path)
    clashes = [k for k in INJECTED_TOP if k in engine]
    clashes += [f"optimizer.params.{k}" for k in INJECTED_OPTIMIZER
                if k in engine.get("optimizer", {}).get("params", {})]
    clashes += [f"scheduler.params.{k}" for k in INJECTED_SCHEDULER
                if k in engine.get("scheduler", {}).get("params", {})]
    if clashes:
        raise ValueError(f"{path} sets {', '.join(clashes)}: these come from the run config and are injected; "
                         "remove them from the DeepSpeed JSON")
    zero = engine.get("zero_optimization")
    if isinstance(zero, dict) and "stage" in zero:
        stage = zero["stage"]
        if isinstance(stage, str) and stage.strip().isdigit():  # DeepSpeed reads "2" as 2; so does the run
            stage = zero["stage"] = int(stage)
        if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
            raise ValueError(f"{path}: zero_optimization.stage is {stage!r}; use 0, 1, 2 or 3")
    if "scheduler" in engine:
        _refuse_other_scheduler(engine["scheduler"], f"{path}: scheduler.type is")
    if _enabled(engine, "fp16") and _enabled(engine, "bf16"):
        raise ValueError(f"{path}: fp16 and bf16 are both enabled; enable one (bf16 where the GPUs have it: "
                         "no loss scaling)")
    if accelerator is not None:
        _check_precision_supported(engine, path, accelerator)
    return engine


def _refuse_other_scheduler(scheduler: dict[str, Any], what: str) -> None:
    """Refuse a scheduler block whose type the run config cannot drive (``what`` starts the message)."""
    if scheduler.get("type") not in SCHEDULERS.values():
        raise ValueError(f"{what} {scheduler.get('type')!r}; the schedule comes from the run config (optim.schedule: "
                         f"{' or '.join(SCHEDULERS)}, {' or '.join(SCHEDULERS.values())}): name one of these or leave "
                         "the scheduler block out")


def _enabled(engine: dict[str, Any], precision_name: str) -> bool:
    """Whether the JSON enables ``fp16`` or ``bf16`` (DeepSpeed also reads bf16 under its old key ``bfloat16``)."""
    keys = ("bf16", "bfloat16") if precision_name == "bf16" else (precision_name,)
    return any(isinstance(engine.get(k), dict) and engine[k].get("enabled") is True for k in keys)


def _check_block_types(engine: dict[str, Any], path: Path) -> None:
    """The blocks read key by key must be objects (``"optimizer": null`` or ``"zero_optimization": "2"`` would
    fail inside DeepSpeed or `engine_config` with an AttributeError)."""
    for key in OBJECT_BLOCKS:
        if key in engine and not isinstance(engine[key], dict):
            raise ValueError(f"{path}: {key} must be a JSON object ({{...}}), not {json_type(engine[key])}; fix it "
                             "or leave the key out")
    for key in ("optimizer", "scheduler"):
        params = engine.get(key, {}).get("params", {})
        if not isinstance(params, dict):
            raise ValueError(f"{path}: {key}.params must be a JSON object ({{...}}), not {json_type(params)}")


def _check_misspelt_keys(engine: dict[str, Any], path: Path) -> None:
    """Refuse a top-level key that is not DeepSpeed's but close to one of `DEEPSPEED_KEYS` (letter case
    ignored): DeepSpeed would ignore it and run without that setting."""
    for key in engine:
        if key in DEEPSPEED_KEYS:
            continue
        close = difflib.get_close_matches(key.lower(), DEEPSPEED_KEYS, n=1, cutoff=MISSPELLING_CUTOFF)
        if close:
            injected = (f" That one comes from the run config: remove {key!r}" if close[0] in INJECTED_TOP else "")
            raise ValueError(f"{path}: unknown key {key!r}, which DeepSpeed would ignore; did you mean {close[0]!r}?"
                             + injected)


def _check_precision_supported(engine: dict[str, Any], path: Path, accelerator: Any) -> None:
    """Refuse fp16 or bf16 where ``accelerator`` does not support it: the check of DeepSpeed's engine
    (``DeepSpeedEngine._do_sanity_check``), made before any model is built, naming the configs that fit."""
    device = accelerator.device_name()
    for name, supported in (("fp16", accelerator.is_fp16_supported), ("bf16", accelerator.is_bf16_supported)):
        if not _enabled(engine, name) or supported():
            continue
        if device == "cpu":
            configs = sorted(f"{CONFIG_DIRECTORY.name}/{p.name}" for p in CONFIG_DIRECTORY.glob("*_cpu.json"))
            fix = f"set deepspeed_config to a CPU config ({', '.join(configs)}), or run on GPUs"
        else:
            fix = f"use a config that does not enable {name} ({'bf16' if name == 'fp16' else 'fp16'} or fp32)"
        raise ValueError(f"{path}: {name} is enabled, but DeepSpeed's {device} accelerator cannot train in {name} on "
                         f"this machine (deepspeed.initialize would stop: \"Type {name} is not supported on your "
                         f"device\"); {fix}")


def zero_stage(engine_json: dict[str, Any]) -> int:
    return engine_json.get("zero_optimization", {}).get("stage", 0)


def engine_config(engine_json: dict[str, Any], plan: BatchPlan, grad_clip: float,
                  optimizer_params: dict[str, Any] | None, lr: float, min_lr: float, warmup_steps: int,
                  total_steps: int, load_universal: bool = False, schedule: str = "linear") -> dict[str, Any]:
    """A copy of the DeepSpeed JSON with the values that come from a run config: batch sizes, clipping, the
    AdamW block's params (``optimizer_params=None`` drops the block for a client optimizer, such as torch's Adamax,
    and lets ZeRO wrap it), the warm-up/decay schedule (``SCHEDULERS[schedule]``, replacing the JSON's
    WarmupDecayLR or WarmupCosineLR; another scheduler there is refused), and ``load_universal`` when resuming from
    a universal checkpoint (``pretrain.checkpoint.find_resume_point``)."""
    engine = copy.deepcopy(engine_json)
    engine.update(plan.deepspeed_fields())
    engine["gradient_clipping"] = grad_clip
    engine.setdefault("steps_per_print", 10**9)
    if optimizer_params is None:  # a client optimizer: ZeRO refuses ones off DeepSpeed's own list without this
        engine.pop("optimizer", None)
        engine["zero_allow_untested_optimizer"] = True
    else:
        engine.setdefault("optimizer", {"type": "AdamW", "params": {}})
        engine["optimizer"].setdefault("params", {}).update(optimizer_params)
    scheduler = engine.setdefault("scheduler", {"type": SCHEDULERS[schedule], "params": {}})
    _refuse_other_scheduler(scheduler, "the DeepSpeed JSON names scheduler")
    scheduler["type"] = SCHEDULERS[schedule]
    params = scheduler.setdefault("params", {})
    params.update(total_num_steps=total_steps, warmup_num_steps=warmup_steps)
    if schedule == "cosine":  # WarmupCosineLR scales the optimizer's lr: from and down to min_lr / lr of it
        params.update(warmup_min_ratio=min_lr / lr, cos_min_ratio=min_lr / lr)
    else:
        params.update(warmup_max_lr=lr, warmup_min_lr=min_lr)
    params.setdefault("warmup_type", "linear")
    if load_universal:
        engine.setdefault("checkpoint", {})["load_universal"] = True
    return engine


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: weight decay on matrices and embeddings, none on biases and LayerNorm weights (1-D)."""
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for parameter in model.parameters():
        if parameter.requires_grad:
            (no_decay if parameter.ndim < 2 else decay).append(parameter)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _scheduler_not_started(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("Attempting to get learning rate from scheduler before it has started")


def adam_op(config: dict[str, Any]) -> str | None:
    """The op builder ``deepspeed.initialize`` loads for ``config``'s optimizer: ``FusedAdamBuilder`` for an Adam or
    AdamW block without ``torch_adam: true``, ``CPUAdamBuilder`` when its state is offloaded (CPU or NVMe); None
    for another optimizer or torch's AdamW."""
    optimizer = config.get("optimizer") or {}
    if str(optimizer.get("type", "")).lower() not in ("adam", "adamw"):
        return None
    if optimizer.get("params", {}).get("torch_adam", False):
        return None
    offload = (config.get("zero_optimization", {}).get("offload_optimizer") or {}).get("device", "none")
    return "CPUAdamBuilder" if offload in ("cpu", "nvme") else "FusedAdamBuilder"


def optimizer_name(optimizer: Any) -> str:
    """The class an engine's optimizer (``engine.basic_optimizer``: ZeRO wraps it) steps with, by module and name,
    as a checkpoint's marker records it: a checkpoint resumes only into a class that takes over its state."""
    kind = optimizer if isinstance(optimizer, type) else type(optimizer)
    return f"{kind.__module__}.{kind.__qualname__}"


TORCH_ADAM = frozenset(optimizer_name(kind) for kind in (torch.optim.AdamW, torch.optim.Adam))
DEEPSPEED_ADAM = frozenset(("deepspeed.ops.adam.fused_adam.FusedAdam", "deepspeed.ops.adam.cpu_adam.DeepSpeedCPUAdam"))


def takes_over(saved: str, built: str, universal: bool = False) -> bool:
    """Whether an optimizer of class ``built`` goes on from the state one of class ``saved`` checkpointed, loaded
    as saved or (``universal``: on another world size or ZeRO stage) from DeepSpeed's universal conversion of it.
    Its own always. Every Adam here keeps step, exp_avg and exp_avg_sq per parameter, but as saved, DeepSpeed's
    (FusedAdam, CPUAdam) read ``bias_correction`` from the parameter groups, which torch's Adam / AdamW save
    without it: theirs goes on with either, torch's only with torch's. Universally converted, the parameter groups
    are the new run's, and the step a plain number, which torch's refuses at its first step: DeepSpeed's goes on
    from either, torch's from neither."""
    if saved == built:
        return True
    if universal:
        return saved in DEEPSPEED_ADAM | TORCH_ADAM and built in DEEPSPEED_ADAM
    return saved in DEEPSPEED_ADAM and built in DEEPSPEED_ADAM | TORCH_ADAM


def _with_torch_adam(config: dict[str, Any]) -> dict[str, Any]:
    config = copy.deepcopy(config)
    config["optimizer"].setdefault("params", {})["torch_adam"] = True
    return config


def adam_that_loads(config: dict[str, Any], resumed: ResumePoint | None = None) -> dict[str, Any]:
    """``config``, or a copy that steps with torch's AdamW (``torch_adam: true``: the same update, unfused) where
    DeepSpeed's FusedAdam cannot be loaded on some rank: without the CUDA toolkit (PyPI's CUDA torch brings no
    nvcc) every run would otherwise stop inside ``deepspeed.initialize``. A JSON that sets ``torch_adam: false``
    asked for FusedAdam, and offloaded optimizer state needs CPUAdam: where that cannot be loaded, `SetupError`
    names the cause and the fix. A collective.

    A checkpoint ``resumed`` goes on with an optimizer that takes over its state (`takes_over`): one torch's Adam
    stepped, loaded as saved, goes on with it, as DeepSpeed's Adams cannot; one FusedAdam stepped goes on with
    torch's AdamW where FusedAdam does not load, unless it is resumed through a universal conversion."""
    op = adam_op(config)
    saved = (resumed.meta.get("optimizer_class") or "") if resumed is not None else ""
    explicit = "torch_adam" in (config.get("optimizer") or {}).get("params", {})
    saved_class = saved.rsplit(".", 1)[-1]
    where = resumed.directory / resumed.tag if resumed is not None else None
    universal = resumed is not None and resumed.universal
    if op is not None and saved in TORCH_ADAM and not universal:
        if op == "CPUAdamBuilder":
            raise SetupError(f"{where} was stepped by torch's {saved_class}, and the DeepSpeed JSON offloads "
                             "optimizer state (zero_optimization.offload_optimizer), which DeepSpeed's CPUAdam "
                             "steps: it cannot take over torch's state (its parameter groups lack bias_correction). "
                             "Resume with a JSON without offload_optimizer, or one that offloads torch's "
                             "(optimizer.params.torch_adam true, zero_force_ds_cpu_optimizer false)")
        if explicit:
            raise SetupError(f"{where} was stepped by torch's {saved_class} and the DeepSpeed JSON sets "
                             "optimizer.params.torch_adam false, asking for DeepSpeed's FusedAdam, which cannot "
                             "take over torch's state (its parameter groups lack bias_correction): drop torch_adam "
                             "from the JSON to resume with torch's optimizer")
        say_once(f"[optimizer] {where} was stepped by torch's {saved_class}: so is this run (DeepSpeed's FusedAdam, "
                 "which the DeepSpeed JSON would use, cannot take over torch's state)")
        return _with_torch_adam(config)
    failure = None if op is None else first_error(op_failure(op))
    if failure is None:
        return config
    if op == "CPUAdamBuilder":
        raise SetupError(f"DeepSpeed's CPUAdam, which steps optimizer state offloaded by the DeepSpeed JSON "
                         f"(zero_optimization.offload_optimizer), cannot be loaded here: {failure}. DeepSpeed builds "
                         "it on first use with a C++ compiler (g++; or set CXX) and Python's headers (Debian/Ubuntu: "
                         "python3-dev); or choose a JSON without offload_optimizer")
    if explicit:
        raise SetupError(f"DeepSpeed's FusedAdam cannot be loaded here: {failure}. The DeepSpeed JSON sets "
                         f"optimizer.params.torch_adam false; {FUSED_ADAM_NEEDS}; or drop torch_adam from the JSON "
                         "to step with torch's AdamW where FusedAdam does not load")
    if saved in DEEPSPEED_ADAM and universal:
        raise SetupError(f"DeepSpeed's FusedAdam cannot be loaded here: {failure}. {where} was stepped by DeepSpeed's "
                         f"{saved_class} and is resumed on another world size or ZeRO stage, through "
                         "DeepSpeed's universal conversion, which torch's AdamW cannot go on from: "
                         f"{FUSED_ADAM_NEEDS}; or resume with the world size and ZeRO stage it was saved with")
    stepped = f" {where} was stepped by DeepSpeed's {saved_class}, whose state torch's AdamW takes " \
        "over." if saved in DEEPSPEED_ADAM else ""
    say_once(f"[optimizer] DeepSpeed's FusedAdam cannot be loaded here ({failure}): stepping with torch's AdamW, "
             f"the same update unfused. For the fused one: {FUSED_ADAM_NEEDS}.{stepped} A checkpoint of this "
             "run resumes with torch's AdamW on the world size and ZeRO stage it was saved with")
    return _with_torch_adam(config)


def build_engine(model: torch.nn.Module, config: dict[str, Any], weight_decay: float,
                 client_optimizer: Callable[[list[dict[str, Any]]], torch.optim.Optimizer] | None = None,
                 resumed: ResumePoint | None = None) -> Any:
    """``deepspeed.initialize`` on ``model`` with `parameter_groups`; ``client_optimizer(groups)`` replaces the
    JSON's optimizer block when given; `adam_that_loads` decides between DeepSpeed's FusedAdam and torch's AdamW.
    The optimizer built here must take over the state of the checkpoint to be ``resumed`` (`takes_over` the class
    its marker's ``optimizer_class`` records, where it records one): else `SetupError`, before anything loads."""
    if client_optimizer is None:
        config = adam_that_loads(config, resumed)
    groups = parameter_groups(model, weight_decay)
    optimizer = client_optimizer(groups) if client_optimizer is not None else None
    # Messages no user can act on, once per rank: DeepSpeed's schedulers ask for their rate in their constructor,
    # before the start below ("Attempting to get learning rate from scheduler before it has started"), and its ZeRO
    # stages call collectives torch deprecates (all_gather_into_tensor, reduce_scatter_tensor: a FutureWarning per
    # rank and collective on torch >= 2.13, which torch's c10d logger wrapper reports as its own line).
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed\.c10d_logger")
    deepspeed_logger = logging.getLogger("DeepSpeed")
    deepspeed_logger.addFilter(_scheduler_not_started)
    try:
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, optimizer=optimizer,
                                               config=config)
    finally:
        deepspeed_logger.removeFilter(_scheduler_not_started)
    saved = resumed.meta.get("optimizer_class") if resumed is not None else None
    built = optimizer_name(engine.basic_optimizer)
    if resumed is not None and saved is not None and not takes_over(saved, built, resumed.universal):
        converted = " (converted to DeepSpeed's universal checkpoint: another world size or ZeRO stage)" \
            if resumed.universal else ""
        raise SetupError(f"{resumed.directory / resumed.tag} was stepped by {saved}, whose state{converted} {built}, "
                         "which this run builds, cannot take over. Resume with the optimizer settings it ran with: the "
                         "DeepSpeed JSON's optimizer block and offload_optimizer; in fine-tuning, also the optimizer "
                         "setting")
    if engine.lr_scheduler is not None:
        # DeepSpeed's schedulers start at iteration -1 and the engine steps them after each optimizer step, so step
        # k would run at iteration k - 2's rate (the first two at the warm-up's start). From iteration 0, step k runs
        # at k - 1's, as transformers' schedules do: the first at min_lr, the peak right after warmup_steps.
        # A resumed run's load_checkpoint then sets the iteration it saved.
        engine.lr_scheduler.step(0)
    return engine


def precision(engine: Any) -> str:
    return "fp16" if engine.fp16_enabled() else "bf16" if engine.bfloat16_enabled() else "fp32"


# --------------------------------------------------------------------------------------- one optimizer step
def optimizer_step(engine: Any, micro_batches: Sequence[dict[str, torch.Tensor]],
                   loss_of: Callable[[Any], torch.Tensor],
                   observe: Callable[[dict[str, torch.Tensor], Any], None],
                   before_update: Callable[[], None]) -> float | None:
    """Forward and backward of each micro-batch, then DeepSpeed's step (it applies the update at the last one).

    ``loss_of(output)`` is the scalar to backpropagate; ``observe(batch, output)`` sees each micro-batch's output
    (statistics); ``before_update()`` runs after the last backward and before the update is applied — where a
    non-finite loss stops the run with the weights untouched. Returns `measured_gradient_norm`'s answer.
    """
    measured = None
    for index, batch in enumerate(micro_batches):
        output = engine(**batch)
        engine.backward(loss_of(output))
        observe(batch, output)
        if index == len(micro_batches) - 1:
            before_update()
            measured = measured_gradient_norm(engine)
        engine.step()
    return measured


def measured_gradient_norm(engine: Any) -> float | None:
    """The global gradient norm, measured here after the last micro-batch's backward (before the ``engine.step()``
    that applies the update) where DeepSpeed's step records none (`records_gradient_norm`), else None;
    `step_gradient_norm` reads either after the step."""
    return None if records_gradient_norm(engine) else gradient_norm(engine.module.parameters())


def records_gradient_norm(engine: Any) -> bool:
    """Whether DeepSpeed's step records the global gradient norm: its ZeRO and bf16/fp16 optimizers do; without
    ZeRO in fp32 the engine steps the plain torch optimizer and drops `clip_grad_norm_`'s result."""
    return engine.fp16_enabled() or hasattr(engine.optimizer, "_global_grad_norm")


def gradient_norm(parameters: Iterable[torch.nn.Parameter]) -> float:
    """The L2 norm of all gradients together, in fp32 (after the boundary's backward, without ZeRO: the averaged
    gradients every rank holds alike)."""
    norms = [torch.linalg.vector_norm(p.grad, dtype=torch.float32) for p in parameters if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0


def step_gradient_norm(engine: Any, measured: float | None) -> float | None:
    """The global gradient norm of the step just taken: DeepSpeed's, else the one `measured_gradient_norm` took."""
    norm = engine.get_global_grad_norm()
    return measured if norm is None else float(norm)


def nonfinite_gradient_norm(engine: Any, measured: float | None = None) -> float | None:
    """The global gradient norm of the step just taken (`step_gradient_norm`) when it is NaN/inf under fp32/bf16,
    else None.

    fp16's loss scaler skips and logs such steps. Under fp32/bf16 DeepSpeed skips or applies the update
    depending on the ZeRO stage, with at most a log line, and training would go on: the caller stops, never
    saving this step."""
    if engine.fp16_enabled():
        return None
    norm = step_gradient_norm(engine, measured)
    if norm is None or math.isfinite(norm):
        return None
    return norm
