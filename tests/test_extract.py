"""dataset/ingest/formats (the readers), line by line: each reader's text checked whole against hand-written text
from small real files written here (with each format's own library), and each Unreadable reason checked whole, so
that a changed rule or message is noticed (test_ingest.py measures the extraction of larger documents by their
overlap with a reference)."""
from __future__ import annotations

import codecs
import io
import sys
import zipfile

import pytest

from dataset.ingest.formats import extract_file, file_format
from dataset.ingest.formats.base import Document, Extracted, MissingLibrary, Reading, Unreadable
from dataset.ingest.formats.html import _frame_body, _prose_size, _short_main, _slug, block_text, prepare_page
from dataset.ingest.formats.jsonl import JSONL
from dataset.ingest.formats.pdf import join_wrapped_lines, strip_page_furniture
from dataset.jsonl import SkipReport

NIGHT = "The keeper trims the lamp twice each night and writes the weather in the log book by the door."
WINTER = "In winter the storms came from the north, and the boats sheltered in the harbour below the cape."
TREE = "Nobody remembered who had planted the apple tree beside the keeper's cottage, but it bore fruit."


def texts(path, **kwargs) -> list[str]:
    return [d.text for d in extract_file(path, **kwargs).documents]


def reason(path, **kwargs) -> str:
    """The reason `path` is Unreadable for."""
    with pytest.raises(Unreadable) as e:
        extract_file(path, **kwargs)
    return str(e.value)


def write(path, data):
    path.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
    return path


