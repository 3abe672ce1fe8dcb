"""Rollouts that call tools (trainer_utils/rollouts.py sample_tool_rollouts) and what the agent stage reads of its
prompts: the token sequence is the template's, only the replies are trained, the round cap, malformed calls,
unknown or unoffered tools (prompts of one batch offering different ones), replies cut off, rollouts that outgrow
the context (at its exact bound), keyed sampling, the policy's device and temperature, the rewards, and prompt files
that offer bad or unknown tools. The training runs themselves: tests/test_agent_training.py."""
from __future__ import annotations

import json

import pytest
import torch

import trainer_utils.rollouts as rollouts_mod
from common.errors import DataError
from common.tokens import IGNORE_INDEX
from common.tools import BUNDLED, tool_schemas
from dataset.jsonl import read_records
from dataset.prompts import PromptDataset
from model import PocketLM
from trainer_utils.rewards import BUILTIN, Completion
from trainer_utils.rollouts import keyed_uniforms, sample_tool_rollouts
from trainer_utils.stages.agent import offered_tools

from conftest import ROOT, tiny_config, write_jsonl

CALC = {"calculator": BUNDLED["calculator"]}


def call(name: str, **arguments) -> str:
    return '<tool_call>\n{"name": "' + name + '", "arguments": ' + json.dumps(arguments) + "}\n</tool_call>"


def prompt_messages(question: str = "What is 2 + 3?", tools: tuple[str, ...] = ("calculator",)) -> list[dict]:
    return [{"role": "system", "content": "", "tools": tool_schemas(list(tools))},
            {"role": "user", "content": question}]


class Scripted:
    """Stands in for model.generate: each row's reply is its script's entry for the round it is in (the number of
    tool results its prompt holds so far), encoded with the tokenizer and ended by <|im_end|>, or cut at the
    token budget or at the first token the rollout's `stop` marks; every sampled token's log-probability is -0.5. A
    script may be {text in the prompt: script}. Records each call's rows and uniforms."""

    def __init__(self, tok, script: list[str] | dict[str, list[str]], end: bool = True) -> None:
        self.tok, self.script, self.end, self.calls = tok, script, end, []

    def __call__(self, model, prompts, max_new_tokens, temperature=1.0, pad_token_id=0, stop=None, uniforms=None,
                 log_probs=None):
        self.calls.append(([list(p) for p in prompts], uniforms))
        out = []
        for p in prompts:
            text = self.tok.decode(p)
            script = self.script if isinstance(self.script, list) else \
                next(v for k, v in self.script.items() if k in text)
            round_ = text.count("<tool_response>")
            ids = self.tok.encode(script[min(round_, len(script) - 1)]) + [self.tok.im_end_id] * self.end
            ids = ids[:max_new_tokens]
            # as model.generate does: the row ends at the first token `stop` marks, which it keeps
            ends = [k for k, t in enumerate(ids) if stop(torch.tensor([t]), torch.tensor([True]))[0]]
            out.append(ids[:ends[0] + 1] if ends else ids)
            log_probs.append([-0.5] * len(out[-1]))
        return out


@pytest.fixture
def model():
    return torch.nn.Linear(1, 1)  # sample_tool_rollouts reads only its device; generation is scripted


def rollout(monkeypatch, tok, script, model, tools=(CALC,), group=1, max_rounds=3, max_new_tokens=64,
            max_len=2048, end=True, keys=None, question="What is 2 + 3?"):
    fake = Scripted(tok, script, end)
    monkeypatch.setattr(rollouts_mod, "generate", fake)
    prompts = [tok.chat_prompt(prompt_messages(question)) for _ in tools]
    out = sample_tool_rollouts(model, prompts, group, max_new_tokens, max_rounds, max_len, tok, list(tools),
                               row_keys=keys)
    return out, prompts, fake


def test_the_training_row_is_the_templates_conversation_and_only_replies_are_targets(monkeypatch, tokenizer, model):
    script = [call("calculator", expression="2 + 3"), "2 + 3 = 5. The answer is 5."]
    out, [prompt], _ = rollout(monkeypatch, tokenizer, script, model)
    use = out.uses[0]
    assert (use.calls, use.errors, use.malformed, use.answered) == (1, 0, 0, True)
    assert out.finals == ["2 + 3 = 5. The answer is 5."]
    assert [m["role"] for m in use.turns] == ["assistant", "tool", "assistant"]
    assert json.loads(use.turns[1]["content"]) == {"result": 5}
    # the whole row, token for token, is what the chat template writes for the finished conversation
    conversation = prompt_messages() + list(use.turns)
    expected = tokenizer.encode_chat(conversation)[0][:-1]  # up to the last reply's <|im_end|>
    inputs, targets, old = out.rows.unpacked(0)
    assert inputs + targets[-1:] == expected
    # the targets are the replies' tokens (their <|im_end|> included), nothing of the prompt or the tool's turn
    labelled = tokenizer.encode_chat(conversation)[1][1:len(expected)]
    assert [t != IGNORE_INDEX for t in targets] == labelled
    assert out.policy_tokens == [sum(labelled)]
    assert all(o == (-0.5 if t != IGNORE_INDEX else 0) for o, t in zip(old, targets))
    assert int((out.rows.targets != IGNORE_INDEX).sum()) == sum(labelled)  # nothing in the padding


