"""The pre-training loop on a DeepSpeed engine: build → (resume) → steps → checkpoints → metrics.

``train(cfg)`` runs on every rank of any launcher (deepspeed, torchrun, mpirun, or plain ``python`` for one
process) and reads as its steps: open the shards, resolve the model, find the resume point, build the engine,
restore progress, build the loader, then `run_steps` (`train_step` each, a checkpoint every
``train.save_interval``). What it relies on DeepSpeed for: ZeRO 0-3, fp16 loss scaling / bf16, gradient
accumulation and clipping, the optimizer (its AdamW block) and the warm-up/decay schedule, checkpoint files,
the universal checkpoint converter, the CSV/TensorBoard monitor. What it shares with fine-tuning:
``pretrain.engine`` (process group, DeepSpeed JSON, parameter groups, RNG, the optimizer step) and
``pretrain.checkpoint`` (save, resume). What is its own: the data order (``pretrain.data``), batch planning
(``pretrain.batch_plan``), early exit, the NaN stop's diagnosis, ``metrics.jsonl`` and the progress bar.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import socket
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as torch_dist
from deepspeed.accelerator import get_accelerator
from tqdm import tqdm

from common.files import sha256_file
from data_prep.shard_format import MANIFEST_NAME, ShardDataset, ShardError
from pretrain import checkpoint as ckpt
from pretrain.batch_plan import BatchPlan, plan_batch
from pretrain.config import RunConfig
from pretrain.accelerator import (COMPILER_NEEDS, accelerator_name, collective_device, compiler_failure,
                                  default_device, matmul_peak_tflops)
from pretrain.data import PretrainLoader, SampleOrder, collate, sample_objectives, to_device
from pretrain.engine import (NonFiniteLossError, SetupError, build_engine, engine_config, first_error,
                             gather_objects, init_distributed, nonfinite_gradient_norm, on_every_rank,
                             optimizer_name, optimizer_step, precision, read_engine_json, seed_everything,
                             step_gradient_norm, zero_stage)
from pretrain.hf import hf_model_config, load_hf_bert
from pretrain.model import REPORTED_OBJECTIVES, ModelConfig, UniLMModel, build_model, training_flops
from common.files import write_atomically


# ------------------------------------------------------------------------------------------ building blocks
def resolve_model_config(cfg: RunConfig) -> ModelConfig:
    """The model config this run trains: an HF directory's, or a preset with ``model.overrides`` applied."""
    return cfg.model.model_config(hf_model_config(cfg.model.init_from) if cfg.model.init_from else None)


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
        report(f"[metrics] {path} belongs to an earlier run this one does not resume (it left no checkpoint, or "
               f"train.resume=never); kept as {kept.name}")
        return
    records = read_metrics(path, report)
    kept = [r for r in records if r.get("step", 0) <= resumed_step]
    text = "".join(json.dumps(r) + "\n" for r in kept)
    if len(kept) == len(records) and path.read_text(errors="replace") == text:
        return
    write_atomically(path, lambda tmp: tmp.write_text(text))


class StepBar:
    """Rank 0's progress over optimizer steps: a tqdm bar on a terminal; elsewhere (cluster logs, a redirected
    output) a plain line every ``every`` steps."""

    def __init__(self, total: int, initial: int, desc: str, every: int = 10) -> None:
        self.every = every
        self.bar = tqdm(total=total, initial=initial, desc=desc, unit="step", file=sys.stderr, mininterval=1.0,
                        dynamic_ncols=True, disable=None)

    def update(self, step: int, loss: float, lr: float, samples_per_s: float | None = None,
               tflops: float | None = None, mfu: float | None = None) -> None:
        """Show step ``step``; ``tflops`` (per GPU) and ``mfu`` as `Throughput.per_rank` measures them, when given."""
        self.bar.n = step
        postfix = {"loss": f"{loss:.4f}", **({"samples_s": f"{samples_per_s:.1f}"} if samples_per_s else {}),
                   **({"tflops": f"{tflops:.3g}", "mfu": f"{mfu:.1%}"} if tflops and mfu else {})}
        self.bar.set_postfix(postfix)  # refreshes the bar
        if self.bar.disable and step % self.every == 0:
            print(f"[step {step}/{self.bar.total}] loss {loss:.4f} lr {lr:.3g}"
                  + (f" {samples_per_s:.1f} samples/s" if samples_per_s else "")
                  + (f" {tflops:.3g} TFLOP/s per GPU, MFU {mfu:.1%}" if tflops and mfu else ""), flush=True)

    def close(self) -> None:
        self.bar.close()


