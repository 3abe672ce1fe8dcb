"""PocketLM model package: config and presets, the decoder, generation, loading and HF conversion."""
from .checkpoint import load_model
from .config import PRESETS, ConfigError, ModelConfig, get_preset
from .generate import generate, sample_next
from .loading import CheckpointError, save_model
from .model import KVCache, PocketLM

__all__ = ["PRESETS", "ConfigError", "ModelConfig", "get_preset", "generate", "sample_next", "CheckpointError",
           "load_model", "save_model", "KVCache", "PocketLM"]
