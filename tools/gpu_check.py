"""`make gpu-check`: the GPU path checked within one short device lease, at most 6 minutes of wall clock on one
H100 or H200, DeepSpeed's FusedAdam build included.

    python -m tools.gpu_check [--out bench_out/gpu_check] [--work bench_out/gpu_check_work]
                              [--samples data/samples] [--budget 350]

Results go to ``OUT/results.json``, rewritten whole (atomically) after each part, so a call stopped by a time limit
keeps the parts that finished; every command's output goes to ``OUT/logs/NAME.log`` as it runs. What the parts
build and run (shards, training runs, 4-6 GB checkpoints, deleted once used) goes to ``--work``.

Parts, most important first, and the wall time each should take on one H200. Sized from docs/gpus.md: a training
step of batch 330 x 512 runs at 250-287 samples/s there (1.2-1.3 s), a checkpoint holds 4.4 GB, FusedAdam builds
in about a minute, the model step of 32 x 512 takes 0.093 s in bf16. Assumed, as docs/gpus.md does not say: ~20 s to
start a unilm-large training process (imports, model, DeepSpeed's engine; blocks not compiled), ~6 s to write or
read a checkpoint, ~40 s to compile a Transformer block.

  setup            60 s  FusedAdam built in the background (~60 s of nvcc) while the CPUs build the 8,000-word
                         vocabulary and 512-token shards of the sample corpus (~25 s) and the fine-tuning task files;
                         the fast paths' accuracy tests start in the background (small models: little GPU work)
  fp16_resume      75 s  unilm-large.yaml, fp16 ZeRO-2, batch 330 = 33 x 10, 512 tokens, eager blocks (a resumed
                         process would run other compiled kernels than the uninterrupted one), lr 1e-4 from step 2:
                         steps 1-5, a checkpoint at 3, SIGKILL once step 5 is logged; relaunched, it resumes from step
                         3, and its losses of steps 4-5 are compared with the killed process's (`kill_and_resume`:
                         2 processes of ~20 s, 7 steps of ~1.3 s, 2 saves and a load of ~6 s)
  accuracy_tests   15 s  waits for the background ``pytest -m gpu`` of tests/pretrain/test_kernels.py and
                         test_model.py: bf16/fp16 accuracy of the chunked loss and of the compiled blocks (~60 s, two
                         compilations of a small model, mostly hidden under setup and fp16_resume)
  bf16_resume      75 s  the same in bf16, with the checkpoint at 4 and the kill after step 7; samples/s, real
                         tokens/s, TFLOP/s and MFU per GPU are the medians of the killed process's steps 2-7
  model_step       70 s  ``tools.bench_model --gpu``: unilm-large 32 x 512, 77 masked positions, dropout on, bf16:
                         eager, transformers.BertForPreTraining (sdpa), then the fast paths (compiled blocks + chunked
                         loss; one compilation, reused by the 24 blocks), 5 timed steps after 3 warm-up steps each
  finetune_decode  55 s  seq2seq fine-tuning (BBC article -> headline, 8 steps of 16, bf16 ZeRO-2) of bf16_resume's
                         checkpoint, then ``finetune.decode`` with beam 5 in bf16 on 16 dev articles
                  -----
                  350 s  (the default budget; with the start of Python and make, under 6 minutes)

A part starts only while at least half its estimate is left of the budget, and is stopped (its processes killed) at
2.5 x its estimate or at the end of the budget, whichever comes first. A part that fails or is stopped keeps the
exit codes and values it recorded, ``parts.NAME`` gets its status, error and ``wall_s``, and the later parts still
run (those that need its output fail at once, saying so). Keys of results.json besides ``parts``:
  fp16_resume      train_fp16_zero2_batch330_rc (the first process's exit code: -9 when it was killed as planned),
                   train_fp16_zero2_batch330_killed_after_step, resume_rc, resume_from_step, resume_max_loss_diff,
                   resume_losses, resume_ok
  bf16_resume      the same with train_bf16_... and bf16_resume_...; train_samples_per_s_seq512,
                   train_tokens_per_s_seq512, train_tflops_seq512, train_mfu_seq512, train_peak_tflops,
                   train_step_time_s_seq512, train_measured_steps
  model_step       model_step_rc, model_step_pct_of_bf16_peak and model_step_samples_per_s (per variant),
                   model_step_vs_hf (eager and fast, samples/s over transformers'), model_step_bf16_peak_tflops
  accuracy_tests   accuracy_tests_rc, accuracy_tests (tests, failures, errors, skipped, passed)
  finetune_decode  finetune_rc, finetune_steps, finetune_dev (the dev scores), decode_rc, decode_records, decode_s
  setup            shards_seq512, task_files, fused_adam_rc, fused_adam_s
Exit code 0 when every part passed, 1 otherwise, 2 without a CUDA GPU (then nothing is written).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.files import write_text_atomically
from common.paths import REPO_ROOT
from pretrain import checkpoint as ckpt
from pretrain.metrics import read_metrics

LIMIT_FACTOR = 2.5
"""A part is stopped once it has run this many times its estimate (or at the end of the budget)."""
POLL_S = 0.1
"""How often `kill_and_resume` looks at the run's metrics; a step takes ~1.2 s on the GPUs this check is sized for."""
RESUME_TOLERANCE = 1e-4
"""Largest difference of a resumed step's loss from the uninterrupted one's that passes. A bound set by reasoning,
not measured: two steps of run-to-run noise of CUDA kernels (atomics in backward) should stay orders of magnitude
below it, while other dropout masks move the mean loss over 330 x 512 tokens by ~1e-3 and other samples or lost
optimizer state by more. The losses are recorded beside it; the `-m gpu` suite measures the noise itself, with
two uninterrupted runs."""
ACCURACY_TESTS = ("tests/pretrain/test_kernels.py", "tests/pretrain/test_model.py")
"""Where the fast paths' ``-m gpu`` accuracy tests are (the same ones ``tools/gpu_speed.sh tests`` runs)."""
FINETUNE_SAMPLES = ("bbc", "rotten.csv.bz2", "squad.json")
"""What ``finetune.task_files`` reads from the sample folder."""
MODEL_VARIANTS = ("eager", "transformers", "fast")
"""The model step's variants (`tools.bench_model.GPU_VARIANTS`), the one that compiles last."""


