"""The OpenAI wire format: request models (pydantic), error bodies and response / stream-chunk builders.

Fields follow the OpenAI API field for field; the extensions (`top_k`, `repetition_penalty`, `ignore_eos`,
`truncate`, `enable_thinking`) are plain body fields, which the official client sends through `extra_body`.
Unknown fields are ignored, as other OpenAI-compatible servers do; known features this server cannot honour
(log-probabilities, JSON mode, presence/frequency penalties, logit bias, echo, suffix, best_of) are refused with a
400 rather than silently dropped. Tools are offered to the model through the chat template; its calls come back
as `tool_calls` (common/tool_calls.py reads them; a malformed one stays text).
"""
from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from common.tokens import CHAT_ROLES
from common.tool_calls import Reply, ToolCall

MAX_STOP = 4  # as OpenAI


class APIError(Exception):
    """An error answered as OpenAI does: {"error": {"message", "type", "param", "code"}} with an HTTP status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# ------------------------------------------------------------------------------ requests
class ChatMessage(BaseModel):
    """One message; `content` is a string or a list of text parts, normalised to a string. An assistant message
    may carry the `tool_calls` it made (OpenAI's {"id", "type": "function", "function": {"name", "arguments"}},
    arguments a JSON string) and its `reasoning_content`; a `tool` message answers a call (`tool_call_id`)."""

    model_config = ConfigDict(extra="ignore")
    role: str
    content: Any = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _normalise(self) -> ChatMessage:
        if self.role == "developer":  # OpenAI's newer name for the system role
            self.role = "system"
        if self.role not in CHAT_ROLES:
            raise ValueError(f"unknown role {self.role!r}; expected one of {list(CHAT_ROLES)} (or developer, read as "
                             "system)")
        if self.tool_calls is not None:
            if self.role != "assistant":
                raise ValueError("tool_calls: only an assistant message carries them")
            for call in self.tool_calls:
                function = call.get("function", call)
                args = function.get("arguments") if isinstance(function, dict) else None
                if isinstance(args, str):
                    try:
                        args = json.loads(args)
                    except json.JSONDecodeError:
                        raise ValueError("tool_calls: function.arguments must be a JSON object (as a string)") \
                            from None
                if not (isinstance(function, dict) and isinstance(function.get("name"), str) and function["name"]
                        and isinstance(args, dict)):
                    raise ValueError('tool_calls: each must be {"type": "function", "function": {"name": str, '
                                     '"arguments": JSON object string}}')
        content = self.content
        if content is None and self.role == "assistant":
            content = ""
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ValueError("content parts must be {\"type\": \"text\", \"text\": ...}; this model reads text "
                                 "only")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise ValueError(f"content must be a string or a list of text parts, got {type(content).__name__}"
                             if content is not None else "content is required")
        self.content = content
        return self

    def as_dict(self) -> dict[str, Any]:
        """The message as the chat template reads it."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        return out


class StreamOptions(BaseModel):
    """`stream_options`: include_usage adds a last chunk with the token counts."""

    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class CommonRequest(BaseModel):
    """Fields shared by chat and text completions."""

    model_config = ConfigDict(extra="ignore")
    model: str
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    n: int | None = Field(None, ge=1)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: Any = None
    max_tokens: int | None = Field(None, ge=1)
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # extensions
    top_k: int | None = Field(None, ge=0, description="keep the k most likely tokens; 0 = off")
    repetition_penalty: float | None = Field(None, gt=0, description="CTRL-style penalty on tokens already in the "
                                                                     "text; 1 = off")
    ignore_eos: bool = Field(False, description="keep going past the stop token (benchmarks)")

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: Any) -> list[str]:
        if v is None:
            return []
        items = [v] if isinstance(v, str) else v
        if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
            raise ValueError("stop must be a string or a list of strings")
        if len(items) > MAX_STOP:
            raise ValueError(f"stop takes at most {MAX_STOP} strings, got {len(items)}")
        return [s for s in items if s]

    def unsupported(self) -> list[tuple[str, str]]:
        """(field, what to do instead) for each feature asked for that this server does not implement."""
        out = []
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                out.append((name, "use repetition_penalty (an extension field) instead"))
        if self.logit_bias:
            out.append(("logit_bias", "logit bias is not supported"))
        return out


