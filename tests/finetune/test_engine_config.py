"""The DeepSpeed engine config fine-tuning picks when none is named: the machine's (CPU here), else the named one;
what the run config injects into it for the optimizer."""
from __future__ import annotations

import pytest
from deepspeed.accelerator import get_accelerator

from common.paths import REPO_ROOT
from finetune.config import CPU_DEEPSPEED_CONFIG, GPU_DEEPSPEED_CONFIGS, default_deepspeed_config, load_config
from finetune.engine import deepspeed_config
from pretrain.accelerator import native_bf16
from pretrain.batch_plan import plan_batch
from pretrain.engine import read_engine_json

REQUIRED = {"task": "classify", "train": "t.jsonl", "dev": "d.jsonl", "init": "m", "out": "o"}


def test_no_config_named_means_the_machines_default() -> None:
    cfg = load_config(None, REQUIRED)
    assert cfg.deepspeed_config is None  # recorded as "auto" in run_config.json
    if get_accelerator().device_name() == "cpu":
        assert default_deepspeed_config() == CPU_DEEPSPEED_CONFIG
    else:
        assert default_deepspeed_config() == GPU_DEEPSPEED_CONFIGS["bf16" if native_bf16() else "fp16"]
    assert cfg.deepspeed_config_path.resolve() == (REPO_ROOT / default_deepspeed_config()).resolve()
    for path in (CPU_DEEPSPEED_CONFIG, *GPU_DEEPSPEED_CONFIGS.values()):
        assert (REPO_ROOT / path).is_file(), path


def test_a_named_config_wins_from_the_cli_and_from_overrides() -> None:
    flag = load_config(None, dict(REQUIRED, deepspeed_config="ds_configs/zero2_fp16.json"))
    assert flag.deepspeed_config_path.resolve() == (REPO_ROOT / "ds_configs/zero2_fp16.json").resolve()
    override = load_config(None, REQUIRED, ["deepspeed_config=ds_configs/zero1_fp32_cpu.json"])
    assert override.deepspeed_config_path.resolve() == (REPO_ROOT / "ds_configs/zero1_fp32_cpu.json").resolve()


def test_adamax_is_a_client_optimizer_that_zero_accepts_and_offload_refuses() -> None:
    plan = plan_batch(8, 4, 1)
    adamax = load_config(None, dict(REQUIRED, optimizer="adamax", deepspeed_config="ds_configs/zero2_bf16.json"))
    engine = deepspeed_config(adamax, plan, read_engine_json(adamax.deepspeed_config_path), 10, 1, False)
    assert "optimizer" not in engine and engine["zero_allow_untested_optimizer"] is True
    adamw = load_config(None, dict(REQUIRED, deepspeed_config="ds_configs/zero2_bf16.json"))
    engine = deepspeed_config(adamw, plan, read_engine_json(adamw.deepspeed_config_path), 10, 1, False)
    assert engine["optimizer"]["params"]["lr"] == adamw.lr and "zero_allow_untested_optimizer" not in engine
    offload = load_config(None, dict(REQUIRED, optimizer="adamax",
                                     deepspeed_config="ds_configs/zero2_offload_fp16.json"))
    with pytest.raises(ValueError, match=r"zero2_offload_fp16.json: optimizer adamax .* set optimizer=adamw"):
        deepspeed_config(offload, plan, read_engine_json(offload.deepspeed_config_path), 10, 1, False)


def test_a_training_set_smaller_than_one_batch_names_both_batch_flags_when_the_micro_batch_is_too_big() -> None:
    from finetune.engine import schedule

    cfg = load_config(None, dict(REQUIRED, batch_size=24, micro_batch_size=8))
    with pytest.raises(ValueError, match=r"^t.jsonl: 5 training items, fewer than one global batch of 24; lower "
                                         r"--batch-size to at most 5, with a --micro-batch-size that splits it "
                                         r"\(now 8\)$"):
        schedule(cfg, 5)
    with pytest.raises(ValueError, match=r"lower --batch-size to at most 20$"):
        schedule(cfg, 20)
    assert schedule(cfg, 48) == (2, 2 * cfg.epochs, max(1, round(cfg.warmup_ratio * 2 * cfg.epochs)))
