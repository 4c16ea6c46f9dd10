"""Pre-training application: the checks a run passes before its first step, each naming the file or key to fix.

Every rank sees one shared out_dir, the shards match their hashes, the shards fit the model (recipe, vocabulary,
lengths, ``model.init_from``'s vocabulary and casing), and the fast paths resolve for this run (``train.compile``
with its compile probe, ``train.chunked_loss``, ``train.pack_samples``). Preflight runs `model_for_shards` too.
"""
from __future__ import annotations

import logging
import socket
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from data_prep.shard_format import ShardDataset, ShardError
from pretrain.accelerator import COMPILER_NEEDS, accelerator_name, compiler_failure, default_device
from pretrain.config import RunConfig, resolve_model_config
from pretrain.distributed import SetupError, first_error, gather_objects
from pretrain.engine import zero_stage
from pretrain.model import ModelConfig
from pretrain.warm_start import checkpoint_marker, is_checkpoint
from pretrain.weight_files import model_directory

log = logging.getLogger(__name__)


def check_trainable(dataset: Any, model_cfg: ModelConfig, where: str) -> None:
    """Refuse a shard recipe this model cannot learn from, before step 1: a masked-LM model needs masked
    positions (GPT-recipe shards have none), a causal LM predicts every next token and would learn to predict
    the [MASK] tokens of masked-LM shards."""
    recipe = dataset.manifest.get("recipe")
    if recipe == "gpt" and not model_cfg.causal_lm:
        raise ValueError(f"{where}: GPT-recipe shards (no masked positions) cannot train a masked-LM model "
                         "(nothing to predict); use model.preset=gpt or set model.overrides.causal_lm=true, or "
                         "build unilm/bert shards")
    if recipe in ("unilm", "bert") and model_cfg.causal_lm:
        raise ValueError(f"{where}: {recipe}-recipe shards hold [MASK]ed inputs for a masked-LM model, but the "
                         "model is a causal LM (model.causal_lm); build GPT-recipe shards or use a masked-LM preset")



def check_shared_out_dir(out_dir: Path, rank: int, world_size: int) -> None:
    """Every rank must see ``out_dir`` as rank 0 does (a collective): rank 0 writes a file of a fresh name there and
    each rank reads it back. A node-local out_dir (the same path on each node's own disk) would leave each node's
    checkpoint files where the others cannot read them: its saves look complete to rank 0 and cannot be resumed."""
    if world_size == 1:
        return
    written: Any = None
    if rank == 0:
        token = uuid.uuid4().hex
        try:
            (out_dir / f".shared-check-{token}").write_text(token)
            written = (token, socket.gethostname())
        except OSError as error:
            written = OSError(f"rank 0 cannot write under out_dir {out_dir}: {error}")
    written = gather_objects(written)[0]  # after rank 0's write
    if isinstance(written, Exception):
        raise written
    token, writer = written
    path = out_dir / f".shared-check-{token}"  # this rank's out_dir: the same path, on its node
    try:
        seen = path.read_text()
    except OSError:
        seen = None
    problem = None
    if seen != token:
        problem = (f"rank {rank} on {socket.gethostname()} does not see {path}, which rank 0 on {writer} wrote: "
                   f"out_dir {out_dir} must be one shared directory, at the same path, on every node (each rank "
                   "writes its part of every checkpoint there)")
    problem = first_error(problem)
    if rank == 0:
        path.unlink(missing_ok=True)
    if problem is not None:
        raise OSError(problem)


def verify_shards(cfg: RunConfig, dataset: ShardDataset, rank: int, world_size: int) -> None:
    """With ``data.verify`` the ranks check the shards' hashes, each every world-size-th shard (a collective: a bad
    shard found by any rank stops every rank, naming it)."""
    if cfg.data.verify:
        verify_started = time.monotonic()
        problem = None
        try:
            dataset.verify(rank, world_size)
        except ShardError as error:
            problem = str(error)
        problem = first_error(problem)
        if problem is not None:
            raise ShardError(problem)
        if rank == 0:
            log.info(f"[data] verified {len(dataset.manifest['shards'])} shard(s) against the manifest hashes in "
                     f"{time.monotonic() - verify_started:.1f}s ({world_size} rank(s) sharing them)")


