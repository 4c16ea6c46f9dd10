"""Generation the UniLM way: append [MASK], predict it, put the prediction in its place, repeat.

`generate` runs one batched beam search (beam 1 = greedy) over either of two steppers that compute the
next-token log-probabilities, and must agree:
- `CachedStepper` keeps every layer's keys/values of the source and of the tokens generated so far. A step
  feeds two positions — the previous prediction (replacing the [MASK] it was predicted at) and a new [MASK] —
  and then drops the [MASK]'s keys/values from the cache (UniLM's incremental decoding), so each step costs two
  query positions whatever the length. Sources of different lengths are padded inside the cache; explicit
  position ids and a key-validity vector keep every example exactly as if it were alone.
- `FullStepper` (`--no-cache`) packs `[CLS] src [SEP] y1 .. yt [MASK]` and runs the whole sequence through the
  model under `pretrain.masks.build_attention_mask(SEQ2SEQ)` — the very mask fine-tuning trains with — so
  agreement of the two proves the cache right.

Beam search: GNMT length penalty ((5 + length) / 6) ** alpha on the summed log-probabilities (length counts
the final [SEP]), repeated n-gram blocking on word-piece ids (trigrams by default, as the paper decodes) with
UniLM's exemption for "." (nothing is blocked right after one and "." itself never is, so "u . s ." or "2 . 5"
may recur), a minimum and maximum target length. A hypothesis finishes when a [SEP] is among the top `beam_size`
candidates; `beam_size` beams stay alive. An example is done once its best finished hypothesis scores at least
what any alive beam could still reach (its log-probability can only fall; divided by the largest length penalty
left), so stopping early never changes the result of searching to the maximum length, as UniLM's decoder does;
the batch stops once every example is done. At the maximum length unfinished beams count as finished. Beam 1 is
greedy search: no length penalty.

CLI: `python -m finetune.decode --model DIR --input FILE.jsonl --output FILE.jsonl [--beam-size 5] ...` (or UniLM's
line files: `--input NAME.src` and an output not named `.jsonl`, one prediction per line, tokenised as UniLM writes
it: "the u . s . ?"); when every record has a
`tgt` (or `NAME.tgt` is beside `NAME.src`), ROUGE and BLEU against it go to `FILE.metrics.json`
(`score_predictions`). Finished batches are kept in `FILE.partial.jsonl` until the output is written, so a decode
that is stopped continues after them (`PredictionJournal`); a second decode of the same output while one runs is
refused, naming the first (`lock_output`).
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch

from common import locks
from common.files import sha256_file
from common.signals import describe, stop_once
from data_prep.text import split_sentences
from pretrain.accelerator import default_device
from pretrain.masks import SEQ2SEQ, build_segment_ids
from common.files import write_atomically
from pretrain.outputs import check_output

from .task_files import read_seq2seq, write_jsonl
from .metrics import generation_metrics
from .seq2seq import source_budget
from .model_io import check_vocab, load_finetuned
from .tokenizer import X_SEP, Tokenizer


@dataclass(frozen=True)
class DecodeConfig:
    """How to search."""

    beam_size: int = 5
    """Hypotheses kept per example; 1 is greedy decoding (the most likely word piece at each step, whatever the
    length penalty, as UniLM's and transformers' greedy search)."""
    max_tgt_len: int = 64
    """Most target word pieces generated (the final [SEP] not counted)."""
    min_tgt_len: int = 1
    """[SEP] is forbidden before this many target word pieces."""
    length_penalty: float = 0.0
    """GNMT alpha: hypotheses are ranked by log-prob / ((5 + length) / 6) ** alpha; 0 = raw log-prob."""
    no_repeat_ngram: int = 3
    """Forbid a word piece that would repeat an n-gram of this size already in the hypothesis (3: trigram
    blocking, the paper's; 1: no word piece twice, for short outputs such as headlines; 0: off)."""
    no_repeat_ignore: frozenset[int] = frozenset()
    """Word-piece ids the blocking exempts (UniLM's `forbid_ignore_word`, "." by default in `finetune.decode` and
    fine-tuning): never blocked, and nothing is blocked while one is among the n - 1 last word pieces."""
    use_cache: bool = True
    """Incremental key/value cache; False recomputes the whole sequence each step (same outputs, slower)."""

    def __post_init__(self) -> None:
        if self.beam_size < 1 or self.max_tgt_len < 1 or not 0 <= self.min_tgt_len <= self.max_tgt_len \
                or self.no_repeat_ngram < 0 or not math.isfinite(self.length_penalty):
            raise ValueError(f"invalid decoding config {self}: need beam_size >= 1, "
                             "0 <= min_tgt_len <= max_tgt_len >= 1, no_repeat_ngram >= 0 and a finite length penalty")


@dataclass(frozen=True)
class SpecialIds:
    cls_id: int
    sep_id: int
    mask_id: int
    pad_id: int
    unk_id: int | None = None
    unused_ids: tuple[int, ...] = ()
    """BERT's placeholder entries (`finetune.tokenizer.UNUSED`) no text is read as."""

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> "SpecialIds":
        return cls(tokenizer.cls_id, tokenizer.sep_id, tokenizer.mask_id, tokenizer.pad_id, tokenizer.unk_id,
                   tokenizer.unused_ids)

    @property
    def never_generated(self) -> list[int]:
        """The tokens a target never holds ([SEP] ends it): a generated special token would vanish from the text
        while taking a place in the length budget and hiding repeats from n-gram blocking; a generated placeholder
        would print as "[unused5]"."""
        return [i for i in (self.cls_id, self.mask_id, self.pad_id, self.unk_id) if i is not None] \
            + list(self.unused_ids)


# ------------------------------------------------------------------------------------------------ steppers
class FullStepper:
    """Recomputes `[CLS] src [SEP] y1..yt [MASK]` for every row at every step (the reference)."""

    def __init__(self, model: torch.nn.Module, sources: list[list[int]], special: SpecialIds, device: torch.device):
        self.model, self.special, self.device = model, special, device
        self.sources = sources  # per row, packed [CLS] src [SEP]
        self.targets: list[list[int]] = [[] for _ in sources]

    def start(self) -> torch.Tensor:
        return self._next_log_probs()

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        for row, token in enumerate(tokens.tolist()):
            self.targets[row].append(token)
        return self._next_log_probs()

    def reorder(self, rows: torch.Tensor) -> None:
        rows = rows.tolist()
        self.sources = [self.sources[r] for r in rows]
        self.targets = [list(self.targets[r]) for r in rows]

    def _next_log_probs(self) -> torch.Tensor:
        sequences = [s + t + [self.special.mask_id] for s, t in zip(self.sources, self.targets)]
        max_len = max(map(len, sequences))
        input_ids = torch.full((len(sequences), max_len), self.special.pad_id, dtype=torch.long)
        for row, sequence in enumerate(sequences):
            input_ids[row, : len(sequence)] = torch.tensor(sequence)
        length = torch.tensor([len(s) for s in sequences])
        len_a = torch.tensor([len(s) for s in self.sources])
        input_ids, length, len_a = (t.to(self.device) for t in (input_ids, length, len_a))
        hidden = self.model.encode_objective(input_ids, SEQ2SEQ, len_a, length)
        last = hidden[torch.arange(len(sequences), device=self.device), length - 1]
        return torch.log_softmax(self.model.mlm_logits(last).float(), dim=-1)


class CachedStepper:
    """Keys/values of the source and of the generated tokens are cached; each step runs two positions."""

    def __init__(self, model: torch.nn.Module, sources: list[list[int]], special: SpecialIds, device: torch.device):
        self.model, self.special, self.device = model, special, device
        rows, source_width = len(sources), max(map(len, sources))
        self.source_length = torch.tensor([len(s) for s in sources], device=device)  # Long[N]
        self.source_ids = torch.full((rows, source_width), special.pad_id, dtype=torch.long)
        for row, source in enumerate(sources):
            self.source_ids[row, : len(source)] = torch.tensor(source)
        self.source_ids = self.source_ids.to(device)
        self.generated = 0  # target tokens already in the cache or about to enter it
        self.cache = None  # per layer (keys, values) Float[N, heads, Lk, head_size]
        self.key_valid = None  # Bool[N, Lk]: False at source padding

    def _segments(self, positions: torch.Tensor) -> torch.Tensor:
        """Segment ids (source 4 / target 5) at Long[N, Lq] positions, from `pretrain.masks` itself."""
        width = int(positions.max()) + 1
        objective = torch.full_like(self.source_length, SEQ2SEQ)
        segments = build_segment_ids(objective, self.source_length, torch.full_like(self.source_length, width), width)
        return segments.gather(1, positions)

    def _run(self, input_ids: torch.Tensor, positions: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden, cache = self.model.encode(input_ids, self._segments(positions), attention_mask,
                                          position_ids=positions, past_key_values=self.cache, use_cache=True)
        # the last position is the [MASK] placeholder: its prediction is kept, its keys/values are not
        self.cache = tuple((keys[:, :, :-1], values[:, :, :-1]) for keys, values in cache)
        return torch.log_softmax(self.model.mlm_logits(hidden[:, -1]).float(), dim=-1)

    def start(self) -> torch.Tensor:
        rows, width = self.source_ids.shape
        positions = torch.arange(width, device=self.device).expand(rows, width)
        source_valid = positions < self.source_length[:, None]  # Bool[N, S]
        # source queries see the valid source (a padding query sees itself only: no all-False row);
        # the [MASK] (at position len(source)) sees the valid source and itself
        source_rows = source_valid[:, None, :] | torch.eye(width, dtype=torch.bool, device=self.device)
        source_rows = torch.cat([source_rows, source_rows.new_zeros(rows, width, 1)], dim=2)
        mask_row = torch.cat([source_valid, source_valid.new_ones(rows, 1)], dim=1)[:, None, :]
        input_ids = torch.cat([self.source_ids, self.source_ids.new_full((rows, 1), self.special.mask_id)], dim=1)
        positions = torch.cat([positions, self.source_length[:, None]], dim=1)
        self.key_valid = source_valid
        return self._run(input_ids, positions, torch.cat([source_rows, mask_row], dim=1))

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        rows = tokens.shape[0]
        self.generated += 1
        token_position = self.source_length + self.generated - 1
        positions = torch.stack([token_position, token_position + 1], dim=1)
        input_ids = torch.stack([tokens.to(self.device), torch.full_like(tokens, self.special.mask_id)], dim=1)
        ones = self.key_valid.new_ones(rows, 1)
        token_row = torch.cat([self.key_valid, ones, ~ones], dim=1)  # the token does not see the [MASK]
        mask_row = torch.cat([self.key_valid, ones, ones], dim=1)
        self.key_valid = torch.cat([self.key_valid, ones], dim=1)
        return self._run(input_ids, positions, torch.stack([token_row, mask_row], dim=1))

    def reorder(self, rows: torch.Tensor) -> None:
        rows = rows.to(self.device)
        self.cache = tuple((keys[rows], values[rows]) for keys, values in self.cache)
        self.key_valid, self.source_length = self.key_valid[rows], self.source_length[rows]


# ------------------------------------------------------------------------------------------------ search
def length_penalty(length: int, alpha: float) -> float:
    """GNMT (Wu et al. 2016): ((5 + length) / 6) ** alpha."""
    return ((5.0 + length) / 6.0) ** alpha


def block_repeated_ngrams(log_probs: torch.Tensor, hypotheses: list[list[int]], n: int,
                          ignore: frozenset[int] = frozenset()) -> None:
    """Set to -inf, in place, each word piece that would complete an n-gram its hypothesis already has
    (n = 1: each word piece it already has). Word pieces in `ignore` are never set, and a hypothesis whose n - 1
    last word pieces include one has nothing set.

    log_probs Float[N, V]; hypotheses: N token lists.
    """
    rows, banned_tokens = [], []
    for row, tokens in enumerate(hypotheses):
        if len(tokens) < n:
            continue
        prefix = tokens[len(tokens) - n + 1:]  # the n - 1 last tokens, which the next one would extend
        if ignore.intersection(prefix):
            continue
        banned = {tokens[i + n - 1] for i in range(len(tokens) - n + 1) if tokens[i: i + n - 1] == prefix} - ignore
        rows += [row] * len(banned)
        banned_tokens += sorted(banned)
    if rows:  # one indexed write on log_probs' device: the ids travel, the distribution stays
        index = torch.tensor([rows, banned_tokens], device=log_probs.device)
        log_probs[index[0], index[1]] = -math.inf


def best_reachable(alive: list[tuple[int, int, float]], length: int, config: DecodeConfig) -> float:
    """The highest score any of the `alive` (row, token, log-prob) beams, now `length` word pieces long, can still
    finish with: its log-probability (<= 0) only falls, and is divided by the largest length penalty of a length
    it can still end at (`length` + 1 to `max_tgt_len`)."""
    if not alive:
        return -math.inf
    penalty = max(length_penalty(min(length + 1, config.max_tgt_len), config.length_penalty),
                  length_penalty(config.max_tgt_len, config.length_penalty))
    return max(score for _, _, score in alive) / penalty


@dataclass(frozen=True)
class Hypothesis:
    tokens: list[int]
    """Generated word pieces without the final [SEP]."""
    log_prob: float
    """Summed log-probability (the final [SEP] included when it ended)."""
    score: float
    """log_prob / length penalty: what beams are ranked by."""


@torch.no_grad()  # not inference_mode: run mid-training, ZeRO-3 may keep parameters it gathers here
def generate(model: torch.nn.Module, sources: list[list[int]], special: SpecialIds,
             config: DecodeConfig) -> list[Hypothesis]:
    """Best hypothesis per source. `sources`: packed `[CLS] src [SEP]` id lists (one batch).

    Runs on the model's device: the log-probabilities, the length/n-gram bans, the beam scores and the top-k over
    beams × vocabulary stay there; each step brings only the 2·beam candidates per example (score, row, token) to
    the host for the finished/alive bookkeeping and sends back the chosen rows and tokens."""
    if config.beam_size == 1:  # greedy: ends at the first [SEP] it prefers; a length penalty would keep it going
        config = dataclasses.replace(config, length_penalty=0.0)
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    beams, batch_size = config.beam_size, len(sources)
    rows = [s for s in sources for _ in range(beams)]  # row = example * beams + beam
    stepper = (CachedStepper if config.use_cache else FullStepper)(model, rows, special, device)
    scores = torch.full((batch_size, beams), -math.inf, device=device)
    scores[:, 0] = 0.0  # all beams start identical: only the first may expand
    hypotheses: list[list[int]] = [[] for _ in rows]
    finished: list[list[Hypothesis]] = [[] for _ in range(batch_size)]
    done = [False] * batch_size
    never = torch.tensor(special.never_generated, device=device)
    log_probs = stepper.start()
    for length in range(1, config.max_tgt_len + 1):  # length of the hypotheses after this step
        log_probs[:, never] = -math.inf
        if length <= config.min_tgt_len:
            log_probs[:, special.sep_id] = -math.inf
        if config.no_repeat_ngram:
            block_repeated_ngrams(log_probs, hypotheses, config.no_repeat_ngram, config.no_repeat_ignore)
        vocab = log_probs.shape[1]
        total = (scores.view(-1, 1) + log_probs).view(batch_size, beams * vocab)
        top_scores, top_index = total.topk(min(2 * beams, total.shape[1]), dim=1)
        top_scores, top_index = top_scores.tolist(), top_index.tolist()  # [B, 2·beams] candidates, not [B, V]
        next_rows, next_tokens, next_scores = [], [], []
        for example in range(batch_size):
            alive = []
            if not done[example]:
                for rank, (score, index) in enumerate(zip(top_scores[example], top_index[example])):
                    row, token = example * beams + index // vocab, index % vocab
                    if token == special.sep_id:
                        if rank < beams and score > -math.inf:
                            normalised = score / length_penalty(length, config.length_penalty)
                            finished[example].append(Hypothesis(hypotheses[row], score, normalised))
                    else:
                        alive.append((row, token, score))
                    if len(alive) == beams:
                        break
                done[example] = bool(finished[example]) and (
                    max(h.score for h in finished[example]) >= best_reachable(alive, length, config))
            if done[example]:  # keep the batch shape: dummy beams that never win
                alive = [(example * beams, special.pad_id, -math.inf)] * beams
            alive += [(example * beams, special.pad_id, -math.inf)] * (beams - len(alive))
            for row, token, score in alive:
                next_rows.append(row)
                next_tokens.append(token)
                next_scores.append(score)
        hypotheses = [hypotheses[row] + [token] for row, token in zip(next_rows, next_tokens)]
        scores = torch.tensor(next_scores, device=device).view(batch_size, beams)
        if all(done) or length == config.max_tgt_len:
            break
        stepper.reorder(torch.tensor(next_rows, device=device))
        log_probs = stepper.step(torch.tensor(next_tokens, device=device))
    final_scores = scores.tolist()
    best = []
    for example in range(batch_size):
        candidates = list(finished[example])
        if not done[example]:  # maximum length reached: unfinished beams compete as they are
            for beam in range(beams):
                score = final_scores[example][beam]
                if score > -math.inf:
                    tokens = hypotheses[example * beams + beam]
                    normalised = score / length_penalty(len(tokens), config.length_penalty)
                    candidates.append(Hypothesis(tokens, score, normalised))
        best.append(max(candidates, key=lambda h: h.score) if candidates
                    else Hypothesis([], -math.inf, -math.inf))
    model.train(was_training)
    return best


# ------------------------------------------------------------------------------------------------ files
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
    return frozenset(ids.values())


def pack_source(tokenizer: Tokenizer, text: str, max_src_len: int) -> tuple[list[int], bool]:
    """`[CLS] src [SEP]` with src cut to `max_src_len` word pieces; also whether it was cut."""
    ids = tokenizer.encode(text)
    return [tokenizer.cls_id, *ids[:max_src_len], tokenizer.sep_id], len(ids) > max_src_len


class PredictionJournal:
    """The predictions of the batches decoded so far, appended to a file beside the output as each batch ends
    (flushed and fsync'ed), so that a decode stopped by Ctrl-C, SIGTERM, a crash or a lost machine continues where
    it stopped when the same command runs again. The file's first line is the `fingerprint` of what decides the
    predictions (the model's files, the sources, the decoding settings and batch size); a file of another
    fingerprint is started afresh. The output's writer removes the file once the output is in place."""

    def __init__(self, path: Path, fingerprint: str) -> None:
        self.path, self.fingerprint = path, fingerprint
        self.predictions: list[str] = []
        self.truncated = 0

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
                        entry = json.loads(line)
                    except json.JSONDecodeError:
                        break
                    if not isinstance(entry, dict) or entry.get("start") != len(self.predictions):
                        break
                    self.predictions += entry["predictions"]
                    self.truncated += entry["truncated"]
                found = f"continuing after the {len(self.predictions)} predictions {self.path} holds"
            else:
                found = (f"{self.path} holds predictions of another model, input or settings; starting afresh "
                         "(it is replaced)")
        kept = self._line(0, self.predictions, self.truncated) if self.predictions else ""  # one entry for it all
        write_atomically(self.path, lambda tmp: tmp.write_text(
            json.dumps({"fingerprint": self.fingerprint}) + "\n" + kept, encoding="utf-8"))
        return found

    @staticmethod
    def _line(start: int, predictions: list[str], truncated: int) -> str:
        return json.dumps({"start": start, "predictions": predictions, "truncated": truncated},
                          ensure_ascii=False) + "\n"

    def add(self, start: int, predictions: list[str], truncated: int) -> None:
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(self._line(start, predictions, truncated))
            handle.flush()
            os.fsync(handle.fileno())
        self.predictions += predictions
        self.truncated += truncated

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


def decode_records(model: torch.nn.Module, tokenizer: Tokenizer, records: list[dict], config: DecodeConfig,
                   max_src_len: int, batch_size: int = 8, progress: bool = False,
                   spaced: bool = False, journal: PredictionJournal | None = None) -> tuple[list[str], int]:
    """Predicted text per record (`src` field) and how many sources were truncated (to `max_src_len`, lowered by
    `source_budget` to leave room for a target of `config.max_tgt_len`). `spaced`: words and punctuation
    separated by spaces, as UniLM writes its predictions (`Tokenizer.decode`). `journal`: starts after the
    batches it holds and records each batch decoded."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    check_vocab(model, tokenizer)
    max_src_len = source_budget(model.cfg.max_position_embeddings, max_src_len, config.max_tgt_len)
    missing = next((number for number, record in enumerate(records, 1) if not isinstance(record.get("src"), str)),
                   None)
    if missing is not None:  # before any decoding: a bad record at the end would waste the work before it
        raise ValueError(f"record {missing} has no 'src' text (decoding reads JSONL records with a 'src' text, and "
                         "'tgt' references to score against)")
    predictions, truncated = (list(journal.predictions), journal.truncated) if journal else ([], 0)
    for start in range(len(predictions), len(records), batch_size):
        batch = records[start: start + batch_size]
        sources, batch_truncated = [], 0
        for record in batch:
            packed, cut = pack_source(tokenizer, record["src"], max_src_len)
            sources.append(packed)
            batch_truncated += cut
        decoded = [tokenizer.decode(hypothesis.tokens, spaced)
                   for hypothesis in generate(model, sources, SpecialIds.of(tokenizer), config)]
        if journal:
            journal.add(start, decoded, batch_truncated)
        predictions += decoded
        truncated += batch_truncated
        if progress:
            print(f"[decode] {len(predictions)}/{len(records)}", file=sys.stderr, flush=True)
    return predictions, truncated


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


def metrics_path(output: str | Path) -> Path:
    """`out.jsonl` (or `out.txt`, ...) → `out.metrics.json` (beside the output)."""
    return beside(output, ".metrics.json")


def beside(output: str | Path, ending: str) -> Path:
    """A file beside `output` named after it: `pred.tsv`, `.metrics.json` → `pred.metrics.json`."""
    output = Path(output)
    return output.with_name(output.name.removesuffix(output.suffix) + ending)


def writes_lines(output: Path) -> bool:
    """Whether predictions go to `output` one per line, in UniLM's tokenised form (`write_predictions`)."""
    return output.suffix != ".jsonl"


def write_predictions(output: Path, records: list[dict], predictions: list[str]) -> None:
    """`output.jsonl`: the input records with their `prediction`; any other name: one prediction per line, in input
    order (UniLM's decoding output, what files2rouge and the question-generation scripts read beside the
    references; `decode_records(spaced=True)` gives its tokenised form)."""
    if not writes_lines(output):
        write_atomically(output, lambda tmp: write_jsonl(
            ({**record, "prediction": p} for record, p in zip(records, predictions)), tmp))
    else:
        write_atomically(output, lambda tmp: tmp.write_text(
            "".join(" ".join(p.split()) + "\n" for p in predictions), encoding="utf-8"))


def finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value
    return parse


def device_argument(parser: argparse.ArgumentParser, text: str | None) -> torch.device:
    """The device `--device TEXT` names (default: this process's GPU when there is one, else cpu), refused with
    the choices when torch cannot read it or this machine has no such CUDA device."""
    if text is None:
        return default_device()
    try:
        device = torch.device(text)
    except RuntimeError:
        parser.error(f"--device {text}: not a torch device; use cpu, cuda or cuda:N")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device.type == "cuda" and (device.index or 0) >= count:
        parser.error(f"--device {text}: this machine has {count} CUDA device(s)"
                     + ("; use cpu" if count == 0 else f"; use cuda:0 to cuda:{count - 1}"))
    return device


def refuse_distributed_launch(parser: argparse.ArgumentParser) -> None:
    """Stop a one-process tool started by a distributed launcher (torchrun, DeepSpeed's, mpirun: a world size
    above 1), where every rank would do all the work and all but the first would find the output written."""
    for name in ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE"):
        size = os.environ.get(name, "1")
        if size.isdigit() and int(size) > 1:
            parser.error(f"runs in one process, on one device (its GPU, or --device), but a launcher started "
                         f"{size} ranks ({name}={size}): run it as `{parser.prog} ...` itself")


def main(argv: list[str] | None = None) -> None:

    parser = argparse.ArgumentParser(prog="python -m finetune.decode",
                                     description="UniLM seq2seq decoding (greedy / beam search with a KV cache)")
    parser.add_argument("--model", required=True, help="a fine-tuning output directory (or an HF BERT directory)")
    parser.add_argument("--input", required=True, help="JSONL with `src` (and optionally `tgt` references), or "
                        "UniLM's line files: NAME.src (and NAME.tgt beside it)")
    parser.add_argument("--output", required=True,
                        help="NAME.jsonl: the input records with their `prediction`; any other name: one "
                             "prediction per line, words and punctuation split by spaces (as UniLM's decoding "
                             "writes, for files2rouge and its question-generation scoring)")
    parser.add_argument("--beam-size", type=int_at_least(1), default=5,
                        help="1: greedy, no length penalty (default 5)")
    parser.add_argument("--max-tgt-len", type=int_at_least(1), default=None,
                        help="longest target in word pieces (default: the fine-tuning run's max_tgt_len, else 64)")
    parser.add_argument("--min-tgt-len", type=int_at_least(0), default=1,
                        help="shortest target in word pieces (default 1; at most --max-tgt-len)")
    parser.add_argument("--max-src-len", type=int_at_least(1), default=None,
                        help="default: the fine-tuning run's, else 448")
    parser.add_argument("--length-penalty", type=finite_float, default=None,
                        help="GNMT alpha (default: the fine-tuning run's eval_length_penalty, e.g. 1.0 for CNN/DM, "
                             "else 0: none)")
    parser.add_argument("--no-repeat-ngram", type=int_at_least(0), default=None, metavar="N",
                        help="forbid repeating an n-gram of N word pieces (3: trigram blocking, the paper's; "
                             "1: no word piece twice, for headlines; 0: off; default: the fine-tuning run's "
                             "eval_no_repeat_ngram, else 3)")
    parser.add_argument("--no-repeat-ignore", default=None, metavar="TOKENS",
                        help="word pieces the blocking exempts, separated by | ('.', UniLM's: nothing is blocked "
                             "after one, and it is never blocked; '' for none; default: the fine-tuning run's "
                             "eval_no_repeat_ignore, else '.')")
    parser.add_argument("--no-cache", action="store_true", help="recompute everything each step (proves the cache)")
    parser.add_argument("--batch-size", type=int_at_least(1), default=8, help="sources decoded together (>= 1)")
    parser.add_argument("--device", default=None,
                        help="torch device to decode on (default: this process's GPU when there is one, else cpu)")
    parser.add_argument("--force", action="store_true", help="replace an existing non-empty --output")
    args = parser.parse_args(argv)
    refuse_distributed_launch(parser)
    handle = lock_output(parser, args.output)
    try:
        _decode(parser, args)
    finally:
        locks.release(handle)


def lock_output(parser: argparse.ArgumentParser, output: str) -> IO[str]:
    """The lock (``common.locks``) a decode holds on ``.NAME.decode.lock`` beside its output from start to end,
    so that a second decode of the same output (which would share its `PredictionJournal`) is refused, naming the
    first; returns the handle that holds it."""
    path = beside(output, ".decode.lock")
    path = path.with_name("." + path.name)
    try:
        handle, previous = locks.take(path)
    except locks.Held as held:
        parser.error(f"--output {output}: another decode of it is running ({held}); wait for it to end or stop "
                     "it, or choose another --output")
    except OSError as error:
        parser.error(f"--output {output}: cannot lock {path} ({error})"
                     + (f"; put the output on {locks.NO_LOCKS_HINT}" if locks.cannot_lock(error) else ""))
    if previous:
        print(f"[decode] an earlier decode of {output} ended without releasing {path} (killed): "
              f"{locks.holder_text(previous)}", file=sys.stderr, flush=True)
    return handle


def _decode(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    paired_references = Path(args.input).with_suffix(".tgt") if Path(args.input).suffix == ".src" else None
    try:
        check_output(args.output, [args.input, paired_references, args.model], force=args.force, file=True)
        # the predictions so far, kept beside the output until it is written (`PredictionJournal`)
        check_output(beside(args.output, ".partial.jsonl"), [args.input, paired_references], force=True, file=True)
    except (ValueError, FileExistsError) as error:
        parser.error(str(error))

    device = device_argument(parser, args.device)
    try:
        finetuned = load_finetuned(args.model, expect_task="seq2seq")
    except (ValueError, OSError) as error:
        parser.error(f"--model {args.model}: {error}")
    finetuned.model.to(device)
    max_tgt_len = args.max_tgt_len if args.max_tgt_len is not None else finetuned.run_settings.get("max_tgt_len", 64)
    if args.beam_size > finetuned.tokenizer.vocab_size:
        parser.error(f"--beam-size {args.beam_size}: more beams than the {finetuned.tokenizer.vocab_size} word pieces "
                     "a step can choose from")
    if args.min_tgt_len > max_tgt_len:
        parser.error(f"--min-tgt-len {args.min_tgt_len} exceeds the longest target, {max_tgt_len} word pieces "
                     "(--max-tgt-len, default the fine-tuning run's max_tgt_len)")
    run = finetuned.run_settings  # what the run evaluated with decides what the command line leaves open
    length_penalty = args.length_penalty if args.length_penalty is not None else run.get("eval_length_penalty", 0.0)
    no_repeat_ngram = args.no_repeat_ngram if args.no_repeat_ngram is not None else run.get("eval_no_repeat_ngram", 3)
    no_repeat_ignore = args.no_repeat_ignore if args.no_repeat_ignore is not None else \
        run.get("eval_no_repeat_ignore", NO_REPEAT_IGNORE)
    try:
        ignore = ignore_ids(finetuned.tokenizer, no_repeat_ignore, "--no-repeat-ignore")
    except ValueError as error:
        parser.error(str(error))
    config = DecodeConfig(args.beam_size, max_tgt_len, args.min_tgt_len, length_penalty, no_repeat_ngram, ignore,
                          not args.no_cache)
    try:
        max_src_len = source_budget(finetuned.model.cfg.max_position_embeddings,
                                    args.max_src_len if args.max_src_len is not None else
                                    finetuned.run_settings.get("max_src_len", 448), max_tgt_len)
    except ValueError as error:
        parser.error(f"--max-tgt-len: {error}")
    try:
        records = read_seq2seq(args.input, targets=False)
    except (ValueError, OSError) as error:
        parser.error(f"--input {args.input}: {error.strerror if isinstance(error, OSError) else error}")
    spaced = writes_lines(Path(args.output))
    model_files = finetuned.meta.get("files") or {path.name: sha256_file(path)
                                                  for path in sorted(Path(args.model).iterdir()) if path.is_file()}
    journal = PredictionJournal(beside(args.output, ".partial.jsonl"), PredictionJournal.fingerprint_of(
        model_files, records, dict(dataclasses.asdict(config), max_src_len=max_src_len, batch_size=args.batch_size,
                                   spaced=spaced)))
    try:
        found = journal.open()
    except ValueError as error:
        parser.error(str(error))
    if found:
        print(f"[decode] {found}", file=sys.stderr, flush=True)
    kept = len(journal.predictions)
    began = time.perf_counter()
    with stop_once():  # its handling included: a second signal does not cut that short
        try:
            predictions, truncated = decode_records(finetuned.model, finetuned.tokenizer, records, config,
                                                    max_src_len, args.batch_size, progress=True, spaced=spaced,
                                                    journal=journal)
        except ValueError as error:  # a record it cannot decode, found before decoding any
            journal.remove()
            parser.error(f"--input {args.input}: {error}")
        except KeyboardInterrupt as stop:
            said, code = describe(stop)
            print(f"\n[decode] {said}: {len(journal.predictions)} of {len(records)} predictions are kept in "
                  f"{journal.path}; the same command continues after them", file=sys.stderr, flush=True)
            sys.exit(code)
    seconds = time.perf_counter() - began
    empty = [number for number, record in enumerate(records, 1) if not record["src"].strip()]
    if empty:
        print(f"[decode] {len(empty)} empty source(s) (record {', '.join(map(str, empty[:5]))}"
              f"{' ...' if len(empty) > 5 else ''}) decoded from [CLS] [SEP] alone, as UniLM's decoder does: the "
              "output keeps one prediction per input")
    if len(predictions) != len(records):
        raise RuntimeError(f"{len(predictions)} predictions for {len(records)} input records; nothing written")
    write_predictions(Path(args.output), records, predictions)
    journal.remove()
    before = f"{len(records) - kept} decoded now, {kept} kept from before; " if kept else ""
    print(f"[decode] {len(records)} inputs in {seconds:.1f}s ({before}{truncated} sources truncated to {max_src_len} "
          f"word pieces) → {args.output}")
    if all(isinstance(r.get("tgt"), str) for r in records):
        scores = score_predictions(finetuned.tokenizer, predictions, [r["tgt"] for r in records])
        write_atomically(metrics_path(args.output),
                              lambda tmp: tmp.write_text(json.dumps(scores, indent=2) + "\n"))
        print("[decode] " + "  ".join(f"{k} {v:.2f}" for k, v in scores.items()) + f" → {metrics_path(args.output)}")


if __name__ == "__main__":
    main()
