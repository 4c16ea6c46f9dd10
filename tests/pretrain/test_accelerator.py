"""The rank's device and DeepSpeed's op builds, as far as a CPU machine can check them: TORCH_CUDA_ARCH_LIST in the
form DeepSpeed's own builder parses (checked against that builder), the preflight's note, local-rank discovery,
device binding and collectives on the CPU accelerator, the accelerator a child process gets, and what a run does
where torch.compile cannot build its kernels."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder

from conftest import ROOT, subprocess_env
from pretrain import accelerator
from pretrain.accelerator import apply_deepspeed_arch_list, deepspeed_arch_list
from training_runs import TESTS, launch


def deepspeed_gencode_flags(arch_list: str, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """What DeepSpeed's FusedAdam builder makes of TORCH_CUDA_ARCH_LIST (its ahead-of-time parse, no compiler)."""
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", arch_list)
    return FusedAdamBuilder().compute_capability_args()


@pytest.mark.parametrize("given, expected", [
    ("9.0a", "9.0"),
    ("8.6+PTX", "8.6+PTX"),
    ("9.0", "9.0"),
    ("8.0 8.6;9.0a", "8.0;8.6;9.0"),
    ("9.0a;9.0+PTX", "9.0+PTX"),
    (" 10.0f ; 12.0a+PTX ", "10.0;12.0+PTX"),
    ("Hopper", "9.0+PTX"),
    ("Ampere;Turing", "7.5+PTX;8.0;8.6+PTX"),
])
def test_arch_lists_are_rewritten_into_what_deepspeeds_builder_parses(given: str, expected: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    assert deepspeed_arch_list(given) == expected
    flags = deepspeed_gencode_flags(expected, monkeypatch)
    for token in expected.split(";"):
        number = token.removesuffix("+PTX").replace(".", "")
        assert f"-gencode=arch=compute_{number},code=sm_{number}" in flags
        assert (f"-gencode=arch=compute_{number},code=compute_{number}" in flags) == token.endswith("+PTX")


def test_the_suffixed_arch_that_cuda_images_set_breaks_deepspeeds_builder(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="invalid literal for int"):
        deepspeed_gencode_flags("9.0a", monkeypatch)  # why the rewrite exists (DeepSpeed 0.19.8's FusedAdam build)
    environ = {"TORCH_CUDA_ARCH_LIST": "9.0a"}
    note = apply_deepspeed_arch_list(environ)
    assert environ["TORCH_CUDA_ARCH_LIST"] == "9.0" and 'TORCH_CUDA_ARCH_LIST="9.0"' in note
    assert deepspeed_gencode_flags(environ["TORCH_CUDA_ARCH_LIST"], monkeypatch) == \
        ["-gencode=arch=compute_90,code=sm_90"]
    for untouched in ({}, {"TORCH_CUDA_ARCH_LIST": "8.0;9.0+PTX"}):
        before = dict(untouched)
        assert apply_deepspeed_arch_list(untouched) is None and untouched == before


@pytest.mark.parametrize("bad", ["sm_90", "9", "9.x", ";"])
def test_unreadable_arch_lists_are_refused_naming_the_entry(bad: str) -> None:
    with pytest.raises(ValueError, match="TORCH_CUDA_ARCH_LIST"):
        deepspeed_arch_list(bad)


def test_preflight_names_the_value_to_set_or_the_problem() -> None:
    from pretrain.preflight import arch_list_note

    note, problem = arch_list_note("9.0a")
    assert not problem and 'Set TORCH_CUDA_ARCH_LIST="9.0"' in note
    assert arch_list_note("8.0;9.0") == (None, False) and arch_list_note(None) == (None, False)
    note, problem = arch_list_note("sm_90")
    assert problem and "'sm_90'" in note


def test_preflight_reports_the_arch_list_of_this_host(unilm_shards, tmp_path, monkeypatch, capsys) -> None:
    from pretrain.preflight import preflight

    overrides = [f"data.shards={unilm_shards}", f"out_dir={tmp_path}"]
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    assert preflight("pretrain/configs/tiny.yaml", overrides, None, local_ranks=2) == []
    out = capsys.readouterr().out
    assert "1 host(s), 2 ranks" in out and 'Set TORCH_CUDA_ARCH_LIST="9.0"' in out
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "sm_90")
    problems = preflight("pretrain/configs/tiny.yaml", overrides, None, local_ranks=2)
    assert len(problems) == 1 and "cannot read 'sm_90'" in problems[0]


