"""The shard builder on real text: determinism, masking statistics, recipes, document boundaries, bad input."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from data_prep import build, report
from data_prep.chunks import _middle, iter_chunks
from data_prep.inspect import shard_statistics
from data_prep.shard_format import Objective, ShardDataset
from data_prep.sources import ReadOptions, Unit
from data_prep.vocab import load_encoder, load_vocab
from shard_builds import build_error, build_three_ways, directory_bytes, logged, run_build


def restored(sample) -> np.ndarray:
    """Input ids with the original tokens put back at the masked positions."""
    ids = sample.input_ids.copy()
    ids[sample.masked_positions] = sample.masked_labels
    return ids


def test_byte_identical_for_any_workers_or_builders(samples_dir, vocab_file, tmp_path):
    common = ["--input", samples_dir / "news/lee.txt", "--vocab", vocab_file, "--max-seq-len", 64, "--seed", 7,
              "--chunk-chars", 40_000, "--samples-per-shard", 300, "--dupe-factor", 2]
    one = build_three_ways(common, tmp_path)
    assert len(one["shards"]) >= 3 and one["documents"]["read"] == 300
    reference = directory_bytes(tmp_path / "one")
    run_build(*common[:-6], "--seed", 8, *common[-6:], "--out", tmp_path / "other_seed")
    assert directory_bytes(tmp_path / "other_seed")["shard-00000.bin"] != reference["shard-00000.bin"]


def test_finalize_refuses_missing_builders(samples_dir, vocab_file, tmp_path):
    args = ["--input", samples_dir / "news/lee.txt", "--vocab", vocab_file, "--num-builders", 3, "--builder-index", 1,
            "--out", tmp_path]
    build.main([str(a) for a in args] + ["--quiet"])
    assert not (tmp_path / "manifest.json").exists()
    assert "builder(s) [0, 2] of 3 have not finished" in build_error("--finalize", "--out", tmp_path)


def test_builders_of_another_split_are_cleared_and_the_new_split_finalizes(samples_dir, vocab_file, tmp_path):
    common = ["--input", samples_dir / "news/lee.txt", "--vocab", vocab_file, "--chunk-chars", 40_000,
              "--out", tmp_path / "o", "--quiet"]
    build.main([str(a) for a in common] + ["--num-builders", "2", "--builder-index", "0"])
    for index in range(3):
        build.main([str(a) for a in common] + ["--num-builders", "3", "--builder-index", str(index)])
    build.main(["--finalize", "--out", str(tmp_path / "o")])
    assert (tmp_path / "o" / "manifest.json").is_file()


def test_masking_statistics(unilm_shards):
    stats = shard_statistics(ShardDataset(unilm_shards))
    assert stats["masked_fraction"] == pytest.approx(0.15, abs=0.01)
    assert stats["replacement"]["mask"] == pytest.approx(0.8, abs=0.02)
    assert stats["replacement"]["random"] == pytest.approx(0.1, abs=0.015)
    assert stats["replacement"]["keep"] == pytest.approx(0.1, abs=0.015)
    spans = stats["span_lengths"]
    assert set(spans) <= {"1", "2", "3"}
    # 80% of spans are drawn single; shrinking the last span to the exact budget adds a little
    assert spans["1"] / sum(spans.values()) == pytest.approx(0.8, abs=0.03)
    assert spans["3"] / sum(spans.values()) > 0.06  # trigrams exist (some become bigrams when shrunk)
    assert stats["special_tokens_masked"] == 0


def test_samples_never_leak_labels_or_mask_specials(unilm_shards):
    ds = ShardDataset(unilm_shards)
    special = ds.special_tokens
    max_predictions = ds.manifest["masking"]["max_predictions"]
    shown_equal = total = 0
    for sample in ds:
        ids, positions, labels = sample.input_ids, sample.masked_positions, sample.masked_labels
        structural = {0, sample.segment_a_length - 1, sample.length - 1}
        assert ids[0] == special["cls"] and ids[sample.segment_a_length - 1] == special["sep"]
        assert ids[-1] == special["sep"]
        assert 1 <= len(positions) <= max_predictions and np.all(np.diff(positions) > 0)
        assert not structural & set(positions.tolist())
        assert not set(labels.tolist()) & set(special.values()) - {special["unk"]}
        unmasked = np.ones(sample.length, bool)
        unmasked[positions] = False
        assert not np.any(ids[unmasked] == special["mask"])  # [MASK] only where a label is hidden
        content = np.delete(np.arange(sample.length), sorted(structural))
        assert not np.isin(ids[content], [special["cls"], special["sep"], special["pad"]]).any()
        shown_equal += int((ids[positions] == labels).sum())
        total += len(positions)
    assert shown_equal / total == pytest.approx(0.1, abs=0.015)  # only the 10% kept tokens show their label


def test_objective_proportions_and_nsp(unilm_shards, bert_shards):
    unilm = ShardDataset(unilm_shards)
    counts = unilm.manifest["objective_counts"]
    total = sum(counts.values())
    mix = {"bidirectional": 1 / 3, "seq2seq": 1 / 3, "left_to_right": 1 / 6, "right_to_left": 1 / 6}
    for key, expected in mix.items():
        assert counts[key] / total == pytest.approx(expected, abs=0.03), key
    for sample in unilm:
        single = sample.objective in (Objective.LEFT_TO_RIGHT, Objective.RIGHT_TO_LEFT)
        assert (sample.segment_a_length == sample.length) == single
        assert (sample.is_random_next == -1) == (sample.objective != Objective.BIDIRECTIONAL)
    bert = ShardDataset(bert_shards)
    labels = np.array([s.is_random_next for s in bert])
    assert set(labels.tolist()) == {0, 1} and labels.mean() == pytest.approx(0.5, abs=0.03)
    assert all(s.objective == Objective.BIDIRECTIONAL for s in bert)


def test_objective_mix_override(samples_dir, vocab_file, tmp_path):
    manifest = run_build("--input", samples_dir / "news/lee.txt", "--vocab", vocab_file, "--max-seq-len", 64,
                         "--objective-mix", "seq2seq=0.75,right_to_left=0.25", "--out", tmp_path)
    counts = manifest["objective_counts"]
    assert counts["bidirectional"] == counts["left_to_right"] == 0
    assert counts["seq2seq"] / manifest["num_samples"] == pytest.approx(0.75, abs=0.05)


def test_segments_never_cross_documents_except_random_next(minilm_dir, tmp_path):
    words = ["apple", "river", "stone", "cloud", "green", "house", "music", "paper", "table", "water", "light", "horse"]
    corpus = tmp_path / "marked.jsonl"
    with open(corpus, "w") as f:
        for word in words:
            f.write(json.dumps({"text": " ".join(f"{word.title()} {word} {word} {word}." for _ in range(60))}) + "\n")
    out = tmp_path / "out"
    run_build("--input", corpus, "--vocab", minilm_dir / "vocab.txt", "--uncased", "--max-seq-len", 48,
              "--out", out)
    ds = ShardDataset(out)
    vocab = load_vocab(minilm_dir / "vocab.txt")
    word_ids = {vocab.tokens.index(w) for w in words}
    random_next = 0
    for sample in ds:
        ids = restored(sample)
        segment_a = set(ids[1:sample.segment_a_length - 1].tolist()) & word_ids
        assert len(segment_a) == 1
        if sample.segment_a_length < sample.length:
            segment_b = set(ids[sample.segment_a_length:-1].tolist()) & word_ids
            assert len(segment_b) == 1
            assert (segment_a != segment_b) == (sample.is_random_next == 1)
            random_next += sample.is_random_next == 1
    assert random_next > 10


def test_gpt_is_contiguous_and_unmasked(gpt_shards, small_corpus, vocab_file):
    ds = ShardDataset(gpt_shards)
    assert ds.manifest["masking"] is None and ds.manifest["objective_counts"]["left_to_right"] == len(ds)
    assert all(len(s.masked_positions) == 0 and s.segment_a_length == s.length <= 64 for s in ds)
    from data_prep.text import clean_document, split_sentences

    vocab = load_vocab(vocab_file)
    tokenizer = load_encoder(str(vocab_file), vocab.sha256, False)
    first_doc = clean_document(json.loads(small_corpus.read_text().split("\n")[0])["text"])
    expected = [t for e in tokenizer.encode_batch(split_sentences(first_doc), add_special_tokens=False) for t in e.ids]
    windows, produced = 0, []
    while len(produced) < len(expected):
        produced.extend(ds[windows].input_ids[1:-1].tolist())
        windows += 1
    assert produced == expected  # the first document's windows, in order, are exactly its token stream


def test_dupe_factor_masks_each_copy_differently(samples_dir, vocab_file, tmp_path):
    base = run_build("--input", samples_dir / "news/lee.txt", "--vocab", vocab_file, "--recipe", "bert",
                     "--out", tmp_path / "one")
    twice = run_build("--input", samples_dir / "news/lee.txt", "--vocab", vocab_file, "--recipe", "bert",
                      "--dupe-factor", 2, "--max-predictions", 5, "--out", tmp_path / "two")
    assert twice["num_samples"] == 2 * base["num_samples"]
    ds = ShardDataset(tmp_path / "two")
    half = len(ds) // 2  # one chunk: copy 1 follows copy 0
    different = 0
    for i in range(half):
        a, b = ds[i], ds[i + half]
        np.testing.assert_array_equal(restored(a), restored(b))
        assert len(a.masked_positions) <= 5
        different += not np.array_equal(a.masked_positions, b.masked_positions)
    assert different > 0.9 * half


def test_hostile_corpus_builds_with_counted_skips(vocab_file, samples_dir, tmp_path):
    corpus = tmp_path / "hostile.jsonl"
    news = (samples_dir / "news/lee.txt").read_text().split("\n\n")[:20]
    with open(corpus, "wb") as f:
        for text in news:
            f.write(json.dumps({"text": text}).encode() + b"\n")
        f.write(b'{"text": "caf\xe9 latin-1 bytes. Second sentence."}\n')              # not UTF-8
        f.write(b'{"text": ""}\n{"text": "   \\n\\t  "}\n')                               # empty
        f.write(b'{"text": "Only one sentence here"}\n')                                 # too short
        f.write(b'{"text": "Ctrl\\u0000 chars\\u0007 and \\u001b escapes. They are removed. Fine."}\n')
        f.write(b'{"text": "broken json\n{"id": 3}\n')                                   # malformed, no text
        huge = "Lorem ipsum dolor sit amet, consectetur adipiscing elit. " * 90_000      # ~5 MB, one line
        f.write(json.dumps({"text": huge}).encode() + b"\n")
    assert corpus.stat().st_size > 5_000_000
    manifest = run_build("--input", corpus, "--vocab", vocab_file, "--recipe", "bert", "--max-seq-len", 64,
                         "--out", tmp_path / "out")
    docs = manifest["documents"]
    assert docs["read"] == 28
    assert docs["skip_reasons"] == {"empty": 2, "invalid_utf8": 1, "malformed_json": 1, "missing_text_field": 1,
                                    "too_few_sentences": 1}
    assert docs["skipped"] == 6 and docs["skip_examples"]["invalid_utf8"] == [f"{corpus}:21"]
    assert manifest["num_samples"] > 5000  # the 5 MB line became many bounded samples
    dump = ShardDataset(tmp_path / "out")
    assert max(s.length for s in dump) <= 64


def test_output_dir_conflicts(samples_dir, vocab_file, minilm_dir, tmp_path):
    args = ["--input", samples_dir / "news/lee.txt", "--max-seq-len", 32, "--out", tmp_path]
    run_build(*args, "--vocab", vocab_file)
    assert "already holds a finished build" in build_error(*args, "--vocab", vocab_file)
    assert "holds shards built with another vocab" in build_error(*args, "--vocab", minilm_dir / "vocab.txt")
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    manifest["format_version"] = 0
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    assert "shard format version 0" in build_error(*args, "--vocab", vocab_file)
    run_build(*args, "--vocab", minilm_dir / "vocab.txt", "--uncased", "--overwrite")
    assert ShardDataset(tmp_path).manifest["vocab"]["size"] == 30522


def test_stray_shards_and_corpus_without_samples(samples_dir, vocab_file, unilm_shards, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    data = bytearray((unilm_shards / "shard-00000.bin").read_bytes())
    data[8] = 7  # format version 7
    (out / "shard-00000.bin").write_bytes(bytes(data))
    error = build_error("--input", samples_dir / "news/lee.txt", "--vocab", vocab_file, "--out", out)
    assert "shard-00000.bin: shard format version 7" in error
    (tmp_path / "empty.jsonl").write_text('{"text": ""}\n{"text": "One sentence only"}\n')
    error = build_error("--input", tmp_path / "empty.jsonl", "--vocab", vocab_file, "--out", tmp_path / "o2")
    assert "no samples" in error and "2 documents read, 2 skipped" in error


@pytest.mark.parametrize("extra, message", [
    (["--recipe", "t5"], "unknown recipe 't5'; choose one of unilm, bert, gpt"),
    (["--objective-mix", "bidirectional=0.5,seq2seq=0.4"], "proportions sum to 0.9, they must sum to 1"),
    (["--objective-mix", "causal=1"], "unknown objective(s) ['causal']"),
    (["--objective-mix", "bidirectional:1"], "expected name=proportion pairs"),
    (["--objective-mix", "bidirectional=nan,seq2seq=1"], "proportions must be numbers in [0, 1]"),
    (["--mask-prob", "nan"], "--mask-prob nan must be a probability in (0, 1)"),
    (["--recipe", "bert", "--objective-mix", "seq2seq=1"], "applies to --recipe unilm"),
    (["--recipe", "gpt", "--dupe-factor", "2"], "gpt has no masking"),
    (["--max-seq-len", "4"], "--max-seq-len 4 must be between 8 and 65535"),
    (["--short-seq-prob", "2"], "--short-seq-prob 2.0 must be a probability in [0, 1]"),
    (["--short-seq-prob", "nan"], "--short-seq-prob nan must be a probability in [0, 1]"),
    (["--seed", "-1"], "--seed -1 must be 0 or more"),
    (["--workers", "0"], "--workers 0: give at least 1"),
])
def test_bad_settings_are_clear_errors(samples_dir, vocab_file, tmp_path, extra, message):
    error = build_error("--input", samples_dir / "news/lee.txt", "--vocab", vocab_file, "--out", tmp_path, *extra)
    assert message in error


def test_bad_vocab_and_inputs_are_clear_errors(samples_dir, tmp_path):
    (tmp_path / "vocab.txt").write_text("[PAD]\n[UNK]\nthe\n")
    error = build_error("--input", samples_dir / "news/lee.txt", "--vocab", tmp_path / "vocab.txt",
                        "--out", tmp_path / "o")
    assert "vocab.txt: missing special token(s) ['[CLS]', '[SEP]', '[MASK]']" in error
    error = build_error("--input", samples_dir / "news/lee.txt", "--vocab", tmp_path / "none.txt",
                        "--out", tmp_path / "o")
    assert "none.txt: file not found" in error
    error = build_error("--input", tmp_path / "absent.jsonl", "--vocab", tmp_path / "vocab.txt",
                        "--out", tmp_path / "o")
    assert "absent.jsonl: file not found" in error
    (tmp_path / "blank.txt").write_text(" \n\n\t\n")
    error = build_error("--input", tmp_path / "blank.txt", "--vocab", samples_dir / "minilm", "--out", tmp_path / "o")
    assert "they hold no text (empty or whitespace-only files?)" in error


def test_train_vocab_then_build_in_one_command(samples_dir, tmp_path):
    manifest = run_build("--input", samples_dir / "news/lee.txt", "--train-vocab", 800, "--vocab-out",
                         tmp_path / "vocab.txt", "--recipe", "gpt", "--out", tmp_path / "out")
    assert manifest["vocab"]["size"] == 800 and manifest["token_dtype"] == "uint16"
    assert (tmp_path / "out/vocab.txt").read_bytes() == (tmp_path / "vocab.txt").read_bytes()


def test_a_trained_vocab_states_its_casing_and_is_not_replaced_unasked(tmp_path):
    """Lowercased French: a cased vocab trained on it has no capital letter, so only the tokenizer config written
    beside it keeps later builds (and this one) cased, its accented pieces in use."""
    words = "le pâté était très bon et la crème brûlée aussi mais où est le café de noël".split()
    rng = np.random.default_rng(0)
    text = "\n\n".join(". ".join(" ".join(rng.choice(words, 9)) for _ in range(8)) + "." for _ in range(40))
    (tmp_path / "fr.txt").write_text(text)
    vocab = tmp_path / "v" / "vocab.txt"
    args = ["--input", tmp_path / "fr.txt", "--recipe", "gpt"]
    trained = run_build(*args, "--train-vocab", 150, "--vocab-out", vocab, "--out", tmp_path / "a")
    assert json.loads((vocab.parent / "tokenizer_config.json").read_text())["do_lower_case"] is False
    again = run_build(*args, "--vocab", vocab, "--out", tmp_path / "b")
    assert trained["vocab"]["uncased"] is again["vocab"]["uncased"] is False
    ids = ShardDataset(tmp_path / "b")[0].input_ids.tolist()
    assert any(load_vocab(vocab).tokens[i] in ("pâté", "très", "où") for i in ids)
    error = build_error(*args, "--train-vocab", 150, "--vocab-out", vocab)
    assert f"--vocab-out {vocab}: {vocab} and {vocab.parent / 'tokenizer_config.json'} exist(s)" in error
    assert "pass --overwrite" in error
    build.main([str(a) for a in args] + ["--train-vocab", "150", "--vocab-out", str(vocab), "--uncased",
                                         "--overwrite"])
    assert json.loads((vocab.parent / "tokenizer_config.json").read_text())["do_lower_case"] is True


def test_the_default_cap_follows_the_mask_probability(samples_dir, vocab_file, tmp_path, caplog):
    manifest = run_build("--input", samples_dir / "news/lee.txt", "--vocab", vocab_file, "--recipe", "bert",
                         "--mask-prob", 0.3, "--out", tmp_path / "o")
    assert manifest["masking"]["max_predictions"] == round(0.3 * 128)
    assert shard_statistics(ShardDataset(tmp_path / "o"))["masked_fraction"] == pytest.approx(0.3, abs=0.01)
    assert "caps masking" not in logged(caplog)


def test_bert_text_format_keeps_each_line_a_sentence(samples_dir, tmp_path):
    """BERT's pre-training text (a sentence per line, a blank line between documents) of short lowercased
    documents: each line is a sentence, so every two-line document makes instances (joined into one line they
    were one sentence each, too short to tell as lowercased text, and every document was skipped)."""
    from data_prep.text import clean_document, split_sentences

    documents = []
    for path in sorted((samples_dir / "bbc" / "business").glob("*.txt")):
        body = " ".join(path.read_text(encoding="utf-8", errors="replace").split("\n", 1)[1].split())
        sentences = split_sentences(body.lower(), uncased=True)
        pairs = [a + "\n" + b for a, b in zip(sentences, sentences[1:]) if len(a) + len(b) < 180]
        documents += pairs[:1]
        if len(documents) == 12:
            break
    assert len(documents) == 12
    corpus = tmp_path / "bert_format.txt"
    corpus.write_text("\n\n".join(documents) + "\n", encoding="utf-8")
    manifest = run_build("--input", corpus, "--vocab", samples_dir / "minilm" / "vocab.txt", "--uncased",
                         "--recipe", "bert", "--out", tmp_path / "o")
    assert manifest["documents"]["read"] == 12 and manifest["documents"]["skipped"] == 0
    assert all(split_sentences(clean_document(d)) == d.split("\n") for d in documents)


def test_a_txt_document_is_a_blank_line_block_a_line_or_a_file(samples_dir, vocab_file, tmp_path):
    """BBC articles, one per file, paragraphs between blank lines: by default each paragraph is a document (BERT's
    convention), `--txt-documents file` keeps each article whole, and a file of one article per line is read with
    `line`."""
    articles = sorted((samples_dir / "bbc" / "tech").glob("*.txt"))[:30]
    (tmp_path / "articles").mkdir()
    for path in articles:
        shutil.copy(path, tmp_path / "articles" / path.name)
    common = ["--input", tmp_path / "articles", "--vocab", vocab_file, "--recipe", "bert", "--max-seq-len", 256]
    blocks = run_build(*common, "--out", tmp_path / "blocks")
    whole = run_build(*common, "--txt-documents", "file", "--out", tmp_path / "whole")
    paragraphs = sum(len([b for b in p.read_text(encoding="utf-8", errors="replace").split("\n\n") if b.strip()])
                     for p in articles)
    assert blocks["documents"]["read"] == paragraphs > 3 * len(articles)
    assert whole["documents"]["read"] == len(articles) and whole["reading"]["txt_documents"] == "file"
    padding = {name: 1 - m["num_tokens"] / (m["num_samples"] * 256)
               for name, m in (("blocks", blocks), ("whole", whole))}
    assert padding["whole"] < padding["blocks"] - 0.2, padding  # whole articles fill their samples
    (tmp_path / "per_line.txt").write_text("".join(" ".join(p.read_text(encoding="utf-8", errors="replace").split())
                                                   + "\n" for p in articles), encoding="utf-8")
    per_line = run_build("--input", tmp_path / "per_line.txt", *common[2:], "--txt-documents", "line",
                         "--out", tmp_path / "lines")
    assert per_line["documents"]["read"] == len(articles)
    assert "both say what a document" in build_error(*common, "--txt-documents", "line", "--rows-as-sentences",
                                                     "--out", tmp_path / "x")


def test_random_next_from_the_same_document_stays_away_from_a():
    from data_prep.instances import InstanceConfig, Uniforms, document_instances

    sentences = [[1000 + i] * 3 for i in range(300)]  # sentence i is three tokens 1000 + i
    instances = document_instances(sentences, [], InstanceConfig(recipe="bert", max_seq_len=32),
                                   Uniforms(np.random.default_rng(0)))
    labels = np.array([inst.is_random_next for inst in instances])
    assert labels.mean() == pytest.approx(0.5, abs=0.08)
    for inst in instances:
        a_last, b_first = inst.tokens_a[-1] - 1000, inst.tokens_b[0] - 1000
        b_sentences = sorted({t - 1000 for t in inst.tokens_b})
        a_sentences = {t - 1000 for t in inst.tokens_a}
        if inst.is_random_next:  # B lies wholly before A or after A's true next sentence
            assert b_sentences[-1] < min(a_sentences) or b_sentences[0] > a_last + 1
        else:
            assert 0 <= b_first - a_last <= 2  # the continuation (its first tokens may be truncated away)


def test_pair_truncation_flips_a_coin_per_removed_token_as_bert_does():
    """BERT's truncate_seq_pair removes each token from the front or the back on its own coin flip: of 60 tokens cut
    from 100, the front's share is Binomial(60, 1/2) (sd 3.9), not any count from 0 to 60 alike (sd 17.6)."""
    from data_prep.instances import Uniforms, _truncate_pair

    rng = Uniforms(np.random.default_rng(0))
    fronts = []
    for _ in range(2000):
        a, b = _truncate_pair(list(range(100)), [-1] * 10, 50, rng)
        assert len(a) == 40 and b == [-1] * 10 and a == list(range(a[0], a[0] + 40))  # one contiguous piece of A
        fronts.append(a[0])
    assert np.mean(fronts) == pytest.approx(30, abs=0.5) and 3.4 < np.std(fronts) < 4.4
    for len_a, len_b, limit in [(5, 3, 5), (3, 3, 5), (40, 40, 61), (3, 9, 7), (100, 1, 20), (7, 6, 12)]:
        a, b = list(range(len_a)), list(range(len_b))
        bert_a, bert_b = list(a), list(b)
        while len(bert_a) + len(bert_b) > limit:  # BERT's loop: the longer loses a token, B on a tie
            (bert_a if len(bert_a) > len(bert_b) else bert_b).pop()
        cut_a, cut_b = _truncate_pair(a, b, limit, rng)
        assert (len(cut_a), len(cut_b)) == (len(bert_a), len(bert_b)), (len_a, len_b, limit)


