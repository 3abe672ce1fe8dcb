"""Build the bundled tool-call set: questions in English and Chinese that one of the bundled tools answers
(common/tools.py: calculator, unit conversion, date arithmetic, the element table), or two chained calls answer
(the second made from the first's result: convert then multiply, count days then turn them into weeks or hours,
look up an atomic number then multiply it), for SFT, a held-out eval and reinforcement learning.

    python scripts/build_tool_demo.py   # writes dataset/demo/tools_{sft,heldout,chained_sft,chained_heldout,rl}.jsonl

Each conversation offers the right tool, half of them one other too (in random order), in its system turn, the way a
client sends `tools`; the assistant calls the right one with the right arguments, the tool's real result comes
back as a `tool` message, and the assistant answers from it ("... The answer is 84." / "……答案是 84。"). A third of
the calls come with a short reasoning (`reasoning_content`, rendered as <think>...</think>), so a model learns
both forms.

    tools_sft.jsonl      {"conversations": [system + tools, user, assistant + tool_calls, tool, assistant], ...}
    tools_heldout.jsonl  {"conversations": [system + tools, user], "answer": "84",
                          "tool_call": {"name": "calculator", "arguments": {"expression": "347 * 29"}}, ...}
    tools_chained_sft.jsonl, tools_chained_heldout.jsonl    the same for the chained questions: two call-and-
                         result rounds before the answer; a held-out item's "tool_call" is the first call
    tools_rl.jsonl       prompts as the held-out files write them, both kinds, for train_agent.py

The held-out file is a tool task for eval_model.py --task_file (tool-call accuracy and the answer reached with
and without tools, by kind); no held-out question is asked in the SFT or the RL file. Everything is generated
here with --seed; the answers are the tools' own results, so they are right by construction. Rerunning writes
identical bytes.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import random
import sys
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common.tool_calls import ToolCall  # noqa: E402
from common.tools import BUNDLED, ELEMENTS, run_tool, tool_schemas  # noqa: E402

NEW_TOKENS = 128  # a reasoning and a call take up to about 100 tokens
# (English singular, English plural, Chinese) of each unit of common/tools.py UNITS
UNIT_NAMES = {
    "m": ("meter", "meters", "米"), "km": ("kilometer", "kilometers", "千米"),
    "cm": ("centimeter", "centimeters", "厘米"), "mm": ("millimeter", "millimeters", "毫米"),
    "mi": ("mile", "miles", "英里"), "ft": ("foot", "feet", "英尺"),
    "in": ("inch", "inches", "英寸"), "yd": ("yard", "yards", "码"), "kg": ("kilogram", "kilograms", "千克"),
    "g": ("gram", "grams", "克"), "lb": ("pound", "pounds", "磅"), "oz": ("ounce", "ounces", "盎司"),
    "l": ("liter", "liters", "升"), "ml": ("milliliter", "milliliters", "毫升"), "gal": ("gallon", "gallons", "加仑"),
    "c": ("degree Celsius", "degrees Celsius", "摄氏度"), "f": ("degree Fahrenheit", "degrees Fahrenheit", "华氏度"),
    "k": ("kelvin", "kelvin", "开尔文"),
}
DIMENSIONS = (("m", "km", "cm", "mm", "mi", "ft", "in", "yd"), ("kg", "g", "lb", "oz"), ("l", "ml", "gal"),
              ("c", "f", "k"))
OPS = {"+": ("plus", "加"), "-": ("minus", "减"), "*": ("times", "乘以"), "/": ("divided by", "除以")}

Question = dict[str, Any]  # kind, lang, question, call (name, arguments), reasoning, answer, reply


def question(kind: str, lang: str, text: str, name: str, arguments: dict[str, Any], reasoning: str,
             reply: Callable[[dict[str, Any]], tuple[str, str]]) -> Question:
    """A question with its call; the answer and the final reply come from running the call."""
    result = call_result(name, arguments)
    said, answer = reply(result)
    return finished(kind, lang, text, [(name, arguments, result)], reasoning, said, answer)


def call_result(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """What the bundled tool returns for this call (a call that fails is a bug of this script, never data)."""
    result = json.loads(run_tool(ToolCall(name, arguments)))
    if "error" in result:
        raise AssertionError(f"{name}{arguments}: {result['error']}")
    return result


def finished(kind: str, lang: str, text: str, calls: list[tuple[str, dict[str, Any], dict[str, Any]]],
             reasoning: str, said: str, answer: Any) -> Question:
    """A question with its calls (name, arguments, result) in order, and the final reply stating the answer."""
    final = f"{said} The answer is {answer}." if lang == "en" else f"{said}答案是 {answer}。"
    return {"kind": kind, "lang": lang, "question": text, "name": calls[0][0], "arguments": calls[0][1],
            "calls": [{"name": n, "arguments": a, "result": json.dumps(r, ensure_ascii=False)} for n, a, r in calls],
            "reasoning": reasoning, "answer": str(answer), "reply": final}


def arithmetic(rng: random.Random, lang: str) -> Question:
    op = rng.choice("+-*/")
    a, b = rng.randint(10, 999), rng.randint(2, 99) if op in "*/" else rng.randint(10, 999)
    if op == "/" and rng.random() < 0.75:
        a = b * rng.randint(2, 99)  # mostly whole quotients
    if op == "-" and rng.random() < 0.7:
        a, b = max(a, b), min(a, b)
    expression = f"{a} {op} {b}"
    shown = f"{a} {rng.choice({'*': '*×', '/': '/÷'}.get(op, op))} {b}"
    if rng.random() < 0.2:  # three terms, as written
        c = rng.randint(2, 30)
        second = rng.choice("+-*")
        expression = shown = f"({a} {op} {b}) {second} {c}" if rng.random() < 0.5 else f"{a} {op} {b} {second} {c}"
        en, zh = f"Calculate {shown}.", f"计算 {shown}。"
    else:
        word, zh_word = OPS[op]
        en = rng.choice((f"What is {a} {word} {b}?", f"Calculate {shown}.", f"What is {shown}?"))
        zh = rng.choice((f"{a} {zh_word} {b} 等于多少？", f"计算 {shown}。", f"{shown} 等于多少？"))
    reason = (f"This needs arithmetic: {expression}. I will use the calculator." if lang == "en"
              else f"需要计算 {expression}，用计算器。")
    def reply(r: dict) -> tuple[str, str]:
        return (f"{expression} = {r['result']}." if lang == "en" else f"{expression} = {r['result']}。"), r["result"]
    return question("calculator", lang, en if lang == "en" else zh, "calculator", {"expression": expression},
                    reason, reply)


def conversion(rng: random.Random, lang: str) -> Question:
    src, dst = rng.sample(rng.choice(DIMENSIONS), 2)
    value = rng.choice((rng.randint(1, 500), round(rng.uniform(0.5, 100), 1)))
    if src in "cfk":
        value = rng.randint(-40, 120) if src != "k" else rng.randint(230, 400)
    (s1, s_pl, s_zh), (_, d_pl, d_zh) = UNIT_NAMES[src], UNIT_NAMES[dst]
    s_en = s1 if value == 1 else s_pl
    if lang == "en":
        forms = [f"Convert {value} {s_en} to {d_pl}.", f"What is {value} {s_en} in {d_pl}?"]
        if src not in "cfk":
            forms.append(f"How many {d_pl} are in {value} {s_en}?")
        text = rng.choice(forms)
        reason = f"A conversion from {src} to {dst}: convert_units."
    else:
        text = rng.choice((f"{value} {s_zh}等于多少{d_zh}？", f"把 {value} {s_zh}换算成{d_zh}。"))
        reason = f"把 {src} 换算成 {dst}，用 convert_units。"
    def reply(r: dict) -> tuple[str, str]:
        if lang == "en":
            return f"{value} {s_en} is {r['result']} {UNIT_NAMES[dst][1]}.", r["result"]
        return f"{value} {s_zh}等于 {r['result']} {d_zh}。", r["result"]
    return question("convert_units", lang, text, "convert_units",
                    {"value": value, "from_unit": src, "to_unit": dst}, reason, reply)


def random_date(rng: random.Random) -> str:
    return (dt.date(2020, 1, 1) + dt.timedelta(days=rng.randint(0, 365 * 10))).isoformat()


def date_shift(rng: random.Random, lang: str) -> Question:
    date, days = random_date(rng), rng.randint(1, 400)
    before = rng.random() < 0.3
    if lang == "en":
        after = (f"What date is {days} days after {date}?", f"What is the date {days} days after {date}?")
        text = f"What was the date {days} days before {date}?" if before else rng.choice(after)
        reason = f"Date arithmetic: {date} {'-' if before else '+'} {days} days. add_days does it."
    else:
        text = f"{date} 之{'前' if before else '后'} {days} 天是哪一天？"
        reason = f"日期计算：{date} {'减' if before else '加'} {days} 天，用 add_days。"
    def reply(r: dict) -> tuple[str, str]:
        if lang == "en":
            return f"{days} days {'before' if before else 'after'} {date} is {r['date']}.", r["date"]
        return f"{date} 之{'前' if before else '后'} {days} 天是 {r['date']}。", r["date"]
    return question("add_days", lang, text, "add_days", {"date": date, "days": -days if before else days},
                    reason, reply)


def date_span(rng: random.Random, lang: str) -> Question:
    start, end = sorted((random_date(rng), random_date(rng)))
    if lang == "en":
        text = rng.choice((f"How many days are there from {start} to {end}?",
                           f"How many days between {start} and {end}?"))
        reason = f"Counting days from {start} to {end}: days_between."
    else:
        text = rng.choice((f"从 {start} 到 {end} 有多少天？", f"{start} 和 {end} 之间相差几天？"))
        reason = f"计算 {start} 到 {end} 的天数，用 days_between。"
    def reply(r: dict) -> tuple[str, str]:
        if lang == "en":
            return f"There are {r['days']} days from {start} to {end}.", r["days"]
        return f"从 {start} 到 {end} 有 {r['days']} 天。", r["days"]
    return question("days_between", lang, text, "days_between", {"start": start, "end": end}, reason, reply)


def element(rng: random.Random, lang: str) -> Question:
    _, symbol, english, chinese = rng.choice(ELEMENTS)
    asked = rng.choice(("symbol", "atomic_number", "name"))  # "name": which element has this symbol
    name = symbol if asked == "name" else english if lang == "en" else chinese
    if lang == "en":
        text = {"symbol": f"What is the chemical symbol for {english}?",
                "atomic_number": f"What is the atomic number of {english}?",
                "name": f"Which element has the symbol {symbol}?"}[asked]
        reason = f"The element table has {name}: lookup_element."
    else:
        text = {"symbol": f"{chinese}的元素符号是什么？", "atomic_number": f"{chinese}的原子序数是多少？",
                "name": f"元素符号 {symbol} 是哪种元素？"}[asked]
        reason = f"查元素表：{name}，用 lookup_element。"
    def reply(r: dict) -> tuple[str, str]:
        if asked == "name":
            return ((f"{symbol} is the symbol of {r['name']}.", r["name"]) if lang == "en"
                    else (f"{symbol} 是{r['name_zh']}的元素符号。", r["name_zh"]))
        if lang == "en":
            what = "chemical symbol for" if asked == "symbol" else "atomic number of"
            return f"The {what} {english} is {r[asked]}.", r[asked]
        return f"{chinese}的{'元素符号' if asked == 'symbol' else '原子序数'}是 {r[asked]}。", r[asked]
    return question("lookup_element", lang, text, "lookup_element", {"name": name}, reason, reply)


MAKERS = (arithmetic, conversion, date_shift, date_span, element)


# ---------------------------------------------------------------- chained: two calls, the second from the first
def chain(first: tuple[str, dict[str, Any]], then: Callable[[dict[str, Any]], dict[str, Any]]
          ) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """A call, then the calculator on an expression made from its result: both calls with their real results."""
    result = call_result(*first)
    second = then(result)
    return [(*first, result), ("calculator", second, call_result("calculator", second))]


def convert_then_calculate(rng: random.Random, lang: str) -> Question:
    """A quantity per item, converted, then multiplied by the count: convert_units, then the calculator."""
    src, dst = rng.sample(rng.choice(DIMENSIONS[:3]), 2)  # no temperatures: multiplying one makes no sense
    value, count = round(rng.uniform(0.5, 50), 1), rng.randint(2, 12)
    (_, s_pl, s_zh), (_, d_pl, d_zh) = UNIT_NAMES[src], UNIT_NAMES[dst]
    if lang == "en":
        text = rng.choice((f"Each box holds {value} {s_pl}. How many {d_pl} do {count} boxes hold?",
                           f"One lap is {value} {s_pl}. How many {d_pl} are {count} laps?"))
        reason = f"First convert {value} {src} to {dst} with convert_units, then multiply by {count}."
    else:
        text = rng.choice((f"每箱装 {value} {s_zh}，{count} 箱一共多少{d_zh}？",
                           f"一圈是 {value} {s_zh}，{count} 圈是多少{d_zh}？"))
        reason = f"先用 convert_units 把 {value} {src} 换算成 {dst}，再乘以 {count}。"
    calls = chain(("convert_units", {"value": value, "from_unit": src, "to_unit": dst}),
                  lambda converted: {"expression": f"{converted['result']} * {count}"})
    converted, total = calls[0][2]["result"], calls[1][2]["result"]
    said = (f"{value} {s_pl} is {converted} {d_pl}, and {count} of them make {total} {d_pl}." if lang == "en"
            else f"{value} {s_zh}等于 {converted} {d_zh}，{count} 份一共 {total} {d_zh}。")
    return finished("convert_then_calculate", lang, text, calls, reason, said, total)


def days_then_calculate(rng: random.Random, lang: str) -> Question:
    """A span in weeks or hours: days_between, then the calculator."""
    start, end = sorted((random_date(rng), random_date(rng)))
    hours = rng.random() < 0.5
    unit_en, unit_zh = ("hours", "小时") if hours else ("weeks", "周")
    if lang == "en":
        text = f"How many {unit_en} are there from {start} to {end}?"
        reason = f"Count the days with days_between, then convert them to {unit_en} with the calculator."
    else:
        text = f"从 {start} 到 {end} 有多少{unit_zh}？"
        reason = f"先用 days_between 算天数，再用计算器换算成{unit_zh}。"
    calls = chain(("days_between", {"start": start, "end": end}),
                  lambda r: {"expression": f"{r['days']} * 24" if hours else f"{r['days']} / 7"})
    days, total = calls[0][2]["days"], calls[1][2]["result"]
    said = (f"There are {days} days from {start} to {end}, which is {total} {unit_en}." if lang == "en"
            else f"从 {start} 到 {end} 有 {days} 天，即 {total} {unit_zh}。")
    return finished("days_then_calculate", lang, text, calls, reason, said, total)


def element_then_calculate(rng: random.Random, lang: str) -> Question:
    """A multiple of an element's atomic number: lookup_element, then the calculator."""
    _, _, english, chinese = rng.choice(ELEMENTS)
    count = rng.randint(2, 9)
    name = english if lang == "en" else chinese
    if lang == "en":
        text = f"What is {count} times the atomic number of {english}?"
        reason = f"Look up {english} with lookup_element, then multiply its atomic number by {count}."
    else:
        text = f"{chinese}的原子序数乘以 {count} 是多少？"
        reason = f"先用 lookup_element 查{chinese}，再把原子序数乘以 {count}。"
    calls = chain(("lookup_element", {"name": name}), lambda r: {"expression": f"{r['atomic_number']} * {count}"})
    number, total = calls[0][2]["atomic_number"], calls[1][2]["result"]
    said = (f"The atomic number of {english} is {number}; {count} times that is {total}." if lang == "en"
            else f"{chinese}的原子序数是 {number}，乘以 {count} 是 {total}。")
    return finished("element_then_calculate", lang, text, calls, reason, said, total)


