"""Rewards for reinforcement learning that are checked, not guessed, and the group-normalised advantages made
from them (GRPO: each prompt's completions compared with each other).

A reward spec is a comma-separated list of terms, each optionally weighted: "exact", "exact=1,format=0.2",
"exact,length=0.5", "my_rewards.py:score=0.5". The built-in terms (each in [0, 1] or [-1, 0]):

    exact    1 when the completion's answer is the record's "answer" (common/answers.py answer_right: a number
             after "the answer is" or the last number; a text answer, a date or a name, stated so or the whole
             text, normalised), else 0: the verifiable reward, the evaluation's judge of tool items. A
             completion that states several different numbers ("The answer is 3. The answer is 4.") gets 0:
             otherwise listing guesses pays, and a policy learns to
    format   1 when the completion states one answer in the taught format ("... The answer is 12."), else 0
    tool_call
             1 when the completion's first tool call is the record's "tool_call" ({"name", "arguments"}, compared
             as common/tool_calls.same_call compares them) and no call is malformed, else 0 (the prompts of
             dataset/demo/tools_heldout.jsonl carry it)
    tool_use 1 when a rollout with tools (train_agent.py) made calls, every one well formed and run without an
             error, and then answered right (as `exact` judges); else 0. A bonus on a checked answer: calls
             alone earn nothing, and neither do clean calls followed by a wrong answer (which a group where
             nobody is right would otherwise reward)
    length   0 up to LENGTH_FREE of the budget, then falling linearly to -1 at the whole budget (a completion
             cut off by the budget gets -1): long rambling answers cost
    FILE.py:FUNCTION
             the user's own: FUNCTION(completion: str, record: dict) -> float, where `record` is the prompt's
             JSON record (its "answer" and any other fields)
    DIR      a Hugging Face sequence-classification model directory (a reward model you have locally, e.g.
             MiniMind's InternLM2-1.8B-reward): its score of the prompt's chat answered by the completion (the
             logit with one label, else the last label's probability); needs `transformers`

The total is the weighted sum. Only a DIR term needs a second model: every other term is computed from the text.
"""
from __future__ import annotations

import importlib.util
import inspect
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from common.answers import answer_right, stated_numbers
from common.errors import ConfigError, TrainingError
from common.files import require_package
from common.tool_calls import parse_reply, same_call
from dataset.jsonl import prompt_messages

LENGTH_FREE = 0.5  # the share of the token budget a completion may use before the length term costs anything


@dataclass
class ToolUse:
    """What a rollout with tools did (trainer_utils/rollouts.py sample_tool_rollouts, which fills it in as the
    rollout goes): the turns it added after the prompt (its replies as assistant messages, the tools' results as
    tool messages), the calls it made, the blocks that looked like calls but were not, the calls whose result was
    an error (unknown tool, bad arguments), and how it ended if not with an answer: `capped` (still calling after
    the last round), `overflow` (no room left in the context), `cut` (a reply ran out of tokens)."""

    turns: list[dict[str, Any]] = field(default_factory=list)
    calls: int = 0
    malformed: int = 0
    errors: int = 0
    capped: bool = False
    overflow: bool = False
    cut: bool = False

    @property
    def answered(self) -> bool:
        """It ended with a reply of its own (no calls left unrun, not cut off)."""
        return not (self.capped or self.overflow or self.cut)


@dataclass(frozen=True)
class Completion:
    """One sampled completion, as rewards see it: its text, its token count and budget, and its prompt's
    record (with the gold "answer"). A rollout with tools: `text` is its final answer ("" when it ended without
    one), `tokens` the policy's own, and `tool_use` what it did."""

    text: str
    tokens: int
    budget: int
    record: dict[str, Any]
    tool_use: ToolUse | None = None


RewardFn = Callable[[Completion], float]
BatchRewardFn = Callable[[Sequence[Completion]], list[float]]


