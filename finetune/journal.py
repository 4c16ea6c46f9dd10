"""The resumable journal of a decode: the predictions of the batches decoded so far, kept beside the output
until it is written, so a stopped decode continues after them."""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.files import write_text_atomically


@dataclass
class Decoded:
    """Decoded records `start`, `start` + 1, ... in input order: a batch, or everything decoded so far."""

    start: int = 0
    """Index of the first record (0-based, in the input)."""
    predictions: list[str] = field(default_factory=list)
    """The best hypothesis's text per record."""
    n_best: list[list[dict[str, Any]]] = field(default_factory=list)
    """Per record, its hypotheses best first as `{"text", "score"}` (score: log-probability / length penalty);
    empty unless more than one was asked for."""
    truncated: int = 0
    """Sources among them cut to the source budget."""

    def extend(self, later: Decoded) -> None:
        """Append `later`, the records that follow these."""
        if later.start != self.start + len(self.predictions):
            raise ValueError(f"records from {later.start} do not follow {self.start} + {len(self.predictions)}")
        self.predictions += later.predictions
        self.n_best += later.n_best
        self.truncated += later.truncated

    def line(self) -> str:
        """One JSON line of the journal."""
        entry = {"start": self.start, "predictions": self.predictions, "truncated": self.truncated}
        return json.dumps(dict(entry, n_best=self.n_best) if self.n_best else entry, ensure_ascii=False) + "\n"

    @classmethod
    def of_line(cls, line: str) -> Decoded:
        """The batch a journal line holds (ValueError, KeyError or TypeError where it is not one)."""
        entry = json.loads(line)
        decoded = cls(entry["start"], entry["predictions"], entry.get("n_best", []), entry["truncated"])
        if not (isinstance(decoded.start, int) and isinstance(decoded.predictions, list)
                and isinstance(decoded.truncated, int) and isinstance(decoded.n_best, list)):
            raise TypeError("not a journal entry")
        return decoded


class PredictionJournal:
    """The predictions of the batches decoded so far, appended to a file beside the output as each batch ends
    (flushed and fsync'ed), so that a decode stopped by Ctrl-C, SIGTERM, a crash or a lost machine continues where
    it stopped when the same command runs again. The file's first line is the `fingerprint` of what decides the
    predictions (the model's files, the sources, the decoding settings and batch size); a file of another
    fingerprint is started afresh. The output's writer removes the file once the output is in place.

    One process writes it: under several ranks rank 0, which appends each round's batches in input order once
    they are gathered (`finetune.generation.decode_records`). Its batches are the same whatever the number of
    ranks, so a decode stopped under N ranks continues under any other number."""

    def __init__(self, path: Path, fingerprint: str) -> None:
        self.path, self.fingerprint = path, fingerprint
        self.decoded = Decoded()

    @property
    def predictions(self) -> list[str]:
        return self.decoded.predictions

    @staticmethod
    def fingerprint_of(model_files: dict[str, str], records: list[dict], settings: dict[str, Any]) -> str:
        sources = hashlib.sha256(json.dumps([r.get("src") for r in records], ensure_ascii=False).encode()).hexdigest()
        return hashlib.sha256(json.dumps({"model": model_files, "sources": sources, "settings": settings},
                                         sort_keys=True, default=sorted).encode()).hexdigest()

    def open(self) -> str | None:
        """Read what an earlier run of the same fingerprint left (a torn last line, from a kill mid-write, is
        dropped) and rewrite the file to that; returns what happened, in words, when there was a file. A file that
        is no decode's journal is refused (ValueError), not replaced."""
        found = None
        if self.path.is_file():
            try:
                lines = self.path.read_text(encoding="utf-8").splitlines()
                header = json.loads(lines[0]) if lines else None
            except (UnicodeDecodeError, json.JSONDecodeError):
                header = None
            if not isinstance(header, dict) or "fingerprint" not in header:
                raise ValueError(f"{self.path} exists and is not the predictions an earlier decode kept there; "
                                 "move it, or choose another --output")
            if header["fingerprint"] == self.fingerprint:
                for line in lines[1:]:
                    try:
                        self.decoded.extend(Decoded.of_line(line))
                    except (ValueError, KeyError, TypeError):  # torn, or not the batch that follows
                        break
                found = f"continuing after the {len(self.predictions)} predictions {self.path} holds"
            else:
                found = (f"{self.path} holds predictions of another model, input or settings; starting afresh "
                         "(it is replaced)")
        kept = self.decoded.line() if self.predictions else ""  # one entry for it all
        write_text_atomically(self.path, json.dumps({"fingerprint": self.fingerprint}) + "\n" + kept)
        return found

    def add(self, batch: Decoded) -> None:
        """Record `batch`, the records that follow those kept, durably (flushed and fsync'ed)."""
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(batch.line())
            handle.flush()
            os.fsync(handle.fileno())
        self.decoded.extend(batch)

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)
