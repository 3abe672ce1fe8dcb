"""Knowledge distillation from a frozen teacher that shares the student's tokenizer (train_distillation.py)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from common.config import option
from common.errors import ConfigError, TokenizerError
from dataset.config import DataConfig
from dataset.jsonl import read_records
from dataset.kinds import CONVERSATIONS, TEXT, DataKind
from dataset.tokenizer import Tokenizer
from model import ModelConfig
from model.checkpoint import load_model
from model.loading import resolve_model_dir

from ..config import TrainConfig
from ..context import SetupContext
from ..objectives import Distillation, Objective
from .base import Stage
from .sft import SFT_DEMO


@dataclass
class DistillOptions:
    """What distillation learns from: a frozen teacher's distribution beside the labels."""

    title: ClassVar[str] = "distillation"
    teacher: str | None = option(None, "the teacher's run, checkpoint or model dir (required; same tokenizer, any "
                                       "size)", metavar="DIR")
    alpha: float = option(0.5, "weight of the labels' cross-entropy; the teacher's KL gets 1 - alpha", at_least=0,
                          at_most=1)
    temperature: float = option(1.5, "softmax temperature of teacher and student (the KL scaled by T^2)", above=0)


class Distill(Stage):
    name = "distill"
    script = "train_distillation.py"
    defaults: ClassVar[dict[str, Any]] = dict(data_path=SFT_DEMO, batch_size=16, learning_rate=5e-4)
    options = DistillOptions
    features = frozenset({"conversations"})
    estimates_memory = False  # the estimate is of one model; here a teacher runs beside it

    def data_kind(self, data: DataConfig) -> DataKind:
        """Either kind, as the first file's first record shows."""
        _, first = next(read_records(data.sources()[0].path, "any", data.skip_bad_lines))
        return TEXT if "text" in first else CONVERSATIONS

    def check(self, config: TrainConfig) -> None:
        if config.objective.teacher is None:
            raise ConfigError(f"{self.script} learns from a teacher: pass --teacher out/<run>")

    def check_session(self, setup: SetupContext) -> None:
        teacher_dir(setup)

    def objective(self, setup: SetupContext) -> Objective:
        o = setup.options
        teacher, _ = load_model(teacher_dir(setup), device=setup.device)
        return Distillation(teacher, o.alpha, o.temperature)


def teacher_dir(setup: SetupContext) -> Path:
    """The --teacher model dir, checked to speak the student's tokenizer and cover its context."""
    teacher = resolve_model_dir(setup.options.teacher)
    if not (teacher / "tokenizer.json").is_file():
        raise TokenizerError(f"--teacher {teacher}: no tokenizer.json, so it cannot be checked to share the "
                             f"student's tokenizer ({setup.tokenizer.path})")
    if Tokenizer(teacher).sha256 != setup.tokenizer.sha256:
        raise TokenizerError(f"--teacher {teacher} uses another tokenizer than the student "
                             f"({setup.tokenizer.path}); distillation compares distributions token by token, "
                             "so they must share one")
    cfg = ModelConfig.load(teacher / "config.json")
    if cfg.max_position_embeddings < setup.max_seq_len:
        raise ConfigError(f"--teacher {teacher} covers {cfg.max_position_embeddings} positions, fewer than "
                          f"--max_seq_len {setup.max_seq_len}")
    return teacher
