"""Text out of a document file: plain text, Markdown, HTML, PDF, EPUB, DOCX and JSONL, each read with a library
made for its format (dataset/ingest.py walks a folder through here).

    documents = extract_file(Path("paper.pdf"))   # -> [Document(text, where, pages)]

A file that cannot be read raises Unreadable with a reason for the user ("encrypted: needs a password",
"no text layer", "broken archive"...), never an empty document. The libraries are optional: a format whose
library is missing raises MissingLibrary naming the package to install.

What each format keeps:
  - .txt, .md: the text as it is (UTF-8, or UTF-16 with a byte-order mark; another encoding only with
    `encoding=`: guessing one silently would train on mojibake).
  - .html, .htm: the page's main text (trafilatura), headings and definition-list terms on lines of their own,
    without navigation, sidebars, footers, comments or page chrome (hidden elements, menus, buttons, mdBook's
    keyboard help, heading permalinks); a short page that marks its <main> is that element's text.
  - .pdf: each page's text layer (PDFium), without the running headers, footers and page numbers repeated at
    the top or bottom of the pages, with lines wrapped by the layout joined back into paragraphs.
  - .epub: every chapter of the reading order (ebooklib), one document per chapter, block elements on their
    own lines.
  - .docx: paragraphs and tables of the body, in document order (python-docx); page headers and footers left out.
  - .jsonl (.jsonl.gz): each {"text"} record, one document per line (bad lines as in every data stage).
"""
from __future__ import annotations

import codecs
import importlib
import re
import statistics
import unicodedata
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from common.errors import DataError
from dataset.jsonl import SkipReport, read_records

# suffix -> format; ".jsonl.gz" is matched on the last two suffixes
FORMATS = {".txt": "text", ".text": "text", ".md": "markdown", ".markdown": "markdown", ".html": "html",
           ".htm": "html", ".xhtml": "html", ".pdf": "pdf", ".epub": "epub", ".docx": "docx", ".jsonl": "jsonl",
           ".jsonl.gz": "jsonl"}
# format -> (module to import, package to install)
LIBRARIES = {"html": ("trafilatura", "trafilatura"), "pdf": ("pypdfium2", "pypdfium2"),
             "epub": ("ebooklib", "ebooklib"), "docx": ("docx", "python-docx")}


class Unreadable(Exception):
    """A file that yields no text; str(e) is the reason, shown as `file: reason`."""


class MissingLibrary(Unreadable):
    """The format's library is not installed; the message names the package."""


@dataclass
class Document:
    """One document's text and where it came from (a path, `path#chapter` or `path:line`)."""

    text: str
    where: str


@dataclass
class Extracted:
    """What one file gave: its documents, and its pages (PDF; 0 for the other formats)."""

    documents: list[Document]
    pages: int = 0
    pages_without_text: tuple[int, ...] = ()  # PDF pages (1-based) with no text layer: images, read as nothing


def file_format(path: Path) -> str | None:
    """The format of `path` from its suffix (case-insensitive), or None when no reader takes it."""
    suffixes = "".join(path.suffixes[-2:]).lower()
    return FORMATS.get(suffixes) or FORMATS.get(path.suffix.lower())


def library(fmt: str) -> Any:
    """Import the format's library, or raise MissingLibrary saying what to install."""
    module, package = LIBRARIES[fmt]
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingLibrary(f"reading .{fmt} files needs the {package} package: pip install {package}") from None


# ----------------------------------------------------------------------------------------------- plain text
# the codecs that read (and drop) each byte-order mark
_BOMS = ((codecs.BOM_UTF8, "utf-8-sig"), (codecs.BOM_UTF16_LE, "utf-16"), (codecs.BOM_UTF16_BE, "utf-16"))


def decode_text(data: bytes, encoding: str | None = None) -> str:
    """Bytes of a text file as str: UTF-8, UTF-16 with a byte-order mark, or `encoding` when given."""
    for bom, codec in _BOMS:
        if data.startswith(bom):
            return data.decode(codec)
    if b"\x00" in data[:8192]:
        raise Unreadable("binary content (NUL bytes), not a text file")
    try:
        return data.decode(encoding or "utf-8")
    except UnicodeDecodeError as e:
        hint = "" if encoding else "; convert it to UTF-8, or pass --encoding (e.g. gb18030, cp1252)"
        raise Unreadable(f"not {encoding or 'UTF-8'} (byte 0x{data[e.start]:02x} at offset {e.start}){hint}") \
            from None
    except LookupError:
        raise Unreadable(f"unknown encoding {encoding!r}") from None


