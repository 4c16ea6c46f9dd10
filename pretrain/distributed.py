"""The process group every rank of a run joins, and how ranks act as one: the launcher's environment (SLURM, MPI,
torchrun, DeepSpeed), rank helpers, one rank speaking for all (`say_once`), a setup step every rank takes together
(`on_every_rank`), and the diagnosed stops (`RunStopped`) raised alike on every rank."""
from __future__ import annotations

import datetime
import logging
import os
import re
import socket
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import deepspeed
import torch.distributed as torch_dist

from pretrain.accelerator import apply_deepspeed_arch_list, bind_local_device, local_rank
from pretrain.kernels import retain_freed_memory

log = logging.getLogger(__name__)


class RunStopped(RuntimeError):
    """A diagnosed stop, not a crash: entry points print the message without a traceback (`say_once`) and exit
    with ``exit_code``. Raised alike on every rank: each is raised after the ranks agree on it in a collective
    (`first_error`, `on_every_rank`, the step's reduced loss and gradient norm)."""
    exit_code = 1


class SetupError(RunStopped):
    """A setting, shard set, initial model or checkpoint the run cannot use, found before the first step: said in
    one line (the message names the file or key and the fix), exit code 2 as for a bad config."""
    exit_code = 2


class NonFiniteLossError(RunStopped):
    """A NaN/inf loss or gradient (fp32/bf16): the run stops without saving, leaving the last checkpoint intact."""
    exit_code = 3



class PeerLostError(RunStopped):
    """A collective failed because a rank stopped answering (it died, its node vanished, or it hung past
    ``train.collective_timeout_s``): raised on the ranks that are left, each saying it itself (the others cannot
    agree on it in a collective). Exit code 5, so an elastic launch restarts on the ranks left."""
    exit_code = 5


LOST_PEER_SIGNS = ("timed out", "timeout", "connection closed", "connection reset", "broken pipe",
                   "connection refused", "nccl communicator was aborted", "socket closed", "read error")
"""Lower-case fragments of the messages gloo and NCCL raise when a collective's peer died or did not answer in
time (gloo: ``Timed out waiting 120000ms for recv operation``, ``Connection closed by peer``)."""


def is_lost_peer(error: BaseException) -> bool:
    """Whether ``error``, raised inside a collective, says a peer died or stopped answering."""
    return isinstance(error, RuntimeError) and any(sign in str(error).lower() for sign in LOST_PEER_SIGNS)


def set_collective_timeout(seconds: float) -> None:
    """Give every process group of this rank (the world's and those DeepSpeed made for ZeRO) a timeout of
    ``seconds``: a collective that waits longer for a rank fails instead of hanging (gloo raises; NCCL's watchdog
    aborts the group and ends the process, ``TORCH_NCCL_ASYNC_ERROR_HANDLING``). Set once the run is set up:
    converting and loading a checkpoint may legitimately keep ranks waiting longer."""
    from torch.distributed import distributed_c10d  # the groups' registry and timeout setter are not public API

    for group in list(distributed_c10d._world.pg_map):
        distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=seconds), group)


def lost_peer_error(error: BaseException, where: str, timeout_s: float, window_s: float = 5.0) -> PeerLostError:
    """The `PeerLostError` of ``error`` (`is_lost_peer`), raised in ``where`` (``step 7``): names the ranks that
    stopped answering. Each rank left reports its failure to the launcher's store and waits up to ``window_s`` for
    the others' reports; the ranks that never report are the ones lost (a rank that hung past the timeout, or died)."""
    rank, world_size = torch_dist.get_rank(), torch_dist.get_world_size()
    silent: list[int] | None = None
    try:
        from torch.distributed import distributed_c10d  # the default group's store: private API, best effort

        store = distributed_c10d._get_default_store()
        store.set_timeout(datetime.timedelta(seconds=window_s))
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        keys = [f"unilm/lost_peer/{attempt}/{other}" for other in range(world_size)]
        store.set(keys[rank], where)
        deadline = time.monotonic() + window_s
        while True:
            silent = [other for other, key in enumerate(keys) if not store.check([key])]
            if not silent or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    except Exception:  # the store lived with a lost rank: say what this rank knows
        silent = None
    kind = "did not answer within train.collective_timeout_s" \
        if any(sign in str(error).lower() for sign in ("timed out", "timeout")) else "closed its connection"
    who = (f"rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))} stopped answering" if silent
           else "a peer stopped answering")
    first_line = str(error).strip().splitlines()[0][:300] if str(error).strip() else type(error).__name__
    return PeerLostError(
        f"{where}: {who} (rank {rank} on {socket.gethostname()} saw a collective fail: a peer {kind}"
        f"{f' of {timeout_s:g} s' if 'within' in kind else ''}; {first_line}). The last complete checkpoint is "
        "intact: an elastic launch (make pretrain MAX_RESTARTS=N) restarts from it on the ranks left; otherwise "
        "rerun the same command")