def test_documents_alone_in_their_chunk_get_random_next_segments(samples_dir, vocab_file, tmp_path):
    texts = [json.loads(line)["text"] for line in open(samples_dir / "books.jsonl")][:10]
    novels = tmp_path / "novels.jsonl"  # two documents longer than --chunk-chars: each is alone in its chunk
    with open(novels, "w") as f:
        for i in range(2):
            f.write(json.dumps({"text": "\n\n".join(texts[5 * i:5 * i + 5])[:600_000]}) + "\n")
    common = ["--input", novels, "--vocab", vocab_file, "--recipe", "bert", "--chunk-chars", 500_000]
    one = run_build(*common, "--out", tmp_path / "one")
    nsp = one["nsp_counts"]
    assert nsp["random_next"] / (nsp["random_next"] + nsp["true_next"]) == pytest.approx(0.5, abs=0.03)  # was 0
    run_build(*common, "--workers", 2, "--out", tmp_path / "two")
    assert directory_bytes(tmp_path / "two") == directory_bytes(tmp_path / "one")
    (tmp_path / "single.jsonl").write_text(novels.read_text().split("\n")[0] + "\n")  # no other document at all
    single = run_build(*common[:1], tmp_path / "single.jsonl", *common[2:], "--out", tmp_path / "single")
    nsp = single["nsp_counts"]
    assert nsp["random_next"] / (nsp["random_next"] + nsp["true_next"]) == pytest.approx(0.5, abs=0.04)
    assert report.random_next_warning({"nsp_counts": {"random_next": 10, "true_next": 990}}).startswith(
        "[build] warning: only 1.0% of the 1000 NSP pairs have a random next segment")


