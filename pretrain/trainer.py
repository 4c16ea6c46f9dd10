"""The pre-training loop on a DeepSpeed engine: build → (resume) → steps → checkpoints → metrics.

``train(cfg)`` runs on every rank of any launcher (deepspeed, torchrun, mpirun, or plain ``python`` for one
process). What it relies on DeepSpeed for: ZeRO 0-3, fp16 loss scaling / bf16, gradient accumulation and
clipping, the optimizer (its AdamW block) and the WarmupDecayLR schedule, checkpoint files, the universal
checkpoint converter, the CSV/TensorBoard monitor. What it adds: the data order (``pretrain.data``), batch
planning (``pretrain.batch_plan``), checkpoint completeness, RNG state and compatibility
(``pretrain.checkpoint``), early exit, NaN stop, ``metrics.jsonl`` and the progress bar.
"""
from __future__ import annotations

import copy
import dataclasses
import errno
import json
import math
import os
import shutil
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as torch_dist

from pretrain import checkpoint as ckpt
from pretrain.accelerator import apply_deepspeed_arch_list, bind_local_device, collective_device, local_rank
from pretrain.batch_plan import BatchPlan, plan_batch
from pretrain.config import RunConfig
from pretrain.data import PretrainLoader, SampleOrder, collate, sample_objectives, to_device
from pretrain.kernels import retain_freed_memory
from pretrain.model import ModelConfig, build_model, preset

REPORTED_OBJECTIVES = ("bidirectional_mlm", "nsp", "left_to_right", "right_to_left", "seq2seq", "causal_lm")
# Hyper-parameters that come from the run config only; a DeepSpeed JSON that sets them is refused.
_INJECTED_TOP = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                 "gradient_clipping")
_INJECTED_OPTIMIZER = ("lr", "betas", "eps", "weight_decay")
_INJECTED_SCHEDULER = ("total_num_steps", "warmup_num_steps", "warmup_max_lr", "warmup_min_lr")


class NonFiniteLossError(RuntimeError):
    """A NaN/inf loss or gradient (fp32/bf16): the run stops without saving, leaving the last checkpoint intact."""
    exit_code = 3


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (disk full, I/O error); the previous complete one is intact."""
    exit_code = 4


# ------------------------------------------------------------------------------------------ building blocks
def init_distributed() -> tuple[int, int]:
    """Join the process group of whichever launcher started us; plain ``python`` becomes a 1-rank group.

    First binds the rank's device (``LOCAL_RANK``, `pretrain.accelerator.bind_local_device`) and puts
    ``TORCH_CUDA_ARCH_LIST`` in the form DeepSpeed's op builder reads; on a CPU-only machine keeps freed memory in
    the process instead (`pretrain.kernels.retain_freed_memory`)."""
    device = bind_local_device()
    import deepspeed

    if device.type == "cpu":
        retain_freed_memory()
    arch_note = apply_deepspeed_arch_list()
    if arch_note and local_rank() == 0:
        print(f"[ops] {arch_note}", file=sys.stderr, flush=True)

    launched = all(k in os.environ for k in ("RANK", "WORLD_SIZE")) or "OMPI_COMM_WORLD_SIZE" in os.environ \
        or "PMI_SIZE" in os.environ
    if not launched:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
    # under mpirun DeepSpeed's MPI discovery sets MASTER_PORT from this argument
    deepspeed.init_distributed(auto_mpi_discovery=True, verbose=False,
                               distributed_port=int(os.environ.get("MASTER_PORT", 29500)))
    return torch_dist.get_rank(), torch_dist.get_world_size()


def resolve_model_config(cfg: RunConfig) -> ModelConfig:
    """The model config this run trains: an HF directory's, or a preset with ``model.overrides`` applied."""
    if cfg.model.init_from:
        from pretrain.hf import load_hf_bert
        base = load_hf_bert(cfg.model.init_from).cfg
    elif cfg.model.preset:
        base = preset(cfg.model.preset)
    else:
        return ModelConfig(**cfg.model.overrides)
    return dataclasses.replace(base, **cfg.model.overrides)


