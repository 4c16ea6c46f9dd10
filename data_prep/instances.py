"""Training instances from tokenized documents, and their precomputed masking.

Recipes (``--recipe``):
  ``unilm`` — objective per instance drawn from the mix (default 1/3 bidirectional with NSP, 1/3 seq2seq,
              1/6 left-to-right, 1/6 right-to-left); every objective gets cloze masking in spans, as in the paper.
  ``bert``  — bidirectional + NSP only, single masked tokens, as in BERT.
  ``gpt``   — contiguous left-to-right windows of each document, no masking (every next token is a label).

Pairs follow BERT's ``create_instances_from_document``: sentences accumulate up to a target length (a random
shorter one with probability ``short_seq_prob``), A is a random prefix of them, B the rest (true
continuation) or — for NSP, with probability 1/2 — sentences from another document (``is_random_next = 1``):
one of the same chunk, or, for a document alone in its chunk, one of the neighbouring chunk's (the caller's
``other_documents``); with no other document at all, as in BERT, sentences of the same document away from A
and its continuation. The unused sentences go back to the stream. Segments never cross documents except that
random B. Layout: ``[CLS] A [SEP]`` or ``[CLS] A [SEP] B [SEP]``.

Masking (``mask_samples``): 15% (``mask_prob``) of the non-special tokens (at least 1, at most ``max_predictions``,
by default round(mask_prob × max_seq_len), so a full-length sample is masked at that rate too), in spans whose
lengths follow the recipe (``SPAN_LENGTH_PROBS``): unilm 80% single tokens and 20% bigrams or trigrams, never
adjacent (UniLM, Dong et al. 2019), bert single tokens at uniformly chosen positions (BERT, Devlin et al. 2019); of
the masked tokens 80% become [MASK], 10% a random non-special token, 10% stay. Everything random comes from a
generator seeded by (seed, document index, stream), never by process order, so any split of the work gives the
same bytes.
"""
from __future__ import annotations

import bisect
import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from data_prep.shard_format import Objective

RECIPES = ("unilm", "bert", "gpt")
SPAN_LENGTH_PROBS = {"unilm": (0.8, 0.1, 0.1), "bert": (1.0,)}
"""Probability of a masked span of length 1, 2, 3, … in each masked recipe (gpt masks nothing)."""
UNILM_MIX = {Objective.BIDIRECTIONAL: 1 / 3, Objective.SEQ2SEQ: 1 / 3,
             Objective.LEFT_TO_RIGHT: 1 / 6, Objective.RIGHT_TO_LEFT: 1 / 6}


@dataclass(frozen=True)
class MaskingConfig:
    """Cloze masking parameters (recorded in the manifest, resolved for the recipe and the length: `resolved`)."""

    mask_prob: float = 0.15
    """fraction of non-special tokens to predict"""
    max_predictions: int | None = None
    """cap on masked tokens per sample. Null: round(mask_prob × max_seq_len) (19 at 128, 77 at 512 with 0.15), so
    a full-length sample is masked at mask_prob too"""
    span_length_probs: tuple[float, ...] | None = None
    """probability of a masked span of length 1, 2, 3, …. Null: the recipe's (unilm 0.8 / 0.1 / 0.1, bert single
    tokens: `SPAN_LENGTH_PROBS`)"""
    replace_mask: float = 0.8
    """fraction of masked tokens shown as [MASK]"""
    replace_random: float = 0.1
    """fraction shown as a random token (the rest stay unchanged)"""
    whole_word_mask: bool = False
    """mask whole words: a masked span covers every word piece of each word it touches (a piece and its ``##``
    continuations; each CJK character is a word), spans count words, one replacement per word
    (`data_prep.whole_words`)"""

    def __post_init__(self) -> None:
        if not 0 < self.mask_prob < 1:  # NaN fails too
            raise ValueError(f"--mask-prob {self.mask_prob} must be a probability in (0, 1)")
        if self.mask_prob > 0.5:
            raise ValueError(f"--mask-prob {self.mask_prob}: at most 0.5 (spans need unmasked tokens between them)")
        if self.max_predictions is not None and self.max_predictions < 1:
            raise ValueError(f"--max-predictions {self.max_predictions} must be at least 1")
        if self.span_length_probs is not None and abs(sum(self.span_length_probs) - 1) > 1e-6:
            raise ValueError(f"span_length_probs {self.span_length_probs} must sum to 1")
        if self.replace_mask < 0 or self.replace_random < 0 or self.replace_mask + self.replace_random > 1:
            raise ValueError("replace_mask + replace_random must be within [0, 1]")

    @classmethod
    def for_recipe(cls, recipe: str, **settings: Any) -> MaskingConfig:
        """The masking of ``recipe`` with these other settings: its span lengths (``SPAN_LENGTH_PROBS``); gpt's
        config is never used (it masks nothing, and the manifest records no masking)."""
        return cls(span_length_probs=SPAN_LENGTH_PROBS.get(recipe, SPAN_LENGTH_PROBS["unilm"]), **settings)

    def resolved(self, recipe: str, max_seq_len: int) -> MaskingConfig:
        """This masking with its unset values filled in for ``recipe`` at ``max_seq_len`` tokens."""
        return dataclasses.replace(
            self, span_length_probs=self.span_length_probs or SPAN_LENGTH_PROBS.get(recipe, SPAN_LENGTH_PROBS["unilm"]),
            max_predictions=self.max_predictions or default_max_predictions(max_seq_len, self.mask_prob))


