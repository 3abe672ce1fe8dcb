"""The chat page (serving/static/, served at /) in a real headless browser: Debian's chromium driven by selenium
against a real server (tests/test_serve.py's `serve`: uvicorn in a thread on a free loopback port).

The browser is installed when it is missing and this process can (root with apt-get: once per session, about a
minute); otherwise the browser tests skip, or fail when POCKETLM_REQUIRE_BROWSER=1 (CI). Screenshots are written
under each test's tmp dir and copied to $POCKETLM_SCREENSHOT_DIR when it is set. The screenshot in docs/serving.md:

    python tests/test_web_chat.py [--checkpoint out/demo-sft] [--out docs/web-chat.png]
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import httpx
import pytest
import torch

from conftest import ROOT  # first: it puts the repository on sys.path (for a run as a script)

# isort: split
from test_serve import KEY, load_tok, make_run, serve, wait_until
from test_serve_tools import CALL, scripted

PACKAGES = ["chromium", "chromium-driver"]
FONTS = ["fonts-wqy-microhei"]  # a small CJK font, so that screenshots show Chinese (the tests read the DOM)
REQUIRE = "POCKETLM_REQUIRE_BROWSER"
SYSTEM = "You are PocketLM, a small helpful assistant."
ENGLISH = "Hello! What can you do?"
FOLLOW_UP = "Tell me more about that."
CHINESE = "你好，请介绍一下你自己。"
CJK = re.compile(r"[\u4e00-\u9fff]")
MAX_TOKENS = 24


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """One intra-op thread: the tiny model is faster so, and chromium needs the other core."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ------------------------------------------------------------------------------------- no browser needed
@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("web")
    # seed 3: greedy replies in both languages, always running to max_tokens (a long one to stop)
    return {"sft": make_run(base / "chat-model", "sft", 3), "pretrain": make_run(base / "text-model", "pretrain", 2)}


@pytest.fixture(scope="module")
def chat(runs):
    with serve(runs["sft"], max_batch_size=4, max_queue=8) as s:
        yield s


def test_the_page_is_served_without_a_key_and_loads_nothing_from_elsewhere(chat):
    page = httpx.get(f"{chat.url}/")  # the server has an API key: the page needs none
    assert page.status_code == 200 and page.headers["content-type"] == "text/html; charset=utf-8"
    assert "default-src 'self'" in page.headers["content-security-policy"]  # the browser enforces it
    assert '<meta charset="utf-8">' in page.text
    for name, kind in (("chat.js", "javascript"), ("chat.css", "text/css")):
        r = httpx.get(f"{chat.url}/static/{name}")
        assert r.status_code == 200 and kind in r.headers["content-type"]
    assert httpx.get(f"{chat.url}/static/missing.js").status_code == 404
    for path in (ROOT / "serving" / "static").iterdir():
        text = path.read_text(encoding="utf-8")
        assert not re.search(r"(https?:)?//[\w-]+(\.[\w-]+)+/|@import|url\(", text), path  # no remote anything
        if path.suffix == ".js":
            assert not re.search(r"\.(inner|outer)HTML\s*=|insertAdjacentHTML|document\.write", text)  # text only
    # what the page reads: the model's name and stage, with and without the key
    assert httpx.get(f"{chat.url}/health").json()["prompt_format"] == "chat"
    [card] = httpx.get(f"{chat.url}/v1/models", headers=auth()).json()["data"]
    assert (card["id"], card["prompt_format"]) == ("chat-model", "chat")


