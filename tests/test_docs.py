"""What the code tells users must exist: flags named in messages and docstrings, files a docstring points to."""
from __future__ import annotations

import argparse
import importlib
import re

import pytest

import eval_model
import model.__main__ as model_main
import serve_openai_api
import train_full_sft
import train_tokenizer
from dataset import cache, clean, inspect
from dataset.ingest import cli as ingest
from export import convert
from launch import slurm
from trainer_utils.stages import STAGES

from conftest import PACKAGES, ROOT

LIBRARY = [p for d in PACKAGES for p in (ROOT / d).rglob("*.py")]
# every training script (one per registered stage), then the other entry points
ENTRY_POINTS = {**{s.script: importlib.import_module(s.script.removesuffix(".py")).main for s in STAGES.values()},
                "eval_model.py": eval_model.main, "dataset.cache": cache.main, "dataset.clean": clean.main,
                "dataset.ingest": ingest.main,
                "dataset.inspect": inspect.main, "model": model_main.main,
                "model.convert": convert.main, "train_tokenizer.py": train_tokenizer.main, "launch.slurm": slurm.main,
                "serve_openai_api.py": serve_openai_api.main}
# Flags of other programs that the docs and messages show next to ours (torchrun; qpdf and LibreOffice's soffice,
# which dataset.ingest's skip reasons suggest).
EXTERNAL = {"--nproc_per_node", "--local-rank", "--help", "--decrypt", "--password", "--convert-to"}


class _Parsed(BaseException):  # BaseException: no entry point's error handling may swallow it
    pass


def flags_of(main, monkeypatch) -> set[str]:
    """The long flags an entry point's parser accepts, read off the parser as it is about to parse."""
    seen: set[str] = set()

    def record(self, *args, **kwargs):
        seen.update(s for s in self._option_string_actions if s.startswith("--"))
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", record)
    with pytest.raises(_Parsed):
        main([])
    monkeypatch.undo()
    return seen


def test_every_flag_named_in_library_code_exists(monkeypatch):
    known = set().union(*(flags_of(main, monkeypatch) for main in ENTRY_POINTS.values())) | EXTERNAL
    named = {(p.relative_to(ROOT), f) for p in LIBRARY for f in re.findall(r"--[a-z][a-z0-9_-]+", p.read_text())}
    unknown = sorted((str(p), f) for p, f in named if f not in known and not f.startswith("--no-"))
    assert unknown == []


def test_files_named_in_docstrings_exist():
    missing = []
    for path in [*LIBRARY, *ROOT.glob("*.py")]:
        for name in re.findall(r"\b([A-Za-z_]+\.md)\b", path.read_text()):
            if not (ROOT / name).exists() and not list(ROOT.glob(f"*/{name}")):
                missing.append((str(path.relative_to(ROOT)), name))
    assert missing == []


def test_vocabulary_mismatch_advice_names_a_training_flag(tmp_path, capsys, monkeypatch):
    """A model whose embedding table is smaller than the tokenizer: the advice must be a flag training has."""
    from model import PocketLM, save_model

    from conftest import tiny_config
    save_model(PocketLM(tiny_config(vocab_size=256)), tmp_path / "small")
    training_flags = flags_of(train_full_sft.main, monkeypatch)
    assert train_full_sft.main(["--init_from", str(tmp_path / "small"), "--out_dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "vocab_size 256" in err
    advice = set(re.findall(r"--[a-z_]+", err))
    assert advice and advice <= training_flags, advice


@pytest.mark.slow  # a process per entry point
@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_every_entry_point_runs_as_documented(entry):
    """`python X.py --help` / `python -m X --help` prints its usage: a module without its `__main__` guard
    would exit 0 having done nothing (python -m dataset.cache once did)."""
    import subprocess
    import sys
    command = [sys.executable, entry] if entry.endswith(".py") else [sys.executable, "-m", entry]
    run = subprocess.run([*command, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.startswith("usage:"), (entry, run.stdout[:200], run.stderr[-500:])
