"""Inference helpers shared by eval_model.py: run metadata, device/dtype choice, streaming decode, prompt
fitting and perplexity scoring.

Nothing here imports `dataset/` (model and dataset never import each other; docs/layout.md):
tokenizer-dependent steps take callables or token ids, and the byte length of each token is read straight
from the checkpoint's tokenizer.json.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterable, Iterator, Literal, Sequence

import torch
import torch.nn.functional as F

from common.config import option
from common.device import parse_device
from common.errors import CheckpointError
from common.files import TRAIN_INFO_NAME
from common.tokens import IGNORE_INDEX

from .config import ModelConfig, parse_rope_scaling
from .generate import generate
from .model import PocketLM, set_attention_policy
from .stats import RouterLoad

# How a checkpoint is prompted: raw text continued, or conversations through the chat template. Checkpoints
# written before this key existed say it as their "stage" (pretrain / sft).
PROMPT_FORMATS = ("text", "chat")
LEGACY_STAGES = {"pretrain": "text", "sft": "chat"}
REPLACEMENT_CHAR = "\ufffd"  # what a lossy UTF-8 decode shows for an incomplete multi-byte character


# ------------------------------------------------------------------------ run metadata
def read_train_info(model_dir: str | Path) -> dict:
    """The checkpoint's train_info.json, its "prompt_format" always set (from an older checkpoint's "stage");
    {"prompt_format": "text"} when there is none (e.g. an imported model)."""
    path = Path(model_dir) / TRAIN_INFO_NAME
    if not path.is_file():
        return {"prompt_format": "text"}
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable ({e})") from None
    if isinstance(info, dict) and "prompt_format" not in info and info.get("stage") in LEGACY_STAGES:
        info["prompt_format"] = LEGACY_STAGES[info["stage"]]
    if not isinstance(info, dict) or info.get("prompt_format") not in PROMPT_FORMATS:
        got = info.get("prompt_format", info.get("stage")) if isinstance(info, dict) else None
        raise CheckpointError(f"{path}: expected an object with \"prompt_format\" in {list(PROMPT_FORMATS)}, got "
                              f"{got!r}")
    return info


@dataclass
class DeviceConfig:
    """Where a model runs and in which number format (evaluation; training extends it)."""

    title: ClassVar[str] = "precision and devices"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = option(
        "auto", "number format; auto asks the device's precision policy (docs/precision.md): training "
                "autocasts to bf16 where it is native (Ampere+ GPUs, CPUs with AVX512-BF16/AMX), fp16 with loss "
                "scaling on older GPUs, else fp32; evaluation and serving use bf16 weights on GPUs with native "
                "bf16, else fp32")
    device: str = option("auto", "auto (CUDA, else Apple MPS, else CPU) | cpu | cuda | cuda:N | mps",
                         metavar="DEVICE")


@dataclass
class ContextConfig:
    """How a model is used past its training context: RoPE scaling, chosen when it is loaded (evaluation and
    serving)."""

    title: ClassVar[str] = "long context"
    rope_scaling: str | None = option(
        None, "stretch RoPE to FACTOR x the training context, whose length the model then takes: linear:FACTOR "
              "(positions divided by FACTOR) or yarn:FACTOR (YaRN: slow frequencies interpolated, fast ones kept, "
              "attention sharpened); default: the checkpoint's own (none for a trained one). Exported as "
              "transformers' rope_scaling (docs/model.md)", metavar="TYPE:FACTOR")

    def scaling(self) -> dict[str, Any] | None:
        """--rope_scaling as ModelConfig.rope_scaling (for load_model), None when not given; a ConfigError for a
        bad value, before anything loads."""
        return parse_rope_scaling(self.rope_scaling) if self.rope_scaling is not None else None


def describe_rope_scaling(config: ModelConfig) -> str:
    """", RoPE yarn x4 (from 256 tokens)" for a model with rope_scaling, "" without (startup lines)."""
    scaling = config.rope_scaling
    if scaling is None:
        return ""
    trained = scaling.get("original_max_position_embeddings", config.max_seq_len)
    return f", RoPE {scaling['rope_type']} x{scaling['factor']:g} (trained at {trained} tokens)"


def resolve_device(name: str | None = None) -> torch.device:
    """The requested device (common.device.parse_device: auto, cpu, cuda[:N], mps; anything else is a
    ConfigError naming what is supported, before anything is loaded); on CUDA the attention kernel policy is
    set (model.model.set_attention_policy)."""
    device = parse_device(name)
    if device.type == "cuda":
        set_attention_policy()
    return device


# ---------------------------------------------------------------------- streaming text
class StreamDecoder:
    """Turns generated ids into printable text pieces without splitting a multi-byte character.

    With byte-level BPE one Chinese character (3 UTF-8 bytes) may span several tokens, and decoding a partial
    character yields U+FFFD. Tokens are held back while their text ends in U+FFFD and released together once
    the character is complete. Decoding only the held-back ids keeps each step O(1): byte-level tokens map to
    bytes independently, so the pieces concatenate to the decode of the whole sequence.
    """

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self._pending: list[int] = []

    def push(self, token_id: int) -> str:
        """Add one token; return the text that became complete (possibly '')."""
        self._pending.append(int(token_id))
        text = self._decode(self._pending)
        if text.endswith(REPLACEMENT_CHAR):
            return ""
        self._pending = []
        return text

    def flush(self) -> str:
        """Text still held back at the end; a character that never completed is dropped."""
        text = self._decode(self._pending).rstrip(REPLACEMENT_CHAR) if self._pending else ""
        self._pending = []
        return text


def stream_generate(model: PocketLM, prompts: Sequence[Sequence[int]], decode: Callable[[list[int]], str],
                    on_text: Callable[[str], None] | None = None, **kwargs) -> list[list[int]]:
    """`generate` (same keyword arguments), passing the first row's text to on_text as characters complete."""
    decoder = StreamDecoder(decode)

    def on_token(tokens: torch.Tensor, active: torch.Tensor) -> None:
        if bool(active[0]) and (piece := decoder.push(int(tokens[0]))):
            on_text(piece)

    new = generate(model, prompts, on_token=on_token if on_text else None, **kwargs)
    if on_text and (tail := decoder.flush()):
        on_text(tail)
    return new


