"""Hugging Face BERT checkpoints in and out: `load_hf_bert(path)` and `save_hf_bert(model, path)`.

Our parameter names map one-to-one onto HF BERT names (`_HF_NAMES`); the only tensor that changes shape is the
segment (token-type) embedding, because UniLM uses 6 segment types and BERT 2. Which rows travel depends on the
attention the model trains with:

    masked-LM model (bidirectional; exported as `BertForPreTraining`, `BertForMaskedLM` or `BertModel`)
      export (6 → 2)   rows 0 and 1 (bidirectional A/B) are written; rows 2..5 (left-to-right, right-to-left,
                       seq2seq source/target) are dropped with a warning — a HF BERT cannot represent them, so the
                       exported model behaves as ours on bidirectional inputs only.
      import (2 → 6)   HF type 0 ("first/only segment") → our rows 0, 2, 3, 4; HF type 1 ("second segment") →
                       rows 1 and 5 (`SEGMENT_ROWS_FROM_HF`).
    causal LM (`causal_lm`, the gpt preset; exported as `BertLMHeadModel` or `BertModel`, with `is_decoder: true`
    so that transformers applies the causal mask)
      export (6 → 2)   row 2 (left-to-right), the only row its tokens are embedded with, becomes HF types 0 and 1
                       (our causal LM ignores segments, so a tokenizer's pair behaves as ours too); rows 0, 1, 3..5,
                       which its training never updates (weight decay only shrinks them), are dropped with a warning,
                       and so are the pooler and NSP head (their loss weight is 0 for a causal LM) — `BertModel`
                       keeps its pooler, untrained.
      import (2 → 6)   an `is_decoder` config builds a `causal_lm` model; HF type 0 → every row
                       (`SEGMENT_ROWS_FROM_HF_DECODER`; the model reads row 2). A type 1 that differs from type 0
                       has no place in it and is dropped with a warning.
    UniLM format (`save_hf_bert(all_segments=True)`, `python -m pretrain.export --format unilm`): all 6 rows as
    token types 0..5 (`type_vocab_size: 6`), with s2s-ft's `source_type_id: 4` / `target_type_id: 5`
    (`UNILM_SEQ2SEQ_CONFIG`); `BertForMaskedLM` then runs a seq2seq input as ours given the 3-D seq2seq mask.
    The same tensors also go to `pytorch_model.bin` and the config to `bert_config.json`, which microsoft/unilm's
    own loaders (unilm-v1, s2s-ft) open.
    A checkpoint that already has 6 types loads as is, either kind; one with a single type (type_vocab_size 1)
    gives its row to all six.

Tensors are read safely: `model.safetensors` with safetensors, `pytorch_model.bin` with
`torch.load(weights_only=True)`, a checkpoint saved in shards through its `*.index.json`; a file that holds no
weights (cut short, a git-lfs pointer, a training checkpoint) is refused, naming it. Checkpoints with or
without the `bert.` prefix and with or without the MLM/NSP heads (and pooler) load; missing heads are freshly
initialised and a warning names them. The layout of the original releases loads as well: `bert_config.json` for
`config.json`, TF-era `gamma`/`beta` LayerNorm names, half-precision tensors, and microsoft/unilm's layouts
(`pretrain.unilm_layouts`): UniLM v1's released checkpoints (`unilm1-large-cased.bin`, given by name or as
`pytorch_model.bin`, beside BERT-large cased's config; LayerNorm eps 1e-5 as v1's code), whose 6 segment rows are
ours in the same order, with their relax_projection and new_pos_ids variants, and s2s-ft's UniLM (fast QKV) and
MiniLM directories.

A missing MLM head (sentence-embedding checkpoints such as MiniLM ship the encoder alone) starts with its
transform's dense layer at the identity (zero bias) rather than at random: the decoder is tied to the word
embeddings, and an encoder's last hidden state still carries its token in that embedding space (measured on the
samples' MiniLM: the identity-headed model reads back 57 % of its unmasked input tokens; a random transform, 0 %),
so word prediction starts from what the encoder already writes instead of a random 384×384 map it must first
undo. Fine-tuned for BBC headlines (200 steps of 16, lr 5e-4, seed 42), greedy dev ROUGE-L went 6.8 → 13.6 and
dev loss 6.87 → 6.15. LayerNorm (1, 0) and the zero decoder bias are BERT's initialisation either way.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

from pretrain.masks import (
    NUM_SEGMENT_TYPES,
    SEGMENT_BIDIRECTIONAL_A,
    SEGMENT_BIDIRECTIONAL_B,
    SEGMENT_LEFT_TO_RIGHT,
    SEGMENT_SEQ2SEQ_SOURCE,
    SEGMENT_SEQ2SEQ_TARGET,
)
from pretrain.model import IGNORE_INDEX, ModelConfig, UniLMModel, build_model
from pretrain.unilm_layouts import TASK_DEFAULT, to_bert_layout
from pretrain.weight_files import model_directory, read_state_dict, stored_shape

log = logging.getLogger(__name__)

# (our name prefix, HF BertForPreTraining name prefix); `{i}` is a layer index.
_HF_NAMES = (
    ("embeddings.token.", "bert.embeddings.word_embeddings."),
    ("embeddings.position.", "bert.embeddings.position_embeddings."),
    ("embeddings.segment.", "bert.embeddings.token_type_embeddings."),
    ("embeddings.norm.", "bert.embeddings.LayerNorm."),
    ("layers.{i}.attention.query.", "bert.encoder.layer.{i}.attention.self.query."),
    ("layers.{i}.attention.key.", "bert.encoder.layer.{i}.attention.self.key."),
    ("layers.{i}.attention.value.", "bert.encoder.layer.{i}.attention.self.value."),
    ("layers.{i}.attention.output.", "bert.encoder.layer.{i}.attention.output.dense."),
    ("layers.{i}.attention_norm.", "bert.encoder.layer.{i}.attention.output.LayerNorm."),
    ("layers.{i}.ffn_in.", "bert.encoder.layer.{i}.intermediate.dense."),
    ("layers.{i}.ffn_out.", "bert.encoder.layer.{i}.output.dense."),
    ("layers.{i}.ffn_norm.", "bert.encoder.layer.{i}.output.LayerNorm."),
    ("pooler.", "bert.pooler.dense."),
    ("mlm_head.dense.", "cls.predictions.transform.dense."),
    ("mlm_head.norm.", "cls.predictions.transform.LayerNorm."),
    ("mlm_head.decoder.bias", "cls.predictions.bias"),
    ("nsp_head.", "cls.seq_relationship."),
)
# HF keys that carry nothing of their own: buffers, and the decoder tied to the embeddings / bias.
_HF_REDUNDANT = ("bert.embeddings.position_ids", "bert.embeddings.token_type_ids",
                 "cls.predictions.decoder.weight", "cls.predictions.decoder.bias")
# Our tensors that a HF BERT checkpoint may lack (BertModel has no heads, BertForMaskedLM no pooler/NSP).
_OPTIONAL_PREFIXES = ("pooler.", "mlm_head.", "nsp_head.")
# The task heads of HF's fine-tuned BERT classes (sequence / token classification, multiple choice; question
# answering): a fine-tuned BERT's encoder loads, its head is left out with a warning, as from_pretrained does.
_HF_TASK_HEADS = ("classifier.", "qa_outputs.")
# HF token type of each of our segment rows, on import (see the module docstring): a bidirectional BERT's type 0 →
# our rows 0, 2, 3, 4 and type 1 → rows 1, 5; a decoder's (is_decoder) type 0 → every row.
SEGMENT_ROWS_FROM_HF = (0, 1, 0, 0, 0, 1)
SEGMENT_ROWS_FROM_HF_DECODER = (0,) * NUM_SEGMENT_TYPES
# Our rows written as HF types 0 and 1, on export: a masked-LM model's bidirectional A/B, a causal LM's left-to-right
# row twice.
SEGMENT_ROWS_TO_HF = (SEGMENT_BIDIRECTIONAL_A, SEGMENT_BIDIRECTIONAL_B)
SEGMENT_ROWS_TO_HF_DECODER = (SEGMENT_LEFT_TO_RIGHT, SEGMENT_LEFT_TO_RIGHT)
# Our modules a causal LM never trains (the NSP loss weight is 0 for every non-bidirectional sample): its HF classes
# have no place for them, and an import does not report them missing.
_UNTRAINED_BY_CAUSAL_LM = ("pooler.", "nsp_head.")


def _rename(name: str, table: tuple[tuple[str, str], ...]) -> str | None:
    for source, target in table:
        pattern = "^" + re.escape(source).replace(r"\{i\}", r"(\d+)")
        match = re.match(pattern, name)
        if match:
            renamed = target.replace("{i}", match.group(1)) if match.groups() else target
            return renamed + name[match.end():]
    return None


def to_hf_name(name: str) -> str | None:
    """Our parameter name → HF BertForPreTraining name (None for the tied decoder weight)."""
    return _rename(name, _HF_NAMES)


def from_hf_name(name: str) -> str | None:
    """HF BertForPreTraining name (with `bert.` prefix) → our parameter name (None if unknown)."""
    return _rename(name, tuple((hf, ours) for ours, hf in _HF_NAMES))


# transformers' names of the exact (erf) gelu, the one our blocks compute
_EXACT_GELU = ("gelu", "gelu_python")


# config.json model types of a BERT: transformers' own, and s2s-ft's UniLM and MiniLM (`UnilmConfig`, `MinilmConfig`:
# BERT's keys, and BERT's tensors once `pretrain.unilm_layouts` has brought them to its layout)
BERT_MODEL_TYPES = ("bert", "unilm", "minilm")

# config.json keys with no default: the tensors' shapes
_REQUIRED_CONFIG_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")


def config_from_hf(config: dict) -> ModelConfig:
    """Our ModelConfig from a HF BERT `config.json` dict (`is_decoder: true` → `causal_lm`); refuses what our model
    cannot express."""
    if config.get("model_type", "bert") not in BERT_MODEL_TYPES:
        raise ValueError(f"not a BERT config: model_type={config.get('model_type')!r} (one of "
                         f"{', '.join(BERT_MODEL_TYPES)} loads)")
    missing = [key for key in _REQUIRED_CONFIG_KEYS if not isinstance(config.get(key), int)]
    if missing:
        raise ValueError(f"not a BERT config: no integer {', '.join(missing)} (a BERT config.json has "
                         f"{', '.join(_REQUIRED_CONFIG_KEYS)}; keys {sorted(config)[:8]} are another model's?)")
    if config["num_attention_heads"] <= 0 or config["hidden_size"] % config["num_attention_heads"]:
        raise ValueError(f"hidden_size={config['hidden_size']} is not divisible by num_attention_heads="
                         f"{config['num_attention_heads']} (each head takes hidden_size / num_attention_heads "
                         "dimensions): num_attention_heads is wrong for these weights")
    if config.get("hidden_act", "gelu") not in _EXACT_GELU:
        raise ValueError(f"only the exact (erf) gelu is supported (hidden_act {' or '.join(map(repr, _EXACT_GELU))}), "
                         f"config has hidden_act={config['hidden_act']!r}; tanh approximations such as 'gelu_new' "
                         "and other activations would change what the weights compute")
    if config.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError("only absolute position embeddings are supported, config has "
                         f"position_embedding_type={config['position_embedding_type']!r}")
    if config.get("type_vocab_size", 2) not in (1, 2, NUM_SEGMENT_TYPES):
        raise ValueError(f"type_vocab_size={config['type_vocab_size']} cannot be mapped to "
                         f"{NUM_SEGMENT_TYPES} segment types (1, 2 or {NUM_SEGMENT_TYPES} can)")
    if config.get("add_cross_attention"):
        raise ValueError("add_cross_attention=true (the decoder of an encoder-decoder): its cross-attention layers "
                         "have no place in our model")
    return ModelConfig(
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        num_layers=config["num_hidden_layers"],
        num_heads=config["num_attention_heads"],
        intermediate_size=config["intermediate_size"],
        max_position_embeddings=config.get("max_position_embeddings", 512),
        hidden_dropout=config.get("hidden_dropout_prob", 0.1),
        attention_dropout=config.get("attention_probs_dropout_prob", 0.1),
        layer_norm_eps=config.get("layer_norm_eps", 1e-12),
        initializer_range=config.get("initializer_range", 0.02),
        causal_lm=bool(config.get("is_decoder", False)),  # transformers' switch for the causal mask
    )


# A model directory's config file: Hugging Face's name, then the original BERT release's (`bert_config.json`, beside
# `pytorch_model.bin` in the archives pytorch-pretrained-bert and UniLM v1's fine-tuning code read).
CONFIG_FILES = ("config.json", "bert_config.json")


def hf_config_file(path: str | Path) -> Path | None:
    """The config file of a BERT model directory (`CONFIG_FILES`, first found), or of the directory that holds a
    weights file given by name; or None."""
    directory = model_directory(path)
    return next((directory / name for name in CONFIG_FILES if (directory / name).is_file()), None)


def read_hf_config(path: str | Path) -> tuple[Path, dict]:
    """(config file, its JSON object) of a model directory or a weights file given by name; refuses a missing or
    malformed one, naming it."""
    config_file = hf_config_file(path)
    if config_file is None:
        if Path(path).is_file():
            raise FileNotFoundError(f"{path}: a weights file without a config.json (or bert_config.json) beside it: "
                                    "put the config of the model it holds there (UniLM v1's released "
                                    "unilm1-large-cased.bin: BERT-large cased's config.json, as v1's --bert_model "
                                    "bert-large-cased gives it)")
        raise FileNotFoundError(f"{path}: no config.json — expected a Hugging Face BERT directory "
                                "(config.json + model.safetensors or pytorch_model.bin)")
    try:
        config = json.loads(config_file.read_text())
    except ValueError as e:
        raise ValueError(f"{config_file}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{config_file}: not a JSON object")
    return config_file, config


def hf_model_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of a HF BERT directory (or of a weights file given by name), from its `config.json` (or
    `bert_config.json`). No tensor is read, except the segment table's shape when the config does not itself say
    six token types and an eps: six stored rows under BERT's config are UniLM v1's released layout (its `.bin`
    beside the BERT config it was trained from), whose code normalises with eps 1e-5 whatever that config says."""
    config_file, config = read_hf_config(path)
    try:
        model_cfg = config_from_hf(config)
    except ValueError as e:
        raise ValueError(f"{config_file}: {e}") from None
    if config.get("type_vocab_size", 2) != NUM_SEGMENT_TYPES or "layer_norm_eps" not in config:
        rows = stored_shape(path, "embeddings.token_type_embeddings.weight")
        if rows and rows[0] == NUM_SEGMENT_TYPES:
            log.info(f"{path}: six segment rows under {config_file.name} (type_vocab_size "
                     f"{config.get('type_vocab_size', 2)}, layer_norm_eps {config.get('layer_norm_eps', 'unset')}): "
                     f"UniLM v1's released layout, loaded with its LayerNorm eps {UNILM_V1_LAYER_NORM_EPS}")
            model_cfg = dataclasses.replace(model_cfg, layer_norm_eps=UNILM_V1_LAYER_NORM_EPS)
    return model_cfg


