"""Every ```yaml block of the front pages (README.md, README_zh.md) and docs/ is real: a training config parses
through the trainers' own loader exactly as `--config FILE` reads it (a wrong key, type, group or stage is the
error a user would get), a block headed by a recipe's path says what that recipe file says, and any other kind
of block is parsed by its own loader or listed in NOT_RECIPES with the reason. Parsing only: nothing is trained,
no data is read."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import yaml
from test_readme import PAGES, rel, split_fences

from common.config import read_config_file, settings
from common.errors import ConfigError
from dataset.config import CacheConfig
from trainer_utils.config import TrainConfig
from trainer_utils.stages import STAGES, parse_train_config

from conftest import ROOT

YAML_FENCES = {"yaml", "yml"}
# A block whose first line is a comment naming a recipe file quotes that recipe.
RECIPE_HEADER = re.compile(r"^\s*#\s*(recipes/[\w.-]+\.ya?ml)\b")
# YAML blocks that are no config of ours, each with the reason: (page, the block's first line) -> why.
NOT_RECIPES: dict[tuple[str, str], str] = {}
# The order a block's stage is chosen in: the first stage that has every setting the block names.
STAGE_ORDER = ("pretrain", "sft", "lora", "dpo", "grpo", "distill")
# Settings that only `python -m dataset.cache` / `dataset.inspect` have: a block with one is a data config.
DATA_ONLY = set(settings(CacheConfig)).difference(*(settings(s.config_class) for s in STAGES.values()))
GROUPS = {f.name for cls in (TrainConfig, CacheConfig) for f in dataclasses.fields(cls)}


def yaml_blocks() -> list[tuple[str, int, str]]:
    """(page, line of the opening fence, text) of every YAML block on the pages."""
    found = []
    for page in PAGES:
        _, blocks = split_fences(page.read_text(encoding="utf-8"))
        for info, lines in blocks:
            if info in YAML_FENCES:
                start = lines[0][0] - 1 if lines else 0
                found.append((rel(page), start, "\n".join(line for _, line in lines) + "\n"))
    return found


BLOCKS = yaml_blocks()


def flat_settings(raw: dict) -> dict:
    """{setting: value} of a parsed block, nested by group or flat, as the config reader takes it."""
    out = {}
    for key, value in raw.items():
        if key in GROUPS and isinstance(value, dict):
            out.update(value)
        else:
            out[key] = value
    return out


def stage_of(text: str, raw: dict) -> str:
    """The stage a training config is for: a quoted recipe's (recipes are named <model>-<stage>.yaml), else the
    first stage that has every setting the block names; a block that starts from a trained model (--init_from)
    or trains on conversations is fine-tuning, not pretraining."""
    header = RECIPE_HEADER.match(text)
    if header:
        return Path(header.group(1)).stem.rsplit("-", 1)[1]
    flat = flat_settings(raw)

    def has(stage: str, name: str) -> bool:
        known = settings(STAGES[stage].config_class)
        return name in known and known[name].applies_to(STAGES[stage])

    fits = [s for s in STAGE_ORDER if all(has(s, n) for n in flat)]
    data = flat.get("data_path") or []
    chat = "init_from" in flat or any("sft" in str(p) for p in (data if isinstance(data, list) else [data]))
    if chat:
        fits = [s for s in fits if s != "pretrain"] or fits
    return fits[0] if fits else "pretrain"  # no stage has them all: the loader names the setting that is wrong


def check_block(text: str, path: Path) -> str:
    """Parse one block as what it is; return what it was taken for. Raises what the real loader raises."""
    raw = yaml.safe_load(text)
    if not isinstance(raw, dict):
        raise AssertionError(f"not a mapping of settings: {type(raw).__name__}")
    path.write_text(text, encoding="utf-8")
    if "configs" in raw:  # a bench/bench_learning.py --ablation file
        from bench import bench_learning

        bench_learning.load_ablation(path)
        return "ablation"
    if DATA_ONLY & set(flat_settings(raw)):  # python -m dataset.cache / dataset.inspect --config FILE
        read_config_file(CacheConfig, path)
        return "data config"
    stage = stage_of(text, raw)
    parse_train_config(stage, ["--config", str(path)], None)  # exactly what `train_<stage>.py --config` does
    header = RECIPE_HEADER.match(text)
    if header:
        recipe = ROOT / header.group(1)
        assert recipe.is_file(), f"the block quotes {header.group(1)}, which does not exist"
        config_class = STAGES[stage].config_class
        quoted = read_config_file(config_class, path, STAGES[stage])
        assert quoted == read_config_file(config_class, recipe, STAGES[stage]), (
            f"the block differs from {header.group(1)}")
    return f"{stage} config"


def test_the_pages_have_yaml_blocks():
    assert BLOCKS, "no ```yaml block found: the block finder is broken (docs/training.md shows a recipe)"


@pytest.mark.parametrize("page,line,text", BLOCKS, ids=[f"{p}:{n}" for p, n, _ in BLOCKS])
def test_every_yaml_block_parses_as_what_it_is(page, line, text, tmp_path):
    first = text.splitlines()[0] if text.strip() else ""
    if (page, first) in NOT_RECIPES:
        yaml.safe_load(text)  # still valid YAML
        return
    try:
        check_block(text, tmp_path / "block.yaml")
    except (ConfigError, AssertionError) as e:
        pytest.fail(f"{page}:{line}: the ```yaml block does not load as `--config` would: {e} (fix the block, or "
                    "list it in NOT_RECIPES with the reason it is no config of ours)")


def test_not_recipes_lists_only_blocks_that_exist():
    shown = {(page, text.splitlines()[0] if text.strip() else "") for page, _, text in BLOCKS}
    assert sorted(set(NOT_RECIPES) - shown) == []


def test_a_misplaced_setting_fails(tmp_path):
    """The check is as strict as the loader: a recipe block with one setting moved into another group fails."""
    quoted = [text for _, _, text in BLOCKS if RECIPE_HEADER.match(text)]
    assert quoted, "no block quotes a recipe"
    raw = yaml.safe_load(quoted[0])
    group = next(g for g, v in raw.items() if isinstance(v, dict) and v)
    name = next(iter(raw[group]))
    other = next(g for g in raw if g != group and isinstance(raw[g], dict))
    raw[other][name] = raw[group].pop(name)
    with pytest.raises(ConfigError, match=f"{name} belongs to group {group!r}"):
        check_block(yaml.safe_dump(raw, sort_keys=False), tmp_path / "moved.yaml")


@pytest.mark.parametrize("text,kind", [
    ("data:\n  data_path: dataset/pretrain_hq.jsonl\n", "pretrain config"),
    ("model:\n  init_from: out/pretrain-minimind-26m\ndata:\n  data_path: dataset/sft_mini_512.jsonl\n", "sft config"),
    ("data_path: dataset/sft_mini_512.jsonl\ninit_from: out/pretrain-minimind-26m\n", "sft config"),
    ("model:\n  init_from: out/sft-minimind-26m\nlora:\n  lora_rank: 8\n", "lora config"),
    ("model:\n  init_from: out/sft-minimind-26m\nobjective:\n  beta: 0.1\n", "dpo config"),
    ("model:\n  init_from: out/sft-minimind-26m\nobjective:\n  num_generations: 4\n", "grpo config"),
    ("objective:\n  teacher: out/sft-minimind-104m\n", "distill config"),
    ("recipe: recipes/demo-pretrain.yaml\nconfigs:\n  lr-2e-3: {learning_rate: 2.0e-3}\n", "ablation"),
    ("data:\n  data_path: dataset/sft_mini_512.jsonl\ntarget:\n  kind: sft\n  max_seq_len: 512\n", "data config"),
])
def test_a_block_is_taken_for_what_it_configures(text, kind, tmp_path):
    assert check_block(text, tmp_path / "block.yaml") == kind
