"""The two ways the project grows, each shown with a throwaway example written into a temporary folder: a new
document format for `dataset.ingest` (its module and one registry line, dataset/ingest/formats/__init__.py) and
a new training stage (its module and one line in trainer_utils/stages' STAGES). Nothing shared is edited: the
examples plug into the registries as they are."""
from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import dataset.ingest.formats as formats
from dataset.ingest.pipeline import ingest
from trainer_utils import driver
from trainer_utils.stages import STAGES

from conftest import cli_flags, read_metrics

CSV_FORMAT = '''
"""CSV: each row's "text" column, one document per row (`file:row`)."""
import csv

from dataset.ingest.formats.base import Document, Extracted, Format, Reading, Unreadable, decode_text


def read_csv(path, reading: Reading) -> Extracted:
    rows = list(csv.DictReader(decode_text(path.read_bytes(), reading.encoding).splitlines()))
    if rows and "text" not in rows[0]:
        raise Unreadable("a CSV without a text column")
    return Extracted([Document(row["text"], f"{path}:{n}") for n, row in enumerate(rows, start=2)])


CSV = Format("csv", (".csv",), read_csv)
'''

Z_LOSS_STAGE = '''
"""Pretraining with PaLM's z-loss (Chowdhery et al. 2022): 1e-4 * log(Z)^2 per token beside the cross-entropy,
which keeps the softmax's normaliser near 1."""
import torch.nn.functional as F

from common.tokens import IGNORE_INDEX
from trainer_utils.objectives import LanguageModeling, StepOutput, trained_forward
from trainer_utils.stages.pretrain import Pretrain


class ZLossLM(LanguageModeling):
    def __call__(self, forward, batch, autocast):
        x, y = batch[0], batch[1]
        with autocast():
            logits, router = trained_forward(forward, x)
        logits = logits.float()
        ce = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
        z = (logits.logsumexp(-1) ** 2)[y != IGNORE_INDEX].sum()
        return StepOutput(ce + 1e-4 * z, metrics={"z": z.detach()}, router=router)


class ZLossPretrain(Pretrain):
    name = "zloss"
    script = "train_zloss.py"

    def objective(self, setup):
        return ZLossLM()
'''


def load_module(tmp_path: Path, name: str, source: str):
    """A module written into tmp_path and imported, as a user's new file would be."""
    path = tmp_path / f"{name}.py"
    path.write_text(source, encoding="utf-8")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_a_new_format_is_its_module_and_one_registry_line(tmp_path, monkeypatch):
    csv_format = load_module(tmp_path, "csv_format", CSV_FORMAT)
    monkeypatch.setattr(formats, "FORMATS", (*formats.FORMATS, csv_format.CSV))  # the registry line
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "notes.csv").write_text('id,text\n1,"The keeper trims the lamp twice each night, by the book."\n'
                                      '2,"Fog horns sound every thirty seconds when the light is hidden."\n')
    (folder / "log.txt").write_text("The supply boat comes on Thursdays, weather permitting, with oil.\n")
    report = ingest([str(folder)], tmp_path / "corpus.jsonl", progress=False)
    records = [json.loads(line) for line in (tmp_path / "corpus.jsonl").read_text().splitlines()]
    assert [(r["source"], r["text"]) for r in records] == [
        (f"{folder}/log.txt", "The supply boat comes on Thursdays, weather permitting, with oil."),
        (f"{folder}/notes.csv:2", "The keeper trims the lamp twice each night, by the book."),
        (f"{folder}/notes.csv:3", "Fog horns sound every thirty seconds when the light is hidden.")]
    assert report["by_format"]["csv"]["documents"] == 2 and report["by_format"]["text"]["documents"] == 1


def test_a_new_stage_is_its_module_and_one_registry_line(corpus, tmp_path, monkeypatch):
    stage = load_module(tmp_path, "zloss_stage", Z_LOSS_STAGE).ZLossPretrain()
    monkeypatch.setitem(STAGES, stage.name, stage)  # the registry line
    argv = cli_flags({"data_path": corpus["pretrain"], "cache_dir": corpus["cache"], "out_dir": tmp_path / "out",
                      "run_name": "z", "preset": "tiny", "batch_size": 2, "max_seq_len": 32, "max_steps": 3,
                      "dtype": "float32", "log_interval": 1, "num_workers": 0, "eval_interval": 3})
    assert driver.main("zloss", argv, "pretraining with a z-loss") == 0
    run = tmp_path / "out" / "z"
    steps = read_metrics(run)
    assert [r["step"] for r in steps] == [1, 2, 3]
    # the stage's own term is logged beside the loss: log(Z) of a fresh model's logits is about log(vocab) > 0
    assert all(math.isfinite(r["loss"]) and r["z"] > 0 for r in steps)
    assert {json.loads(p.read_text())["method"] for p in run.rglob("train_info.json")} == {"zloss"}  # its checkpoint
