"""The pre-training loop on a DeepSpeed engine: build → (resume) → steps → checkpoints → metrics.

``train(cfg)`` runs on every rank of any launcher (deepspeed, torchrun, mpirun, or plain ``python`` for one
process) and reads as its steps: check the setup (``pretrain.setup_checks``), find the resume point, build the
engine, restore progress, build the loader, then `run_steps` (`train_step` each: forward, ``engine.backward``,
``engine.step``; a checkpoint every ``train.save_interval``). What it relies on DeepSpeed for: ZeRO 0-3, fp16 loss
scaling / bf16, gradient accumulation and clipping, the optimizer (its AdamW block) and the warm-up/decay schedule,
checkpoint files, the universal checkpoint converter, the CSV/TensorBoard monitor. What it shares with
fine-tuning: the shared runtime (``pretrain.distributed``, ``pretrain.engine``, ``pretrain.rng``,
``pretrain.checkpoint``, ``pretrain.resume``, ``pretrain.metrics``, ``pretrain.progress``, ``pretrain.stopping``).
What is its own: the data order (``pretrain.data``), batch planning (``pretrain.batch_plan``), early exit, the NaN
stop's diagnosis and the held-out evaluation.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import socket
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as torch_dist
from deepspeed.accelerator import get_accelerator

from common.files import sha256_file
from data_prep.shard_format import MANIFEST_NAME, ShardDataset
from pretrain import checkpoint as ckpt
from pretrain.batch_plan import BatchPlan, InfeasibleBatchError, plan_batch, plan_for_world
from pretrain.config import RunConfig
from pretrain.data import PretrainLoader, SampleOrder, collate, sample_objectives, to_device
from pretrain.distributed import (
    NonFiniteLossError,
    SetupError,
    gather_objects,
    init_distributed,
    is_lost_peer,
    lost_peer_error,
    on_every_rank,
    set_collective_timeout,
)
from pretrain.elastic import Recovery
from pretrain.engine import (
    build_engine,
    engine_config,
    measured_gradient_norm,
    nonfinite_gradient_norm,
    optimizer_name,
    precision,
    read_engine_json,
    step_gradient_norm,
    zero_stage,
)
from pretrain.metrics import Metrics, StepSums, Throughput, build_throughput, write_monitor
from pretrain.model import ModelConfig, UniLMModel, build_model
from pretrain.resume import (
    LOCK_FILE,
    ResumePoint,
    find_resume_point,
    load_or_seed,
    lock_run_directory,
    report_changed_settings,
)
from pretrain.rng import seed_everything
from pretrain.setup_checks import (
    check_shared_out_dir,
    compiler_works,
    fast_path_settings,
    model_for_shards,
    verify_shards,
)
from pretrain.stopping import StopRequest
from pretrain.warm_start import init_optimizer, load_initial_model

log = logging.getLogger(__name__)


def build_deepspeed_config(cfg: RunConfig, plan: BatchPlan, engine_json: dict[str, Any],
                           load_universal: bool) -> dict[str, Any]:
    """The DeepSpeed JSON (engine settings, from `read_engine_json`) with batch sizes, optimizer and schedule
    values injected, and DeepSpeed's CSV (and, when installed, TensorBoard) monitor writing to out_dir/monitor."""
    engine = engine_config(
        engine_json, plan, grad_clip=cfg.optim.grad_clip,
        optimizer_params=dict(lr=cfg.optim.lr, betas=list(cfg.optim.betas), eps=cfg.optim.eps,
                              weight_decay=cfg.optim.weight_decay),
        lr=cfg.optim.lr, min_lr=cfg.optim.min_lr, warmup_steps=cfg.optim.warmup_steps,
        total_steps=cfg.train.max_steps, load_universal=load_universal, schedule=cfg.optim.schedule)
    monitor_dir = str(Path(cfg.out_dir) / "monitor")
    engine.setdefault("csv_monitor", {"enabled": True, "output_path": monitor_dir, "job_name": "train"})
    if _tensorboard_installed():
        engine.setdefault("tensorboard", {"enabled": True, "output_path": monitor_dir, "job_name": "train"})
    return engine