def exact(c: Completion) -> float:
    answers = c.record.get("answer")
    answers = [answers] if isinstance(answers, str) else answers
    if not answers or len(set(stated_numbers(c.text))) > 1:
        return 0.0
    return float(answer_right(c.text, answers, stated_only=True))


def stated(c: Completion) -> float:
    return float(len(stated_numbers(c.text)) == 1)


def tool_call(c: Completion) -> float:
    call, reply = c.record.get("tool_call"), parse_reply(c.text)
    if not isinstance(call, dict) or not reply.calls or reply.malformed:
        return 0.0
    return float(same_call(reply.calls[0], call.get("name"), call.get("arguments") or {}))


def tool_use(c: Completion) -> float:
    """1 when a rollout called tools, every call was well formed and ran, and it went on to the right answer
    (`exact`): only what the answer's check verifies pays. Calls alone earn nothing (a rollout that loops on calls
    until the cap gets 0), nor does an answer without a call, nor a clean call followed by a wrong answer
    (`calculator("1")` and any guess would otherwise beat the rest of a group where nobody is right)."""
    u = c.tool_use
    clean = u is not None and u.calls > 0 and u.malformed == 0 and u.errors == 0 and u.answered
    return float(clean and exact(c) == 1.0)


def length(c: Completion) -> float:
    free = LENGTH_FREE * c.budget
    return -min(1.0, max(0.0, (c.tokens - free) / (c.budget - free))) if c.budget > free else 0.0


BUILTIN: dict[str, RewardFn] = {"exact": exact, "format": stated, "length": length, "tool_call": tool_call,
                                "tool_use": tool_use}


@dataclass(frozen=True)
class Term:
    """One weighted term of a reward: `fn` scores a batch of completions (a per-completion function is mapped)."""

    name: str
    weight: float
    fn: BatchRewardFn


def each(fn: RewardFn) -> BatchRewardFn:
    return lambda completions: [fn(c) for c in completions]


class RewardModel:
    """A Hugging Face sequence-classification model directory as a reward term (module docstring). Checked when
    named; loaded on first use, on `device`, in eval mode; completions scored in batches of `batch_size`."""

    def __init__(self, path: Path, device: torch.device | str = "cpu", batch_size: int = 16) -> None:
        require_package("transformers", f"reward {path} (a reward model directory)")
        try:
            architectures = json.loads((path / "config.json").read_text()).get("architectures") or []
        except (OSError, ValueError) as e:
            raise ConfigError(f"reward {path}: cannot read its config.json ({e})") from None
        if not any(a.endswith("ForSequenceClassification") for a in architectures):
            raise ConfigError(f"reward {path}: not a sequence-classification model (architectures: "
                              f"{architectures or 'none'}); a reward model scores text with one output")
        self.path, self.device, self.batch_size = path, torch.device(device), batch_size
        self.model: Any = None

    def _load(self) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer
        self.tokenizer = AutoTokenizer.from_pretrained(self.path, local_files_only=True, trust_remote_code=True)
        if self.tokenizer.pad_token is None:  # batches are padded; the model reads its score at the last token
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForSequenceClassification.from_pretrained(
            self.path, local_files_only=True, trust_remote_code=True).to(self.device).eval()
        self.model.config.pad_token_id = self.tokenizer.pad_token_id

    def text(self, c: Completion) -> str:
        """The prompt's chat answered by the completion, as the reward model's chat template writes it (its
        turns on lines of their own when it has none)."""
        chat = [*prompt_messages(c.record), {"role": "assistant", "content": c.text}]
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template(chat, tokenize=False)
        return "\n".join(m["content"] for m in chat)

    @torch.no_grad()
    def __call__(self, completions: Sequence[Completion]) -> list[float]:
        if self.model is None:
            self._load()
        out: list[float] = []
        for i in range(0, len(completions), self.batch_size):
            texts = [self.text(c) for c in completions[i:i + self.batch_size]]
            batch = self.tokenizer(texts, padding=True, truncation=True, return_tensors="pt").to(self.device)
            logits = self.model(**batch).logits.float()
            out += (logits[:, 0] if logits.shape[-1] == 1 else logits.softmax(-1)[:, -1]).tolist()
        return out