def model_for_shards(cfg: RunConfig, dataset: ShardDataset, rank: int = 0) -> ModelConfig:
    """The model config this run trains, once the shards fit it: a recipe the model can train, a vocabulary its
    embeddings hold, and (from ``model.init_from``) that model's vocabulary and casing. Preflight runs it too."""
    model_cfg = resolve_model_config(cfg)
    check_trainable(dataset, model_cfg, cfg.data.shards)
    if cfg.model.init_from and cfg.model.check_init_vocab and is_checkpoint(cfg.model.init_from):
        check_checkpoint_vocabulary(dataset, cfg.model.init_from)
    elif cfg.model.init_from and cfg.model.check_init_vocab:  # shards of another vocabulary: rebuild them
        check_init_vocabulary(dataset, str(model_directory(cfg.model.init_from)),  # a weights file: beside it
                              report=log.warning if rank == 0 else lambda _: None)
    check_vocabulary_fits(dataset, model_cfg, cfg.model.init_from)
    check_lengths_fit(dataset, model_cfg, cfg.data.max_seq_len, "data.shards")
    if cfg.data.eval_shards:
        held_out = ShardDataset(cfg.data.eval_shards)
        check_trainable(held_out, model_cfg, cfg.data.eval_shards)
        check_lengths_fit(held_out, model_cfg, cfg.data.max_seq_len, "data.eval_shards")
        if held_out.manifest["vocab"]["sha256"] != dataset.manifest["vocab"]["sha256"]:
            raise ValueError(f"data.eval_shards {cfg.data.eval_shards} were built with another vocabulary than "
                             f"data.shards {cfg.data.shards}: their ids name other word pieces, so the held-out loss "
                             "would measure nothing; build both with the same --vocab")
    return model_cfg


def check_lengths_fit(dataset: ShardDataset, model_cfg: ModelConfig, max_seq_len: int | None, key: str) -> None:
    """The longest sample the shards hold must fit ``data.max_seq_len`` and the model's position table."""
    positions = model_cfg.max_position_embeddings
    if max_seq_len is not None and max_seq_len > positions:
        raise ValueError(f"data.max_seq_len={max_seq_len} exceeds the model's {positions} positions "
                         f"(max_position_embeddings); lower it, or raise model.overrides.max_position_embeddings")
    limit = max_seq_len or positions
    longest = int(dataset.manifest["max_seq_len"])
    if longest > limit:
        setting = f"data.max_seq_len={max_seq_len}" if max_seq_len else f"the model's {positions} positions"
        raise ValueError(f"{key} {dataset.directory} hold samples of up to {longest} tokens (built with --max-seq-len "
                         f"{longest}), more than {setting}; rebuild them with --max-seq-len {limit}, or raise "
                         f"{'data.max_seq_len' if max_seq_len else 'model.overrides.max_position_embeddings'}")


def check_vocabulary_fits(dataset: ShardDataset, model_cfg: ModelConfig, init_from: str | None = None) -> None:
    """The model's embeddings must hold a row for every id of the shards' vocabulary. A run from ``init_from``
    cannot grow its vocabulary (the weights fix its size): the fix is shards built with that model's."""
    size = dataset.manifest["vocab"].get("size")
    if size is None or int(size) <= model_cfg.vocab_size:
        return
    if init_from:
        raise ValueError(f"the shards' vocabulary ({dataset.directory}) has {size} tokens but model.vocab_size is "
                         f"{model_cfg.vocab_size}, and a run from model.init_from {init_from} keeps that model's "
                         f"vocabulary (its weights fix the size); rebuild the shards with "
                         f"`python -m data_prep.build --vocab {init_from}`")
    raise ValueError(f"the shards' vocabulary has {size} tokens but model.vocab_size is "
                     f"{model_cfg.vocab_size}; set model.overrides.vocab_size={size}")


def check_checkpoint_vocabulary(dataset: ShardDataset, init_from: str) -> None:
    """The shards of a run that starts from a checkpoint of this pipeline must be tokenized with the vocabulary it
    was trained on (the vocab hash its marker records)."""
    tag_dir, meta = checkpoint_marker(init_from)
    theirs, ours = meta.get("vocab_hash"), dataset.manifest["vocab"].get("sha256")
    if theirs is not None and ours is not None and theirs != ours:
        raise ValueError(f"{dataset.directory} was built with another vocabulary (sha256 {ours[:12]}…) than "
                         f"model.init_from {tag_dir} was trained on ({theirs[:12]}…): its ids would name other word "
                         "pieces; build the shards with that run's --vocab, or set model.check_init_vocab=false")


