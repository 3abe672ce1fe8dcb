"""Tool use: reading replies (common/tool_calls.py), the bundled tools (common/tools.py), the tool loop and its
accuracy (evaluation/tool_use.py), tool task files, and the bundled tool-call set (scripts/build_tool_demo.py)."""
from __future__ import annotations

import datetime as dt
import json
import sys

import pytest

import evaluation.tool_use as tool_use
from common.errors import DataError
from common.tool_calls import ToolCall, parse_reply, same_call
from common.tools import BUNDLED, ELEMENTS, Tool, run_tool, tool_schemas
from dataset.tasks import read_task_file
from evaluation.scoring import TaskTotals, score_items, task_table
from evaluation.tool_use import run_tools

from conftest import ROOT, tiny_config, write_jsonl

sys.path.insert(0, str(ROOT / "scripts"))
import build_tool_demo  # noqa: E402

DEMO = ROOT / "dataset" / "demo"


def call_text(name: str, arguments: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


# ---------------------------------------------------------------------- reading replies
def test_reply_with_reasoning_text_and_calls():
    text = ("<think>\nneeds the calculator\n</think>\n\nLet me compute.\n"
            + call_text("calculator", {"expression": "2+3"}) + "\n"
            + call_text("add_days", {"date": "2026-01-01", "days": 3}))
    reply = parse_reply(text)
    assert reply.reasoning == "needs the calculator"
    assert reply.content == "Let me compute."
    assert reply.calls == (ToolCall("calculator", {"expression": "2+3"}),
                           ToolCall("add_days", {"date": "2026-01-01", "days": 3}))
    assert reply.malformed == ()


def test_plain_reply_has_no_reasoning_and_no_calls():
    reply = parse_reply("  Hello there.  ")
    assert (reply.reasoning, reply.content, reply.calls, reply.malformed) == (None, "Hello there.", (), ())


def test_reply_that_starts_inside_an_opened_think_block():
    reply = parse_reply("plan it\n</think>\n\nThe answer is 4.", thinking=True)
    assert (reply.reasoning, reply.content) == ("plan it", "The answer is 4.")
    cut = parse_reply("<think>\nstill thinking when the budget ran out")
    assert (cut.reasoning, cut.content) == ("still thinking when the budget ran out", "")


@pytest.mark.parametrize("body, why", [
    ('{"name": "calculator", "arguments": {"expression": "1+1"}', "not JSON"),
    ('["calculator"]', "not an object"),
    ('{"arguments": {}}', 'no "name"'),
    ('{"name": "", "arguments": {}}', 'no "name"'),  # a blank name is no call
    ('{"name": "  ", "arguments": {"expression": "1+1"}}', 'no "name"'),
    ('{"name": "calculator", "arguments": [1]}', '"arguments" is not an object'),
    ('{"name": "calculator", "arguments": "{oops"}', "string but not JSON"),
])
def test_malformed_calls_stay_text_and_are_never_calls(body, why):
    text = f"Sure.\n<tool_call>\n{body}\n</tool_call>"
    reply = parse_reply(text)
    assert reply.calls == ()
    assert len(reply.malformed) == 1 and why in reply.malformed[0]
    assert body in reply.content  # shown to the user as the model wrote it


def test_truncated_call_is_malformed_and_good_calls_before_it_count():
    text = call_text("calculator", {"expression": "7*6"}) + '\n<tool_call>\n{"name": "calcu'
    reply = parse_reply(text)
    assert reply.calls == (ToolCall("calculator", {"expression": "7*6"}),)
    assert len(reply.malformed) == 1 and "never closed" in reply.malformed[0]
    assert reply.content.startswith("<tool_call>") and "calcu" in reply.content


def test_arguments_as_a_json_string_are_read():
    reply = parse_reply('<tool_call>{"name": "lookup_element", "arguments": "{\\"name\\": \\"iron\\"}"}</tool_call>')
    assert reply.calls == (ToolCall("lookup_element", {"name": "iron"}),)


def test_same_call_ignores_spacing_case_and_number_form_only():
    call = ToolCall("calculator", {"expression": "12*7"})
    assert same_call(call, "calculator", {"expression": "12 * 7"})
    assert not same_call(call, "calculator", {"expression": "12 * 8"})
    assert not same_call(call, "convert_units", {"expression": "12*7"})
    units = ToolCall("convert_units", {"value": 2, "from_unit": "KM", "to_unit": "m"})
    assert same_call(units, "convert_units", {"value": 2.0, "from_unit": "km", "to_unit": "m"})
    assert same_call(units, "convert_units", {"value": "2", "from_unit": "km", "to_unit": "m"})
    assert not same_call(units, "convert_units", {"value": 2, "from_unit": "km", "to_unit": "cm"})
    assert not same_call(units, "convert_units", {"value": 2, "from_unit": "km"})


# ---------------------------------------------------------------------- the bundled tools
def result(tool: str, **arguments) -> dict:
    return json.loads(run_tool(ToolCall(tool, arguments)))


def test_calculator_computes_arithmetic():
    assert result("calculator", expression="347 * 29") == {"result": 10063}
    assert result("calculator", expression="(12 + 3) * 4 - 2 ** 3") == {"result": 52}
    assert result("calculator", expression="10 / 4") == {"result": 2.5}
    assert result("calculator", expression="10 / 3") == {"result": 3.33}
    assert result("calculator", expression="-7 // 2 + 17 % 5") == {"result": -2}
    assert result("calculator", expression="6 × 7 ÷ 2") == {"result": 21}


@pytest.mark.parametrize("expression", [
    "__import__('os').system('true')", "open('x')", "(1).__class__", "x + 1", "[1, 2]", "1 if 1 else 2",
    "lambda: 1", "'a' * 3", "True + 1",
])
def test_calculator_evaluates_no_code(expression):
    assert "error" in result("calculator", expression=expression)


@pytest.mark.parametrize("expression, why", [
    ("1 / 0", "division by zero"), ("9 ** 9 ** 9", "too large"), ("10 ** 20", "out of range"),
    ("1 +", "not an arithmetic expression"), ("1" * 300, "longer than"),
])
def test_calculator_refuses_what_it_cannot_compute(expression, why):
    assert why in result("calculator", expression=expression)["error"]


def test_unit_conversion():
    assert result("convert_units", value=1, from_unit="mi", to_unit="km") == {"result": 1.61, "unit": "km"}
    assert result("convert_units", value=100, from_unit="C", to_unit="f") == {"result": 212, "unit": "f"}
    assert result("convert_units", value=32, from_unit="°F", to_unit="k") == {"result": 273.15, "unit": "k"}
    assert result("convert_units", value=2, from_unit="lb", to_unit="g") == {"result": 907.18, "unit": "g"}
    assert "cannot convert length" in result("convert_units", value=1, from_unit="m", to_unit="kg")["error"]
    assert "unknown unit" in result("convert_units", value=1, from_unit="parsec", to_unit="m")["error"]


def test_dates():
    assert result("add_days", date="2024-02-28", days=2) == {"date": "2024-03-01", "weekday": "Friday"}
    assert result("add_days", date="2026-03-01", days=-1)["date"] == "2026-02-28"
    assert result("days_between", start="2026-01-01", end="2026-12-25") == {"days": 358}
    assert "YYYY-MM-DD" in result("add_days", date="March 3", days=1)["error"]
    assert "out of range" in result("add_days", date="9999-12-31", days=5)["error"]


def test_element_table_by_english_chinese_name_or_symbol():
    iron = {"name": "iron", "name_zh": "铁", "symbol": "Fe", "atomic_number": 26}
    assert result("lookup_element", name="Iron") == iron
    assert result("lookup_element", name="铁") == iron
    assert result("lookup_element", name="fe") == iron
    assert "no element" in result("lookup_element", name="kryptonite")["error"]
    assert len({row[0] for row in ELEMENTS}) == len(ELEMENTS)


@pytest.mark.parametrize("call, why", [
    (ToolCall("rm", {}), "unknown tool"),
    (ToolCall("calculator", {}), "missing expression"),
    (ToolCall("calculator", {"expression": "1", "x": 2}), "unknown x"),
    (ToolCall("add_days", {"date": "2026-01-01", "days": "3"}), "days must be an integer"),
    (ToolCall("add_days", {"date": "2026-01-01", "days": 1.5}), "days must be an integer"),
    (ToolCall("convert_units", {"value": True, "from_unit": "m", "to_unit": "km"}), "value must be a number"),
    (ToolCall("lookup_element", {"name": 3}), "name must be a string"),
])
def test_bad_calls_come_back_as_errors_not_exceptions(call, why):
    out = json.loads(run_tool(call))
    assert why in out["error"]


def test_whole_float_days_are_accepted_as_integers():
    assert result("add_days", date="2026-01-01", days=2.0)["date"] == "2026-01-03"


def test_schemas_are_openai_functions_with_every_parameter_required():
    for schema in tool_schemas():
        function = schema["function"]
        tool = BUNDLED[function["name"]]
        assert schema["type"] == "function"
        assert function["parameters"]["required"] == list(tool.parameters)
        assert set(function["parameters"]["properties"]) == set(tool.parameters)


# An error is what the model reads back instead of a result: each message is checked whole, as written, so that a
# changed word, separator, limit or named argument shows.
@pytest.mark.parametrize("tool, arguments, error", [
    ("calculator", {"expression": "1 / 0"}, "division by zero"),
    ("calculator", {"expression": "1 ** 65"}, "exponent or base too large"),
    ("calculator", {"expression": "1000001 ** 1"}, "exponent or base too large"),
    ("calculator", {"expression": "1000000 ** 64"}, "result out of range"),  # an integer past 1e15
    ("calculator", {"expression": "1000000.0 ** 64"}, "result out of range"),  # a float past ~1.8e308
    ("calculator", {"expression": "x + 1"}, "unsupported in an expression: x"),
    ("convert_units", {"value": 1e308, "from_unit": "km", "to_unit": "mm"}, "result out of range"),  # infinity
    ("convert_units", {"value": 1, "from_unit": "m", "to_unit": "kg"}, "cannot convert length (m) to mass (kg)"),
    ("convert_units", {"value": 1, "from_unit": "parsec", "to_unit": "m"},
     "unknown unit 'parsec' (from_unit); known: m, km, cm, mm, mi, ft, in, yd, kg, g, lb, oz, l, ml, gal, c, f, k"),
    ("add_days", {"date": "March 3", "days": 1}, "date must be a date as YYYY-MM-DD, got 'March 3'"),
    ("add_days", {"date": "9999-12-31", "days": 5}, "date out of range"),
    ("days_between", {"start": "soon", "end": "2026-01-01"}, "start must be a date as YYYY-MM-DD, got 'soon'"),
    ("days_between", {"start": "2026-01-01", "end": "later"}, "end must be a date as YYYY-MM-DD, got 'later'"),
    ("add_days", {"date": "2026-01-01", "days": "三"}, 'add_days: days must be an integer, got "三"'),
    ("convert_units", {"value": 1}, "convert_units takes value, from_unit, to_unit; missing from_unit, to_unit"),
    ("calculator", {"expression": "1", "x": 2, "y": 3}, "calculator takes expression; unknown x, y"),
    ("rm", {}, "unknown tool 'rm'; available: calculator, convert_units, add_days, days_between, lookup_element"),
])
def test_errors_read_back_as_written(tool, arguments, error):
    assert result(tool, **arguments) == {"error": error}


def test_calculator_limits_include_their_bounds():
    """Powers up to an exponent of 64 and a base of a million, results up to 1e15, expressions up to 200
    characters; ^ is a power."""
    assert result("calculator", expression="1 ** 64") == {"result": 1}
    assert result("calculator", expression="(-1000000) ** 1") == {"result": -1000000}
    assert result("calculator", expression="10 ** 15") == {"result": 1_000_000_000_000_000}
    assert result("calculator", expression="1" + " " * 199) == {"result": 1}
    assert result("calculator", expression="2 ^ 10") == {"result": 1024}


def test_every_element_is_found_by_each_of_its_names_with_or_without_the_word_element():
    for number, symbol, english, chinese in ELEMENTS:
        row = {"name": english, "name_zh": chinese, "symbol": symbol, "atomic_number": number}
        for name in (symbol, symbol.upper(), english.capitalize(), f" {chinese} ", f"{chinese}元素",
                     f"{english.capitalize()}元素", f"{symbol}元素"):
            assert result("lookup_element", name=name) == row, name


def test_a_tools_own_failure_is_that_calls_error_and_results_are_strict_json():
    def broken(text: str) -> dict:
        raise RuntimeError("boom")

    registry = {"broken": Tool("broken", "Fails", {"text": ("string", "")}, broken),
                "nan": Tool("nan", "Not a number", {}, lambda: {"result": float("nan")})}
    assert json.loads(run_tool(ToolCall("broken", {"text": "x"}), registry)) == {
        "error": "broken failed: RuntimeError: boom"}
    # NaN is no JSON: a tool that returns it is a bug of the tool, never written out for the model to read
    with pytest.raises(ValueError, match="JSON"):
        run_tool(ToolCall("nan", {}), registry)
    assert '"name_zh": "铁"' in run_tool(ToolCall("lookup_element", {"name": "iron"}))  # characters, not \u escapes


# ---------------------------------------------------------------------- the tool loop
class Scripted:
    """A stand-in for the model: each prompt's next reply from a script, keyed by its conversation's first user
    message; counts the generations."""

    def __init__(self, scripts: dict[str, list[str]]) -> None:
        self.scripts, self.calls = scripts, 0
        self.seen: list[list[dict]] = []

    def encode(self, messages: list[dict]) -> list[int]:
        self.seen.append([dict(m) for m in messages])
        return [len(self.seen) - 1]  # a handle: decode() looks the conversation up

    def generate(self, prompts: list[list[int]], budget: int) -> list[list[int]]:
        self.calls += 1
        return prompts

    def decode(self, ids: list[int]) -> str:
        messages = self.seen[ids[0]]
        user = next(m["content"] for m in messages if m["role"] == "user")
        done = sum(m["role"] == "assistant" for m in messages)
        script = self.scripts[user]
        return script[min(done, len(script) - 1)]


def loop(scripts: dict[str, list[str]], max_rounds: int = 3, max_positions: int = 10_000, budget: int = 10):
    model = Scripted(scripts)
    conversations = [[{"role": "user", "content": user}] for user in scripts]
    encode = lambda messages: model.encode(messages) * (max_positions // 2 if "long" in messages[0]["content"]  # noqa
                                                        else 1)
    return run_tools(model.generate, conversations, encode, model.decode, budget, max_positions, max_rounds), model


def test_loop_runs_calls_and_feeds_results_back():
    runs, model = loop({"q": [call_text("calculator", {"expression": "6*7"}), "6*7 = 42. The answer is 42."]})
    run = runs[0]
    assert [m["role"] for m in run.messages] == ["user", "assistant", "tool", "assistant"]
    assert run.messages[1]["tool_calls"] == [{"name": "calculator", "arguments": {"expression": "6*7"}}]
    assert json.loads(run.messages[2]["content"]) == {"result": 42}
    assert run.final == "6*7 = 42. The answer is 42." and not run.capped and model.calls == 2


def test_loop_stops_at_the_round_cap_without_running_the_last_calls():
    always = [call_text("calculator", {"expression": "1+1"})]
    runs, model = loop({"q": always}, max_rounds=2)
    run = runs[0]
    assert run.capped
    assert sum(m["role"] == "tool" for m in run.messages) == 2  # two rounds ran, the third reply's call did not
    assert len(run.replies) == 3 and model.calls == 3


def test_loop_batches_conversations_and_ends_each_on_its_own():
    runs, model = loop({"direct": ["The answer is 5."],
                        "one call": [call_text("lookup_element", {"name": "gold"}), "The answer is 79."]})
    assert [len(r.replies) for r in runs] == [1, 2]
    assert model.calls == 2  # round one for both, round two for the one still going


def test_malformed_calls_are_not_run():
    runs, _ = loop({"q": ['<tool_call>\n{"name": "calculator"\n</tool_call>']})
    assert [m["role"] for m in runs[0].messages] == ["user", "assistant"]
    assert runs[0].replies[0].malformed


def test_conversation_too_long_for_the_model_ends_as_overflow():
    runs, model = loop({"long question": ["never generated"]}, max_positions=100, budget=60)
    assert runs[0].overflow and runs[0].replies == [] and model.calls == 0


# ---------------------------------------------------------------------- tool tasks
def tool_item(question: str, answer: str, name: str, arguments: dict, **extra) -> dict:
    return {"conversations": [{"role": "system", "content": "", "tools": tool_schemas([name])},
                              {"role": "user", "content": question}],
            "answer": answer, "tool_call": {"name": name, "arguments": arguments}, **extra}


def test_tool_items_are_scored_on_the_call_and_the_answer(tmp_path, monkeypatch, tokenizer):
    right = call_text("calculator", {"expression": "6 * 7"})
    script = {  # question -> (replies with tools, reply without)
        "six times seven": ([right, "The answer is 42."], "The answer is 41."),
        "wrong arguments": ([call_text("calculator", {"expression": "6 + 7"}), "The answer is 13."], "42"),
        "wrong tool": ([call_text("lookup_element", {"name": "6"}), "The answer is 6."], "no idea"),
        "malformed": (['<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}\n</tool_call>'], ""),
        "never ends": ([right], ""),
    }
    path = write_jsonl(tmp_path / "tools.jsonl", [tool_item(q, "42", "calculator", {"expression": "6*7"},
                                                            max_tool_rounds=2) for q in script])
    task = read_task_file(path)
    assert task.kind == "tools"

    def fake_greedy(model, tok, batch_size, autocast):
        def run(prompts, budget):
            out = []
            for ids in prompts:
                text = tokenizer.decode(ids)
                question = next(q for q in script if q in text)
                replies, bare = script[question]
                rounds = text.count("<tool_response>")
                out.append(tokenizer.encode(replies[min(rounds, len(replies) - 1)] if "<tools>" in text else bare))
            return out
        return run

    monkeypatch.setattr(tool_use, "greedy", fake_greedy)
    model = type("M", (), {"config": tiny_config(max_position_embeddings=4096)})()
    score = score_items(model, task.name, task.kind, task.items, tokenizer)
    by_id = {s["id"]: s for s in score.samples}
    flags = [(by_id[f"tools.jsonl:{i + 1}"]["valid"], by_id[f"tools.jsonl:{i + 1}"]["right_tool"],
              by_id[f"tools.jsonl:{i + 1}"]["right_call"], by_id[f"tools.jsonl:{i + 1}"]["correct"],
              by_id[f"tools.jsonl:{i + 1}"]["bare"]) for i in range(len(script))]
    assert flags == [(True, True, True, True, False),  # the right call, the right answer; 41 without tools
                     (True, True, False, False, True),  # right tool, wrong arguments; 42 said without tools
                     (True, False, False, False, False),
                     (False, False, False, False, False),  # malformed: no call, no answer
                     (True, True, True, False, False)]  # calls until the cap: no final answer
    assert by_id["tools.jsonl:5"]["capped"]
    assert (score.call_valid, score.call_tool, score.call_acc, score.acc, score.bare_acc) == (0.8, 0.6, 0.4, 0.2, 0.2)
    table = task_table([score])
    assert "right call" in table and "acc without tools" in table


def test_tool_totals_add_up_across_ranks():
    a = TaskTotals("tools", 3, correct=2, valid=3, right_tool=3, right_call=2, bare=1)
    b = TaskTotals("tools", 2, correct=1, valid=1, right_tool=1, right_call=1, bare=0)
    summed = TaskTotals.from_list("tools", [x + y for x, y in zip(a.as_list(), b.as_list())])
    score = summed.score("t")
    assert (score.items, score.acc, score.call_valid, score.call_acc, score.bare_acc) == (5, 0.6, 0.8, 0.6, 0.2)


@pytest.mark.parametrize("change, message", [
    ({"tool_call": {"name": "calculator"}}, '"tool_call" must be'),
    ({"tool_call": "calculator"}, '"tool_call" must be'),
    ({"conversations": [{"role": "user", "content": "hi"}]}, "offers its tools"),
    ({"max_tool_rounds": 0}, '"max_tool_rounds" must be'),
    ({"answer": 42}, '"answer" must be'),
])
def test_bad_tool_items_name_file_and_line(tmp_path, change, message):
    good = tool_item("q", "1", "calculator", {"expression": "1"})
    path = write_jsonl(tmp_path / "t.jsonl", [good, {**good, **change}])
    with pytest.raises(DataError, match=rf"t\.jsonl:2: .*{message}"):
        read_task_file(path)


# ---------------------------------------------------------------------- the bundled tool-call set
def records(name: str) -> list[dict]:
    return [json.loads(line) for line in open(DEMO / name, encoding="utf-8")]


BUNDLED_FILES = ("tools_sft.jsonl", "tools_heldout.jsonl", "tools_chained_sft.jsonl", "tools_chained_heldout.jsonl",
                 "tools_rl.jsonl")
CHAINED_KINDS = {"convert_then_calculate", "days_then_calculate", "element_then_calculate"}


def test_bundled_set_is_reproducible(tmp_path):
    assert build_tool_demo.main(["--out_dir", str(tmp_path)]) == 0
    for name in BUNDLED_FILES:
        assert (tmp_path / name).read_bytes() == (DEMO / name).read_bytes(), name


def test_bundled_heldout_questions_are_never_trained_on():
    def questions(*names: str) -> list[str]:
        return [r["conversations"][1]["content"] for name in names for r in records(name)]

    asked = set(questions("tools_sft.jsonl", "tools_chained_sft.jsonl", "tools_rl.jsonl"))
    held, chained = questions("tools_heldout.jsonl"), questions("tools_chained_heldout.jsonl")
    assert len(set(held)) == len(held) == 200 and len(set(chained)) == len(chained) == 60
    assert not asked & set(held + chained)
    kinds = {r["kind"] for r in records("tools_rl.jsonl")}
    assert CHAINED_KINDS < kinds and len(kinds) == 8  # the RL prompts hold every kind
    assert {r["kind"] for r in records("tools_chained_heldout.jsonl")} == CHAINED_KINDS


def test_bundled_chained_conversations_make_the_second_call_from_the_first_result():
    for r in records("tools_chained_sft.jsonl")[:300]:
        messages = r["conversations"]
        offered = {t["function"]["name"] for t in messages[0]["tools"]}
        calls = [m["tool_calls"][0] for m in messages if m.get("tool_calls")]
        results = [json.loads(m["content"]) for m in messages if m["role"] == "tool"]
        assert r["kind"] in CHAINED_KINDS and len(calls) == len(results) == 2 and {c["name"] for c in calls} == offered
        for c, result in zip(calls, results):
            assert result == json.loads(run_tool(ToolCall(c["name"], c["arguments"])))
        first = next(v for k, v in results[0].items() if k in ("result", "days", "atomic_number"))
        assert calls[1]["name"] == "calculator" and calls[1]["arguments"]["expression"].startswith(f"{first} ")
        answer = messages[-1]["content"].rsplit(" ", 1)[-1].rstrip(".。")
        assert answer == str(results[1]["result"]), r


def test_bundled_answers_are_the_tools_results_and_calls_fit_the_question():
    for r in records("tools_sft.jsonl")[:400] + records("tools_heldout.jsonl"):
        messages = r["conversations"]
        offered = [t["function"]["name"] for t in messages[0]["tools"]]
        if "tool_call" in r:
            call, answer = r["tool_call"], r["answer"]
        else:
            call = messages[2]["tool_calls"][0]
            answer = messages[4]["content"].rsplit(" ", 1)[-1].rstrip(".。")
            assert messages[3]["content"] == run_tool(ToolCall(call["name"], call["arguments"]))
        assert call["name"] in offered and 1 <= len(offered) <= 2
        out = json.loads(run_tool(ToolCall(call["name"], call["arguments"])))
        assert str(answer) in {str(v) for v in out.values()}, (r, out)
        question = messages[1]["content"]
        for value in call["arguments"].values():  # every argument is read off the question (units: by name)
            if isinstance(value, (int, float)) or call["name"] != "convert_units":
                assert str(abs(value) if isinstance(value, int) else value) in question.replace("×", "*").replace(
                    "÷", "/") or call["name"] == "calculator", (question, call)
        if call["name"] == "add_days":
            start = dt.date.fromisoformat(call["arguments"]["date"])
            assert out["date"] == (start + dt.timedelta(days=call["arguments"]["days"])).isoformat()


def test_bundled_conversations_fit_the_recipe_context(tokenizer):
    longest = max(len(tokenizer.encode_chat(r["conversations"])[0]) for r in records("tools_sft.jsonl"))
    assert longest <= 672  # recipes/demo-tool-sft.yaml's max_seq_len: nothing is cut
    chained = max(len(tokenizer.encode_chat(r["conversations"])[0]) for r in records("tools_chained_sft.jsonl"))
    assert chained <= 768  # recipes/demo-agent-sft.yaml's


# ---------------------------------------------------------------------- eval_model.py --tools
def saved_model(root, stage: str):
    from dataset.tokenizer import DEFAULT_TOKENIZER_DIR
    from model import PocketLM, save_model
    save_model(PocketLM(tiny_config(vocab_size=6400, max_position_embeddings=2048)), root,
               tokenizer_dir=DEFAULT_TOKENIZER_DIR)
    (root / "train_info.json").write_text(json.dumps({"stage": stage}))
    return root


def scripted_eval(monkeypatch, replies: list[str]) -> list[list[int]]:
    """eval_model's generation replaced by `replies` in turn (the last one repeated); returns the prompts."""
    import eval_model
    prompts: list[list[int]] = []

    def new_ids(self, batch, max_new_tokens, on_text=None):
        prompts.extend(batch)
        return [self.tok.encode(replies.pop(0) if len(replies) > 1 else replies[0]) for _ in batch]

    monkeypatch.setattr(eval_model.Evaluator, "new_ids", new_ids)
    return prompts


def test_eval_model_tools_runs_the_calls_and_prints_each_turn(tmp_path, monkeypatch, capsys, tokenizer):
    import eval_model
    run = saved_model(tmp_path / "chat", "sft")
    prompts = scripted_eval(monkeypatch, ["<think>\nuse it\n</think>\n\n" + call_text("calculator", {
        "expression": "6 * 7"}), "6 * 7 = 42. The answer is 42."])
    assert eval_model.main(["--checkpoint", str(run), "--tools", "--prompt", "What is 6 * 7?"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [">>> What is 6 * 7?", "[thinking] use it", '[tool call] calculator({"expression": "6 * 7"})',
                   '[tool result] {"result": 42}', "6 * 7 = 42. The answer is 42."]
    first, second = (tokenizer.decode(p) for p in prompts)
    assert all(f'"name": "{name}"' in first for name in BUNDLED)  # every bundled tool offered
    assert '<tool_response>\n{"result": 42}\n</tool_response>' in second


def test_eval_model_tools_stops_at_the_round_cap(tmp_path, monkeypatch, capsys):
    import eval_model
    run = saved_model(tmp_path / "chat", "sft")
    scripted_eval(monkeypatch, [call_text("calculator", {"expression": "1 + 1"})])
    assert eval_model.main(["--checkpoint", str(run), "--tools", "--max_tool_rounds", "2", "--prompt", "loop"]) == 0
    captured = capsys.readouterr()
    assert captured.out.count("[tool result]") == 2 and captured.out.count("[tool call]") == 3
    assert "stopped after 2 rounds of tool calls" in captured.err


def test_eval_model_tools_needs_a_chat_checkpoint_and_a_generation_mode(tmp_path, capsys):
    import eval_model
    text_run = saved_model(tmp_path / "text", "pretrain")
    assert eval_model.main(["--checkpoint", str(text_run), "--tools", "--prompt", "hi"]) == 2
    assert "--tools needs a chat checkpoint" in capsys.readouterr().err
    assert eval_model.main(["--checkpoint", str(text_run), "--tools", "--ppl", str(DEMO / "tools_sft.jsonl")]) == 2
    assert "--tools: with --prompt or --chat" in capsys.readouterr().err


def test_a_tool_task_file_scores_through_eval_model(tmp_path, capsys):
    import eval_model
    run = saved_model(tmp_path / "chat", "sft")
    out = tmp_path / "scores.json"
    assert eval_model.main(["--checkpoint", str(run), "--task_file", str(DEMO / "tools_heldout.jsonl"), "--limit",
                            "4", "--out", str(out)]) == 0
    assert "| tools_heldout | 4 |" in capsys.readouterr().out
    [task] = json.loads(out.read_text())["tasks"]
    assert task["items"] == 4 and {"call_acc", "bare_acc", "call_valid"} <= set(task)
    assert len(task["samples"]) == 4 and all("turns" in s for s in task["samples"])
