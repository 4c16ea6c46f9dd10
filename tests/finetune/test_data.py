"""Data converters (real samples → task files), tokenizer loading, seq2seq packing and target masking."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from finetune.seq2seq import (
    Seq2SeqExample,
    collate,
    encode_examples,
    masked_count,
    pack_and_mask,
    seq2seq_loss,
    x_sep_note,
)
from finetune.task_files import bbc_articles, convert_samples, is_dev, read_jsonl
from finetune.tokenizer import load_tokenizer
from pretrain.hf import load_hf_bert


def test_converters_write_the_task_formats_with_disjoint_deterministic_splits(task_files, samples_dir, tmp_path):
    topic_train = read_jsonl(task_files / "bbc_topic.train.jsonl")
    topic_dev = read_jsonl(task_files / "bbc_topic.dev.jsonl")
    assert {r["label"] for r in topic_train} == {"business", "entertainment", "politics", "sports", "tech"}
    assert 0.05 < len(topic_dev) / (len(topic_train) + len(topic_dev)) < 0.15
    assert not {r["text"] for r in topic_train} & {r["text"] for r in topic_dev}
    # not in the articles' topic order: the first examples of a split (eval_max_examples) hold every class
    every_class = {r["label"] for r in topic_train}
    assert {r["label"] for r in topic_dev[:40]} == {r["label"] for r in topic_train[:40]} == every_class
    headline = read_jsonl(task_files / "bbc_headline.dev.jsonl")[0]
    assert set(headline) == {"src", "tgt"} and len(headline["tgt"]) < len(headline["src"])
    rotten = read_jsonl(task_files / "rotten.train.jsonl")
    assert {r["label"] for r in rotten} == {"fresh", "rotten"}
    assert json.loads((task_files / "squad.json").read_text())["data"]
    convert_samples(samples_dir, tmp_path)  # the same split again
    assert (tmp_path / "bbc_topic.dev.jsonl").read_bytes() == (task_files / "bbc_topic.dev.jsonl").read_bytes()
    key, topic, title, body = next(bbc_articles(samples_dir))
    assert key.startswith(f"bbc/{topic}/") and title and body and is_dev(key, 1.0) and not is_dev(key, 0.0)


def test_read_jsonl_names_the_bad_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok", "label": "a"}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        read_jsonl(path)


def test_read_jsonl_names_a_whole_json_document(tmp_path, samples_dir):
    """A SQuAD file or a JSON array given as a task file: the mistake is named, not line 1's parse error."""
    with pytest.raises(ValueError, match=r"squad.json is a SQuAD JSON file: .*task: qa"):
        read_jsonl(samples_dir / "squad.json")
    array = tmp_path / "records.json"
    array.write_text(json.dumps([{"text": "ok", "label": "a"}, {"text": "no", "label": "b"}], indent=2))
    with pytest.raises(ValueError, match=r"records.json is one JSON document \(an array\), not JSON lines"):
        read_jsonl(array)
    array.write_text(json.dumps([{"text": "ok", "label": "a"}]))  # on one line: a JSON value, not an object
    with pytest.raises(ValueError, match=r"one JSON document \(an array\)"):
        read_jsonl(array)


def test_tokenizer_casing_from_the_model_directory(minilm_dir, tiny_init):
    uncased = load_tokenizer(minilm_dir)
    assert uncased.lowercase and uncased.decode(uncased.encode("Hello World")) == "hello world"
    assert load_tokenizer(tiny_init).mask_id == 4
    with pytest.raises(FileNotFoundError, match="vocab.txt"):
        load_tokenizer(tiny_init / "nowhere")