class Metrics:
    """Rank 0's ``metrics.jsonl`` (one JSON object per optimizer step) and progress bar."""

    def __init__(self, path: Path, resumed_step: int | None, max_steps: int, enabled: bool) -> None:
        self.enabled = enabled
        self.path = path
        self.bar = None
        if not enabled:
            return
        prepare_metrics_file(path, resumed_step)
        self.bar = StepBar(max_steps, resumed_step or 0, "pretrain")

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as handle:
            handle.write(json.dumps(record) + "\n")
        if self.bar is not None and "loss" in record:
            self.bar.update(record["step"], record["loss"], record["lr"], record["samples_per_s"],
                            record.get("tflops"), record.get("mfu"))

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


@dataclasses.dataclass(frozen=True)
class Throughput:
    """A step's model TFLOP/s per rank and its model FLOPs utilisation (MFU)."""

    model_cfg: ModelConfig
    world_size: int
    peak_tflops: float
    """One rank's dense matmul peak in the training dtype (``train.peak_tflops``, or `measured_peak_tflops`)."""

    def per_rank(self, summary: dict[str, Any], samples: int, elapsed: float) -> dict[str, float]:
        """``tflops``: `pretrain.model.training_flops` of the step's global batch (``summary`` from
        `StepSums.reduce`, ``samples`` sequences) per second, divided by the world size; ``mfu``: that over the
        peak; ``peak_tflops``."""
        flops = training_flops(self.model_cfg, summary["tokens"], summary["squared_lengths"], summary["predictions"],
                               samples)
        tflops = flops / self.world_size / elapsed / 1e12
        return {"tflops": tflops, "mfu": tflops / self.peak_tflops, "peak_tflops": self.peak_tflops}


def measured_peak_tflops(engine: Any, rank: int) -> float:
    """`pretrain.accelerator.matmul_peak_tflops` on every rank's device in the engine's training dtype, measured by
    all ranks together (after a barrier, as they will train: ranks sharing a CPU share its cores) and agreed on as
    the median over the ranks, so every rank's MFU has one denominator and a rank slowed for a moment (the other
    ranks still starting up, another process) does not skew it."""
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[precision(engine)]
    distributed = torch_dist.is_initialized() and torch_dist.get_world_size() > 1
    if distributed:
        torch_dist.barrier()
    peaks = sorted(gather_objects(matmul_peak_tflops(engine.device, dtype))) if distributed \
        else [matmul_peak_tflops(engine.device, dtype)]
    peak = statistics.median(peaks)
    if rank == 0:
        spread = f", median of {len(peaks)} ranks measured together: {peaks[0]:.3g}–{peaks[-1]:.3g}" \
            if len(peaks) > 1 else ""
        print(f"[mfu] measured {precision(engine)} matmul peak of {engine.device}: {peak:.3g} TFLOP/s{spread} "
              "(set train.peak_tflops to use a fixed one)", flush=True)
    return peak


def write_monitor(engine: Any, record: dict[str, Any]) -> None:
    """Every number of a step's ``metrics.jsonl`` record (losses, throughput, MFU, ...) as a DeepSpeed monitor event
    ``Train/Steps/<key>`` at x = the optimizer step (CSV files, and TensorBoard when installed; rank 0 writes)."""
    numbers = {key: value for key, value in record.items()
               if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)}
    if engine.monitor.enabled:
        engine.monitor.write_events([(f"Train/Steps/{key}", value, record["step"]) for key, value in numbers.items()])


