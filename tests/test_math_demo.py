"""The bundled verifiable task (scripts/build_math_demo.py, dataset/demo/math_*.jsonl): reproducible, the held-out
questions never trained on, every answer right, and the files readable as what they are for."""
from __future__ import annotations

import json
import re
import sys

import pytest

from common.answers import judge
from dataset.tasks import read_task_file

from conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import build_math_demo  # noqa: E402

DEMO = ROOT / "dataset" / "demo"


def recompute(question: str) -> int:
    """The answer worked out again from the question's text, independently of the generator."""
    numbers = [int(n) for n in re.findall(r"\d+", question)]
    if "+" in question or "加" in question:
        return numbers[0] + numbers[1]
    if " - " in question or "减" in question:
        return numbers[0] - numbers[1]
    if any(w in question for w in ("larger", "largest", "哪个大", "最大")):
        return max(numbers)
    if any(w in question for w in ("smaller", "smallest", "哪个小", "最小")):
        return min(numbers)
    if "after" in question or "后面" in question:
        return numbers[0] + 1
    quoted = re.findall(r"[\"“](.+?)[\"”]", question)
    if "appear" in question or "里有几个" in question:
        return max(quoted, key=len).count(min(quoted, key=len))  # the run, the letter: in either order
    return len(quoted[0])  # letters of a word, characters of a Chinese word


def records(name: str) -> list[dict]:
    return [json.loads(line) for line in open(DEMO / name, encoding="utf-8")]


def test_the_shipped_files_are_what_the_script_writes(tmp_path):
    assert build_math_demo.main(["--out_dir", str(tmp_path)]) == 0
    for name in ("math_train.jsonl", "math_heldout.jsonl", "math_sft.jsonl"):
        assert (tmp_path / name).read_bytes() == (DEMO / name).read_bytes(), name
    assert build_math_demo.main(["--out_dir", str(tmp_path / "other"), "--seed", "1"]) == 0
    assert (tmp_path / "other" / "math_heldout.jsonl").read_bytes() != (DEMO / "math_heldout.jsonl").read_bytes()


def test_held_out_questions_are_never_trained_on_and_every_answer_is_right():
    train, held, sft = records("math_train.jsonl"), records("math_heldout.jsonl"), records("math_sft.jsonl")
    question = lambda r: r["conversations"][0]["content"]  # noqa: E731
    assert not {question(r) for r in train} & {question(r) for r in held}
    assert [question(r) for r in sft] == [question(r) for r in train]
    assert {(r["kind"], r["lang"]) for r in held} == {(r["kind"], r["lang"]) for r in train}  # every kind, both
    for r in train + held:
        assert int(r["answer"]) == recompute(question(r)), question(r)
    for r, s in zip(train, sft):  # the worked answers state the right answer, as the judge reads it
        verdict = judge(s["conversations"][1]["content"], [r["answer"]])
        assert verdict.correct and verdict.stated, s


def test_the_files_read_as_a_generation_task_and_as_sft_conversations():
    from dataset.jsonl import validate_conversations
    task = read_task_file(DEMO / "math_heldout.jsonl")
    assert task.kind == "generate" and len(task.items) == len(records("math_heldout.jsonl"))
    assert task.items[0].messages[0][0] == "user" and task.items[0].max_new_tokens == build_math_demo.NEW_TOKENS
    for r in records("math_sft.jsonl"):
        validate_conversations(r)


def test_a_bad_heldout_size_is_refused(tmp_path, capsys):
    assert build_math_demo.main(["--out_dir", str(tmp_path), "--heldout", "0"]) == 2
    assert capsys.readouterr().err.startswith("error: --heldout must be between 1 and")
    with pytest.raises(SystemExit):
        build_math_demo.main(["--heldout", "many"])
