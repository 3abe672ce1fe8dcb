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
from dataclasses import dataclass, field
from typing import Any

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


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


Event = tuple[str, "str | ToolCall"]  # ("content" | "reasoning", text) or ("call", ToolCall)


class ReplyStream:
    """Reads a reply as it is generated, for streaming: push() text pieces, get events back as soon as they are
    certain; finish() at the end. Text that may be the start of a marker is held until the next piece decides it.

    Events: ("reasoning", text) inside a leading <think> block; ("content", text) outside it and outside call
    blocks; ("call", ToolCall) when a <tool_call> block closes and reads as a call (a malformed one comes back as
    content, its raw text, and is listed in `malformed`). Whitespace at the edges of the reasoning and of the
    content is not emitted (the template trims both). With tools=False, text after the reasoning is content as
    generated: nothing in it is a call.
    """

    def __init__(self, tools: bool = True, thinking: bool = False) -> None:
        self.tools = tools
        self.state = "think" if thinking else "start"
        self.thought = thinking  # a <think> block was opened
        self.buf = ""
        self.started = {"content": False, "reasoning": False}
        self.held = {"content": "", "reasoning": ""}  # trailing whitespace, emitted only if more text follows
        self.malformed: list[str] = []

    def _emit(self, channel: str, text: str) -> list[Event]:
        if channel == "content" and not (self.tools or self.thought):  # neither calls nor thinking: as generated
            return [(channel, text)] if text else []
        if not self.started[channel]:
            text = text.lstrip()
        text = self.held[channel] + text
        body = text.rstrip()
        self.held[channel] = text[len(body):]
        if not body:
            return []
        self.started[channel] = True
        return [(channel, body)]

    def _safe(self, marker: str) -> int:
        """How much of the buffer is certainly not the start of `marker` (its longest partial suffix held)."""
        for k in range(min(len(marker) - 1, len(self.buf)), 0, -1):
            if marker.startswith(self.buf[-k:]):
                return len(self.buf) - k
        return len(self.buf)

    def push(self, text: str) -> list[Event]:
        self.buf += text
        events: list[Event] = []
        while True:
            if self.state == "start":
                head = self.buf.lstrip()
                if THINK_OPEN.startswith(head) and len(head) < len(THINK_OPEN):
                    return events  # maybe a <think> still coming
                if head.startswith(THINK_OPEN):
                    self.buf, self.state, self.thought = head[len(THINK_OPEN):], "think", True
                else:
                    self.state = "text"
            elif self.state == "think":
                inside, closed, rest = self.buf.partition(THINK_CLOSE)
                if not closed:
                    cut = self._safe(THINK_CLOSE)
                    events += self._emit("reasoning", self.buf[:cut])
                    self.buf = self.buf[cut:]
                    return events
                events += self._emit("reasoning", inside)
                self.buf, self.state = rest, "text"
            elif self.state == "text":
                before, opened, rest = self.buf.partition(CALL_OPEN) if self.tools else (self.buf, "", "")
                if not opened:
                    cut = self._safe(CALL_OPEN) if self.tools else len(self.buf)
                    events += self._emit("content", self.buf[:cut])
                    self.buf = self.buf[cut:]
                    return events
                events += self._emit("content", before)
                self.buf, self.state = rest, "call"
            else:  # inside a call block
                body, closed, rest = self.buf.partition(CALL_CLOSE)
                if not closed:
                    return events
                raw = CALL_OPEN + body + CALL_CLOSE
                try:
                    events.append(("call", parse_call(body.strip())))
                except ValueError as e:
                    self.malformed.append(f"{raw!r}: {e}")
                    events += self._emit("content", raw)
                self.buf, self.state = rest, "text"

    def finish(self) -> list[Event]:
        """The events the end of the reply decides: an unclosed block's text (a cut-off call is content, and
        malformed; a cut-off <think> is all reasoning)."""
        rest, self.buf = self.buf, ""
        if self.state == "call":
            self.malformed.append(f"{CALL_OPEN + rest!r}: {CALL_OPEN} never closed")
            return self._emit("content", CALL_OPEN + rest)
        if self.state == "think":
            return self._emit("reasoning", rest)
        self.state = "text"
        return self._emit("content", rest)


def parse_reply(text: str, thinking: bool = False, tools: bool = True) -> Reply:
    """Read a generated assistant turn (decoded text, special tokens dropped) into its parts: the events of
    ReplyStream over the whole text, joined. `thinking`: the prompt already opened the <think> block (the
    template's enable_thinking=True), so the reply starts inside it; tools=False: no calls are read."""
    stream = ReplyStream(tools=tools, thinking=thinking)
    events = stream.push(text) + stream.finish()
    reasoning = "".join(str(v) for kind, v in events if kind == "reasoning") if stream.thought else None
    content = "".join(str(v) for kind, v in events if kind == "content")
    calls = tuple(v for kind, v in events if kind == "call")
    return Reply(reasoning, content, calls, tuple(stream.malformed))  # type: ignore[arg-type]


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