def test_tool_results_ids_are_what_the_template_writes_after_a_turn(tokenizer):
    """Every tool round of the bundled chained SFT conversations: prompt + reply + tool_results(...) equals the
    template's encoding of the conversation up to the next reply."""
    for line in (ROOT / "dataset/demo/tools_chained_sft.jsonl").read_text(encoding="utf-8").splitlines()[:20]:
        turns = json.loads(line)["conversations"]
        for i, turn in enumerate(turns):
            if turn["role"] != "assistant" or not turn.get("tool_calls"):
                continue
            j = next(k for k in range(i + 1, len(turns) + 1) if k == len(turns) or turns[k]["role"] != "tool")
            before = tokenizer.chat_prompt(turns[:i])
            reply = tokenizer.encode_chat(turns[:i + 1])[0][len(before):-1]  # through <|im_end|>
            assert reply[-1] == tokenizer.im_end_id
            assert before + reply + tokenizer.tool_results(turns[i + 1:j]) == tokenizer.chat_prompt(turns[:j])


def test_a_rollout_that_keeps_calling_is_capped_with_no_answer(monkeypatch, tokenizer, model):
    out, _, fake = rollout(monkeypatch, tokenizer, [call("calculator", expression="1 + 1")], model, max_rounds=2)
    use = out.uses[0]
    assert use.capped and not use.answered and use.calls == 2 and out.finals == [""]
    assert len(fake.calls) == 3  # two rounds of calls run, the third reply's calls not
    assert [m["role"] for m in use.turns] == ["assistant", "tool", "assistant", "tool", "assistant"]
    completion = Completion("", out.policy_tokens[0], 64, {"answer": "2"}, use)
    assert BUILTIN["exact"](completion) == 0 and BUILTIN["tool_use"](completion) == 0


def test_malformed_calls_unknown_and_unoffered_tools_are_outcomes_not_errors(monkeypatch, tokenizer, model):
    script = ["<tool_call>\nnot json\n</tool_call>"]
    out, _, _ = rollout(monkeypatch, tokenizer, script, model)
    use = out.uses[0]
    assert (use.calls, use.malformed, use.answered) == (0, 1, True)  # no call: the reply is the answer
    for name, why in (("weather", "unknown tool"), ("add_days", "unknown tool")):  # add_days: bundled, not offered
        script = [call(name, date="2024-01-01", days=3), "The answer is 5."]
        out, _, _ = rollout(monkeypatch, tokenizer, script, model)
        use = out.uses[0]
        assert (use.calls, use.errors, use.answered) == (1, 1, True), name
        assert why in json.loads(use.turns[1]["content"])["error"]
        completion = Completion(out.finals[0], out.policy_tokens[0], 64, {"answer": "5"}, use)
        assert BUILTIN["exact"](completion) == 1 and BUILTIN["tool_use"](completion) == 0  # the error costs it


def test_a_reply_cut_off_by_its_budget_ends_the_rollout_unanswered(monkeypatch, tokenizer, model):
    script = [call("calculator", expression="2 + 3")]
    out, _, _ = rollout(monkeypatch, tokenizer, script, model, max_new_tokens=8)
    use = out.uses[0]
    assert use.cut and not use.answered and use.calls == 0 and out.finals == [""] and out.rows.truncated == [True]


def test_a_rollout_stops_when_its_next_reply_might_not_fit(monkeypatch, tokenizer, model):
    prompt = tokenizer.chat_prompt(prompt_messages())
    script = [call("calculator", expression="2 + 3"), "The answer is 5."]
    out, _, fake = rollout(monkeypatch, tokenizer, script, model, max_len=len(prompt) + 64 + 10)
    use = out.uses[0]
    assert use.overflow and use.calls == 1 and not use.answered and len(fake.calls) == 1


