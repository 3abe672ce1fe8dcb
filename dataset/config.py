"""The data settings shared by every entry point that reads training files, and the one way to prepare them.

Training, `python -m dataset.cache` and `python -m dataset.inspect` all build a DataConfig and call
`prepare_data` (and the latter two `training_data`), so a cache prepared ahead of time (e.g. before a cluster
job) has exactly the key the trainer looks up, and the batches inspected are the ones trained on.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, Literal

from common.config import option
from common.errors import ConfigError

from .datasets import PretrainDataset, SFTDataset
from .jsonl import DataError, SkipReport
from .kinds import CONVERSATIONS, PAIRS, PROMPTS, TEXT, CachedKind, DataKind
from .mixture import Mixture
from .preference import PreferenceDataset
from .prompts import PromptDataset
from .token_cache import DEFAULT_SPLIT_SEED, TokenCache, prepare
from .tokenizer import Tokenizer


@dataclass(frozen=True)
class DataSource:
    """One training file of the mix, with its weight (None: proportional to its size)."""

    path: str
    weight: float | None = None

    @property
    def name(self) -> str:
        return Path(self.path).stem


def parse_source(spec: str) -> DataSource:
    """`path` or `path:weight`. The weight is what follows the last colon when that is a number, so paths that
    contain colons still work."""
    path, sep, tail = spec.rpartition(":")
    if not sep or not path:
        return DataSource(spec)
    try:
        weight = float(tail)
    except ValueError:
        return DataSource(spec)
    if not math.isfinite(weight) or weight <= 0:
        raise ConfigError(f"--data_path {spec}: the weight must be a positive number, got {tail}")
    return DataSource(path, weight)


@dataclass
class DataConfig:
    """Where the training text is, how it is split and how it is tokenized (once, into a cache)."""

    title: ClassVar[str] = "data"
    data_path: list[str] | None = option(
        None, "JSONL file(s), each tokenized once and cached beside it; several are mixed by weight: a.jsonl:0.7 "
              "b.jsonl:0.3 (default weights: proportional to size)", metavar="F.jsonl[:W]", several=True)
    tokenizer: str | None = option(None, "tokenizer dir (default: model/tokenizer, or the --init_from "
                                         "checkpoint's)", metavar="DIR")
    val_fraction: float = option(0.005, "share of documents held out for validation", at_least=0, below=1)
    eval_data_path: list[str] | None = option(
        None, "JSONL file(s) scored at every evaluation beside the --data_path files' validation splits and never "
              "trained on (val_loss/<file>, val_ppl/<file>), e.g. the documents `python -m dataset.ingest "
              "--heldout` set aside", metavar="F.jsonl", several=True)
    split_seed: int = option(DEFAULT_SPLIT_SEED, "seed of the document-level train/validation split (part of "
                                                 "the cache key; independent of --seed)")
    num_workers: int | None = option(None, "tokenization processes (default: CPUs, at most 8)", at_least=0)
    cache_dir: str | None = option(None, "token cache location (default: <data_path>.pocketlm-cache beside "
                                         "the data)", metavar="DIR")
    skip_bad_lines: bool = option(False, "skip and count malformed lines instead of stopping at the first")
    overlong: Literal["truncate", "drop"] = option(
        "truncate", "conversations over max_seq_len: cut after the last whole assistant turn that fits, or "
                    "drop (DPO pairs: drop the oldest prompt turns, then cut the answers' ends)",
        feature="conversations")


    def sources(self) -> list[DataSource]:
        """The --data_path files with their weights, checked: all weighted or none, no file twice."""
        sources = [parse_source(spec) for spec in self.data_path or []]
        if not sources:
            raise ConfigError("--data_path is required")
        weighted = [s.weight is not None for s in sources]
        if any(weighted) and not all(weighted):
            raise ConfigError("--data_path: give a weight to every file (a.jsonl:0.7 b.jsonl:0.3) or to none "
                              "(proportional to size)")
        paths = [str(Path(s.path).resolve()) for s in sources]
        twice = list(dict.fromkeys(s.path for s, p in zip(sources, paths) if paths.count(p) > 1))
        if twice:
            raise ConfigError(f"--data_path names {', '.join(twice)} more than once")
        return sources


def prepare_data(data: DataConfig, tokenizer: Tokenizer, kind: CachedKind, max_seq_len: int,
                 log: Callable[[str], None] = print) -> list[tuple[DataSource, TokenCache]]:
    """The token cache of each --data_path file (built if missing or stale). Pretraining caches do not depend
    on the context length (windows are cut at read time); SFT and DPO caches do, since overlong examples are cut
    or dropped while tokenizing."""
    prepared = [(source, prepare_file(source.path, data, tokenizer, kind, max_seq_len, data.val_fraction, log))
                for source in data.sources()]
    for source, cache in prepared:
        if (note := compression_note(source.path, cache, tokenizer)) is not None:
            log(note)
    return prepared


def prepare_file(path: str, data: DataConfig, tokenizer: Tokenizer, kind: CachedKind, max_seq_len: int,
                 val_fraction: float, log: Callable[[str], None]) -> TokenCache:
    """One file's token cache, with the data settings."""
    extra = {"max_seq_len": max_seq_len, "overlong": data.overlong} if kind != TEXT else {}
    return prepare(path, tokenizer, kind, val_fraction, data.split_seed, data.num_workers, data.skip_bad_lines,
                   data.cache_dir, log=log, **extra)


