"""The pieces pre-training and fine-tuning share: RNG capture/restore, the DeepSpeed JSON check."""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from common.paths import REPO_ROOT
from pretrain import accelerator, distributed, engine, rng
from pretrain.distributed import SetupError, first_slurm_host, launched_rank, slurm_task_environment


def draws() -> tuple[torch.Tensor, np.ndarray, float]:
    return torch.rand(3), np.random.rand(3), random.random()


def assert_same(first: tuple, second: tuple) -> None:
    assert torch.equal(first[0], second[0]) and np.array_equal(first[1], second[1]) and first[2] == second[2]


def test_rng_state_round_trip() -> None:
    rng.seed_everything(3)
    state = rng.rng_state()
    first = draws()
    rng.set_rng_state(state)
    assert_same(first, draws())


def test_portable_rng_state_survives_a_weights_only_load(tmp_path: Path) -> None:
    rng.seed_everything(5)
    torch.save({"rng_states": [rng.portable_rng_state()]}, tmp_path / "state.pt")
    first = draws()
    rng.restore_rng_state(torch.load(tmp_path / "state.pt", weights_only=True)["rng_states"][0])
    assert_same(first, draws())


def test_resume_rng_continues_on_the_same_world_size_and_reseeds_on_another() -> None:
    rng.seed_everything(11)
    saved = [rng.portable_rng_state(), rng.portable_rng_state()]
    continued = draws()
    rng.resume_rng(saved, seed=1, step=4, rank=0, world_size=2)
    assert_same(continued, draws())
    rng.resume_rng(saved, seed=1, step=4, rank=0, world_size=3)
    other_size = draws()
    rng.seed_everything(1 * 1_000_003 + 4 * 1_009 + 0)
    assert_same(other_size, draws())


