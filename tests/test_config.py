"""The typed configuration: flags from dataclasses, --config files and recipes, re-runnable train_config.json,
one data config for training and `python -m dataset.cache`, and flags that cannot take effect."""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

import eval_model
import train_agent
import train_distillation
import train_dpo
import train_full_sft
import train_grpo
import train_lora
import train_pretrain
from common.config import build_config, option, parse_config, read_config_file, to_dict
from common.errors import ConfigError
from dataset import cache as cache_mod
from model import load_model
from trainer_utils.config import TrainConfig
from trainer_utils.stages import STAGES, parse_train_config

from conftest import ROOT, cli_flags, read_metrics

RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))


def flags(corpus, tmp_path, run="run", **over) -> list[str]:
    base = {"data_path": corpus["pretrain"], "cache_dir": corpus["cache"], "out_dir": tmp_path, "run_name": run,
            "preset": "tiny", "batch_size": 4, "max_steps": 2, "dtype": "float32", "log_interval": 1,
            "eval_interval": 100, "save_interval": 100, "num_workers": 0, "learning_rate": 1e-3, "warmup_steps": 1}
    return cli_flags(base, **over)


# ------------------------------------------------------------------------------ machinery
def test_flags_keep_minimind_names_and_help_is_grouped(capsys):
    with pytest.raises(SystemExit):
        train_pretrain.main(["--help"])
    out = capsys.readouterr().out
    for flag in ("--batch_size", "--learning_rate", "--max_seq_len", "--hidden_size", "--num_hidden_layers",
                 "--accumulation_steps", "--epochs", "--data_path", "--out_dir", "--save_interval",
                 "--log_interval", "--use_wandb", "--grad_clip", "--dtype", "--num_workers", "--config"):
        assert flag in out, flag
    groups = [line for line in out.splitlines() if line.endswith(":") and not line.startswith(" ")]
    assert groups[-6:] == ["data:", "model:", "optimization:", "precision and devices:", "output and logging:",
                           "evaluation:"]
    assert "--overlong" not in out  # an SFT setting


def test_precedence_defaults_then_stage_then_file_then_command_line(tmp_path):
    assert parse_train_config("pretrain", [], "").optim.learning_rate == 5e-4
    assert parse_train_config("sft", [], "").optim.learning_rate == 5e-5  # the stage's default
    recipe = tmp_path / "r.yaml"
    recipe.write_text("optim:\n  learning_rate: 3e-4\n  batch_size: 7\nseed: 3\n")  # nested and flat; 3e-4 is a
    config = parse_train_config("sft", ["--config", str(recipe), "--batch_size", "5"], "")  # YAML string
    assert (config.optim.learning_rate, config.optim.batch_size, config.optim.seed) == (3e-4, 5, 3)


@pytest.mark.parametrize("text,message", [
    ("optim:\n  learning_rat: 1\n", "unknown setting 'learning_rat' (did you mean 'learning_rate'?)"),
    ("optim:\n  data_path: x.jsonl\n", "data_path belongs to group 'data', not 'optim'"),
    ("batch_size: eight\n", "batch_size must be int, got 'eight'"),
    ("dtype: fp8\n", "dtype must be one of"),
    ("overlong: drop\n", "overlong is a conversations setting, which pretrain runs do not have"),
    ("- a\n- b\n", "expected a mapping of settings"),
    ("optim: [1\n", "not valid YAML"),
    ("batch_size: 0\n", "--batch_size must be >= 1, got 0"),
])
def test_bad_config_files_are_one_line_errors(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=None) as e:
        parse_train_config("pretrain", ["--config", str(path)], "")
    assert message in str(e.value) and "\n" not in str(e.value)


def test_config_round_trips_through_to_dict():
    config = parse_train_config("sft", ["--batch_size", "3", "--overlong", "drop", "--resume"], "")
    written = to_dict(config, STAGES["sft"])
    assert "resume" not in written["run"] and "overwrite" not in written["run"]  # actions, not settings
    again = build_config(TrainConfig, {k: v for g in written.values() for k, v in g.items()},
                         STAGES["sft"].defaults)
    assert to_dict(again, STAGES["sft"]) == written
    assert "overlong" not in to_dict(config, STAGES["pretrain"])["data"]


