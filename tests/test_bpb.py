"""Validation bits per byte (val_bpb) and training time (elapsed_s) in metrics.jsonl: bpb equals the logged loss
rescaled by the tokens and UTF-8 bytes of the very batches evaluated, per file of a mixture, for pretraining and
SFT; absent for DPO and for a tokenizer that is not byte-level; elapsed_s leaves out evaluation pauses."""
from __future__ import annotations

import math
import re
import time
from pathlib import Path

import pytest
from test_distributed import args as ddp_args
from test_distributed import single, torchrun
from test_mixture import run_flags
from test_train import flags

import train_dpo
import train_pretrain
from common.errors import CheckpointError
from common.tokens import IGNORE_INDEX
from model.inference import token_byte_lengths
from trainer_utils import loop as loop_mod
from trainer_utils import session as session_mod
from trainer_utils.components.evaluation import Evaluation
from trainer_utils.data import eval_batches
from trainer_utils.stages import parse_train_config

from conftest import ROOT, strict_records


def tokens_and_bytes(run_dir: Path, stage: str) -> dict[str, tuple[int, int]]:
    """Per validation file of a finished run: the target tokens and their UTF-8 bytes in the batches its
    evaluations score, recounted from the data its train_config.json describes."""
    argv = ["--config", str(run_dir / "train_config.json"), "--run_name", "recount"]
    session = loop_mod.Session(parse_train_config(stage, argv, ""), stage)
    try:
        lengths = token_byte_lengths(session.tokenizer.path, session.model_config.vocab_size)
        counts = {}
        for v in session.val_sets:
            targets = [b[1].flatten() for b in eval_batches(v.data, session.config.optim.batch_size,
                                                            session.config.eval.eval_batches, 0, 1)]
            scored = [t[t != IGNORE_INDEX] for t in targets]
            counts[v.name] = (sum(len(t) for t in scored), sum(int(lengths[t].sum()) for t in scored))
        return counts
    finally:
        session.backend.close()


def expected_bpb(loss: float, tokens: int, n_bytes: int) -> float:
    """Nats per token -> bits per byte."""
    return loss / math.log(2) * tokens / n_bytes


def evals(run_dir: Path) -> list[dict]:
    return [r for r in strict_records(run_dir) if "val_loss" in r]


def test_pretraining_logs_val_bpb_of_the_evaluated_batches(corpus, tmp_path, capsys):
    assert train_pretrain.main(flags(corpus, tmp_path, sample_prompts="none")) == 0
    [(tokens, n_bytes)] = tokens_and_bytes(tmp_path / "run", "pretrain").values()
    records = evals(tmp_path / "run")
    assert [r["step"] for r in records] == [4, 8]
    for r in records:
        assert r["val_bpb"] == pytest.approx(expected_bpb(r["val_loss"], tokens, n_bytes), abs=2e-5)
    assert f"bpb {records[-1]['val_bpb']:.4f}" in capsys.readouterr().err  # the console's eval line


def test_sft_logs_val_bpb(sft_run):
    [(tokens, n_bytes)] = tokens_and_bytes(sft_run, "sft").values()
    [r] = evals(sft_run)
    assert r["val_bpb"] == pytest.approx(expected_bpb(r["val_loss"], tokens, n_bytes), abs=2e-5)


def test_each_file_of_a_mixture_gets_its_val_bpb(two_sources, tmp_path, capsys):
    assert train_pretrain.main(run_flags(two_sources, tmp_path, "mix", "pretrain", max_steps=4)) == 0
    counts = tokens_and_bytes(tmp_path / "mix", "pretrain")
    [r] = [r for r in evals(tmp_path / "mix") if r["step"] == 4]
    each = []
    for name, (tokens, n_bytes) in counts.items():
        each.append(r[f"val_bpb/{name}"])
        assert each[-1] == pytest.approx(expected_bpb(r[f"val_loss/{name}"], tokens, n_bytes), abs=2e-5)
    assert r["val_bpb"] == pytest.approx(0.7 * each[0] + 0.3 * each[1], abs=2e-5)  # weighted as val_loss is
    # the console's eval line (to 4 decimals, the log's values to 5)
    shown = re.search(r"bpb ([\d.]+) \(first ([\d.]+), second ([\d.]+)\)", capsys.readouterr().err)
    assert [float(x) for x in shown.groups()] == pytest.approx([r["val_bpb"], *each], abs=1e-4)
    assert each[0] != each[1]  # each file's own validation split