class ChatCompletionRequest(CommonRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None  # accepted; the model decides how many calls it writes
    response_format: dict | None = None
    enable_thinking: bool | None = Field(None, description="open (true) or close (false) the answer's <think> "
                                                           "block in the prompt; the reasoning comes back as "
                                                           "reasoning_content (Qwen's chat template switch)")
    truncate: Literal["none", "oldest_turns"] = Field(
        "none", description="oldest_turns: drop the oldest turns (never a leading system message) until the "
                            "conversation fits the context, instead of refusing it")

    @field_validator("tools")
    @classmethod
    def _tools(cls, v: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        for tool in v or []:
            function = tool.get("function")
            if tool.get("type") != "function" or not isinstance(function, dict) or not isinstance(
                    function.get("name"), str) or not function["name"]:
                raise ValueError('each tool must be {"type": "function", "function": {"name": str, "description", '
                                 '"parameters"}}')
        return v or None

    @model_validator(mode="after")
    def _tool_choice(self) -> ChatCompletionRequest:
        choice, names = self.tool_choice, [t["function"]["name"] for t in self.tools or []]
        if choice is None or choice in ("none", "auto"):
            return self
        if choice == "required" or isinstance(choice, dict):
            if not names:
                raise ValueError("tool_choice: asks for a tool call, but no tools are given")
            if isinstance(choice, dict):
                name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
                if name not in names:
                    raise ValueError(f"tool_choice: {{\"type\": \"function\", \"function\": {{\"name\": ...}}}} "
                                     f"naming one of the tools ({', '.join(names)})")
            return self
        raise ValueError('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                         '{"name": ...}}')

    @property
    def offered_tools(self) -> list[dict[str, Any]] | None:
        """The tools the prompt offers: none when tool_choice is "none"."""
        return None if self.tool_choice == "none" else self.tools

    @property
    def call_prefill(self) -> str:
        """The start of the answer that makes the model call: a required call opens a <tool_call> block, a named
        one also writes the tool's name (the model writes the arguments)."""
        if self.tool_choice == "required":
            return "<tool_call>\n"
        if isinstance(self.tool_choice, dict):
            return '<tool_call>\n{"name": "' + self.tool_choice["function"]["name"] + '", "arguments": '
        return ""

    def unsupported(self) -> list[tuple[str, str]]:
        out = super().unsupported()
        if self.logprobs or self.top_logprobs:
            out.append(("logprobs", "log-probabilities are not supported"))
        if self.response_format and self.response_format.get("type", "text") != "text":
            out.append(("response_format", "only text responses are supported"))
        return out


class CompletionRequest(CommonRequest):
    """POST /v1/completions: `prompt` is a string, a list of strings, a list of token ids or a list of those."""

    prompt: Any
    echo: bool | None = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None
    truncate: Literal["none", "oldest_tokens"] = Field(
        "none", description="oldest_tokens: keep the last tokens of a prompt that does not fit, instead of refusing it")

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: Any) -> list[str | list[int]]:
        def ids(x: Any) -> bool:
            return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)
        if isinstance(v, str) or ids(v):
            return [v]
        if isinstance(v, list) and v and all(isinstance(p, str) or ids(p) for p in v):
            return v
        raise ValueError("prompt must be a string, a list of strings, a non-empty list of token ids or a list of "
                         "those")

    def unsupported(self) -> list[tuple[str, str]]:
        out = super().unsupported()
        if self.logprobs:
            out.append(("logprobs", "log-probabilities are not supported"))
        if self.echo:
            out.append(("echo", "echo is not supported"))
        if self.suffix:
            out.append(("suffix", "suffix (insertion) is not supported"))
        if self.best_of not in (None, 1) and self.best_of != self.n:
            out.append(("best_of", "best_of is not supported"))
        return out


