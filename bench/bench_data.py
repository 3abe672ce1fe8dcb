"""Data benchmarks: tokenize-once preparation throughput, cache reuse, batch reads, SFT padding.

    python bench/bench_data.py --data_path /path/to/pretrain_bench.jsonl [--sft_path dataset/demo/sft_demo.jsonl]

Prints a table and writes JSON to bench/results/data-<host>.json (or --out). Preparation is measured cold
(a fresh cache directory) and warm (reuse); peak RSS includes the worker processes.
"""
from __future__ import annotations

import argparse
import json
import platform
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dataset.datasets import PretrainDataset, SFTDataset  # noqa: E402
from dataset.token_cache import prepare  # noqa: E402
from dataset.tokenizer import DEFAULT_TOKENIZER_DIR, Tokenizer  # noqa: E402


def peak_rss_mb() -> dict[str, float]:
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return {"main_mb": round(own, 1), "largest_worker_mb": round(children, 1)}


def bench_prepare(data: Path, tok: Tokenizer, workers: int | None, seq_len: int, batch: int) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="pocketlm-bench-"))
    try:
        t0 = time.perf_counter()
        cache = prepare(data, tok, "pretrain", val_fraction=0.005, num_workers=workers, cache_dir=tmp)
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        prepare(data, tok, "pretrain", val_fraction=0.005, num_workers=workers, cache_dir=tmp)
        warm = time.perf_counter() - t0
        tokens = sum(s["tokens"] for s in cache.meta["splits"].values())
        ds = PretrainDataset(cache, "train", seq_len)
        n_batches = 200
        t0 = time.perf_counter()
        for k in range(n_batches):
            ds.batch(ds.global_indices(k * batch, batch))
        read = time.perf_counter() - t0
        mb = data.stat().st_size / 1e6
        return {"file_mb": round(mb, 1), "tokens": tokens, "cold_seconds": round(cold, 2),
                "mb_per_s": round(mb / cold, 2), "tokens_per_s": round(tokens / cold),
                "warm_reuse_seconds": round(warm, 4), "peak_rss": peak_rss_mb(),
                "batch_read": {"batch_size": batch, "seq_len": seq_len,
                               "batches_per_s": round(n_batches / read, 1),
                               "tokens_per_s": round(n_batches * batch * seq_len / read)}}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def bench_sft_padding(data: Path, tok: Tokenizer, seq_len: int) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="pocketlm-bench-"))
    try:
        cache = prepare(data, tok, "sft", num_workers=0, cache_dir=tmp, max_seq_len=seq_len, overlong="truncate")
        out = {"max_seq_len": seq_len, "conversations": cache.meta["splits"]["train"]["documents"],
               **cache.meta["stats"]}
        for b in (8, 16, 32):
            out[f"padding_fraction_bs{b}"] = round(SFTDataset(cache, batch_size=b).padding_fraction(), 4)
        return out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data_path", default="dataset/demo/pretrain_demo.jsonl")
    p.add_argument("--sft_path", default="dataset/demo/sft_demo.jsonl")
    p.add_argument("--tokenizer", default=str(DEFAULT_TOKENIZER_DIR))
    p.add_argument("--num_workers", type=int, default=None)
    p.add_argument("--max_seq_len", type=int, default=512)
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    tok = Tokenizer(args.tokenizer)
    results = {"machine": {"host": platform.node(), "cpu_count": __import__("os").cpu_count(),
                           "python": platform.python_version(), "numpy": np.__version__},
               "prepare": {Path(args.data_path).name: bench_prepare(Path(args.data_path), tok, args.num_workers,
                                                                     args.max_seq_len, args.batch_size)},
               "sft": {Path(args.sft_path).name: bench_sft_padding(Path(args.sft_path), tok, args.max_seq_len)}}
    print(json.dumps(results, indent=2))
    out = Path(args.out or Path(__file__).parent / "results" / f"data-{platform.node()}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
