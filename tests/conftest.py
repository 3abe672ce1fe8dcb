"""Shared pytest fixtures: tiny configs and deterministic seeding."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from model import ModelConfig, PocketLM, get_preset  # noqa: E402


def tiny_config(style: str = "llama", **overrides) -> ModelConfig:
    """A 2-layer, d64 model: fast enough for logic tests. vocab 256 keeps softmaxes cheap."""
    base = dict(vocab_size=256, max_seq_len=64, max_position_embeddings=256)
    if style == "gpt2":
        base.update(norm="layernorm", position_embedding="learned", mlp="gelu", bias=True,
                    num_key_value_heads=4)
    return get_preset("tiny", **{**base, **overrides})


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture
def tiny_model() -> PocketLM:
    return PocketLM(tiny_config()).eval()


@pytest.fixture(scope="session")
def tokenizer():
    from dataset.tokenizer import Tokenizer
    return Tokenizer()  # the shipped default in model/tokenizer/


def write_jsonl(path: Path, records: list) -> Path:
    """Write records (dicts, or raw strings written verbatim) one per line."""
    import json
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)) + "\n")
    return path
