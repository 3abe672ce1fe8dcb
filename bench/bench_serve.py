"""Serving benchmark: N concurrent streaming clients against a real server, versus the same requests one by one.

    python bench/bench_serve.py [--checkpoint out/<run>] [--preset minimind-26m --hidden_size 256 ...]
                                [--clients 8] [--max_tokens 64] [--prompt_len 32] [--out F.json]

Starts serve_openai_api.py on a free loopback port (a checkpoint, or a randomly initialised model of the given
shape saved to a temporary directory: speed does not depend on what a model learned), then sends `--clients`
streaming requests with the official `openai` AsyncOpenAI client, first one after another, then all at once.
Every request asks for exactly --max_tokens tokens (`ignore_eos`), so both phases do the same work. Reports
each phase's aggregate tokens/s (the fastest of --repeats rounds) and the speed-up, and p50/p95 time to first
token and time per output token (a request's decode time over its tokens after the first). Any failed request
fails the benchmark. Bounded: --timeout seconds for the whole run.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.portable import portable  # noqa: E402
from dataset.tokenizer import DEFAULT_TOKENIZER_DIR  # noqa: E402
from model import ModelConfig, PocketLM, get_preset, save_model  # noqa: E402
from model.inference import read_train_info  # noqa: E402
from model.loading import resolve_model_dir  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation; values need not be sorted."""
    s = sorted(values)
    if len(s) == 1:
        return s[0]
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (pos - lo)


def random_model_dir(out: Path, preset: str, overrides: dict) -> Path:
    """A randomly initialised model of the preset's shape (with overrides), saved with the default tokenizer."""
    torch.manual_seed(0)
    model = PocketLM(get_preset(preset, **{k: v for k, v in overrides.items() if v is not None}))
    return save_model(model, out, tokenizer_dir=DEFAULT_TOKENIZER_DIR)


def start_server(checkpoint: Path, max_batch_size: int, threads: int | None, timeout: float
                 ) -> tuple[subprocess.Popen, str, str]:
    """serve_openai_api.py on a free loopback port: (process, base URL, the startup line)."""
    env = dict(os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {}))
    proc = subprocess.Popen([sys.executable, "serve_openai_api.py", "--checkpoint", str(checkpoint), "--port", "0",
                             "--log_level", "warning", "--max_batch_size", str(max_batch_size), "--dtype", "float32"],
                            cwd=ROOT, stderr=subprocess.PIPE, text=True, env=env)
    deadline, lines = time.time() + timeout, []
    while time.time() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line)
        if m := re.search(r"on (http://127\.0\.0\.1:\d+)/v1/(chat/)?completions", line):
            return proc, m[1], line.strip()
    proc.kill()
    raise RuntimeError("the server did not start:\n" + "".join(lines))


async def one_request(client, model: str, chat: bool, prompt: str | list[int], max_tokens: int) -> dict:
    """One streamed request: when it was sent, when each text chunk came, how many tokens it got."""
    sent = time.perf_counter()
    kw = dict(model=model, max_tokens=max_tokens, temperature=0.8, stream=True,
              stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    if chat:
        stream = await client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **kw)
    else:
        stream = await client.completions.create(prompt=prompt, **kw)
    arrivals, tokens = [], 0
    async for chunk in stream:
        if chunk.choices:
            piece = chunk.choices[0].delta.content if chat else chunk.choices[0].text
            if piece:
                arrivals.append(time.perf_counter())
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    if tokens != max_tokens or not arrivals:
        raise RuntimeError(f"expected {max_tokens} tokens, got {tokens} ({len(arrivals)} text chunks)")
    first, last = arrivals[0], arrivals[-1]
    return {"ttft_s": first - sent, "tpot_s": (last - first) / (tokens - 1) if tokens > 1 else 0.0,
            "tokens": tokens, "start": sent, "end": last}


async def phase(client, model: str, chat: bool, prompts: list, max_tokens: int, concurrent: bool) -> dict:
    """All prompts at once, or one after another; per-phase throughput and latency percentiles."""
    t0 = time.perf_counter()
    if concurrent:
        results = await asyncio.gather(*(one_request(client, model, chat, p, max_tokens) for p in prompts))
    else:
        results = [await one_request(client, model, chat, p, max_tokens) for p in prompts]
    wall = time.perf_counter() - t0
    ttft, tpot = [r["ttft_s"] for r in results], [r["tpot_s"] for r in results]
    tokens = sum(r["tokens"] for r in results)
    ms = lambda x: round(1000 * x, 1)  # noqa: E731
    return {"requests": len(results), "tokens": tokens, "wall_s": round(wall, 3),
            "tokens_per_s": round(tokens / wall, 1),
            "ttft_ms_p50": ms(percentile(ttft, 50)), "ttft_ms_p95": ms(percentile(ttft, 95)),
            "tpot_ms_p50": ms(percentile(tpot, 50)), "tpot_ms_p95": ms(percentile(tpot, 95)),
            "tpot_ms_mean": ms(statistics.fmean(tpot))}


