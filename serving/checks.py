"""From an API request to what the engine runs: the checks a request must pass (the model it names, parameters
this server does not support, n), its prompt's token ids within the model's context (a chat rendered with the
checkpoint's template, a text prompt encoded or given as ids; both optionally truncated to fit), and its sampling
parameters. Every refusal is an APIError in OpenAI's shape and wording, naming the parameter to fix.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from model.inference import fit_chat, keep_recent

from .engine import SamplingParams
from .schema import APIError, CommonRequest

if TYPE_CHECKING:
    from .service import Service


class RequestChecks:
    """The checks and conversions of one served model's requests."""

    def __init__(self, service: Service) -> None:
        self.service = service

    def check_model(self, name: str, param: str | None = "model") -> None:
        if name != self.service.name:
            raise APIError(404, f"The model `{name}` does not exist; this server serves `{self.service.name}`.",
                           param=param, code="model_not_found")

    def check_request(self, req: CommonRequest) -> None:
        self.check_model(req.model)
        for field, hint in req.unsupported():
            raise APIError(400, f"{field}: not supported by this server; {hint}", param=field,
                           code="unsupported_parameter")
        engine = self.service.engine
        if (req.n or 1) > engine.max_batch_size:
            raise APIError(400, f"n: at most {engine.max_batch_size} (the server's max_batch_size), got {req.n}",
                           param="n")

    def too_long(self, prompt_tokens: int, max_tokens: int, param: str, hint: str) -> APIError:
        return APIError(400, f"This model's maximum context length is {self.service.context} tokens. However, you "
                             f"requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the {param}, "
                             f"{max_tokens} in the completion). Please reduce the length of the {param} or "
                             f"completion{hint}.", param=param, code="context_length_exceeded")

    def no_room(self, max_tokens: int) -> APIError:
        return APIError(400, f"max_tokens: {max_tokens} leaves no room for a prompt in this model's "
                             f"{self.service.context}-token context", param="max_tokens")

    def chat_prompt(self, messages: list[dict], encode: Callable[[list[dict]], list[int]], max_tokens: int | None,
                    truncate: bool) -> tuple[list[int], int]:
        """The conversation's ids (rendered with the checkpoint's chat template by `encode`) and the completion
        budget."""
        ctx = self.service.context
        if max_tokens is not None and max_tokens >= ctx:
            raise self.no_room(max_tokens)
        if truncate:
            # without max_tokens, a quarter of the context stays for the answer
            budget = ctx - (max_tokens if max_tokens is not None else max(1, ctx // 4))
            _, ids, _ = fit_chat(messages, encode, budget)
            ids, _ = keep_recent(ids, budget)  # the newest turn alone may still be too long
        else:
            ids = encode(messages)
        if max_tokens is None:
            max_tokens = ctx - len(ids)  # OpenAI's default: whatever the context leaves
        if max_tokens < 1 or len(ids) + max_tokens > ctx:
            raise self.too_long(len(ids), max(max_tokens, 1), "messages", ', or send "truncate": "oldest_turns" '
                                                                         "to drop the oldest turns")
        return ids, max_tokens

    def text_prompt(self, prompt: str | list[int], max_tokens: int, truncate: bool) -> list[int]:
        """A text completion's prompt as ids (an empty one starts a new document), within the context."""
        ctx, vocab, tok = self.service.context, self.service.engine.model.config.vocab_size, self.service.tokenizer
        if max_tokens >= ctx:
            raise self.no_room(max_tokens)
        if isinstance(prompt, str):
            ids = tok.encode(prompt) or [tok.eot_id]
        else:
            if any(not 0 <= t < vocab for t in prompt):
                raise APIError(400, f"prompt: token ids must be in [0, {vocab})", param="prompt")
            ids = list(prompt)
        if truncate:
            ids, _ = keep_recent(ids, ctx - max_tokens)
        if len(ids) + max_tokens > ctx:
            raise self.too_long(len(ids), max_tokens, "prompt", ', or send "truncate": "oldest_tokens" to keep its '
                                                               "end")
        return ids

    def sampling(self, req: CommonRequest, max_tokens: int, chat: bool) -> SamplingParams:
        temperature = 1.0 if req.temperature is None else req.temperature
        top_p = 1.0 if req.top_p is None else req.top_p
        if top_p == 0:  # keep only the most likely token: greedy (sample_next needs top_p > 0)
            temperature, top_p = 0.0, 1.0
        return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=req.top_k or 0,
                              repetition_penalty=req.repetition_penalty or 1.0, seed=req.seed,
                              stop=tuple(req.stop or ()),
                              stop_ids=() if req.ignore_eos else tuple(self.service.tokenizer.stop_ids(chat)))