def _tensorboard_installed() -> bool:
    try:
        import tensorboard  # noqa: F401  (an optional dependency: DeepSpeed's TensorBoard monitor needs it)
    except ImportError:
        return False
    return True


def shard_identity(dataset: ShardDataset) -> dict[str, Any]:
    """What ties a checkpoint to its data: the manifest file's hash and the vocab hash it records."""
    return {"manifest_hash": sha256_file(Path(dataset.directory) / MANIFEST_NAME),
            "vocab_hash": dataset.manifest["vocab"].get("sha256")}


def check_predicted_tokens(stats: dict[str, Any], step: int, where: str) -> None:
    """A step whose loss counted no predicted token (on any rank) is an error, not a loss of zero."""
    if not stats["objectives"]:
        raise ValueError(f"step {step}: the global batch has no predicted token (no masked position, no next "
                         f"token, no NSP label), so its loss would be a meaningless 0; check the shards {where} "
                         "(data_prep.inspect) and the model's recipe")


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
@dataclasses.dataclass
class Progress:
    """Where the run stands on this rank."""

    step: int = 0
    """Optimizer steps done."""
    consumed_samples: int = 0
    """Samples of the global order consumed (= step × global batch)."""
    last_checkpoint: ckpt.Saved | None = None
    """The newest complete checkpoint (resumed from or saved)."""


def train(cfg: RunConfig) -> dict[str, Any]:
    """Run (or continue) the pre-training run ``cfg`` on this rank. Returns rank-local summary values."""
    started = time.monotonic()
    rank, world_size = init_distributed()
    new_paths = missing_paths(Path(cfg.out_dir) / LOCK_FILE) if rank == 0 else []
    run_lock = lock_run_directory(cfg.out_dir, rank)  # before anything under out_dir is read or written
    try:
        return _train_locked(cfg, rank, world_size, started)
    except SetupError:
        if run_lock is not None:  # a refused run leaves nothing behind: only its lock was written
            remove_new_paths(new_paths)
        raise
    finally:
        if run_lock is not None:
            run_lock.release()


def missing_paths(path: Path) -> list[Path]:
    """``path`` and those of its parent directories that do not exist yet, deepest first: what taking the run lock
    creates."""
    missing = []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    return missing


def remove_new_paths(paths: list[Path]) -> None:
    """Remove `missing_paths`' answer from before the lock was taken (the lock file, then each directory while
    it is empty), while the lock is still held, so no other run can have taken it and written there."""
    for path in paths:
        try:
            if path.is_dir():
                path.rmdir()
            else:
                path.unlink()
        except OSError:  # a directory something else wrote into since: keep it and its parents
            return


@dataclasses.dataclass(frozen=True)
class RunSetup:
    """What `check_setup` found fit for this run, before anything is built on the device."""

    plan: BatchPlan
    engine_json: dict[str, Any]
    dataset: ShardDataset
    model_cfg: ModelConfig
    identity: dict[str, Any]
    """What ties a checkpoint to this run: shard and vocab hashes, model config, seed (`check_compatible`)."""
    resume: ResumePoint | None
    fast_paths: dict[str, bool]
    deepspeed_config: dict[str, Any]
    model: UniLMModel
    """The initial model (`initial_model`)."""
    batch_note: str | None = None
    """What ``train.on_world_change=nearest_batch`` chose, when the world size changed (`plan_for_world`)."""


