"""Build the bundled verifiable task: small arithmetic, comparison and counting questions in English and Chinese,
each with one exact answer, for training on checked rewards and for measuring what a small model learned.

    python scripts/build_math_demo.py          # writes dataset/demo/math_{train,heldout,sft}.jsonl

Nine kinds of question, each in both languages: a + b and a - b (0..20, never negative), the larger and the
smaller of two numbers (0..20), the largest and the smallest of three (0..12), the number after n, the letters of
an English word or the characters of a Chinese word, and the count of one letter repeated in a short run.

The comparisons are the kinds a model can learn from checked rewards alone: their answer is one of the numbers
in the question, so sampling finds it often (one of two or three numbers) and a rule learned on some questions
carries over to the rest. A sum found by sampling is right for one pair of numbers only; the sums,
differences and the next number stay in the task as the kinds that a 4.6M-parameter model does not learn this way
after a short SFT (docs/post-training.md#grpo reports every kind before and after). Every question that can be asked is
enumerated (each set of three numbers once, in one of its orders), shuffled with --seed and split: about
--heldout questions (spread over the kinds and languages in proportion) are never in the training files.

    math_train.jsonl    {"conversations": [{"role": "user", ...}], "answer": "12", "kind": ..., "lang": ...}
    math_heldout.jsonl  the same format, the held-out questions
    math_sft.jsonl      the training questions answered in the format the judge reads (for a short SFT):
                        "7 + 5 = 12. The answer is 12." / "7 加 5 等于 12。答案是 12。"

The first two are generation task files as they are (eval_model.py --task_file dataset/demo/math_heldout.jsonl:
a chat prompt, the answer judged as a number by common/answers.py) and prompts with checked answers. Nothing is
taken from elsewhere: the questions, words and answers are generated here (dataset/demo/NOTICE.md). Rerunning it
with the same seed writes identical bytes.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from itertools import combinations, permutations
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EN_WORDS = ("cat", "dog", "sun", "tree", "book", "fish", "milk", "bird", "apple", "house", "water", "green",
            "table", "river", "music", "bread", "garden", "orange", "yellow", "window", "summer", "letter",
            "pencil", "flower", "kitchen", "morning", "teacher", "picture", "elephant", "mountain")
ZH_WORDS = ("猫", "太阳", "苹果", "大树", "图书馆", "火车站", "好朋友", "自行车", "长城", "飞机场", "向日葵",
            "中华人民", "小学生", "电视机", "春夏秋冬", "山清水秀", "一心一意", "东南西北", "天安门", "动物园")
LETTERS = "abcdefghijklmnopqrstuvwxyz"
NEW_TOKENS = 48  # the longest worked answer is about 30 tokens


def questions() -> list[dict[str, str]]:
    """Every question, in a fixed order: kind, lang, the question, the worked answer and the answer."""
    out = []

    def add(kind: str, lang: str, question: str, work: str, answer: int) -> None:
        said = f"{work}. The answer is {answer}." if lang == "en" else f"{work}。答案是 {answer}。"
        out.append({"kind": kind, "lang": lang, "question": question, "reply": said, "answer": str(answer)})

    for a in range(21):
        for b in range(21):
            add("add", "en", f"What is {a} + {b}?", f"{a} + {b} = {a + b}", a + b)
            add("add", "zh", f"{a} 加 {b} 等于多少？", f"{a} 加 {b} 等于 {a + b}", a + b)
            if a >= b:
                add("sub", "en", f"What is {a} - {b}?", f"{a} - {b} = {a - b}", a - b)
                add("sub", "zh", f"{a} 减 {b} 等于多少？", f"{a} 减 {b} 等于 {a - b}", a - b)
            if a != b:
                big, small = max(a, b), min(a, b)
                add("max", "en", f"Which is larger, {a} or {b}?", f"{big} is larger than {small}", big)
                add("max", "zh", f"{a} 和 {b} 哪个大？", f"{big} 比 {small} 大", big)
                add("min", "en", f"Which is smaller, {a} or {b}?", f"{small} is smaller than {big}", small)
                add("min", "zh", f"{a} 和 {b} 哪个小？", f"{small} 比 {big} 小", small)
    # three different numbers 0..12, each set once, in one of its six orders (by its place in the enumeration)
    for i, triple in enumerate(combinations(range(13), 3)):
        a, b, c = list(permutations(triple))[i % 6]
        en, zh = f"{a}, {b} and {c}", f"{a}、{b}、{c}"
        add("max3", "en", f"Which is the largest of {en}?", f"The largest of {en} is {max(triple)}", max(triple))
        add("max3", "zh", f"{zh} 中哪个最大？", f"{zh} 中最大的是 {max(triple)}", max(triple))
        add("min3", "en", f"Which is the smallest of {en}?", f"The smallest of {en} is {min(triple)}", min(triple))
        add("min3", "zh", f"{zh} 中哪个最小？", f"{zh} 中最小的是 {min(triple)}", min(triple))
    for n in range(100):
        add("next", "en", f"What number comes after {n}?", f"After {n} comes {n + 1}", n + 1)
        add("next", "zh", f"{n} 后面的数是几？", f"{n} 后面是 {n + 1}", n + 1)
    for word in EN_WORDS:
        add("length", "en", f"How many letters are in the word \"{word}\"?",
            f"\"{word}\" is {'-'.join(word)}: {len(word)} letters", len(word))
    for word in ZH_WORDS:
        add("length", "zh", f"“{word}”有几个字？", f"“{word}”是{'、'.join(word)}，共 {len(word)} 个字", len(word))
    for letter in LETTERS:
        for n in range(1, 10):
            run = letter * n
            add("count", "en", f"How many times does \"{letter}\" appear in \"{run}\"?",
                f"\"{run}\" has {n} times \"{letter}\"", n)
            add("count", "zh", f"“{run}”里有几个“{letter}”？", f"“{run}”里有 {n} 个“{letter}”", n)
    return out


def split(items: list[dict[str, str]], heldout: int, seed: int) -> tuple[list[dict], list[dict]]:
    """A shuffled (train, held-out) split, the held-out share of each (kind, lang) equal to the whole's."""
    rng = random.Random(seed)
    groups: dict[tuple[str, str], list[dict[str, str]]] = {}
    for q in items:
        groups.setdefault((q["kind"], q["lang"]), []).append(q)
    train, held = [], []
    for key in sorted(groups):
        group = groups[key]
        rng.shuffle(group)
        n = round(heldout * len(group) / len(items))
        held += group[:n]
        train += group[n:]
    rng.shuffle(train)
    rng.shuffle(held)
    return train, held


def task_record(q: dict[str, str]) -> dict:
    return {"conversations": [{"role": "user", "content": q["question"]}], "answer": q["answer"],
            "max_new_tokens": NEW_TOKENS, "kind": q["kind"], "lang": q["lang"]}


def sft_record(q: dict[str, str]) -> dict:
    return {"conversations": [{"role": "user", "content": q["question"]},
                              {"role": "assistant", "content": q["reply"]}], "kind": q["kind"], "lang": q["lang"]}


def write(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out_dir", default=str(ROOT / "dataset" / "demo"))
    p.add_argument("--heldout", type=int, default=600, help="questions kept out of training")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    items = questions()
    if not 0 < args.heldout < len(items):
        print(f"error: --heldout must be between 1 and {len(items) - 1}", file=sys.stderr)
        return 2
    train, held = split(items, args.heldout, args.seed)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write(out / "math_train.jsonl", [task_record(q) for q in train])
    write(out / "math_heldout.jsonl", [task_record(q) for q in held])
    write(out / "math_sft.jsonl", [sft_record(q) for q in train])
    print(f"{len(train)} training and {len(held)} held-out questions -> {out}/math_{{train,heldout,sft}}.jsonl")
    return 0


if __name__ == "__main__":
    sys.exit(main())
