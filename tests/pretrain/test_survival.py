"""What survives a crash: kills during checkpoint writes, power loss, a rank lost mid-step, a full disk,
non-finite gradients, hostile hostfiles and unsafe loading.

Faults are injected from outside the library by ``tests/fault_injection.py``, which wraps the functions where
they belong and runs ``pretrain.train`` (``UNILM_TEST_FAULT=POINT@STEP[@RANK]``: SIGKILL at a save point or at
the start of a step, or an inf gradient). Runs are 1 rank (2 only where a second rank is the
point), tiny model, global batch 8; one uninterrupted run (``reference``) gives the losses every resumed run must
reproduce bit for bit (dropout on: RNG states are in the checkpoints).
"""
from __future__ import annotations

import ast
import json
import os
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import GPU_ENV, TEST_SEED, subprocess_env
from pretrain import checkpoint as ckpt
from pretrain.moments import MOMENTS
from training_runs import check, launch, losses, metrics, train_command

FAULT_ENV = "UNILM_TEST_FAULT"  # read by tests/fault_injection.py

ROOT = Path(__file__).resolve().parents[2]
MODEL_FILE, OPTIM_FILE = "mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"


def train(overrides: list[str], fault: str | None = None, nproc: int = 1,
          timeout: int = 300) -> subprocess.CompletedProcess:
    """Run the tiny training to its end, optionally with a fault injected (``UNILM_TEST_FAULT``)."""
    if fault is None:
        return launch(overrides, nproc, timeout=timeout)
    return launch(overrides, nproc, timeout=timeout, extra_env={FAULT_ENV: fault}, module="fault_injection")


@pytest.fixture(scope="module")
def common(unilm_shards: Path) -> list[str]:
    return [f"data.shards={unilm_shards}", "model.overrides.vocab_size=4000", "train.global_batch_size=8",
            "train.max_steps=8", "train.save_interval=2", "train.keep_last=10"]


