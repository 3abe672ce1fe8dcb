"""dataset.ingest and its readers (formats/): every format read from real files (made with each format's own library),
the broken ones skipped with their reason, splitting, page furniture, languages, determinism, the CLI, and the
bundled example folder's extraction quality (bench/bench_ingest.py's measure)."""
from __future__ import annotations

import builtins
import contextlib
import io
import json
import math
import sys
import types
import zipfile
from pathlib import Path

import pytest

from common.errors import ConfigError, DataError
from dataset.ingest.cli import main
from dataset.ingest.formats import extract_file, file_format
from dataset.ingest.formats.base import MissingLibrary, Unreadable
from dataset.ingest.formats.pdf import join_wrapped_lines, strip_page_furniture
from dataset.ingest.language import detect_language
from dataset.ingest.pipeline import FormatStats, IngestOptions, heldout_path, ingest, is_heldout
from dataset.ingest.split import split_document
from dataset.ingest.walk import find_files

from conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "bench"))
import bench_ingest  # noqa: E402
import build_documents_demo as demo  # noqa: E402

DOCUMENTS = ROOT / "dataset" / "demo" / "documents"
PARAGRAPHS = ["The lighthouse keeper wrote every evening about the weather and the ships that passed the cape.",
              "In winter the storms came from the north, and the lamp had to be trimmed twice each night.",
              "Nobody remembered who had planted the apple tree beside the keeper's cottage, but it bore fruit."]
BLOCKS = [demo.Block("h1", "Notes from the cape"), *[demo.Block("p", " ".join([p] * 3)) for p in PARAGRAPHS],
          demo.Block("code", ">>> lamp.trim()\n>>> lamp.light()")]
TEXT = demo.plain_text(BLOCKS)
# three documents for three PDF pages, with first and last lines of their own (a line at the top or the bottom of
# every page is a running header or footer)
PAGES = [[demo.Block("h1", title), *BLOCKS[1:-1], demo.Block("code", f">>> lamp.{verb}()"),
          demo.Block("p", f"Written at the cape in {month}.")]
         for title, verb, month in [("Notes from the cape", "trim", "March"), ("Letters from the harbour", "light",
                                                                              "June"),
                                    ("Songs of the keeper", "clean", "October")]]


def words(text: str) -> list[str]:
    return text.split()


def read(path) -> str:
    return "\n\n".join(d.text for d in extract_file(path).documents)


def scanned_pdf() -> bytes:
    from fpdf import FPDF
    from PIL import Image

    pdf = FPDF()
    for _ in range(2):
        pdf.add_page()
        pdf.image(Image.new("RGB", (200, 100), "white"), x=10, y=10, w=100)
    return bytes(pdf.output())


def encrypted_pdf() -> bytes:
    from fpdf import FPDF

    pdf = FPDF()
    pdf.add_page()
    pdf.set_font("helvetica", size=12)
    pdf.multi_cell(0, 5, PARAGRAPHS[0] * 5)
    pdf.set_encryption(owner_password="owner", user_password="secret")
    return bytes(pdf.output())


# ---------------------------------------------------------------------------------------- each format, read
@pytest.mark.parametrize("fmt", ["pdf", "html", "epub", "docx"])
def test_each_format_gives_back_its_text_without_furniture(tmp_path, fmt):
    path = tmp_path / f"doc.{fmt}"
    if fmt == "pdf":
        path.write_bytes(demo.render_pdf(PAGES, "cape notes"))
        reference = "\n\n".join(map(demo.plain_text, PAGES))
    elif fmt == "html":
        path.write_bytes(demo.render_html(BLOCKS, "cape", ["harbour", "keeper"]))
        reference = TEXT
    elif fmt == "epub":
        path.write_bytes(demo.render_epub([BLOCKS, BLOCKS[:2]], ["one", "two"]))
        reference = TEXT + "\n\n" + demo.plain_text(BLOCKS[:2])
    else:
        path.write_bytes(demo.render_docx(BLOCKS, "cape"))
        reference = TEXT
    text = read(path)
    q = bench_ingest.overlap(reference, text)
    assert q["recovered"] > 0.99 and q["boilerplate"] < 0.01, (fmt, q, text[:300])
    for furniture in ("Sign in", "All rights reserved", "Other modules", "Python Library Notes", "Draft for internal"):
        assert furniture not in text


def test_epub_gives_a_document_per_chapter_named_by_its_file(tmp_path):
    path = tmp_path / "book.epub"
    path.write_bytes(demo.render_epub([BLOCKS, BLOCKS[:2]], ["one", "two"]))
    docs = extract_file(path).documents
    assert [d.where for d in docs] == [f"{path}#chap_00.xhtml", f"{path}#chap_01.xhtml"]
    assert docs[1].text.splitlines() == [BLOCKS[0].text, BLOCKS[1].text]  # block elements on lines of their own


def test_pdf_counts_pages_and_joins_wrapped_lines(tmp_path):
    path = tmp_path / "doc.pdf"
    path.write_bytes(demo.render_pdf(PAGES, "cape notes"))
    extracted = extract_file(path)
    assert extracted.pages == 3
    # each long paragraph wraps over several lines on the page and comes back as one (the line it ends on
    # may run on into the next paragraph: the text layer has no paragraphs)
    text = extracted.documents[0].text
    assert all(text.count(b.text) == 3 for b in BLOCKS[1:-1])
    assert all(line in text.splitlines() for line in ("Notes from the cape", "Songs of the keeper"))


def test_html_keeps_entity_like_text_as_written(tmp_path):
    blocks = [demo.Block("h1", "Entities"), demo.Block("p", "Write &gt; or &#62; for a greater-than sign. " * 8)]
    path = tmp_path / "page.html"
    path.write_bytes(demo.render_html(blocks, "entities", []))
    assert "Write &gt; or &#62; for" in read(path)


# Pages shaped like the generators' output met on real documentation (written here, none copied): DocBook's,
# with none of the frames (<main>, <article>...) trafilatura looks for the main text in; Sphinx's, whose sections
# are named by their titles; mdBook's, a chapter inside its sidebar, menu bar and keyboard-help popup.
TERMS = {"keeper": "The keeper trims the lamp twice each night and writes the weather in the log book.",
         "harbour": "Boats that shelter from the northern storms tie up in the harbour below the cape.",
         "apple tree": "Nobody remembers who planted the apple tree beside the cottage, but it bears fruit."}


def definitions(terms: dict[str, str], dt: str = "dt", dd: str = "dd") -> str:
    return "".join(f"<{dt}>{term}</{dt}><{dd}><p>{text}</p></{dd}>" for term, text in terms.items())


def lines_of(path) -> list[str]:
    return [line.removeprefix("- ") for line in read(path).splitlines()]  # trafilatura's list items: "- "


def assert_terms_before_definitions(lines: list[str], terms: dict[str, str]) -> None:
    for term, text in terms.items():
        assert term in lines and lines[lines.index(term) + 1] == text, (term, lines)


def test_html_without_a_frame_keeps_headings_and_definition_terms(tmp_path):
    path = tmp_path / "glossary.html"
    path.write_text(f"""<!DOCTYPE HTML PUBLIC "-//W3C//DTD HTML 4.01 Transitional//EN">
<HTML><HEAD><TITLE>Words of the cape</TITLE><META NAME="GENERATOR" CONTENT="Modular DocBook HTML Stylesheet">
</HEAD><BODY CLASS="BOOK"><DIV CLASS="BOOK"><DIV CLASS="TITLEPAGE"><H1 CLASS="TITLE"><A NAME="AEN2">Words of the
cape</A></H1><P CLASS="COPYRIGHT">Copyright 2026 the keepers of the cape</P></DIV>
<DIV CLASS="TOC"><DL><DT><B>Table of Contents</B></DT><DT>1. <A HREF="#INTRO">Introduction</A></DT>
<DT>2. <A HREF="#WORDS">Words</A></DT></DL></DIV>
<DIV CLASS="CHAPTER"><H1><A NAME="INTRO"></A>Chapter 1. Introduction</H1><P>{PARAGRAPHS[0]}</P></DIV>
<DIV CLASS="CHAPTER"><HR><H1><A NAME="WORDS"></A>Chapter 2. Words</H1><P>{PARAGRAPHS[1]}</P>
<DIV CLASS="VARIABLELIST"><DL>{definitions(TERMS, "DT", "DD")}</DL></DIV></DIV></DIV></BODY></HTML>""",
                    encoding="utf-8")
    lines = lines_of(path)
    assert {"Chapter 1. Introduction", "Chapter 2. Words"} <= set(lines)
    assert_terms_before_definitions(lines, TERMS)


