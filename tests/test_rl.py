"""Reinforcement learning's pieces, against hand-written references: the policy losses (GRPO's clipped surrogate,
CISPO's clipped importance weight, the k3 KL), masking of prompt and padding tokens, the group-normalised
advantages, and the checked rewards."""
from __future__ import annotations

import contextlib
import json
import math
import re

import numpy as np
import pytest
import torch

from common.answers import answer_right
from common.errors import ConfigError
from common.tokens import IGNORE_INDEX
from trainer_utils.objectives import PolicyGradient, token_log_probs
from trainer_utils.rewards import Completion, group_advantages, parse_reward, score

B, T, V = 2, 5, 7


class Logits(torch.nn.Module):
    """A "policy" that is its logits: each token's log-probability is a parameter of its own."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.logits = torch.nn.Parameter(torch.randn(B, T, V))

    def forward(self, x: torch.Tensor, position_ids=None, attention_mask=None, return_router: bool = False,
                logits_at: torch.Tensor | None = None):
        logits = self.logits if logits_at is None else self.logits[logits_at]
        return (logits, None) if return_router else logits


def batch(policy: Logits, old_shift: torch.Tensor | float = 0.0, advantages=(1.0, -1.0), reference=None):
    """Targets on positions 2..4 of row 0 and 2..3 of row 1 (a prompt before, padding after); old log-probs
    are the policy's own minus `old_shift` (ratio = exp(old_shift))."""
    x = torch.zeros(B, T, dtype=torch.long)
    y = torch.full((B, T), IGNORE_INDEX)
    y[0, 2:5], y[1, 2:4] = torch.tensor([1, 2, 3]), torch.tensor([4, 5])
    with torch.no_grad():
        old = token_log_probs(policy.logits, y) - old_shift
    per_token = torch.tensor(advantages)[:, None].expand(B, T).clone()  # each row one completion
    parts = [x, y, old, per_token, None, None]
    return (*parts, reference) if reference is not None else tuple(parts)


def loss_and_grad(objective, policy, b):
    policy.zero_grad()
    out = objective(policy, b, contextlib.nullcontext)
    out.loss.backward()
    return out, policy.logits.grad.clone()


@pytest.mark.parametrize("loss_type", ["grpo", "cispo"])
def test_at_the_first_step_the_ratio_is_one_and_the_gradient_is_reinforce(loss_type):
    """Sampled by the policy being trained (old = current): loss = -sum(A) over completion tokens, and the
    gradient is that of -sum(A * log pi(token)), REINFORCE's."""
    policy = Logits()
    b = batch(policy)
    out, grad = loss_and_grad(PolicyGradient(loss_type), policy, b)
    mask = (b[1] != IGNORE_INDEX).float()
    assert PolicyGradient(loss_type).count(b) == 5
    if loss_type == "grpo":
        assert out.loss.item() == pytest.approx(-(b[3] * mask).sum().item())
    assert out.metrics["ratio"].item() == pytest.approx(5.0) and out.metrics["clip_frac"].item() == 0
    policy.zero_grad()
    (-(b[3] * token_log_probs(policy.logits, b[1])) * mask).sum().backward()
    torch.testing.assert_close(grad, policy.logits.grad)


def test_grpo_clips_on_both_sides_in_the_advantage_direction():
    """ratio 1.5 (above 1 + 0.2): clipped (no gradient) where A > 0, kept where A < 0; ratio 0.5 (below 1 - 0.2):
    clipped where A < 0, kept where A > 0. The clipped tokens' loss is -clip(ratio) * A."""
    for shift, clipped_row in ((math.log(1.5), 0), (math.log(0.5), 1)):
        policy = Logits()
        b = batch(policy, shift, advantages=(2.0, -3.0))
        out, grad = loss_and_grad(PolicyGradient("grpo", epsilon=0.2, epsilon_high=0.2), policy, b)
        ratio = math.exp(shift)
        bound = 1.2 if ratio > 1 else 0.8
        a = (2.0, -3.0)
        kept_row = 1 - clipped_row
        tokens = (3, 2)
        expected = -(bound * a[clipped_row] * tokens[clipped_row] + ratio * a[kept_row] * tokens[kept_row])
        assert out.loss.item() == pytest.approx(expected, rel=1e-5)
        assert grad[clipped_row].abs().sum() == 0 and grad[kept_row].abs().sum() > 0
        assert out.metrics["clip_frac"].item() == tokens[clipped_row]


