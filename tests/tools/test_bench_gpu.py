"""The GPU benchmark's code run where CI runs: the model-step measurement and the training-step throughput on the
CPU with the tiny model, the streaming command runner, and the GPU section's part-by-part bookkeeping."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import pytest

from pretrain.model import UniLMModel
from tests.conftest import DISTRIBUTED_VARIABLES
from tools import bench_all
from tools.bench_model import GPU_VARIANTS, measure_gpu, report_gpu
from tools.bench_train import train_step_throughput
from tools.stages import stream


@pytest.mark.slow  # ≈ 40 s: torch.compile builds the compiled variants for the CPU
def test_model_step_measurement_runs_every_variant_on_the_cpu() -> None:
    result = measure_gpu("tiny", batch_size=4, seq_len=64, predictions=8, steps=1, dtypes=("bf16",), device="cpu")
    assert set(result["rows"]) == {f"bf16_{variant}" for variant in GPU_VARIANTS}
    peak = result["peak_tflops"]["bf16"]
    for row in result["rows"].values():
        assert row["step_s"] > 0 and abs(row["samples_per_s"] - 4 / row["step_s"]) < 1e-9
        # no upper bound: on a shared CPU the peak probe and the step may see different loads
        assert abs(row["mfu"] - row["tflops"] / peak) < 1e-12 and row["mfu"] > 0
    assert "x transformers" in report_gpu(result)


def test_a_variant_that_fails_is_named_and_the_others_are_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(self: UniLMModel) -> None:
        raise RuntimeError("compiler failed")

    monkeypatch.setattr(UniLMModel, "compile_blocks", broken)
    result = measure_gpu("tiny", batch_size=2, seq_len=32, predictions=4, steps=1, dtypes=("bf16",), device="cpu")
    assert set(result["rows"]) == {"bf16_eager", "bf16_chunked_loss", "bf16_transformers"}
    assert result["errors"] == {"bf16_compiled": "RuntimeError: compiler failed",
                                "bf16_fast": "RuntimeError: compiler failed"}
    assert "bf16_fast FAILED: RuntimeError: compiler failed" in report_gpu(result)
    rows = bench_all.table_rows({"gpu": {"device": "cpu", "model": result}})
    assert len(rows) == 3 and not any("vs transformers" in r["benchmark"] for r in rows)


@pytest.mark.slow
def test_training_step_throughput_is_read_from_the_runs_metrics(unilm_shards: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    for name in DISTRIBUTED_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    result = train_step_throughput(str(unilm_shards), tmp_path, "bf16", steps=3, skipped=1, overrides=(
        "model.preset=tiny", "deepspeed_config=ds_configs/zero2_bf16_cpu.json", "train.global_batch_size=8",
        "train.micro_batch_size=4"))
    run_dir = tmp_path / f"train_bf16_{unilm_shards.name}"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert set(result) == {"samples_per_s", "tokens_per_s", "tflops", "mfu", "peak_tflops", "step_time_s"}
    assert result["samples_per_s"] == statistics.median(r["samples_per_s"] for r in records[1:])
    assert not (run_dir / "checkpoints").exists()
    assert "[exit] exit_at_step" in (tmp_path / f"{run_dir.name}.log").read_text()


def test_stream_returns_and_logs_the_output_as_the_command_prints_it(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "logs" / "child.log"
    code = "import sys; print('one', flush=True); print('two', file=sys.stderr, flush=True); sys.exit(3)"
    returncode, output = stream([sys.executable, "-c", code], log)
    assert returncode == 3 and output.split() == ["one", "two"]
    assert log.read_text() == output and capsys.readouterr().out == output
    stream([sys.executable, "-c", "print('three')"], log)
    assert log.read_text().split() == ["one", "two", "three"]  # appended


def test_the_gpu_section_keeps_the_parts_that_ran_when_one_fails(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    model = {"peak_tflops": {"bf16": 700.0}, "rows": {}, "errors": {"bf16_fast": "RuntimeError: compiler failed"}}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "GPU")
    monkeypatch.setattr(bench_all, "_shards", lambda args, seq_len=128: f"shards-{seq_len}")
    monkeypatch.setattr(bench_all, "_run", lambda command: Path(command[-1]).write_text(json.dumps(model)))
    partial_after: list[dict] = []

    def training(shards: str, out: Path, precision: str, overrides: tuple[str, ...] = (),
                 label: str = "") -> dict[str, float]:
        partial_after.append(json.loads((tmp_path / "gpu_partial.json").read_text()))
        if precision == "fp16":
            raise RuntimeError("training run failed (exit 1)")
        if overrides:
            assert overrides == ("train.pack_samples=false",) and label == "unpacked" and shards == "shards-512"
            return {"samples_per_s": 380.0}
        return {"samples_per_s": 400.0 if shards == "shards-512" else 1500.0}

    monkeypatch.setattr("tools.bench_train.train_step_throughput", training)
    result = bench_all.bench_gpu(argparse.Namespace(out=tmp_path, work=tmp_path / "work"))
    assert result["model"] == model and result["device"] == "GPU"
    assert result["train"] == {"bf16": {512: {"samples_per_s": 400.0}, 128: {"samples_per_s": 1500.0}}}
    assert result["train_unpacked"] == {"bf16": {512: {"samples_per_s": 380.0}}}
    assert list(result["errors"]) == ["model step: bf16_fast", "train fp16 512"]
    assert "exit 1" in result["errors"]["train fp16 512"]
    assert partial_after[0]["model"] == model and partial_after[0]["train"] == {}  # written after each part
    final = json.loads((tmp_path / "gpu_partial.json").read_text())
    assert final["train"]["bf16"] == {"512": {"samples_per_s": 400.0}, "128": {"samples_per_s": 1500.0}}


def test_gpu_speed_refuses_a_machine_without_a_cuda_gpu_and_writes_nothing(tmp_path: Path) -> None:
    import os
    import subprocess

    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    script = Path(__file__).resolve().parents[2] / "tools" / "gpu_speed.sh"
    done = subprocess.run([str(script), str(tmp_path / "out"), "bench"], capture_output=True, text=True,
                          env=dict(os.environ, PYTHON=sys.executable), timeout=120)
    assert done.returncode == 2 and "needs a CUDA GPU, and torch sees none here (torch " in done.stderr
    assert "the CPU figures are make bench" in done.stderr and not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------- make gpu-check (tools.gpu_check)
def test_gpu_check_refuses_a_machine_without_a_cuda_gpu_and_writes_nothing(tmp_path: Path) -> None:
    import subprocess

    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    root = Path(__file__).resolve().parents[2]
    out, work = tmp_path / "out", tmp_path / "work"
    done = subprocess.run(["make", "-s", "gpu-check", f"GPU_CHECK_OUT={out}", f"PY={sys.executable}"], cwd=root,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "tools.gpu_check: needs a CUDA GPU, and torch sees none here (torch " in done.stderr
    assert not out.exists() and not list(tmp_path.iterdir())
    done = subprocess.run([sys.executable, "-m", "tools.gpu_check", "--out", str(out), "--work", str(work)], cwd=root,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "nothing was written" in done.stderr and not list(tmp_path.iterdir())


def test_gpu_check_parts_write_results_after_each_part_and_later_parts_still_run(tmp_path: Path) -> None:
    from tools.gpu_check import Check, CheckFailed, Part, run_parts

    out = tmp_path / "out"
    check = Check(out, tmp_path / "work", tmp_path, {"device": "GPU"})
    seen: list[dict] = []

    def results_file() -> dict:
        seen.append(json.loads((out / "results.json").read_text()))  # valid JSON at every point
        assert not [p.name for p in out.iterdir() if p.name != "results.json" and p.is_file()]  # no temporary left
        return seen[-1]

    def first(check: Check) -> None:
        assert results_file() == {"device": "GPU", "parts": {}}  # written before the first part
        check.results["first_key"] = 1

    def raises(check: Check) -> None:
        written = results_file()
        assert written["first_key"] == 1 and written["parts"]["first"]["status"] == "ok"
        check.results["raises_rc"] = 3  # recorded before the failure: kept
        raise RuntimeError("boom")

    def hangs(check: Check) -> None:
        assert results_file()["parts"]["raises"]["status"] == "failed"
        check.results["hangs_started"] = True
        check.run("sleeper", [sys.executable, "-c", "import time; time.sleep(60)"])

    def fails_its_check(check: Check) -> None:
        assert results_file()["parts"]["hangs"]["status"] == "timed out"
        raise CheckFailed("losses differ")

    parts = [Part("first", 1, first), Part("raises", 1, raises), Part("hangs", 0.4, hangs),  # stopped at 2.5 x 0.4 s
             Part("fails", 1, fails_its_check), Part("too_long", 100, first)]  # more than twice the budget left
    assert run_parts(parts, check, budget_s=30) is False
    final = json.loads((out / "results.json").read_text())
    assert {name: part["status"] for name, part in final["parts"].items()} == {
        "first": "ok", "raises": "failed", "hangs": "timed out", "fails": "failed", "too_long": "skipped"}
    assert final["first_key"] == 1 and final["raises_rc"] == 3 and final["hangs_started"] is True
    assert final["parts"]["raises"]["error"] == "RuntimeError: boom"
    assert final["parts"]["fails"]["error"] == "CheckFailed: losses differ"
    assert "sleeper still running at the part's time limit" in final["parts"]["hangs"]["error"]
    assert 0.9 < final["parts"]["hangs"]["wall_s"] < 10 and check.jobs["sleeper"].process.returncode == -9
    assert "budget left, under half the part's estimate" in final["parts"]["too_long"]["error"]
    assert all(part["wall_s"] >= 0 and "estimate_s" in part for part in final["parts"].values())
    assert len(seen) == 4 and (out / "logs" / "sleeper.log").is_file()


def test_a_killed_gpu_check_keeps_the_parts_that_finished(tmp_path: Path) -> None:
    import subprocess

    script = f"""
