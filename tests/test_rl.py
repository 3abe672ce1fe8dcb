"""Reinforcement learning's pieces, against hand-written references: the policy losses (GRPO's clipped surrogate,
CISPO's clipped importance weight, the k3 KL; their defaults, temperature and bounds), masking of prompt and padding
tokens, the group-normalised advantages, the checked rewards and reward models, and the rollouts packed for the
loss."""
from __future__ import annotations

import contextlib
import json
import math
import re
import shutil
import sys

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


# ------------------------------------------------------------------ rewards: bounds, specs and messages
def test_the_tool_use_reward_pays_a_single_clean_call():
    from trainer_utils.rewards import ToolUse
    one = ToolUse(calls=1)
    assert score(parse_reward("tool_use"), [Completion("The answer is 5.", 10, 64, {"answer": "5"}, one)])[0].tolist() \
        == [1.0]


def test_the_length_term_stays_within_minus_one_and_zero():
    """-1 at the budget and past it (a rollout's own tokens can outnumber one reply's budget), 0 up to half of it,
    and 0 for any completion when there is no budget to share (no division by it)."""
    lengths = [parse_reward("length")[0].fn([completion("12", tokens=t, budget=40)])[0] for t in (0, 20, 30, 40, 80)]
    assert lengths == pytest.approx([0, 0, -0.5, -1, -1])
    assert parse_reward("length")[0].fn([completion("12", tokens=5, budget=0)]) == [0.0]


def test_the_eps_of_the_advantages_only_shrinks_them():
    """A group of two different rewards: each advantage is ±1 / (1 + eps), just under one."""
    got = group_advantages(torch.tensor([0.0, 2.0, 5.0, 5.0]), 2)
    assert got.tolist() == pytest.approx([-1 / (1 + 1e-4), 1 / (1 + 1e-4), 0, 0], abs=1e-7)
    assert got.abs().max() < 1


def test_no_terms_score_zero():
    total, parts = score([], [completion("12"), completion("13")])
    assert total.tolist() == [0.0, 0.0] and parts == {}


def test_reward_specs_with_colons_and_equals_in_paths_and_blank_terms(tmp_path):
    """A user's file may sit in a folder whose name holds ':' or '=' (the function is after the last ':', the
    weight after the last '='); it is given the completion and the prompt's record; empty terms are skipped."""
    folder = tmp_path / "a:b=c"
    folder.mkdir()
    (folder / "r.py").write_text("def right(completion, record):\n    return float(record['answer'] in completion)\n")
    terms = parse_reward(f"exact,, {folder / 'r.py'}:right=0.5 ,format")
    assert [(t.name, t.weight) for t in terms] == [("exact", 1.0), ("right", 0.5), ("format", 1.0)]
    assert score(terms[1:2], [completion("It is 12"), completion("It is 13")])[1]["right"].tolist() == [1, 0]


def test_reward_errors_say_what_went_wrong(tmp_path):
    path = tmp_path / "fails.py"
    path.write_text("def fails(completion, record):\n    raise ValueError('bad')\n")
    text = "x" * 100
    expected = (f"reward {path}:fails: fails raised ValueError: bad (on the completion '{'x' * 80}' of the record "
                "answered '12'); the last checkpoint is intact")
    from common.errors import TrainingError
    with pytest.raises(TrainingError) as caught:
        score(parse_reward(f"{path}:fails"), [completion(text)])
    assert str(caught.value) == expected
    for spec, message in (("exact=inf", "reward exact=inf: the weight must be finite"),
                          (",", "a reward spec names no term"),
                          ("exakt", "reward exakt: unknown; built in: exact, format, length, tool_call, tool_use, "
                                    "FILE.py:FUNCTION, or a reward model's directory")):
        with pytest.raises(ConfigError) as caught:
            parse_reward(spec)
        assert str(caught.value) == message


