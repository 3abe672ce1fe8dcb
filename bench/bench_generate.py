"""Generation benchmark: greedy decode tokens/s with the KV cache, without it, and transformers' generate.

    python bench/bench_generate.py [--preset minimind-26m] [--prompt_len 32] [--new_tokens 128] [--batch 1]

The transformers model is PocketLM's own export (model.convert), so all three decode the same weights; the
greedy outputs are checked to be identical before any time is reported. Random weights are used: speed does
not depend on what the model learned, and a random model never stops early at an EOS.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.device import parse_device  # noqa: E402
from export.convert import export_hf  # noqa: E402
from model import PocketLM, generate, get_preset, save_model  # noqa: E402


def best_of(fn, repeats: int) -> float:
    """Fastest of `repeats` timed calls (after one warm-up): the least disturbed by other load."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def run(preset: str, prompt_len: int, new_tokens: int, batch: int, repeats: int, device: str) -> dict:
    torch.manual_seed(0)
    cfg = get_preset(preset)
    model = PocketLM(cfg).to(device).eval()
    prompts = torch.randint(3, cfg.vocab_size, (batch, prompt_len)).tolist()
    result: dict = {"preset": preset, "device": device, "batch": batch, "prompt_len": prompt_len,
                    "new_tokens": new_tokens, "threads": torch.get_num_threads()}

    ours = lambda cache: generate(model, prompts, max_new_tokens=new_tokens, temperature=0, use_cache=cache)  # noqa: E731
    reference = ours(True)
    assert ours(False) == reference, "cached and uncached greedy decoding disagree"
    for name, cache in (("kv_cache", True), ("no_cache", False)):
        seconds = best_of(lambda: ours(cache), repeats)
        result[f"{name}_tokens_per_s"] = round(batch * new_tokens / seconds, 1)

    try:
        import transformers
    except ImportError:
        result["transformers"] = "not installed"
        return result
    with tempfile.TemporaryDirectory() as tmp:
        save_model(model.cpu(), Path(tmp) / "ours")
        export_hf(Path(tmp) / "ours", Path(tmp) / "hf")
        hf = transformers.AutoModelForCausalLM.from_pretrained(Path(tmp) / "hf").to(device).eval()
    model.to(device)
    ids = torch.tensor(prompts, device=device)

    @torch.inference_mode()
    def hf_generate() -> list[list[int]]:
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens,
                          do_sample=False, pad_token_id=0, eos_token_id=None)
        return out[:, prompt_len:].tolist()

    assert hf_generate() == reference, "transformers' greedy output differs from PocketLM's"
    seconds = best_of(hf_generate, repeats)
    result["transformers_tokens_per_s"] = round(batch * new_tokens / seconds, 1)
    result["kv_cache_vs_transformers"] = round(result["kv_cache_tokens_per_s"] / result["transformers_tokens_per_s"], 2)
    result["kv_cache_vs_no_cache"] = round(result["kv_cache_tokens_per_s"] / result["no_cache_tokens_per_s"], 2)
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="minimind-26m")
    p.add_argument("--prompt_len", type=int, default=32)
    p.add_argument("--new_tokens", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="auto", help="auto (CUDA, else MPS, else CPU) | cpu | cuda[:N] | mps")
    p.add_argument("--out", default=None, help="write the result JSON here")
    args = p.parse_args(argv)
    device = str(parse_device(args.device))
    result = run(args.preset, args.prompt_len, args.new_tokens, args.batch, args.repeats, device)
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