@pytest.fixture(scope="module")
def reference(common: list[str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted run: 8 steps, checkpoints at 2, 4, 6, 8 (all kept)."""
    out_dir = tmp_path_factory.mktemp("survival") / "reference"
    check(train(common + [f"out_dir={out_dir}"]))
    return out_dir


# ------------------------------------------------------------------------------ 1. crash during checkpoint write
@pytest.mark.slow
def test_kills_during_checkpoint_writes_resume_from_the_newest_complete_one(
        common: list[str], reference: Path, tmp_path: Path) -> None:
    """One run killed (SIGKILL) at five points of its saves in turn (six launches, ≈ 40 s); each restart of the
    same command resumes from the newest complete checkpoint, and in the end every step's loss equals the
    uninterrupted run's."""
    overrides = common + [f"out_dir={tmp_path}"]
    tag4 = tmp_path / "checkpoints" / "global_step4"
    # (fault, checkpoint the restart must resume from, what the killed save left in global_step4)
    crashes = [
        ("save_begin@4", None, set()),                                      # before DeepSpeed wrote anything
        (f"after:{MODEL_FILE}@4", "global_step2", {MODEL_FILE}),            # between model and optimizer files
        (f"after:{OPTIM_FILE}@4", "global_step2", {MODEL_FILE, OPTIM_FILE}),  # all files, not yet fsync'ed
        ("before_marker@4", "global_step2", {MODEL_FILE, OPTIM_FILE, ckpt.WEIGHTS, MOMENTS}),  # fsync'ed, no marker
        ("before_latest@6", "global_step2", None),                          # step 6 complete, `latest` still 4
    ]
    for fault, resumed_from, left in crashes:
        process = train(overrides, fault=fault)
        assert process.returncode == -signal.SIGKILL, (fault, process.stderr[-3000:])
        assert f"[fault] {FAULT_ENV}: SIGKILL at {fault.split('@')[0]}" in process.stderr
        if resumed_from is not None:
            assert f"[resume] {resumed_from}:" in process.stdout, (fault, process.stdout[-2000:])
        if left is not None:
            assert {p.name for p in tag4.glob("*")} == left, fault
            assert ckpt.newest_complete_tag(tmp_path / "checkpoints") in (None, "global_step2"), fault
    checkpoints = tmp_path / "checkpoints"
    assert (checkpoints / "latest").read_text() == "global_step4"   # the kill came before `latest` moved on
    assert ckpt.newest_complete_tag(checkpoints, hashes=True) == "global_step6"
    final = check(train(overrides))
    assert "[resume] global_step6: step 6, consumed_samples 48" in final.stdout
    assert losses(tmp_path) == losses(reference)   # bit for bit, dropout on
    assert [r["consumed_samples"] for r in metrics(tmp_path)] == [8 * step for step in range(1, 9)]


@pytest.mark.slow
def test_kills_at_random_moments_of_saves_resume_from_the_newest_complete_one(
        common: list[str], reference: Path, tmp_path: Path) -> None:
    """SIGKILL from outside at a random moment after a save's directory appears (no hook), twice; a save every
    step. Wherever the kills land, the restart resumes from the newest complete checkpoint and matches."""
    seed = TEST_SEED  # TEST_SEED=N replays a failure's kill moments
    rng = random.Random(seed)
    overrides = common + [f"out_dir={tmp_path}", "train.save_interval=1"]
    checkpoints = tmp_path / "checkpoints"
    for step in (3, 6):
        process = subprocess.Popen(train_command(overrides), cwd=ROOT, env=subprocess_env(),
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 240
        while not (checkpoints / f"global_step{step}").exists() and process.poll() is None \
                and time.monotonic() < deadline:
            time.sleep(0.002)
        time.sleep(rng.uniform(0.0, 0.15))
        process.kill()
        assert process.wait(timeout=60) == -signal.SIGKILL, f"the run ended before the kill (seed {seed})"
    newest = ckpt.newest_complete_tag(checkpoints, hashes=True)
    final = check(train(overrides))
    assert f"[resume] {newest}:" in final.stdout, (seed, final.stdout[-2000:])
    assert losses(tmp_path) == losses(reference), f"seed {seed}"


# ---------------------------------------------------------------------------------------------- 2. power loss
@pytest.mark.slow
def test_truncated_or_corrupted_newest_checkpoints_are_skipped_with_the_reason(
        common: list[str], reference: Path, tmp_path: Path) -> None:
    out_dir = tmp_path / "run"
    shutil.copytree(reference, out_dir)
    checkpoints = out_dir / "checkpoints"
    (checkpoints / "global_step8" / OPTIM_FILE).write_bytes(b"")               # zero bytes
    with open(checkpoints / "global_step6" / MODEL_FILE, "r+b") as handle:     # cut short
        handle.truncate(1000)
    with open(checkpoints / "global_step4" / OPTIM_FILE, "r+b") as handle:     # right size, lost blocks
        handle.seek(4096)
        handle.write(bytes(4096))
    process = check(train(common + [f"out_dir={out_dir}"]))
    skipped = [line for line in process.stdout.splitlines() if line.startswith("[resume] skipping")]
    assert len(skipped) == 3, process.stdout[-3000:]
    assert "global_step8: " + OPTIM_FILE + " has 0 bytes, the marker recorded" in skipped[0]
    assert "global_step6: " + MODEL_FILE + " has 1000 bytes" in skipped[1] and "(truncated)" in skipped[1]
    assert "global_step4: " + OPTIM_FILE + " does not match the sha256 recorded at save time" in skipped[2]
    assert "[resume] global_step2: step 2, consumed_samples 16" in process.stdout
    assert losses(out_dir) == losses(reference)
    assert ckpt.newest_complete_tag(checkpoints, hashes=True) == "global_step8"   # rewritten whole


def test_saves_fsync_files_and_directories_before_the_marker_and_latest(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    tag_dir = tmp_path / "global_step4"
    (tag_dir / "sub").mkdir(parents=True)
    for name in (MODEL_FILE, OPTIM_FILE, "sub/extra.pt"):
        (tag_dir / name).write_bytes(b"w" * 100)
    synced: list[tuple[str, bool]] = []   # (path, marker visible at that moment)
    real_fsync = os.fsync

    def recording_fsync(descriptor: int) -> None:
        path = Path(os.readlink(f"/proc/self/fd/{descriptor}"))
        synced.append((str(path.relative_to(tmp_path)) if path != tmp_path else ".",
                       (tag_dir / ckpt.MARKER).exists()))
        real_fsync(descriptor)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    ckpt.write_marker(tag_dir, {"step": 4})
    ckpt.update_latest(tmp_path, "global_step4")
    before_marker = {path for path, marker_seen in synced if not marker_seen}
    assert {f"global_step4/{MODEL_FILE}", f"global_step4/{OPTIM_FILE}", "global_step4/sub/extra.pt",
            "global_step4/sub", "global_step4", "."} <= before_marker
    assert f"global_step4/.complete.json.partial-{os.getpid()}" in before_marker   # the marker's bytes before its name
    assert synced[-2:] == [(f".latest.partial-{os.getpid()}", True), (".", True)]  # latest: bytes, rename, directory
    marker = json.loads((tag_dir / ckpt.MARKER).read_text())
    assert set(marker["sha256"]) == set(marker["files"]) == {MODEL_FILE, OPTIM_FILE, "sub/extra.pt"}


# ------------------------------------------------------------------------------------ 3. rank lost mid-step
@pytest.mark.slow
def test_a_rank_killed_between_checkpoints_ends_the_launch_and_the_restart_loses_nothing(
        unilm_shards: Path, tmp_path: Path) -> None:
    """Rank 1 killed mid-step, then mid-save on the restart, then a clean restart: three launches of 2 ranks (≈ 45 s
    on 2 cores), each loss the point of the next."""
    overrides = [f"data.shards={unilm_shards}", "model.overrides.vocab_size=4000", f"out_dir={tmp_path}",
                 "train.global_batch_size=8", "train.max_steps=9", "train.save_interval=3"]
    # a launch that hung after losing a rank would end in train()'s TimeoutExpired, failing the test
    killed = train(overrides, fault="step@5@1", nproc=2, timeout=240)   # rank 1 dies as step 5 begins
    assert killed.returncode != 0, killed.stdout[-2000:]
    assert "SIGKILL at step of step 5 on rank 1" in killed.stderr
    assert [r["step"] for r in metrics(tmp_path)] == [1, 2, 3, 4]
    assert ckpt.newest_complete_tag(tmp_path / "checkpoints") == "global_step3"
    # the restart loses rank 1 again, this time while it writes its part of the step-6 checkpoint
    fault = "after:zero_pp_rank_1_mp_rank_00_optim_states.pt@6@1"
    killed = train(overrides, fault=fault, nproc=2, timeout=240)
    assert killed.returncode != 0 and "SIGKILL at after:zero_pp_rank_1" in killed.stderr, killed.stderr[-3000:]
    assert "[resume] global_step3:" in killed.stdout
    assert ckpt.newest_complete_tag(tmp_path / "checkpoints") == "global_step3"   # global_step6 is partial
    resumed = check(train(overrides, nproc=2))
    assert "[resume] global_step3: step 3, consumed_samples 24" in resumed.stdout
    records = metrics(tmp_path)
    assert [r["step"] for r in records] == list(range(1, 10))  # steps 4-6 redone, nothing skipped or doubled
    assert [r["consumed_samples"] for r in records] == [8 * step for step in range(1, 10)]


# -------------------------------------------------------------------------------------------- 4. full disk
@pytest.mark.slow
def test_a_full_disk_fails_the_save_cleanly_and_keeps_the_previous_checkpoint(
        common: list[str], reference: Path, tmp_path: Path) -> None:
    out_dir, checkpoints = tmp_path / "run", tmp_path / "run" / "checkpoints"
    checkpoints.mkdir(parents=True)
    one_save = sum(f.stat().st_size for f in (reference / "checkpoints" / "global_step2").iterdir())
    size_kib = int(one_save * 1.5) // 1024   # room for one checkpoint, not two
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(checkpoints)],
                           capture_output=True, text=True)
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root / CAP_SYS_ADMIN): {mount.stderr.strip()}")
    try:
        process = train(common + [f"out_dir={out_dir}"])
        assert process.returncode == 4, process.stderr[-4000:]
        assert "Traceback" not in process.stderr
        assert "[stop] rank 0 could not write checkpoint" in process.stderr and "global_step4" in process.stderr
        assert "No space left on device" in process.stderr
        assert "The last complete checkpoint (global_step2) is intact" in process.stderr
        assert not (checkpoints / "global_step4").exists()   # the partial save was removed
        assert ckpt.verify_tag(checkpoints / "global_step2", hashes=True)[1] is None
        assert (checkpoints / "latest").read_text() == "global_step2"
        moved = tmp_path / "bigger"
        shutil.copytree(out_dir, moved)
    finally:
        subprocess.run(["umount", str(checkpoints)], check=True)
    resumed = check(train(common + [f"out_dir={moved}", "train.exit_at_step=4"]))
    assert "[resume] global_step2: step 2, consumed_samples 16" in resumed.stdout
    assert losses(moved) == {step: loss for step, loss in losses(reference).items() if step <= 4}


def test_a_full_disk_while_writing_the_weights_is_an_os_error(tmp_path: Path) -> None:
    """safetensors reports a full disk as its own error type: the save turns it into the OSError (ENOSPC) that
    stops the run with exit 4 and the previous checkpoint named, instead of a traceback."""
    import errno

    import torch
    full = tmp_path / "full"
    full.mkdir()
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(full)], capture_output=True,
                           text=True)
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root / CAP_SYS_ADMIN): {mount.stderr.strip()}")
    try:
        with pytest.raises(OSError) as raised:
            ckpt.write_weights(full, {"w": torch.zeros(256, 256)})  # 256 KiB into 64 KiB
        assert raised.value.errno == errno.ENOSPC
    finally:
        subprocess.run(["umount", str(full)], check=True)