def test_seq2seq_packing_masks_targets_only_and_sometimes_the_final_sep(tiny_init):
    tokenizer = load_tokenizer(tiny_init)
    example = Seq2SeqExample(source_ids=[10, 11, 12], target_ids=[20, 21])
    final_sep_masked = 0
    for seed in range(50):
        packed = pack_and_mask(example, tokenizer, 0.7, np.random.default_rng(seed))
        assert packed["len_a"] == 5 and len(packed["input_ids"]) == 8
        assert list(packed["input_ids"][:5]) == [tokenizer.cls_id, 10, 11, 12, tokenizer.sep_id]
        positions = packed["masked_positions"]
        assert len(positions) >= 1 and all(5 <= p < 8 for p in positions)
        assert all(packed["input_ids"][p] == tokenizer.mask_id for p in positions)
        original = [tokenizer.cls_id, 10, 11, 12, tokenizer.sep_id, 20, 21, tokenizer.sep_id]
        assert list(packed["masked_labels"]) == [original[p] for p in positions]
        final_sep_masked += 7 in positions
    assert 20 < final_sep_masked < 50  # about 70% of the time


def test_masked_count_is_what_packing_masks(tiny_init):
    tokenizer = load_tokenizer(tiny_init)
    examples = [Seq2SeqExample(source_ids=[10], target_ids=list(range(20, 20 + n))) for n in (0, 1, 3, 9, 30)]
    packed = [pack_and_mask(e, tokenizer, 0.5, np.random.default_rng([7, i])) for i, e in enumerate(examples)]
    count = masked_count(examples, 0.5, [np.random.default_rng([7, i]) for i in range(len(examples))])
    assert count == sum(len(p["masked_positions"]) for p in packed)
    assert count != masked_count(examples, 0.5, [np.random.default_rng([8, i]) for i in range(len(examples))])


def test_special_tokens_in_fine_tuning_text_read_as_transformers_reads_them(minilm_dir):
    """"passage [SEP] answer" keeps its [SEP] (UniLM's question-generation sources), as BertTokenizer keeps it; the
    shard builder's encoder still reads it as plain words."""
    from transformers import AutoTokenizer

    from data_prep.vocab import encoder_of

    ours, theirs = load_tokenizer(minilm_dir), AutoTokenizer.from_pretrained(str(minilm_dir))
    texts = ["The dam was finished in 1936. [SEP] 1936", "a [CLS] b [MASK] c [PAD] [UNK] d", "no [sep] here",
             "Plain text, with no special tokens."]
    for text in texts:
        assert ours.encode(text) == theirs(text, add_special_tokens=False)["input_ids"], text
    assert ours.encode(texts[0]).count(ours.sep_id) == 1
    assert ours.sep_id not in encoder_of(ours.vocab, ours.lowercase).encode(texts[0]).ids


def test_unilm_sentence_separator_is_one_word_piece_it_decodes_and_scores_as(minilm_dir, tiny_init, tmp_path):
    """UniLM's CNN/DM targets join sentences with " [X_SEP] ", which its code reads as [unused1] of BERT's
    vocabulary: a model learns to write it, decoding prints it, and scoring reads it as a sentence break."""
    from finetune.generation import score_predictions

    reference = "Police arrested two men in London. [X_SEP] The men were charged with fraud. [X_SEP] They deny it"
    bert = load_tokenizer(minilm_dir)
    ids = bert.encode(reference)
    assert bert.x_sep_id == bert.vocab.tokens.index("[unused1]") and ids.count(bert.x_sep_id) == 2
    assert len(ids) == len(bert.encode(reference.replace(" [X_SEP]", ""))) + 2  # one word piece each
    assert bert.decode(ids).startswith("police arrested two men in london. [X_SEP] the men")
    assert bert.decode(ids, spaced=True).startswith("police arrested two men in london . [X_SEP] the men")
    for spaced in (False, True):
        scores = score_predictions(bert, [bert.decode(ids, spaced)], [reference])
        assert scores["rougeLsum"] == pytest.approx(100) and scores["bleu"] == pytest.approx(100), spaced
    assert x_sep_note([{"src": "a", "tgt": reference}], bert) is None

    own = tmp_path / "vocab.txt"  # a vocabulary with its own [X_SEP] entry reads it as that one
    own.write_text((tiny_init / "vocab.txt").read_text() + "[X_SEP]\n")
    with_entry = load_tokenizer(own, lowercase=True)
    assert with_entry.encode("a . [X_SEP] b")[2] == with_entry.vocab.size - 1 == with_entry.x_sep_id

    without = load_tokenizer(tiny_init)  # neither entry: read as words, and a run is told so
    assert without.x_sep_id is None and len(without.encode("[X_SEP]")) > 1
    assert "[unused1]" in x_sep_note([{"src": "a", "tgt": reference}], without)
    assert x_sep_note([{"src": "a", "tgt": "no separator"}], without) is None