def test_preflight_notes_a_gpu_host_where_fused_adam_cannot_be_built(unilm_shards, tmp_path, monkeypatch,
                                                                     capsys) -> None:
    """A GPU host without the CUDA toolkit (PyPI's CUDA torch brings no nvcc): noted when the JSON uses FusedAdam,
    not with a toolkit, nor with a JSON that steps with torch's AdamW."""
    from deepspeed import git_version_info
    from torch.utils import cpp_extension

    from pretrain.preflight import preflight

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(git_version_info, "installed_ops", {})  # a DeepSpeed installed without prebuilt ops
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", None)
    run = [f"data.shards={unilm_shards}", f"out_dir={tmp_path}"]
    gpu_json = [*run, "deepspeed_config=ds_configs/zero2_bf16.json"]
    assert preflight("pretrain/configs/tiny.yaml", gpu_json, None, local_ranks=2) == []
    out = capsys.readouterr().out
    assert "[preflight] localhost: DeepSpeed's FusedAdam is not prebuilt and cannot be built here (no CUDA toolkit " \
           "found: CUDA_HOME is unset and there is no nvcc on PATH or in /usr/local/cuda): the run steps with " \
           "torch's AdamW" in out, out
    assert preflight("pretrain/configs/tiny.yaml", run, None, local_ranks=2) == []  # its CPU JSON: torch_adam
    assert "FusedAdam" not in capsys.readouterr().out
    toolkit = tmp_path / "cuda"
    (toolkit / "bin").mkdir(parents=True)
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", str(toolkit))
    assert accelerator.fused_adam_toolkit_missing() == f"the CUDA toolkit at {toolkit} has no bin/nvcc"
    (toolkit / "bin" / "nvcc").write_text("#!/bin/sh\n")
    (toolkit / "bin" / "nvcc").chmod(0o755)
    assert accelerator.fused_adam_toolkit_missing() is None
    assert preflight("pretrain/configs/tiny.yaml", gpu_json, None, local_ranks=2) == []
    assert "FusedAdam" not in capsys.readouterr().out
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", None)
    monkeypatch.setattr(git_version_info, "installed_ops", {"fused_adam": True})  # prebuilt: no toolkit needed
    assert accelerator.fused_adam_toolkit_missing() is None


def test_local_rank_comes_from_whichever_launcher_set_it(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"):
        monkeypatch.delenv(name, raising=False)
    assert accelerator.local_rank() == 0
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "3")
    assert accelerator.local_rank() == 3
    monkeypatch.setenv("LOCAL_RANK", "1")  # torchrun / deepspeed's launcher
    assert accelerator.local_rank() == 1


class OneVisibleGpu:
    """What DeepSpeed's CUDA accelerator shows a process that sees one GPU (or `count`)."""

    def __init__(self, count: int = 1) -> None:
        self.bound: list[int] = []
        self.count = count

    def device_name(self, index: int | None = None) -> str:
        return "cuda" if index is None else f"cuda:{index}"

    def device_count(self) -> int:
        return self.count

    def set_device(self, index: int) -> None:
        self.bound.append(index)