def inject_engine_values(engine: dict[str, Any], plan: BatchPlan, grad_clip: float,
                         optimizer_params: dict[str, Any] | None, lr: float, min_lr: float, warmup_steps: int,
                         total_steps: int) -> dict[str, Any]:
    """A copy of the DeepSpeed JSON ``engine`` with the values that come from a run config: batch sizes, clipping,
    the AdamW block's params (``optimizer_params=None`` drops the block for a client optimizer) and the linear
    warm-up/decay schedule (DeepSpeed's WarmupDecayLR unless the JSON names another scheduler)."""
    engine = copy.deepcopy(engine)
    engine.update(plan.deepspeed_fields())
    engine["gradient_clipping"] = grad_clip
    engine.setdefault("steps_per_print", 10**9)
    if optimizer_params is None:
        engine.pop("optimizer", None)
    else:
        engine.setdefault("optimizer", {"type": "AdamW", "params": {}})
        engine["optimizer"].setdefault("params", {}).update(optimizer_params)
    engine.setdefault("scheduler", {"type": "WarmupDecayLR", "params": {}})
    engine["scheduler"].setdefault("params", {}).update(
        total_num_steps=total_steps, warmup_num_steps=warmup_steps, warmup_max_lr=lr, warmup_min_lr=min_lr)
    engine["scheduler"]["params"].setdefault("warmup_type", "linear")
    return engine


def build_deepspeed_config(cfg: RunConfig, plan: BatchPlan, load_universal: bool) -> dict[str, Any]:
    """The DeepSpeed JSON (engine settings) with batch sizes, optimizer and schedule values injected."""
    path = cfg.deepspeed_config_path
    engine = json.loads(path.read_text())
    clashes = [k for k in _INJECTED_TOP if k in engine]
    clashes += [f"optimizer.params.{k}" for k in _INJECTED_OPTIMIZER if k in engine.get("optimizer", {}).get("params", {})]
    clashes += [f"scheduler.params.{k}" for k in _INJECTED_SCHEDULER if k in engine.get("scheduler", {}).get("params", {})]
    if clashes:
        raise ValueError(f"{path} sets {', '.join(clashes)}: these come from the run config (train.*, optim.*) "
                         "and are injected; remove them from the DeepSpeed JSON")
    engine = inject_engine_values(
        engine, plan, grad_clip=cfg.optim.grad_clip,
        optimizer_params=dict(lr=cfg.optim.lr, betas=list(cfg.optim.betas), eps=cfg.optim.eps,
                              weight_decay=cfg.optim.weight_decay),
        lr=cfg.optim.lr, min_lr=cfg.optim.min_lr, warmup_steps=cfg.optim.warmup_steps,
        total_steps=cfg.train.max_steps)
    monitor_dir = str(Path(cfg.out_dir) / "monitor")
    engine.setdefault("csv_monitor", {"enabled": True, "output_path": monitor_dir, "job_name": "train"})
    try:
        import tensorboard  # noqa: F401  (DeepSpeed's TensorBoard monitor needs it)
        engine.setdefault("tensorboard", {"enabled": True, "output_path": monitor_dir, "job_name": "train"})
    except ImportError:
        pass
    if load_universal:
        engine.setdefault("checkpoint", {})["load_universal"] = True
    return engine


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: weight decay on matrices and embeddings, none on biases and LayerNorm weights (1-D)."""
    decay, no_decay = [], []
    for parameter in model.parameters():
        if parameter.requires_grad:
            (no_decay if parameter.ndim < 2 else decay).append(parameter)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def shard_identity(dataset: Any) -> dict[str, Any]:
    """What ties a checkpoint to its data: the manifest file's hash and the vocab hash it records."""
    from data_prep.shard_format import MANIFEST_NAME, sha256_file

    return {"manifest_hash": sha256_file(Path(dataset.directory) / MANIFEST_NAME),
            "vocab_hash": dataset.manifest["vocab"].get("sha256")}


