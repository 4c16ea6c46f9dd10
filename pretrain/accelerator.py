"""The rank's device, through DeepSpeed's accelerator API, and what DeepSpeed's CUDA op builder needs.

On a CPU machine (``DS_ACCELERATOR=cpu``, or DeepSpeed finding no GPU) every function here is a no-op or answers
``cpu``, so CPU runs stay exactly as they were. On GPUs:
  * ``bind_local_device`` makes the process use GPU ``LOCAL_RANK`` before anything touches CUDA (NCCL, RNG, the
    model and the loader's copies all follow the current device);
  * ``collective_device`` is where a tensor handed to a collective must live (NCCL refuses CPU tensors);
  * ``matmul_peak_tflops`` measures the device's dense matmul throughput in a dtype (the denominator of MFU);
  * ``compiler_failure`` tells whether ``torch.compile`` works on the device here (its toolchain is not a package);
  * ``op_failure`` tells whether one of DeepSpeed's ops loads here (FusedAdam is JIT-built with the CUDA
    toolkit's ``nvcc``, which PyPI's CUDA torch does not bring; CPUAdam with a C++ compiler);
  * ``deepspeed_arch_list`` rewrites ``TORCH_CUDA_ARCH_LIST`` into the ``X.Y`` / ``X.Y+PTX`` tokens DeepSpeed's JIT
    op builder parses (``deepspeed/ops/op_builder/builder.py`` reads each token as ``int`` major and minor, so the
    arch-specific ``9.0a`` that CUDA images set fails its FusedAdam build with ``invalid literal for int()``).
"""
from __future__ import annotations

import os
import re
import time
from collections.abc import MutableMapping
from typing import Any

import torch

# MPI launchers name the local rank before DeepSpeed's MPI discovery copies it into LOCAL_RANK.
_LOCAL_RANK_VARIABLES = ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID")
_ARCH = re.compile(r"^(\d+)\.(\d+)([a-z]?)(\+PTX)?$")
# torch.utils.cpp_extension's named architectures (DeepSpeed's builder knows none of them)
_NAMED_ARCHES = {"Kepler+Tesla": "3.7", "Kepler": "3.5+PTX", "Maxwell+Tegra": "5.3", "Maxwell": "5.0;5.2+PTX",
                 "Pascal": "6.0;6.1+PTX", "Volta+Tegra": "7.2", "Volta": "7.0+PTX", "Turing": "7.5+PTX",
                 "Ampere+Tegra": "8.7", "Ampere": "8.0;8.6+PTX", "Ada": "8.9+PTX", "Hopper": "9.0+PTX"}


def accelerator_name() -> str:
    """``cuda`` (or another DeepSpeed accelerator's device type), or ``cpu``."""
    from deepspeed.accelerator import get_accelerator
    return get_accelerator().device_name()


def local_rank() -> int:
    """This process's rank on its machine, from whichever launcher started it (0 for plain ``python``)."""
    for name in _LOCAL_RANK_VARIABLES:
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


def bind_local_device() -> torch.device:
    """Make device ``LOCAL_RANK`` this process's current device; returns it (``cpu`` on a CPU accelerator).

    Without it every rank of a node would start on GPU 0: NCCL would hang or fail, and CUDA RNG states and
    pinned copies would belong to the wrong device. DeepSpeed itself places local rank N on device N (its process
    group, engine and ZeRO-3 partitioning read ``LOCAL_RANK``), so a rank whose launcher hid the other GPUs from it
    (a per-rank ``CUDA_VISIBLE_DEVICES``, as ``srun --gpus-per-task=1`` sets) is refused here, before any of them
    fails with "invalid device ordinal"."""
    from deepspeed.accelerator import get_accelerator
    accelerator = get_accelerator()
    if accelerator.device_name() == "cpu":
        return torch.device("cpu")
    index = _local_device_index(accelerator)
    accelerator.set_device(index)
    return torch.device(accelerator.device_name(index))