CHAINED = (convert_then_calculate, days_then_calculate, element_then_calculate)


def generate(n: int, rng: random.Random, held: set[str], hold: bool, makers: tuple = MAKERS) -> list[Question]:
    """n questions, the kinds (`makers`) and languages in turn, none whose text is in `held`. hold=True: all
    different, and added to `held`; else a question may come twice (the element table has 240 questions in all)."""
    out: list[Question] = []
    while len(out) < n:
        maker, lang = makers[len(out) % len(makers)], ("en", "zh")[(len(out) // len(makers)) % 2]
        q = maker(rng, lang)
        if q["question"] not in held:
            if hold:
                held.add(q["question"])
            out.append(q)
    return out


def offered_tools(q: Question, rng: random.Random) -> list[dict[str, Any]]:
    """The tools the question needs, and in half the one-call conversations one other, shuffled: a model must read
    which ones fit.
    (Each signature costs 90-150 prompt tokens with the shipped tokenizer: more would not fit a 512-token SFT.)"""
    needed = list(dict.fromkeys(call["name"] for call in q["calls"]))
    others = [name for name in BUNDLED if name not in needed]
    # a chained question's two tools are already a choice to read, and a third would overflow the demo's context
    names = needed + (rng.sample(others, rng.randint(0, 1)) if len(needed) == 1 else [])
    rng.shuffle(names)
    return tool_schemas(names)


def prompt(q: Question, rng: random.Random) -> list[dict[str, Any]]:
    return [{"role": "system", "content": "", "tools": offered_tools(q, rng)},
            {"role": "user", "content": q["question"]}]


def sft_record(q: Question, rng: random.Random) -> dict[str, Any]:
    turns: list[dict[str, Any]] = []
    for call in q["calls"]:  # a chained question: the next call is made from the last one's result
        turns += [{"role": "assistant", "content": "",
                   "tool_calls": [{"name": call["name"], "arguments": call["arguments"]}]},
                  {"role": "tool", "content": call["result"]}]
    if rng.random() < 1 / 3:
        turns[0]["reasoning_content"] = q["reasoning"]
    return {"conversations": prompt(q, rng) + turns + [{"role": "assistant", "content": q["reply"]}],
            "kind": q["kind"], "lang": q["lang"]}


def heldout_record(q: Question, rng: random.Random) -> dict[str, Any]:
    return {"conversations": prompt(q, rng), "answer": q["answer"],
            "tool_call": {"name": q["name"], "arguments": q["arguments"]}, "max_new_tokens": NEW_TOKENS,
            "kind": q["kind"], "lang": q["lang"]}


def write(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out_dir", default=str(ROOT / "dataset" / "demo"))
    p.add_argument("--train", type=int, default=6000, help="SFT conversations with one call")
    p.add_argument("--heldout", type=int, default=200, help="held-out questions with one call")
    p.add_argument("--chained_train", type=int, default=1500, help="SFT conversations with two chained calls")
    p.add_argument("--chained_heldout", type=int, default=60, help="held-out questions with two chained calls")
    p.add_argument("--rl", type=int, default=1200, help="RL prompts (both kinds), none of them held out")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if min(args.train, args.heldout, args.chained_train, args.chained_heldout, args.rl) < 1:
        print("error: --train, --heldout, --chained_train, --chained_heldout and --rl must be at least 1",
              file=sys.stderr)
        return 2
    if args.heldout > 400:  # a fifth are element questions, of which there are 240, half kept for training
        print("error: --heldout is at most 400", file=sys.stderr)
        return 2
    rng, asked = random.Random(args.seed), set()
    held = generate(args.heldout, rng, asked, hold=True)  # first, so that training never asks a held-out question
    train = generate(args.train, rng, asked, hold=False)
    sft = [sft_record(q, rng) for q in train]
    heldout = [heldout_record(q, rng) for q in held]
    # the chained questions and the RL prompts draw from streams of their own: the one-call records above stay
    # what they were before these existed
    chain_rng = random.Random(args.seed + 1)
    held_chained = generate(args.chained_heldout, chain_rng, asked, hold=True, makers=CHAINED)
    train_chained = generate(args.chained_train, chain_rng, asked, hold=False, makers=CHAINED)
    chained_sft = [sft_record(q, chain_rng) for q in train_chained]
    chained_heldout = [heldout_record(q, chain_rng) for q in held_chained]
    rl_rng = random.Random(args.seed + 2)
    rl = [heldout_record(q, rl_rng) for q in generate(args.rl, rl_rng, asked, hold=False, makers=MAKERS + CHAINED)]
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = {"tools_sft.jsonl": sft, "tools_heldout.jsonl": heldout, "tools_chained_sft.jsonl": chained_sft,
             "tools_chained_heldout.jsonl": chained_heldout, "tools_rl.jsonl": rl}
    for name, written in files.items():
        write(out / name, written)
    print(", ".join(f"{name} {len(written)}" for name, written in files.items()) + f" -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
