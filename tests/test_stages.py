"""Stages plug into the one loop: a stage defined entirely here trains, checkpoints and resumes through the public
entry point, with its own defaults, options, features, objective and hooks; and the loop's code names no stage."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from common.config import option, settings
from common.tokens import IGNORE_INDEX
from dataset.config import DataConfig
from model.loading import resolve_model_dir
from trainer_utils.driver import main
from trainer_utils.objectives import LanguageModeling
from trainer_utils.stages import STAGES, Stage, StepBatches

from conftest import ROOT, cli_flags, read_metrics


class FirstHalf(LanguageModeling):
    """Next-token loss on the first part of each window only (the before_loss hook masks the rest)."""


@dataclass
class FirstHalfOptions:
    """The stage's own setting: which share of each window it learns."""

    title: ClassVar[str] = "first part"
    keep_share: float = option(0.5, "share of each window learned", above=0, at_most=1)


class FirstHalfStage(Stage):
    """Pretraining text, learning only the first --keep_share of each window; counts its hook calls, and logs the
    share of targets it kept per window (a metric of its own, averaged over the windows it counts)."""

    name = "firsthalf"
    script = "test_stages.py"
    options = FirstHalfOptions
    defaults = dict(batch_size=2, learning_rate=1e-3, optimizer="adamw")

    def __init__(self) -> None:
        self.prepared, self.steps, self.seen = 0, 0, []

    def data_kind(self, data: DataConfig) -> str:
        return "pretrain"

    def objective(self, setup):
        self.seen.append(("objective", setup.options.keep_share))
        return FirstHalf()

    def prepare(self, ctx) -> None:
        self.prepared += 1
        self.seen.append(("prepare", ctx.options.keep_share))

    def before_loss(self, ctx, step: StepBatches) -> StepBatches:
        self.steps += 1
        out, kept, windows = [], 0.0, 0
        for x, y in step.micro:
            y = y.clone()
            y[:, int(y.shape[1] * ctx.options.keep_share):] = IGNORE_INDEX
            out.append((x, y))
            kept += ((y != IGNORE_INDEX).sum(1) / y.shape[1]).sum().item()
            windows += y.shape[0]
        metrics = {"kept_share": torch.tensor(kept, dtype=torch.float64),
                   "windows": torch.tensor(float(windows), dtype=torch.float64)}
        return StepBatches(out, step.input_tokens, metrics)

    def metric_unit(self, name: str) -> str | None:
        return "windows" if name == "kept_share" else None


def toy_flags(corpus, tmp_path, **over) -> list[str]:
    base = {"data_path": corpus["pretrain"], "cache_dir": corpus["cache"], "out_dir": tmp_path, "preset": "tiny",
            "max_seq_len": 32, "max_steps": 6, "dtype": "float32", "log_interval": 2, "eval_interval": 3,
            "save_interval": 3, "num_workers": 0, "sample_prompts": "none"}
    return cli_flags(base, **over)


def test_a_stage_defined_in_a_test_trains_checkpoints_and_resumes(corpus, tmp_path):
    stage = FirstHalfStage()
    assert main(stage, toy_flags(corpus, tmp_path, max_steps=3), None) == 0
    run = tmp_path / "firsthalf-tiny"  # the default run name is the stage's
    config = json.loads((run / "train_config.json").read_text())
    assert config["resolved"]["stage"] == "firsthalf" and config["optim"]["batch_size"] == 2  # its defaults
    assert stage.prepared == 1 and stage.steps == 3
    # its own option, at its default, is what its hooks saw, and the run's config records it in the objective group
    assert stage.seen == [("objective", 0.5), ("prepare", 0.5)] and config["objective"] == {"keep_share": 0.5}
    # the hook's masking reached the loss: half of each 32-token window is learned, 2 windows a step
    assert [r["tokens_seen"] for r in read_metrics(run)] == [2 * 16 * 2, 3 * 16 * 2]
    # its own metric, per window (not per token, the objective's unit); the count itself is not logged
    assert all(r["kept_share"] == 0.5 and "windows" not in r for r in read_metrics(run))
    assert json.loads((resolve_model_dir(run) / "train_info.json").read_text())["method"] == "firsthalf"

    assert main(stage, toy_flags(corpus, tmp_path, resume=True), None) == 0
    records = read_metrics(run)
    assert [r["step"] for r in records] == [2, 3, 4, 6] and records[-1]["tokens_seen"] == 6 * 16 * 2
    assert stage.prepared == 2 and stage.steps == 6  # a resumed Trainer prepares again, steps on from 3


