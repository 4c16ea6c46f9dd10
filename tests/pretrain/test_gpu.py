"""Pre-training on a CUDA GPU (`pytest -m gpu`, one GPU): the runs users launch, on NCCL, with DeepSpeed's CUDA
accelerator and its JIT-built ops (FusedAdam; CPUAdam for offload). Skipped where torch sees no CUDA device.

Every training run is a child process with ``DS_ACCELERATOR=cuda`` (this process keeps the CPU accelerator the CPU
suite uses): 1 rank, tiny model, the real unilm test shards, global batch 8, dropout on.
  fp16 ZeRO-2   8 steps uninterrupted, twice (how far two identical GPU runs differ: atomics in CUDA backward
                kernels need not add in the same order), and once stopped at step 4 and rerun to step 8 (eager)
  bf16 ZeRO-3   4 steps with held-out evaluation every 2, then exported to Hugging Face and loaded in transformers
  ZeRO-2 offload  fp16, optimizer states and step on the CPU (DeepSpeed's CPUAdam)
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import GPU_ENV, ROOT, subprocess_env
from training_runs import check, launch, losses, metrics

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
FUSED_ADAM = "deepspeed.ops.adam.fused_adam.FusedAdam"


def adam_of_gpu_runs(log: subprocess.CompletedProcess) -> str:
    """The class the GPU JSONs step with: DeepSpeed's FusedAdam where this machine has the CUDA toolkit to build it
    (or a prebuilt op); where it lacks it, torch's AdamW, as the run ``log`` says."""
    from pretrain.accelerator import fused_adam_toolkit_missing

    if fused_adam_toolkit_missing() is None:
        return FUSED_ADAM
    assert "[optimizer] DeepSpeed's FusedAdam cannot be loaded here" in log.stdout + log.stderr, log.stderr[-2000:]
    return "torch.optim.adamw.AdamW"


def gpu_launch(overrides: list[str], **extra_env: str) -> subprocess.CompletedProcess:
    return check(launch(overrides, extra_env={**GPU_ENV, **extra_env}, timeout=420))