@pytest.mark.parametrize("epsilon, epsilon_high", [(0.1, 0.3), (0.3, 0.1)])
def test_grpos_lower_and_upper_clip_bounds_are_each_their_own(epsilon, epsilon_high):
    """Asymmetric bounds (clip-higher): the lower bound is 1 - epsilon and the upper 1 + epsilon_high, never the
    other's. Ratio 0.8 with A < 0 is clipped only under 1 - 0.1; ratio 1.2 with A > 0 only over 1 + 0.1."""
    low, high = 1 - epsilon, 1 + epsilon_high
    a, tokens = (2.0, -1.0), (3, 2)
    for ratio in (0.8, 1.2):
        policy = Logits()
        b = batch(policy, math.log(ratio), advantages=a)
        out, grad = loss_and_grad(PolicyGradient("grpo", epsilon=epsilon, epsilon_high=epsilon_high), policy, b)
        clipped = (ratio > high, ratio < low)  # row 0 (A > 0) is clipped above, row 1 (A < 0) below
        assert any(clipped) == (ratio == 0.8 and epsilon == 0.1 or ratio == 1.2 and epsilon_high == 0.1)
        weight = [min(max(ratio, low), high) if clipped[row] else ratio for row in (0, 1)]
        expected = -sum(weight[row] * a[row] * tokens[row] for row in (0, 1))
        assert out.loss.item() == pytest.approx(expected, rel=1e-5)
        for row in (0, 1):
            assert (grad[row].abs().sum() == 0) == clipped[row], (ratio, row)


def test_cispo_clips_the_weight_and_keeps_every_gradient():
    """ratio 1.5 > 1 + epsilon_high: the weight is 1.2, held fixed; the gradient is -1.2 * A * d log pi for every
    completion token, whatever the advantage's sign."""
    policy = Logits()
    b = batch(policy, math.log(1.5), advantages=(2.0, -3.0))
    out, grad = loss_and_grad(PolicyGradient("cispo", epsilon_high=0.2), policy, b)
    mask = (b[1] != IGNORE_INDEX).float()
    assert out.metrics["clip_frac"].item() == 5
    policy.zero_grad()
    (-(1.2 * b[3] * token_log_probs(policy.logits, b[1])) * mask).sum().backward()
    torch.testing.assert_close(grad, policy.logits.grad)
    assert grad[0].abs().sum() > 0 and grad[1].abs().sum() > 0


def test_prompt_and_padding_tokens_neither_count_nor_learn():
    policy = Logits()
    b = batch(policy, math.log(1.3))
    out, grad = loss_and_grad(PolicyGradient("grpo"), policy, b)
    other = list(b)
    other[2] = b[2].clone()
    other[2][b[1] == IGNORE_INDEX] = -50.0  # nonsense old log-probs where nothing is learned
    out2, _ = loss_and_grad(PolicyGradient("grpo"), policy, tuple(other))
    assert out.loss.item() == pytest.approx(out2.loss.item())
    # a prompt or padding position's logits get no gradient
    assert grad[0, :2].abs().sum() == 0 and grad[1, :2].abs().sum() == 0 and grad[1, 4].abs().sum() == 0


