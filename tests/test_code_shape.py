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


TRAINER_LINES = 300


def test_the_trainer_stays_small():
    """The loop's Trainer: the step, the checkpoint and fit(); what grows beside it gets a module of its own (a
    component, a stage, the driver)."""
    tree = ast.parse((ROOT / "trainer_utils/loop.py").read_text(encoding="utf-8"))
    [trainer] = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Trainer"]
    assert trainer.end_lineno - trainer.lineno + 1 <= TRAINER_LINES


def rooted_at_ctx(target: ast.expr) -> bool:
    """Whether an assignment target is an attribute or item of `ctx` (ctx.x, ctx.x.y, ctx.x[k])."""
    node = target
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return isinstance(node, ast.Name) and node.id == "ctx" and node is not target


def test_components_and_stages_return_what_they_produce():
    """A component or a stage hook reads its RunContext and returns what it produced (a Report, prepare()'s state):
    it never writes into the context, which only the loop updates (trainer_utils/context.py)."""
    writes = []
    folders = [ROOT / "trainer_utils" / "components", ROOT / "trainer_utils" / "stages"]
    for path in sorted(p for folder in folders for p in folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets = (node.targets if isinstance(node, ast.Assign) else [node.target]
                       if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
            calls_setattr = (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                             and node.func.id == "setattr" and node.args and rooted_at_ctx(
                                 ast.Attribute(value=node.args[0], attr="x")))
            if calls_setattr or any(rooted_at_ctx(t) for t in targets):
                writes.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert writes == []
