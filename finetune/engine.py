"""The fine-tuning loop: plan → (resume) → epochs of steps → dev eval → keep the best.

Built on what pre-training runs on (one copy of each): `pretrain.engine` (process group, DeepSpeed JSON with the
injected values and its clash check, parameter groups, RNG capture/restore, the optimizer step over
micro-batches, the non-finite checks) and `pretrain.checkpoint` (save with stale-marker removal, fsync, marker,
atomic `latest` and pruning; a full disk stops with `CheckpointWriteError`; resume from the newest
hash-verified complete checkpoint, converted to a universal checkpoint and re-seeded when the world size
changes). The run is defined by (config, seed): the order of training items in epoch e is a seeded
permutation, rank r takes its slice of each global batch, so a stopped run resumed from its newest complete
checkpoint (automatic: rerun the same command) continues with exactly the next batch. A non-finite loss or
gradient stops the run with `pretrain.engine.NonFiniteLossError` (exit code 3), as in pre-training.

Only fine-tuning's own parts live here: epochs and per-epoch evaluation, keeping the best model (written as a
Hugging Face export into `out`), `metrics.jsonl` (one record per step) and `summary.json`. Evaluation runs on
every rank (needed under ZeRO-3's partitioned parameters; rank 0's scores decide) and rank 0 writes. The best
model is exported from DeepSpeed's fp32 master weights, gathered from every rank's partition
(`pretrain.checkpoint.gather_full_weights`): under bf16/fp16 the module itself holds rounded copies, under
ZeRO-3 only partitions; so every ZeRO stage and precision exports the same full-precision model.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as torch_dist

from common.files import write_atomically
from pretrain import checkpoint as ckpt
from pretrain.accelerator import collective_device
from pretrain.batch_plan import BatchPlan, plan_batch
from pretrain.data import to_device
from pretrain.distributed import NonFiniteLossError, gather_objects, init_distributed
from pretrain.engine import (
    build_engine,
    engine_config,
    nonfinite_gradient_norm,
    optimizer_name,
    optimizer_step,
    read_engine_json,
    zero_stage,
)
from pretrain.metrics import prepare_metrics_file
from pretrain.progress import StepBar
from pretrain.resume import ResumePoint, find_resume_point, load_or_seed, lock_run_directory, report_changed_settings
from pretrain.stopping import StopRequest

from .config import FinetuneConfig
from .model_io import save_finetuned
from .tasks import TaskSetup
from .tokenizer import Tokenizer

LOG_FILE = "metrics.jsonl"
"""One JSON object per optimizer step (step, epoch, loss, lr), as pre-training's ``out_dir/metrics.jsonl``."""
log = logging.getLogger(__name__)

SUMMARY_FILE = "summary.json"
"""The run's outcome: per-epoch dev scores, the best epoch, steps done, whether it finished."""


def schedule(cfg: FinetuneConfig, train_size: int) -> tuple[int, int, int]:
    """(steps per epoch, total steps, warm-up steps). An epoch drops its last incomplete global batch."""
    if train_size < cfg.batch_size:
        raise ValueError(f"{cfg.train}: {train_size} training items, fewer than one global batch of {cfg.batch_size}; "
                         f"lower --batch-size to at most {train_size}"
                         + (f", with a --micro-batch-size that splits it (now {cfg.micro_batch_size})"
                            if cfg.micro_batch_size > train_size else ""))
    steps_per_epoch = train_size // cfg.batch_size
    total = cfg.epochs * steps_per_epoch
    if cfg.max_steps is not None:
        total = min(total, cfg.max_steps)
    return steps_per_epoch, total, max(1, round(cfg.warmup_ratio * total))


