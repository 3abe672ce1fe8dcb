"""What the API serves: a checkpoint's model inside the batching engine, its tokenizer, its prompt format and its
name, loaded as eval_model.py loads a checkpoint.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from common.device import choose_dtype
from common.errors import ConfigError
from dataset.tokenizer import DEFAULT_TOKENIZER_DIR, Tokenizer
from model import generate, load_model
from model.inference import read_train_info

from .config import ServeConfig
from .engine import Engine

logger = logging.getLogger("pocketlm.serving")


@dataclass
class Service:
    """What the API serves: the engine (which owns the model), the tokenizer, the prompt format and the model's
    name."""

    engine: Engine
    tokenizer: Tokenizer
    prompt_format: str  # "chat": chat completions; "text": text completions
    name: str
    created: int  # when the checkpoint was written (the model card's `created`)
    model_dir: Path

    @property
    def context(self) -> int:
        return self.engine.max_model_len


def load_service(config: ServeConfig, device: torch.device) -> Service:
    """Load the checkpoint as eval_model.py does (prompt format from train_info.json, the checkpoint's
    tokenizer) and
    wrap it in an engine (not started)."""
    m = config.model
    dtype = choose_dtype(config.device.dtype, device, "inference").dtype
    model, model_dir = load_model(m.checkpoint, device=device, dtype=dtype, rope_scaling=config.context.scaling())
    prompt_format = m.prompt_format or read_train_info(model_dir)["prompt_format"]
    has_tokenizer = (model_dir / "tokenizer.json").is_file()
    if not has_tokenizer:
        logger.warning("%s has no tokenizer.json; using the default tokenizer", model_dir)
    tok = Tokenizer(model_dir if has_tokenizer else DEFAULT_TOKENIZER_DIR)
    tok.check_fits(model.config.vocab_size)
    if m.max_model_len is not None and m.max_model_len > model.config.max_position_embeddings:
        raise ConfigError(f"--max_model_len {m.max_model_len} is beyond the model's max_position_embeddings "
                          f"({model.config.max_position_embeddings})")
    generate(model, [[tok.eot_id]], max_new_tokens=2, temperature=0)  # warm-up: the first request is not slower
    b = config.batching
    engine = Engine(model, tok.decode, tok.pad_id, max_batch_size=b.max_batch_size, max_queue=b.max_queue,
                    max_model_len=m.max_model_len)
    name = m.model_name or Path(m.checkpoint).resolve().name
    created = int((model_dir / "config.json").stat().st_mtime) if (model_dir / "config.json").exists() else 0
    return Service(engine, tok, prompt_format, name, created, model_dir)