BOOK_WORDS = ["apple", "river", "stone", "cloud", "green", "house", "music", "paper", "table", "water", "light",
              "horse"]


def random_next_pairs(out: Path, vocab: Path) -> tuple[int, int, int]:
    """(NSP pairs, random-next pairs, random-next pairs whose B comes from A's own book) of a build of `book_rows`
    text, a book's sentences made of its marker word alone."""
    word_ids = {load_vocab(vocab).tokens.index(w) for w in BOOK_WORDS}
    pairs = random_next = same_book = 0
    for sample in ShardDataset(out):
        if sample.is_random_next == -1:
            continue
        ids = restored(sample)
        book_a = set(ids[1:sample.segment_a_length - 1].tolist()) & word_ids
        book_b = set(ids[sample.segment_a_length:-1].tolist()) & word_ids
        pairs += 1
        random_next += sample.is_random_next
        same_book += sample.is_random_next == 1 and bool(book_a & book_b)
    return pairs, random_next, same_book


def book_rows(word: str, rows: int = 400) -> list[str]:
    """A book of one sentence per row (BookCorpus on the hub), ~26 characters a row."""
    return [f"{word.title()} {word} {word} {word}." for _ in range(rows)]


def test_random_next_segments_of_a_running_text_come_from_other_books(minilm_dir, tmp_path):
    """Rows of consecutive books (no book boundaries, as BookCorpus on the hub): a chunk's documents are pieces of
    one or two books, so B comes from `FAR_CHUNKS` chunks away (past the 10k-character books here), never from A's
    book; books in files of their own (one document, one unit each) take B from the next file."""
    vocab = minilm_dir / "vocab.txt"
    common = ["--vocab", vocab, "--uncased", "--recipe", "bert", "--max-seq-len", 48]
    (tmp_path / "rows.txt").write_text("\n".join(row for word in BOOK_WORDS for row in book_rows(word)) + "\n")
    run_build("--input", tmp_path / "rows.txt", *common, "--rows-as-sentences", "--rows-per-document", 20,
              "--chunk-chars", 3000, "--out", tmp_path / "rows")
    pairs, random_next, same_book = random_next_pairs(tmp_path / "rows", vocab)
    assert pairs > 300 and random_next / pairs == pytest.approx(0.5, abs=0.06)
    assert same_book == 0  # drawn from the chunk's other documents: most were A's book
    books = tmp_path / "books"
    books.mkdir()
    for word in BOOK_WORDS:
        (books / f"{word}.txt").write_text("\n".join(book_rows(word)) + "\n")
    run_build("--input", books, *common, "--txt-documents", "file", "--out", tmp_path / "files")
    pairs, random_next, same_book = random_next_pairs(tmp_path / "files", vocab)
    assert pairs > 300 and random_next / pairs == pytest.approx(0.5, abs=0.06)
    assert same_book == 0  # drawn from the book's own sentences, away from A: all were A's book
    for index in range(2):  # a builder reads the next unit's text for its own units' donors: the same bytes
        build.main([str(a) for a in ["--input", books, *common, "--txt-documents", "file", "--num-builders", 2,
                                     "--builder-index", index, "--out", tmp_path / "split", "--quiet"]])
    build.main(["--finalize", "--out", str(tmp_path / "split"), "--quiet"])
    assert directory_bytes(tmp_path / "split") == directory_bytes(tmp_path / "files")


