"""The files an ingest reads: folders walked in a fixed order (hidden entries left out, linked folders read, each
real folder once), and what a folder may hold that is no file to read (a dangling link, a FIFO, a device)."""
from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Iterable

from common.errors import DataError

from .formats.base import Unreadable


def find_files(inputs: Iterable[str | Path], exclude: Iterable[Path] = ()) -> list[Path]:
    """Every file under the inputs (folders walked in sorted order, hidden entries left out; files as given),
    each once, in a fixed order; `exclude` (the output and its report) left out."""
    skip = {p.resolve() for p in exclude}
    files, seen = [], set()
    for given in inputs:
        root = Path(given)
        if root.is_file():
            found = [root]
        elif root.is_dir():
            found = []
            # linked folders are read too, each real folder once: a link back up the tree is no loop
            visited: set[str] = set()
            for folder, dirs, names in os.walk(root, followlinks=True):
                visited.add(os.path.realpath(folder))
                dirs[:] = sorted(d for d in dirs if not d.startswith(".")
                                 and os.path.realpath(os.path.join(folder, d)) not in visited)
                found += [Path(folder) / n for n in sorted(names) if not n.startswith(".")]
        else:
            raise DataError(f"{root}: no such file or folder")
        for path in found:
            key = Path(os.path.realpath(path))  # path.resolve() raises on a link to itself: read (and skipped) later
            if key not in seen and key not in skip:
                seen.add(key)
                files.append(path)
    return files


def regular_file_size(path: Path) -> int:
    """The size of a file that can be read; Unreadable for what a folder may also hold: a symbolic link to nothing,
    a FIFO or a device (opening those would wait forever, or read without end), a file that vanished."""
    try:
        st = path.stat()
    except OSError as e:
        dangling = path.is_symlink() and isinstance(e, FileNotFoundError)
        raise Unreadable("a symbolic link to nothing" if dangling else f"cannot read it ({e.strerror or e})") from None
    if not stat.S_ISREG(st.st_mode):
        raise Unreadable("not a regular file (a FIFO, socket or device)")
    return st.st_size