def test_eval_and_cache_entry_points_share_the_machinery(tmp_path):
    config = parse_config(eval_model.EvalConfig, ["--checkpoint", "x", "--prompt", "a", "--prompt", "b",
                                                   "--top_p", "0.5"])
    assert config.task.prompt == ["a", "b"] and config.sampling.top_p == 0.5
    with pytest.raises(ConfigError, match="--top_p must be <= 1"):
        parse_config(eval_model.EvalConfig, ["--checkpoint", "x", "--top_p", "1.5"])
    with pytest.raises(ConfigError, match="--prompt and --chat are alternatives"):
        parse_config(eval_model.EvalConfig, ["--checkpoint", "x", "--prompt", "a", "--chat"])
    from dataset.config import CacheConfig
    training = parse_train_config("pretrain", [], "").data
    assert parse_config(CacheConfig, ["--data_path", "f.jsonl"]).data == \
        type(training)(**{**vars(training), "data_path": ["f.jsonl"]})  # the same data defaults


def test_ingest_takes_a_config_file_and_its_flags_as_before(tmp_path, capsys):
    """python -m dataset.ingest reads its settings through parse_config: folders as arguments, a --config file,
    the flags it always had (--no_near_dedup too), and one error line for a missing --out."""
    from dataset.ingest import cli as ingest
    docs = tmp_path / "docs"
    docs.mkdir()
    same = "A lighthouse keeper trims the wick at dusk and logs the weather by lamplight. " * 3
    (docs / "a.txt").write_text(same + "First.", encoding="utf-8")
    (docs / "b.txt").write_text(same + "Second.", encoding="utf-8")  # a near-duplicate of a.txt
    recipe = tmp_path / "ingest.yaml"
    recipe.write_text("records:\n  min_chars: 5\n  near_dedup: false\nfiles:\n  quiet: true\n")
    runs = {"file": [str(docs), "--config", str(recipe)], "flag": [str(docs), "--no_near_dedup", "--quiet"],
            "default": [str(docs), "--quiet"]}
    for name, argv in runs.items():
        out = tmp_path / f"{name}.jsonl"
        assert ingest.main([*argv, "--out", str(out)]) == 0
        kept = json.loads(out.with_name(out.name + ".report.json").read_text())["records"]["kept"]
        assert kept == (1 if name == "default" else 2), name  # near-deduplication drops b.txt by default only
    capsys.readouterr()
    assert ingest.main([str(docs)]) == 2
    assert capsys.readouterr().err == "error: name the output file: --out corpus.jsonl\n"


@dataclasses.dataclass
class _Files:
    inputs: list[str] = option([], "folders and files", positional=True, metavar="PATH")
    out: str = option("x.jsonl", "where")


@dataclasses.dataclass
class _PositionalConfig:
    files: _Files = dataclasses.field(default_factory=_Files)


def test_a_list_setting_takes_the_commands_arguments(tmp_path, capsys):
    """positional=True: the values that are not flags; a config file may give them; the command line wins."""
    parsed = parse_config(_PositionalConfig, ["a", "b c", "--out", "y"]).files
    assert (parsed.inputs, parsed.out) == (["a", "b c"], "y")
    assert parse_config(_PositionalConfig, ["--out", "y"]).files.inputs == []  # none given: the default
    recipe = tmp_path / "r.yaml"
    recipe.write_text("inputs: [p, q]\n")
    assert parse_config(_PositionalConfig, ["--config", str(recipe)]).files.inputs == ["p", "q"]
    assert parse_config(_PositionalConfig, ["--config", str(recipe), "r"]).files.inputs == ["r"]
    with pytest.raises(SystemExit):
        parse_config(_PositionalConfig, ["--help"])
    assert " [PATH ...] [--config FILE] [flags: see below]\n" in capsys.readouterr().out.splitlines(True)[0]


@dataclasses.dataclass
class _One:
    path: str = option("", "a path", positional=True)


