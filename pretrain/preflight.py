"""Check a cluster before a long run: ``make preflight HOSTFILE=... CONFIG=...``.

For the run config and hostfile it verifies, before any rank starts:
  * the DeepSpeed JSON passes the checks training makes of it (``pretrain.engine.read_engine_json``);
  * the global batch splits over the slots the run uses (else the feasible choices are listed);
  * every host is reachable (password-less ssh, as DeepSpeed's launcher needs: with several hosts each one over
    ssh, this machine too, as the launcher reaches them; a hostfile of this machine alone runs in-process);
  * with several hosts, the first (the rendezvous master) is not a loopback name, and every host sees a file
    written where out_dir is (out_dir must be one shared directory);
  * every host runs the same code version (``git describe`` / package version) as this one;
  * every host sees the shards with the same manifest hash (and opens them: sizes, magic, version);
  * every host has free disk for ``keep_last + 1`` checkpoints (≈20 bytes per parameter each, an estimate);
  * every host's ``TORCH_CUDA_ARCH_LIST`` is one DeepSpeed's op builder can read (else the exact value to set);
  * every GPU host can build DeepSpeed's FusedAdam when the JSON uses it (a note otherwise: the run then steps
    with torch's AdamW);
  * a checkpoint can be written within the launcher's SIGTERM grace period (a warning otherwise: see below).

The hosts and slots checked are those DeepSpeed's launcher would use: the whole hostfile, or what its filters
``--include`` / ``--exclude`` (``NAME[:SLOT[,SLOT ...]][@NAME ...]``) or ``--num_nodes N`` leave, resolved by the
launcher's own functions; the first host left is the rendezvous master. ``--active-hosts`` prints those hosts, one
per line, and checks nothing else (``make pretrain`` takes its master address from it).

A host whose ssh connects but stalls is reported as a problem after ``SSH_TIMEOUT_S`` and the other hosts are
still checked.

SIGTERM: the run saves a checkpoint and exits when it gets SIGTERM (a scheduler's preemption), but DeepSpeed's
launcher (0.19.8, ``deepspeed/launcher/launch.py``) forwards SIGTERM to the ranks and SIGKILLs them
``LAUNCHER_GRACE_S`` = 30 s later; the period is fixed in its code, with no setting. A save that takes longer is
cut off (the previous complete checkpoint stays valid, so only the steps since it are lost). The preflight
measures the write speed under ``out_dir`` and warns when the estimated checkpoint time exceeds the period;
then save more often (``train.save_interval``) and stop before the allocation ends with
``train.exit_after_minutes`` instead of relying on SIGTERM, or send SIGTERM to the ranks directly (torchrun
and mpirun do not impose that limit).

    python -m pretrain.preflight --config pretrain/configs/tiny.yaml --hostfile hostfiles/localhost [k=v ...]
    python -m pretrain.preflight --config pretrain/configs/tiny.yaml --local-ranks 8 [k=v ...]   # this machine only
    python -m pretrain.preflight --config CONFIG --hostfile FILE --include 'node-1:0,1@node-2' [k=v ...]
    python -m pretrain.preflight --active-hosts --hostfile FILE --exclude node-1
"""
from __future__ import annotations

import argparse
import ipaddress
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from deepspeed.launcher.runner import apply_num_nodes_and_gpus, parse_inclusion_exclusion

from common.config_loader import config_error
from common.files import sha256_file
from common.paths import REPO_ROOT
from data_prep.shard_format import MANIFEST_NAME, ShardDataset
from pretrain.accelerator import FUSED_ADAM_NEEDS, deepspeed_arch_list, fused_adam_toolkit_missing
from pretrain.batch_plan import InfeasibleBatchError, plan_batch
from pretrain.checkpoint import code_version
from pretrain.config import RunConfig, load_config, resolve_model_config
from pretrain.engine import adam_op, read_engine_json
from pretrain.hf import hf_model_config
from pretrain.setup_checks import model_for_shards
from pretrain.warm_start import checkpoint_marker, is_checkpoint
from pretrain.weight_files import hf_weight_files