def _local_device_index(accelerator: Any) -> int:
    """``LOCAL_RANK``, the index of this rank's device, refused (naming the fix) when the process sees fewer."""
    index, count = local_rank(), accelerator.device_count()
    if index >= count:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        shown = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
        raise RuntimeError(f"local rank {index} has no {accelerator.device_name()} device: this process sees {count}"
                           f"{shown}. DeepSpeed puts local rank N on device N, so every rank must see all of its "
                           "machine's GPUs: launch at most that many ranks per machine (hostfile slots=N or "
                           "--num_gpus N) and do not give each rank its own CUDA_VISIBLE_DEVICES (under SLURM: "
                           "hostfiles/slurm.sbatch, or srun --gpu-bind=none)")
    return index


def native_bf16() -> bool:
    """Whether the device of this process (GPU ``LOCAL_RANK``) computes bf16 natively. On CUDA that is compute
    capability 8.0 or newer (Ampere on): ``torch.cuda.is_bf16_supported()``, which DeepSpeed's accelerator
    answers with, also says yes on a V100 or T4, which only emulate bf16, many times slower than fp16. Reads the
    device's properties without creating a context on it. Other accelerators: DeepSpeed's answer."""
    from deepspeed.accelerator import get_accelerator
    accelerator = get_accelerator()
    if accelerator.device_name() == "cuda" and torch.version.hip is None:
        return torch.cuda.get_device_capability(_local_device_index(accelerator))[0] >= 8
    return bool(accelerator.is_bf16_supported())


def collective_device() -> torch.device:
    """Where tensors passed to ``torch.distributed`` collectives must live: the CPU under gloo, the rank's current
    accelerator device under NCCL (or any other device backend)."""
    import torch.distributed as torch_dist
    if torch_dist.get_backend() == "gloo":
        return torch.device("cpu")
    from deepspeed.accelerator import get_accelerator
    return torch.device(get_accelerator().current_device_name())


def default_device() -> torch.device:
    """The device a single process (decoding, evaluation) runs on: the current accelerator device, else the CPU."""
    from deepspeed.accelerator import get_accelerator
    accelerator = get_accelerator()
    if accelerator.device_name() == "cpu" or not accelerator.is_available():
        return torch.device("cpu")
    return torch.device(accelerator.current_device_name())