def deepspeed_config(cfg: FinetuneConfig, plan: BatchPlan, engine_json: dict[str, Any], total_steps: int,
                     warmup_steps: int, load_universal: bool) -> dict[str, Any]:
    """The engine JSON with batch sizes, optimizer values and the warm-up/decay schedule injected."""
    if cfg.optimizer == "adamax" and engine_json.get("zero_optimization", {}).get("offload_optimizer"):
        raise ValueError(f"{cfg.deepspeed_config_path}: optimizer adamax (torch.optim.Adamax) cannot run under "
                         "ZeRO-Offload (zero_optimization.offload_optimizer): DeepSpeed offloads only its own CPU "
                         "Adam; set optimizer=adamw, or use a DeepSpeed JSON without offload_optimizer")
    adamw = None if cfg.optimizer == "adamax" else dict(lr=cfg.lr, weight_decay=cfg.weight_decay)  # Adamax: client
    return engine_config(engine_json, plan, grad_clip=cfg.grad_clip, optimizer_params=adamw, lr=cfg.lr, min_lr=0.0,
                         warmup_steps=warmup_steps, total_steps=max(total_steps, warmup_steps + 1),
                         load_universal=load_universal)


BATCH_KEYS = ("--batch-size", "--micro-batch-size")
"""How a fine-tuning run sets its global batch and micro-batch (named in `plan_batch`'s refusals)."""

TASK_IDENTITY = ("labels", "regression", "multiple_choice", "version_2")
"""What of a task's setup a checkpoint's head is shaped by: resuming with others would load the wrong head."""


def run_identity(cfg: FinetuneConfig, model_config: dict, tokenizer: Tokenizer,
                 task_meta: dict[str, Any]) -> dict[str, Any]:
    """What ties a checkpoint to this run (checked on resume by `pretrain.checkpoint.check_compatible`): the
    model, vocabulary, training file, seed, the task with its label space, and where its weights started (the
    ``--init`` directory, or its architecture alone with ``--from-scratch``)."""
    train_hash = hashlib.sha256(Path(cfg.train).read_bytes()).hexdigest()  # stands for the shard manifest
    task = {"task": cfg.task, **{k: task_meta[k] for k in TASK_IDENTITY if k in task_meta}}
    return {"model_config": model_config, "vocab_hash": tokenizer.vocab.sha256, "manifest_hash": train_hash,
            "seed": cfg.seed, "task": task,
            "init": {"path": str(Path(cfg.init).resolve()), "from_scratch": cfg.from_scratch}}


@dataclasses.dataclass
class Progress:
    """Where the fine-tuning run stands (saved in every checkpoint)."""

    step: int = 0
    history: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """One record per finished epoch: train loss and dev scores."""
    best: dict[str, Any] | None = None
    """The record of the best epoch so far (by the task's primary metric)."""
    epoch_losses: list[float] = dataclasses.field(default_factory=list)
    """Step losses of the epoch in progress."""
    last_checkpoint: ckpt.Saved | None = None

    def client_state(self) -> dict[str, Any]:
        return {"history": self.history, "best": self.best, "epoch_losses": self.epoch_losses}


def fit(cfg: FinetuneConfig, task: TaskSetup, tokenizer: Tokenizer) -> dict[str, Any]:
    """Train `task` per `cfg` on this rank (resuming automatically); returns the summary.json content. The
    process group holds the run lock of `cfg.out` throughout (`pretrain.checkpoint.RunLock`)."""
    rank, world_size = init_distributed()  # joins the group, or finds the one `finetune.run` joined
    run_lock = lock_run_directory(cfg.out, rank)
    try:
        return _fit_locked(cfg, task, tokenizer, rank, world_size)
    finally:
        if run_lock is not None:
            run_lock.release()


