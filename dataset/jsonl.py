"""Streaming JSON Lines reading with file:line errors, record validation and counted skips.

Every data stage (cleaning, tokenizer training, tokenization) reads through here, so a bad line is reported
the same way everywhere: `DataError("data.jsonl:17: invalid JSON (...)")`, or skipped and counted when the
user asked for `--skip_bad_lines`.
"""
from __future__ import annotations

import gzip
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from common.answers import gold_answers
from common.errors import DataError
from common.files import write_atomic  # noqa: F401  (re-exported: the data stages write through it)
from common.tokens import CHAT_ROLES

from .kinds import RecordShape

# A "line" longer than this is almost always a JSON array or a whole file on one line, not a record.
DEFAULT_MAX_LINE_BYTES = 64 * 1024 * 1024


@dataclass
class SkipReport:
    """Counts of skipped lines per reason, plus the first few locations for the user to look at."""

    counts: Counter = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)

    def add(self, reason: str, where: str) -> None:
        self.counts[reason] += 1
        if len(self.examples) < 5:
            self.examples.append(f"{where}: {reason}")

    def reject(self, path: Path, lineno: int, reason: str, skip: bool) -> None:
        """A bad line: raise DataError naming it, or, when the user asked for skipping, count it."""
        if not skip:
            raise DataError(f"{path}:{lineno}: {reason} (use --skip_bad_lines to skip such lines)")
        self.add(reason.split(" (")[0], f"{path.name}:{lineno}")

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def summary(self) -> str:
        if not self.total:
            return "no lines skipped"
        reasons = ", ".join(f"{n} {r}" for r, n in self.counts.most_common())
        return f"skipped {self.total} bad lines ({reasons}); first: " + "; ".join(self.examples)


def check_path(path: str | Path) -> Path:
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: no such file")
    if path.is_dir():
        raise DataError(f"{path}: is a directory, expected a .jsonl file")
    return path


def iter_raw_lines(path: str | Path, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
                   start_offset: int = 0) -> Iterator[tuple[int, bytes]]:
    """Yield (line number, raw bytes without newline), bounded in memory by max_line_bytes; a .gz file is read
    decompressed.

    Blank lines are skipped silently (common at file ends). A longer line raises DataError without being
    read whole.
    """
    path = check_path(path)
    with (gzip.open if path.suffix == ".gz" else open)(path, "rb") as f:
        f.seek(start_offset)
        lineno = 0
        while True:
            try:
                raw = f.readline(max_line_bytes + 1)
            except (gzip.BadGzipFile, EOFError) as e:
                raise DataError(f"{path}: not a readable gzip file ({e})") from None
            if not raw:
                return
            lineno += 1
            if len(raw) > max_line_bytes and not raw.endswith(b"\n"):
                raise DataError(f"{path}:{lineno}: line is longer than {max_line_bytes:,} bytes; expected one "
                                "JSON object per line (is this a JSON array or a single-line file?)")
            if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]  # UTF-8 byte-order mark written by some editors
            raw = raw.rstrip(b"\r\n")
            if raw.strip():
                yield lineno, raw


