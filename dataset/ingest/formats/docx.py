"""Word .docx: the body's paragraphs and tables in document order (python-docx), page headers and footers left
out; an old binary .doc renamed .docx is Unreadable, saying how to convert it."""
from __future__ import annotations

from pathlib import Path

from .base import Document, Extracted, Format, Reading, Unreadable, check_zip, library

_OLE_MAGIC = b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1"  # the container of .doc (Word 97-2003), often renamed .docx

def read_docx(path: Path, reading: Reading) -> Extracted:
    docx = library("docx", "docx", package="python-docx")
    from docx.opc.exceptions import PackageNotFoundError

    with open(path, "rb") as f:
        if f.read(8) == _OLE_MAGIC:
            raise Unreadable("an old binary Word .doc, not a .docx (convert it: soffice --convert-to docx)")
    check_zip(path, "Word .docx").close()
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


DOCX = Format("docx", (".docx",), read_docx)