def _fit_locked(cfg: FinetuneConfig, task: TaskSetup, tokenizer: Tokenizer, rank: int,
                world_size: int) -> dict[str, Any]:
    """``fit`` once this process group holds the run lock of ``cfg.out``: its steps, in order."""
    started = time.perf_counter()
    plan = plan_batch(cfg.batch_size, cfg.micro_batch_size, world_size, BATCH_KEYS)
    steps_per_epoch, total_steps, warmup_steps = schedule(cfg, task.train_size)
    engine, progress, resume, meta = _start(cfg, task, tokenizer, rank, world_size, plan, total_steps, warmup_steps)
    out = Path(cfg.out)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "run_config.json").write_text(json.dumps(cfg.to_dict(), indent=1))
        # resumed: the steps past the checkpoint are redone, their old records dropped
        prepare_metrics_file(out / LOG_FILE, progress.step if resume is not None else None)
    metrics_file = open(out / LOG_FILE, "a") if rank == 0 else None
    bar = StepBar(total_steps, progress.step, f"finetune {cfg.task}", every=max(1, min(50, steps_per_epoch // 4))) \
        if rank == 0 else None
    stop_requested = StopRequest(time.monotonic(), cfg.exit_after_minutes)
    engine.train()

    def ends_an_epoch(step: int) -> bool:
        return step > 0 and (step % steps_per_epoch == 0 or step == total_steps)

    try:
        if ends_an_epoch(progress.step) and len(progress.history) < -(-progress.step // steps_per_epoch):
            # resumed from an epoch's checkpoint whose dev evaluation did not finish: evaluate it now
            end_epoch(cfg, engine, task, tokenizer, progress, (progress.step - 1) // steps_per_epoch, total_steps,
                      rank, out)
        while progress.step < total_steps:
            epoch, index_in_epoch = divmod(progress.step, steps_per_epoch)
            lr = engine.get_lr()[0]  # the rate this step applies (the scheduler moves on after it)
            step_loss, stop = train_step(cfg, engine, task, plan, progress, epoch, index_in_epoch, rank, metrics_file,
                                         stop_requested)  # one rank signalled: all save and exit together
            progress.step += 1
            progress.epoch_losses.append(step_loss)
            if metrics_file:
                record = {"step": progress.step, "epoch": epoch + 1, "loss": step_loss, "lr": lr}
                metrics_file.write(json.dumps(record) + "\n")
                metrics_file.flush()
            if bar is not None:
                bar.update(progress.step, step_loss, lr)
            epoch_done = ends_an_epoch(progress.step)
            exiting = (stop or progress.step == cfg.exit_at_step) and progress.step < total_steps
            if epoch_done or exiting or (cfg.save_interval and progress.step % cfg.save_interval == 0):
                # before the epoch's dev evaluation: a failure there loses no training (the rerun evaluates it)
                progress.last_checkpoint = ckpt.save(engine, cfg.checkpoint_dir, progress.step, meta,
                                                     progress.client_state(), cfg.keep_last,
                                                     progress.last_checkpoint)
            if epoch_done:
                end_epoch(cfg, engine, task, tokenizer, progress, epoch, total_steps, rank, out)
            if exiting:
                if rank == 0 and progress.last_checkpoint is not None:  # saved just above
                    reason = "exit_at_step" if progress.step == cfg.exit_at_step else "time limit / SIGTERM / Ctrl-C"
                    log.info("[finetune] %s: saved %s at step %d; rerun the command to continue", reason,
                             progress.last_checkpoint.tag, progress.step)
                break
    finally:
        stop_requested.close()
        if metrics_file:
            metrics_file.close()
        if bar is not None:
            bar.close()
    summary = {"task": cfg.task, "primary_metric": task.primary_metric, "best": progress.best,
               "epochs": progress.history, "steps": progress.step, "total_steps": total_steps,
               "world_size": world_size, "finished": progress.step >= total_steps,
               "wall_s_this_launch": time.perf_counter() - started, **task.meta}
    if rank == 0:
        _write_summary(out, summary, task.primary_metric)
    return summary


def _start(cfg: FinetuneConfig, task: TaskSetup, tokenizer: Tokenizer, rank: int, world_size: int, plan: BatchPlan,
           total_steps: int, warmup_steps: int) -> tuple[Any, Progress, ResumePoint | None, dict[str, Any]]:
    """The run's DeepSpeed engine, resumed from ``cfg.out``'s last checkpoint of this same run where there is one:
    (engine, progress, resume point, the metadata every checkpoint records)."""
    identity = run_identity(cfg, dataclasses.asdict(task.backbone.cfg), tokenizer, task.meta)
    engine_json = read_engine_json(cfg.deepspeed_config_path)
    resume = find_resume_point(cfg.checkpoint_dir, "auto", identity, world_size, zero_stage(engine_json),
                               report=log.info if rank == 0 else None,
                               restart=f"use another --out, or delete {cfg.checkpoint_dir} to start afresh there")
    if rank == 0:
        log.info("[finetune] DeepSpeed config %s", cfg.deepspeed_config_path)
        report_changed_settings(resume, cfg.to_dict(), log.info)
    engine = build_engine(
        task.module, deepspeed_config(cfg, plan, engine_json, total_steps, warmup_steps,
                                      load_universal=resume is not None and resume.universal),
        cfg.weight_decay,
        client_optimizer=(lambda groups: torch.optim.Adamax(groups, lr=cfg.lr)) if cfg.optimizer == "adamax" else None,
        resumed=resume)
    progress = restore_progress(engine, resume, cfg.seed, rank, world_size, total_steps)
    meta = dict(identity, run_config=cfg.to_dict(), code_version=ckpt.code_version(), world_size=world_size,
                zero_stage=engine.zero_optimization_stage(), optimizer_class=optimizer_name(engine.basic_optimizer))
    return engine, progress, resume, meta


def _write_summary(out: Path, summary: dict[str, Any], primary_metric: str) -> None:
    """``summary.json``, written whole or not at all; a finished run names its best epoch."""
    write_atomically(out / SUMMARY_FILE, lambda tmp: tmp.write_text(json.dumps(summary, indent=1) + "\n"))
    best = summary["best"]
    if summary["finished"] and best is not None:
        log.info("[finetune] done: best epoch %s, %s %.4g; its model is %s (finetune.json, summary.json)",
                 best["epoch"], primary_metric, best[primary_metric], out)


def restore_progress(engine: Any, resume: ResumePoint | None, seed: int, rank: int, world_size: int,
                     total_steps: int) -> Progress:
    """Load the resume point and continue its RNG streams, or seed per-rank dropout streams."""
    state = load_or_seed(engine, resume, seed, rank, world_size)
    if state is None or resume is None:  # the state is the resume point's
        return Progress()
    if rank == 0:
        log.info("[finetune] resumed %s: step %d/%d", resume.tag, state["step"], total_steps)
    return Progress(state["step"], state["history"], state["best"], state["epoch_losses"], resume.saved)


def reduce_step(losses: list[torch.Tensor], accumulation_steps: int, stop: bool) -> dict[str, Any]:
    """This rank's micro-batch losses (device tensors) and stop request, reduced over ranks in one all-reduce with one
    transfer to the host, the step's only wait for the device: ``loss`` (the mean over ranks of each rank's mean;
    NaN/inf when any rank's loss is), ``stop`` (whether any rank asked to) and ``local_losses`` (this rank's)."""
    local = torch.stack([loss.detach().to(torch.float64) for loss in losses])
    totals = torch.cat([(local.sum() / accumulation_steps).view(1), local.new_tensor([float(stop)])])
    totals = totals.to(collective_device())
    torch_dist.all_reduce(totals)
    loss_sum, stops, *mine = torch.cat([totals, local.to(totals.device)]).tolist()
    return {"loss": loss_sum / torch_dist.get_world_size(), "stop": stops > 0, "local_losses": mine}


def train_step(cfg: FinetuneConfig, engine: Any, task: TaskSetup, plan: BatchPlan, progress: Progress, epoch: int,
               index_in_epoch: int, rank: int, metrics_file: Any, stop_requested: StopRequest) -> tuple[float, bool]:
    """One optimizer step on this rank's slice of the step's global batch. Its loss is the mean over the global
    batch whatever the (micro-batch, accumulation, ranks) split: a mean over examples in equal micro-batches, and,
    for a task with `TaskSetup.predicted_count`, each micro-batch's summed token loss over the step's tokens per
    micro-batch. Returns the step's loss, the mean over ranks (what one rank holding the whole batch would report),
    and whether any rank's ``stop_requested`` was set by the end of its backward passes. A NaN/inf loss on any rank
    (before the update) or gradient (after it) raises `NonFiniteLossError`."""
    order = np.random.default_rng([cfg.seed, epoch]).permutation(task.train_size)
    global_batch = order[index_in_epoch * cfg.batch_size: (index_in_epoch + 1) * cfg.batch_size]
    per_rank = plan.samples_per_rank
    mine = global_batch[rank * per_rank: (rank + 1) * per_rank].tolist()
    normalizer = {} if task.predicted_count is None else {"token_normalizer": torch.tensor(
        plan.per_micro_batch(task.predicted_count(global_batch.tolist(), epoch)), dtype=torch.float32)}
    micro_batches = []
    for begin in range(0, per_rank, cfg.micro_batch_size):
        batch = task.make_batch(mine[begin: begin + cfg.micro_batch_size], epoch)
        micro_batches.append(to_device({**batch, **normalizer}, engine.device))
    losses: list[torch.Tensor] = []
    summary: dict[str, Any] = {}

    def stop_if_nonfinite(what: str, stopped: str) -> None:
        last = progress.last_checkpoint.tag if progress.last_checkpoint else "none"
        message = (f"{what} at step {progress.step + 1} (epoch {epoch + 1}); stopped {stopped}; "
                   f"the last complete checkpoint ({last}) in {cfg.checkpoint_dir} is intact. Check the learning rate "
                   "and the precision (fp16 loss scaling: try bf16)")
        if metrics_file:
            event = {"step": progress.step + 1, "event": "nonfinite", "message": message}
            metrics_file.write(json.dumps(event) + "\n")
            metrics_file.flush()
        raise NonFiniteLossError(message)

    def before_update() -> None:
        summary.update(reduce_step(losses, plan.gradient_accumulation_steps, bool(stop_requested)))
        if not math.isfinite(summary["loss"]):
            stop_if_nonfinite(f"non-finite loss (this rank's micro-batches: {summary['local_losses']})",
                              "before the optimizer step")

    measured_norm = optimizer_step(engine, micro_batches, loss_of=lambda loss: loss,
                                   observe=lambda batch, loss: losses.append(loss.detach()),
                                   before_update=before_update)
    bad_norm = nonfinite_gradient_norm(engine, measured_norm)
    if bad_norm is not None:
        stop_if_nonfinite(f"non-finite gradient norm {bad_norm}", "without saving this step")
    return summary["loss"], summary["stop"]


def end_epoch(cfg: FinetuneConfig, engine: Any, task: TaskSetup, tokenizer: Tokenizer, progress: Progress, epoch: int,
              total_steps: int, rank: int, out: Path) -> None:
    """Evaluate on dev, record the epoch, and export the model when it is the best so far (rank 0 writes, the
    fp32 master weights every rank helps gather). Rank 0's scores decide for all: every rank keeps the same
    record, and all join the gathering collective or none does."""
    scores = gather_objects(task.evaluate(engine.module))[0]
    engine.train()
    record = {"epoch": epoch + 1, "step": progress.step, "train_loss": float(np.mean(progress.epoch_losses)),
              **scores}
    progress.history.append(record)
    progress.epoch_losses = []
    improved = progress.best is None or scores[task.primary_metric] > progress.best[task.primary_metric]
    if improved:
        progress.best = record
        weights = ckpt.gather_full_weights(engine.module, keep=rank == 0)  # collective under ZeRO
        if rank == 0:
            save_finetuned(out, task.backbone, task.head, tokenizer, task=cfg.task,
                           extra_meta={"settings": cfg.to_dict(), "best": record, **task.meta}, weights=weights)
    if rank == 0:
        log.info("[finetune] epoch %d step %d/%d: %s%s", epoch + 1, progress.step, total_steps,
                 "  ".join(f"{k} {v:.4g}" for k, v in record.items() if isinstance(v, float)),
                 " (best)" if improved else "")
