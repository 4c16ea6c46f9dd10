"""WordPiece tokenisation for fine-tuning: the pre-training encoder (`data_prep.vocab`) on a model's `vocab.txt`.

The vocabulary is validated and encoded exactly as the shard builder does (HF `tokenizers` WordPiece with
BERT's normaliser and pre-tokeniser), so fine-tuning text is split the way pre-training text was. Casing comes
from `tokenizer_config.json` (`do_lower_case`) or `tokenizer.json` when the directory has one (Hugging Face BERT
directories do), from a shard directory's manifest, otherwise from the vocabulary itself: a vocabulary none of
whose word pieces changes under lower-casing is uncased.
Exports and fine-tuning outputs carry both files (`data_prep.vocab.write_hf_tokenizer`), so `finetune.decode
--model DIR` and `AutoTokenizer` find them.
BERT's special tokens written in fine-tuning text are read as themselves, as transformers' BertTokenizer reads
them: "passage [SEP] answer" (the source of UniLM's question-generation data) keeps its [SEP]. Pre-training text
is read by the shard builder, which splits such strings like any other words.
Lone surrogates (JSON allows "\\ud83d", half of a cut-off emoji), which the encoder refuses, and the other characters
the shard builder drops (`data_prep.text.replace_control_characters`) are dropped here too.
UniLM's sentence separator ` [X_SEP] ` (its CNN/DailyMail targets join a summary's sentences with it) is one word
piece, as in UniLM's code: the vocabulary's `[X_SEP]`, else `[unused1]`, the entry UniLM's BERT vocabularies give
it; a model then learns to write it, and decoding prints it as `[X_SEP]`. A vocabulary with neither reads it as
the words "[ X _ SEP ]" (`Tokenizer.x_sep_id` is None).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer as WordPieceEncoder, decoders

from data_prep.text import replace_control_characters
from data_prep.vocab import SPECIAL_TOKENS, Vocab, encoder_of, resolve_casing, resolve_vocab_source

_DECODER = decoders.WordPiece(prefix="##", cleanup=True)
_SPACED_DECODER = decoders.WordPiece(prefix="##", cleanup=False)
X_SEP = "[X_SEP]"
"""UniLM's sentence separator in its CNN/DailyMail targets (and so in its models' output)."""
X_SEP_ENTRIES = (X_SEP, "[unused1]")
"""The vocabulary entries that stand for `X_SEP`, in order of preference (UniLM's code maps `[unused1]` to it)."""
UNUSED = re.compile(r"\[unused\d+\]")
"""The placeholder entries BERT's vocabularies reserve (`[unused0]` …): no text is read as one (the encoder reads
"[unused5]" as the words "[ unused5 ]"), so no target holds one, except the one that stands for `X_SEP`."""


def _encodable(text: str) -> str:
    """`text` with the characters the shard builder drops replaced by U+FFFD, which BERT's normaliser drops: the ids
    are those of the text without them, and character offsets still point into `text`."""
    return replace_control_characters(text, "\ufffd")


@dataclass(frozen=True)
class Tokenizer:
    """The WordPiece encoder of one vocabulary plus the special-token ids fine-tuning needs."""

    vocab: Vocab
    encoder: WordPieceEncoder
    lowercase: bool
    x_sep_id: int | None = None
    """The word piece `[X_SEP]` is read as (see the module docstring); None: read as words."""

    @property
    def vocab_path(self) -> Path:
        return self.vocab.path

    @property
    def vocab_size(self) -> int:
        return self.vocab.size

    pad_id = property(lambda self: self.vocab.special_ids["pad"])
    unk_id = property(lambda self: self.vocab.special_ids["unk"])
    cls_id = property(lambda self: self.vocab.special_ids["cls"])
    sep_id = property(lambda self: self.vocab.special_ids["sep"])
    mask_id = property(lambda self: self.vocab.special_ids["mask"])

    @property
    def unused_ids(self) -> tuple[int, ...]:
        """The ids of the vocabulary's `UNUSED` entries but `X_SEP`'s."""
        return tuple(i for i, token in enumerate(self.vocab.tokens) if UNUSED.fullmatch(token) and i != self.x_sep_id)

    def encode(self, text: str) -> list[int]:
        """Word-piece ids of `text` (no [CLS]/[SEP] added)."""
        return self.encoder.encode(_encodable(text)).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [encoding.ids for encoding in self.encoder.encode_batch([_encodable(text) for text in texts])]

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids and (start, end) character offsets into `text` of each word piece."""
        encoding = self.encoder.encode(_encodable(text))
        return encoding.ids, encoding.offsets

    def words(self, text: str) -> str:
        """`text` in the model's word form: normalised as the encoder normalises (lower-cased and accents
        stripped for an uncased vocabulary) and split into words and punctuation, joined by single spaces. A
        decoded prediction and its reference compare in this form: "$280bn" and the decoder's "$ 280bn" both give
        "$ 280bn", so a score measures the model, not the detokeniser."""
        normalised = self.encoder.normalizer.normalize_str(_encodable(text))
        return " ".join(piece for piece, _ in self.encoder.pre_tokenizer.pre_tokenize_str(normalised))

    def decode(self, ids: list[int], spaced: bool = False) -> str:
        """Text of `ids`: special tokens dropped, `##` pieces joined to their word, `[X_SEP]` written as itself.
        `spaced`: every word and punctuation mark separated by one space ("the u . s . ?"), the tokenised text
        UniLM's decoding writes; else punctuation joined to the word before it ("the u. s.?")."""
        special = set(self.vocab.special_ids.values())
        pieces = [X_SEP if i == self.x_sep_id else self.vocab.tokens[i] for i in ids if i not in special]
        return (_SPACED_DECODER if spaced else _DECODER).decode(pieces)


def load_tokenizer(model_dir: str | Path, lowercase: bool | None = None) -> Tokenizer:
    """The tokenizer of a model directory (its `vocab.txt`, or the `tokenizer.json` transformers 5 saves alone), a
    shard directory, a `vocab.txt` or a `tokenizer.json`; cased or not as `data_prep.vocab.resolve_casing` decides
    for shard building (the tokenizer config beside the vocabulary, else the vocabulary's own word pieces), or as
    `lowercase` says (a shard manifest's recorded casing)."""
    path = Path(model_dir)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such vocab.txt or model directory; a model directory must carry the "
                                "vocabulary it was trained with (or pass --vocab)")
    source = resolve_vocab_source(path)
    lowercase = resolve_casing(source, None) if lowercase is None else lowercase
    vocab = source.load()
    # a copy of the shard builder's encoder (which must keep reading "[SEP]" in a corpus as plain words)
    encoder = encoder_of(vocab, lowercase).to_str()
    entry = next((token for token in X_SEP_ENTRIES if token in vocab.tokens), None)
    if entry is not None:  # the encoder's entry is named [X_SEP], so that the text "[X_SEP]" is read as it
        state = json.loads(encoder)
        state["model"]["vocab"][X_SEP] = state["model"]["vocab"].pop(entry)
        encoder = json.dumps(state)
    wordpiece = WordPieceEncoder.from_str(encoder)
    wordpiece.add_special_tokens(list(SPECIAL_TOKENS.values()) + ([X_SEP] if entry is not None else []))
    return Tokenizer(vocab, wordpiece, lowercase, None if entry is None else vocab.tokens.index(entry))