def zip_of(entries: dict[str, bytes | str]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as archive:
        for name, data in entries.items():
            archive.writestr(name, data)
    return buf.getvalue()


# ------------------------------------------------------------------------------------------- formats, libraries
@pytest.mark.parametrize("name, fmt", [
    ("a.txt", "text"), ("notes.v1.txt", "text"), ("A.MD", "markdown"), ("page.XHTML", "html"),
    ("x.jsonl.gz", "jsonl"), ("corpus.v2.JSONL.GZ", "jsonl"), ("x.tar.gz", None), ("README", None)])
def test_file_format_reads_the_last_two_suffixes_then_the_last(tmp_path, name, fmt):
    """".jsonl.gz" is told by the last two suffixes, any case; "notes.v1.txt" (no format ".v1.txt") by its last."""
    assert file_format(tmp_path / name) == fmt


def test_a_missing_library_names_its_package_not_its_module(tmp_path, monkeypatch):
    """python-docx is imported as `docx`: the message names what to pip install."""
    monkeypatch.setitem(sys.modules, "docx", None)  # import docx -> ImportError
    with pytest.raises(MissingLibrary) as e:
        extract_file(write(tmp_path / "a.docx", b"PK"))
    assert str(e.value) == "reading .docx files needs the python-docx package: pip install python-docx"


# ------------------------------------------------------------------------------------------- plain text
@pytest.mark.parametrize("data, encoding, text", [
    (codecs.BOM_UTF8 + "hé".encode(), None, "hé"),
    (codecs.BOM_UTF16_LE + "hé".encode("utf-16-le"), None, "hé"),
    (codecs.BOM_UTF16_BE + "hé".encode("utf-16-be"), None, "hé"),
    (codecs.BOM_UTF8 + "hé".encode(), "cp1252", "hé"),  # a byte-order mark wins over --encoding
    ("café".encode("latin-1"), "latin-1", "café"),
    (b"line one\n  line two  \n", None, "line one\n  line two  \n"),  # as it is, spaces and all
    (b"a" * 8192 + b"\x00", None, "a" * 8192 + "\x00"),  # a NUL past the first 8192 bytes is only a character
])
def test_plain_text_is_decoded_as_it_is(tmp_path, data, encoding, text):
    assert texts(write(tmp_path / "a.txt", data), encoding=encoding) == [text]


@pytest.mark.parametrize("data, encoding, why", [
    ("café".encode("latin-1"), None,
     "not UTF-8 (byte 0xe9 at offset 3); convert it to UTF-8, or pass --encoding (e.g. gb18030, cp1252)"),
    ("café".encode("latin-1"), "ascii", "not ascii (byte 0xe9 at offset 3)"),  # no hint: the user chose one
    (b"abc", "nope", "unknown encoding 'nope'"),
    (b"a" * 8191 + b"\x00", None, "binary content (NUL bytes), not a text file"),
    (b" \n\t\n", None, "no text in it"),
])
def test_plain_text_reasons(tmp_path, data, encoding, why):
    assert reason(write(tmp_path / "a.md", data), encoding=encoding) == why


def test_files_no_reader_takes_or_that_cannot_be_opened(tmp_path):
    assert reason(write(tmp_path / "photo.png", b"x")) == "no reader for .png"
    assert reason(write(tmp_path / "README", b"x")) == "no reader for files without a suffix"
    (tmp_path / "folder.txt").mkdir()
    assert reason(tmp_path / "folder.txt") == "cannot read it (Is a directory)"


# ------------------------------------------------------------------------------------------- JSONL
def test_jsonl_bad_lines_are_named_by_line_or_skipped_and_counted(tmp_path):
    path = write(tmp_path / "d.jsonl", '{"text": "first"}\n[1]\n{"text": "third"}\n')
    assert reason(path) == "line 2: expected a JSON object, got list (use --skip_bad_lines to skip such lines)"
    report = SkipReport()
    docs = extract_file(path, skip_bad_lines=True, report=report).documents
    assert docs == [Document("first", f"{path}:1"), Document("third", f"{path}:3")]
    assert dict(report.counts) == {"expected a JSON object, got list": 1}
    with pytest.raises(Unreadable, match="^line 2: "):  # the reader's own default: bad lines are errors
        JSONL.read(path, Reading())
    # a reason about the whole file loses its "path: " prefix
    assert reason(write(tmp_path / "e.jsonl", b"")) == "no usable records (empty file, or every line was bad)"


# ------------------------------------------------------------------------------------------- HTML
def page(body: str, head: str = "<title>The lamp</title>") -> str:
    return f"<!DOCTYPE html><html><head>{head}</head><body>{body}</body></html>"


def tree_of(markup: str):
    import trafilatura

    return trafilatura.load_html(markup)


@pytest.mark.parametrize("title, slug", [("24.6.1. Menus", "24-6-1-menus"), ("  Éditer l'Été! ", "editer-l-ete"),
                                         ("¶", "")])
def test_slug_is_docutils_id_of_a_title(title, slug):
    assert _slug(title) == slug


CHROME = ('<div hidden="">a</div><p aria-hidden="true">b</p><ul role="menu"><li>c</li></ul><div role="menubar">d</div>'
          '<div role="toolbar">e</div><div role="dialog">f</div><form role="search">g</form>'
          '<div role="navigation">h</div><nav>i</nav><button>j</button><div id="mdbook-menu-bar">k</div>'
          '<div id="menu-bar">l</div><div id="mdbook-help-container">m</div>'
          '<div class="header"><p>Next: <a href="n.html">N</a>, Up: top</p></div>'
          '<div class="nav-panel"><p>Previous: p</p></div><div class="header"><p>Up: q</p></div>')


def test_prepare_page_takes_out_chrome_and_the_ids_of_sections_named_by_their_titles():
    """Chrome goes with its text (the tails, text of the parent, stay); a section keeps its id only when the id is
    not its heading's title (whole, or the title's end after a number)."""
    import lxml.etree

    tree = tree_of(page(
        CHROME + "tail<div class=\"header\"><p>Not a navigation line</p></div>"
        '<section id="menus"><h2>24.6.1. Menus<a href="#menus">¶</a></h2><p>kept</p></section>'
        '<div class="body section" id="sidebar"><p>first</p><h3>Sidebar</h3></div>'
        '<section id="menus"><h2>Submenus</h2></section>'  # "submenus" does not end in "-menus"
        '<section id="x"><p>no heading</p></section><section id="!!"><h2>Other</h2></section>'
        '<h2><a href="#y">§</a>Rust <a href="#z">#</a><a href="#w">link</a></h2>'))
    prepare_page(tree)
    assert lxml.etree.tostring(tree.find("body"), encoding="unicode") == (
        '<body>tail<div class="header"><p>Not a navigation line</p></div>'
        '<section><h2>24.6.1. Menus</h2><p>kept</p></section>'
        '<div class="body section"><p>first</p><h3>Sidebar</h3></div>'
        '<section id="menus"><h2>Submenus</h2></section>'
        '<section id="x"><p>no heading</p></section><section id="!!"><h2>Other</h2></section>'
        '<h2>Rust <a href="#w">link</a></h2></body>')


def test_prose_size_counts_text_outside_links_scripts_and_styles():
    tree = tree_of(page("<p>ab  cd <a href='x'>link</a></p>\n<p> ef<script>var x</script><style>p {}</style>g</p>"))
    assert _prose_size(tree.find("body")) == len("ab cd ef g")  # pieces joined by a space, runs of white as one


@pytest.mark.parametrize("body, is_main", [
    ("<p>abcd</p><main>abcde</main>", True),  # 2 * 5 >= len("abcd abcde") = 10
    ("<p>abcde</p><main>abcde</main>", False),  # 2 * 5 < 11
    ("<p>abcd <a href='x'>a long link</a></p><main>abcde</main>", True),  # links are not prose
    ("<div role='main'>abcde</div>", True),
    ("<main>abcde</main><main>fghij</main>", False),  # which one? neither
    ("<main> </main>", False),  # no text
    ("<main>a</main>", True),
    (f"<main>{'a' * 249}</main>", True),
    (f"<main>{'a' * 250}</main>", False),  # long enough for trafilatura to trust
])
def test_short_main_is_a_short_pages_one_main_element_holding_most_of_its_text(body, is_main):
    tree = tree_of(page(body))
    main = _short_main(tree)
    assert (main is not None) == is_main
    if is_main:
        assert main is tree.xpath("//main | //*[@role='main']")[0]


def test_short_main_needs_a_body():
    import lxml.html

    assert _short_main(lxml.html.fromstring("<main>abcde</main>")) is None


def read_page(tmp_path, body: str, **kwargs) -> list[str]:
    return texts(write(tmp_path / "page.html", page(body)), **kwargs)


def test_a_short_page_is_its_main_elements_text_block_by_block(tmp_path):
    """trafilatura, not trusting so little text, would read the whole page: the sidebar and the last line too."""
    assert read_page(tmp_path, "<div class='sidebar'><p>Other chapters</p></div><main><h1>The lamp</h1>"
                               "<p>Oil &amp; wick,  trimmed.</p><p>x &lt; y</p></main><div>Print this page</div>") == \
        ["The lamp\nOil & wick, trimmed.\nx < y"]


def test_a_long_page_is_trafilaturas_main_text_with_tables_and_entity_like_text_as_written(tmp_path):
    """Without its readers' comments; "&gt;" written in the page stays as written."""
    body = (f"<main><h1>The lamp</h1><p>{NIGHT}</p><p>{WINTER}</p><p>{TREE}</p><p>Write &amp;gt; &amp; <b>bold</b>"
            " &amp;lt; tail</p><table><tr><td>cell one</td><td>cell two</td></tr></table></main>"
            "<div id='comments'><h3>Comments</h3><p>A reader wrote that this lamp is the brightest on the coast.</p>"
            "</div>")
    assert read_page(tmp_path, body) == \
        [f"The lamp\n{NIGHT}\n{WINTER}\n{TREE}\nWrite &gt; & bold &lt; tail\n| cell one | cell two |"]


def test_a_page_without_a_frame_is_read_whole_with_its_headings_and_terms(tmp_path):
    body = f"Loose text<h1>Glossary</h1><dl><dt>keeper</dt><dd>{NIGHT}</dd></dl><p>{NIGHT}</p>"
    assert read_page(tmp_path, body) == [f"Loose text\nGlossary\n- keeper\n- {NIGHT}\n{NIGHT}"]


def test_a_given_encoding_wins_over_the_pages_guess_and_a_declared_one_is_read(tmp_path):
    """Without a charset the guess for these cp1252 bytes is wrong ("Crčme"); a declared one is found without
    --encoding."""
    paragraph = f"<main><h1>Café</h1><p>{NIGHT} Crème brûlée.</p></main>"
    guessed = write(tmp_path / "a.html", f"<html><body>{paragraph}</body></html>".encode("cp1252"))
    assert texts(guessed, encoding="cp1252") == [f"Café\n{NIGHT} Crème brûlée."]
    declared = page(paragraph, head='<meta charset="windows-1252"><title>The lamp</title>').encode("cp1252")
    assert texts(write(tmp_path / "b.html", declared)) == [f"Café\n{NIGHT} Crème brûlée."]


def test_frame_body_wraps_a_frameless_body_in_main_and_leaves_others():
    import lxml.etree
    import lxml.html

    def framed(markup: str) -> str:
        tree = tree_of(markup) if markup.startswith("<!") else lxml.html.fromstring(markup)
        _frame_body(tree)
        return lxml.etree.tostring(tree, encoding="unicode")

    assert framed(page("Loose<h1>Title</h1><p>text</p>tail")) == \
        "<html><head><title>The lamp</title></head><body><main>Loose<h1>Title</h1><p>text</p>tail</main></body></html>"
    with_article = page("<div>Menu</div><article><p>text</p></article>")
    assert framed(with_article) == with_article.removeprefix("<!DOCTYPE html>")
    no_body = "<div><p>text</p></div>"  # a fragment: nothing to frame
    assert framed(no_body) == no_body


@pytest.mark.parametrize("markup, why", [
    ("", "not a readable HTML page"), ("   ", "not a readable HTML page"),
    (page("<nav>only navigation</nav>"), "no main text found in the page")])
def test_html_reasons(tmp_path, markup, why):
    assert reason(write(tmp_path / "page.html", markup)) == why


def test_block_text_puts_each_block_on_its_line():
    """Scripts, styles and the head are not text (a script after a head that held a style was once kept: dropping
    the head ended the walk); a comment is no block; runs of spaces in a line are one; a <pre> is a block too
    ("Run<pre>make" once read "Runmake"); the element's own tail is not its text."""
    import lxml.html

    root = lxml.html.document_fromstring(
        "<html><head><title>T</title><style>p {}</style></head><body><h1>The  lamp</h1><style>h1 {}</style>"
        "<p>Oil <b>and</b>\twick<br>trimmed</p><!-- a comment --><div>in <span>a</span> div<script>var x;</script>"
        "</div><ul><li>one</li><li>two</li></ul><p>  </p>after<div>Run<pre>make all</pre></div></body></html>")
    assert block_text(root) == "The lamp\nOil and wick\ntrimmed\nin a div\none\ntwo\nafter\nRun\nmake all"
    body = lxml.html.document_fromstring("<html><body><main><p>The lamp</p></main>tail</body></html>").find("body")
    assert block_text(body.find("main")) == "The lamp"


def test_block_text_keeps_a_pre_as_it_is():
    """Code in an EPUB chapter or a short page: its lines, their indentation and its blank lines kept, inline
    markup inside it read as text, trailing spaces dropped; the text around it on lines of its own."""
    import lxml.etree
    import lxml.html

    root = lxml.html.document_fromstring(
        "<html><body><p>Code:</p><pre>def lamp(oil):\n    if oil:  \n        return <b>'lit'</b>\n\n    return None"
        "</pre><p>After  it.</p><pre>  TeX</pre><pre><b>bold</b> first, <i>italic</i></pre></body></html>")
    assert block_text(root) == ("Code:\ndef lamp(oil):\n    if oil:\n        return 'lit'\n\n    return None\n"
                                "After it.\n  TeX\nbold first, italic")
    xhtml = lxml.etree.fromstring('<body xmlns="http://www.w3.org/1999/xhtml"><p>Run</p><pre>\nmake\n  all\n</pre>'
                                  "</body>")
    assert block_text(xhtml) == "Run\nmake\n  all"  # its first and last line breaks are no lines


def test_block_text_reads_xhtml_tags_in_their_namespace():
    import lxml.etree

    root = lxml.etree.fromstring('<body xmlns="http://www.w3.org/1999/xhtml"><h1>The lamp</h1><p>Oil <b>and</b> '
                                 "wick</p><div>trimmed</div></body>")
    assert block_text(root) == "The lamp\nOil and wick\ntrimmed"


# ------------------------------------------------------------------------------------------- PDF
def test_strip_page_furniture_drops_page_numbers_and_lines_recurring_at_the_edges():
    """Edges are the first two and the last two lines; a line recurs when its digits-aside form is at an edge of
    two pages and of half of them (counted once a page)."""
    pages = [["Cape notes 1", "Alpha one", "Body a", "Chapter 3", "Page 1 of 4"],
             ["Cape notes 2", "Beta", "Delta", "Body b2", "- 2 -"],  # in the middle: not counted
             ["Gamma", "Cape notes 3", "Cape notes 9", "Chapter 7", "3"],  # line 3 of 5 is no edge
             ["Delta", "Delta", "Body d", "Body d2", "Epsilon"]]  # twice on one page: once
    # "cape notes #" is at an edge of 3 pages, "chapter #" of 2 (>= 2, >= 4 / 2): both go
    assert strip_page_furniture(pages) == [["Alpha one", "Body a"], ["Beta", "Delta", "Body b2"],
                                           ["Gamma", "Cape notes 9"], pages[3]]


@pytest.mark.parametrize("pages, kept", [
    ([["Title", "Body", "  12 "]], [["Title", "Body"]]),  # one page: nothing recurs (1 < 2); the number goes
    ([["Draft", "one"], ["Draft", "two"], ["three"], ["four"], ["five"]],  # on 2 of 5 pages: 2 < 5 / 2
     [["Draft", "one"], ["Draft", "two"], ["three"], ["four"], ["five"]]),
])
def test_strip_page_furniture_needs_two_pages_and_half_of_them(pages, kept):
    assert strip_page_furniture(pages) == kept


@pytest.mark.parametrize("lines, text", [
    ([], ""),
    (["only"], "only"),
    # the 90th percentile of widths 30, 40, 40 is 40 ((40 * -6 + 40 * 16) / 10): 30 is not under 0.75 * 40
    (["a" * 30, "b" * 40, "c" * 40], f"{'a' * 30} {'b' * 40} {'c' * 40}"),
    # widths 2, 2, 12, 13, 16: the 90th percentile is 17.2 ((13 * -4 + 16 * 14) / 10), 0.75 * 17.2 = 12.9: a line
    # of 13 goes on, one of 12 ends its paragraph
    (["ab", "cd", "e" * 12, "f" * 13, "g" * 16], f"ab\ncd\n{'e' * 12}\n{'f' * 13} {'g' * 16}"),
    # widths 4, 2 give 5.4 ((2 * -7 + 4 * 17) / 10): 4 is under 0.75 * 5.4 = 4.05
    (["abcd", "ab"], "abcd\nab"),
    # widths 2, 2 give 2 ((2 * -7 + 2 * 17) / 10): every line goes on; a hyphen after a letter, before a lower-case
    # letter, is joined away
    (["a-", "bc"], "abc"), (["2-", "bc"], "2- bc"), (["a-", "Bc"], "a- Bc"), (["-", "a"], "- a"),
    (["ab-", "iOS"], "abiOS"),  # only the first letter is looked at
    # a Chinese character takes two columns (widths 4, 4): no space between two of them, a space before a letter
    (["中文", "文字"], "中文文字"), (["中文", "abcd"], "中文 abcd"), (["abcd", "中文"], "abcd 中文"),
    # the last character of a line and the first of the next are looked at (widths 5, 4: 5.7, under 4.275 ends)
    (["中文a", "文字"], "中文a 文字"),
])
def test_join_wrapped_lines_cases(lines, text):
    assert join_wrapped_lines(lines) == text


@pytest.mark.parametrize("tops, kept", [
    (["No. #", "No. 3"], []),  # digits aside: a "#" reads as any number
    (["Maße", "Masse"], ["Maße", "Masse"]),  # measures and mass: told apart (upper-cased, both read MASSE)
])
def test_strip_page_furniture_compares_lines_lower_cased_digits_aside(tops, kept):
    pages = [[top, "body"] for top in tops]
    assert [line for page in strip_page_furniture(pages) for line in page if line != "body"] == kept


def pdf_bytes(pages: list[list[str] | None]) -> bytes:
    """A PDF (fpdf2, Helvetica) with a page per item: its lines, one per text line, or an image (None)."""
    from fpdf import FPDF
    from PIL import Image

    pdf = FPDF()
    pdf.set_font("helvetica", size=11)
    for lines in pages:
        pdf.add_page()
        if lines is None:
            pdf.image(Image.new("RGB", (20, 10), "white"), x=10, y=10, w=50)
        for line in lines or []:
            pdf.cell(0, 6, line, new_x="LMARGIN", new_y="NEXT")
    return bytes(pdf.output())


def test_pdf_text_without_headers_and_page_numbers_its_wrapped_lines_joined(tmp_path):
    path = write(tmp_path / "a.pdf", pdf_bytes([
        ["Cape notes 2026", "The keeper trims the lamp twice each night and", "writes the weather down.",
         "Page 1 of 2"],
        ["Cape notes 2026", "Boats shelter in the harbour below the cape", "when storms come.", "Page 2 of 2"]]))
    assert extract_file(path) == Extracted([Document(
        "The keeper trims the lamp twice each night and writes the weather down.\n"
        "Boats shelter in the harbour below the cape when storms come.", str(path))], pages=2)


def test_pdf_pages_under_20_characters_have_no_text_layer(tmp_path):
    """A carriage return inside a line breaks it. Lines of 20, 19, 14 and 15 columns: their 90th percentile is 20.5
    (sorted 14, 15, 19, 20: (19 * -5 + 20 * 15) / 10), so a line under 15.375 ends its paragraph."""
    path = write(tmp_path / "a.pdf", pdf_bytes([["x" * 20], ["y" * 19], ["z" * 14 + "\r" + "z" * 15]]))
    assert extract_file(path) == Extracted([Document(f"{'x' * 20} {'y' * 19} {'z' * 14}\n{'z' * 15}", str(path))],
                                           pages=3, pages_without_text=(2,))


def test_a_pdf_half_images_is_read_and_one_mostly_images_is_a_scan(tmp_path):
    path = write(tmp_path / "half.pdf", pdf_bytes([["a" * 30], ["b" * 30], None, None]))
    assert extract_file(path) == Extracted([Document("a" * 30 + " " + "b" * 30, str(path))], pages=4,
                                           pages_without_text=(3, 4))
    assert reason(write(tmp_path / "scan.pdf", pdf_bytes([["a" * 30], None, None, None]))) == \
        "no text layer on 3 of 4 pages (images: a scan? run OCR first, e.g. ocrmypdf)"


def test_pdf_reasons(tmp_path):
    from fpdf import FPDF

    pdf = FPDF()
    pdf.add_page()
    pdf.set_font("helvetica", size=12)
    pdf.cell(0, 6, NIGHT)
    pdf.set_encryption(owner_password="owner", user_password="secret")
    assert reason(write(tmp_path / "locked.pdf", bytes(pdf.output()))) == \
        "encrypted: needs a password (decrypt it first, e.g. qpdf --decrypt --password=... in.pdf out.pdf)"
    assert reason(write(tmp_path / "bad.pdf", b"%PDF-1.4 not really")) == \
        "not a readable PDF, damaged or truncated (Failed to load document (PDFium: Data format error).)"


# ------------------------------------------------------------------------------------------- EPUB
def epub_bytes(chapters: dict[str, str], spine_extra: tuple[str, ...] = ()) -> bytes:
    """An EPUB (ebooklib) with a chapter per item (file name: body markup), its navigation page first in the
    reading order."""
    from ebooklib import epub

    book = epub.EpubBook()
    book.set_identifier("cape")
    book.set_title("Cape")
    book.set_language("en")
    items = []
    for name, body in chapters.items():
        chapter = epub.EpubHtml(title=name, file_name=name, lang="en")
        chapter.content = f"<html><head><title>{name}</title></head><body>{body}</body></html>"
        book.add_item(chapter)
        items.append(chapter)
    book.add_item(epub.EpubItem(uid="style", file_name="style.css", media_type="text/css", content=b"p {}"))
    book.toc = items
    book.add_item(epub.EpubNcx())
    book.add_item(epub.EpubNav())
    book.spine = ["nav", *items, *spine_extra]
    buf = io.BytesIO()
    epub.write_epub(buf, book)
    return buf.getvalue()


def test_epub_gives_a_document_per_chapter_with_text(tmp_path):
    path = write(tmp_path / "book.epub", epub_bytes(
        {"one.xhtml": f"<h1>The lamp</h1><p>{NIGHT}</p>", "blank.xhtml": "<p> </p>", "two.xhtml": "<p>Winter</p>"},
        spine_extra=("style",)))
    assert extract_file(path) == Extracted([Document(f"The lamp\n{NIGHT}", f"{path}#one.xhtml"),
                                            Document("Winter", f"{path}#two.xhtml")])


def test_epub_read_by_its_navigation_page_not_its_ncx(tmp_path):
    """The NCX (EPUB 2's table of contents) is not read: a broken one does not make the book unreadable."""
    with zipfile.ZipFile(io.BytesIO(epub_bytes({"one.xhtml": f"<p>{NIGHT}</p>"}))) as book:
        entries = {name: book.read(name) for name in book.namelist()}
    entries["EPUB/toc.ncx"] = b"<ncx"
    assert texts(write(tmp_path / "book.epub", zip_of(entries))) == [NIGHT]


def test_epub_reasons(tmp_path):
    assert reason(write(tmp_path / "blank.epub", epub_bytes({"blank.xhtml": "<p> </p>"}))) == \
        "an EPUB with no text in its reading order"
    drm = zip_of({"mimetype": "application/epub+zip",
                  "META-INF/encryption.xml": "<encryption><EncryptedData/></encryption>"})
    assert reason(write(tmp_path / "drm.epub", drm)) == "encrypted (DRM): its chapters cannot be read"
    no_container = zip_of({"mimetype": "application/epub+zip", "META-INF/encryption.xml": "<encryption/>"})
    assert reason(write(tmp_path / "bad.epub", no_container)) == \
        "not a valid EPUB (\"There is no item named 'META-INF/container.xml' in the archive\")"


def damaged_zip() -> bytes:
    """A zip whose one entry's bytes no longer match their CRC."""
    data = bytearray(zip_of({"mimetype": "application/epub+zip"}))
    data[data.index(b"application")] = ord("A")
    return bytes(data)


@pytest.mark.parametrize("suffix, kind", [("epub", "EPUB"), ("docx", "Word .docx")])
def test_broken_archives(tmp_path, suffix, kind):
    assert reason(write(tmp_path / f"a.{suffix}", damaged_zip())) == "broken archive: mimetype is damaged"
    assert reason(write(tmp_path / f"b.{suffix}", b"PK\x03\x04 cut short")) == \
        f"broken archive: not a readable {kind} (zip) file (File is not a zip file)"


# ------------------------------------------------------------------------------------------- DOCX
def test_docx_body_paragraphs_and_tables_in_order_without_headers(tmp_path):
    import docx

    document = docx.Document()
    document.sections[0].header.paragraphs[0].text = "Running header"
    document.sections[0].footer.paragraphs[0].text = "Running footer"
    document.add_heading("The lamp", level=1)
    document.add_paragraph("  Trimmed twice.  ")  # a paragraph as it is
    document.add_paragraph("   ")
    table = document.add_table(rows=3, cols=3)
    for cell, text in zip(table.rows[0].cells, ["wick", " ", "oil "]):
        cell.text = text
    table.cell(2, 0).text = "0"
    document.add_paragraph("After the table.")
    document.save(tmp_path / "a.docx")
    assert texts(tmp_path / "a.docx") == ["The lamp\n  Trimmed twice.  \nwick | oil\n0\nAfter the table."]


def test_docx_reasons(tmp_path):
    import docx

    docx.Document().save(tmp_path / "empty.docx")
    assert reason(tmp_path / "empty.docx") == "a .docx with no text in its body"
    assert reason(write(tmp_path / "old.docx", b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1" + bytes(100))) == \
        "an old binary Word .doc, not a .docx (convert it: soffice --convert-to docx)"
    assert reason(write(tmp_path / "other.docx", zip_of({"notes.txt": "x"}))) == \
        "not a valid .docx (\"There is no item named '[Content_Types].xml' in the archive\")"


def test_a_reader_failing_on_a_malformed_file_is_named(tmp_path):
    """A .docx whose body is not XML: python-docx's parser error, whole."""
    import docx

    docx.Document().save(tmp_path / "good.docx")
    with zipfile.ZipFile(tmp_path / "good.docx") as good:
        entries = {name: good.read(name) for name in good.namelist()}
    entries["word/document.xml"] = b"<w:document"
    assert reason(write(tmp_path / "a.docx", zip_of(entries))) == (
        "the docx reader failed (XMLSyntaxError: Namespace prefix w on document is not defined, line 1, column 12 "
        "(<string>, line 1))")