@dataclasses.dataclass
class _Two:
    a: list[str] = option([], "some", positional=True)
    b: list[str] = option([], "more", positional=True)


@dataclasses.dataclass
class _OnePathConfig:
    one: _One = dataclasses.field(default_factory=_One)


@dataclasses.dataclass
class _TwoListsConfig:
    two: _Two = dataclasses.field(default_factory=_Two)


@pytest.mark.parametrize("config, message", [
    (_OnePathConfig, "path: only a list setting can take the command's arguments"),
    (_TwoListsConfig, "b: a command has one setting for its arguments; a has them"),
])
def test_one_list_setting_at_most_takes_the_arguments(config, message):
    with pytest.raises(TypeError, match=message):
        parse_config(config, [])


# ---------------------------------------------------------------- recipes and re-runs
def test_every_recipe_parses_for_its_stage():
    assert {p.stem for p in RECIPES} >= {"demo-pretrain", "demo-sft", "minimind-26m-pretrain", "minimind-26m-sft",
                                         "minimind-104m-pretrain", "gpt2-100m-pretrain"}
    assert {p.stem for p in RECIPES} >= {"demo-lora", "demo-dpo", "demo-distill", "minimind-26m-lora",
                                         "minimind-26m-dpo", "minimind-26m-distill"}
    for path in RECIPES:
        stage = recipe_stage(path)
        config = parse_train_config(stage, ["--config", str(path)], "")
        assert recipe_values(path, stage), path
        trains_on_a_model = stage in ("sft", "lora", "dpo", "grpo", "agent") or path.stem in CONTINUED_PRETRAINING
        assert (config.model.init_from is not None) == trains_on_a_model or stage == "distill", path
        assert (getattr(config.objective, "teacher", None) is not None) == (stage == "distill"), path
    gpt2 = parse_train_config("pretrain", ["--config", str(ROOT / "recipes/gpt2-100m-pretrain.yaml")], "")
    o = gpt2.optim
    assert (o.learning_rate, o.beta1, o.beta2, o.adam_eps, o.weight_decay, o.warmup_steps, o.min_lr) == \
        (3e-4, 0.9, 0.95, 1e-8, 0.1, 1000, 1e-5)
    assert (o.batch_size, o.accumulation_steps, o.max_steps, gpt2.model.max_seq_len) == (8, 4, 50000, 512)


def sibling(path: Path, stage: str) -> Path:
    """The recipe of the same model for another stage."""
    return path.with_name(f"{path.stem.rsplit('-', 1)[0]}-{stage}.yaml")


# pretraining recipes that start from a trained model (the rest start from scratch)
CONTINUED_PRETRAINING = {"demo-domain-pretrain"}


def recipe_stage(path) -> str:
    """A recipe's training script, from its name: <model>-<stage>.yaml."""
    return path.stem.rsplit("-", 1)[1]


def recipe_values(path, stage: str) -> dict:
    """The settings a config file gives, read as `stage`'s script reads them."""
    return read_config_file(STAGES[stage].config_class, path, STAGES[stage])