def _train_locked(cfg: RunConfig, rank: int, world_size: int, started: float) -> dict[str, Any]:
    """``train`` once this process group holds the run lock of ``cfg.out_dir``: its steps, in order."""
    setup = check_setup(cfg, rank, world_size)
    engine = build_training_engine(cfg, setup.model, setup.deepspeed_config, setup.fast_paths, setup.resume)
    if cfg.train.init_optimizer and cfg.model.init_from and setup.resume is None:  # a resumed run has its own
        take_over_optimizer(engine, cfg.model.init_from, rank)
    throughput = build_throughput(setup.model_cfg, world_size, engine, rank, cfg.train.peak_tflops)
    progress = restore_progress(engine, setup.resume, cfg.train.seed, rank, world_size)
    hosts = gather_objects(socket.gethostname())  # one per rank: a recovery names the hosts that left or joined
    recovery = Recovery.begin(Path(cfg.out_dir), setup.resume.meta if setup.resume else None,
                              setup.resume.tag if setup.resume else None, world_size, hosts,
                              setup.batch_note) if rank == 0 else None  # before the metrics drop redone steps
    loader = build_loader(cfg, setup.dataset, setup.model_cfg, setup.plan, rank, progress.consumed_samples,
                          engine.device, pack=setup.fast_paths["pack_samples"])
    eval_set = EvalSet(cfg, setup.plan, rank, world_size, loader.pad_id, loader.max_len) \
        if cfg.train.eval_interval else None
    write_run_config(cfg, rank)
    metrics = Metrics(Path(cfg.out_dir) / "metrics.jsonl", progress.step if setup.resume else None,
                      cfg.train.max_steps, enabled=rank == 0)
    meta = dict(setup.identity, run_config=cfg.to_dict(), code_version=ckpt.code_version(), world_size=world_size,
                hosts=hosts, zero_stage=zero_stage(setup.engine_json), precision=precision(engine),
                optimizer_class=optimizer_name(engine.basic_optimizer))
    stop_requested = StopRequest(started, cfg.train.exit_after_minutes)
    try:
        run_steps(cfg, engine, loader, eval_set, setup.plan, metrics, progress, meta, stop_requested, throughput,
                  recovery)
    finally:
        loader.close()
        metrics.close()
        stop_requested.close()
    return {"step": progress.step, "consumed_samples": progress.consumed_samples,
            "last_checkpoint": last_tag(progress), "data_wait_s": loader.wait_seconds,
            "wall_s": time.monotonic() - started}


def check_setup(cfg: RunConfig, rank: int, world_size: int) -> RunSetup:
    """Everything the run needs before the engine, checked on every rank together.

    Fails before building anything if the batch cannot be split, the DeepSpeed JSON (and the config built from it),
    the shards, the initial model or the checkpoint to resume do not fit this run: one line naming what and the
    fix (`SetupError`), not a traceback per rank. What one rank finds wrong (a file missing on its node) stops every
    rank together, at the end of each step below (`on_every_rank`, or the collective check itself), before any rank
    enters another collective."""
    try:
        check_shared_out_dir(Path(cfg.out_dir), rank, world_size)
        early_plan, engine_json, dataset = on_every_rank(lambda: (
            batch_before_resume(cfg, world_size),
            read_engine_json(cfg.deepspeed_config_path, accelerator=get_accelerator()),
            ShardDataset(cfg.data.shards)))
        verify_shards(cfg, dataset, rank, world_size)
        model_cfg = on_every_rank(lambda: model_for_shards(cfg, dataset, rank))
        identity = dict(shard_identity(dataset), model_config=dataclasses.asdict(model_cfg), seed=cfg.train.seed)
        # a mismatch message names these shards by path (a marker has its own in its run config, not in identity)
        resume = find_resume_point(cfg.checkpoint_dir, cfg.train.resume, dict(identity, shards=str(dataset.directory)),
                                   world_size, zero_stage(engine_json), report=log.info if rank == 0 else None,
                                   check_world=lambda saved: batch_for_world(cfg, world_size, saved))
        plan, batch_note = (early_plan, None) if early_plan is not None and (
            resume is None or resume.meta["world_size"] == world_size) else \
            batch_for_world(cfg, world_size, resume.meta["world_size"] if resume else None)
        fast_paths, deepspeed_config, model = on_every_rank(lambda: (
            fast_path_settings(cfg, engine_json, model_cfg),
            build_deepspeed_config(cfg, plan, engine_json, load_universal=resume is not None and resume.universal),
            initial_model(cfg, model_cfg)))
    except (ValueError, OSError) as error:  # raised on every rank alike (the collective checks)
        raise SetupError(str(error)) from error
    if fast_paths["compile"]:
        fast_paths["compile"] = compiler_works(cfg.train.compile, rank)
    if rank == 0:
        log.info("[fast paths] " + ", ".join(f"train.{name}={'on' if on else 'off'}" for name, on in fast_paths.items())
                 + " (null settings resolved for this run's device, precision and model)")
        report_changed_settings(resume, cfg.to_dict(), log.info)
        if batch_note:
            log.warning(batch_note)
    return RunSetup(plan, engine_json, dataset, model_cfg, identity, resume, fast_paths, deepspeed_config, model,
                    batch_note)