def auth(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def api_answer(s, messages: list[dict], max_tokens: int = MAX_TOKENS) -> dict:
    """The server's greedy answer, asked as the page asks (the same body, not streamed)."""
    body = {"model": s.name, "messages": messages, "temperature": 0, "top_p": 0.9, "max_tokens": max_tokens,
            "truncate": "oldest_turns"}
    r = httpx.post(f"{s.url}/v1/chat/completions", json=body, headers=auth(), timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


# ----------------------------------------------------------------------------------------- the browser
def find(*names: str) -> str | None:
    for name in names:
        path = shutil.which(name)
        if path:
            return path
    return None


def browser_paths() -> tuple[str, str] | str:
    """(chromium, chromedriver), installing them first when they are missing and this process may (root with
    apt-get); else why not."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -r requirements-dev.txt)"
    browser, driver = find("chromium", "chromium-browser"), find("chromedriver")
    if browser and driver:
        return browser, driver
    if not hasattr(os, "geteuid") or os.geteuid() != 0 or not shutil.which("apt-get"):
        return "chromium and chromedriver are not installed (as root: apt-get install -y chromium chromium-driver)"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}

    def apt(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["apt-get", *args], capture_output=True, text=True, env=env, timeout=1200)

    r = apt("install", "-y", "-qq", *PACKAGES)
    if r.returncode != 0:  # no or stale package lists: update once and retry
        apt("update", "-qq")
        r = apt("install", "-y", "-qq", *PACKAGES)
    if r.returncode != 0:
        return f"apt-get install -y {' '.join(PACKAGES)} failed: {r.stderr.strip()[-500:]}"
    apt("install", "-y", "-qq", *FONTS)  # best effort
    browser, driver = find("chromium", "chromium-browser"), find("chromedriver")
    return (browser, driver) if browser and driver else "apt-get installed chromium but it is not on PATH"


@pytest.fixture(scope="session")
def chromium() -> tuple[str, str]:
    found = browser_paths()
    if isinstance(found, str):
        if os.environ.get(REQUIRE) == "1":
            pytest.fail(f"{REQUIRE}=1 but {found}")
        pytest.skip(found)
    return found


def start_browser(paths: tuple[str, str], width: int = 1100, height: int = 760):
    """Headless chromium; the driver path is given so selenium never tries to download one (offline)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = paths[0]
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", f"--window-size={width},{height}",
                 "--lang=en-US"):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(paths[1]), options=options)


@pytest.fixture(scope="module")
def browser(chromium):
    driver = start_browser(chromium)
    yield driver
    driver.quit()