class RecordingGpu:
    """A GPU's generator as DeepSpeed's accelerator exposes it, recording what is done to it."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def manual_seed(self, seed: int) -> None:
        self.calls.append(("seed", seed))

    def set_rng_state(self, state: torch.Tensor, index: int) -> None:
        self.calls.append(("restore", index))


def test_a_state_without_the_gpus_generator_seeds_it_per_rank_on_resume(monkeypatch) -> None:
    """Left alone, the GPU generator would keep the start-up seed, the same on every rank: the same dropout on
    all of them. Restored where saved; seeded from (seed, step, rank) where not."""
    cpu_saved = [rng.portable_rng_state() for _ in range(2)]  # on the CPU: no "accelerator" entry
    gpu = RecordingGpu()
    monkeypatch.setattr(rng, "get_accelerator", lambda: gpu)
    monkeypatch.setattr(rng, "_accelerator_generator", lambda: (gpu, "cuda", 0))
    for rank in (0, 1):
        rng.resume_rng(cpu_saved, seed=1, step=4, rank=rank, world_size=2)
    assert gpu.calls == [("seed", 1 * 1_000_003 + 4 * 1_009), ("seed", 1 * 1_000_003 + 4 * 1_009 + 1)]
    gpu.calls.clear()
    gpu_saved = [dict(state, accelerator={"device": "cuda", "state": torch.zeros(8, dtype=torch.uint8)})
                 for state in cpu_saved]
    rng.resume_rng(gpu_saved, seed=1, step=4, rank=1, world_size=2)
    assert gpu.calls == [("restore", 0)]


def test_srun_tasks_get_rank_world_size_and_master_from_slurm() -> None:
    task = {"SLURM_STEP_NUM_TASKS": "16", "SLURM_PROCID": "11", "SLURM_LOCALID": "3", "SLURM_JOB_ID": "123456",
            "SLURM_STEP_NODELIST": "gpu-[007-010,12],cpu1", "SLURM_JOB_NODELIST": "gpu-[001-020]"}
    assert slurm_task_environment(task) == {"RANK": "11", "WORLD_SIZE": "16", "LOCAL_RANK": "3",
                                            "MASTER_ADDR": "gpu-007", "MASTER_PORT": "23456"}
    ports = {int(slurm_task_environment(dict(task, SLURM_JOB_ID=str(job)))["MASTER_PORT"])
             for job in range(0, 10**6, 7)}
    assert min(ports) == 20000 and max(ports) < 32768  # below the kernel's ephemeral ports: not taken by a connection
    assert slurm_task_environment(dict(task, MASTER_ADDR="ib-gpu-007", MASTER_PORT="6000")) == {
        "RANK": "11", "WORLD_SIZE": "16", "LOCAL_RANK": "3"}
    # a launcher inside the step already named the ranks (DeepSpeed's, torchrun; slurm.sbatch's one task per node)
    assert slurm_task_environment(dict(task, RANK="5", WORLD_SIZE="16")) == {}
    # sbatch's own shell sets SLURM_NTASKS and SLURM_PROCID but no step: a plain python there is one rank
    assert slurm_task_environment({"SLURM_NTASKS": "16", "SLURM_PROCID": "0", "SLURM_JOB_NODELIST": "a[1-2]"}) == {}
    assert slurm_task_environment(dict(task, SLURM_STEP_NUM_TASKS="1")) == {}
    # mpirun inside an allocation starts one daemon per node with srun: its ranks inherit that step's SLURM_*,
    # which describe the daemons (rank 13 of 16 would be taken as rank 1 of 2); the MPI variables name the rank
    daemons = dict(task, SLURM_STEP_NUM_TASKS="2", SLURM_PROCID="1", SLURM_LOCALID="0")
    for mpi in ({"OMPI_COMM_WORLD_SIZE": "16", "OMPI_COMM_WORLD_RANK": "13"}, {"PMI_SIZE": "16", "PMI_RANK": "13"},
                {"PMIX_RANK": "13"}):
        assert slurm_task_environment(dict(daemons, **mpi)) == {}
        assert launched_rank(dict(daemons, **mpi)) == 13
    # srun launching the ranks itself with PMI: the two agree, and SLURM's variables stand
    assert slurm_task_environment(dict(task, PMI_SIZE="16", PMI_RANK="11"))["RANK"] == "11"
    assert launched_rank(task) == 11 and launched_rank({}) == 0 and launched_rank({"RANK": "3", "PMI_RANK": "5"}) == 3
    without_nodes = {k: v for k, v in task.items() if not k.endswith("NODELIST")}
    with pytest.raises(RuntimeError, match="set MASTER_ADDR to the host of task 0"):
        slurm_task_environment(without_nodes)
    assert [first_slurm_host(n) for n in ("node1,node2", "n[1-3]-ib", "a[3,1]b[5-6]", "single")] == [
        "node1", "n1-ib", "a3b5", "single"]


def test_engine_json_that_sets_injected_values_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"gradient_clipping": 1.0, "scheduler": {"params": {"warmup_num_steps": 5}},
                                "zero_optimization": {"stage": 2}}))
    with pytest.raises(ValueError, match=r"gradient_clipping, scheduler.params.warmup_num_steps.*run config"):
        engine.read_engine_json(path)
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    assert engine.zero_stage(engine.read_engine_json(path)) == 2


_GLOO_EXIT = """
import sys, torch, torch.distributed as dist
from pretrain.distributed import close_distributed
dist.init_process_group("gloo")
tensor = torch.ones(1000)
for _ in range(20):
    dist.all_reduce(tensor)
    dist.all_gather([torch.empty(1000) for _ in range(dist.get_world_size())], tensor)