def test_far_donors_come_from_far_in_the_unit_else_elsewhere(tmp_path):
    rows = tmp_path / "rows.txt"
    rows.write_text("".join(f"Row {i:05d} of the text.\n" for i in range(3000)))  # 24 characters a row
    other = tmp_path / "other.txt"
    other.write_text("".join(f"Other {i:05d} of the text.\n" for i in range(3000)))
    options = ReadOptions(rows_as_sentences=True, rows_per_document=10)
    plain = list(iter_chunks(0, Unit(str(rows)), options, 2400, donors=False))
    starts = dict(zip([c.records[0][0] for c in plain],
                      np.cumsum([0] + [sum(len(r) for r, _ in c.records) for c in plain[:-1]])))
    where = {record: starts[c.records[0][0]] for c in plain for record, _ in c.records}
    chunks = list(iter_chunks(0, Unit(str(rows)), options, 2400))
    assert [c.records for c in chunks] == [c.records for c in plain] and len(chunks) > 20
    for chunk in chunks:  # every donor piece is a document of a chunk at least 4 chunks (9,600 characters) away
        assert chunk.donor  # (a whole chunk here: smaller than the budget)
        assert all(abs(where[text] - where[chunk.records[0][0]]) >= 4 * 2400 for text in chunk.donor)
    short = list(iter_chunks(0, Unit(str(rows)), options, 24_000,
                             elsewhere=(Unit(str(other)), options)))
    assert len(short) == 3  # shorter than 4 chunks: the other unit's documents, in order, on from its start
    given = [text for chunk in short for text in chunk.donor]
    assert given[0].startswith("Other 00000") and all(t.startswith("Other") for t in given)
    assert len(set(given)) == len(given)
    alone = list(iter_chunks(0, Unit(str(rows)), options, 24_000))
    assert alone[0].donor[0] in {r for r, _ in alone[-1].records}  # nowhere else: the unit's farthest chunk
    assert alone[-1].donor[0] in {r for r, _ in alone[0].records}


