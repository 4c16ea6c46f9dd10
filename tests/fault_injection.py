"""``python -m fault_injection`` (with ``tests/`` on the path): `pretrain.train` with one fault injected from
outside the library, by wrapping the functions where the fault belongs.

``UNILM_TEST_FAULT=POINT@STEP`` or ``POINT@STEP@RANK`` picks it. Kill points (SIGKILL: no cleanup, no flush,
a crash): ``step`` (as optimizer step STEP begins), ``save_begin`` (the checkpoint of STEP, before anything
is written), ``after:FILE`` (after DeepSpeed wrote FILE of that checkpoint), ``before_marker``,
``before_latest``; ``node`` (as step STEP begins, SIGKILL to the launcher that started this rank, a torch
elastic agent, then to the rank: its "node" is lost); ``freeze`` (the same with SIGSTOP: the node hangs, its
processes alive but silent). With ``UNILM_TEST_FAULT_ONCE=FILE`` a fault fires only while FILE does not exist, and
creates it (a restarted run does not meet it again). ``inf_grad`` turns one gradient of step STEP to inf instead;
``enospc`` makes this rank's checkpoint of STEP fail as on a full disk (ENOSPC as its files are synced).
"""
from __future__ import annotations

import errno
import functools
import inspect
import math
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as torch_dist
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

from pretrain import checkpoint as ckpt, train as entry, trainer

FAULT_ENV = "UNILM_TEST_FAULT"


def _parse(spec: str) -> tuple[str, int, int | None]:
    parts = spec.split("@")
    return parts[0], int(parts[1]), int(parts[2]) if len(parts) > 2 else None


POINT, STEP, RANK = _parse(os.environ[FAULT_ENV])


def _wanted(point: str, step: int) -> bool:
    rank = torch_dist.get_rank() if torch_dist.is_initialized() else 0
    if not (point == POINT and step == STEP and (RANK is None or RANK == rank)):
        return False
    once = os.environ.get("UNILM_TEST_FAULT_ONCE")
    if once is None:
        return True
    try:
        with open(once, "x") as record:  # names the faulted rank's process for the test to end it
            record.write(str(os.getpid()))
    except FileExistsError:
        return False
    return True


def _kill_if_wanted(point: str, step: int) -> None:
    if _wanted(point, step):
        rank = torch_dist.get_rank() if torch_dist.is_initialized() else 0
        print(f"[fault] {FAULT_ENV}: SIGKILL at {point} of step {step} on rank {rank}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), 9)


def _step_of_path(path: str | Path) -> int | None:
    for part in Path(path).parts:
        if ckpt.step_of_tag(part) is not None:
            return ckpt.step_of_tag(part)
    return None


def _wrap(owner: Any, name: str, before: Any = None, after: Any = None) -> None:
    """Replace ``owner.name`` by a wrapper that calls ``before(arguments)`` / ``after(arguments)`` around it, with
    the call's arguments bound to their parameter names (callers pass them by position or by keyword)."""
    original = getattr(owner, name)
    signature = inspect.signature(original)

    @functools.wraps(original)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        arguments = signature.bind(*args, **kwargs).arguments
        if before is not None:
            before(arguments)
        result = original(*args, **kwargs)
        if after is not None:
            after(arguments)
        return result
    setattr(owner, name, wrapped)


def _lose_node_if_wanted(step: int) -> None:
    for point, signal_number in (("node", 9), ("freeze", 19)):  # SIGKILL, SIGSTOP
        if _wanted(point, step):
            print(f"[fault] {FAULT_ENV}: signal {signal_number} to the node (agent {os.getppid()} and rank "
                  f"{torch_dist.get_rank()}) at step {step}", file=sys.stderr, flush=True)
            os.kill(os.getppid(), signal_number)
            os.kill(os.getpid(), signal_number)


def _train_step_with_fault(original: Any) -> Any:
    @functools.wraps(original)
    def train_step(engine: Any, loader: Any, plan: Any, metrics: Any, progress: Any, *args: Any) -> Any:
        step = progress.step + 1
        _kill_if_wanted("step", step)
        _lose_node_if_wanted(step)
        hook = None
        if _wanted("inf_grad", step):  # one gradient of this step becomes inf
            hook = engine.module.embeddings.token.weight.register_hook(lambda grad: torch.full_like(grad, math.inf))
        try:
            return original(engine, loader, plan, metrics, progress, *args)
        finally:
            if hook is not None:
                hook.remove()
    return train_step


def install() -> None:
    trainer.train_step = _train_step_with_fault(trainer.train_step)
    _wrap(ckpt, "save", before=lambda a: _kill_if_wanted("save_begin", a["step"]))
    _wrap(TorchCheckpointEngine, "save",
          after=lambda a: _kill_if_wanted(f"after:{Path(a['path']).name}", _step_of_path(a["path"])))
    _wrap(ckpt, "write_marker", before=lambda a: _kill_if_wanted("before_marker", _step_of_path(a["tag_dir"])))
    _wrap(ckpt, "update_latest", before=lambda a: _kill_if_wanted("before_latest", ckpt.step_of_tag(a["tag"])))
    _wrap(ckpt, "fsync_tree", before=lambda a: _disk_full_if_wanted(_step_of_path(a["directory"])))


def _disk_full_if_wanted(step: int | None) -> None:
    if step is not None and _wanted("enospc", step):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


if __name__ == "__main__":
    install()
    entry.main(sys.argv[1:])
