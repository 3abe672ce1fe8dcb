"""dataset.clean: cleaning steps, length filter, exact and MinHash near-duplicate removal, and the CLI."""
from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from datasketch import MinHash

from common.errors import ConfigError
from dataset.clean import (
    CleanOptions,
    CleanStats,
    Deduper,
    clean_file,
    clean_records,
    clean_text,
    dedup_texts,
    filter_sentences,
    report_path,
    shingle_hashes,
    split_sentences,
)

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------ synthetic corpus
def _vocab(rng: random.Random, n: int = 3000) -> list[str]:
    words: set[str] = set()
    while len(words) < n:
        words.add("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))))
    return sorted(words)


def _english_doc(rng: random.Random, vocab: list[str]) -> str:
    sentences = []
    for _ in range(rng.randint(7, 10)):
        words = rng.choices(vocab, k=rng.randint(9, 15))
        sentences.append(" ".join(words).capitalize() + ".")
    return " ".join(sentences)


def _chinese_doc(rng: random.Random) -> str:
    # Random CJK ideographs in clauses: no spaces at all, so only character shingles can compare them.
    clauses = ["".join(chr(rng.randint(0x4E00, 0x9FA5)) for _ in range(rng.randint(6, 14)))
               for _ in range(rng.randint(18, 26))]
    return "".join(c + rng.choice("，，。") for c in clauses)


def _jaccard(a: str, b: str, k: int = 5) -> float:
    """Exact Jaccard of character k-gram sets, independent of the implementation under test."""
    def grams(s: str) -> set[str]:
        s = " ".join(s.split()).casefold()
        return {s[i:i + k] for i in range(len(s) - k + 1)}
    ga, gb = grams(a), grams(b)
    return len(ga & gb) / len(ga | gb)


def _replace_words(rng: random.Random, doc: str, vocab: list[str], n: int) -> str:
    words = doc.split(" ")
    for i in rng.sample(range(len(words)), n):
        words[i] = rng.choice(vocab) + ("." if words[i].endswith(".") else "")
    return " ".join(words)


def _replace_chars(rng: random.Random, doc: str, n: int) -> str:
    chars = list(doc)
    for i in rng.sample([i for i, c in enumerate(chars) if c not in "，。"], n):
        chars[i] = chr(rng.randint(0x4E00, 0x9FA5))
    return "".join(chars)


def _to_fullwidth(s: str) -> str:
    return "".join(chr(ord(c) + 0xFEE0) if "!" <= c <= "~" else "\u3000" if c == " " else c for c in s)


def _planted_corpus(seed: int = 1234) -> tuple[list[dict], dict[int, str]]:
    """200 distinct documents (160 English-like, 40 Chinese) plus planted duplicates after their originals.

    Returns (records in stream order, {id of planted record: expected drop reason}).
    """
    rng = random.Random(seed)
    vocab = _vocab(rng)
    originals = [_english_doc(rng, vocab) for _ in range(160)] + [_chinese_doc(rng) for _ in range(40)]
    rng.shuffle(originals)
    planted: list[tuple[int, str, str]] = []  # (original index, text, expected reason)
    for i in rng.sample(range(200), 70):
        doc = originals[i]
        chinese = "\u4e00" <= doc[0] <= "\u9fff"
        variant = rng.choice(["edit", "edit", "append", "spaces", "html", "fullwidth"])
        if variant == "edit":
            text = _replace_chars(rng, doc, 2) if chinese else _replace_words(rng, doc, vocab, 2)
            planted.append((i, text, "near_duplicate"))
        elif variant == "append":
            extra = "".join(chr(rng.randint(0x4E00, 0x9FA5)) for _ in range(8)) + "。" if chinese else \
                " ".join(rng.choices(vocab, k=4)).capitalize() + "."
            planted.append((i, doc + ("" if chinese else " ") + extra, "near_duplicate"))
        elif variant == "spaces":  # same text once whitespace is tidied and collapsed
            # (Chinese has no spaces to widen; adding one where there was none would make a different key.)
            planted.append((i, "\r\n\n" + doc.replace(" ", "  \n ", 3) + "   \n", "exact_duplicate"))
        elif variant == "html":  # same text once the markup is stripped
            planted.append((i, f"<p>{doc}</p>\n<br/>", "exact_duplicate"))
        else:  # same text once NFKC folds the full-width forms
            planted.append((i, _to_fullwidth(doc) if not chinese else doc, "exact_duplicate"))
    # Near-duplicates must really be near (>= 0.9), and the originals really distinct, for the test to mean much.
    for i, text, reason in planted:
        if reason == "near_duplicate":
            assert _jaccard(originals[i], text) >= 0.9
    # Stream order: each original at position i, each plant somewhere after its original.
    events = [(float(i), {"id": i, "text": t}) for i, t in enumerate(originals)]
    expected: dict[int, str] = {}
    for n, (i, text, reason) in enumerate(planted):
        pid = 1000 + n
        events.append((rng.uniform(i + 0.5, 260.0), {"id": pid, "text": text, "source": f"plant:{i}"}))
        expected[pid] = reason
    events.sort(key=lambda e: e[0])
    return [record for _, record in events], expected


def test_planted_duplicates_are_dropped_and_originals_kept() -> None:
    records, expected = _planted_corpus()
    stats = CleanStats()
    deduper = Deduper()  # defaults: 5-char shingles, 128 permutations, threshold 0.8
    kept = list(clean_records(enumerate(records, 1), CleanOptions(), deduper, stats=stats))
    kept_ids = {r["id"] for r in kept}
    assert kept_ids == set(range(200)), "every original kept, every plant dropped"
    dropped = {r["id"]: None for r in records if r["id"] not in kept_ids}
    assert set(dropped) == set(expected)
    want = {reason: list(expected.values()).count(reason) for reason in ("exact_duplicate", "near_duplicate")}
    assert want["near_duplicate"] >= 20 and want["exact_duplicate"] >= 20  # the seed plants enough of both
    assert dict(stats.dropped) == want
    assert stats.kept == 200 and stats.records == len(records)
    # Reasons per record: replay the stream through a fresh deduper.
    deduper, opts = Deduper(), CleanOptions()
    for r in records:
        reason = deduper.check(*dedup_texts({"text": clean_text(r["text"], opts)[0]}))
        assert reason == expected.get(r["id"]), r["id"]
    assert len(deduper) == 200


def test_signatures_are_found_across_storage_blocks(monkeypatch) -> None:
    """Signatures live in fixed-size blocks; with tiny blocks the planted corpus spans many of them."""
    monkeypatch.setattr(Deduper, "_BLOCK", 16)
    records, expected = _planted_corpus()
    deduper, opts = Deduper(), CleanOptions()
    for r in records:
        reason = deduper.check(*dedup_texts({"text": clean_text(r["text"], opts)[0]}))
        assert reason == expected.get(r["id"]), r["id"]
    assert len(deduper._blocks) == 200 // 16 + 1


def test_near_duplicates_just_above_the_threshold_are_found() -> None:
    """LSH bands are tuned for recall: pairs at Jaccard 0.83-0.88 (threshold 0.8) are nearly all caught.
    datasketch's default band split would miss about a quarter of them (measured: 43 of 60 found)."""
    rng = random.Random(21)
    vocab = _vocab(rng)
    pairs = []
    while len(pairs) < 60:
        doc = _english_doc(rng, vocab)
        edited = _replace_words(rng, doc, vocab, rng.randint(3, 6))
        if 0.83 <= _jaccard(doc, edited) <= 0.88:
            pairs.append((doc, edited))
    found = 0
    for doc, edited in pairs:
        deduper = Deduper()
        assert deduper.check(doc) is None
        found += deduper.check(edited) == "near_duplicate"
    assert found >= 54  # measured: 57


def test_originals_are_dissimilar() -> None:
    records, _ = _planted_corpus()
    originals = [r["text"] for r in records if r["id"] < 200]
    rng = random.Random(0)
    pairs = [rng.sample(originals, 2) for _ in range(100)]
    assert max(_jaccard(a, b) for a, b in pairs) < 0.3


def test_exact_only_when_near_dedup_is_off() -> None:
    records, expected = _planted_corpus()
    stats = CleanStats()
    list(clean_records(enumerate(records, 1), CleanOptions(), Deduper(near_dedup=False), stats=stats))
    assert stats.dropped["near_duplicate"] == 0
    assert stats.dropped["exact_duplicate"] == list(expected.values()).count("exact_duplicate")


def test_chinese_near_duplicates_use_character_shingles() -> None:
    rng = random.Random(7)
    a, b = _chinese_doc(rng), _chinese_doc(rng)
    deduper = Deduper()
    assert deduper.check(a) is None
    assert deduper.check(b) is None  # a different Chinese text is not a duplicate
    near = _replace_chars(rng, a, 2)
    assert _jaccard(a, near) >= 0.9
    assert deduper.check(near) == "near_duplicate"
    assert deduper.check(a) == "exact_duplicate"
    assert len(deduper) == 2


def test_near_dedup_is_case_insensitive_and_threshold_bounded() -> None:
    rng = random.Random(3)
    vocab = _vocab(rng)
    doc = _english_doc(rng, vocab)
    deduper = Deduper()
    assert deduper.check(doc) is None
    assert deduper.check(doc.upper()) == "near_duplicate"
    half = _replace_words(rng, doc, vocab, len(doc.split()) // 3)  # heavily edited: Jaccard well below 0.8
    assert _jaccard(doc, half) < 0.6
    assert deduper.check(half) is None


def test_minhash_equals_datasketch_update_batch() -> None:
    """Deduper computes signatures in numpy; they must be exactly what datasketch itself would compute."""
    deduper = Deduper(num_perm=64, seed=5)
    text = "Hello world, 你好，世界！ " * 40 + "a long tail of text " * 3000  # > one chunk of shingles
    ref = MinHash(num_perm=64, seed=5, hashfunc=lambda x: x, scheme="affine32")
    ref.update_batch(shingle_hashes(text.casefold(), 5).tolist())
    np.testing.assert_array_equal(deduper.minhash(text).hashvalues, ref.hashvalues)


def test_shingle_hashes() -> None:
    assert shingle_hashes("", 5).size == 0
    assert shingle_hashes("abc", 5).size == 1  # shorter than a shingle: the whole text is one
    assert shingle_hashes("abcabcabc", 3).size == 3  # abc, bca, cab
    assert shingle_hashes("你好世界和平", 5).size == 2
    np.testing.assert_array_equal(shingle_hashes("the same text", 4), shingle_hashes("the same text", 4))


# ------------------------------------------------------------------------------------------ cleaning steps
@pytest.mark.parametrize("raw, want", [
    ("<p>Hello <b>world</b></p>", "Hello world"),
    ("one<br>two<br/>three<br />four", "one\ntwo\nthree\nfour"),
    ("un<b>believ</b>able", "unbelievable"),
    ('<div class="x" id=main>Text <a href="https://e.com/?a=1&b=2" target=_blank>link</a></div>', "Text link"),
    ("Before<script type='text/javascript'>var x = 1 < 2 && y > 3;</script>After", "BeforeAfter"),
    ("<style>\np { color: red; }\n</style>Body text", "Body text"),
    ("<p>a<script>1</script>b<!-- c -->d<SCRIPT src=x></Script >e<style>", "abde"),  # a stray tag is a tag
    ("<!DOCTYPE html><html><head><title>T</title></head><body><p>Hi</p></body></html>", "T\n\n\nHi"),
    ("Line one <br> line two", "Line one\nline two"),
    ("a <b>bold</b> <i>move</i>", "a bold move"),
    ("Keep <!-- a comment --> this", "Keep  this"),
    ("<P>Upper case</P>", "Upper case"),
    ("<input disabled>Name</label>", "Name"),
])
def test_html_is_stripped(raw: str, want: str) -> None:
    text, steps = clean_text(raw)
    assert text == want
    assert "html_tags" in steps


@pytest.mark.parametrize("raw", [
    "a < b and c > d",
    "x<y",
    "if a<b and c>d then swap",  # <b ...> with bare non-HTML "attributes" is a comparison, not a tag
    "std::vector<int> v; Map<String, Object> m;",
    'File "<stdin>", line 1, in <module>',
    "usage: prog <input> <output> [--data <path>]",  # placeholders: known tag names but no HTML evidence
    "#include <Python.h>\n#include <stdio.h>",
    "render(<MyComponent />)",
    "(<class 'C'>, <object object at 0x7f>)",
    "<foo>_<VersionNumber>-<DebianRevisionNumber>.deb",
    "3 <5 and 7> 2",
])
def test_plain_text_with_angle_brackets_survives(raw: str) -> None:
    text, steps = clean_text(raw)
    assert text == raw
    assert steps == []


def test_table_cells_are_not_glued() -> None:
    assert clean_text("<table><tr><td>a</td><td>b</td></tr><tr><td>c</td></tr></table>")[0].split() == ["a", "b", "c"]
    row = clean_text("<table><tr><td>a</td><td>b</td></tr></table>")[0]
    assert row.split() == ["a", "b"] and "\n" not in row  # the cells of a row stay on one line


@pytest.mark.parametrize("raw", [
    "In HTML, <!-- starts a comment and never ends here",
    "Type <script> to start a script block; this text has no closing tag",
    "a <style>-like marker, unclosed",
])
def test_unclosed_comment_or_script_is_left_alone(raw: str) -> None:
    assert clean_text(raw) == (raw, [])


def test_entities_are_unescaped_once_and_only_with_semicolon() -> None:
    assert clean_text("Tom &amp; Jerry &lt;3 &#39;hi&#39; &#x4e2d;&#25991;")[0] == "Tom & Jerry <3 'hi' 中文"
    assert clean_text("a&nbsp;b")[0] == "a b"  # U+00A0, then NFKC folds it to a space
    assert clean_text("&amp;lt;")[0] == "&lt;"  # double-escaped text is decoded one level, not two
    assert clean_text("&lt;p&gt;literal&lt;/p&gt;")[0] == "<p>literal</p>"  # escaped markup is content
    for raw in ("R&D at AT&T", "&notation", "?a=1&copy=2", "&unknown;", "x &amp y"):
        assert clean_text(raw)[0] == raw
    text, steps = clean_text("fish &amp; chips")
    assert steps == ["html_entities"]


def test_html_stripping_can_be_disabled() -> None:
    raw = "<p>x &amp; y</p>"
    assert clean_text(raw, CleanOptions(strip_html=False))[0] == raw


def test_control_characters_are_removed() -> None:
    text, steps = clean_text("a\x00b\x1b[31mc\u200bd\ufeffe\u00adf\x7fg\u2060h")
    assert text == "ab[31mcdefgh"
    assert steps == ["control_chars"]
    assert clean_text("col1\tcol2\nline2")[0] == "col1\tcol2\nline2"  # tab and newline kept
    family = "\U0001F468\u200d\U0001F469\u200d\U0001F467"  # ZWJ emoji sequence stays one glyph
    assert clean_text(family)[0] == family
    assert clean_text("page1\x0cpage2")[0] == "page1\npage2"  # form feed separates, not glues
    assert clean_text("lone \ud800 surrogate")[0] == "lone  surrogate"


def test_unicode_normalisation_forms() -> None:
    text, steps = clean_text("ＡＢＣ１２３ ﬁne")
    assert text == "ABC123 fine" and steps == ["unicode"]
    assert clean_text("ＡＢＣ", CleanOptions(unicode_form="NFC"))[0] == "ＡＢＣ"
    assert clean_text("e\u0301", CleanOptions(unicode_form="NFC"))[0] == "\u00e9"
    assert clean_text("ＡＢＣ e\u0301", CleanOptions(unicode_form="none"))[0] == "ＡＢＣ e\u0301"
    # Chinese full-width punctuation survives NFKC by default; full-width letters are still folded.
    assert clean_text("你好，世界！（ＡＢＣ）……")[0] == "你好，世界！（ABC）……"
    ascii_punct = clean_text("你好，世界！（ＡＢＣ）……", CleanOptions(keep_cjk_punct=False))[0]
    assert ascii_punct == "你好,世界!(ABC)......"
    with pytest.raises(ValueError):
        CleanOptions(unicode_form="NFD")


def test_whitespace_tidy() -> None:
    text, steps = clean_text("\n\n  indented first   \r\nsecond\t \r\n\n\n\n\n\nthird  \n\n")
    assert text == "  indented first\nsecond\n\n\nthird"  # at most two blank lines, trailing spaces gone
    assert steps == ["whitespace"]
    assert clean_text("a\n\n\nb", CleanOptions(max_blank_lines=1))[0] == "a\n\nb"
    assert clean_text("a\n\n\nb")[0] == "a\n\n\nb"  # two blank lines (PEP 8 between definitions) are kept
    assert clean_text("already clean\n\nparagraph") == ("already clean\n\nparagraph", [])


# --------------------------------------------------------------------------------------- records and filters
def _run(records: list[dict], **kw) -> tuple[list[dict], CleanStats]:
    stats = CleanStats()
    deduper = kw.pop("deduper", Deduper())
    kept = list(clean_records(enumerate(records, 1), kw.pop("opts", CleanOptions()), deduper, stats=stats, **kw))
    return kept, stats


def test_length_bounds_are_measured_after_cleaning() -> None:
    records = [
        {"text": "<p>hello</p>"},  # 12 characters raw, 5 clean
        {"text": "sixsix"},
        {"text": "x" * 20},
        {"text": "y" * 21},
        {"conversations": [{"role": "user", "content": "abc"}, {"role": "assistant", "content": "defg"}]},
    ]
    kept, stats = _run(records, min_chars=6, max_chars=20)
    assert [r.get("text") for r in kept] == ["sixsix", "x" * 20, None]  # the 7-character conversation is kept
    assert stats.dropped == {"too_short": 1, "too_long": 1}
    _, stats = _run(records[-1:], min_chars=8)  # total content of all turns is 7
    assert stats.dropped == {"too_short": 1}


def test_rejected_records_do_not_enter_the_duplicate_index() -> None:
    records = [{"text": "tiny"}, {"text": "tiny"}, {"text": "x" * 30}, {"text": "x" * 30 + "  "}, {"text": "<br>"},
               {"text": "y" * 12}, {"text": "y" * 12}]
    deduper = Deduper()
    kept, stats = _run(records, min_chars=10, max_chars=20, deduper=deduper)
    assert kept == [{"text": "y" * 12}]
    assert stats.dropped == {"too_short": 2, "too_long": 2, "empty_after_cleaning": 1, "exact_duplicate": 1}
    assert len(deduper) == 1


def test_empty_after_cleaning() -> None:
    records = [
        {"text": "<br>"},
        {"text": "\x00\u200b \n"},
        {"conversations": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "<p></p>"}]},
        {"conversations": [{"role": "system", "content": ""}, {"role": "user", "content": "Hi"},
                           {"role": "assistant", "content": "Hello!"}]},
    ]
    kept, stats = _run(records)
    assert stats.dropped == {"empty_after_cleaning": 3}
    assert len(kept) == 1 and kept[0]["conversations"][0] == {"role": "system", "content": ""}