def test_the_kl_to_the_reference_is_the_k3_estimator():
    policy = Logits()
    b = batch(policy)
    logp = token_log_probs(policy.logits, b[1]).detach()
    mask = b[1] != IGNORE_INDEX
    same = PolicyGradient("grpo", beta=0.1)(policy, (*b, logp.clone()), contextlib.nullcontext)
    assert same.metrics["kl"].item() == pytest.approx(0.0, abs=1e-6)
    reference = logp - 0.5 * mask  # the reference likes every completion token less
    out = PolicyGradient("grpo", beta=0.1)(policy, (*b, reference), contextlib.nullcontext)
    k3 = math.exp(-0.5) + 0.5 - 1  # exp(r) - r - 1 at r = -0.5
    assert out.metrics["kl"].item() == pytest.approx(5 * k3, rel=1e-5)
    assert out.loss.item() == pytest.approx(same.loss.item() + 0.1 * 5 * k3, rel=1e-5)


def test_group_advantages_compare_each_prompts_completions():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 3.0])
    got = group_advantages(rewards, 4, eps=0.0 + 1e-4)
    assert got[:4].tolist() == pytest.approx([1, -1, -1, 1], rel=1e-3)  # mean 0.5, std 0.5
    assert got[4:8].tolist() == [0.0] * 4  # all alike: nothing to prefer
    assert got[8:].tolist() == pytest.approx([-0.57735, -0.57735, -0.57735, 1.73205], rel=1e-3)
    assert group_advantages(rewards, 4, scale=False)[8:].tolist() == pytest.approx([-0.75, -0.75, -0.75, 2.25])
    with pytest.raises(ValueError, match="do not make groups of 5"):
        group_advantages(rewards, 5)


def completion(text, answer="12", tokens=10, budget=40):
    return Completion(text, tokens, budget, {"answer": answer})


def test_built_in_rewards_check_the_answer_the_format_and_the_length():
    terms = parse_reward("exact, format=0.5, length=0.25")
    done = [completion("7 + 5 = 12. The answer is 12."), completion("7 + 5 = 13. The answer is 13."),
            completion("It is 12"), completion("答案是 12。"), completion("12", tokens=30), completion("12", tokens=40)]
    total, parts = score(terms, done)
    assert parts["exact"].tolist() == [1, 0, 1, 1, 1, 1]
    assert parts["format"].tolist() == [1, 1, 0, 1, 0, 0]
    assert parts["length"].tolist() == pytest.approx([0, 0, 0, 0, -0.5, -1])  # free up to half the budget
    assert total.tolist() == pytest.approx([1.5, 0.5, 1, 1.5, 1 - 0.125, 1 - 0.25])
    assert score(parse_reward("exact"), [completion("Paris.", answer=["Paris", "paris, france"])])[0].item() == 1
    # hedging does not pay: different stated numbers score 0; one number stated twice is right, but not the format
    hedged = [completion("The answer is 12. The answer is 4."), completion("答案是 12。 The answer is 12.")]
    _, parts = score(terms, hedged)
    assert parts["exact"].tolist() == [0, 1] and parts["format"].tolist() == [0, 0]


def test_the_exact_reward_judges_a_stated_date_or_name_as_the_evaluation_does():
    """A tool rollout's final reply ends "The answer is 2023-02-01." (add_days) or "The answer is W." (an element's
    symbol): the evaluation counts them right (common/answers.answer_right), so the reward must too, or a whole
    kind of question pays nothing however it is answered. Listing candidates, which the evaluation's unstated
    fallback would accept, does not pay."""
    exact = parse_reward("exact")
    replies = [("269 days after 2022-05-08 is 2023-02-01. The answer is 2023-02-01.", "2023-02-01"),
               ("The chemical symbol for tungsten is W. The answer is W.", "W"), ("答案是 硫。", "硫"),
               ("2023-02-01", "2023-02-01"), ("The answer is 2023-02-02.", "2023-02-01"),
               ("It is 2023-01-31 or 2023-02-01 or 2023-02-02", "2023-02-01")]
    total, _ = score(exact, [completion(text, answer=answer) for text, answer in replies])
    assert total.tolist() == [1, 1, 1, 1, 0, 0]
    assert [answer_right(text, [answer]) for text, answer in replies] == [True, True, True, True, False, True]