close_distributed()
assert not dist.is_initialized()
"""


@pytest.mark.slow
def test_ranks_that_close_the_process_group_exit_cleanly(tmp_path: Path) -> None:
    """Left to interpreter shutdown, a gloo group aborts the process at exit in most 4-rank runs ("terminate
    called without an active exception"); the commands close it when they complete."""
    import subprocess
    import sys

    from conftest import subprocess_env

    script = tmp_path / "exit.py"
    script.write_text(_GLOO_EXIT)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", str(script)]
    for _ in range(4):  # without closing, each run aborts about half the time here
        done = subprocess.run(command, env=subprocess_env(PYTHONPATH=str(Path(__file__).resolve().parents[2])),
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0 and "terminate called" not in done.stderr, done.stderr[-3000:]


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs POSIX shared memory in /dev/shm")
def test_shared_memory_names_are_unlinked_and_their_mappings_stay_valid(tmp_path: Path, one_rank_group) -> None:
    """What a rank maps from /dev/shm/deepspeed_* loses its name (nothing stays in RAM after the run); the mapping
    still reads and writes, and what the process maps from elsewhere is left alone."""
    import mmap

    shm = Path("/dev/shm") / f"deepspeed_allreduce_buffer_test_{os.getpid()}_0"
    other = tmp_path / "other.bin"
    for path in (shm, other):
        path.write_bytes(b"\0" * 4096)
    with shm.open("r+b") as handle, other.open("r+b") as other_handle:
        view, other_view = mmap.mmap(handle.fileno(), 4096), mmap.mmap(other_handle.fileno(), 4096)
    maps = tmp_path / "maps"
    maps.write_text(f"7f00-7f01 rw-s 00000000 00:19 12 {shm}\n7f02-7f03 rw-s 00000000 00:19 13 {other}\n"
                    "7f04-7f05 r--p 00000000 00:00 0 \n")
    try:
        assert distributed.unlink_shared_memory_names(maps) == [str(shm)]
        assert not shm.exists() and other.exists()
        view[:5] = b"still"
        assert view[:5] == b"still"
        assert distributed.unlink_shared_memory_names(maps) == []  # already gone: nothing to do, no error
    finally:
        view.close()
        other_view.close()
        shm.unlink(missing_ok=True)


def test_each_step_runs_at_the_rate_transformers_schedules_give_it(one_rank_group, monkeypatch) -> None:
    """A real DeepSpeed engine from `engine_config` + `build_engine`: the rate its optimizer applies at step k is
    transformers' warm-up schedule at k - 1 (0 first, the peak right after the warm-up), not DeepSpeed's own start
    a step later; the linear decay is transformers' too."""
    from transformers import get_cosine_schedule_with_warmup, get_linear_schedule_with_warmup

    from pretrain.batch_plan import plan_batch

    monkeypatch.setenv("LOCAL_RANK", "0")
    peak, warmup, total = 1e-3, 4, 12
    engine_json = engine.read_engine_json(REPO_ROOT / "ds_configs/zero0_fp32_cpu.json")
    for schedule, make in (("linear", get_linear_schedule_with_warmup), ("cosine", get_cosine_schedule_with_warmup)):
        config = engine.engine_config(engine_json, plan_batch(1, 1, 1), 1.0, {"lr": peak}, peak, 0.0, warmup, total,
                                      schedule=schedule)
        ds_engine = engine.build_engine(torch.nn.Linear(2, 1), config, weight_decay=0.0)
        applied = []
        for _ in range(total):
            applied.append(ds_engine.optimizer.param_groups[0]["lr"])
            ds_engine.backward(ds_engine(torch.ones(1, 2)).sum())
            ds_engine.step()
        reference_optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=peak)
        reference = make(reference_optimizer, warmup, total)
        expected = []
        for _ in range(total):
            expected.append(reference_optimizer.param_groups[0]["lr"])
            reference_optimizer.step()
            reference.step()
        assert applied[0] == 0.0 and applied[:warmup] == pytest.approx(expected[:warmup], abs=1e-12)
        if schedule == "linear":
            assert applied == pytest.approx(expected, rel=1e-6, abs=1e-12)
        else:  # DeepSpeed's cosine decays one step ahead of transformers' and reaches min_lr (0 here) on the last step
            assert applied[warmup] == pytest.approx(peak * (1 + math.cos(math.pi / (total - warmup))) / 2)
            assert applied[warmup + 1:] == pytest.approx(expected[warmup + 2:] + [0.0], rel=1e-6, abs=1e-12)


def test_a_broken_deepspeed_json_is_named(tmp_path: Path) -> None:
    broken = tmp_path / "ds.json"
    broken.write_text('{"zero_optimization": {stage: 2}}')
    with pytest.raises(ValueError, match=r"ds.json: not valid JSON \(Expecting property name"):
        engine.read_engine_json(broken)
    broken.write_text("[1, 2]")
    with pytest.raises(ValueError, match="ds.json: a DeepSpeed config is a JSON object, this holds a list"):
        engine.read_engine_json(broken)


def test_zero_offload_with_accumulation_takes_each_micro_batchs_gradients(one_rank_group, monkeypatch) -> None:
    """DeepSpeed hooks the backward of the loss among the tensors a module returns, and its ZeRO optimizer relies on
    that hook to learn which micro-batch's gradients a backward makes. With the optimizer offloaded and gradient
    buckets smaller than the model, the pre-training forward's output must expose its loss to it: the update equals
    the one without offload (it took the wrong micro-batch's gradients when the output hid the loss)."""
    from pretrain.batch_plan import plan_batch
    from pretrain.data import synthetic_batch
    from pretrain.model import build_model, preset

    monkeypatch.setenv("LOCAL_RANK", "0")
    cfg = dataclasses.replace(preset("tiny"), vocab_size=1200, hidden_dropout=0.0, attention_dropout=0.0)
    engine_json = engine.read_engine_json(REPO_ROOT / "ds_configs/zero2_fp32_cpu.json")

    def train(offload: bool) -> tuple[list[float], torch.Tensor]:
        zero = dict(engine_json["zero_optimization"], reduce_bucket_size=5000)  # a bucket fills inside a backward
        if offload:
            zero["offload_optimizer"] = {"device": "cpu"}
        config = engine.engine_config(dict(engine_json, zero_optimization=zero, zero_force_ds_cpu_optimizer=False),
                                      plan_batch(4, 2, 1), 1.0, {"lr": 1e-3}, 1e-3, 0.0, 1, 10)
        torch.manual_seed(0)
        model = build_model(cfg)
        ds_engine = engine.build_engine(model, config, weight_decay=0.01)
        norms = []
        for step in range(2):
            batches = [synthetic_batch(cfg, 2, 16, 3, seed=step * 2 + micro) for micro in range(2)]
            engine.optimizer_step(ds_engine, batches, loss_of=lambda output: output.loss,
                                  observe=lambda batch, output: None, before_update=lambda: None)
            norms.append(float(ds_engine.get_global_grad_norm()))
        return norms, model.layers[0].ffn_in.weight.detach().clone()

    (norms, weights), (offloaded_norms, offloaded_weights) = train(offload=False), train(offload=True)
    assert offloaded_norms == pytest.approx(norms, rel=1e-5)
    torch.testing.assert_close(offloaded_weights, weights, rtol=1e-5, atol=1e-6)


def test_without_zero_the_step_measures_the_gradient_norm_deepspeed_does_not(one_rank_group, monkeypatch) -> None:
    """Without ZeRO in fp32 DeepSpeed records no gradient norm: `optimizer_step` measures it, equal to the norm
    ZeRO-2 records for the same step, so a non-finite gradient stops such a run too (it was applied and saved)."""
    from pretrain.batch_plan import plan_batch
    from pretrain.data import synthetic_batch
    from pretrain.model import build_model, preset

    monkeypatch.setenv("LOCAL_RANK", "0")
    cfg = dataclasses.replace(preset("tiny"), vocab_size=1200, hidden_dropout=0.0, attention_dropout=0.0)
    batches = [synthetic_batch(cfg, 2, 16, 3, seed=micro) for micro in range(2)]

    def step(ds_json: str, scale: float = 1.0) -> tuple[Any, float | None]:
        config = engine.engine_config(engine.read_engine_json(REPO_ROOT / "ds_configs" / ds_json), plan_batch(4, 2, 1),
                                      1.0, {"lr": 1e-3}, 1e-3, 0.0, 1, 10)
        torch.manual_seed(0)
        ds_engine = engine.build_engine(build_model(cfg), config, weight_decay=0.01)
        measured = engine.optimizer_step(ds_engine, batches, loss_of=lambda output: output.loss * scale,
                                         observe=lambda batch, output: None, before_update=lambda: None)
        return ds_engine, measured

    zero0, measured = step("zero0_fp32_cpu.json")
    zero2, recorded = step("zero2_fp32_cpu.json")
    assert zero0.get_global_grad_norm() is None and measured is not None and recorded is None
    assert measured == pytest.approx(engine.step_gradient_norm(zero2, None), rel=1e-5) and measured > 0
    assert engine.nonfinite_gradient_norm(zero0, measured) is None
    zero0, measured = step("zero0_fp32_cpu.json", scale=math.inf)
    assert not math.isfinite(engine.nonfinite_gradient_norm(zero0, measured))


# ------------------------------------------------------------------------------- FusedAdam or torch's AdamW
FUSED, CPU_ADAM = "FusedAdamBuilder", "CPUAdamBuilder"


@pytest.mark.parametrize("optimizer, zero, op", [
    ({"type": "AdamW", "params": {}}, {"stage": 2}, FUSED),
    ({"type": "adam"}, {}, FUSED),
    ({"type": "AdamW", "params": {"torch_adam": False}}, {}, FUSED),
    ({"type": "AdamW", "params": {"torch_adam": True}}, {}, None),
    ({"type": "AdamW", "params": {}}, {"stage": 2, "offload_optimizer": {"device": "cpu"}}, CPU_ADAM),
    ({"type": "AdamW", "params": {"torch_adam": True}}, {"stage": 2, "offload_optimizer": {"device": "cpu"}}, None),
    ({"type": "AdamW", "params": {}}, {"stage": 3, "offload_optimizer": {"device": "none"}}, FUSED),
    ({"type": "Lamb", "params": {}}, {}, None),
    (None, {}, None),  # a client optimizer
])
def test_the_op_deepspeed_loads_for_each_optimizer_block(optimizer, zero, op) -> None:
    config = {"zero_optimization": zero} | ({"optimizer": optimizer} if optimizer is not None else {})
    assert engine.adam_op(config) == op


def test_a_build_log_is_summarised_by_its_first_line_and_the_line_naming_the_cause() -> None:
    log = ("Error building extension 'fused_adam': [1/3] /usr/local/cuda/bin/nvcc -c fused_adam_frontend.cpp -o f.o\n"
           "FAILED: f.o\n/usr/local/cuda/bin/nvcc -c fused_adam_frontend.cpp -o f.o\n"
           "nvcc fatal   : Unsupported gpu architecture 'compute_90a'\nninja: build stopped: subcommand failed.\n")
    assert accelerator.error_summary(RuntimeError(log)) == (
        "RuntimeError: Error building extension 'fused_adam' "
        "(nvcc fatal   : Unsupported gpu architecture 'compute_90a')")
    assert accelerator.error_summary(RuntimeError("CUDA_HOME does not exist, unable to compile CUDA op(s)")) == \
        "RuntimeError: CUDA_HOME does not exist, unable to compile CUDA op(s)"


@pytest.mark.slow  # ≈ 10 s: a failed JIT build
def test_where_fused_adam_cannot_be_built_the_engine_steps_with_torch_adamw_unless_the_json_insists(
        one_rank_group, monkeypatch, tmp_path, caplog) -> None:
    """A real failed FusedAdam build (DeepSpeed's own JIT load; here its C++ compiler is missing, on a GPU machine
    without the CUDA toolkit nvcc is): the engine is built and steps with torch's AdamW, saying why once; a JSON
    that sets torch_adam false stops before deepspeed.initialize, naming the cause and the fix."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.ops.op_builder.builder import OpBuilder

    from pretrain.batch_plan import plan_batch

    monkeypatch.setenv("LOCAL_RANK", "0")
    get_accelerator().create_op_builder("ShareMemCommBuilder").load()  # DeepSpeed's CPU comm op, with the compiler
    monkeypatch.setattr(OpBuilder, "_loaded_ops", {"deepspeed_shm_comm": OpBuilder._loaded_ops["deepspeed_shm_comm"]})
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ops"))  # nothing built before
    engine_json = engine.read_engine_json(REPO_ROOT / "ds_configs/zero0_fp32_cpu.json")
    del engine_json["optimizer"]["params"]["torch_adam"]  # as the GPU configs: DeepSpeed's FusedAdam
    config = engine.engine_config(engine_json, plan_batch(1, 1, 1), 1.0, {"lr": 0.1}, 0.1, 0.0, 1, 4)
    model = torch.nn.Linear(2, 1)
    before = model.weight.detach().clone()
    ds_engine = engine.build_engine(model, config, weight_decay=0.0)
    assert type(ds_engine.optimizer) is torch.optim.AdamW
    assert "torch_adam" not in config["optimizer"]["params"]  # the caller's config is left as it was
    for _ in range(2):  # the first step runs at the warm-up's start, rate 0
        ds_engine.backward(ds_engine(torch.ones(1, 2)).sum())
        ds_engine.step()
    assert not torch.equal(model.weight.detach(), before) and torch.isfinite(model.weight).all()
    said = caplog.text  # said once, through logging (`say_once`)
    caplog.clear()
    assert "[optimizer] DeepSpeed's FusedAdam cannot be loaded here (RuntimeError: Error building extension " \
           "'fused_adam' (" in said and "): stepping with torch's AdamW" in said, said
    assert re.search(r"/nonexistent/g\+\+: (not found|No such file or directory)", said), said
    assert "CUDA toolkit's nvcc" in said

    # a checkpoint FusedAdam stepped goes on with torch's AdamW, which takes over its state
    from pretrain.resume import ResumePoint

    fused = ResumePoint(tmp_path, "global_step4", "global_step4",
                        {"optimizer_class": "deepspeed.ops.adam.fused_adam.FusedAdam"})
    resumed = engine.build_engine(torch.nn.Linear(2, 1), config, weight_decay=0.0, resumed=fused)
    assert type(resumed.optimizer) is torch.optim.AdamW
    assert f"{tmp_path / 'global_step4'} was stepped by DeepSpeed's FusedAdam, whose state torch's AdamW takes " \
           "over. A checkpoint of this run resumes with torch's AdamW" in caplog.text

    config["optimizer"]["params"]["torch_adam"] = False  # (torch does not retry a failed build in one process)
    with pytest.raises(SetupError, match=r"^DeepSpeed's FusedAdam cannot be loaded here: .*The DeepSpeed JSON "
                                                r"sets optimizer.params.torch_adam false; DeepSpeed builds FusedAdam"):
        engine.build_engine(torch.nn.Linear(2, 1), config, weight_decay=0.0)


def test_a_checkpoint_resumes_into_the_optimizer_that_stepped_it(one_rank_group, monkeypatch, tmp_path,
                                                                 caplog) -> None:
    """DeepSpeed's FusedAdam cannot take over torch's AdamW's state (its load stops on a KeyError: the parameter
    groups torch saved lack bias_correction). A checkpoint stepped by torch's AdamW (where FusedAdam did not load)
    resumes with it wherever it runs, even where FusedAdam loads; a JSON that insists on FusedAdam, or a class
    that cannot take over the one the marker records, is refused before anything is loaded."""
    from pretrain.batch_plan import plan_batch
    from pretrain.resume import ResumePoint

    monkeypatch.setenv("LOCAL_RANK", "0")
    engine_json = engine.read_engine_json(REPO_ROOT / "ds_configs/zero0_fp32_cpu.json")
    del engine_json["optimizer"]["params"]["torch_adam"]  # as the GPU configs: DeepSpeed's FusedAdam
    config = engine.engine_config(engine_json, plan_batch(1, 1, 1), 1.0, {"lr": 0.1}, 0.1, 0.0, 1, 4)

    def resumed(optimizer: str) -> ResumePoint:
        return ResumePoint(tmp_path, "global_step4", "global_step4", {"step": 4, "optimizer_class": optimizer})

    torch_adamw, fused = engine.optimizer_name(torch.optim.AdamW), "deepspeed.ops.adam.fused_adam.FusedAdam"
    assert torch_adamw == "torch.optim.adamw.AdamW"
    ds_engine = engine.build_engine(torch.nn.Linear(2, 1), config, weight_decay=0.0, resumed=resumed(torch_adamw))
    assert engine.optimizer_name(ds_engine.basic_optimizer) == torch_adamw  # FusedAdam was not even tried
    assert "torch_adam" not in config["optimizer"]["params"]
    assert f"[optimizer] {tmp_path / 'global_step4'} was stepped by torch's AdamW: so is this run" in \
        caplog.text

    config["optimizer"]["params"]["torch_adam"] = False
    with pytest.raises(SetupError, match=r"was stepped by torch's AdamW and the DeepSpeed JSON sets "
                                                r"optimizer.params.torch_adam false"):
        engine.build_engine(torch.nn.Linear(2, 1), config, weight_decay=0.0, resumed=resumed(torch_adamw))
    config["optimizer"]["params"]["torch_adam"] = True
    engine.build_engine(torch.nn.Linear(2, 1), config, weight_decay=0.0, resumed=resumed(fused))  # takes it over
    adamax = engine.optimizer_name(torch.optim.Adamax)
    with pytest.raises(SetupError, match=rf"^{tmp_path / 'global_step4'} was stepped by {adamax}, whose state "
                                                rf"{torch_adamw}, which this run builds, cannot take over\. Resume "
                                                r"with the optimizer settings it ran with"):
        engine.build_engine(torch.nn.Linear(2, 1), config, weight_decay=0.0, resumed=resumed(adamax))
    # a checkpoint whose marker records no optimizer (written before markers did) is not second-guessed
    engine.build_engine(torch.nn.Linear(2, 1), config, weight_decay=0.0,
                        resumed=ResumePoint(tmp_path, "global_step4", "global_step4", {"step": 4}))
    # only torch's Adam / AdamW state makes a JSON that would use FusedAdam step with torch's AdamW instead
    config = copy.deepcopy(config)
    del config["optimizer"]["params"]["torch_adam"]
    monkeypatch.setattr(engine, "op_failure", lambda op: None)  # as where FusedAdam loads
    assert engine.adam_that_loads(config, resumed(adamax)) is config
    assert engine.adam_that_loads(config, resumed(fused)) is config
    assert engine.adam_that_loads(config, resumed(torch_adamw))["optimizer"]["params"]["torch_adam"] is True
    assert engine.adam_that_loads(config, resumed(engine.optimizer_name(torch.optim.Adam)))["optimizer"]["params"][
        "torch_adam"] is True
    config["zero_optimization"] = {"stage": 2, "offload_optimizer": {"device": "cpu"}}  # DeepSpeed's CPUAdam
    with pytest.raises(SetupError, match=r"was stepped by torch's AdamW, and the DeepSpeed JSON offloads "
                                                r"optimizer state .*Resume with a JSON without offload_optimizer, or "
                                                r"one that offloads torch's"):
        engine.adam_that_loads(config, resumed(torch_adamw))
    assert engine.adam_that_loads(config, resumed(fused)) is config


@pytest.mark.slow  # builds DeepSpeed's FusedAdam for the CPU once (≈ 40 s with g++), two universal conversions
def test_which_adam_goes_on_from_which_checkpoint_as_saved_and_universally_converted(one_rank_group, monkeypatch,
                                                                                    tmp_path) -> None:
    """DeepSpeed's FusedAdam (its CPU build here: the same class and state as on GPUs) and torch's AdamW, ZeRO-2
    checkpoints of two steps resumed for two more, as saved (ZeRO-2) and universally converted (ZeRO-1): where one
    goes on from the other's state it ends where four FusedAdam steps do; where DeepSpeed's load or the first step
    would fail (FusedAdam reading bias_correction torch's groups lack; torch's AdamW refusing the plain-number step
    a conversion gives it), `build_engine` either builds the optimizer that goes on or refuses before loading."""
    from pretrain.batch_plan import plan_batch
    from pretrain.convert import to_universal
    from pretrain.data import synthetic_batch
    from pretrain.model import build_model, preset
    from pretrain.resume import ResumePoint

    monkeypatch.setenv("LOCAL_RANK", "0")
    failure = accelerator.op_failure(FUSED)
    if failure is not None:
        pytest.skip(f"DeepSpeed's FusedAdam does not build on this machine: {failure}")
    cfg = dataclasses.replace(preset("tiny"), vocab_size=1200, hidden_dropout=0.0, attention_dropout=0.0)
    engine_json = engine.read_engine_json(REPO_ROOT / "ds_configs/zero2_fp32_cpu.json")
    del engine_json["optimizer"]["params"]["torch_adam"]  # as the GPU configs: DeepSpeed's FusedAdam

    def train(steps: range, torch_adam: bool | None = None, resumed: ResumePoint | None = None,
              save: str | None = None) -> tuple[str, torch.Tensor]:
        json_ = copy.deepcopy(engine_json)
        if torch_adam is not None:
            json_["optimizer"]["params"]["torch_adam"] = torch_adam
        universal = resumed is not None and resumed.universal
        json_["zero_optimization"]["stage"] = 1 if universal else 2
        config = engine.engine_config(json_, plan_batch(2, 2, 1), 1.0, {"lr": 1e-2}, 1e-2, 0.0, 1, 10,
                                      load_universal=universal)
        torch.manual_seed(0)
        model = build_model(cfg)
        ds_engine = engine.build_engine(model, config, weight_decay=0.01, resumed=resumed)
        if resumed is not None:
            ds_engine.load_checkpoint(str(resumed.directory), resumed.load_tag)
        for step in steps:
            engine.optimizer_step(ds_engine, [synthetic_batch(cfg, 2, 16, 3, seed=step)], loss_of=lambda o: o.loss,
                                  observe=lambda batch, output: None, before_update=lambda: None)
        if save is not None:
            ds_engine.save_checkpoint(str(tmp_path), save)
        return engine.optimizer_name(ds_engine.basic_optimizer), model.layers[0].ffn_in.weight.detach().clone()

    fused_adam, four_steps = train(range(4))
    assert fused_adam == "deepspeed.ops.adam.fused_adam.FusedAdam"
    torch_adamw = "torch.optim.adamw.AdamW"
    assert train(range(2), save="fused")[0] == fused_adam
    assert train(range(2), torch_adam=True, save="torch")[0] == torch_adamw

    def resumed(tag: str, optimizer: str | None, universal: bool = False) -> ResumePoint:
        load_tag = to_universal(tmp_path, tag) if universal else tag
        return ResumePoint(tmp_path, tag, load_tag, {"optimizer_class": optimizer} if optimizer else {})

    def goes_on(expected: str, **arguments) -> None:
        built, weights = train(range(2, 4), **arguments)
        assert built == expected
        torch.testing.assert_close(weights, four_steps, rtol=1e-5, atol=1e-6)

    # as saved: FusedAdam's state goes on with either; torch's only with torch's
    goes_on(torch_adamw, torch_adam=True, resumed=resumed("fused", fused_adam))
    goes_on(torch_adamw, resumed=resumed("torch", torch_adamw))  # the JSON leaves the choice to the checkpoint
    with pytest.raises(KeyError, match="bias_correction"):  # DeepSpeed's own load, where nothing chooses
        train(range(2, 4), resumed=resumed("torch", None))
    with pytest.raises(SetupError, match=rf"^{tmp_path / 'torch'} was stepped by torch's AdamW and the "
                                                r"DeepSpeed JSON sets optimizer.params.torch_adam false, asking for "
                                                r"DeepSpeed's FusedAdam, which cannot take over torch's state"):
        train(range(2, 4), torch_adam=False, resumed=resumed("torch", torch_adamw))

    # universally converted: FusedAdam goes on from either; torch's AdamW from neither
    goes_on(fused_adam, torch_adam=False, resumed=resumed("torch", torch_adamw, universal=True))
    goes_on(fused_adam, resumed=resumed("fused", fused_adam, universal=True))
    with pytest.raises(RuntimeError, match="state_steps"):  # torch's first step, where nothing chooses
        train(range(2, 4), torch_adam=True, resumed=resumed("fused", None, universal=True))
    with pytest.raises(SetupError, match=rf"^{tmp_path / 'fused'} was stepped by {fused_adam}, whose state "
                                                r"\(converted to DeepSpeed's universal checkpoint: another world size "
                                                rf"or ZeRO stage\) {torch_adamw}, which this run builds, cannot take "
                                                r"over"):
        train(range(2, 4), torch_adam=True, resumed=resumed("fused", fused_adam, universal=True))
    monkeypatch.setattr(engine, "op_failure", lambda op: "RuntimeError: no CUDA toolkit")  # as without nvcc
    with pytest.raises(SetupError, match=r"^DeepSpeed's FusedAdam cannot be loaded here: RuntimeError: no "
                                                rf"CUDA toolkit\. {tmp_path / 'fused'} was stepped by DeepSpeed's "
                                                r"FusedAdam and is resumed on another world size or ZeRO stage, "
                                                r".*or resume with the world size and ZeRO stage it was saved with$"):
        train(range(2, 4), resumed=resumed("fused", fused_adam, universal=True))


@pytest.mark.slow  # ≈ 5 s: a failed JIT build
def test_offloaded_optimizer_state_stops_naming_the_compiler_where_cpu_adam_cannot_be_built(
        one_rank_group, monkeypatch, tmp_path) -> None:
    from deepspeed.accelerator import get_accelerator
    from deepspeed.ops.op_builder.builder import OpBuilder

    from pretrain.batch_plan import plan_batch

    monkeypatch.setenv("LOCAL_RANK", "0")
    get_accelerator().create_op_builder("ShareMemCommBuilder").load()  # DeepSpeed's CPU comm op, with the compiler
    monkeypatch.setattr(OpBuilder, "_loaded_ops", {"deepspeed_shm_comm": OpBuilder._loaded_ops["deepspeed_shm_comm"]})
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ops"))
    engine_json = engine.read_engine_json(REPO_ROOT / "ds_configs/zero2_fp32_cpu.json")
    del engine_json["optimizer"]["params"]["torch_adam"]
    engine_json["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    config = engine.engine_config(engine_json, plan_batch(1, 1, 1), 1.0, {"lr": 0.1}, 0.1, 0.0, 1, 4)
    with pytest.raises(SetupError, match=r"^DeepSpeed's CPUAdam, which steps optimizer state offloaded .*cannot "
                                                r"be loaded here: RuntimeError: Error building extension 'cpu_adam' "
                                                r"\(.*/nonexistent/g\+\+: (not found|No such file or directory)\)\. "
                                                r".*C\+\+ compiler"):
        engine.build_engine(torch.nn.Linear(2, 1), config, weight_decay=0.0)