def test_html_keeps_sections_titled_like_navigation_without_permalinks(tmp_path):
    def section(name: str, title: str, body: str) -> str:
        return (f'<section id="{name}"><h2>{title}<a class="headerlink" href="#{name}" title="Link to this heading">'
                f"¶</a></h2>{body}</section>")

    menus = {"Trim Wick": "Cut the burnt end of the wick so that the flame burns clean and bright all night.",
             "Log Weather": "Write the wind, the sea and the ships that passed into the book kept by the lamp."}
    path = tmp_path / "lamp.html"
    path.write_text(f"""<!DOCTYPE html><html><head><title>The lamp room</title></head><body>
<div class="related" role="navigation" aria-label="Related"><h3>Navigation</h3><ul><li><a href="index.html">index
</a></li></ul></div><div class="document"><div class="documentwrapper"><div class="bodywrapper">
<div class="body" role="main"><section id="the-lamp-room"><h1>The lamp room<a class="headerlink" href="#the-lamp-room">
¶</a></h1><p>{PARAGRAPHS[0]}</p>{section("menus", "Menus", f"<p>{PARAGRAPHS[1]}</p><dl>{definitions(menus)}</dl>")}
{section("editing-and-navigation", "Editing and Navigation", f"<p>{PARAGRAPHS[2]}</p>")}</section></div></div></div>
<div class="sphinxsidebar" role="navigation" aria-label="Main"><h4>Previous topic</h4><p><a href="a.html">The
cape</a></p></div></div><div class="footer">© Copyright 2026, the keepers.</div></body></html>""",
                    encoding="utf-8")
    lines = lines_of(path)
    assert {"The lamp room", "Menus", "Editing and Navigation", *PARAGRAPHS} <= set(lines)
    assert_terms_before_definitions(lines, menus)
    assert "¶" not in read(path) and "Previous topic" not in lines


def mdbook_page(chapter: str) -> str:
    pages = ["Introduction", "The lamp", "The harbour"]
    return f"""<!DOCTYPE HTML><html lang="en" class="light sidebar-visible"><head><title>The lamp</title></head>
<body><div id="mdbook-help-container"><div id="mdbook-help-popup"><h2 class="mdbook-help-title">Keyboard shortcuts
</h2><div><p>Press <kbd>←</kbd> or <kbd>→</kbd> to navigate between chapters</p><p>Press <kbd>S</kbd> or
<kbd>/</kbd> to search in the book</p><p>Press <kbd>?</kbd> to show this help</p><p>Press <kbd>Esc</kbd> to hide
this help</p></div></div></div><div id="mdbook-body-container">
<nav id="mdbook-sidebar" class="sidebar" aria-label="Table of contents"><ol class="chapter">
{"".join(f'<li class="chapter-item"><a href="{i}.html">{i}. {t}</a></li>' for i, t in enumerate(pages, 1))}</ol></nav>
<div id="mdbook-page-wrapper" class="page-wrapper"><div class="page"><div id="mdbook-menu-bar" class="menu-bar sticky">
<div class="left-buttons"><button id="mdbook-theme-toggle" class="icon-button" type="button" title="Change theme">
</button><ul id="mdbook-theme-list" class="theme-popup" aria-label="Themes" role="menu">
{"".join(f'<li role="none"><button role="menuitem" class="theme">{t}</button></li>' for t in ("Light", "Coal"))}
</ul></div><h1 class="menu-title">Notes from the cape</h1><div class="right-buttons"><a href="print.html"
title="Print this book" aria-label="Print this book"></a></div></div><div id="mdbook-search-wrapper" class="hidden">
<form id="mdbook-searchbar-outer" class="searchbar-outer"><input type="search" placeholder="Search this book ...">
</form></div><div id="mdbook-content" class="content"><main>{chapter}</main>
<nav class="nav-wrapper" aria-label="Page navigation"><a rel="prev" href="1.html" class="mobile-nav-chapters previous"
title="Previous chapter" aria-label="Previous chapter" aria-keyshortcuts="Left">←</a></nav></div></div></div></div>
</body></html>"""


def test_html_leaves_out_mdbook_chrome_around_a_chapter(tmp_path):
    # a one-paragraph chapter, where trafilatura went looking for more text and took the keyboard help
    path = tmp_path / "short.html"
    path.write_text(mdbook_page('<h1 id="lamp"><a class="header" href="#lamp">The lamp</a></h1>'
                                "<p>The lamp is trimmed twice each night.</p>"), encoding="utf-8")
    assert lines_of(path) == ["The lamp", "The lamp is trimmed twice each night."]
    path = tmp_path / "long.html"
    path.write_text(mdbook_page("".join(f'<h{level} id="s{level}"><a class="header" href="#s{level}">{title}</a>'
                                        f"</h{level}><p>{text}</p>" for level, title, text in
                                        zip((1, 2, 2), ("The lamp", "Winter", "The tree"), PARAGRAPHS))),
                    encoding="utf-8")
    lines = lines_of(path)
    assert lines == ["The lamp", PARAGRAPHS[0], "Winter", PARAGRAPHS[1], "The tree", PARAGRAPHS[2]], lines


def test_plain_text_encodings(tmp_path):
    (tmp_path / "bom.txt").write_bytes("\ufeffhello wörld".encode("utf-8"))
    (tmp_path / "utf16.txt").write_bytes("hello wörld".encode("utf-16"))
    (tmp_path / "gbk.txt").write_bytes("中文文本，这是一个测试。".encode("gbk"))
    (tmp_path / "binary.txt").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00")
    assert read(tmp_path / "bom.txt") == "hello wörld"
    assert read(tmp_path / "utf16.txt") == "hello wörld"
    with pytest.raises(Unreadable, match=r"not UTF-8 \(byte 0xd6 at offset 0\); .*--encoding"):
        read(tmp_path / "gbk.txt")
    assert "\n".join(d.text for d in extract_file(tmp_path / "gbk.txt", encoding="gb18030").documents) == \
        "中文文本，这是一个测试。"
    with pytest.raises(Unreadable, match="binary content"):
        read(tmp_path / "binary.txt")


