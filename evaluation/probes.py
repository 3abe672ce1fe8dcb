"""Watching a model learn: samples of fixed prompts, and probes with a known answer.

A prompt file has one prompt per line; `prompt<TAB>expected` makes it a probe ("The capital of France is<TAB>
Paris"). A probe reports three things, so progress is visible long before the answer is right:
    correct   the greedy continuation contains the expected text
    logprob   log-probability of the expected continuation given the prompt (teacher-forced), in nats
    rank      rank of its first token among all next tokens after the prompt (1 = the model's top choice)
Tokenizer-dependent steps come in as callables (model/ does not import dataset/).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from common.errors import DataError
from model.generate import generate
from model.model import PocketLM


@dataclass
class Probe:
    """One line of a prompt file: the prompt and, for a probe, the expected answer."""

    prompt: str
    expected: str | None = None
    where: str = ""  # file:line, for messages


@dataclass
class ProbeResult:
    """What a probe showed at one point of training."""

    prompt: str
    expected: str
    greedy: str
    correct: bool
    logprob: float
    rank: int


def read_prompt_file(path: str | Path) -> list[Probe]:
    """Prompts (and `prompt<TAB>expected` probes) of a file; blank lines and lines starting with '#' are
    skipped. DataError names the file (and line) when it cannot be used."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: cannot read prompt file ({getattr(e, 'strerror', None) or e})") from None
    probes = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        prompt, _, expected = line.partition("\t")
        if not prompt.strip():
            raise DataError(f"{path}:{lineno}: empty prompt before the tab")
        probes.append(Probe(prompt.strip(), expected.strip() or None, f"{path}:{lineno}"))
    if not probes:
        raise DataError(f"{path}: no prompts (one per line, `prompt<TAB>expected` for a probe; '#' comments)")
    return probes


def read_probe_file(path: str | Path) -> list[Probe]:
    """A prompt file in which every line is a probe (`prompt<TAB>expected`)."""
    probes = read_prompt_file(path)
    for p in probes:
        if p.expected is None:
            raise DataError(f"{p.where}: a probe is `prompt<TAB>expected`; this line has no tab or no answer")
    return probes


def continuation_ids(prompt: str, expected: str, encode: Callable[[str], list[int]],
                     prompt_ids: list[int]) -> list[int]:
    """The ids of `expected` as the continuation of raw text `prompt`.

    Between two words a space belongs to the answer (" Paris"). Tokenized together, prompt and answer split
    at the prompt's own ids when the tokenizer puts a boundary there (GPT-2-style pre-tokenizers do before a
    space); a run of CJK characters is one pre-token, so there the answer is tokenized on its own.
    """
    joiner = " " if prompt[-1:].isascii() and prompt[-1:].isalnum() and expected[:1].isascii() and \
        expected[:1].isalnum() else ""
    text = joiner + expected
    joint = encode(prompt + text)
    if joint[:len(prompt_ids)] == prompt_ids and len(joint) > len(prompt_ids):
        return joint[len(prompt_ids):]
    return encode(text)


@torch.no_grad()
def score_continuation(model: PocketLM, prompt_ids: Sequence[int], expected_ids: Sequence[int]) -> tuple[float, int]:
    """(log-probability of expected_ids after prompt_ids, rank of their first token among all next tokens)."""
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt_ids) + list(expected_ids)], device=device)
    logp = torch.log_softmax(model(ids)[0].float(), dim=-1)
    first = len(prompt_ids) - 1  # the position that predicts the first expected token
    targets = torch.tensor(list(expected_ids), device=device)
    picked = logp[first:first + len(expected_ids)].gather(1, targets[:, None])
    rank = int((logp[first] > logp[first, expected_ids[0]]).sum()) + 1
    return float(picked.sum()), rank


def run_probes(model: PocketLM, probes: Sequence[Probe], prompt_ids: Callable[[str], list[int]],
               encode: Callable[[str], list[int]], decode: Callable[[list[int]], str], chat: bool,
               eos_token_ids: Sequence[int], pad_token_id: int, max_new_tokens: int = 16) -> list[ProbeResult]:
    """Greedy continuation, log-probability and rank of each probe's expected answer. `prompt_ids` renders a
    prompt as the model is prompted (raw text, or a chat turn when `chat`); an answer to a chat prompt is the
    assistant's content, whose first token the template keeps on a token boundary."""
    was_training = model.training
    model.eval()
    prompts = [prompt_ids(p.prompt) for p in probes]
    greedy = generate(model, prompts, max_new_tokens=max_new_tokens, temperature=0.0,
                      eos_token_ids=eos_token_ids, pad_token_id=pad_token_id)
    results = []
    for probe, ids, new in zip(probes, prompts, greedy):
        answer = encode(probe.expected) if chat else continuation_ids(probe.prompt, probe.expected, encode, ids)
        logprob, rank = score_continuation(model, ids, answer)
        text = decode(new)
        results.append(ProbeResult(probe.prompt, probe.expected, text,
                                   probe.expected.casefold() in text.casefold(), logprob, rank))
    model.train(was_training)
    return results