def test_lone_surrogates_in_fine_tuning_text_are_dropped_as_shard_building_drops_them(minilm_dir, tmp_path):
    """JSON allows "\\ud83d", the first half of an emoji cut off by a scraper; the encoder refuses such a string."""
    path = tmp_path / "headlines.jsonl"
    path.write_text('{"src": "Fans cheer as the final whistle blows \\ud83d", "tgt": "Final whistle \\ud83d\\ude00"}\n'
                    '{"src": "Markets rise", "tgt": "\\udc00 Markets up"}\n', encoding="utf-8")
    records = read_jsonl(path)
    assert "\ud83d" in records[0]["src"]
    tokenizer = load_tokenizer(minilm_dir)
    examples, _ = encode_examples(records, tokenizer, max_src_len=32, max_tgt_len=16, max_positions=128)
    assert examples[0].source_ids == tokenizer.encode("Fans cheer as the final whistle blows")
    assert examples[1].target_ids == tokenizer.encode("Markets up")
    context = "Kickoff \ud83d at noon."
    ids, offsets = tokenizer.encode_with_offsets(context)
    assert ids == tokenizer.encode("Kickoff at noon.")
    assert [context[start:end] for start, end in offsets] == ["Kickoff", "at", "noon", "."]  # offsets into `context`


def test_seq2seq_encoding_truncates_and_counts_and_rejects_empty_fields(tiny_init):
    tokenizer = load_tokenizer(tiny_init)
    records = [{"src": "the market rose sharply " * 20, "tgt": "shares up"}, {"src": "short", "tgt": "x " * 30}]
    examples, counts = encode_examples(records, tokenizer, max_src_len=16, max_tgt_len=8, max_positions=512)
    assert (counts.sources, counts.targets) == (1, 1)
    assert len(examples[0].source_ids) == 16 and len(examples[1].target_ids) == 8
    with pytest.raises(ValueError, match="record 2 has an empty or missing 'tgt'"):
        encode_examples([records[0], {"src": "a", "tgt": " "}], tokenizer, 16, 8, 512, where="train.jsonl")


def test_seq2seq_sources_are_cut_only_as_far_as_the_pair_needs(tiny_init):
    """UniLM's truncation: `[CLS] src [SEP] tgt [SEP]` fits the positions; a short target leaves the source the
    rest of them, up to max_src_len."""
    tokenizer = load_tokenizer(tiny_init)
    long_source = "the market rose sharply " * 30
    records = [{"src": long_source, "tgt": "shares up"}, {"src": long_source, "tgt": "shares " * 40}]
    examples, counts = encode_examples(records, tokenizer, max_src_len=100, max_tgt_len=30, max_positions=64)
    short_target = len(tokenizer.encode("shares up"))
    assert [len(e.target_ids) for e in examples] == [short_target, 30]
    assert [len(e.source_ids) for e in examples] == [64 - 3 - short_target, 64 - 3 - 30]
    assert (counts.sources, counts.targets) == (2, 1)
    examples, _ = encode_examples(records, tokenizer, max_src_len=20, max_tgt_len=30, max_positions=64)
    assert [len(e.source_ids) for e in examples] == [20, 20]  # max_src_len still caps
    with pytest.raises(ValueError, match="max_tgt_len 61 leaves no source word piece .* lower it to at most 60"):
        encode_examples(records, tokenizer, max_src_len=20, max_tgt_len=61, max_positions=64)


