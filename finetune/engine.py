"""The fine-tuning loop on a DeepSpeed engine: plan → (resume) → epochs of steps → dev eval → keep the best.

Reused from pre-training (one copy of each): process-group start-up (`pretrain.trainer.init_distributed`),
batch arithmetic (`pretrain.batch_plan.plan_batch`), AdamW parameter groups, RNG state capture/restore, and
the checkpoint bookkeeping of `pretrain.checkpoint` (completeness marker, atomic `latest`, pruning,
compatibility check). The run is defined by (config, seed): the order of training items in epoch e is a seeded
permutation, rank r takes its slice of each global batch, so a stopped run resumed from its newest complete
checkpoint (automatic: rerun the same command) continues with exactly the next batch.

Only fine-tuning's own parts live here: epochs and per-epoch evaluation, keeping the best model (written as a
Hugging Face export into `out`), `metrics.json` and `train_log.jsonl`. Evaluation runs on every rank (same
result; needed under ZeRO-3's partitioned parameters) and rank 0 writes. Export of the best model reads the
full module, so ZeRO stages 0-2 (the CPU configs) are supported; a ZeRO-3 fine-tuning run needs a
consolidation step first (not done here). Resuming on another world size works with ZeRO-0 (whole states);
ZeRO-1/2 would need the universal-checkpoint conversion that `pretrain.trainer.find_resume_point` does for
pre-training (not wired in here: it takes a pre-training RunConfig).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as torch_dist

from pretrain import checkpoint as ckpt
from pretrain.batch_plan import plan_batch
from pretrain.data import to_device
from pretrain.outputs import write_file_atomically
from pretrain.trainer import (gather_objects, init_distributed, inject_engine_values, parameter_groups,
                              portable_rng_state, restore_rng_state)

from .config import FinetuneConfig
from .model_io import save_finetuned
from .tasks import TaskSetup
from .tokenizer import Tokenizer


def schedule(cfg: FinetuneConfig, train_size: int) -> tuple[int, int, int]:
    """(steps per epoch, total steps, warm-up steps). An epoch drops its last incomplete global batch."""
    if train_size < cfg.batch_size:
        raise ValueError(f"{cfg.train}: {train_size} training items, fewer than one global batch of {cfg.batch_size}")
    steps_per_epoch = train_size // cfg.batch_size
    total = cfg.epochs * steps_per_epoch
    if cfg.max_steps is not None:
        total = min(total, cfg.max_steps)
    return steps_per_epoch, total, max(1, round(cfg.warmup_ratio * total))


def deepspeed_config(cfg: FinetuneConfig, plan, total_steps: int, warmup_steps: int) -> dict[str, Any]:
    """The engine JSON with batch sizes, optimizer values and the warm-up/decay schedule injected."""
    adamw = None if cfg.optimizer == "adamax" else dict(lr=cfg.lr, weight_decay=cfg.weight_decay)  # Adamax: client
    return inject_engine_values(json.loads(cfg.deepspeed_config_path.read_text()), plan, grad_clip=cfg.grad_clip,
                                optimizer_params=adamw, lr=cfg.lr, min_lr=0.0, warmup_steps=warmup_steps,
                                total_steps=max(total_steps, warmup_steps + 1))


def _identity(cfg: FinetuneConfig, model_config: dict, tokenizer: Tokenizer) -> dict[str, Any]:
    """What ties a checkpoint to this run (checked on resume by `pretrain.checkpoint.check_compatible`)."""
    train_hash = hashlib.sha256(Path(cfg.train).read_bytes()).hexdigest()  # stands for the shard manifest
    return {"model_config": model_config, "vocab_hash": tokenizer.vocab.sha256, "manifest_hash": train_hash,
            "seed": cfg.seed}


def fit(cfg: FinetuneConfig, task: TaskSetup, tokenizer: Tokenizer) -> dict[str, Any]:
    """Train `task` per `cfg` on this rank (resuming automatically); returns the metrics.json content. The
    process group holds the run lock of `cfg.out` throughout (`pretrain.checkpoint.RunLock`)."""
    rank, world_size = init_distributed()
    run_lock = ckpt.lock_run_directory(cfg.out, rank)
    try:
        return _fit_locked(cfg, task, tokenizer, rank, world_size)
    finally:
        if run_lock is not None:
            run_lock.release()


def _fit_locked(cfg: FinetuneConfig, task: TaskSetup, tokenizer: Tokenizer, rank: int,
                world_size: int) -> dict[str, Any]:
    import deepspeed

    plan = plan_batch(cfg.batch_size, cfg.micro_batch_size, world_size)
    steps_per_epoch, total_steps, warmup_steps = schedule(cfg, task.train_size)
    backbone = task.module.backbone
    identity = _identity(cfg, dataclasses.asdict(backbone.cfg), tokenizer)
    out = Path(cfg.out)
    resume_tag = ckpt.choose_resume_tag(cfg.checkpoint_dir, report=print if rank == 0 else None)
    if resume_tag is not None:
        ckpt.check_compatible(ckpt.read_marker(cfg.checkpoint_dir / resume_tag), identity,
                              str(cfg.checkpoint_dir / resume_tag))

    if rank == 0:
        print(f"[finetune] DeepSpeed config {cfg.deepspeed_config_path}", flush=True)
    groups = parameter_groups(task.module, cfg.weight_decay)
    client_optimizer = torch.optim.Adamax(groups, lr=cfg.lr) if cfg.optimizer == "adamax" else None
    engine, _, _, _ = deepspeed.initialize(model=task.module, model_parameters=groups, optimizer=client_optimizer,
                                           config=deepspeed_config(cfg, plan, total_steps, warmup_steps))
    step, history, best, losses = 0, [], None, []
    if resume_tag is not None:
        load_path, state = engine.load_checkpoint(str(cfg.checkpoint_dir), tag=resume_tag)
        if load_path is None:
            raise RuntimeError(f"DeepSpeed could not load {cfg.checkpoint_dir / resume_tag}")
        step, history, best, losses = state["step"], state["history"], state["best"], state["epoch_losses"]
        if len(state["rng_states"]) == world_size:
            restore_rng_state(state["rng_states"][rank])
        if rank == 0:
            print(f"[finetune] resumed {resume_tag}: step {step}/{total_steps}", flush=True)
    else:
        ckpt.seed_everything(cfg.seed + rank)  # per-rank dropout streams
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "run_config.json").write_text(json.dumps(cfg.to_dict(), indent=1))
    meta_common = dict(identity, run_config=cfg.to_dict(), code_version=ckpt.code_version(),
                       world_size=world_size, zero_stage=engine.zero_optimization_stage())

    def save_checkpoint() -> None:
        tag = ckpt.tag_for_step(step)
        state = dict(step=step, history=history, best=best, epoch_losses=losses,
                     rng_states=gather_objects(portable_rng_state()))
        engine.save_checkpoint(str(cfg.checkpoint_dir), tag=tag, client_state=state, save_latest=False)
        torch_dist.barrier()
        if rank == 0:
            ckpt.write_marker(cfg.checkpoint_dir / tag, dict(meta_common, step=step))
            ckpt.update_latest(cfg.checkpoint_dir, tag)
            ckpt.prune(cfg.checkpoint_dir, cfg.keep_last, just_written=tag)
        torch_dist.barrier()

    log = open(out / "train_log.jsonl", "a" if resume_tag else "w") if rank == 0 else None
    per_rank = plan.samples_per_rank
    started = time.perf_counter()
    engine.train()
    try:
        while step < total_steps:
            epoch, index_in_epoch = divmod(step, steps_per_epoch)
            order = np.random.default_rng([cfg.seed, epoch]).permutation(task.train_size)
            global_batch = order[index_in_epoch * cfg.batch_size: (index_in_epoch + 1) * cfg.batch_size]
            mine = global_batch[rank * per_rank: (rank + 1) * per_rank].tolist()
            step_loss = 0.0
            for begin in range(0, per_rank, cfg.micro_batch_size):
                batch = task.make_batch(mine[begin: begin + cfg.micro_batch_size], epoch)
                loss = engine(**to_device(batch, engine.device))
                if not torch.isfinite(loss):
                    raise FloatingPointError(f"non-finite loss at step {step + 1} (epoch {epoch + 1}); the last "
                                             f"checkpoint in {cfg.checkpoint_dir} is intact")
                engine.backward(loss)
                engine.step()
                step_loss += loss.item() / plan.gradient_accumulation_steps
            step += 1
            losses.append(step_loss)
            if log:
                log.write(json.dumps({"step": step, "epoch": epoch + 1, "loss": step_loss,
                                      "lr": engine.get_lr()[0]}) + "\n")
                log.flush()
            epoch_done = step % steps_per_epoch == 0 or step == total_steps
            if epoch_done:
                scores = task.evaluate(engine.module)
                engine.train()
                record = {"epoch": epoch + 1, "step": step, "train_loss": float(np.mean(losses)), **scores}
                history.append(record)
                losses = []
                improved = best is None or scores[task.primary_metric] > best[task.primary_metric]
                if improved:
                    best = record
                    if rank == 0:
                        save_finetuned(out, backbone, task.head, tokenizer, task=cfg.task,
                                       extra_meta={"settings": cfg.to_dict(), "best": best, **task.meta})
                if rank == 0:
                    print(f"[finetune] epoch {epoch + 1} step {step}/{total_steps}: " +
                          "  ".join(f"{k} {v:.4g}" for k, v in record.items() if isinstance(v, float)) +
                          (" (best)" if improved else ""), flush=True)
            if epoch_done or step == cfg.exit_at_step:
                save_checkpoint()
            if step == cfg.exit_at_step and step < total_steps:
                if rank == 0:
                    print(f"[finetune] exit_at_step {step}: checkpoint saved; rerun the command to continue",
                          flush=True)
                break
    finally:
        if log:
            log.close()
    summary = {"task": cfg.task, "primary_metric": task.primary_metric, "best": best, "epochs": history,
               "steps": step, "total_steps": total_steps, "world_size": world_size,
               "finished": step >= total_steps, "wall_s_this_launch": time.perf_counter() - started, **task.meta}
    if rank == 0:
        write_file_atomically(out / "metrics.json", lambda tmp: tmp.write_text(json.dumps(summary, indent=1) + "\n"))
    return summary