class StepSums:
    """A step's (or an evaluation's) loss, tokens and per-objective loss sums on this rank, reduced over ranks.

    Everything stays a float64 tensor on the device until `reduce`, whose all-reduce and one transfer to the host
    are the step's only wait for the device. Layout of ``values``: ``_FIELDS`` then a (sum, count) pair per
    `REPORTED_OBJECTIVES` slot."""

    _FIELDS = ("loss", "micro_batches", "tokens", "squared_lengths", "stop")

    def __init__(self, device: torch.device | str) -> None:
        self.values = torch.zeros(len(self._FIELDS) + 2 * len(REPORTED_OBJECTIVES), dtype=torch.float64,
                                  device=device)

    def _field(self, name: str) -> torch.Tensor:
        return self.values[self._FIELDS.index(name)]

    def add(self, batch: dict[str, torch.Tensor], output: Any) -> None:
        """Count one micro-batch's ``pretrain.model.PretrainOutput``."""
        length = batch["length"].to(self.values.device, torch.float64)
        self._field("loss").add_(output.loss.detach().to(torch.float64))
        self._field("micro_batches").add_(1)
        self._field("tokens").add_(length.sum())
        self._field("squared_lengths").add_(length.square().sum())
        objectives = self.values[len(self._FIELDS):].view(-1, 2)
        objectives[:, 0].add_(output.objective_sums.to(torch.float64))
        objectives[:, 1].add_(output.objective_counts.to(torch.float64))

    def reduce(self, stop: bool) -> dict[str, Any]:
        """Sum over ranks in one all-reduce: mean loss per micro-batch, ``set_loss`` (the objective over every
        micro-batch added on every rank: mean loss per predicted token plus mean NSP loss per NSP sample), tokens
        (and the sum of squared sample lengths), per-objective mean losses, whether any rank asked to stop, and this
        rank's own loss sum."""
        self._field("stop").fill_(float(stop))
        reduced = self.values.to(collective_device(), copy=True)
        torch_dist.all_reduce(reduced)
        *values, local_loss = torch.cat([reduced, self._field("loss").view(1).to(reduced.device)]).tolist()
        totals = dict(zip(self._FIELDS, values))
        sums, counts = values[len(self._FIELDS)::2], values[len(self._FIELDS) + 1::2]  # per REPORTED_OBJECTIVES slot
        objectives = {name: sums[i] / counts[i] for i, name in enumerate(REPORTED_OBJECTIVES) if counts[i] > 0}
        nsp = REPORTED_OBJECTIVES.index("nsp")
        predictions = sum(counts) - counts[nsp]
        set_loss = (sum(sums) - sums[nsp]) / max(predictions, 1) + sums[nsp] / max(counts[nsp], 1)
        return {"loss": totals["loss"] / totals["micro_batches"], "set_loss": set_loss,
                "tokens": int(totals["tokens"]), "squared_lengths": totals["squared_lengths"],
                "predictions": predictions, "stop": totals["stop"] > 0, "objectives": objectives,
                "local_loss": local_loss}


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
    new_paths = missing_paths(Path(cfg.out_dir) / ckpt.LOCK_FILE) if rank == 0 else []
    run_lock = ckpt.lock_run_directory(cfg.out_dir, rank)  # before anything under out_dir is read or written
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