import os, signal
from pathlib import Path
from tools.gpu_check import Check, Part, run_parts
def finished(check): check.results["finished_key"] = 1
def killed(check):
    check.results["unsaved"] = 2
    os.kill(os.getpid(), signal.SIGKILL)  # a device call stopped by its time limit
run_parts([Part("finished", 1, finished), Part("killed", 1, killed)], Check(Path({str(tmp_path)!r}), Path(), Path(),
          {{}}), 30)
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).resolve().parents[2], timeout=120)
    assert done.returncode == -9
    results = json.loads((tmp_path / "results.json").read_text())
    assert results == {"parts": {"finished": {"estimate_s": 1, "status": "ok", "wall_s": results["parts"]["finished"]
                                              ["wall_s"]}}, "finished_key": 1}


TOY_TRAINER = """
import json, sys, time
from pathlib import Path
from pretrain import checkpoint as ckpt
from pretrain.metrics import prepare_metrics_file
args = dict(arg.split("=", 1) for arg in sys.argv[1:])
run = Path(args["out_dir"]); checkpoints = run / "checkpoints"; checkpoints.mkdir(parents=True, exist_ok=True)
tag = ckpt.newest_complete_tag(checkpoints)
step = ckpt.step_of_tag(tag) if tag else 0
prepare_metrics_file(run / "metrics.jsonl", step if tag else None)
drift = float(args.get("drift", 0)) if tag else 0.0  # a resume that is not exact
rates = {"samples_per_s": 250.0, "tokens_per_s": 1e5, "tflops": 400.0, "mfu": 0.5, "peak_tflops": 800.0}
while step < int(args.get("train.exit_at_step", 100)):
    # after the step the check kills it at, it waits for the kill: no race with the next save
    time.sleep(60 if step == int(args["kill_after"]) else 0.05)
    step += 1
    with open(run / "metrics.jsonl", "a") as metrics:
        metrics.write(json.dumps({"step": step, "loss": 10 - step / 10 + drift, "step_time_s": 1.0 + step / 100,
                                  **rates}) + "\\n")
    if step % int(args["train.save_interval"]) == 0 or step == int(args.get("train.exit_at_step", 0)):
        (checkpoints / ckpt.tag_for_step(step)).mkdir()
        (checkpoints / ckpt.tag_for_step(step) / "state").write_text(str(step))
        ckpt.write_marker(checkpoints / ckpt.tag_for_step(step), {})
"""
"""A stand-in for pretrain.train: a marker-vouched checkpoint every ``train.save_interval`` steps, resuming from the
newest, each step's metrics.jsonl record."""


