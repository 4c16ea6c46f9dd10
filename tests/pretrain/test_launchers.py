"""Each launcher starts 2 ranks of pretrain.train (gloo, tiny model, real shards); together they run ZeRO 0/1/3
(ZeRO-2 is the stage of test_train.py) and bf16."""
from __future__ import annotations

import json
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import subprocess_env

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run(command: list[str], extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = subprocess_env(**(extra_env or {}))
    process = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert process.returncode == 0, process.stdout[-3000:] + process.stderr[-5000:]
    return process


def train_args(shards: Path, out_dir: Path, ds_config: str, *extra: str) -> list[str]:
    return ["--config", "pretrain/configs/tiny.yaml", f"data.shards={shards}", f"out_dir={out_dir}",
            f"deepspeed_config={ds_config}", "model.overrides.vocab_size=4000", "train.max_steps=3",
            "train.save_interval=3", "optim.warmup_steps=2", *extra]


def assert_trained(out_dir: Path, world_size: int = 2, zero_stage: int | None = None, steps: int = 3) -> list[dict]:
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    marker = json.loads((out_dir / "checkpoints" / f"global_step{steps}" / "complete.json").read_text())
    assert marker["world_size"] == world_size
    if zero_stage is not None:
        assert marker["zero_stage"] == zero_stage
    return records


@pytest.mark.skipif(shutil.which("numactl") is None, reason="needs numactl (make system-deps)")
def test_deepspeed_launcher_with_the_localhost_hostfile_zero0_and_core_binding(unilm_shards: Path,
                                                                               tmp_path: Path) -> None:
    """DeepSpeed's launcher with the localhost hostfile (what `make pretrain` runs on a CPU machine) and a core
    bound to each rank (numactl). Also: the run leaves none of DeepSpeed's CPU all-reduce buffers (66 MB a rank)
    behind in /dev/shm."""
    port = free_port()
    process = run([str(BIN / "deepspeed"), "--hostfile", "hostfiles/localhost", "--no_ssh_check", "--master_addr",
                   "127.0.0.1", "--master_port", str(port), "--bind_cores_to_rank", "pretrain/train.py",
                   *train_args(unilm_shards, tmp_path, "ds_configs/zero0_fp32_cpu.json")])
    assert_trained(tmp_path, zero_stage=0)
    shown = process.stdout + process.stderr
    bound = re.findall(r"spawned with command: \['numactl', .*?'-C', '[\d,-]+', .*?'--local_rank=(\d)'", shown)
    assert sorted(bound) == ["0", "1"], shown[-3000:]  # each rank started under numactl with its cores
    assert "deepspeed_shm_comm" in shown  # the shared-memory all-reduce was in use
    assert not list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"))


def test_torchrun_zero1_with_held_out_eval(unilm_shards: Path, tmp_path: Path) -> None:
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "pretrain.train",
         *train_args(unilm_shards, tmp_path, "ds_configs/zero1_fp32_cpu.json", f"data.eval_shards={unilm_shards}",
                     "train.eval_interval=2", "train.eval_samples=13")])
    records = assert_trained(tmp_path, zero_stage=1)
    assert "eval_loss" in records[1] and "eval_loss_seq2seq" in records[1] and "eval_loss" not in records[0]


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs openmpi (make system-deps)")
def test_mpirun_zero3(unilm_shards: Path, tmp_path: Path) -> None:
    run(["mpirun", "-np", "2", "--oversubscribe", "--bind-to", "none", sys.executable, "-m", "pretrain.train",
         *train_args(unilm_shards, tmp_path, "ds_configs/zero3_fp32_cpu.json")],
        {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "MASTER_PORT": str(free_port())})
    assert_trained(tmp_path, zero_stage=3)


def test_srun_style_one_task_per_rank(unilm_shards: Path, tmp_path: Path) -> None:
    """Ranks started as srun starts them, one task each (SLURM_PROCID, SLURM_STEP_NUM_TASKS, SLURM_LOCALID, the
    step's node list; no RANK/WORLD_SIZE): they form one 2-rank run, not two 1-rank runs."""
    env = subprocess_env(SLURM_STEP_NUM_TASKS="2", SLURM_STEP_NODELIST="localhost", SLURM_JOB_ID="1",
                         MASTER_PORT=str(free_port()))
    processes = [subprocess.Popen([sys.executable, "-m", "pretrain.train",
                                   *train_args(unilm_shards, tmp_path, "ds_configs/zero2_fp32_cpu.json")],
                                  cwd=ROOT, env=dict(env, SLURM_PROCID=str(task), SLURM_LOCALID=str(task)),
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for task in range(2)]
    outputs = [process.communicate(timeout=300)[0] for process in processes]
    assert [process.returncode for process in processes] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    assert_trained(tmp_path, world_size=2, zero_stage=2)


def test_torchrun_zero2_bf16(unilm_shards: Path, tmp_path: Path) -> None:
    """Also: neither DeepSpeed's scheduler asking for its rate before the engine starts it nor torch's deprecation
    of the collective DeepSpeed's ZeRO-2 calls reaches the user (one line per rank each, nothing to act on)."""
    process = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
                   "pretrain.train", *train_args(unilm_shards, tmp_path, "ds_configs/zero2_bf16_cpu.json")])
    shown = process.stdout + process.stderr
    for message in ("before it has started", "all_gather_into_tensor", "reduce_scatter_tensor"):
        assert message not in shown, shown[-3000:]
    marker = json.loads((tmp_path / "checkpoints" / "global_step3" / "complete.json").read_text())
    assert marker["precision"] == "bf16"
    assert_trained(tmp_path, zero_stage=2)