@pytest.mark.slow
def test_a_new_run_saving_an_old_runs_tag_leaves_nothing_of_it(common: list[str], tmp_path: Path) -> None:
    """A run started afresh (train.resume=never) in a directory where an older run saved the same step (four
    launches, ≈ 45 s: the older run on 2 ranks, its conversion on 1, the fresh run, a resume on 2): the tag
    holds only the new run's files (a second rank's optimizer file stayed behind and was vouched for, so moving
    the checkpoint to two ranks failed), and the older run's universal conversion is gone (a resume on another
    world size reused it: the older run's weights)."""
    check(train(common + [f"out_dir={tmp_path}", "train.exit_at_step=2"], nproc=2))
    converted = check(train(common + [f"out_dir={tmp_path}", "train.exit_at_step=3"]))
    checkpoints = tmp_path / "checkpoints"
    assert "world size 2 -> 1" in converted.stdout and (checkpoints / "global_step2_universal").is_dir()
    check(train(common + [f"out_dir={tmp_path}", "train.resume=never", "optim.lr=1.0e-3", "train.exit_at_step=2"]))
    assert not (checkpoints / "global_step2_universal").exists()
    assert not list((checkpoints / "global_step2").glob("zero_pp_rank_1_*"))
    marker = json.loads((checkpoints / "global_step2" / "complete.json").read_text())
    assert marker["world_size"] == 1 and not any("rank_1" in name for name in marker["files"])
    resumed = check(train(common + [f"out_dir={tmp_path}", "optim.lr=1.0e-3", "train.exit_at_step=3",
                                    "train.resume=" + str(checkpoints / "global_step2")], nproc=2))
    assert "world size 1 -> 2" in resumed.stdout