def _train_locked(cfg: RunConfig, rank: int, world_size: int, started: float) -> dict[str, Any]:
    """``train`` once this process group holds the run lock of ``cfg.out_dir``: its steps, in order."""
    # Fail before building anything if the batch cannot be split, the DeepSpeed JSON (and the config built from it),
    # the shards, the initial model or the checkpoint to resume do not fit this run: one line naming what and the
    # fix (`SetupError`), not a traceback per rank.
    # What one rank finds wrong (a file missing on its node) stops every rank together, at the end of each step
    # below (`on_every_rank`, or the collective check itself), before any rank enters another collective.
    try:
        check_shared_out_dir(Path(cfg.out_dir), rank, world_size)
        plan, engine_json, dataset = on_every_rank(lambda: (
            plan_batch(cfg.train.global_batch_size, cfg.train.micro_batch_size, world_size),
            read_engine_json(cfg.deepspeed_config_path, accelerator=get_accelerator()),
            ShardDataset(cfg.data.shards)))
        verify_shards(cfg, dataset, rank, world_size)
        model_cfg = on_every_rank(lambda: model_for_shards(cfg, dataset, rank))
        identity = dict(shard_identity(dataset), model_config=dataclasses.asdict(model_cfg), seed=cfg.train.seed)
        # a mismatch message names these shards by path (a marker has its own in its run config, not in identity)
        resume = ckpt.find_resume_point(cfg.checkpoint_dir, cfg.train.resume,
                                        dict(identity, shards=str(dataset.directory)), world_size,
                                        zero_stage(engine_json), report=print if rank == 0 else None)
        fast_paths, deepspeed_config, model = on_every_rank(lambda: (
            fast_path_settings(cfg, engine_json, model_cfg),
            build_deepspeed_config(cfg, plan, engine_json, load_universal=resume is not None and resume.universal),
            initial_model(cfg, model_cfg)))
    except (ValueError, OSError) as error:  # raised on every rank alike (the collective checks)
        raise SetupError(str(error)) from error
    if fast_paths["compile"]:
        fast_paths["compile"] = compiler_works(cfg.train.compile, rank)
    if rank == 0:
        print("[fast paths] " + ", ".join(f"train.{name}={'on' if on else 'off'}" for name, on in fast_paths.items())
              + " (null settings resolved for this run's device, precision and model)", flush=True)
    if rank == 0:
        ckpt.report_changed_settings(resume, cfg.to_dict(), print)
    engine = build_training_engine(cfg, model, deepspeed_config, fast_paths, resume)
    throughput = Throughput(model_cfg, world_size, cfg.train.peak_tflops or measured_peak_tflops(engine, rank))
    progress = restore_progress(engine, resume, cfg.train.seed, rank, world_size)
    loader = build_loader(cfg, dataset, model_cfg, plan, rank, progress.consumed_samples, engine.device,
                          pack=fast_paths["pack_samples"])
    eval_set = EvalSet(cfg, plan, rank, world_size, loader.pad_id, loader.max_len) if cfg.train.eval_interval else None
    write_run_config(cfg, rank)
    metrics = Metrics(Path(cfg.out_dir) / "metrics.jsonl", progress.step if resume else None, cfg.train.max_steps,
                      enabled=rank == 0)
    meta = dict(identity, run_config=cfg.to_dict(), code_version=ckpt.code_version(), world_size=world_size,
                zero_stage=zero_stage(engine_json), precision=precision(engine),
                optimizer_class=optimizer_name(engine.basic_optimizer))
    stop_requested = StopRequest(started, cfg.train.exit_after_minutes)
    try:
        run_steps(cfg, engine, loader, eval_set, plan, metrics, progress, meta, stop_requested, throughput)
    finally:
        loader.close()
        metrics.close()
        stop_requested.close()
    return {"step": progress.step, "consumed_samples": progress.consumed_samples,
            "last_checkpoint": last_tag(progress), "data_wait_s": loader.wait_seconds,
            "wall_s": time.monotonic() - started}


def check_shared_out_dir(out_dir: Path, rank: int, world_size: int) -> None:
    """Every rank must see ``out_dir`` as rank 0 does (a collective): rank 0 writes a file of a fresh name there and
    each rank reads it back. A node-local out_dir (the same path on each node's own disk) would leave each node's
    checkpoint files where the others cannot read them: its saves look complete to rank 0 and cannot be resumed."""
    if world_size == 1:
        return
    written: Any = None
    if rank == 0:
        token = uuid.uuid4().hex
        try:
            (out_dir / f".shared-check-{token}").write_text(token)
            written = (token, socket.gethostname())
        except OSError as error:
            written = OSError(f"rank 0 cannot write under out_dir {out_dir}: {error}")
    written = gather_objects(written)[0]  # after rank 0's write
    if isinstance(written, Exception):
        raise written
    token, writer = written
    path = out_dir / f".shared-check-{token}"  # this rank's out_dir: the same path, on its node
    try:
        seen = path.read_text()
    except OSError:
        seen = None
    problem = None
    if seen != token:
        problem = (f"rank {rank} on {socket.gethostname()} does not see {path}, which rank 0 on {writer} wrote: "
                   f"out_dir {out_dir} must be one shared directory, at the same path, on every node (each rank "
                   "writes its part of every checkpoint there)")
    problem = first_error(problem)
    if rank == 0:
        path.unlink(missing_ok=True)
    if problem is not None:
        raise OSError(problem)


def verify_shards(cfg: RunConfig, dataset: ShardDataset, rank: int, world_size: int) -> None:
    """With ``data.verify`` the ranks check the shards' hashes, each every world-size-th shard (a collective: a bad
    shard found by any rank stops every rank, naming it)."""
    if cfg.data.verify:
        verify_started = time.monotonic()
        problem = None
        try:
            dataset.verify(rank, world_size)
        except ShardError as error:
            problem = str(error)
        problem = first_error(problem)
        if problem is not None:
            raise ShardError(problem)
        if rank == 0:
            print(f"[data] verified {len(dataset.manifest['shards'])} shard(s) against the manifest hashes in "
                  f"{time.monotonic() - verify_started:.1f}s ({world_size} rank(s) sharing them)", flush=True)


