"""Phase 2 starts from phase 1's own checkpoint (``model.init_from`` a checkpoints or tag directory): the weights
are phase 1's last save bit for bit (all six segment rows), with ``train.init_optimizer`` so are Adam's moments and
step count, mapped by parameter name across world sizes and ZeRO stages; a partial or corrupted checkpoint is
refused naming its file, another architecture naming the field."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import pretrain.moments
from common.paths import REPO_ROOT
from pretrain import checkpoint as ckpt
from pretrain.config import load_config, resolve_model_config
from pretrain.moments import MOMENTS, gather_moments, read_moments
from training_runs import check, launch, metrics

TINY = REPO_ROOT / "pretrain/configs/tiny.yaml"
PHASE_1_STEPS = 4


@pytest.fixture(scope="module")
def phase1(unilm_shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Phase 1: the tiny model, 4 steps on 2 ranks (ZeRO-2, fp32, gloo); its checkpoints directory."""
    out = tmp_path_factory.mktemp("phase1")
    check(launch([f"out_dir={out}", f"data.shards={unilm_shards}", f"train.max_steps={PHASE_1_STEPS}",
                  "train.save_interval=2", "optim.warmup_steps=2", "train.global_batch_size=8",
                  "train.micro_batch_size=2"], nproc=2))
    return out / "checkpoints"


def phase2_config(phase1: Path, unilm_shards: Path, out: Path, *overrides: str):
    return load_config(TINY, [f"out_dir={out}", f"data.shards={unilm_shards}", f"model.init_from={phase1}",
                              "train.max_steps=10", "optim.warmup_steps=2", "train.global_batch_size=4",
                              "train.micro_batch_size=2", *overrides])


def phase2_engine(cfg):
    """Phase 2's engine on this process's 1-rank group, as `pretrain.trainer.train` builds it before step 1."""
    from pretrain.trainer import build_training_engine, check_setup, take_over_optimizer

    setup = check_setup(cfg, rank=0, world_size=1)
    engine = build_training_engine(cfg, setup.model, setup.deepspeed_config, setup.fast_paths, setup.resume)
    if cfg.train.init_optimizer:
        take_over_optimizer(engine, cfg.model.init_from, rank=0)
    return engine


@pytest.mark.slow  # ≈ 30 s: phase 1 on 2 ranks
@pytest.mark.parametrize("deepspeed_config", ["ds_configs/zero2_fp32_cpu.json", "ds_configs/zero0_fp32_cpu.json"])
def test_phase_2_starts_with_phase_1s_weights_and_adam_moments(phase1: Path, unilm_shards: Path, tmp_path: Path,
                                                              one_rank_group, deepspeed_config: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "0")  # as a launcher sets it (deepspeed.initialize reads it)
    cfg = phase2_config(phase1, unilm_shards, tmp_path / "phase2", "train.init_optimizer=true",
                        f"deepspeed_config={deepspeed_config}")
    engine = phase2_engine(cfg)
    last = phase1 / f"global_step{PHASE_1_STEPS}"
    assert (phase1 / ckpt.LATEST).read_text() == last.name
    _, saved = ckpt.load_weights(last)
    weights = ckpt.gather_full_weights(engine.module)
    assert weights.keys() == saved.keys()
    assert all(torch.equal(weights[name], saved[name]) for name in saved), "weights differ from phase 1's"
    segments = weights["embeddings.segment.weight"]
    assert segments.shape[0] == 6 and torch.equal(segments, saved["embeddings.segment.weight"])

    moments = read_moments(last / MOMENTS)
    assert int(moments["step"][0]) == PHASE_1_STEPS  # every update of phase 1 (fp32: none skipped)
    assert any(value.abs().sum() > 0 for key, value in moments.items() if key.startswith("exp_avg_sq/"))
    taken = gather_moments(engine)
    assert taken.keys() == moments.keys()
    assert all(torch.equal(taken[key], moments[key]) for key in moments), "moments differ from phase 1's"
    monkeypatch.setattr(pretrain.moments, "BUCKET_ELEMENTS", 1000)  # many all-reduces, some parameters over one
    rebucketed = gather_moments(engine)
    assert rebucketed.keys() == moments.keys()
    assert all(torch.equal(rebucketed[key], moments[key]) for key in moments)
    if "zero0" in deepspeed_config:  # without ZeRO: the torch optimizer's own state, read directly
        state = engine.basic_optimizer.state
        for name, parameter in engine.module.named_parameters():
            assert torch.equal(state[parameter]["exp_avg"], moments[f"exp_avg/{name}"])
            assert torch.equal(state[parameter]["exp_avg_sq"], moments[f"exp_avg_sq/{name}"])
            assert int(state[parameter]["step"]) == PHASE_1_STEPS