def test_donor_pieces_of_wikipedia_pages_are_whole_paragraphs(samples_dir):
    """The middle of a long page that goes with another chunk as NSP donor text is cut at paragraph breaks: cut
    anywhere, its raw wikitext began or ended inside templates and links, which cleaning then left as text."""
    import re

    from data_prep.sources import read_unit
    from data_prep.text import clean_document
    from data_prep.wiki_dump import document_text

    pages = [r for r in read_unit(Unit(str(samples_dir / "wiki/enwiki-excerpt.xml.bz2"))) if isinstance(r, str)
             and len(r) > 40_000]
    markup = re.compile(r"\{\{|\}\}|\[\[|\]\]|\|\s*\w+\s*=|^\s*\||<ref|cite ", re.M)
    pieces = [_middle(page, budget) for page in pages for budget in (20_000, 30_000)]
    assert len(pieces) > 50 and all(len(p) <= b for p, b in zip(pieces, [20_000, 30_000] * len(pages)))
    assert sum(len(piece) for piece in pieces) > 0.8 * 25_000 * len(pieces)
    assert [m.group(0) for piece in pieces for m in markup.finditer(clean_document(document_text(piece)))] == []


def test_unk_share_is_recorded_and_a_wrong_casing_is_warned_about(samples_dir, minilm_dir, tmp_path, caplog):
    shutil.copy(minilm_dir / "vocab.txt", tmp_path / "vocab.txt")  # an uncased vocab, alone
    args = ["--input", samples_dir / "news/lee.txt", "--vocab", tmp_path / "vocab.txt"]
    manifest = run_build(*args, "--cased", "--out", tmp_path / "cased")
    pieces = manifest["wordpieces"]
    assert pieces["unk"] / pieces["total"] > 0.1  # every capitalised word
    err = logged(caplog)
    assert f"of the word pieces are [UNK]: vocab {tmp_path / 'vocab.txt'} (cased) does not cover this text" in err
    assert "pass --uncased if the vocab is uncased" in err
    stats = shard_statistics(ShardDataset(tmp_path / "cased"))  # a masked [UNK] is text, not a structure token
    assert stats["special_tokens_masked"] == 0 and stats["masked_fraction"] == pytest.approx(0.15, abs=0.01)
    stated = report.unk_warning(manifest | {"wordpieces": pieces}, "m", casing_from="m/tokenizer_config.json")
    assert "(cased, as m/tokenizer_config.json states) does not cover" in stated and "pass --" not in stated
    manifest = run_build(*args, "--out", tmp_path / "uncased")
    assert manifest["wordpieces"]["unk"] / manifest["wordpieces"]["total"] < 0.005
    assert "[UNK]" not in logged(caplog)


