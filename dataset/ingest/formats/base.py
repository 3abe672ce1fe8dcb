"""What every format's reader shares: the documents it gives, the reasons a file gives none, the settings it reads
with, and the format's record in the registry (formats/__init__.py)."""
from __future__ import annotations

import codecs
import importlib
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from dataset.jsonl import SkipReport


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


@dataclass(frozen=True)
class Reading:
    """How files are read: the encoding of text that is not UTF-8, and JSONL's bad lines (skipped and counted into
    `report`, or the file Unreadable naming the line)."""

    encoding: str | None = None
    skip_bad_lines: bool = False
    report: SkipReport | None = None


@dataclass(frozen=True)
class Format:
    """A format ingest reads: its name (the report's), the suffixes that mark its files (".jsonl.gz": the last two
    suffixes), and its reader, which gives the file's documents or raises Unreadable."""

    name: str
    suffixes: tuple[str, ...]
    read: Callable[[Path, Reading], Extracted]


def library(module: str, fmt: str, package: str | None = None) -> Any:
    """Import a format's library, or raise MissingLibrary saying what to install (`package`, when its name is not
    the module's)."""
    package = package or module
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingLibrary(f"reading .{fmt} files needs the {package} package: pip install {package}") from None


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


def check_zip(path: Path, kind: str) -> zipfile.ZipFile:
    try:
        archive = zipfile.ZipFile(path)
        bad = archive.testzip()
    except (zipfile.BadZipFile, EOFError) as e:
        raise Unreadable(f"broken archive: not a readable {kind} (zip) file ({e})") from None
    if bad is not None:
        raise Unreadable(f"broken archive: {bad} is damaged")
    return archive
