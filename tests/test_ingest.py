"""dataset.ingest and dataset.extract: every format read from real files (made with each format's own library),
the broken ones skipped with their reason, splitting, page furniture, languages, determinism, the CLI, and the
bundled example folder's extraction quality (bench/bench_ingest.py's measure)."""
from __future__ import annotations

import builtins
import json
import sys
import zipfile

import pytest

from common.errors import ConfigError, DataError
from dataset.ingest.cli import main
from dataset.ingest.formats import extract_file, file_format
from dataset.ingest.formats.base import MissingLibrary, Unreadable
from dataset.ingest.formats.pdf import join_wrapped_lines, strip_page_furniture
from dataset.ingest.language import detect_language
from dataset.ingest.pipeline import IngestOptions, heldout_path, ingest
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
