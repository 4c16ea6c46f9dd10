"""The run config: YAML presets + dotted overrides, frozen, validated; DeepSpeed JSON injection."""
from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path

import pytest

from common.paths import REPO_ROOT
from pretrain.batch_plan import plan_batch
from pretrain.config import load_config
from pretrain.engine import parameter_groups, read_engine_json
from pretrain.trainer import build_deepspeed_config

PRESETS = sorted((REPO_ROOT / "pretrain" / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", PRESETS, ids=[p.stem for p in PRESETS])
def test_presets_load_and_name_existing_deepspeed_configs(path: Path) -> None:
    cfg = load_config(path)
    assert cfg.deepspeed_config_path.is_file()
    json.loads(cfg.deepspeed_config_path.read_text())


def test_the_paper_settings_are_the_defaults_of_unilm_large() -> None:
    cfg = load_config(REPO_ROOT / "pretrain/configs/unilm-large.yaml")
    assert (cfg.optim.lr, cfg.optim.betas, cfg.optim.weight_decay, cfg.optim.warmup_steps, cfg.optim.grad_clip) == \
        (3e-5, (0.9, 0.999), 0.01, 40_000, 1.0)
    assert cfg.train.global_batch_size == 330 and cfg.train.max_steps == 770_000
    assert {p.stem for p in PRESETS} >= {"unilm-large", "bert-large", "gpt", "tiny"}


def test_overrides_parse_types_and_the_config_is_frozen(tmp_path: Path) -> None:
    cfg = load_config(REPO_ROOT / "pretrain/configs/tiny.yaml",
                      ["train.max_steps=100", "optim.lr=2e-3", "model.overrides.hidden_dropout=0.0",
                       "train.exit_after_minutes=1.5", f"out_dir={tmp_path}"])
    assert cfg.train.max_steps == 100 and cfg.optim.lr == 2e-3 and cfg.train.exit_after_minutes == 1.5
    assert cfg.model.overrides == {"hidden_dropout": 0.0} and cfg.out_dir == str(tmp_path)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.train.max_steps = 5  # type: ignore[misc]


@pytest.mark.parametrize("override, message", [
    ("train.max_stpes=3", r"unknown config key.*train.max_stpes \(did you mean train.max_steps\?\)"),
    ("model.overrides.hiden_size=8", r"model.overrides.hiden_size \(did you mean model.overrides.hidden_size\?\)"),
    ("train.max_steps=abc", "train.max_steps='abc' is not a valid int$"),
    ("train.exit_at_step=500", "exit_at_step must be in"),
    ("optim.warmup_steps=100", "must be < train.max_steps"),
    ("train.eval_interval=5", "needs data.eval_shards"),
    ("train.eval_samples=0", r"train.eval_samples must be >= 1 \(or null"),
    ("train.eval_batches=4", r"train.eval_batches \(replaced by train.eval_samples \(held-out samples"),
    ("optim.betas=[0.9]", "two numbers"),
    ("train.peak_tflops=0", "train.peak_tflops must be > 0"),
    ("train.peak_tflops=fast", "train.peak_tflops='fast' is not a valid"),
])
def test_invalid_values_fail_early(override: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_config(REPO_ROOT / "pretrain/configs/tiny.yaml", [override])


def test_a_bad_setting_is_one_line_not_a_traceback(capsys) -> None:
    from pretrain.train import main
    with pytest.raises(SystemExit) as stopped:
        main(["--config", str(REPO_ROOT / "pretrain/configs/tiny.yaml"), "train.max_step=5"])
    assert stopped.value.code == 2
    assert capsys.readouterr().err == (f"[config] {REPO_ROOT / 'pretrain/configs/tiny.yaml'} + overrides: unknown "
                                       "config key(s): train.max_step (did you mean train.max_steps?)\n")
    with pytest.raises(SystemExit):  # a missing file is not the overrides' doing
        main(["--config", str(REPO_ROOT / "pretrain/configs/tiny.yml"), "train.max_steps=5"])
    assert capsys.readouterr().err.startswith(f"[config] {REPO_ROOT / 'pretrain/configs/tiny.yml'}: no such config "
                                              "file (")


def test_preflight_names_a_bad_config_in_one_line_and_checks_the_vocabulary_before_launch(unilm_shards, tmp_path,
                                                                                          capsys) -> None:
    """A bad config stops preflight with one line naming the file; shards whose vocabulary the model cannot hold
    are a problem there, not a traceback per rank once launched."""
    from pretrain.preflight import main

    typo = tmp_path / "typo.yaml"
    typo.write_text((REPO_ROOT / "pretrain/configs/tiny.yaml").read_text().replace("micro_batch_size",
                                                                                     "micro_batch_sise"))
    assert main(["--config", str(typo)]) == 2
    assert capsys.readouterr().err.startswith(f"[preflight] PROBLEM: {typo}: unknown config key(s): "
                                              "train.micro_batch_sise (did you mean train.micro_batch_size?)")
    assert main(["--config", str(tmp_path / "none.yaml")]) == 2
    assert "none.yaml" in capsys.readouterr().err
    common = ["--config", str(REPO_ROOT / "pretrain/configs/tiny.yaml"), f"data.shards={unilm_shards}",
              f"out_dir={tmp_path / 'run'}"]
    assert main(common + ["model.overrides.vocab_size=100"]) == 1
    size = json.loads((unilm_shards / "manifest.json").read_text())["vocab"]["size"]
    assert (f"[preflight] PROBLEM: the shards' vocabulary has {size} tokens but model.vocab_size is 100; set "
            f"model.overrides.vocab_size={size}") in capsys.readouterr().err


def test_preflight_checks_lengths_and_held_out_shards_against_the_model(unilm_shards, gpt_shards, tmp_path,
                                                                        capsys) -> None:
    """Samples longer than the model's positions, a data.max_seq_len beyond them, and held-out shards the model
    cannot learn from or of another vocabulary are problems before launch (they were a loader-thread traceback, an
    index error in the embedding, and an eval_loss of 0 at every evaluation)."""
    from pretrain.preflight import main
    from shard_builds import run_build

    common = ["--config", str(REPO_ROOT / "pretrain/configs/tiny.yaml"), f"data.shards={unilm_shards}",
              f"out_dir={tmp_path / 'run'}", "model.overrides.vocab_size=4000"]
    longest = json.loads((unilm_shards / "manifest.json").read_text())["max_seq_len"]
    assert main(common + [f"model.overrides.max_position_embeddings={longest // 2}"]) == 1
    assert (f"hold samples of up to {longest} tokens (built with --max-seq-len {longest}), more than the model's "
            f"{longest // 2} positions; rebuild them with --max-seq-len {longest // 2}") in capsys.readouterr().err
    assert main(common + [f"data.max_seq_len={2 * 512}"]) == 1
    assert "data.max_seq_len=1024 exceeds the model's" in capsys.readouterr().err
    assert main(common + [f"data.eval_shards={gpt_shards}", "train.eval_interval=2"]) == 1
    assert f"{gpt_shards}: GPT-recipe shards (no masked positions) cannot train a masked-LM" in capsys.readouterr().err
    other = tmp_path / "other"
    run_build("--input", REPO_ROOT / "data/samples/news/lee.txt", "--vocab", REPO_ROOT / "data/samples/minilm",
              "--max-seq-len", longest, "--out", other)
    assert main(common + [f"data.eval_shards={other}", "train.eval_interval=2",
                          "model.overrides.vocab_size=30522"]) == 1
    assert "were built with another vocabulary than data.shards" in capsys.readouterr().err


@pytest.mark.parametrize("settings, message", [
    ({"zero_optimization": {"stage": "4"}}, "zero_optimization.stage is 4; use 0, 1, 2 or 3"),
    ({"zero_optimization": {"stage": "two"}}, "zero_optimization.stage is 'two'; use 0, 1, 2 or 3"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "fp16 and bf16 are both enabled; enable one"),
])
def test_a_deepspeed_json_is_checked_where_deepspeed_would_fail_later(tmp_path: Path, settings, message) -> None:
    path = tmp_path / "engine.json"
    path.write_text(json.dumps(settings))
    with pytest.raises(ValueError, match=message):
        read_engine_json(path)
    path.write_text(json.dumps({"zero_optimization": {"stage": "2"}}))  # DeepSpeed reads "2" as 2; so does the run
    assert read_engine_json(path)["zero_optimization"]["stage"] == 2


def test_deepspeed_json_gets_batch_optimizer_and_schedule_injected(tmp_path: Path) -> None:
    cfg = load_config(REPO_ROOT / "pretrain/configs/unilm-large.yaml", [f"out_dir={tmp_path}"])
    engine_json = read_engine_json(cfg.deepspeed_config_path)
    config = build_deepspeed_config(cfg, plan_batch(330, 11, 3), engine_json, load_universal=False)
    assert (config["train_batch_size"], config["train_micro_batch_size_per_gpu"],
            config["gradient_accumulation_steps"]) == (330, 11, 10)
    assert config["gradient_clipping"] == 1.0 and config["fp16"]["enabled"]
    assert config["optimizer"] == {"type": "AdamW", "params": {"lr": 3e-5, "betas": [0.9, 0.999], "eps": 1e-6,
                                                                "weight_decay": 0.01}}
    assert config["scheduler"] == {"type": "WarmupDecayLR", "params": {
        "total_num_steps": 770_000, "warmup_num_steps": 40_000, "warmup_max_lr": 3e-5, "warmup_min_lr": 0.0,
        "warmup_type": "linear"}}
    assert "checkpoint" not in config
    assert build_deepspeed_config(cfg, plan_batch(330, 11, 3), engine_json, load_universal=True)["checkpoint"] == \
        {"load_universal": True}


def test_the_cosine_schedule_is_deepspeeds_and_decays_as_gpt_does(tmp_path: Path) -> None:
    """optim.schedule: cosine (the gpt config) runs DeepSpeed's WarmupCosineLR: linear warm-up to lr, then
    lr · (1 + cos(pi · progress)) / 2 down to min_lr; a scheduler the run config cannot drive is refused."""
    import math

    import torch
    from deepspeed.runtime.lr_schedules import WarmupCosineLR

    cfg = load_config(REPO_ROOT / "pretrain/configs/gpt.yaml", [f"out_dir={tmp_path}", "train.max_steps=100",
                                                                "optim.warmup_steps=10", "optim.min_lr=2.5e-5"])
    assert cfg.optim.schedule == "cosine"
    engine_json = read_engine_json(cfg.deepspeed_config_path)
    config = build_deepspeed_config(cfg, plan_batch(64, 8, 8), engine_json, load_universal=False)
    assert config["scheduler"] == {"type": "WarmupCosineLR", "params": {
        "total_num_steps": 100, "warmup_num_steps": 10, "warmup_min_ratio": 0.1, "cos_min_ratio": 0.1,
        "warmup_type": "linear"}}
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=cfg.optim.lr)
    scheduler = WarmupCosineLR(optimizer, **config["scheduler"]["params"])
    lrs = []
    for _ in range(100):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    low, peak = cfg.optim.min_lr, cfg.optim.lr
    # the scheduler alone, as DeepSpeed starts it: its very first step runs at 0 (`build_engine` starts it a step on)
    assert lrs[0] == 0.0 and lrs[1] == pytest.approx(low) and max(lrs) == pytest.approx(peak, rel=1e-3)
    assert lrs[5] == pytest.approx(low + (peak - low) * 4 / 10, rel=1e-3)
    assert lrs[55] == pytest.approx(low + (peak - low) * (1 + math.cos(math.pi * 45 / 90)) / 2, rel=1e-3)
    assert lrs[99] == pytest.approx(low, rel=0.01)
    with pytest.raises(ValueError, match="names scheduler 'OneCycle'; the schedule comes from the run config"):
        build_deepspeed_config(cfg, plan_batch(64, 8, 8), {**engine_json, "scheduler": {"type": "OneCycle"}}, False)
    with pytest.raises(ValueError, match="optim.schedule must be linear or cosine, got 'step'"):
        load_config(REPO_ROOT / "pretrain/configs/gpt.yaml", ["optim.schedule=step"])


def test_batch_sizes_in_the_deepspeed_json_are_refused(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"train_batch_size": 32, "optimizer": {"type": "AdamW", "params": {"lr": 1}}}))
    cfg = load_config(REPO_ROOT / "pretrain/configs/tiny.yaml", [f"deepspeed_config={bad}"])
    with pytest.raises(ValueError, match="train_batch_size, optimizer.params.lr"):
        read_engine_json(cfg.deepspeed_config_path)