# ------------------------------------------------------------------ a reward model directory's pieces
def classifier_dir(path, architectures=("LlamaForSequenceClassification",)):
    """A directory that names a sequence classifier (enough to be taken as a reward model; loaded only when used)."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"architectures": list(architectures)}))
    return path


def test_a_reward_model_runs_where_it_is_told_and_scores_from_its_logits(tmp_path):
    """The CPU unless told otherwise; completions go in batches of batch_size, each on the model's device (here
    "meta", so that it cannot be the CPU by chance); one label: its logit; more: the last label's probability."""
    from types import SimpleNamespace

    transformers = pytest.importorskip("transformers")
    from trainer_utils.rewards import RewardModel
    d = classifier_dir(tmp_path / "rm")
    assert RewardModel(d).device == torch.device("cpu")
    [term] = parse_reward(str(d), device="meta")
    rm, seen = term.fn, []
    logits = iter([torch.tensor([[0.0, 0.0, math.log(2)], [0.0, math.log(3), 0.0]]), torch.tensor([[1.0, 2.0, 1.0]])])

    class Tokenizer:  # no chat template
        chat_template = None

        def __call__(self, texts, **_):
            seen.append(texts)
            return transformers.BatchEncoding({"input_ids": torch.zeros(len(texts), 3, dtype=torch.long)})

    def model(input_ids):
        assert input_ids.device == torch.device("meta")
        return SimpleNamespace(logits=next(logits))

    rm.tokenizer, rm.model, rm.batch_size = Tokenizer(), model, 2
    done = [Completion(t, 5, 40, {"prompt": "Hi?", "answer": "1"}) for t in ("a", "b", "c")]
    e = math.e
    assert rm(done) == pytest.approx([0.5, 0.2, 1 / (2 + e)])  # softmax's last column: 2/4, 1/5, 1/(1+e+1)
    assert seen == [["Hi?\na", "Hi?\nb"], ["Hi?\nc"]]  # no chat template: the turns on lines of their own
    rm.model = lambda input_ids: SimpleNamespace(logits=torch.tensor([[-2.5]] * len(input_ids)))
    assert rm(done) == [-2.5] * 3  # one label: the logit itself


def test_a_reward_model_is_loaded_onto_its_device(reward_model):
    from trainer_utils.rewards import RewardModel
    rm = RewardModel(reward_model, device="meta")  # a device the CPU cannot pass for
    rm._load()
    assert {p.device.type for p in rm.model.parameters()} == {"meta"} and not rm.model.training


def test_a_reward_model_needs_transformers_and_a_classifier(tmp_path, monkeypatch):
    from trainer_utils.rewards import RewardModel
    d = classifier_dir(tmp_path / "rm", architectures=())
    pytest.importorskip("transformers")
    with pytest.raises(ConfigError, match=r"not a sequence-classification model \(architectures: none\)"):
        RewardModel(d)
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ConfigError, match=rf"^reward {re.escape(str(d))} \(a reward model directory\) needs the"):
        RewardModel(d)


def test_a_reward_model_without_a_pad_token_scores_padded_batches_as_single_ones(reward_model, tmp_path):
    """Its tokenizer has no pad token (GPT-2's do not): the end of text pads, and a batch of completions of
    different lengths scores each as it scores alone. A chat longer than the tokenizer's maximum is cut to it."""
    from trainer_utils.rewards import RewardModel
    d = tmp_path / "no_pad"
    shutil.copytree(reward_model, d)
    config = json.loads((d / "tokenizer_config.json").read_text())
    config["pad_token"] = None
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    rm = RewardModel(d)
    done = [Completion(text, 5, 40, {"prompt": "What is 7 + 5?", "answer": "12"})
            for text in ("The answer is 12.", "I do not know, but it could be thirteen or more.")]
    together = rm(done)
    assert together == pytest.approx([rm([c])[0] for c in done], abs=1e-5)
    assert rm.tokenizer.pad_token == rm.tokenizer.eos_token
    rm.tokenizer.model_max_length = 6
    cut = rm.tokenizer(rm.text(done[1]), truncation=True, return_tensors="pt")
    assert cut["input_ids"].shape[1] == 6
    with torch.no_grad():
        assert rm(done[1:]) == pytest.approx([rm.model(**cut).logits[0, 0].item()], abs=1e-5)