UNILM_V1_LAYER_NORM_EPS = 1e-5
"""The LayerNorm epsilon of UniLM v1's code (`BertLayerNorm(..., eps=1e-5)` throughout its `modeling.py`)."""


# The config.json keys (our ModelConfig's fields of the same name) that set a tensor's dimensions.
_SIZE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "max_position_embeddings")


def _size_hint(stored: torch.Size, needed: torch.Size, cfg: ModelConfig, source: ModelConfig, config_name: str) -> str:
    """The config key that sets a dimension a checkpoint's tensor differs in (when one alone has that size), where
    its value came from, and the size the weights need."""
    hints = []
    for have, need in zip(stored, needed):
        keys = [key for key in _SIZE_KEYS if getattr(cfg, key) == need]
        if have == need or len(keys) != 1:
            continue
        origin = config_name if getattr(source, keys[0]) == need else f"set in place of {config_name}'s " \
            f"{getattr(source, keys[0])}"
        hints.append(f"{keys[0]}={need} ({origin}), the weights have {have}: make it {have}")
    return f" ({'; '.join(hints)})" if hints else ""


def load_hf_bert(path: str | Path, cfg: ModelConfig | None = None,
                 supplement: dict[str, torch.Tensor] | None = None, task: int = TASK_DEFAULT) -> UniLMModel:
    """Our model with the weights of a HF BERT directory (config.json + model.safetensors | pytorch_model.bin,
    or either split into shards by an index file; or the original release's bert_config.json + pytorch_model.bin).

    ``cfg`` (default: the directory's own, `hf_model_config`) builds the model instead, for settings that leave
    the tensors' shapes alone, such as other dropout rates, or a longer ``max_position_embeddings``, whose rows past
    the checkpoint's repeat its learned ones (`extend_position_table`); another shape it changes is an error naming
    the tensor, and
    a `causal_lm` other than the directory's (`is_decoder`) is named in a warning.

    Accepts BertModel, BertForMaskedLM, BertForPreTraining and BertLMHeadModel checkpoints, with or without the
    `bert.` prefix and with TF-era `gamma`/`beta` LayerNorm names; of a fine-tuned BERT
    (BertForSequenceClassification …) the encoder, its task head left out with a warning. Segment types 2 → 6 as
    in the module docstring. Tensors our model has but the checkpoint lacks (pooler, MLM head, NSP head) keep
    their fresh init, with a warning (not for the pooler and NSP head of a causal LM, which never trains them),
    except a missing MLM transform, which starts at the identity (module docstring); anything else missing,
    unknown or of the wrong shape is an error.
    ``supplement`` (our names) adds or replaces tensors: what a fine-tuning output keeps beside its HF file (all
    six segment rows, the heads its HF task class has no place for); its own task head then goes unremarked.
    microsoft/unilm's layouts load too (`pretrain.unilm_layouts`): UniLM v1's `.bin` given by name beside its BERT
    config, its relax_projection and new_pos_ids variants (block ``task`` of each per-task tensor), s2s-ft's UniLM
    and MiniLM directories.
    """
    directory = Path(path)
    source = hf_model_config(directory)
    stored = to_bert_layout(read_state_dict(directory), read_hf_config(directory)[1], task, str(directory))
    return load_hf_state(directory, stored, source, cfg or source, supplement)


