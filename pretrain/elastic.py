"""Recovery from a lost rank or node: torch elastic's agent and rendezvous restart the run, this module launches them
and keeps the record.

    python -m pretrain.elastic --max-restarts 2 --nproc-per-node 8 --nodes 4 --min-nodes 3 \\
        --endpoint node-1:29400 -- pretrain/train.py --config pretrain/configs/unilm-large.yaml

runs ``torchrun`` (`torchrun_command`) on this host: one agent, whose workers are the node's ranks. Every host of
the run starts the same command (``make pretrain MAX_RESTARTS=N`` does, over pdsh). When a rank dies or hangs past
``train.collective_timeout_s`` (`pretrain.distributed.PeerLostError`) or a node disappears, each agent left stops
its workers, the agents that are left (at least ``--min-nodes``) meet again at the rendezvous and start
`pretrain.train` anew, which resumes from the newest complete checkpoint (converted when the world size changed;
``train.on_world_change`` says what becomes of the batch), up to ``--max-restarts`` times.

The restarted run writes one JSON line per recovery to ``out_dir/restarts.jsonl`` (`Recovery`): when, the world
and hosts before and after, the step resumed from, the steps redone and the seconds lost.
"""
from __future__ import annotations

import argparse
import collections
import datetime
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

RESTARTS_FILE = "restarts.jsonl"
RENDEZVOUS_CONF = {"last_call_timeout": 15, "keep_alive_interval": 2, "keep_alive_max_attempt": 3,
                   "join_timeout": 600}
"""torch elastic's rendezvous settings (seconds): once ``--min-nodes`` agents have met, the round waits
``last_call_timeout`` for the rest (so a start whose hosts come up a few seconds apart begins with all of them); an
agent silent for ``keep_alive_interval`` × ``keep_alive_max_attempt`` counts as gone, so the hosts left meet again
without it; the first round waits ``join_timeout`` for ``--min-nodes`` agents."""


AGENT_ENVIRONMENT = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
"""Set for the agent: each start of the ranks meets in a store of its own, served by its rank 0 on a new
``MASTER_PORT``, instead of the agent's store, which torch elastic keeps on one port for every restart with the
keys of the start before. Restarted ranks reading those keys take the lost group's gloo addresses for their own:
on one host with a rank killed from outside, the restarted ranks hung in the default group's connection setup or
failed in DeepSpeed's ``new_group`` with ``Connection refused``. (The lost-peer report of the ranks left,
`pretrain.distributed.lost_peer_error`, goes to this store: when rank 0 itself is lost, the others name no rank.)"""


def torchrun_command(script: list[str], max_restarts: int, nproc_per_node: int, nodes: int, min_nodes: int,
                     endpoint: str, run_id: str, rendezvous_conf: dict[str, Any] | None = None) -> list[str]:
    """The torchrun (torch elastic agent) command of one host: ``nproc_per_node`` workers running ``script``
    (a path and its arguments), restarted up to ``max_restarts`` times, meeting the other hosts' agents at
    ``endpoint`` (``HOST:PORT``, served by the agent on that host: the first host) under ``run_id``."""
    if not 1 <= min_nodes <= nodes:
        raise ValueError(f"need 1 <= MIN_NODES <= the number of hosts ({nodes}), got {min_nodes}")
    if max_restarts < 0:
        raise ValueError(f"MAX_RESTARTS must be >= 0, got {max_restarts}")
    conf = dict(RENDEZVOUS_CONF, **(rendezvous_conf or {}))
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={min_nodes}:{nodes}",
            f"--nproc-per-node={nproc_per_node}", f"--max-restarts={max_restarts}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}",
            "--rdzv-conf=" + ",".join(f"{key}={value}" for key, value in conf.items()),
            "--monitor-interval=0.5", *script]


# ------------------------------------------------------------------------------------------------ the record
def restart_count(environ: dict[str, str] | os._Environ[str] = os.environ) -> int | None:
    """How many times torch elastic's agent restarted this run's workers (0 at the first start), or None when no
    elastic agent started this process."""
    value = environ.get("TORCHELASTIC_RESTART_COUNT")
    return int(value) if value is not None and value.isdigit() else None


def host_changes(before: list[str], after: list[str]) -> tuple[list[str], list[str]]:
    """(hosts left, hosts joined) between two lists of one host name per rank: a host that lost some of its ranks
    is named once per rank lost."""
    old, new = collections.Counter(before), collections.Counter(after)
    return sorted((old - new).elements()), sorted((new - old).elements())