def test_rounds_are_keyed_per_row_whatever_the_batch(monkeypatch, tokenizer, model):
    """Round k of row r draws with the key (*row_keys[r], k): the numbers do not depend on which rows share the
    batch (here one row ends after its first reply, the other goes on alone)."""
    keys = [(1, 2, 3, 0, 0), (1, 2, 3, 1, 0)]
    fake = Scripted(tokenizer, {"2 + 3": [call("calculator", expression="2 + 3"), "The answer is 5."],
                                "4 + 4": ["The answer is 8."]})
    monkeypatch.setattr(rollouts_mod, "generate", fake)
    prompts = [tokenizer.chat_prompt(prompt_messages()), tokenizer.chat_prompt(prompt_messages("What is 4 + 4?"))]
    out = sample_tool_rollouts(model, prompts, 1, 64, 3, 2048, tokenizer, [CALC, CALC], row_keys=keys)
    assert out.finals == ["The answer is 5.", "The answer is 8."]
    (rows_1, first), (rows_2, second) = fake.calls
    assert len(rows_1) == 2 and len(rows_2) == 1
    assert torch.equal(first, keyed_uniforms([(*k, 0) for k in keys], 64, "cpu"))
    assert torch.equal(second, keyed_uniforms([(*keys[0], 1)], 64, "cpu"))


def test_real_sampling_of_a_row_does_not_depend_on_its_batch_mates(tokenizer):
    torch.manual_seed(0)
    model = PocketLM(tiny_config(vocab_size=tokenizer.vocab_size, max_position_embeddings=1024)).eval()
    prompts = [tokenizer.chat_prompt(prompt_messages(q)) for q in ("What is 2 + 3?", "计算 7 * 8。")]
    keys = [(5, 1, 0, i, g) for i in range(2) for g in range(2)]
    both = sample_tool_rollouts(model, prompts, 2, 12, 2, 1024, tokenizer, [CALC, CALC], row_keys=keys)
    alone = sample_tool_rollouts(model, prompts[1:], 2, 12, 2, 1024, tokenizer, [CALC], row_keys=keys[2:])
    assert both.rows.completions[2:] == alone.rows.completions
    for i in range(2):
        torch.testing.assert_close(torch.tensor(both.rows.unpacked(2 + i)[2]), torch.tensor(alone.rows.unpacked(i)[2]),
                                   atol=1e-6, rtol=0)
    assert both.rows.completions[0] != both.rows.completions[1]  # each member of a group draws its own


def test_the_tool_use_reward_pays_only_well_formed_calls_that_led_to_the_right_answer():
    from trainer_utils.rewards import ToolUse
    done = ToolUse((), calls=2, malformed=0, errors=0)
    for use, expected in ((done, 1.0), (ToolUse((), 0, 0, 0), 0.0), (ToolUse((), 1, 1, 0), 0.0),
                          (ToolUse((), 1, 0, 1), 0.0), (ToolUse((), 3, 0, 0, capped=True), 0.0),
                          (ToolUse((), 1, 0, 0, cut=True), 0.0), (ToolUse((), 1, 0, 0, overflow=True), 0.0),
                          (None, 0.0)):
        assert BUILTIN["tool_use"](Completion("The answer is 5.", 10, 64, {"answer": "5"}, use)) == expected, use
    # one clean call and a wrong answer (calculator("1"), then a guess): in a group where nobody is right, paying
    # it would make that the best rollout of the group
    assert BUILTIN["tool_use"](Completion("The answer is 7.", 10, 64, {"answer": "5"}, done)) == 0.0
    assert BUILTIN["tool_use"](Completion("The answer is 5.", 10, 64, {}, done)) == 0.0  # nothing to check against