def model_for_shards(cfg: RunConfig, dataset: ShardDataset, rank: int = 0) -> ModelConfig:
    """The model config this run trains, once the shards fit it: a recipe the model can train, a vocabulary its
    embeddings hold, and (from ``model.init_from``) that model's vocabulary and casing. Preflight runs it too."""
    model_cfg = resolve_model_config(cfg)
    check_trainable(dataset, model_cfg, cfg.data.shards)
    if cfg.model.init_from and cfg.model.check_init_vocab:  # shards of another vocabulary: the fix is to rebuild them
        check_init_vocabulary(dataset, cfg.model.init_from, report=print if rank == 0 else lambda _: None)
    check_vocabulary_fits(dataset, model_cfg, cfg.model.init_from)
    check_lengths_fit(dataset, model_cfg, cfg.data.max_seq_len, "data.shards")
    if cfg.data.eval_shards:
        held_out = ShardDataset(cfg.data.eval_shards)
        check_trainable(held_out, model_cfg, cfg.data.eval_shards)
        check_lengths_fit(held_out, model_cfg, cfg.data.max_seq_len, "data.eval_shards")
        if held_out.manifest["vocab"]["sha256"] != dataset.manifest["vocab"]["sha256"]:
            raise ValueError(f"data.eval_shards {cfg.data.eval_shards} were built with another vocabulary than "
                             f"data.shards {cfg.data.shards}: their ids name other word pieces, so the held-out loss "
                             "would measure nothing; build both with the same --vocab")
    return model_cfg


def check_lengths_fit(dataset: ShardDataset, model_cfg: ModelConfig, max_seq_len: int | None, key: str) -> None:
    """The longest sample the shards hold must fit ``data.max_seq_len`` and the model's position table."""
    positions = model_cfg.max_position_embeddings
    if max_seq_len is not None and max_seq_len > positions:
        raise ValueError(f"data.max_seq_len={max_seq_len} exceeds the model's {positions} positions "
                         f"(max_position_embeddings); lower it, or raise model.overrides.max_position_embeddings")
    limit = max_seq_len or positions
    longest = int(dataset.manifest["max_seq_len"])
    if longest > limit:
        setting = f"data.max_seq_len={max_seq_len}" if max_seq_len else f"the model's {positions} positions"
        raise ValueError(f"{key} {dataset.directory} hold samples of up to {longest} tokens (built with --max-seq-len "
                         f"{longest}), more than {setting}; rebuild them with --max-seq-len {limit}, or raise "
                         f"{'data.max_seq_len' if max_seq_len else 'model.overrides.max_position_embeddings'}")


def check_vocabulary_fits(dataset: ShardDataset, model_cfg: ModelConfig, init_from: str | None = None) -> None:
    """The model's embeddings must hold a row for every id of the shards' vocabulary. A run from ``init_from``
    cannot grow its vocabulary (the weights fix its size): the fix is shards built with that model's."""
    size = dataset.manifest["vocab"].get("size")
    if size is None or int(size) <= model_cfg.vocab_size:
        return
    if init_from:
        raise ValueError(f"the shards' vocabulary ({dataset.directory}) has {size} tokens but model.vocab_size is "
                         f"{model_cfg.vocab_size}, and a run from model.init_from {init_from} keeps that model's "
                         f"vocabulary (its weights fix the size); rebuild the shards with "
                         f"`python -m data_prep.build --vocab {init_from}`")
    raise ValueError(f"the shards' vocabulary has {size} tokens but model.vocab_size is "
                     f"{model_cfg.vocab_size}; set model.overrides.vocab_size={size}")


