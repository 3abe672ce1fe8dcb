"""Properties that must hold for any input, checked on inputs Hypothesis generates (and shrinks to the smallest
that fails): where the input space is too large for tests by example.

The default profile keeps each property to a few dozen examples so the suite stays fast, and draws them the same
way on every run (derandomized: a red CI run is the code's, never the draw's); `HYPOTHESIS_PROFILE=thorough` runs
many more, freshly drawn, to look for new failures (which then become @example cases here). `make mutate` runs
them as `mutation`: the default's examples, not shrunk (a mutant is killed by the first failure; shrinking it
would take minutes of mutmut's time limit).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os

import pytest
import torch
from hypothesis import Phase, assume, example, given, settings
from hypothesis import strategies as st

from common.errors import ConfigError, TrainingError
from common.tool_calls import parse_reply
from common.tools import BUNDLED, ToolCall, ToolError, calculator, run_tool
from dataset.ingest.split import split_document
from dataset.tokenizer import chat_turns
from trainer_utils.budget import (
    HIGH,
    LOW,
    TARGET,
    BudgetPlan,
    Costs,
    count_due,
    make_plan,
    parse_duration,
    replanned_end,
)
from trainer_utils.optim import WarmupCosine

settings.register_profile("default", max_examples=60, deadline=None, derandomize=True)
settings.register_profile("thorough", max_examples=2000, deadline=None)
settings.register_profile("mutation", max_examples=60, deadline=None, derandomize=True,
                          phases=(Phase.explicit, Phase.reuse, Phase.generate))
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

# Text made of what decides where a document is cut: paragraph and line breaks, sentence ends (English and
# Chinese), spaces, and runs of letters too long for any boundary.
TEXT = st.lists(st.sampled_from(["A", "word", " ", "\n", "\n\n", ". ", "。", "中文", "x" * 37]),
                max_size=80).map("".join)


@given(text=TEXT, max_chars=st.integers(min_value=1, max_value=60))
def test_split_document_ends_keeps_the_text_in_order_and_keeps_to_max_chars(text, max_chars):
    """Every record is at most max_chars long (a run with no boundary is cut between characters), and the records
    are the text's own pieces in order, with nothing but whitespace between them: nothing lost, nothing repeated.
    (A long paragraph followed by more text once recursed until RecursionError.)"""
    records = split_document(text, max_chars)
    assert all(0 < len(r) <= max_chars for r in records)
    position = 0
    for record in records:
        found = text.find(record, position)
        assert found >= 0 and text[position:found].strip() == "", (record, text[position:found])
        position = found + len(record)
    assert text[position:].strip() == ""


def test_a_paragraph_longer_than_max_chars_then_more_text_is_split():
    """The two inputs that recursed forever at the default max_chars, by example."""
    for text in ("A" * 9000 + "\n\nnext", "word " * 2000 + "\n\nnext"):
        records = split_document(text, 8000)
        assert records[-1] == "next" and all(len(r) <= 8000 for r in records)
        assert "".join(records).replace(" ", "") == text.replace(" ", "").replace("\n", "")


# Arithmetic-looking text: numbers at the edges of the calculator's limits, every operator it knows and some it
# does not, brackets, and the × ÷ ^ it rewrites.
EXPRESSION = st.one_of(
    st.text(max_size=40),
    st.lists(st.sampled_from(["1", "9", "0", "1e6", "999999", "1e308", "64", "65", ".5", "+", "-", "*", "/", "//",
                              "%", "**", "^", "(", ")", " ", "×", "÷", "x", "'a'", "[1]"]), max_size=25).map("".join))


@given(EXPRESSION)
@example("1e6**64")  # float overflow inside the limits on base and exponent: once an OverflowError escaped
@example("1e400")  # a constant that is already infinite
@example("\x00")  # a NUL byte: the parser raised ValueError, not SyntaxError (found by a freshly drawn run)
def test_the_calculator_gives_a_finite_number_or_a_tool_error(expression):
    try:
        result = calculator(expression)
    except ToolError:
        return
    assert isinstance(result["result"], (int, float)) and math.isfinite(result["result"])


def reject_non_json(constant: str):
    raise AssertionError(f"{constant} is not JSON")


# A tool's arguments as a model might write them: the right names with values of any JSON type (often of the
# right one, to reach the tool's own code), or names of its own.
VALUE = st.one_of(st.text(max_size=30), st.integers(), st.floats(), st.booleans(), st.none(),
                  st.dates().map(str), st.sampled_from(["km", "mm", "°C", "f", "oz", "gal", "铁", "gold", "U"]),
                  st.lists(st.integers(), max_size=2))
CALL = st.one_of(
    st.sampled_from(sorted(BUNDLED)).flatmap(lambda name: st.tuples(
        st.just(name), st.fixed_dictionaries({p: VALUE for p in BUNDLED[name].parameters}))),
    st.tuples(st.sampled_from([*sorted(BUNDLED), "no_such_tool"]),
              st.dictionaries(st.text(max_size=8), VALUE, max_size=3)))


@given(CALL)
@example(("calculator", {"expression": "1e6**64"}))
@example(("convert_units", {"value": 1e308, "from_unit": "km", "to_unit": "mm"}))
@example(("add_days", {"date": "2026-01-01", "days": 10**30}))
def test_every_bundled_tool_answers_any_call_with_a_json_object(call):
    """run_tool never raises for the model's input: a result, or {"error": ...}, as strict JSON."""
    name, arguments = call
    answer = json.loads(run_tool(ToolCall(name, arguments)), parse_constant=reject_non_json)
    assert isinstance(answer, dict) and answer


