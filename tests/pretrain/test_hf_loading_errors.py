"""Model directories that cannot load say why in one message naming the file, the field and the fix: unreadable
weight files (cut short, git-lfs pointers, training checkpoints), tensors that do not fit the config, and — in
pre-training — the one-line `[stop]` with exit code 2 that every other setup problem gets."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pretrain.hf import hf_model_config, load_hf_bert, save_hf_bert
from pretrain.model import ModelConfig, build_model
from training_runs import launch

LFS_POINTER = (b"version https://git-lfs.github.com/spec/v1\n"
               b"oid sha256:4d7a214614ab2935c943f9e0ff69d22eadbb8f32b1258daaa5e2ca24d17e2393\nsize 1344997306\n")


def tiny_hf_dir(out: Path, **sizes: int) -> Path:
    """A HF BERT directory of a tiny random model (config.json + model.safetensors)."""
    torch.manual_seed(0)
    cfg = dict(vocab_size=100, hidden_size=48, num_layers=2, num_heads=4, intermediate_size=96,
               max_position_embeddings=80)
    save_hf_bert(build_model(ModelConfig(**{**cfg, **sizes})), out, quiet=True)
    return out


def with_config(directory: Path, **changes: object) -> dict:
    """Change keys of the directory's config.json; returns the config as it was."""
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **changes}))
    return config


def as_pytorch_model_bin(directory: Path, content: object) -> None:
    (directory / "model.safetensors").unlink()
    torch.save(content, directory / "pytorch_model.bin")


# Each kind of unreadable weight file: what its message must say besides the file's name.
UNREADABLE = {"truncated safetensors": "incomplete metadata", "lfs safetensors": "git-lfs pointer",
              "lfs bin": "git-lfs pointer", "truncated bin": "failed finding central directory",
              "deepspeed states": "it pickles argparse.Namespace"}


def unreadable_weight_file(directory: Path, case: str) -> Path:
    """A HF directory whose weight file is one of `UNREADABLE`; returns that file."""
    tiny_hf_dir(directory)
    safetensors = directory / "model.safetensors"
    # copies: the loaded tensors map the file, which may be cut short next
    state = {name: tensor.clone() for name, tensor in load_file(safetensors).items()}
    if case == "truncated safetensors":
        safetensors.write_bytes(safetensors.read_bytes()[:20_000])  # "incomplete metadata, file not fully covered"
    elif case == "lfs safetensors":
        safetensors.write_bytes(LFS_POINTER)  # safetensors alone says "header too large"
    elif case == "lfs bin":
        as_pytorch_model_bin(directory, state)
        (directory / "pytorch_model.bin").write_bytes(LFS_POINTER)
    elif case == "truncated bin":
        as_pytorch_model_bin(directory, state)
        data = (directory / "pytorch_model.bin").read_bytes()
        (directory / "pytorch_model.bin").write_bytes(data[:len(data) // 2])
    else:  # what DeepSpeed's mp_rank_00_model_states.pt holds beside the weights: the run's arguments, optimizer state
        as_pytorch_model_bin(directory, {"module": state, "args": argparse.Namespace(lr=1e-4), "optimizer": None,
                                         "global_steps": 10})
    return next(path for path in directory.iterdir() if path.name != "config.json")


@pytest.mark.parametrize("case", UNREADABLE)
def test_an_unreadable_weight_file_is_named_with_its_likely_cause(tmp_path, case):
    path = unreadable_weight_file(tmp_path / "model", case)
    with pytest.raises(ValueError) as error:
        load_hf_bert(path.parent)
    message = str(error.value)
    assert message.startswith(str(path)) and UNREADABLE[case] in message, message
    assert "weights_only" not in message  # torch's advice to unpickle whatever the file holds is not passed on
    assert ("git lfs pull" if "lfs" in case else "cut short (download it again) or a training checkpoint") in message


def test_a_training_checkpoint_as_pytorch_model_bin_is_named_so(tmp_path):
    directory = tiny_hf_dir(tmp_path / "trained")
    state = load_file(directory / "model.safetensors")
    as_pytorch_model_bin(directory, {"model": state, "optimizer": {"state": {}}, "step": 3})
    with pytest.raises(ValueError, match=rf"^{directory / 'pytorch_model.bin'} is a training checkpoint, not model "
                                         r"weights: its weights are nested under 'model' beside \['model', "
                                         r"'optimizer', 'step'\]; save that entry alone"):
        load_hf_bert(directory)


def test_a_deeper_checkpoint_names_its_layer_count(tmp_path):
    directory = tiny_hf_dir(tmp_path / "two_layers")
    with_config(directory, num_hidden_layers=1)
    with pytest.raises(ValueError, match=r"it has 2 layers \(0-1\), the config builds 1 \(num_hidden_layers\)"):
        load_hf_bert(directory)


def test_a_tensor_of_another_size_names_the_config_key(tmp_path):
    directory = tiny_hf_dir(tmp_path / "positions")  # 80 positions
    config = with_config(directory, max_position_embeddings=128)
    with pytest.raises(ValueError, match=r"position_embeddings.weight has shape \(80, 48\), our "
                                         r"embeddings.position.weight needs \(128, 48\) \(max_position_embeddings="
                                         r"128 \(config.json\), the weights have 80: make it 80\)$"):
        load_hf_bert(directory)
    source = hf_model_config(directory)  # a setting in place of config.json's, as model.overrides gives one
    (directory / "config.json").write_text(json.dumps(config))
    longer = load_hf_bert(directory, source)  # more positions than config.json's: the learned rows repeat
    assert longer.embeddings.position.weight.shape == (128, 48)


def test_a_head_count_that_does_not_divide_the_width_names_num_attention_heads(tmp_path):
    directory = tiny_hf_dir(tmp_path / "heads")
    with_config(directory, num_attention_heads=5)
    with pytest.raises(ValueError, match=r"config.json: hidden_size=48 is not divisible by num_attention_heads=5"):
        hf_model_config(directory)


@pytest.mark.slow  # launches pretrain.train
def test_a_bad_model_init_from_stops_pretraining_in_one_line_with_exit_code_2(unilm_shards, tmp_path):
    directory = tiny_hf_dir(tmp_path / "init", vocab_size=4000, num_layers=1)  # 80 positions, config says 128
    with_config(directory, max_position_embeddings=128)
    process = launch([f"data.shards={unilm_shards}", f"out_dir={tmp_path / 'run'}", "model.preset=null",
                      f"model.init_from={directory}", "model.check_init_vocab=false"])
    assert process.returncode == 2, process.stderr[-3000:]
    assert "Traceback" not in process.stderr
    (stop,) = [line for line in process.stderr.splitlines() if line.startswith("[stop]")]
    assert stop.startswith(f"[stop] model.init_from: {directory}: bert.embeddings.position_embeddings.weight has "
                           "shape (80, 48)") and "max_position_embeddings=128" in stop, stop