def test_preflight_checks_batch_plan_shards_and_hosts(unilm_shards: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The free disk each host reports is fixed here, so the result does not depend on this machine's disk."""
    from pretrain.preflight import preflight, read_hostfile

    def free_disk(gib: float) -> None:
        usage = SimpleNamespace(total=2**50, used=0, free=int(gib * 2**30))
        monkeypatch.setattr(shutil, "disk_usage", lambda path: usage)

    free_disk(1000)
    assert read_hostfile(ROOT / "hostfiles/localhost") == {"localhost": 2}
    with pytest.raises(ValueError, match=r"^hostfile .*hostfiles/nope: no such file \(.*hostfiles has localhost, "
                                         r"multinode.example"):
        read_hostfile(ROOT / "hostfiles/nope")
    assert sum(read_hostfile(ROOT / "hostfiles/multinode.example").values()) == 16
    overrides = [f"data.shards={unilm_shards}", f"out_dir={tmp_path}"]
    assert preflight("pretrain/configs/tiny.yaml", overrides, str(ROOT / "hostfiles/localhost")) == []
    eight = tmp_path / "eight"
    eight.write_text("localhost slots=8\n")
    problems = preflight("pretrain/configs/unilm-large.yaml", overrides, str(eight))
    assert len(problems) == 1 and "No (micro, accumulation) pair reaches 330 on 8 ranks" in problems[0]
    free_disk(10)  # UniLM-large: ~6 GiB a checkpoint, keep_last + 1 of them
    problems = preflight("pretrain/configs/unilm-large.yaml", overrides, str(ROOT / "hostfiles/localhost"))
    assert len(problems) == 1 and "localhost: 10.0 GiB free under" in problems[0], problems
    assert "checkpoints" in problems[0]
    problems = preflight("pretrain/configs/tiny.yaml", [f"data.shards={tmp_path}", f"out_dir={tmp_path}"], None)
    assert len(problems) == 1 and "no manifest" in problems[0]


def test_preflight_of_several_hosts_probes_each_over_ssh_and_checks_master_and_shared_out_dir(
        unilm_shards: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With several hosts DeepSpeed's launcher reaches every one over ssh, this machine too: so does the preflight.
    A loopback first host would be every other host's own rendezvous address, and a node-local out_dir would split
    each checkpoint between the nodes' disks: both are named."""
    from pretrain import preflight as preflight_module

    probed = {}

    def fake_remote_probe(host, config, overrides, shared_file=None):
        probed[host] = shared_file
        report = preflight_module.probe(preflight_module.load_config(config, overrides), shared_file)
        return dict(report, sees_shared_file=False) if host == "node-b" else report  # node-b: its own disk

    monkeypatch.setattr(preflight_module, "remote_probe", fake_remote_probe)
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=1\nnode-b slots=1\n")
    out_dir = tmp_path / "runs" / "new"  # not created yet: the check writes where it will be
    problems = preflight_module.preflight("pretrain/configs/tiny.yaml",
                                          [f"data.shards={unilm_shards}", f"out_dir={out_dir}"], str(hostfile))
    assert set(probed) == {"localhost", "node-b"} and len(set(probed.values())) == 1
    assert Path(probed["localhost"]).parent == tmp_path and not Path(probed["localhost"]).exists()  # removed after
    assert len(problems) == 2, problems
    assert problems[0].startswith(f"{hostfile}: its first host, localhost, is where every rank meets rank 0")
    assert problems[1].startswith("node-b: does not see the file the preflight wrote in out_dir") and \
        "must be one shared directory" in problems[1]


def test_a_host_that_cannot_read_the_run_config_is_named_with_the_path(
        unilm_shards: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """The probe runs over ssh: what it cannot read comes back in its report, with the path, not as a traceback
    that reads like an unreachable host."""
    from pretrain import preflight as preflight_module

    def fake_remote_probe(host, config, overrides, shared_file=None):  # node-b's checkout lacks the config
        given = config if host == "localhost" else str(tmp_path / "run.yaml")
        assert preflight_module.main(["--probe", "--config", given, *overrides]) == 0
        return json.loads(capsys.readouterr().out.splitlines()[-1])  # as remote_probe reads it

    monkeypatch.setattr(preflight_module, "remote_probe", fake_remote_probe)
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=1\nnode-b slots=1\n")
    problems = preflight_module.preflight("pretrain/configs/tiny.yaml",
                                          [f"data.shards={unilm_shards}", f"out_dir={tmp_path}"], str(hostfile))
    assert problems[-1] == (f"node-b: {tmp_path / 'run.yaml'}: no such config file (every host reads the run config "
                            "at the same path, in its checkout of the same code)"), problems


def test_preflight_checks_model_init_from_on_each_host(unilm_shards: Path, minilm_dir: Path, tmp_path: Path) -> None:
    """Every rank reads model.init_from: the preflight reads its config.json and finds its weight files (a sharded
    checkpoint's index included) without loading a tensor."""
    from pretrain.preflight import preflight

    def problems_with(init_from: Path, *extra: str) -> list[str]:
        overrides = [f"data.shards={unilm_shards}", f"out_dir={tmp_path}", "model.preset=null",
                     f"model.init_from={init_from}", *extra]
        return preflight("pretrain/configs/tiny.yaml", overrides, None)

    # the shards here were built with another vocabulary than the MiniLM's: the run would stop on it, so does this
    (problem,) = problems_with(minilm_dir)
    assert "was built with another vocabulary than model.init_from" in problem
    assert problems_with(minilm_dir, "model.check_init_vocab=false") == []
    problems = problems_with(tmp_path / "absent")
    assert len(problems) == 1 and "model.init_from" in problems[0] and "no config.json" in problems[0]
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_text((minilm_dir / "config.json").read_text())
    (sharded / "model.safetensors.index.json").write_text(
        '{"metadata": {}, "weight_map": {"embeddings.word_embeddings.weight": "model-00001-of-00002.safetensors"}}')
    problems = problems_with(sharded)
    assert len(problems) == 1 and "model-00001-of-00002.safetensors" in problems[0]


def test_slurm_script_is_valid_bash() -> None:
    subprocess.run(["bash", "-n", str(ROOT / "hostfiles/slurm.sbatch")], check=True)


_FAKE_MAKE = """#!/bin/bash
# make pretrain: a launcher (this shell, which dies on SIGTERM as DeepSpeed's one-node
# launcher does) waiting for one "rank" that saves and exits on SIGTERM, as pretrain/train.py does
python3 -c '
import pathlib, signal, sys, time
out = pathlib.Path(sys.argv[3])
signal.signal(signal.SIGTERM, lambda *_: (out.joinpath("saved").write_text("step"), sys.exit(0)))
out.joinpath("started").write_text("")
time.sleep(120)
' pretrain/train.py --local_rank=0 "$RANK_OUT"
"""


def test_the_slurm_scripts_sigterm_reaches_the_ranks_which_save_and_exit(tmp_path: Path) -> None:
    """SBATCH --signal=B:TERM signals the batch shell alone (DeepSpeed's one-node launcher would die on it and
    leave the ranks training): the script passes it to the ranks, waits for them, and ends with their status."""
    fakes = tmp_path / "bin"
    fakes.mkdir()
    (fakes / "make").write_text(_FAKE_MAKE)
    (fakes / "scontrol").write_text("#!/bin/bash\nhostname\n")
    for fake in fakes.iterdir():
        fake.chmod(0o755)
    (tmp_path / "hostfiles").mkdir()
    env = subprocess_env(PATH=f"{fakes}:{subprocess_env()['PATH']}", SLURM_SUBMIT_DIR=str(tmp_path),
                         SLURM_JOB_ID="7", SLURM_JOB_NODELIST="here", SLURM_GPUS_ON_NODE="1",
                         RANK_OUT=str(tmp_path))
    script = subprocess.Popen(["bash", str(ROOT / "hostfiles/slurm.sbatch"), "pretrain/configs/tiny.yaml"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (tmp_path / "started").exists():
        assert script.poll() is None and time.monotonic() < deadline, script.communicate()
        time.sleep(0.1)
    script.send_signal(signal.SIGTERM)
    _, stderr = script.communicate(timeout=60)
    assert script.returncode == 0, stderr
    assert "[slurm] SIGTERM: every rank saves its step and exits" in stderr
    assert (tmp_path / "saved").read_text() == "step"
    assert (tmp_path / "hostfiles" / "slurm-7").read_text().split()[1] == "slots=1"
