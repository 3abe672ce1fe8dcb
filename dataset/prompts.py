"""Prompts with checked answers, for reinforcement learning: read with file:line errors, tokenized through the
chat template, walked in a seeded order that a resume (on any number of ranks) picks up where it stopped.

    {"prompt": "What is 7 + 5?", "answer": "12"}                                     the prompt is the user's turn
    {"conversations": [{"role": "user", "content": "..."}, ...], "answer": ["12", "twelve"]}
                                              MiniMind's RL format: a last assistant turn (a placeholder) is left out

Each record is kept whole: rewards read its "answer" and any other field (trainer_utils/rewards.py). Prompts are
few and short, so they are tokenized in memory when read (no token cache). A batch is the prompts' token ids,
left-padded (as generation takes them), their lengths and their record indices.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from common.errors import DataError

from .datasets import GlobalOrder
from .jsonl import SkipReport, prompt_messages, read_records
from .kinds import PROMPTS, RECORDS
from .tokenizer import Tokenizer


class PromptDataset(GlobalOrder):
    """The prompts of one JSONL file (module docstring). A prompt longer than max_prompt_tokens is a bad line
    (DataError naming it, or counted into `report` with skip_bad_lines)."""

    def __init__(self, path: str | Path, tokenizer: Tokenizer, max_prompt_tokens: int, seed: int = 0,
                 skip_bad_lines: bool = False, report: SkipReport | None = None) -> None:
        super().__init__(seed)
        self.path, self.pad_id = Path(path), tokenizer.pad_id
        self.report = report if report is not None else SkipReport()
        self.records: list[dict[str, Any]] = []
        self.linenos: list[int] = []  # each record's line in the file, for messages that name it
        self.prompts: list[list[int]] = []
        for lineno, record in read_records(path, RECORDS[PROMPTS], skip_bad_lines, self.report):
            ids = tokenizer.chat_prompt(prompt_messages(record))
            if len(ids) > max_prompt_tokens:
                self.report.reject(self.path, lineno, f"the prompt is {len(ids)} tokens, more than the "
                                   f"{max_prompt_tokens} it may take", skip_bad_lines)
                continue
            self.records.append(record)
            self.linenos.append(lineno)
            self.prompts.append(ids)
        if not self.prompts:
            raise DataError(f"{path}: no prompts left ({self.report.summary()})")
        self.lengths = np.array([len(p) for p in self.prompts], dtype=np.int64)

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def num_examples(self) -> int:
        return len(self.prompts)

    def prompt_text(self, index: int) -> str:
        """What the prompt asks: its last user turn."""
        return prompt_messages(self.records[index])[-1]["content"]

    def epoch_order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.prompts))

    def input_tokens(self, indices: np.ndarray) -> int:
        return int(self.lengths[indices].sum())

    def batch(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ids (B, longest) left-padded, lengths (B,), record indices (B,))."""
        lengths = self.lengths[indices]
        ids = np.full((len(indices), int(lengths.max())), self.pad_id, dtype=np.int64)
        for row, i in enumerate(indices):
            ids[row, ids.shape[1] - lengths[row]:] = self.prompts[i]
        return torch.from_numpy(ids), torch.from_numpy(lengths.copy()), torch.from_numpy(np.asarray(indices,
                                                                                                    dtype=np.int64))