def test_a_rank_binds_the_device_of_its_local_rank_and_one_without_it_is_refused_naming_the_fix(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import deepspeed.accelerator

    gpu = OneVisibleGpu()
    monkeypatch.setattr(deepspeed.accelerator, "get_accelerator", lambda: gpu)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert accelerator.bind_local_device() == torch.device("cuda:0") and gpu.bound == [0]
    monkeypatch.setenv("LOCAL_RANK", "3")  # a machine with one GPU and more ranks than GPUs
    with pytest.raises(RuntimeError, match=r"local rank 3 has no cuda device: this process sees 1\. DeepSpeed puts "
                                           r"local rank N on device N.*--num_gpus N"):
        accelerator.bind_local_device()
    # srun --gpus-per-task=1 shows each rank its own GPU alone; DeepSpeed would still use device LOCAL_RANK
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with pytest.raises(RuntimeError, match=r"sees 1 \(CUDA_VISIBLE_DEVICES=3\).*do not give each rank its own "
                                           r"CUDA_VISIBLE_DEVICES \(under SLURM: hostfiles/slurm\.sbatch"):
        accelerator.bind_local_device()
    assert gpu.bound == [0]  # nothing bound by a refused rank


def test_bf16_counts_as_native_from_compute_capability_8_and_on_the_local_ranks_gpu(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.cuda.is_bf16_supported() (what DeepSpeed's accelerator answers) says yes on a V100 too, which emulates
    bf16; the capability of GPU LOCAL_RANK decides, read without touching GPU 0."""
    import deepspeed.accelerator

    gpu = OneVisibleGpu(count=3)
    gpu.is_bf16_supported = lambda: True
    monkeypatch.setattr(deepspeed.accelerator, "get_accelerator", lambda: gpu)
    monkeypatch.setattr(torch.version, "hip", None)
    asked: list[int] = []
    capabilities = {0: (7, 0), 2: (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: asked.append(index) or capabilities[index])
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert accelerator.native_bf16() is False  # V100: fine-tuning's default engine is then fp16
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert accelerator.native_bf16() is True
    assert asked == [0, 2]
    gpu.count = 1  # a rank shown only its own GPU (per-rank CUDA_VISIBLE_DEVICES): the binding's refusal, not torch's
    with pytest.raises(RuntimeError, match=r"local rank 2 has no cuda device: this process sees 1\."):
        accelerator.native_bf16()
    assert asked == [0, 2]


def test_on_the_cpu_accelerator_binding_is_a_no_op_and_collectives_use_cpu_tensors(one_rank_group) -> None:
    from pretrain.metrics import StepSums
    from pretrain.model import REPORTED_OBJECTIVES, PretrainOutput

    assert accelerator.bind_local_device() == torch.device("cpu")
    assert accelerator.default_device() == torch.device("cpu")
    assert accelerator.collective_device() == torch.device("cpu")
    sums = StepSums(accelerator.collective_device())
    seq2seq = REPORTED_OBJECTIVES.index("seq2seq")
    for loss, lengths in ((2.5, [10, 15]), (3.5, [5, 10])):
        objective_sums, objective_counts = torch.zeros(len(REPORTED_OBJECTIVES)), torch.zeros(len(REPORTED_OBJECTIVES))
        objective_sums[seq2seq], objective_counts[seq2seq] = 1.5, 1.0
        sums.add({"length": torch.tensor(lengths)},
                 PretrainOutput(torch.tensor(loss), objective_sums, objective_counts))
    stats = sums.reduce(stop=False)
    assert stats == {"loss": 3.0, "set_loss": 1.5, "tokens": 40, "squared_lengths": 450.0, "predictions": 2.0,
                     "stop": False, "objectives": {"seq2seq": 1.5}, "local_loss": 6.0}


def test_child_processes_get_the_cpu_accelerator_only_without_a_gpu_or_a_choice() -> None:
    environ: dict[str, str] = {}
    chosen = accelerator.choose_ds_accelerator(environ)
    if torch.cuda.is_available():
        assert chosen == "auto" and "DS_ACCELERATOR" not in environ
        assert accelerator.local_launch_arguments(environ)[:2] == ["--num_gpus", str(torch.cuda.device_count())]
    else:
        assert chosen == "cpu" and environ == {"DS_ACCELERATOR": "cpu"}
        assert accelerator.local_launch_arguments(environ) == [
            "--hostfile", "hostfiles/localhost", "--no_ssh_check", "--master_addr", "127.0.0.1"]
    asked = {"DS_ACCELERATOR": "cuda"}
    assert accelerator.choose_ds_accelerator(asked) == "cuda" and asked == {"DS_ACCELERATOR": "cuda"}
    assert accelerator.local_launch_arguments({"DS_ACCELERATOR": "cpu"})[:2] == ["--hostfile", "hostfiles/localhost"]
    if torch.cuda.is_available():
        assert accelerator.local_launch_arguments({}, max_gpus=1)[:2] == ["--num_gpus", "1"]
    assert os.environ.get("DS_ACCELERATOR") == "cpu"  # the test process itself was left alone


# ------------------------------------------------------------------------------- torch.compile's toolchain
DECIDE = """
import torch
from no_compiler import MISSING_COMPILER  # torch.compile finds no C++ compiler
from pretrain.accelerator import compiler_failure
from pretrain.distributed import SetupError
from pretrain.setup_checks import compiler_works
print("failure:", compiler_failure(torch.device("cpu")))
print("left to the default:", compiler_works(None, 0))
try:
    compiler_works(True, 0)
except SetupError as error:
    print("asked for:", error)
"""


@pytest.mark.slow  # ≈ 20 s: the compiler's first CPU build
def test_compiler_failure_is_none_where_torch_compile_builds(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    assert accelerator.compiler_failure(torch.device("cpu")) is None


def test_without_a_compiler_a_default_run_goes_uncompiled_and_a_run_that_asked_for_it_stops(tmp_path):
    process = subprocess.run([sys.executable, "-c", DECIDE], cwd=ROOT, capture_output=True, text=True, timeout=300,
                             env=subprocess_env(TORCHINDUCTOR_CACHE_DIR=str(tmp_path), PYTHONPATH=str(TESTS)))
    assert process.returncode == 0, process.stderr[-3000:]
    lines = dict(line.split(": ", 1) for line in process.stdout.splitlines())
    assert "InvalidCxxCompiler: No working C++ compiler found" in lines["failure"]
    assert "/nonexistent/g++" in lines["failure"]
    assert lines["left to the default"] == "False"
    assert f"[fast paths] torch.compile fails here ({lines['failure']}), so the blocks run uncompiled (slower). " \
           "torch.compile builds its kernels at run time" in process.stderr
    assert lines["asked for"].startswith(f"train.compile=true, but torch.compile fails here: {lines['failure']}. ")
    assert lines["asked for"].endswith("python3-dev); or set train.compile=false")


@pytest.mark.slow
def test_a_training_run_that_asks_for_compiled_blocks_stops_before_its_first_step_where_they_cannot_build(
        unilm_shards, tmp_path):
    process = launch([f"data.shards={unilm_shards}", "model.overrides.vocab_size=4000", f"out_dir={tmp_path / 'run'}",
                      "train.compile=true"], extra_env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}, module="no_compiler")
    assert process.returncode != 0, process.stdout[-2000:]
    assert "train.compile=true, but torch.compile fails here: InductorError: InvalidCxxCompiler" in process.stderr, \
        process.stderr[-3000:]
    assert "Traceback" not in process.stderr and not (tmp_path / "run" / "metrics.jsonl").exists()
