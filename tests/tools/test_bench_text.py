"""tools.bench_text on a few documents of each sample corpus: it returns every measurement, and agreement that can
fail (identical input to both sides would agree fully)."""
from __future__ import annotations

import json

from tools import bench_text


def test_bench_text_returns_speed_and_agreement_for_each_corpus(samples_dir, tmp_path, capsys):
    corpora = {"wiki": str(samples_dir / "wiki/enwiki-excerpt.xml.bz2"), "news": str(samples_dir / "news/lee.txt")}
    result = bench_text.measure(corpora, max_documents=4, repeat=1)
    assert set(result) == {"date_utc", "machine", "repeat", "splitting", "cleanup"}
    assert set(result["splitting"]) == {"wiki", "news"} and set(result["cleanup"]) == {"wiki"}
    for split in result["splitting"].values():
        assert {"sentences_per_s", "chars_per_s", "speed_ratio", "boundary_precision", "boundary_recall",
                "boundary_f1", "identical_sentences", "differing_sentences"} <= set(split)
        assert set(split["chars_per_s"]) == {"ours", "blingfire"} and split["sentences"]["ours"] > 4
        assert 0.5 < split["boundary_f1"] <= 1 and 0 < split["identical_sentences"] <= 1
    clean = result["cleanup"]["wiki"]
    assert clean["pages"] > 0 and set(clean["chars_per_s"]) == {"ours", "mwparserfromhell"}
    assert 0.3 < clean["word_f1_overall"] < 1  # the two clean-ups keep different text
    json.dumps(result)


def test_identical_splits_agree_fully_and_shifted_ones_do_not():
    sentences = ["One two.", "Three four five.", "Six."]
    assert bench_text._boundaries(sentences) == {7, 21}
    assert bench_text._boundaries(["One two. Three four five.", "Six."]) == {21}
    assert bench_text._word_f1("a b c", "a b c") == 1.0 and bench_text._word_f1("a b", "c d") == 0.0