class ChatPage:
    """The page as a user works it: typing, clicking, reading what it shows."""

    def __init__(self, driver, url: str) -> None:
        self.driver, self.url = driver, url

    def open(self, key: str | None = KEY, max_tokens: int | None = MAX_TOKENS, greedy: bool = True) -> ChatPage:
        from selenium.webdriver.common.keys import Keys

        self.driver.get(self.url + "/")
        self.wait(lambda: self.js("return document.getElementById('model-name').textContent") != "…")
        if key is not None:
            self.type("api-key", key, Keys.TAB)  # leaving the field stores the key and reloads the model card
        if greedy:
            self.el("temperature").send_keys(Keys.HOME)  # the slider's minimum: 0, greedy
        if max_tokens is not None:
            self.type("max-tokens", str(max_tokens))
        if key == KEY:
            self.wait(lambda: not self.error())  # the model card read with the key (an earlier error cleared)
        return self

    def js(self, script: str, *args):
        return self.driver.execute_script(script, *args)

    def el(self, id: str):
        from selenium.webdriver.common.by import By
        return self.driver.find_element(By.ID, id)

    def type(self, id: str, *keys: str) -> None:
        self.el(id).clear()
        self.el(id).send_keys(*keys)

    def wait(self, condition, timeout: float = 20) -> None:
        from selenium.webdriver.support.ui import WebDriverWait
        WebDriverWait(self.driver, timeout, poll_frequency=0.05).until(lambda _: condition())

    def text(self, id: str) -> str:
        return self.js("return document.getElementById(arguments[0]).textContent", id)

    def messages(self) -> list[dict]:
        """What the conversation shows: role, text and stats line of each message, exactly (textContent)."""
        return self.js("""return [...document.querySelectorAll('#messages .message')].map(m => ({
            role: m.classList.contains('user') ? 'user' : 'assistant', text: m.querySelector('.text').textContent,
            stats: m.querySelector('.stats').textContent, streaming: m.classList.contains('streaming')}))""")

    def send(self, text: str, wait: bool = True) -> dict | None:
        """Type a message, press Enter, and (wait) return the finished reply."""
        from selenium.webdriver.common.keys import Keys
        before = len(self.messages())
        self.el("prompt").send_keys(text, Keys.ENTER)
        if not wait:
            return None
        self.wait(lambda: self.idle() and (len(self.messages()) >= before + 2 or self.error()))
        return self.messages()[-1] if len(self.messages()) >= before + 2 else None

    def idle(self) -> bool:
        return self.el("send").is_enabled() and not self.el("stop").is_enabled()

    def error(self) -> str:
        return "" if self.js("return document.getElementById('error').hidden") else self.text("error")

    def record_updates(self) -> None:
        """From now on, note the last reply's text at every change of the conversation."""
        self.js("""window.seen = [];
            new MutationObserver(() => {
              const t = document.querySelector('#messages .message.assistant:last-child .text');
              if (t) window.seen.push(t.textContent);
            }).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});""")

    def screenshot(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.driver.save_screenshot(str(path))
        if os.environ.get("POCKETLM_SCREENSHOT_DIR"):
            out = Path(os.environ["POCKETLM_SCREENSHOT_DIR"])
            out.mkdir(parents=True, exist_ok=True)
            shutil.copy(path, out / path.name)
        return path


@contextmanager
def slowed(engine, seconds: float) -> Iterator[None]:
    """Each decode step takes `seconds` longer: the tiny model's replies then arrive token by token, in time for
    the browser to show them growing (and for a user to press Stop)."""
    real = engine.step

    def step() -> bool:
        time.sleep(seconds)
        return real()

    engine.step = step
    try:
        yield
    finally:
        del engine.step


def health(s) -> dict:
    return httpx.get(f"{s.url}/health").json()


@pytest.mark.slow  # starts chromium
def test_a_streamed_multi_turn_conversation_is_the_apis_greedy_conversation(chat, browser, tmp_path):
    page = ChatPage(browser, chat.url).open()
    assert page.text("model-name") == "chat-model" and page.text("model-format") == "(chat)"
    assert page.js("return document.characterSet") == "UTF-8" and not page.error()
    # nothing but this server was asked for anything
    resources = page.js("return performance.getEntriesByType('resource').map(e => e.name)")
    assert resources and all(r.startswith(chat.url + "/") for r in resources)
    page.type("system", SYSTEM)

    # turn 1: the reply grows in place, then equals the server's greedy answer to the same conversation
    page.record_updates()
    with slowed(chat.engine, 0.03):
        reply = page.send(ENGLISH)
    conversation = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ENGLISH}]
    expected = api_answer(chat, conversation)
    text = expected["choices"][0]["message"]["content"]
    assert reply["text"] == text and len(text) > 10
    partial = [t for t in dict.fromkeys(page.js("return window.seen")) if t and t != text]
    assert len(partial) >= 3 and all(text.startswith(t) for t in partial)  # streamed: growing prefixes
    tokens, rate = re.fullmatch(r"(\d+) tokens · (\d+\.\d) tokens/s", reply["stats"]).groups()
    assert int(tokens) == expected["usage"]["completion_tokens"] == MAX_TOKENS and float(rate) > 0

    # turn 2 carries the history: the answer is the two-turn conversation's, not the follow-up's alone
    reply = page.send(FOLLOW_UP)
    conversation += [{"role": "assistant", "content": text}, {"role": "user", "content": FOLLOW_UP}]
    second = api_answer(chat, conversation)["choices"][0]["message"]["content"]
    alone = api_answer(chat, [{"role": "system", "content": SYSTEM},
                              {"role": "user", "content": FOLLOW_UP}])["choices"][0]["message"]["content"]
    assert reply["text"] == second != alone
    assert [m["role"] for m in page.messages()] == ["user", "assistant"] * 2

    # Chinese in, Chinese out: the DOM holds the characters themselves
    reply = page.send(CHINESE)
    conversation += [{"role": "assistant", "content": second}, {"role": "user", "content": CHINESE}]
    zh = api_answer(chat, conversation)["choices"][0]["message"]["content"]
    assert page.messages()[-2]["text"] == CHINESE and reply["text"] == zh and CJK.search(zh)
    page.screenshot(tmp_path / "web-chat-conversation.png")

    # a cleared conversation starts again: the follow-up now gets the answer it gets alone
    page.el("clear").click()
    assert page.messages() == []
    assert page.send(FOLLOW_UP)["text"] == alone
    assert page.js("return sessionStorage.getItem('pocketlm.apiKey')") == KEY  # this tab only