OWN_MODEL = """from transformers import AutoModel, LlamaConfig, LlamaForSequenceClassification, LlamaModel


class OwnConfig(LlamaConfig):
    model_type = "own_llama"


class OwnModel(LlamaModel):
    config_class = OwnConfig


class OwnForSequenceClassification(LlamaForSequenceClassification):
    config_class = OwnConfig


AutoModel.register(OwnConfig, OwnModel, exist_ok=True)
"""
OWN_TOKENIZER = """from transformers import PreTrainedTokenizerFast


class OwnTokenizer(PreTrainedTokenizerFast):
    pass
"""


def test_a_reward_model_with_code_of_its_own_is_loaded_with_it(reward_model, tmp_path, monkeypatch):
    """A reward model directory may ship its own model and tokenizer classes as Python files (InternLM2's reward
    model does): they are trusted, as the directory is the user's choice, and used."""
    pytest.importorskip("transformers")
    import transformers.dynamic_module_utils as dynamic

    from trainer_utils.rewards import RewardModel
    monkeypatch.setattr(dynamic, "HF_MODULES_CACHE", str(tmp_path / "modules"))  # where transformers copies the code
    monkeypatch.setattr(sys, "path", list(sys.path))
    d = tmp_path / "own_code"
    shutil.copytree(reward_model, d)
    (d / "modeling_own.py").write_text(OWN_MODEL)
    (d / "tokenization_own.py").write_text(OWN_TOKENIZER)
    model_map = {"AutoConfig": "modeling_own.OwnConfig",
                 "AutoModelForSequenceClassification": "modeling_own.OwnForSequenceClassification"}
    for name, changes in (
            ("config.json", {"model_type": "own_llama", "architectures": ["OwnForSequenceClassification"],
                             "auto_map": model_map}),
            ("tokenizer_config.json", {"tokenizer_class": "OwnTokenizer",
                                       "auto_map": {"AutoTokenizer": [None, "tokenization_own.OwnTokenizer"]}})):
        config = json.loads((d / name).read_text())
        (d / name).write_text(json.dumps({**config, **changes}))
    rm = RewardModel(d)
    rm._load()
    assert (type(rm.model).__name__, type(rm.tokenizer).__name__) == ("OwnForSequenceClassification", "OwnTokenizer")


# ------------------------------------------------------------------ rollouts: the packed layout, by hand
def hand_rows():
    """Two prompts; the first's group: two tokens, nothing (a rollout that ended at once), one token; the
    second's: three tokens, the middle one a tool's result (not the policy's)."""
    from trainer_utils.rollouts import Row
    prompts = [[1, 2, 3], [7, 8]]
    rows = [Row([4, 5], [True, True], [-0.1, -0.2]), Row([], [], []), Row([6], [True], [-0.3]),
            Row([9, 10, 11], [True, False, True], [-0.4, 0.0, -0.5])]
    return prompts, [0, 0, 0, 1], rows


def test_packed_rows_are_laid_out_as_written_by_hand():
    """Row 0: the first prompt but its last token, then each rollout's inputs (the prompt's last token, then its
    own but its last) at its own positions, segment j for the j-th rollout of the row; then padding to 16
    (segment and member -1, no target). A rollout that added nothing takes no place, and the next one goes on."""
    from trainer_utils.rollouts import pack_rollouts
    prompts, owner, rows = hand_rows()
    out = pack_rollouts(prompts, owner, rows, [False] * 4, 0, torch.device("cpu"))
    pad = 16 - 5
    assert out.inputs.tolist() == [[1, 2, 3, 4, 3] + [0] * pad, [7, 8, 9, 10] + [0] * 12]
    assert out.positions.tolist() == [[0, 1, 2, 3, 2] + [0] * pad, [0, 1, 2, 3] + [0] * 12]
    assert out.segment.tolist() == [[0, 0, 1, 1, 3] + [-1] * pad, [0, 1, 1, 1] + [-1] * 12]
    assert out.members.tolist() == [[-1, -1, 0, 0, 2] + [-1] * pad, [-1, 3, 3, 3] + [-1] * 12]
    assert out.targets.tolist() == [[-100, -100, 4, 5, 6] + [-100] * pad, [-100, 9, -100, 11] + [-100] * 12]
    torch.testing.assert_close(out.old_log_probs, torch.tensor([[0, 0, -0.1, -0.2, -0.3] + [0] * pad,
                                                                [0, -0.4, 0, -0.5] + [0] * 12]))
    assert (out.inputs.dtype, out.positions.dtype, out.old_log_probs.dtype) == (torch.long, torch.long,
                                                                                torch.float32)