def test_one_bad_byte_costs_a_character_not_the_book(samples_dir, vocab_file, tmp_path, caplog):
    from data_prep.text import clean_document, split_sentences

    text = json.loads(open(samples_dir / "books.jsonl").readline())["text"]
    book = "\n".join(split_sentences(clean_document(text))).encode()  # a sentence per line: one document
    (tmp_path / "clean").mkdir()
    (tmp_path / "bad").mkdir()
    (tmp_path / "clean" / "book.txt").write_bytes(book + b"\n")
    at = book.find(b"'")
    (tmp_path / "bad" / "book.txt").write_bytes(book[:at] + b"\x92" + book[at + 1:] + b"\n")  # cp1252 apostrophe
    line = book[:at].count(b"\n") + 1
    clean = run_build("--input", tmp_path / "clean", "--vocab", vocab_file, "--out", tmp_path / "clean_out")
    bad = run_build("--input", tmp_path / "bad", "--vocab", vocab_file, "--out", tmp_path / "bad_out")
    assert bad["documents"]["skipped"] == 0 and bad["num_samples"] == clean["num_samples"]
    assert bad["num_tokens"] == pytest.approx(clean["num_tokens"], abs=3)
    assert bad["documents"]["repaired_lines"] == 1
    assert bad["documents"]["repair_examples"] == [f"{tmp_path / 'bad' / 'book.txt'}:{line}"]
    assert "1 line(s) of text inputs held bytes that are not UTF-8" in logged(caplog)


