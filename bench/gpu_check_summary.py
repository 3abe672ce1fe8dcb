"""Summary of bench/gpu_check.sh: each check's result and time, the headline numbers, and summary.json.

    python bench/gpu_check_summary.py OUT_DIR BUDGET_S NAME... -- RESULT... -- SECONDS...

Reads throughput.json and generation.json from OUT_DIR when the checks wrote them, prints one line per check
and per measured preset, writes OUT_DIR/summary.json, and exits 0 only when every check passed.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any


def summarize(out: Path, budget_s: int, names: list[str], results: list[str], seconds: list[int]) -> dict[str, Any]:
    """Print the summary and write summary.json; returns what was written."""
    checks = [{"check": n, "result": r, "seconds": s} for n, r, s in zip(names, results, seconds)]
    summary: dict[str, Any] = {"passed": bool(checks) and all(c["result"] == "PASS" for c in checks),
                               "checks": checks}
    print(f"\nGPU check summary ({time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}, "
          f"{sum(seconds)} s of a {budget_s} s budget); results in {out}")
    for c in checks:
        print(f"  {c['check']:<14} {c['result']}  ({c['seconds']} s)")
    for name in ("throughput", "generation"):
        path = out / f"{name}.json"
        if path.exists():
            summary[name] = json.loads(path.read_text())
    for row in summary.get("throughput", {}).get("results", []):
        mfu = f"{row['mfu']:.1%}" if row.get("mfu") is not None else "n/a (unknown peak)"
        print(f"  {row['preset']:<14} {row['dtype']}, batch {row['batch_size']}x{row['seq_len']}: "
              f"{row['tokens_per_s']:,} tokens/s, MFU {mfu}, step {row['loop_step_s']} s, "
              f"loop overhead {row['loop_overhead_frac']:.1%}, peak {row['peak_mem_gb']} GB"
              + (f", dispatch {row['dispatch_share']:.1%} of the step" if "dispatch_share" in row else "")
              + (f", step x{row['vs_dense']['bare_step_ratio']} of {row['vs_dense']['preset']}"
                 if "vs_dense" in row else ""))
    gen = summary.get("generation")
    if gen:
        reference = gen.get("transformers_tokens_per_s", gen.get("transformers", "n/a"))
        print(f"  {'generation':<14} {gen['preset']}: KV cache {gen['kv_cache_tokens_per_s']} tokens/s, "
              f"no cache {gen['no_cache_tokens_per_s']}, transformers {reference}")
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print("PASS" if summary["passed"] else "FAIL")
    return summary


def main(argv: list[str]) -> int:
    try:
        out, budget, rest = Path(argv[0]), int(argv[1]), argv[2:]
        first = rest.index("--")
        second = rest.index("--", first + 1)
        names, results = rest[:first], rest[first + 1:second]
        seconds = [int(s) for s in rest[second + 1:]]
    except (IndexError, ValueError):
        print(__doc__, file=sys.stderr)
        return 2
    if not len(names) == len(results) == len(seconds):
        print(f"error: {len(names)} names, {len(results)} results, {len(seconds)} times", file=sys.stderr)
        return 2
    return 0 if summarize(out, budget, names, results, seconds)["passed"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
