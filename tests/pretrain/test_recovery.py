"""Recovery without a command typed: two torch elastic agents on this machine ("nodes" a and b, one gloo rank each,
`pretrain.elastic`, the command ``make pretrain MAX_RESTARTS=N`` runs on each host) train the tiny model; node b is
lost after a checkpoint (its agent and rank SIGKILLed, or frozen with SIGSTOP), and node a's agent restarts the run
on the one rank left, which resumes from the newest complete checkpoint through the world-size conversion.

The fault comes from ``tests/fault_injection.py`` (``node@STEP@RANK``, ``freeze@STEP@RANK``); dropout is off, so a
1-rank resume of the same checkpoint by hand gives the same losses bit for bit.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import ROOT, subprocess_env
from pretrain.elastic import read_restarts
from training_runs import TESTS, check, launch, losses, metrics

STEPS, BATCH, LOST_AT = 8, 8, 5   # checkpoints at 2, 4, 6, 8; node b lost as step 5 begins (after global_step4)
RENDEZVOUS = "last_call_timeout=3,keep_alive_interval=1,keep_alive_max_attempt=3"  # quick on one machine


def overrides(shards: Path, out_dir: Path, *extra: str) -> list[str]:
    return [f"data.shards={shards}", "model.overrides.vocab_size=4000", f"out_dir={out_dir}",
            f"train.global_batch_size={BATCH}", f"train.max_steps={STEPS}", "train.save_interval=2",
            "train.keep_last=10", "model.overrides.hidden_dropout=0.0", "model.overrides.attention_dropout=0.0", *extra]


def free_port() -> int:
    import socket
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def two_nodes(train_overrides: list[str], fault: str, work: Path, max_restarts: int = 2,
              timeout: float = 240) -> tuple[subprocess.CompletedProcess, float]:
    """Nodes a (serving the rendezvous) and b, each an agent of `pretrain.elastic` with one rank, running
    ``fault_injection`` (``fault`` fires once); returns node a's finished process and its wall time. Node b's
    processes, whatever the fault left of them, are killed at the end."""
    port = free_port()
    env = subprocess_env(UNILM_TEST_FAULT=fault, UNILM_TEST_FAULT_ONCE=str(work / "fault_fired"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH")]))

    def agent(is_host: int) -> subprocess.Popen:
        command = [sys.executable, "-m", "pretrain.elastic",
                   f"--max-restarts={max_restarts}", "--nproc-per-node=1", "--nodes=2", "--min-nodes=1",
                   f"--endpoint=127.0.0.1:{port}", f"--run-id=test{port}",
                   f"--rendezvous-conf=is_host={is_host},{RENDEZVOUS}", "--",
                   "tests/fault_injection.py", "--config", "pretrain/configs/tiny.yaml", *train_overrides]
        return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)  # its own process group: the test ends it whole

    started = time.monotonic()
    node_a, node_b = agent(1), agent(0)
    try:
        stdout, stderr = node_a.communicate(timeout=timeout)
    finally:
        # the agents' process groups, and the faulted rank (an agent starts each rank in a session of its own)
        fired = work / "fault_fired"
        groups = [node_a.pid, node_b.pid] + ([int(fired.read_text())] if fired.exists() and fired.read_text() else [])
        for group in groups:
            try:
                os.killpg(group, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for node in (node_a, node_b):
            node.communicate()
    return subprocess.CompletedProcess(node_a.args, node_a.returncode, stdout, stderr), time.monotonic() - started


@pytest.fixture(scope="module")
def node_lost(unilm_shards: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    """Node b SIGKILLed (agent and rank) as step 5 begins: the one run every test of (a) checks."""
    work = tmp_path_factory.mktemp("node_lost")
    process, seconds = two_nodes(overrides(unilm_shards, work / "run"), f"node@{LOST_AT}@1", work)
    print(f"[test] node lost: the run took {seconds:.1f} s")
    return work / "run", process


@pytest.mark.slow
def test_a_lost_node_the_run_finishes_on_the_node_left(node_lost: tuple[Path, subprocess.CompletedProcess]) -> None:
    """Two agents start, train, and lose node b after global_step4; with nothing typed the run goes on on node a
    alone and ends at max_steps with exit 0 (about 40 s here: two starts of the ranks and a conversion)."""
    out_dir, process = node_lost
    check(process)
    assert (out_dir.parent / "fault_fired").exists()   # node b's rank lost its node (said on node b's console)
    stop = next(line for line in process.stderr.splitlines() if line.startswith("[stop]"))
    assert f"step {LOST_AT} (after global_step4): rank 1 stopped answering" in stop, stop
    assert "closed its connection" in stop
    assert "world size 2 -> 1" in process.stdout
    records = metrics(out_dir)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert records[-1]["consumed_samples"] == STEPS * BATCH
    assert (out_dir / "checkpoints" / "latest").read_text() == f"global_step{STEPS}"


@pytest.mark.slow
def test_the_recovery_is_on_the_record(node_lost: tuple[Path, subprocess.CompletedProcess]) -> None:
    out_dir, process = node_lost
    (record,) = read_restarts(out_dir)
    assert record["restart"] == 1 and record["world_size_before"] == 2 and record["world_size_after"] == 1
    assert len(record["hosts_before"]) == 2 and len(record["hosts_left"]) == 1 and record["hosts_joined"] == []
    assert record["resumed_from"] == "global_step4" and record["resume_step"] == 4
    assert record["steps_redone"] == record["last_logged_step"] - 4 <= 2   # at most one save_interval
    assert record["first_step_after"] == 5 and 0 < record["seconds_lost"] < 120
    line = next(line for line in process.stdout.splitlines() if line.startswith("[recovery]"))
    assert f"{record['seconds_lost']} s lost" in line and "world 2 -> 1 ranks" in line
    print(f"[test] seconds lost: {record['seconds_lost']}, steps redone: {record['steps_redone']}")
    pytest.importorskip("matplotlib")
    from pretrain.plot import plot_run
    assert plot_run(out_dir).stat().st_size > 0   # the curve marks the recovery at the step resumed from


@pytest.mark.slow
def test_the_losses_after_the_recovery_equal_a_one_rank_resume_by_hand(
        node_lost: tuple[Path, subprocess.CompletedProcess], unilm_shards: Path, tmp_path: Path) -> None:
    out_dir, _ = node_lost
    checkpoint = tmp_path / "copy" / "global_step4"
    shutil.copytree(out_dir / "checkpoints" / "global_step4", checkpoint)
    by_hand = tmp_path / "by_hand"
    check(launch(overrides(unilm_shards, by_hand, f"train.resume={checkpoint}")))
    recovered = losses(out_dir)
    assert losses(by_hand) == {step: recovered[step] for step in range(5, STEPS + 1)}   # bit for bit


@pytest.mark.slow
def test_a_frozen_node_is_detected_within_the_timeout_and_the_run_recovers(unilm_shards: Path,
                                                                         tmp_path: Path) -> None:
    """Node b stops (SIGSTOP, agent and rank) as step 5 begins; node a's collective gives up after
    train.collective_timeout_s=5, names the step and the rank, and the run recovers on node a as when node b is
    killed (about 45 s: the timeout on top of the killed-node case)."""
    process, _ = two_nodes(overrides(unilm_shards, tmp_path / "run", "train.collective_timeout_s=5"),
                           f"freeze@{LOST_AT}@1", tmp_path)
    check(process)
    stop = next(line for line in process.stderr.splitlines() if line.startswith("[stop]"))
    assert f"step {LOST_AT} (after global_step4): rank 1 stopped answering" in stop, stop
    assert "did not answer within train.collective_timeout_s of 5 s" in stop
    assert [r["step"] for r in metrics(tmp_path / "run")] == list(range(1, STEPS + 1))
    (record,) = read_restarts(tmp_path / "run")
    assert record["world_size_after"] == 1 and record["resume_step"] == 4 and record["seconds_lost"] >= 5


@pytest.mark.slow
def test_without_restarts_a_lost_node_stops_the_run_naming_the_step_and_rank(unilm_shards: Path,
                                                                            tmp_path: Path) -> None:
    process, _ = two_nodes(overrides(unilm_shards, tmp_path / "run"), f"node@{LOST_AT}@1", tmp_path, max_restarts=0)
    assert process.returncode != 0
    assert f"[stop] step {LOST_AT} (after global_step4): rank 1 stopped answering" in process.stderr
    assert [r["step"] for r in metrics(tmp_path / "run")] == [1, 2, 3, 4]
    assert not (tmp_path / "run" / "restarts.jsonl").exists()
    assert json.loads((tmp_path / "run" / "checkpoints" / "global_step4" / "complete.json").read_text())["step"] == 4


# ------------------------------------------------------------------------------- the pieces, without processes
def test_the_batch_policy_when_the_world_changes() -> None:
    from pretrain.batch_plan import InfeasibleBatchError, plan_for_world

    plan, note = plan_for_world(24, 4, 1, 2, "keep_global_batch")   # 2 -> 1 rank: twice the accumulation
    assert (plan.global_batch_size, plan.gradient_accumulation_steps, note) == (24, 6, None)
    with pytest.raises(InfeasibleBatchError, match="nearest_batch goes on with the nearest feasible one") as raised:
        plan_for_world(24, 4, 5, 6, "keep_global_batch")
    assert "Nearest feasible global batches: 20" in str(raised.value)
    plan, note = plan_for_world(24, 4, 5, 6, "nearest_batch")
    assert plan.global_batch_size == 20 and note is not None and "global batch 20" in note
    with pytest.raises(InfeasibleBatchError, match="train.on_world_change=stop refuses"):
        plan_for_world(24, 4, 1, 2, "stop")
    assert plan_for_world(24, 4, 2, 2, "stop")[0].gradient_accumulation_steps == 3   # no change: no policy


def test_host_changes_count_the_ranks_each_host_lost_or_gained() -> None:
    from pretrain.elastic import host_changes

    assert host_changes(["a", "a", "b", "b"], ["a", "a"]) == (["b", "b"], [])
    assert host_changes(["a", "b"], ["a", "c"]) == (["b"], ["c"])


def test_the_agent_command_of_a_host() -> None:
    from pretrain.elastic import torchrun_command

    command = torchrun_command(["pretrain/train.py", "--config", "c.yaml"], 3, 8, 4, 2, "node-1:29400", "run")
    assert command[1:3] == ["-m", "torch.distributed.run"] and "--nnodes=2:4" in command
    assert "--max-restarts=3" in command and "--rdzv-endpoint=node-1:29400" in command
    assert command[-3:] == ["pretrain/train.py", "--config", "c.yaml"]
    with pytest.raises(ValueError, match="MIN_NODES"):
        torchrun_command(["x.py"], 1, 1, 2, 3, "h:1", "run")
    with pytest.raises(ValueError, match="MAX_RESTARTS must be >= 0, got -1"):
        torchrun_command(["x.py"], -1, 1, 1, 1, "h:1", "run")


class _Replaced(Exception):
    """What the stand-in for `os.execve` raises: the agent's command and environment, where it would have run."""