def test_conversations_cleaned_per_turn_and_deduped() -> None:
    rng = random.Random(11)
    vocab = _vocab(rng)
    answer = _english_doc(rng, vocab)
    conv = {"conversations": [{"role": "user", "content": "What is  ＰｏｃｋｅｔＬＭ?  ", "name": "u1"},
                              {"role": "assistant", "content": f"<p>{answer}</p>\x00"}],
            "source": "test", "lang": "en"}
    same_after_cleaning = {"conversations": [{"role": "user", "content": "What is PocketLM?"},
                                             {"role": "assistant", "content": answer + "\n\n\n\n\n"}]}
    near = {"conversations": [{"role": "user", "content": "What is PocketLM?"},
                              {"role": "assistant", "content": _replace_words(rng, answer, vocab, 2)}]}
    swapped_roles = {"conversations": [{"role": "assistant", "content": "What is PocketLM?"},
                                       {"role": "user", "content": answer}]}  # not an exact duplicate
    other = {"conversations": [{"role": "user", "content": "Another question"},
                               {"role": "assistant", "content": _english_doc(rng, vocab)}]}
    kept, stats = _run([conv, same_after_cleaning, near, swapped_roles, other])
    assert kept[0] == {"conversations": [{"role": "user", "content": "What is  PocketLM?", "name": "u1"},
                                         {"role": "assistant", "content": answer}],
                       "source": "test", "lang": "en"}  # other fields of the record and the turn kept
    assert len(kept) == 2 and kept[1]["conversations"][0]["content"] == "Another question"
    assert stats.dropped == {"exact_duplicate": 1, "near_duplicate": 2}  # swapped roles: same content, near
    assert stats.modified == {"unicode": 1, "html_tags": 1, "control_chars": 1, "whitespace": 2}