# fp32 weights + Adam moments (12) + low-precision copy / slack + safetensors fp32 (4)
CHECKPOINT_BYTES_PER_PARAMETER = 20
SSH_TIMEOUT_S = 120
LAUNCHER_GRACE_S = 30  # deepspeed.launcher.launch.terminate_process_tree: psutil.wait_procs(timeout=30), then kill
WRITE_PROBE_BYTES = 64 * 2**20
LOCAL_NAMES = {"localhost", "127.0.0.1", socket.gethostname(), socket.getfqdn()}
# Host names: dot-separated labels of letters, digits, inner hyphens (RFC 1123) and underscores (ssh config aliases,
# container names), so never an ssh option "-o..." or a shell word
_HOSTNAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
                       r"(?:\.[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?)*$")
_SLOTS = re.compile(r"^slots=([1-9][0-9]{0,3})$")


def valid_host(host: str) -> bool:
    """A host name or an IPv4/IPv6 address: nothing ssh or a shell could read as an option or a command."""
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return bool(_HOSTNAME.match(host))


def read_hostfile(path: str | Path) -> dict[str, int]:
    """``host slots=N`` lines (DeepSpeed's hostfile format; # comments allowed) → {host: slots}.

    Every entry is validated before any host name reaches ssh (here, or DeepSpeed's launcher after ``make
    preflight``): a host name or IP address, 1 ≤ N ≤ 9999, each host once."""
    hosts: dict[str, int] = {}
    if not Path(path).is_file():
        others = sorted(other.name for other in Path(path).parent.glob("*")
                        if other.is_file() and other.suffix not in (".sbatch", ".sh", ".md")) \
            if Path(path).parent.is_dir() else []
        listed = f" ({Path(path).parent} has {', '.join(others)})" if others else ""
        raise ValueError(f"hostfile {path}: {'a directory' if Path(path).is_dir() else 'no such file'}{listed}")
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        slots = _SLOTS.match(parts[1]) if len(parts) == 2 else None
        if slots is None:
            raise ValueError(f"{path}:{number}: expected 'HOST slots=N' (N ≥ 1), got {line!r}")
        if not valid_host(parts[0]):
            raise ValueError(f"{path}:{number}: {parts[0]!r} is not a host name or IP address")
        if parts[0] in hosts:
            raise ValueError(f"{path}:{number}: host {parts[0]!r} listed twice")
        hosts[parts[0]] = int(slots.group(1))
    if not hosts:
        raise ValueError(f"{path}: no hosts")
    return hosts


def active_slots(hostfile: str | Path, include: str = "", exclude: str = "",
                 num_nodes: int = -1) -> dict[str, list[int]]:
    """{host: slot ids} a DeepSpeed launch with this hostfile and filters uses, in hostfile order: DeepSpeed's own
    ``parse_inclusion_exclusion`` and ``apply_num_nodes_and_gpus``, as its launcher resolves them.

    ``include`` / ``exclude``: ``NAME[:SLOT[,SLOT ...]][@NAME ...]`` ("" = none); ``num_nodes``: the first N hosts
    (-1 = all). A filter the launcher refuses (a host not in the hostfile, a slot it does not have, two filters
    together) or one that leaves no slot is a ValueError naming the hostfile and the value."""
    slots = read_hostfile(hostfile)
    given = [f"--{flag} {shlex.quote(str(value))}" for flag, value in
             (("include", include), ("exclude", exclude), ("num_nodes", num_nodes if num_nodes > 0 else ""))
             if value != ""]
    if len(given) > 1:  # the launcher's main() refuses these together before resolving them
        raise ValueError(f"{hostfile}: {' '.join(given)}: give one of --include, --exclude, --num_nodes")
    try:
        active = apply_num_nodes_and_gpus(parse_inclusion_exclusion(slots, include, exclude), num_nodes, -1)
    except ValueError as error:  # DeepSpeed's words, or int() on a malformed slot list
        raise ValueError(f"{hostfile}: {given[0]}: {error} (a filter is NAME[:SLOT[,SLOT ...]][@NAME ...] of the "
                         "hostfile's hosts, slots numbered from 0)") from None
    if not active:
        raise ValueError(f"{hostfile}: {given[0]} leaves no slot to run on")
    return dict(active)