@dataclass(frozen=True)
class InstanceConfig:
    """How documents become samples (recorded in the manifest)."""

    recipe: str = "unilm"
    """one of unilm, bert, gpt (the module docstring says what each makes)"""
    max_seq_len: int = 128
    """tokens per sample, [CLS]/[SEP] included"""
    short_seq_prob: float = 0.1
    """share of samples (every objective) built to a random shorter length, as BERT's short_seq_prob"""
    objective_mix: dict[str, float] = field(default_factory=dict)
    """unilm only: objective name → probability (e.g. bidirectional=0.5,seq2seq=0.5 as a flag); empty means the
    recipe's default"""

    def __post_init__(self) -> None:
        if not 0 <= self.short_seq_prob <= 1:  # NaN fails too
            raise ValueError(f"--short-seq-prob {self.short_seq_prob} must be a probability in [0, 1] "
                             "(BERT uses 0.1)")
        if self.recipe not in RECIPES:
            raise ValueError(f"unknown recipe {self.recipe!r}; choose one of {', '.join(RECIPES)}")
        if not 8 <= self.max_seq_len <= 65535:
            raise ValueError(f"--max-seq-len {self.max_seq_len} must be between 8 and 65535")
        if self.objective_mix and self.recipe != "unilm":
            raise ValueError(f"--objective-mix applies to --recipe unilm; {self.recipe} has a fixed objective")
        if self.objective_mix:
            keys = {o.key for o in Objective}
            unknown = sorted(set(self.objective_mix) - keys)
            if unknown:
                raise ValueError(f"--objective-mix: unknown objective(s) {unknown}; use {sorted(keys)}")
            if any(not isinstance(p, (int, float)) or not 0 <= p <= 1 for p in self.objective_mix.values()):  # NaN too
                raise ValueError(f"--objective-mix: proportions must be numbers in [0, 1], got {self.objective_mix}")
            total = sum(self.objective_mix.values())
            if abs(total - 1) > 1e-6:
                raise ValueError(f"--objective-mix: proportions sum to {total:.6g}, they must sum to 1")

    @property
    def mix(self) -> dict[Objective, float]:
        """Objective probabilities actually used."""
        if self.recipe == "bert":
            return {Objective.BIDIRECTIONAL: 1.0}
        if self.recipe == "gpt":
            return {Objective.LEFT_TO_RIGHT: 1.0}
        if self.objective_mix:
            return {o: float(self.objective_mix.get(o.key, 0.0)) for o in Objective}
        return dict(UNILM_MIX)

    @property
    def masked(self) -> bool:
        return self.recipe != "gpt"

    @property
    def min_sentences(self) -> int:
        """Pair recipes need two sentences for A and B; GPT takes any non-empty text."""
        return 1 if self.recipe == "gpt" else 2


def parse_objective_mix(text: str) -> dict[str, float]:
    """``"bidirectional=0.5,seq2seq=0.5"`` → dict; raises ValueError with the expected syntax."""
    mix: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        try:
            if not sep:
                raise ValueError
            mix[key.strip()] = float(value)
        except ValueError:
            raise ValueError(f"--objective-mix {text!r}: expected name=proportion pairs separated by commas, "
                             "e.g. bidirectional=0.5,seq2seq=0.25,left_to_right=0.125,right_to_left=0.125") from None
    return mix