@pytest.mark.slow
def test_every_recipe_trains_two_steps(corpus, tmp_path):
    """Each recipe runs as shipped except for what this machine needs: small data, batch and context, two layers
    of each new model (the width, heads and every other setting as shipped: at full depth the 100M-class
    models' Muon step alone takes ~10 s on 2 CPU cores), and one evaluation (at the last step, where every
    evaluation component of the recipe runs once)."""
    small = ["--data_path", str(corpus["pretrain"]), "--cache_dir", str(corpus["cache"]), "--out_dir",
             str(tmp_path), "--max_steps", "2", "--batch_size", "1", "--accumulation_steps", "1",
             "--max_seq_len", "32", "--num_workers", "0", "--eval_interval", "2", "--save_interval", "2",
             "--eval_task_items", "2"]  # a recipe's held-out task runs, on two items (the tool set's 200 took minutes)
    for path in [p for p in RECIPES if p.stem.endswith("pretrain") and p.stem not in CONTINUED_PRETRAINING]:
        extra = ["--tokenizer", str(ROOT / "model/tokenizer")] if "gpt2" in path.stem else []  # no 16k one here
        assert train_pretrain.main(["--config", str(path), *small, *extra, "--num_hidden_layers", "2"]) == 0, path
    # continued pretraining on the pretraining run it starts from, the small data also as the held-out file
    for path in [p for p in RECIPES if p.stem in CONTINUED_PRETRAINING]:
        start = tmp_path / Path(recipe_values(path, "pretrain")["init_from"]).name
        args = [*small, "--init_from", str(start), "--eval_data_path", str(corpus["pretrain"])]
        assert train_pretrain.main(["--config", str(path), *args]) == 0, path
    # SFT on a pretraining recipe's run, or on another SFT recipe's run (demo-math-sft on demo-sft,
    # demo-tool-pass2-sft on demo-tool-sft): each runs once the run it starts from exists, whatever the names' order
    pending = {}
    for path in (p for p in RECIPES if recipe_stage(p) == "sft"):
        start = sibling(path, "pretrain")
        if start.exists():
            pending[path] = tmp_path / recipe_values(start, "pretrain")["run_name"]
        else:
            pending[path] = tmp_path / Path(recipe_values(path, "sft")["init_from"]).name
    while pending:
        ready = [path for path, init in pending.items() if init.exists()]
        assert ready, f"SFT recipes whose start no recipe trains: {sorted(p.name for p in pending)}"
        for path in ready:
            args = [*small, "--data_path", str(corpus["sft"]), "--init_from", str(pending.pop(path))]
            assert train_full_sft.main(["--config", str(path), *args]) == 0, path
            run = recipe_values(path, "sft")["run_name"]
            assert load_model(tmp_path / run)[0] is not None
    # post-training on the runs above: each recipe's --init_from / --teacher point at them by run name
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join((ROOT / "dataset/demo/dpo_demo.jsonl").read_text().splitlines(True)[:40]))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join((ROOT / "dataset/demo/math_train.jsonl").read_text().splitlines(True)[:40]))
    scripts = {"lora": train_lora.main, "dpo": train_dpo.main, "distill": train_distillation.main,
               "grpo": train_grpo.main, "agent": train_agent.main}
    for path in [p for p in RECIPES if recipe_stage(p) in scripts]:
        stage = recipe_stage(path)
        recipe = recipe_values(path, stage)
        chat = stage == "lora" or "sft" in recipe["data_path"][0]  # distillation takes either kind
        data = {"dpo": pairs, "grpo": prompts, "agent": prompts}.get(stage) or corpus["sft" if chat else "pretrain"]
        args = [*small, "--data_path", str(data)]
        if stage in ("grpo", "agent"):  # a prompt and its completion within the context; no held-out task here
            args += ["--max_seq_len", "64", "--max_completion_tokens", "8", "--eval_tasks", "none"]
        for key in ("init_from", "teacher"):
            if recipe.get(key):
                args += [f"--{key}", str(tmp_path / Path(recipe[key]).name)]
        assert scripts[stage](["--config", str(path), *args]) == 0, path
        assert load_model(tmp_path / recipe["run_name"])[0] is not None


@pytest.mark.parametrize("stage", ["pretrain", "sft"])
def test_train_config_json_reproduces_the_run(corpus, tmp_path, stage):
    if stage == "pretrain":
        assert train_pretrain.main(flags(corpus, tmp_path, "first")) == 0
        again = train_pretrain.main
    else:
        assert train_pretrain.main(flags(corpus, tmp_path, "base")) == 0
        sft = flags(corpus, tmp_path, "first", preset=None, data_path=corpus["sft"], init_from=tmp_path / "base",
                    max_seq_len=64)
        assert train_full_sft.main(sft) == 0
        again = train_full_sft.main
    written = json.loads((tmp_path / "first/train_config.json").read_text())
    assert written["resolved"]["stage"] == stage and "resume" not in written["run"]
    assert again(["--config", str(tmp_path / "first/train_config.json"), "--run_name", "second"]) == 0
    first, second = read_metrics(tmp_path / "first"), read_metrics(tmp_path / "second")
    assert first[0]["loss"] == second[0]["loss"] and first[-1]["loss"] == second[-1]["loss"]


