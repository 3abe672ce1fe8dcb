"""The data settings shared by every entry point that reads a training file, and the one way to prepare them.

Training and `python -m dataset.cache` both build a DataConfig and call `prepare_data`, so a cache prepared
ahead of time (e.g. before a cluster job) has exactly the key the trainer looks up.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar, Literal

from common.config import option
from common.errors import ConfigError

from .cache import DEFAULT_SPLIT_SEED, TokenCache, prepare
from .tokenizer import Tokenizer


@dataclass
class DataConfig:
    """Where the training text is, how it is split and how it is tokenized (once, into a cache)."""

    title: ClassVar[str] = "data"
    data_path: str | None = option(None, "JSONL file (tokenized once, cached beside it)", metavar="F.jsonl")
    tokenizer: str | None = option(None, "tokenizer dir (default: model/tokenizer, or the --init_from "
                                         "checkpoint's)", metavar="DIR")
    val_fraction: float = option(0.005, "share of documents held out for validation", at_least=0, below=1)
    split_seed: int = option(DEFAULT_SPLIT_SEED, "seed of the document-level train/validation split (part of "
                                                 "the cache key; independent of --seed)")
    num_workers: int | None = option(None, "tokenization processes (default: CPUs, at most 8)", at_least=0)
    cache_dir: str | None = option(None, "token cache location (default: <data_path>.pocketlm-cache beside "
                                         "the data)", metavar="DIR")
    skip_bad_lines: bool = option(False, "skip and count malformed lines instead of stopping at the first")
    overlong: Literal["truncate", "drop"] = option(
        "truncate", "conversations over max_seq_len: cut after the last whole assistant turn that fits, or "
                    "drop", stages=("sft",))


def prepare_data(data: DataConfig, tokenizer: Tokenizer, kind: str, max_seq_len: int,
                 log: Callable[[str], None] = print) -> TokenCache:
    """The token cache for `data` (built if missing or stale). Pretraining caches do not depend on the
    context length (windows are cut at read time); SFT caches do, since overlong conversations are cut
    or dropped while tokenizing."""
    extra = {"max_seq_len": max_seq_len, "overlong": data.overlong} if kind == "sft" else {}
    return prepare(data.data_path, tokenizer, kind, data.val_fraction, data.split_seed, data.num_workers,
                   data.skip_bad_lines, data.cache_dir, log=log, **extra)


@dataclass
class CacheTarget:
    """What the prepared cache is for."""

    title: ClassVar[str] = "cache"
    kind: Literal["pretrain", "sft"] = option("pretrain", "pretraining text ({\"text\"}) or SFT conversations")
    # The SFT cache depends on the context; 512 is the default presets' (the trainer's --max_seq_len default).
    max_seq_len: int = option(512, "SFT only: conversations longer than this are cut or dropped (pass the "
                                   "--max_seq_len you will train with)", at_least=1)


@dataclass
class CacheConfig:
    """`python -m dataset.cache`: the trainers' data settings plus what the cache is for."""

    data: DataConfig
    target: CacheTarget

    def check(self) -> None:
        if self.data.data_path is None:
            raise ConfigError("--data_path is required")
