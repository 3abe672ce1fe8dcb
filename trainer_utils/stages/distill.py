"""Knowledge distillation from a frozen teacher that shares the student's tokenizer (train_distillation.py)."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from common.errors import ConfigError, TokenizerError
from dataset.config import CONVERSATIONS, TEXT, DataConfig
from dataset.jsonl import read_records
from dataset.tokenizer import Tokenizer
from model import ModelConfig
from model.checkpoint import load_model
from model.loading import resolve_model_dir

from ..objectives import Distillation, Objective
from .base import Stage
from .sft import SFT_DEMO

if TYPE_CHECKING:
    from ..config import TrainConfig
    from ..session import Session


class Distill(Stage):
    name = "distill"
    script = "train_distillation.py"
    defaults: ClassVar[dict[str, Any]] = dict(data_path=SFT_DEMO, batch_size=16, learning_rate=5e-4)
    features = frozenset({"conversations", "teacher"})
    estimates_memory = False  # the estimate is of one model; here a teacher runs beside it

    def data_kind(self, data: DataConfig) -> str:
        """Either kind, as the first file's first record shows."""
        _, first = next(read_records(data.sources()[0].path, "any", data.skip_bad_lines))
        return TEXT if "text" in first else CONVERSATIONS

    def check(self, config: TrainConfig) -> None:
        if config.objective.teacher is None:
            raise ConfigError(f"{self.script} learns from a teacher: pass --teacher out/<run>")

    def check_session(self, session: Session) -> None:
        teacher_dir(session)

    def objective(self, session: Session, device: torch.device) -> Objective:
        o = session.config.objective
        teacher, _ = load_model(teacher_dir(session), device=device)
        return Distillation(teacher, o.alpha, o.temperature)


def teacher_dir(session: Session) -> Path:
    """The --teacher model dir, checked to speak the student's tokenizer and cover its context."""
    teacher = resolve_model_dir(session.config.objective.teacher)
    if not (teacher / "tokenizer.json").is_file():
        raise TokenizerError(f"--teacher {teacher}: no tokenizer.json, so it cannot be checked to share the "
                             f"student's tokenizer ({session.tokenizer.path})")
    if Tokenizer(teacher).sha256 != session.tokenizer.sha256:
        raise TokenizerError(f"--teacher {teacher} uses another tokenizer than the student "
                             f"({session.tokenizer.path}); distillation compares distributions token by token, "
                             "so they must share one")
    cfg = ModelConfig.load(teacher / "config.json")
    if cfg.max_position_embeddings < session.max_seq_len:
        raise ConfigError(f"--teacher {teacher} covers {cfg.max_position_embeddings} positions, fewer than "
                          f"--max_seq_len {session.max_seq_len}")
    return teacher
