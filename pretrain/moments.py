"""Adam's moments by parameter name: gathered whole in fp32 from the optimizer however DeepSpeed partitions it,
written beside a checkpoint's weights (``adam_moments.safetensors``), read back, and set into a new run's optimizer.

A run that starts from another run's checkpoint (``model.init_from`` with ``train.init_optimizer``: phase 2 from
phase 1) takes over each parameter's ``exp_avg`` and ``exp_avg_sq`` and the optimizer's step count (Adam's bias
correction goes on), mapped by parameter name, so the new run may have another world size, ZeRO stage (0-2) or
micro-batch size. DeepSpeed's own optimizer files are pickles laid out by partition; this file is neither.

File format (``FORMAT_VERSION`` in the safetensors metadata as ``format_version``): ``exp_avg/NAME`` and
``exp_avg_sq/NAME`` (fp32, the parameter's shape) for every trained parameter ``NAME`` of the module (a tied
weight once, under its first name), and ``step`` (int64, one element: optimizer updates applied).

Where the optimizer keeps its state: without ZeRO (stage 0, fp32) per module parameter; under ZeRO 1/2 and the bf16
optimizer in flat fp32 partitions, each parameter's fragment found through DeepSpeed's ``_hp_mapping`` (every rank
holds its fragments; an all-reduce per `BUCKET_ELEMENTS` of parameters assembles them whole). ZeRO-3 and ZeRO-0
fp16 keep state in layouts not mapped per parameter here: their checkpoints carry no moments, and taking moments
over into them is refused.
"""
from __future__ import annotations

import errno
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as torch_dist
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from common.files import write_atomically

log = logging.getLogger(__name__)

MOMENTS = "adam_moments.safetensors"
FORMAT_VERSION = 1
KEYS = ("exp_avg", "exp_avg_sq")


class MomentsUnavailable(ValueError):
    """The optimizer keeps its state where moments cannot be mapped per parameter (the message says why)."""


