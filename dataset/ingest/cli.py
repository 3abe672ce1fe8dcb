"""A folder of documents into a clean pretraining corpus, in one deterministic pass.

    python -m dataset.ingest my_docs/ --out corpus.jsonl
    python -m dataset.ingest papers/ notes/ book.epub --out corpus.jsonl --max_chars 4000
    python -m dataset.ingest --files_from list.txt --out corpus.jsonl

Walks each folder (sorted, hidden files and folders left out) and reads every .txt, .md, .html/.htm, .pdf, .epub,
.docx and .jsonl file with the library made for its format (dataset/ingest/formats/). Then, per document:
  1. split at paragraph boundaries into records of at most --max_chars characters (a paragraph longer than that
     at sentence ends, a sentence longer than that at a space);
  2. cleaned and deduplicated as `python -m dataset.clean` does (HTML remnants, Unicode, control characters,
     whitespace; records under --min_chars dropped; exact and MinHash near-duplicates of an earlier record
     dropped, the first kept);
  3. written as {"text", "source", "part", "lang"}: the file it came from (`path#chapter` for an EPUB chapter,
     `path:line` for a JSONL record), its part number when split, and its detected language (ISO 639-1,
     py3langid; "und" for text too short to tell).

A file that gives no text is a counted skip with its reason on a `file: reason` line (encrypted or scanned
PDF, broken archive, text not in UTF-8 ...), never an empty record and never a crash; a format whose library is
missing names the package to install. Files of other types are counted by suffix. The same inputs give the
same bytes. The report goes to stdout and <out>.report.json: files by type, skips and why, characters,
duplicates, languages, and the time each format took (pages/s, MB/s).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from common.config import option, parse_config
from common.errors import ConfigError, DataError
from dataset.clean import report_or_error

from .pipeline import IngestOptions, format_report, ingest


def _listed(files_from: str) -> list[str]:
    try:
        text = Path(files_from).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{files_from}: cannot read the list of files ({e})") from None
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


@dataclass
class IngestFiles:
    """What is read and where it goes."""

    title: ClassVar[str] = "files"
    inputs: list[str] = option([], "folders (walked) and files to read", positional=True, metavar="PATH")
    files_from: str | None = option(None, "a text file naming one file or folder per line", metavar="LIST")
    out: str | None = option(None, "output .jsonl; the report goes to <out>.report.json", metavar="OUT")
    quiet: bool = option(False, "no progress bar")


@dataclass
class IngestConfig:
    """`python -m dataset.ingest`'s settings: flags, or a --config file."""

    files: IngestFiles = field(default_factory=IngestFiles)
    records: IngestOptions = field(default_factory=IngestOptions)


def main(argv: list[str] | None = None) -> int:
    try:
        config = parse_config(IngestConfig, argv, __doc__, prog="python -m dataset.ingest")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    files = config.files

    def run() -> dict[str, Any]:
        if files.out is None:
            raise ConfigError("name the output file: --out corpus.jsonl")
        inputs = files.inputs + (_listed(files.files_from) if files.files_from else [])
        if not inputs:
            raise ConfigError("name at least one folder or file (or --files_from LIST)")
        return ingest(inputs, files.out, config.records, progress=not files.quiet and sys.stderr.isatty())

    return report_or_error(run, files.out or "", format_report)
