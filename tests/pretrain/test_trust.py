"""Trust nothing on disk: what a checkpoint directory, `latest`, a run directory, `metrics.jsonl`, an output path,
a config value, a shard or a hostfile may hold, and what we refuse to do with it.

Most tests build the hostile input by hand (no DeepSpeed run); the few real runs are 1 rank, tiny model.
"""
from __future__ import annotations

import json
import os
import pickle
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from conftest import ROOT, subprocess_env
from pretrain import checkpoint as ckpt
from pretrain.model import ModelConfig, build_model
from pretrain.resume import RunLock, RunLockedError, choose_resume_tag, lock_run_directory

TINY = dict(vocab_size=120, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32,
            max_position_embeddings=64)


class _Payload:
    """Unpickling this creates a file: proof that a pickle was loaded."""

    def __init__(self, witness: Path) -> None:
        self.witness = witness

    def __reduce__(self):
        return (Path.touch, (self.witness,))


def planted_pickle(tag_dir: Path, witness: Path) -> None:
    tag_dir.mkdir(parents=True, exist_ok=True)
    with open(tag_dir / "mp_rank_00_model_states.pt", "wb") as handle:
        pickle.dump({"module": _Payload(witness)}, handle)


def tag_with_weights(directory: Path, step: int, parent: str | None = None, config: dict | None = None) -> str:
    """A checkpoint as a save leaves it: DeepSpeed-like files, model_weights.safetensors, marker, `latest`."""
    tag = ckpt.tag_for_step(step)
    tag_dir = directory / tag
    tag_dir.mkdir(parents=True)
    (tag_dir / "mp_rank_00_model_states.pt").write_bytes(b"x" * (100 + step))
    torch.manual_seed(step)
    ckpt.write_weights(tag_dir, build_model(ModelConfig(**(config or TINY))).state_dict())
    save_id = ckpt.write_marker(tag_dir, {"step": step, "model_config": config or TINY, "parent_save_id": parent})
    ckpt.update_latest(directory, tag)
    return save_id


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


# ------------------------------------------------------------------------------- 1. nothing unvouched is unpickled
def test_a_marker_listing_no_files_vouches_for_nothing_and_no_pickle_runs(tmp_path: Path) -> None:
    from pretrain import export

    witness = tmp_path / "payload-ran"
    tag_dir = tmp_path / "checkpoints" / "global_step4"
    planted_pickle(tag_dir, witness)
    (tag_dir / ckpt.MARKER).write_text(json.dumps({"format_version": ckpt.FORMAT_VERSION, "files": {}, "sha256": {},
                                                   "zero_stage": 0, "model_config": TINY}))
    assert ckpt.verify_tag(tag_dir) == (None, f"{ckpt.MARKER} lists no files (a marker must vouch for every "
                                              "file of the save)")
    with pytest.raises(FileNotFoundError, match="lists no files"):
        export.main([str(tag_dir), str(tmp_path / "hf")])
    assert not witness.exists() and not (tmp_path / "hf").exists()


def test_finetune_init_from_a_hand_made_checkpoint_runs_no_pickle(tmp_path: Path, vocab_file: Path) -> None:
    from finetune.model_io import load_init

    witness = tmp_path / "payload-ran"
    tag_dir = tmp_path / "checkpoints" / "global_step4"
    planted_pickle(tag_dir, witness)
    ckpt.write_marker(tag_dir, {"step": 4, "zero_stage": 0, "model_config": TINY})  # a well-formed marker, even
    with pytest.raises(ckpt.UnvouchedCheckpointError, match="model_weights.safetensors.*exit_at_step=5"):
        load_init(tag_dir, vocab=vocab_file)
    assert not witness.exists()


def test_export_and_init_read_the_safetensors_weights_after_the_hash_check(tmp_path: Path) -> None:
    from pretrain.export import load_consolidated

    checkpoints = tmp_path / "checkpoints"
    tag_with_weights(checkpoints, 4)
    model = load_consolidated(checkpoints)
    torch.manual_seed(4)
    expected = build_model(ModelConfig(**TINY)).state_dict()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in expected.items())
    flip_a_byte(checkpoints / "global_step4" / ckpt.WEIGHTS)
    with pytest.raises(FileNotFoundError, match="does not match the sha256"):
        load_consolidated(checkpoints)


@pytest.mark.parametrize("latest", ["/etc", "../elsewhere/global_step4", "global_step4/../../x", "global_step4/sub"])
def test_a_latest_leading_outside_the_checkpoint_directory_is_refused(tmp_path: Path, latest: str) -> None:
    checkpoints = tmp_path / "checkpoints"
    tag_with_weights(checkpoints, 4)
    (checkpoints / ckpt.LATEST).write_text(latest)
    for call in (lambda: choose_resume_tag(checkpoints), lambda: ckpt.load_weights(checkpoints)):
        with pytest.raises(ckpt.CheckpointPathError, match=f"names {latest!r}, not a tag"):
            call()