def load_hf_state(directory: Path, stored: dict[str, torch.Tensor], source: ModelConfig, cfg: ModelConfig,
                  supplement: dict[str, torch.Tensor] | None = None) -> UniLMModel:
    """`load_hf_bert` of tensors already read (HF names, as ``stored``), ``source`` being the config they were saved
    under and ``cfg`` the one to build; ``directory`` names them in messages."""
    if cfg.causal_lm != source.causal_lm:
        log.warning(f"{directory} holds a {'causal LM (is_decoder)' if source.causal_lm else 'masked-LM BERT'}, "
                    f"loaded here as a {'causal LM' if cfg.causal_lm else 'masked-LM model'} (causal_lm="
                    f"{str(cfg.causal_lm).lower()}): its weights were trained under the other attention mask; "
                    "train them before use")
    model = build_model(cfg)
    ours = model.state_dict()
    loaded, decoder, decoder_bias, task_head = _map_hf_names(directory, stored, ours, cfg, source)
    if task_head and supplement is None:
        log.warning(f"{directory}: left out its fine-tuned task head {sorted(task_head)}; the encoder loads")
    loaded.update(supplement or {})
    _take_decoder(directory, loaded, decoder, decoder_bias, supplement)
    identity_transform = _check_missing(directory, ours, loaded, cfg)
    model.load_state_dict(loaded, strict=False)
    if identity_transform:
        with torch.no_grad():
            model.mlm_head.dense.weight.copy_(torch.eye(cfg.hidden_size))
            model.mlm_head.dense.bias.zero_()
    return model