# ------------------------------------------------------------------------ prompt budget
def keep_recent(ids: Sequence[int], budget: int) -> tuple[list[int], int]:
    """The last `budget` ids and how many were dropped from the front."""
    dropped = max(0, len(ids) - budget)
    return list(ids[dropped:]), dropped


def fit_chat(messages: Sequence[dict[str, str]], encode: Callable[[list[dict[str, str]]], list[int]],
             budget: int) -> tuple[list[dict[str, str]], list[int], int]:
    """Drop the oldest turns (never a leading system message) until encode(messages) fits in budget.

    Returns (kept messages, their ids, number of messages dropped). Whole exchanges go so the history still
    starts with a user turn. The newest user turn is always kept, so the ids may still exceed the budget; the
    caller then keeps the most recent tokens (keep_recent).
    """
    system = list(messages[:1]) if messages and messages[0]["role"] == "system" else []
    rest = list(messages[len(system):])
    dropped = 0
    ids = encode(system + rest)
    while len(ids) > budget and len(rest) > 1:
        cut = 1
        while cut < len(rest) - 1 and rest[cut]["role"] != "user":
            cut += 1
        rest, dropped = rest[cut:], dropped + cut
        ids = encode(system + rest)
    return system + rest, ids, dropped


# --------------------------------------------------------------------------- perplexity
def token_byte_lengths(tokenizer_dir: str | Path, vocab_size: int) -> torch.Tensor:
    """UTF-8 bytes each token id stands for (special tokens: 0), read from a byte-level BPE tokenizer.json.

    In the byte-level alphabet every character of a vocabulary entry is exactly one byte, so the length of
    the entry is its byte count; summing over a token span gives the bytes of the text it encodes exactly.
    """
    path = Path(tokenizer_dir) / "tokenizer.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        decoder_type, vocab = (data.get("decoder") or {}).get("type"), data["model"]["vocab"]
        added = data.get("added_tokens", [])
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{path}: unreadable tokenizer file ({e})") from None
    if decoder_type != "ByteLevel":
        raise CheckpointError(f"{path}: bits per byte needs a byte-level BPE tokenizer, decoder is {decoder_type!r}")
    lengths = torch.zeros(vocab_size, dtype=torch.long)
    for token, i in vocab.items():
        if i < vocab_size:
            lengths[i] = len(token)
    for t in added:
        if t["id"] < vocab_size:
            lengths[t["id"]] = 0 if t.get("special") else len(t["content"].encode("utf-8"))
    return lengths