@pytest.mark.slow  # two ranks in real processes
def test_two_ranks_count_the_bytes_of_all_ranks(corpus, tmp_path):
    """The bytes are summed over the ranks with the loss: two ranks evaluating the same examples as one process
    (every validation window here) log the same val_bpb."""
    single(ddp_args(corpus, tmp_path, "single", batch_size=8))
    torchrun(2, ddp_args(corpus, tmp_path, "ddp", batch_size=4))
    a, b = evals(tmp_path / "single"), evals(tmp_path / "ddp")
    assert [r["step"] for r in a] == [r["step"] for r in b] == [3, 6]
    assert [r["val_bpb"] for r in a] == pytest.approx([r["val_bpb"] for r in b], abs=2e-5)


def test_no_val_bpb_for_a_tokenizer_that_is_not_byte_level(corpus, tmp_path, monkeypatch, capsys):
    def not_byte_level(*_):
        raise CheckpointError("tokenizer.json: bits per byte needs a byte-level BPE tokenizer, decoder is 'Metaspace'")
    monkeypatch.setattr(session_mod, "token_byte_lengths", not_byte_level)
    assert train_pretrain.main(flags(corpus, tmp_path, max_steps=4, sample_prompts="none")) == 0
    assert "note: no val_bpb in the log" in capsys.readouterr().err
    [r] = evals(tmp_path / "run")
    assert r["val_loss"] > 0 and not [k for k in r if "bpb" in k]


def test_no_val_bpb_for_dpo(sft_run, tmp_path):
    pairs = tmp_path / "pairs.jsonl"
    lines = (ROOT / "dataset/demo/dpo_demo.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)[:60]
    pairs.write_text("".join(lines), encoding="utf-8")
    argv = flags({"pretrain": pairs, "cache": tmp_path / "cache"}, tmp_path, "dpo", init_from=sft_run, preset=None,
                 max_seq_len=128, val_fraction=0.1, max_steps=2, eval_interval=2, sample_prompts="none")
    assert train_dpo.main(argv) == 0
    [r] = evals(tmp_path / "dpo")
    assert "val_reward_accuracy" in r and not [k for k in r if "bpb" in k]


def test_elapsed_s_is_training_time_without_evaluation(corpus, tmp_path, monkeypatch):
    """A slow evaluation (here 2 s more at step 4) does not count; a resume goes on from the
    checkpoint's training time."""
    real = Evaluation.run

    def slow_at_step_4(self, ctx):
        if ctx.state.step == 4:
            time.sleep(2)
        real(self, ctx)

    monkeypatch.setattr(Evaluation, "run", slow_at_step_4)
    t0 = time.perf_counter()
    assert train_pretrain.main(flags(corpus, tmp_path, sample_prompts="none")) == 0
    wall = time.perf_counter() - t0
    records = strict_records(tmp_path / "run")
    train = {r["step"]: r["elapsed_s"] for r in records if "loss" in r}
    val = {r["step"]: r["elapsed_s"] for r in records if "val_loss" in r}
    assert list(train) == [2, 4, 6, 8] and list(train.values()) == sorted(train.values())
    assert val[4] == pytest.approx(train[4], abs=0.05) and val[8] == pytest.approx(train[8], abs=0.05)
    assert train[8] - train[4] < 2 and 0 < train[8] < wall - 2

    monkeypatch.undo()
    assert train_pretrain.main(flags(corpus, tmp_path, max_steps=10, resume=True, sample_prompts="none")) == 0
    resumed = [r for r in strict_records(tmp_path / "run") if "loss" in r][-1]
    assert resumed["step"] == 10 and resumed["elapsed_s"] > train[8]
