"""Reinforcement learning with verifiable rewards: GRPO and CISPO on prompts with checked answers (train_grpo.py).

Each optimizer step, before the loss (`before_loss`), every micro-batch of prompts becomes a batch of completions:

    sample      --num_generations completions per prompt from the current policy, in one batched KV-cached
                generation (trainer_utils/rollouts.py), each row's random numbers keyed by (seed, step, prompt,
                member of the group): a resume and a DDP run sample exactly what one uninterrupted process does
    score       the reward's terms on each completion's text against its record (trainer_utils/rewards.py)
    compare     advantages: each reward minus its group's mean, over the group's standard deviation
    learn       the policy loss on the completion tokens (objectives.PolicyGradient), normalised over the step's
                completion tokens; with --beta > 0, plus the k3 KL to the frozen --init_from model

One update per rollout: the ratio is that of the trained forward to the sampler's own log-probabilities, 1 up to
their arithmetic (a KV-cached decode against a full forward, both in the training precision), and the clip
bounds what that mismatch can do. Groups never span ranks or micro-batches. Logged per completion: the reward,
each term, the length and the truncated share; per group: the within-group standard deviation and the share whose
rewards differ (informative: the others teach nothing, and --skip_uniform_groups leaves them out of the loss); per
token: the clipped share, the ratio, the entropy and the KL; the sampler's tokens per second (per rank). At every
evaluation the first groups of that step go to rollouts.jsonl with their rewards; the held-out measure is
--eval_tasks (the bundled dataset/demo/math_heldout.jsonl: exact-match accuracy by generation).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from common.config import option
from common.errors import ConfigError
from common.tokens import IGNORE_INDEX
from dataset.config import DataConfig
from dataset.kinds import PROMPTS, DataKind
from model.checkpoint import load_model

from ..context import RunContext, SetupContext, StepBatches, every
from ..objectives import POLICY_LOSSES, Autocast, Objective, PolicyGradient, completion_logits
from ..rewards import Completion, group_advantages, parse_reward, score
from ..rollouts import Rollouts, sample_rollouts
from .base import Stage

ROLLOUT_TAG = 0x67727030  # "grp0": separates the rollouts' random numbers from any other seeded stream
LOGGED_GROUPS = 2  # groups written to rollouts.jsonl at each evaluation


def rollout_keys(seed: int, step: int, indices: list[int], group: int) -> list[tuple[int, ...]]:
    """One sampling key per completion (prompt-major): the run's seed, the step, the prompt's index in the data
    and the completion's place in its group, so every member of a group samples its own tokens (a key without
    the member would sample the group's completions alike: equal rewards, zero advantages, nothing learned) and a
    resumed or data-parallel run draws exactly what one uninterrupted process draws."""
    return [(seed, ROLLOUT_TAG, step, i, g) for i in indices for g in range(group)]


@dataclass
class GRPOOptions:
    """What reinforcement learning optimises: sampled completions, rewarded by checks, compared within groups."""

    title: ClassVar[str] = "reinforcement learning (GRPO / CISPO)"
    beta: float = option(0.0, "weight of the KL to the --init_from model (0: no reference model is kept)",
                         at_least=0)
    temperature: float = option(1.0, "the temperature completions are sampled (and trained) at", above=0)
    num_generations: int = option(8, "completions sampled per prompt (a group; advantages compare them)",
                                  at_least=2)
    max_completion_tokens: int = option(64, "tokens a completion may have (with tools: each reply); one cut off "
                                            "there is 'truncated' (with tools, its rollout ends unanswered); prompts "
                                            "get --max_seq_len minus this", at_least=1)
    reward: str = option("exact,format=0.1", "the reward, weighted terms: exact (the record's answer; with tools, "
                                             "the final one's), format (the answer stated as taught), tool_call, "
                                             "tool_use (tool calls all well formed and run, then an answer), length, "
                                             "FILE.py:FUNCTION, a reward model's directory "
                                             "(trainer_utils/rewards.py)", metavar="SPEC")
    scale_rewards: bool = option(True, "divide each group's centred rewards by their standard deviation "
                                       "(--no-scale_rewards: Dr. GRPO's unscaled advantages)")
    loss_type: str = option(POLICY_LOSSES[0], "the policy loss: grpo, PPO's clipped ratio; cispo, a clipped "
                                              "stop-gradient weight on every token (trainer_utils/objectives.py "
                                              "PolicyGradient)", choices=POLICY_LOSSES)
    skip_uniform_groups: bool = option(False, "leave out of the loss the groups whose completions all scored the "
                                              "same (their advantages are 0): their tokens no longer dilute the "
                                              "loss's normaliser nor cost a training forward (DAPO's dynamic "
                                              "sampling, without drawing more prompts; with --beta, their KL term "
                                              "goes too; a micro-batch where no group differs is trained whole)")
    epsilon: float = option(0.2, "the ratio's lower clip, 1 - epsilon (grpo)", at_least=0, below=1)
    epsilon_high: float = option(0.2, "the ratio's upper clip, 1 + epsilon_high (grpo and cispo)", above=0)

    def check(self) -> None:
        parse_reward(self.reward)  # a bad spec or reward file fails now, before anything slow


class GRPO(Stage):
    name = "grpo"
    script = "train_grpo.py"
    options = GRPOOptions
    defaults: ClassVar[dict[str, Any]] = dict(data_path=["dataset/demo/math_train.jsonl"], batch_size=8,
                                              learning_rate=1e-5)
    features = frozenset({"conversations", "adapters"})
    needs_init = True
    estimates_memory = False  # the estimate is of one training batch; here the rollouts' KV cache and a
    # reference model may run beside it (the log's peak memory is measured)

    def data_kind(self, data: DataConfig) -> DataKind:
        return PROMPTS

    def record_tokens(self, setup: SetupContext) -> int:
        budget = setup.options.max_completion_tokens
        if budget >= setup.max_seq_len:
            raise ConfigError(f"--max_completion_tokens {budget} leaves no room for a prompt in --max_seq_len "
                              f"{setup.max_seq_len}")
        return setup.max_seq_len - budget

    def objective(self, setup: SetupContext) -> Objective:
        o = setup.options
        return PolicyGradient(o.loss_type, o.epsilon, o.epsilon_high, o.beta, o.temperature)

    def prepare(self, ctx: RunContext) -> RolloutSampler:
        return RolloutSampler(ctx)

    def before_loss(self, ctx: RunContext, step: StepBatches) -> StepBatches:
        return ctx.stage_state.sample(ctx, step)

    def metric_unit(self, name: str) -> str | None:
        if name in ("reward", "completion_tokens", "truncated") or name.startswith("reward/"):
            return "completions"
        return {"reward_std": "groups", "informative": "groups", "rollout_tokens_per_s": "rollout_s"}.get(name)


@dataclass
class Sampled:
    """A micro-batch's rollouts: the training rows, each completion as the rewards read it, and metrics of the
    sampler's own (sums; the stage's metric_unit says per what)."""

    rows: Rollouts
    completions: list[Completion]
    metrics: dict[str, float] = field(default_factory=dict)


class RolloutSampler:
    """A GRPO run's sampler: the reward's terms, the frozen reference (--beta > 0), and the step's batches."""

    def __init__(self, ctx: RunContext) -> None:
        o = ctx.options
        self.terms = parse_reward(o.reward, ctx.device)
        self.group, self.budget, self.temperature = o.num_generations, o.max_completion_tokens, o.temperature
        self.tokenizer, self.stop_ids = ctx.tokenizer, ctx.tokenizer.stop_ids(chat=True)
        self.reference = None
        if o.beta > 0:  # the --init_from model as it was (a LoRA run's adapters merged), frozen
            self.reference = load_model(ctx.init_dir, device=ctx.device)[0].eval().requires_grad_(False)
        self.scale_rewards, self.skip_uniform_groups = o.scale_rewards, o.skip_uniform_groups
        self.log_every = ctx.config.eval.eval_interval

    @torch.no_grad()
    def sample(self, ctx: RunContext, step: StepBatches) -> StepBatches:
        """The step's prompt micro-batches as PolicyGradient batches, with the rollouts' metrics (sums)."""
        device, seed, number, data = ctx.device, ctx.config.optim.seed, ctx.state.step, ctx.train_data
        micro, input_tokens, logged = [], 0, []
        sums: dict[str, float] = {}
        t0 = time.perf_counter()
        for ids, lengths, indices in step.micro:
            indices = indices.tolist()
            prompts = [row[len(row) - n:] for row, n in zip(ids.tolist(), lengths.tolist())]
            keys = rollout_keys(seed, number, indices, self.group)
            sampled = self.rollout(ctx, prompts, indices, keys)
            r, completions = sampled.rows, sampled.completions
            total, parts = score(self.terms, completions)
            advantages = group_advantages(total, self.group, self.scale_rewards)
            groups = total.view(-1, self.group)
            informative = groups.amax(dim=1) > groups.amin(dim=1)
            if self.skip_uniform_groups and informative.any():
                # a micro-batch where no group differs is trained whole, as without the option (all its advantages
                # are 0): never an empty step, which the loop would skip as non-finite (and fp16's scaler with it)
                r = r.only(informative.nonzero()[:, 0].tolist())
            batch = r.policy_batch(advantages)
            if self.reference is not None:
                batch = (*batch, self.reference_log_probs(batch, ctx.precision.autocast))
            micro.append(batch)
            policy_tokens = sum(c.tokens for c in completions)
            # the packed rows' inputs: each prompt once, then all its completions continued with (tools' results too)
            input_tokens += int((r.segment >= 0).sum())
            # sums; the log divides each by its metric_unit: rollout_tokens_per_s is the tokens sampled, over the
            # seconds this hook took (sampling, scoring and the reference's pass)
            add(sums, reward=total.sum(), completions=len(completions), groups=groups.shape[0],
                reward_std=groups.std(dim=1, unbiased=False).sum(), informative=informative.sum(),
                truncated=sum(r.truncated),
                completion_tokens=policy_tokens, rollout_tokens_per_s=policy_tokens, **sampled.metrics,
                **{f"reward/{k}": v.sum() for k, v in parts.items()})
            if not logged:
                logged = rollout_rows(completions, total, parts, self.group, data, indices)
        add(sums, rollout_s=time.perf_counter() - t0)
        if ctx.backend.is_main and every(self.log_every, number + 1, ctx.control.total_steps):
            ctx.logger.log_rows("rollouts", number + 1, logged)
        metrics = {k: torch.tensor(float(v), device=device, dtype=torch.float64) for k, v in sums.items()}
        return StepBatches(micro, input_tokens, metrics)

    def rollout(self, ctx: RunContext, prompts: list[list[int]], indices: list[int], keys: list[tuple[int, ...]]
                ) -> Sampled:
        """The group's completions of each prompt (the records at `indices` of the data), sampled with the rows'
        keys: one generation per completion."""
        records = ctx.train_data.records
        r = sample_rollouts(ctx.model, prompts, self.group, self.budget, self.stop_ids, self.tokenizer.pad_id,
                            self.temperature, autocast=ctx.precision.autocast, row_keys=keys)
        completions = [Completion(self.tokenizer.decode(c, skip_special_tokens=True), len(c), self.budget,
                                  records[indices[row]]) for row, c in zip(r.prompt_rows, r.completions)]
        return Sampled(r, completions)

    def reference_log_probs(self, batch: tuple[torch.Tensor, ...], autocast: Autocast) -> torch.Tensor:
        """The frozen reference's log-probability of each target of a policy batch at the sampling temperature (0
        elsewhere)."""
        inputs, targets = batch[0], batch[1]
        valid = targets != IGNORE_INDEX
        logits, _ = completion_logits(self.reference, inputs, valid, autocast, batch[4], batch[5])
        out = torch.zeros(targets.shape, device=targets.device)
        out[valid] = torch.log_softmax(logits.float() / self.temperature, -1).gather(-1, targets[valid][:, None])[:, 0]
        return out


def add(sums: dict[str, float], **values: Any) -> None:
    for k, v in values.items():
        sums[k] = sums.get(k, 0.0) + float(v)


def rollout_rows(completions: list[Completion], total: torch.Tensor, parts: dict[str, torch.Tensor], group: int,
                 data: Any, indices: list[int]) -> list[dict[str, Any]]:
    """The first groups' prompts, completions and rewards, as rollouts.jsonl rows (a rollout with tools: its turns
    too, the replies and the tools' results)."""
    rows = []
    for r, c in enumerate(completions[:LOGGED_GROUPS * group]):
        record = data.records[indices[r // group]]
        rows.append({"prompt": data.prompt_text(indices[r // group]), "answer": record.get("answer"),
                     "completion": c.text, "tokens": c.tokens, "reward": round(float(total[r]), 4),
                     **{k: round(float(v[r]), 4) for k, v in parts.items()},
                     **({"turns": list(c.tool_use.turns)} if c.tool_use is not None else {})})
    return rows