def batch_before_resume(cfg: RunConfig, world_size: int) -> BatchPlan | None:
    """The batch plan on ``world_size`` ranks, checked before anything is read; None where it does not split but a
    checkpoint saved on another world size may be resumed, whose ``train.on_world_change`` then decides
    (`batch_for_world`)."""
    try:
        return plan_batch(cfg.train.global_batch_size, cfg.train.micro_batch_size, world_size)
    except InfeasibleBatchError:
        if cfg.train.resume == "never":
            raise
        return None


def batch_for_world(cfg: RunConfig, world_size: int, saved_world_size: int | None) -> tuple[BatchPlan, str | None]:
    """`plan_for_world` with this run's batch settings and ``train.on_world_change``."""
    return plan_for_world(cfg.train.global_batch_size, cfg.train.micro_batch_size, world_size, saved_world_size,
                          cfg.train.on_world_change)


def initial_model(cfg: RunConfig, model_cfg: ModelConfig) -> UniLMModel:
    """The model the run starts from: freshly initialised, or with the weights of ``model.init_from`` (an HF
    directory's or a checkpoint's, `pretrain.warm_start.load_initial_model`), read and checked against ``model_cfg``
    (a file that holds no weights, a tensor of another shape, one missing or unknown: a ValueError naming the file
    and tensor)."""
    seed_everything(cfg.train.seed)  # identical initial weights on every rank
    if not cfg.model.init_from:
        return build_model(model_cfg)
    try:
        return load_initial_model(cfg.model.init_from, model_cfg)
    except (ValueError, OSError) as error:
        raise ValueError(f"model.init_from: {error}") from error


def take_over_optimizer(engine: Any, init_from: str, rank: int) -> None:
    """``train.init_optimizer``: the Adam moments and step count of the checkpoint ``model.init_from`` go into the
    new run's optimizer (`pretrain.warm_start.init_optimizer`), every rank together."""
    step = on_every_rank(lambda: init_optimizer(engine, init_from))
    if rank == 0:
        log.info(f"[init] Adam moments and step count ({step}) taken over from {init_from}")


def build_training_engine(cfg: RunConfig, model: UniLMModel, deepspeed_config: dict[str, Any],
                          fast_paths: dict[str, bool], resume: ResumePoint | None = None) -> Any:
    """The DeepSpeed engine around the run's initial model (`initial_model`) with `build_deepspeed_config`'s
    config, and the optimizer ``resume`` was stepped by."""
    model.activation_checkpointing = cfg.train.activation_checkpointing
    model.chunked_loss = fast_paths["chunked_loss"]
    if fast_paths["compile"]:
        model.compile_blocks()
    return build_engine(model, deepspeed_config, cfg.optim.weight_decay, resumed=resume)


def restore_progress(engine: Any, resume: ResumePoint | None, seed: int, rank: int,
                     world_size: int) -> Progress:
    """Load the resume point into ``engine`` and continue its RNG streams, or seed per-rank dropout streams."""
    state = load_or_seed(engine, resume, seed, rank, world_size)
    if state is None or resume is None:
        return Progress()
    if rank == 0:
        log.info(f"[resume] {resume.tag}: step {state['step']}, consumed_samples {state['consumed_samples']}")
    return Progress(state["step"], state["consumed_samples"], resume.saved)


