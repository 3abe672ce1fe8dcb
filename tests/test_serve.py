"""serve_openai_api.py and serving/: the batching engine against model.generate, and a real uvicorn server
driven by the official `openai` client (httpx where the client cannot express the request).

Servers run in a thread of this process on a free loopback port, so a test can hold the engine's decode loop
(`held`) to make "arrive together" and "queue full" deterministic; slow tests start the script itself.
"""
from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Iterator

import httpx
import openai
import pytest
import torch
import uvicorn

from common.config import parse_config
from dataset.tokenizer import DEFAULT_TOKENIZER_DIR
from model import PocketLM, generate, load_model, save_model
from serving.api import create_app
from serving.config import ServeConfig
from serving.engine import (
    ChoiceEnd,
    Engine,
    QueueFull,
    RequestEnd,
    RequestError,
    SamplingParams,
    TextDelta,
    TextStream,
)
from serving.service import load_service

from conftest import ROOT, cli_flags, tiny_config

KEY = "test-key"


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """One intra-op thread: for these tiny models two threads only add synchronisation (10x slower on a busy
    2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ------------------------------------------------------------------------- engine alone
def as_text(ids: list[int]) -> str:
    """A decode where every id is one character, so text and token ids convert both ways."""
    return "".join(chr(0x100 + i) for i in ids)


def as_ids(text: str) -> list[int]:
    return [ord(c) - 0x100 for c in text]


def run_engine(engine: Engine, arrivals: dict[int, list[tuple[list[int], SamplingParams]]], n: int = 1
               ) -> list[list]:
    """Submit each request at its step (arrivals: step -> requests), step until all are done; events per request."""
    events: list[list] = []
    step = 0
    while step <= max(arrivals) or engine.step():
        for prompt, params in arrivals.get(step, []):
            events.append([])
            engine.submit(prompt, params, n, events[-1].append)
        step += 1
    return events


def tokens_of(events: list, index: int = 0) -> list[int]:
    return as_ids("".join(e.text for e in events if isinstance(e, TextDelta) and e.index == index))


@pytest.mark.parametrize("style", ["llama", "gpt2", "moe"])
def test_batched_greedy_decoding_equals_generate_alone(style):
    """Requests admitted at different steps, of different lengths, some ending at a stop id: each decodes exactly
    as model.generate decodes it alone, through cache growth, right shifts (a longer prompt arriving) and
    compaction (max_model_len reached)."""
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32) if style == "moe" else {}
    model = PocketLM(tiny_config("gpt2" if style == "gpt2" else "llama", initializer_range=0.3, **moe)).eval()
    engine = Engine(model, as_text, pad_id=0, max_batch_size=4, max_queue=16, max_model_len=80, first_cache_len=8)
    rng = random.Random(0)
    arrivals: dict[int, list] = {}
    for step in (0, 0, 1, 3, 3, 7, 12, 20, 20, 33):
        p = rng.randint(1, 40)
        prompt = [rng.randint(1, 255) for _ in range(p)]
        arrivals.setdefault(step, []).append((prompt, SamplingParams(max_tokens=80 - p, temperature=0,
                                                                     stop_ids=(7,))))
    events = run_engine(engine, arrivals)
    for (prompt, params), ev in zip([r for s in sorted(arrivals) for r in arrivals[s]], events):
        expected = generate(model, [prompt], max_new_tokens=params.max_tokens, temperature=0, eos_token_ids=[7])[0]
        assert tokens_of(ev) == expected
        [end] = [e for e in ev if isinstance(e, ChoiceEnd)]
        assert end.finish_reason == ("length" if len(expected) == params.max_tokens else "stop")
        assert ev[-1] == RequestEnd(len(prompt), end.tokens)
    s = engine.stats
    assert s.batched_steps > 0 and s.max_batch == 4 and s.compactions > 0 and s.cache_len == 80
    assert engine.snapshot()["running"] == 0 and s.requests_done == 10


def test_seeded_sampling_is_the_same_alone_and_batched():
    model = PocketLM(tiny_config(initializer_range=0.3)).eval()
    prompt = list(range(10, 30))
    params = SamplingParams(max_tokens=40, temperature=0.9, top_k=50, top_p=0.9, repetition_penalty=1.2, seed=7)
    alone = tokens_of(run_engine(Engine(model, as_text, 0), {0: [(prompt, params)]})[0])
    # model.generate with the same settings and a generator seeded the same way draws the same tokens
    g = torch.Generator().manual_seed(7)
    assert alone == generate(model, [prompt], max_new_tokens=40, temperature=0.9, top_k=50, top_p=0.9,
                             repetition_penalty=1.2, generator=g)[0]
    others = SamplingParams(max_tokens=30, temperature=1.0)  # unseeded neighbours, arriving before and after
    events = run_engine(Engine(model, as_text, 0), {0: [([5, 6, 7], others)], 2: [(prompt, params)],
                                                    4: [(list(range(50)), others)]})
    assert tokens_of(events[1]) == alone
    # n choices: choice i is seeded with seed + i
    [both] = run_engine(Engine(model, as_text, 0), {0: [(prompt, params)]}, n=2)
    assert tokens_of(both, 0) == alone and tokens_of(both, 1) != alone
    [seed_8] = run_engine(Engine(model, as_text, 0), {0: [(prompt, dataclasses.replace(params, seed=8))]})
    assert tokens_of(both, 1) == tokens_of(seed_8)


def test_text_stream_cuts_at_stop_strings_and_holds_back_their_beginnings():
    ts = TextStream(lambda ids: "".join(map(chr, ids)), ["END", "xy"])
    out = [ts.push(ord(c)) for c in "abE"]
    assert out == [("a", False), ("b", False), ("", False)]  # "E" may start "END"
    assert ts.push(ord("N")) == ("", False) and ts.push(ord("x")) == ("EN", False)  # "ENx" is not "END"
    assert ts.push(ord("y")) == ("", True) and ts.text == "abEN"  # "xy" cut, with what followed
    ts = TextStream(lambda ids: "".join(map(chr, ids)), ["END"])
    assert [ts.push(ord(c)) for c in "EN"] == [("", False), ("", False)]
    assert ts.finish() == ("EN", False)  # the end releases a beginning that never completed
    # multi-byte characters: nothing released until complete (StreamDecoder)
    ts = TextStream(lambda ids: bytes(ids).decode("utf-8", "replace"), [])
    assert [ts.push(b) for b in "é".encode()] == [("", False), ("é", False)]


def test_engine_cancel_queue_limits_and_bad_requests():
    model = PocketLM(tiny_config()).eval()
    engine = Engine(model, as_text, 0, max_batch_size=2, max_queue=1, max_model_len=64)
    long = SamplingParams(max_tokens=50, temperature=0)
    seen: list = []
    first = engine.submit([1, 2, 3], long, 2, seen.append)
    engine.step()  # takes both rows
    engine.submit([4], long)  # waits
    with pytest.raises(QueueFull):
        engine.submit([5], long)
    assert engine.snapshot()["running"] == 2 and engine.snapshot()["queued"] == 1
    engine.cancel(first)
    engine.step()
    events_at_cancel = len(seen)
    assert engine.snapshot()["running"] == 1 and engine.stats.requests_cancelled == 1  # the waiting one started
    while engine.step():
        pass
    assert len(seen) == events_at_cancel  # nothing more reaches a cancelled request
    # a request whose sampling breaks (NaN probabilities) fails alone; its neighbour in the batch goes on
    broken, fine = [], []
    other = Engine(model, as_text, 0, max_batch_size=4)
    other.submit([1, 2], SamplingParams(max_tokens=5, temperature=1e-300), 2, broken.append)
    other.submit([3, 4], SamplingParams(max_tokens=5, temperature=0), 1, fine.append)
    while other.step():
        pass
    assert [type(e) for e in broken] == [RequestError] and "sampling failed" in broken[0].message
    assert isinstance(fine[-1], RequestEnd) and other.stats.requests_failed == 1
    assert other.snapshot()["running"] == 0
    for prompt, params, n in (([], long, 1), ([1], long, 3), ([1], SamplingParams(max_tokens=64), 1),
                              ([10 ** 6], long, 1), ([1], SamplingParams(top_p=0), 1)):
        with pytest.raises(ValueError):
            engine.submit(prompt, params, n)


# ----------------------------------------------------------------------- real servers
def make_run(root: Path, stage: str, seed: int, **config) -> Path:
    """A model directory as training leaves it: tiny vocab-6400 model (a large init makes greedy text vary),
    the default tokenizer and train_info.json with its stage."""
    torch.manual_seed(seed)
    model = PocketLM(tiny_config(vocab_size=6400, initializer_range=0.3, **config))
    save_model(model, root, tokenizer_dir=DEFAULT_TOKENIZER_DIR)
    (root / "train_info.json").write_text(json.dumps({"stage": stage}))
    return root


@contextmanager
def serve(run: Path, api_key: str | None = KEY, **settings) -> Iterator[SimpleNamespace]:
    """uvicorn serving `run` from a thread of this process on a free loopback port."""
    config = parse_config(ServeConfig, cli_flags({"checkpoint": run, "device": "cpu", "dtype": "float32",
                                                  **settings}))
    service = load_service(config, torch.device("cpu"))
    app = create_app(service, api_key=api_key, max_body_bytes=config.server.max_body_bytes)
    sock = socket.create_server(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 20
    while not server.started and time.time() < deadline:
        time.sleep(0.02)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        yield SimpleNamespace(url=url, engine=service.engine, name=service.name,
                              client=openai.OpenAI(base_url=f"{url}/v1", api_key=api_key or "none", max_retries=0))
    finally:
        server.should_exit = True
        thread.join(20)
        sock.close()


@contextmanager
def held(engine: Engine) -> Iterator[threading.Event]:
    """Hold the engine's decode loop before its next step until the yielded event is set (or the block ends):
    requests sent meanwhile wait together."""
    gate, real = threading.Event(), engine.step

    def step() -> bool:
        gate.wait()
        return real()

    engine.step = step
    try:
        yield gate
    finally:
        gate.set()
        del engine.step


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("serve")
    return {"sft": make_run(base / "chat-model", "sft", 1), "pretrain": make_run(base / "text-model", "pretrain", 2)}


@pytest.fixture(scope="module")
def chat(runs):
    with serve(runs["sft"], max_batch_size=4, max_queue=8, max_body_bytes=4096) as s:
        yield s


@pytest.fixture(scope="module")
def text(runs):
    with serve(runs["pretrain"], api_key=None) as s:
        yield s


HI = [{"role": "user", "content": "Hello, who are you?"}]


def health(s) -> dict:
    return httpx.get(f"{s.url}/health").json()


def test_models_and_health(chat):
    assert chat.name == "chat-model"
    [card] = chat.client.models.list().data
    assert (card.id, card.object, card.owned_by) == ("chat-model", "model", "pocketlm")
    assert chat.client.models.retrieve("chat-model").id == "chat-model"
    with pytest.raises(openai.NotFoundError):
        chat.client.models.retrieve("gpt-4")
    h = health(chat)  # no key needed
    assert h["status"] == "ok" and h["prompt_format"] == "chat" and h["max_batch_size"] == 4


def test_chat_completion_and_its_stream_agree(chat):
    kw = dict(model="chat-model", messages=HI, max_tokens=12, temperature=0.8, seed=3)
    r = chat.client.chat.completions.create(**kw)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion" and r.model == "chat-model"
    assert abs(r.created - time.time()) < 60
    [c] = r.choices
    assert c.index == 0 and c.message.role == "assistant" and c.finish_reason in ("stop", "length")
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens == len(load_tok().chat_prompt(HI))
    assert chat.client.chat.completions.create(**kw).choices[0].message.content == c.message.content  # seeded

    chunks = list(chat.client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert len({ch.id for ch in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == c.message.content
    assert chunks[-2].choices[0].finish_reason == c.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == r.usage.model_dump()
    assert all(ch.usage is None for ch in chunks[:-1])
    # on the wire: server-sent events ending with [DONE]; no usage chunk unless asked for
    raw = httpx.post(f"{chat.url}/v1/chat/completions", json={**kw, "stream": True},
                     headers={"Authorization": f"Bearer {KEY}"})
    assert raw.headers["content-type"].startswith("text/event-stream")
    events = raw.text.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""] and all(e.startswith("data: ") for e in events[:-1])
    assert all("usage" not in json.loads(e[6:]) for e in events[:-2])


def load_tok():
    from dataset.tokenizer import Tokenizer
    return Tokenizer(DEFAULT_TOKENIZER_DIR)


def test_n_choices_stop_strings_and_extensions(chat):
    r = chat.client.chat.completions.create(model="chat-model", messages=HI, max_tokens=10, n=3, seed=1,
                                            temperature=1.0)
    assert [c.index for c in r.choices] == [0, 1, 2] and len({c.message.content for c in r.choices}) > 1
    assert r.usage.prompt_tokens == len(load_tok().chat_prompt(HI)) and 3 <= r.usage.completion_tokens <= 30
    greedy = dict(model="chat-model", messages=HI, max_tokens=20, temperature=0,
                  extra_body={"ignore_eos": True, "top_k": 5, "repetition_penalty": 1.3})
    full = chat.client.chat.completions.create(**greedy).choices[0]
    assert full.finish_reason == "length" and len(full.message.content) > 6
    stop = full.message.content[4:7]
    cut = chat.client.chat.completions.create(**greedy, stop=[stop, "never"]).choices[0]
    text = full.message.content
    assert cut.finish_reason == "stop" and cut.message.content == text[:text.index(stop)]
    streamed = chat.client.chat.completions.create(**greedy, stop=stop, stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in streamed) == cut.message.content


def test_text_completions(text):
    c = text.client
    r = c.completions.create(model="text-model", prompt="Once upon a time", max_tokens=8, temperature=0)
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.usage.completion_tokens <= 8
    [choice] = r.choices
    ids = load_tok().encode("Once upon a time")
    assert r.usage.prompt_tokens == len(ids)
    by_ids = c.completions.create(model="text-model", prompt=ids, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == choice.text
    stream = list(c.completions.create(model="text-model", prompt="Once upon a time", max_tokens=8, temperature=0,
                                       stream=True, stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in stream if ch.choices) == choice.text
    assert stream[-2].choices[0].finish_reason == choice.finish_reason and stream[-1].usage.prompt_tokens == len(ids)
    two = c.completions.create(model="text-model", prompt=["Once upon a time", "床前明月光"], max_tokens=6, n=2,
                               temperature=0)
    assert [ch.index for ch in two.choices] == [0, 1, 2, 3] and two.choices[0].text == two.choices[1].text
    assert two.choices[0].text == c.completions.create(model="text-model", prompt="Once upon a time", max_tokens=6,
                                                        temperature=0).choices[0].text
    long = "word " * 300
    with pytest.raises(openai.BadRequestError, match="maximum context length is 256"):
        c.completions.create(model="text-model", prompt=long, max_tokens=8)
    kept = c.completions.create(model="text-model", prompt=long, max_tokens=8, extra_body={"truncate": "oldest_tokens"})
    assert kept.usage.prompt_tokens == 256 - 8


def test_rope_scaling_serves_the_scaled_model_over_its_context(runs):
    """--rope_scaling linear:2: the served model is the scaled one, its context twice the training context (64),
    and a prompt past the training context continues as the scaled model continues it."""
    with serve(runs["pretrain"], api_key=None, rope_scaling="linear:2") as s:
        assert s.engine.model.config.rope_scaling == {"rope_type": "linear", "factor": 2.0}
        assert s.engine.max_model_len == 128
        prompt = load_tok().encode("Once upon a time, " * 40)[:100]
        assert len(prompt) == 100
        r = s.client.completions.create(model="text-model", prompt=prompt, max_tokens=20, temperature=0)
        scaled, _ = load_model(runs["pretrain"], rope_scaling={"rope_type": "linear", "factor": 2.0})
        tok = load_tok()
        new = generate(scaled, [prompt], max_new_tokens=20, temperature=0, eos_token_ids=tok.stop_ids(chat=False),
                       pad_token_id=tok.pad_id)[0]
        assert r.choices[0].text == tok.decode(new).rstrip("\ufffd")  # an unfinished character is held back
        with pytest.raises(openai.BadRequestError, match="maximum context length is 128"):
            s.client.completions.create(model="text-model", prompt=prompt + prompt, max_tokens=8)


def test_errors_are_openai_errors(chat, text):
    c = chat.client
    ok = dict(model="chat-model", messages=HI, max_tokens=4)
    cases = [
        (openai.NotFoundError, "does not exist", dict(model="gpt-4o")),
        (openai.BadRequestError, "at least 1 item", dict(messages=[])),
        (openai.BadRequestError, "unknown role 'robot'", dict(messages=[{"role": "robot", "content": "hi"}])),
        (openai.BadRequestError, "content is required", dict(messages=[{"role": "user"}])),
        (openai.BadRequestError, "content must be", dict(messages=[{"role": "user", "content": 5}])),
        (openai.BadRequestError, "max_tokens", dict(max_tokens=0)),
        (openai.BadRequestError, "no room for a prompt", dict(max_tokens=10_000)),
        (openai.BadRequestError, "maximum context length", dict(messages=[{"role": "user", "content": "hi " * 300}])),
        (openai.BadRequestError, "n: at most 4", dict(n=5)),
        (openai.BadRequestError, "presence_penalty", dict(presence_penalty=0.5)),
        (openai.BadRequestError, "stop takes at most 4", dict(stop=list("abcde"))),
        (openai.BadRequestError, "temperature", dict(temperature=3)),
    ]
    for error, message, change in cases:
        with pytest.raises(error, match=message) as e:
            c.chat.completions.create(**{**ok, **change})
        assert set(e.value.body) == {"message", "type", "param", "code"}
    with pytest.raises(openai.BadRequestError, match="use /v1/completions") as e:
        text.client.chat.completions.create(model="text-model", messages=HI)
    assert e.value.body["code"] == "wrong_endpoint"
    with pytest.raises(openai.BadRequestError, match="/v1/chat/completions"):
        c.completions.create(model="chat-model", prompt="hi")
    with pytest.raises(openai.AuthenticationError, match="Incorrect API key"):
        openai.OpenAI(base_url=f"{chat.url}/v1", api_key="wrong", max_retries=0).chat.completions.create(**ok)
    # what the client cannot send: broken JSON, a body that is not an object, an oversized body, a bad route
    auth = {"Authorization": f"Bearer {KEY}"}
    for body, status, code in ((b'{"model": ', 400, "invalid_json"), (b"[1, 2]", 400, "invalid_json"),
                               (json.dumps({**ok, "pad": "x" * 5000}).encode(), 413, "request_too_large")):
        r = httpx.post(f"{chat.url}/v1/chat/completions", content=body, headers=auth)
        assert r.status_code == status and r.json()["error"]["code"] == code
    r = httpx.get(f"{chat.url}/v1/engines", headers=auth)
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.post(f"{chat.url}/v1/chat/completions", json=ok)  # no key
    assert r.status_code == 401 and "didn't provide an API key" in r.json()["error"]["message"]


def test_truncate_drops_the_oldest_turns(chat):
    history = [{"role": "system", "content": "Be brief."}]
    for i in range(12):
        history += [{"role": "user", "content": f"question {i} " * 8}, {"role": "assistant", "content": "ok " * 6}]
    history.append({"role": "user", "content": "last question"})
    with pytest.raises(openai.BadRequestError, match="oldest_turns"):
        chat.client.chat.completions.create(model="chat-model", messages=history, max_tokens=50)
    r = chat.client.chat.completions.create(model="chat-model", messages=history, max_tokens=50,
                                            extra_body={"truncate": "oldest_turns"})
    assert 100 < r.usage.prompt_tokens <= 256 - 50


def test_requests_arriving_together_are_decoded_together_and_as_alone(chat):
    prompts = [[{"role": "user", "content": q}] for q in ("one", "a longer second question", "3", "four four")]
    kw = dict(model="chat-model", max_tokens=16, temperature=0.9, seed=11, extra_body={"ignore_eos": True})
    alone = [chat.client.chat.completions.create(messages=m, **kw).choices[0].message.content for m in prompts]
    before = health(chat)["batched_steps"]
    results: dict[int, str] = {}
    with held(chat.engine) as gate:
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(
            i, chat.client.chat.completions.create(messages=prompts[i], **kw).choices[0].message.content))
                   for i in range(4)]
        for t in threads:
            t.start()
        wait_until(lambda: health(chat)["queued"] == 4)
        gate.set()
        for t in threads:
            t.join(30)
    assert [results[i] for i in range(4)] == alone  # seeded: the same text batched as alone
    h = health(chat)
    assert h["max_batch"] == 4 and h["batched_steps"] >= before + 15 and h["running"] == 0


def test_queue_full_is_503_with_retry_after(runs):
    with serve(runs["sft"], max_batch_size=1, max_queue=1) as s, held(s.engine) as gate:
        waiting = threading.Thread(target=lambda: s.client.chat.completions.create(model="chat-model", messages=HI,
                                                                                   max_tokens=4))
        waiting.start()
        wait_until(lambda: health(s)["queued"] == 1)
        r = httpx.post(f"{s.url}/v1/chat/completions", json={"model": "chat-model", "messages": HI},
                       headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 503 and r.headers["Retry-After"] == "1" and r.json()["error"]["code"] == "server_busy"
        with pytest.raises(openai.InternalServerError) as e:
            s.client.chat.completions.create(model="chat-model", messages=HI)
        assert e.value.status_code == 503
        gate.set()
        waiting.join(30)
        assert health(s)["requests_done"] == 1


def test_a_client_that_disconnects_frees_its_slot(chat):
    real = chat.engine.step

    def slow_step() -> bool:  # ~250 tokens at 20 ms: seconds of work the disconnect must cut short
        time.sleep(0.02)
        return real()

    chat.engine.step = slow_step
    try:
        before = health(chat)
        body = {"model": "chat-model", "messages": HI, "max_tokens": 200, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{chat.url}/v1/chat/completions", json=body,
                          headers={"Authorization": f"Bearer {KEY}"}) as r:
            data = (line for line in r.iter_lines() if line.startswith("data: "))
            next(data), next(data)  # the role, then the first text: the request is decoding
            assert health(chat)["running"] == 1
        wait_until(lambda: health(chat)["running"] == 0)
        after = health(chat)
        assert after["requests_cancelled"] == before["requests_cancelled"] + 1
        assert after["tokens"] - before["tokens"] < 100
        # a non-streamed request whose client gives up is cancelled too
        with pytest.raises(openai.APITimeoutError):
            chat.client.with_options(timeout=0.5).chat.completions.create(
                model="chat-model", messages=HI, max_tokens=200, extra_body={"ignore_eos": True})
        wait_until(lambda: health(chat)["requests_cancelled"] == after["requests_cancelled"] + 1)
        assert health(chat)["running"] == 0
    finally:
        del chat.engine.step


def wait_until(condition, timeout: float = 10.0) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, "timed out"
        time.sleep(0.02)


@pytest.mark.slow  # starts a process
@pytest.mark.parametrize("sigint", [signal.SIG_DFL, signal.SIG_IGN], ids=["foreground", "background-job"])
def test_the_script_serves_a_trained_sft_run(sft_run, sigint):
    """serve_openai_api.py on a real (tiny, trained) SFT run: a free port, a chat answer, a clean exit.

    The server starts with the SIGINT disposition given here, not with this process's: a shell starts background
    jobs with SIGINT ignored (`nohup make test &`, `serve_openai_api.py &` in a script), children inherit that, and
    Ctrl-C must end the server as 130 either way."""
    proc = subprocess.Popen([sys.executable, "serve_openai_api.py", "--checkpoint", str(sft_run), "--port", "0",
                             "--log_level", "warning"], cwd=ROOT, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, sigint))
    try:
        lines = []
        while not (port := re.search(r"http://127\.0\.0\.1:(\d+)/v1/chat/completions", lines[-1] if lines else "")):
            lines.append(proc.stderr.readline())
            assert lines[-1], "".join(lines)  # the process ended before serving
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port[1]}/v1", api_key="none", max_retries=3)
        r = client.chat.completions.create(model="sft", messages=HI, max_tokens=8)
        assert r.choices[0].finish_reason in ("stop", "length") and r.usage.prompt_tokens > 5
    finally:
        proc.send_signal(signal.SIGINT)  # Ctrl-C: a graceful shutdown
        assert proc.wait(30) == 130
    assert "Traceback" not in proc.stderr.read()


@pytest.mark.slow  # starts a process
def test_the_script_refuses_a_missing_checkpoint_in_one_line(tmp_path):
    bad = subprocess.run([sys.executable, "serve_openai_api.py", "--checkpoint", str(tmp_path / "missing")],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.startswith("error: ") and "Traceback" not in bad.stderr


@pytest.mark.slow  # starts a process
def test_bench_serve_writes_its_numbers(tmp_path):
    import importlib.util
    spec = importlib.util.spec_from_file_location("bench_serve", ROOT / "bench" / "bench_serve.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "serve.json"
    bench.main(["--preset", "tiny", "--hidden_size", "64", "--num_hidden_layers", "2", "--clients", "3",
                "--max_tokens", "4", "--prompt_len", "5", "--repeats", "1", "--threads", "1", "--timeout", "120",
                "--out", str(out)])
    r = json.loads(out.read_text())
    assert r["errors"] == 0 and r["endpoint"] == "completions" and r["speedup"] > 0
    for phase in ("sequential", "concurrent"):
        assert r[phase]["tokens"] == 12 and r[phase]["tokens_per_s"] > 0 and r[phase]["ttft_ms_p95"] > 0
    assert r["engine"]["max_batch"] >= 2 and r["engine_only"]["batched_tokens_per_s"] > 0
