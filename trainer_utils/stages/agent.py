"""Agentic reinforcement learning: GRPO (or CISPO) on rollouts that call the bundled tools (train_agent.py).

The GRPO stage with one thing changed: a completion is a conversation. Each rollout generates a reply; a reply
that ends its turn with well-formed tool calls has them run by the bundled registry (common/tools.py, only the
tools its prompt offers; the model's text is never evaluated), the results come back as the chat template
writes tool turns, and the rollout goes on, for at most --max_rounds rounds of calls, all rollouts of a step
batched together (trainer_utils/rollouts.py sample_tool_rollouts). The loss covers the replies' tokens only: the
prompt, the tools' results and the template's markers around them are masked, and every reply keeps the
sampler's log-probabilities. Keys as GRPO's, with the round: a resume and a DDP run sample what one process does.

Rewards judge the end (`exact` on the final answer: a rollout that loops on calls until the cap, or is cut off,
has none) with an optional small `tool_use` term for calls that were all well formed and ran; calls alone earn
nothing. Malformed calls, unknown tools, tool errors and the cap are ordinary outcomes, counted in the log:
tool_calls and malformed per rollout, call_errors per call, capped and overflow shares.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from common.config import option
from common.errors import DataError
from common.tools import BUNDLED, Tool

from ..context import RunContext
from ..rewards import Completion
from ..rollouts import sample_tool_rollouts
from .grpo import GRPO, GRPOOptions, RolloutSampler, Sampled


@dataclass
class AgentOptions(GRPOOptions):
    """GRPO's settings (their agentic defaults in AgentRL.defaults), and how many rounds of calls a rollout makes."""

    title: ClassVar[str] = "agentic reinforcement learning (GRPO / CISPO with tools)"
    max_rounds: int = option(3, "rounds of tool calls a rollout may make; a reply still calling after them ends it "
                                "unanswered (capped)", at_least=1)


class AgentRL(GRPO):
    name = "agent"
    script = "train_agent.py"
    options = AgentOptions
    # a reply with a call and a short answer fit 96 tokens; the reward judges the end, with a little for clean calls
    defaults: ClassVar[dict[str, Any]] = dict(data_path=["dataset/demo/tools_rl.jsonl"], batch_size=4,
                                              learning_rate=1e-5, max_completion_tokens=96,
                                              reward="exact,tool_use=0.1")

    def prepare(self, ctx: RunContext) -> ToolSampler:
        return ToolSampler(ctx)

    def metric_unit(self, name: str) -> str | None:
        if name in ("tool_calls", "malformed", "capped", "overflow"):
            return "completions"
        if name == "call_errors":
            return "calls"
        return super().metric_unit(name)


def offered_tools(data: Any) -> list[dict[str, Tool]]:
    """Each prompt's tools, from the registry: the ones its system turn offers (all of them when it offers none).
    DataError naming the file and line of a prompt that offers a tool the registry does not have."""
    out = []
    for record, lineno in zip(data.records, data.linenos):
        turns = record.get("conversations") or record.get("messages") or []
        schemas = turns[0].get("tools") if turns and turns[0].get("role") == "system" else None
        names = [t.get("function", t)["name"] for t in schemas or ()]
        unknown = [n for n in names if n not in BUNDLED]
        if unknown:
            raise DataError(f"{data.path}:{lineno}: offers tool {unknown[0]!r}, which is not one of the bundled "
                            f"tools train_agent.py runs ({', '.join(BUNDLED)})")
        out.append({n: BUNDLED[n] for n in names} if names else dict(BUNDLED))
    return out


class ToolSampler(RolloutSampler):
    """GRPO's sampler, its completions rollouts with tools (the module docstring)."""

    def __init__(self, ctx: RunContext) -> None:
        super().__init__(ctx)
        self.rounds, self.max_len = ctx.options.max_rounds, ctx.max_seq_len
        self.tools = offered_tools(ctx.train_data)

    def rollout(self, ctx: RunContext, prompts: list[list[int]], indices: list[int], keys: list[tuple[int, ...]]
                ) -> Sampled:
        """The group's rollouts of each prompt, with the tools each prompt offers."""
        records = ctx.train_data.records
        t = sample_tool_rollouts(ctx.model, prompts, self.group, self.budget, self.rounds, self.max_len,
                                 self.tokenizer, [self.tools[i] for i in indices], self.temperature,
                                 autocast=ctx.precision.autocast, row_keys=keys)
        rows = t.rows
        budget = self.budget * (self.rounds + 1)
        completions = [Completion(final, tokens, budget, records[indices[row]], use)
                       for row, final, tokens, use in zip(rows.prompt_rows, t.finals, t.policy_tokens, t.uses)]
        metrics = {"tool_calls": sum(u.calls for u in t.uses), "calls": sum(u.calls for u in t.uses),
                   "call_errors": sum(u.errors for u in t.uses), "malformed": sum(u.malformed for u in t.uses),
                   "capped": sum(u.capped for u in t.uses), "overflow": sum(u.overflow for u in t.uses)}
        return Sampled(rows, completions, metrics)
