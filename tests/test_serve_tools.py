"""Tool calls and reasoning through the real server, driven by the official `openai` client: `tools` and
`tool_choice` in, `tool_calls` / `reasoning_content` out (whole and streamed, finish_reason "tool_calls"), the
client's tool loop sending `tool` results back, and malformed calls returned as text.

The model's words are chosen by the test: `scripted` makes the engine's text come from given replies, a piece per
generated token, whatever tokens the tiny model samples. Everything else (HTTP, the chat template with tools,
prompt encoding, the engine's decode loop, streaming, the reading of the reply) is the server's own code.
"""
from __future__ import annotations

import dataclasses
import json
import random
from contextlib import contextmanager
from typing import Iterator

import openai
import pytest
from test_serve import _one_thread, make_run, serve  # noqa: F401  (the fixture: one intra-op thread)

from common.tool_calls import ReplyStream, ToolCall, parse_reply
from common.tools import run_tool, tool_schemas
from dataset.tokenizer import DEFAULT_TOKENIZER_DIR, Tokenizer

TOOLS = tool_schemas(["calculator", "lookup_element"])
ASK = [{"role": "user", "content": "What is 6 * 7?"}]
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6 * 7"}}\n</tool_call>'


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    run = make_run(tmp_path_factory.mktemp("serve-tools") / "tool-model", "sft", 3, max_position_embeddings=1024)
    with serve(run) as s:
        yield s


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(DEFAULT_TOKENIZER_DIR)


def pieces(text: str) -> list[str]:
    """The reply cut where a marker may be split across tokens: 1-4 characters a piece (seeded)."""
    rng, out, i = random.Random(len(text)), [], 0
    while i < len(text):
        k = rng.randint(1, 4)
        out.append(text[i:i + k])
        i += k
    return out


@contextmanager
def scripted(server, *replies: str) -> Iterator[list[list[int]]]:
    """The next requests' text: `replies` in order (one per request), a piece per generated token, each request
    running exactly as many tokens as its reply has pieces (its max_tokens and stop ids overridden); yields the
    prompts the engine was given."""
    engine = server.engine
    queue: list[str] = []
    script = list(replies)
    prompts: list[list[int]] = []
    real_decode, real_submit = engine.decode, engine.submit

    def decode(ids: list[int]) -> str:
        return queue.pop(0) if queue else ""

    def submit(ids, params, n, deliver):
        prompts.append(list(ids))
        queue[:] = pieces(script.pop(0))
        params = dataclasses.replace(params, max_tokens=len(queue), stop_ids=(), stop=())
        return real_submit(ids, params, n, deliver)

    engine.decode, engine.submit = decode, submit
    try:
        yield prompts
    finally:
        engine.decode, engine.submit = real_decode, real_submit


def ask(server, reply: str, messages=ASK, stream: bool = False, **kw):
    """One chat completion whose model text is `reply` (it ends by length: no stop id is generated)."""
    args = dict(model="tool-model", messages=messages, max_tokens=64, temperature=0, **kw)
    with scripted(server, reply) as prompts:
        out = server.client.chat.completions.create(**args, stream=stream)
        out = list(out) if stream else out
    return out, prompts[0]


def streamed(chunks) -> dict:
    """What a client assembles from a stream: content, reasoning, tool calls by index, the finish reason."""
    content, reasoning, calls, finish = "", "", {}, None
    for ch in chunks:
        if not ch.choices:
            continue
        choice = ch.choices[0]
        delta = choice.delta
        content += delta.content or ""
        reasoning += getattr(delta, "reasoning_content", None) or (delta.model_extra or {}).get(
            "reasoning_content") or ""
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"id": call.id, "name": "", "arguments": ""})
            entry["name"] += call.function.name or ""
            entry["arguments"] += call.function.arguments or ""
        finish = choice.finish_reason or finish
    return {"content": content, "reasoning": reasoning, "calls": [calls[i] for i in sorted(calls)], "finish": finish}


def test_the_openai_tool_loop_round_trip(server, tok):
    first, prompt = ask(server, CALL, tools=TOOLS)
    assert prompt == tok.chat_prompt(ASK, tools=TOOLS)  # the tools reach the model through the template
    [choice] = first.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "calculator"
    assert json.loads(call.function.arguments) == {"expression": "6 * 7"}

    # the client's loop: the assistant's message as returned, then the tool's result for its call id
    result = run_tool(ToolCall(call.function.name, json.loads(call.function.arguments)))
    messages = ASK + [choice.message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id, "content": result}]
    answer = "6 * 7 = 42. The answer is 42."
    second, prompt = ask(server, answer, messages=messages, tools=TOOLS)
    assert second.choices[0].message.content == answer and not second.choices[0].message.tool_calls
    assert second.choices[0].finish_reason == "length"  # the script ran to its end: no stop id
    expected = ASK + [{"role": "assistant", "content": "", "tool_calls": [
        {"name": "calculator", "arguments": {"expression": "6 * 7"}}]}, {"role": "tool", "content": result}]
    assert prompt == tok.chat_prompt(expected, tools=TOOLS)  # the call and its result, rendered as trained
    text = tok.decode(prompt)
    assert CALL in text and '<tool_response>\n{"result": 42}\n</tool_response>' in text


