"""Fine-tune a pre-trained (or HF BERT) model: `python -m finetune.run --task {classify,qa,seq2seq} ...`.

Thin entry: parse → config → load the initial model → build the task → `finetune.engine.fit`. Runs under any
launcher (`deepspeed`, `torchrun`, `mpirun`, or plain `python` as one rank). See `finetune/configs/` for the
papers' settings and `finetune.config.FinetuneConfig` for every key.
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from deepspeed.accelerator import get_accelerator

from common.config_loader import add_field_flags, given_fields, keys_help
from pretrain import checkpoint as ckpt
from pretrain.batch_plan import plan_batch
from pretrain.console import configure_console
from pretrain.distributed import RunStopped, SetupError, close_distributed, init_distributed, on_every_rank, say_once
from pretrain.engine import read_engine_json
from pretrain.model import build_model
from pretrain.outputs import check_output
from pretrain.resume import LOCK_FILE
from pretrain.rng import seed_everything

from .config import FinetuneConfig, load_config
from .engine import BATCH_KEYS, LOG_FILE, fit, schedule
from .model_io import load_init
from .tasks import TaskSetup, build_task
from .tokenizer import Tokenizer

FLAG_KEYS = ("task", "train", "dev", "init", "out", "vocab", "from_scratch", "epochs", "max_steps", "batch_size",
             "micro_batch_size", "lr", "max_seq_len", "max_src_len", "max_tgt_len", "aux_lm_weight", "deepspeed_config",
             "seed")
"""The `FinetuneConfig` keys that have a flag of their own (`--max-steps`); `--set KEY=VALUE` sets any key."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m finetune.run", description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="config keys (YAML, flags, or --set KEY=VALUE):\n"
                                            + keys_help(FinetuneConfig))
    parser.add_argument("--config", help="YAML in finetune/configs/ (CLI flags override it)")
    add_field_flags(parser, FinetuneConfig, FLAG_KEYS)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any config key")
    parser.add_argument("--force", action="store_true",
                        help="start a fresh run in a non-empty --out that holds no checkpoint of a run to resume")
    parser.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)  # the deepspeed launcher passes it
    return parser.parse_args(argv)


class InputError(ValueError):
    """A setting, model or data file the run cannot use, found before training starts: one line, no traceback."""


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    flags = given_fields(args, FinetuneConfig)
    configure_console()
    rank, world_size = init_distributed()  # first: a problem one rank finds in the setup then stops every rank
    configure_console(logging.INFO if rank == 0 else logging.WARNING)  # rank 0 speaks for all
    try:  # together, naming that rank; across nodes no launcher would stop the others at the rendezvous
        cfg, task, tokenizer = on_every_rank(lambda: prepare(args, flags, world_size))
    except SetupError as error:
        raise InputError(str(error)) from error
    try:
        return fit(cfg, task, tokenizer)
    except (ckpt.CheckpointMismatchError, SetupError) as error:  # --out holds a run this one cannot continue, or
        # the engine cannot be built here (an optimizer op that does not load, or one that cannot take over the state)
        raise InputError(str(error)) from error
    except RunStopped as error:  # a diagnosis (non-finite loss, checkpoint not written), not a crash: no traceback
        say_once(f"[stop] {error}")
        sys.exit(error.exit_code)


def prepare(args: argparse.Namespace, flags: dict, world_size: int) -> tuple[FinetuneConfig, TaskSetup, Tokenizer]:
    """This rank's config, task (data and model) and tokenizer, checked in the order that names a problem soonest:
    raises `InputError` naming the file or setting."""
    try:
        cfg = load_config(args.config, flags, args.set)
        check_run_output(cfg.out, [cfg.init, cfg.train, cfg.dev, cfg.vocab], args.force)
        for key, path in (("train", cfg.train), ("dev", cfg.dev)):  # before the model loads: named at once
            if path and not Path(path).exists():
                raise InputError(f"{path}: no such file or directory (the {key} file)")
        # what needs no model or data first: the DeepSpeed JSON and the batch split over this launch's ranks
        read_engine_json(cfg.deepspeed_config_path, accelerator=get_accelerator())  # a precision it can train in
        plan_batch(cfg.batch_size, cfg.micro_batch_size, world_size, BATCH_KEYS)
        backbone, tokenizer = load_init(cfg.init, cfg.vocab, cfg.task, cfg.max_position_embeddings)
        seed_everything(cfg.seed)  # the same head (and, from scratch, backbone) initialisation on every rank
        if cfg.from_scratch:
            backbone = build_model(backbone.cfg)
        task = build_task(cfg, backbone, tokenizer)
        schedule(cfg, task.train_size)  # a global batch larger than the training set
    except InputError:
        raise
    except (ValueError, FileExistsError) as error:  # FileExistsError: an --out holding something else
        raise InputError(str(error)) from error
    except FileNotFoundError as error:  # torch's or our own message (no filename) says what is missing
        raise InputError(f"{error.filename}: no such file or directory" if error.filename else str(error)) from error
    except OSError as error:  # a directory where a file goes, no permission, ...
        raise InputError(f"{error.filename}: {error.strerror}" if error.filename else str(error)) from error
    return cfg, task, tokenizer


RUN_START_FILES = {LOCK_FILE, "run_config.json", LOG_FILE, "checkpoints"}
"""What a run writes before its first checkpoint: a directory holding only these is a run that failed early."""


def check_run_output(out: str, inputs: list[str | None], force: bool) -> None:
    """Refuse an output directory that is one of the inputs, or that holds something other than a run to
    resume (its checkpoints) or a run that stopped before its first checkpoint, unless `force`."""
    has_checkpoint = any(p.is_dir() and ckpt.step_of_tag(p.name) is not None
                         for p in (Path(out) / "checkpoints").glob("global_step*"))
    failed_early = Path(out).is_dir() and {p.name for p in Path(out).iterdir()} <= RUN_START_FILES
    check_output(out, inputs, force=force or has_checkpoint or failed_early)


if __name__ == "__main__":
    try:
        main()
    except InputError as error:  # every rank has it (the message names the rank that found it): said once
        say_once(f"[finetune] {error}")
        sys.exit(2)
    close_distributed()
