"""JSONL (.jsonl, .jsonl.gz): each {"text"} record, one document per line (`file:line`); bad lines as in every data
stage: the file Unreadable naming the line, or skipped and counted with --skip_bad_lines."""
from __future__ import annotations

import re
from pathlib import Path

from common.errors import DataError
from dataset.jsonl import read_records

from .base import Document, Extracted, Format, Reading, Unreadable


def read_jsonl(path: Path, reading: Reading) -> Extracted:
    try:
        docs = [Document(r["text"], f"{path}:{n}") for n, r in read_records(
            path, "text", skip_bad_lines=reading.skip_bad_lines, report=reading.report)]
    except DataError as e:  # "path:7: reason" -> "line 7: reason"
        raise Unreadable(re.sub(rf"^{re.escape(str(path))}:(\d+):", r"line \1:", str(e))
                         .removeprefix(f"{path}: ")) from None
    return Extracted(docs)


JSONL = Format("jsonl", (".jsonl", ".jsonl.gz"), read_jsonl)