class Recovery:
    """Rank 0's record of one recovery, begun when the restarted run is set up (before ``metrics.jsonl`` drops the
    steps to redo) and written to ``restarts.jsonl`` once its first optimizer step is done (`finish`)."""

    def __init__(self, out_dir: Path, record: dict[str, Any], failed_at: float | None) -> None:
        self.path, self.record, self.failed_at = out_dir / RESTARTS_FILE, record, failed_at

    @classmethod
    def begin(cls, out_dir: Path, resume_meta: dict[str, Any] | None, resumed_from: str | None, world_size: int,
              hosts: list[str], batch_note: str | None,
              environ: dict[str, str] | os._Environ[str] = os.environ) -> Recovery | None:
        """The recovery this start is, or None: a start of an elastic agent's restarted workers, or one whose world
        differs from its checkpoint's under an elastic agent (a host joined, which restarts the workers without
        counting it as a restart)."""
        from pretrain.metrics import read_metrics  # (deepspeed's import: not for the launcher's command)

        restarts = restart_count(environ)
        saved_world = resume_meta.get("world_size") if resume_meta else None
        if restarts is None or (restarts == 0 and saved_world in (None, world_size)):
            return None
        metrics_path = out_dir / "metrics.jsonl"
        steps = [r["step"] for r in read_metrics(metrics_path) if "loss" in r] if metrics_path.exists() else []
        failed_at = metrics_path.stat().st_mtime if metrics_path.exists() else None  # the last progress record
        resume_step = int(resume_meta.get("step", 0)) if resume_meta else 0
        hosts_before = list(resume_meta.get("hosts") or []) if resume_meta else []
        left, joined = host_changes(hosts_before, hosts) if hosts_before else ([], [])
        record = {"restart": restarts, "world_size_before": saved_world, "world_size_after": world_size,
                  "hosts_before": hosts_before, "hosts_after": hosts, "hosts_left": left, "hosts_joined": joined,
                  "resumed_from": resumed_from, "resume_step": resume_step,
                  "last_logged_step": max(steps, default=0),
                  "steps_redone": max(0, max(steps, default=0) - resume_step)}
        if batch_note:
            record["batch"] = batch_note
        return cls(out_dir, record, failed_at)

    def finish(self, step: int) -> dict[str, Any]:
        """Complete the record after optimizer step ``step``, the first since the restart: the seconds lost run
        from the last progress record before the failure to now. Appends it to ``restarts.jsonl`` and says it."""
        now = time.time()
        record = {"time": datetime.datetime.fromtimestamp(now, datetime.timezone.utc).isoformat(timespec="seconds"),
                  **self.record, "first_step_after": step,
                  "seconds_lost": round(now - self.failed_at, 1) if self.failed_at is not None else None}
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        who = (f"; hosts left: {', '.join(record['hosts_left'])}" if record["hosts_left"] else "") \
            + (f"; hosts joined: {', '.join(record['hosts_joined'])}" if record["hosts_joined"] else "")
        log.info(f"[recovery] restart {record['restart']}: world {record['world_size_before']} -> "
                 f"{record['world_size_after']} ranks{who}; resumed from step {record['resume_step']} "
                 f"({record['resumed_from']}), {record['steps_redone']} step(s) redone, "
                 f"{record['seconds_lost']} s lost from the last step logged before the failure to step {step} "
                 f"(recorded in {self.path})")
        return record


def read_restarts(out_dir: str | Path) -> list[dict[str, Any]]:
    """The recoveries of a run (``restarts.jsonl``), oldest first; none when it has not recovered."""
    from pretrain.metrics import read_metrics

    path = Path(out_dir) / RESTARTS_FILE
    return read_metrics(path) if path.exists() else []


# ------------------------------------------------------------------------------------------------ entry point
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pretrain.elastic", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--max-restarts", type=int, required=True, help="restarts of the run after a failure")
    parser.add_argument("--nproc-per-node", type=int, required=True, help="ranks on this host")
    parser.add_argument("--nodes", type=int, default=1, help="hosts of the run (each runs this command)")
    parser.add_argument("--min-nodes", type=int, default=None,
                        help="hosts the run may shrink to and go on with (default: all of them)")
    parser.add_argument("--endpoint", default="127.0.0.1:29400",
                        help="HOST:PORT of the rendezvous, served by the agent on that host (the first host)")
    parser.add_argument("--run-id", default="unilm", help="the rendezvous id: the same on every host of one run")
    parser.add_argument("--rendezvous-conf", default="", help="KEY=VALUE,... over the rendezvous settings "
                        f"({', '.join(f'{k}={v}' for k, v in RENDEZVOUS_CONF.items())})")
    parser.add_argument("script", nargs=argparse.REMAINDER, help="-- pretrain/train.py --config YAML [key=value ...]")
    args = parser.parse_args(argv)
    script = args.script[1:] if args.script[:1] == ["--"] else args.script
    if not script:
        parser.error("give the training command after --")
    conf = dict(item.split("=", 1) for item in args.rendezvous_conf.split(",") if item)
    try:
        command = torchrun_command(script, args.max_restarts, args.nproc_per_node, args.nodes,
                                   args.min_nodes or args.nodes, args.endpoint, args.run_id, conf)
    except ValueError as error:
        parser.error(str(error))
    # the agent replaces this process: signals to it reach torchrun itself
    os.execve(command[0], command, {**os.environ, **AGENT_ENVIRONMENT})


if __name__ == "__main__":
    main()