def test_the_skip_warning_weighs_characters(samples_dir, vocab_file, tmp_path, caplog):
    news = (samples_dir / "news/lee.txt").read_text().split("\n\n")[:60]
    book = json.loads(open(samples_dir / "books.jsonl").readline())["text"]
    with open(tmp_path / "mixed.jsonl", "wb") as f:
        for text in news:
            f.write(json.dumps({"text": text}).encode() + b"\n")
        f.write(json.dumps({"text": book}).encode().replace(b"'", b"\x92", 1) + b"\n")  # a book, not UTF-8
    manifest = run_build("--input", tmp_path / "mixed.jsonl", "--vocab", vocab_file, "--out", tmp_path / "out")
    documents = manifest["documents"]
    assert documents["skipped"] == 1 and documents["skip_characters"]["invalid_utf8"] > len(book)
    assert documents["characters"] > sum(map(len, news)) + len(book)
    err = logged(caplog)
    assert "warning: 1 of 61 documents (" in err and "of the characters read) were skipped" in err
    old = {k: v for k, v in documents.items() if k in ("read", "skipped", "skip_reasons", "skip_examples")}
    assert report.skip_warning({**manifest, "documents": old}) is None  # a manifest without character counts


def test_inputs_reached_twice_are_read_once(samples_dir, vocab_file, tmp_path, caplog, monkeypatch):
    (tmp_path / "news").mkdir()
    for part in range(2):
        (tmp_path / "news" / f"part{part}.txt").write_text(
            "\n\n".join((samples_dir / "news/lee.txt").read_text().split("\n\n")[part * 30:(part + 1) * 30]))
    monkeypatch.chdir(tmp_path)
    once = run_build("--input", "news", "--vocab", vocab_file, "--out", tmp_path / "once")
    twice = run_build("--input", "news", "news/part0.txt", "./news/part0.txt", "--vocab", vocab_file,
                      "--out", tmp_path / "twice")
    assert twice["documents"]["read"] == once["documents"]["read"] == 60
    shards = [directory_bytes(tmp_path / name)["shard-00000.bin"] for name in ("once", "twice")]
    assert shards[0] == shards[1]
    err = logged(caplog)
    assert "--input news/part0.txt: 1 unit(s) come also from --input news and are read once, from there" in err
    assert "--input ./news/part0.txt: 1 unit(s) come also from --input news" in err