def check_init_vocabulary(dataset: ShardDataset, init_from: str, report: Any = print) -> None:
    """The shards of a run that starts from ``model.init_from`` must be tokenized with that model's vocabulary
    and casing: its embedding row i belongs to the word piece on line i of its vocab.txt, so shards built with
    another vocabulary (or the same one with the other casing) would train its weights on scrambled ids. A shard
    vocabulary that extends the model's (its ids first, new pieces after) passes."""
    from data_prep.vocab import VocabError, load_vocab, resolve_casing, resolve_vocab_source

    fix = (f"rebuild the shards with `python -m data_prep.build --vocab {init_from}` (its casing comes with it), "
           "or set model.check_init_vocab=false to train its weights on these ids anyway")
    try:
        source = resolve_vocab_source(init_from)
        theirs = source.load()
        uncased = resolve_casing(source, None)
    except VocabError as error:
        report(f"[init] warning: cannot check that the shards use model.init_from's vocabulary ({error})")
        return
    ours = load_vocab(Path(dataset.directory) / dataset.manifest["vocab"].get("file", "vocab.txt"))
    differing = [i for i, token in enumerate(theirs.tokens) if i >= ours.size or ours.tokens[i] != token]
    if differing:
        first = differing[0]
        shard_token = ours.tokens[first] if first < ours.size else "(none)"
        raise ValueError(f"{dataset.directory} was built with another vocabulary than model.init_from {init_from}: "
                         f"{len(differing)} of model.init_from's {theirs.size} ids name other word pieces (id {first}: "
                         f"{shard_token!r} in the shards, {theirs.tokens[first]!r} in {theirs.path}); {fix}")
    shard_uncased = dataset.manifest["vocab"].get("uncased")
    if isinstance(shard_uncased, bool) and shard_uncased != uncased:
        raise ValueError(f"{dataset.directory} was tokenized {'uncased' if shard_uncased else 'cased'}, but "
                         f"model.init_from {init_from} is {'uncased' if uncased else 'cased'}; {fix}")


def initial_model(cfg: RunConfig, model_cfg: ModelConfig) -> UniLMModel:
    """The model the run starts from: freshly initialised, or with the weights of ``model.init_from``, read and
    checked against ``model_cfg`` (a file that holds no weights, a tensor of another shape, one missing or unknown:
    a ValueError naming the file and tensor)."""
    seed_everything(cfg.train.seed)  # identical initial weights on every rank
    if not cfg.model.init_from:
        return build_model(model_cfg)
    try:
        return load_hf_bert(cfg.model.init_from, model_cfg)
    except (ValueError, OSError) as error:
        raise ValueError(f"model.init_from: {error}") from error


def build_training_engine(cfg: RunConfig, model: UniLMModel, deepspeed_config: dict[str, Any],
                          fast_paths: dict[str, bool], resume: ckpt.ResumePoint | None = None) -> Any:
    """The DeepSpeed engine around the run's initial model (`initial_model`) with `build_deepspeed_config`'s
    config, and the optimizer ``resume`` was stepped by."""
    model.activation_checkpointing = cfg.train.activation_checkpointing
    model.chunked_loss = fast_paths["chunked_loss"]
    if fast_paths["compile"]:
        model.compile_blocks()
    return build_engine(model, deepspeed_config, cfg.optim.weight_decay, resumed=resume)


def fast_path_settings(cfg: RunConfig, engine_json: dict[str, Any], model_cfg: ModelConfig) -> dict[str, bool]:
    """``train.compile``, ``train.chunked_loss`` and ``train.pack_samples`` with their null defaults resolved for this
    run: compile on CUDA under ZeRO 0-2, chunked loss under bf16/fp16, packing unless the model is a causal LM.
    Refuses compiling under ZeRO-3 (its parameter hooks run inside the blocks) and packing a causal LM."""
    stage = zero_stage(engine_json)
    half = any(engine_json.get(key, {}).get("enabled", False) for key in ("fp16", "bf16", "bfloat16"))
    compile_blocks = cfg.train.compile
    if compile_blocks is None:
        compile_blocks = accelerator_name() == "cuda" and stage < 3
    elif compile_blocks and stage == 3:
        raise ValueError("train.compile=true does not work with ZeRO-3 (DeepSpeed gathers each block's parameters "
                         "inside its forward); use ZeRO 0-2 or train.compile=false")
    chunked_loss = half if cfg.train.chunked_loss is None else cfg.train.chunked_loss
    pack_samples = not model_cfg.causal_lm if cfg.train.pack_samples is None else cfg.train.pack_samples
    if pack_samples and model_cfg.causal_lm:
        raise ValueError("train.pack_samples=true does not apply to a causal LM (model.causal_lm: its samples are "
                         "full-length blocks, each predicted whole); use train.pack_samples=false or null")
    return {"compile": compile_blocks, "chunked_loss": chunked_loss, "pack_samples": pack_samples}