def toy_trainer(tmp_path: Path, save_step: int, kill_after_step: int, drift: float = 0.0) -> list[str]:
    (tmp_path / "toy_trainer.py").write_text(TOY_TRAINER)
    return [sys.executable, str(tmp_path / "toy_trainer.py"), f"train.save_interval={save_step}",
            f"kill_after={kill_after_step}", f"drift={drift}"]


def test_the_bf16_part_kills_after_the_checkpoint_resumes_and_records_its_keys(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bf16 part with the stand-in trainer: killed once step 7 is logged, rerun to step 7 from step 4."""
    import time

    from pretrain import checkpoint as ckpt
    from tools import gpu_check

    monkeypatch.setattr(gpu_check, "resume_command", lambda shards, run_dir, precision, save_step: [
        *toy_trainer(tmp_path, save_step, 7), f"out_dir={run_dir}"])
    check = gpu_check.Check(tmp_path / "out", tmp_path / "work", tmp_path, {"shards_seq512": "shards"})
    check.deadline = time.monotonic() + 100
    gpu_check.bf16_resume(check)
    assert check.results == {
        "shards_seq512": "shards", "train_bf16_zero2_batch330_killed_after_step": 7, "train_bf16_zero2_batch330_rc": -9,
        "bf16_resume_from_step": 4, "bf16_resume_rc": 0, "bf16_resume_max_loss_diff": 0.0, "bf16_resume_ok": True,
        "bf16_resume_losses": {"steps": [5, 6, 7], "uninterrupted": [9.5, 9.4, 9.3], "resumed": [9.5, 9.4, 9.3]},
        "train_samples_per_s_seq512": 250.0, "train_tokens_per_s_seq512": 1e5, "train_tflops_seq512": 400.0,
        "train_mfu_seq512": 0.5, "train_peak_tflops": 800.0, "train_step_time_s_seq512": 1.045,
        "train_measured_steps": 6}  # steps 2-7
    run_dir = tmp_path / "work" / "bf16_resume"
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6, 7]  # the rerun's steps replace the killed run's past its checkpoint
    assert ckpt.newest_complete_tag(run_dir / "checkpoints") == "global_step7"  # kept for the fine-tuning part
    assert set(gpu_check.resume_names("fp16", "").values()) == {
        "train_fp16_zero2_batch330_rc", "train_fp16_zero2_batch330_killed_after_step", "resume_rc",
        "resume_from_step", "resume_max_loss_diff", "resume_losses", "resume_ok"}


def test_kill_and_resume_fails_a_rerun_whose_losses_differ(tmp_path: Path) -> None:
    import time

    from tools.gpu_check import Check, kill_and_resume

    check = Check(tmp_path / "out", tmp_path, tmp_path, {})
    check.deadline = time.monotonic() + 100
    run_dir = tmp_path / "run"
    recorded: dict = {}
    _, problem = kill_and_resume(check, "toy", [*toy_trainer(tmp_path, 3, 5, drift=0.01), f"out_dir={run_dir}"],
                                 run_dir, 3, 5, recorded.__setitem__)
    assert recorded["ok"] is False and recorded["max_loss_diff"] == pytest.approx(0.01)
    assert recorded["resume_from_step"] == 3 and recorded["resume_rc"] == 0 and recorded["first_rc"] == -9
    assert problem == "the resumed losses differ from the uninterrupted ones by 0.01 (> 0.0001)"


def test_kill_and_resume_reports_a_first_run_that_ends_by_itself(tmp_path: Path) -> None:
    import time

    from tools.gpu_check import Check, kill_and_resume

    check = Check(tmp_path / "out", tmp_path, tmp_path, {})
    check.deadline = time.monotonic() + 60
    recorded: dict = {}
    _, problem = kill_and_resume(check, "crash", [sys.executable, "-c", "raise SystemExit(1)"], tmp_path / "run", 3, 5,
                                 recorded.__setitem__)
    assert problem == "the first process ended by itself (exit 1) at step 0"
    assert recorded == {"first_rc": 1, "resume_from_step": None, "ok": False}
    with pytest.raises(ValueError, match="kill_after_step < 2 x save_step"):  # the next save would come first
        kill_and_resume(check, "late", [], tmp_path / "run", 2, 4, recorded.__setitem__)


def test_gpu_check_commands_parse_as_the_library_reads_them(tmp_path: Path) -> None:
    """The training, fine-tuning and decoding commands of the check name settings and flags that exist (a typo would
    cost a device lease)."""
    from finetune import decode, run
    from pretrain.config import load_config
    from tools.gpu_check import decode_command, finetune_command, resume_command

    command = resume_command("shards", tmp_path / "run", "fp16", 3) + ["train.exit_at_step=5"]
    # the trainer itself, not a launcher: torchrun would start it in a session of its own, out of the kill's reach
    assert command[:3] == [sys.executable, "-m", "pretrain.train"]
    config = load_config(command[command.index("--config") + 1], command[command.index("--config") + 2:])
    assert (config.train.global_batch_size, config.train.micro_batch_size) == (330, 33)
    assert (config.train.compile, config.train.save_interval, config.train.exit_at_step) == (False, 3, 5)
    assert (config.optim.lr, config.optim.warmup_steps, config.model.preset) == (1e-4, 2, "unilm-large")
    assert config.deepspeed_config_path.is_file() and config.deepspeed_config.endswith("zero2_fp16.json")
    args = run.parse_args(finetune_command(tmp_path, tmp_path / "ckpt", tmp_path / "ft")[3:])
    assert args.deepspeed_config == "ds_configs/zero2_bf16.json" and args.set == ["keep_last=1"]
    assert decode_command(tmp_path, tmp_path / "ft")[3:5] == ["--model", str(tmp_path / "ft")]
    with pytest.raises(SystemExit) as stop:
        decode.main(decode_command(tmp_path, tmp_path / "ft")[3:] + ["--help"])
    assert stop.value.code == 0


def test_gpu_check_model_step_part_reads_the_benchmark_s_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tools import gpu_check

    check = gpu_check.Check(tmp_path, tmp_path, tmp_path, {})
    rows = {"bf16_eager": {"mfu": 0.445, "samples_per_s": 344.0}, "bf16_fast": {"mfu": 0.486, "samples_per_s": 376.0},
            "bf16_transformers": {"mfu": 0.429, "samples_per_s": 300.0}}
    commands = []

    def fake_run(name: str, argv: list[str]) -> int:
        commands.append(argv)
        Path(argv[argv.index("--json") + 1]).write_text(json.dumps({"peak_tflops": {"bf16": 787.0}, "rows": rows}))
        return 0

    monkeypatch.setattr(check, "run", fake_run)
    gpu_check.model_step(check)
    assert commands[0][commands[0].index("--variants") + 1:][:3] == ["eager", "transformers", "fast"]
    assert check.results["model_step_pct_of_bf16_peak"] == pytest.approx({"eager": 44.5, "fast": 48.6,
                                                                         "transformers": 42.9})
    assert check.results["model_step_vs_hf"] == pytest.approx({"eager": 344 / 300, "fast": 376 / 300})
    assert check.results["model_step_bf16_peak_tflops"] == 787.0 and check.results["model_step_rc"] == 0


def test_gpu_check_accuracy_part_counts_the_junit_report(tmp_path: Path) -> None:
    from tools import gpu_check

    check = gpu_check.Check(tmp_path, tmp_path, tmp_path, {})
    check.deadline = float("inf")
    (tmp_path / "accuracy_tests.xml").write_text('<testsuites><testsuite name="pytest" errors="0" failures="1" '
                                                 'skipped="1" tests="5"/></testsuites>')
    check.start("accuracy_tests", [sys.executable, "-c", "raise SystemExit(1)"])
    with pytest.raises(gpu_check.CheckFailed, match="pytest exited 1"):
        gpu_check.accuracy_tests(check)
    assert check.results == {"accuracy_tests_rc": 1,
                             "accuracy_tests": {"tests": 5, "failures": 1, "errors": 0, "skipped": 1, "passed": 3}}
    (tmp_path / "accuracy_tests.xml").write_text('<testsuites><testsuite errors="0" failures="0" skipped="5" '
                                                 'tests="5"/></testsuites>')
    check.start("accuracy_tests", [sys.executable, "-c", "pass"])
    with pytest.raises(gpu_check.CheckFailed, match="no accuracy test passed"):  # all skipped: no GPU seen
        gpu_check.accuracy_tests(check)


def test_the_model_step_measures_the_variants_asked_for_in_their_order(monkeypatch: pytest.MonkeyPatch) -> None:
    from tools import bench_model

    result = measure_gpu("tiny", batch_size=2, seq_len=32, predictions=4, steps=1, dtypes=("bf16",), device="cpu",
                         variants=("transformers", "eager"))
    assert list(result["rows"]) == ["bf16_transformers", "bf16_eager"]
    asked: dict = {}
    monkeypatch.setattr(bench_model, "measure_gpu", lambda **kwargs: asked.update(kwargs) or {
        "setup": "", "useful_tflop_per_step": 1.0, "peak_tflops": {}, "rows": {}})
    bench_model.main(["--gpu", "--dtypes", "bf16", "--variants", "eager", "fast", "--steps", "5"])
    assert asked == {"steps": 5, "dtypes": ("bf16",), "variants": ("eager", "fast")}


def test_gpu_check_main_records_the_machine_then_each_part(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import signal

    import torch

    from tools import gpu_check

    monkeypatch.setattr(gpu_check, "cuda_refusal", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "NVIDIA H200")
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # main sets cuda for the check's commands; restored after the test
    monkeypatch.setattr(gpu_check, "PARTS", (gpu_check.Part("passes", 1, lambda check: None),))
    handler = signal.getsignal(signal.SIGTERM)
    try:
        assert gpu_check.main(["--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")]) == 0
        results = json.loads((tmp_path / "out" / "results.json").read_text())
        assert results["device"] == "NVIDIA H200" and results["torch"] == torch.__version__
        assert results["budget_s"] == gpu_check.BUDGET_S == 350 and results["parts"]["passes"]["status"] == "ok"
        assert os.environ["DS_ACCELERATOR"] == "cuda"

        def fails(check: gpu_check.Check) -> None:
            raise gpu_check.CheckFailed("no")

        monkeypatch.setattr(gpu_check, "PARTS", (gpu_check.Part("fails", 1, fails),))
        assert gpu_check.main(["--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")]) == 1
    finally:
        signal.signal(signal.SIGTERM, handler)


def test_gpu_check_setup_names_missing_sample_corpora_and_still_waits_for_the_op_build(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    from tools import gpu_check

    check = gpu_check.Check(tmp_path / "out", tmp_path / "work", tmp_path / "samples", {})
    check.deadline = time.monotonic() + 60
    started = []
    start = check.start

    def stand_in(name: str, argv: list[str]) -> gpu_check.Job:  # no op build, no GPU tests here
        started.append((name, argv))
        return start(name, [sys.executable, "-c", "pass"])

    monkeypatch.setattr(check, "start", stand_in)
    with pytest.raises(gpu_check.CheckFailed) as failed:
        gpu_check.setup(check)
    samples = tmp_path / "samples"
    assert str(failed.value) == (f"sample corpora missing in {samples}: wiki/enwiki-excerpt.xml.bz2, books.jsonl; "
                                 f"sample corpora missing in {samples}: bbc, rotten.csv.bz2, squad.json; `make "
                                 "sample-corpus` fetches them; a machine without network needs them brought along "
                                 "(SAMPLES=DIR)")
    assert [name for name, _ in started] == ["fused_adam", "accuracy_tests"]
    assert started[1][1][-2:] == list(gpu_check.ACCURACY_TESTS) and "-m" in started[1][1]
    assert check.results["fused_adam_rc"] == 0 and "shards_seq512" not in check.results
