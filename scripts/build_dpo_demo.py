"""Build the bundled DPO demo pairs (dataset/demo/dpo_demo.jsonl) from the SFT demo conversations.

    python scripts/build_dpo_demo.py                 # defaults below; prints what it built
    python scripts/build_dpo_demo.py --max_pairs 500 --out /tmp/dpo.jsonl

The pairs are synthetic. "chosen" is a conversation of dataset/demo/sft_demo.jsonl as it is; "rejected" has the
same prompt turns and a degenerate answer of one of two kinds, picked per conversation by a seeded coin:
    mismatch  the final answer of another conversation in the same language (CJK characters present or not)
              from another source, so it is off topic;
    loop      the real answer's first sentence repeated until it is 2-3x as long as the answer (at most
              LOOP_MAX_CHARS characters), the way a small model loops.
So DPO on them teaches two things only: answer the question that was asked, and stop instead of repeating
yourself. Conversations are skipped when their kind cannot make a different answer (an answer under
MIN_LOOP_CHARS characters to loop, a first sentence too long to repeat, no other-topic answer, or a rejected
answer equal to the chosen one). At most --max_pairs pairs are kept (a seeded sample, in file order).
Everything is seeded, so running the script twice writes identical bytes.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common.errors import PocketLMError  # noqa: E402
from dataset.jsonl import read_records, validate_preference, write_atomic  # noqa: E402

DEFAULT_SRC = ROOT / "dataset" / "demo" / "sft_demo.jsonl"
DEFAULT_OUT = ROOT / "dataset" / "demo" / "dpo_demo.jsonl"
MIN_LOOP_CHARS = 10  # "Yes." looped is barely a loop; shorter answers are not used for the loop kind
LOOP_MAX_CHARS = 400  # a looping answer is cut here (keeps the file small and most rows within 512 tokens)
MISMATCH_MAX_CHARS = 1000  # longer answers are not used as another conversation's mismatched reply
CJK = re.compile(r"[\u3400-\u9fff\uf900-\ufaff]")
# A sentence ends at CJK end punctuation, at ASCII end punctuation before a space (not inside "docs.python.org"),
# or at a line break.
SENTENCE_END = re.compile(r"[。！？；…]|[.!?;](?=\s|$)|\n")


def language(messages: list[dict[str, str]]) -> str:
    """"zh" when the last user turn or the answer holds CJK characters, else "en"."""
    last_user = next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")
    return "zh" if CJK.search(last_user + messages[-1]["content"]) else "en"


def first_sentence(text: str) -> str:
    text = text.strip()
    end = SENTENCE_END.search(text)
    return text[:end.end()].strip() if end else text


def loop_answer(answer: str, lang: str, rng: random.Random) -> str | None:
    """The answer's first sentence repeated to 2-3x the answer's length (at most LOOP_MAX_CHARS), or None when
    the answer is too short to loop meaningfully or its first sentence too long to repeat within the limit."""
    answer = answer.strip()
    unit = first_sentence(answer)
    if len(answer) < MIN_LOOP_CHARS or 2 * len(unit) > LOOP_MAX_CHARS:
        return None
    sep = "" if lang == "zh" else " "
    target = min(LOOP_MAX_CHARS, round(len(answer) * rng.uniform(2.0, 3.0)))
    repeats = max(2, math.ceil(target / (len(unit) + len(sep))))
    looped = sep.join([unit] * repeats)
    return looped[:max(target, 2 * len(unit) + len(sep))].rstrip()


def mismatched_answer(answer: str, lang: str, source: str, pool: dict[str, list[tuple[str, str]]],
                      rng: random.Random, attempts: int = 50) -> str | None:
    """Another conversation's final answer in the same language from another source, or None."""
    candidates = pool[lang]
    for _ in range(attempts):
        other, other_source = candidates[rng.randrange(len(candidates))]
        if other_source != source and other.strip() != answer.strip():
            return other
    return None


def build(src: Path, max_pairs: int, seed: int) -> tuple[list[dict[str, Any]], Counter]:
    """The pairs (in the source file's order) and the counts of what was built and skipped."""
    convs = [(lineno, rec) for lineno, rec in read_records(src, "conversations")
             if rec["conversations"][-1]["role"] == "assistant"]
    pool: dict[str, list[tuple[str, str]]] = {"en": [], "zh": []}
    seen: set[str] = set()
    for _, rec in convs:
        answer = rec["conversations"][-1]["content"]
        if answer.strip() and answer not in seen and len(answer) <= MISMATCH_MAX_CHARS:
            seen.add(answer)
            pool[language(rec["conversations"])].append((answer, rec.get("source", "")))
    counts: Counter = Counter()
    pairs = []
    for lineno, rec in convs:
        conv = rec["conversations"]
        lang, answer, source = language(conv), conv[-1]["content"], rec.get("source", "")
        rng = random.Random(f"{seed}/{lineno}")  # per line: a pair does not depend on the other lines
        kind = "loop" if rng.random() < 0.5 else "mismatch"
        rejected = (loop_answer(answer, lang, rng) if kind == "loop"
                    else mismatched_answer(answer, lang, source, pool, rng))
        if rejected is None or rejected.strip() == answer.strip():
            counts[f"skipped ({kind})"] += 1
            continue
        pair = {"chosen": conv, "rejected": [*conv[:-1], {"role": "assistant", "content": rejected}],
                "source": source, "lang": lang, "rejected_kind": kind}
        try:
            validate_preference(pair)
        except ValueError as e:  # e.g. a conversation that is all assistant turns: no prompt to prefer over
            counts[f"skipped ({e})"] += 1
            continue
        pairs.append(pair)
    if len(pairs) > max_pairs:
        keep = sorted(random.Random(seed).sample(range(len(pairs)), max_pairs))
        counts["left out by --max_pairs"] = len(pairs) - max_pairs
        pairs = [pairs[i] for i in keep]
    counts.update(f"{p['rejected_kind']} ({p['lang']})" for p in pairs)
    return pairs, counts


def main(argv: list[str] | None = None) -> int:
    """Build the DPO demo file and print its counts."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--src", type=Path, default=DEFAULT_SRC, help="SFT conversations (.jsonl)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="preference pairs to write (.jsonl)")
    parser.add_argument("--max_pairs", type=int, default=2000, help="keep at most this many pairs")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        pairs, counts = build(args.src, args.max_pairs, args.seed)
    except PocketLMError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    data = "".join(json.dumps(p, ensure_ascii=False) + "\n" for p in pairs).encode("utf-8")
    write_atomic(args.out, data)
    print(f"wrote {len(pairs):,} pairs ({len(data) / 1e6:.2f} MB) to {args.out}")
    for what, n in sorted(counts.items()):
        print(f"  {what}: {n:,}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