@pytest.mark.slow  # starts chromium
def test_stop_ends_a_long_reply_and_frees_the_servers_slot(chat, browser, tmp_path):
    page = ChatPage(browser, chat.url).open(max_tokens=200)
    assert api_answer(chat, [{"role": "user", "content": ENGLISH}], 200)["usage"]["completion_tokens"] == 200
    before = health(chat)
    with slowed(chat.engine, 0.05):  # 200 tokens: 10 s unless stopped
        page.send(ENGLISH, wait=False)
        page.wait(lambda: len(page.messages()) == 2 and len(page.messages()[-1]["text"]) > 3)
        assert health(chat)["running"] == 1 and page.el("stop").is_enabled()
        page.el("stop").click()
        wait_until(lambda: health(chat)["running"] == 0)
        page.wait(page.idle)
        shown = page.messages()[-1]
        time.sleep(0.3)
        assert page.messages()[-1] == shown and not shown["streaming"]  # no more text arrives
    after = health(chat)
    assert after["requests_cancelled"] == before["requests_cancelled"] + 1
    assert after["tokens"] - before["tokens"] < 100 and after["queued"] == 0
    assert shown["stats"].startswith("stopped after ") and not page.error()
    page.screenshot(tmp_path / "web-chat-stopped.png")
    # the stopped reply stays in the conversation; the next turn works
    page.type("max-tokens", str(MAX_TOKENS))
    assert page.send(FOLLOW_UP)["stats"].endswith("tokens/s") and len(page.messages()) == 4


@pytest.mark.slow  # starts chromium
def test_api_errors_are_shown_in_the_page(chat, browser, tmp_path):
    page = ChatPage(browser, chat.url).open(key="")
    # no key: the page still shows what it serves (/health) and says what is missing
    page.wait(lambda: "didn't provide an API key" in page.error())
    assert page.text("model-name") == "chat-model"
    page = ChatPage(browser, chat.url).open(key="wrong-key")
    page.wait(lambda: page.error() == "Incorrect API key provided.")
    assert page.send(ENGLISH) is None and page.error() == "Incorrect API key provided."
    assert page.messages() == [] and page.el("prompt").get_attribute("value") == ENGLISH  # back for another try
    page.screenshot(tmp_path / "web-chat-error.png")
    # the right key: the error goes, and a request the server refuses shows the server's own message
    page.type("api-key", KEY, "\t")
    page.wait(lambda: not page.error())
    page.type("max-tokens", "5000")
    page.el("prompt").clear()
    assert page.send(ENGLISH) is None and "leaves no room for a prompt" in page.error()


@pytest.mark.slow  # starts chromium
def test_a_pretrain_checkpoint_says_it_needs_an_sft_checkpoint(runs, browser):
    with serve(runs["pretrain"], api_key=None) as s:
        page = ChatPage(browser, s.url).open(key=None)
        page.wait(lambda: not page.js("return document.getElementById('notice').hidden"))
        assert page.text("model-name") == "text-model" and page.text("model-format") == "(text)"
        assert "needs an SFT checkpoint" in page.text("notice")
        assert not page.el("send").is_enabled() and not page.el("prompt").is_enabled()


