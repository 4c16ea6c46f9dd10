"""Build settings through the one config path: ``--config YAML``, the flags (aliases of their keys) and ``--set``."""
from __future__ import annotations

import dataclasses
import typing

import pytest

from common.config_loader import field_docs
from data_prep import build
from data_prep.config import CONFIG_DIR, BuildSettings, load_settings
from shard_builds import build_error, run_build


def dotted_keys(cls: type, prefix: str = "") -> list[str]:
    hints = typing.get_type_hints(cls)
    keys = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            keys += dotted_keys(hints[f.name], f"{prefix}{f.name}.")
        else:
            keys.append(prefix + f.name)
    return keys


def directory_bytes(directory) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_a_yaml_with_overrides_builds_the_bytes_of_the_same_flags(samples_dir, vocab_file, tmp_path):
    config = tmp_path / "bert-64.yaml"
    config.write_text("instances:\n  recipe: bert\n  max_seq_len: 64\nmasking:\n  mask_prob: 0.1\nseed: 5\n"
                      "txt_documents: line\n")
    common = ["--input", samples_dir / "news/lee.txt", "--vocab", vocab_file]
    from_yaml = run_build(*common, "--config", config, "--set", "masking.mask_prob=0.2", "--set", "seed=3",
                          "--out", tmp_path / "yaml")
    run_build(*common, "--recipe", "bert", "--max-seq-len", 64, "--mask-prob", 0.2, "--seed", 3,
                           "--txt-documents", "line", "--out", tmp_path / "flags")
    assert from_yaml["masking"]["mask_prob"] == 0.2 and from_yaml["seed"] == 3 and from_yaml["recipe"] == "bert"
    assert directory_bytes(tmp_path / "yaml") == directory_bytes(tmp_path / "flags")


def test_flags_override_the_yaml_and_set_overrides_both(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("instances:\n  max_seq_len: 64\n  recipe: bert\nchunk_chars: 1000\n")
    args = build.parse_args(["--config", str(config), "--max-seq-len", "48"])
    settings = build.load_build_settings(args)
    assert settings.instances.max_seq_len == 48 and settings.instances.recipe == "bert"  # the rest of the section
    assert settings.chunk_chars == 1000 and settings.masking.max_predictions == round(0.15 * 48)
    args = build.parse_args(["--config", str(config), "--max-seq-len", "48", "--set", "instances.max_seq_len=32"])
    assert build.load_build_settings(args).instances.max_seq_len == 32
    args = build.parse_args(["--text-field", "yes", "--objective-mix", "bidirectional=0.5,seq2seq=0.5"])
    settings = build.load_build_settings(args)  # a flag's text stays text, whatever YAML would make of it
    assert settings.text_field == "yes" and settings.instances.objective_mix == {"bidirectional": 0.5, "seq2seq": 0.5}


def test_unknown_keys_are_refused_by_name(samples_dir, vocab_file, tmp_path):
    common = ["--input", samples_dir / "news/lee.txt", "--vocab", vocab_file, "--out", tmp_path / "o"]
    error = build_error(*common, "--set", "masking.mask_probability=0.2")
    assert "unknown config key(s): masking.mask_probability" in error
    config = tmp_path / "c.yaml"
    config.write_text("instances:\n  max_len: 64\n")
    error = build_error(*common, "--config", config)
    assert error.startswith(f"data_prep.build: error: {config}: unknown config key(s): instances.max_len")
    assert "no such config file" in build_error(*common, "--config", tmp_path / "absent.yaml")
    assert not (tmp_path / "o").exists()


def test_help_lists_every_key_and_every_key_has_a_docstring(capsys):
    with pytest.raises(SystemExit) as done:
        build.main(["--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    keys = dotted_keys(BuildSettings)
    assert "masking.max_predictions" in keys and "instances.max_seq_len" in keys and "txt_documents" in keys
    assert [key for key in keys if f"  {key} (" not in text] == []
    for cls in (BuildSettings, *{typing.get_type_hints(BuildSettings)[name] for name in ("instances", "masking")}):
        assert set(field_docs(cls)) == {f.name for f in dataclasses.fields(cls)}, cls.__name__


def test_the_example_config_is_the_default_build():
    assert load_settings(CONFIG_DIR / "unilm-128.yaml") == BuildSettings()