def parse_request(model: type[CommonRequest], body: dict) -> Any:
    """The validated request, or a 400 APIError naming the first bad field (`param`, e.g. "messages[0].role")."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        param = ""
        for part in err["loc"]:
            if isinstance(part, int):
                param += f"[{part}]"
            elif part in model.model_fields or part in ChatMessage.model_fields or part == "include_usage":
                param += ("." if param else "") + part
        if err["type"] == "missing":
            raise APIError(400, f"Missing required parameter: '{param}'.", param=param,
                           code="missing_required_parameter") from None
        msg = err["msg"].removeprefix("Value error, ")
        raise APIError(400, f"{param}: {msg}" if param else msg, param=param or None, code="invalid_value") from None


# ----------------------------------------------------------------------------- responses
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def tool_call_entry(call: ToolCall, index: int | None = None) -> dict[str, Any]:
    """A call as OpenAI returns it: an id, type "function", the name and the arguments as a JSON string (with an
    `index` in a streamed delta)."""
    entry: dict[str, Any] = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                             "function": {"name": call.name, "arguments": json.dumps(call.arguments,
                                                                                     ensure_ascii=False)}}
    return entry if index is None else {"index": index, **entry}


def reply_message(reply: Reply | str) -> dict[str, Any]:
    """An answer's message: its text, or a read reply's content, tool calls (content null beside them, as
    OpenAI) and reasoning_content."""
    if isinstance(reply, str):
        return {"role": "assistant", "content": reply}
    message: dict[str, Any] = {"role": "assistant", "content": reply.content or (None if reply.calls else "")}
    if reply.reasoning is not None:
        message["reasoning_content"] = reply.reasoning
    if reply.calls:
        message["tool_calls"] = [tool_call_entry(c) for c in reply.calls]
    return message


def chat_response(id: str, created: int, model: str, replies: list[Reply | str], reasons: list[str | None],
                  counts: dict[str, int]) -> dict:
    """A chat completion; a choice whose reply made tool calls finishes with "tool_calls"."""
    choices = [{"index": i, "message": reply_message(t), "logprobs": None,
                "finish_reason": "tool_calls" if isinstance(t, Reply) and t.calls else r}
               for i, (t, r) in enumerate(zip(replies, reasons))]
    return {"id": id, "object": "chat.completion", "created": created, "model": model, "choices": choices,
            "usage": counts}


def completion_response(id: str, created: int, model: str, texts: list[str], reasons: list[str | None],
                        counts: dict[str, int]) -> dict:
    choices = [{"index": i, "text": t, "logprobs": None, "finish_reason": r}
               for i, (t, r) in enumerate(zip(texts, reasons))]
    return {"id": id, "object": "text_completion", "created": created, "model": model, "choices": choices,
            "usage": counts}


def chunk(chat: bool, id: str, created: int, model: str, index: int, text: str | None = None,
          finish_reason: str | None = None, role: bool = False, with_usage: bool = False,
          reasoning: str | None = None, tool_call: dict[str, Any] | None = None) -> dict:
    """One streamed chunk for one choice: chat chunks carry a `delta` (the role first, then content, reasoning
    or a tool call), text completion chunks a `text`. With stream_options.include_usage every chunk has
    "usage": null."""
    if chat:
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
        if text is not None:
            delta["content"] = text
        if reasoning is not None:
            delta["reasoning_content"] = reasoning
        if tool_call is not None:
            delta["tool_calls"] = [tool_call]
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    else:
        choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
    out = {"id": id, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
           "model": model, "choices": [choice]}
    if with_usage:
        out["usage"] = None
    return out


def usage_chunk(chat: bool, id: str, created: int, model: str, counts: dict[str, int]) -> dict:
    """The last chunk when stream_options.include_usage is set: no choices, the request's usage."""
    return {"id": id, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": [], "usage": counts}


def sse(data: dict | str) -> bytes:
    """One server-sent event."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {text}\n\n".encode()