def test_seq2seq_loss_is_label_smoothed_cross_entropy_at_masked_positions(tiny_init):
    tokenizer = load_tokenizer(tiny_init)
    model = load_hf_bert(tiny_init)
    examples, _ = encode_examples([{"src": "shares in the firm rose", "tgt": "firm shares rise"},
                                   {"src": "the match ended in a draw today", "tgt": "draw"}], tokenizer, 32, 8, 512)
    batch = collate([pack_and_mask(e, tokenizer, 0.7, np.random.default_rng(i)) for i, e in enumerate(examples)],
                    tokenizer.pad_id)
    loss = seq2seq_loss(model, batch, label_smoothing=0.1)
    assert torch.isfinite(loss) and loss.item() > 0
    loss.backward()
    assert model.embeddings.segment.weight.grad[5].abs().sum() > 0  # the target segment (5) is trained
    assert model.embeddings.segment.weight.grad[0].abs().sum() == 0  # no bidirectional segment in seq2seq
    no_smoothing = seq2seq_loss(model, batch, label_smoothing=0.0)
    assert not torch.allclose(no_smoothing, loss)


def test_seq2seq_fine_tuning_then_decoding_reproduces_memorised_targets(tiny_init):
    """The whole generation path end to end: pack → mask → loss → train, then UniLM decoding (cache and no cache)."""
    from finetune.beam import DecodeConfig, SpecialIds, generate
    from finetune.generation import pack_source
    from finetune.seq2seq import Seq2SeqModel

    torch.manual_seed(0)
    tokenizer, backbone = load_tokenizer(tiny_init), load_hf_bert(tiny_init)
    records = [{"src": "shares in the bank rose after profits beat forecasts", "tgt": "bank profits beat forecasts"},
               {"src": "the team won the cup final after extra time", "tgt": "team wins cup"},
               {"src": "the new phone will go on sale next month in europe", "tgt": "phone on sale next month"}]
    examples, _ = encode_examples(records, tokenizer, 64, 16, 512)
    model = Seq2SeqModel(backbone, label_smoothing=0.0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(200):
        batch = collate([pack_and_mask(e, tokenizer, 0.7, np.random.default_rng([step, i]))
                         for i, e in enumerate(examples)], tokenizer.pad_id)
        loss = model(**batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    sources = [pack_source(tokenizer, r["src"], 64)[0] for r in records]
    for use_cache in (True, False):
        config = DecodeConfig(beam_size=2, max_tgt_len=10, use_cache=use_cache)
        decoded = [tokenizer.decode(h.tokens) for h in generate(backbone, sources, SpecialIds.of(tokenizer), config)]
        assert decoded == [r["tgt"] for r in records]


def test_a_test_split_is_held_out_from_train_and_leaves_dev_unchanged(task_files, samples_dir, tmp_path):
    counts = convert_samples(samples_dir, tmp_path, dev_fraction=0.1, test_fraction=0.1)
    assert (tmp_path / "bbc_headline.dev.jsonl").read_bytes() == (task_files / "bbc_headline.dev.jsonl").read_bytes()
    splits = {name: {r["src"] for r in read_jsonl(tmp_path / f"bbc_headline.{name}.jsonl")}
              for name in ("train", "dev", "test")}
    assert not splits["train"] & splits["test"] and not splits["dev"] & splits["test"]
    assert 0.05 < counts["bbc_headline.test"] / sum(len(s) for s in splits.values()) < 0.15
    without = {r["src"] for r in read_jsonl(task_files / "bbc_headline.train.jsonl")}
    assert without == splits["train"] | splits["test"]  # the test articles come out of train only
    with pytest.raises(ValueError, match="sum < 1"):
        convert_samples(samples_dir, tmp_path, dev_fraction=0.5, test_fraction=0.5)