def probe(cfg: RunConfig, shared_file: str | None = None) -> dict[str, Any]:
    """What this host sees: code version, shard manifest hash, ``model.init_from``, free disk under out_dir, and
    whether ``shared_file`` (written under out_dir by the host that runs the preflight) is there."""
    report: dict[str, Any] = {"host": socket.gethostname(), "code_version": code_version()}
    if shared_file is not None:
        report["sees_shared_file"] = Path(shared_file).is_file()
    try:
        ShardDataset(cfg.data.shards)
        report["manifest_hash"] = sha256_file(Path(cfg.data.shards) / MANIFEST_NAME)
    except Exception as error:  # reported, not raised: the caller lists every host's problems
        report["shards_error"] = str(error)
    target = existing_ancestor(Path(cfg.out_dir))
    if cfg.model.init_from:  # every rank reads it
        try:
            if is_checkpoint(cfg.model.init_from):  # this pipeline's checkpoint: every file there, of its size
                checkpoint_marker(cfg.model.init_from)
            else:
                hf_model_config(cfg.model.init_from)
                hf_weight_files(cfg.model.init_from)
        except (OSError, ValueError) as error:
            report["init_from_error"] = str(error)
    report["free_bytes"] = shutil.disk_usage(target).free
    report["cuda_arch_list"] = os.environ.get("TORCH_CUDA_ARCH_LIST")
    try:
        if adam_op(read_engine_json(cfg.deepspeed_config_path)) == "FusedAdamBuilder":
            report["fused_adam_missing"] = fused_adam_toolkit_missing()
    except (OSError, ValueError):  # the JSON's own check reports it
        pass
    report["write_bytes_per_s"] = write_speed(target)
    return report


def existing_ancestor(path: Path) -> Path:
    """``path`` resolved, or its nearest ancestor that exists (where a new out_dir will be created)."""
    target = path.resolve()
    while not target.exists():
        target = target.parent
    return target


def arch_list_note(value: str | None) -> tuple[str | None, bool]:
    """(what to tell about a host's ``TORCH_CUDA_ARCH_LIST``, whether it is a problem). A value DeepSpeed's builder
    cannot parse but the trainer rewrites (``9.0a``) is a note with the value to set; an unreadable one a problem."""
    if value is None or not value.strip():
        return None, False
    try:
        normalised = deepspeed_arch_list(value)
    except ValueError as error:
        return str(error), True
    if normalised == value:
        return None, False
    return (f"TORCH_CUDA_ARCH_LIST={value!r} cannot be parsed by DeepSpeed's op builder; the trainer builds for "
            f"{normalised!r}. Set TORCH_CUDA_ARCH_LIST=\"{normalised}\" (e.g. in .deepspeed_env) to prebuild "
            "ops"), False