@pytest.mark.slow
def test_a_full_disk_on_one_rank_stops_every_rank_and_keeps_the_previous_checkpoint(common: list[str],
                                                                                   tmp_path: Path) -> None:
    process = train(common + [f"out_dir={tmp_path}"], fault="enospc@4@1", nproc=2, timeout=150)
    assert process.returncode != 0 and "pretrain/checkpoint.py" not in process.stderr, process.stderr[-4000:]
    stops = [line for line in process.stderr.splitlines() if line.startswith("[stop]")]
    # rank 1 failed; rank 0 stops too instead of waiting for it in a collective, and says it for both, once
    (line,) = stops
    assert "rank 1 could not write checkpoint" in line and "global_step4: No space left on device" in line
    assert "The last complete checkpoint (global_step2) is intact" in line
    checkpoints = tmp_path / "checkpoints"
    assert not (checkpoints / "global_step4").exists() and (checkpoints / "latest").read_text() == "global_step2"


# ------------------------------------------------------------------------------------ 5. numerical faults
@pytest.mark.slow
@pytest.mark.parametrize("ds_config", ["ds_configs/zero2_fp32_cpu.json", "ds_configs/zero2_bf16_cpu.json",
                                       "ds_configs/zero0_fp32_cpu.json"])  # ZeRO 0: DeepSpeed records no norm