def test_a_stage_declares_its_own_options(corpus, tmp_path, capsys):
    """--keep_share exists for this stage only: in its --help under its own title, checked against its bounds,
    read from a --config file's objective group, seen by its hooks; no registered stage has it."""
    stage = FirstHalfStage()
    with pytest.raises(SystemExit):
        main(stage, ["--help"], None)
    out = capsys.readouterr().out
    assert "first part:" in out and "--keep_share X" in out and "--beta " not in out
    assert main(stage, toy_flags(corpus, tmp_path, keep_share=0), None) == 2
    assert "--keep_share must be > 0, got 0" in capsys.readouterr().err
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("objective:\n  keep_share: 0.25\n")
    assert main(stage, [*toy_flags(corpus, tmp_path, max_steps=2), "--config", str(recipe)], None) == 0
    assert stage.seen[-1] == ("prepare", 0.25)
    assert all(r["kept_share"] == 0.25 for r in read_metrics(tmp_path / "firsthalf-tiny"))
    assert not any("keep_share" in settings(s.config_class) for s in STAGES.values())


def test_a_stage_has_only_the_settings_of_its_features(corpus, tmp_path, capsys):
    with pytest.raises(SystemExit):  # argparse: no --lora_rank without the "adapters" feature
        main(FirstHalfStage(), toy_flags(corpus, tmp_path, lora_rank=4), None)
    assert "--lora_rank" in capsys.readouterr().err

    class Adapted(FirstHalfStage):
        features = frozenset({"adapters"})
        needs_init = True

    assert main(Adapted(), toy_flags(corpus, tmp_path, lora_rank=4), None) == 2  # the flag exists; --init_from not
    assert "test_stages.py trains on top of a trained model: pass --init_from" in capsys.readouterr().err


def test_stages_with_a_setting_of_one_name_each_declare_their_own():
    """--beta is DPO's and GRPO's, --temperature distillation's and GRPO's: each its own declaration, with its own
    default, bounds and help; the stages without them do not have them."""
    def declared(name: str) -> dict[str, tuple]:
        found = {}
        for stage_name, stage in STAGES.items():
            known = settings(stage.config_class)
            if name in known:
                f = known[name].field
                found[stage_name] = (f.default, f.metadata["above"], f.metadata["at_least"], f.metadata["help"])
        return found

    beta, temperature = declared("beta"), declared("temperature")
    # the agent stage is GRPO with tools: its options extend GRPO's (one declaration, inherited)
    assert set(beta) == {"dpo", "grpo", "agent"} and set(temperature) == {"distill", "grpo", "agent"}
    assert beta["dpo"][:3] == (0.1, 0, None) and beta["grpo"][:3] == beta["agent"][:3] == (0.0, None, 0)
    assert temperature["distill"][0] == 1.5 and temperature["grpo"][0] == 1.0
    assert "T^2" in temperature["distill"][3] and "sampled" in temperature["grpo"][3]
    assert set(declared("label_smoothing")) == {"dpo"} and set(declared("num_generations")) == {"grpo", "agent"}
    assert set(declared("max_rounds")) == {"agent"}


@pytest.mark.parametrize("name", sorted(STAGES))
def test_every_stage_default_is_a_setting_it_has(name):
    """Stage.defaults are flag names: a misspelled one would be ignored without this."""
    stage = STAGES[name]
    known = settings(stage.config_class)
    assert all(k in known and known[k].applies_to(stage) for k in stage.defaults), stage.defaults


def test_every_script_is_one_registered_stage():
    scripts = {p.name for p in ROOT.glob("train_*.py")} - {"train_tokenizer.py"}
    assert {s.script for s in STAGES.values()} == scripts
    for stage in STAGES.values():
        assert f'train("{stage.name}", argv, __doc__)' in (ROOT / stage.script).read_text()


STAGE_NAMES = re.compile(r"""["'](%s)["']""" % "|".join(STAGES))


LOOP_FILES = ["trainer_utils/loop.py", "trainer_utils/driver.py", "trainer_utils/session.py", "trainer_utils/config.py",
              "trainer_utils/context.py",
              *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "trainer_utils/components").glob("*.py"))]


@pytest.mark.parametrize("path", LOOP_FILES)
def test_the_loop_names_no_stage_and_tests_no_objective_type(path):
    text = (ROOT / path).read_text()
    assert not STAGE_NAMES.findall(text), f"{path} names a stage: {STAGE_NAMES.findall(text)}"
    assert not re.search(r"isinstance\([^)]*objective", text), f"{path} tests an objective's type"


def test_the_empty_step_poison_still_skips_a_toy_stage_step(corpus, tmp_path):
    """A stage whose hook leaves no target in a step: the step is skipped like any empty one (not applied)."""
    class NoTargets(FirstHalfStage):
        def before_loss(self, ctx, step):
            return StepBatches([(x, torch.full_like(y, IGNORE_INDEX)) for x, y in step.micro], step.input_tokens)

    assert main(NoTargets(), toy_flags(corpus, tmp_path, max_steps=2, eval_interval=100, save_interval=100), None) == 0
    [record] = read_metrics(tmp_path / "firsthalf-tiny")
    assert record["skipped_steps"] == 2 and record["tokens_seen"] == 0
