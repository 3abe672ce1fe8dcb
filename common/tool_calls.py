"""Reading a model's reply: its <think> reasoning, its text, and its <tool_call> blocks.

The chat template (dataset/tokenizer.py) writes an assistant turn as

    <think>
    reasoning
    </think>

    content
    <tool_call>
    {"name": "calculator", "arguments": {"expression": "12 * 7"}}
    </tool_call>

and `parse_reply` reads generated text back into those parts. A model's output is untrusted: a block that is not
a JSON object with a string "name" and an object "arguments" (or a JSON string holding one), or a <tool_call> that
was never closed (generation cut off), is not a call. It stays in the content as text and is listed in
`Reply.malformed`, so a caller can show it, count it, or score it, and nothing downstream ever executes it.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL_BLOCK = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """One call the model asked for: a tool's name and its arguments (a JSON object)."""

    name: str
    arguments: dict[str, Any]

    def as_message(self) -> dict[str, Any]:
        """The call as a chat message's tool_calls entry (what the template renders back)."""
        return {"name": self.name, "arguments": self.arguments}


@dataclass(frozen=True)
class Reply:
    """A generated assistant turn, read: reasoning (None when the model did not think), the text around the
    calls, the well-formed calls in order, and the blocks that looked like calls but were not (with why)."""

    reasoning: str | None
    content: str
    calls: tuple[ToolCall, ...] = ()
    malformed: tuple[str, ...] = field(default=())


def parse_call(body: str) -> ToolCall:
    """The inside of one <tool_call> block as a ToolCall; ValueError saying what is wrong with it."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON ({e.msg} at character {e.pos})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"a JSON {type(obj).__name__}, not an object")
    name, args = obj.get("name"), obj.get("arguments", {})
    if not isinstance(name, str) or not name.strip():
        raise ValueError('no "name" string')
    if isinstance(args, str):  # some models (and OpenAI's wire format) carry the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            raise ValueError('"arguments" is a string but not JSON') from None
    if not isinstance(args, dict):
        raise ValueError('"arguments" is not an object')
    return ToolCall(name.strip(), args)


def split_reasoning(text: str, thinking: bool = False) -> tuple[str | None, str]:
    """(reasoning, the rest) of a reply. `thinking`: the prompt already opened the <think> block (the template's
    enable_thinking=True), so the reply starts inside it. An unclosed block is all reasoning: the model was still
    thinking when generation stopped."""
    stripped = text.lstrip()
    if not thinking:
        if not stripped.startswith(THINK_OPEN):
            return None, text.strip()
        stripped = stripped[len(THINK_OPEN):]
    inside, closed, rest = stripped.partition(THINK_CLOSE)
    return inside.strip(), rest.strip() if closed else ""


def parse_reply(text: str, thinking: bool = False) -> Reply:
    """Read a generated assistant turn (decoded text, special tokens dropped) into its parts."""
    reasoning, rest = split_reasoning(text, thinking)
    calls: list[ToolCall] = []
    malformed: list[str] = []
    kept: list[str] = []  # the text that stays content: everything but well-formed call blocks
    end = 0
    for match in _CALL_BLOCK.finditer(rest):
        kept.append(rest[end:match.start()])
        try:
            calls.append(parse_call(match.group(1).strip()))
        except ValueError as e:
            malformed.append(f"{match.group(0)!r}: {e}")
            kept.append(match.group(0))
        end = match.end()
    tail = rest[end:]
    if CALL_OPEN in tail:
        malformed.append(f"{tail[tail.index(CALL_OPEN):]!r}: {CALL_OPEN} never closed")
    kept.append(tail)
    content = "\n".join(part.strip() for part in kept if part.strip())
    return Reply(reasoning, content, tuple(calls), tuple(malformed))


def _canonical(value: Any) -> Any:
    """A value as arguments are compared: numbers as floats, strings case-folded without spaces."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        text = "".join(value.split()).casefold()
        try:  # "12" and 12 are the same argument
            return float(text)
        except ValueError:
            return text
    if isinstance(value, dict):
        return {str(k): _canonical(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_canonical(v) for v in value]
    return value


def same_call(call: ToolCall, name: str, arguments: dict[str, Any]) -> bool:
    """Whether `call` is the expected one: the same tool and the same arguments, compared up to spacing, letter
    case and how a number is written ("12 * 7" is "12*7"; 2 is 2.0)."""
    return call.name == name and _canonical(call.arguments) == _canonical(arguments)