def test_a_tag_that_is_a_link_out_of_the_checkpoint_directory_is_refused(tmp_path: Path) -> None:
    tag_with_weights(tmp_path / "elsewhere", 4)
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    (checkpoints / "global_step4").symlink_to(tmp_path / "elsewhere" / "global_step4")
    with pytest.raises(ckpt.CheckpointPathError, match="outside"):
        ckpt.load_weights(checkpoints / "global_step4")


def test_marker_entries_that_leave_the_tag_directory_are_refused(tmp_path: Path) -> None:
    checkpoints = tmp_path / "checkpoints"
    tag_with_weights(checkpoints, 4)
    (tmp_path / "secret").write_bytes(b"s")
    marker = checkpoints / "global_step4" / ckpt.MARKER
    record = json.loads(marker.read_text())
    record["files"]["../../secret"] = 1
    record["sha256"]["../../secret"] = "0" * 64
    marker.write_text(json.dumps(record))
    assert "a path outside the checkpoint" in ckpt.verify_tag(checkpoints / "global_step4")[1]


# ------------------------------------------------------------------- 2. one validity rule for resume, latest, prune
def test_pruning_after_resuming_past_a_corrupt_newest_keeps_the_new_save(tmp_path: Path) -> None:
    """Checkpoints 2 and 4, the newest one bit-flipped (sizes intact); the restart resumes from 2, saves 3, prunes
    with keep_last=1: the new save and `latest` survive; the corrupt 4 (newer than the save) is left alone."""
    first = tag_with_weights(tmp_path, 2)
    tag_with_weights(tmp_path, 4, parent=first)
    flip_a_byte(tmp_path / "global_step4" / ckpt.WEIGHTS)
    reports: list[str] = []
    assert choose_resume_tag(tmp_path, reports.append) == "global_step2"
    assert any("global_step4: model_weights.safetensors does not match the sha256" in r for r in reports)
    tag_with_weights(tmp_path, 3, parent=first)
    assert ckpt.prune(tmp_path, keep_last=1, just_written="global_step3") == ["global_step2"]
    assert (tmp_path / ckpt.LATEST).read_text() == "global_step3"
    assert ckpt.verify_tag(tmp_path / "global_step3") == (ckpt.read_marker(tmp_path / "global_step3"), None)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["global_step3", "global_step4"]


def test_prune_counts_only_hash_valid_checkpoints(tmp_path: Path) -> None:
    for step in (2, 4, 6):
        tag_with_weights(tmp_path, step)
    flip_a_byte(tmp_path / "global_step4" / ckpt.WEIGHTS)  # sizes intact: only the hash tells
    # keep_last=2: the one written (6) and the newest *valid* one before it (2); the corrupt 4 goes
    assert ckpt.prune(tmp_path, keep_last=2, just_written="global_step6") == ["global_step4"]


def test_a_rolled_back_run_resumes_where_latest_says_and_names_the_abandoned_tags(tmp_path: Path) -> None:
    """Tags 100/200/300 of one history; then a run resumed explicitly from 100 saved 150 (`latest`=150)."""
    id100 = tag_with_weights(tmp_path, 100)
    id200 = tag_with_weights(tmp_path, 200, parent=id100)
    tag_with_weights(tmp_path, 300, parent=id200)
    tag_with_weights(tmp_path, 150, parent=id100)
    reports: list[str] = []
    assert choose_resume_tag(tmp_path, reports.append) == "global_step150"
    assert any("not resuming global_step200, global_step300" in r and "abandoned" in r for r in reports), reports
    assert ckpt.prune(tmp_path, keep_last=1, just_written="global_step150") == ["global_step100"]
    assert {p.name for p in tmp_path.iterdir() if p.is_dir()} == {"global_step150", "global_step200", "global_step300"}


def test_a_save_whose_latest_update_was_cut_off_is_resumed(tmp_path: Path) -> None:
    id4 = tag_with_weights(tmp_path, 4)
    tag_with_weights(tmp_path, 6, parent=id4)
    ckpt.update_latest(tmp_path, "global_step4")  # the crash came between the marker of 6 and `latest`
    assert choose_resume_tag(tmp_path) == "global_step6"


# ---------------------------------------------------------------------------------------------------- 3. run lock
HOLD_LOCK = ("import sys, time; from pretrain.resume import RunLock; lock = RunLock.acquire(sys.argv[1]); "
             "print('held', flush=True); time.sleep(600)")


def hold_lock(out_dir: Path) -> subprocess.Popen:
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(out_dir)], cwd=ROOT, env=subprocess_env(),
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_a_second_holder_is_refused_naming_the_first_and_a_killed_holder_is_reported_stale(tmp_path: Path) -> None:
    import socket

    holder = hold_lock(tmp_path)
    try:
        with pytest.raises(RunLockedError, match=f"in use by another run: pid {holder.pid} on "
                                                      f"{socket.gethostname()}, started "):
            RunLock.acquire(tmp_path)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    reports: list[str] = []
    lock = RunLock.acquire(tmp_path, report=reports.append)  # kill -9 released it
    assert len(reports) == 1 and f"pid {holder.pid}" in reports[0] and "ended without releasing" in reports[0]
    lock.release()
    reports.clear()
    RunLock.acquire(tmp_path, report=reports.append).release()  # a clean release leaves nothing stale
    assert reports == []


