"""The DeepSpeed JSON is checked where it is read (`pretrain.engine.read_engine_json`: pre-training, fine-tuning,
the preflight): what DeepSpeed would ignore, or stop on later with a traceback, is refused before anything is
built, in one line naming the file and the key."""
from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from deepspeed.accelerator import get_accelerator

from common.paths import REPO_ROOT
from pretrain import engine

CONFIGS = REPO_ROOT / "ds_configs"
CPU_CONFIGS = ("zero0_fp32_cpu.json", "zero1_fp32_cpu.json", "zero2_bf16_cpu.json", "zero2_fp32_cpu.json",
               "zero3_fp32_cpu.json")
# DeepSpeed's CPU accelerator where torch's mkldnn has no fp16 (most CPUs): bf16 yes, fp16 no
CPU_WITHOUT_FP16 = SimpleNamespace(device_name=lambda: "cpu", is_fp16_supported=lambda: None,
                                   is_bf16_supported=lambda: True)


def engine_json(tmp_path: Path, settings: dict) -> Path:
    path = tmp_path / "engine.json"
    path.write_text(json.dumps(settings))
    return path


def test_every_config_of_the_repository_passes() -> None:
    assert sorted(p.name for p in CONFIGS.glob("*_cpu.json")) == list(CPU_CONFIGS)
    for path in sorted(CONFIGS.glob("*.json")):
        engine.read_engine_json(path)
    for name in CPU_CONFIGS:  # on this machine's accelerator too, whatever it is
        engine.read_engine_json(CONFIGS / name, accelerator=get_accelerator())


def test_fp16_where_the_accelerator_has_none_is_refused_naming_the_cpu_configs() -> None:
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    assert CPU_Accelerator().is_bf16_supported()  # DeepSpeed's CPU accelerator trains in bf16: not refused
    fp16 = CONFIGS / "zero2_fp16.json"  # unilm-large.yaml's
    assert engine.read_engine_json(fp16)["fp16"]["enabled"]  # no accelerator named: the file's own checks only
    with pytest.raises(ValueError) as refused:
        engine.read_engine_json(fp16, accelerator=CPU_WITHOUT_FP16)
    message = str(refused.value)
    assert message.startswith(f"{fp16}: fp16 is enabled, but DeepSpeed's cpu accelerator cannot train in fp16 on "
                              "this machine"), message
    assert "set deepspeed_config to a CPU config (" + ", ".join(f"ds_configs/{n}" for n in CPU_CONFIGS) in message
    for name in CPU_CONFIGS:
        engine.read_engine_json(CONFIGS / name, accelerator=CPU_WITHOUT_FP16)
    without_bf16 = SimpleNamespace(device_name=lambda: "cuda", is_fp16_supported=lambda: True,
                                   is_bf16_supported=lambda: False)
    with pytest.raises(ValueError, match=r"zero2_bf16.json: bf16 is enabled, but DeepSpeed's cuda accelerator .*"
                                         r"use a config that does not enable bf16 \(fp16 or fp32\)"):
        engine.read_engine_json(CONFIGS / "zero2_bf16.json", accelerator=without_bf16)
    engine.read_engine_json(CONFIGS / "zero2_fp16.json", accelerator=without_bf16)


def test_a_scheduler_the_run_config_cannot_drive_is_refused_naming_the_file(tmp_path: Path) -> None:
    for scheduler, named in (({"type": "OneCycle"}, "'OneCycle'"), ({"params": {"warmup_type": "linear"}}, "None")):
        path = engine_json(tmp_path, {"scheduler": scheduler})
        with pytest.raises(ValueError, match=re.escape(f"{path}: scheduler.type is {named}; the schedule comes from "
                                                       "the run config (optim.schedule: linear or cosine")):
            engine.read_engine_json(path)
    for scheduler in ("WarmupDecayLR", "WarmupCosineLR"):
        engine.read_engine_json(engine_json(tmp_path, {"scheduler": {"type": scheduler}}))


@pytest.mark.parametrize("settings, message", [
    ({"optimizer": None}, "optimizer must be a JSON object ({...}), not null"),
    ({"optimizer": "AdamW"}, "optimizer must be a JSON object ({...}), not a string"),
    ({"scheduler": "x"}, "scheduler must be a JSON object ({...}), not a string"),
    ({"zero_optimization": "2"}, "zero_optimization must be a JSON object ({...}), not a string"),
    ({"fp16": True}, "fp16 must be a JSON object ({...}), not a boolean"),
    ({"optimizer": {"type": "AdamW", "params": [0.9]}}, "optimizer.params must be a JSON object ({...}), not an array"),
])
def test_a_block_that_is_not_an_object_is_refused_naming_the_key(tmp_path: Path, settings: dict,
                                                                  message: str) -> None:
    path = engine_json(tmp_path, settings)
    with pytest.raises(ValueError, match=re.escape(f"{path}: {message}")):
        engine.read_engine_json(path)


@pytest.mark.parametrize("key, meant", [("zero_optimisation", "zero_optimization"), ("FP16", "fp16"),
                                        ("schedular", "scheduler"), ("optimiser", "optimizer"),
                                        ("steps_per_prnt", "steps_per_print")])
def test_a_misspelt_top_level_key_is_refused_with_the_key_deepspeed_reads(tmp_path: Path, key: str,
                                                                          meant: str) -> None:
    """DeepSpeed ignores a key it does not read: ``zero_optimisation`` trained at ZeRO 0."""
    path = engine_json(tmp_path, {key: {}})
    with pytest.raises(ValueError, match=re.escape(f"{path}: unknown key {key!r}, which DeepSpeed would ignore; "
                                                   f"did you mean {meant!r}?")):
        engine.read_engine_json(path)