# ------------------------------------------------------------------- one data config
def test_cache_prepared_ahead_is_the_one_training_reuses(corpus, tmp_path, capsys):
    """`python -m dataset.cache --data_path F` then `train_pretrain.py --data_path F`, both with defaults."""
    data = tmp_path / "data.jsonl"
    data.write_bytes(Path(corpus["pretrain"]).read_bytes())
    assert cache_mod.main(["--data_path", str(data), "--num_workers", "0"]) == 0
    capsys.readouterr()
    assert train_pretrain.main(["--data_path", str(data), "--preset", "tiny", "--max_steps", "1", "--out_dir",
                                str(tmp_path / "out"), "--batch_size", "2", "--num_workers", "0"]) == 0
    err = capsys.readouterr().err
    assert "reusing the prepared cache" in err and "prepared data.jsonl" not in err
    assert len(list((tmp_path / "data.jsonl.pocketlm-cache").glob("pretrain-*"))) == 1


def test_sft_cache_prepared_ahead_with_the_training_context(corpus, tmp_path, capsys):
    assert train_pretrain.main(flags(corpus, tmp_path, "base")) == 0
    data = tmp_path / "sft.jsonl"
    data.write_bytes(Path(corpus["sft"]).read_bytes())
    assert cache_mod.main(["--data_path", str(data), "--kind", "sft", "--max_seq_len", "64",
                           "--num_workers", "0"]) == 0
    capsys.readouterr()
    assert train_full_sft.main(["--data_path", str(data), "--init_from", str(tmp_path / "base"), "--out_dir",
                                str(tmp_path), "--max_steps", "1", "--batch_size", "2"]) == 0  # tiny: context 64
    assert "reusing the prepared cache" in capsys.readouterr().err


# ------------------------------------------------------- flags that cannot take effect
@pytest.mark.parametrize("flag", [{"preset": "mini-30m"}, {"hidden_size": 32}, {"num_hidden_layers": 3}])
def test_shape_flags_with_init_from_are_errors(corpus, tmp_path, capsys, flag):
    assert train_pretrain.main(flags(corpus, tmp_path, "base")) == 0
    capsys.readouterr()
    sft = flags(corpus, tmp_path, "sft", **{"preset": None, "data_path": corpus["sft"], "init_from": tmp_path / "base",
                                           **flag})
    assert train_full_sft.main(sft) == 2
    err = capsys.readouterr().err
    assert f"--{next(iter(flag))} cannot take effect with --init_from" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "sft").exists()


def test_dropout_takes_effect_on_loaded_weights_and_default_name_follows_the_model(corpus, tmp_path):
    assert train_pretrain.main(flags(corpus, tmp_path, "base")) == 0
    sft = flags(corpus, tmp_path, None, preset=None, data_path=corpus["sft"], init_from=tmp_path / "base",
                dropout=0.25)
    assert train_full_sft.main(sft) == 0
    run = tmp_path / "sft-tiny"  # named after the model loaded (tiny), not the default preset
    assert load_model(run)[0].config.dropout == 0.25


def test_model_flags_on_resume_must_describe_the_run(corpus, tmp_path, capsys):
    reshape = dict(hidden_size=32, max_steps=2)
    assert train_pretrain.main(flags(corpus, tmp_path, **reshape)) == 0
    # the same command again, as a Slurm requeue sends it: fine
    assert train_pretrain.main(flags(corpus, tmp_path, **{**reshape, "max_steps": 3}, resume=True)) == 0
    capsys.readouterr()
    assert train_pretrain.main(flags(corpus, tmp_path, hidden_size=64, max_steps=4, resume=True)) == 2
    err = capsys.readouterr().err
    assert "--preset, --hidden_size cannot take effect with --resume" in err
    assert "hidden_size 64 (the run has 32)" in err
    assert train_pretrain.main(flags(corpus, tmp_path, hidden_size=32, dropout=0.5, max_steps=4, resume=True)) == 2
    assert "dropout 0.5 (the run has 0.0)" in capsys.readouterr().err


