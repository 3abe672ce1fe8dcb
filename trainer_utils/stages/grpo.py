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
each term, the within-group standard deviation, the length and the truncated share; per token: the clipped share,
the ratio, the entropy and the KL; the sampler's tokens per second (per rank). At every evaluation the first
groups of that step go to rollouts.jsonl with their rewards; the held-out measure is --eval_tasks (the bundled
dataset/demo/math_heldout.jsonl: exact-match accuracy by generation).
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from common.errors import ConfigError
from common.tokens import IGNORE_INDEX
from dataset.config import PROMPTS, DataConfig
from model.checkpoint import load_model

from ..components.base import every
from ..objectives import Autocast, Objective, PolicyGradient, completion_logits
from ..rewards import Completion, group_advantages, parse_reward, score
from ..rollouts import sample_rollouts
from .base import Stage, StepBatches

if TYPE_CHECKING:
    from ..config import TrainConfig
    from ..loop import Trainer
    from ..session import Session

ROLLOUT_TAG = 0x67727030  # "grp0": separates the rollouts' random numbers from any other seeded stream
LOGGED_GROUPS = 2  # groups written to rollouts.jsonl at each evaluation


def rollout_keys(seed: int, step: int, indices: list[int], group: int) -> list[tuple[int, ...]]:
    """One sampling key per completion (prompt-major): the run's seed, the step, the prompt's index in the data
    and the completion's place in its group, so every member of a group samples its own tokens (a key without
    the member would sample the group's completions alike: equal rewards, zero advantages, nothing learned) and a
    resumed or data-parallel run draws exactly what one uninterrupted process draws."""
    return [(seed, ROLLOUT_TAG, step, i, g) for i in indices for g in range(group)]


class GRPO(Stage):
    name = "grpo"
    script = "train_grpo.py"
    defaults: ClassVar[dict[str, Any]] = dict(data_path=["dataset/demo/math_train.jsonl"], batch_size=8,
                                              learning_rate=1e-5, beta=0.0, temperature=1.0)
    features = frozenset({"conversations", "adapters", "reinforcement"})
    needs_init = True
    estimates_memory = False  # the estimate is of one training batch; here the rollouts' KV cache and a
    # reference model may run beside it (the log's peak memory is measured)

    def data_kind(self, data: DataConfig) -> str:
        return PROMPTS

    def check(self, config: TrainConfig) -> None:
        super().check(config)
        parse_reward(config.objective.reward)  # a bad spec or reward file fails now, before anything slow

    def record_tokens(self, session: Session) -> int:
        budget = session.config.objective.max_completion_tokens
        if budget >= session.max_seq_len:
            raise ConfigError(f"--max_completion_tokens {budget} leaves no room for a prompt in --max_seq_len "
                              f"{session.max_seq_len}")
        return session.max_seq_len - budget

    def objective(self, session: Session, device: torch.device) -> Objective:
        o = session.config.objective
        return PolicyGradient(o.loss_type, o.epsilon, o.epsilon_high, o.beta, o.temperature)

    def prepare(self, trainer: Trainer) -> RolloutSampler:
        return RolloutSampler(trainer)

    def before_loss(self, trainer: Trainer, step: StepBatches) -> StepBatches:
        return trainer.stage_state.sample(trainer, step)

    def metric_unit(self, name: str) -> str | None:
        if name in ("reward", "completion_tokens", "truncated") or name.startswith("reward/"):
            return "completions"
        return {"reward_std": "groups", "rollout_tokens_per_s": "rollout_s"}.get(name)