def test_a_group_fills_a_row_up_to_pack_tokens_exactly(monkeypatch):
    """The first group takes 2 + 2 + 0 + 1 = 5 tokens: a limit of 5 keeps it in one row, 4 splits it (the row
    that goes on holds the prompt again)."""
    from trainer_utils import rollouts
    prompts, owner, rows = hand_rows()
    monkeypatch.setattr(rollouts, "PACK_TOKENS", 5)
    assert rollouts.pack_rollouts(prompts, owner, rows, [False] * 4, 0, torch.device("cpu")).inputs.shape[0] == 2
    monkeypatch.setattr(rollouts, "PACK_TOKENS", 4)
    split = rollouts.pack_rollouts(prompts, owner, rows, [False] * 4, 0, torch.device("cpu"))
    assert split.inputs.shape[0] == 3 and split.inputs[1, :3].tolist() == [1, 2, 3]  # prompt, then rollout 2


def test_only_keeps_the_rows_of_the_prompts_asked_for_and_trims_them(monkeypatch):
    """Each rollout in a row of its own: the rows of prompt 0 (members 0 and 2; rollout 1 has none) or of prompt 1
    alone, at the width their longest row needs (not their sum); the completions' own fields stay whole."""
    from trainer_utils import rollouts
    prompts, owner, rows = hand_rows()
    rows[0], rows[2] = (rollouts.Row([4] * k, [True] * k, [-0.1] * k) for k in (10, 8))  # rows of 12 and 10 tokens
    rows[3] = rollouts.Row(list(range(20, 40)), [True] * 20, [-0.1] * 20)  # prompt 1's row: 21 tokens, width 32
    monkeypatch.setattr(rollouts, "PACK_TOKENS", 2)
    out = rollouts.pack_rollouts(prompts, owner, rows, [False, False, False, True], 0, torch.device("cpu"))
    assert out.inputs.shape == (4, 32)  # rollout 1 added nothing: its row holds the prompt alone
    first = out.only([0])
    assert first.members.amax(dim=1).tolist() == [0, 2] and first.inputs.shape == (2, 16)
    assert (first.completions, first.truncated, first.prompt_rows) == (out.completions, out.truncated,
                                                                      [0, 0, 0, 1])
    assert out.only([1]).inputs.shape == (1, 32)
    with pytest.raises(ValueError, match="^no rows left: keep at least one prompt with a rollout$"):
        out.only([])


def test_no_keys_draw_no_numbers():
    from trainer_utils.rollouts import keyed_uniforms
    assert keyed_uniforms([], 5, "cpu").shape == (0, 5)


def test_rollouts_are_made_on_the_policys_device(monkeypatch):
    """The rows, the keyed numbers and the stop test are on the device the policy is on (the "meta" device here,
    so that the CPU cannot pass for it), and so is the advantages' layout."""
    from trainer_utils import rollouts
    seen = []

    def fake_generate(model, prompts, max_new_tokens, stop=None, uniforms=None, log_probs=None, **_):
        seen.append(uniforms.device)
        tokens = torch.tensor([5] * len(prompts), device="meta")
        seen.append(stop(tokens, torch.ones(len(prompts), dtype=torch.bool, device="meta")).device)
        log_probs.extend([[-0.5, -0.5]] * len(prompts))
        return [[4, 5]] * len(prompts)

    monkeypatch.setattr(rollouts, "generate", fake_generate)
    policy = torch.nn.Linear(1, 1, device="meta")
    out = rollouts.sample_rollouts(policy, [[1, 2, 3]], 2, 2, [5], 0, row_keys=[(0,), (1,)])
    fields = (out.inputs, out.positions, out.segment, out.targets, out.old_log_probs, out.members,
              out.per_token(torch.tensor([1.0, -1.0])))
    assert {t.device.type for t in fields} == {"meta"} and {d.type for d in seen} == {"meta"}