@pytest.mark.slow  # ≈ 30 s: phase 1, then 2 steps of phase 2
def test_phase_2_trains_from_a_tag_directory_with_its_own_schedule_and_samples(phase1: Path, unilm_shards: Path,
                                                                              tmp_path: Path) -> None:
    out = tmp_path / "phase2"
    done = check(launch([f"out_dir={out}", f"data.shards={unilm_shards}", f"model.init_from={phase1 / 'global_step2'}",
                         "train.init_optimizer=true", "train.max_steps=2", "optim.warmup_steps=1",
                         "train.global_batch_size=4", "train.micro_batch_size=2"]))
    assert f"[init] Adam moments and step count (2) taken over from {phase1 / 'global_step2'}" in done.stdout
    records = [r for r in metrics(out) if "loss" in r]
    assert [r["consumed_samples"] for r in records] == [4, 8]  # the new run's data order, from its start
    assert records[0]["lr"] == 0.0  # its own warm-up, from optim.min_lr
    marker = ckpt.read_marker(out / "checkpoints" / "global_step2")
    assert marker["step"] == 2 and MOMENTS in marker["files"]
    assert int(read_moments(out / "checkpoints" / "global_step2" / MOMENTS)["step"][0]) == 2 + 2


@pytest.mark.slow  # ≈ 30 s: phase 1
def test_a_partial_or_corrupted_checkpoint_is_refused_naming_the_file(phase1: Path, unilm_shards: Path,
                                                                      tmp_path: Path, one_rank_group,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from pretrain.trainer import initial_model

    monkeypatch.setenv("LOCAL_RANK", "0")
    copy = tmp_path / "checkpoints"
    shutil.copytree(phase1, copy)
    weights = copy / "global_step4" / ckpt.WEIGHTS
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # same size, other bytes: only the hash tells
    weights.write_bytes(bytes(data))
    cfg = phase2_config(copy, unilm_shards, tmp_path / "phase2")
    with pytest.raises(ValueError, match=rf"{ckpt.WEIGHTS} does not match the sha256 recorded at save time"):
        initial_model(cfg, resolve_model_config(cfg))
    weights.write_bytes(bytes(data[:100]))  # truncated: its size already tells
    with pytest.raises(FileNotFoundError, match=rf"{copy / 'global_step4'} is not a valid checkpoint: {ckpt.WEIGHTS} "
                                                r"has 100 bytes"):
        resolve_model_config(cfg)

    unfinished = copy / "global_step2"
    (unfinished / ckpt.MARKER).unlink()  # a save that never finished
    with pytest.raises(FileNotFoundError, match=rf"{unfinished} is not a valid checkpoint: no {ckpt.MARKER}"):
        resolve_model_config(phase2_config(unfinished, unilm_shards, tmp_path / "phase2"))

    moments_copy = tmp_path / "moments"
    shutil.copytree(phase1, moments_copy)
    moments = moments_copy / "global_step4" / MOMENTS
    data = bytearray(moments.read_bytes())
    data[-1] ^= 0xFF
    moments.write_bytes(bytes(data))
    with pytest.raises(Exception, match=rf"{MOMENTS} does not match the sha256 recorded at save time"):
        phase2_engine(phase2_config(moments_copy, unilm_shards, tmp_path / "phase2", "train.init_optimizer=true"))


@pytest.mark.slow  # ≈ 30 s: phase 1
def test_another_architecture_is_refused_naming_the_field(phase1: Path, unilm_shards: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"trained with num_layers=2, this run sets model.overrides.num_layers=3"):
        resolve_model_config(phase2_config(phase1, unilm_shards, tmp_path, "model.overrides.num_layers=3"))
    with pytest.raises(ValueError, match=r"max_position_embeddings=512, this run sets "
                                         r"model.overrides.max_position_embeddings=256"):  # longer only
        resolve_model_config(phase2_config(phase1, unilm_shards, tmp_path,
                                           "model.overrides.max_position_embeddings=256"))
    model_cfg = resolve_model_config(phase2_config(phase1, unilm_shards, tmp_path, "model.overrides.hidden_dropout=0"))
    assert model_cfg.hidden_dropout == 0 and model_cfg.num_layers == 2  # dropout is a training setting


@pytest.mark.slow  # ≈ 30 s: phase 1
def test_phase_2_may_lengthen_the_position_table_its_new_rows_and_their_moments_repeating_the_learned_ones(
        phase1: Path, unilm_shards: Path, tmp_path: Path, one_rank_group, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "0")
    cfg = phase2_config(phase1, unilm_shards, tmp_path / "phase2", "train.init_optimizer=true",
                        "model.overrides.max_position_embeddings=1200")
    engine = phase2_engine(cfg)
    last = phase1 / f"global_step{PHASE_1_STEPS}"
    _, saved = ckpt.load_weights(last)
    weights, moments = ckpt.gather_full_weights(engine.module), gather_moments(engine)
    phase1_moments = read_moments(last / MOMENTS)
    for table, before in (("embeddings.position.weight", saved), ("exp_avg/embeddings.position.weight", phase1_moments),
                          ("exp_avg_sq/embeddings.position.weight", phase1_moments)):
        longer, learned = (weights if table in weights else moments)[table], before[table]
        assert longer.shape[0] == 1200 and learned.shape[0] == 512, table
        assert torch.equal(longer[:512], learned) and torch.equal(longer[512:1024], learned), table
        assert torch.equal(longer[1024:], learned[:176]), table  # row 1024 + i = row i
    assert all(torch.equal(weights[name], saved[name]) for name in saved if "position" not in name)


def test_init_optimizer_needs_a_checkpoint_to_start_from(unilm_shards: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"train.init_optimizer=true needs model.init_from"):
        load_config(TINY, [f"out_dir={tmp_path}", f"data.shards={unilm_shards}", "train.init_optimizer=true"])
