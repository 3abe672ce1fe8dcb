"""Tool use at inference: generate, read the reply's tool calls, run them, feed the results back, continue; and
tool-call accuracy on a task of tool items.

One round is a generation for every conversation still going, batched. A reply with well-formed calls
(common/tool_calls.py) has them run by the bundled registry (common/tools.py: pure functions, the model's text is
never evaluated) and their results appended as `tool` messages; a reply without calls ends its conversation. At
most `max_rounds` rounds of calls run: a reply that still calls after them ends the conversation with its calls
not run (`capped`), so a model that loops on calls cannot loop forever. A conversation that outgrows the model's
positions ends there too (`overflow`); it is never cut from the left, which would drop the tools it was given.

A tool item (dataset/tasks.py ToolItem) is scored on its first reply, the call (valid: one or more well-formed
calls and nothing malformed; the right tool; the right call, arguments compared by common/tool_calls.same_call),
and on its end: the final reply's answer (common/answers.answer_right). The same question is also asked without
tools (the system turn's tools removed) and judged alike, which says what the tools added.

Nothing here imports dataset/: the tokenizer is passed in.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from itertools import groupby
from typing import Any, Callable, Protocol, Sequence

import torch

from common.answers import answer_right
from common.tool_calls import Reply, parse_reply, same_call
from common.tools import BUNDLED, Tool, run_tool
from model.generate import generate

Message = dict[str, Any]
Generate = Callable[[list[list[int]], int], list[list[int]]]  # (prompts, new-token budget) -> new ids per prompt
Autocast = Callable[[], contextlib.AbstractContextManager]
DEFAULT_ROUNDS = 3


class ChatCodec(Protocol):
    """The tokenizer's part used here (dataset/tokenizer.py Tokenizer)."""

    eot_id: int

    def chat_prompt(self, messages: Sequence[Message]) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str: ...

    def stop_ids(self, chat: bool) -> list[int]: ...


@dataclass
class ToolRun:
    """One conversation carried through tool use: its messages (the generated turns and the tool results
    appended), each reply as read, and how it ended early, if it did."""

    messages: list[Message]
    replies: list[Reply] = field(default_factory=list)
    capped: bool = False  # the last reply's calls were not run: max_rounds reached
    overflow: bool = False  # the conversation no longer fit the model's positions

    @property
    def final(self) -> str:
        """The last reply's text ("" before any reply)."""
        return self.replies[-1].content if self.replies else ""


def assistant_message(reply: Reply) -> Message:
    """A reply as the assistant message the chat template renders back (tool calls and reasoning kept)."""
    message: Message = {"role": "assistant", "content": reply.content}
    if reply.calls:
        message["tool_calls"] = [call.as_message() for call in reply.calls]
    if reply.reasoning is not None:
        message["reasoning_content"] = reply.reasoning
    return message


def run_tools(generate_fn: Generate, conversations: Sequence[Sequence[Message]], encode: Callable[[list[Message]],
              list[int]], decode: Callable[[list[int]], str], max_new_tokens: int, max_positions: int,
              max_rounds: int = DEFAULT_ROUNDS, registry: dict[str, Tool] = BUNDLED,
              on_turn: Callable[[int, Message], None] | None = None) -> list[ToolRun]:
    """Carry every conversation through tool use, as the module docstring says; `on_turn(index, message)` sees
    each appended assistant and tool message as it comes (e.g. to print it)."""
    runs = [ToolRun(list(c)) for c in conversations]
    active = list(range(len(runs)))
    for round_ in range(max_rounds + 1):
        prompts = {}
        for i in active:
            ids = encode(runs[i].messages)
            if len(ids) + max_new_tokens > max_positions:
                runs[i].overflow = True
            else:
                prompts[i] = ids
        active = list(prompts)
        if not active:
            break
        going = []
        for i, new in zip(active, generate_fn([prompts[i] for i in active], max_new_tokens)):
            run, reply = runs[i], parse_reply(decode(new))
            run.replies.append(reply)
            appended = [assistant_message(reply)]
            if reply.calls and round_ == max_rounds:
                run.capped = True
            elif reply.calls:
                appended += [{"role": "tool", "content": run_tool(call, registry)} for call in reply.calls]
                going.append(i)
            run.messages += appended
            for message in appended:
                if on_turn:
                    on_turn(i, message)
        active = going
    return runs