def write_speed(directory: Path, size: int = WRITE_PROBE_BYTES) -> float | None:
    """Bytes per second of one fsync'ed write of ``size`` bytes into ``directory`` (None if it cannot write)."""
    import os
    import tempfile
    import time

    block = os.urandom(1 << 20)
    try:
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".preflight-write-") as handle:
            started = time.perf_counter()
            for _ in range(size // len(block)):
                handle.write(block)
            handle.flush()
            os.fsync(handle.fileno())
            return size / max(time.perf_counter() - started, 1e-9)
    except OSError:
        return None


def sigterm_save_warning(checkpoint_size: int, write_bytes_per_s: float | None, host: str) -> str | None:
    """A warning when writing one checkpoint at the measured speed may outlast the launcher's grace period."""
    if not write_bytes_per_s:
        return None
    seconds = checkpoint_size / write_bytes_per_s
    if seconds <= LAUNCHER_GRACE_S:
        return None
    return (f"{host}: a checkpoint (~{checkpoint_size / 2**30:.1f} GiB at {write_bytes_per_s / 2**20:.0f} MiB/s "
            f"measured) takes ~{seconds:.0f} s, longer than the {LAUNCHER_GRACE_S} s the deepspeed launcher waits "
            "after SIGTERM before SIGKILL: a preempted run loses the steps since its last checkpoint. Set "
            "train.save_interval to bound that loss and train.exit_after_minutes to stop before the allocation ends")


def checkpoint_bytes(cfg: RunConfig) -> int:
    model_cfg = resolve_model_config(cfg)
    h, layers, vocab = model_cfg.hidden_size, model_cfg.num_layers, model_cfg.vocab_size
    parameters = (layers * (4 * h * h + 2 * h * model_cfg.intermediate_size)
                  + (vocab + model_cfg.max_position_embeddings) * h)
    return CHECKPOINT_BYTES_PER_PARAMETER * parameters


def remote_probe(host: str, config: str, overrides: list[str], shared_file: str | None = None) -> dict[str, Any]:
    command = (f"cd {shlex.quote(str(REPO_ROOT))} && {shlex.quote(sys.executable)} -m pretrain.preflight --probe "
               f"--config {shlex.quote(config)} "
               + (f"--shared-file {shlex.quote(shared_file)} " if shared_file else "")
               + " ".join(shlex.quote(o) for o in overrides))
    try:
        result = subprocess.run(["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10", host, command],
                                capture_output=True, text=True, timeout=SSH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"host": host, "unreachable": f"ssh connected but gave no answer within {SSH_TIMEOUT_S} s (stalled)"}
    if result.returncode != 0:
        return {"host": host, "unreachable": (result.stderr or result.stdout).strip()[-500:]}
    try:
        return json.loads(result.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"host": host, "unreachable": f"no probe report in its answer ({result.stdout[-200:]!r})"}


def preflight(config: str, overrides: list[str], hostfile: str | None, local_ranks: int = 1, include: str = "",
              exclude: str = "", num_nodes: int = -1, cfg: RunConfig | None = None) -> list[str]:
    """Problems found (empty = ready). Without a hostfile: this machine alone with ``local_ranks`` ranks. With
    one, the hosts and slots ``include`` / ``exclude`` / ``num_nodes`` leave (``active_slots``). ``cfg``: the run
    config ``config`` and ``overrides`` make, where the caller has read it already; each other host reads it."""
    cfg = cfg if cfg is not None else load_config(config, overrides)
    filtered = bool(include or exclude or num_nodes > 0)
    if hostfile:
        hosts = active_slots(hostfile, include, exclude, num_nodes)
    elif filtered:
        raise ValueError("--include, --exclude and --num_nodes choose among a hostfile's hosts: give --hostfile")
    else:
        hosts = {"localhost": list(range(local_ranks))}
    world = sum(len(slots) for slots in hosts.values())
    problems = []
    try:  # what training checks of the file; whether the GPUs have its precision, each rank checks as it starts
        read_engine_json(cfg.deepspeed_config_path)
    except FileNotFoundError:
        problems.append(f"DeepSpeed config {cfg.deepspeed_config} not found")
    except OSError as error:
        problems.append(f"DeepSpeed config {cfg.deepspeed_config}: cannot read it ({error.strerror})")
    except ValueError as error:
        problems.append(f"DeepSpeed config {error}")
    try:
        plan = plan_batch(cfg.train.global_batch_size, cfg.train.micro_batch_size, world)
        print(f"[preflight] {len(hosts)} host(s), {world} ranks: {plan}")
    except InfeasibleBatchError as error:
        problems.append(str(error))
    local = probe(cfg)
    if "shards_error" not in local and "init_from_error" not in local:  # those are reported per host below
        try:
            model_for_shards(cfg, ShardDataset(cfg.data.shards))
        except (ValueError, OSError) as error:
            problems.append(str(error))
    try:
        checkpoint_size = checkpoint_bytes(cfg)
    except (OSError, ValueError):  # an unreadable model.init_from: each host's probe names it
        checkpoint_size = None
    needed = (cfg.train.keep_last + 1) * (checkpoint_size or 0)
    several = len(hosts) > 1
    first = next(iter(hosts))
    if several and (first == "localhost" or _loopback(first)):
        first_host = "the first host the filter leaves" if filtered else "its first host"
        problems.append(f"{hostfile}: {first_host}, {first}, is where every rank meets rank 0 (the launcher's "
                        f"master_addr), but from another host {first} is that host itself: list this machine by a "
                        f"name the others reach (e.g. {socket.gethostname()}), or launch with --master_addr NAME")
    # the directory out_dir is in (or will be): a file written there must be visible to every host
    shared_file = None
    if several:
        shared_file = existing_ancestor(Path(cfg.out_dir)) / f".preflight-shared-{os.getpid()}-{time.time_ns()}"
        try:
            shared_file.write_text("")
        except OSError:
            shared_file = None
    try:
        for host in hosts:
            # several hosts: DeepSpeed's launcher reaches each over ssh (pdsh), this machine too, so does the probe
            report = local if host in LOCAL_NAMES and not several else \
                remote_probe(host, config, overrides, str(shared_file) if shared_file else None)
            check_host(host, report, local, cfg, needed, checkpoint_size, problems)
    finally:
        if shared_file is not None:
            shared_file.unlink(missing_ok=True)
    return problems


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_host(host: str, report: dict[str, Any], local: dict[str, Any], cfg: RunConfig, needed: int,
               checkpoint_size: int | None, problems: list[str]) -> None:
    """Add what ``host``'s probe report shows wrong to ``problems``; print ok or notes otherwise."""
    problems_before = len(problems)
    if "unreachable" in report:
        problems.append(f"{host}: not reachable by ssh ({report['unreachable']})")
        return
    if "config_error" in report:
        problems.append(f"{host}: {report['config_error']} (every host reads the run config at the same path, in "
                        "its checkout of the same code)")
        return
    if report.get("sees_shared_file") is False:
        problems.append(f"{host}: does not see the file the preflight wrote in out_dir {cfg.out_dir}'s directory: "
                        "out_dir must be one shared directory, at the same path, on every host (each rank writes "
                        "its part of every checkpoint there)")
    note, is_problem = arch_list_note(report.get("cuda_arch_list"))
    if note is not None:
        if is_problem:
            problems.append(f"{host}: {note}")
        else:
            print(f"[preflight] {host}: {note}")
    if report.get("fused_adam_missing"):
        print(f"[preflight] {host}: DeepSpeed's FusedAdam is not prebuilt and cannot be built here "
              f"({report['fused_adam_missing']}): the run steps with torch's AdamW, the same update unfused (or "
              "stops, where the JSON sets torch_adam false). "
              f"For the fused one: {FUSED_ADAM_NEEDS}")
    if report["code_version"] != local["code_version"]:
        problems.append(f"{host}: code version {report['code_version']} != {local['code_version']} here")
    if "init_from_error" in report:
        problems.append(f"{host}: model.init_from: {report['init_from_error']}")
    if "shards_error" in report:
        problems.append(f"{host}: shards {cfg.data.shards}: {report['shards_error']}")
    elif report["manifest_hash"] != local.get("manifest_hash"):
        problems.append(f"{host}: shards {cfg.data.shards} differ from this host's (manifest hash)")
    warning = sigterm_save_warning(checkpoint_size or 0, report.get("write_bytes_per_s"), host)
    if warning is not None:
        print(f"[preflight] WARNING: {warning}", file=sys.stderr)
    if report["free_bytes"] < needed:
        problems.append(f"{host}: {report['free_bytes'] / 2**30:.1f} GiB free under {cfg.out_dir}, "
                        f"need ~{needed / 2**30:.1f} GiB for {cfg.train.keep_last + 1} checkpoints")
    if len(problems) == problems_before:
        print(f"[preflight] {host}: ok (code {report['code_version']}, "
              f"{report['free_bytes'] / 2**30:.0f} GiB free)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pretrain.preflight", description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=None, help="run config (required, except with --active-hosts)")
    parser.add_argument("--hostfile", default=None, help="DeepSpeed hostfile (default: this machine only)")
    parser.add_argument("--local-ranks", type=int, default=1,
                        help="ranks on this machine when there is no hostfile (make pretrain: one per GPU)")
    # the hostfile filters, spelt as deepspeed's launcher spells them (make pretrain passes one string to both)
    parser.add_argument("--include", default="", help="only these hosts/slots of the hostfile: "
                        "NAME[:SLOT[,SLOT ...]][@NAME ...], as deepspeed --include")
    parser.add_argument("--exclude", default="", help="all but these hosts/slots, as deepspeed --exclude")
    parser.add_argument("--num_nodes", type=int, default=-1, help="the hostfile's first N hosts, as deepspeed")
    parser.add_argument("--active-hosts", action="store_true",
                        help="print the hosts the filters leave, one per line (the first is the rendezvous "
                             "master), and check nothing else")
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)  # run on each host over ssh
    parser.add_argument("--shared-file", default=None, help=argparse.SUPPRESS)  # with --probe: is it there?
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    if args.probe:
        try:
            cfg = load_config(args.config, args.overrides)
        except (ValueError, OSError) as error:  # the config as this host reads it: missing there, or another one
            report = {"host": socket.gethostname(), "config_error": config_error(args.config, error, args.overrides)}
        else:
            report = probe(cfg, args.shared_file)
        print(json.dumps(report))
        return 0
    if args.local_ranks < 1:
        parser.error(f"--local-ranks must be >= 1, got {args.local_ranks}")
    if args.num_nodes != -1 and args.num_nodes < 1:
        parser.error(f"--num_nodes must be >= 1, got {args.num_nodes}")
    if args.active_hosts:
        if not args.hostfile:
            parser.error("--active-hosts needs --hostfile")
        try:
            hosts = active_slots(args.hostfile, args.include, args.exclude, args.num_nodes)
        except (ValueError, OSError) as error:
            print(f"[preflight] PROBLEM: {error}", file=sys.stderr)
            return 2
        print("\n".join(hosts))
        return 0
    if args.config is None:
        parser.error("the following arguments are required: --config")
    try:  # once: a config read from a pipe (/dev/fd/N) can be read only once
        cfg = load_config(args.config, args.overrides)
    except (ValueError, OSError) as error:  # the config itself (a missing file, a misspelt key, a bad value)
        print(f"[preflight] PROBLEM: {config_error(args.config, error, args.overrides)}", file=sys.stderr)
        return 2
    try:
        problems = preflight(args.config, args.overrides, args.hostfile, args.local_ranks, args.include,
                             args.exclude, args.num_nodes, cfg=cfg)
    except (ValueError, OSError) as error:  # the hostfile, say
        print(f"[preflight] PROBLEM: {error}", file=sys.stderr)
        return 2
    for problem in problems:
        print(f"[preflight] PROBLEM: {problem}", file=sys.stderr)
    print("[preflight] ready" if not problems else f"[preflight] {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
