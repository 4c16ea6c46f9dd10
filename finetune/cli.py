"""Command-line helpers the fine-tuning tools share (`finetune.decode`, `finetune.predict`): argument types that
name their bound, the device choice, and the names of files written beside an output."""
from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from pathlib import Path

import torch

from pretrain.accelerator import default_device


def finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value
    return parse


def device_of(text: str | None) -> torch.device:
    """The device `--device TEXT` names (default: this process's GPU when there is one, else cpu); a ValueError
    with the choices when torch cannot read it or this machine has no such CUDA device."""
    if text is None:
        return default_device()
    try:
        device = torch.device(text)
    except RuntimeError:
        raise ValueError(f"--device {text}: not a torch device; use cpu, cuda or cuda:N") from None
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device.type == "cuda" and (device.index or 0) >= count:
        raise ValueError(f"--device {text}: this machine has {count} CUDA device(s)"
                         + ("; use cpu" if count == 0 else f"; use cuda:0 to cuda:{count - 1}"))
    return device


def device_argument(parser: argparse.ArgumentParser, text: str | None) -> torch.device:
    """`device_of`, its error a usage error of `parser`."""
    try:
        return device_of(text)
    except ValueError as error:
        parser.error(str(error))


def refuse_distributed_launch(parser: argparse.ArgumentParser) -> None:
    """Stop a one-process tool started by a distributed launcher (torchrun, DeepSpeed's, mpirun: a world size
    above 1), where every rank would do all the work and all but the first would find the output written."""
    for name in ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE"):
        size = os.environ.get(name, "1")
        if size.isdigit() and int(size) > 1:
            parser.error(f"runs in one process, on one device (its GPU, or --device), but a launcher started "
                         f"{size} ranks ({name}={size}): run it as `{parser.prog} ...` itself")


def beside(output: str | Path, ending: str) -> Path:
    """A file beside `output` named after it: `pred.tsv`, `.metrics.json` → `pred.metrics.json`."""
    output = Path(output)
    return output.with_name(output.name.removesuffix(output.suffix) + ending)