# ------------------------------------------------- checked before anything slow
@pytest.mark.parametrize("extra,message", [
    (["--deepspeed", "missing.json"], "--deepspeed missing.json: No such file or directory"),
    (["--deepspeed", "launch/ds_zero2.json", "--dtype", "float16"], "use --dtype bfloat16 or float32"),
    (["--resume", "--overwrite"], "--resume and --overwrite contradict each other"),
    (["--learning_rate", "0"], "--learning_rate must be > 0"),
])
def test_flags_are_checked_before_data_preparation(corpus, tmp_path, capsys, extra, message):
    cache = tmp_path / "cache"
    argv = flags(corpus, tmp_path, cache_dir=cache) + extra
    assert train_pretrain.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and len(err.splitlines()) == 1
    assert not cache.exists()


def test_an_unknown_dtype_is_a_usage_error_before_data_preparation(corpus, tmp_path, capsys):
    cache = tmp_path / "cache"
    with pytest.raises(SystemExit) as usage:
        train_pretrain.main(flags(corpus, tmp_path, cache_dir=cache, dtype="fp8"))
    assert usage.value.code == 2 and "--dtype: invalid choice: 'fp8'" in capsys.readouterr().err
    assert not cache.exists()


@pytest.mark.parametrize("flag,module", [("--use_wandb", "wandb"), ("--use_tensorboard", "tensorboard"),
                                         ("--deepspeed", "deepspeed")])
def test_missing_optional_package_names_the_install_command(corpus, tmp_path, capsys, monkeypatch, flag, module):
    monkeypatch.setitem(sys.modules, module, None)  # `import module` now fails as if it were not installed
    cache = tmp_path / "cache"
    extra = [flag, "launch/ds_zero2.json"] if flag == "--deepspeed" else [flag]
    assert train_pretrain.main(flags(corpus, tmp_path, cache_dir=cache) + extra) == 2
    err = capsys.readouterr().err
    assert f"{flag} needs the `{module}` package" in err and "pip install -r requirements.txt" in err
    assert len(err.splitlines()) == 1 and not cache.exists()


def test_python_m_model_and_the_trainers_accept_the_same_model_flags():
    """Each model switch is declared once (a ModelConfig field with a role): the trainers' model group and
    `python -m model` derive their flags from it, with the same meaning and bounds."""
    from common.config import settings
    from model.__main__ import ModelCommand
    from model.config import ModelConfig, switches

    trainer = {n: s for n, s in settings(TrainConfig).items() if s.group == "model"}
    ours = settings(ModelCommand)
    switched = {f.name for f in dataclasses.fields(ModelConfig) if "role" in f.metadata}
    assert switched == set(switches()) and switched | {"preset"} <= set(trainer) & set(ours)
    assert set(trainer) - set(ours) == {"init_from", "compile"}  # training only
    assert set(ours) - set(trainer) == {"estimate", "vocab_size", "batch_size", "accumulation_steps", "dtype",
                                        "optimizer",  # the step, in other groups of the trainers
                                        "plan", "time_budget", "device", "data_path", "presets"}  # --plan
    for name in switched | {"preset"}:
        assert trainer[name].meta == ours[name].meta and trainer[name].base == ours[name].base, name
    # and they build the same model: MoE, RoPE and QK-norm flags included
    for argv in [[], ["--hidden_size", "96", "--num_hidden_layers", "3"],
                 ["--num_experts", "4", "--num_experts_per_tok", "1"],
                 ["--rope_theta", "1e6", "--qk_norm", "--zero_init_residual"],
                 ["--preset", "tiny", "--num_experts", "8", "--moe_intermediate_size", "32", "--router_z_loss_coef",
                  "0.1"]]:
        from model.__main__ import model_config
        from model.config import config_from_flags
        built = model_config(parse_config(ModelCommand, ["--estimate", *argv]).step)
        assert built == config_from_flags(parse_train_config("pretrain", argv, "").model), argv