class Uniforms:
    """Random draws for one document from its own generator, fetched in blocks (scalar numpy calls are slow)."""

    def __init__(self, rng: np.random.Generator, block: int = 256):
        self.rng, self.block = rng, block
        self.values: list[float] = []

    def next(self) -> float:
        if not self.values:
            self.values = self.rng.random(self.block).tolist()[::-1]
        return self.values.pop()

    def integer(self, low: int, high: int) -> int:
        """Uniform integer in [low, high)."""
        return low + int(self.next() * (high - low))  # next() < 1, so the result stays below high

    def heads(self, count: int) -> int:
        """How many of `count` fair coin flips come up heads: Binomial(count, 1/2)."""
        return int(self.rng.binomial(count, 0.5))


@dataclass(frozen=True)
class Instance:
    """An unmasked sample: objective, segment A (and B) token ids, NSP label."""

    objective: Objective
    tokens_a: list[int]
    tokens_b: list[int] | None
    is_random_next: int


def _truncate_pair(a: list[int], b: list[int], max_tokens: int, rng: Uniforms) -> tuple[list[int], list[int]]:
    """BERT's truncate_seq_pair: shorten the longer segment, each removed token from the front or back at random."""
    excess = len(a) + len(b) - max_tokens
    if excess <= 0:
        return a, b
    # remove from the longer until equal, then alternately, B first (BERT's loop cuts B on a tie): closed form of
    # the one-token-at-a-time loop
    first = min(excess, abs(len(a) - len(b)))
    rest = excess - first
    cut_a = (first if len(a) > len(b) else 0) + rest // 2
    cut_b = (first if len(b) > len(a) else 0) + (rest + 1) // 2
    return _trim(a, cut_a, rng), _trim(b, cut_b, rng)


def _trim(tokens: list[int], count: int, rng: Uniforms) -> list[int]:
    """`tokens` less `count` of them, each from the front or the back on a coin flip (BERT's loop, in one draw)."""
    if count <= 0:
        return tokens
    front = rng.heads(count)
    return tokens[front:len(tokens) - (count - front)]


class Documents(Protocol):
    """Tokenized documents by index (a list of them, or a view of one): the candidates for an NSP random B."""

    def __len__(self) -> int: ...

    def __getitem__(self, i: int) -> list[list[int]]: ...


def document_instances(sentences: list[list[int]], other_documents: Documents,
                       cfg: InstanceConfig, rng: Uniforms) -> list[Instance]:
    """Instances of one tokenized document (a list of sentences of token ids).

    ``other_documents`` are the candidates for NSP random B (other documents of the same chunk, or of its
    neighbour); when there are none, random B comes from this document, away from A and its continuation.
    """
    if cfg.recipe == "gpt":
        flat = list(itertools.chain.from_iterable(sentences))
        window = cfg.max_seq_len - 2
        return [Instance(Objective.LEFT_TO_RIGHT, flat[i:i + window], None, -1) for i in range(0, len(flat), window)]

    objectives = [o for o, p in cfg.mix.items() if p > 0]
    cumulative = np.cumsum([cfg.mix[o] for o in objectives]).tolist()
    instances: list[Instance] = []

    def draw() -> tuple[Objective, int]:
        objective = objectives[min(bisect.bisect(cumulative, rng.next() * cumulative[-1]), len(objectives) - 1)]
        pair = objective in (Objective.BIDIRECTIONAL, Objective.SEQ2SEQ)
        max_tokens = cfg.max_seq_len - (3 if pair else 2)
        target = rng.integer(2, max_tokens + 1) if rng.next() < cfg.short_seq_prob else max_tokens
        return objective, target

    objective, target = draw()
    current: list[list[int]] = []
    current_length = 0
    i = 0
    while i < len(sentences):
        current.append(sentences[i])
        current_length += len(sentences[i])
        if i == len(sentences) - 1 or current_length >= target:
            i = _emit(current, objective, target, i, sentences, other_documents, cfg, rng, instances)
            current, current_length = [], 0
            objective, target = draw()
        i += 1
    return instances


