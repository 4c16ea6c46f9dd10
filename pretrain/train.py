"""Pre-training entry point (thin): parse → config → train.

    deepspeed --hostfile hostfiles/localhost --no_ssh_check --master_addr 127.0.0.1 \\
        pretrain/train.py --config pretrain/configs/tiny.yaml out_dir=runs/tiny train.max_steps=50
    deepspeed --num_gpus 8 pretrain/train.py --config pretrain/configs/unilm-large.yaml
    torchrun --nproc_per_node 2 -m pretrain.train --config pretrain/configs/tiny.yaml
    mpirun -np 2 python -m pretrain.train --config pretrain/configs/tiny.yaml
    python -m pretrain.train --config pretrain/configs/tiny.yaml          # one process

Everything after ``--config`` is a dotted ``key=value`` override (``train.exit_at_step=100``).
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

if __package__ in (None, ""):  # `deepspeed pretrain/train.py` runs this file as a script
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common.config_loader import config_error, keys_help  # noqa: E402
from pretrain.config import RunConfig, load_config  # noqa: E402
from pretrain.console import configure_console  # noqa: E402
from pretrain.distributed import (  # noqa: E402
    PeerLostError,
    RunStopped,
    SetupError,
    close_distributed,
    init_distributed,
    on_every_rank,
    say_once,
)
from pretrain.trainer import train  # noqa: E402

log = logging.getLogger("pretrain.train")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pretrain.train",
                                     description="UniLM / BERT / GPT pre-training on DeepSpeed",
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="config keys (YAML, or KEY=VALUE after --config; model.overrides.* takes "
                                            "any pretrain.model.ModelConfig field):\n" + keys_help(RunConfig))
    parser.add_argument("--config", required=True, help="run YAML (pretrain/configs/*.yaml)")
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed launcher
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    args = parser.parse_args(argv)
    configure_console()
    init_distributed()  # first: a config one rank cannot read (not at this path on its node) stops every rank
    try:
        cfg = on_every_rank(lambda: load_config(args.config, args.overrides))
    except SetupError as error:  # a bad setting: one line, said once, not a traceback per rank
        say_once(f"[config] {config_error(args.config, error, args.overrides)}")
        sys.exit(2)
    try:
        train(cfg)
    except PeerLostError as error:  # each rank left says what it saw: the ranks cannot agree on it any more
        log.warning(f"[stop] {error}")
        sys.exit(error.exit_code)
    except RunStopped as error:  # a diagnosis (non-finite loss, checkpoint not written), not a crash: no traceback
        say_once(f"[stop] {error}")
        sys.exit(error.exit_code)


if __name__ == "__main__":
    main()
    close_distributed()