def test_tool_call_reward_checks_the_first_call_against_the_records():
    record = {"answer": "42", "tool_call": {"name": "calculator", "arguments": {"expression": "6 * 7"}}}
    def call(tool: str, **arguments) -> str:
        return "<tool_call>\n" + json.dumps({"name": tool, "arguments": arguments}) + "\n</tool_call>"
    texts = [call("calculator", expression="6*7"), call("calculator", expression="6 + 7"),
             call("lookup_element", name="6"), "The answer is 42.", call("calculator", expression="6 * 7")[:-5],
             call("calculator", expression="6 * 7") + "\n<tool_call>\n{oops}\n</tool_call>"]
    done = [Completion(t, 10, 20, record) for t in texts]
    _, parts = score(parse_reward("tool_call"), done)
    assert parts["tool_call"].tolist() == [1, 0, 0, 0, 0, 0]  # right; arguments; tool; no call; cut off; malformed
    assert score(parse_reward("tool_call"), [Completion(texts[0], 10, 20, {"answer": "42"})])[0].item() == 0


def test_a_users_reward_function_from_a_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text("def polite(completion, record):\n    return 1.0 if 'please' in completion else -1.0\n"
                    "def broken(completion, record):\n    return 'yes'\n"
                    "def one_arg(completion):\n    return 0\n")
    terms = parse_reward(f"exact,{path}:polite=0.5")
    assert [t.name for t in terms] == ["exact", "polite"]
    total, parts = score(terms, [completion("please: 12"), completion("no")])
    assert parts["polite"].tolist() == [1, -1] and total.tolist() == pytest.approx([1.5, -0.5])
    with pytest.raises(ConfigError, match="broken returned 'yes'; a reward is a finite number"):
        score(parse_reward(f"{path}:broken"), [completion("x")])
    for spec, message in ((f"{path}:one_arg", "must take \\(completion: str, record: dict\\)"),
                          (f"{path}:absent", "has no function 'absent'"),
                          (f"{tmp_path}/nope.py:f", "no such file"),
                          ("exakt", "unknown; built in: exact, format, length"),
                          ("exact=much", "the weight 'much' is not a number"), (" , ", "names no term")):
        with pytest.raises(ConfigError, match=message):
            parse_reward(spec)
    (tmp_path / "bad.py").write_text("raise RuntimeError('boom')\n")
    with pytest.raises(ConfigError, match="importing .*bad.py failed: RuntimeError: boom"):
        parse_reward(f"{tmp_path / 'bad.py'}:f")


# ------------------------------------------------------------------ prompts with checked answers
def test_prompt_records_in_both_formats(tmp_path, tokenizer):
    """Our {"prompt", "answer"} and MiniMind's RL conversations (a placeholder last assistant turn left out):
    chat prompts, the records kept whole for the rewards; batches left-padded, with lengths and indices."""
    from dataset.prompts import PromptDataset

    from conftest import write_jsonl
    path = write_jsonl(tmp_path / "rl.jsonl", [
        {"prompt": "What is 7 + 5?", "answer": "12", "kind": "add"},
        {"conversations": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"},
                           {"role": "assistant", "content": "空"}], "answer": ["4", "four"]}])
    ds = PromptDataset(path, tokenizer, max_prompt_tokens=64)
    assert len(ds) == ds.num_examples == 2 and ds.records[0]["kind"] == "add"
    assert ds.prompts[0] == tokenizer.chat_prompt([{"role": "user", "content": "What is 7 + 5?"}])
    assert ds.prompts[1] == tokenizer.chat_prompt([{"role": "system", "content": "Be brief."},
                                                   {"role": "user", "content": "2 + 2?"}])
    ids, lengths, index = ds.batch(np.array([1, 0]))
    assert index.tolist() == [1, 0] and lengths.tolist() == [len(ds.prompts[1]), len(ds.prompts[0])]
    for row, i in enumerate([1, 0]):
        assert ids[row, ids.shape[1] - lengths[row]:].tolist() == ds.prompts[i]
        assert (ids[row, :ids.shape[1] - lengths[row]] == tokenizer.pad_id).all()
    assert ds.input_tokens(np.array([0, 1])) == sum(map(len, ds.prompts))
    # a seeded order per epoch, the same whoever asks and from wherever
    again = PromptDataset(path, tokenizer, max_prompt_tokens=64)
    assert ds.global_indices(0, 7).tolist() == again.global_indices(0, 7).tolist()
    assert ds.global_indices(3, 4).tolist() == again.global_indices(0, 7).tolist()[3:]