@dataclass
class PerplexityStats:
    """Summed negative log-likelihood over scored tokens, with token and byte counts."""

    nats: float = 0.0
    tokens: int = 0
    bytes: int = 0

    @property
    def loss(self) -> float:
        return self.nats / self.tokens if self.tokens else float("nan")

    @property
    def ppl(self) -> float:
        return math.exp(self.loss)

    @property
    def bits_per_byte(self) -> float:
        return self.nats / math.log(2) / self.bytes if self.bytes else float("nan")


Window = tuple[list[int], list[bool]]  # token ids and, per id, whether it is scored as a target


def split_windows(ids: Sequence[int], scored: Sequence[bool], length: int) -> Iterator[Window]:
    """Cut one sequence into windows of up to length + 1 ids, consecutive ones sharing their boundary id.

    This is the training layout (PretrainDataset): each window feeds `length` inputs, and the last target of
    one window is the first input of the next, so every id but the very first is a target exactly once.
    """
    for start in range(0, max(len(ids) - 1, 0), length):
        yield list(ids[start:start + length + 1]), list(scored[start:start + length + 1])


def pack_documents(docs: Iterable[Sequence[int]], length: int) -> Iterator[Window]:
    """Windows (as split_windows) over the concatenation of docs, built lazily; every id is scored."""
    buf: list[int] = []
    for doc in docs:
        buf.extend(doc)
        while len(buf) >= length + 1:
            yield buf[:length + 1], [True] * (length + 1)
            buf = buf[length:]
    if len(buf) > 1:  # a lone leftover id was already scored as the previous window's last target
        yield buf, [True] * len(buf)


@torch.inference_mode()
def score_windows(model: PocketLM, windows: Iterable[Window], token_bytes: torch.Tensor,
                  batch_size: int = 8, stats: PerplexityStats | None = None,
                  router: RouterLoad | None = None) -> PerplexityStats:
    """Add each window's next-token NLL over its scored targets (and their bytes) to stats; a RouterLoad, when
    given, sees which positions are real tokens.

    Windows of a batch are right-padded; with causal attention padding after a row's last id cannot change
    that row's logits, so no attention mask is needed.
    """
    stats = stats if stats is not None else PerplexityStats()
    device = next(model.parameters()).device
    windows = iter(windows)
    while batch := list(islice(windows, batch_size)):
        width = max(len(ids) for ids, _ in batch) - 1
        x = torch.zeros((len(batch), width), dtype=torch.long)
        y = torch.full((len(batch), width), IGNORE_INDEX, dtype=torch.long)
        for row, (ids, scored) in enumerate(batch):
            n = len(ids) - 1
            x[row, :n] = torch.tensor(ids[:-1])
            y[row, :n] = torch.where(torch.tensor(scored[1:]), torch.tensor(ids[1:]), IGNORE_INDEX)
        if router is not None:
            router.observe(torch.arange(width)[None] < torch.tensor([len(ids) - 1 for ids, _ in batch])[:, None])
        logits = model(x.to(device)).float()  # fp32 loss even for a bf16 model
        stats.nats += F.cross_entropy(logits.flatten(0, 1), y.to(device).flatten(), ignore_index=IGNORE_INDEX,
                                      reduction="sum").item()
        targets = y[y != IGNORE_INDEX]
        stats.tokens += targets.numel()
        stats.bytes += int(token_bytes[targets].sum())
    return stats