def build_loader(cfg: RunConfig, dataset: ShardDataset, model_cfg: ModelConfig, plan: BatchPlan, rank: int,
                 consumed_samples: int, device: torch.device, pack: bool = False) -> PretrainLoader:
    order = SampleOrder(sample_objectives(dataset), cfg.train.seed)
    max_len = cfg.data.max_seq_len or model_cfg.max_position_embeddings
    return PretrainLoader(dataset, order, plan, rank, consumed_samples, dataset.special_tokens["pad"], max_len,
                          cfg.data.prefetch_steps, device=device, pack=pack, causal_lm=model_cfg.causal_lm)


def write_run_config(cfg: RunConfig, rank: int) -> None:
    if rank == 0:
        out_dir = Path(cfg.out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "run_config.json").write_text(json.dumps(cfg.to_dict(), indent=1))


def run_steps(cfg: RunConfig, engine: Any, loader: PretrainLoader, eval_set: EvalSet | None, plan: BatchPlan,
              metrics: Metrics, progress: Progress, meta: dict[str, Any], stop_requested: StopRequest,
              throughput: Throughput, recovery: Recovery | None = None) -> None:
    """Optimizer steps until ``train.max_steps`` / ``train.exit_at_step`` / a stop request; saves on the way.

    From here on a collective that waits longer than ``train.collective_timeout_s`` for a rank, or whose peer died,
    stops this rank with a `PeerLostError` naming the step and the ranks lost (`pretrain.distributed`);
    ``recovery`` (a restarted run's) is recorded after the first step."""
    set_collective_timeout(cfg.train.collective_timeout_s)
    try:
        _run_steps(cfg, engine, loader, eval_set, plan, metrics, progress, meta, stop_requested, throughput, recovery)
    except RuntimeError as error:
        if not is_lost_peer(error):
            raise
        raise lost_peer_error(error, f"step {progress.step + 1} (after {last_tag(progress) or 'no checkpoint'})",
                              cfg.train.collective_timeout_s) from error


def _run_steps(cfg: RunConfig, engine: Any, loader: PretrainLoader, eval_set: EvalSet | None, plan: BatchPlan,
               metrics: Metrics, progress: Progress, meta: dict[str, Any], stop_requested: StopRequest,
               throughput: Throughput, recovery: Recovery | None) -> None:
    rank = torch_dist.get_rank()
    engine.train()
    last_step = min(cfg.train.max_steps, cfg.train.exit_at_step or cfg.train.max_steps)
    if cfg.train.exit_at_step is not None and progress.step >= cfg.train.exit_at_step and rank == 0:
        log.info(f"[exit] exit_at_step: already at step {progress.step}")
    elif progress.step >= cfg.train.max_steps and rank == 0:
        log.info(f"[done] this run already reached train.max_steps={cfg.train.max_steps}: nothing to train (raise "
                 "train.max_steps to train further)")
    while progress.step < last_step:
        record, stop = train_step(engine, loader, plan, metrics, progress, stop_requested, throughput)
        if eval_set is not None and progress.step % cfg.train.eval_interval == 0:
            record.update(eval_set.evaluate(engine))
            engine.train()
        metrics.write(record)
        write_monitor(engine, record)
        if recovery is not None:
            recovery.finish(progress.step)
            recovery = None
        exiting = stop or progress.step == cfg.train.exit_at_step
        if progress.step % cfg.train.save_interval == 0 or progress.step == cfg.train.max_steps or exiting:
            progress.last_checkpoint = ckpt.save(
                engine, cfg.checkpoint_dir, progress.step, dict(meta, consumed_samples=progress.consumed_samples),
                {}, cfg.train.keep_last, progress.last_checkpoint)
        if exiting:
            if rank == 0:
                say_exit(progress, at_exit_step=progress.step == cfg.train.exit_at_step)
            break