@pytest.mark.parametrize("record, message", [
    ({"prompt": "2 + 2?"}, '"answer" must be a string or a list of strings'),
    ({"prompt": "", "answer": "4"}, '"prompt" must be a non-empty string'),
    ({"question": "2 + 2?", "answer": "4"}, 'expected a "prompt", "conversations" or "messages" field'),
    ({"conversations": [{"role": "assistant", "content": "4"}], "answer": "4"},
     "\"conversations\" must end with the user's turn"),
    ({"conversations": [{"role": "user", "content": 4}], "answer": "4"}, 'turn 0 "content" must be a string'),
    ({"prompt": "word " * 80, "answer": "4"}, "the prompt is {n} tokens, more than the 64 it may take"),
])
def test_bad_prompt_lines_name_the_file_and_line_or_are_counted(tmp_path, tokenizer, record, message):
    from common.errors import DataError
    from dataset.prompts import PromptDataset

    from conftest import write_jsonl
    path = write_jsonl(tmp_path / "rl.jsonl", [{"prompt": "1 + 1?", "answer": "2"}, record])
    if "{n}" in message:  # the prompt's length as the chat template and this tokenizer make it
        message = message.format(n=len(tokenizer.chat_prompt([{"role": "user", "content": record["prompt"]}])))
    with pytest.raises(DataError, match=f"rl.jsonl:2: {re.escape(message)}"):
        PromptDataset(path, tokenizer, max_prompt_tokens=64)
    ds = PromptDataset(path, tokenizer, max_prompt_tokens=64, skip_bad_lines=True)
    assert len(ds) == 1 and ds.report.total == 1
    with pytest.raises(DataError, match="no usable records|no prompts left"):
        PromptDataset(write_jsonl(tmp_path / "none.jsonl", [record]), tokenizer, 64, skip_bad_lines=True)


# ------------------------------------------------------------------ rollouts
@pytest.fixture(scope="module")
def policy():
    from model import PocketLM

    from conftest import tiny_config
    torch.manual_seed(0)
    return PocketLM(tiny_config(vocab_size=6400, initializer_range=0.3)).eval()


def test_rollouts_lay_out_groups_of_completions_for_the_policy_loss(policy, tokenizer):
    """Each prompt's group on consecutive rows; targets exactly the completion's tokens (its stop token kept);
    the old log-probs those of one forward per row, without padding."""
    from trainer_utils.rollouts import sample_rollouts
    prompts = [tokenizer.chat_prompt([{"role": "user", "content": q}]) for q in ("What is 7 + 5?", "2 + 2?")]
    first = sample_rollouts(policy, prompts, group=3, max_new_tokens=12, stop_ids=tokenizer.stop_ids(chat=True),
                            pad_id=tokenizer.pad_id, generator=torch.Generator().manual_seed(1))
    # the same draws again, with a token that row 0 sampled fifth as a stop token too: rows end early
    stop = [*tokenizer.stop_ids(chat=True), first.completions[0][4]]
    out = sample_rollouts(policy, prompts, group=3, max_new_tokens=12, stop_ids=stop, pad_id=tokenizer.pad_id,
                          generator=torch.Generator().manual_seed(1))
    assert out.prompt_rows == [0, 0, 0, 1, 1, 1] and len(out.completions) == 6
    assert out.inputs.shape[0] == 2  # a row per prompt: its group packed after it
    assert not out.truncated[0] and len(out.completions[0]) <= 5 and any(out.truncated)
    for r, (row, completion) in enumerate(zip(out.prompt_rows, out.completions)):
        assert completion and (out.truncated[r] == (completion[-1] not in stop))
        assert len(completion) == 12 or not out.truncated[r]
        assert all(t not in stop for t in completion[:-1])  # it ended at its first stop token
        sequence = prompts[row] + completion
        inputs, targets, old = out.unpacked(r)
        wanted = torch.tensor(targets) != IGNORE_INDEX
        assert torch.tensor(targets)[wanted].tolist() == completion
        assert inputs == sequence[:-1]
        with torch.no_grad():
            logits = policy(torch.tensor([sequence[:-1]]))[0]
        alone = torch.log_softmax(logits.double(), -1)[torch.arange(len(prompts[row]) - 1, len(sequence) - 1),
                                                        torch.tensor(completion)]
        assert torch.tensor(old)[wanted].tolist() == pytest.approx(alone.tolist(), abs=1e-4)
        assert (torch.tensor(old)[~wanted] == 0).all()