def test_prompts_offering_bad_or_unknown_tools_stop_naming_the_line(tmp_path, tokenizer):
    good = {"conversations": prompt_messages(), "answer": "5"}
    no_name = {"conversations": [{"role": "system", "content": "", "tools": [{"type": "function", "function":
                                  {"description": "x"}}]}, {"role": "user", "content": "hi"}], "answer": "1"}
    path = write_jsonl(tmp_path / "bad.jsonl", [good, no_name])
    with pytest.raises(DataError, match=rf"{path}:2: turn 0 tool 0 is not a function schema"):
        list(read_records(path, "prompt"))
    weather = {"conversations": prompt_messages(), "answer": "5"}
    weather["conversations"][0]["tools"] = tool_schemas(["calculator"]) + [
        {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    path = write_jsonl(tmp_path / "unknown.jsonl", [good, good, weather])
    data = PromptDataset(path, tokenizer, 1024)
    with pytest.raises(DataError, match=rf"{path}:3: offers tool 'get_weather', which is not one of the bundled"):
        offered_tools(data)
    data = PromptDataset(write_jsonl(tmp_path / "ok.jsonl", [good, {"prompt": "What is 1 + 1?", "answer": "2"}]),
                         tokenizer, 1024)
    assert [list(t) for t in offered_tools(data)] == [["calculator"], list(BUNDLED)]  # no tools offered: all


def test_a_row_never_outgrows_max_len_when_a_tools_result_does_not_fit(monkeypatch, tokenizer, model):
    """Overflow was judged before the tools' results were appended, so a long result made a row longer than
    max_len (past the context the model was built for). A result that does not fit ends the rollout unanswered,
    the row as it was before it."""
    from common.tools import Tool
    long = {"lookup": Tool("lookup", "Look up", {"term": ("string", "")}, lambda term: {"result": "word " * 300})}
    prompt = tokenizer.chat_prompt(prompt_messages())
    max_new_tokens = 64
    max_len = len(prompt) + max_new_tokens + 20  # the reply fits, its 300-word result does not
    out, _, _ = rollout(monkeypatch, tokenizer, [call("lookup", term="x"), "The answer is 5."], model,
                        tools=(long,), max_new_tokens=max_new_tokens, max_len=max_len)
    use = out.uses[0]
    inputs, targets, _ = out.rows.unpacked(0)
    assert len(inputs) + 1 <= max_len
    assert use.overflow and not use.answered and use.calls == 1 and out.finals == [""]
    assert [m["role"] for m in use.turns] == ["assistant"]  # the result that did not fit is not in the row


def test_each_prompt_of_a_batch_runs_only_the_tools_it_offers(monkeypatch, tokenizer, model):
    """Prompts of one batch offer different tools (in their text and as their registries): every rollout runs its
    calls with its own prompt's tools, and a call to a tool its prompt does not offer is refused for that prompt,
    though the batch's other prompt offers it. Two rollouts per prompt, so a row confused with its prompt shows."""
    offered = (("calculator",), ("add_days",))
    prompts = [tokenizer.chat_prompt(prompt_messages("What is 2 + 3?", tools)) for tools in offered]
    tools = [{name: BUNDLED[name] for name in names} for names in offered]
    both = call("calculator", expression="2 + 3") + "\n" + call("add_days", date="2024-01-01", days=3)
    monkeypatch.setattr(rollouts_mod, "generate", Scripted(tokenizer, [both, "Done."]))
    out = sample_tool_rollouts(model, prompts, 2, 128, 3, 2048, tokenizer, tools)
    refused = {"error": "unknown tool 'add_days'; available: calculator"}, \
        {"error": "unknown tool 'calculator'; available: add_days"}
    expected = [[{"result": 5}, refused[0]]] * 2 + [[refused[1], {"date": "2024-01-04", "weekday": "Thursday"}]] * 2
    assert [[json.loads(m["content"]) for m in use.turns if m["role"] == "tool"] for use in out.uses] == expected
    assert [(use.calls, use.errors, use.answered) for use in out.uses] == [(2, 1, True)] * 4


def reply_and_result_lengths(tok, reply: str, result: dict) -> tuple[int, int]:
    """The tokens a reply takes (its <|im_end|> included) and those its tool's result adds after it."""
    return len(tok.encode(reply)) + 1, len(tok.tool_results([{"role": "tool", "content": json.dumps(result)}]))


def test_a_rollout_goes_on_while_its_results_and_next_reply_fit_exactly(monkeypatch, tokenizer, model):
    """max_len is a bound that may be reached: the results fit when they end exactly at it (the rollout then stops,
    as no reply fits after them), and the next reply's whole budget fits when it ends exactly at it."""
    prompt = tokenizer.chat_prompt(prompt_messages())
    script = [call("calculator", expression="2 + 3"), "The answer is 5."]
    reply, result = reply_and_result_lengths(tokenizer, script[0], {"result": 5})
    used = len(prompt) + reply + result  # after the first round
    turns = lambda use: [m["role"] for m in use.turns]  # noqa: E731
    for max_len, roles, overflow in ((used + reply, ["assistant", "tool", "assistant"], False),
                                     (used + reply - 1, ["assistant", "tool"], True),
                                     (used, ["assistant", "tool"], True), (used - 1, ["assistant"], True)):
        # each reply's budget: the first reply's length
        out, _, _ = rollout(monkeypatch, tokenizer, script, model, max_new_tokens=reply, max_len=max_len)
        assert (turns(out.uses[0]), out.uses[0].overflow) == (roles, overflow), max_len


def test_malformed_blocks_and_errors_add_up_over_rounds(monkeypatch, tokenizer, model):
    bad = "\n<tool_call>\nnot json\n</tool_call>"
    script = [call("weather", city="Paris") + bad, call("calculator", formula="1") + bad, "The answer is 5."]
    out, _, _ = rollout(monkeypatch, tokenizer, script, model)
    use = out.uses[0]
    assert (use.calls, use.errors, use.malformed, use.answered) == (2, 2, 2, True)


def test_a_rollout_that_ends_in_a_round_does_not_end_its_batch_mates(monkeypatch, tokenizer, model):
    """The first row of the batch is capped (calls left at the last round), or its tools' results do not fit: the
    row after it still gets its reply, its calls run."""
    prompts = [tokenizer.chat_prompt(prompt_messages(q)) for q in ("What is 2 + 3?", "What is 4 + 4?")]
    script = {"2 + 3": [call("calculator", expression="2 + 3")], "4 + 4": ["The answer is 8."]}
    monkeypatch.setattr(rollouts_mod, "generate", Scripted(tokenizer, script))
    out = sample_tool_rollouts(model, prompts, 1, 64, 0, 2048, tokenizer, [CALC, CALC])
    assert out.uses[0].capped and out.finals == ["", "The answer is 8."]
    from common.tools import Tool
    long = {"lookup": Tool("lookup", "Look up", {"term": ("string", "")}, lambda term: {"result": "word " * 300})}
    script = {"2 + 3": [call("lookup", term="x")], "4 + 4": [call("calculator", expression="4 + 4"), "8."]}
    monkeypatch.setattr(rollouts_mod, "generate", Scripted(tokenizer, script))
    out = sample_tool_rollouts(model, prompts, 1, 64, 3, len(prompts[1]) + 300, tokenizer, [long, CALC])
    assert out.uses[0].overflow and out.finals == ["", "8."] and out.uses[1].calls == 1


def test_tool_rollouts_need_a_key_per_row(tokenizer, model):
    with pytest.raises(ValueError, match="^1 row keys for 2 rows$"):
        sample_tool_rollouts(model, [[1, 2]], 2, 8, 1, 64, tokenizer, [CALC], row_keys=[(0,)])


def test_tool_rollouts_are_made_on_the_policys_device(monkeypatch, tokenizer):
    """The rows, the keyed numbers and the stop test on the policy's device (the "meta" device, which the CPU
    cannot pass for)."""
    seen = []
    answer = tokenizer.encode("The answer is 5.") + [tokenizer.im_end_id]

    def fake_generate(model, prompts, max_new_tokens, stop=None, uniforms=None, log_probs=None, **_):
        tokens = torch.full((len(prompts),), tokenizer.im_end_id, device="meta")
        seen.extend([uniforms.device, stop(tokens, torch.ones(len(prompts), dtype=torch.bool, device="meta")).device])
        log_probs.extend([[-0.5] * len(answer)] * len(prompts))
        return [answer] * len(prompts)

    monkeypatch.setattr(rollouts_mod, "generate", fake_generate)
    out = sample_tool_rollouts(torch.nn.Linear(1, 1, device="meta"), [tokenizer.chat_prompt(prompt_messages())], 1,
                               64, 3, 2048, tokenizer, [CALC], row_keys=[(0,)])
    rows = out.rows
    fields = (rows.inputs, rows.positions, rows.segment, rows.targets, rows.old_log_probs, rows.members)
    assert {t.device.type for t in fields} == {"meta"} and {d.type for d in seen} == {"meta"}


def test_tool_rollouts_sample_from_the_policy_at_temperature_one_by_default(tokenizer):
    """The sampler's log-probabilities, kept for the importance ratio, are the policy's own (a full forward's
    log-softmax), or those of softmax(logits / temperature) when a temperature is given."""
    from trainer_utils.objectives import token_log_probs
    torch.manual_seed(0)
    model = PocketLM(tiny_config(vocab_size=tokenizer.vocab_size, max_position_embeddings=1024)).eval()
    prompt = tokenizer.chat_prompt(prompt_messages())
    for temperature in (None, 2.0):
        given = {} if temperature is None else {"temperature": temperature}
        out = sample_tool_rollouts(model, [prompt], 1, 6, 1, 1024, tokenizer, [CALC], row_keys=[(3,)], **given)
        inputs, targets, old = out.rows.unpacked(0)
        with torch.no_grad():
            logits = model(torch.tensor([inputs])) / (temperature or 1.0)
        policy = token_log_probs(logits, torch.tensor([targets]))[0]
        torch.testing.assert_close(torch.tensor(old), policy, atol=1e-4, rtol=0)