def compiler_works(setting: bool | None, rank: int) -> bool:
    """Whether to compile the blocks, ``train.compile`` having resolved to on: `compiler_failure` on every rank's
    device (a collective: every rank decides alike). A failure stops the run, naming the fix, when the run config
    asked for compilation (``true``), and turns it off with a note when that was the default (``null``)."""
    failure = compiler_failure(default_device())
    if failure is not None and rank != 0:
        failure += f" (rank {rank} on {socket.gethostname()})"
    failure = first_error(failure)
    if failure is None:
        return True
    if setting:
        raise SetupError(f"train.compile=true, but torch.compile fails here: {failure}. {COMPILER_NEEDS}; or set "
                         "train.compile=false")
    if rank == 0:
        print(f"[fast paths] torch.compile fails here ({failure}), so the blocks run uncompiled (slower). "
              f"{COMPILER_NEEDS}; train.compile=false silences this", file=sys.stderr, flush=True)
    return False


def restore_progress(engine: Any, resume: ckpt.ResumePoint | None, seed: int, rank: int,
                     world_size: int) -> Progress:
    """Load the resume point into ``engine`` and continue its RNG streams, or seed per-rank dropout streams."""
    state = ckpt.load_or_seed(engine, resume, seed, rank, world_size)
    if state is None:
        return Progress()
    if rank == 0:
        print(f"[resume] {resume.tag}: step {state['step']}, consumed_samples {state['consumed_samples']}",
              flush=True)
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


class StopRequest:
    """Whether this process should save and exit: SIGTERM received (a scheduler's preemption), a first Ctrl-C
    (SIGINT; a second one stops at once, without saving), or ``train.exit_after_minutes`` passed."""

    def __init__(self, started: float, exit_after_minutes: float | None) -> None:
        self.started, self.exit_after_minutes = started, exit_after_minutes
        self.signalled = False
        self.previous_handler = signal.signal(signal.SIGTERM, self._on_sigterm)
        self.previous_sigint = signal.signal(signal.SIGINT, self._on_sigint)

    def _on_sigterm(self, *_: Any) -> None:
        self.signalled = True

    def _on_sigint(self, *_: Any) -> None:
        if self.signalled:
            raise KeyboardInterrupt
        self.signalled = True
        if os.environ.get("RANK", "0") == "0":
            print("\n[stop] Ctrl-C: saving the step in progress, then exiting (Ctrl-C again stops at once, without "
                  "saving)", file=sys.stderr, flush=True)

    def __bool__(self) -> bool:
        out_of_time = (self.exit_after_minutes is not None
                       and time.monotonic() - self.started > 60 * self.exit_after_minutes)
        return out_of_time or self.signalled

    def close(self) -> None:
        signal.signal(signal.SIGTERM, self.previous_handler)
        signal.signal(signal.SIGINT, self.previous_sigint)


def run_steps(cfg: RunConfig, engine: Any, loader: PretrainLoader, eval_set: EvalSet | None, plan: BatchPlan,
              metrics: Metrics, progress: Progress, meta: dict[str, Any], stop_requested: StopRequest,
              throughput: Throughput) -> None:
    """Optimizer steps until ``train.max_steps`` / ``train.exit_at_step`` / a stop request; saves on the way."""
    rank = torch_dist.get_rank()
    engine.train()
    last_step = min(cfg.train.max_steps, cfg.train.exit_at_step or cfg.train.max_steps)
    if cfg.train.exit_at_step is not None and progress.step >= cfg.train.exit_at_step and rank == 0:
        print(f"[exit] exit_at_step: already at step {progress.step}", flush=True)
    elif progress.step >= cfg.train.max_steps and rank == 0:
        print(f"[done] this run already reached train.max_steps={cfg.train.max_steps}: nothing to train (raise "
              "train.max_steps to train further)", flush=True)
    while progress.step < last_step:
        record, stop = train_step(engine, loader, plan, metrics, progress, stop_requested, throughput)
        if eval_set is not None and progress.step % cfg.train.eval_interval == 0:
            record.update(eval_set.evaluate(engine))
            engine.train()
        metrics.write(record)
        write_monitor(engine, record)
        exiting = stop or progress.step == cfg.train.exit_at_step
        if progress.step % cfg.train.save_interval == 0 or progress.step == cfg.train.max_steps or exiting:
            progress.last_checkpoint = ckpt.save(
                engine, cfg.checkpoint_dir, progress.step, dict(meta, consumed_samples=progress.consumed_samples),
                {}, cfg.train.keep_last, progress.last_checkpoint)
        if exiting:
            if rank == 0:
                at_exit_step = progress.step == cfg.train.exit_at_step
                how = ("rerun without train.exit_at_step (or with a later one) to continue" if at_exit_step
                       else "rerun the same command to continue")
                reason = "exit_at_step" if at_exit_step else "time limit / SIGTERM / Ctrl-C"
                print(f"[exit] {reason}: saved {progress.last_checkpoint.tag} at step {progress.step}; {how}", flush=True)
            break