@pytest.mark.parametrize("pack_tokens", [2048, 40])
def test_packed_rows_give_the_loss_and_gradient_of_a_row_per_completion(policy, tokenizer, monkeypatch,
                                                                         pack_tokens):
    """A group's prompt computed once, its completions after it under the shared-context mask, at their own
    positions: the policy loss and its gradient are those of one right-padded row per completion. With a small
    PACK_TOKENS a group spreads over rows, each holding the prompt again: the same again."""
    from trainer_utils import rollouts
    monkeypatch.setattr(rollouts, "PACK_TOKENS", pack_tokens)
    prompts = [tokenizer.chat_prompt([{"role": "user", "content": q}]) for q in ("What is 7 + 5?", "Count to 3.")]
    out = rollouts.sample_rollouts(policy, prompts, 3, 10, tokenizer.stop_ids(chat=True), tokenizer.pad_id,
                                   row_keys=[(1, i, g) for i in range(2) for g in range(3)])
    assert out.inputs.shape[0] == 2 if pack_tokens == 2048 else out.inputs.shape[0] > 2
    advantages = torch.tensor([1.0, -0.5, 0.25, 2.0, -1.0, 0.5])
    packed, single = out.policy_batch(advantages), out.one_row_each(advantages, tokenizer.pad_id)
    objective = PolicyGradient("grpo")
    losses, grads = [], []
    for b in (packed, single):
        policy.zero_grad()
        result = objective(policy, b, contextlib.nullcontext)
        result.loss.backward()
        losses.append(result.loss.item())
        grads.append(torch.cat([p.grad.flatten() for p in policy.parameters()]))
        assert objective.count(b) == sum(len(c) for c in out.completions)
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    assert float((grads[0] - grads[1]).norm() / grads[1].norm()) < 1e-5  # fp32 rounding, summed in other orders


@pytest.mark.parametrize("pack_tokens", [2048, 40])
def test_leaving_out_uniform_groups_keeps_the_loss_and_gradient_of_the_others(policy, tokenizer, monkeypatch,
                                                                             pack_tokens):
    """Rollouts.only (--skip_uniform_groups): the kept groups' rows give the loss and gradient the whole batch gives
    with the others' advantages at 0, and only their tokens count (a group spread over rows goes, each of its
    rows)."""
    from trainer_utils import rollouts
    monkeypatch.setattr(rollouts, "PACK_TOKENS", pack_tokens)
    prompts = [tokenizer.chat_prompt([{"role": "user", "content": q}])
               for q in ("What is 7 + 5?", "Count to 3.", "Name a colour.")]
    out = rollouts.sample_rollouts(policy, prompts, 2, 10, tokenizer.stop_ids(chat=True), tokenizer.pad_id,
                                   row_keys=[(2, i, g) for i in range(3) for g in range(2)])
    advantages = torch.tensor([1.0, -1.0, 0.0, 0.0, -1.0, 1.0])  # the second prompt's group scored alike
    kept = out.only([0, 2])
    assert kept.inputs.shape[0] < out.inputs.shape[0] and kept.inputs.shape[1] % rollouts.SHAPE_STEP == 0
    assert set(kept.members[kept.members >= 0].tolist()) == {0, 1, 4, 5}
    objective = PolicyGradient("grpo")
    losses, grads = [], []
    for b in (out.policy_batch(advantages), kept.policy_batch(advantages)):
        policy.zero_grad()
        result = objective(policy, b, contextlib.nullcontext)
        result.loss.backward()
        losses.append(result.loss.item())
        grads.append(torch.cat([p.grad.flatten() for p in policy.parameters()]))
    # the loss is a sum of terms that cancel (each group's advantages sum to zero), so near 0 its float32 rounding
    # depends on how the threads split the sums: 2.4e-7 apart on two threads
    assert losses[0] == pytest.approx(losses[1], rel=1e-5, abs=1e-6)
    assert float((grads[0] - grads[1]).norm() / grads[1].norm()) < 1e-5
    assert objective.count(kept.policy_batch(advantages)) == sum(len(out.completions[i]) for i in (0, 1, 4, 5))
    with pytest.raises(ValueError, match="no rows left"):
        out.only([])


