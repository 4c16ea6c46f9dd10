"""WordPiece vocabularies: validate a BERT ``vocab.txt``, build the ``tokenizers`` encoder, train a new vocab.

``resolve_vocab_source`` accepts a ``vocab.txt``, a Hugging Face model/tokenizer directory (``vocab.txt`` with
``tokenizer_config.json``, or ``tokenizer.json`` alone, as transformers 5 saves it), a ``tokenizer.json`` or a
shard directory, and reads the casing stated beside the vocabulary; ``resolve_casing`` falls back to the
vocabulary itself (uncased when no word piece changes under lower-casing, as in BERT's uncased vocabularies).
Shard building and fine-tuning both resolve a vocabulary this way, so they tokenize alike.
``write_hf_tokenizer`` writes the files ``transformers.AutoTokenizer`` loads (``vocab.txt``,
``tokenizer_config.json``, ``special_tokens_map.json``) so it tokenizes exactly as this encoder does.

The encoder is HF ``tokenizers`` WordPiece with BERT's normaliser and pre-tokeniser. ``uncased=True`` lowercases
and strips accents (BERT-uncased); a trained vocabulary is cased unless asked (as UniLM). Special tokens are
deliberately *not* registered as added tokens, so a corpus that contains the literal text ``[SEP]`` or ``[MASK]``
is split into ordinary word pieces and can never inject structure into a sample.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

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
    extracted: bool = False
    """the tokens come from a tokenizer.json (``path``), not from a vocab.txt file"""

    @property
    def size(self) -> int:
        return len(self.tokens)


def load_vocab(path: Path | str) -> Vocab:
    """Read and validate a BERT ``vocab.txt`` (one token per line, UTF-8, unique, with the five special tokens)."""
    path = Path(path)
    if not path.is_file():
        raise VocabError(f"vocab {path}: file not found; {_FIX}")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw[: err.start].count(b"\n") + 1
        raise VocabError(f"vocab {path}: line {line} is not UTF-8; {_FIX}") from None
    return _validated(path, text, hashlib.sha256(raw).hexdigest())


def vocab_from_text(text: str, origin: Path | str) -> Vocab:
    """The vocabulary ``text`` (vocab.txt content, e.g. extracted from ``origin``, a tokenizer.json), validated as
    ``load_vocab`` validates a file; its sha256 is that of the vocab.txt it would be written as."""
    vocab = _validated(Path(origin), text, hashlib.sha256(text.encode("utf-8")).hexdigest())
    return dataclasses.replace(vocab, extracted=True)


_FIX = ('pass a BERT-style vocab.txt, or train one: "make vocab", or "python -m data_prep.build --train-vocab SIZE '
        '--vocab-out PATH --input ..."')


def _validated(path: Path, text: str, sha256: str) -> Vocab:
    tokens = text.split("\n")
    if tokens and tokens[-1] == "":
        tokens.pop()
    tokens = [t.rstrip("\r") for t in tokens]
    if not tokens:
        raise VocabError(f"vocab {path}: empty; {_FIX}")
    if tokens[0].startswith("\ufeff"):
        raise VocabError(f"vocab {path}: starts with a UTF-8 byte-order mark (an editor added it), which would "
                         f"become part of {tokens[0][1:]!r}; save the file as UTF-8 without a BOM")
    first_seen: dict[str, int] = {}
    for number, token in enumerate(tokens, 1):
        if not token.strip() or token != token.strip():
            raise VocabError(f"vocab {path}: line {number} is blank or has surrounding whitespace ({token!r}); {_FIX}")
        if token in first_seen:
            raise VocabError(f"vocab {path}: line {number} repeats {token!r} (first at line {first_seen[token]}); "
                             f"{_FIX}")
        first_seen[token] = number
    missing = [t for t in SPECIAL_TOKENS.values() if t not in first_seen]
    if missing:
        raise VocabError(f"vocab {path}: missing special token(s) {missing}; {_FIX}")
    special_ids = {name: first_seen[token] - 1 for name, token in SPECIAL_TOKENS.items()}
    return Vocab(path, tuple(tokens), sha256, special_ids)


def vocab_is_uncased(tokens: Iterable[str]) -> bool:
    """Whether a vocabulary looks uncased: no word piece (special tokens aside) changes under lower-casing. A
    character without a lower-case form (ℝ, an upper-case letter that real uncased BERT vocabularies hold) does
    not make it cased."""
    return all(token == token.lower() for token in tokens if not (token.startswith("[") and token.endswith("]")))


def _normalizer(uncased: bool) -> normalizers.Normalizer:
    return normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=uncased,
                                      lowercase=uncased)


@functools.lru_cache(maxsize=4)  # one encoder per (file, hash, casing) per process: building it costs ~20 ms
def load_encoder(path: str, sha256: str, uncased: bool) -> Tokenizer:
    """The WordPiece encoder for a validated vocab (``sha256`` keys the cache so an edited file reloads)."""
    return _encoder(Path(path).read_text(encoding="utf-8").split("\n"), uncased)


_ENCODERS: dict[tuple[str, bool], Tokenizer] = {}


def encoder_of(vocab: Vocab, uncased: bool) -> Tokenizer:
    """The WordPiece encoder of a validated ``vocab`` (from a file or a tokenizer.json), one per (sha256, casing)."""
    key = (vocab.sha256, uncased)
    if key not in _ENCODERS:
        _ENCODERS[key] = _encoder(vocab.tokens, uncased)
    return _ENCODERS[key]


def _encoder(tokens: Iterable[str], uncased: bool) -> Tokenizer:
    vocab = {token.rstrip("\r"): i for i, token in enumerate(tokens) if token}
    tokenizer = Tokenizer(models.WordPiece(vocab, unk_token=SPECIAL_TOKENS["unk"], max_input_chars_per_word=100))
    tokenizer.normalizer = _normalizer(uncased)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    return tokenizer


def train_vocab(documents: Callable[[], Iterable[str]], size: int, out: Path, uncased: bool) -> Vocab:
    """Train a WordPiece vocab of ``size`` entries on the documents ``documents()`` streams and write it to
    ``out``, with the tokenizer config that states its casing beside it: a later ``--vocab out`` encodes as it was
    trained, even when no word piece shows the casing (lowercased text, scripts without case).

    The same documents give the same file. ``documents()`` is read twice: first for the characters, whose
    continuing pieces (``##c``) are numbered in sorted order before training, since the trainer numbers those it
    meets in hash-map order, and its choice between merges of equal counts follows those numbers: two trainings
    on the same text gave different vocabularies."""
    if size < 100:
        raise VocabError(f"--train-vocab {size}: too small; use at least 100 (BERT uses ~30,000)")
    tokenizer = Tokenizer(models.WordPiece(unk_token=SPECIAL_TOKENS["unk"]))
    tokenizer.normalizer = _normalizer(uncased)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    continuing = _continuing_pieces(documents(), tokenizer)
    trainer = trainers.WordPieceTrainer(vocab_size=size, special_tokens=[*SPECIAL_TOKENS.values(), *continuing],
                                        show_progress=False, continuing_subword_prefix="##")
    tokenizer.train_from_iterator(documents(), trainer=trainer)
    by_id = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(f"{token}\n" for token, _ in by_id), encoding="utf-8")
    write_tokenizer_config(out.parent, uncased)
    return load_vocab(out)


def _continuing_pieces(documents: Iterable[str], tokenizer: Tokenizer) -> list[str]:
    """``##c`` for every character c of the normalised documents that can stand inside a word (not whitespace,
    punctuation or a CJK character, which the pre-tokeniser splits off), in sorted order."""
    characters: set[str] = set()
    for document in documents:
        characters.update(tokenizer.normalizer.normalize_str(document))
    return [f"##{c}" for c in sorted(characters)
            if len(tokenizer.pre_tokenizer.pre_tokenize_str(tokenizer.normalizer.normalize_str(f"a{c}a"))) == 1]


HF_TOKENIZER_CONFIG = "tokenizer_config.json"
HF_TOKENIZER_JSON = "tokenizer.json"
HF_SPECIAL_TOKENS_MAP = "special_tokens_map.json"


@dataclass(frozen=True)
class VocabSource:
    """What ``--vocab`` names: a vocab file (or the vocabulary text of a tokenizer.json) and the casing it states."""

    description: str
    vocab_file: Path | None
    """a vocab.txt to use as it is; None when the vocabulary comes from a tokenizer.json"""
    vocab_text: str | None
    """vocab.txt content (one token per line, in id order) extracted from a tokenizer.json"""
    uncased: bool | None
    """casing stated by a tokenizer config; None for a bare vocab.txt"""
    casing_from: str | None = None
    added_tokens: tuple[tuple[int, str, str], ...] = ()
    """(id, token, file) of the tokens a Hugging Face tokenizer adds to its vocabulary"""

    def load(self) -> Vocab:
        """The validated vocabulary: the vocab.txt, or the tokenizer.json's vocabulary. A tokenizer that adds
        tokens the vocabulary lacks (``tokenizer.add_tokens``) is refused: this encoder reads only the WordPiece
        vocabulary and would split them into word pieces, never using their embedding rows."""
        if self.vocab_file is not None:
            vocab = load_vocab(self.vocab_file)
        else:
            assert self.vocab_text is not None  # a source has a vocab.txt or the vocabulary of its tokenizer.json
            vocab = vocab_from_text(self.vocab_text, self.description)
        extra = sorted({(i, token, origin) for i, token, origin in self.added_tokens
                        if not (0 <= i < vocab.size and vocab.tokens[i] == token)})
        if extra:
            shown = ", ".join(f"{token!r} (id {i})" for i, token, _ in extra[:5])
            more = f" and {len(extra) - 5} more" if len(extra) > 5 else ""
            raise VocabError(f"{extra[0][2]}: the tokenizer adds {len(extra)} token(s) its {vocab.size}-entry "
                             f"WordPiece vocabulary lacks: {shown}{more}. This encoder reads only the vocabulary, so "
                             "they would be split into word pieces and their embedding rows never used; append them "
                             f"to {vocab.path.name if self.vocab_file else 'the vocabulary'} in id order (as word "
                             "pieces they then match whole words only), or remove them from the tokenizer")
        return vocab


def resolve_vocab_source(path: Path | str) -> VocabSource:
    """Read ``--vocab``: a vocab.txt, a Hugging Face model/tokenizer directory, a tokenizer.json, or a shard
    directory. The casing is what a file beside the vocabulary states: ``tokenizer_config.json``, else
    ``tokenizer.json``'s normaliser, else a shard ``manifest.json``'s ``vocab.uncased``; None when none does."""
    path = Path(path)
    if path.is_dir():
        vocab_txt, tokenizer_json = path / "vocab.txt", path / HF_TOKENIZER_JSON
        uncased, casing_from = _stated_casing(path)
        if vocab_txt.is_file():
            return VocabSource(str(path), vocab_txt, None, uncased, casing_from, _added_tokens(path))
        if tokenizer_json.is_file():
            return VocabSource(str(path), None, _tokenizer_json(tokenizer_json)[0], uncased, casing_from,
                               _added_tokens(path))
        raise VocabError(f"vocab {path}: a directory without vocab.txt or tokenizer.json; pass a BERT vocab.txt, "
                         "a Hugging Face BERT model directory, or a tokenizer.json")
    if path.name.endswith(".json") and path.is_file():
        vocab_text, uncased = _tokenizer_json(path)
        return VocabSource(str(path), None, vocab_text, uncased, str(path), _tokenizer_json_added(path))
    return VocabSource(str(path), path, None, *_stated_casing(path.parent), _added_tokens(path.parent))


HF_ADDED_TOKENS = "added_tokens.json"


def _added_tokens(directory: Path) -> tuple[tuple[int, str, str], ...]:
    """(id, token, file) of every token the Hugging Face tokenizer files in ``directory`` add: ``tokenizer.json``'s
    ``added_tokens``, ``added_tokens.json`` (a slow tokenizer's) and ``tokenizer_config.json``'s
    ``added_tokens_decoder`` (BERT's own special tokens are among them, at their vocabulary ids)."""
    found: list[tuple[int, str, str]] = []
    if (directory / HF_TOKENIZER_JSON).is_file():
        found += _tokenizer_json_added(directory / HF_TOKENIZER_JSON)
    if (added := directory / HF_ADDED_TOKENS).is_file():
        found += [(int(i), str(token), str(added)) for token, i in _read_json(added).items()]
    if (config := directory / HF_TOKENIZER_CONFIG).is_file():
        decoder = _read_json(config).get("added_tokens_decoder") or {}
        found += [(int(i), str(entry.get("content")), str(config)) for i, entry in decoder.items()
                  if isinstance(entry, dict)]
    return tuple(found)


def _tokenizer_json_added(path: Path) -> tuple[tuple[int, str, str], ...]:
    return tuple((int(entry["id"]), str(entry["content"]), str(path))
                 for entry in _read_json(path).get("added_tokens") or [] if isinstance(entry, dict) and "id" in entry)


def _stated_casing(directory: Path) -> tuple[bool | None, str | None]:
    """(uncased, the file that says so) from the tokenizer or shard files in ``directory``; (None, None)."""
    config, tokenizer_json, manifest = (directory / HF_TOKENIZER_CONFIG, directory / HF_TOKENIZER_JSON,
                                        directory / "manifest.json")
    if config.is_file():
        return _config_casing(config), str(config)
    if tokenizer_json.is_file():
        return _tokenizer_json(tokenizer_json)[1], str(tokenizer_json)
    if manifest.is_file():
        stated = (_read_json(manifest).get("vocab") or {}).get("uncased")
        if isinstance(stated, bool):
            return stated, f"{manifest} (vocab.uncased)"
    return None, None


def resolve_casing(source: VocabSource, uncased_flag: bool | None) -> bool:
    """The casing to encode with: the source's, else the flag's, else the vocabulary's own
    (`vocab_is_uncased`); a flag that contradicts what the source states fails."""
    if source.uncased is None:
        if uncased_flag is not None:
            return uncased_flag
        return vocab_is_uncased(source.load().tokens)
    if uncased_flag is not None and uncased_flag != source.uncased:
        flag, states = ("--uncased", "keeps case") if uncased_flag else ("--cased", "lowercases")
        raise VocabError(f"{flag} contradicts --vocab {source.description}: {source.casing_from} {states}; "
                         "drop the flag (the casing comes from the tokenizer config)")
    return source.uncased


def _config_casing(config: Path) -> bool:
    settings = _read_json(config)
    uncased = bool(settings.get("do_lower_case", True))  # BertTokenizer's default
    strip_accents = settings.get("strip_accents")
    if strip_accents is not None and bool(strip_accents) != uncased:
        raise VocabError(f"{config}: strip_accents {strip_accents} with do_lower_case {uncased} is not supported "
                         "(this encoder strips accents exactly when it lowercases, as BERT does)")
    if not settings.get("tokenize_chinese_chars", True) or not settings.get("do_basic_tokenize", True):
        raise VocabError(f"{config}: tokenize_chinese_chars / do_basic_tokenize false is not supported (this encoder "
                         "splits text as BERT's basic tokenizer does, CJK characters one by one)")
    return uncased


def _tokenizer_json(path: Path) -> tuple[str, bool]:
    """(vocab.txt text, uncased) of a WordPiece tokenizer.json with BERT's normaliser and pre-tokeniser."""
    settings = _read_json(path)
    model = settings.get("model") or {}
    if model.get("type") != "WordPiece" or model.get("continuing_subword_prefix", "##") != "##":
        raise VocabError(f"{path}: a {model.get('type')} tokenizer; only BERT WordPiece tokenizers (## "
                         "continuation pieces) are supported")
    pre_tokenizer = (settings.get("pre_tokenizer") or {}).get("type")
    if pre_tokenizer != "BertPreTokenizer":
        raise VocabError(f"{path}: pre-tokenizer {pre_tokenizer}, not BertPreTokenizer; the shards would not "
                         "be tokenized as this tokenizer does")
    normalizer = settings.get("normalizer") or {}
    if normalizer.get("type") != "BertNormalizer":
        raise VocabError(f"{path}: normalizer {normalizer.get('type')}, not BertNormalizer")
    uncased = bool(normalizer.get("lowercase", True))
    strip_accents = normalizer.get("strip_accents")
    if (strip_accents is not None and bool(strip_accents) != uncased) or \
            not normalizer.get("handle_chinese_chars", True):
        raise VocabError(f"{path}: normalizer settings {normalizer} are not BERT's cased or uncased ones")
    by_id = sorted((i, token) for token, i in model["vocab"].items())
    if [i for i, _ in by_id] != list(range(len(by_id))):
        raise VocabError(f"{path}: vocabulary ids are not 0..{len(by_id) - 1} without gaps")
    return "".join(f"{token}\n" for _, token in by_id), uncased


def _read_json(path: Path) -> dict:
    try:
        settings = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise VocabError(f"{path}: not valid UTF-8 JSON ({err})") from None
    if not isinstance(settings, dict):
        raise VocabError(f"{path}: not a JSON object")
    return settings


def write_hf_tokenizer(vocab: Vocab | Path | str, uncased: bool, out: Path | str,
                       model_max_length: int | None = None) -> None:
    """Write ``vocab.txt``, ``tokenizer_config.json`` and ``special_tokens_map.json`` for ``transformers``.

    ``BertTokenizer(Fast)`` built from them normalises as ``load_encoder(…, uncased)`` does: lowercasing and
    accent stripping together (``strip_accents`` None follows ``do_lower_case``), Chinese characters split.
    ``model_max_length`` (the model's position table) is what ``truncation=True`` cuts inputs to.
    ``vocab``: a vocab.txt path or a validated `Vocab`; a vocabulary from a vocab.txt is copied byte for byte.
    """
    if not isinstance(vocab, Vocab):
        vocab = load_vocab(vocab)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    target = out / "vocab.txt"
    if vocab.extracted:
        target.write_text("".join(f"{token}\n" for token in vocab.tokens), encoding="utf-8")
    elif vocab.path.resolve() != target.resolve():
        shutil.copyfile(vocab.path, target)
    write_tokenizer_config(out, uncased, model_max_length)


def write_tokenizer_config(out: Path, uncased: bool, model_max_length: int | None = None) -> None:
    """``tokenizer_config.json`` and ``special_tokens_map.json`` in ``out``: the casing and the special tokens of
    the vocab.txt there, as ``transformers`` and ``resolve_vocab_source`` read them."""
    special = {f"{name}_token": token for name, token in SPECIAL_TOKENS.items()}
    config: dict[str, object] = {"tokenizer_class": "BertTokenizer", "do_lower_case": uncased, "strip_accents": None,
              "tokenize_chinese_chars": True, "do_basic_tokenize": True, **special}
    if model_max_length is not None:
        config["model_max_length"] = model_max_length
    (out / HF_TOKENIZER_CONFIG).write_text(json.dumps(config, indent=1, sort_keys=True) + "\n")
    (out / HF_SPECIAL_TOKENS_MAP).write_text(json.dumps(special, indent=1, sort_keys=True) + "\n")