class RolloutSampler:
    """A GRPO run's sampler: the reward's terms, the frozen reference (--beta > 0), and the step's batches."""

    def __init__(self, trainer: Trainer) -> None:
        s = trainer.session
        o = s.config.objective
        self.terms = parse_reward(o.reward, trainer.device)
        self.group, self.budget, self.temperature = o.num_generations, o.max_completion_tokens, o.temperature
        self.tokenizer, self.stop_ids = s.tokenizer, s.tokenizer.stop_ids(chat=True)
        self.reference = None
        if o.beta > 0:  # the --init_from model as it was (a LoRA run's adapters merged), frozen
            self.reference = load_model(s.init_dir, device=trainer.device)[0].eval().requires_grad_(False)
        self.log_every = trainer.config.eval.eval_interval

    @torch.no_grad()
    def sample(self, trainer: Trainer, step: StepBatches) -> StepBatches:
        """The step's prompt micro-batches as PolicyGradient batches, with the rollouts' metrics (sums)."""
        s, device, seed, number = trainer.session, trainer.device, trainer.config.optim.seed, trainer.state.step
        records = s.train_data.records
        micro, input_tokens, logged = [], 0, []
        sums: dict[str, float] = {}
        t0 = time.perf_counter()
        for ids, lengths, indices in step.micro:
            indices = indices.tolist()
            prompts = [row[len(row) - n:] for row, n in zip(ids.tolist(), lengths.tolist())]
            keys = rollout_keys(seed, number, indices, self.group)
            r = sample_rollouts(trainer.model, prompts, self.group, self.budget, self.stop_ids,
                                self.tokenizer.pad_id, self.temperature, autocast=trainer.precision.autocast,
                                row_keys=keys)
            completions = [Completion(self.tokenizer.decode(c, skip_special_tokens=True), len(c), self.budget,
                                      records[indices[row]]) for row, c in zip(r.prompt_rows, r.completions)]
            total, parts = score(self.terms, completions)
            advantages = group_advantages(total, self.group, trainer.config.objective.scale_rewards)
            batch = (r.inputs, r.targets, r.old_log_probs, advantages.to(device))
            if self.reference is not None:
                batch = (*batch, self.reference_log_probs(r.targets, r.inputs, trainer.precision.autocast))
            micro.append(batch)
            sampled = sum(c.tokens for c in completions)
            input_tokens += sum(len(p) for p in prompts) * self.group + sampled
            groups = total.view(-1, self.group)
            # sums; the log divides each by its metric_unit: rollout_tokens_per_s is the tokens sampled, over the
            # seconds this hook took (sampling, scoring and the reference's pass)
            add(sums, reward=total.sum(), completions=len(completions), groups=groups.shape[0],
                reward_std=groups.std(dim=1, unbiased=False).sum(), truncated=sum(r.truncated),
                completion_tokens=sampled, rollout_tokens_per_s=sampled,
                **{f"reward/{k}": v.sum() for k, v in parts.items()})
            if not logged:
                logged = rollout_rows(completions, total, parts, self.group, s.train_data, indices)
        add(sums, rollout_s=time.perf_counter() - t0)
        if trainer.backend.is_main and every(self.log_every, number + 1, trainer.total_steps):
            trainer.logger.log_rows("rollouts", number + 1, logged)
        metrics = {k: torch.tensor(float(v), device=device, dtype=torch.float64) for k, v in sums.items()}
        return StepBatches(micro, input_tokens, metrics)

    def reference_log_probs(self, targets: torch.Tensor, inputs: torch.Tensor, autocast: Autocast) -> torch.Tensor:
        """The frozen reference's log-probability of each target at the sampling temperature (0 elsewhere)."""
        valid = targets != IGNORE_INDEX
        logits, _ = completion_logits(self.reference, inputs, valid, autocast)
        out = torch.zeros(targets.shape, device=targets.device)
        out[valid] = torch.log_softmax(logits.float() / self.temperature, -1).gather(-1, targets[valid][:, None])[:, 0]
        return out


def add(sums: dict[str, float], **values: Any) -> None:
    for k, v in values.items():
        sums[k] = sums.get(k, 0.0) + float(v)


def rollout_rows(completions: list[Completion], total: torch.Tensor, parts: dict[str, torch.Tensor], group: int,
                 data: Any, indices: list[int]) -> list[dict[str, Any]]:
    """The first groups' prompts, completions and rewards, as rollouts.jsonl rows."""
    rows = []
    for r, c in enumerate(completions[:LOGGED_GROUPS * group]):
        record = data.records[indices[r // group]]
        rows.append({"prompt": data.prompt_text(indices[r // group]), "answer": record.get("answer"),
                     "completion": c.text, "tokens": c.tokens, "reward": round(float(total[r]), 4),
                     **{k: round(float(v[r]), 4) for k, v in parts.items()}})
    return rows
