"""Final answers in generated text: what a model answered, and whether it is right.

The judge of generation tasks (eval_model.py --tasks gsm8k, naturalqs_open, ...), and the verifiable reward of
reinforcement learning. A gold answer is one of two kinds:

    number (GSM8K): the model's answer is the number it states after "the answer is", "####" or "答案是" (the
        format the few-shot examples teach: "strict"), else the last number it wrote ("flexible"). Both are found and
        compared as lm-evaluation-harness's gsm8k tasks do (its `regex` filters, then `exact_match` with
        REGEXES_TO_IGNORE and case ignored), so the two agree item by item (tests/test_tasks.py runs the harness).
    text (Natural Questions, SQuAD, ...): the whole output, normalised as SQuAD's scorer does (lower case, no
        punctuation, no articles, single spaces), equals one of the gold answers normalised the same way
        (`judge`); a reply's answer (`answer_right`: tool use, rewards) may also be stated, "The answer is
        2023-02-01."

An item is of the number kind when every gold answer is a number once normalised.
"""
from __future__ import annotations

import re
import string
from dataclasses import dataclass
from typing import Any, Sequence

# What the harness's gsm8k tasks use (one pattern for its two prompt formats: "So the answer is 18." and "#### 18",
# and the Chinese "答案是 18"). STRICT takes the first statement, FLEXIBLE the last number-like run ("$1,234.5", or a
# lone digit).
STRICT_NUMBER = r"(?:answer is|####|答案是)\s*\$?(-?[0-9.,]+)"
FLEXIBLE_NUMBER = r"(-?[$0-9.,]{2,})|(-?[0-9]+)"
REGEXES_TO_IGNORE = (",", r"\$", r"(?s).*#### ", r"\.$")  # removed from both sides before comparing
_NUMBER = re.compile(r"-?[0-9]*\.?[0-9]+")
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def gold_answers(value: Any, key: str = "answer") -> tuple[str, ...]:
    """A record's right answers: a string, or a non-empty list of strings; ValueError naming `key` otherwise."""
    answers = [value] if isinstance(value, str) else value
    if not isinstance(answers, list) or not answers or not all(isinstance(a, str) for a in answers):
        raise ValueError(f'"{key}" must be a string or a list of strings (the right answers), got {value!r}')
    return tuple(answers)


def find_number(text: str, pattern: str, last: bool = False) -> str | None:
    """The first (or last) match of `pattern` in `text`, stripped; of a pattern with alternative groups, the
    group that matched (the harness's regex filter). None when nothing matches."""
    matches = re.findall(pattern, text)
    if not matches:
        return None
    match = matches[-1 if last else 0]
    if isinstance(match, tuple):
        match = next((group for group in match if group), "")
    return match.strip()


def stated_numbers(text: str) -> list[str]:
    """Every number the text states in the taught format, normalised, in order."""
    return [normalize_number(m.strip()) for m in re.findall(STRICT_NUMBER, text)]


def normalize_number(text: str) -> str:
    """A number as the harness compares it: REGEXES_TO_IGNORE removed in turn, lower-cased."""
    for pattern in REGEXES_TO_IGNORE:
        text = re.sub(pattern, "", text)
    return text.lower()


def normalize_text(text: str) -> str:
    """SQuAD's answer normalisation: lower case, punctuation and articles dropped, whitespace collapsed."""
    return " ".join(_ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION)).split())


def is_number_answer(answers: Sequence[str]) -> bool:
    """Whether gold answers are judged as numbers (every one is a number once normalised)."""
    return bool(answers) and all(_NUMBER.fullmatch(normalize_number(a.strip())) for a in answers)


@dataclass(frozen=True)
class Verdict:
    """What the judge made of one output: the answer it read (None: none found), whether it is right, and
    whether the output stated it in the taught format (a number after "the answer is"; always True for text)."""

    answer: str | None
    correct: bool
    stated: bool


def judge(output: str, answers: Sequence[str]) -> Verdict:
    """Judge a generated `output` against the gold `answers` (any one of them is right)."""
    if is_number_answer(answers):
        gold = {normalize_number(a.strip()) for a in answers}
        strict = find_number(output, STRICT_NUMBER)
        answer = strict if strict is not None else find_number(output, FLEXIBLE_NUMBER, last=True)
        return Verdict(answer, answer is not None and normalize_number(answer) in gold, strict is not None)
    answer = normalize_text(output)
    return Verdict(answer, answer in {normalize_text(a) for a in answers}, True)


_STATED_TEXT = re.compile(r"(?:answer is|答案是)\s*(.+?)\s*[.。!！]?\s*$", re.IGNORECASE | re.DOTALL)


def answer_right(output: str, answers: Sequence[str], stated_only: bool = False) -> bool:
    """Whether a reply reached a right answer. Numbers as `judge` reads them; a text answer (a date, a name)
    stated as "the answer is X" / "答案是 X" must be X, and without a statement must appear among the reply's
    words (normalised as SQuAD's), since a reply built on a tool's result is a sentence ending with the answer.

    stated_only (a reward's judge, trainer_utils/rewards.py): an unstated text answer counts only as the whole
    reply, never as one of its words, since a policy paid for a gold answer anywhere in its words learns to
    list candidates."""
    if is_number_answer(answers):
        return judge(output, answers).correct
    golds = {normalize_text(a) for a in answers}
    stated = _STATED_TEXT.search(output)
    if stated:
        return normalize_text(stated.group(1)) in golds
    if stated_only:
        return normalize_text(output) in golds
    words = f" {normalize_text(output)} "
    return any(gold and f" {gold} " in words for gold in golds)