def read_plain(path: Path, encoding: str | None = None) -> Extracted:
    return Extracted([Document(decode_text(path.read_bytes(), encoding), str(path))])


# ----------------------------------------------------------------------------------------------------- HTML
# Page chrome, taken out before trafilatura sees the page: its rules catch most navigation, but not in the
# fallbacks it runs on a short page, which read the whole page again. Chrome here is what is never prose: what
# the page does not show (`hidden`, `aria-hidden`), widgets by their ARIA role (menus, toolbars, dialogs,
# search, navigation), <nav> and <button>, mdBook's menu bar (theme buttons, the book's title on every page) and
# its keyboard-help popup ("Press ← or → to navigate between chapters": hidden by the stylesheet, so nothing in
# the markup says so), texinfo's "Next: …, Up: …" line above and below each node (GNU manuals), and a heading's
# permalink ("¶" after Sphinx's headings, "§" before rustdoc's).
_CHROME = ("//*[@hidden or @aria-hidden='true' or @role='menu' or @role='menubar' or @role='toolbar'"
           " or @role='dialog' or @role='search' or @role='navigation'] | //nav | //button"
           " | //*[@id='mdbook-menu-bar' or @id='menu-bar' or @id='mdbook-help-container']"
           " | //div[@class='header' or @class='nav-panel'][p[starts-with(normalize-space(), 'Next:')"
           " or starts-with(normalize-space(), 'Previous:') or starts-with(normalize-space(), 'Up:')]]"
           " | //a[starts-with(@href, '#')][normalize-space()='¶' or normalize-space()='§' or normalize-space()='#']")
# The sections of Sphinx/docutils pages (<section>, or <div class="section"> before docutils 0.17), whose id is
# their heading's title
_TITLED_SECTIONS = "//section[@id] | //div[@id][contains(concat(' ', normalize-space(@class), ' '), ' section ')]"
_HEADINGS = frozenset({"h1", "h2", "h3", "h4", "h5", "h6"})
# characters: trafilatura's MIN_EXTRACTED_SIZE, under which it stops trusting the main text it found and falls
# back to reading the whole page, one line per piece of text ("your first\ncrate\n." around a link)
_SHORT_PAGE = 250


def _slug(text: str) -> str:
    """An id as docutils makes it from a title: ASCII letters and digits, the rest runs of "-"."""
    ascii_text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode().lower()
    return re.sub(r"[^a-z0-9]+", "-", ascii_text).strip("-")


def prepare_page(tree: Any) -> None:
    """Take a page's chrome out of its lxml tree (in place), and keep trafilatura from dropping sections for
    their titles."""
    for el in tree.xpath(_CHROME):
        el.drop_tree()  # its tail is text of the parent, kept
    # trafilatura drops a section whose id reads like navigation ("menu", "nav", "sidebar", "share"...), and a
    # docutils section's id is only its title (less its number, "24.6.1. Menus" -> "menus"): IDLE's help lost
    # "Menus" and "Editing and Navigation" whole
    for section in tree.xpath(_TITLED_SECTIONS):
        heading = next((c for c in section if c.tag in _HEADINGS), None)
        title, name = _slug(heading.text_content()) if heading is not None else "", _slug(section.get("id"))
        if name and (title == name or title.endswith("-" + name)):
            del section.attrib["id"]


def _frame_body(tree: Any) -> None:
    """Make <body> the frame of a page that has none of the frames trafilatura looks for main text in (<main>,
    <article>, class "content"...: DocBook and texinfo pages). Without one it gets only the page's loose
    paragraphs, not its headings nor its <dt> terms (a glossary of user names kept each definition, not the
    name); in a frame it reads the page the way it reads any other, its navigation and footers pruned the same
    way. BODY_XPATH is trafilatura's list of those frames (compiled XPaths; strings in older versions): without it
    the page is left as it is."""
    from trafilatura import xpaths

    frames = getattr(xpaths, "BODY_XPATH", None)
    body = tree.find("body")
    if frames is None or body is None or any(f(tree) if callable(f) else tree.xpath(f) for f in frames):
        return
    main = body.makeelement("main", {})
    main.text, body.text = body.text, None
    main.extend(list(body))
    body.append(main)


