"""Model weight files read safely: which files of a Hugging Face directory hold its tensors, and reading them.

`model.safetensors` is read with safetensors and `pytorch_model.bin` (or any `.bin` state dict) with
`torch.load(weights_only=True)`, so nothing but tensors and containers is unpickled; a checkpoint saved in shards is
read through its `*.index.json`. A file that holds no weights (cut short, a git-lfs pointer, a training checkpoint)
is refused with a message naming it and what it most likely is.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

# Weight files of a HF model directory, in from_pretrained's order of preference; an index file lists the shards of
# a checkpoint saved in parts (`save_pretrained(max_shard_size=...)`).
_WEIGHT_FILES = (("model.safetensors", False), ("model.safetensors.index.json", True),
                 ("pytorch_model.bin", False), ("pytorch_model.bin.index.json", True))


WEIGHT_FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
"""What a weights file given by name may be: safetensors, or a `torch.save`d state dict (UniLM v1's released
`unilm1-large-cased.bin`, whose config is the BERT config beside it)."""


def model_directory(path: str | Path) -> Path:
    """The directory whose config and vocabulary serve a model named by ``path``: the directory itself, or the one
    that holds a weights file given by name."""
    path = Path(path)
    return path.parent if path.is_file() else path


def hf_weight_files(directory: str | Path) -> tuple[list[Path], set[str] | None]:
    """The files that hold a HF directory's tensors — one file, or the shards an index lists — and, for an index,
    the tensor names it lists; or a weights file given by name (`WEIGHT_FILE_SUFFIXES`). Checks that they exist;
    reads no tensor."""
    directory = Path(directory)
    if directory.is_file():
        if directory.suffix not in WEIGHT_FILE_SUFFIXES:
            raise ValueError(f"{directory}: not a weights file (a {' or '.join(WEIGHT_FILE_SUFFIXES)} state dict); "
                             "give a model directory, or the weights file inside it")
        return [directory], None
    for name, is_index in _WEIGHT_FILES:
        path = directory / name
        if not path.is_file():
            continue
        if not is_index:
            return [path], None
        try:
            weight_map = json.loads(path.read_text())["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{path}: not a checkpoint index (a JSON object with a 'weight_map' of tensor name → "
                             f"file): {e}") from None
        missing = [shard for shard in shards if not (directory / shard).is_file()]
        if missing:
            raise FileNotFoundError(f"{path} lists shard files that are not in {directory}: {missing}")
        return [directory / shard for shard in shards], set(weight_map)
    tensorflow = sorted(p.name for p in directory.glob("*.ckpt*.index"))
    raise FileNotFoundError(f"{directory}: no weights (looked for {', '.join(n for n, _ in _WEIGHT_FILES)})"
                            + (f"; {tensorflow[0]} is a TensorFlow checkpoint, which this loader does not read: "
                               "Google's BERT releases are on the Hugging Face hub as PyTorch weights "
                               "(google-bert/bert-large-cased, ...)" if tensorflow else ""))


# The first bytes of a git-lfs pointer.
_LFS_POINTER = b"version https://git-lfs.github.com/spec/"
# Where training checkpoints (PyTorch Lightning, fairseq, DeepSpeed's mp_rank_*_model_states.pt) keep the weights,
# beside optimizer state and step counters.
_CHECKPOINT_KEYS = ("model", "state_dict", "module")


def git_lfs_pointer(path: Path) -> bool:
    """Whether ``path`` is a git-lfs pointer: the few lines a clone without git-lfs holds in place of a large file."""
    with open(path, "rb") as handle:
        return handle.read(len(_LFS_POINTER)) == _LFS_POINTER


def read_weight_file(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of one weight file: safetensors, or a `pytorch_model.bin` read by `torch.load(weights_only=True)`
    (tensors and containers only; nothing else is unpickled). A file that holds no such dict is refused with a
    ValueError naming it and what it most likely is: cut short, a git-lfs pointer, a training checkpoint."""
    if git_lfs_pointer(path):
        raise ValueError(f"{path} is a git-lfs pointer, not the weights: run `git lfs pull` in the repository it "
                         "was cloned from, or download the file itself")
    try:
        state = load_file(path) if path.suffix == ".safetensors" else \
            torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # whatever the file's bytes make the readers raise (pickle's UnpicklingError, ...)
        # torch's own text advises weights_only=False, which would run any code the file holds: never passed on
        pickled = re.findall(r"Unsupported global: GLOBAL ([\w.]+)", str(error))
        reason = (f"it pickles {pickled[0]}, which model weights do not hold" if pickled else
                  "not a PyTorch tensor file" if type(error).__name__ == "UnpicklingError" else
                  str(error).split(". ")[0] or type(error).__name__)
        raise ValueError(f"{path} ({path.stat().st_size:,} bytes) cannot be read as model weights ({reason}); "
                         "most likely it is a download cut short (download it again) or a training checkpoint "
                         "rather than model weights (export the weights: `python -m pretrain.export` for this "
                         "project's checkpoints)") from None
    if not isinstance(state, dict):
        raise ValueError(f"{path} holds a {type(state).__name__}, not model weights (a dict of tensor name → tensor)")
    not_tensors = sorted(str(name) for name, value in state.items() if not isinstance(value, torch.Tensor))
    if not_tensors:
        nested = next((key for key in _CHECKPOINT_KEYS if isinstance(state.get(key), dict)), None)
        if nested is not None:
            raise ValueError(f"{path} is a training checkpoint, not model weights: its weights are nested under "
                             f"{nested!r} beside {sorted(map(str, state))[:8]}; save that entry alone as the weights "
                             "file, or export the weights (`python -m pretrain.export` for this project's "
                             "checkpoints)")
        raise ValueError(f"{path}: not model weights: {not_tensors[:5]} hold no tensor")
    return state


def read_state_dict(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a HF model directory (`hf_weight_files`), checked against its index when it has one, or of a
    weights file given by name."""
    files, listed = hf_weight_files(directory)
    state: dict[str, torch.Tensor] = {}
    for path in files:
        state.update(read_weight_file(path))
    absent = sorted((listed or set()) - set(state))
    if absent:
        raise ValueError(f"{directory}: tensors its index lists are in none of its shards: {absent[:5]}"
                         + (f" and {len(absent) - 5} more" if len(absent) > 5 else ""))
    return state


def stored_shape(path: str | Path, name_suffix: str) -> tuple[int, ...] | None:
    """The shape of the first tensor whose name ends with ``name_suffix`` in a model's weights (a directory or a
    weights file), or None: read from safetensors' header, or from a `pytorch_model.bin` mapped into memory (a file
    in torch's pre-1.6 format, which cannot be mapped, is read whole)."""
    try:
        files = hf_weight_files(path)[0]
    except (OSError, ValueError):  # no weights to look at: the read that loads them names the problem
        return None
    for file in files:
        if file.suffix == ".safetensors":
            try:
                with safe_open(file, framework="pt") as handle:
                    name = next((key for key in handle.keys() if key.endswith(name_suffix)), None)
                    if name is not None:
                        return tuple(handle.get_slice(name).get_shape())
            except Exception:  # not weights at all: the read that loads them names the problem
                return None
            continue
        try:
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # the legacy (not zip) format, which torch cannot map
            state = read_weight_file(file)
        except Exception:  # not weights at all: the read that loads them names the problem
            return None
        if isinstance(state, dict):
            name = next((key for key in state if isinstance(key, str) and key.endswith(name_suffix)), None)
            if name is not None and isinstance(state[name], torch.Tensor):
                return tuple(state[name].shape)
    return None