def test_a_filesystem_without_flock_is_a_diagnosed_stop_naming_the_fix(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    import errno
    import fcntl

    def flock(fd: int, operation: int) -> None:  # what NFS without lockd or Lustre without -o flock answer
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", flock)
    with pytest.raises(RunLockedError, match=r"run.lock: cannot take the run lock .*No locks available.*"
                                                  r"filesystem with flock support"):
        lock_run_directory(tmp_path, rank=0)


@pytest.mark.slow
def test_a_training_run_in_a_directory_in_use_stops_at_once_naming_the_holder(unilm_shards: Path,
                                                                              tmp_path: Path) -> None:
    from training_runs import launch

    holder = hold_lock(tmp_path)
    try:
        process = launch([f"data.shards={unilm_shards}", "model.overrides.vocab_size=4000", f"out_dir={tmp_path}",
                          "train.global_batch_size=8", "train.max_steps=8"], timeout=300)
    finally:
        holder.kill()
        holder.wait()
    assert process.returncode != 0
    assert f"in use by another run: pid {holder.pid}" in process.stderr
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.slow
def test_a_refused_run_leaves_no_out_dir_behind(tmp_path: Path) -> None:
    """The run lock (out_dir/run.lock) is taken before the setup checks; a run they refuse removes the lock and the
    directories it created for it, so a typo does not leave run directories around."""
    from training_runs import launch

    out_dir = tmp_path / "runs" / "new"
    process = launch([f"data.shards={tmp_path / 'no-shards'}", "model.overrides.vocab_size=4000",
                      f"out_dir={out_dir}"], timeout=300)
    assert process.returncode == 2 and "[stop] " in process.stderr and "no-shards" in process.stderr, \
        process.stderr[-3000:]
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------------------ 4. metrics.jsonl
def test_a_torn_last_metrics_line_is_skipped_and_reported_and_the_file_rewritten_atomically(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pretrain import metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in (1, 2, 3)) + '{"step": 4, "lo')
    replaced: list[tuple[str, str]] = []
    real_replace = os.replace
    monkeypatch.setattr(metrics.os, "replace", lambda a, b: (replaced.append((Path(a).name, Path(b).name)),
                                                             real_replace(a, b)))
    reports: list[str] = []
    metrics.prepare_metrics_file(path, resumed_step=2, report=reports.append)
    assert reports == [f"[metrics] {path}:4: skipping a torn or unreadable line ('{{\"step\": 4, \"lo')"]
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]
    assert len(replaced) == 1 and replaced[0][0].startswith(".metrics.jsonl.partial-") \
        and replaced[0][1] == "metrics.jsonl"  # written beside, then renamed over


def test_a_fresh_run_keeps_an_earlier_history(tmp_path: Path) -> None:
    from pretrain import metrics

    path = tmp_path / "metrics.jsonl"
    for history in ("first\n", "second\n"):
        path.write_text(history)
        metrics.prepare_metrics_file(path, resumed_step=None, report=lambda line: None)
        assert not path.exists()
    assert (tmp_path / "metrics.1.jsonl").read_text() == "first\n"
    assert (tmp_path / "metrics.2.jsonl").read_text() == "second\n"


# ------------------------------------------------------------------------------------------------- 6. values
@pytest.mark.parametrize("override, key", [
    ("optim.lr=.nan", "optim.lr"), ("optim.grad_clip=.nan", "optim.grad_clip"), ("optim.lr=.inf", "optim.lr"),
    ("train.seed=-1", "train.seed"), ("data.max_seq_len=0", "data.max_seq_len"), ("optim.eps=0", "optim.eps"),
    ("optim.weight_decay=.nan", "optim.weight_decay"), ("optim.betas=[0.9, .nan]", "optim.betas"),
    ("train.max_steps=true", "train.max_steps"), ("model.overrides.layer_norm_eps=.nan", None),
    ("train.on_world_change=shrink", "train.on_world_change"),
    ("train.collective_timeout_s=0", "train.collective_timeout_s"),
])
def test_bad_pretraining_values_are_refused_naming_the_key(override: str, key: str | None, tmp_path: Path) -> None:
    from pretrain.config import load_config, resolve_model_config

    with pytest.raises(ValueError, match=(key or "layer_norm_eps").replace(".", r"\.")):
        resolve_model_config(load_config("pretrain/configs/tiny.yaml", [override, f"out_dir={tmp_path}"]))


@pytest.mark.parametrize("setting, key", [
    ("max_steps=-5", "max_steps"), ("lr=abc", "lr"), ("epochs=2.5", "epochs"), ("dropout=.nan", "dropout"),
    ("grad_clip=-1", "grad_clip"), ("seed=-3", "seed"), ("exit_at_step=0", "exit_at_step"),
    ("eval_length_penalty=.inf", "eval_length_penalty"), ("similarity=3", "similarity"),
    ("eval_no_repeat_ngram=-1", "eval_no_repeat_ngram"),
])
def test_bad_finetuning_values_are_refused_naming_the_key(setting: str, key: str) -> None:
    from finetune.config import load_config

    flags = dict(task="classify", train="t.jsonl", dev="d.jsonl", init="i", out="o")
    with pytest.raises(ValueError, match=key):
        load_config(None, flags, [setting])
    assert load_config(None, flags, ["lr=2e-5"]).lr == 2e-5  # a number YAML reads as a string still works