async def drive(url: str, model: str, chat: bool, prompts: list, max_tokens: int, repeats: int) -> dict:
    """`repeats` rounds of (sequential, concurrent); per phase the fastest round, the least disturbed by other
    load on a shared machine (as bench_generate.py), and every round's tokens/s."""
    import httpx
    from openai import AsyncOpenAI

    rounds: dict[str, list[dict]] = {"sequential": [], "concurrent": []}
    async with AsyncOpenAI(base_url=f"{url}/v1", api_key="bench", max_retries=0, timeout=120) as client:
        # warm-up, untimed: the math libraries prepare kernels for each new attention length and batch size
        await phase(client, model, chat, prompts, max_tokens, concurrent=True)
        for _ in range(repeats):
            for name in rounds:
                rounds[name].append(await phase(client, model, chat, prompts, max_tokens, name == "concurrent"))
    async with httpx.AsyncClient() as h:
        health = (await h.get(f"{url}/health")).json()
    best = {name: max(runs, key=lambda r: r["tokens_per_s"]) for name, runs in rounds.items()}
    return {**best, "speedup": round(best["concurrent"]["tokens_per_s"] / best["sequential"]["tokens_per_s"], 2),
            "tokens_per_s_all_rounds": {name: [r["tokens_per_s"] for r in runs] for name, runs in rounds.items()},
            "server": health}


def engine_only(model_dir: Path, prompts: list[list[int]], max_tokens: int, max_batch_size: int,
                repeats: int, threads: int | None) -> dict:
    """The engine in this process without HTTP: the same prompts one by one and all at once (tokens/s, the
    fastest of `repeats` rounds after a warm-up one), the ceiling the server's numbers compare with."""
    from model import load_model
    from serving.engine import Engine, SamplingParams

    model, _ = load_model(model_dir)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.8)

    def tokens_per_s(groups: list[list[list[int]]]) -> float:
        engine = Engine(model, lambda ids: "", 0, max_batch_size=max_batch_size, max_queue=len(prompts))
        t0 = time.perf_counter()
        for group in groups:
            for p in group:
                engine.submit(p, params)
            while engine.step():
                pass
        return len(prompts) * max_tokens / (time.perf_counter() - t0)

    out, default_threads = {}, torch.get_num_threads()
    torch.set_num_threads(threads or default_threads)  # as many as the server had
    try:
        for name, groups in (("sequential", [[p] for p in prompts]), ("batched", [prompts])):
            # the first round is slow: the math libraries prepare kernels for each new attention length
            out[f"{name}_tokens_per_s"] = round(max(tokens_per_s(groups) for _ in range(repeats + 1)), 1)
    finally:
        torch.set_num_threads(default_threads)
    return out


def run(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        if args.checkpoint:
            checkpoint = Path(args.checkpoint)
            shape = {"checkpoint": portable(checkpoint)}
        else:
            overrides = {"hidden_size": args.hidden_size, "num_hidden_layers": args.num_hidden_layers,
                         "num_attention_heads": args.num_attention_heads,
                         "num_key_value_heads": args.num_key_value_heads}
            checkpoint = random_model_dir(Path(tmp) / "bench-model", args.preset, overrides)
            shape = {"preset": args.preset, **{k: v for k, v in overrides.items() if v is not None},
                     "weights": "random"}
        proc, url, banner = start_server(checkpoint, args.max_batch_size, args.threads, args.timeout)
        try:
            model_dir = resolve_model_dir(checkpoint)
            chat = read_train_info(model_dir)["prompt_format"] == "chat"  # it decides the endpoint, as in the server
            vocab = ModelConfig.load(model_dir / "config.json").vocab_size
            g = torch.Generator().manual_seed(0)
            # chat: a message of about prompt_len tokens; text: exactly prompt_len random token ids (no specials)
            prompts = [" ".join(["word"] * args.prompt_len) if chat
                       else torch.randint(3, vocab, (args.prompt_len,), generator=g).tolist()
                       for _ in range(args.clients)]
            model_name = checkpoint.resolve().name
            result = asyncio.run(asyncio.wait_for(drive(url, model_name, chat, prompts, args.max_tokens,
                                                        args.repeats), args.timeout))
        finally:
            proc.terminate()
            proc.wait(30)
        if not chat:  # token-id prompts: the engine alone sees exactly what the server saw
            result["engine_only"] = engine_only(model_dir, prompts, args.max_tokens, args.max_batch_size,
                                                args.repeats, args.threads)
    return {"model": shape, "server": banner, "endpoint": "chat" if chat else "completions", "device": "cpu",
            "torch": torch.__version__, "server_threads": args.threads or torch.get_num_threads(),
            "load_avg_1m_at_start": round(os.getloadavg()[0], 2), "clients": args.clients,
            "max_tokens": args.max_tokens, "prompt_len": args.prompt_len, "max_batch_size": args.max_batch_size,
            "repeats": args.repeats,
            **{k: v for k, v in result.items() if k != "server"}, "engine": result["server"], "errors": 0}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default=None, help="serve this run or model dir (default: a random model)")
    p.add_argument("--preset", default="minimind-26m")
    p.add_argument("--hidden_size", type=int, default=256)
    p.add_argument("--num_hidden_layers", type=int, default=4)
    p.add_argument("--num_attention_heads", type=int, default=4)
    p.add_argument("--num_key_value_heads", type=int, default=2)
    p.add_argument("--clients", type=int, default=8, help="concurrent streaming clients (and requests per phase)")
    p.add_argument("--max_tokens", type=int, default=64)
    p.add_argument("--prompt_len", type=int, default=32)
    p.add_argument("--max_batch_size", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3, help="rounds of both phases; the fastest of each is reported")
    p.add_argument("--threads", type=int, default=None,
                   help="the server's torch threads (default: torch's; on a loaded machine 1 is steadier)")
    p.add_argument("--timeout", type=float, default=600, help="seconds for the whole benchmark at most")
    p.add_argument("--out", default=None, help="write the result JSON here")
    args = p.parse_args(argv)
    if not 1 <= args.clients <= 64 or not 2 <= args.max_tokens <= 4096 or not 1 <= args.repeats <= 10:
        p.error("need 1 <= --clients <= 64, 2 <= --max_tokens <= 4096 and 1 <= --repeats <= 10")
    result = run(args)
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