def synchronize(device: torch.device) -> None:
    """Wait until ``device`` has finished its queued work (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_peak_tflops(device: torch.device, dtype: torch.dtype, seconds: float = 0.25) -> float:
    """Best dense matrix-multiply throughput of ``device`` in ``dtype``, TFLOP/s, over about ``seconds`` of square
    multiplies (8192² on a GPU, where smaller ones leave the tensor cores idle; 1024² on the CPU, 512² for the
    CPU's slow half-precision kernels). Timed in groups of multiplies after one warm-up; the best group counts."""
    size = 8192 if device.type != "cpu" else 1024 if dtype == torch.float32 else 512
    generator = torch.Generator(device=device).manual_seed(0)
    a, b = (torch.randn(size, size, device=device, dtype=dtype, generator=generator) for _ in range(2))
    a @ b
    synchronize(device)
    group, best, deadline = 1, 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        began = time.perf_counter()
        for _ in range(group):
            a @ b
        synchronize(device)
        elapsed = time.perf_counter() - began
        best = max(best, 2 * size**3 * group / elapsed)
        group = group * 2 if elapsed < seconds / 20 else group  # groups long enough to hide the launch overhead
    return best / 1e12


COMPILER_NEEDS = ("torch.compile builds its kernels at run time, with Triton on GPUs and a C++ compiler on CPUs: "
                  "both need a C compiler (gcc; or set CC / CXX) and Python's headers (Debian/Ubuntu: python3-dev)")


def compiler_failure(device: torch.device) -> str | None:
    """Why ``torch.compile`` cannot build a kernel for ``device`` on this machine (the innermost error, type and
    first line), or None when it can: a two-op function compiled and run there once (seconds; the blocks' own
    compilation then finds the toolchain warm). Slim containers and some clusters lack what `COMPILER_NEEDS`."""
    def probe(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(x) * 2 + 1

    try:
        probe_input = torch.arange(8.0, device=device)
        torch.compile(probe, dynamic=False)(probe_input)
        synchronize(device)
    except Exception as error:  # noqa: BLE001 -- any failure of the compiler stack is the answer
        cause: BaseException = error
        while cause.__cause__ is not None:
            cause = cause.__cause__
        return error_summary(cause)
    return None


FUSED_ADAM_NEEDS = ("DeepSpeed builds FusedAdam on first use with the CUDA toolkit's nvcc (the major version of "
                    "torch's CUDA; found through CUDA_HOME, PATH or /usr/local/cuda) and ninja; or prebuild it: "
                    "DS_BUILD_FUSED_ADAM=1 pip install deepspeed --no-build-isolation --no-cache-dir")


def op_failure(builder: str) -> str | None:
    """Why DeepSpeed's op ``builder`` (``FusedAdamBuilder``, ``CPUAdamBuilder``) cannot be loaded here (its error,
    summarised), or None when it can: the very load DeepSpeed's optimizer makes in its constructor (prebuilt, cached
    in ``TORCH_EXTENSIONS_DIR``, or JIT-built now, as it would be moments later), so the engine finds it loaded."""
    from deepspeed.ops import op_builder
    try:
        getattr(op_builder, builder)().load(verbose=False)
    except Exception as error:  # noqa: BLE001 -- a missing toolkit, a failed build, an incompatible op: the answer
        return error_summary(error)
    return None


def fused_adam_toolkit_missing() -> str | None:
    """What this CUDA machine lacks to build DeepSpeed's FusedAdam, found without building it (for the preflight):
    None where the op is prebuilt, where torch finds a CUDA toolkit with nvcc, or where torch sees no GPU."""
    if not torch.cuda.is_available():
        return None
    from deepspeed.git_version_info import installed_ops
    if installed_ops.get("fused_adam", False):
        return None
    from torch.utils import cpp_extension
    if cpp_extension.CUDA_HOME is None:
        return "no CUDA toolkit found: CUDA_HOME is unset and there is no nvcc on PATH or in /usr/local/cuda"
    if not os.access(os.path.join(cpp_extension.CUDA_HOME, "bin", "nvcc"), os.X_OK):
        return f"the CUDA toolkit at {cpp_extension.CUDA_HOME} has no bin/nvcc"
    return None


_BUILD_PROGRESS = re.compile(r":? \[\d+/\d+\] .*")
_CAUSE_LINE = re.compile(r"error|not found|no such file|fatal|unable|cannot", re.IGNORECASE)


def error_summary(error: BaseException) -> str:
    """One line for a toolchain's exception: its type and first line (without a build log's command lines), and
    the line of the log that names the cause, when there is one (``/bin/sh: 1: g++: not found``, ``nvcc fatal``)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    first = _BUILD_PROGRESS.sub("", lines[0]) if lines else ""
    cause = next((line for line in lines[1:] if _CAUSE_LINE.search(line) and not line.startswith("FAILED:")), None)
    summary = f"{type(error).__name__}: {first}" + (f" ({cause})" if cause else "")
    return summary if len(summary) <= 400 else summary[:399] + "…"


# ------------------------------------------------------------------------------------------- one-machine launch
LOCALHOST_HOSTFILE = "hostfiles/localhost"


def choose_ds_accelerator(environ: MutableMapping[str, str] = os.environ) -> str:
    """``DS_ACCELERATOR`` for the processes this one starts: the user's value when set; ``cpu`` when torch sees no
    GPU (it also silences DeepSpeed's fallback warning); else left unset for DeepSpeed to detect the GPU."""
    if "DS_ACCELERATOR" not in environ and not torch.cuda.is_available():
        environ["DS_ACCELERATOR"] = "cpu"
    return environ.get("DS_ACCELERATOR", "auto")


def local_launch_arguments(environ: MutableMapping[str, str] = os.environ, max_gpus: int | None = None) -> list[str]:
    """``deepspeed`` launcher arguments for a run on this machine alone (no ssh): one rank per visible GPU (at most
    ``max_gpus``), or the two ranks of ``hostfiles/localhost`` on a CPU accelerator."""
    on_cpu = environ.get("DS_ACCELERATOR") == "cpu" or not torch.cuda.is_available()
    gpus = torch.cuda.device_count() if max_gpus is None else min(max_gpus, torch.cuda.device_count())
    where = ["--hostfile", LOCALHOST_HOSTFILE] if on_cpu else ["--num_gpus", str(gpus)]
    return [*where, "--no_ssh_check", "--master_addr", "127.0.0.1"]


# ---------------------------------------------------------------------------------- op builds (TORCH_CUDA_ARCH_LIST)
def deepspeed_arch_list(value: str) -> str:
    """``TORCH_CUDA_ARCH_LIST`` in the form DeepSpeed's op builder parses: ``;``-separated ``X.Y`` or ``X.Y+PTX``.

    Accepts what torch accepts: ``;`` or spaces between entries, arch-specific suffixes (``9.0a``, ``10.0f``:
    dropped, the base ``sm_90`` code runs there; DeepSpeed's ops use no arch-specific instructions), ``+PTX``
    (kept), torch's named architectures (``Hopper`` → ``9.0+PTX``). Duplicates merge (``+PTX`` if any had it),
    sorted ascending as the builder sorts them. Raises ``ValueError`` naming an entry it cannot read.

    >>> deepspeed_arch_list("9.0a")
    '9.0'
    >>> deepspeed_arch_list("8.0 8.6+PTX;9.0a")
    '8.0;8.6+PTX;9.0'
    """
    entries = [entry for entry in re.split(r"[;\s]+", value.strip()) if entry]
    archs: dict[tuple[int, int], bool] = {}
    for entry in entries:
        for token in _NAMED_ARCHES.get(entry, entry).split(";"):
            match = _ARCH.match(token)
            if match is None:
                raise ValueError(f"TORCH_CUDA_ARCH_LIST={value!r}: cannot read {entry!r}; use compute capabilities "
                                 "such as '8.0;9.0' or '9.0+PTX' (nvidia-smi --query-gpu=compute_cap --format=csv)")
            key = (int(match.group(1)), int(match.group(2)))
            archs[key] = archs.get(key, False) or bool(match.group(4))
    if not archs:
        raise ValueError(f"TORCH_CUDA_ARCH_LIST={value!r} names no architecture; unset it or set e.g. '9.0'")
    return ";".join(f"{major}.{minor}{'+PTX' if ptx else ''}" for (major, minor), ptx in sorted(archs.items()))


def apply_deepspeed_arch_list(environ: MutableMapping[str, str] = os.environ) -> str | None:
    """Rewrite ``environ["TORCH_CUDA_ARCH_LIST"]`` for DeepSpeed's builder before any op is built; returns a line
    saying what changed (None when unset or already in that form)."""
    value = environ.get("TORCH_CUDA_ARCH_LIST")
    if value is None or not value.strip():
        return None
    normalised = deepspeed_arch_list(value)
    if normalised == value:
        return None
    environ["TORCH_CUDA_ARCH_LIST"] = normalised
    return (f"TORCH_CUDA_ARCH_LIST={value!r} is not in the form DeepSpeed's op builder parses: building ops for "
            f"{normalised!r} (set TORCH_CUDA_ARCH_LIST=\"{normalised}\" to silence this and to prebuild them)")