def _prose_size(el: Any) -> int:
    """Characters of text in an element outside its links, scripts and styles, runs of white space as one."""
    return len(" ".join(" ".join(el.xpath(".//text()[not(ancestor::a or ancestor::script or ancestor::style)]"))
                        .split()))


def _short_main(tree: Any) -> Any:
    """The main element of a short page that says where its main text is (one <main> or role="main", with at
    least half the page's text outside links: a one-paragraph mdBook chapter), or None. trafilatura does not
    trust so little text and falls back to reading the whole page; read block by block, the main element is the
    page's text."""
    landmarks, body = tree.xpath("//main | //*[@role='main']"), tree.find("body")
    if len(landmarks) != 1 or body is None:
        return None
    main = landmarks[0]
    short = 0 < main.xpath("string-length(normalize-space())") < _SHORT_PAGE
    return main if short and 2 * _prose_size(main) >= _prose_size(body) else None


def read_html(path: Path, encoding: str | None = None) -> Extracted:
    trafilatura = library("html")
    data = path.read_bytes()
    # trafilatura finds the page's charset itself; a given --encoding wins over it
    tree = trafilatura.load_html(decode_text(data, encoding) if encoding else data)
    if tree is None:
        raise Unreadable("not a readable HTML page")
    prepare_page(tree)
    main = _short_main(tree)
    if main is not None:
        text = block_text(main)
    else:
        _frame_body(tree)
        # trafilatura's text output HTML-unescapes text that the parser has already unescaped, so "&gt;"
        # written in a page (about HTML, say) would come out as ">": escaping every "&" first makes that
        # second pass give the text back as it is
        for el in tree.iter():
            if el.text and "&" in el.text:
                el.text = el.text.replace("&", "&amp;")
            if el.tail and "&" in el.tail:
                el.tail = el.tail.replace("&", "&amp;")
        text = trafilatura.extract(tree, include_comments=False, include_tables=True, deduplicate=False)
    if not text or not text.strip():
        raise Unreadable("no main text found in the page")
    return Extracted([Document(text, str(path))])


# The block elements of (X)HTML: their text goes on lines of its own.
_BLOCKS = frozenset("address article aside blockquote br dd div dl dt figcaption figure footer h1 h2 h3 h4 h5 h6 "
                    "header hr li main nav ol p pre section table td th tr ul".split())


def block_text(root: Any) -> str:
    """All the text of an lxml (X)HTML element, one line per block element, <pre> kept as it is (the element
    is changed: read it once)."""
    import lxml.etree

    for bad in list(root.iter("script", "style", "head")):  # listed first: a drop ends a walk inside it
        bad.drop_tree()
    for el in root.iter():
        tag = el.tag.rsplit("}", 1)[-1] if isinstance(el.tag, str) else ""
        if tag in _BLOCKS:
            el.tail = "\n" + (el.tail or "")
            if el.text:  # a <pre> too: "Run<pre>make" once read "Runmake"
                el.text = "\n" + el.text
    lines = (re.sub(r"[ \t]+", " ", line).strip() if "\n" not in line else line
             for line in lxml.etree.tostring(root, method="text", encoding="unicode", with_tail=False).split("\n"))
    return "\n".join(line for line in lines if line.strip())


def html_block_text(markup: bytes) -> str:
    """All the text of an (X)HTML document (an EPUB chapter: no page furniture to remove), one line per block
    element, <pre> kept as it is."""
    import lxml.html

    return block_text(lxml.html.document_fromstring(markup))


# ------------------------------------------------------------------------------------------------------ PDF
# A line that is only a page number: "12", "- 12 -", "Page 12", "12 / 40", "page 3 of 9", "第 3 页".
_PAGE_NUMBER = re.compile(r"^(?:[-–—]\s*)?(?:page\s*)?\d{1,5}(?:\s*(?:/|of)\s*\d{1,5})?(?:\s*[-–—])?$"
                          r"|^第\s*\d+\s*页(?:\s*共\s*\d+\s*页)?$", re.IGNORECASE)
_EDGE = 2  # lines at the top and at the bottom of a page where headers, footers and page numbers sit
_CJK = re.compile(r"[\u3000-\u9fff\uac00-\ud7af\uff00-\uffef]")


def _edge_key(line: str) -> str:
    return re.sub(r"\d+", "#", line.strip().lower())