def say_exit(progress: Progress, at_exit_step: bool) -> None:
    how = ("rerun without train.exit_at_step (or with a later one) to continue" if at_exit_step
           else "rerun the same command to continue")
    reason = "exit_at_step" if at_exit_step else "time limit / SIGTERM / Ctrl-C"
    log.info(f"[exit] {reason}: saved {last_tag(progress)} at step {progress.step}; {how}")


def train_step(engine: Any, loader: PretrainLoader, plan: BatchPlan, metrics: Metrics, progress: Progress,
               stop_requested: StopRequest, throughput: Throughput) -> tuple[dict[str, Any], bool]:
    """One optimizer step over this rank's micro-batches: forward and backward of each, DeepSpeed's step after each
    (it accumulates, and applies the update at the last one); advances ``progress``. Returns the step's
    ``metrics.jsonl`` record and whether any rank asked to stop. The step's one wait for the device is the
    reduction of its sums, after the last backward and before the update: a non-finite loss raises
    `NonFiniteLossError` there, the weights untouched; a non-finite gradient (fp32/bf16) raises it after the update,
    unsaved. Either diagnosis is recorded in the metrics too."""
    step_started = time.perf_counter()
    wait_before, skipped_before = loader.wait_seconds, engine.skipped_steps
    micro_batches = loader.next_step()
    sums = StepSums(engine.device)
    for index, batch in enumerate(micro_batches):
        output = engine(**batch)
        engine.backward(output.loss)
        sums.add(batch, output)
        if index == len(micro_batches) - 1:  # this micro-batch's step() applies the update: check before it
            summary = checked_summary(engine, sums, bool(stop_requested), loader, plan, metrics, progress)
            measured_norm = measured_gradient_norm(engine)
        engine.step()
    progress.step += 1
    progress.consumed_samples = loader.consumed_samples
    elapsed = time.perf_counter() - step_started
    check_gradient_norm(engine, measured_norm, summary, plan, metrics, progress)
    record = {
        "step": progress.step, "consumed_samples": progress.consumed_samples, "loss": summary["loss"],
        "lr": summary["lr"], "grad_norm": _maybe_float(step_gradient_norm(engine, measured_norm)),
        **{f"loss_{name}": value for name, value in summary["objectives"].items()},
        "samples_per_s": plan.global_batch_size / elapsed, "tokens_per_s": summary["tokens"] / elapsed,
        **throughput.per_rank(summary, plan.global_batch_size, elapsed),
        "step_time_s": elapsed, "data_wait_s": loader.wait_seconds - wait_before,
    }
    if engine.fp16_enabled():
        record.update(fp16_record(engine, skipped_before, progress.step))
    return record, summary["stop"]


def checked_summary(engine: Any, sums: StepSums, stop: bool, loader: PretrainLoader, plan: BatchPlan,
                    metrics: Metrics, progress: Progress) -> dict[str, Any]:
    """The step's sums reduced over the ranks (`StepSums.reduce`) with the rate its update applies (``lr``), once
    they count a predicted token and their loss is finite; else the step stops here, before its update."""
    step = progress.step + 1
    summary = sums.reduce(stop)
    check_predicted_tokens(summary, step, loader.dataset.directory)
    summary["lr"] = engine.get_lr()[0]  # the rate this optimizer step applies
    if not math.isfinite(summary["loss"]):
        if not math.isfinite(summary["local_loss"]):
            log.warning(f"[rank {torch_dist.get_rank()}] non-finite local loss at step {step}")
        message = nonfinite_diagnostic(step, loader.consumed_samples - plan.global_batch_size, summary, summary["lr"],
                                       engine.optimizer.loss_scale if engine.fp16_enabled() else None,
                                       last_tag(progress))
        metrics.write({"step": step, "event": "nonfinite_loss", "message": message})
        raise NonFiniteLossError(message)
    return summary