@pytest.mark.parametrize("reply", [
    "<think>\nThe user wants a product.\n</think>\n\nLet me compute that.\n" + CALL,
    CALL + "\n" + CALL.replace("6 * 7", "2 + 2"),
    "<think>\n\n</think>\n\nIron has atomic number 26.",
])
def test_streamed_reply_reads_as_the_whole(server, reply):
    whole, _ = ask(server, reply, tools=TOOLS)
    chunks, _ = ask(server, reply, tools=TOOLS, stream=True)
    got = streamed(chunks)
    message = whole.choices[0].message
    reasoning = (message.model_extra or {}).get("reasoning_content")
    assert got["content"] == (message.content or "")
    assert got["reasoning"] == (reasoning or "")
    assert [(c["name"], json.loads(c["arguments"])) for c in got["calls"]] == [
        (c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]
    assert got["finish"] == whole.choices[0].finish_reason
    expected = parse_reply(reply)
    assert (reasoning, message.content or "") == (expected.reasoning, expected.content)
    assert len(got["calls"]) == len(expected.calls)
    if expected.calls:
        assert got["finish"] == "tool_calls" and len({c["id"] for c in got["calls"]}) == len(got["calls"])


@pytest.mark.parametrize("broken", [
    '<tool_call>\n{"name": "calculator", "arguments": {expression: 6 * 7}}\n</tool_call>',
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6 *',
])
def test_malformed_calls_come_back_as_text(server, broken):
    whole, _ = ask(server, broken, tools=TOOLS)
    message = whole.choices[0].message
    assert not message.tool_calls and message.content == broken.strip()
    assert whole.choices[0].finish_reason == "length"
    got = streamed(ask(server, broken, tools=TOOLS, stream=True)[0])
    assert got["calls"] == [] and got["content"] == broken.strip() and got["finish"] == "length"


def test_tool_choice_none_required_and_named(server, tok):
    none, prompt = ask(server, CALL, tools=TOOLS, tool_choice="none")
    assert prompt == tok.chat_prompt(ASK) and "<tools>" not in tok.decode(prompt)
    assert none.choices[0].message.content == CALL and not none.choices[0].message.tool_calls  # text, not run

    rest = '{"name": "calculator", "arguments": {"expression": "6 * 7"}}\n</tool_call>'
    required, prompt = ask(server, rest, tools=TOOLS, tool_choice="required")
    assert prompt == tok.chat_prompt(ASK, tools=TOOLS, prefill="<tool_call>\n")
    assert required.choices[0].message.tool_calls[0].function.name == "calculator"

    named = {"type": "function", "function": {"name": "lookup_element"}}
    args = '{"name": "iron"}}\n</tool_call>'
    forced, prompt = ask(server, args, tools=TOOLS, tool_choice=named)
    assert tok.decode(prompt).endswith('<tool_call>\n{"name": "lookup_element", "arguments": ')
    [call] = forced.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("lookup_element", {"name": "iron"})
    got = streamed(ask(server, args, tools=TOOLS, tool_choice=named, stream=True)[0])
    assert [c["name"] for c in got["calls"]] == ["lookup_element"] and got["finish"] == "tool_calls"


def test_thinking_switch_and_a_plain_answer_without_tools(server, tok):
    reply, prompt = ask(server, "The user greets me.\n</think>\n\nHello!", extra_body={"enable_thinking": True})
    assert prompt == tok.chat_prompt(ASK, enable_thinking=True)
    message = reply.choices[0].message
    assert (message.model_extra["reasoning_content"], message.content) == ("The user greets me.", "Hello!")
    closed, prompt = ask(server, "Hello!", extra_body={"enable_thinking": False})
    assert tok.decode(prompt).endswith("<think>\n\n</think>\n\n") and closed.choices[0].message.content == "Hello!"
    plain = "  <tool_call> is just text here \n"
    out, _ = ask(server, plain)  # no tools offered, no thinking: the text exactly as generated
    assert out.choices[0].message.content == plain and "reasoning_content" not in (out.choices[0].message.model_extra
                                                                                  or {})


@pytest.mark.parametrize("change, message", [
    (dict(tools=[{"type": "function", "function": {"description": "no name"}}]), "each tool must be"),
    (dict(tools=[{"type": "retrieval"}]), "each tool must be"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "rm"}}), "naming one of the tools"),
    (dict(tool_choice="required"), "no tools are given"),
    (dict(tools=TOOLS, tool_choice="sometimes"), "tool_choice must be"),
    (dict(messages=[{"role": "user", "content": "hi", "tool_calls": [{"type": "function", "function": {
        "name": "calculator", "arguments": "{}"}}]}]), "only an assistant message"),
    (dict(messages=ASK + [{"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {
        "name": "calculator", "arguments": "{not json"}}]}]), "arguments must be a JSON object"),
])
def test_bad_tool_requests_are_400(server, change, message):
    with pytest.raises(openai.BadRequestError, match=message):
        server.client.chat.completions.create(**{"model": "tool-model", "messages": ASK, "max_tokens": 4, **change})


def test_stream_reader_holds_partial_markers_only():
    reader = ReplyStream()
    assert reader.push("Let me <tool") == [("content", "Let me")]  # " <tool" may open a call: held
    assert reader.push("box> is not a call") == [("content", " <toolbox> is not a call")]
    assert reader.finish() == []