# --------------------------------------------------------------------------------------------- 6. shard reader
def _copy(shards: Path, tmp_path: Path) -> Path:
    import shutil
    return Path(shutil.copytree(shards, tmp_path / "shards"))


def _section_offsets(shard: Path) -> tuple[int, int, int, int]:
    """(num_samples, token section start, masked positions start, token width) of a shard."""
    from data_prep.shard_format import _HEADER, HEADER_BYTES, INDEX_DTYPE, _align8
    _, _, width, num_samples, num_tokens, _ = _HEADER.unpack_from(shard.read_bytes()[:HEADER_BYTES])
    tokens = HEADER_BYTES + _align8(num_samples * INDEX_DTYPE.itemsize)
    return num_samples, tokens, tokens + _align8(num_tokens * width), width


def test_a_manifest_listing_a_shard_twice_is_refused(unilm_shards: Path, tmp_path: Path) -> None:
    from data_prep.shard_format import MANIFEST_NAME, ShardDataset, ShardError

    shards = _copy(unilm_shards, tmp_path)
    manifest = json.loads((shards / MANIFEST_NAME).read_text())
    manifest["shards"].append(manifest["shards"][0])
    manifest["num_samples"] += manifest["shards"][0]["num_samples"]
    (shards / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(ShardError, match=rf"shard\(s\) \['{manifest['shards'][0]['file']}'\] listed more than once"):
        ShardDataset(shards)


def test_out_of_range_objective_token_and_masked_position_name_the_shard_and_sample(unilm_shards: Path,
                                                                                   tmp_path: Path) -> None:
    import numpy as np

    from data_prep.shard_format import HEADER_BYTES, INDEX_DTYPE, ShardDataset, ShardError

    shards = _copy(unilm_shards, tmp_path)
    shard = sorted(shards.glob("shard-*.bin"))[0]
    original = shard.read_bytes()
    num_samples, tokens_at, positions_at, width = _section_offsets(shard)
    index = np.frombuffer(original, INDEX_DTYPE, num_samples, HEADER_BYTES)

    data = bytearray(original)
    data[HEADER_BYTES + 2 * INDEX_DTYPE.itemsize + INDEX_DTYPE.fields["objective"][1]] = 9  # sample 2
    shard.write_bytes(bytes(data))
    with pytest.raises(ShardError, match=rf"{shard}: sample 2: objective id is not one of \[0, 1, 2, 3\]"):
        ShardDataset(shards)

    data = bytearray(original)
    data[tokens_at + width * int(index[3]["token_offset"]) + width - 1] = 0xFF  # sample 3, first token ≥ 65280
    shard.write_bytes(bytes(data))
    dataset = ShardDataset(shards)
    with pytest.raises(ShardError, match=rf"{shard}: sample 3: input_ids holds id \d+, not below the vocabulary "
                                         "size 4000"):
        dataset[3]
    dataset[4]  # the others still read

    masked = next(i for i in range(num_samples) if index[i]["num_masked"] > 0)
    data = bytearray(original)
    position = positions_at + 2 * int(index[masked]["mask_offset"])
    data[position:position + 2] = int(index[masked]["length"]).to_bytes(2, "little")  # one past its last token
    shard.write_bytes(bytes(data))
    with pytest.raises(ShardError, match=rf"{shard}: sample {masked}: masked position \d+ is not inside its"):
        ShardDataset(shards)[masked]


def test_the_recipe_a_model_cannot_train_is_refused(gpt_shards: Path, unilm_shards: Path) -> None:
    from data_prep.shard_format import ShardDataset
    from pretrain.model import preset
    from pretrain.setup_checks import check_trainable

    with pytest.raises(ValueError, match="GPT-recipe shards .* cannot train a masked-LM model"):
        check_trainable(ShardDataset(gpt_shards), preset("tiny"), str(gpt_shards))
    causal = ModelConfig(**dict(TINY, causal_lm=True))
    with pytest.raises(ValueError, match="unilm-recipe shards .* the model is a causal LM"):
        check_trainable(ShardDataset(unilm_shards), causal, str(unilm_shards))
    check_trainable(ShardDataset(gpt_shards), causal, str(gpt_shards))


def test_a_step_that_predicts_no_token_is_an_error() -> None:
    from pretrain.trainer import check_predicted_tokens

    with pytest.raises(ValueError, match="step 7: the global batch has no predicted token"):
        check_predicted_tokens({"loss": 0.0, "objectives": {}}, 7, "S")
    check_predicted_tokens({"loss": 2.0, "objectives": {"causal_lm": 2.0}}, 7, "S")


def test_init_from_a_model_of_another_vocabulary_is_told_to_rebuild_the_shards(unilm_shards: Path, minilm_dir: Path,
                                                                               tmp_path: Path) -> None:
    """Shards of another, larger vocabulary than model.init_from's: the first message is the fix (rebuild them with
    its vocabulary), not a vocab_size its weights cannot take; with model.check_init_vocab=false the size message
    says the same."""
    from data_prep.shard_format import ShardDataset
    from pretrain.config import load_config
    from pretrain.setup_checks import model_for_shards

    small = tmp_path / "small-bert"  # MiniLM's config and first 1,500 word pieces
    small.mkdir()
    config = json.loads((minilm_dir / "config.json").read_text())
    (small / "config.json").write_text(json.dumps(dict(config, vocab_size=1500)))
    pieces = (minilm_dir / "vocab.txt").read_text(encoding="utf-8").splitlines()[:1500]
    (small / "vocab.txt").write_text("".join(f"{piece}\n" for piece in pieces), encoding="utf-8")
    dataset = ShardDataset(unilm_shards)
    size = dataset.manifest["vocab"]["size"]
    assert size > 1500
    overrides = [f"data.shards={unilm_shards}", f"out_dir={tmp_path}", "model.preset=null", f"model.init_from={small}"]
    with pytest.raises(ValueError, match=f"was built with another vocabulary than model.init_from {small}: "):
        model_for_shards(load_config("pretrain/configs/tiny.yaml", overrides), dataset)
    unchecked = load_config("pretrain/configs/tiny.yaml", overrides + ["model.check_init_vocab=false"])
    with pytest.raises(ValueError, match=re.escape(
            f"has {size} tokens but model.vocab_size is 1500, and a run from model.init_from {small} keeps that "
            f"model's vocabulary (its weights fix the size); rebuild the shards with `python -m data_prep.build "
            f"--vocab {small}`")):
        model_for_shards(unchecked, dataset)


@pytest.mark.slow
def test_gpt_shards_with_a_masked_lm_model_stop_before_step_one(gpt_shards: Path, tmp_path: Path) -> None:
    from training_runs import launch

    process = launch([f"data.shards={gpt_shards}", "model.overrides.vocab_size=4000", f"out_dir={tmp_path}",
                      "train.global_batch_size=8", "train.max_steps=8"], timeout=300)
    assert process.returncode != 0 and "cannot train a masked-LM model" in process.stderr
    assert not (tmp_path / "metrics.jsonl").exists()


# ---------------------------------------------------------------------------------------------------- 7. launch
def test_the_preflight_reports_a_stalled_host_and_checks_the_others(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from pretrain import preflight

    def ssh(command: list[str], **kwargs: object) -> subprocess.CompletedProcess:
        if command[0] != "ssh":
            return real_run(command, **kwargs)
        host = command[5]
        if host == "node-stalls":
            raise subprocess.TimeoutExpired(command, kwargs["timeout"])
        report = {"host": host, "code_version": "git:other", "manifest_hash": None, "free_bytes": 2**50}
        return subprocess.CompletedProcess(command, 0, json.dumps(report) + "\n", "")

    real_run = subprocess.run
    monkeypatch.setattr(preflight.subprocess, "run", ssh)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-stalls slots=1\nnode-fine slots=1\n")
    problems = preflight.preflight("pretrain/configs/tiny.yaml", [f"out_dir={tmp_path}"], str(hostfile))
    assert any(p.startswith("node-stalls: not reachable") and "stalled" in p for p in problems), problems
    assert any(p.startswith("node-fine: code version git:other") for p in problems), problems


def test_the_preflight_warns_when_a_checkpoint_may_outlast_the_launchers_sigterm_grace() -> None:
    import re

    from pretrain import preflight

    launcher = Path(__import__("deepspeed").__file__).parent / "launcher" / "launch.py"
    assert re.search(rf"wait_procs\(children, timeout={preflight.LAUNCHER_GRACE_S}\)", launcher.read_text())
    assert preflight.sigterm_save_warning(2**30, 2**30, "h") is None                # 1 s
    warning = preflight.sigterm_save_warning(64 * 2**30, 2**30, "h")                # 64 s
    assert warning.startswith("h: a checkpoint (~64.0 GiB at 1024 MiB/s measured) takes ~64 s, longer than the 30 s")
    assert "train.save_interval" in warning and "train.exit_after_minutes" in warning


def make_pretrain(hostfile: Path, *variables: str) -> subprocess.CompletedProcess:
    # -o: never remake the venv stamp (a dry run still remakes targets the Makefile itself depends on); VENV: this
    # interpreter's, which resolves a hostfile filter (INCLUDE, EXCLUDE, NUM_NODES) while make expands the recipe
    return subprocess.run(["make", "-n", "-o", f"{sys.prefix}/.installed", "pretrain", f"VENV={sys.prefix}",
                           f"HOSTFILE={hostfile}", *variables], cwd=ROOT, env=subprocess_env(), capture_output=True,
                          text=True, timeout=60)


def launch_lines(process: subprocess.CompletedProcess) -> tuple[str, str]:
    """The preflight and deepspeed command lines `make -n pretrain` printed, whitespace runs as one space."""
    assert process.returncode == 0, process.stderr
    lines = [" ".join(line.split()) for line in process.stdout.splitlines()]
    return (next(line for line in lines if "-m pretrain.preflight" in line),
            next(line for line in lines if "/bin/deepspeed " in line))


def test_make_pretrain_refuses_a_hostfile_word_that_is_not_a_host_before_any_shell(tmp_path: Path) -> None:
    hostile = tmp_path / "hostile"
    hostile.write_text("node1;touch${IFS}PWNED slots=1\n")
    process = make_pretrain(hostile)
    assert process.returncode != 0 and "a host entry is not a host name or IP address" in process.stderr
    assert "deepspeed" not in process.stdout and "preflight" not in process.stdout
    good = tmp_path / "good"
    good.write_text("node-1 slots=1\nnode_2 slots=1\n")
    process = make_pretrain(good)
    assert process.returncode == 0 and "--master_addr 'node-1'" in process.stdout


def test_make_pretrain_refuses_a_loopback_first_host_among_several(tmp_path: Path) -> None:
    """The first host is the launcher's master_addr: as localhost, every other node would meet itself."""
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=1\nnode-2 slots=1\n")
    process = make_pretrain(hostfile)
    assert process.returncode != 0 and "its first host, localhost, is where every rank meets rank 0" in process.stderr
    assert "deepspeed" not in process.stdout
    named = subprocess.run(["make", "-n", "-o", ".venv/.installed", "pretrain", f"HOSTFILE={hostfile}",
                            "MASTER_ADDR=10.1.2.3"], cwd=ROOT, env=subprocess_env(), capture_output=True, text=True,
                           timeout=60)
    assert named.returncode == 0 and "--master_addr '10.1.2.3'" in named.stdout
    hostfile.write_text("localhost slots=2\n")  # this machine alone: no ssh, 127.0.0.1
    assert "--master_addr '127.0.0.1'" in make_pretrain(hostfile).stdout


def test_make_pretrain_passes_a_host_filter_on_and_meets_at_the_first_host_it_leaves(tmp_path: Path) -> None:
    """INCLUDE / EXCLUDE / NUM_NODES reach deepspeed and the preflight quoted; the master address and the ssh check
    follow the hosts the filter leaves (ranks meet at --master_addr: an excluded host would never answer)."""
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node-1 slots=2\nnode-2 slots=2\nnode-3 slots=2\n")
    deepspeed = f"{sys.prefix}/bin/deepspeed --hostfile '{hostfile}'"
    preflight, launch = launch_lines(make_pretrain(hostfile))  # no filter: as before
    assert launch == f"{deepspeed} --master_addr 'node-1' \\" and preflight.endswith(f"--hostfile '{hostfile}'")
    preflight, launch = launch_lines(make_pretrain(hostfile, "EXCLUDE=node-1"))
    assert launch == f"{deepspeed} --exclude 'node-1' --master_addr 'node-2' \\"
    assert preflight.endswith(f"--hostfile '{hostfile}' --exclude 'node-1'")
    # values reach every shell quoted, the host resolution run while make expands the recipe included (these two
    # filters together resolve to nothing: the preflight, the recipe's first line, would stop on them)
    hostile = f"node-1:0,1;touch {tmp_path}/PWNED'"
    preflight, launch = launch_lines(make_pretrain(hostfile, f"INCLUDE={hostile}", "NUM_NODES=2"))
    flags = "--include '" + hostile.replace("'", "'\\''") + "' --num_nodes '2'"
    assert launch.startswith(f"{deepspeed} {flags} ") and preflight.endswith(flags)
    assert not (tmp_path / "PWNED").exists()
    # this machine alone after the filter: no ssh check, rendezvous on 127.0.0.1 (its loopback name is no problem)
    hostfile.write_text("localhost slots=2\nnode-2 slots=2\n")
    _, launch = launch_lines(make_pretrain(hostfile, "INCLUDE=localhost:1"))
    assert launch == f"{deepspeed} --include 'localhost:1' --no_ssh_check --master_addr '127.0.0.1' \\"
    hostfile.write_text("node-1 slots=1\nlocalhost slots=1\nnode-3 slots=1\n")
    process = make_pretrain(hostfile, "EXCLUDE=node-1")
    assert process.returncode != 0 and "deepspeed" not in process.stdout
    assert f"{hostfile}: the first host that --exclude 'node-1' leaves, localhost, is where every rank meets rank 0" \
        in process.stderr


def test_the_preflight_checks_the_hosts_and_slots_a_host_filter_leaves(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                       capsys: pytest.CaptureFixture) -> None:
    """The world size of the batch plan is the slot count left; only the hosts left are probed (one local host: in
    process, no ssh); the first host left is the rendezvous master."""
    from pretrain import preflight

    probed = []

    def remote_probe(host, config, overrides, shared_file=None):
        probed.append(host)
        return preflight.probe(preflight.load_config(config, overrides), shared_file)

    monkeypatch.setattr(preflight, "remote_probe", remote_probe)
    monkeypatch.setattr(preflight, "write_speed", lambda directory: None)
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=8\nnode-b slots=4\nnode-c slots=4\n")

    def check(**host_filter: object) -> list[str]:
        probed.clear()
        return preflight.preflight("pretrain/configs/tiny.yaml", [f"out_dir={tmp_path}"], str(hostfile),
                                   **host_filter)

    # tiny: a global batch of 24 in micro-batches of 4 splits over 3 or 6 ranks, not over 5 or 12
    problems = check(include="localhost:0,2,5")
    assert "[preflight] 1 host(s), 3 ranks: " in capsys.readouterr().out and probed == []
    assert not any("ranks" in problem for problem in problems), problems
    problems = check(include="localhost:0,1,2,3,4")
    assert any("No (micro, accumulation) pair reaches 24 on 5 ranks" in problem for problem in problems), problems
    problems = check(exclude="localhost@node-c:0,1")
    assert "[preflight] 2 host(s), 6 ranks: " in capsys.readouterr().out and probed == ["node-b", "node-c"]
    assert not any("first host" in problem for problem in problems), problems
    problems = check(num_nodes=2)
    assert any("micro-batches of 4 on 12 data-parallel ranks" in problem for problem in problems), problems
    assert probed == ["localhost", "node-b"]
    hostfile.write_text("node-a slots=1\nlocalhost slots=1\nnode-c slots=1\n")
    problems = check(exclude="node-a")
    assert probed == ["localhost", "node-c"]
    assert any(problem.startswith(f"{hostfile}: the first host the filter leaves, localhost, is where every rank "
                                  "meets rank 0") for problem in problems), problems


BAD_HOST_FILTERS = {
    "a host not in the hostfile": (["--include", "node-z"],
                                   "--include node-z: Hostname 'node-z' not found in hostfile"),
    "a slot the host lacks": (["--include", "node-b:0,2"],
                              "--include node-b:0,2: No slot '2' specified on host 'node-b'"),
    "a malformed slot list": (["--exclude", "node-b:one"], "--exclude node-b:one: invalid literal for int()"),
    "two filters": (["--include", "node-b", "--exclude", "localhost"],
                    "--include node-b --exclude localhost: give one of --include, --exclude, --num_nodes"),
    "nothing left": (["--exclude", "localhost@node-b"], "--exclude localhost@node-b leaves no slot to run on"),
}


@pytest.mark.parametrize("case", BAD_HOST_FILTERS)
def test_a_bad_host_filter_is_one_line_naming_the_hostfile_and_the_value(
        case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    from pretrain import preflight

    def no_subprocess(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"a subprocess ran for a bad filter: {args}")

    monkeypatch.setattr(preflight.subprocess, "run", no_subprocess)
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=2\nnode-b slots=2\n")
    arguments, message = BAD_HOST_FILTERS[case]
    for mode in (["--config", "pretrain/configs/tiny.yaml", f"out_dir={tmp_path}"], ["--active-hosts"]):
        assert preflight.main([*mode, "--hostfile", str(hostfile), *arguments]) == 2
        shown = capsys.readouterr()
        assert shown.err.count("\n") == 1 and shown.out == ""
        assert shown.err.startswith(f"[preflight] PROBLEM: {hostfile}: {message}"), shown.err


def test_the_preflight_prints_the_hosts_a_filter_leaves_master_first(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture) -> None:
    """What `make pretrain` takes its master address and ssh check from when a filter is given."""
    from pretrain.preflight import main

    hostfile = tmp_path / "hosts"
    hostfile.write_text("node-a slots=2\nnode-b slots=2\nnode-c slots=2\n")
    for arguments, hosts in (([], ["node-a", "node-b", "node-c"]),
                             (["--exclude", "node-a@node-b:0"], ["node-b", "node-c"]),
                             (["--include", "node-c@node-b:1"], ["node-b", "node-c"]),  # in hostfile order
                             (["--num_nodes", "1"], ["node-a"])):
        assert main(["--active-hosts", "--hostfile", str(hostfile), *arguments]) == 0
        assert capsys.readouterr().out.splitlines() == hosts
    assert main(["--config", "pretrain/configs/tiny.yaml", "--include", "localhost"]) == 2  # a filter needs a hostfile
    assert capsys.readouterr().err.startswith("[preflight] PROBLEM: --include, --exclude and --num_nodes choose")


# -------------------------------------------------------------------------------- real runs: rollback, torn line
@pytest.mark.slow
def test_a_rolled_back_run_with_a_torn_metrics_line_resumes_from_its_own_latest(unilm_shards: Path,
                                                                                tmp_path: Path) -> None:
    """Saves at 2/4/6/8; a run rolled back to 4 saves 5 and is killed mid-write of a metrics line; the plain
    command then resumes at 5 (where `latest` points), names 6 and 8 as abandoned, skips the torn line."""
    from training_runs import check, launch, metrics

    common = [f"data.shards={unilm_shards}", "model.overrides.vocab_size=4000", "train.global_batch_size=8",
              "train.max_steps=8", "train.save_interval=2", "train.keep_last=10", f"out_dir={tmp_path}"]
    checkpoints = tmp_path / "checkpoints"
    check(launch(common))
    check(launch(common + [f"train.resume={checkpoints / 'global_step4'}", "train.exit_at_step=5"]))
    assert (checkpoints / ckpt.LATEST).read_text() == "global_step5"
    with open(tmp_path / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 6, "consumed_sam')
    resumed = check(launch(common))
    assert "[resume] global_step5: step 5, consumed_samples 40" in resumed.stdout, resumed.stdout[-3000:]
    assert "not resuming global_step6, global_step8" in resumed.stdout
    assert f"{tmp_path / 'metrics.jsonl'}:" in resumed.stdout and "skipping a torn or unreadable line" in resumed.stdout
    assert [r["step"] for r in metrics(tmp_path)] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert (checkpoints / ckpt.LATEST).read_text() == "global_step8"
    assert json.loads((checkpoints / "global_step6" / ckpt.MARKER).read_text())["parent_save_id"] == \
        json.loads((checkpoints / "global_step5" / ckpt.MARKER).read_text())["save_id"]


_RESUME_DECISION = """
import json, sys
from pathlib import Path
import torch.distributed as dist
from pretrain import checkpoint as ckpt
from pretrain.resume import find_resume_point

dist.init_process_group("gloo")
rank = dist.get_rank()
hashed = []
real_sha256 = ckpt.sha256_file
ckpt.sha256_file = lambda path: hashed.append(Path(path).name) or real_sha256(path)
directory = Path(sys.argv[1 + rank])
identity = json.loads(sys.argv[3])
try:
    point = find_resume_point(directory, "auto", identity, world_size=2, zero_stage=0)
    outcome = point.tag
except (OSError, ValueError) as error:
    outcome = f"{type(error).__name__}: {error}"
Path(sys.argv[4], f"rank{rank}.json").write_text(json.dumps({"outcome": outcome, "hashed": sorted(hashed)}))
dist.destroy_process_group()
"""


@pytest.mark.slow  # 2 ranks under torchrun, twice
def test_rank_0_alone_hashes_the_resumed_checkpoint_and_a_rank_seeing_another_save_stops(tmp_path: Path) -> None:
    """Two gloo ranks resume: rank 0 hashes each file once, rank 1 none (it checks the marker's save id). A rank
    whose out_dir holds another save at that path (another node's disk) stops every rank, naming rank and host:
    rank 0 going on alone would wait in the engine's first collective."""
    identity = {"model_config": TINY, "world_size": 2, "zero_stage": 0}
    shared, other = tmp_path / "shared", tmp_path / "other"
    for directory in (shared, other):
        directory.mkdir()
        tag_dir = directory / "global_step4"
        tag_dir.mkdir()
        (tag_dir / "mp_rank_00_model_states.pt").write_bytes(b"x" * 100)
        ckpt.write_marker(tag_dir, dict(identity, step=4))  # each its own save id
        ckpt.update_latest(directory, "global_step4")
    script = tmp_path / "resume.py"
    script.write_text(_RESUME_DECISION)

    def launch(rank0_dir: Path, rank1_dir: Path) -> dict[int, dict]:
        results = Path(tempfile.mkdtemp(dir=tmp_path))
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                               str(script), str(rank0_dir), str(rank1_dir), json.dumps(identity), str(results)],
                              env=subprocess_env(PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return {rank: json.loads((results / f"rank{rank}.json").read_text()) for rank in (0, 1)}

    same = launch(shared, shared)
    assert same[0]["outcome"] == same[1]["outcome"] == "global_step4"
    assert same[0]["hashed"] == ["mp_rank_00_model_states.pt"] and same[1]["hashed"] == []
    split = launch(shared, other)
    for rank in (0, 1):
        assert split[rank]["outcome"].startswith(f"FileNotFoundError: rank 1 on {os.uname().nodename} does not see "
                                                 f"the checkpoint rank 0 resumes, {other / 'global_step4'}, as rank 0 "
                                                 "does")
        assert "out_dir must be one shared directory, at the same path, on every node" in split[rank]["outcome"]


def test_an_export_whose_shards_moved_is_told_to_pass_shards(tmp_path: Path) -> None:
    """The run config names shards that are gone: the message says --shards DIR, not "rebuild them"."""
    from pretrain.export import shard_vocabulary

    tag_dir = tmp_path / "checkpoints" / "global_step2"
    tag_dir.mkdir(parents=True)
    (tag_dir / "mp_rank_00_model_states.pt").write_bytes(b"x" * 10)
    moved = tmp_path / "shards-before-the-move"
    ckpt.write_marker(tag_dir, {"step": 2, "run_config": {"data": {"shards": str(moved)}}})
    ckpt.update_latest(tmp_path / "checkpoints", "global_step2")
    with pytest.raises(ValueError, match=rf"the run's shards were at {moved} when it trained: if they moved, pass "
                                         r"--shards DIR"):
        shard_vocabulary(tmp_path / "checkpoints")