@given(hours=st.integers(0, 48), minutes=st.integers(0, 59), seconds=st.integers(0, 59),
       parts=st.sets(st.sampled_from("hms"), min_size=1), upper=st.booleans())
def test_a_duration_is_the_sum_of_its_parts(hours, minutes, seconds, parts, upper):
    """'1h30m', '90s', '2H5S' ...: the parts written, added up by hand; zero is refused."""
    values = {"h": hours, "m": minutes, "s": seconds}
    text = "".join(f"{values[u]}{u}" for u in "hms" if u in parts)
    text = text.upper() if upper else text
    expected = sum(values[u] * {"h": 3600, "m": 60, "s": 1}[u] for u in parts)
    if expected == 0:
        try:
            parse_duration(text)
        except ConfigError:
            return
        raise AssertionError(f"{text!r} parsed as a budget")
    assert parse_duration(text) == expected


@given(st.text(max_size=12))
@example("1h-30m")
@example("nan")
def test_any_text_is_a_duration_or_a_config_error(text):
    try:
        seconds = parse_duration(text)
    except ConfigError:
        return
    assert 0 < seconds < float("inf")


@given(after=st.integers(0, 300), length=st.integers(0, 300), interval=st.integers(1, 50))
def test_count_due_counts_what_a_loop_over_the_steps_counts(after, length, interval):
    """The steps after+1 .. end that are a multiple of the interval, or the last: counted one by one."""
    end = after + length
    assert count_due(after, end, interval) == sum(1 for k in range(after + 1, end + 1) if k % interval == 0 or k == end)


# Text that is not markup: the template's own tags are what the reader looks for.
PLAIN = st.text(st.characters(blacklist_characters="<>", blacklist_categories=("Cs", "Cc")), max_size=40)
ARGUMENT = st.one_of(st.integers(-10**6, 10**6), st.booleans(), PLAIN, st.floats(allow_nan=False,
                                                                                  allow_infinity=False))
CALLS = st.lists(st.fixed_dictionaries({"name": st.from_regex(r"[a-z][a-z_]{0,15}", fullmatch=True),
                                        "arguments": st.dictionaries(st.from_regex(r"[a-z]{1,8}", fullmatch=True),
                                                                     ARGUMENT, max_size=3)}), max_size=3)


@given(content=PLAIN, reasoning=st.none() | PLAIN, calls=CALLS)
def test_an_assistant_turn_reads_back_as_the_chat_template_wrote_it(content, reasoning, calls):
    """The template writes <think>, content and <tool_call> blocks (dataset/tokenizer.py); the reply reader
    (common/tool_calls.py) must give back the same reasoning, content and calls, in order."""
    message = {"role": "assistant", "content": content, "tool_calls": calls}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    role, body, _ = chat_turns([message])[-1]
    reply = parse_reply(body)
    assert role == "assistant" and reply.malformed == ()
    assert reply.content.strip() == content.strip()
    assert [(c.name, c.arguments) for c in reply.calls] == [(c["name"], c["arguments"]) for c in calls]
    if reasoning is not None:
        assert reply.reasoning is not None and reply.reasoning.strip() == reasoning.strip()


# A time budget's plan (trainer_utils/budget.py) for any measured costs: what the run would spend, added up step by
# step here (not with the plan's own arithmetic).
def spends(plan: BudgetPlan, after: int, end: int, step_s: float) -> float:
    """Seconds from step `after` (trained; its own evaluation and checkpoint, when due, still to come) to the end
    of step `end`, counted one step at a time."""
    seconds = 0.0
    for s in range(max(after, 1), end + 1):
        seconds += step_s if s > after else 0.0
        due = lambda interval: s % interval == 0 or s == end  # noqa: E731
        seconds += plan.eval_s * due(plan.eval_interval) + plan.save_s * due(plan.save_interval)
    return seconds


SECONDS = st.floats(min_value=0.0, max_value=20.0)
PLANS = st.fixed_dictionaries({
    "budget_s": st.floats(min_value=30.0, max_value=3000.0), "spent_share": st.floats(min_value=0.0, max_value=0.5),
    "step_s": st.floats(min_value=0.05, max_value=20.0), "first_extra_s": SECONDS, "eval_s": SECONDS,
    "save_s": SECONDS, "start_s": SECONDS, "limit": st.integers(1, 3000), "eval_interval": st.integers(1, 500),
    "save_interval": st.none() | st.integers(1, 500)})


