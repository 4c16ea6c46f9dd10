"""Fine-tuning's run config: the same loader as pre-training's (YAML < flags < --set), coerced and validated."""
from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import ROOT, subprocess_env
from finetune.config import FinetuneConfig, load_config

REQUIRED = {"task": "classify", "train": "t.jsonl", "dev": "d.jsonl", "init": "m", "out": "o"}


def test_set_values_are_coerced_to_the_field_types() -> None:
    cfg = load_config(None, REQUIRED, ["lr=3e-5", "epochs=2", "eval_max_examples=10", "similarity=true"])
    assert cfg.lr == 3e-5 and isinstance(cfg.lr, float)
    assert cfg.epochs == 2 and cfg.eval_max_examples == 10 and cfg.similarity is True


def test_precedence_yaml_then_flags_then_set(tmp_path) -> None:
    yaml_path = tmp_path / "run.yaml"
    yaml_path.write_text("lr: 1.0e-4\nepochs: 4\nbatch_size: 16\n")
    cfg = load_config(yaml_path, dict(REQUIRED, epochs=3, lr=None), ["batch_size=8"])
    assert (cfg.lr, cfg.epochs, cfg.batch_size) == (1e-4, 3, 8)


@pytest.mark.parametrize("override, message", [
    ("lr=fast", "lr='fast' is not a valid"),
    ("epoch=3", "unknown config key.*epoch"),
    ("lr=-1", "lr must be > 0, got -1.0"),
    ("warmup_ratio=1", r"warmup_ratio must be in \[0, 1\), got 1.0"),
    ("exit_after_minutes=0", "exit_after_minutes must be > 0"),
    ("save_interval=0", "save_interval must be >= 1"),
    ("eval_max_tgt_len=0", r"eval_max_tgt_len must be >= 1 \(or null: max_tgt_len\), got 0"),
    ("max_position_embeddings=0", r"max_position_embeddings must be >= 1 \(or null: init's\), got 0"),
    ("metric=rougeL", "metric 'rougeL' is not a classify dev score; choose one of accuracy, macro_f1, mcc"),
])
def test_bad_values_are_refused_by_name(override: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_config(None, REQUIRED, [override])


def test_a_seq2seq_run_on_a_delimited_file_is_told_it_reads_jsonl() -> None:
    with pytest.raises(ValueError, match=r"train.tsv: seq2seq reads JSONL files, one \{\"src\""):
        load_config(None, dict(REQUIRED, task="seq2seq", train="train.tsv"))


def test_missing_required_settings_are_named_as_flags() -> None:
    with pytest.raises(ValueError, match="missing required setting.*--dev, --init"):
        load_config(None, {"task": "classify", "train": "t.jsonl", "out": "o"})


def test_help_lists_every_key() -> None:
    shown = subprocess.run([sys.executable, "-m", "finetune.run", "--help"], cwd=ROOT, env=subprocess_env(),
                           capture_output=True, text=True, check=True).stdout
    for name in FinetuneConfig.__dataclass_fields__:
        assert f"  {name} (" in shown, name


@pytest.mark.parametrize("path", sorted((ROOT / "finetune" / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads_and_fits_a_512_position_bert(path, minilm_dir) -> None:
    """Each shipped config loads and fits a 512-position BERT, or the positions it extends the model to."""
    from finetune.generation import ignore_ids
    from finetune.seq2seq import source_budget
    from finetune.tokenizer import load_tokenizer

    cfg = load_config(path, {k: v for k, v in REQUIRED.items() if k != "task"})
    positions = cfg.max_position_embeddings or 512
    if cfg.task == "seq2seq":
        assert source_budget(positions, cfg.max_src_len, cfg.max_tgt_len) >= min(cfg.max_src_len, 48)
        assert source_budget(positions, cfg.max_src_len, cfg.decode_max_tgt_len) == cfg.max_src_len or positions == 512
        assert ignore_ids(load_tokenizer(minilm_dir), cfg.eval_no_repeat_ignore, path.name)
    else:
        assert cfg.max_seq_len <= 512


def test_run_flags_are_the_config_fields_typed_and_only_given_ones_are_passed_on() -> None:
    from common.config_loader import given_fields
    from finetune import run

    args = run.parse_args(["--task", "seq2seq", "--lr", "3e-5", "--max-steps", "7", "--from-scratch",
                           "--deepspeed-config", "ds.json", "--set", "epochs=2"])
    assert given_fields(args, FinetuneConfig) == {"task": "seq2seq", "lr": 3e-5, "max_steps": 7, "from_scratch": True,
                                                  "deepspeed_config": "ds.json"}
    with pytest.raises(SystemExit):
        run.parse_args(["--epochs", "two"])  # typed by the field
    cfg = load_config(None, dict(REQUIRED, **given_fields(run.parse_args(["--epochs", "4"]), FinetuneConfig)),
                      ["epochs=5"])
    assert cfg.epochs == 5  # --set after the flags
    with pytest.raises(ValueError, match="task must be one of classify, qa, seq2seq, got 'bogus'"):
        load_config(None, dict(REQUIRED, **given_fields(run.parse_args(["--task", "bogus"]), FinetuneConfig)))


@pytest.mark.parametrize("module, flags", [
    ("finetune.decode", ("--beam-size", "--max-tgt-len", "--min-tgt-len", "--max-src-len", "--length-penalty",
                         "--no-repeat-ngram", "--no-repeat-ignore", "--no-cache", "--batch-size", "--device",
                         "--n-best", "--dtype", "--force")),
    ("finetune.predict", ("--glue-task", "--max-seq-len", "--batch-size", "--device", "--force")),
    ("finetune.task_files", ("--samples", "--out", "--dev-fraction", "--test-fraction")),
])
def test_every_finetune_entry_point_lists_its_settings_in_help(module: str, flags: tuple[str, ...]) -> None:
    shown = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, env=subprocess_env(),
                           capture_output=True, text=True, check=True).stdout
    assert all(flag in shown for flag in flags), [flag for flag in flags if flag not in shown]
