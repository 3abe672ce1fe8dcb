"""The code's shape: no function or method over MAX_LINES lines outside the tests (its docstring and comments
count), so each reads in one screen and a growing one is split where it grows."""
from __future__ import annotations

import ast

from conftest import ROOT

MAX_LINES = 80
SKIP = {"tests", ".venv", "mutants", ".git", "out"}


def test_no_function_is_longer_than_a_screen():
    long = []
    for path in sorted(ROOT.rglob("*.py")):
        if SKIP & set(path.relative_to(ROOT).parts):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {lines} lines")
    assert not long, "functions over 80 lines:\n" + "\n".join(long)
