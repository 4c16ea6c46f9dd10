"""WordPiece vocabularies: validate a BERT ``vocab.txt``, build the ``tokenizers`` encoder, train a new vocab.

The encoder is HF ``tokenizers`` WordPiece with BERT's normaliser and pre-tokeniser. Cased by default (as
UniLM); ``uncased=True`` lowercases and strips accents (BERT-uncased). Special tokens are deliberately *not*
registered as added tokens, so a corpus that contains the literal text ``[SEP]`` or ``[MASK]`` is split into
ordinary word pieces and can never inject structure into a sample.
"""
from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

SPECIAL_TOKENS = {"pad": "[PAD]", "unk": "[UNK]", "cls": "[CLS]", "sep": "[SEP]", "mask": "[MASK]"}


class VocabError(ValueError):
    """A vocab file that cannot be used; the message names the file, the problem and the fix."""


@dataclass(frozen=True)
class Vocab:
    """A validated vocab file: its tokens, sha256 and special-token ids."""

    path: Path
    tokens: tuple[str, ...]
    sha256: str
    special_ids: dict[str, int]  # pad, unk, cls, sep, mask

    @property
    def size(self) -> int:
        return len(self.tokens)


def load_vocab(path: Path | str) -> Vocab:
    """Read and validate a BERT ``vocab.txt`` (one token per line, UTF-8, unique, with the five special tokens)."""
    path = Path(path)
    fix = "pass a BERT-style vocab.txt, or train one with --train-vocab SIZE --vocab-out PATH"
    if not path.is_file():
        raise VocabError(f"vocab {path}: file not found; {fix}")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw[: err.start].count(b"\n") + 1
        raise VocabError(f"vocab {path}: line {line} is not UTF-8; {fix}") from None
    tokens = text.split("\n")
    if tokens and tokens[-1] == "":
        tokens.pop()
    tokens = [t.rstrip("\r") for t in tokens]
    if not tokens:
        raise VocabError(f"vocab {path}: empty; {fix}")
    first_seen: dict[str, int] = {}
    for number, token in enumerate(tokens, 1):
        if not token.strip() or token != token.strip():
            raise VocabError(f"vocab {path}: line {number} is blank or has surrounding whitespace ({token!r}); {fix}")
        if token in first_seen:
            raise VocabError(f"vocab {path}: line {number} repeats {token!r} (first at line {first_seen[token]}); "
                             f"{fix}")
        first_seen[token] = number
    missing = [t for t in SPECIAL_TOKENS.values() if t not in first_seen]
    if missing:
        raise VocabError(f"vocab {path}: missing special token(s) {missing}; {fix}")
    special_ids = {name: first_seen[token] - 1 for name, token in SPECIAL_TOKENS.items()}
    return Vocab(path, tuple(tokens), hashlib.sha256(raw).hexdigest(), special_ids)


def _normalizer(uncased: bool) -> normalizers.Normalizer:
    return normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=uncased,
                                      lowercase=uncased)


@functools.lru_cache(maxsize=4)  # one encoder per (file, hash, casing) per process: building it costs ~20 ms
def load_encoder(path: str, sha256: str, uncased: bool) -> Tokenizer:
    """The WordPiece encoder for a validated vocab (``sha256`` keys the cache so an edited file reloads)."""
    vocab = {token: i for i, token in enumerate(Path(path).read_text(encoding="utf-8").split("\n")) if token}
    tokenizer = Tokenizer(models.WordPiece(vocab, unk_token=SPECIAL_TOKENS["unk"], max_input_chars_per_word=100))
    tokenizer.normalizer = _normalizer(uncased)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    return tokenizer


def train_vocab(documents: Iterable[str], size: int, out: Path, uncased: bool) -> Vocab:
    """Train a WordPiece vocab of ``size`` entries on ``documents`` (streamed) and write it to ``out``."""
    if size < 100:
        raise VocabError(f"--train-vocab {size}: too small; use at least 100 (BERT uses ~30,000)")
    tokenizer = Tokenizer(models.WordPiece(unk_token=SPECIAL_TOKENS["unk"]))
    tokenizer.normalizer = _normalizer(uncased)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(vocab_size=size, special_tokens=list(SPECIAL_TOKENS.values()),
                                        show_progress=False, continuing_subword_prefix="##")
    tokenizer.train_from_iterator(documents, trainer=trainer)
    by_id = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(f"{token}\n" for token, _ in by_id), encoding="utf-8")
    return load_vocab(out)