def test_greedy_rollouts_repeat_one_completion_and_sampling_follows_the_seed(policy, tokenizer):
    from model.generate import generate
    from trainer_utils.rollouts import sample_rollouts
    prompt = tokenizer.chat_prompt([{"role": "user", "content": "Count to five."}])
    stop = tokenizer.stop_ids(chat=True)
    greedy = sample_rollouts(policy, [prompt], 3, 10, stop, tokenizer.pad_id, temperature=0.0)
    alone = generate(policy, [prompt], 10, temperature=0.0, eos_token_ids=stop, pad_token_id=tokenizer.pad_id)[0]
    assert all(c[:len(alone)] == alone for c in greedy.completions) and len({tuple(c) for c in greedy.completions}) == 1
    runs = [sample_rollouts(policy, [prompt], 4, 10, stop, tokenizer.pad_id,
                            generator=torch.Generator().manual_seed(seed)).completions for seed in (5, 5, 6)]
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_keyed_rows_sample_the_same_completion_in_any_batch(policy, tokenizer):
    """A row's completion and its log-probs are a function of its key: the second prompt's group comes out the
    same decoded beside another prompt (other padding, other rows) as alone, and another key gives another."""
    from trainer_utils.rollouts import sample_rollouts
    prompts = [tokenizer.chat_prompt([{"role": "user", "content": q}]) for q in ("Hi, how long is a day?", "2+2?")]
    stop = tokenizer.stop_ids(chat=True)
    keys = [(7, 0, i, g) for i in range(2) for g in range(3)]
    both = sample_rollouts(policy, prompts, 3, 12, stop, tokenizer.pad_id, row_keys=keys)
    alone = sample_rollouts(policy, prompts[1:], 3, 12, stop, tokenizer.pad_id, row_keys=keys[3:])
    assert both.completions[3:] == alone.completions
    assert len({tuple(c) for c in alone.completions}) > 1  # the group's members differ
    # other batch shapes round fp32 differently, by a CPU-dependent few parts per million (1.4e-6 seen on AVX2)
    for i in range(3):
        torch.testing.assert_close(torch.tensor(both.unpacked(3 + i)[2]), torch.tensor(alone.unpacked(i)[2]),
                                   atol=1e-5, rtol=1e-5)
    other = sample_rollouts(policy, prompts[1:], 3, 12, stop, tokenizer.pad_id, row_keys=[(8, 0, 1, g) for g in
                                                                                           range(3)])
    assert other.completions != alone.completions
    with pytest.raises(ValueError, match="2 row keys for 3 rows"):
        sample_rollouts(policy, prompts[1:], 3, 12, stop, tokenizer.pad_id, row_keys=keys[:2])


