"""EPUB: every chapter of the reading order (ebooklib), one document per chapter (`book.epub#chapter.xhtml`),
block elements on their own lines; a book with DRM is Unreadable."""
from __future__ import annotations

from pathlib import Path

from .base import Document, Extracted, Format, Reading, Unreadable, check_zip, library
from .html import html_block_text


def read_epub(path: Path, reading: Reading) -> Extracted:
    ebooklib = library("ebooklib", "epub")
    from ebooklib import epub

    with check_zip(path, "EPUB") as archive:
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


EPUB = Format("epub", (".epub",), read_epub)
