"""Beam search the UniLM way: append [MASK], predict it, put the prediction in its place, repeat.

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
greedy search: no length penalty. `beam_search` also gives the n best hypotheses of each source (n <= beam size).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from pretrain.masks import SEQ2SEQ, build_segment_ids
from pretrain.model import UniLMModel

from .tokenizer import Tokenizer


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
    def of(cls, tokenizer: Tokenizer) -> SpecialIds:
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

    def __init__(self, model: UniLMModel, sources: list[list[int]], special: SpecialIds, device: torch.device):
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
        order = rows.tolist()
        self.sources = [self.sources[r] for r in order]
        self.targets = [list(self.targets[r]) for r in order]

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

    def __init__(self, model: UniLMModel, sources: list[list[int]], special: SpecialIds, device: torch.device):
        self.model, self.special, self.device = model, special, device
        rows, source_width = len(sources), max(map(len, sources))
        self.source_length = torch.tensor([len(s) for s in sources], device=device)  # Long[N]
        self.source_ids = torch.full((rows, source_width), special.pad_id, dtype=torch.long)
        for row, source in enumerate(sources):
            self.source_ids[row, : len(source)] = torch.tensor(source)
        self.source_ids = self.source_ids.to(device)
        self.generated = 0  # target tokens already in the cache or about to enter it
        self.cache: tuple[tuple[torch.Tensor, torch.Tensor], ...] | None = None
        """Per layer (keys, values) Float[N, heads, Lk, head_size]; None before `start`."""
        self.key_valid = torch.zeros(rows, 0, dtype=torch.bool, device=device)  # Bool[N, Lk]: False at source padding

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
        assert self.cache is not None, "reorder after start"
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


def generate(model: UniLMModel, sources: list[list[int]], special: SpecialIds,
             config: DecodeConfig) -> list[Hypothesis]:
    """Best hypothesis per source. `sources`: packed `[CLS] src [SEP]` id lists (one batch)."""
    return [hypotheses[0] for hypotheses in beam_search(model, sources, special, config)]


@torch.no_grad()  # not inference_mode: run mid-training, ZeRO-3 may keep parameters it gathers here
def beam_search(model: UniLMModel, sources: list[list[int]], special: SpecialIds, config: DecodeConfig,
                n_best: int = 1) -> list[list[Hypothesis]]:
    """The `n_best` best hypotheses per source (`n_best` <= `config.beam_size`), best first (equal scores in the
    order they were found, so the first is `generate`'s). `sources`: packed `[CLS] src [SEP]` id lists (one batch).

    With `n_best` > 1 an example is done once its n-th best finished hypothesis scores at least what any alive
    beam could still reach, so the list is what searching to the maximum length would give; the first stays the
    1-best (what finishes after the 1-best search would have stopped scores no higher). A list may be shorter
    than `n_best` where fewer hypotheses exist (a tiny vocabulary or `max_tgt_len`).

    Runs on the model's device: the log-probabilities, the length/n-gram bans, the beam scores and the top-k over
    beams × vocabulary stay there; each step brings only the 2·beam candidates per example (score, row, token) to
    the host for the finished/alive bookkeeping and sends back the chosen rows and tokens."""
    if not 1 <= n_best <= config.beam_size:
        raise ValueError(f"n_best must be in [1, beam_size={config.beam_size}], got {n_best}")
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
        top = total.topk(min(2 * beams, total.shape[1]), dim=1)
        top_scores, top_index = top.values.tolist(), top.indices.tolist()  # [B, 2·beams] candidates, not [B, V]
        next_rows, next_tokens, next_scores = [], [], []
        for example in range(batch_size):
            best = [(example * beams + index // vocab, index % vocab, score)
                    for score, index in zip(top_scores[example], top_index[example])]
            alive = [] if done[example] else \
                _extend(best, hypotheses, finished[example], length, config, special.sep_id)
            done[example] = done[example] or len(finished[example]) >= n_best and (
                nth_best(finished[example], n_best) >= best_reachable(alive, length, config))
            if done[example]:  # keep the batch shape: dummy beams that never win
                alive = []
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
    results = []
    for example in range(batch_size):
        candidates = list(finished[example])
        if not done[example]:  # maximum length reached: unfinished beams compete as they are
            for beam in range(beams):
                score = final_scores[example][beam]
                if score > -math.inf:
                    tokens = hypotheses[example * beams + beam]
                    normalised = score / length_penalty(len(tokens), config.length_penalty)
                    candidates.append(Hypothesis(tokens, score, normalised))
        ranked = sorted(candidates, key=lambda h: h.score, reverse=True)  # stable: ties keep their order
        results.append(ranked[:n_best] or [Hypothesis([], -math.inf, -math.inf)])
    model.train(was_training)
    return results


def _extend(candidates: list[tuple[int, int, float]], hypotheses: list[list[int]], finished: list[Hypothesis],
            length: int, config: DecodeConfig, sep_id: int) -> list[tuple[int, int, float]]:
    """One example's step: of its best (row, token, score) ``candidates`` (2·beam of them, best first), each [SEP]
    among the first beam finishes its row's hypothesis (appended to ``finished``, normalised by the length
    penalty), and the first beam others are the beams that go on (returned)."""
    alive = []
    for rank, (row, token, score) in enumerate(candidates):
        if token == sep_id:
            if rank < config.beam_size and score > -math.inf:
                normalised = score / length_penalty(length, config.length_penalty)
                finished.append(Hypothesis(hypotheses[row], score, normalised))
        else:
            alive.append((row, token, score))
        if len(alive) == config.beam_size:
            break
    return alive


def nth_best(hypotheses: list[Hypothesis], n: int) -> float:
    """The n-th highest score among `hypotheses` (at least n of them)."""
    return sorted((h.score for h in hypotheses), reverse=True)[n - 1]

