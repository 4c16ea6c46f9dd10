"""Seq2seq predictions for a file's records: sources packed and cut to their budget, decoded in batches by
`finetune.beam.generate`, and scored against references the way UniLM's generation results are."""
from __future__ import annotations

import logging

from data_prep.text import split_sentences
from pretrain.distributed import gather_objects
from pretrain.model import UniLMModel

from .beam import DecodeConfig, SpecialIds, beam_search
from .journal import Decoded, PredictionJournal
from .metrics import generation_metrics
from .model_io import check_vocab
from .seq2seq import source_budget
from .tokenizer import X_SEP, Tokenizer

log = logging.getLogger(__name__)

NO_REPEAT_IGNORE = "."
"""The word pieces repeated n-gram blocking exempts by default: UniLM's `--forbid_ignore_word "."`."""


def ignore_ids(tokenizer: Tokenizer, spec: str, where: str) -> frozenset[int]:
    """The ids of the word pieces `spec` names, separated by | as UniLM's `--forbid_ignore_word` writes them
    ("." or ".|[X_SEP]"; "" for none); each must be one entry of the vocabulary, except `[X_SEP]`, which a
    vocabulary without it (`Tokenizer.x_sep_id`) never generates."""
    tokens = [token for token in spec.split("|") if token and not (token == X_SEP and tokenizer.x_sep_id is None)]
    ids = {token: tokenizer.encoder.token_to_id(token) for token in tokens}
    unknown = [token for token, i in ids.items() if i is None]
    if unknown:
        raise ValueError(f"{where}: {unknown} not in the vocabulary {tokenizer.vocab_path} (each must be one of its "
                         "word pieces, such as '.')")
    return frozenset(i for i in ids.values() if i is not None)


def pack_source(tokenizer: Tokenizer, text: str, max_src_len: int) -> tuple[list[int], bool]:
    """`[CLS] src [SEP]` with src cut to `max_src_len` word pieces; also whether it was cut."""
    ids = tokenizer.encode(text)
    return [tokenizer.cls_id, *ids[:max_src_len], tokenizer.sep_id], len(ids) > max_src_len


def decode_records(model: UniLMModel, tokenizer: Tokenizer, records: list[dict], config: DecodeConfig,
                   max_src_len: int, batch_size: int = 8, progress: bool = False, spaced: bool = False,
                   journal: PredictionJournal | None = None, n_best: int = 1, rank: int = 0,
                   world_size: int = 1) -> Decoded:
    """The predicted text per record (`src` field), their `n_best` hypotheses (when > 1) and how many sources were
    truncated (to `max_src_len`, lowered by `source_budget` to leave room for a target of `config.max_tgt_len`).
    `spaced`: words and punctuation separated by spaces, as UniLM writes its predictions (`Tokenizer.decode`).
    `journal`: starts after the batches it holds and records each batch decoded.

    Data-parallel over `world_size` ranks (a collective: every rank of the process group calls it alike): the
    batches are those one process decodes (records 0 to batch_size - 1, ...); each round, rank r decodes the
    round's r-th batch, and every rank gathers the round's batches in input order, so the result is the one
    process's, whatever the number of ranks. Only rank 0 may hold a `journal`: it appends each round as gathered,
    and the ranks start after the batches it holds. Rank 0 returns every record's predictions; another rank those
    decoded in this call."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if journal is not None and rank != 0:
        raise ValueError("only rank 0 keeps the journal")
    check_vocab(model, tokenizer)
    max_src_len = source_budget(model.cfg.max_position_embeddings, max_src_len, config.max_tgt_len)
    missing = next((number for number, record in enumerate(records, 1) if not isinstance(record.get("src"), str)),
                   None)
    if missing is not None:  # before any decoding: a bad record at the end would waste the work before it
        raise ValueError(f"record {missing} has no 'src' text (decoding reads JSONL records with a 'src' text, and "
                         "'tgt' references to score against)")
    kept = journal.decoded if journal else Decoded()
    start = gather_objects(len(kept.predictions))[0] if world_size > 1 else len(kept.predictions)  # rank 0's
    decoded = Decoded(0, list(kept.predictions), list(kept.n_best), kept.truncated) if rank == 0 else Decoded(start)
    starts = range(start, len(records), batch_size)
    for first in range(0, len(starts), world_size):
        round_starts = starts[first: first + world_size]
        mine = decode_batch(model, tokenizer, records, round_starts[rank], batch_size, config, max_src_len, spaced,
                            n_best) if rank < len(round_starts) else None
        batches = gather_objects(mine)[: len(round_starts)] if world_size > 1 else [mine]
        for batch in filter(None, batches):  # each a Decoded: a rank past the input's end has no batch
            if journal:
                journal.add(batch)
            decoded.extend(batch)
        if progress and rank == 0:
            log.info("[decode] %d/%d", len(decoded.predictions), len(records))
    return decoded


def decode_batch(model: UniLMModel, tokenizer: Tokenizer, records: list[dict], start: int, batch_size: int,
                 config: DecodeConfig, max_src_len: int, spaced: bool, n_best: int) -> Decoded:
    """Records `start` to `start + batch_size - 1` decoded together (`decode_records`)."""
    sources, truncated = [], 0
    for record in records[start: start + batch_size]:
        packed, cut = pack_source(tokenizer, record["src"], max_src_len)
        sources.append(packed)
        truncated += cut
    ranked = beam_search(model, sources, SpecialIds.of(tokenizer), config, n_best)
    texts = [[tokenizer.decode(hypothesis.tokens, spaced) for hypothesis in hypotheses] for hypotheses in ranked]
    lists = [[{"text": text, "score": hypothesis.score} for text, hypothesis in zip(row, hypotheses)]
             for row, hypotheses in zip(texts, ranked)] if n_best > 1 else []
    return Decoded(start, [row[0] for row in texts], lists, truncated)


def score_predictions(tokenizer: Tokenizer, predictions: list[str], references: list[str]) -> dict[str, float]:
    """ROUGE and BLEU of decoded `predictions` against `references`, both in the model's word form
    (`Tokenizer.words`: an uncased model is scored on lower-cased, accent-stripped references; punctuation split
    off on both sides), the tokenised, lower-cased comparison UniLM's generation results use; one sentence per
    line for `rougeLsum` (a text's lines and `[X_SEP]`s, each piece split as shard building splits sentences;
    under an uncased model, whose predictions have no capitals to tell where a sentence starts, both sides are
    split lowercased, as shard building splits text without capitals)."""
    def sentences_of(line: str) -> list[str]:
        line = " ".join(line.split())
        return split_sentences(line.lower(), uncased=True) if tokenizer.lowercase else split_sentences(line)

    def word_form(text: str) -> str:  # UniLM's CNN/DM files join a summary's sentences with " [X_SEP] "
        sentences = (s for line in text.replace(X_SEP, "\n").splitlines() for s in sentences_of(line))
        return "\n".join(filter(None, map(tokenizer.words, sentences)))
    return generation_metrics([word_form(p) for p in predictions], [word_form(r) for r in references])