def test_markdown_and_jsonl(tmp_path):
    (tmp_path / "a.md").write_text(demo.render_markdown(BLOCKS), encoding="utf-8")
    assert read(tmp_path / "a.md").startswith("# Notes from the cape\n\n")
    lines = [json.dumps({"text": p, "id": i}) for i, p in enumerate(PARAGRAPHS)]
    (tmp_path / "a.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    docs = extract_file(tmp_path / "a.jsonl").documents
    assert [d.text for d in docs] == PARAGRAPHS and docs[2].where == f"{tmp_path / 'a.jsonl'}:3"
    assert file_format(tmp_path / "x.jsonl.gz") == "jsonl" and file_format(tmp_path / "X.PDF") == "pdf"
    assert file_format(tmp_path / "x.png") is None


# ---------------------------------------------------------------------------------------- broken files
def broken_files(tmp_path) -> dict[str, str]:
    """file name -> the reason it is skipped for (a regex)."""
    good_epub = demo.render_epub([BLOCKS], ["one"])
    good_docx = demo.render_docx(BLOCKS, "cape")
    good_pdf = demo.render_pdf(PAGES, "cape")
    files = {
        "encrypted.pdf": (encrypted_pdf(), r"encrypted: needs a password"),
        "scanned.pdf": (scanned_pdf(), r"no text layer on 2 of 2 pages \(images"),
        "truncated.pdf": (good_pdf[:len(good_pdf) // 2], r"not a readable PDF, damaged or truncated"),
        "truncated.epub": (good_epub[:len(good_epub) // 2], r"broken archive: not a readable EPUB"),
        "truncated.docx": (good_docx[:len(good_docx) // 2], r"broken archive: not a readable Word"),
        "old.docx": (b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1" + bytes(600), r"an old binary Word \.doc"),
        "latin1.txt": ("café crème".encode("latin-1"), r"not UTF-8 \(byte 0xe9 at offset 3\)"),
        "empty.md": (b"", r"no text in it"),
        "bad.jsonl": (b'{"text": "fine"}\n{"text": \n', r"line 2: invalid JSON"),
        "nav-only.html": (b"<html><body></body></html>", r"no main text|not a readable HTML"),
    }
    for name, (data, _) in files.items():
        (tmp_path / name).write_bytes(data)
    # an EPUB whose chapters are encrypted (DRM): a valid archive with an encryption.xml
    drm = tmp_path / "drm.epub"
    drm.write_bytes(good_epub)
    with zipfile.ZipFile(drm, "a") as z:
        z.writestr("META-INF/encryption.xml", "<encryption><EncryptedData/></encryption>")
    return {**{n: r for n, (_, r) in files.items()}, "drm.epub": r"encrypted \(DRM\)"}


def test_broken_files_are_unreadable_with_their_reason(tmp_path):
    for name, reason in broken_files(tmp_path).items():
        with pytest.raises(Unreadable, match=reason):
            extract_file(tmp_path / name)


def test_ingest_counts_and_names_every_skip_and_never_writes_an_empty_record(tmp_path, capsys):
    folder = tmp_path / "docs"
    folder.mkdir()
    reasons = broken_files(folder)
    (folder / "good.html").write_bytes(demo.render_html(BLOCKS, "cape", []))
    (folder / "photo.png").write_bytes(b"\x89PNG")
    (folder / ".hidden.txt").write_text("secret notes that are long enough to keep", encoding="utf-8")
    (folder / ".git").mkdir()
    (folder / ".git" / "HEAD.txt").write_text("ref: refs/heads/main and more words", encoding="utf-8")
    out = tmp_path / "corpus.jsonl"
    warnings = []
    report = ingest([folder], out, progress=False, warn=warnings.append)
    assert report["files"] == {"found": len(reasons) + 2, "read": 1, "skipped": len(reasons), "other_types": 1}
    assert report["other_types"] == {".png": 1}
    for name, reason in reasons.items():
        line = next(s for s in report["skipped"] if s.startswith(f"{folder / name}: "))
        assert __import__("re").search(reason, line), line
    assert warnings == [f"skipped {s}" for s in report["skipped"]]
    records = [json.loads(x) for x in out.read_text(encoding="utf-8").splitlines()]
    assert records and all(r["text"].strip() and r["source"] == str(folder / "good.html") for r in records)
    assert json.loads((tmp_path / "corpus.jsonl.report.json").read_text())["records"]["kept"] == len(records)


def test_a_folder_of_links_and_special_files_is_read_once_and_never_waits(tmp_path):
    """What a real folder may hold beside documents: a link to a folder (read, as its files are the user's), links
    back up the tree (no loop: each real folder is read once), a link to nothing and a FIFO (opening one would
    wait forever): each of the last two is one skip line, the ingest goes on."""
    import os

    folder, elsewhere = tmp_path / "docs", tmp_path / "elsewhere"
    (folder / "sub").mkdir(parents=True)
    elsewhere.mkdir()
    (folder / "sub" / "notes.txt").write_text(PARAGRAPHS[0], encoding="utf-8")
    (elsewhere / "linked.txt").write_text(PARAGRAPHS[1], encoding="utf-8")
    (folder / "sub" / "up").symlink_to("..")  # docs/sub/up -> docs
    (folder / "sub" / "round").symlink_to(folder / "sub")  # itself
    (folder / "elsewhere").symlink_to(elsewhere)
    (folder / "gone.txt").symlink_to(tmp_path / "missing.txt")
    os.mkfifo(folder / "pipe.txt")
    warnings = []
    report = ingest([folder], tmp_path / "out.jsonl", progress=False, warn=warnings.append)
    assert report["files"] == {"found": 4, "read": 2, "skipped": 2, "other_types": 0}
    assert warnings == [f"skipped {folder / 'gone.txt'}: a symbolic link to nothing",
                        f"skipped {folder / 'pipe.txt'}: not a regular file (a FIFO, socket or device)"]
    kept = (tmp_path / "out.jsonl").read_text(encoding="utf-8")
    assert PARAGRAPHS[0][:40] in kept and PARAGRAPHS[1][:40] in kept


def test_jsonl_bad_lines_are_skipped_and_counted_when_asked(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"text": "a first record long enough"}\nnot json\n'
                                      '{"text": "a second record long enough"}\n', encoding="utf-8")
    report = ingest([tmp_path / "d.jsonl"], tmp_path / "out.jsonl", IngestOptions(skip_bad_lines=True),
                    progress=False)
    assert report["records"]["kept"] == 2 and report["bad_lines"]["total"] == 1
    assert report["bad_lines"]["first"] == ["d.jsonl:2: invalid JSON"]


def test_a_missing_library_names_the_package(tmp_path, monkeypatch):
    (tmp_path / "a.pdf").write_bytes(demo.render_pdf([BLOCKS], "x"))
    real_import = builtins.__import__

    def no_pdfium(name, *args, **kwargs):
        if name == "pypdfium2":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.delitem(sys.modules, "pypdfium2", raising=False)
    monkeypatch.setattr(builtins, "__import__", no_pdfium)
    with pytest.raises(MissingLibrary, match="needs the pypdfium2 package: pip install pypdfium2"):
        extract_file(tmp_path / "a.pdf")


def test_nothing_kept_is_an_error_and_writes_no_output(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "tiny.txt").write_text("hi", encoding="utf-8")
    out = tmp_path / "out.jsonl"
    with pytest.raises(DataError, match="no text kept from 1 files"):
        ingest([tmp_path / "docs"], out, progress=False)
    assert not out.exists()
    with pytest.raises(DataError, match="no such file or folder"):
        ingest([tmp_path / "nowhere"], out, progress=False)


# ---------------------------------------------------------------------------------------- the pipeline
def test_split_document_keeps_paragraphs_whole_and_bounds_every_record():
    text = "\n\n".join(p * 2 for p in PARAGRAPHS * 4)
    chunks = split_document(text, 500)
    assert all(len(c) <= 500 for c in chunks) and len(chunks) > 1
    assert "\n\n".join(chunks) == text  # cut only at paragraph boundaries here
    one_paragraph = " ".join(PARAGRAPHS * 10)  # no line breaks: cut at sentence ends
    chunks = split_document(one_paragraph, 300)
    assert all(len(c) <= 300 and c.endswith(".") for c in chunks)
    assert words(" ".join(chunks)) == words(one_paragraph)
    chunks = split_document("x" * 250, 100)  # no boundary at all: hard cuts
    assert [len(c) for c in chunks] == [100, 100, 50]
    assert split_document("   ", 100) == []


def test_page_furniture_goes_and_content_stays():
    pages = [[f"Annual report 2024 · chapter {i}", f"The first line of page {'abcde'[i - 1]}.",
              "A line repeated in the body", f"The last line of page {'abcde'[i - 1]}.", f"Page {i} of 5"]
             for i in range(1, 6)]
    kept = strip_page_furniture(pages)
    assert kept == [[p[1], p[2], p[3]] for p in pages]
    assert strip_page_furniture(pages[:1]) == [pages[0][:4]]  # one page: nothing recurs, the page number goes
    assert strip_page_furniture([["Title", "text", "7"]]) == [["Title", "text"]]  # a bare page number goes


def test_join_wrapped_lines():
    lines = ["This sentence was wrapped by the page layout at", "the right margin, and a word was hyphen-",
             "ated too.", "Short line.", "中文的句子因为版面而在这里换行了，所以后面", "的字要接上。"]
    assert join_wrapped_lines(lines) == ("This sentence was wrapped by the page layout at the right margin, and a "
                                         "word was hyphenated too.\nShort line.\n"
                                         "中文的句子因为版面而在这里换行了，所以后面的字要接上。")


def test_languages_are_told_per_record(tmp_path):
    assert detect_language(PARAGRAPHS[0]) == "en"
    assert detect_language("床前明月光，疑是地上霜。举头望明月，低头思故乡。") == "zh"
    assert detect_language("42 !!") == "und"
    (tmp_path / "en.txt").write_text(" ".join(PARAGRAPHS), encoding="utf-8")
    (tmp_path / "zh.txt").write_text("床前明月光，疑是地上霜。举头望明月，低头思故乡。" * 3, encoding="utf-8")
    report = ingest([tmp_path], tmp_path / "out.jsonl", progress=False)
    assert {k: v["records"] for k, v in report["languages"].items()} == {"en": 1, "zh": 1}


def test_languages_told_in_blocks_give_the_same_bytes(tmp_path, monkeypatch):
    # Records are cleaned a block at a time before their languages are told: a partial last block, held-out
    # records and the order of the output must not depend on the block's size.
    import dataset.ingest.pipeline as ingest_module

    options = IngestOptions(heldout=0.3, max_chars=2000)
    whole = tmp_path / "whole.jsonl"
    ingest([DOCUMENTS], whole, options, progress=False)
    monkeypatch.setattr(ingest_module, "_LANGUAGE_BLOCK", 4)
    blocks = tmp_path / "blocks.jsonl"
    report = ingest([DOCUMENTS], blocks, options, progress=False)
    assert report["records"]["kept"] % 4 != 0  # a partial last block is part of the test
    assert blocks.read_bytes() == whole.read_bytes()
    assert heldout_path(blocks).read_bytes() == heldout_path(whole).read_bytes()


def test_duplicates_are_dropped_and_the_output_is_excluded_from_the_input(tmp_path):
    (tmp_path / "a.txt").write_text(" ".join(PARAGRAPHS), encoding="utf-8")
    (tmp_path / "copy.md").write_text(" ".join(PARAGRAPHS), encoding="utf-8")
    (tmp_path / "near.txt").write_text(" ".join(PARAGRAPHS).replace("north", "east"), encoding="utf-8")
    out = tmp_path / "corpus.jsonl"
    first = ingest([tmp_path], out, progress=False)
    assert first["dropped"]["exact_duplicate"] == 1 and first["dropped"]["near_duplicate"] == 1
    again = ingest([tmp_path], out, progress=False)  # the earlier output sits in the folder: not read
    assert again["files"]["found"] == 3
    assert find_files([tmp_path, tmp_path / "a.txt"], exclude=[out]) == find_files([tmp_path], exclude=[out])


def test_same_folder_same_bytes(tmp_path):
    first, second = tmp_path / "1.jsonl", tmp_path / "2.jsonl"
    ingest([DOCUMENTS], first, progress=False)
    ingest([DOCUMENTS], second, progress=False)
    assert first.read_bytes() == second.read_bytes()


def test_options_are_checked():
    with pytest.raises(ConfigError, match="min_chars"):
        IngestOptions(min_chars=100, max_chars=50)
    with pytest.raises(ConfigError, match="threshold"):
        IngestOptions(threshold=0)


def test_cli(tmp_path, capsys):
    (tmp_path / "list.txt").write_text(f"# my files\n{DOCUMENTS / 'notes'}\n", encoding="utf-8")
    assert main(["--files_from", str(tmp_path / "list.txt"), "--out", str(tmp_path / "c.jsonl"), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "files: 18 found, 18 read, 0 skipped" in out and "languages: en" in out
    assert main([str(tmp_path / "nowhere"), "--out", str(tmp_path / "c.jsonl")]) == 2
    assert "error: " in capsys.readouterr().err


# ---------------------------------------------------------------------------------------- the bundled folder
def test_bundled_folder_meets_the_extraction_goals(tmp_path):
    refs = [json.loads(x) for x in (ROOT / "dataset" / "demo" / "documents_reference.jsonl").read_text(
        encoding="utf-8").splitlines()]
    files = {r["file"]: r["text"] for r in refs[1:]}
    assert sorted(files) == sorted(p.relative_to(DOCUMENTS).as_posix() for p in DOCUMENTS.rglob("*") if p.is_file())
    out = tmp_path / "corpus.jsonl"
    report = ingest([DOCUMENTS], out, progress=False)
    assert report["files"]["skipped"] == 0
    assert set(report["by_format"]) == {"pdf", "html", "epub", "docx", "markdown", "text", "jsonl"}
    texts: dict[str, list[str]] = {}
    for line in out.read_text(encoding="utf-8").splitlines():
        r = json.loads(line)
        texts.setdefault(bench_ingest.source_file(r["source"], DOCUMENTS), []).append(r["text"])
    for name, reference in files.items():
        q = bench_ingest.overlap(reference, "\n\n".join(texts[name]))
        assert q["recovered"] >= 0.98 and q["boilerplate"] <= 0.02, (name, q)


def test_overlap_measure_can_fail():
    assert bench_ingest.overlap("abcdefghij" * 20, "abcdefghij" * 20) == {"recovered": 1.0, "boilerplate": 0.0}
    q = bench_ingest.overlap("the reference text of the document", "Home | About | the reference text")
    assert q["recovered"] < 0.7 and q["boilerplate"] > 0.3


def test_heldout_documents_go_to_their_own_file_whole(tmp_path):
    from dataset.ingest.pipeline import is_heldout

    out = tmp_path / "corpus.jsonl"
    report = ingest([DOCUMENTS], out, IngestOptions(heldout=0.2, max_chars=2000), progress=False)
    held = [json.loads(x) for x in heldout_path(out).read_text(encoding="utf-8").splitlines()]
    kept = [json.loads(x) for x in out.read_text(encoding="utf-8").splitlines()]
    assert heldout_path(out).name == "corpus.heldout.jsonl" and report["heldout"]["records"] == len(held) > 0
    assert len(held) + len(kept) == report["records"]["kept"]
    assert {r["source"] for r in held}.isdisjoint(r["source"] for r in kept)  # every part of a document together
    assert all(is_heldout(r["source"], 0.2) for r in held) and not any(is_heldout(r["source"], 0.2) for r in kept)
    again = ingest([DOCUMENTS], tmp_path / "again.jsonl", IngestOptions(heldout=0.2, max_chars=2000), progress=False)
    assert again["heldout"]["records"] == len(held)
    with pytest.raises(ConfigError, match="heldout"):
        IngestOptions(heldout=1.0)


def test_a_docx_table_keeps_cells_that_read_alike_and_a_merged_cell_once(tmp_path):
    """"0 | 0 | 0" once came out as "0" (cells deduplicated by their text); a merged cell, which python-docx gives
    once per grid column it spans, must still appear once."""
    import docx
    document = docx.Document()
    table = document.add_table(rows=2, cols=3)
    for cell in table.rows[0].cells:
        cell.text = "0"
    merged = table.cell(1, 0).merge(table.cell(1, 1))
    merged.text = "wide"
    table.cell(1, 2).text = "narrow"
    document.save(tmp_path / "t.docx")
    assert read(tmp_path / "t.docx").splitlines() == ["0 | 0 | 0", "wide | narrow"]


SENTENCES = ["Fjords cut deep into the western coast.", "Glaciers carved these valleys slowly.",
             "Herring once filled the northern seas.", "Lighthouses guided ships past reefs."]


def pdf_of_pages(kinds: str) -> bytes:
    """A PDF with a page per letter of `kinds`: t a page of text, i a page that is only an image."""
    from fpdf import FPDF
    from PIL import Image

    pdf = FPDF()
    pdf.set_font("helvetica", size=12)
    for n, kind in enumerate(kinds, 1):
        pdf.add_page()
        if kind == "t":
            # a sentence of its own per page: a line that recurs on most pages is running furniture, dropped
            pdf.multi_cell(0, 8, SENTENCES[n - 1])
        else:
            pdf.image(Image.new("RGB", (200, 100), "white"), x=10, y=10, w=100)
    return bytes(pdf.output())


def test_image_pages_inside_a_text_pdf_are_counted_and_named(tmp_path):
    """The scan check once averaged over the file: a text PDF's image-only pages vanished uncounted. Now each page
    is judged: the text is kept and the pages without text are named in the report; a mostly-image file is a
    scan."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "mixed.pdf").write_bytes(pdf_of_pages("ttit"))
    (tmp_path / "docs" / "scan.pdf").write_bytes(pdf_of_pages("itii"))
    warnings = []
    report = ingest([str(tmp_path / "docs")], tmp_path / "out.jsonl", IngestOptions(min_chars=10), progress=False,
                    warn=warnings.append)
    mixed = str(tmp_path / "docs" / "mixed.pdf")
    assert report["pages_without_text"] == [f"{mixed}: page 3"]
    assert report["by_format"]["pdf"]["pages_without_text"] == 1 and report["by_format"]["pdf"]["pages"] == 4
    assert any(w.startswith(f"{mixed}: page 3 of 4 has no text layer") for w in warnings)
    assert [s for s in report["skipped"] if "scan.pdf" in s] == [
        f"{tmp_path / 'docs' / 'scan.pdf'}: no text layer on 3 of 4 pages (images: a scan? run OCR first, e.g. "
        "ocrmypdf)"]
    kept = (tmp_path / "out.jsonl").read_text()
    assert "Fjords cut deep" in kept and "Lighthouses guided ships" in kept


# ---------------------------------------------------------------------------------------- the report, whole
# A CLI run over a small folder, every number in its report worked out by hand from the files written here.
# Paths are relative to the run's folder, so a document's name (and so whether --heldout picks it) is the same on
# every machine; the clock is faked, so every time in the report is a count of readings.
JSONL_FIRST = "The harbour master counts the boats that come in before the storm."  # 66 chars
JSONL_LAST = "Glaciers carved these valleys slowly over many thousands of years."  # 66 chars
FRENCH = "Le café crème du matin est servi chaud au bord de la mer."  # 57 chars, written in Latin-1: 57 bytes
LOGBOOK = ("In the logbook the keeper wrote <b>fog</b> &amp; rain, and the fishing fleet waited in the bay for the "
           "weather to turn.")  # 119 chars; what looks like markup in a document's text is its content
NUMBERS = "3.14 2.71 1.41 1.73 2.23 0.57 4.66 8.31 9.81 6.02 1.61 2.50 7.29"  # 64 chars, no letters: "und"
TICK = 2**-9  # s; exact in binary, so sums of ticks carry no rounding of their own


class Clock:
    """time.perf_counter for dataset.ingest: each reading `tick` after the one before."""

    def __init__(self, tick: float):
        self.tick, self.readings = tick, 0

    def perf_counter(self) -> float:
        self.readings += 1
        return self.readings * self.tick


class Terminal(io.StringIO):
    """stderr as a terminal, so that the progress bar is up to --quiet alone."""

    def isatty(self) -> bool:
        return True


def write_folder(root) -> int:
    """The CLI test's folder under `root`; returns the PDFs' size in bytes (fpdf decides it)."""
    docs = root / "docs"
    (docs / "sub").mkdir(parents=True)
    (docs / ".git").mkdir()
    texts = {
        "a.txt": "\n\n".join(PARAGRAPHS),  # 95 + 2 + 90 + 2 + 96 = 285 chars: at --max_chars 200, records of 187, 96
        "b.md": PARAGRAPHS[2] + "\n\n" + LOGBOOK,  # 217 chars: a.txt's second record again (a duplicate), LOGBOOK
        "near.txt": PARAGRAPHS[0] + "\n\n" + PARAGRAPHS[1].replace("north", "east"),  # 186 chars: a near duplicate
        "nums.txt": NUMBERS,
        "sub/c.txt": "hi there",  # 8 chars: under --min_chars
        "vidé.md": "",  # skipped: no text in it
        "d.jsonl": "\n".join([json.dumps({"text": JSONL_FIRST}), "not json", json.dumps({"text": JSONL_LAST}),
                               "nor this"]) + "\n",
        "README": "read me",  # no reader: another type
        ".hidden.txt": PARAGRAPHS[1],  # hidden: left out, as everything in .git is
        ".git/x.txt": PARAGRAPHS[2],
    }
    for name, text in texts.items():
        (docs / name).write_text(text, encoding="utf-8")
    (docs / "fr.txt").write_bytes(FRENCH.encode("latin-1"))
    (docs / "photo.png").write_bytes(b"\x89PNG")
    (docs / "scan.PNG").write_bytes(b"\x89PNG")  # counted as .png
    (docs / "gone.txt").symlink_to(root / "missing.txt")
    (docs / "loop.txt").symlink_to("loop.txt")  # a link to itself: once a crash (RuntimeError: Symlink loop)
    mixed = pdf_of_pages("tiit")  # SENTENCES[0] on page 1, SENTENCES[3] on page 4, images on pages 2 and 3
    two = pdf_of_pages("itt")  # an image on page 1, SENTENCES[1] and SENTENCES[2] on pages 2 and 3
    (docs / "mixed.pdf").write_bytes(mixed)
    (docs / "two.pdf").write_bytes(two)
    return len(mixed) + len(two)


def run_cli(root, *args, tick: float = TICK, block: int = 256) -> tuple[int, str, str]:
    """main(args) run in the folder `root`, on a terminal, by a fake clock, telling languages `block` records at a
    time: its exit code, stdout and stderr."""
    import dataset.ingest.pipeline as ingest_module

    stdout, stderr = io.StringIO(), Terminal()
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        mp.setattr(ingest_module, "time", Clock(tick))
        mp.setattr(ingest_module, "_LANGUAGE_BLOCK", block)
        mp.setattr(sys, "stderr", stderr)
        with contextlib.redirect_stdout(stdout):
            code = main(list(args))
    return code, stdout.getvalue(), stderr.getvalue()


def read_jsonl(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture
def cli_run(tmp_path):
    """`python -m dataset.ingest docs --out out/corpus.jsonl` with every option set, on a terminal, --quiet;
    languages told 3 records at a time (9 records kept: blocks of 3, 3, 3 and a last, empty one). A run per test
    (0.2 s): the mutation tester runs only the tests during which a function ran."""
    pdf_size = write_folder(tmp_path)
    code, stdout, stderr = run_cli(tmp_path, "docs", "--out", "out/corpus.jsonl", "--max_chars", "200", "--min_chars",
                                   "30", "--encoding", "latin-1", "--skip_bad_lines", "--heldout", "0.05",
                                   "--threshold", "0.5", "--quiet", block=3)
    out = tmp_path / "out"
    report = (out / "corpus.jsonl.report.json").read_text(encoding="utf-8")
    return types.SimpleNamespace(code=code, stdout=stdout, stderr=stderr, pdf_size=pdf_size,
                                 report=json.loads(report), report_text=report,
                                 corpus_text=(out / "corpus.jsonl").read_text(encoding="utf-8"),
                                 corpus=read_jsonl(out / "corpus.jsonl"),
                                 heldout=read_jsonl(out / "corpus.heldout.jsonl"))


def record(text: str, source: str, lang: str, part: int = 1) -> dict:
    return {"text": text, "source": source, "part": part, "lang": lang}


def test_cli_writes_the_records_in_file_order_and_holds_out_by_name(cli_run):
    """What is kept, in order, split, labelled and held out. --heldout 0.05 picks the documents whose name's
    SHA-256 starts below 0.05 * 2**64: `printf docs/nums.txt | sha256sum` starts 0a83fd31 (0.041),
    `docs/d.jsonl:3` 06ea9b73 (0.027); every other name here starts at 3b5a101d (0.23) or above."""
    assert cli_run.code == 0
    assert cli_run.corpus == [
        record(PARAGRAPHS[0] + "\n\n" + PARAGRAPHS[1], "docs/a.txt", "en"),
        record(PARAGRAPHS[2], "docs/a.txt", "en", part=2),
        record(LOGBOOK, "docs/b.md", "en", part=2),  # part 1 repeats a.txt's part 2: dropped
        record(JSONL_FIRST, "docs/d.jsonl:1", "en"),
        record(FRENCH, "docs/fr.txt", "fr"),  # read with --encoding latin-1
        record(SENTENCES[0] + " " + SENTENCES[3], "docs/mixed.pdf", "en"),
        record(SENTENCES[1] + " " + SENTENCES[2], "docs/two.pdf", "en"),
    ]  # near.txt: a near duplicate; sub/c.txt: too short
    assert cli_run.heldout == [record(JSONL_LAST, "docs/d.jsonl:3", "en"), record(NUMBERS, "docs/nums.txt", "und")]
    assert f'"{FRENCH}"' in cli_run.corpus_text  # UTF-8 as it is, not \u escapes


def test_cli_report_json_whole(cli_run):
    """Every field of <out>.report.json, and its layout. Times: the clock is read once at the start, twice per
    file of a known format (read or skipped: 12 here), twice per block of records told their language (4), once
    at the end."""
    pdf_mb = round(cli_run.pdf_size / 1e6 / (2 * TICK), 3)

    def fmt(files, read, skipped, size, documents, chars, mb_per_s, **pdf):
        return {"files": files, "read": read, "skipped": skipped, "bytes": size, "pages": pdf.get("pages", 0),
                "pages_without_text": pdf.get("pages_without_text", 0), "documents": documents, "chars": chars,
                "seconds": round(files * TICK, 3), "mb_per_s": mb_per_s, **pdf}

    assert cli_run.report == {
        "inputs": ["docs"],
        "output": "out/corpus.jsonl",
        "files": {"found": 15, "read": 9, "skipped": 3, "other_types": 3},
        "by_format": {
            # 78 + 1 + 9 + 78 + 1 + 9 = 176 bytes in 1 tick (1/512 s): 0.090112 MB/s
            "jsonl": fmt(1, 1, 0, 176, 2, 66 + 66, 0.09),
            # b.md: 217 bytes; vidé.md: skipped; 2 ticks: 217e-6 * 256 = 0.055552 MB/s
            "markdown": fmt(2, 1, 1, 217, 1, 217, 0.056),
            "pdf": fmt(2, 2, 0, cli_run.pdf_size, 2, (39 + 1 + 36) + (37 + 1 + 38), pdf_mb, pages=4 + 3,
                       pages_without_text=2 + 1, pages_per_s=1792.0),  # 7 pages in 2/512 s
            # a 285 + fr 57 + near 186 + nums 64 + c 8 = 600 bytes (2 links skipped), 7 ticks: 0.0438857 MB/s
            "text": fmt(7, 5, 2, 600, 5, 600, 0.044),
        },
        "other_types": {"(no suffix)": 1, ".png": 2},
        "skipped": ["docs/gone.txt: a symbolic link to nothing",
                    "docs/loop.txt: cannot read it (Too many levels of symbolic links)",
                    "docs/vidé.md: no text in it"],
        "pages_without_text": ["docs/mixed.pdf: pages 2, 3", "docs/two.pdf: page 1"],
        "bad_lines": {"total": 2, "reasons": {"invalid JSON": 2},
                      "first": ["d.jsonl:2: invalid JSON", "d.jsonl:4: invalid JSON"]},
        # a.txt 2, b.md 2, d.jsonl 2, fr, mixed, near, nums, one, c: 12; less c, b.md's part 1, near.txt: 9, 2 held
        "records": {"from_documents": 12, "kept": 9, "documents_split": 2},
        "heldout": {"output": "out/corpus.heldout.jsonl", "records": 2},
        "dropped": {"empty_after_cleaning": 0, "too_short": 1, "exact_duplicate": 1, "near_duplicate": 1},
        # 187 + 96 + 96 + 119 + 66 + 66 + 57 + 76 + 186 + 64 + 76 + 8 = 1097; less 96, 186 and 8 = 807
        "chars": {"extracted": 1097, "kept": 807},
        # most chars first (not by name): en 187 + 96 + 119 + 66 + 66 + 76 + 76 = 686, und 64, fr 57
        "languages": {"en": {"records": 7, "chars": 686}, "und": {"records": 1, "chars": 64},
                      "fr": {"records": 1, "chars": 57}},
        "elapsed_s": 0.064,  # readings 1 (start) ... 1 + 2 * 12 + 2 * 4 + 1 = 34 (end): 33 ticks = 0.064453125
        "extract_s": 0.023,  # 12 files, a tick each: 0.0234375
        "language_s": 0.008,  # 4 blocks, a tick each: 0.0078125
        "options": {"max_chars": 200, "min_chars": 30, "encoding": "latin-1", "skip_bad_lines": True, "heldout": 0.05,
                    "near_dedup": True, "threshold": 0.5, "shingle_size": 5, "num_perm": 128, "seed": 1},
    }
    # indented by 2, UTF-8 as it is (not \u escapes), a line end at the end
    assert cli_run.report_text.startswith('{\n  "inputs": [\n    "docs"\n  ],\n  "output": "out/corpus.jsonl",\n')
    assert '"docs/vidé.md: no text in it"' in cli_run.report_text and cli_run.report_text.endswith("\n}\n")


def test_cli_summary_and_warnings_whole(cli_run):
    """The lines printed on stdout, and on stderr the warnings, one a line (--quiet: no progress bar)."""
    assert cli_run.stdout == "\n".join([
        "ingested docs -> out/corpus.jsonl",
        "  files: 15 found, 9 read, 3 skipped, 3 of other types",
        "    jsonl         1 read     0 skipped           132 chars  0.09 MB/s",
        "    markdown      1 read     1 skipped           217 chars  0.06 MB/s",
        f"    pdf           2 read     0 skipped           152 chars  {cli_run.pdf_size * 256e-6:.2f} MB/s, "
        "7 pages (1,792/s)",
        "    text          5 read     2 skipped           600 chars  0.04 MB/s",
        "  other types (not read): (no suffix) 1, .png 2",
        "  PDF pages without text (not read): docs/mixed.pdf: pages 2, 3; docs/two.pdf: page 1",
        "  bad JSONL lines skipped: 2 (d.jsonl:2: invalid JSON; d.jsonl:4: invalid JSON)",
        "  records: 12 from the documents (2 documents split), 9 kept",
        "  held out: 2 of them -> out/corpus.heldout.jsonl",
        "  dropped: empty_after_cleaning 0, too_short 1, exact_duplicate 1, near_duplicate 1",
        "  chars: 1,097 extracted, 807 kept",
        "  languages: en 7 records / 686 chars, und 1 records / 64 chars, fr 1 records / 57 chars",
        "  0.1 s (0.0 s reading files, 0.0 s telling languages); report: out/corpus.jsonl.report.json",
    ]) + "\n"
    assert cli_run.stderr == ("skipped docs/gone.txt: a symbolic link to nothing\n"
                              "skipped docs/loop.txt: cannot read it (Too many levels of symbolic links)\n"
                              "docs/mixed.pdf: pages 2, 3 of 4 have no text layer (images: their text is not read; "
                              "OCR the file to keep it)\n"
                              "docs/two.pdf: page 1 of 3 has no text layer (images: their text is not read; "
                              "OCR the file to keep it)\n"
                              "skipped docs/vidé.md: no text in it\n")


def test_cli_defaults_reach_the_ingest_and_the_bar_is_drawn_on_a_terminal(tmp_path):
    """Without options: the documented defaults (report options), nothing held out (no file, no line for it),
    none of the lines for what did not happen, and, without --quiet on a terminal, the progress bar on stderr.
    The clock stands still: a format read in no measurable time has no speed (null, "-"), not a division by 0."""
    (tmp_path / "a.txt").write_text("\n\n".join(PARAGRAPHS), encoding="utf-8")  # 285 chars, one record
    code, stdout, stderr = run_cli(tmp_path, "a.txt", "--out", "c.jsonl", tick=0.0)
    assert code == 0
    assert stdout == "\n".join([
        "ingested a.txt -> c.jsonl",
        "  files: 1 found, 1 read, 0 skipped, 0 of other types",
        "    text          1 read     0 skipped           285 chars  -",
        "  records: 1 from the documents (0 documents split), 1 kept",
        "  dropped: empty_after_cleaning 0, too_short 0, exact_duplicate 0, near_duplicate 0",
        "  chars: 285 extracted, 285 kept",
        "  languages: en 1 records / 285 chars",
        "  0.0 s (0.0 s reading files, 0.0 s telling languages); report: c.jsonl.report.json",
    ]) + "\n"
    report = json.loads((tmp_path / "c.jsonl.report.json").read_text())
    assert report["options"] == {"max_chars": 8000, "min_chars": 20, "encoding": None, "skip_bad_lines": False,
                                 "heldout": 0.0, "near_dedup": True, "threshold": 0.8, "shingle_size": 5,
                                 "num_perm": 128, "seed": 1}
    assert report["by_format"]["text"]["seconds"] == 0.0 and report["by_format"]["text"]["mb_per_s"] is None
    assert report["heldout"] is None and not (tmp_path / "c.heldout.jsonl").exists()
    assert "ingest: 100%" in stderr and "1/1 [" in stderr


def test_heldout_is_a_name_hash_below_the_share():
    """A document is held out when the first 8 bytes of its name's SHA-256, as a fraction of 2**64, are below the
    share: `printf docs/1291.txt | sha256sum` starts a9cd1eec0981e000, a fraction exact as a float."""
    edge = 0xA9CD1EEC0981E000 / 2**64  # 0.66328...
    assert not is_heldout("docs/1291.txt", edge)
    assert is_heldout("docs/1291.txt", math.nextafter(edge, 1.0))
    assert not is_heldout("docs/1291.txt", 0.0) and is_heldout("docs/1291.txt", 0.9)


@pytest.mark.parametrize("text, max_chars, records", [
    # a paragraph that fits without the blank line after it stays whole (it was once cut at a space)
    ("Short one.\n\nNext one.", 10, ["Short one.", "Next one."]),
    # paragraphs before lines: "cccc" would fit beside the first paragraph, but belongs to the second
    ("aaaa\nbbbb\n\ncccc\ndddd", 16, ["aaaa\nbbbb", "cccc\ndddd"]),
    ("aaaa bbbb\ncccc dddd", 12, ["aaaa bbbb", "cccc dddd"]),  # lines before spaces
    ("你好。再见。", 4, ["你好。", "再见。"]),  # two sentences (no space to cut at): at the sentence end
    ("aa bb cccc", 7, ["aa bb", "cccc"]),  # at the last space that keeps the record under max_chars
    ("a bbbbbb", 4, ["a", "bbb", "bbb"]),  # a space after one character is a cut; a long word is cut anywhere
    # paragraphs of 6, 6 and 4 characters (the blank lines counted) at 10: the first alone (6 + 6 > 10), the last two
    # together, exactly 10 ("efgh\n\n" + "ijkl")
    ("abcd\n\nefgh\n\nijkl", 10, ["abcd", "efgh\n\nijkl"]),
])
def test_split_document_cuts_at_the_coarsest_boundary(text, max_chars, records):
    assert split_document(text, max_chars) == records


def test_format_speeds_are_rounded_and_absent_without_a_measurable_time():
    """MB/s to 3 decimals, pages/s to 1 (1.5 MB and 3 pages in 0.7 s: 2.142857 MB/s, 4.2857 pages/s); a format
    read in no measurable time has no speed rather than a division by zero; pages/s only for a format with pages."""
    stats = FormatStats(files=1, read=1, bytes=1_500_000, pages=3, documents=1, chars=9, seconds=0.7).summary()
    assert stats == {"files": 1, "read": 1, "skipped": 0, "bytes": 1_500_000, "pages": 3, "pages_without_text": 0,
                     "documents": 1, "chars": 9, "seconds": 0.7, "mb_per_s": 2.143, "pages_per_s": 4.3}
    timeless = FormatStats(bytes=10, pages=3).summary()
    assert timeless["mb_per_s"] is None and timeless["pages_per_s"] is None
    assert "pages_per_s" not in FormatStats(bytes=10, seconds=1.0).summary()
    # a MB is 10**6 bytes: 2,001,001 bytes in 2 s are 1.0005005 MB/s, 1.001 (over 1,000,001 it would be 1.0)
    assert FormatStats(bytes=2_001_001, seconds=2.0).summary()["mb_per_s"] == 1.001


def test_ten_letters_are_enough_to_tell_a_language():
    assert detect_language("lighthous") == "und"  # 9 letters
    assert detect_language("lighthouse") != "und"


def test_cli_help_names_every_option_with_its_default(monkeypatch, capsys):
    """--help: the command's docstring as written, and each option with its help (defaults filled in)."""
    import dataset.ingest.cli as cli_module

    monkeypatch.setenv("COLUMNS", "250")  # one line per option
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: python -m dataset.ingest [PATH ...] [--config FILE] [flags: see below]\n\n"
                           + cli_module.__doc__)
    lines = text.splitlines()
    for option, help_ in [
        ("  --config FILE         ", "YAML/JSON file of settings (nested by group or flat); flags given here win over "
                                   "it"),
        ("  PATH                  ", "folders (walked) and files to read"),
        ("  --files_from LIST     ", "a text file naming one file or folder per line"),
        ("  --out OUT             ", "output .jsonl; the report goes to <out>.report.json"),
        ("  --quiet, --no-quiet   ", "no progress bar"),
        ("  --max_chars N         ", "longer documents are split into records at paragraph boundaries (default: 8000)"),
        ("  --min_chars N         ", "records shorter than this after cleaning are dropped (default: 20)"),
        ("  --encoding ENCODING   ", "the encoding of text files that are not UTF-8 (e.g. gb18030, cp1252); without "
                                   "it such files are skipped, with the reason"),
        ("                        ", "JSONL: skip and count bad lines (without it, a file with a bad line is "
                                   "skipped, naming it)"),
        ("  --heldout SHARE       ", "share of documents (whole files, EPUB chapters, JSONL lines; chosen by a hash of "
                                   "their name) written to <out stem>.heldout.jsonl instead, to measure the adapted "
                                   "model on (train_pretrain.py --eval_data_path) (default: 0.0)"),
        ("                        ", "near-duplicates dropped too (--no-near_dedup: exact deduplication only) (on by "
                                   "default)"),
        ("  --no_near_dedup       ", "the same as --no-near_dedup"),
        ("  --threshold X         ", "Jaccard similarity that counts as a near-duplicate (default: 0.8)"),
    ]:
        assert option + help_ in lines, (option, help_)
    # the settings MinHash needs are a --config file's only
    assert not any(flag in text for flag in ("--shingle_size", "--num_perm", "--seed"))


@pytest.mark.parametrize("args, message", [
    (["docs"], "name the output file: --out corpus.jsonl"),
    (["--out", "c.jsonl"], "name at least one folder or file (or --files_from LIST)"),
    (["docs", "--out", "c.jsonl", "--max_chars", "10", "--min_chars", "20"],
     "need 1 <= --min_chars <= --max_chars, got 20 and 10"),
])
def test_cli_usage_errors(args, message, capsys):
    assert main(args) == 2 and capsys.readouterr().err == f"error: {message}\n"


def test_cli_files_from(tmp_path, capsys):
    """A list names files and folders one a line; blank lines and comments (indented too) are left out; a list
    that cannot be read is one error line, naming it."""
    (tmp_path / "a.txt").write_text(PARAGRAPHS[0], encoding="utf-8")
    (tmp_path / "list.txt").write_text(f"# mine\n\n   # {tmp_path}/not-a-file.txt\n  {tmp_path / 'a.txt'}  \n",
                                       encoding="utf-8")
    out = tmp_path / "c.jsonl"
    assert main(["--files_from", str(tmp_path / "list.txt"), "--out", str(out), "--quiet"]) == 0
    assert [r["source"] for r in read_jsonl(out)] == [str(tmp_path / "a.txt")]
    assert main(["--files_from", str(tmp_path / "nowhere.txt"), "--out", str(out)]) == 2
    assert capsys.readouterr().err == (f"error: {tmp_path / 'nowhere.txt'}: cannot read the list of files ([Errno 2] "
                                       f"No such file or directory: '{tmp_path / 'nowhere.txt'}')\n")


def test_cli_no_near_dedup_keeps_near_duplicates_only(tmp_path):
    text = " ".join(PARAGRAPHS)
    for name, body in [("a.txt", text), ("b.txt", text), ("c.txt", text.replace("north", "east"))]:
        (tmp_path / name).write_text(body, encoding="utf-8")
    code, stdout, _ = run_cli(tmp_path, "a.txt", "b.txt", "c.txt", "--out", "out/c.jsonl", "--no_near_dedup", "--quiet")
    assert code == 0 and stdout.startswith("ingested a.txt, b.txt, c.txt -> out/c.jsonl\n")
    report = json.loads((tmp_path / "out" / "c.jsonl.report.json").read_text())
    assert report["dropped"]["exact_duplicate"] == 1 and report["dropped"]["near_duplicate"] == 0
    assert [r["source"] for r in read_jsonl(tmp_path / "out" / "c.jsonl")] == ["a.txt", "c.txt"]
    assert report["options"]["near_dedup"] is False


def test_the_near_dedup_settings_reach_the_deduplication(tmp_path, monkeypatch):
    """Each near-duplicate setting is the deduplication's, the seed too (it picks the MinHash permutations: another
    seed, other signatures)."""
    import dataset.ingest.pipeline as ingest_module

    made = []

    class Recorded(ingest_module.Deduper):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(ingest_module, "Deduper", Recorded)
    (tmp_path / "a.txt").write_text(PARAGRAPHS[0], encoding="utf-8")
    opts = IngestOptions(shingle_size=3, num_perm=64, threshold=0.7, seed=7)
    ingest([str(tmp_path / "a.txt")], tmp_path / "c.jsonl", opts, progress=False)
    [d] = made
    assert (d.near_dedup, d.shingle_size, d.num_perm, d.threshold, d.seed) == (True, 3, 64, 0.7, 7)


def test_cli_a_failing_disk_is_one_error_line_naming_the_output(tmp_path, monkeypatch, capsys):
    """An OSError that names no file (a full disk) is reported against the output."""
    import errno

    import dataset.ingest.pipeline as ingest_module

    def full(path, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    (tmp_path / "a.txt").write_text(PARAGRAPHS[0], encoding="utf-8")
    monkeypatch.setattr(ingest_module, "write_atomic", full)
    assert main([str(tmp_path / "a.txt"), "--out", str(tmp_path / "c.jsonl"), "--quiet"]) == 1
    assert capsys.readouterr().err == f"error: {tmp_path / 'c.jsonl'}: No space left on device\n"


@pytest.mark.parametrize("options, message", [
    (dict(min_chars=0), "need 1 <= --min_chars <= --max_chars, got 0 and 8000"),
    (dict(min_chars=100, max_chars=50), "need 1 <= --min_chars <= --max_chars, got 100 and 50"),
    (dict(threshold=0.0), "--threshold must be in (0, 1], got 0.0"),
    (dict(threshold=1.5), "--threshold must be in (0, 1], got 1.5"),
    (dict(heldout=-0.1), "--heldout must be in [0, 1), got -0.1"),
    (dict(heldout=1.5), "--heldout must be in [0, 1), got 1.5"),
])
def test_options_out_of_range_are_named_whole(options, message):
    with pytest.raises(ConfigError) as error:
        IngestOptions(**options)
    assert str(error.value) == message


def test_options_at_the_ends_of_their_ranges_are_taken():
    IngestOptions(min_chars=1, max_chars=1)
    IngestOptions(min_chars=7, max_chars=7, threshold=1.0, heldout=0.0)


def test_heldout_path_keeps_the_suffix_or_gives_jsonl():
    assert heldout_path("data/corpus.jsonl") == Path("data/corpus.heldout.jsonl")
    assert heldout_path("data/corpus.txt") == Path("data/corpus.heldout.txt")
    assert heldout_path("data/corpus") == Path("data/corpus.heldout.jsonl")


def test_a_file_that_vanished_is_unreadable_with_the_reason(tmp_path):
    """A listed file gone before it is read (not a link): the system's reason, not "a symbolic link to nothing"."""
    from dataset.ingest.walk import regular_file_size

    with pytest.raises(Unreadable) as error:
        regular_file_size(tmp_path / "gone.txt")
    assert str(error.value) == "cannot read it (No such file or directory)"


def test_ingest_errors_name_what_is_wrong_whole(tmp_path):
    """An output that is a folder; inputs with no files (all named); nothing kept (the first three skips named,
    none when nothing was skipped)."""
    (tmp_path / "e1").mkdir()
    (tmp_path / "e2").mkdir()
    (tmp_path / "bad").mkdir()
    for name in ("a.md", "b.md", "c.md", "d.md"):
        (tmp_path / "bad" / name).write_text("", encoding="utf-8")
    (tmp_path / "short.txt").write_text("hi", encoding="utf-8")
    out = tmp_path / "out.jsonl"
    cases = [
        (([tmp_path / "short.txt"], tmp_path / "e1"),
         f"{tmp_path / 'e1'}: is a folder, expected an output .jsonl path"),
        (([tmp_path / "e1", tmp_path / "e2"], out), f"{tmp_path / 'e1'}, {tmp_path / 'e2'}: no files found"),
        (([tmp_path / "short.txt"], out), f"no text kept from 1 files under {tmp_path / 'short.txt'}"),
        (([tmp_path / "bad", tmp_path / "short.txt"], out),
         f"no text kept from 5 files under {tmp_path / 'bad'}, {tmp_path / 'short.txt'}; skipped: "
         + "; ".join(f"{tmp_path / 'bad' / n}: no text in it" for n in ("a.md", "b.md", "c.md"))),
    ]
    for (inputs, output), message in cases:
        with pytest.raises(DataError) as error:
            ingest(inputs, output, progress=False, warn=lambda msg: None)
        assert str(error.value) == message
        assert not out.exists() and not heldout_path(out).exists()


def test_ingest_draws_its_progress_bar_by_default(tmp_path, capsys):
    (tmp_path / "a.txt").write_text(PARAGRAPHS[0], encoding="utf-8")
    ingest([tmp_path / "a.txt"], tmp_path / "out.jsonl")
    err = capsys.readouterr().err
    assert "ingest: 100%" in err and "1/1 [" in err and "file/s]" in err


def test_a_file_name_that_is_not_utf8_is_read_and_named_exactly(tmp_path):
    """A name in another encoding (bytes that are not UTF-8, common on old archives) reaches Python as surrogates;
    such a file was once a crash (UnicodeEncodeError) when its record, or the report naming it, was written. Its
    source reads back as the name's own bytes, and the summary on screen shows it escaped."""
    import os

    folder = os.fsencode(tmp_path / "docs")
    os.mkdir(folder)
    with open(folder + b"/caf\xe9.txt", "wb") as f:
        f.write(PARAGRAPHS[0].encode("utf-8"))
    with open(folder + b"/bad\xff.pdf", "wb") as f:  # skipped, and named in the report and on screen
        f.write(b"not a PDF")
    out = tmp_path / "out.jsonl"
    assert main([str(tmp_path / "docs"), "--out", str(out), "--quiet"]) == 0
    assert [os.fsencode(r["source"]) for r in read_jsonl(out)] == [folder + b"/caf\xe9.txt"]
    report = json.loads(out.with_name("out.jsonl.report.json").read_text(encoding="utf-8"))
    assert [os.fsencode(s.partition(": ")[0]) for s in report["skipped"]] == [folder + b"/bad\xff.pdf"]


def test_the_list_of_files_is_read_as_utf8_whatever_the_locale(tmp_path):
    """--files_from's list is UTF-8 (as the files it names are), also where the locale's encoding is ASCII (LC_ALL=C
    without Python's UTF-8 mode), where read in the locale's encoding a list naming café.txt would not decode."""
    import os
    import subprocess

    from dataset.ingest.cli import _listed

    (tmp_path / "list.txt").write_text(f"{tmp_path / 'café.txt'}\n", encoding="utf-8")
    expected = [str(tmp_path / "café.txt")]
    assert _listed(str(tmp_path / "list.txt")) == expected
    env = {**os.environ, "LC_ALL": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}
    done = subprocess.run([sys.executable, "-c", "import sys; from dataset.ingest.cli import _listed; "
                           "print(ascii(_listed(sys.argv[1])))", str(tmp_path / "list.txt")],
                          cwd=ROOT, env=env, capture_output=True, text=True, encoding="ascii", errors="replace")
    assert done.stdout == ascii(expected) + "\n", done.stderr
