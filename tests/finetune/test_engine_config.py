"""The DeepSpeed engine config fine-tuning picks when none is named: the machine's (CPU here), else the named one."""
from __future__ import annotations

from deepspeed.accelerator import get_accelerator

from finetune.config import CPU_DEEPSPEED_CONFIG, GPU_DEEPSPEED_CONFIGS, default_deepspeed_config, load_config
from pretrain.config import REPO_ROOT

REQUIRED = {"task": "classify", "train": "t.jsonl", "dev": "d.jsonl", "init": "m", "out": "o"}


def test_no_config_named_means_the_machines_default() -> None:
    cfg = load_config(None, REQUIRED)
    assert cfg.deepspeed_config is None  # recorded as "auto" in run_config.json
    accelerator = get_accelerator()
    if accelerator.device_name() == "cpu":
        assert default_deepspeed_config() == CPU_DEEPSPEED_CONFIG
    else:
        assert default_deepspeed_config() == GPU_DEEPSPEED_CONFIGS["bf16" if accelerator.is_bf16_supported() else "fp16"]
    assert cfg.deepspeed_config_path.resolve() == (REPO_ROOT / default_deepspeed_config()).resolve()
    for path in (CPU_DEEPSPEED_CONFIG, *GPU_DEEPSPEED_CONFIGS.values()):
        assert (REPO_ROOT / path).is_file(), path


def test_a_named_config_wins_from_the_cli_and_from_overrides() -> None:
    flag = load_config(None, dict(REQUIRED, deepspeed_config="ds_configs/zero2_fp16.json"))
    assert flag.deepspeed_config_path.resolve() == (REPO_ROOT / "ds_configs/zero2_fp16.json").resolve()
    override = load_config(None, REQUIRED, ["deepspeed_config=ds_configs/zero1_fp32_cpu.json"])
    assert override.deepspeed_config_path.resolve() == (REPO_ROOT / "ds_configs/zero1_fp32_cpu.json").resolve()