def make(p: dict) -> BudgetPlan:
    costs = Costs(p["step_s"], p["first_extra_s"], p["eval_s"], p["save_s"], 3, p["start_s"])
    return make_plan(p["budget_s"], p["spent_share"] * p["budget_s"], costs, p["limit"], p["eval_interval"],
                     p["save_interval"])


@given(PLANS)
def test_a_plan_is_the_longest_run_that_ends_by_its_target(p):
    """The run the plan makes (set-up, start, first step's extra, steps with their evaluations and checkpoints)
    ends by TARGET of the budget, one step more would not (unless the limit stops it), and when a step with its
    evaluation and checkpoint is small next to the budget it ends no earlier than LOW: inside the guard's band.
    A plan that leaves no step is refused, and then not even one step fits."""
    spent = p["spent_share"] * p["budget_s"]
    fixed = spent + p["start_s"] + p["first_extra_s"]
    try:
        plan = make(p)
    except TrainingError:
        one = dataclasses.replace(
            make_plan(1e12, 0.0, Costs(1.0, 0.0, 0.0, 0.0, 3), 1, p["eval_interval"], p["save_interval"]),
            eval_s=p["eval_s"], save_s=p["save_s"] if p["save_interval"] else 0.0)
        assert fixed + spends(one, 0, 1, p["step_s"]) > TARGET * p["budget_s"]
        return
    end = fixed + spends(plan, 0, plan.steps, plan.step_s)
    assert 1 <= plan.steps <= p["limit"] and end <= TARGET * p["budget_s"] + 1e-9
    if plan.steps < p["limit"]:
        assert fixed + spends(plan, 0, plan.steps + 1, plan.step_s) > TARGET * p["budget_s"]
        if p["step_s"] + p["eval_s"] + p["save_s"] <= (TARGET - LOW) * p["budget_s"]:
            assert end >= LOW * p["budget_s"]


@given(p=PLANS, at=st.floats(min_value=0.0, max_value=1.0), late=st.floats(min_value=0.0, max_value=0.4),
       speed=st.floats(min_value=0.2, max_value=5.0))
def test_a_replan_ends_in_the_band_or_as_early_as_it_can(p, at, late, speed):
    """At any step, with the budget spent so far and a new step time: the plan is kept only when its end is
    projected inside [LOW, HIGH] of the budget (or early, when no step more is allowed or fits; or late, when it
    ends at this step already); a new end is the most steps that end by TARGET, or this very step when none does."""
    try:
        plan = make(p)
    except TrainingError:
        return
    step = round(at * plan.steps)
    step_s = plan.step_s * speed
    spent = min(plan.budget_s, p["spent_share"] * plan.budget_s + step * plan.step_s * (1 + late))
    budget, new = plan.budget_s, replanned_end(plan, step, spent, step_s)
    if new is None:
        at_end = spent + spends(plan, step, plan.end, step_s)
        # early is kept when no more steps are allowed, or one more would overrun (steps too coarse for the band)
        no_more = plan.end >= plan.limit or spent + spends(plan, step, plan.end + 1, step_s) > TARGET * budget
        in_band = LOW * budget - 1e-6 <= at_end <= HIGH * budget + 1e-6
        assert in_band or (at_end < LOW * budget and no_more) or (at_end > HIGH * budget and plan.end == step)
        return
    assert step <= new <= plan.limit and new != plan.end
    if new > step:
        assert spent + spends(plan, step, new, step_s) <= TARGET * budget + 1e-9
    if new < plan.limit:
        assert spent + spends(plan, step, new + 1, step_s) > TARGET * budget


@given(total=st.integers(1, 400), warmup=st.integers(0, 100),
       replans=st.lists(st.tuples(st.floats(0.0, 1.0), st.integers(0, 400)), max_size=4))
def test_a_replanned_schedule_keeps_its_past_decays_without_jumps_and_ends_at_min_lr(total, warmup, replans):
    """Any sequence of re-plans (each from a step already reached, to any later end) of a schedule that decays
    (a warm-up shorter than its steps): the learning rates already used never change, past the peak they never
    rise, and the last step's is the minimum."""
    assume(warmup < total)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    schedule = WarmupCosine(opt, max_lr=1.0, min_lr=0.1, warmup=warmup, total=total)
    step = 0
    for where, extra in replans:
        before = [schedule.lr_at(s) for s in range(step + 1)]
        step += round(where * (schedule.end - step))
        schedule.end_at(step, step + extra)
        assert [schedule.lr_at(s) for s in range(len(before))] == before
    end = schedule.end
    lrs = [schedule.lr_at(s) for s in range(end + 1)]
    peak = max(range(end + 1), key=lambda s: (lrs[s], -s))
    assert all(a >= b - 1e-12 for a, b in zip(lrs[peak:], lrs[peak + 1:]))
    if end > step:  # (one stopped where it stood keeps the rate it had)
        assert lrs[end] == pytest.approx(0.1)