@pytest.fixture(scope="module")
def tool_chat(tmp_path_factory):
    """A chat model with room for the bundled tools' signatures in its prompt (about 750 tokens)."""
    run = make_run(tmp_path_factory.mktemp("web-tools") / "tool-model", "sft", 3, max_position_embeddings=1024)
    with serve(run) as s:
        yield s


@pytest.mark.slow  # starts chromium
def test_tool_calls_and_thinking_are_shown_collapsed_and_the_calls_run(tool_chat, browser, tmp_path):
    page = ChatPage(browser, tool_chat.url).open()
    page.wait(lambda: not page.js("return document.getElementById('tools-setting').hidden"))
    page.el("use-tools").click()
    answer = "6 * 7 = 42. The answer is 42."
    with scripted(tool_chat, "<think>\nThe user asks for a product.\n</think>\n\n" + CALL, answer) as prompts:
        reply = page.send("What is 6 * 7?")
    assert reply is not None and reply["text"] == answer and not page.error()
    assert [m["role"] for m in page.messages()] == ["user", "assistant", "assistant"]  # the call, then the answer
    assert page.messages()[1]["text"] == ""  # the first reply only thought and called
    blocks = page.js("""return [...document.querySelectorAll('#messages details')].map(d => ({
        kind: d.className, open: d.open, summary: d.querySelector('summary').textContent,
        body: [...d.querySelectorAll('.reasoning, pre')].map(e => e.textContent)}))""")
    assert blocks == [
        {"kind": "thinking", "open": False, "summary": "Thinking", "body": ["The user asks for a product."]},
        {"kind": "tool-call", "open": False, "summary": "Tool call: calculator",
         "body": ['{"expression": "6 * 7"}', '{"result": 42}']}]
    tok = load_tok()
    first, second = (tok.decode(p) for p in prompts)
    assert "<tools>" in first and '"name": "calculator"' in first  # the bundled tools were offered
    assert CALL in second and '<tool_response>\n{"result": 42}\n</tool_response>' in second  # and answered
    page.el("messages").find_element("css selector", "details.tool-call summary").click()  # opens on a click
    assert page.js("return document.querySelector('details.tool-call').open")
    page.screenshot(tmp_path / "web-chat-tools.png")

    # the next turn sends the whole exchange again: the call and its result stay in the history
    with scripted(tool_chat, "You are welcome.") as prompts:
        assert page.send("Thanks!")["text"] == "You are welcome."
    again = tok.decode(prompts[0])
    assert CALL in again and '{"result": 42}' in again and answer in again


# ------------------------------------------------------------------------------ docs/serving.md's screenshot
def readme_screenshot(checkpoint: Path, out: Path) -> None:
    """A short English and Chinese conversation with `checkpoint` (sampled as the page's defaults sample),
    saved as a small PNG."""
    found = browser_paths()
    if isinstance(found, str):
        sys.exit(f"error: {found}")
    torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
    with serve(checkpoint, api_key=None) as s:
        driver = start_browser(found, 1000, 860)
        try:
            page = ChatPage(driver, s.url).open(key=None, max_tokens=60, greedy=False)
            for question in ("How do I get documentation on Python?", "你好，你是谁？"):
                reply = page.send(question)
                assert reply is not None, page.error()
            driver.save_screenshot(str(out))
        finally:
            driver.quit()
    from PIL import Image  # a palette of 256 colours: a UI screenshot stays sharp at a fraction of the bytes
    Image.open(out).convert("RGB").quantize(256).save(out, optimize=True)
    print(f"{out}: {out.stat().st_size // 1024} KB ({checkpoint})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=readme_screenshot.__doc__)
    parser.add_argument("--checkpoint", type=Path, default=ROOT / "out" / "demo-sft")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "web-chat.png")
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    readme_screenshot(args.checkpoint, args.out)