def _map_hf_names(directory: Path, stored: dict[str, torch.Tensor], ours: dict[str, torch.Tensor], cfg: ModelConfig,
                  source: ModelConfig) -> tuple[dict[str, torch.Tensor], torch.Tensor | None, torch.Tensor | None,
                                                list[str]]:
    """Map a checkpoint's tensors onto our names: (ours by name, the HF decoder weight and bias if stored, the task
    head's names left out). Segment rows 1 or 2 → 6 (module docstring); an unknown tensor or one of the wrong
    shape is an error naming it."""
    loaded: dict[str, torch.Tensor] = {}
    unknown, task_head = [], []
    decoder = decoder_bias = None
    for stored_name, tensor in stored.items():
        if stored_name.startswith(_HF_TASK_HEADS):
            task_head.append(stored_name)
            continue
        hf_name = _canonical_hf_name(stored_name)
        if hf_name in _HF_REDUNDANT:
            decoder = tensor if hf_name == "cls.predictions.decoder.weight" else decoder
            decoder_bias = tensor if hf_name == "cls.predictions.decoder.bias" else decoder_bias
            continue
        name = from_hf_name(hf_name)
        if name is None or name not in ours:  # another model's tensor, or a layer beyond cfg's
            unknown.append(stored_name)
            continue
        if name == "embeddings.segment.weight":
            tensor = _six_segment_rows(directory, tensor, source)
        if name == "embeddings.position.weight" and \
                tensor.shape[0] == source.max_position_embeddings < cfg.max_position_embeddings:
            tensor = extend_position_table(tensor, cfg.max_position_embeddings)
        if tensor.shape != ours[name].shape:
            raise ValueError(f"{directory}: {hf_name} has shape {tuple(tensor.shape)}, our {name} needs "
                             f"{tuple(ours[name].shape)}"
                             + _size_hint(tensor.shape, ours[name].shape, cfg, source,
                                          getattr(hf_config_file(directory), "name", "config.json")))
        loaded[name] = tensor
    if unknown:
        layers = {int(m.group(1)) for n in unknown if (m := re.search(r"encoder\.layer\.(\d+)\.", n))}
        hint = (f" (it has {max(layers) + 1} layers (0-{max(layers)}), the config builds {cfg.num_layers} "
                "(num_hidden_layers): a model with fewer layers cannot take a deeper checkpoint's weights)"
                if layers and max(layers) >= cfg.num_layers else "")
        raise ValueError(f"{directory}: tensors our model has no place for{hint}: {unknown[:5]}"
                         + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""))
    return loaded, decoder, decoder_bias, task_head


