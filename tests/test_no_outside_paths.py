"""No file in the repository names a place outside it: a user's clone has no ../shared folder, no /work tree and
no one else's home directory, so a default, a command in the docs or a recorded result that points there is
broken (or meaningless) for everyone but the machine it was written on.

The rule, applied to every line of every git-tracked text file (binary files, dev/LOG.md, which is a dated
history of what ran where, and this file, which has to spell the patterns out, are left out):

(a) no known outside-tree location: `../shared`, `/work/`, `/root/`, `/home/` or `/Users/` at the start of a
    path, that is, not preceded by a letter, digit, `.`, `/` or `:`; so a URL (`https://example.org/home/`) or
    a sub-folder of ours that happens to be called `work` is not one;
(b) no relative path that climbs out of the repository: a slash-separated word with a `..` segment is flagged
    when it ends up above the repository root both when resolved from the file's own folder (how Markdown links
    and paths in a file next to its data are meant) and when resolved from the repository root (how the commands
    in the docs are run). `../README.md` in docs/ stays inside, `../shared/corpora` or `../../x` does not.
    Flagging a word that climbs out from either base alone would flag every docs page's link back to the README
    and third-party text in the demo data (`dpkg -i ../foo.deb`).

Everything else is fine: system paths that exist on any machine or are generic (`/usr/bin/python3`, `/etc/...`,
`/proc/cpuinfo`, `/dev/null`, `/opt/homebrew`, `/tmp/...` as an example output folder or a past run's scratch
folder), URLs, and placeholders (`/path/to/minimind/model`, `DIR`). What this cannot tell apart, review must: a
script's input comes from its arguments or from inside the repository, never from a default under /tmp.
A failure lists each hit as `file:line: text`.
"""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SELF = Path(__file__).resolve().relative_to(ROOT).as_posix()
EXEMPT = {"dev/LOG.md", SELF}
# (a): locations that exist only on some machine (ours or a user's), never in a clone of the repository
OUTSIDE = re.compile(r"(?<![\w./:])(?:\.\./shared\b|/(?:work|root|home|Users)/)")
# (b): a word made of path characters with a `..` segment and a slash (not `..` alone, `...` or `a..b`)
PATH_WORD = re.compile(r"[\w.~+@*/-]+")
URL_BEFORE = re.compile(r"[a-zA-Z][\w+.-]*://\S*$")  # the text before a word ends inside a URL
# A walk without git (a tarball or an exported tree) skips what .gitignore keeps out of the repository: these
# folders, and corpora downloaded into dataset/ (/dataset/*.jsonl).
WALK_SKIP = {"__pycache__", "out", "runs", "wandb", "hf_out", "node_modules"}


def tracked_files(root: Path = ROOT) -> list[str]:
    """The repository's files, relative to `root`: `git ls-files`, or a walk of the tree where git is missing."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True).stdout
        return sorted(p for p in out.decode("utf-8").split("\0") if p)
    except (OSError, subprocess.CalledProcessError):
        files = []
        for folder, dirs, names in os.walk(root):
            dirs[:] = [d for d in dirs if not d.startswith(".") and d not in WALK_SKIP and not d.endswith(
                (".egg-info", ".pocketlm-cache"))]
            files += [Path(folder, n).relative_to(root).as_posix() for n in names if not n.endswith(".pyc")
                      and not (Path(folder) == root / "dataset" and n.endswith(".jsonl"))]
        return sorted(files)


def read_text(path: Path) -> str | None:
    """The file's text, or None for a binary file (a NUL byte, or not UTF-8)."""
    data = path.read_bytes()
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def climbs_out(word: str, folder: str) -> bool:
    """True if the relative path `word`, in a file in `folder` (relative to the root), is above the root both
    from that folder and from the root."""
    if word.startswith("/") or "/" not in word or ".." not in word.split("/"):
        return False
    return all(os.path.normpath(os.path.join(base, word)).split(os.sep)[0] == ".." for base in (folder or ".", "."))


def outside_paths(line: str, folder: str) -> list[str]:
    """The outside-tree paths in one line of a file in `folder`: what each match of rule (a) or (b) found."""
    found = [m.group(0) for m in OUTSIDE.finditer(line)]
    if ".." in line:
        for m in PATH_WORD.finditer(line):
            # a URL's path is the server's, not ours
            if climbs_out(m.group(0), folder) and not URL_BEFORE.search(line, 0, m.start()):
                found.append(m.group(0))
    return found


def scan(root: Path = ROOT) -> list[str]:
    hits = []
    for rel in tracked_files(root):
        path = root / rel
        if rel in EXEMPT or not path.is_file():
            continue
        text = read_text(path)
        if text is None:
            continue
        folder = os.path.dirname(rel)
        for number, line in enumerate(text.splitlines(), 1):
            for found in outside_paths(line, folder):
                at = line.find(found)
                shown = line.strip() if len(line) <= 200 else "..." + line[max(0, at - 80):at + 120] + "..."
                hits.append(f"{rel}:{number}: {shown}")
                break
    return hits


@pytest.mark.parametrize("line, folder", [
    ("DEFAULT = '/work/data/bench/pretrain_bench.jsonl'", "scripts"),
    ("the benchmark corpus (`../shared/corpora`)", "docs"),
    ('"command": "/home/alice/venv/bin/python train_pretrain.py"', "bench/results"),
    ("tokenizer: /Users/bob/pocketlm/model/tokenizer", ""),
    ("cd /root/pocketlm && make test", ""),
    ("python train.py --data_path ../../corpora/x.jsonl", "docs"),
    ("[the data](../../data/x.jsonl)", "docs"),
    ("see dataset/../../elsewhere/x", ""),
])
def test_outside_paths_are_found(line, folder):
    assert outside_paths(line, folder), line


@pytest.mark.parametrize("line, folder", [
    ("[← back to the README](../README.md)", "docs"),
    ("![plot](../bench/results/tokenizer-mix-sweep.png)", "docs"),
    ("#!/usr/bin/env bash; /usr/bin/python3 > /dev/null", ""),
    ("grep flags /proc/cpuinfo; ls /etc/os-release /opt/homebrew/bin", ""),
    ("--out_dir /tmp/tok --compare /path/to/minimind/model", ""),
    ("https://example.org/home/work/../shared/x and http://host/work/x", ""),
    ("a ... b, range 1..5, git diff main..HEAD, x = y[..., 0]", ""),
    ("ROOT = Path(__file__).resolve().parents[1]  # the framework/work/ folder", ""),
    ("python bench/bench_learning.py --out out/bench-learning", ""),
])
def test_ordinary_paths_pass(line, folder):
    assert outside_paths(line, folder) == [], line


def test_no_file_names_a_path_outside_the_repository():
    hits = scan()
    assert hits == [], "paths outside the repository (a clone has none of them):\n" + "\n".join(hits)
