"""RNG seeding, and capturing and restoring every generator a rank draws from (torch, numpy, Python and its
accelerator's), so a resumed run continues each rank's dropout stream."""
from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from deepspeed.accelerator import get_accelerator


def seed_everything(seed: int) -> None:
    """Seed Python, numpy and torch; ``torch.manual_seed`` seeds every accelerator device's generator too (CUDA),
    so a per-rank seed gives each rank its own dropout stream on GPUs as on CPUs."""
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


def _accelerator_generator() -> tuple[Any, str, int] | None:
    """(DeepSpeed accelerator, its device type, the current device index) when the process runs on an accelerator
    with its own generators (CUDA), else None (the CPU generator is torch's)."""
    accelerator = get_accelerator()
    name = accelerator.device_name()
    if name == "cpu" or not accelerator.is_available():
        return None
    return accelerator, name, int(accelerator.current_device())


def rng_state() -> dict[str, Any]:
    """This process's torch, numpy and Python RNG states, and on an accelerator the generator of its current device
    (``"accelerator": {"device": "cuda", "state": ByteTensor}``: dropout on a GPU draws from it)."""
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    found = _accelerator_generator()
    if found is not None:
        accelerator, name, index = found
        state["accelerator"] = {"device": name, "state": accelerator.get_rng_state(index)}
    return state


def set_rng_state(state: dict[str, Any]) -> bool:
    """Restore ``rng_state()``'s values. The accelerator generator is restored when the state has one for this
    process's device type; a state without one (saved before it was recorded, or on a CPU) leaves it as it was.
    Returns whether this process's accelerator generator (if it has one) was restored."""
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    saved, found = state.get("accelerator"), _accelerator_generator()
    if found is None:
        return True
    if saved is not None and saved["device"] == found[1]:
        accelerator, _, index = found
        accelerator.set_rng_state(saved["state"].cpu(), index)
        return True
    return False


def portable_rng_state() -> dict[str, Any]:
    """`rng_state` as plain Python / tensor values (loadable with ``torch.load(weights_only=True)``)."""
    state = rng_state()
    name, keys, pos, has_gauss, cached = state["numpy"]
    state["numpy"] = (name, keys.tolist(), pos, has_gauss, cached)
    return state


def restore_rng_state(state: dict[str, Any]) -> bool:
    """Set the RNG states saved by `portable_rng_state`; returns `set_rng_state`'s answer."""
    name, keys, pos, has_gauss, cached = state["numpy"]
    return set_rng_state(dict(state, numpy=(name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached)))


def resume_rng(saved_states: Sequence[dict[str, Any]], seed: int, step: int, rank: int, world_size: int) -> None:
    """Continue this rank's dropout stream from a checkpoint's gathered RNG states; saved by another world size
    they cannot continue, so fresh ones are derived from (seed, step, rank). A state without this device's
    generator (saved on a CPU, or before GPU generators were saved) restores the rest and seeds the GPU's from
    (seed, step, rank): it would otherwise stay where the identical start-up seed of every rank put it, giving
    every rank the same dropout."""
    derived = seed * 1_000_003 + step * 1_009 + rank
    if len(saved_states) != world_size:
        seed_everything(derived)
    elif not restore_rng_state(saved_states[rank]):
        get_accelerator().manual_seed(derived)
