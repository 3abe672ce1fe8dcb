"""The kinds of training data, each named once, and the record each kind reads.

A stage trains on one kind (trainer_utils/stages: Stage.data_kind). The kind's value names its token cache on disk
(and `python -m dataset.cache --kind`), so the values stay as they were: raw text ("pretrain"), conversations
("sft") and preference pairs ("dpo") are tokenized once into a cache; prompts with checked answers ("prompts"),
for reinforcement learning, are few and short, tokenized in memory when read, with no cache and no validation
split. What a line of a .jsonl file must hold is its record shape (dataset/jsonl.py parse_line): RECORDS maps
each kind to the shape it reads, so no module spells that pairing again.
"""
from __future__ import annotations

from typing import Final, Literal

CachedKind = Literal["pretrain", "sft", "dpo"]
DataKind = Literal[CachedKind, "prompts"]
TEXT: Final[DataKind] = "pretrain"
CONVERSATIONS: Final[DataKind] = "sft"
PAIRS: Final[DataKind] = "dpo"
PROMPTS: Final[DataKind] = "prompts"

# What one line must be: {"text"}, {"conversations"}, {"chosen", "rejected"} (with a prompt), {"prompt" |
# "conversations", "answer"}; "any" takes text or conversations, "object" any JSON object.
RecordShape = Literal["text", "conversations", "dpo", "prompt", "any", "object"]
RECORDS: Final[dict[DataKind, RecordShape]] = {TEXT: "text", CONVERSATIONS: "conversations", PAIRS: "dpo",
                                               PROMPTS: "prompt"}