def test_short_chats_with_different_answers_are_not_near_duplicates() -> None:
    """Role labels are not shingled, so they cannot pad two short chats into a near-duplicate."""
    chats = [{"conversations": [{"role": "user", "content": "Hi, how is it going?"},
                                {"role": "assistant", "content": a}]} for a in ("Good", "Fine", "Great")]
    kept, stats = _run(chats)
    assert len(kept) == 3


# ------------------------------------------------------------------------------------------------- CLI
def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dataset.clean", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def _write_jsonl(path: Path, lines: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)) + "\n"
                            for r in lines), encoding="utf-8")
    return path


@pytest.mark.slow  # starts a process
def test_cli_writes_output_and_report(tmp_path: Path) -> None:
    rng = random.Random(5)
    vocab = _vocab(rng)
    docs = [_english_doc(rng, vocab) for _ in range(4)]
    raw = _write_jsonl(tmp_path / "raw.jsonl", [
        {"text": docs[0], "source": "a"},
        {"text": "<p>" + docs[1] + "</p>", "source": "b", "meta": {"k": [1, 2]}},
        {"text": docs[0] + "  ", "source": "a-copy"},
        {"text": _replace_words(rng, docs[1], vocab, 2), "source": "b-near"},
        {"text": "tiny", "source": "short"},
        {"text": " ".join(docs) * 2, "source": "long"},
        {"text": "ＦＵＬＬ width " + docs[3], "source": "c"},
    ])
    out = tmp_path / "sub" / "clean.jsonl"
    max_chars = str(len("ＦＵＬＬ width " + docs[3]) + max(len(d) for d in docs))
    res = _cli("--data_path", str(raw), "--out", str(out), "--min_chars", "10", "--max_chars", max_chars)
    assert res.returncode == 0, res.stderr
    kept = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert [r["source"] for r in kept] == ["a", "b", "c"]
    assert kept[1] == {"text": docs[1], "source": "b", "meta": {"k": [1, 2]}}
    assert kept[2]["text"].startswith("FULL width ")
    report = json.loads(report_path(out).read_text(encoding="utf-8"))
    assert report["input_lines"] == 7 and report["kept"] == 3 and report["kind"] == "text"
    assert report["dropped"] == {"bad_line": 0, "empty_after_cleaning": 0, "too_short": 1, "too_long": 1,
                                 "exact_duplicate": 1, "near_duplicate": 1}
    assert report["dropped_total"] == 4
    assert report["modified"]["html_tags"] == 1 and report["modified"]["unicode"] == 1
    assert report["modified"]["whitespace"] == 2  # the trailing spaces, and the newlines </p> left
    assert report["elapsed_s"] >= 0 and report["records_per_s"] > 0
    assert "kept" in res.stdout and str(report_path(out)) in res.stdout
    assert sorted(p.name for p in out.parent.iterdir()) == ["clean.jsonl", "clean.jsonl.report.json"]  # no temp
    plain = out.parent / "plain.txt"
    plain.write_text("x")  # the temp-file-and-rename must not leave the output with mkstemp's 0600 mode
    assert out.stat().st_mode == report_path(out).stat().st_mode == plain.stat().st_mode


