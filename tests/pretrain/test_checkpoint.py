"""Checkpoint bookkeeping without DeepSpeed: completion markers, `latest`, pruning, compatibility."""
from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from common import files
from pretrain import checkpoint as ckpt, rng
from pretrain.resume import ResumePoint, changed_settings, check_compatible, report_changed_settings


def fake_save(directory: Path, step: int, complete: bool = True) -> str:
    tag = ckpt.tag_for_step(step)
    (directory / tag).mkdir(parents=True)
    (directory / tag / "mp_rank_00_model_states.pt").write_bytes(b"x" * (100 + step))
    (directory / tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt").write_bytes(b"y" * 50)
    if complete:
        ckpt.write_marker(directory / tag, {"step": step})
        ckpt.update_latest(directory, tag)
    return tag


def test_only_complete_checkpoints_count(tmp_path: Path) -> None:
    for step in (4, 8):
        fake_save(tmp_path, step)
    fake_save(tmp_path, 12, complete=False)                        # a save that died half-way
    truncated = fake_save(tmp_path, 10)
    (tmp_path / truncated / "mp_rank_00_model_states.pt").write_bytes(b"x")  # damaged after its marker
    assert ckpt.complete_tags(tmp_path) == ["global_step4", "global_step8"]
    assert ckpt.newest_complete_tag(tmp_path) == "global_step8"
    marker = ckpt.read_marker(tmp_path / "global_step8")
    assert marker["files"] == {"mp_rank_00_model_states.pt": 108, "zero_pp_rank_1_mp_rank_00_optim_states.pt": 50}
    assert marker["format_version"] == ckpt.FORMAT_VERSION and marker["step"] == 8


def test_fsync_tree_skips_a_file_another_rank_renamed_after_the_listing(tmp_path: Path, monkeypatch) -> None:
    tag_dir = tmp_path / "global_step4"
    tag_dir.mkdir()
    (tag_dir / "zero_pp_rank_1_mp_rank_00_optim_states.pt").write_bytes(b"y" * 50)
    listing = sorted(tag_dir.rglob("*")) + [tag_dir / f".{ckpt.WEIGHTS}.partial-1"]  # listed, then renamed by rank 0
    monkeypatch.setattr(Path, "rglob", lambda self, pattern: iter(listing))
    flushed = []
    real_fsync = files.fsync_path
    monkeypatch.setattr(files, "fsync_path", lambda path: (real_fsync(path), flushed.append(Path(path).name)))
    ckpt.fsync_tree(tag_dir)
    assert flushed == ["zero_pp_rank_1_mp_rank_00_optim_states.pt", "global_step4", tmp_path.name]
    with pytest.raises(FileNotFoundError):  # a missing tag directory itself is still an error
        ckpt.fsync_tree(tmp_path / "global_step8")


def test_latest_is_replaced_atomically(tmp_path: Path) -> None:
    fake_save(tmp_path, 4)
    fake_save(tmp_path, 8)
    assert (tmp_path / "latest").read_text() == "global_step8"
    assert [p.name for p in tmp_path.iterdir() if "partial" in p.name] == []


def test_prune_keeps_the_last_k_and_never_a_save_in_progress(tmp_path: Path) -> None:
    for step in (2, 4, 6, 8):
        fake_save(tmp_path, step)
    fake_save(tmp_path, 5, complete=False)   # stale, older than the newest complete one
    fake_save(tmp_path, 10, complete=False)  # may still be being written
    (tmp_path / "global_step2_universal").mkdir()
    assert ckpt.prune(tmp_path, keep_last=2) == ["global_step2", "global_step4", "global_step5"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == \
        ["global_step10", "global_step6", "global_step8"]


def test_unknown_marker_version_is_refused(tmp_path: Path) -> None:
    fake_save(tmp_path, 4)
    marker = tmp_path / "global_step4" / ckpt.MARKER
    marker.write_text(json.dumps(dict(json.loads(marker.read_text()), format_version=99)))
    with pytest.raises(ckpt.CheckpointMismatchError, match="format_version 99, this code reads 1: it was written "
                                                           "by a newer version of this project; resume it with"):
        ckpt.read_marker(tmp_path / "global_step4")


@pytest.mark.parametrize("field, value, message", [
    ("vocab_hash", "other", "vocab_hash='abc'"),
    ("seed", 2, "seed=1"),
])
def test_mismatch_names_the_field(field: str, value: object, message: str) -> None:
    saved = {"model_config": {"hidden_size": 64}, "vocab_hash": "abc", "manifest_hash": "def", "seed": 1}
    check_compatible(saved, dict(saved), "ckpt")
    with pytest.raises(ckpt.CheckpointMismatchError, match="refusing to resume") as error:
        check_compatible(saved, dict(saved, **{field: value}), "ckpt")
    assert message in str(error.value) and field in str(error.value)
    with pytest.raises(ckpt.CheckpointMismatchError, match=r"model.num_layers=2.*model.num_layers=4"):
        check_compatible(dict(saved, model_config={"num_layers": 2}), dict(saved, model_config={"num_layers": 4}),
                              "ckpt")


def test_rebuilt_shards_are_named_as_such() -> None:
    saved = {"model_config": {}, "vocab_hash": "abc", "manifest_hash": "d" * 64, "seed": 1}
    with pytest.raises(ckpt.CheckpointMismatchError, match=r"another build of its shards \(manifest sha256 "
                                                          r"dddddddddddd…, these shards' eeeeeeeeeeee…\): they were "
                                                          r"rebuilt .*point data.shards at the shards"):
        check_compatible(saved, dict(saved, manifest_hash="e" * 64), "ckpt")
    saved["run_config"] = {"data": {"shards": "/data/shards/unilm-512"}}
    with pytest.raises(ckpt.CheckpointMismatchError, match=r"eeeeeeeeeeee…; trained on /data/shards/unilm-512, these "
                                                          r"are data/shards/unilm-128\): they were rebuilt"):
        check_compatible(saved, dict(saved, manifest_hash="e" * 64, shards="data/shards/unilm-128"), "ckpt")
    tuned = dict(saved, task={"task": "classify"})  # a fine-tuning run: its hash is its training file's
    with pytest.raises(ckpt.CheckpointMismatchError, match=r"ckpt was trained on another training file \(sha256 "
                                                          r"dddddddddddd…, this one's eeeeeeeeeeee…\); refusing to "
                                                          r"resume \(use another --out\)"):
        check_compatible(tuned, dict(tuned, manifest_hash="e" * 64), "ckpt", restart="use another --out")


def test_a_resumed_run_names_the_settings_it_changed() -> None:
    saved = {"optim": {"lr": 1e-4, "betas": [0.9, 0.999]}, "train": {"max_steps": 40, "exit_at_step": 10}}
    now = {"optim": {"lr": 1e-2, "betas": (0.9, 0.999)}, "train": {"max_steps": 50, "exit_at_step": None}}
    assert changed_settings(saved, now) == ["optim.lr: 0.0001 -> 0.01", "train.max_steps: 40 -> 50"]
    reports = []
    resume = ResumePoint(Path("c"), "global_step40", "global_step40", {"step": 40, "run_config": saved})
    report_changed_settings(resume, now, reports.append)
    assert reports == ["[resume] settings changed since global_step40, the run continues with the new ones from "
                       "step 40: optim.lr: 0.0001 -> 0.01; train.max_steps: 40 -> 50"]
    report_changed_settings(resume, saved, reports.append)
    # the run config in memory holds tuples where the checkpoint's JSON has lists: the same setting
    report_changed_settings(resume, dict(saved, optim={"lr": 1e-4, "betas": (0.9, 0.999)}), reports.append)
    report_changed_settings(None, now, reports.append)
    assert len(reports) == 1


def test_code_version_is_known() -> None:
    assert ckpt.code_version().split(":")[0] in {"git", "pkg"}


def test_activation_checkpointing_stored_by_older_checkpoints_is_no_mismatch() -> None:
    """It was a model field; now a training setting that may change on resume."""
    current = {"model_config": {"hidden_size": 64}, "vocab_hash": "abc", "manifest_hash": "def", "seed": 1}
    for stored in (False, True):
        check_compatible(dict(current, model_config={"hidden_size": 64, "activation_checkpointing": stored}),
                              current, "ckpt")
def test_rng_state_holds_an_accelerator_generator_only_on_an_accelerator() -> None:
    from deepspeed.accelerator import get_accelerator

    state = rng.rng_state()
    if get_accelerator().device_name() == "cpu":  # the CPU suite: torch's CPU generator is "torch"
        assert set(state) == {"torch", "numpy", "python"}
    else:
        assert state["accelerator"]["device"] == get_accelerator().device_name()
        assert state["accelerator"]["state"].dtype == torch.uint8


def test_portable_rng_states_load_with_weights_only_and_old_or_foreign_ones_still_restore(tmp_path: Path) -> None:
    from pretrain.rng import portable_rng_state, restore_rng_state

    rng.seed_everything(5)
    torch.save(portable_rng_state(), tmp_path / "rng.pt")
    first = (torch.rand(3), np.random.rand(3), random.random())
    saved = torch.load(tmp_path / "rng.pt", weights_only=True)
    restore_rng_state(saved)
    assert torch.equal(torch.rand(3), first[0]) and np.array_equal(np.random.rand(3), first[1])
    assert random.random() == first[2]
    # a checkpoint written before accelerator generators were recorded, and one written on a GPU (its CUDA state,
    # a ByteTensor, travels through weights_only loading; a CPU process restores the rest and leaves CUDA alone)
    older = {k: v for k, v in saved.items() if k != "accelerator"}
    from_gpu = dict(older, accelerator={"device": "cuda", "state": torch.zeros(16, dtype=torch.uint8)})
    torch.save(from_gpu, tmp_path / "gpu_rng.pt")
    for state in (older, torch.load(tmp_path / "gpu_rng.pt", weights_only=True)):
        restore_rng_state(state)
        assert torch.equal(torch.rand(3), first[0]) and random.random() == first[2]
