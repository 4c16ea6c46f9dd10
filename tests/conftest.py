"""Shared fixtures: the real sample corpora fetched by `make sample-corpus` (see data_prep/samples.py)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import settings

from tools.torch_extensions import default_extensions_dir

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = Path(os.environ.get("UNILM_SAMPLES", ROOT / "data" / "samples"))
TEST_SEED = int(os.environ.get("TEST_SEED", "20261206"))
"""Where every test's random draws start (Python's, numpy's and torch's global generators, hypothesis's examples);
``TEST_SEED=N make test`` replays another seed. The session header reports it."""

settings.register_profile("seeded", settings(derandomize=True))
settings.load_profile("seeded")


def pytest_report_header(config: pytest.Config) -> str:
    return f"random seed: TEST_SEED={TEST_SEED} (each test starts Python's, numpy's and torch's generators from it)"


@pytest.fixture(autouse=True)
def seeded_generators() -> None:
    """Each test starts its global generators from `TEST_SEED`, whatever ran before it: its draws are replayable."""
    import random

    import numpy as np
    import torch

    random.seed(TEST_SEED)
    np.random.seed(TEST_SEED % 2**32)
    torch.manual_seed(TEST_SEED)

# Set by a launcher, or by an in-process 1-rank DeepSpeed run of an earlier test (pretrain.trainer.init_distributed):
# a child process that inherited them would think a launcher started it and reuse a port this process holds.
DISTRIBUTED_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                         "CROSS_RANK", "CROSS_SIZE")


def subprocess_env(**extra: str) -> dict[str, str]:
    """The environment for a test's child process: ours without distributed launch variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in DISTRIBUTED_VARIABLES}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    env.update(extra)
    return env


_NODE_LOCAL_RANK = r"""
import os, runpy, sys
from pathlib import Path
work, rank = Path(sys.argv[1]), os.environ["RANK"]
os.chdir(work / f"node{rank}")  # relative paths name this rank's own files, as a node-local disk would
sys.argv = [sys.argv[2], *sys.argv[3:]]
try:
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
except SystemExit as stop:
    (work / f"exit_{rank}").write_text(str(stop.code))
    raise
"""


def launch_node_local(work: Path, module: str, args: list[str]) -> tuple[subprocess.CompletedProcess, list[str]]:
    """``python -m module args`` on two gloo ranks under torchrun, rank r in ``work/node{r}`` (made here if missing:
    put a rank's files there first), so a relative path names a file on "its node's disk". Returns the process and
    each rank's exit code ("" where the rank did not exit by itself: the launcher killed it)."""
    for rank in (0, 1):
        (work / f"node{rank}").mkdir(exist_ok=True)
    (work / "node_local_rank.py").write_text(_NODE_LOCAL_RANK)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(work / "node_local_rank.py"), str(work), module, *args],
                          env=subprocess_env(PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=300)
    return done, [(work / f"exit_{rank}").read_text() if (work / f"exit_{rank}").exists() else "" for rank in (0, 1)]


# The CPU suite runs on DeepSpeed's CPU accelerator even on a GPU machine (bit-exact gloo runs, 2 ranks on any
# machine). GPU tests (`-m gpu`) start their runs in child processes with GPU_ENV: in this process the accelerator
# is chosen once, on the first `get_accelerator()`.
os.environ.setdefault("DS_ACCELERATOR", "cpu")
default_extensions_dir()