def check_init_vocabulary(dataset: ShardDataset, init_from: str,
                          report: Callable[[str], None] = log.warning) -> None:
    """The shards of a run that starts from ``model.init_from`` must be tokenized with that model's vocabulary
    and casing: its embedding row i belongs to the word piece on line i of its vocab.txt, so shards built with
    another vocabulary (or the same one with the other casing) would train its weights on scrambled ids. A shard
    vocabulary that extends the model's (its ids first, new pieces after) passes."""
    from data_prep.vocab import VocabError, load_vocab, resolve_casing, resolve_vocab_source

    fix = (f"rebuild the shards with `python -m data_prep.build --vocab {init_from}` (its casing comes with it), "
           "or set model.check_init_vocab=false to train its weights on these ids anyway")
    try:
        source = resolve_vocab_source(init_from)
        theirs = source.load()
        uncased = resolve_casing(source, None)
    except VocabError as error:
        report(f"[init] warning: cannot check that the shards use model.init_from's vocabulary ({error})")
        return
    ours = load_vocab(Path(dataset.directory) / dataset.manifest["vocab"].get("file", "vocab.txt"))
    differing = [i for i, token in enumerate(theirs.tokens) if i >= ours.size or ours.tokens[i] != token]
    if differing:
        first = differing[0]
        shard_token = ours.tokens[first] if first < ours.size else "(none)"
        raise ValueError(f"{dataset.directory} was built with another vocabulary than model.init_from {init_from}: "
                         f"{len(differing)} of model.init_from's {theirs.size} ids name other word pieces (id {first}: "
                         f"{shard_token!r} in the shards, {theirs.tokens[first]!r} in {theirs.path}); {fix}")
    shard_uncased = dataset.manifest["vocab"].get("uncased")
    if isinstance(shard_uncased, bool) and shard_uncased != uncased:
        raise ValueError(f"{dataset.directory} was tokenized {'uncased' if shard_uncased else 'cased'}, but "
                         f"model.init_from {init_from} is {'uncased' if uncased else 'cased'}; {fix}")



def fast_path_settings(cfg: RunConfig, engine_json: dict[str, Any], model_cfg: ModelConfig) -> dict[str, bool]:
    """``train.compile``, ``train.chunked_loss`` and ``train.pack_samples`` with their null defaults resolved for this
    run: compile on CUDA under ZeRO 0-2, chunked loss under bf16/fp16, packing unless the model is a causal LM.
    Refuses compiling under ZeRO-3 (its parameter hooks run inside the blocks) and packing a causal LM."""
    stage = zero_stage(engine_json)
    half = any(engine_json.get(key, {}).get("enabled", False) for key in ("fp16", "bf16", "bfloat16"))
    compile_blocks = cfg.train.compile
    if compile_blocks is None:
        compile_blocks = accelerator_name() == "cuda" and stage < 3
    elif compile_blocks and stage == 3:
        raise ValueError("train.compile=true does not work with ZeRO-3 (DeepSpeed gathers each block's parameters "
                         "inside its forward); use ZeRO 0-2 or train.compile=false")
    chunked_loss = half if cfg.train.chunked_loss is None else cfg.train.chunked_loss
    pack_samples = not model_cfg.causal_lm if cfg.train.pack_samples is None else cfg.train.pack_samples
    if pack_samples and model_cfg.causal_lm:
        raise ValueError("train.pack_samples=true does not apply to a causal LM (model.causal_lm: its samples are "
                         "full-length blocks, each predicted whole); use train.pack_samples=false or null")
    return {"compile": compile_blocks, "chunked_loss": chunked_loss, "pack_samples": pack_samples}


def compiler_works(setting: bool | None, rank: int) -> bool:
    """Whether to compile the blocks, ``train.compile`` having resolved to on: `compiler_failure` on every rank's
    device (a collective: every rank decides alike). A failure stops the run, naming the fix, when the run config
    asked for compilation (``true``), and turns it off with a note when that was the default (``null``)."""
    failure = compiler_failure(default_device())
    if failure is not None and rank != 0:
        failure += f" (rank {rank} on {socket.gethostname()})"
    failure = first_error(failure)
    if failure is None:
        return True
    if setting:
        raise SetupError(f"train.compile=true, but torch.compile fails here: {failure}. {COMPILER_NEEDS}; or set "
                         "train.compile=false")
    if rank == 0:
        log.warning(f"[fast paths] torch.compile fails here ({failure}), so the blocks run uncompiled (slower). "
                    f"{COMPILER_NEEDS}; train.compile=false silences this")
    return False