def _emit(current: list[list[int]], objective: Objective, target: int, i: int, sentences: list[list[int]],
          other_documents: Documents, cfg: InstanceConfig, rng: Uniforms,
          instances: list[Instance]) -> int:
    """Turn the accumulated sentences (``sentences[i + 1 - len(current):i + 1]``) into one instance; returns the
    (possibly rewound) sentence cursor."""
    if objective in (Objective.LEFT_TO_RIGHT, Objective.RIGHT_TO_LEFT):
        flat = list(itertools.chain.from_iterable(current))[: cfg.max_seq_len - 2]
        if flat:
            instances.append(Instance(objective, flat, None, -1))
        return i
    a_end = rng.integer(1, len(current)) if len(current) >= 2 else 1
    tokens_a = list(itertools.chain.from_iterable(current[:a_end]))
    is_random_next = -1
    first = i + 1 - len(current)
    # with no other document, B may start before A (ending where A starts) or after A's true next sentence
    away = first + max(0, len(sentences) - (i + 2))
    if objective == Objective.BIDIRECTIONAL:
        # a fair coin even when A is one long sentence (BERT forces random B then, skewing NSP towards 1)
        is_random_next = int(rng.next() < 0.5)
        if is_random_next and not other_documents and away <= 0:
            is_random_next = 0  # a document too short to draw B away from A: the true continuation
    if is_random_next == 1:
        if other_documents:
            other = other_documents[rng.integer(0, len(other_documents))]
            start, stop = rng.integer(0, len(other)), len(other)
        else:
            other = sentences
            start = rng.integer(0, away)
            start, stop = (start, first) if start < first else (start - first + i + 2, len(sentences))
        target_b = max(1, target - len(tokens_a))
        tokens_b: list[int] = []
        for sentence in other[start:stop]:
            tokens_b.extend(sentence)
            if len(tokens_b) >= target_b:
                break
        i -= len(current) - a_end  # the unused sentences go back to the stream
    else:
        tokens_b = list(itertools.chain.from_iterable(current[a_end:]))
        if not tokens_b:  # one long sentence: split it so B is still its true continuation
            cut = rng.integer(1, len(tokens_a)) if len(tokens_a) >= 2 else 0
            tokens_a, tokens_b = tokens_a[:cut], tokens_a[cut:]
    tokens_a, tokens_b = _truncate_pair(tokens_a, tokens_b, cfg.max_seq_len - 3, rng)
    if tokens_a and tokens_b:
        instances.append(Instance(objective, tokens_a, tokens_b, is_random_next))
    return i


def default_max_predictions(max_seq_len: int, mask_prob: float = 0.15) -> int:
    """The --max-predictions default: ``mask_prob`` of the length, so the cap binds only on the rounding (77 at 512
    with 15 %)."""
    return max(1, round(mask_prob * max_seq_len))


def masking_budget(num_maskable: np.ndarray, cfg: MaskingConfig) -> np.ndarray:
    """Tokens to mask per sample: round(15% of maskable), at least 1, at most max_predictions (None: no cap beyond
    the rate) and maskable."""
    return np.minimum(np.clip(np.rint(num_maskable * cfg.mask_prob).astype(np.int64), 1, cfg.max_predictions),
                      num_maskable)


def random_draws_needed(num_maskable: np.ndarray, cfg: MaskingConfig) -> int:
    """How many uniforms ``mask_samples`` consumes for these samples: 3 per masked token + 1 per maskable one."""
    return int(3 * masking_budget(num_maskable, cfg).sum() + num_maskable.sum())


