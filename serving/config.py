"""serve_openai_api.py's settings: typed groups that become its command-line flags (common/config.py)."""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import ClassVar, Literal

from common.config import option
from common.errors import ConfigError
from model.inference import ContextConfig, DeviceConfig


@dataclass
class ServedModel:
    """Which checkpoint, under which name, and how long its sequences may get."""

    title: ClassVar[str] = "checkpoint"
    checkpoint: str | None = option(None, "run dir (out/<run>), checkpoint dir or model dir (required)",
                                    metavar="DIR")
    model_name: str | None = option(None, "the model's id in the API (/v1/models, the requests' \"model\"); "
                                          "default: the checkpoint directory's name", metavar="NAME")
    prompt_format: Literal["text", "chat"] | None = option(
        None, "override train_info.json's prompt format: chat checkpoints answer /v1/chat/completions, text ones "
              "/v1/completions")
    max_model_len: int | None = option(None, "longest prompt + completion in tokens (default: the model's "
                                             "max_position_embeddings, which --rope_scaling sets); bounds the KV "
                                             "cache's memory", at_least=2)


@dataclass
class ServerSettings:
    """Where to listen and what to accept."""

    title: ClassVar[str] = "server"
    host: str = option("127.0.0.1", "address to listen on; loopback by default (anything else is reachable "
                                    "from the network: set --api_key)")
    port: int = option(8998, "TCP port; 0 picks a free one (printed at startup)", at_least=0, at_most=65535)
    api_key: str | None = option(None, "require `Authorization: Bearer KEY` on /v1/ (default: $POCKETLM_API_KEY "
                                       "when set, else no key); /health stays open", metavar="KEY")
    max_body_bytes: int = option(1 << 20, "largest request body accepted (413 beyond)", at_least=1)
    log_level: Literal["critical", "error", "warning", "info", "debug"] = option(
        "info", "server log level (info: one access line per request)")


@dataclass
class BatchingSettings:
    """How many sequences decode together and how many requests may wait."""

    title: ClassVar[str] = "batching"
    max_batch_size: int = option(8, "sequences decoded together at most (a request with n choices takes n)",
                                 at_least=1)
    max_queue: int = option(64, "requests waiting for a free slot at most; beyond, 503 with Retry-After",
                            at_least=0)


@dataclass
class ServeConfig:
    """serve_openai_api.py's settings."""

    model: ServedModel
    server: ServerSettings
    batching: BatchingSettings
    device: DeviceConfig
    context: ContextConfig

    def check(self) -> None:
        if self.model.checkpoint is None:
            raise ConfigError("--checkpoint is required")
        self.context.scaling()  # a bad --rope_scaling is reported before the model loads


def is_loopback(host: str) -> bool:
    """Whether `host` is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