# A text that takes this many times the tokens per byte of the tokenizer's own text is in a script or language the
# tokenizer barely learned; without the tokenizer's own figure (compression.json), about a token per byte is its
# byte-level fallback.
POOR_COMPRESSION = 1.6
FALLBACK_BYTES_PER_TOKEN = 1.5


def compression_note(path: str, cache: TokenCache, tokenizer: Tokenizer) -> str | None:
    """A warning when the tokenizer compresses the file's text much worse than its own (None when it does not,
    or the cache predates the byte count)."""
    text_bytes = cache.meta.get("stats", {}).get("text_bytes")
    splits = cache.meta["splits"].values()
    tokens = sum(s["tokens"] for s in splits) - sum(s["documents"] for s in splits)  # less each <|endoftext|>
    if not text_bytes or tokens <= 0:
        return None
    bpt, own = text_bytes / tokens, tokenizer.own_bytes_per_token
    if own is not None and own / bpt >= POOR_COMPRESSION:
        against = f"{own / bpt:.1f} times the tokens per byte of the tokenizer's own text ({own:.2f} bytes a token)"
    elif own is None and bpt < FALLBACK_BYTES_PER_TOKEN:
        against = "about one token per byte: the tokenizer falls back to single bytes for most of it"
    else:
        return None
    return (f"warning: {path}: {bpt:.2f} bytes per token, {against}. Another script or language? Each token "
            "carries less of it and a context window holds less. Training works; to do better, train a tokenizer "
            "on this text mixed with your general text (train_tokenizer.py) and pretrain a model with it "
            "(--init_from keeps the start model's tokenizer)")


@dataclass
class ValSet:
    """One source's validation split (or a whole --eval_data_path file), and its weight in the mixture's validation
    loss (0 for an --eval_data_path file: scored, not mixed in)."""

    name: str
    weight: float
    data: Any  # PretrainDataset | SFTDataset | PreferenceDataset


@dataclass
class TrainingData:
    """What the trainer reads: one training order (a Mixture when there are several files), and each file's
    validation split (none when it has no validation documents)."""

    train: Any  # PretrainDataset | SFTDataset | PreferenceDataset | Mixture
    val: list[ValSet]
    sources: list[dict[str, Any]]  # path, weight (normalised) and training samples of each file

    @property
    def first_val(self) -> Any:
        return self.val[0].data if self.val else None