def mask_samples(tokens: np.ndarray, token_offset: np.ndarray, length: np.ndarray, segment_a_length: np.ndarray,
                 uniforms: np.ndarray, cfg: MaskingConfig, mask_id: int,
                 random_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mask S packed samples at once, in place in ``tokens``; vectorised over all samples.

    tokens: int [T] the samples back to back; token_offset, length, segment_a_length: int [S];
    uniforms: float [random_draws_needed] in [0, 1), laid out per sample as
      (span lengths k | replacement k | random token k | slot keys n), samples concatenated in order, so the
      caller can draw each document's block from that document's own generator (the span-length draws are
      taken under single-token masking too, which reads none: one layout for every recipe).
    Returns (num_masked [S], masked_positions [K] ascending within each sample, masked_labels [K]).
    Spans live in each sample's maskable coordinates (positions without [CLS]/[SEP]), so special tokens are never
    masked, and are placed uniformly at random (stars and bars: the spans and the unmasked tokens in a random
    order). Spans of several tokens (unilm) keep at least one unmasked token between them, so each is a separate
    run; single tokens (bert) may sit side by side, a uniform choice of positions as BERT's.
    """
    if cfg.span_length_probs is None:
        raise ValueError("mask_samples needs the span lengths: MaskingConfig.resolved(recipe, max_seq_len)")
    num_samples = len(length)
    single = segment_a_length == length
    n = length - np.where(single, 2, 3)                       # maskable tokens per sample
    k = masking_budget(n, cfg)                                 # masked tokens per sample
    block = 3 * k + n
    block_start = np.cumsum(block) - block
    sample_of_masked = np.repeat(np.arange(num_samples), k)
    rank = np.arange(k.sum()) - np.repeat(np.cumsum(k) - k, k)  # index of a masked token within its sample
    u_span = uniforms[np.repeat(block_start, k) + rank]
    u_replace = uniforms[np.repeat(block_start + k, k) + rank]
    u_token = uniforms[np.repeat(block_start + 2 * k, k) + rank]

    # span lengths: draw k per sample, keep those starting before the budget, shorten the last to fit exactly
    cumulative = np.cumsum(cfg.span_length_probs)[:-1]
    lengths = 1 + np.searchsorted(cumulative, u_span, side="right")
    ends = np.cumsum(lengths)
    ends -= np.repeat(ends[np.cumsum(k) - k] - lengths[np.cumsum(k) - k], k)  # cumulative within each sample
    starts_at = ends - lengths
    keep = starts_at < k[sample_of_masked]
    span_sample = sample_of_masked[keep]
    span_length = np.minimum(lengths, k[sample_of_masked] - starts_at)[keep]
    num_spans = np.bincount(span_sample, minlength=num_samples)

    # slots: num_spans smallest of (n - k + 1) random keys per sample, in increasing slot order; without a gap
    # between spans, (n - k + num_spans) slots: span i then starts i places earlier
    apart = len(cfg.span_length_probs) > 1
    num_slots = n - k + (1 if apart else num_spans)
    slot_sample = np.repeat(np.arange(num_samples), num_slots)
    slot = np.arange(num_slots.sum()) - np.repeat(np.cumsum(num_slots) - num_slots, num_slots)
    keys = uniforms[np.repeat(block_start + 3 * k, num_slots) + slot]
    order = np.argsort(slot_sample + keys)  # by sample, then key (keys in [0, 1), ties have probability ~0)
    chosen = order[slot < np.repeat(num_spans, num_slots)]  # sorted by sample, so slot is the rank in its sample
    chosen = np.sort(chosen)  # slot order within each sample (indices grow with sample, then slot)
    span_offset = np.cumsum(span_length) - span_length
    span_offset -= np.repeat(span_offset[np.cumsum(num_spans) - num_spans], num_spans)  # within each sample
    span_start = slot[chosen] + span_offset
    if not apart:
        span_start -= np.arange(len(span_sample)) - np.repeat(np.cumsum(num_spans) - num_spans, num_spans)

    within = np.arange(span_length.sum()) - np.repeat(np.cumsum(span_length) - span_length, span_length)
    maskable_index = np.repeat(span_start, span_length) + within
    content_a = np.where(single, n, segment_a_length - 2)[sample_of_masked]
    positions = 1 + maskable_index + (maskable_index >= content_a)  # skip [CLS] and the middle [SEP]
    absolute = token_offset[sample_of_masked] + positions
    return k, positions, replace_masked(tokens, absolute, u_replace, u_token, cfg, mask_id, random_ids)


def replace_masked(tokens: np.ndarray, absolute: np.ndarray, u_replace: np.ndarray, u_token: np.ndarray,
                   cfg: MaskingConfig, mask_id: int, random_ids: np.ndarray) -> np.ndarray:
    """BERT's 80/10/10 at the masked indices ``absolute`` of ``tokens`` (in place): [MASK] where ``u_replace`` <
    ``replace_mask``, a random id picked by ``u_token`` where it falls in the next ``replace_random``, else the
    token kept. Returns the original ids there (the labels), Long[len(absolute)]."""
    labels = tokens[absolute].astype(np.int64)
    shown = labels.copy()
    shown[u_replace < cfg.replace_mask] = mask_id
    use_random = (u_replace >= cfg.replace_mask) & (u_replace < cfg.replace_mask + cfg.replace_random)
    shown[use_random] = random_ids[(u_token[use_random] * len(random_ids)).astype(np.int64)]
    tokens[absolute] = shown
    return labels