def test_the_entry_point_becomes_the_agent_with_a_store_per_start(monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture) -> None:
    from pretrain import elastic

    def execve(path: str, argv: list[str], environment: dict[str, str]) -> None:
        raise _Replaced(path, argv, environment)

    monkeypatch.setattr(elastic.os, "execve", execve)
    with pytest.raises(_Replaced) as replaced:
        elastic.main(["--max-restarts", "2", "--nproc-per-node", "2", "--nodes", "2", "--min-nodes", "1",
                      "--endpoint", "node-1:29400", "--rendezvous-conf", "join_timeout=30",
                      "--", "pretrain/train.py", "--config", "c.yaml", "train.max_steps=8"])
    path, argv, environment = replaced.value.args
    assert path == argv[0] == sys.executable and "--nnodes=1:2" in argv and "--max-restarts=2" in argv
    assert any(a.startswith("--rdzv-conf=") and "join_timeout=30" in a for a in argv)
    assert argv[-4:] == ["pretrain/train.py", "--config", "c.yaml", "train.max_steps=8"]
    assert environment["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"  # each start of the ranks: a store of its own
    for bad, said in ((["--"], "give the training command after --"),
                      (["--min-nodes", "3", "--", "x.py"], "MIN_NODES")):
        with pytest.raises(SystemExit) as stopped:
            elastic.main(["--max-restarts", "1", "--nproc-per-node", "1", *bad])
        assert stopped.value.code == 2 and said in capsys.readouterr().err


def test_a_batch_that_does_not_split_stops_a_run_that_cannot_resume_from_another_world() -> None:
    from pretrain.batch_plan import InfeasibleBatchError, plan_for_world
    from pretrain.config import load_config
    from pretrain.trainer import batch_before_resume

    with pytest.raises(InfeasibleBatchError):  # the world did not change: no policy applies
        plan_for_world(24, 4, 5, 5, "keep_global_batch")
    tiny = ROOT / "pretrain/configs/tiny.yaml"
    assert batch_before_resume(load_config(tiny), 2).gradient_accumulation_steps == 3
    assert batch_before_resume(load_config(tiny), 5) is None  # a checkpoint of another world size may decide
    with pytest.raises(InfeasibleBatchError):
        batch_before_resume(load_config(tiny, ["train.resume=never"]), 5)


# ------------------------------------------------------------------------------- one host: make pretrain itself
def rank_process(marker: str, rank: int) -> psutil.Process | None:
    """The first start's process of ``rank`` among the processes whose environment carries ``marker`` (the
    test's own run: torch elastic starts each rank in a session of its own, so it is found by its environment)."""
    for process in psutil.process_iter():
        try:
            environ = process.environ()
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
        if environ.get("UNILM_TEST_RUN") == marker and environ.get("RANK") == str(rank) \
                and environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
            return process
    return None


@pytest.mark.slow
def test_make_pretrain_on_one_host_recovers_from_a_rank_killed_from_outside(unilm_shards: Path,
                                                                            tmp_path: Path) -> None:
    """The single-host run as typed: ``make pretrain MAX_RESTARTS=2`` (one agent, two local ranks); once
    global_step2 is complete, rank 1 is SIGKILLed from outside (no hook); the agent restarts both ranks, which
    resume from global_step2, finish at max_steps with exit 0 and record the recovery. About 55 s on two cores
    (65 s beside other suites): the preflight, two starts of two ranks, the ranks left waiting 5 s for the lost
    one's report, and 4 steps, the fewest that put a checkpoint before the kill and a step after the recovery."""
    steps, batch, out_dir = 4, 8, tmp_path / "run"
    run_overrides = f"model.overrides.vocab_size=4000 out_dir={out_dir} train.global_batch_size={batch} " \
                    f"train.max_steps={steps} train.save_interval=2 train.keep_last=10 optim.warmup_steps=1"
    env = {k: v for k, v in subprocess_env(UNILM_TEST_RUN=str(tmp_path)).items() if k not in ("MAKEFLAGS", "MFLAGS")}
    make = subprocess.Popen(["make", "--no-print-directory", "pretrain", "CONFIG=pretrain/configs/tiny.yaml",
                             "MAX_RESTARTS=2", f"RDZV_PORT={free_port()}", f"SHARDS={unilm_shards}",
                             f"OVERRIDES={run_overrides}"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        marker = out_dir / "checkpoints" / "global_step2" / "complete.json"
        deadline = time.monotonic() + 240
        while not marker.exists() and make.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        rank_1 = rank_process(str(tmp_path), 1)
        assert marker.exists() and rank_1 is not None, make.communicate(timeout=30)[0][-6000:] if make.poll() \
            is not None else "no checkpoint within 240 s"
        rank_1.kill()   # SIGKILL
        output, _ = make.communicate(timeout=240)
    finally:   # whatever is left of the run: make's group and the ranks (each in a session of its own)
        for process in [p for p in psutil.process_iter() if p.pid != os.getpid()]:
            try:
                if process.environ().get("UNILM_TEST_RUN") == str(tmp_path):
                    process.kill()
            except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
                pass
        if make.poll() is None:
            make.kill()
            make.communicate()
    assert make.returncode == 0, output[-6000:]
    assert "exitcode  : -9" in output or "exitcode: -9" in output, output[-6000:]   # the agent saw rank 1 die
    records = metrics(out_dir)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert records[-1]["consumed_samples"] == steps * batch
    (record,) = read_restarts(out_dir)
    assert record["restart"] == 1 and record["world_size_before"] == record["world_size_after"] == 2
    assert record["resumed_from"] == "global_step2" and record["steps_redone"] == record["last_logged_step"] - 2
    assert record["first_step_after"] == 3 and 0 < record["seconds_lost"] < 120
    print(f"[test] seconds lost: {record['seconds_lost']}, steps redone: {record['steps_redone']}")
