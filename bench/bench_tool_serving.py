"""What reading tool calls costs the server: the same streamed chat completion (tools offered, the same prompt and
the same number of generated tokens) with the server's reply reading on, and with it replaced by a pass-through.

    python bench/bench_tool_serving.py [--checkpoint out/demo-tool-sft] [--requests 16] [--max_tokens 64]

The server runs in this process (uvicorn in a thread on a free loopback port), serving the checkpoint, or a
randomly initialised demo-shaped model when there is none (speed does not depend on what a model learned). Each
request asks for exactly --max_tokens tokens (`ignore_eos`); the two settings alternate request by request, so
drift on a shared machine falls on both. Reports the median time per request of each, their ratio, and the
reader's own cost per token (common/tool_calls.py ReplyStream over the tool-call set's replies, a token at a time).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import openai
import torch
import uvicorn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import serving.api as api  # noqa: E402
import serving.routes as routes  # noqa: E402
from bench.portable import portable  # noqa: E402
from common.config import parse_config  # noqa: E402
from common.device import cpu_description  # noqa: E402
from common.tool_calls import ReplyStream  # noqa: E402
from common.tools import tool_schemas  # noqa: E402
from dataset.tokenizer import DEFAULT_TOKENIZER_DIR, Tokenizer  # noqa: E402
from model import PocketLM, get_preset, save_model  # noqa: E402
from serving.config import ServeConfig  # noqa: E402
from serving.service import load_service  # noqa: E402


def demo_shaped_model(out: Path) -> Path:
    torch.manual_seed(0)
    config = get_preset("mini-30m", hidden_size=256, num_attention_heads=4, num_hidden_layers=4, qk_norm=True,
                        max_position_embeddings=2048)  # the demo recipe's shape
    save_model(PocketLM(config), out, tokenizer_dir=DEFAULT_TOKENIZER_DIR)
    (out / "train_info.json").write_text(json.dumps({"stage": "sft"}))
    return out


def reader_cost(tok: Tokenizer) -> float:
    """Microseconds ReplyStream spends per token on the tool-call set's assistant replies, fed a token at a time."""
    replies = []
    for line in open(ROOT / "dataset" / "demo" / "tools_sft.jsonl", encoding="utf-8"):
        record = json.loads(line)
        replies.append(tok.decode(tok.encode_chat(record["conversations"])[0]).split("<|im_start|>assistant\n")[1])
    pieces = [[tok.decode([t]) for t in tok.encode(r)] for r in replies[:300]]
    start = time.perf_counter()
    for reply in pieces:
        reader = ReplyStream()
        for piece in reply:
            reader.push(piece)
        reader.finish()
    return (time.perf_counter() - start) / sum(len(p) for p in pieces) * 1e6


class PassThrough(routes.Reading):
    """The reading replaced by nothing: every piece is content as generated."""

    def stream(self) -> ReplyStream:
        return ReplyStream(tools=False)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, default=ROOT / "out" / "demo-tool-sft")
    p.add_argument("--requests", type=int, default=16, help="requests per setting")
    p.add_argument("--max_tokens", type=int, default=64)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = args.checkpoint if args.checkpoint.exists() else demo_shaped_model(Path(tmp) / "demo-shaped")
        config = parse_config(ServeConfig, ["--checkpoint", str(checkpoint), "--device", "cpu"])
        service = load_service(config, torch.device("cpu"))
        server = uvicorn.Server(uvicorn.Config(api.create_app(service), log_level="warning"))
        sock = socket.create_server(("127.0.0.1", 0))
        threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
        while not server.started:
            time.sleep(0.02)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{sock.getsockname()[1]}/v1", api_key="none",
                               max_retries=0)
        request = dict(model=service.name, messages=[{"role": "user", "content": "What is 347 * 29?"}],
                       tools=tool_schemas(), max_tokens=args.max_tokens, temperature=0, stream=True,
                       extra_body={"ignore_eos": True})
        times: dict[str, list[float]] = {"read": [], "pass-through": []}
        real = routes.Reading  # what the chat route reads an answer with
        try:
            for i in range(2 * args.requests + 2):  # the first two warm up
                setting = ("read", "pass-through")[i % 2]
                routes.Reading = real if setting == "read" else PassThrough
                start = time.perf_counter()
                chunks = list(client.chat.completions.create(**request))
                if i >= 2:
                    times[setting].append(time.perf_counter() - start)
                assert chunks[-1].choices[0].finish_reason in ("length", "tool_calls"), chunks[-1]
        finally:
            routes.Reading = real
            server.should_exit = True
    read, plain = (statistics.median(times[k]) for k in ("read", "pass-through"))
    result = {"machine": f"{cpu_description()}, {os.cpu_count()} cores, 1 torch thread",
              "checkpoint": portable(checkpoint),
              "requests_each": args.requests, "max_tokens": args.max_tokens,
              "median_s_read": round(read, 4), "median_s_pass_through": round(plain, 4),
              "ratio": round(read / plain, 4), "reader_us_per_token": round(reader_cost(service.tokenizer), 2)}
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