def test_no_weight_decay_on_biases_and_layer_norms() -> None:
    from pretrain.model import build_model, preset
    model = build_model(preset("tiny"))
    decay, no_decay = parameter_groups(model, 0.01)
    names = {id(p): n for n, p in model.named_parameters()}
    assert decay["weight_decay"] == 0.01 and no_decay["weight_decay"] == 0.0
    assert all(names[id(p)].endswith("bias") or "norm" in names[id(p)].lower() for p in no_decay["params"])
    assert any("norm" in names[id(p)].lower() for p in no_decay["params"])
    assert all(p.ndim == 2 for p in decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_model_from_preset_overrides_or_a_full_config(tmp_path: Path) -> None:
    from pretrain.config import resolve_model_config
    cfg = load_config(REPO_ROOT / "pretrain/configs/tiny.yaml", ["model.overrides.num_layers=3"])
    assert resolve_model_config(cfg).num_layers == 3 and resolve_model_config(cfg).hidden_size == 64
    full = {"vocab_size": 100, "hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64}
    cfg = load_config(REPO_ROOT / "pretrain/configs/tiny.yaml",
                      ["model.preset=null", f"model.overrides={json.dumps(full)}"])
    assert resolve_model_config(cfg).hidden_size == 32
    with pytest.raises(ValueError, match="model.preset, model.init_from"):
        load_config(REPO_ROOT / "pretrain/configs/tiny.yaml", ["model.preset=null"])


def test_model_overrides_are_coerced_to_the_model_config_types_and_checked() -> None:
    cfg = load_config(REPO_ROOT / "pretrain/configs/tiny.yaml",
                      ["model.overrides.layer_norm_eps=1e-5", "model.overrides.num_layers=3"])
    assert cfg.model.overrides == {"layer_norm_eps": 1e-5, "num_layers": 3}
    assert isinstance(cfg.model.overrides["layer_norm_eps"], float)
    with pytest.raises(ValueError, match="unknown config key.*model.overrides.num_layer\\b"):
        load_config(REPO_ROOT / "pretrain/configs/tiny.yaml", ["model.overrides.num_layer=3"])
    with pytest.raises(ValueError, match="model.overrides.num_layers='three' is not a valid"):
        load_config(REPO_ROOT / "pretrain/configs/tiny.yaml", ["model.overrides.num_layers=three"])


def test_activation_checkpointing_is_a_training_setting() -> None:
    from pretrain.model import ModelConfig
    cfg = load_config(REPO_ROOT / "pretrain/configs/tiny.yaml", ["train.activation_checkpointing=true"])
    assert cfg.train.activation_checkpointing is True
    assert "activation_checkpointing" not in {f.name for f in dataclasses.fields(ModelConfig)}
    stored = {"vocab_size": 10, "hidden_size": 8, "num_layers": 1, "num_heads": 2, "intermediate_size": 16,
              "activation_checkpointing": True}  # what older checkpoints' markers hold
    assert ModelConfig.from_dict(stored).hidden_size == 8


def test_help_lists_every_key() -> None:
    import subprocess
    import sys

    from conftest import subprocess_env
    shown = subprocess.run([sys.executable, "-m", "pretrain.train", "--help"], cwd=REPO_ROOT, env=subprocess_env(),
                           capture_output=True, text=True, check=True).stdout
    for key in ("out_dir", "data.shards", "model.overrides", "optim.lr", "train.max_steps",
                "train.activation_checkpointing"):
        assert f"  {key} (" in shown, key


def test_fast_path_defaults_resolve_per_run_and_compile_refuses_zero3() -> None:
    from pretrain.model import preset
    from pretrain.setup_checks import fast_path_settings

    def resolved(overrides: list[str], engine_json: dict, model: str = "tiny") -> dict[str, bool]:
        return fast_path_settings(load_config(REPO_ROOT / "pretrain/configs/tiny.yaml", overrides), engine_json,
                                  preset(model))

    fp32, bf16 = {"zero_optimization": {"stage": 2}}, {"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}
    # this process runs on DeepSpeed's CPU accelerator (conftest), where compiling is off by default
    assert resolved([], fp32) == {"compile": False, "chunked_loss": False, "pack_samples": True}
    assert resolved([], bf16)["chunked_loss"] is True
    assert resolved(["train.compile=true", "train.chunked_loss=false", "train.pack_samples=false"], bf16) == {
        "compile": True, "chunked_loss": False, "pack_samples": False}
    with pytest.raises(ValueError, match="train.compile=true does not work with ZeRO-3"):
        resolved(["train.compile=true"], {"zero_optimization": {"stage": 3}})
    assert resolved([], {"zero_optimization": {"stage": 3}})["compile"] is False
    # a causal LM (GPT) trains one full-length block per row
    assert resolved([], fp32, "gpt")["pack_samples"] is False
    with pytest.raises(ValueError, match="train.pack_samples=true does not apply to a causal LM"):
        resolved(["train.pack_samples=true"], fp32, "gpt")


def test_yaml_syntax_errors_are_value_errors_naming_the_file_or_the_override(tmp_path: Path, capsys) -> None:
    """A YAML syntax error in the run file (with the line and column yaml stopped at) or in an override's value is a
    one-line [config] stop of pretrain.train, as is any bad setting; fine-tuning's loader is the same one."""
    from finetune.config import load_config as load_finetune_config
    from pretrain.train import main

    bad = tmp_path / "bad.yaml"
    bad.write_text("data:\n  shards: [a\n")
    problem = r"not valid YAML: expected ',' or '\]', but got '<stream end>' \(while parsing a flow sequence\)$"
    with pytest.raises(ValueError, match=rf"^{re.escape(str(bad))}:3:1: {problem}"):
        load_config(bad)
    with pytest.raises(ValueError, match=rf"^override 'optim.betas=\[0.9, 0.98': {problem}"):
        load_config(REPO_ROOT / "pretrain/configs/tiny.yaml", ["optim.betas=[0.9, 0.98"])
    with pytest.raises(ValueError, match=rf"^{re.escape(str(bad))}:3:1: {problem}"):
        load_finetune_config(bad, {})
    with pytest.raises(SystemExit) as stopped:
        main(["--config", str(bad)])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"[config] {bad}:3:1: not valid YAML") and err.count("\n") == 1  # the file named once
    from pretrain import preflight
    assert preflight.main(["--config", str(bad)]) == 2
    assert capsys.readouterr().err.startswith(f"[preflight] PROBLEM: {bad}:3:1: not valid YAML")
    assert preflight.main(["--probe", "--config", str(bad)]) == 0  # a host's report, over ssh
    assert json.loads(capsys.readouterr().out)["config_error"].startswith(f"{bad}:3:1: not valid YAML")


def test_an_absent_section_or_an_incomplete_model_is_named(tmp_path: Path) -> None:
    from pretrain.config import resolve_model_config

    no_data = tmp_path / "no_data.yaml"
    no_data.write_text("out_dir: runs/a\ndeepspeed_config: ds_configs/zero2_fp32_cpu.json\n")
    with pytest.raises(ValueError, match=r"^data.shards is required"):
        load_config(no_data)
    with pytest.raises(ValueError, match=r"^model.overrides needs hidden_size, num_layers, num_heads, "
                                         r"intermediate_size when model.preset is null$"):
        resolve_model_config(load_config(REPO_ROOT / "pretrain/configs/tiny.yaml",
                                          ["model.preset=null", "model.overrides.vocab_size=100"]))


@pytest.mark.parametrize("override, message", [
    ("model.overrides.hidden_dropout=1.5", r"model.overrides.hidden_dropout must be in \[0, 1\), got 1.5"),
    ("model.overrides.vocab_size=0", "model.overrides.vocab_size must be a positive int, got 0"),
    ("model.preset=tinyy", "model.preset: unknown model preset 'tinyy'; choose one of unilm-large, "),
])
def test_model_errors_name_the_key_a_run_sets(override: str, message: str) -> None:
    from pretrain.config import resolve_model_config

    with pytest.raises(ValueError, match=f"^{message}"):
        resolve_model_config(load_config(REPO_ROOT / "pretrain/configs/tiny.yaml", [override]))


@pytest.mark.parametrize("arguments, message", [
    (["train.max_step=5"], "unknown config key(s): train.max_step (did you mean train.max_steps?)"),
    (["model.overrides.hidden_dropout=1.5"], "model.overrides.hidden_dropout must be in [0, 1), got 1.5"),
    (["model.overrides.num_heads=5", "model.overrides.hidden_size=128"],
     "model.overrides.hidden_size=128 is not divisible by num_heads=5"),
    (["model.overrides.vocab_size=0"], "model.overrides.vocab_size must be a positive int, got 0"),
    (["model.preset=tinyy"], "model.preset: unknown model preset 'tinyy'"),
    (["model.init_from=ABSENT"], "ABSENT: no config.json"),
    (["optim.betas=[0.9, 0.98"], "override 'optim.betas=[0.9, 0.98': not valid YAML"),
])
def test_the_resolving_cli_refuses_what_training_refuses_in_one_line(arguments: list[str], message: str,
                                                                   tmp_path: Path, capsys) -> None:
    from pretrain.config import main

    arguments = [a.replace("ABSENT", str(tmp_path / "absent")) for a in arguments]
    with pytest.raises(SystemExit) as stopped:
        main([str(REPO_ROOT / "pretrain/configs/tiny.yaml"), *arguments])
    assert stopped.value.code == 2
    captured = capsys.readouterr()
    message = message.replace("ABSENT", str(tmp_path / "absent"))
    named = f"{REPO_ROOT / 'pretrain/configs/tiny.yaml'} + overrides"  # the file, unless the message names it
    assert captured.err.startswith(f"python -m pretrain.config: error: {named}: {message}"), captured.err
    assert captured.err.count("\n") == 1 and captured.out == ""


def test_the_resolving_cli_names_a_missing_file_and_prints_a_good_config(tmp_path: Path, capsys) -> None:
    from pretrain.config import main

    with pytest.raises(SystemExit) as stopped:
        main([str(tmp_path / "none.yaml")])
    assert stopped.value.code == 2
    error = "python -m pretrain.config: error:"
    assert capsys.readouterr().err == f"{error} {tmp_path / 'none.yaml'}: no such config file\n"
    with pytest.raises(SystemExit):
        main([str(REPO_ROOT / "pretrain/configs/tinyy.yaml")])
    configs = REPO_ROOT / "pretrain/configs"
    assert capsys.readouterr().err.startswith(f"{error} {configs}/tinyy.yaml: no such config file ({configs} has "
                                              "bert-continue.yaml, ")
    main([str(REPO_ROOT / "pretrain/configs/tiny.yaml"), "model.overrides.hidden_dropout=0.5"])
    assert "hidden_dropout: 0.5" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main([str(tmp_path)])
    assert capsys.readouterr().err == f"{error} {tmp_path}: a directory, not a config file\n"


def test_a_config_read_from_a_pipe(unilm_shards, tmp_path, capsys) -> None:
    """`python -m pretrain.config <(sed ... tiny.yaml)`: the shell passes /dev/fd/N, a pipe, not a regular file,
    which can be read once: so does the preflight."""
    from pretrain import preflight
    from pretrain.config import main

    def pipe_of_tiny() -> int:
        read, write = os.pipe()
        with os.fdopen(write, "w") as pipe:
            pipe.write((REPO_ROOT / "pretrain/configs/tiny.yaml").read_text())
        return read

    read = pipe_of_tiny()
    try:
        main([f"/dev/fd/{read}", "train.seed=11"])
    finally:
        os.close(read)
    assert "seed: 11" in capsys.readouterr().out
    read = pipe_of_tiny()
    try:
        assert preflight.main(["--config", f"/dev/fd/{read}", f"data.shards={unilm_shards}",
                               f"out_dir={tmp_path / 'run'}"]) == 0, capsys.readouterr().err
    finally:
        os.close(read)
    assert capsys.readouterr().out.endswith("[preflight] ready\n")


def test_an_unusable_train_resume_names_the_key_and_its_values(tmp_path: Path, one_rank_group) -> None:
    from pretrain import checkpoint as ckpt
    from pretrain.resume import find_resume_point

    with pytest.raises(ckpt.CheckpointPathError, match=r"^train.resume=sometimes: sometimes is neither a checkpoints "
                                                       r"directory .*; use auto, never, or a checkpoints/tag "
                                                       r"directory$"):
        find_resume_point(tmp_path / "checkpoints", "sometimes", {}, world_size=1, zero_stage=0)
    checkpoints = tmp_path / "checkpoints"
    (checkpoints / "global_step4").mkdir(parents=True)  # unfinished: not listed
    with pytest.raises(ckpt.CheckpointPathError, match=rf"^train.resume={checkpoints}/global_step99: "
                                                       rf"{checkpoints}/global_step99 does not exist; {checkpoints} "
                                                       r"holds no complete checkpoint$"):
        find_resume_point(checkpoints, str(checkpoints / "global_step99"), {}, world_size=1, zero_stage=0)
