"""Setup checks one rank fails stop every rank together: a node-local out_dir, a file missing on one node (the
checkpoint one rank does not see: tests/pretrain/test_trust.py). Across nodes no launcher stops the other ranks,
which would wait in the next collective until its timeout. Each test runs two gloo ranks under torchrun, giving
rank 1 its own directory where a node-local path would give it one; one launch plays every scenario of the
checks in turn (a launch costs ~8 s of start-up on 2 cores)."""
from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, subprocess_env

pytestmark = pytest.mark.slow  # two gloo ranks under torchrun
SCENARIOS = ("shared", "node_local", "one_rank_fails", "none_fails")

_SCENARIOS = r"""
import json, sys
from pathlib import Path
import torch.distributed as dist
from pretrain.distributed import on_every_rank
from pretrain.setup_checks import check_shared_out_dir

dist.init_process_group("gloo")
rank = dist.get_rank()
work = Path(sys.argv[1])


def out_dir(node_local):
    directory = work / (f"node{rank}" if node_local else "shared") / "run"
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def fails_on_rank_1():
    if rank == 1:
        raise FileNotFoundError(f"model.init_from {work / 'bert'}: no config.json")
    return rank * 10


for scenario in sys.argv[2:]:
    try:
        if scenario in ("shared", "node_local"):
            outcome = f"returned {check_shared_out_dir(out_dir(scenario == 'node_local'), rank, 2)!r}"
        else:
            check = fails_on_rank_1 if scenario == "one_rank_fails" else lambda: rank * 10
            outcome = f"returned {on_every_rank(check)!r}"
    except Exception as error:
        outcome = f"raised {type(error).__name__}: {error}"
    (work / f"outcome_{scenario}_{rank}").write_text(outcome)
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder where one launch of two ranks played every scenario, one after the other."""
    work = tmp_path_factory.mktemp("setup_agreement")
    script = work / "scenarios.py"
    script.write_text(_SCENARIOS)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(script), str(work), *SCENARIOS], env=subprocess_env(PYTHONPATH=str(ROOT)),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return work


def outcomes(work: Path, scenario: str) -> list[str]:
    """Each rank's outcome of ``scenario``: "returned ..." or "raised Type: message"."""
    return [(work / f"outcome_{scenario}_{rank}").read_text() for rank in (0, 1)]


def test_a_node_local_out_dir_stops_every_rank_naming_the_rank_that_does_not_see_it(work: Path) -> None:
    assert outcomes(work, "shared") == ["returned None"] * 2
    assert list((work / "shared" / "run").iterdir()) == []  # the check leaves nothing behind
    for outcome in outcomes(work, "node_local"):
        assert outcome.startswith(f"raised OSError: rank 1 on {socket.gethostname()} does not see "
                                  f"{work / 'node1' / 'run'}/.shared-check-"), outcome
        assert "which rank 0 on" in outcome and "must be one shared directory, at the same path, on every node" in \
            outcome


def test_a_problem_one_rank_finds_stops_every_rank_naming_it(work: Path) -> None:
    assert outcomes(work, "one_rank_fails") == [
        f"raised SetupError: model.init_from {work / 'bert'}: no config.json (rank 1 on {socket.gethostname()})"
    ] * 2
    assert outcomes(work, "none_fails") == ["returned 0", "returned 10"]


def test_a_config_one_rank_does_not_see_stops_every_rank_naming_it_once(tmp_path: Path) -> None:
    """`pretrain.train` with its config at a path one node lacks: every rank stops at once (exit code 2), and the
    message, naming that rank and host, is said once."""
    from conftest import launch_node_local

    (tmp_path / "node0").mkdir()
    (tmp_path / "node0" / "run.yaml").write_text((ROOT / "pretrain" / "configs" / "tiny.yaml").read_text())
    done, exit_codes = launch_node_local(tmp_path, "pretrain.train", ["--config", "run.yaml"])
    stops = [line for line in done.stderr.splitlines() if line.startswith("[config]")]
    assert stops == [f"[config] run.yaml: no such config file (rank 1 on "
                     f"{socket.gethostname()})"], done.stderr[-4000:]
    assert exit_codes == ["2", "2"]  # rank 0 stopped by itself
