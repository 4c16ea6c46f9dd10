"""`make ops`: build DeepSpeed's JIT ops ahead of the run that needs them, into ``TORCH_EXTENSIONS_DIR``.

    python -m tools.ops [OP ...]

DeepSpeed builds an op with the machine's compiler the first time a process loads it (on 2 CPU cores about 40 s of
g++ for the all-reduce, 2 minutes for FusedAdam; nvcc on a GPU machine), while the run's other ranks wait on the
build's lock. Built here first, every run finds it cached. The ops (default: those a run on this machine loads):

  shm_comm     the CPU accelerator's shared-memory all-reduce, loaded by every DeepSpeed start on CPUs (default
               where torch sees no GPU)
  fused_adam   DeepSpeed's FusedAdam, the GPU configs' optimizer (default where torch sees a GPU; the CPU suite's
               tests of FusedAdam checkpoints build its CPU version)

Each op is loaded exactly as the run loads it (`pretrain.accelerator.op_failure`); an op that cannot be built here
is named with the reason, and the exit code is 1. ``make test`` runs this in the background while it fetches the
sample corpora and lints, so the suite's first DeepSpeed starts do not wait for a compiler.
"""
from __future__ import annotations

import argparse
import sys
import time

OPS = {"shm_comm": "ShareMemCommBuilder", "fused_adam": "FusedAdamBuilder"}
"""Op name on the command line → DeepSpeed's op builder class (resolved for the accelerator in use)."""


def default_ops(gpu: bool) -> list[str]:
    """The ops a run on this machine loads: FusedAdam on a GPU machine, the shared-memory all-reduce on CPUs."""
    return ["fused_adam"] if gpu else ["shm_comm"]


def build(names: list[str]) -> list[str]:
    """Load (building where not cached) each op of ``names``; one line per op; the problems, one per op that
    failed."""
    from pretrain.accelerator import apply_deepspeed_arch_list, op_failure
    from tools.torch_extensions import default_extensions_dir

    folder = default_extensions_dir()
    apply_deepspeed_arch_list()
    problems = []
    for name in names:
        started = time.monotonic()
        failure = op_failure(OPS[name])
        took = time.monotonic() - started
        if failure:
            problems.append(f"{name} ({OPS[name]}): {failure}")
        print(f"[ops] {name}: " + (f"cannot be built here: {failure}" if failure else
                                   f"ready in {folder} ({took:.0f} s)"), flush=True)
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.ops", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("ops", nargs="*", metavar="OP",
                        help=f"ops to build: {', '.join(OPS)} (default: those a run on this machine loads)")
    args = parser.parse_args(argv)
    unknown = [name for name in args.ops if name not in OPS]
    if unknown:
        parser.error(f"unknown op {', '.join(map(repr, unknown))}; the ops: {', '.join(OPS)}")
    from pretrain.accelerator import choose_ds_accelerator

    gpu = choose_ds_accelerator() != "cpu"  # before DeepSpeed picks its accelerator
    problems = build(args.ops or default_ops(gpu))
    for problem in problems:
        print(f"[ops] {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