def strip_page_furniture(pages: list[list[str]]) -> list[list[str]]:
    """Drop the lines at a page's top or bottom that are page numbers, or that recur (digits aside) at the
    edges of at least half the pages (and of two): running headers and footers."""
    counts: dict[str, int] = {}
    for lines in pages:
        for key in {_edge_key(x) for x in lines[:_EDGE] + lines[-_EDGE:]}:
            counts[key] = counts.get(key, 0) + 1
    repeated = {k for k, n in counts.items() if n >= 2 and n >= len(pages) / 2}
    out = []
    for lines in pages:
        keep = []
        for i, line in enumerate(lines):
            edge = i < _EDGE or i >= len(lines) - _EDGE
            if edge and (_PAGE_NUMBER.match(line.strip()) or _edge_key(line) in repeated):
                continue
            keep.append(line)
        out.append(keep)
    return out


def _columns(line: str) -> int:
    """A line's width in columns: a Chinese or Japanese character takes two."""
    return len(line) + len(_CJK.findall(line))


def join_wrapped_lines(lines: list[str]) -> str:
    """Lines as the layout wrapped them back into paragraphs: a line that fills most of the text width goes on
    with the next one (a hyphen at its end joined away when a lower-case letter follows; no space between
    Chinese or Japanese characters); a shorter line ends its paragraph. (The text layer has no paragraphs: a
    paragraph whose last line happens to fill the width runs on into the next one.)"""
    if not lines:
        return ""
    widths = [_columns(x) for x in lines]
    width = statistics.quantiles(widths, n=10)[-1] if len(lines) > 1 else widths[0]
    out = lines[0]
    for prev, line, prev_width in zip(lines, lines[1:], widths):
        if prev_width < 0.75 * width:
            out += "\n" + line
        elif prev.endswith("-") and len(prev) > 1 and prev[-2].isalpha() and line[:1].islower():
            out = out[:-1] + line
        elif _CJK.match(prev[-1:]) and _CJK.match(line[:1]):
            out += line
        else:
            out += " " + line
    return out


PAGE_TEXT_MIN = 20  # characters: a page with less text than this has no text layer to speak of (an image)


def read_pdf(path: Path, encoding: str | None = None) -> Extracted:
    pdfium = library("pdf")
    try:
        pdf = pdfium.PdfDocument(str(path))
    except pdfium.PdfiumError as e:
        if "password" in str(e).lower():
            raise Unreadable("encrypted: needs a password (decrypt it first, e.g. qpdf --decrypt "
                             "--password=... in.pdf out.pdf)") from None
        raise Unreadable(f"not a readable PDF, damaged or truncated ({e})") from None
    try:
        pages = []
        for i in range(len(pdf)):
            page = pdf[i]
            textpage = page.get_textpage()
            text = textpage.get_text_bounded()
            textpage.close()
            page.close()
            pages.append([x.strip() for x in text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
                          if x.strip()])
    finally:
        pdf.close()
    if not pages:
        raise Unreadable("a PDF with no pages")
    # Judged page by page, not on the file's average: a few image pages in a text PDF are counted and named
    # (Extracted.pages_without_text), a file that is mostly images is a scan
    textless = tuple(i for i, lines in enumerate(pages, 1) if sum(map(len, lines)) < PAGE_TEXT_MIN)
    if 2 * len(textless) > len(pages):
        raise Unreadable(f"no text layer on {len(textless)} of {len(pages)} pages (images: a scan? run OCR first, "
                         "e.g. ocrmypdf)")
    lines = [x for page in strip_page_furniture(pages) for x in page]
    return Extracted([Document(join_wrapped_lines(lines), str(path))], pages=len(pages), pages_without_text=textless)


# ----------------------------------------------------------------------------------------------------- EPUB
def _check_zip(path: Path, kind: str) -> zipfile.ZipFile:
    try:
        archive = zipfile.ZipFile(path)
        bad = archive.testzip()
    except (zipfile.BadZipFile, EOFError) as e:
        raise Unreadable(f"broken archive: not a readable {kind} (zip) file ({e})") from None
    if bad is not None:
        raise Unreadable(f"broken archive: {bad} is damaged")
    return archive