def test_lone_surrogates_never_break_the_output(tmp_path: Path) -> None:
    # Valid JSON, but "\\ud800" decodes to a lone surrogate that UTF-8 cannot encode.
    raw = tmp_path / "raw.jsonl"
    raw.write_text('{"text": "odd \\ud800 text", "note": "\\udc00 kept"}\n', encoding="utf-8")
    out = tmp_path / "clean.jsonl"
    report = clean_file(raw, out)
    assert report["kept"] == 1 and report["modified"]["control_chars"] == 1
    assert json.loads(out.read_bytes().decode("utf-8")) == {"text": "odd  text", "note": "\udc00 kept"}


@pytest.mark.slow  # starts a process
def test_cli_bad_line_stops_with_file_line_error(tmp_path: Path) -> None:
    raw = _write_jsonl(tmp_path / "raw.jsonl", [{"text": "fine line"}, '{"text": "broken', {"text": "ok"}])
    out = tmp_path / "clean.jsonl"
    res = _cli("--data_path", str(raw), "--out", str(out))
    assert res.returncode == 2
    assert "Traceback" not in res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {raw}:2: invalid JSON"), res.stderr
    assert not out.exists() and list(tmp_path.iterdir()) == [raw]  # nothing half-written


@pytest.mark.slow  # starts a process
def test_cli_skip_bad_lines_counts_them(tmp_path: Path) -> None:
    raw = _write_jsonl(tmp_path / "raw.jsonl", [
        {"text": "fine line one"}, '{"text": "broken', "[1, 2]",
        {"conversations": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
        {"text": "fine line two"}, "", {"text": "fine line one"}])
    out = tmp_path / "clean.jsonl"
    res = _cli("--data_path", str(raw), "--out", str(out), "--skip_bad_lines")
    assert res.returncode == 0, res.stderr
    report = json.loads(report_path(out).read_text(encoding="utf-8"))
    # A conversations record in a file detected as text is a bad line too; the blank line is not counted.
    assert report["dropped"]["bad_line"] == 3 and report["dropped"]["exact_duplicate"] == 1
    assert report["kept"] == 2 and report["input_lines"] == 6
    assert report["input_lines"] == report["kept"] + report["dropped_total"]
    assert sum(report["bad_line_reasons"].values()) == 3
    assert any("raw.jsonl:2" in e for e in report["bad_line_examples"])


@pytest.mark.slow  # starts a process
def test_cli_missing_empty_and_wrong_kind(tmp_path: Path) -> None:
    out = str(tmp_path / "clean.jsonl")
    for raw, message in [(tmp_path / "nope.jsonl", "no such file"),
                         (_write_jsonl(tmp_path / "empty.jsonl", []), "no usable records")]:
        res = _cli("--data_path", str(raw), "--out", out)
        assert res.returncode == 2 and "Traceback" not in res.stderr
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: {raw}: {message}"), res.stderr
    conv = _write_jsonl(tmp_path / "sft.jsonl", [
        {"conversations": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}])
    res = _cli("--data_path", str(conv), "--out", out, "--kind", "text")
    assert res.returncode == 2 and f"{conv}:1:" in res.stderr and "Traceback" not in res.stderr
    res = _cli("--data_path", str(conv), "--out", out, "--no_near_dedup")
    assert res.returncode == 0, res.stderr
    assert json.loads(report_path(out).read_text(encoding="utf-8"))["kind"] == "conversations"


# ------------------------------------------------------------------------------------ sentence-level filter
@pytest.mark.parametrize("text, want", [
    ("Hello world. This is a test! Is it? Yes.", ["Hello world.", "This is a test!", "Is it?", "Yes."]),
    ("Really?! Yes... Fine.", ["Really?!", "Yes...", "Fine."]),
    ("It was 2020.  Then it was not.", ["It was 2020.", "Then it was not."]),  # the gap's width is not kept
    ("One\nTwo. Three\n\n  Four.", ["One", "Two.", "Three", "Four."]),  # a newline always ends a sentence
])
def test_split_sentences_english(text: str, want: list[str]) -> None:
    assert split_sentences(text) == want


@pytest.mark.parametrize("text, want", [
    ("你好。今天天气很好！你去哪里？", ["你好。", "今天天气很好！", "你去哪里？"]),
    ("真的吗？！是的。", ["真的吗？！", "是的。"]),
    # ； and … join clauses of one sentence, like ; in English.
    ("我去学校；然后回家……好的。再见。", ["我去学校；然后回家……好的。", "再见。"]),
    ("一。 二。", ["一。", "二。"]),  # whitespace after 。 is allowed, and is not part of a sentence
    ("你好!世界?好的", ["你好!", "世界?", "好的"]),  # --ascii_cjk_punct's ！？ still split before Chinese
])
def test_split_sentences_chinese(text: str, want: list[str]) -> None:
    assert split_sentences(text) == want


def test_split_sentences_mixed_english_and_chinese() -> None:
    text = "PocketLM is small. 它很小。It trains on a CPU! 真的吗？Yes."
    assert split_sentences(text) == ["PocketLM is small.", "它很小。", "It trains on a CPU!", "真的吗？", "Yes."]


@pytest.mark.parametrize("text, want", [
    ("Pi is 3.14 and e is 2.718. Both are irrational.", ["Pi is 3.14 and e is 2.718.", "Both are irrational."]),
    ("Mr. Smith met Dr. Jones. They talked.", ["Mr. Smith met Dr. Jones.", "They talked."]),
    ("He moved to the U.S. Army base. It was far.", ["He moved to the U.S. Army base.", "It was far."]),
    ("Fruit, e.g. apples, i.e. Pink Lady. Good.", ["Fruit, e.g. apples, i.e. Pink Lady.", "Good."]),
    ("(e.g. This one) stays. J. K. Rowling wrote it.", ["(e.g. This one) stays.", "J. K. Rowling wrote it."]),
    ("See example.com now. Or v1.2.3 later.", ["See example.com now.", "Or v1.2.3 later."]),
    ("I said no. Then I left.", ["I said no.", "Then I left."]),  # "No." is an abbreviation, "no." is not
    ("See No. 5 and Fig. 2 at 9 a.m. Today.", ["See No. 5 and Fig. 2 at 9 a.m. Today."]),  # documented limit
])
def test_split_sentences_keeps_abbreviations_and_decimals(text: str, want: list[str]) -> None:
    assert split_sentences(text) == want


@pytest.mark.parametrize("text, want", [
    ('She said "Stop." Then she left.', ['She said "Stop."', "Then she left."]),
    ("He asked 'why?' Nobody knew.", ["He asked 'why?'", "Nobody knew."]),
    ('He asked "why?" and left.', ['He asked "why?" and left.']),  # a lower-case word goes on with the sentence
    ("(It was late.) The end.", ["(It was late.)", "The end."]),
    ("他说：“你好。”然后走了。", ["他说：“你好。”", "然后走了。"]),
    ("「真的吗？」她问。『是的！』", ["「真的吗？」", "她问。", "『是的！』"]),
    ("（完。）下一章。", ["（完。）", "下一章。"]),
    ("“Done.” ‘Next.’", ["“Done.”", "‘Next.’"]),
])
def test_split_sentences_keeps_closing_quotes_and_brackets(text: str, want: list[str]) -> None:
    assert split_sentences(text) == want


def test_filter_sentences_drops_short_and_long_and_rejoins() -> None:
    text = ("Hi. This sentence is long enough.  So is this second one!\n"
            "  Indented line keeps its indent. Ok.\n"
            "\n"
            "你好。这是一个足够长的中文句子，可以留下。" + "这句话太长了" * 10 + "。")
    out, counts = filter_sentences(text, min_chars=10, max_chars=40)
    assert out == ("This sentence is long enough.  So is this second one!\n"  # the two-space gap is kept
                   "  Indented line keeps its indent.\n"
                   "\n"
                   "这是一个足够长的中文句子，可以留下。")
    assert counts == {"kept": 4, "too_short": 3, "too_long": 1}
    # The bounds are inclusive: exactly 10 and exactly 40 characters are kept.
    ten, forty = "Abcdefghi.", "A" * 39 + "."
    assert filter_sentences(f"{ten} {forty}", 10, 40) == (f"{ten} {forty}", {"kept": 2})
    assert filter_sentences(f"{ten} {forty}", 11, 39) == ("", {"too_short": 1, "too_long": 1})


def test_filter_sentences_keeps_paragraphs_and_unchanged_text() -> None:
    text = "First paragraph stays.\n\nTiny.\n\nThird paragraph stays."
    assert filter_sentences(text, 10) == ("First paragraph stays.\n\nThird paragraph stays.",
                                          {"kept": 2, "too_short": 1})
    assert filter_sentences("Tiny.\n\nSecond paragraph stays.\nOk.", 10) == ("Second paragraph stays.",
                                                                             {"kept": 1, "too_short": 2})
    out, _ = filter_sentences("Line one stays.\nNo.\n\nLine three stays.", 10)
    assert out == "Line one stays.\n\nLine three stays."
    # A text that loses nothing comes back exactly as it was, odd whitespace and all.
    untouched = "  Indented.   Spaced   out.  \n\n\n\nEnd."
    assert filter_sentences(untouched, 1, 100) == (untouched, {"kept": 3})


def test_sentence_split_in_clean_records() -> None:
    records = [
        {"id": 1, "text": "<p>Tom &amp; Jerry ran.</p> Ok. A sentence that is far too long to keep, really."},
        {"id": 2, "text": "Short. Tiny. Small."},  # every sentence too short: emptied, dropped
        {"id": 3, "text": "This one is kept whole."},
        {"id": 4, "text": "<br>"},  # empty after cleaning, as before
        {"id": 5, "text": "Yes. This one is kept whole."},  # a duplicate of 3 once its short sentence is gone
    ]
    kept, stats = _run(records, min_chars=12, max_chars=40, split="sentences")
    # "Tom & Jerry ran." is 16 characters after cleaning (20 before): lengths are measured on the cleaned text.
    assert kept == [{"id": 1, "text": "Tom & Jerry ran."}, {"id": 3, "text": "This one is kept whole."}]
    assert stats.dropped == {"no_sentences_left": 1, "empty_after_cleaning": 1, "exact_duplicate": 1}
    assert stats.sentences == {"kept": 3, "too_short": 5, "too_long": 1}
    assert stats.documents_trimmed == 2  # 1 and 5; 2 was emptied, not trimmed
    assert stats.kept == 2 and stats.chars_out == len("Tom & Jerry ran.") + len("This one is kept whole.")


def test_without_split_the_bounds_apply_to_whole_records() -> None:
    records = [{"text": "Short. Tiny. Small."}, {"text": "A sentence that is far too long to keep, really. Ok."}]
    kept, stats = _run(records, min_chars=12, max_chars=40)
    assert kept == [{"text": "Short. Tiny. Small."}]  # 19 characters: within bounds as a whole
    assert stats.dropped == {"too_long": 1} and stats.sentences == {} and stats.documents_trimmed == 0
    kept, stats = _run(records, min_chars=12, max_chars=60, split="sentences")
    assert kept == [{"text": "A sentence that is far too long to keep, really."}]
    assert stats.dropped == {"no_sentences_left": 1}


def test_sentence_split_refuses_conversations(tmp_path: Path) -> None:
    conv = {"conversations": [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello there."}]}
    with pytest.raises(ConfigError, match=r'--split sentences applies to \{"text"\} records only'):
        _run([{"text": "Fine text here."}, conv], split="sentences")
    with pytest.raises(ConfigError, match="split must be one of none, sentences"):
        _run([{"text": "Fine text here."}], split="words")
    raw = _write_jsonl(tmp_path / "sft.jsonl", [conv])
    with pytest.raises(ConfigError, match="conversation turns would corrupt the dialogues"):
        clean_file(raw, tmp_path / "clean.jsonl", split="sentences")
    assert list(tmp_path.iterdir()) == [raw]  # refused before anything was written
    report = clean_file(raw, tmp_path / "clean.jsonl")  # without --split conversations are cleaned as before
    assert report["kept"] == 1 and report["options"]["split"] == "none"
    assert "sentence_filter" not in report and "no_sentences_left" not in report["dropped"]


@pytest.mark.slow  # starts a process
def test_cli_split_sentences(tmp_path: Path) -> None:
    raw = _write_jsonl(tmp_path / "raw.jsonl", [
        {"text": "Hi. This sentence has enough characters. " + "Way too long " * 50 + "end.", "source": "a"},
        {"text": "Ok. Sure. Yes.", "source": "b"},
        {"text": "你好。这是一个足够长的中文句子，会被保留下来。\n\nMr. Smith went to the U.S. yesterday.",
         "source": "c"},
    ])
    out = tmp_path / "clean.jsonl"
    res = _cli("--data_path", str(raw), "--out", str(out), "--split", "sentences", "--min_chars", "20",
               "--max_chars", "500")
    assert res.returncode == 0, res.stderr
    kept = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert kept == [{"text": "This sentence has enough characters.", "source": "a"},
                    {"text": "这是一个足够长的中文句子，会被保留下来。\n\nMr. Smith went to the U.S. yesterday.",
                     "source": "c"}]
    report = json.loads(report_path(out).read_text(encoding="utf-8"))
    assert report["sentence_filter"] == {"sentences_in": 9, "sentences_kept": 3,
                                         "sentences_dropped": {"too_short": 5, "too_long": 1},
                                         "documents_trimmed": 2, "documents_emptied": 1}
    assert report["dropped"] == {"bad_line": 0, "empty_after_cleaning": 0, "too_short": 0, "too_long": 0,
                                 "no_sentences_left": 1, "exact_duplicate": 0, "near_duplicate": 0}
    assert report["kept"] == 2 and report["dropped_total"] == 1 and report["options"]["split"] == "sentences"
    assert "sentences 9 -> 3 (dropped: too_short 5, too_long 1); documents trimmed 2, emptied 1" in res.stdout
    assert "no_sentences_left" in res.stdout

    sft = _write_jsonl(tmp_path / "sft.jsonl", [
        {"conversations": [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]}])
    res = _cli("--data_path", str(sft), "--out", str(tmp_path / "sft_clean.jsonl"), "--split", "sentences")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith('error: --split sentences applies to {"text"} records only')
    assert not (tmp_path / "sft_clean.jsonl").exists()