def test_an_inf_gradient_stops_with_step_and_objectives_and_keeps_the_checkpoint(
        common: list[str], tmp_path: Path, ds_config: str) -> None:
    process = train(common + [f"out_dir={tmp_path}", f"deepspeed_config={ds_config}"], fault="inf_grad@3")
    assert process.returncode == 3, process.stderr[-3000:]
    stop = next(line for line in process.stderr.splitlines() if line.startswith("[stop]"))
    assert "non-finite gradient norm" in stop and "at step 3 " in stop and "consumed_samples=16" in stop
    for objective in ("bidirectional_mlm", "nsp", "left_to_right", "right_to_left", "seq2seq"):
        assert f"{objective}=" in stop, objective
    assert "the last complete checkpoint (global_step2) is intact" in stop
    checkpoints = tmp_path / "checkpoints"
    assert (checkpoints / "latest").read_text() == "global_step2"
    assert ckpt.newest_complete_tag(checkpoints, hashes=True) == "global_step2"
    assert not (checkpoints / "global_step3").exists() and not (checkpoints / "global_step4").exists()
    records = metrics(tmp_path)
    assert records[-1]["event"] == "nonfinite_gradient"
    assert all(r["grad_norm"] > 0 for r in records if r.get("step") in (1, 2) and "event" not in r), records


def cpu_fp16_supported() -> bool:
    """DeepSpeed's CPU accelerator trains fp16 where oneDNN has fp16 kernels (AVX512-FP16 / AMX-FP16 CPUs)."""
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator
    return bool(CPU_Accelerator().is_fp16_supported())


FP16_ENGINES = [  # (ZeRO stage, where): stage 0 is DeepSpeed's FP16 optimizer, 1-3 ZeRO's own loss scaling
    pytest.param(0, "cpu", marks=pytest.mark.skipif(not cpu_fp16_supported(), reason="this CPU has no fp16 kernels")),
    pytest.param(2, "cpu", marks=pytest.mark.skipif(not cpu_fp16_supported(), reason="this CPU has no fp16 kernels")),
    pytest.param(2, "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not __import__("torch").cuda.is_available(),
                                                                      reason="needs a CUDA GPU")]),
]


@pytest.mark.slow
@pytest.mark.parametrize("stage, where", FP16_ENGINES)
def test_fp16_skips_an_inf_gradient_through_the_loss_scaler_and_logs_it(common: list[str], tmp_path: Path,
                                                                        stage: int, where: str) -> None:
    config = ROOT / "ds_configs" / "zero2_fp16.json"
    if where == "cpu":  # the GPU JSON with DeepSpeed's portable Adam and the stage under test
        engine = json.loads(config.read_text())
        engine["zero_optimization"] = {"stage": stage}
        engine["optimizer"] = {"type": "AdamW", "params": {"torch_adam": True}}
        config = tmp_path / f"zero{stage}_fp16_cpu.json"
        config.write_text(json.dumps(engine))
    process = check(launch(common + [f"out_dir={tmp_path / 'run'}", f"deepspeed_config={config}"],
                           extra_env={FAULT_ENV: "inf_grad@3", **(GPU_ENV if where == "cuda" else {})},
                           module="fault_injection"))
    assert "[step 3] fp16 overflow: optimizer step skipped" in process.stderr
    records = metrics(tmp_path / "run")
    assert [r["step"] for r in records] == list(range(1, 9))
    assert records[2]["overflow"] is True and records[2]["skipped_steps"] == records[1]["skipped_steps"] + 1
    # the scaler backs off on an overflow (at once, or after `hysteresis` of them: ZeRO's scaler waits for 2)
    assert all(0 < r["loss_scale"] <= records[0]["loss_scale"] for r in records)
    assert "event" not in records[-1] and (tmp_path / "run" / "checkpoints" / "latest").read_text() == "global_step8"


