"""What `make` launches on a GPU machine and on a CPU one, and installing the project on top of an existing torch.

The Makefile's accelerator choice is read from what make itself runs: `make -n` (commands printed, not run) with
an `nvidia-smi` on PATH that lists GPUs, or fails as it does where no driver is installed."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser from PyPI, which the dev extra installs there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
TWO_GPUS = "GPU 0: NVIDIA H200 (UUID: GPU-0)\nGPU 1: NVIDIA H200 (UUID: GPU-1)\n"
RUN_ONLY_TARGETS = ["demo", "pretrain", "preflight", "bench", "bench-train", "bench-model", "bench-decode",
                    "finetune-data", "shards", "inspect", "plot"]


def make(tmp_path: Path, gpus: str | None, *args: str, **env: str) -> str:
    """`make -n ARGS` (plus a rule that prints the DS_ACCELERATOR recipes see) with a fake `nvidia-smi` first on
    PATH: listing `gpus`, or failing when None."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "nvidia-smi"
    fake.write_text("#!/bin/sh\n" + (f"printf '{gpus}'\n" if gpus is not None else
                                     "echo 'NVIDIA-SMI has failed: no driver' >&2; exit 9\n"))
    fake.chmod(0o755)
    environ = {k: v for k, v in os.environ.items() if k not in ("DS_ACCELERATOR", "MAKEFLAGS", "MFLAGS")}
    environ.update(PATH=f"{bin_dir}:{environ['PATH']}", **env)
    process = subprocess.run(["make", "-n", "--no-print-directory", "--eval",
                              "show-accelerator: ; +@echo accelerator=[$$DS_ACCELERATOR]", *args],
                             cwd=ROOT, env=environ, capture_output=True, text=True, timeout=120)
    assert process.returncode == 0, process.stderr
    return process.stdout


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_a_gpu_machine_launches_one_rank_per_gpu_on_deepspeeds_own_accelerator_choice(tmp_path: Path) -> None:
    out = make(tmp_path, TWO_GPUS, "show-accelerator", "pretrain")
    assert "accelerator=[]" in out  # not forced to cpu: DeepSpeed detects CUDA
    launch = next(line for line in out.splitlines() if "bin/deepspeed" in line)
    assert "--num_gpus 2" in launch and "--hostfile" not in launch and "--no_ssh_check" in launch
    assert re.search(r"pretrain\.preflight .*--local-ranks 2", out)
    one = make(tmp_path, "GPU 0: NVIDIA H200 (UUID: GPU-0)\n", "pretrain")
    assert "--num_gpus 1" in one and "--local-ranks 1" in one
    assert "--hostfile 'hostfiles/multinode.example'" in make(tmp_path, TWO_GPUS, "pretrain",
                                                             "HOSTFILE=hostfiles/multinode.example")


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_a_cpu_machine_runs_on_the_cpu_accelerator_with_the_localhost_hostfile(tmp_path: Path) -> None:
    out = make(tmp_path, None, "show-accelerator", "pretrain")
    assert "accelerator=[cpu]" in out
    launch = next(line for line in out.splitlines() if "bin/deepspeed" in line)
    assert "--hostfile 'hostfiles/localhost'" in launch and "--num_gpus" not in launch
    assert "accelerator=[]" not in make(tmp_path, "", "show-accelerator")  # nvidia-smi that lists nothing
    # a choice made by the user wins on either machine
    assert "accelerator=[cuda]" in make(tmp_path, None, "show-accelerator", DS_ACCELERATOR="cuda")
    assert "accelerator=[cpu]" in make(tmp_path, TWO_GPUS, "show-accelerator", DS_ACCELERATOR="cpu")
    assert "accelerator=[cpu]" in make(tmp_path, TWO_GPUS, "show-accelerator", "DS_ACCELERATOR=cpu")


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
@pytest.mark.parametrize("gpus", [TWO_GPUS, None])
def test_targets_that_only_run_code_install_no_system_packages(tmp_path: Path, gpus: str | None) -> None:
    for target in RUN_ONLY_TARGETS:
        out = make(tmp_path, gpus, target, "VENV=" + str(tmp_path / "no-venv"))  # even on a fresh machine
        assert "apt-get" not in out and "dpkg" not in out, target
    assert "apt-get" in make(tmp_path, gpus, "setup", "VENV=" + str(tmp_path / "no-venv"))  # setup/test may


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_builds_deepspeeds_ops_into_one_folder_per_torch_build(tmp_path: Path) -> None:
    """An upgraded torch (or a second venv on the checkout) must not load ops built against another torch."""
    import torch

    from tools.torch_extensions import extensions_dir

    def ops_folder(venv: Path, **env: str) -> str:
        environ = {k: v for k, v in os.environ.items() if k not in ("TORCH_EXTENSIONS_DIR", "MAKEFLAGS", "MFLAGS")}
        process = subprocess.run(["make", "-s", "--no-print-directory", f"VENV={venv}", "--eval",
                                  "show-ops: ; @echo ops=[$$TORCH_EXTENSIONS_DIR]", "show-ops"],
                                 cwd=ROOT, env={**environ, **env}, capture_output=True, text=True, timeout=120)
        assert process.returncode == 0, process.stderr
        return process.stdout.strip()

    folder = ops_folder(Path(sys.prefix))
    assert folder == f"ops=[{extensions_dir()}]"
    assert folder.endswith(f"/.cache/torch_extensions/torch-{torch.__version__}-py{sys.version_info[0]}"
                           f"{sys.version_info[1]}]")
    assert ops_folder(tmp_path / "no-venv") == f"ops=[{ROOT}/.cache/torch_extensions]"  # before setup made it
    assert ops_folder(Path(sys.prefix), TORCH_EXTENSIONS_DIR="/shared/ops") == "ops=[/shared/ops]"