def _trained_parameters(module: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """(name, parameter) of every parameter the optimizer steps, a tied one once (under its first name)."""
    for name, parameter in module.named_parameters():
        if parameter.requires_grad:
            yield name, parameter


def _flat_partitions(optimizer: torch.optim.Optimizer) -> dict[int, torch.Tensor]:
    """The optimizer's parameters by the address of their storage (ZeRO's flat fp32 partitions)."""
    return {p.untyped_storage().data_ptr(): p for group in optimizer.param_groups for p in group["params"]}


ADAMS = ("Adam", "AdamW", "FusedAdam", "DeepSpeedCPUAdam")
"""The optimizer classes whose state these are (fine-tuning's Adamax keeps other moments)."""


def _check_layout(engine: Any) -> None:
    if type(engine.basic_optimizer).__name__ not in ADAMS:
        raise MomentsUnavailable(f"optimizer {type(engine.basic_optimizer).__name__} keeps no Adam moments")
    if engine.zero_optimization_stage() == 3:
        raise MomentsUnavailable("ZeRO-3 partitions the optimizer state in a layout not mapped per parameter here")
    if engine.fp16_enabled() and engine.zero_optimization_stage() == 0:
        raise MomentsUnavailable("ZeRO-0 fp16 keeps the optimizer state in flat groups not mapped per parameter here")


def _where(engine: Any, parameter: torch.nn.Parameter, partitions: dict[int, torch.Tensor]
           ) -> tuple[dict[str, Any], torch.Tensor | None, Any]:
    """(the optimizer's state dict that holds ``parameter``'s moments, the tensor it is keyed by, the fragment
    mapping or None). Without ZeRO the state is keyed by the parameter itself."""
    optimizer = engine.basic_optimizer
    mapping = getattr(parameter, "_hp_mapping", None)
    if not hasattr(parameter, "_hp_mapping"):
        return optimizer.state[parameter], parameter, None
    if mapping is None:  # another rank holds all of it
        return {}, None, None
    flat = partitions[mapping.hp_fragment.untyped_storage().data_ptr()]
    return optimizer.state[flat], flat, mapping


def optimizer_step_count(engine: Any) -> int | None:
    """Optimizer updates applied so far (Adam's ``step``), None before the first."""
    optimizer = engine.basic_optimizer
    for state in optimizer.state.values():
        if "step" in state:
            return int(state["step"])
    steps = [group["step"] for group in optimizer.param_groups if "step" in group]
    return int(steps[0]) if steps else None


BUCKET_ELEMENTS = 1 << 25
"""Elements (fp32: 128 MiB) of partitioned moments assembled per all-reduce under ZeRO 1/2: a few collectives per
save instead of one per parameter and moment, in bounded memory on the ranks that keep none of it."""


def gather_moments(engine: Any, keep: bool = True) -> dict[str, torch.Tensor] | None:
    """Every trained parameter's ``exp_avg`` and ``exp_avg_sq``, whole, in fp32 on the CPU, and ``step``; a
    collective under ZeRO 1/2 (every rank calls it, in the same order). ``keep=False``: takes part and returns {}.
    None (on every rank alike) where there are none to record: before the first update, or a layout
    `MomentsUnavailable` names."""
    try:
        _check_layout(engine)
    except MomentsUnavailable:
        return None
    step = optimizer_step_count(engine)
    if step is None:
        return None
    partitions = _flat_partitions(engine.basic_optimizer)
    moments: dict[str, torch.Tensor] = {}
    bucket: list[tuple[str, torch.nn.Parameter, dict[str, Any], Any]] = []
    bucket_elements = 0
    for name, parameter in _trained_parameters(engine.module):
        state, _, mapping = _where(engine, parameter, partitions)
        if not hasattr(parameter, "_hp_mapping"):  # the optimizer steps the parameter itself: its state is whole
            for key in KEYS:  # a parameter that never had a gradient has no state yet: zeros, as Adam starts
                if keep:
                    moments[f"{key}/{name}"] = state[key].detach().float().to("cpu", copy=True) if key in state \
                        else torch.zeros(parameter.shape, dtype=torch.float32)
            continue
        if bucket and (bucket_elements + parameter.numel() > BUCKET_ELEMENTS
                       or bucket[0][1]._dp_group is not parameter._dp_group):  # type: ignore[attr-defined]
            _assemble(bucket, moments, keep)
            bucket, bucket_elements = [], 0
        bucket.append((name, parameter, state, mapping))
        bucket_elements += parameter.numel()
    _assemble(bucket, moments, keep)
    if keep:
        moments["step"] = torch.tensor([step], dtype=torch.int64)
    return moments


def _assemble(bucket: list[tuple[str, torch.nn.Parameter, dict[str, Any], Any]], moments: dict[str, torch.Tensor],
              keep: bool) -> None:
    """One all-reduce per moment of ``bucket``'s partitioned parameters, laid end to end: each rank fills the
    fragments it holds (the rest stays zero, and each element is held by one rank), so the sum is every whole
    parameter's moment. Adds them to ``moments`` where ``keep``."""
    if not bucket:
        return
    first = bucket[0][1]
    offsets = [0]
    for _, parameter, _, _ in bucket:
        offsets.append(offsets[-1] + parameter.numel())
    for key in KEYS:
        flat = torch.zeros(offsets[-1], dtype=torch.float32, device=first.device)
        for (_, _, state, mapping), offset in zip(bucket, offsets):
            if mapping is not None:  # None: another rank holds all of this parameter
                hp, lp = mapping.hp_fragment_address, mapping.lp_fragment_address
                flat.narrow(0, offset + lp.start, lp.numel).copy_(state[key].narrow(0, hp.start, hp.numel))
        torch_dist.all_reduce(flat, group=first._dp_group)  # type: ignore[attr-defined]
        if keep:
            for (name, parameter, _, _), offset in zip(bucket, offsets):
                moments[f"{key}/{name}"] = flat.narrow(0, offset, parameter.numel()).reshape(parameter.shape) \
                    .to("cpu", copy=True)


def write_moments(tag_dir: Path, moments: dict[str, torch.Tensor]) -> None:
    """Write `gather_moments`' tensors as ``MOMENTS`` into the tag directory (before its marker, which lists and
    hashes it)."""
    try:
        write_atomically(tag_dir / MOMENTS, lambda tmp: save_file(moments, str(tmp),
                                                                   metadata={"format_version": str(FORMAT_VERSION)}),
                         durable=False)
    except SafetensorError as error:  # safetensors reports a full disk as its own error type, the errno in words
        raise OSError(errno.ENOSPC if "No space left" in str(error) else errno.EIO, str(error)) from error


def read_moments(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a ``MOMENTS`` file (its marker's hash checked by the caller); refuses another format version."""
    with safe_open(str(path), framework="pt") as handle:
        version = (handle.metadata() or {}).get("format_version")
        if version != str(FORMAT_VERSION):
            raise ValueError(f"{path}: Adam moments of format_version {version}, this code reads {FORMAT_VERSION}")
        return {key: handle.get_tensor(key) for key in handle.keys()}


def set_moments(engine: Any, moments: dict[str, torch.Tensor], where: str) -> int:
    """Put ``moments`` (`read_moments`) into ``engine``'s optimizer before its first step, each parameter's by name,
    with their step count, which is returned. A parameter without moments (another architecture) or of another
    shape is refused naming it and ``where`` (the file)."""
    _check_layout(engine)
    step = int(moments["step"][0])
    partitions = _flat_partitions(engine.basic_optimizer)
    torch_step = type(engine.basic_optimizer).__module__.startswith("torch.")  # torch's Adam keeps a tensor
    for name, parameter in _trained_parameters(engine.module):
        state, keyed_by, mapping = _where(engine, parameter, partitions)
        if keyed_by is None:
            continue
        for key in KEYS:
            stored = moments.get(f"{key}/{name}")
            if stored is None or stored.shape != parameter.shape:
                found = "none" if stored is None else f"shape {tuple(stored.shape)}"
                raise ValueError(f"{where}: {key} of parameter {name} ({tuple(parameter.shape)}): {found} there")
            if key not in state:
                state[key] = torch.zeros_like(keyed_by, dtype=torch.float32)
            full = stored.to(state[key].device, torch.float32).flatten()
            if mapping is None:
                state[key].copy_(full.reshape(state[key].shape))
            else:
                hp, lp = mapping.hp_fragment_address, mapping.lp_fragment_address
                state[key].narrow(0, hp.start, hp.numel).copy_(full.narrow(0, lp.start, lp.numel))
        state["step"] = torch.tensor(float(step)) if torch_step else step
    for group in engine.basic_optimizer.param_groups:
        if "step" in group:  # DeepSpeed's FusedAdam starts a parameter's count from its group's
            group["step"] = step
    return step
