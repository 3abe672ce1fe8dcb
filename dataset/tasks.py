"""Benchmark task files: the items a model is scored on, read with file:line errors.

Two line formats, mixed freely:
    request lines, as lm-evaluation-harness / OLMo's evaluation write them (one line per choice of an item; the
    lines of an item share its "doc_id"; "idx" orders the choices, "label" is the gold one):
        {"doc_id": 7, "idx": 0, "label": 2, "request": {"context": "Question: ...\\nAnswer:", "continuation": " x"}}
    item lines, one item each (the format to convert your own benchmark into, e.g. C-Eval from its CSV):
        {"id": "q1", "context": "Question: ...\\nAnswer:", "choices": [" a", " b", " c"], "gold": 1}
        {"id": "p1", "context": "The capital of France is", "continuation": " Paris"}
An item with several choices is a ranked classification (accuracy: the choice of highest log-likelihood); one
with one continuation (or a request line alone in its doc) is scored in bits per byte of that continuation.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.errors import DataError

from .jsonl import check_path, iter_raw_lines


@dataclass(frozen=True)
class TaskItem:
    """One benchmark item: a context and its continuations; `gold` indexes the right one (0 when only one)."""

    id: str
    context: str
    continuations: tuple[str, ...]
    gold: int = 0

    @property
    def is_choice(self) -> bool:
        return len(self.continuations) > 1


@dataclass(frozen=True)
class Task:
    """A named list of items, all ranked choices or all single continuations (`kind`: "choice" | "bpb")."""

    name: str
    kind: str
    items: tuple[TaskItem, ...]
    source: str


def _string(record: dict[str, Any], key: str, where: str) -> str:
    value = record.get(key)
    if not isinstance(value, str):
        raise DataError(f"{where}: \"{key}\" must be a string, got {type(value).__name__}")
    return value


def _int(record: dict[str, Any], key: str, where: str) -> int:
    value = record.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise DataError(f"{where}: \"{key}\" must be an integer, got {value!r}")
    return value


def read_task_file(path: str | Path, name: str | None = None) -> Task:
    """The task in a JSONL file (either line format, module docstring); DataError naming the file and line of
    the first problem: a line that is not a JSON object, a missing or mistyped field, an item's request lines that
    disagree on their context or gold label or skip a choice, items of both kinds in one file, or no items."""
    path = check_path(path)
    items: list[TaskItem] = []
    requests: dict[str, dict[str, Any]] = {}  # doc_id -> {"line", "context", "gold", "choices": {idx: text}}
    for lineno, raw in iter_raw_lines(path):
        where = f"{path}:{lineno}"
        try:
            record = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise DataError(f"{where}: invalid JSON ({e})") from None
        if not isinstance(record, dict):
            raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
        if "request" in record:
            request = record["request"]
            if not isinstance(request, dict):
                raise DataError(f"{where}: \"request\" must be an object")
            doc = str(record.get("doc_id", record.get("native_id", lineno)))
            context, continuation = _string(request, "context", where), _string(request, "continuation", where)
            idx, gold = _int(record, "idx", where) if "idx" in record else 0, record.get("label", 0)
            if not isinstance(gold, int) or isinstance(gold, bool):
                gold = None  # e.g. the answer's text: fine for a doc with one continuation (checked below)
            entry = requests.setdefault(doc, {"line": where, "context": context, "gold": gold, "choices": {}})
            if entry["context"] != context or entry["gold"] != gold:
                raise DataError(f"{where}: doc {doc} has another context or label than its first line "
                                f"({entry['line']})")
            if idx in entry["choices"]:
                raise DataError(f"{where}: doc {doc} has choice {idx} twice")
            entry["choices"][idx] = continuation
            continue
        item_id = str(record.get("id", f"{path.name}:{lineno}"))
        context = _string(record, "context", where)
        if "choices" in record:
            choices = record["choices"]
            if not isinstance(choices, list) or len(choices) < 2 or not all(isinstance(c, str) for c in choices):
                raise DataError(f"{where}: \"choices\" must be a list of at least 2 strings")
            gold = _int(record, "gold", where)
            if not 0 <= gold < len(choices):
                raise DataError(f"{where}: \"gold\" {gold} is not one of the {len(choices)} choices")
            items.append(TaskItem(item_id, context, tuple(choices), gold))
        else:
            items.append(TaskItem(item_id, context, (_string(record, "continuation", where),)))
    for doc, entry in requests.items():
        choices = entry["choices"]
        if sorted(choices) != list(range(len(choices))):
            raise DataError(f"{entry['line']}: doc {doc} has choices {sorted(choices)}, expected 0..{len(choices) - 1}")
        gold = 0 if len(choices) == 1 else entry["gold"]
        if gold is None:
            raise DataError(f"{entry['line']}: doc {doc}: \"label\" must be the index of the right one of its "
                            f"{len(choices)} choices")
        if not 0 <= gold < len(choices):
            raise DataError(f"{entry['line']}: doc {doc}: label {gold} is not one of its {len(choices)} choices")
        items.append(TaskItem(doc, entry["context"], tuple(choices[i] for i in range(len(choices))), gold))
    if not items:
        raise DataError(f"{path}: no task items")
    kinds = {item.is_choice for item in items}
    if len(kinds) > 1:
        raise DataError(f"{path}: mixes items with several choices and items with one continuation; a task is one "
                        "kind (split the file)")
    return Task(name or path.name.split(".")[0], "choice" if kinds == {True} else "bpb", tuple(items), str(path))