def dataset_vocab_size(dataset: Any) -> int | None:
    vocab = dataset.manifest["vocab"]
    return next((int(vocab[k]) for k in ("size", "vocab_size") if k in vocab), None)


def gather_objects(value: Any) -> list[Any]:
    out: list[Any] = [None] * torch_dist.get_world_size()
    torch_dist.all_gather_object(out, value)
    return out


def portable_rng_state() -> dict[str, Any]:
    """RNG states as plain Python / tensor values (loadable with torch.load(weights_only=True))."""
    state = ckpt.rng_state()
    name, keys, pos, has_gauss, cached = state["numpy"]
    state["numpy"] = (name, keys.tolist(), pos, has_gauss, cached)
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    import numpy as np
    name, keys, pos, has_gauss, cached = state["numpy"]
    state = dict(state, numpy=(name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    ckpt.set_rng_state(state)


# ----------------------------------------------------------------------------------------------- resume
@dataclasses.dataclass(frozen=True)
class ResumePoint:
    tag: str
    """The complete checkpoint resumed from."""
    load_tag: str
    """What DeepSpeed loads: ``tag``, or its universal conversion after a world-size / ZeRO-stage change."""
    meta: dict[str, Any]
    """Its marker (run metadata)."""

    @property
    def universal(self) -> bool:
        return self.load_tag != self.tag


def find_resume_point(cfg: RunConfig, identity: dict[str, Any], world_size: int, zero_stage: int,
                      rank: int) -> ResumePoint | None:
    """Pick the checkpoint to resume (``train.resume``), check it matches this run, convert it to a universal
    checkpoint if the world size or ZeRO stage changed (rank 0 converts, the others wait)."""
    if cfg.train.resume == "never":
        return None
    if cfg.train.resume == "auto":
        directory = cfg.checkpoint_dir
        tag = ckpt.choose_resume_tag(directory, report=print if rank == 0 else None)
        if tag is None:
            return None
        if rank == 0 and ckpt.read_latest(directory) != tag:  # `latest` always names a valid checkpoint
            ckpt.update_latest(directory, tag)
    else:
        directory, tag = ckpt.resolve_tag_dir(cfg.train.resume)
    meta, problem = ckpt.verify_tag(directory / tag, hashes=True)
    if meta is None:
        raise FileNotFoundError(f"{directory / tag} is not a complete checkpoint: {problem}")
    ckpt.check_compatible(meta, identity, str(directory / tag))
    load_tag = tag
    if (meta["world_size"] != world_size or meta["zero_stage"] != zero_stage) and meta["zero_stage"] > 0:
        if rank == 0:
            print(f"[resume] {tag}: world size {meta['world_size']} -> {world_size}, ZeRO stage "
                  f"{meta['zero_stage']} -> {zero_stage}: converting to a universal checkpoint", flush=True)
            load_tag = ckpt.to_universal(directory, tag)
        torch_dist.barrier()
        load_tag = f"{tag}_universal"
    return ResumePoint(tag=tag, load_tag=load_tag, meta=dict(meta, directory=str(directory)))


# ---------------------------------------------------------------------------------------------- metrics
def read_metrics(path: Path, report: Any = print) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl``; a line that is not a JSON object (a write cut short by a kill) is
    skipped and reported with its line number."""
    records = []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not isinstance(record, dict):
            report(f"[metrics] {path}:{number}: skipping a torn or unreadable line ({line[:60]!r})")
            continue
        records.append(record)
    return records


def prepare_metrics_file(path: Path, resumed_step: int | None, report: Any = print) -> None:
    """Make ``metrics.jsonl`` continue the run being started.

    Resumed at step N: records past N (steps being redone) and torn lines are dropped, by writing the kept
    records beside the file and renaming it over the old one, so a kill leaves the old or the new file. A fresh
    run (no checkpoint) never destroys an existing history: the old file is renamed ``metrics.N.jsonl``."""
    if not path.exists():
        return
    if resumed_step is None:
        number = 1
        while path.with_name(f"{path.stem}.{number}{path.suffix}").exists():
            number += 1
        kept = path.with_name(f"{path.stem}.{number}{path.suffix}")
        os.replace(path, kept)
        report(f"[metrics] {path} belongs to an earlier run that left no checkpoint here; kept as {kept.name}")
        return
    records = read_metrics(path, report)
    kept = [r for r in records if r.get("step", 0) <= resumed_step]
    text = "".join(json.dumps(r) + "\n" for r in kept)
    if len(kept) == len(records) and path.read_text(errors="replace") == text:
        return
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


class Metrics:
    """Rank 0's ``metrics.jsonl`` (one JSON object per optimizer step) and progress bar."""

    def __init__(self, path: Path, resumed_step: int | None, max_steps: int, enabled: bool) -> None:
        self.enabled = enabled
        self.path = path
        self.bar = None
        if not enabled:
            return
        prepare_metrics_file(path, resumed_step)
        from tqdm import tqdm
        self.bar = tqdm(total=max_steps, initial=resumed_step or 0, desc="pretrain", unit="step", file=sys.stderr,
                        mininterval=1.0, dynamic_ncols=True, disable=None)

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as handle:
            handle.write(json.dumps(record) + "\n")
        if self.bar is not None and "loss" in record:
            self.bar.update(record["step"] - self.bar.n)
            self.bar.set_postfix(loss=f"{record['loss']:.4f}", samples_s=f"{record['samples_per_s']:.1f}")
            if self.bar.disable and record["step"] % 10 == 0:  # not a terminal (cluster logs): a plain line
                print(f"[step {record['step']}/{self.bar.total}] loss {record['loss']:.4f} "
                      f"lr {record['lr']:.3g} {record['samples_per_s']:.1f} samples/s", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def check_trainable(dataset: Any, model_cfg: ModelConfig, where: str) -> None:
    """Refuse a shard recipe this model cannot learn from, before step 1: a masked-LM model needs masked
    positions (GPT-recipe shards have none), a causal LM predicts every next token and would learn to predict
    the [MASK] tokens of masked-LM shards."""
    recipe = dataset.manifest.get("recipe")
    if recipe == "gpt" and not model_cfg.causal_lm:
        raise ValueError(f"{where}: GPT-recipe shards (no masked positions) cannot train a masked-LM model "
                         "(nothing to predict); use model.preset=gpt or set model.overrides.causal_lm=true, or "
                         "build unilm/bert shards")
    if recipe in ("unilm", "bert") and model_cfg.causal_lm:
        raise ValueError(f"{where}: {recipe}-recipe shards hold [MASK]ed inputs for a masked-LM model, but the "
                         "model is a causal LM (model.causal_lm); build GPT-recipe shards or use a masked-LM preset")


def check_predicted_tokens(stats: dict[str, Any], step: int, where: str) -> None:
    """A step whose loss counted no predicted token (on any rank) is an error, not a loss of zero."""
    if not stats["objectives"]:
        raise ValueError(f"step {step}: the global batch has no predicted token (no masked position, no next "
                         f"token, no NSP label), so its loss would be a meaningless 0; check the shards {where} "
                         "(data_prep.inspect) and the model's recipe")


def _reduce_step_stats(loss_sum: float, micro_steps: int, tokens: int, objective_sums: dict[str, float],
                       objective_counts: dict[str, float], stop: bool) -> dict[str, Any]:
    """Sum step statistics over ranks in one all-reduce."""
    values = [loss_sum, micro_steps, tokens, float(stop)]
    for name in REPORTED_OBJECTIVES:
        values += [objective_sums.get(name, 0.0), objective_counts.get(name, 0.0)]
    tensor = torch.tensor(values, dtype=torch.float64, device=collective_device())
    torch_dist.all_reduce(tensor)
    values = tensor.tolist()
    objectives = {}
    for i, name in enumerate(REPORTED_OBJECTIVES):
        total, count = values[4 + 2 * i], values[5 + 2 * i]
        if count > 0:
            objectives[name] = total / count
    return {"loss": values[0] / values[1], "tokens": int(values[2]), "stop": values[3] > 0,
            "objectives": objectives}


def nonfinite_diagnostic(step: int, consumed_samples: int, stats: dict[str, Any], lr: float,
                         loss_scale: float | None, last_checkpoint: str | None, grad_norm: float | None = None) -> str:
    """``grad_norm`` given: the loss was finite but the gradient was not (the step was not saved)."""
    objectives = ", ".join(f"{k}={v:.4g}" for k, v in stats["objectives"].items()) or "none reported"
    what = f"non-finite loss {stats['loss']}" if grad_norm is None else f"non-finite gradient norm {grad_norm}"
    stopped = "before the optimizer step" if grad_norm is None else "without saving this step"
    return (f"{what} at step {step} (its global batch starts at consumed_samples={consumed_samples}), "
            f"objectives of the batch with their losses: {objectives}; lr={lr:.3g}"
            + (f", loss_scale={loss_scale}" if loss_scale is not None else "")
            + f". Stopped {stopped}; the last complete checkpoint ({last_checkpoint or 'none'}) "
            "is intact. Check the learning rate / warm-up, fp16 loss scaling (try bf16), and the samples of "
            "this step (pretrain.data.SampleOrder.indices(consumed_samples, global_batch_size)).")


# ------------------------------------------------------------------------------------------------ train
def train(cfg: RunConfig) -> dict[str, Any]:
    """Run (or continue) the pre-training run ``cfg`` on this rank. Returns rank-local summary values."""
    started = time.monotonic()
    rank, world_size = init_distributed()
    run_lock = ckpt.lock_run_directory(cfg.out_dir, rank)  # before anything under out_dir is read or written
    try:
        return _train_locked(cfg, rank, world_size, started)
    finally:
        if run_lock is not None:
            run_lock.release()


def _train_locked(cfg: RunConfig, rank: int, world_size: int, started: float) -> dict[str, Any]:
    """``train`` once this process group holds the run lock of ``cfg.out_dir``."""
    # Fail before building anything if the batch cannot be split over this world size.
    plan = plan_batch(cfg.train.global_batch_size, cfg.train.micro_batch_size, world_size)

    import deepspeed
    from data_prep.shard_format import ShardDataset

    dataset = ShardDataset(cfg.data.shards)
    if cfg.data.verify and rank == 0:  # other ranks wait at DeepSpeed's init; a failure here ends the launch
        verify_started = time.monotonic()
        dataset.verify()
        print(f"[data] verified {len(dataset.manifest['shards'])} shard(s) against the manifest hashes in "
              f"{time.monotonic() - verify_started:.1f}s", flush=True)
    model_cfg = resolve_model_config(cfg)
    check_trainable(dataset, model_cfg, cfg.data.shards)
    vocab_size = dataset_vocab_size(dataset)
    if vocab_size is not None and vocab_size > model_cfg.vocab_size:
        raise ValueError(f"the shards' vocabulary has {vocab_size} tokens but model.vocab_size is "
                         f"{model_cfg.vocab_size}; set model.overrides.vocab_size={vocab_size}")
    identity = dict(shard_identity(dataset), model_config=dataclasses.asdict(model_cfg),
                    seed=cfg.train.seed)
    engine_json = json.loads(cfg.deepspeed_config_path.read_text())
    zero_stage = engine_json.get("zero_optimization", {}).get("stage", 0)
    resume = find_resume_point(cfg, identity, world_size, zero_stage, rank)

    ckpt.seed_everything(cfg.train.seed)  # identical initial weights on every rank
    model = build_model(model_cfg) if not cfg.model.init_from else _init_from_hf(cfg.model.init_from, model_cfg)
    num_parameters = model.num_parameters()  # before ZeRO-3 partitions the tensors
    ds_config = build_deepspeed_config(cfg, plan, load_universal=resume is not None and resume.universal)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=parameter_groups(model, cfg.optim.weight_decay),
                                           config=ds_config)
    step, consumed = 0, 0
    if resume is not None:
        load_path, client_state = engine.load_checkpoint(resume.meta["directory"], tag=resume.load_tag)
        if load_path is None:
            raise RuntimeError(f"DeepSpeed could not load {resume.meta['directory']}/{resume.load_tag}")
        step, consumed = client_state["step"], client_state["consumed_samples"]
        if len(client_state["rng_states"]) == world_size:
            restore_rng_state(client_state["rng_states"][rank])
        else:  # another world size: dropout streams cannot continue; derive fresh ones from (seed, step, rank)
            ckpt.seed_everything(cfg.train.seed * 1_000_003 + step * 1_009 + rank)
        if rank == 0:
            print(f"[resume] {resume.tag}: step {step}, consumed_samples {consumed}", flush=True)
    else:
        ckpt.seed_everything(cfg.train.seed + rank)  # per-rank dropout streams

    order = SampleOrder(sample_objectives(dataset), cfg.train.seed)
    pad_id = dataset.special_tokens["pad"]
    max_len = cfg.data.max_seq_len or model_cfg.max_position_embeddings
    loader = PretrainLoader(dataset, order, plan, rank, consumed, pad_id, max_len, cfg.data.prefetch_steps,
                            device=engine.device)
    eval_set = _EvalSet(cfg, plan, rank, world_size, pad_id, max_len) if cfg.train.eval_interval else None
    out_dir = Path(cfg.out_dir)
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "run_config.json").write_text(json.dumps(cfg.to_dict(), indent=1))
    metrics = Metrics(out_dir / "metrics.jsonl", step if resume else None, cfg.train.max_steps, enabled=rank == 0)

    interrupted = {"flag": False}
    previous_handler = signal.signal(signal.SIGTERM, lambda *_: interrupted.update(flag=True))
    last_saved = resume.tag if resume else None
    last_save_id = resume.meta.get("save_id") if resume else None
    fp16 = engine.fp16_enabled()
    meta_common = dict(identity, run_config=cfg.to_dict(), code_version=ckpt.code_version(),
                       world_size=world_size, zero_stage=zero_stage,
                       precision="fp16" if fp16 else "bf16" if engine.bfloat16_enabled() else "fp32")

    if ckpt.FAULT_ENV in os.environ:  # test hook: a kill point after each file DeepSpeed writes
        write_file = engine.checkpoint_engine.save

        def write_file_then_fault(state_dict: Any, path: str) -> None:
            write_file(state_dict, path)
            ckpt.fault_point(f"after:{Path(path).name}", step, rank)
        engine.checkpoint_engine.save = write_file_then_fault

    def save() -> None:
        nonlocal last_saved, last_save_id
        tag = ckpt.tag_for_step(step)
        tag_dir = cfg.checkpoint_dir / tag
        client_state = dict(meta_common, step=step, consumed_samples=consumed,
                            rng_states=gather_objects(portable_rng_state()))
        ckpt.fault_point("save_begin", step, rank)
        if rank == 0:  # a marker left from an earlier save of this tag must not vouch for the files now rewritten
            (tag_dir / ckpt.MARKER).unlink(missing_ok=True)
        try:
            engine.save_checkpoint(str(cfg.checkpoint_dir), tag=tag, client_state=client_state, save_latest=False)
            weights = ckpt.gather_full_weights(engine.module)  # collective under ZeRO
            if rank == 0:
                ckpt.write_weights(tag_dir, weights)
            ckpt.fsync_tree(tag_dir)  # this rank's files are on disk before they count
        except (OSError, RuntimeError) as error:  # a full disk surfaces as OSError or as torch's RuntimeError
            free = shutil.disk_usage(cfg.checkpoint_dir).free
            full = getattr(error, "errno", None) == errno.ENOSPC or free < 2**20  # torch hides the errno
            if not (full or isinstance(error, OSError)):
                raise  # not the disk (e.g. a peer died in DeepSpeed's barrier): a crash, not a diagnosis
            shutil.rmtree(tag_dir, ignore_errors=True)  # never resumed from; frees what it took
            raise CheckpointWriteError(
                f"rank {rank} could not write checkpoint {tag_dir}: "
                f"{'No space left on device' if full else 'I/O error'} ({free / 2**20:.1f} MiB free there; {error}). "
                f"The last complete checkpoint ({last_saved or 'none'}) is intact: free disk space (make preflight "
                "estimates what a run needs) and rerun the same command to continue from it") from error
        torch_dist.barrier()  # every rank's files are written before the marker
        if rank == 0:
            ckpt.fault_point("before_marker", step, rank)
            save_id = ckpt.write_marker(tag_dir, dict(meta_common, step=step, consumed_samples=consumed,
                                                      parent_save_id=last_save_id))
            ckpt.fault_point("before_latest", step, rank)
            ckpt.update_latest(cfg.checkpoint_dir, tag)
            ckpt.prune(cfg.checkpoint_dir, cfg.train.keep_last, just_written=tag)
        else:
            save_id = None
        last_save_id = gather_objects(save_id)[0]
        last_saved = tag

    try:
        engine.train()
        if cfg.train.exit_at_step is not None and step >= cfg.train.exit_at_step and rank == 0:
            print(f"[exit] exit_at_step: already at step {step}", flush=True)
        while step < min(cfg.train.max_steps, cfg.train.exit_at_step or cfg.train.max_steps):
            ckpt.fault_point("step", step + 1, rank)
            step_started = time.perf_counter()
            wait_before = loader.wait_seconds
            micro_batches = loader.next_step()
            loss_sum, tokens = 0.0, 0
            objective_sums: dict[str, float] = {}
            objective_counts: dict[str, float] = {}
            skipped_before = engine.skipped_steps
            inf_grad = None
            if ckpt.fault_injected("inf_grad", step + 1, rank):  # test hook: one gradient becomes inf
                inf_grad = engine.module.embeddings.token.weight.register_hook(
                    lambda grad: torch.full_like(grad, math.inf))
            for index, batch in enumerate(micro_batches):
                output = engine(**batch)
                engine.backward(output.loss)
                loss_sum += output.loss.item()
                tokens += int(batch["length"].sum())
                for name, value in output.objective_losses.items():
                    count = float(output.objective_tokens[name])
                    objective_sums[name] = objective_sums.get(name, 0.0) + float(value) * count
                    objective_counts[name] = objective_counts.get(name, 0.0) + count
                if index == len(micro_batches) - 1:
                    out_of_time = (cfg.train.exit_after_minutes is not None
                                   and time.monotonic() - started > 60 * cfg.train.exit_after_minutes)
                    stats = _reduce_step_stats(loss_sum, len(micro_batches), tokens, objective_sums,
                                               objective_counts, out_of_time or interrupted["flag"])
                    check_predicted_tokens(stats, step + 1, cfg.data.shards)
                    lr = engine.get_lr()[0]  # the rate this optimizer step applies
                    if not math.isfinite(stats["loss"]):
                        if not math.isfinite(loss_sum):
                            print(f"[rank {rank}] non-finite local loss at step {step + 1}", file=sys.stderr)
                        message = nonfinite_diagnostic(step + 1, loader.consumed_samples - plan.global_batch_size,
                                                       stats, lr,
                                                       engine.optimizer.cur_scale if fp16 else None, last_saved)
                        metrics.write({"step": step + 1, "event": "nonfinite_loss", "message": message})
                        raise NonFiniteLossError(message)
                engine.step()
            if inf_grad is not None:
                inf_grad.remove()
            step += 1
            consumed = loader.consumed_samples
            elapsed = time.perf_counter() - step_started
            overflow = engine.skipped_steps > skipped_before
            grad_norm = engine.get_global_grad_norm()
            if not fp16 and grad_norm is not None and not math.isfinite(float(grad_norm)):
                # fp16's loss scaler skips and logs such steps. Under fp32/bf16 DeepSpeed skips or applies the update
                # depending on the ZeRO stage, with at most a log line, and training would go on: stop, never save
                message = nonfinite_diagnostic(step, consumed - plan.global_batch_size, stats, lr, None, last_saved,
                                               grad_norm=float(grad_norm))
                metrics.write({"step": step, "event": "nonfinite_gradient", "message": message})
                raise NonFiniteLossError(message)
            record = {
                "step": step, "consumed_samples": consumed, "loss": stats["loss"],
                "lr": lr, "grad_norm": _maybe_float(grad_norm),
                **{f"loss_{name}": value for name, value in stats["objectives"].items()},
                "samples_per_s": plan.global_batch_size / elapsed, "tokens_per_s": stats["tokens"] / elapsed,
                "tflops": 6.0 * num_parameters * stats["tokens"] / elapsed / 1e12,
                "step_time_s": elapsed, "data_wait_s": loader.wait_seconds - wait_before,
            }
            if fp16:
                record.update(loss_scale=engine.optimizer.cur_scale, overflow=overflow,
                              skipped_steps=engine.skipped_steps)
                if overflow and rank == 0:
                    print(f"[step {step}] fp16 overflow: optimizer step skipped, loss scale now "
                          f"{engine.optimizer.cur_scale}", file=sys.stderr)
            if eval_set is not None and step % cfg.train.eval_interval == 0:
                record.update(eval_set.evaluate(engine))
                engine.train()
            metrics.write(record)
            exiting = stats["stop"] or step == cfg.train.exit_at_step
            if step % cfg.train.save_interval == 0 or step == cfg.train.max_steps or exiting:
                save()
            if exiting:
                if rank == 0:
                    how = ("rerun without train.exit_at_step (or with a later one) to continue"
                           if step == cfg.train.exit_at_step else "rerun the same command to continue")
                    reason = "exit_at_step" if step == cfg.train.exit_at_step else "time limit / SIGTERM"
                    print(f"[exit] {reason}: saved {last_saved} at step {step}; {how}", flush=True)
                break
    finally:
        loader.close()
        metrics.close()
        signal.signal(signal.SIGTERM, previous_handler)
    return {"step": step, "consumed_samples": consumed, "last_checkpoint": last_saved,
            "data_wait_s": loader.wait_seconds, "wall_s": time.monotonic() - started}


def _maybe_float(value: Any) -> float | None:
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _init_from_hf(path: str, model_cfg: ModelConfig) -> torch.nn.Module:
    from pretrain.hf import load_hf_bert
    model = load_hf_bert(path)
    if model.cfg != model_cfg:  # overrides such as dropout changes
        fresh = build_model(model_cfg)
        fresh.load_state_dict(model.state_dict())
        model = fresh
    return model


class _EvalSet:
    """Per-objective loss on a fixed slice of the held-out shards (the first eval_batches × micro × dp
    samples of its epoch-0 order), averaged over ranks."""

    def __init__(self, cfg: RunConfig, plan: BatchPlan, rank: int, world_size: int, pad_id: int,
                 max_len: int) -> None:
        from data_prep.shard_format import ShardDataset
        self.dataset = ShardDataset(cfg.data.eval_shards)
        order = SampleOrder(sample_objectives(self.dataset), cfg.train.seed)
        micro = plan.micro_batch_size
        self.batches = [
            collate([self.dataset[int(i)] for i in order.indices((k * world_size + rank) * micro, micro)],
                    pad_id, max_len)
            for k in range(cfg.train.eval_batches)]

    @torch.no_grad()
    def evaluate(self, engine: Any) -> dict[str, float]:
        engine.eval()
        loss_sum, sums, counts = 0.0, {}, {}
        for batch in self.batches:
            output = engine(**to_device(batch, engine.device))
            loss_sum += output.loss.item()
            for name, value in output.objective_losses.items():
                count = float(output.objective_tokens[name])
                sums[name] = sums.get(name, 0.0) + float(value) * count
                counts[name] = counts.get(name, 0.0) + count
        stats = _reduce_step_stats(loss_sum, len(self.batches), 0, sums, counts, False)
        return {"eval_loss": stats["loss"], **{f"eval_loss_{k}": v for k, v in stats["objectives"].items()}}