class ToolTask(Protocol):
    """What a tool item offers (dataset/tasks.py ToolItem)."""

    id: str
    messages: tuple[Message, ...]  # the prompt: a system turn with "tools", then the user's question
    answers: tuple[str, ...]
    call_name: str
    call_arguments: dict[str, Any]
    max_new_tokens: int
    max_rounds: int
    kind: str  # a label of the item's own ("" for none): scores are broken down by it


@dataclass(frozen=True)
class ToolVerdict:
    """One tool item, judged."""

    valid: bool  # the first reply made one or more well-formed calls and nothing malformed
    right_tool: bool  # its first call named the expected tool
    right_call: bool  # ... with the expected arguments
    correct: bool  # the final reply's answer is right
    bare: bool  # the answer given without tools is right


def without_tools(messages: Sequence[Message]) -> list[Message]:
    """The conversation with the tools taken off its system turn (the turn dropped when it held nothing else)."""
    out = []
    for m in messages:
        if m["role"] == "system" and "tools" in m:
            m = {k: v for k, v in m.items() if k != "tools"}
            if not (m.get("content") or "").strip():
                continue
        out.append(m)
    return out


def greedy(model: torch.nn.Module, tok: ChatCodec, batch_size: int, autocast: Autocast) -> Generate:
    """Batched greedy decoding for chat prompts, ended by the end-of-turn token."""
    def run(prompts: list[list[int]], budget: int) -> list[list[int]]:
        out: list[list[int]] = []
        for start in range(0, len(prompts), batch_size):
            with autocast():
                out += generate(model, prompts[start:start + batch_size], budget, temperature=0.0,
                                eos_token_ids=tok.stop_ids(True), pad_token_id=tok.eot_id)
        return out
    return run


def judge_tool_items(model: torch.nn.Module, items: Sequence[ToolTask], tok: ChatCodec, batch_size: int = 16,
                     autocast: Autocast = contextlib.nullcontext) -> tuple[list[ToolVerdict], list[dict[str, Any]]]:
    """Every item's verdict and a sample record of it (id, the generated turns, the bare reply), in order."""
    max_positions = model.config.max_position_embeddings
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    gen = greedy(model, tok, batch_size, autocast)
    runs: list[ToolRun | None] = [None] * len(items)
    bare: list[str] = [""] * len(items)
    def settings(i: int) -> tuple[int, int]:
        return items[i].max_new_tokens, items[i].max_rounds
    for (budget, rounds), group in groupby(sorted(range(len(items)), key=settings), key=settings):
        index = list(group)
        done = run_tools(gen, [list(items[i].messages) for i in index], tok.chat_prompt, decode, budget,
                         max_positions, rounds)
        plain = [tok.chat_prompt(without_tools(items[i].messages))[-(max_positions - budget):] for i in index]
        for i, run, new in zip(index, done, gen(plain, budget)):
            runs[i], bare[i] = run, decode(new).strip()
    verdicts, samples = [], []
    for item, run, bare_reply in zip(items, runs, bare):
        assert run is not None
        first = run.replies[0] if run.replies else Reply(None, "")
        call = first.calls[0] if first.calls else None
        ended = not (run.capped or run.overflow)
        verdict = ToolVerdict(bool(first.calls) and not first.malformed,
                              call is not None and call.name == item.call_name,
                              call is not None and same_call(call, item.call_name, item.call_arguments),
                              ended and answer_right(run.final, item.answers), answer_right(bare_reply, item.answers))
        verdicts.append(verdict)
        samples.append({"id": item.id, **({"kind": item.kind} if item.kind else {}),
                        "turns": run.messages[len(item.messages):], "capped": run.capped,
                        "overflow": run.overflow, "malformed": list(first.malformed), "bare_reply": bare_reply,
                        **vars(verdict)})
    return verdicts, samples