def train_step(engine: Any, loader: PretrainLoader, plan: BatchPlan, metrics: Metrics, progress: Progress,
               stop_requested: StopRequest, throughput: Throughput) -> tuple[dict[str, Any], bool]:
    """One optimizer step over this rank's micro-batches; advances ``progress``. Returns the step's
    ``metrics.jsonl`` record and whether any rank asked to stop. A non-finite loss (before the update) or
    gradient (fp32/bf16, after it) raises `NonFiniteLossError` with a diagnosis, recorded in the metrics too."""
    rank = torch_dist.get_rank()
    fp16 = engine.fp16_enabled()
    step_started = time.perf_counter()
    wait_before = loader.wait_seconds
    micro_batches = loader.next_step()
    skipped_before = engine.skipped_steps
    sums = StepSums(engine.device)
    summary: dict[str, Any] = {}

    def before_update() -> None:
        summary.update(sums.reduce(bool(stop_requested)))
        check_predicted_tokens(summary, progress.step + 1, loader.dataset.directory)
        summary["lr"] = engine.get_lr()[0]  # the rate this optimizer step applies
        if not math.isfinite(summary["loss"]):
            if not math.isfinite(summary["local_loss"]):
                print(f"[rank {rank}] non-finite local loss at step {progress.step + 1}", file=sys.stderr)
            message = nonfinite_diagnostic(progress.step + 1, loader.consumed_samples - plan.global_batch_size,
                                           summary, summary["lr"], engine.optimizer.loss_scale if fp16 else None,
                                           last_tag(progress))
            metrics.write({"step": progress.step + 1, "event": "nonfinite_loss", "message": message})
            raise NonFiniteLossError(message)

    measured_norm = optimizer_step(engine, micro_batches, loss_of=lambda output: output.loss, observe=sums.add,
                                   before_update=before_update)
    progress.step += 1
    progress.consumed_samples = loader.consumed_samples
    elapsed = time.perf_counter() - step_started
    bad_norm = nonfinite_gradient_norm(engine, measured_norm)
    if bad_norm is not None:
        message = nonfinite_diagnostic(progress.step, progress.consumed_samples - plan.global_batch_size, summary,
                                       summary["lr"], None, last_tag(progress), grad_norm=bad_norm)
        metrics.write({"step": progress.step, "event": "nonfinite_gradient", "message": message})
        raise NonFiniteLossError(message)
    record = {
        "step": progress.step, "consumed_samples": progress.consumed_samples, "loss": summary["loss"],
        "lr": summary["lr"], "grad_norm": _maybe_float(step_gradient_norm(engine, measured_norm)),
        **{f"loss_{name}": value for name, value in summary["objectives"].items()},
        "samples_per_s": plan.global_batch_size / elapsed, "tokens_per_s": summary["tokens"] / elapsed,
        **throughput.per_rank(summary, plan.global_batch_size, elapsed),
        "step_time_s": elapsed, "data_wait_s": loader.wait_seconds - wait_before,
    }
    if fp16:
        overflow = engine.skipped_steps > skipped_before
        record.update(loss_scale=engine.optimizer.loss_scale, overflow=overflow, skipped_steps=engine.skipped_steps)
        if overflow and rank == 0:
            print(f"[step {progress.step}] fp16 overflow: optimizer step skipped, loss scale now "
                  f"{engine.optimizer.loss_scale}", file=sys.stderr)
    return record, summary["stop"]


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