def test_chinese_text_is_kept_and_the_hint_follows_the_cause(minilm_dir, tmp_path):
    para = ("北京是中华人民共和国的首都，也是全国的政治、文化和国际交往中心。"
            "北京有三千多年的建城史和八百多年的建都史，是世界上拥有世界文化遗产数最多的城市。"
            "二零零八年，北京成功举办了第二十九届夏季奥林匹克运动会。")
    with open(tmp_path / "zh.jsonl", "w") as f:
        for _ in range(100):
            f.write(json.dumps({"text": para * 3}, ensure_ascii=False) + "\n")  # one paragraph of 9 sentences
    manifest = run_build("--input", tmp_path / "zh.jsonl", "--vocab", minilm_dir, "--out", tmp_path / "zh")
    assert manifest["documents"]["skipped"] == 0 and manifest["num_samples"] >= 100  # all were dropped before
    prose = ("the river rose in the spring and the farmers moved their herds to the hills while the water fell in "
             "may and they came back ") * 5
    with open(tmp_path / "lower.jsonl", "w") as f:  # a transcript without punctuation: no sentence end to find
        for _ in range(20):
            f.write(json.dumps({"text": prose}) + "\n")
    error = build_error("--input", tmp_path / "lower.jsonl", "--vocab", minilm_dir, "--out", tmp_path / "lower")
    assert "20 of 20 documents are single sentences of 615 characters on average: the sentence splitter found " \
           "no sentence end in them" in error
    assert "as BookCorpus" not in error