def check_gradient_norm(engine: Any, measured_norm: float | None, summary: dict[str, Any], plan: BatchPlan,
                        metrics: Metrics, progress: Progress) -> None:
    """Stop the run, unsaved, after a step whose gradient norm was NaN/inf under fp32/bf16
    (`nonfinite_gradient_norm`)."""
    bad_norm = nonfinite_gradient_norm(engine, measured_norm)
    if bad_norm is None:
        return
    message = nonfinite_diagnostic(progress.step, progress.consumed_samples - plan.global_batch_size, summary,
                                   summary["lr"], None, last_tag(progress), grad_norm=bad_norm)
    metrics.write({"step": progress.step, "event": "nonfinite_gradient", "message": message})
    raise NonFiniteLossError(message)


def fp16_record(engine: Any, skipped_before: int, step: int) -> dict[str, Any]:
    """The fp16 loss scaler's part of a step's record; an overflow (the step skipped) is said on rank 0."""
    overflow = engine.skipped_steps > skipped_before
    if overflow and torch_dist.get_rank() == 0:
        log.warning(f"[step {step}] fp16 overflow: optimizer step skipped, loss scale now "
                    f"{engine.optimizer.loss_scale}")
    return {"loss_scale": engine.optimizer.loss_scale, "overflow": overflow, "skipped_steps": engine.skipped_steps}


def last_tag(progress: Progress) -> str | None:
    return progress.last_checkpoint.tag if progress.last_checkpoint else None


def _maybe_float(value: Any) -> float | None:
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def eval_passes(indices: np.ndarray, rank: int, world_size: int, micro: int) -> list[tuple[np.ndarray, bool]]:
    """Rank ``rank``'s forward passes over the held-out samples ``indices``: (sample indices, counted). The rank
    takes every ``world_size``-th sample, ``micro`` per pass; every rank runs as many passes (ZeRO-3 gathers the
    parameters in each, a collective), a rank whose samples ran out repeating its first pass uncounted. Over the
    ranks, each sample is counted exactly once."""
    mine = indices[rank::world_size]
    passes = math.ceil(math.ceil(len(indices) / world_size) / micro)
    return [(mine[k * micro:(k + 1) * micro], True) if k * micro < len(mine) else (indices[:1], False)
            for k in range(passes)]


class EvalSet:
    """The held-out loss on a fixed set of samples: the first ``train.eval_samples`` of the held-out shards'
    epoch-0 order (all of them when null), each evaluated once, spread over the ranks (`eval_passes`). Reported
    as the training objective over that whole set, the mean loss over its predicted tokens plus the mean NSP loss
    over its NSP samples (``eval_loss``), and per objective: the same numbers at any world size and micro-batch
    size, so a run resumed on another cluster continues its curve."""

    def __init__(self, cfg: RunConfig, plan: BatchPlan, rank: int, world_size: int, pad_id: int,
                 max_len: int) -> None:
        assert cfg.data.eval_shards is not None  # an evaluator exists only for a run with held-out shards
        self.dataset = ShardDataset(cfg.data.eval_shards)
        order = SampleOrder(sample_objectives(self.dataset), cfg.train.seed)
        count = len(order) if cfg.train.eval_samples is None else min(cfg.train.eval_samples, len(order))
        self.passes = eval_passes(order.indices(0, count), rank, world_size, plan.micro_batch_size)
        self.pad_id, self.max_len = pad_id, max_len

    @torch.no_grad()
    def evaluate(self, engine: Any) -> dict[str, float]:
        engine.eval()
        sums = StepSums(engine.device)
        for indices, counted in self.passes:
            batch = to_device(collate([self.dataset[int(i)] for i in indices], self.pad_id, self.max_len),
                              engine.device)
            output = engine(**batch)
            if counted:
                sums.add(batch, output)
        stats = sums.reduce(stop=False)
        if not stats["objectives"]:
            raise ValueError(f"data.eval_shards {self.dataset.directory}: the held-out samples have no predicted "
                             "token, so their loss would be a meaningless 0; check them with data_prep.inspect")
        return {"eval_loss": stats["set_loss"], **{f"eval_loss_{k}": v for k, v in stats["objectives"].items()}}