# --------------------------------------------------------------------------------------------- 7. safe loading
HOSTILE_ENTRIES = ["-oProxyCommand=touch${IFS}/tmp/pwned slots=1", "node1;reboot slots=1", "$(id) slots=1",
                   "node1 slots=0", "node1 slots=-1", "node1 slots=2 extra", "node1 slots=x", "user@node1 slots=1",
                   "node1", "bad_name! slots=1", "node1 slots=1\nnode1 slots=1"]


@pytest.mark.parametrize("entry", HOSTILE_ENTRIES)
def test_hostile_hostfile_entries_are_refused_before_anything_reaches_ssh(
        entry: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pretrain import preflight

    def no_subprocess(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"a subprocess ran before the hostfile was validated: {args}")

    monkeypatch.setattr(preflight.subprocess, "run", no_subprocess)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# cluster\nlocalhost slots=1\n" + entry + "\n")
    with pytest.raises(ValueError, match=r"hostfile:\d+: "):
        preflight.preflight("pretrain/configs/tiny.yaml", [f"out_dir={tmp_path}"], str(hostfile))


def test_valid_hostfile_entries_are_accepted(tmp_path: Path) -> None:
    from pretrain.preflight import read_hostfile

    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-001 slots=8  # first\n10.0.0.2 slots=8\nfd00::2 slots=1\nn3.cluster.local slots=2\n"
                        "gpu_node_7 slots=4\n")
    assert read_hostfile(hostfile) == {"node-001": 8, "10.0.0.2": 8, "fd00::2": 1, "n3.cluster.local": 2,
                                       "gpu_node_7": 4}


# torch.load calls allowed to unpickle: none (exports and --init read model_weights.safetensors; only DeepSpeed's
# own loader unpickles, on resume, after the marker's hashes check out).
UNPICKLING_ALLOWED: set[tuple[str, str]] = set()


def test_nothing_is_unpickled_or_run_through_a_shell_except_our_own_deepspeed_checkpoints() -> None:
    problems = []
    for path in sorted(p for package in ("pretrain", "finetune", "data_prep")
                       for p in (ROOT / package).rglob("*.py")):
        relative = str(path.relative_to(ROOT))
        tree = ast.parse(path.read_text(), relative)
        functions = [node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [alias.name for alias in node.names] + [getattr(node, "module", None) or ""]
                if {"pickle", "dill", "marshal", "shelve", "cloudpickle"} & {n.split(".")[0] for n in names}:
                    problems.append(f"{relative}:{node.lineno}: imports an unpickler")
            if not isinstance(node, ast.Call):
                continue
            keywords = {k.arg: k.value for k in node.keywords}
            name = ast.unparse(node.func)
            if "shell" in keywords and not (isinstance(keywords["shell"], ast.Constant)
                                            and keywords["shell"].value is False):
                problems.append(f"{relative}:{node.lineno}: {name}(shell=...)")
            if name in {"os.system", "os.popen", "eval", "exec", "subprocess.getoutput", "subprocess.getstatusoutput"}:
                problems.append(f"{relative}:{node.lineno}: {name}()")
            if name == "torch.load":
                safe = isinstance(keywords.get("weights_only"), ast.Constant) and keywords["weights_only"].value is True
                owner = next((f.name for f in functions if f.lineno <= node.lineno <= f.end_lineno), None)
                if not safe and (relative, owner) not in UNPICKLING_ALLOWED:
                    problems.append(f"{relative}:{node.lineno}: torch.load without weights_only=True")
    assert problems == []
