"""Extract the identity conversations (who the model is: PocketLM) from the bundled SFT demo data, for the
demo's LoRA step (recipes/demo-lora.yaml), like MiniMind's identity LoRA.

    python scripts/build_identity_demo.py          # writes dataset/demo/identity_demo.jsonl

They are the conversations whose source is LLaMA-Factory's identity set (see dataset/demo/NOTICE.md), kept
in file order, byte for byte; the SFT data also answers "Who are you?" otherwise (e.g. chatterbot's "I am just
an artificial intelligence."), which is what the adapters are trained to override.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = "llamafactory:identity"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sft", default=str(ROOT / "dataset/demo/sft_demo.jsonl"))
    p.add_argument("--out", default=str(ROOT / "dataset/demo/identity_demo.jsonl"))
    args = p.parse_args(argv)
    with open(args.sft, encoding="utf-8") as f:
        kept = [line for line in f if json.loads(line).get("source") == SOURCE]
    if not kept:
        print(f"error: {args.sft}: no conversations with source {SOURCE!r}", file=sys.stderr)
        return 2
    Path(args.out).write_text("".join(kept), encoding="utf-8")
    print(f"{len(kept)} identity conversations -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