def _canonical_hf_name(stored_name: str) -> str:
    """A stored tensor name as transformers' BertForPreTraining names it: TF-era LayerNorm gamma/beta → weight/bias,
    the `bert.` prefix a BertModel checkpoint omits."""
    hf_name = re.sub(r"LayerNorm\.gamma$", "LayerNorm.weight", stored_name)
    hf_name = re.sub(r"LayerNorm\.beta$", "LayerNorm.bias", hf_name)
    return hf_name if hf_name.startswith(("bert.", "cls.")) else "bert." + hf_name


def extend_position_table(table: torch.Tensor, rows: int) -> torch.Tensor:
    """A learned position table Float[P, H] extended to Float[rows, H] by microsoft/unilm's rule for CNN/DailyMail
    (unilm-v1 `modeling.py`, `from_pretrained`: copies of the first rows in chunks of P, so row P + i = row i for
    i < P, row 2P + i = row i, ...); rows 0..P-1 stay exactly as they were."""
    repeats = -(-rows // table.shape[0])
    return table.repeat(repeats, 1)[:rows].clone()


def with_positions(model: UniLMModel, rows: int) -> UniLMModel:
    """``model`` with ``rows`` positions: itself when it has them, else a copy whose position table's rows past its
    own repeat the learned ones (`extend_position_table`), every other tensor the same; fewer rows are refused."""
    have = model.cfg.max_position_embeddings
    if rows == have:
        return model
    if rows < have:
        raise ValueError(f"{rows} is fewer than the model's {have} positions: its position table is extended, never "
                         "cut (leave it unset, or set at least that many)")
    state = model.state_dict()
    state["embeddings.position.weight"] = extend_position_table(state["embeddings.position.weight"], rows)
    longer = build_model(dataclasses.replace(model.cfg, max_position_embeddings=rows))
    longer.load_state_dict(state)
    return longer.train(model.training)


def _six_segment_rows(directory: Path, tensor: torch.Tensor, source: ModelConfig) -> torch.Tensor:
    """A checkpoint's token-type embedding Float[T, H] as our Float[6, H] segment table (module docstring); a table
    of another size is returned as is, for the shape check to name."""
    if tensor.shape[0] == 1:  # one token type: every segment reads it
        return tensor.expand(NUM_SEGMENT_TYPES, -1).clone()
    if tensor.shape[0] == 2:
        if source.causal_lm and not torch.equal(tensor[0], tensor[1]):
            log.warning(f"{directory}: a causal LM reads one segment row; its HF token type 0 fills them "
                        "all and its different token type 1 is dropped")
        return tensor[list(SEGMENT_ROWS_FROM_HF_DECODER if source.causal_lm else SEGMENT_ROWS_FROM_HF)]
    return tensor


def _take_decoder(directory: Path, loaded: dict[str, torch.Tensor], decoder: torch.Tensor | None,
                  decoder_bias: torch.Tensor | None, supplement: dict[str, torch.Tensor] | None) -> None:
    """Use a stored HF decoder's bias, and warn when its weight is not tied to the word embeddings (ours is)."""
    if decoder_bias is not None and not (supplement and "mlm_head.decoder.bias" in supplement):
        # the bias the HF decoder adds: the same tensor as cls.predictions.bias in a tied model, the one the forward
        # uses in an untied one (transformers 5 keeps cls.predictions.bias apart there, untrained)
        loaded["mlm_head.decoder.bias"] = decoder_bias
    if decoder is not None and not torch.equal(decoder, loaded.get("embeddings.token.weight", decoder)):
        log.warning(f"{directory}: its MLM decoder weights differ from its word embeddings (an untied "
                    "checkpoint, tie_word_embeddings false); our decoder is tied to the word embeddings, so its "
                    "encoder loads exactly but its word predictions are not the checkpoint's: train the MLM head "
                    "before using them (a classifier or span extractor on the encoder is unaffected)")


def _check_missing(directory: Path, ours: dict[str, torch.Tensor], loaded: dict[str, torch.Tensor],
                   cfg: ModelConfig) -> bool:
    """Refuse a checkpoint that lacks an encoder tensor; name the heads that keep their fresh init in a warning.
    Returns whether the MLM transform is missing (it then starts at the identity, module docstring)."""
    tied = "mlm_head.decoder.weight"
    missing = sorted(n for n in ours if n not in loaded and n != tied)
    not_optional = [n for n in missing if not n.startswith(_OPTIONAL_PREFIXES)]
    if not_optional:
        raise ValueError(f"{directory}: checkpoint lacks {not_optional}")
    identity_transform = {"mlm_head.dense.weight", "mlm_head.dense.bias"} <= set(missing)
    reported = [n for n in missing if not (cfg.causal_lm and n.startswith(_UNTRAINED_BY_CAUSAL_LM))]
    if reported:
        log.warning(f"{directory}: no weights for {sorted({n.split('.')[0] for n in reported})} "
                    f"({len(reported)} tensors) — freshly initialised"
                    + (" (the MLM transform at the identity)" if identity_transform else "")
                    + ", train them before use")
    return identity_transform


# What each HF class holds besides the encoder: from_pretrained reports anything else as unexpected.
HF_ARCHITECTURES = {
    "BertForPreTraining": ("bert.", "cls."),
    "BertForMaskedLM": ("bert.embeddings.", "bert.encoder.", "cls.predictions."),
    "BertLMHeadModel": ("bert.embeddings.", "bert.encoder.", "cls.predictions."),
    "BertModel": ("bert.embeddings.", "bert.encoder.", "bert.pooler."),
}
HF_TASK_ARCHITECTURES = {
    "BertForSequenceClassification": ("bert.",),  # + classifier.*: pooled [CLS] -> dropout -> linear
    "BertForMultipleChoice": ("bert.",),  # + classifier.*: one score per choice from its pooled [CLS]
    "BertForQuestionAnswering": ("bert.embeddings.", "bert.encoder."),  # + qa_outputs.*: start/end per token
}
"""The fine-tuned heads of transformers' BERT task classes that a fine-tuning output is written as (with its task
head's tensors, `save_hf_bert(task_head=...)`): the backbone's tensors each class holds."""


def hf_architectures(cfg: ModelConfig) -> tuple[str, ...]:
    """The HF classes that express a model of this config, its default first: a masked-LM model's
    (`BertForPreTraining`, `BertForMaskedLM`, `BertModel`) or a causal LM's (`BertLMHeadModel`, `BertModel`)."""
    if cfg.causal_lm:
        return ("BertLMHeadModel", "BertModel")
    return ("BertForPreTraining", "BertForMaskedLM", "BertModel")


def check_architecture(cfg: ModelConfig, architecture: str) -> None:
    """Refuse, saying why and what to use instead, a HF class that cannot express a model of this config."""
    if architecture not in HF_ARCHITECTURES:
        raise ValueError(f"architecture must be one of {list(HF_ARCHITECTURES)}, got {architecture!r}")
    choices = hf_architectures(cfg)
    if architecture in choices:
        return
    if cfg.causal_lm:
        raise ValueError(f"{architecture} is a masked-LM class and cannot express this model, a causal LM "
                         "(causal_lm=true, the gpt preset) that predicts each next token from the tokens before it; "
                         f"export it as {' or '.join(choices)} (is_decoder: true: transformers applies the causal "
                         "mask)")
    raise ValueError(f"{architecture} is a left-to-right decoder (is_decoder: true, a next-token head), and this "
                     "model is a masked LM (causal_lm=false) that predicts [MASK]ed tokens; export it as "
                     f"{', '.join(choices)}")


def hf_config(cfg: ModelConfig, architecture: str | None = None) -> dict:
    """The HF `config.json` of a BERT equivalent to our config (2 segment types; `is_decoder` for a causal LM);
    `architecture` defaults to the config's first `hf_architectures`."""
    return {
        "architectures": [architecture or hf_architectures(cfg)[0]],
        "model_type": "bert",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "intermediate_size": cfg.intermediate_size,
        "hidden_act": "gelu",
        "hidden_dropout_prob": cfg.hidden_dropout,
        "attention_probs_dropout_prob": cfg.attention_dropout,
        "max_position_embeddings": cfg.max_position_embeddings,
        "type_vocab_size": 2,
        "initializer_range": cfg.initializer_range,
        "layer_norm_eps": cfg.layer_norm_eps,
        "position_embedding_type": "absolute",
        "is_decoder": cfg.causal_lm,
        "tie_word_embeddings": True,
    }


# The fields microsoft/unilm's s2s-ft reads beside BERT's (s2s-ft/s2s_ft/config.py, BertForSeq2SeqConfig and its
# from_exist_config: the token types of source and target), with our seq2seq segment ids (`pretrain.masks`).
UNILM_SEQ2SEQ_CONFIG = {"type_vocab_size": NUM_SEGMENT_TYPES, "source_type_id": SEGMENT_SEQ2SEQ_SOURCE,
                        "target_type_id": SEGMENT_SEQ2SEQ_TARGET}


def save_hf_bert(model: UniLMModel, path: str | Path, architecture: str | None = None,
                 state: dict[str, torch.Tensor] | None = None, task_head: dict[str, torch.Tensor] | None = None,
                 task_config: dict | None = None, quiet: bool = False, all_segments: bool = False) -> Path:
    """Write `config.json` + `model.safetensors` for one HF class to `path`; returns it.

    `architecture` is the class that will load it with no missing and no unexpected weights, by default the
    model's own (`hf_architectures`). A masked-LM model: `BertForPreTraining` (everything: encoder, pooler, MLM
    and NSP heads), `BertForMaskedLM` (no pooler, no NSP head) or `BertModel` (no heads; `bert.` prefix dropped);
    a BertForPreTraining export also loads into the other two, which then list the heads they lack as unexpected
    (HF's usual report). A causal LM (`is_decoder: true`): `BertLMHeadModel` (encoder and next-token head) or
    `BertModel`. Another class is refused (`check_architecture`). Segment rows as in the module docstring, the
    dropped ones named in a warning. Copy a vocab.txt beside it yourself.
    `state` (our names) replaces `model.state_dict()` as the weights written: under DeepSpeed, the fp32 master
    copy that `pretrain.checkpoint.gather_full_weights` collects (the module itself holds bf16/fp16 copies, or
    ZeRO-3 partitions).
    A fine-tuned model of a masked-LM backbone may be written as one of `HF_TASK_ARCHITECTURES` instead: its
    backbone's tensors that class holds, plus `task_head` (HF names, e.g. `classifier.weight`) and `task_config`
    (`num_labels`, `id2label`, ...) in its config. `quiet`: no warning about the dropped segment rows (the caller
    keeps them). `all_segments`: the UniLM format, all 6 segment rows as token types 0..5 and
    `UNILM_SEQ2SEQ_CONFIG` in the config (module docstring), nothing dropped, and the same tensors and config also as
    microsoft/unilm's loaders read them (`write_unilm_loader_files`).
    """
    architecture = architecture or hf_architectures(model.cfg)[0]
    if architecture in HF_TASK_ARCHITECTURES:
        if model.cfg.causal_lm or task_head is None:
            raise ValueError(f"{architecture} needs a masked-LM backbone and its task head's tensors")
        kept = HF_TASK_ARCHITECTURES[architecture]
    else:
        check_architecture(model.cfg, architecture)
        kept = HF_ARCHITECTURES[architecture]
    segment_rows = SEGMENT_ROWS_TO_HF_DECODER if model.cfg.causal_lm else SEGMENT_ROWS_TO_HF
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, tensor in (model.state_dict() if state is None else state).items():
        hf_name = to_hf_name(name)
        # the decoder weight is the token embedding (HF re-ties it on load); heads the class lacks are left out
        if hf_name is None or not hf_name.startswith(kept):
            continue
        if name == "embeddings.segment.weight" and not all_segments:
            tensor = tensor[list(segment_rows)]
        if architecture == "BertModel":
            hf_name = hf_name.removeprefix("bert.")
        tensors[hf_name] = tensor.detach().cpu().contiguous()
    tensors.update({name: tensor.detach().cpu().contiguous() for name, tensor in (task_head or {}).items()})
    if quiet or all_segments:
        pass
    elif model.cfg.causal_lm:
        log.warning("causal LM: exported segment row 2 (left-to-right, the one it embeds every token with) as "
                       "HF token types 0 and 1; dropped rows 0, 1, 3-5, which its training never updates")
    else:
        log.warning("HF BERT has 2 token types: exported segment rows 0/1 (bidirectional A/B); dropped rows "
                       "2-5 (left-to-right, right-to-left, seq2seq source/target)")
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    config = dict(hf_config(model.cfg, architecture), **(UNILM_SEQ2SEQ_CONFIG if all_segments else {}),
                  **(task_config or {}))
    config_text = json.dumps(config, indent=2) + "\n"
    (directory / "config.json").write_text(config_text)
    if all_segments:
        write_unilm_loader_files(tensors, config_text, directory)
    return directory


def write_unilm_loader_files(tensors: dict[str, torch.Tensor], config_text: str, directory: Path) -> None:
    """What microsoft/unilm's own loaders open, beside `model.safetensors` and `config.json`: ``tensors`` (HF names)
    as a plain state dict in `pytorch_model.bin` (unilm-v1's and s2s-ft's ``from_pretrained`` `torch.load` it), and
    the config again as `bert_config.json`, the name v1's ``from_pretrained`` reads. The .bin is in torch's pre-1.6
    format: their READMEs run torch 1.1 (unilm-v1) and 1.2 (s2s-ft), which cannot read the zip format, and newer
    torch reads it too, with ``weights_only=True``."""
    torch.save(tensors, directory / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    (directory / "bert_config.json").write_text(config_text)


def hf_pretraining_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A bidirectional batch of ours (`pretrain.data.collate`'s keys, no padding) in
    ``transformers.BertForPreTraining``'s terms: dense labels, a key-padding mask, token types 0/1."""
    batch_size, seq_len = batch["input_ids"].shape
    labels = torch.full_like(batch["input_ids"], IGNORE_INDEX).scatter(1, batch["masked_positions"],
                                                                      batch["masked_labels"])
    token_type_ids = (torch.arange(seq_len) >= batch["len_a"].unsqueeze(1)).long()
    return dict(input_ids=batch["input_ids"], token_type_ids=token_type_ids,
                attention_mask=torch.ones(batch_size, seq_len, dtype=torch.long), labels=labels,
                next_sentence_label=batch["is_random_next"])
