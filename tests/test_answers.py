"""The judge of generated answers (common/answers.py): numbers as lm-evaluation-harness's gsm8k tasks find and
compare them, texts as SQuAD's scorer normalises them. The harness itself is run on the same outputs in
tests/test_tasks.py (a slow test); these cases pin the behaviour one rule at a time."""
from __future__ import annotations

import pytest

from common.answers import find_number, is_number_answer, judge, normalize_number, normalize_text


@pytest.mark.parametrize("output, gold, answer, correct, stated", [
    (" She sells 9 eggs at $2. So the answer is 18.", "18", "18.", True, True),  # the stated answer, not the last
    (" So the answer is 18. Then 20 more.", "18", "18.", True, True),
    (" 9 eggs, $2 each: 18 dollars", "18", "18", True, False),  # no statement: the last number
    (" The answer is 1,234.", "1234", "1,234.", True, True),  # commas and a final period are ignored
    (" #### 72", "72", "72", True, True),  # GSM8K's own answer line
    (" so the answer is $5", "5", "5", True, True),
    (" she pays $1,800 in all", "1800", "$1,800", True, False),
    (" the answer is 17", "18", "17", False, True),
    (" -3 degrees", "-3", "-3", True, False),
    (" no number at all", "18", None, False, False),
    (" 7 then 8", "7", "8", False, False),  # flexible takes the last number
    ("7 加 5 等于 12。答案是 12。", "12", "12", True, True),
    ("答案是13，不是 12", "13", "13", True, True),  # the stated answer, not the last number
    (" So the answer is 18. Or the answer is 20.", "18", "18.", True, True),  # the first statement counts...
    (" So the answer is 18. Or the answer is 20.", "20", "18.", False, True),  # ...as the harness's gsm8k takes it
])
def test_numbers_are_found_and_compared_as_the_harness_does(output, gold, answer, correct, stated):
    verdict = judge(output, [gold])
    assert (verdict.answer, verdict.correct, verdict.stated) == (answer, correct, stated)


def test_the_harness_regex_filter_picks_the_group_that_matched():
    # FLEXIBLE has two alternatives: a run of 2+ number characters, or a lone digit
    assert find_number("a 5 b", r"(-?[$0-9.,]{2,})|(-?[0-9]+)") == "5"
    assert find_number("a 5 b 12", r"(-?[$0-9.,]{2,})|(-?[0-9]+)", last=True) == "12"
    assert find_number("none", r"(-?[$0-9.,]{2,})|(-?[0-9]+)") is None
    assert normalize_number("Answer: #### $1,000.") == "1000"


@pytest.mark.parametrize("output, golds, correct", [
    (" Justin Timberlake", ["Justin Timberlake"], True),
    (" The Beatles.", ["Beatles"], True),  # articles and punctuation do not count
    (" justin   timberlake", ["Justin Timberlake"], True),
    (" Steve", ["Steve Hale", "Viper"], False),  # exact, not partial
    (" Viper", ["Steve Hale", "Viper"], True),  # any gold answer
])
def test_texts_are_compared_normalised(output, golds, correct):
    assert judge(output, golds).correct is correct and judge(output, golds).stated


def test_the_kind_of_answer_follows_the_gold():
    assert is_number_answer(["18"]) and is_number_answer(["1,234"]) and is_number_answer(["-0.5"])
    assert not is_number_answer(["Paris"]) and not is_number_answer(["18", "eighteen"]) and not is_number_answer([])
    assert normalize_text("The  Eiffel-Tower!") == "eiffeltower"


OUTPUTS = [" She sells 9 eggs at $2. So the answer is 18.", " So the answer is 18. Then 20 more.",
           " 9 eggs, $2 each: 18 dollars", " The answer is 1,234.", " #### 72", " so the answer is $5",
           " she pays $1,800 in all", " the answer is 17", " -3 degrees", " no number at all", " 7 then 8",
           " answer is 3.50", " The answer is -12.\n", " 1.5 or 2, the answer is 2", "", "答案是 7。"]
GOLDS = ["18", "18", "18", "1234", "72", "5", "1800", "18", "-3", "18", "7", "3.50", "-12", "2", "0", "7"]


def test_the_judge_agrees_with_the_harness_filters_and_metric():
    """lm-evaluation-harness's own RegexFilter (strict: first match; flexible: group_select -1) and exact_match
    (REGEXES_TO_IGNORE, case ignored) on the same outputs: the same answers, the same verdicts, and ours is the
    strict one where the output states it, else the flexible one."""
    lm_eval = pytest.importorskip("lm_eval")  # requirements-dev
    from lm_eval.api.metrics import exact_match_hf_evaluate
    from lm_eval.filters.extraction import RegexFilter

    from common.answers import FLEXIBLE_NUMBER, REGEXES_TO_IGNORE, STRICT_NUMBER
    assert lm_eval.__version__
    found = {}
    for name, pattern, group in (("strict", STRICT_NUMBER, 0), ("flexible", FLEXIBLE_NUMBER, -1)):
        harness = RegexFilter(pattern, group_select=group)
        picked = [r[0] for r in harness.apply([[o] for o in OUTPUTS], [{}] * len(OUTPUTS))]
        assert picked == [find_number(o, pattern, last=group == -1) or "[invalid]" for o in OUTPUTS], name
        found[name] = [(p, exact_match_hf_evaluate([p], [g], regexes_to_ignore=list(REGEXES_TO_IGNORE),
                                                   ignore_case=True)["exact_match"]) for p, g in zip(picked, GOLDS)]
    assert sum(m for _, m in found["strict"]) >= 5 and sum(m for _, m in found["flexible"]) >= 5
    for output, gold, strict, flexible in zip(OUTPUTS, GOLDS, found["strict"], found["flexible"]):
        verdict = judge(output, [gold])
        assert verdict.stated == (strict[0] != "[invalid]")
        assert verdict.correct == bool((strict if verdict.stated else flexible)[1]), output