def test_top_k_one_and_a_tiny_top_p_sample_the_greedy_completion(policy, tokenizer):
    from trainer_utils.rollouts import sample_rollouts
    prompt = tokenizer.chat_prompt([{"role": "user", "content": "Count to five."}])
    stop, keys = tokenizer.stop_ids(chat=True), [(1, g) for g in range(2)]
    greedy = sample_rollouts(policy, [prompt], 2, 8, stop, tokenizer.pad_id, temperature=0.0).completions
    assert sample_rollouts(policy, [prompt], 2, 8, stop, tokenizer.pad_id, top_k=1, row_keys=keys).completions \
        == greedy
    assert sample_rollouts(policy, [prompt], 2, 8, stop, tokenizer.pad_id, top_p=1e-6, row_keys=keys).completions \
        == greedy
    assert sample_rollouts(policy, [prompt], 2, 8, stop, tokenizer.pad_id, row_keys=keys).completions != greedy


# ------------------------------------------------------------------ the policy loss: defaults, temperature, bounds
def test_the_default_policy_loss_is_grpo_clipped_a_fifth_either_side_of_one():
    """PolicyGradient() is GRPO with epsilon = epsilon_high = 0.2: ratio 1.3 counts as 1.2 where A > 0, ratio 0.7
    as 0.8 where A < 0 (rows of 3 and 2 completion tokens)."""
    for ratio, clipped_row, bound in ((1.3, 0, 1.2), (0.7, 1, 0.8)):
        policy = Logits()
        out, _ = loss_and_grad(PolicyGradient(), policy, batch(policy, math.log(ratio), advantages=(2.0, -3.0)))
        weight = [bound if row == clipped_row else ratio for row in (0, 1)]
        assert out.loss.item() == pytest.approx(-(weight[0] * 2.0 * 3 + weight[1] * -3.0 * 2), rel=1e-5)
    with pytest.raises(ValueError, match=r"^loss_type must be one of \('grpo', 'cispo'\), got 'ppo'$"):
        PolicyGradient("ppo")


def test_the_policy_is_the_tempered_softmax_and_its_entropy_is_logged():
    """At temperature 2 the policy is softmax(logits / 2): sampled from it (old log-probs its own), every ratio is
    one and the loss is -sum(A) = -(3 * 1 - 2 * 1). With uniform logits over V tokens each completion token's
    entropy is ln V."""
    policy = Logits()
    b = list(batch(policy))
    with torch.no_grad():
        b[2] = token_log_probs(policy.logits / 2, b[1])
    out, _ = loss_and_grad(PolicyGradient(temperature=2.0), policy, tuple(b))
    assert (out.loss.item(), out.metrics["ratio"].item()) == pytest.approx((-1.0, 5.0), rel=1e-5)
    with torch.no_grad():
        policy.logits.zero_()
    out, _ = loss_and_grad(PolicyGradient(), policy, batch(policy))
    assert out.metrics["entropy"].item() == pytest.approx(5 * math.log(V), rel=1e-6)


@pytest.mark.parametrize("loss_type", ["grpo", "cispo"])
def test_a_ratio_on_the_clip_bound_is_not_clipped(loss_type):
    """Bounds of 1 - 0 and 1 + 0, and old log-probs computed as the loss computes the policy's: every ratio is
    exactly 1, on both bounds, and none counts as clipped."""
    policy = Logits()
    b = list(batch(policy))
    with torch.no_grad():
        b[2] = torch.log_softmax(policy.logits.float(), -1).gather(-1, b[1].clamp(min=0)[..., None])[..., 0]
    out, _ = loss_and_grad(PolicyGradient(loss_type, epsilon=0.0, epsilon_high=0.0), policy, tuple(b))
    assert (out.metrics["ratio"].item(), out.metrics["clip_frac"].item()) == (5.0, 0.0)