def parse_line(raw: bytes, kind: RecordShape) -> dict[str, Any]:
    """Decode and validate one line as a record of shape `kind` ("text", "conversations", "dpo", "prompt", "any"
    of the first two, or "object": any JSON object; dataset/kinds.py); raise ValueError."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"invalid UTF-8 at byte {e.start}") from None
    try:
        record = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"invalid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    if kind == "text":
        validate_text(record)
    elif kind == "conversations":
        validate_conversations(record)
    elif kind == "dpo":
        validate_preference(record)
    elif kind == "prompt":
        validate_prompt(record)
    elif kind == "any":
        if "text" in record:
            validate_text(record)
        elif "conversations" in record:
            validate_conversations(record)
        else:
            raise ValueError('expected a "text" or "conversations" field')
    elif kind != "object":
        raise AssertionError(kind)
    return record


def validate_text(record: dict[str, Any]) -> None:
    if "text" not in record:
        raise ValueError(f'missing "text" field (keys: {sorted(record)[:5]})')
    if not isinstance(record["text"], str):
        raise ValueError(f'"text" must be a string, got {type(record["text"]).__name__}')
    if not record["text"].strip():
        raise ValueError('empty "text"')


def validate_messages(messages: Any, name: str, where: str = "") -> None:
    """A non-empty list of {"role", "content"} turns with known roles and string content; for tool use, an
    assistant turn's "tool_calls" (then its content may be null) and "reasoning_content", and a first system
    turn's "tools". MiniMind's records hold tools and tool calls as JSON strings: parsed here, in place.

    `where` prefixes the per-turn messages (e.g. '"chosen" '), so a preference pair names the list at fault.
    """
    if not isinstance(messages, list):
        raise ValueError(f'"{name}" must be a list, got {type(messages).__name__}')
    if not messages:
        raise ValueError(f'empty "{name}"')
    for i, turn in enumerate(messages):
        if not isinstance(turn, dict):
            raise ValueError(f"{where}turn {i} must be an object, got {type(turn).__name__}")
        if turn.get("role") not in CHAT_ROLES:
            raise ValueError(f"{where}turn {i} has unknown role {turn.get('role')!r}; expected one of {CHAT_ROLES}")
        for key in ("tools", "tool_calls"):
            if isinstance(turn.get(key), str):
                try:
                    turn[key] = json.loads(turn[key])
                except json.JSONDecodeError as e:
                    raise ValueError(f'{where}turn {i} "{key}" is a string but not JSON ({e.msg})') from None
        calls = turn.get("tool_calls")
        if calls is not None and not (turn["role"] == "assistant" and isinstance(calls, list)
                                      and all(tool_call_ok(c) for c in calls)):
            raise ValueError(f'{where}turn {i} "tool_calls" must be an assistant turn\'s list of {{"name": str, '
                             '"arguments": object or JSON string}} (optionally inside "function")')
        if turn.get("content") is None and calls:
            turn["content"] = ""  # OpenAI's null content beside tool calls
        if not isinstance(turn.get("content"), str):
            raise ValueError(f'{where}turn {i} "content" must be a string, got {type(turn.get("content")).__name__}')
        if not isinstance(turn.get("reasoning_content", ""), str):
            raise ValueError(f'{where}turn {i} "reasoning_content" must be a string')
        tools = turn.get("tools")
        if tools is not None and not (i == 0 and turn["role"] == "system" and isinstance(tools, list)
                                      and all(isinstance(t, dict) for t in tools)):
            raise ValueError(f'{where}turn {i} "tools" must be a list of objects on the first, system turn')
        for k, tool in enumerate(tools or ()):
            if not tool_schema_ok(tool):
                raise ValueError(f'{where}turn {i} tool {k} is not a function schema: expected {{"type": '
                                 '"function", "function": {"name": str, "description": str, "parameters": '
                                 '{"type": "object", ...}}} (or the "function" object alone)')


def tool_schema_ok(tool: dict[str, Any]) -> bool:
    """A tool as OpenAI's `tools` describe one (or its "function" object alone): a non-empty name, an optional
    string description, and parameters that are a JSON-schema object when given."""
    function = tool.get("function", tool)
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"].strip():
        return False
    parameters = function.get("parameters", {"type": "object"})
    return isinstance(function.get("description", ""), str) and isinstance(parameters, dict) and \
        parameters.get("type", "object") == "object"


def tool_call_ok(call: Any) -> bool:
    """A tool call the chat template can write: {"name", "arguments"}, or OpenAI's {"function": {...}}."""
    call = call.get("function", call) if isinstance(call, dict) else None
    return (isinstance(call, dict) and isinstance(call.get("name"), str) and bool(call["name"])
            and isinstance(call.get("arguments"), (dict, str)))


def validate_conversations(record: dict[str, Any]) -> None:
    conv = record.get("conversations")
    if conv is None:
        raise ValueError(f'missing "conversations" field (keys: {sorted(record)[:5]})')
    validate_messages(conv, "conversations")
    if not any(t["role"] == "assistant" for t in conv):
        raise ValueError("conversation has no assistant turn (nothing to learn from)")


