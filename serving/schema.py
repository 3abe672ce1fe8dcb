"""The OpenAI wire format: request models (pydantic), error bodies and response / stream-chunk builders.

Fields follow the OpenAI API field for field; the extensions (`top_k`, `repetition_penalty`, `ignore_eos`,
`truncate`) are plain body fields, which the official client sends through `extra_body`. Unknown fields are
ignored, as other OpenAI-compatible servers do; known features this server cannot honour (log-probabilities,
tools, JSON mode, presence/frequency penalties, logit bias, echo, suffix, best_of) are refused with a 400 rather
than silently dropped.
"""
from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from common.tokens import CHAT_ROLES

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
    """One message; `content` is a string or a list of text parts, normalised to a string."""

    model_config = ConfigDict(extra="ignore")
    role: str
    content: Any = None
    name: str | None = None

    @model_validator(mode="after")
    def _normalise(self) -> ChatMessage:
        if self.role == "developer":  # OpenAI's newer name for the system role
            self.role = "system"
        if self.role not in CHAT_ROLES:
            raise ValueError(f"unknown role {self.role!r}; expected one of {list(CHAT_ROLES)} (or developer, read as "
                             "system)")
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

    def as_dict(self) -> dict[str, str]:
        return {"role": self.role, "content": self.content}


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
    tools: list | None = None
    response_format: dict | None = None
    truncate: Literal["none", "oldest_turns"] = Field(
        "none", description="oldest_turns: drop the oldest turns (never a leading system message) until the "
                            "conversation fits the context, instead of refusing it")

    def unsupported(self) -> list[tuple[str, str]]:
        out = super().unsupported()
        if self.logprobs or self.top_logprobs:
            out.append(("logprobs", "log-probabilities are not supported"))
        if self.tools:
            out.append(("tools", "tool calls are not supported"))
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


def chat_response(id: str, created: int, model: str, texts: list[str], reasons: list[str | None],
                  counts: dict[str, int]) -> dict:
    choices = [{"index": i, "message": {"role": "assistant", "content": t}, "logprobs": None, "finish_reason": r}
               for i, (t, r) in enumerate(zip(texts, reasons))]
    return {"id": id, "object": "chat.completion", "created": created, "model": model, "choices": choices,
            "usage": counts}


def completion_response(id: str, created: int, model: str, texts: list[str], reasons: list[str | None],
                        counts: dict[str, int]) -> dict:
    choices = [{"index": i, "text": t, "logprobs": None, "finish_reason": r}
               for i, (t, r) in enumerate(zip(texts, reasons))]
    return {"id": id, "object": "text_completion", "created": created, "model": model, "choices": choices,
            "usage": counts}


def chunk(chat: bool, id: str, created: int, model: str, index: int, text: str | None = None,
          finish_reason: str | None = None, role: bool = False, with_usage: bool = False) -> dict:
    """One streamed chunk for one choice: chat chunks carry a `delta` (the role first, then content), text
    completion chunks a `text`. With stream_options.include_usage every chunk has "usage": null."""
    if chat:
        delta: dict[str, str] = {"role": "assistant", "content": ""} if role else {}
        if text is not None:
            delta["content"] = text
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