def test_the_slurm_script_gives_the_preflight_the_runs_overrides(tmp_path: Path) -> None:
    script = (ROOT / "hostfiles/slurm.sbatch").read_text()
    launch = next(line for line in script.splitlines() if line.startswith("make pretrain"))
    assert 'OVERRIDES="$OVERRIDES"' in launch and "make preflight" not in script  # make pretrain runs it, once
    overrides = "OVERRIDES=train.max_steps=7 train.save_interval=7"
    # make pretrain's commands, read from make itself: DeepSpeed's launch, and torch elastic's (MAX_RESTARTS)
    for recovery, launcher in (((), "bin/deepspeed "), (("MAX_RESTARTS=2",), "-m pretrain.elastic ")):
        printed = make(tmp_path, None, "pretrain", overrides, *recovery).replace("\\\n", " ")  # one line a command
        lines = [" ".join(line.split()) for line in printed.splitlines()]
        runs = [line for line in lines if "-m pretrain.preflight" in line or launcher in line]
        assert len(runs) == 2 and "-m pretrain.preflight" in runs[0] and launcher in runs[1], lines  # once, first
        assert all(line.endswith("train.max_steps=7 train.save_interval=7") for line in runs), runs
    subprocess.run(["bash", "-n", str(ROOT / "hostfiles/slurm.sbatch")], check=True)


def test_the_torch_requirement_keeps_a_clusters_cuda_build() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    torch_requirement = next(Requirement(r) for r in project["dependencies"] if Requirement(r).name == "torch")
    # the H200 test machine's torch, the CPU wheel here, the oldest the suite passes on (docs/gpus.md)
    for kept in ("2.11.0+cu130", "2.13.0", "2.6.0+cu124"):
        assert torch_requirement.specifier.contains(kept, prereleases=True), kept
    for refused in ("2.4.1", "2.5.1"):  # 2.4 cannot compile blocks under activation checkpointing
        assert not torch_requirement.specifier.contains(refused), refused


@pytest.mark.slow
def test_an_editable_install_on_top_of_an_existing_torch_keeps_it_and_needs_no_download(tmp_path: Path) -> None:
    """A venv whose torch (and every other dependency) comes from outside it, as a cluster's CUDA torch does from
    its system site-packages: `pip install --no-index -e .` must succeed offline and leave that torch in place."""
    import torch

    venv = tmp_path / "venv"
    subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--without-pip", str(venv)],
                   check=True, timeout=120)
    site = next((venv / "lib").glob("python*/site-packages"))
    shared_site = Path(torch.__file__).parents[1]
    (site / "cluster_site.pth").write_text(f"{shared_site}\n")  # the "system" site: torch and the rest
    python = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL")}
    install = subprocess.run([str(python), "-m", "pip", "install", "--no-index", "--no-build-isolation", "-e", "."],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    check = subprocess.run([str(python), "-c", "import torch, pretrain.trainer; print(torch.__file__); "
                            "print(pretrain.trainer.__file__); print(torch.__version__)"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert check.returncode == 0, check.stderr[-3000:]
    torch_file, project_file, version = check.stdout.split()
    assert Path(torch_file) == Path(torch.__file__) and version == torch.__version__  # kept, not replaced
    assert Path(project_file) == ROOT / "pretrain" / "trainer.py"                     # the checkout, editable
    assert not any(p.name.startswith("torch") for p in site.iterdir())                # nothing torch-like added


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_shards_replaces_an_existing_build_only_when_asked(tmp_path: Path) -> None:
    """A run resumes only on the shards it started with: `make shards` stops at an existing build and names
    OVERWRITE=1, which alone passes --overwrite."""
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "manifest.json").write_text("{}")
    environ = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS")}
    stopped = subprocess.run(["make", "--no-print-directory", "shards", f"SHARDS={shards}"], cwd=ROOT, env=environ,
                             capture_output=True, text=True, timeout=120)
    assert stopped.returncode != 0 and "holds a build; make shards OVERWRITE=1 replaces it" in stopped.stderr
    other = str(tmp_path / "other")
    assert "--overwrite" not in make(tmp_path, None, "shards", f"SHARDS={other}")
    assert "--overwrite" in make(tmp_path, None, "shards", f"SHARDS={other}", "OVERWRITE=1")
