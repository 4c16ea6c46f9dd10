"""Converting a checkpoint to DeepSpeed's universal checkpoint, so a run resumes on another world size or ZeRO
stage (DeepSpeed's own converter, ``deepspeed.checkpoint.ds_to_universal``)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from common.files import fsync_tree, write_text_atomically
from pretrain.checkpoint import MARKER


def to_universal(checkpoint_dir: Path, tag: str, save_id: str | None = None) -> str:
    """Convert ``tag`` to a DeepSpeed universal checkpoint and return the universal tag. A conversion is reused
    while its marker names the save it came from (``save_id``, the tag's marker's): a later save of the same tag
    (a new run in the same directory) is converted afresh.

    Runs DeepSpeed's own converter: ``python -m deepspeed.checkpoint.ds_to_universal --inject_missing_state``.
    """
    universal = f"{tag}_universal"
    target = checkpoint_dir / universal
    if (target / MARKER).is_file():
        try:
            converted_from = json.loads((target / MARKER).read_text()).get("source_save_id")
        except (OSError, ValueError, AttributeError):
            converted_from = None
        if save_id is not None and converted_from == save_id:
            return universal
    shutil.rmtree(target, ignore_errors=True)
    # the other ranks wait in a collective meanwhile (DeepSpeed's timeout: DEEPSPEED_TIMEOUT minutes, default 10),
    # so the conversion uses the machine's cores: one process per rank file read, per parameter merged
    workers = str(max(1, min(8, os.cpu_count() or 1)))
    subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
                    "--input_folder", str(checkpoint_dir / tag), "--output_folder", str(target),
                    "--inject_missing_state", "--num_extract_workers", workers, "--num_merge_workers", workers],
                   check=True)
    fsync_tree(target)
    write_text_atomically(target / MARKER, json.dumps({"source": tag, "source_save_id": save_id}))
    return universal