def gpu_python(code: str) -> dict:
    """Run ``code`` in a child process on DeepSpeed's CUDA accelerator; it prints one JSON line last."""
    process = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=subprocess_env(**GPU_ENV),
                             capture_output=True, text=True, timeout=300)
    assert process.returncode == 0, process.stderr[-4000:]
    return json.loads(process.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def common(unilm_shards: Path) -> list[str]:
    return [f"data.shards={unilm_shards}", "model.overrides.vocab_size=4000", "train.global_batch_size=8",
            "train.micro_batch_size=4", "optim.warmup_steps=2", "train.keep_last=5"]


@pytest.fixture(scope="module")
def fp16_runs(common: list[str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("gpu_fp16")
    # Eager blocks: compiled ones (CUDA's default) get a static graph for the first shape a process sees and a
    # dynamic one after, so a resumed process would run other kernels than the uninterrupted one from step 5 on.
    fp16 = common + ["deepspeed_config=ds_configs/zero2_fp16.json", "train.max_steps=8", "train.save_interval=4",
                     "train.compile=false"]
    runs = {name: base / name for name in ("first", "second", "stopped")}
    for name in ("first", "second"):
        runs[f"{name}_log"] = gpu_launch(fp16 + [f"out_dir={runs[name]}"])
    gpu_launch(fp16 + [f"out_dir={runs['stopped']}", "train.exit_at_step=4"])
    assert max(losses(runs["stopped"])) == 4  # stopped after step 4, saved there
    runs["resume_log"] = gpu_launch(fp16 + [f"out_dir={runs['stopped']}"])
    return runs


def test_fp16_zero2_stop_and_rerun_continues_the_uninterrupted_run(fp16_runs: dict) -> None:
    first, second, resumed = (metrics(fp16_runs[name]) for name in ("first", "second", "stopped"))
    assert "[resume] global_step4: step 4, consumed_samples 32" in fp16_runs["resume_log"].stdout
    for run in (first, second, resumed):
        assert [r["step"] for r in run] == list(range(1, 9))
        assert [r["consumed_samples"] for r in run] == [8 * step for step in range(1, 9)]  # exact, no replay
        assert "loss_scale" in run[0]  # fp16 with DeepSpeed's dynamic loss scaler
    # The tolerance is measured, not assumed: two uninterrupted runs of the same command differ by `noise` (0 where
    # the kernels are deterministic). The resumed run may differ by as much (4× for the accumulation over steps),
    # far less than restarting dropout from the seed would change (the CUDA generator travels in the checkpoint).
    noise = max(abs(a["loss"] - b["loss"]) for a, b in zip(first, second))
    resume_gap = max(abs(a["loss"] - b["loss"]) for a, b in zip(first, resumed))
    assert resume_gap <= 4 * noise + 1e-6 * max(abs(r["loss"]) for r in first), (resume_gap, noise)
    assert [r["loss_scale"] for r in resumed] == [r["loss_scale"] for r in first]


def test_checkpoints_carry_the_cuda_generator_of_the_rank(fp16_runs: dict) -> None:
    state = torch.load(fp16_runs["first"] / "checkpoints" / "global_step8" / "mp_rank_00_model_states.pt",
                       map_location="cpu", weights_only=False)
    rng = state["rng_states"][0]
    assert rng["accelerator"]["device"] == "cuda" and rng["accelerator"]["state"].dtype == torch.uint8
    marker = json.loads((fp16_runs["first"] / "checkpoints" / "global_step8" / "complete.json").read_text())
    assert marker["precision"] == "fp16" and marker["zero_stage"] == 2
    # the GPU JSONs step with DeepSpeed's FusedAdam: built where the CUDA toolkit is, not replaced by torch's AdamW
    assert marker["optimizer_class"] == adam_of_gpu_runs(fp16_runs["first_log"]), fp16_runs["first_log"].stderr[-2000:]


def test_bf16_zero3_with_gpu_evaluation_exports_a_transformers_model(common: list[str], unilm_shards: Path,
                                                                     tmp_path: Path) -> None:
    from transformers import BertForPreTraining

    from pretrain.export import load_consolidated, main as export
    from pretrain.hf import load_hf_bert

    out = tmp_path / "run"
    log = gpu_launch(common + [f"out_dir={out}", "deepspeed_config=ds_configs/zero3_bf16.json", "train.max_steps=4",
                               "train.save_interval=4", f"data.eval_shards={unilm_shards}", "train.eval_interval=2",
                               "train.eval_samples=13"])
    records = metrics(out)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert "eval_loss" in records[1] and "eval_loss_seq2seq" in records[3] and "eval_loss" not in records[0]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in records)
    marker = json.loads((out / "checkpoints" / "global_step4" / "complete.json").read_text())
    assert marker["precision"] == "bf16" and marker["zero_stage"] == 3
    assert marker["optimizer_class"] == adam_of_gpu_runs(log)

    export([str(out / "checkpoints"), str(tmp_path / "hf")])
    ours = load_consolidated(out / "checkpoints" / "global_step4")
    hf = BertForPreTraining.from_pretrained(tmp_path / "hf").cuda().eval()
    assert torch.equal(hf.bert.embeddings.word_embeddings.weight.cpu(), ours.embeddings.token.weight)
    reloaded = load_hf_bert(tmp_path / "hf").state_dict()
    for name, value in ours.state_dict().items():
        if "segment" not in name:
            assert torch.equal(reloaded[name], value), name
    input_ids = torch.randint(5, 4000, (2, 16), device="cuda")
    with torch.no_grad():
        assert torch.isfinite(hf(input_ids=input_ids).prediction_logits).all()


def test_zero2_with_the_optimizer_offloaded_to_the_cpu_trains_and_saves(common: list[str], tmp_path: Path) -> None:
    gpu_launch(common + [f"out_dir={tmp_path}", "deepspeed_config=ds_configs/zero2_offload_fp16.json",
                         "train.max_steps=3", "train.save_interval=3"])
    records = metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3] and all(r["loss"] == r["loss"] for r in records)
    assert (tmp_path / "checkpoints" / "latest").read_text() == "global_step3"
    marker = json.loads((tmp_path / "checkpoints" / "global_step3" / "complete.json").read_text())
    assert marker["optimizer_class"] == "deepspeed.ops.adam.cpu_adam.DeepSpeedCPUAdam"


def test_loader_delivers_pinned_non_blocking_copies_on_the_rank_device(unilm_shards: Path) -> None:
    result = gpu_python(f"""
import json, torch
from data_prep.shard_format import ShardDataset
from pretrain.accelerator import bind_local_device
from pretrain.batch_plan import plan_batch
from pretrain.data import PretrainLoader, SampleOrder, collate, sample_objectives
device = bind_local_device()
dataset = ShardDataset({str(unilm_shards)!r})
order, plan = SampleOrder(sample_objectives(dataset), 5), plan_batch(12, 3, 1)
pad = dataset.special_tokens["pad"]
loader = PretrainLoader(dataset, order, plan, 0, 24, pad, 64, prefetch_steps=2, device=device)
same, devices = True, set()
for step in range(4):
    for batch, indices in zip(loader.next_step(), order.rank_step_indices(24 + 12 * step, plan, 0)):
        expected = collate([dataset[int(i)] for i in indices], pad, 64)
        devices |= {{str(t.device) for t in batch.values()}}
        same &= all(torch.equal(batch[k].cpu(), expected[k]) for k in expected)
side_stream = loader._feed.stream is not None and loader._feed.stream != torch.cuda.current_stream()
loader.close()
print(json.dumps({{"device": str(device), "devices": sorted(devices), "same": same, "side_stream": side_stream,
                  "consumed": loader.consumed_samples}}))
""")
    assert result == {"device": "cuda:0", "devices": ["cuda:0"], "same": True, "side_stream": True,
                      "consumed": 24 + 4 * 12}


def test_cuda_generator_state_round_trips_and_ranks_seed_their_own_streams(tmp_path: Path) -> None:
    result = gpu_python(f"""
import json, torch
from pretrain.accelerator import bind_local_device
from pretrain.rng import portable_rng_state, restore_rng_state, seed_everything
bind_local_device()
seed_everything(11)
seeded = torch.cuda.initial_seed()
torch.nn.functional.dropout(torch.ones(1000, device="cuda"), 0.5)  # advance the CUDA stream
torch.save(portable_rng_state(), {str(tmp_path / "rng.pt")!r})
first = torch.rand(8, device="cuda").tolist()
torch.rand(100, device="cuda")
restore_rng_state(torch.load({str(tmp_path / "rng.pt")!r}, weights_only=True))
again = torch.rand(8, device="cuda").tolist()
seed_everything(12)
other_rank = torch.rand(8, device="cuda").tolist()
print(json.dumps({{"seeded": seeded, "same": first == again, "ranks_differ": first != other_rank}}))
""")
    assert result == {"seeded": 11, "same": True, "ranks_differ": True}
