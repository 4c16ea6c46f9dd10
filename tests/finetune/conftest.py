"""Fine-tuning fixtures: small slices of the real sample data in the task formats (from `task_files`; it and the
tiny model directory `tiny_init` are in tests/conftest.py, shared with the drivers' tests)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from finetune.task_files import read_jsonl, write_jsonl


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


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny models gain nothing from a second thread, and on a shared 2-core machine OpenMP spin-waiting
    makes them many times slower; restored after each test so other packages' tests are unaffected."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