# ------------------------------------------------------------------------------------------- process group
def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``gpu-[007-010,12],cpu1`` → ``gpu-007`` (what ``scontrol show
    hostnames`` lists first)."""
    depth, end = 0, len(nodelist)
    for position, char in enumerate(nodelist):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            end = position
            break
    return re.sub(r"\[([^\]]*)\]", lambda ranges: ranges.group(1).split(",")[0].split("-")[0], nodelist[:end])


def slurm_task_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """torch.distributed's variables for a rank that ``srun`` started as one of the step's tasks (one task per
    rank: ``srun --ntasks-per-node=8 python pretrain/train.py ...``), or {} when a launcher already set
    ``RANK``/``WORLD_SIZE`` (DeepSpeed's, torchrun, or ``hostfiles/slurm.sbatch``'s one task per node) or srun
    started a single task. RANK, WORLD_SIZE and LOCAL_RANK come from ``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS``
    (set by srun only, not by sbatch: a plain ``python`` in a batch script stays a 1-rank run) and
    ``SLURM_LOCALID``; ``MASTER_ADDR``, unless set, is the step's first node, where task 0 runs; ``MASTER_PORT``,
    unless set, is derived from the job id (`SLURM_PORTS`), so two jobs sharing a node do not collide."""
    tasks, task = environ.get("SLURM_STEP_NUM_TASKS", ""), environ.get("SLURM_PROCID", "")
    if ("RANK" in environ and "WORLD_SIZE" in environ) or not (tasks.isdigit() and task.isdigit()) or int(tasks) < 2:
        return {}
    mpi_size, mpi_rank = mpi_environment(environ)
    if (mpi_size is not None and mpi_size != tasks) or (mpi_rank is not None and mpi_rank != task):
        return {}  # mpirun inside an allocation: its ranks inherit the srun step of its per-node daemons
    values = {"RANK": task, "WORLD_SIZE": tasks, "LOCAL_RANK": environ.get("SLURM_LOCALID", "0")}
    if "MASTER_ADDR" not in environ:
        nodes = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
        if not nodes:
            raise RuntimeError("srun started this rank (SLURM_STEP_NUM_TASKS set) without SLURM_STEP_NODELIST or "
                               "SLURM_JOB_NODELIST: set MASTER_ADDR to the host of task 0")
        values["MASTER_ADDR"] = first_slurm_host(nodes)
    if "MASTER_PORT" not in environ:
        job = environ.get("SLURM_JOB_ID", "")
        values["MASTER_PORT"] = str(SLURM_PORTS[int(job) % len(SLURM_PORTS)]) if job.isdigit() else "29500"
    return values


SLURM_PORTS = range(20000, 32000)
"""Where a SLURM job's derived ``MASTER_PORT`` falls: below Linux's ephemeral ports (32768–60999 by default), which
the kernel hands out to outgoing connections, so the port is free when rank 0 binds it."""


MPI_SIZE_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
MPI_RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")


def mpi_environment(environ: Mapping[str, str]) -> tuple[str | None, str | None]:
    """(world size, rank) as an MPI launcher gives them to its ranks (OpenMPI's mpirun, MPICH/Intel MPI's
    mpiexec, srun's PMI), each None where it gives none."""
    size = next((environ[v] for v in MPI_SIZE_VARIABLES if v in environ), None)
    rank = next((environ[v] for v in MPI_RANK_VARIABLES if v in environ), None)
    return size, rank


def launched_rank(environ: Mapping[str, str]) -> int:
    """This process's rank as its launcher set it, before the process group exists (0 when none did): to let one
    rank speak for all before then."""
    for value in (environ.get("RANK"), mpi_environment(environ)[1], environ.get("SLURM_PROCID")):
        if value is not None and value.isdigit():
            return int(value)
    return 0


def init_distributed() -> tuple[int, int]:
    """Join the process group of whichever launcher started us: DeepSpeed's, torchrun, mpirun (DeepSpeed's MPI
    discovery) or ``srun`` with one task per rank (`slurm_task_environment`); plain ``python`` becomes a 1-rank
    group. Returns (rank, world size).

    First binds the rank's device (``LOCAL_RANK``, `pretrain.accelerator.bind_local_device`) and puts
    ``TORCH_CUDA_ARCH_LIST`` in the form DeepSpeed's op builder reads; on a CPU-only machine keeps freed memory in
    the process instead (`pretrain.kernels.retain_freed_memory`). Once joined, a second call only returns them."""
    if torch_dist.is_initialized() and deepspeed.comm.is_initialized():
        return torch_dist.get_rank(), torch_dist.get_world_size()
    os.environ.update(slurm_task_environment(os.environ))
    device = bind_local_device()
    if device.type == "cpu":
        retain_freed_memory()
    arch_note = apply_deepspeed_arch_list()
    if arch_note and local_rank() == 0:
        log.warning(f"[ops] {arch_note}")

    launched = all(k in os.environ for k in ("RANK", "WORLD_SIZE")) or mpi_environment(os.environ)[0] is not None
    if not launched:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
    # a collective that fails or times out on a GPU ends the process instead of leaving it waiting (NCCL's
    # watchdog), so an elastic agent sees the failure and restarts (train.collective_timeout_s)
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    # under mpirun DeepSpeed's MPI discovery sets MASTER_PORT from this argument
    deepspeed.init_distributed(auto_mpi_discovery=True, verbose=False,
                               distributed_port=int(os.environ.get("MASTER_PORT", 29500)))
    if device.type == "cpu":
        unlink_shared_memory_names()
    return torch_dist.get_rank(), torch_dist.get_world_size()


def unlink_shared_memory_names(maps: Path = Path("/proc/self/maps")) -> list[str]:
    """Remove the /dev/shm names of the buffers DeepSpeed's CPU all-reduce maps (a collective on CPU ranks).

    When all ranks share one machine, each creates a POSIX shared-memory buffer (66 MB,
    ``/dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>``) and maps every other rank's; DeepSpeed never
    unlinks them, so every run on a new port left ``world size × 66 MB`` of RAM in /dev/shm until reboot. Once every
    rank has mapped every buffer (the barrier), the names are removed: the mappings stay valid and the memory is
    freed when the last rank exits. Returns the names removed here."""
    try:
        fields = [line.split(maxsplit=5) for line in maps.read_text().splitlines()]
    except OSError:
        fields = []
    mapped = sorted({f[5] for f in fields if len(f) == 6 and f[5].startswith("/dev/shm/deepspeed_")
                     and not f[5].endswith(" (deleted)")})
    if torch_dist.get_world_size() > 1:
        torch_dist.barrier()
    removed = []
    for name in mapped:
        try:
            os.unlink(name)
            removed.append(name)
        except FileNotFoundError:  # another rank removed it first
            pass
    return removed


def close_distributed() -> None:
    """Destroy the process group at the end of a command that completed on every rank (its ``__main__``): a
    process leaving it to interpreter shutdown can abort there ("terminate called without an active exception",
    SIGABRT) while gloo's worker threads still hold work — a finished run reported as failed. Not after an error:
    destroying while other ranks are inside a collective can hang. Hence the barrier first: ranks leave their last
    collective at different times, and on torch 2.6 a 4-rank gloo group whose ranks destroyed it as they came hung
    in every run (6 of 6; with the barrier 1 of 10; torch 2.11 and 2.13 never hung)."""
    if torch_dist.is_available() and torch_dist.is_initialized():
        torch_dist.barrier()
        torch_dist.destroy_process_group()
        # Groups DeepSpeed still references keep their gloo worker threads; a worker releasing the last
        # collective's tensors takes the GIL, and one that asks for it while the interpreter finalizes aborts the
        # process the same way. Give up the GIL briefly so they finish now.
        time.sleep(0.1)


def gather_objects(value: Any) -> list[Any]:
    """``value`` of every rank, in rank order (a collective: every rank calls it)."""
    gathered: list[Any] = [None] * torch_dist.get_world_size()
    torch_dist.all_gather_object(gathered, value)
    return gathered


def first_error(error: Any) -> Any:
    """The first ``error`` that is not None over the ranks, in rank order (a collective, and a barrier): what
    one rank hit before a collective stops every rank, instead of leaving the others waiting in it."""
    if not (torch_dist.is_initialized() and torch_dist.get_world_size() > 1):
        return error
    return next((e for e in gather_objects(error) if e is not None), None)


def say_once(message: str, level: int = logging.WARNING) -> None:
    """Log ``message`` on rank 0 only (a warning: the console's stderr, `pretrain.console`): for what every rank knows
    alike (a `RunStopped`, a setting every rank read), said once rather than once per rank. Before the process group
    exists, the launcher's rank."""
    rank = torch_dist.get_rank() if torch_dist.is_available() and torch_dist.is_initialized() \
        else launched_rank(os.environ)
    if rank == 0:
        log.log(level, message)


def on_every_rank(action: Callable[[], Any]) -> Any:
    """``action()`` on this rank as one step of a setup every rank takes together (a collective): a ValueError or
    OSError it raises on any rank stops every rank here with a `SetupError` (the lowest such rank's message, which
    names its rank and host when that is not rank 0), so no rank goes on into a collective the others have left
    (across nodes, no launcher would stop them: they would wait for the collective's timeout)."""
    result, error = None, None
    try:
        result = action()
    except (ValueError, OSError) as exc:
        rank = torch_dist.get_rank() if torch_dist.is_initialized() else 0
        error = str(exc) if rank == 0 else f"{exc} (rank {rank} on {socket.gethostname()})"
    error = first_error(error)
    if error is not None:
        raise SetupError(error)
    return result