class PartTimeout(Exception):
    """A part ran out of time; its processes were killed."""


class CheckFailed(Exception):
    """A part ran, but what it checks does not hold (or what it needs is missing)."""


@dataclass
class Job:
    """A command started by a part, its output appended to ``log``."""
    name: str
    process: subprocess.Popen
    log: Path
    started: float


class Check:
    """What the parts share: folders, the results being filled in, the current part's deadline, its commands."""

    def __init__(self, out: Path, work: Path, samples: Path, results: dict[str, Any]) -> None:
        self.out, self.work, self.samples, self.results = Path(out), Path(work), Path(samples), results
        self.deadline = float("inf")
        self.jobs: dict[str, Job] = {}
        self.last: Job | None = None
        """The job started or waited for last: a failed part shows the end of its log."""

    def write(self) -> None:
        """results.json, whole or not at all: a process killed mid-write leaves the previous version."""
        write_text_atomically(self.out / "results.json", json.dumps(self.results, indent=1, default=str) + "\n")

    def start(self, name: str, argv: Sequence[str]) -> Job:
        """Start ``argv`` in the repository, its output (standard error merged in) appended to ``OUT/logs/NAME.log``,
        in a session of its own: `kill` then ends it with the processes it started in it (compile workers, data
        build workers)."""
        log = self.out / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        say(f"  $ {' '.join(Path(a).name if i == 0 else a for i, a in enumerate(argv))}  (log: {log})")
        with open(log, "a") as sink:  # the child keeps its own descriptor
            process = subprocess.Popen(list(argv), cwd=REPO_ROOT, stdout=sink, stderr=subprocess.STDOUT,
                                       start_new_session=True)
        self.jobs[name] = self.last = Job(name, process, log, time.monotonic())
        return self.last

    def wait(self, job: Job) -> int:
        """``job``'s exit code; killed, with `PartTimeout`, when the part's deadline comes first."""
        self.last = job
        try:
            return job.process.wait(timeout=max(0.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.kill(job)
            raise PartTimeout(f"{job.name} still running at the part's time limit "
                              f"({time.monotonic() - job.started:.0f} s): killed (log: {job.log})") from None

    def run(self, name: str, argv: Sequence[str]) -> int:
        """Run ``argv`` to its end (`start`, `wait`); its exit code."""
        return self.wait(self.start(name, argv))

    def kill(self, job: Job) -> None:
        if job.process.poll() is None:
            try:
                os.killpg(job.process.pid, signal.SIGKILL)
            except ProcessLookupError:  # it ended in between
                pass
            job.process.wait()

    def kill_all(self) -> None:
        for job in self.jobs.values():
            self.kill(job)

    def need(self, key: str, why: str) -> Any:
        """``results[key]``, recorded by an earlier part; `CheckFailed` naming ``why`` it is missing."""
        if self.results.get(key) is None:
            raise CheckFailed(f"needs {key}, which {why}")
        return self.results[key]


@dataclass(frozen=True)
class Part:
    name: str
    estimate_s: float
    """Wall time it should take on one H200 (the module docstring says how it was sized)."""
    run: Callable[[Check], None]


def say(text: str) -> None:
    print(f"[gpu-check] {text}", flush=True)


def log_tail(job: Job, lines: int = 25) -> str:
    if not job.log.is_file():
        return ""
    return "\n".join(job.log.read_text(errors="replace").splitlines()[-lines:])


def run_parts(parts: Sequence[Part], check: Check, budget_s: float) -> bool:
    """Run ``parts`` in order within ``budget_s`` seconds (the rules are in the module docstring), writing
    results.json at the start and after each part; True when every part passed. Processes still running at the end
    (a background job no part waited for) are killed."""
    end = time.monotonic() + budget_s
    statuses = check.results.setdefault("parts", {})
    check.write()
    try:
        for part in parts:
            left = end - time.monotonic()
            entry: dict[str, Any] = {"estimate_s": part.estimate_s}
            statuses[part.name] = entry
            if left < part.estimate_s / 2:
                entry.update(status="skipped", wall_s=0.0,
                             error=f"{max(0.0, left):.0f} s of the {budget_s:.0f} s budget left, under half the "
                                   "part's estimate")
                say(f"{part.name}: skipped ({entry['error']})")
                check.write()
                continue
            check.deadline = time.monotonic() + min(LIMIT_FACTOR * part.estimate_s, left)
            before, check.last = set(check.results), None
            say(f"{part.name} (estimate {part.estimate_s:.0f} s) ...")
            began = time.monotonic()
            try:
                part.run(check)
                entry["status"] = "ok"
            except PartTimeout as error:
                entry.update(status="timed out", error=str(error))
            except Exception as error:  # a part's failure must not lose the others' results
                if not isinstance(error, CheckFailed):
                    traceback.print_exc()
                entry.update(status="failed", error=f"{type(error).__name__}: {error}")
            entry["wall_s"] = round(time.monotonic() - began, 1)
            check.write()
            added = {key: check.results[key] for key in check.results if key not in before}
            say(f"{part.name}: {entry['status']} in {entry['wall_s']:.0f} s {json.dumps(added, default=str)}")
            if entry["status"] != "ok":
                say(f"{part.name}: {entry['error']}")
                if check.last is not None and (tail := log_tail(check.last)):
                    say(f"end of {check.last.log}:\n{tail}")
    finally:
        check.kill_all()
    return all(entry["status"] == "ok" for entry in statuses.values())


# ------------------------------------------------------------------------------------------------ the parts
def kill_and_resume(check: Check, name: str, command: Sequence[str], run_dir: Path, save_step: int,
                    kill_after_step: int, record: Callable[[str, Any], None]
                    ) -> tuple[list[dict[str, Any]], str | None]:
    """A training ``command`` (writing ``run_dir``, saving every ``save_step`` steps) is killed (SIGKILL, a crash:
    nothing flushed) once it has logged step ``kill_after_step`` after its complete checkpoint of ``save_step``;
    rerun with ``train.exit_at_step=kill_after_step``, it resumes by itself from that checkpoint, and its losses of
    steps ``save_step + 1 .. kill_after_step`` must equal the killed process's, which ran them uninterrupted.

    ``record(key, value)`` receives, as each becomes known: first_rc, killed_after_step, resume_from_step (the
    newest complete checkpoint, which the rerun resumes from), resume_rc, losses (``steps``, ``uninterrupted``,
    ``resumed``), max_loss_diff and ok. Returns the killed process's ``metrics.jsonl`` records and what went wrong
    (None when the resume is exact within `RESUME_TOLERANCE`). The kill reaches ``command``'s process group: the
    trainer must be in it (torchrun starts its workers in sessions of their own; one rank needs no launcher)."""
    if not save_step < kill_after_step < 2 * save_step:  # the kill must come before the next save
        raise ValueError(f"needs save_step < kill_after_step < 2 x save_step, got {save_step}, {kill_after_step}")
    shutil.rmtree(run_dir, ignore_errors=True)
    metrics_file, checkpoints = run_dir / "metrics.jsonl", run_dir / "checkpoints"

    def records() -> list[dict[str, Any]]:
        return read_metrics(metrics_file, report=lambda _: None) if metrics_file.is_file() else []

    def saved() -> bool:
        return ckpt.read_marker(checkpoints / ckpt.tag_for_step(save_step), hashes=False) is not None

    first = check.start(f"{name}_first", command)
    logged, killed = 0, False
    while first.process.poll() is None:
        logged = max((r.get("step", 0) for r in records()), default=0)
        if logged >= kill_after_step and saved():
            check.kill(first)
            killed = True
            record("killed_after_step", logged)
            break
        if time.monotonic() > check.deadline:
            check.kill(first)
            raise PartTimeout(f"{first.name} had logged {logged} of {kill_after_step} steps at the part's time limit: "
                              f"killed (log: {first.log})")
        time.sleep(POLL_S)
    record("first_rc", first.process.returncode)
    reference = records()  # before the rerun drops the steps past its checkpoint from the file
    tag = ckpt.newest_complete_tag(checkpoints, hashes=False) if checkpoints.is_dir() else None
    record("resume_from_step", ckpt.step_of_tag(tag) if tag else None)
    if not killed:
        record("ok", False)
        return reference, f"the first process ended by itself (exit {first.process.returncode}) at step {logged}"
    resume_rc = check.run(f"{name}_resume", [*command, f"train.exit_at_step={kill_after_step}"])
    record("resume_rc", resume_rc)
    steps = list(range(save_step + 1, kill_after_step + 1))
    uninterrupted = {r["step"]: r["loss"] for r in reference if "loss" in r}
    resumed = {r["step"]: r["loss"] for r in records() if "loss" in r}
    record("losses", {"steps": steps, "uninterrupted": [uninterrupted.get(s) for s in steps],
                      "resumed": [resumed.get(s) for s in steps]})
    both = [(uninterrupted[s], resumed[s]) for s in steps if s in uninterrupted and s in resumed]
    gap = max(abs(a - b) for a, b in both) if len(both) == len(steps) else None
    record("max_loss_diff", gap)
    problem = None
    if resume_rc:
        problem = f"the rerun exited {resume_rc}"
    elif tag != ckpt.tag_for_step(save_step):
        problem = f"the rerun resumed from {tag}, not from step {save_step}"
    elif gap is None:
        problem = f"steps {steps} were not all logged by both processes"
    elif gap > RESUME_TOLERANCE:
        problem = f"the resumed losses differ from the uninterrupted ones by {gap:.3g} (> {RESUME_TOLERANCE:g})"
    record("ok", problem is None)
    return reference, problem


def resume_command(shards: str, run_dir: Path, precision: str, save_step: int) -> list[str]:
    """unilm-large in ``precision`` on this GPU (`tools.bench_train.large_run_command`) with eager blocks, a
    checkpoint every ``save_step`` steps, only the newest kept."""
    from tools.bench_train import large_run_command

    # a learning rate BERT's pre-training uses, reached at step 2: the compared steps move the weights enough that a
    # resume that lost them or Adam's moments shows in the losses (100 warm-up steps from 3e-5 would hardly move them)
    return large_run_command(shards, run_dir, precision,
                             ("train.compile=false", f"train.save_interval={save_step}", "train.keep_last=1",
                              "optim.lr=1e-4", "optim.warmup_steps=2"))


def resume_dir(check: Check, precision: str) -> Path:
    return check.work / f"{precision}_resume"


def large_run(check: Check, precision: str, save_step: int, kill_after_step: int,
              names: dict[str, str]) -> tuple[list[dict[str, Any]], str | None]:
    """`kill_and_resume` of `resume_command` in `resume_dir`, its values recorded under ``names[key]``."""
    shards = check.need("shards_seq512", "the setup part builds")
    run_dir = resume_dir(check, precision)

    def record(key: str, value: Any) -> None:
        check.results[names[key]] = value

    return kill_and_resume(check, f"{precision}_resume", resume_command(shards, run_dir, precision, save_step),
                           run_dir, save_step, kill_after_step, record)


def resume_names(precision: str, prefix: str) -> dict[str, str]:
    """results.json's names of `kill_and_resume`'s values (the module docstring lists them)."""
    train = f"train_{precision}_zero2_batch330"
    return {"first_rc": f"{train}_rc", "killed_after_step": f"{train}_killed_after_step",
            "resume_from_step": f"{prefix}resume_from_step", "resume_rc": f"{prefix}resume_rc",
            "losses": f"{prefix}resume_losses", "max_loss_diff": f"{prefix}resume_max_loss_diff",
            "ok": f"{prefix}resume_ok"}


def setup(check: Check) -> None:
    """Background: FusedAdam's build, the accuracy tests. Here: the shards, the fine-tuning task files."""
    from finetune.task_files import read_jsonl, write_jsonl
    from tools.bench_all import SAMPLE_INPUTS, sample_shards

    check.start("fused_adam", [sys.executable, "-m", "tools.ops", "fused_adam"])
    check.start("accuracy_tests", [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                                   f"--junitxml={check.out / 'accuracy_tests.xml'}", *ACCURACY_TESTS])
    problems = []

    def missing(names: Sequence[str]) -> str | None:
        absent = [name for name in names if not (check.samples / name).exists()]
        return f"sample corpora missing in {check.samples}: {', '.join(absent)}" if absent else None

    if problem := missing(SAMPLE_INPUTS):
        problems.append(problem)
    else:
        shards, builds = sample_shards(check.work / "data", 512, check.samples)
        for index, command in enumerate(builds):
            if check.run(f"shards_{index}", command):
                problems.append(f"the shard build failed (log: {check.jobs[f'shards_{index}'].log})")
                break
        else:
            check.results["shards_seq512"] = shards
    data = check.work / "finetune_data"
    if problem := missing(FINETUNE_SAMPLES):
        problems.append(problem)
    elif check.run("task_files", [sys.executable, "-m", "finetune.task_files", "--samples", str(check.samples),
                                  "--out", str(data)]):
        problems.append(f"finetune.task_files failed (log: {check.jobs['task_files'].log})")
    else:
        for split, count in (("train", 128), ("dev", 16)):  # spread over the topics the file is grouped by
            records = read_jsonl(data / f"bbc_headline.{split}.jsonl")
            write_jsonl(records[:: max(1, len(records) // count)][:count], data / f"headline.{split}.jsonl")
        check.results["task_files"] = str(data)
    if any(problem.startswith("sample corpora missing") for problem in problems):
        problems.append("`make sample-corpus` fetches them; a machine without network needs them brought along "
                        "(SAMPLES=DIR)")
    job = check.jobs["fused_adam"]
    try:  # left running at the part's limit: killed, a build leaves its lock file, on which the next build would hang
        check.results["fused_adam_rc"] = job.process.wait(timeout=max(0.0, check.deadline - time.monotonic()))
        check.results["fused_adam_s"] = round(time.monotonic() - job.started, 1)
    except subprocess.TimeoutExpired:
        problems.append(f"DeepSpeed's FusedAdam was still building at the part's time limit (log: {job.log}); the "
                        "training runs wait for it")
    if check.results.get("fused_adam_rc"):
        problems.append(f"DeepSpeed's FusedAdam cannot be built or loaded (log: {job.log}); the training runs step "
                        "with torch's AdamW instead")
    if problems:
        raise CheckFailed("; ".join(problems))


def fp16_resume(check: Check) -> None:
    try:
        _, problem = large_run(check, "fp16", 3, 5, resume_names("fp16", ""))
    finally:  # 4-6 GB each; the bf16 run's are kept for fine-tuning
        shutil.rmtree(resume_dir(check, "fp16") / "checkpoints", ignore_errors=True)
    if problem:
        raise CheckFailed(problem)


def accuracy_tests(check: Check) -> None:
    job = check.jobs.get("accuracy_tests")
    if job is None:
        raise CheckFailed("the setup part did not start them")
    check.results["accuracy_tests_rc"] = check.wait(job)
    report = check.out / "accuracy_tests.xml"
    if report.is_file():
        root = ElementTree.parse(report).getroot()  # pytest writes <testsuites><testsuite tests= ...>
        suite = root.find("testsuite") if root.tag == "testsuites" else root
        suite = root if suite is None else suite
        counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
        counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
        check.results["accuracy_tests"] = counts
    if check.results["accuracy_tests_rc"]:
        raise CheckFailed(f"pytest exited {check.results['accuracy_tests_rc']} (log: {job.log})")
    if not check.results.get("accuracy_tests", {}).get("passed"):  # all skipped: pytest's process saw no GPU
        raise CheckFailed(f"no accuracy test passed (log: {job.log})")


def bf16_resume(check: Check) -> None:
    from tools.bench_train import step_medians

    reference, problem = large_run(check, "bf16", 4, 7, resume_names("bf16", "bf16_"))
    steps = [r for r in reference if r.get("step", 0) >= 2]  # step 1 warms up
    if steps:
        measured = step_medians(steps)
        check.results.update({"train_samples_per_s_seq512": measured["samples_per_s"],
                              "train_tokens_per_s_seq512": measured["tokens_per_s"],
                              "train_tflops_seq512": measured["tflops"], "train_mfu_seq512": measured["mfu"],
                              "train_peak_tflops": measured["peak_tflops"],
                              "train_step_time_s_seq512": measured["step_time_s"], "train_measured_steps": len(steps)})
    if problem:
        raise CheckFailed(problem)


def model_step(check: Check) -> None:
    result_file = check.out / "model_step.json"
    check.results["model_step_rc"] = check.run("model_step", [
        sys.executable, "-m", "tools.bench_model", "--gpu", "--dtypes", "bf16", "--variants", *MODEL_VARIANTS,
        "--steps", "5", "--json", str(result_file)])
    if check.results["model_step_rc"]:
        raise CheckFailed(f"tools.bench_model exited {check.results['model_step_rc']}")
    measured = json.loads(result_file.read_text())
    rows = {name.removeprefix("bf16_"): row for name, row in measured["rows"].items()}
    check.results["model_step_bf16_peak_tflops"] = measured["peak_tflops"]["bf16"]
    check.results["model_step_pct_of_bf16_peak"] = {name: 100 * row["mfu"] for name, row in rows.items()}
    check.results["model_step_samples_per_s"] = {name: row["samples_per_s"] for name, row in rows.items()}
    if "transformers" in rows:
        check.results["model_step_vs_hf"] = {
            name: rows[name]["samples_per_s"] / rows["transformers"]["samples_per_s"]
            for name in ("eager", "fast") if name in rows}
    if measured.get("errors"):
        raise CheckFailed(f"variants failed: {measured['errors']}")


def finetune_command(data: Path, init: Path, out: Path) -> list[str]:
    """Seq2seq fine-tuning on the GPU in bf16 ZeRO-2: 128 BBC articles -> headlines (8 steps of 16), 16 dev ones."""
    return [sys.executable, "-m", "finetune.run", "--task", "seq2seq", "--train", str(data / "headline.train.jsonl"),
            "--dev", str(data / "headline.dev.jsonl"), "--init", str(init), "--out", str(out), "--epochs", "1",
            "--batch-size", "16", "--micro-batch-size", "16", "--max-src-len", "192", "--max-tgt-len", "32",
            "--deepspeed-config", "ds_configs/zero2_bf16.json", "--set", "keep_last=1"]


def decode_command(data: Path, model: Path) -> list[str]:
    """Beam-5 decoding in bf16 of the 16 dev articles with the fine-tuned ``model``."""
    return [sys.executable, "-m", "finetune.decode", "--model", str(model), "--input", str(data / "headline.dev.jsonl"),
            "--output", str(model / "decoded.jsonl"), "--beam-size", "5", "--dtype", "bf16", "--max-tgt-len", "32",
            "--batch-size", "16", "--force"]


def finetune_decode(check: Check) -> None:
    data = Path(check.need("task_files", "the setup part writes"))
    checkpoints = resume_dir(check, "bf16") / "checkpoints"
    if not (checkpoints.is_dir() and ckpt.newest_complete_tag(checkpoints, hashes=False)):
        raise CheckFailed(f"needs the bf16_resume part's checkpoint in {checkpoints}")
    out = check.work / "finetune"
    shutil.rmtree(out, ignore_errors=True)
    try:
        check.results["finetune_rc"] = check.run("finetune", finetune_command(data, checkpoints, out))
        if (out / "metrics.jsonl").is_file():
            check.results["finetune_steps"] = len(read_metrics(out / "metrics.jsonl"))
        if (out / "summary.json").is_file():
            check.results["finetune_dev"] = json.loads((out / "summary.json").read_text()).get("best")
        if check.results["finetune_rc"]:
            raise CheckFailed(f"finetune.run exited {check.results['finetune_rc']}")
        began = time.monotonic()
        check.results["decode_rc"] = check.run("decode", decode_command(data, out))
        check.results["decode_s"] = round(time.monotonic() - began, 1)
        if check.results["decode_rc"]:
            raise CheckFailed(f"finetune.decode exited {check.results['decode_rc']}")
        check.results["decode_records"] = len((out / "decoded.jsonl").read_text().splitlines())
    finally:  # 4-6 GB each
        shutil.rmtree(out / "checkpoints", ignore_errors=True)
        shutil.rmtree(checkpoints, ignore_errors=True)


PARTS = (Part("setup", 60, setup), Part("fp16_resume", 75, fp16_resume), Part("accuracy_tests", 15, accuracy_tests),
         Part("bf16_resume", 75, bf16_resume), Part("model_step", 70, model_step),
         Part("finetune_decode", 55, finetune_decode))
BUDGET_S = sum(part.estimate_s for part in PARTS)


# ----------------------------------------------------------------------------------------------- the command
def cuda_refusal() -> str | None:
    """Why this machine cannot run the check (torch sees no CUDA GPU), or None."""
    import torch
    if torch.cuda.is_available():
        return None
    return (f"needs a CUDA GPU, and torch sees none here (torch {torch.__version__}, CUDA "
            f"{torch.version.cuda or 'none'}); nothing was written. The CPU figures are make bench")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.gpu_check", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench_out/gpu_check"), help="results.json and logs/")
    parser.add_argument("--work", type=Path, default=Path("bench_out/gpu_check_work"),
                        help="shards, training runs, checkpoints (deleted once used)")
    parser.add_argument("--samples", type=Path, default=Path("data/samples"), help="make sample-corpus's folder")
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for all parts (default %(default)s)")
    args = parser.parse_args(argv)
    refusal = cuda_refusal()
    if refusal:
        print(f"{parser.prog}: {refusal}", file=sys.stderr)
        return 2
    import deepspeed
    import torch

    from pretrain.accelerator import apply_deepspeed_arch_list
    from tools.torch_extensions import default_extensions_dir

    # every command of the check runs on DeepSpeed's CUDA accelerator, with op builds it can parse, into one cache
    os.environ["DS_ACCELERATOR"] = "cuda"
    arch_note = apply_deepspeed_arch_list()
    default_extensions_dir()
    results: dict[str, Any] = {
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__, "cuda": torch.version.cuda, "deepspeed": deepspeed.__version__,
        "budget_s": args.budget, "arch_list_note": arch_note, "work": str(args.work)}
    say(f"{results['device']}, torch {results['torch']}, deepspeed {results['deepspeed']}; budget {args.budget:.0f} s; "
        f"results: {args.out / 'results.json'}")
    check = Check(args.out, args.work, args.samples, results)
    # a stop from outside (a time limit's SIGTERM) ends the parts' processes too: they run in sessions of their own
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    passed = run_parts(PARTS, check, args.budget)
    say(f"{'every part passed' if passed else 'NOT every part passed'}; wrote {args.out / 'results.json'}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