def validate_preference(record: dict[str, Any]) -> None:
    """A DPO pair (MiniMind's format): "chosen" and "rejected" message lists that share every turn but the
    last (the prompt, with at least one user turn) and end in two different, non-empty assistant answers.

    Turns are compared as the chat template renders them (content trimmed), so a pair that differs only in
    surrounding whitespace is one prompt, and two answers equal after trimming are identical.
    """
    for name in ("chosen", "rejected"):
        if name not in record:
            raise ValueError(f'missing "{name}" field (keys: {sorted(record)[:5]})')
    for name in ("chosen", "rejected"):
        messages = record[name]
        validate_messages(messages, name, f'"{name}" ')
        if messages[-1]["role"] != "assistant":
            raise ValueError(f'"{name}" does not end with an assistant answer (its last turn is '
                             f'{messages[-1]["role"]!r})')
        if not messages[-1]["content"].strip():
            raise ValueError(f'"{name}" ends with an empty assistant answer')
    chosen, rejected = record["chosen"], record["rejected"]
    if len(chosen) != len(rejected):
        raise ValueError(f'"chosen" and "rejected" have different prompts ({len(chosen) - 1} vs '
                         f"{len(rejected) - 1} turns before the answer)")
    for i, (a, b) in enumerate(zip(chosen[:-1], rejected[:-1])):
        if a["role"] != b["role"] or a["content"].strip() != b["content"].strip():
            raise ValueError(f'"chosen" and "rejected" have different prompts (turn {i} differs)')
    if not any(t["role"] == "user" for t in chosen[:-1]):
        raise ValueError("the prompt has no user turn (every turn before the answer is system or assistant)")
    if chosen[-1]["content"].strip() == rejected[-1]["content"].strip():
        raise ValueError('"chosen" and "rejected" answers are identical (nothing to prefer)')


def prompt_messages(record: dict[str, Any]) -> list[dict[str, str]]:
    """The chat a prompt record asks the model to continue: its "prompt" as the user's turn, or its
    "conversations" (or "messages") without a last assistant turn (MiniMind's RL prompts end with a placeholder
    answer), which must then end with the user's turn; ValueError otherwise."""
    if "prompt" in record:
        if not isinstance(record["prompt"], str) or not record["prompt"].strip():
            raise ValueError('"prompt" must be a non-empty string')
        return [{"role": "user", "content": record["prompt"]}]
    key = next((k for k in ("conversations", "messages") if k in record), None)
    if key is None:
        raise ValueError(f'expected a "prompt", "conversations" or "messages" field (keys: {sorted(record)[:5]})')
    turns = record[key]
    validate_messages(turns, key)
    if turns[-1]["role"] == "assistant":
        turns = turns[:-1]
    if not turns or turns[-1]["role"] != "user":
        raise ValueError(f'"{key}" must end with the user\'s turn (the model answers it; one last assistant '
                         "turn is left out)")
    return turns


def validate_prompt(record: dict[str, Any]) -> None:
    """A prompt with checked answers (reinforcement learning): prompt_messages() of it, and an "answer" that
    is a string or a non-empty list of strings."""
    prompt_messages(record)
    gold_answers(record.get("answer"))


def read_records(path: str | Path, kind: RecordShape, skip_bad_lines: bool = False,
                 report: SkipReport | None = None,
                 max_line_bytes: int = DEFAULT_MAX_LINE_BYTES) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield (line number, validated record). Bad lines raise DataError, or are counted into `report`."""
    path = check_path(path)
    report = report if report is not None else SkipReport()
    seen_any = False
    for lineno, raw in iter_raw_lines(path, max_line_bytes):
        try:
            record = parse_line(raw, kind)
        except ValueError as e:
            report.reject(path, lineno, str(e), skip_bad_lines)
            continue
        seen_any = True
        yield lineno, record
    if not seen_any:
        raise DataError(f"{path}: no usable records (empty file, or every line was bad)")