def read_epub(path: Path, encoding: str | None = None) -> Extracted:
    ebooklib = library("epub")
    from ebooklib import epub

    with _check_zip(path, "EPUB") as archive:
        if "META-INF/encryption.xml" in archive.namelist() and b"EncryptedData" in archive.read(
                "META-INF/encryption.xml"):
            raise Unreadable("encrypted (DRM): its chapters cannot be read")
    try:
        book = epub.read_epub(str(path), options={"ignore_ncx": True})
    except (epub.EpubException, KeyError, AttributeError, ValueError) as e:
        raise Unreadable(f"not a valid EPUB ({e})") from None
    docs = []
    for idref, _ in book.spine:
        item = book.get_item_with_id(idref)
        if item is None or item.get_type() != ebooklib.ITEM_DOCUMENT or isinstance(item, epub.EpubNav):
            continue
        text = html_block_text(item.get_content())
        if text.strip():
            docs.append(Document(text, f"{path}#{item.get_name()}"))
    if not docs:
        raise Unreadable("an EPUB with no text in its reading order")
    return Extracted(docs)


# ----------------------------------------------------------------------------------------------------- DOCX
_OLE_MAGIC = b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1"  # the container of .doc (Word 97-2003), often renamed .docx

def read_docx(path: Path, encoding: str | None = None) -> Extracted:
    docx = library("docx")
    from docx.opc.exceptions import PackageNotFoundError

    with open(path, "rb") as f:
        if f.read(8) == _OLE_MAGIC:
            raise Unreadable("an old binary Word .doc, not a .docx (convert it: soffice --convert-to docx)")
    _check_zip(path, "Word .docx").close()
    try:
        doc = docx.Document(str(path))
    except PackageNotFoundError:
        raise Unreadable("not a Word .docx file (an old .doc? convert it: soffice --convert-to docx)") from None
    except (KeyError, ValueError) as e:
        raise Unreadable(f"not a valid .docx ({e})") from None
    parts = []
    for block in doc.iter_inner_content():
        if hasattr(block, "rows"):  # a table: a line per row, cells joined
            for row in block.rows:
                # a merged cell spans several grid columns, and python-docx gives it once per column: the same
                # XML cell, kept once; separate cells that read alike ("0 | 0 | 0") are all kept
                spans = list({id(c._tc): c for c in row.cells}.values())
                cells = [c.text.strip() for c in spans if c.text.strip()]
                if cells:
                    parts.append(" | ".join(cells))
        elif block.text.strip():
            parts.append(block.text)
    if not parts:
        raise Unreadable("a .docx with no text in its body")
    return Extracted([Document("\n".join(parts), str(path))])


# ---------------------------------------------------------------------------------------------------- JSONL
def read_jsonl(path: Path, encoding: str | None = None, skip_bad_lines: bool = False,
               report: SkipReport | None = None) -> Extracted:
    try:
        docs = [Document(r["text"], f"{path}:{n}")
                for n, r in read_records(path, "text", skip_bad_lines=skip_bad_lines, report=report)]
    except DataError as e:  # "path:7: reason" -> "line 7: reason"
        raise Unreadable(re.sub(rf"^{re.escape(str(path))}:(\d+):", r"line \1:", str(e))
                         .removeprefix(f"{path}: ")) from None
    return Extracted(docs)


READERS: dict[str, Callable[..., Extracted]] = {"text": read_plain, "markdown": read_plain, "html": read_html,
                                                "pdf": read_pdf, "epub": read_epub, "docx": read_docx,
                                                "jsonl": read_jsonl}


def extract_file(path: Path, encoding: str | None = None, skip_bad_lines: bool = False,
                 report: SkipReport | None = None) -> Extracted:
    """The documents of one file; Unreadable (MissingLibrary) when it yields none. JSONL bad lines are
    counted into `report` with skip_bad_lines, else they make the file Unreadable naming the line."""
    fmt = file_format(path)
    if fmt is None:
        raise Unreadable(f"no reader for {path.suffix or 'files without a suffix'}")
    try:
        if fmt == "jsonl":
            extracted = read_jsonl(path, encoding, skip_bad_lines, report)
        else:
            extracted = READERS[fmt](path, encoding)
    except Unreadable:
        raise
    except OSError as e:
        raise Unreadable(f"cannot read it ({e.strerror or e})") from None
    except Exception as e:  # noqa: BLE001 - a third-party parser failing on a malformed file is that file's skip
        raise Unreadable(f"the {fmt} reader failed ({type(e).__name__}: {e})") from None
    if not any(d.text.strip() for d in extracted.documents):
        raise Unreadable("no text in it")
    return extracted
