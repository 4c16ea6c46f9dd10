"""Decoding: cache vs no-cache identity, trigram blocking, beam vs greedy, length limits (tiny models)."""
from __future__ import annotations

import math

import pytest
import torch

from finetune.beam import (
    CachedStepper,
    DecodeConfig,
    FullStepper,
    SpecialIds,
    block_repeated_ngrams,
    generate,
    length_penalty,
)
from finetune.generation import ignore_ids
from finetune.tokenizer import load_tokenizer
from pretrain.model import ModelConfig, UniLMModel, build_model

SPECIAL = SpecialIds(cls_id=2, sep_id=3, mask_id=4, pad_id=0)
VOCAB = 40


def tiny_random_model(seed: int = 0) -> torch.nn.Module:
    """A 2-layer model with large random weights, so next-token distributions are peaked (no near-ties)."""
    torch.manual_seed(seed)
    model = build_model(ModelConfig(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4,
                                    intermediate_size=64, max_position_embeddings=96))
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0.0, 0.3)
    return model.eval()


def sources(lengths: list[int], seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [[SPECIAL.cls_id, *torch.randint(5, VOCAB, (n,), generator=generator).tolist(), SPECIAL.sep_id]
            for n in lengths]


def test_cached_log_probs_equal_full_recompute_step_by_step():
    model = tiny_random_model()
    rows = sources([3, 9, 6])
    forced = torch.randint(5, VOCAB, (3, 6), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        cpu = torch.device("cpu")
        cached, full = CachedStepper(model, rows, SPECIAL, cpu), FullStepper(model, rows, SPECIAL, cpu)
        torch.testing.assert_close(cached.start(), full.start(), atol=1e-5, rtol=1e-5)
        for step in range(forced.shape[1]):
            if step == 3:  # beam reordering (rows duplicated and permuted) keeps them in step
                order = torch.tensor([2, 0, 2])
                cached.reorder(order)
                full.reorder(order)
                forced = forced[order]
            torch.testing.assert_close(cached.step(forced[:, step]), full.step(forced[:, step]), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("beam_size", [1, 4])
@pytest.mark.parametrize("no_repeat_ngram", [3, 1, 0])
def test_cache_and_no_cache_give_identical_outputs(beam_size, no_repeat_ngram):
    model = tiny_random_model()
    batch = sources([4, 11, 7, 2])
    outputs = {}
    for use_cache in (True, False):
        config = DecodeConfig(beam_size=beam_size, max_tgt_len=12, min_tgt_len=2, length_penalty=0.6,
                              no_repeat_ngram=no_repeat_ngram, use_cache=use_cache)
        outputs[use_cache] = generate(model, batch, SPECIAL, config)
    assert [h.tokens for h in outputs[True]] == [h.tokens for h in outputs[False]]
    for cached, full in zip(outputs[True], outputs[False]):
        assert cached.score == pytest.approx(full.score, abs=1e-4)
    assert all(len(h.tokens) >= 2 for h in outputs[True])  # min length held (the [SEP] is not counted)


def test_batched_beam_search_equals_one_example_at_a_time():
    model = tiny_random_model(seed=3)
    batch = sources([5, 13, 2], seed=4)
    config = DecodeConfig(beam_size=3, max_tgt_len=10)
    together = generate(model, batch, SPECIAL, config)
    alone = [generate(model, [source], SPECIAL, config)[0] for source in batch]
    assert [h.tokens for h in together] == [h.tokens for h in alone]


# ---- a crafted bigram "model": P(next | previous token) from a table, through the same stepper interface
class BigramModel(torch.nn.Module):
    """hidden at a query = one-hot of the nearest visible token to its left; logits = a log-prob table row.

    It honours attention masks, position ids and the key/value cache layout of `pretrain.model`, so both
    steppers drive it exactly like the real model.
    """

    def __init__(self, log_table: torch.Tensor):
        super().__init__()
        self.log_table = torch.nn.Parameter(log_table, requires_grad=False)

    def encode(self, input_ids, segment_ids, attention_mask, position_ids=None, past_key_values=None, use_cache=False):
        rows, width = input_ids.shape
        past = 0 if past_key_values is None else past_key_values[0][0].shape[2]
        if position_ids is None:
            position_ids = torch.arange(past, past + width).expand(rows, width)
        key_ids, key_positions = input_ids.float()[:, None, :, None], position_ids.float()[:, None, :, None]
        if past_key_values is not None:
            key_ids = torch.cat([past_key_values[0][0], key_ids], dim=2)
            key_positions = torch.cat([past_key_values[0][1], key_positions], dim=2)
        ids, positions = key_ids[:, 0, :, 0].long(), key_positions[:, 0, :, 0]
        visible = attention_mask & (positions[:, None, :] < position_ids[:, :, None])
        nearest = torch.where(visible, positions[:, None, :], -1.0).argmax(dim=2)
        hidden = torch.nn.functional.one_hot(ids.gather(1, nearest), self.log_table.shape[0]).float()
        return (hidden, ((key_ids, key_positions),)) if use_cache else hidden

    encode_objective = UniLMModel.encode_objective  # the real masks and segment ids, through `encode` above

    def mlm_logits(self, hidden):
        return hidden @ self.log_table


def bigram(transitions: dict[int, dict[int, float]], vocab: int = 12) -> BigramModel:
    table = torch.full((vocab, vocab), 1e-9)
    for previous, following in transitions.items():
        for token, p in following.items():
            table[previous, token] = p
    return BigramModel(table.log())


def test_beam_finds_a_higher_scoring_sequence_than_greedy():
    # greedy: 5 (0.6), then 12 (0.4, the best single choice), then [SEP]: 0.24; beam: 6 (0.4) then [SEP]: 0.4
    model = bigram({3: {5: 0.6, 6: 0.4}, 5: {7: 0.1, 8: 0.1, 9: 0.1, 10: 0.1, 11: 0.1, 3: 0.1, 12: 0.4}, 12: {3: 1.0},
                    6: {3: 1.0}, 7: {3: 1.0}, 8: {3: 1.0}, 9: {3: 1.0}, 10: {3: 1.0}, 11: {3: 1.0}}, vocab=13)
    batch = [[2, 7, 3]]
    for use_cache in (True, False):
        greedy = generate(model, batch, SPECIAL, DecodeConfig(beam_size=1, max_tgt_len=5, use_cache=use_cache))[0]
        beam = generate(model, batch, SPECIAL, DecodeConfig(beam_size=3, max_tgt_len=5, use_cache=use_cache))[0]
        assert greedy.tokens == [5, 12] and beam.tokens == [6]
        assert beam.log_prob == pytest.approx(math.log(0.4), abs=1e-5)
        assert beam.log_prob > greedy.log_prob


@pytest.mark.parametrize("n", [3, 2, 1])
def test_ngram_blocking_leaves_no_repeated_ngram(n):
    # a model that loops 5 6 7 5 6 7 ... and never ends; 20 rare tokens leave room for 15 distinct word pieces
    loop = {3: {5: 1.0}, 5: {6: 0.9, 8: 0.1}, 6: {7: 0.9, 9: 0.1}, 7: {5: 0.9, 10: 0.1},
            8: {5: 0.5, 6: 0.5}, 9: {7: 0.5, 5: 0.5}, 10: {6: 0.5, 7: 0.5}}
    rare = {token: 1e-4 for token in range(12, 32)}
    model = bigram({previous: {**rare, **loop.get(previous, {})} for previous in [3, *range(5, 32)]}, vocab=32)
    batch = [[2, 11, 3], [2, 11, 11, 3]]
    unblocked = generate(model, batch, SPECIAL, DecodeConfig(beam_size=2, max_tgt_len=15, no_repeat_ngram=0))
    assert has_repeated_ngram(unblocked[0].tokens, 3)  # the test has teeth
    for beam_size in (1, 3):
        for use_cache in (True, False):
            config = DecodeConfig(beam_size=beam_size, max_tgt_len=15, no_repeat_ngram=n, use_cache=use_cache)
            for hypothesis in generate(model, batch, SPECIAL, config):
                assert len(hypothesis.tokens) == 15 and not has_repeated_ngram(hypothesis.tokens, n)


def has_repeated_ngram(tokens: list[int], n: int) -> bool:
    ngrams = [tuple(tokens[i: i + n]) for i in range(len(tokens) - n + 1)]
    return len(ngrams) != len(set(ngrams))


def test_block_repeated_ngrams_bans_exactly_the_repeating_tokens():
    hypotheses = [[1, 2, 3, 1, 2], [1, 2, 4, 1, 2, 5, 2], []]
    expected = {3: [[3], [], []], 2: [[3], [4, 5], []], 1: [[1, 2, 3], [1, 2, 4, 5], []]}
    for n, banned in expected.items():
        log_probs = torch.zeros(3, 10)
        block_repeated_ngrams(log_probs, hypotheses, n)
        assert [torch.isinf(row).nonzero().flatten().tolist() for row in log_probs] == banned, n
    with pytest.raises(ValueError, match="no_repeat_ngram"):
        DecodeConfig(no_repeat_ngram=-1)


def test_blocking_exempts_the_ignored_word_pieces_as_unilm_does():
    dot = 21
    hypotheses = [[20, dot, 22, dot, 9, 20, dot],  # "u . s . x u ." : a second "u . s" may follow
                  [5, 6, dot, 7, 5, 6],  # "." after "5 6" again is never blocked
                  [5, 6, 7, 5, 6]]  # no "." involved: 7 is blocked as before
    for ignore, banned in ((frozenset(), [[22], [dot], [7]]), (frozenset({dot}), [[], [], [7]])):
        log_probs = torch.zeros(3, 30)
        block_repeated_ngrams(log_probs, hypotheses, 3, ignore)
        assert [torch.isinf(row).nonzero().flatten().tolist() for row in log_probs] == banned, ignore
    log_probs = torch.zeros(1, 30)
    block_repeated_ngrams(log_probs, [[5, dot, 6]], 1, frozenset({dot}))  # n = 1: every word piece but "."
    assert torch.isinf(log_probs[0]).nonzero().flatten().tolist() == [5, 6]


def test_ignored_word_pieces_are_named_from_the_vocabulary(tiny_init, minilm_dir):
    tokenizer = load_tokenizer(tiny_init)
    assert ignore_ids(tokenizer, ".", "x") == {tokenizer.vocab.tokens.index(".")}
    assert ignore_ids(tokenizer, "", "x") == frozenset()
    with pytest.raises(ValueError, match=r"--no-repeat-ignore: \['\[EOS\]'\] not in the vocabulary"):
        ignore_ids(tokenizer, ".|[EOS]", "--no-repeat-ignore")
    # UniLM's CNN/DM setting: [X_SEP] is [unused1] in a BERT vocabulary; one without it never writes it
    assert ignore_ids(tokenizer, ".|[X_SEP]", "x") == {tokenizer.vocab.tokens.index(".")}
    bert = load_tokenizer(minilm_dir)
    assert ignore_ids(bert, ".|[X_SEP]", "x") == {bert.vocab.tokens.index("."), bert.vocab.tokens.index("[unused1]")}


def test_beam_size_1_is_greedy_whatever_the_length_penalty():
    # after 5: [SEP] 0.45 beats 6 (0.44), whose sure continuation 6 7 8 [SEP] a length penalty would prefer
    model = bigram({3: {5: 1.0}, 5: {3: 0.45, 6: 0.44, 9: 0.11}, 6: {7: 1.0}, 7: {8: 1.0}, 8: {3: 1.0}, 9: {3: 1.0}})
    for alpha in (0.0, 0.6, 1.0):
        for use_cache in (True, False):
            config = DecodeConfig(beam_size=1, max_tgt_len=8, no_repeat_ngram=0, length_penalty=alpha,
                                  use_cache=use_cache)
            best = generate(model, [[2, 9, 3]], SPECIAL, config)[0]
            assert best.tokens == [5] and best.log_prob == pytest.approx(math.log(0.45), abs=1e-4), (alpha, use_cache)
    wider = generate(model, [[2, 9, 3]], SPECIAL, DecodeConfig(beam_size=2, max_tgt_len=8, no_repeat_ngram=0,
                                                               length_penalty=1.0))[0]
    assert wider.tokens == [5, 6, 7, 8]  # the penalty does rank a beam's hypotheses


def test_search_goes_on_until_no_alive_beam_can_beat_the_best_finished_one():
    # beam 2: [6] [SEP] finishes at step 2 (probability 0.1), and [5 7] [SEP] (0.081) at step 3, two finished
    # hypotheses; but [5 7 8] [SEP] (0.729) is still alive and wins, as searching to the maximum length finds
    model = bigram({3: {5: 0.9, 6: 0.1}, 6: {3: 1.0}, 5: {7: 0.9, 3: 0.1}, 7: {8: 0.9, 3: 0.1}, 8: {3: 1.0}})
    for length_penalty_alpha in (0.0, 1.0):
        for use_cache in (True, False):
            config = DecodeConfig(beam_size=2, max_tgt_len=8, no_repeat_ngram=0, length_penalty=length_penalty_alpha,
                                  use_cache=use_cache)
            best = generate(model, [[2, 9, 3]], SPECIAL, config)[0]
            assert best.tokens == [5, 7, 8], (length_penalty_alpha, use_cache)
            assert best.log_prob == pytest.approx(math.log(0.9 ** 3), abs=1e-4)


def test_special_tokens_other_than_sep_are_never_generated():
    """A model that prefers [CLS], [MASK], [PAD] and [UNK] still writes words: a special token would vanish from the
    text while filling the length budget and hiding repeats from n-gram blocking."""
    special = SpecialIds(cls_id=2, sep_id=3, mask_id=4, pad_id=0, unk_id=1)
    favourites = {0: 0.2, 1: 0.2, 2: 0.2, 4: 0.2}
    model = bigram({t: {**favourites, 5: 0.1, 6: 0.05, 3: 0.05} for t in range(12)})
    for beam_size in (1, 3):
        for use_cache in (True, False):
            best = generate(model, [[2, 7, 3]], special, DecodeConfig(beam_size=beam_size, max_tgt_len=4,
                                                                      use_cache=use_cache))[0]
            assert best.tokens and not set(best.tokens) & {0, 1, 2, 4}, best.tokens


def test_bert_placeholder_entries_are_never_generated_but_the_one_standing_for_x_sep(tmp_path):
    """BERT's `[unusedN]` entries: no text is read as one, so no target holds one, and a generated one would print
    as "[unused0]"; `[unused1]`, UniLM's sentence separator, stays (a CNN/DailyMail model writes it)."""
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[unused0]", "[unused1]", "[unused2]", "[UNK]", "[CLS]", "[SEP]", "[MASK]",
                                "the", "cat", "sat", "mat"]) + "\n")
    tokenizer = load_tokenizer(vocab)
    assert not {1, 3} & set(tokenizer.encode("[unused0] the [unused2]")) and tokenizer.encode("[X_SEP]") == [2]
    special = SpecialIds.of(tokenizer)
    assert special.unused_ids == (1, 3) and 2 not in special.never_generated
    model = bigram({t: {1: 0.3, 3: 0.3, 2: 0.2, 9: 0.1, 6: 0.1} for t in range(12)})
    for beam_size in (1, 3):
        for use_cache in (True, False):
            best = generate(model, [[5, 8, 6]], special, DecodeConfig(beam_size=beam_size, max_tgt_len=3,
                                                                      no_repeat_ngram=0, use_cache=use_cache))[0]
            assert best.tokens and best.tokens[0] == 2 and not {1, 3} & set(best.tokens), (beam_size, use_cache)
    assert tokenizer.decode([2, 9]) == "[X_SEP] cat"


def test_min_and_max_length_and_length_penalty():
    model = bigram({3: {3: 0.9, 5: 0.1}, 5: {3: 0.9, 6: 0.1}, 6: {3: 0.9, 5: 0.1}})
    short = generate(model, [[2, 7, 3]], SPECIAL, DecodeConfig(beam_size=2, max_tgt_len=6, min_tgt_len=0))[0]
    assert short.tokens == []
    longer = generate(model, [[2, 7, 3]], SPECIAL, DecodeConfig(beam_size=2, max_tgt_len=6, min_tgt_len=3))[0]
    assert len(longer.tokens) == 3
    capped = generate(model, [[2, 7, 3]], SPECIAL, DecodeConfig(beam_size=2, max_tgt_len=2, min_tgt_len=2))[0]
    assert len(capped.tokens) == 2  # stopped at the maximum before any [SEP]
    assert length_penalty(1, 0.0) == 1.0 and length_penalty(7, 1.0) == pytest.approx(2.0)
    with pytest.raises(ValueError):
        DecodeConfig(beam_size=0)