def user_reward(spec: str) -> RewardFn:
    """FILE.py:FUNCTION as a reward; ConfigError naming the file when it cannot be used."""
    path, _, name = spec.rpartition(":")
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"reward {spec}: no such file {path}")
    module_spec = importlib.util.spec_from_file_location(f"pocketlm_reward_{file.stem}", file)
    module = importlib.util.module_from_spec(module_spec)  # type: ignore[arg-type]
    try:
        module_spec.loader.exec_module(module)  # type: ignore[union-attr]
    except Exception as e:  # the user's file: any error it raises is theirs to see, in one line
        raise ConfigError(f"reward {spec}: importing {path} failed: {type(e).__name__}: {e}") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ConfigError(f"reward {spec}: {path} has no function {name!r}")
    try:
        inspect.signature(fn).bind("completion", {})
    except TypeError:
        raise ConfigError(f"reward {spec}: {name} must take (completion: str, record: dict)") from None

    def call(c: Completion) -> float:  # per completion: the user's function sees one at a time
        try:
            value = fn(c.text, c.record)
        except Exception as e:  # the user's code: one line naming it and what it was given, not a traceback
            raise TrainingError(f"reward {spec}: {name} raised {type(e).__name__}: {e} (on the completion "
                                f"{c.text[:80]!r} of the record answered {c.record.get('answer')!r}); the last "
                                "checkpoint is intact") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(f"reward {spec}: {name} returned {value!r}; a reward is a finite number")
        return float(value)
    return call


def parse_reward(spec: str, device: torch.device | str = "cpu") -> list[Term]:
    """The terms of a reward spec (module docstring); ConfigError for an unknown term or a bad weight. A reward
    model runs on `device`."""
    terms = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        name, eq, weight_text = part.rpartition("=") if "=" in part else (part, "", "")
        try:
            weight = float(weight_text) if eq else 1.0
        except ValueError:
            raise ConfigError(f"reward {part}: the weight {weight_text!r} is not a number") from None
        if not math.isfinite(weight):
            raise ConfigError(f"reward {part}: the weight must be finite")
        if name in BUILTIN:
            terms.append(Term(name, weight, each(BUILTIN[name])))
        elif ".py:" in name:
            terms.append(Term(name.rpartition(":")[2], weight, each(user_reward(name))))
        elif Path(name).is_dir():
            terms.append(Term(Path(name).name, weight, RewardModel(Path(name), device)))
        else:
            raise ConfigError(f"reward {name}: unknown; built in: {', '.join(BUILTIN)}, FILE.py:FUNCTION, or a "
                              "reward model's directory")
    if not terms:
        raise ConfigError("a reward spec names no term")
    return terms


def score(terms: Sequence[Term], completions: Sequence[Completion]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(the total reward of each completion, each term's unweighted values), as float32 tensors."""
    parts = {t.name: torch.tensor(t.fn(completions), dtype=torch.float32) for t in terms}
    total = sum((t.weight * parts[t.name] for t in terms), torch.zeros(len(completions)))
    return total, parts


def group_advantages(rewards: torch.Tensor, group_size: int, scale: bool = True, eps: float = 1e-4
                     ) -> torch.Tensor:
    """GRPO's advantages: each reward minus the mean of its group (the group_size completions of one prompt,
    consecutive), divided by the group's standard deviation when `scale` (Dr. GRPO leaves it out: scale=False).
    A group whose completions all scored the same gets 0: there is nothing to prefer."""
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not make groups of {group_size}")
    groups = rewards.view(-1, group_size).float()
    centred = groups - groups.mean(dim=1, keepdim=True)
    if scale:
        centred = centred / (groups.std(dim=1, keepdim=True, unbiased=False) + eps)
    return centred.flatten()
