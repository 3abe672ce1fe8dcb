"""How the benchmarks record paths and commands in their results: the same on every machine, so a result committed
from one names nothing that only that machine has (tests/test_no_outside_paths.py checks the repository for it).

    shlex.join(map(portable, cmd))     # a command as a result records it: python train_pretrain.py --data_path ...
    portable(args.data_path)           # dataset/demo/dpo_demo.jsonl, not this machine's absolute path to it
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def portable(word: str | Path) -> str:
    """A path or command word as results record it: the running interpreter (sys.executable) as `python`, an
    absolute path inside the repository relative to its root (also as the value of a `--flag=`), anything else (a
    relative path, a path outside the repository, a flag) as it is."""
    word = str(word)
    if word == sys.executable:
        return "python"
    flag, eq, value = word.partition("=")
    if not (eq and flag.startswith("--")):
        flag, eq, value = "", "", word
    if Path(value).is_absolute():
        try:
            value = Path(value).resolve().relative_to(ROOT).as_posix()
        except ValueError:  # outside the repository
            pass
    return flag + eq + value
