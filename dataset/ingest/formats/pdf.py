"""PDF: each page's text layer (PDFium), without the running headers, footers and page numbers repeated at the top
or bottom of the pages, with lines wrapped by the layout joined back into paragraphs; a file whose pages are mostly
images (a scan) is Unreadable, a few image pages are counted and named."""
from __future__ import annotations

import re
import statistics
from pathlib import Path

from .base import Document, Extracted, Format, Reading, Unreadable, library

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


def read_pdf(path: Path, reading: Reading) -> Extracted:
    pdfium = library("pypdfium2", "pdf")
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


PDF = Format("pdf", (".pdf",), read_pdf)