def test_a_misspelling_of_a_value_the_run_config_injects_is_told_to_go(tmp_path: Path) -> None:
    path = engine_json(tmp_path, {"gradient_clip": 1.0})
    with pytest.raises(ValueError, match=re.escape("did you mean 'gradient_clipping'? That one comes from the run "
                                                   "config: remove 'gradient_clip'")):
        engine.read_engine_json(path)


def test_an_unknown_key_far_from_deepspeeds_is_left_alone(tmp_path: Path) -> None:
    """The list of keys DeepSpeed reads is not known to be complete: only close misspellings are refused."""
    settings = {"_comment": "ZeRO-2 for the 8-GPU nodes", "zero_optimization": {"stage": 2}}
    assert engine.read_engine_json(engine_json(tmp_path, settings)) == settings


def test_the_known_keys_are_those_deepspeeds_config_reads(one_rank_group) -> None:
    """`pretrain.engine.DEEPSPEED_KEYS` against the installed DeepSpeed: the top-level keys its ``DeepSpeedConfig``
    looks up in a config dict (less those it refuses as removed features) are the list, plus the mesh sizes that
    ``deepspeed.initialize`` reads."""
    from deepspeed.runtime import config as deepspeed_config

    read: set[str] = set()

    class RecordedKeys(list):
        def __contains__(self, key: object) -> bool:
            read.add(key)
            return super().__contains__(key)

    class Recording(dict):
        def get(self, key, *default):
            read.add(key)
            return super().get(key, *default)

        def __getitem__(self, key):
            read.add(key)
            return super().__getitem__(key)

        def __contains__(self, key: object) -> bool:
            read.add(key)
            return super().__contains__(key)

        def keys(self):
            return RecordedKeys(super().keys())

        def __copy__(self):
            return self

    deepspeed_config.DeepSpeedConfig(Recording(train_batch_size=1, train_micro_batch_size_per_gpu=1))
    removed = set(getattr(deepspeed_config, "_REMOVED_TOP_LEVEL_CONFIG_KEYS", {}))
    assert {"zero_optimization", "fp16", "optimizer", "scheduler"} <= read  # the recording saw the lookups
    assert read - removed - {"sequence_parallel_size"} == set(engine.DEEPSPEED_KEYS) - {"data_parallel_size",
                                                                                       "sequence_parallel_size"}


def test_the_preflight_reports_what_training_would_refuse_in_the_json(unilm_shards: Path, tmp_path: Path) -> None:
    from pretrain.preflight import preflight

    batch = engine_json(tmp_path, {"train_batch_size": 32, "zero_optimization": {"stage": 2}})
    broken = tmp_path / "broken.json"
    broken.write_text('{"zero_optimization": {stage: 2}}')
    for path, message in ((batch, f"DeepSpeed config {batch} sets train_batch_size: these come from the run config"),
                          (broken, f"DeepSpeed config {broken}: not valid JSON")):
        problems = preflight("pretrain/configs/tiny.yaml", [f"data.shards={unilm_shards}", f"out_dir={tmp_path}",
                                                            f"deepspeed_config={path}"], None)
        assert len(problems) == 1 and problems[0].startswith(message), problems


@pytest.mark.slow
def test_a_scheduler_deepspeed_cannot_take_stops_pretraining_in_one_line(unilm_shards: Path, tmp_path: Path) -> None:
    """The DeepSpeed config is built (dry) among the setup checks: its problems are a one-line stop (exit 2), not a
    traceback from building the engine, and the run leaves nothing in its out_dir."""
    from training_runs import launch

    bad = engine_json(tmp_path, {"zero_optimization": {"stage": 2}, "scheduler": {"type": "OneCycle"}})
    out_dir = tmp_path / "run"
    out_dir.mkdir()
    (out_dir / "notes.txt").write_text("not the run's")
    process = launch([f"data.shards={unilm_shards}", "model.overrides.vocab_size=4000", f"out_dir={out_dir}",
                      f"deepspeed_config={bad}"], timeout=300)
    assert process.returncode == 2, process.stderr[-3000:]
    assert f"[stop] {bad}: scheduler.type is 'OneCycle'" in process.stderr
    assert "Traceback" not in process.stderr
    assert [p.name for p in out_dir.iterdir()] == ["notes.txt"]


@pytest.mark.slow
def test_fp16_on_a_cpu_without_it_stops_pretraining_naming_the_cpu_configs(unilm_shards: Path,
                                                                          tmp_path: Path) -> None:
    """unilm-large.yaml's JSON on a CPU-only machine (forced here: DS_ACCELERATOR=cpu): refused before DeepSpeed's
    "Type fp16 is not supported on your device" traceback."""
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    from training_runs import launch

    if CPU_Accelerator().is_fp16_supported():
        pytest.skip("this CPU trains in fp16 (torch's mkldnn has it), so DeepSpeed takes the JSON")
    process = launch([f"data.shards={unilm_shards}", "model.overrides.vocab_size=4000", f"out_dir={tmp_path / 'run'}",
                      "deepspeed_config=ds_configs/zero2_fp16.json"], timeout=300, extra_env={"DS_ACCELERATOR": "cpu"})
    assert process.returncode == 2, process.stderr[-3000:]
    assert "zero2_fp16.json: fp16 is enabled, but DeepSpeed's cpu accelerator cannot train in fp16" in process.stderr
    assert "ds_configs/zero2_fp32_cpu.json" in process.stderr and "Traceback" not in process.stderr
    assert not (tmp_path / "run").exists()