def _share_the_cores_among_workers() -> None:
    """Under `make test`'s pytest-xdist workers, each worker's torch takes its share of the cores. Left at torch's
    default (every core per process) two workers oversubscribe the machine, and OpenMP's waiting threads spin:
    a test of large tensor ops ran 80 times slower beside another worker (36 s instead of 0.44 s)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


_share_the_cores_among_workers()
GPU_ENV = {"DS_ACCELERATOR": "cuda"}
"""Extra environment of a GPU test's child process (DeepSpeed's CUDA accelerator, NCCL)."""


LONGEST_MODULES = ("tools/test_ablation.py", "pretrain/test_train.py", "pretrain/test_survival.py",
                   "pretrain/test_engine.py", "pretrain/test_recovery.py")
"""The modules that took longest in `make test`'s --durations (docs/testing.md), handed out before the other slow
ones. Only the order depends on it: a stale list makes the suite slower, never wrong."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Modules holding `slow` tests run first; `@pytest.mark.gpu` tests are skipped, saying why, where torch sees
    no CUDA device.

    The order is for `make test`'s workers, which take one module at a time in this order: the long multi-process
    modules start first and the many short ones fill in after them, so no worker is left with a long module at the
    end while the other idles. Within a module the order is unchanged."""
    slow_modules = {item.path for item in items if item.get_closest_marker("slow")}
    longest = {ROOT / "tests" / name: rank for rank, name in enumerate(LONGEST_MODULES)}

    def order(item: pytest.Item) -> tuple[int, bool]:
        return longest.get(item.path, len(longest)), item.path not in slow_modules

    items.sort(key=order)  # a stable sort: modules and their tests keep their order
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    import torch
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run with -m gpu on a GPU machine)")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def plain_functional_linear():
    """Gives each test the `torch.nn.functional.linear` it started with. A ZeRO-3 DeepSpeed engine swaps in its own
    (`zero3_linear_wrap`) for the rest of the process; an in-process ZeRO-3 run of an earlier test would otherwise
    leave it to later ones (torch 2.11's compiler then gets gradients wrong through it: off by up to 1e-2)."""
    import torch.nn.functional as F

    linear = F.linear
    yield
    F.linear = linear


@pytest.fixture
def one_rank_group(tmp_path: Path):
    """An in-process 1-rank gloo process group, as `python -m pretrain.train` makes (unless one exists already)."""
    import torch.distributed as torch_dist

    created = not torch_dist.is_initialized()
    if created:
        torch_dist.init_process_group("gloo", store=torch_dist.FileStore(str(tmp_path / "store"), 1), rank=0,
                                      world_size=1)
    yield
    if created:
        ds_comm = sys.modules.get("deepspeed.comm")
        if ds_comm is not None and ds_comm.is_initialized():  # also drops the groups DeepSpeed cached from it
            ds_comm.destroy_process_group()
        else:
            torch_dist.destroy_process_group()


@pytest.fixture(scope="session")
def samples_dir() -> Path:
    """Folder of real corpora; `make test` fetches it first (`make sample-corpus`)."""
    if not (SAMPLES / "wiki").is_dir():
        pytest.fail(f"sample corpora missing in {SAMPLES}: run `make sample-corpus` (make test does it for you)")
    return SAMPLES


@pytest.fixture(scope="session")
def minilm_dir(samples_dir: Path) -> Path:
    """A real 6-layer HF BERT (all-MiniLM-L6-v2): config.json, model.safetensors, uncased vocab.txt."""
    return samples_dir / "minilm"


@pytest.fixture(scope="session")
def task_files(samples_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`finetune.task_files` output of the real samples (BBC topic/headline, Rotten Tomatoes, SQuAD)."""
    from finetune.task_files import convert_samples

    out = tmp_path_factory.mktemp("task_files")
    convert_samples(samples_dir, out)
    return out


@pytest.fixture(scope="session")
def tiny_init(task_files: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Hugging Face BERT directory: tiny random model + an uncased 1,500-piece vocab trained on BBC text."""
    import json

    import torch
    from tokenizers import BertWordPieceTokenizer

    from finetune.task_files import read_jsonl
    from pretrain.hf import save_hf_bert
    from pretrain.model import ModelConfig, build_model

    out = tmp_path_factory.mktemp("tiny_init")
    texts = [r["src"] for r in read_jsonl(task_files / "bbc_headline.train.jsonl")[::10]]
    wordpiece = BertWordPieceTokenizer(lowercase=True)
    wordpiece.train_from_iterator(texts, vocab_size=1500, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
    wordpiece.save_model(str(out))
    torch.manual_seed(0)
    model = build_model(ModelConfig(vocab_size=wordpiece.get_vocab_size(), hidden_size=32, num_layers=2,
                                    num_heads=4, intermediate_size=64, max_position_embeddings=256))
    save_hf_bert(model, out)
    (out / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": True}))
    return out


# --- data_prep fixtures: a small real corpus, a cased WordPiece vocab trained on it, shards per recipe ---

@pytest.fixture(scope="session")
def small_corpus(samples_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """JSONL of real text: the first 40 Wikipedia excerpt articles (wikitext stripped) + 4 Shakespeare excerpts."""
    import itertools
    import json

    from data_prep.sources import read_documents

    wiki = itertools.islice((d for d in read_documents(str(samples_dir / "wiki/enwiki-excerpt.xml.bz2"))
                             if isinstance(d, str)), 40)
    books = itertools.islice((d[:60_000] for d in read_documents(str(samples_dir / "books.jsonl"))
                              if isinstance(d, str)), 4)
    path = tmp_path_factory.mktemp("corpus") / "small.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for text in itertools.chain(wiki, books):
            f.write(json.dumps({"text": text}) + "\n")
    return path


@pytest.fixture(scope="session")
def vocab_file(small_corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cased 4,000-entry WordPiece vocab.txt trained on ``small_corpus``
    ([PAD]=0 [UNK]=1 [CLS]=2 [SEP]=3 [MASK]=4)."""
    from data_prep.build import training_documents
    from data_prep.vocab import train_vocab

    path = tmp_path_factory.mktemp("vocab") / "vocab.txt"
    train_vocab(lambda: training_documents([str(small_corpus)]), 4000, path, uncased=False)
    return path


def _build_shards(recipe: str, corpus: Path, vocab: Path, out: Path) -> Path:
    from data_prep.build import build
    from data_prep.config import BuildConfig
    from data_prep.instances import InstanceConfig
    from data_prep.vocab import load_vocab

    cfg = BuildConfig(inputs=(str(corpus),), vocab_path=str(vocab), vocab_sha256=load_vocab(vocab).sha256,
                      instances=InstanceConfig(recipe=recipe, max_seq_len=64), seed=1,
                      samples_per_shard=2500, chunk_chars=200_000)
    build(cfg, out, progress=False)
    return out


@pytest.fixture(scope="session")
def unilm_shards(small_corpus: Path, vocab_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Shard dir (``data_prep.shard_format.ShardDataset``), recipe unilm, max_seq_len 64, several balanced shards."""
    return _build_shards("unilm", small_corpus, vocab_file, tmp_path_factory.mktemp("unilm_shards"))


@pytest.fixture(scope="session")
def bert_shards(small_corpus: Path, vocab_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Shard dir, recipe bert (bidirectional + NSP), max_seq_len 64."""
    return _build_shards("bert", small_corpus, vocab_file, tmp_path_factory.mktemp("bert_shards"))


@pytest.fixture(scope="session")
def gpt_shards(small_corpus: Path, vocab_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Shard dir, recipe gpt (contiguous left-to-right, no masked positions), max_seq_len 64."""
    return _build_shards("gpt", small_corpus, vocab_file, tmp_path_factory.mktemp("gpt_shards"))