def test_the_grpo_stages_keys_give_each_group_member_its_own_draw(policy, tokenizer):
    """The keys the stage samples with name the seed, the step, the prompt and the member: members of a group draw
    different completions, and a prompt's group is the same whichever batch it is in (resume, DDP)."""
    from trainer_utils.rollouts import sample_rollouts
    from trainer_utils.stages.grpo import rollout_keys
    keys = rollout_keys(42, 3, [5, 9], 4)
    assert len(set(keys)) == 8 and keys[4:] == rollout_keys(42, 3, [9], 4)
    assert not set(keys) & set(rollout_keys(42, 4, [5, 9], 4)) and not set(keys) & set(rollout_keys(43, 3, [5, 9], 4))
    prompt = tokenizer.chat_prompt([{"role": "user", "content": "What is 7 + 5?"}])
    out = sample_rollouts(policy, [prompt], 4, 12, tokenizer.stop_ids(chat=True), tokenizer.pad_id,
                          row_keys=rollout_keys(42, 3, [5], 4))
    assert len({tuple(c) for c in out.completions}) == 4


def test_a_reward_model_directory_scores_the_chat_it_answers(reward_model):
    """Its score of each completion, batched with padding, is what transformers gives the same chat alone."""
    import transformers
    [term] = parse_reward(f"{reward_model}=0.5")
    assert (term.name, term.weight) == (reward_model.name, 0.5)
    done = [Completion(text, 5, 40, {"prompt": "What is 7 + 5?", "answer": "12"})
            for text in ("The answer is 12.", "12", "I do not know, but it could be thirteen or more.")]
    got = term.fn(done)
    tok = transformers.AutoTokenizer.from_pretrained(reward_model)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(reward_model).eval()
    for c, value in zip(done, got):
        chat = [{"role": "user", "content": "What is 7 + 5?"}, {"role": "assistant", "content": c.text}]
        ids = tok(tok.apply_chat_template(chat, tokenize=False), return_tensors="pt")
        with torch.no_grad():
            assert value == pytest.approx(model(**ids).logits[0, 0].item(), abs=1e-5)
    assert len(set(got)) == 3
    total, parts = score(parse_reward(f"exact,{reward_model}=0.5"), done)
    assert total.tolist() == pytest.approx([1 + 0.5 * got[0], 1 + 0.5 * got[1], 0.5 * got[2]], abs=1e-5)


def test_a_directory_that_is_no_reward_model_is_refused(tmp_path):
    pytest.importorskip("transformers")
    (tmp_path / "lm").mkdir()
    (tmp_path / "lm/config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    with pytest.raises(ConfigError, match="not a sequence-classification model"):
        parse_reward(f"{tmp_path / 'lm'}")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="cannot read its config.json"):
        parse_reward(f"{tmp_path / 'empty'}")


def test_sampled_batches_come_in_few_shapes(policy, tokenizer):
    """Rows padded to a multiple of SHAPE_STEP tokens, the vocabulary projection to a multiple of
    VOCAB_ROWS_STEP rows (every valid position kept, first ignored ones added): in bf16 on a CPU, oneDNN keeps
    memory per product shape, and a GRPO run's memory grew without bound before."""
    from trainer_utils.objectives import SHAPE_STEP, padded_selection
    from trainer_utils.rollouts import sample_rollouts
    prompt = tokenizer.chat_prompt([{"role": "user", "content": "Count to five."}])
    out = sample_rollouts(policy, [prompt], 3, 7, tokenizer.stop_ids(chat=True), tokenizer.pad_id,
                          generator=torch.Generator().manual_seed(3))
    assert out.inputs.shape[1] % SHAPE_STEP == 0 and out.targets.shape == out.inputs.shape
    valid = torch.zeros(3, 10, dtype=torch.bool)
    valid[0, 4:9], valid[2, 1:3] = True, True
    picked = padded_selection(valid, 4)
    assert int(picked.sum()) == 8 and bool((picked | ~valid).all())  # 7 valid + the first ignored position
    assert picked.flatten().nonzero()[:, 0].tolist() == [0, 4, 5, 6, 7, 8, 21, 22]
    assert int(padded_selection(valid, 64).sum()) == 30  # no more than there are