def training_data(data: DataConfig, tokenizer: Tokenizer, kind: DataKind, max_seq_len: int, batch_size: int,
                  seed: int, log: Callable[[str], None] = print) -> TrainingData:
    """Prepare every --data_path file and build the training order the loop walks (see dataset/mixture.py).
    max_seq_len bounds a record's tokens (PROMPTS: a prompt's)."""
    if kind == PROMPTS:
        return prompt_data(data, tokenizer, max_seq_len, seed, log)
    def make(cache: TokenCache, split: str) -> Any:
        if kind == CONVERSATIONS:
            return SFTDataset(cache, split, batch_size, seed, tokenizer.pad_id)
        if kind == PAIRS:
            return PreferenceDataset(cache, split, batch_size, seed, tokenizer.pad_id)
        return PretrainDataset(cache, split, max_seq_len, seed)

    prepared = prepare_data(data, tokenizer, kind, max_seq_len, log)
    parts = [make(cache, "train") for _, cache in prepared]
    sources = [s for s, _ in prepared]
    given = [s.weight for s in sources]
    weights = given if given[0] is not None else [float(len(p)) for p in parts]
    weights = [w / sum(weights) for w in weights]
    eval_only = data.eval_data_path or []
    names = _unique_names([s.name for s in sources] + [Path(p).stem for p in eval_only])
    val = []
    for name, weight, (_, cache) in zip(names, weights, prepared):
        if not cache.meta["splits"]["val"]["documents"]:
            continue
        try:
            v = make(cache, "val")
        except DataError as e:  # e.g. fewer validation tokens than one window: train on, without its val loss
            log(f"note: no validation loss for {name}: {e}")
            continue
        if len(v):
            val.append(ValSet(name, weight, v))
    # held-out files: all of each is scored (its "train" split with nothing held back), weighted 0 in val_loss
    for name, path in zip(names[len(sources):], eval_only):
        val.append(ValSet(name, 0.0, make(prepare_file(path, data, tokenizer, kind, max_seq_len, 0.0, log), "train")))
    # one source: its own order, exactly as without mixing; several: drawn by weight (SFT and DPO in whole
    # batches, so each batch comes from one file)
    unit = batch_size if kind != TEXT else 1
    train = parts[0] if len(parts) == 1 else Mixture(parts, weights, unit, seed, names)
    info = [{"path": s.path, "name": n, "weight": round(w, 6), "train_samples": len(p)}
            for s, n, w, p in zip(sources, names, weights, parts)]
    return TrainingData(train, val, info)


def prompt_data(data: DataConfig, tokenizer: Tokenizer, max_prompt_tokens: int, seed: int,
                log: Callable[[str], None]) -> TrainingData:
    """One prompt file, in a seeded order; every prompt trains (the held-out measure is --eval_tasks)."""
    sources = data.sources()
    if len(sources) > 1 or sources[0].weight is not None:
        raise ConfigError(f"--data_path {' '.join(data.data_path)}: reinforcement learning reads one prompt file "
                          "(no weights); join the files into one")
    report = SkipReport()
    prompts = PromptDataset(sources[0].path, tokenizer, max_prompt_tokens, seed, data.skip_bad_lines, report)
    if report.total:
        log(f"{sources[0].path}: {report.summary()}")
    info = [{"path": sources[0].path, "name": sources[0].name, "weight": 1.0, "train_samples": len(prompts)}]
    return TrainingData(prompts, [], info)


def _unique_names(names: list[str]) -> list[str]:
    """File stems as metric names (val_loss/<name>); a stem used twice gets its position appended."""
    return [n if names.count(n) == 1 else f"{n}-{i}" for i, n in enumerate(names)]


@dataclass
class CacheTarget:
    """What the prepared cache is for."""

    title: ClassVar[str] = "cache"
    kind: CachedKind = option("pretrain", "pretraining text ({\"text\"}), SFT conversations or DPO preference "
                                          "pairs")
    # The SFT cache depends on the context; 512 is the default presets' (the trainer's --max_seq_len default).
    max_seq_len: int = option(512, "SFT and DPO: conversations longer than this are cut or dropped (pass the "
                                   "--max_seq_len you will train with)", at_least=1)


@dataclass
class CacheConfig:
    """`python -m dataset.cache`: the trainers' data settings plus what the cache is for."""

    data: DataConfig
    target: CacheTarget

    def check(self) -> None:
        self.data.sources()
