"""Plain text and Markdown, as written."""
from __future__ import annotations

from pathlib import Path

from .base import Document, Extracted, Format, Reading, decode_text


def read_plain(path: Path, reading: Reading) -> Extracted:
    """The text as it is: UTF-8, UTF-16 with a byte-order mark, or --encoding."""
    return Extracted([Document(decode_text(path.read_bytes(), reading.encoding), str(path))])


PLAIN_TEXT = Format("text", (".txt", ".text"), read_plain)
MARKDOWN = Format("markdown", (".md", ".markdown"), read_plain)
