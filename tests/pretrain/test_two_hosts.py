"""Two hosts, really: two network namespaces joined by a veth pair, each with its own address and its
own sshd; DeepSpeed's pdsh launcher, started on the first 'host', starts one rank per host over ssh from a
hostfile naming both addresses. The run trains, checkpoints, is relaunched and resumes; then the cluster shrinks
to one host and the run resumes on it (world size 2 -> 1, universal checkpoint).

The hosts share this machine's file system (code, venv, shards, out_dir), as cluster nodes share one. Only the
addresses of the namespaces made here are used. Needs root, iproute2, openssh-server/-client and pdsh
(``make system-deps``); skipped, saying why, where one is missing or the kernel forbids namespaces.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import subprocess_env

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
SUBNET = "10.213.77"
ADDRESSES = (f"{SUBNET}.1", f"{SUBNET}.2")
INTERFACE = "unilm0"   # the same name in both namespaces, so one GLOO_SOCKET_IFNAME serves every rank
pytestmark = pytest.mark.slow


def sh(*command: str) -> subprocess.CompletedProcess:
    """Run a fixed command (a list, never a shell string); raise with its stderr on failure."""
    process = subprocess.run(command, capture_output=True, text=True, timeout=60)
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(command)}: {process.stderr.strip()}")
    return process


class Cluster:
    """Two namespaces ``names[i]`` at ``ADDRESSES[i]``, an sshd in each, and the ssh material to reach them."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.names = (f"unilm{os.getpid()}a", f"unilm{os.getpid()}b")
        self.sshd: list[subprocess.Popen] = []
        self.ssh_config = work / "ssh_config"
        self.env_file = work / "deepspeed_env"

    def up(self) -> None:
        veth = (f"u{os.getpid()}a", f"u{os.getpid()}b")
        sh("ip", "link", "add", veth[0], "type", "veth", "peer", "name", veth[1])
        for name, end, address in zip(self.names, veth, ADDRESSES):
            sh("ip", "link", "set", end, "netns", name)
            sh("ip", "-n", name, "link", "set", end, "name", INTERFACE)
            sh("ip", "-n", name, "addr", "add", f"{address}/24", "dev", INTERFACE)
            sh("ip", "-n", name, "link", "set", INTERFACE, "up")
            sh("ip", "-n", name, "link", "set", "lo", "up")
        sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.work / "client_key"))
        sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.work / "host_key"))
        shutil.copy(self.work / "client_key.pub", self.work / "authorized_keys")
        Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation directory
        for name, address in zip(self.names, ADDRESSES):
            config = self.work / f"sshd_config_{name}"
            config.write_text(
                f"ListenAddress {address}\nPort 22\nHostKey {self.work / 'host_key'}\n"
                f"PidFile {self.work / name}.pid\nAuthorizedKeysFile {self.work / 'authorized_keys'}\n"
                "PermitRootLogin prohibit-password\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
                "PubkeyAuthentication yes\nUsePAM no\nStrictModes no\nAcceptEnv none\n")
            self.sshd.append(subprocess.Popen(["ip", "netns", "exec", name, shutil.which("sshd"), "-D", "-e",
                                               "-f", str(config)],
                                              stdout=subprocess.DEVNULL, stderr=open(self.work / f"{name}.log", "w")))
        self.ssh_config.write_text(
            f"Host {SUBNET}.*\n  User root\n  IdentityFile {self.work / 'client_key'}\n  IdentitiesOnly yes\n"
            "  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n  BatchMode yes\n  LogLevel ERROR\n"
            "  ConnectTimeout 5\n")
        # what DeepSpeed's launcher exports to every remote rank (its DS_ENV_FILE)
        self.env_file.write_text(
            f"DS_ACCELERATOR=cpu\nOMP_NUM_THREADS=1\nGLOO_SOCKET_IFNAME={INTERFACE}\n"
            f"TORCH_EXTENSIONS_DIR={os.environ['TORCH_EXTENSIONS_DIR']}\n")
        deadline = time.monotonic() + 30
        for address in ADDRESSES:
            while True:
                probe = subprocess.run(["ip", "netns", "exec", self.names[0], "ssh", "-F", str(self.ssh_config),
                                        address, "true"], capture_output=True, text=True, timeout=30)
                if probe.returncode == 0:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"sshd at {address} not reachable: {probe.stderr.strip()}")
                time.sleep(0.3)

    def down(self) -> None:
        for process in self.sshd:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
        for name in self.names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)  # deletes its veth end too

    def deepspeed(self, hosts: list[str], overrides: list[str], port: int) -> subprocess.CompletedProcess:
        """``deepspeed --hostfile`` (pdsh over ssh, even for one host) started in the first namespace."""
        hostfile = self.work / "hostfile"
        hostfile.write_text("".join(f"{host} slots=1\n" for host in hosts))
        env = subprocess_env(DS_ENV_FILE=str(self.env_file), PDSH_SSH_ARGS_APPEND=f"-F {self.ssh_config}")
        command = ["ip", "netns", "exec", self.names[0], str(BIN / "deepspeed"), "--hostfile", str(hostfile),
                   "--launcher", "pdsh", "--force_multi", "--no_ssh_check", "--master_addr", ADDRESSES[0],
                   "--master_port", str(port), "pretrain/train.py", "--config", "pretrain/configs/tiny.yaml",
                   *overrides]
        return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    missing = [tool for tool in ("ip", "sshd", "ssh", "ssh-keygen", "pdsh") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (make system-deps: iproute2, openssh-server/-client, pdsh)")
    cluster = Cluster(tmp_path_factory.mktemp("two_hosts"))
    for name in cluster.names:
        made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
        if made.returncode != 0:
            cluster.down()
            pytest.skip(f"the kernel (or this container) forbids network namespaces: {made.stderr.strip()}")
    try:
        cluster.up()
        yield cluster
    finally:
        cluster.down()


def check(process: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert process.returncode == 0, process.stdout[-4000:] + process.stderr[-4000:]
    return process


def steps(out_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def marker(out_dir: Path, step: int) -> dict:
    return json.loads((out_dir / "checkpoints" / f"global_step{step}" / "complete.json").read_text())


def test_two_hosts_train_checkpoint_resume_then_the_cluster_shrinks(cluster: Cluster, unilm_shards: Path,
                                                                     tmp_path: Path) -> None:
    """Two hosts (network namespaces, sshd, DeepSpeed's pdsh launch) train, checkpoint and resume, then one host
    resumes alone: ≈ 50 s, the launches over ssh of a real two-host run, which nothing else shows."""
    overrides = [f"data.shards={unilm_shards}", f"out_dir={tmp_path}", "model.overrides.vocab_size=4000",
                 "train.global_batch_size=8", "train.save_interval=2", "optim.warmup_steps=2"]
    first = check(cluster.deepspeed(list(ADDRESSES), overrides + ["train.max_steps=4", "train.exit_at_step=2"],
                                    29611))
    assert f"{ADDRESSES[1]}:" in first.stdout  # pdsh prefixes each remote line with its host
    assert steps(tmp_path) == [1, 2] and marker(tmp_path, 2)["world_size"] == 2

    resumed = check(cluster.deepspeed(list(ADDRESSES), overrides + ["train.max_steps=4"], 29612))
    assert "[resume] global_step2: step 2, consumed_samples 16" in resumed.stdout
    assert steps(tmp_path) == [1, 2, 3, 4] and marker(tmp_path, 4)["world_size"] == 2

    shrunk = check(cluster.deepspeed([ADDRESSES[0]], overrides + ["train.max_steps=6"], 29613))
    assert "world size 2 -> 1" in shrunk.stdout
    assert "[resume] global_step4: step 4, consumed_samples 32" in shrunk.stdout
    assert steps(tmp_path) == [1, 2, 3, 4, 5, 6] and marker(tmp_path, 6)["world_size"] == 1
