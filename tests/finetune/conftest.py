"""Fine-tuning fixtures: small slices of the real sample data in the task formats, and a tiny model directory
(a WordPiece vocab trained on BBC text + a randomly initialised 2-layer model, exported as HF BERT)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tokenizers import BertWordPieceTokenizer

from finetune.task_files import convert_samples, read_jsonl, write_jsonl
from pretrain.hf import save_hf_bert
from pretrain.model import ModelConfig, build_model


@pytest.fixture(scope="session")
def task_files(samples_dir: Path, tmp_path_factory) -> Path:
    """`finetune.task_files` output of the real samples (BBC topic/headline, Rotten Tomatoes, SQuAD)."""
    out = tmp_path_factory.mktemp("task_files")
    convert_samples(samples_dir, out)
    return out


def spread(records: list[dict], count: int) -> list[dict]:
    """`count` records spread evenly over the file (the converters write records grouped by topic)."""
    return records[:: max(1, len(records) // count)][:count]


@pytest.fixture(scope="session")
def small_tasks(task_files: Path, tmp_path_factory) -> dict[str, Path]:
    """A few dozen examples per task file."""
    out = tmp_path_factory.mktemp("small_tasks")
    sizes = {"bbc_topic.train": 40, "bbc_topic.dev": 20, "bbc_headline.train": 24, "bbc_headline.dev": 8,
             "rotten.train": 32, "rotten.dev": 16}
    paths = {}
    for name, count in sizes.items():
        paths[name] = out / f"{name}.jsonl"
        write_jsonl(spread(read_jsonl(task_files / f"{name}.jsonl"), count), paths[name])
    paths["squad"] = task_files / "squad.json"
    return paths


@pytest.fixture(scope="session")
def tiny_init(task_files: Path, tmp_path_factory) -> Path:
    """A Hugging Face BERT directory: tiny random model + an uncased 1,500-piece vocab trained on BBC text."""
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


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny models gain nothing from a second thread, and on a shared 2-core machine OpenMP spin-waiting
    makes them many times slower; restored after each test so other packages' tests are unaffected."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
