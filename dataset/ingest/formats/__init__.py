"""Text out of a document file: plain text, Markdown, HTML, PDF, EPUB, DOCX and JSONL, each read with a library
made for its format (dataset/ingest walks a folder through here).

    documents = extract_file(Path("paper.pdf"))   # -> [Document(text, where, pages)]

A file that cannot be read raises Unreadable with a reason for the user ("encrypted: needs a password",
"no text layer", "broken archive"...), never an empty document. The libraries are optional: a format whose
library is missing raises MissingLibrary naming the package to install.

One module per format, each with its Format record (name, suffixes, reader). A new format is its module,
imported here and listed in FORMATS.

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

from pathlib import Path

from dataset.jsonl import SkipReport

from .base import Extracted, Format, Reading, Unreadable
from .docx import DOCX
from .epub import EPUB
from .html import HTML
from .jsonl import JSONL
from .pdf import PDF
from .text import MARKDOWN, PLAIN_TEXT

FORMATS: tuple[Format, ...] = (PLAIN_TEXT, MARKDOWN, HTML, PDF, EPUB, DOCX, JSONL)


def find_format(path: Path) -> Format | None:
    """The format whose suffixes `path` ends with (case-insensitive; the last two suffixes first: .jsonl.gz), or
    None when no reader takes it."""
    by_suffix = {suffix: f for f in FORMATS for suffix in f.suffixes}
    return by_suffix.get("".join(path.suffixes[-2:]).lower()) or by_suffix.get(path.suffix.lower())


def file_format(path: Path) -> str | None:
    """The name of `path`'s format, or None when no reader takes it."""
    found = find_format(path)
    return found.name if found else None


def extract_file(path: Path, encoding: str | None = None, skip_bad_lines: bool = False,
                 report: SkipReport | None = None) -> Extracted:
    """The documents of one file; Unreadable (MissingLibrary) when it yields none. JSONL bad lines are
    counted into `report` with skip_bad_lines, else they make the file Unreadable naming the line."""
    fmt = find_format(path)
    if fmt is None:
        raise Unreadable(f"no reader for {path.suffix or 'files without a suffix'}")
    try:
        extracted = fmt.read(path, Reading(encoding, skip_bad_lines, report))
    except Unreadable:
        raise
    except OSError as e:
        raise Unreadable(f"cannot read it ({e.strerror or e})") from None
    except Exception as e:  # noqa: BLE001 - a third-party parser failing on a malformed file is that file's skip
        raise Unreadable(f"the {fmt.name} reader failed ({type(e).__name__}: {e})") from None
    if not any(d.text.strip() for d in extracted.documents):
        raise Unreadable("no text in it")
    return extracted
