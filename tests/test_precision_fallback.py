"""--on_nonfinite: a run whose precision keeps producing non-finite gradients reloads its last checkpoint and
continues in a wider format (fp16 -> bf16 -> fp32), stays resumable, and stops when nothing wider is left."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_train import flags, stop_at, weights

import train_pretrain
from trainer_utils import loop as loop_mod
from trainer_utils.backend import TorchBackend
from trainer_utils.runtime import fallback_dtype, wider_dtype

from conftest import fake_cpu, read_metrics, strict_records


def poison(monkeypatch, dtypes: set[torch.dtype], when=lambda step: True) -> None:
    """Make the gradients of every step trained in one of `dtypes` infinite (as an fp16 overflow would) when
    `when(steps already taken)` holds; steps in other precisions train normally."""
    real = loop_mod.Trainer.train_step

    def train_step(self, micro, n_valid):
        loss = real(self, micro, n_valid)
        if self.precision.dtype in dtypes and when(self.state.step):
            next(self.model.parameters()).grad.fill_(float("inf"))
        return loss

    monkeypatch.setattr(loop_mod.Trainer, "train_step", train_step)


def events(run_dir: Path) -> list[dict]:
    return [r for r in strict_records(run_dir) if r.get("event") == "precision_fallback"]


def info(run_dir: Path) -> dict:
    latest = run_dir / (run_dir / "latest").read_text().strip()
    return json.loads((latest / "train_info.json").read_text())


# fp16 steps 6.. are poisoned; with --max_bad_steps 2 the log at step 8 sees 3 bad steps in a row. The last
# checkpoint then is step 4 (save_interval 4; step 8's save comes after the check).
FP16_RUN = dict(dtype="float16", max_steps=12, max_bad_steps=2, eval_interval=100)


@pytest.fixture
def native_bf16(monkeypatch):
    """Pretend the CPU computes bf16 natively, so fp16 falls back to bf16 on any machine."""
    fake_cpu(monkeypatch, bf16=True)


def test_fallback_order_and_choice_per_device(monkeypatch):
    cpu = torch.device("cpu")
    fake_cpu(monkeypatch, bf16=True)
    assert fallback_dtype(torch.float16, cpu) == torch.bfloat16
    fake_cpu(monkeypatch, bf16=False)
    assert fallback_dtype(torch.float16, cpu) == torch.float32  # emulated bf16 is slower than fp32
    assert fallback_dtype(torch.bfloat16, cpu) == torch.float32
    assert fallback_dtype(torch.float32, cpu) is None
    assert wider_dtype(torch.float16, torch.bfloat16) == torch.bfloat16
    assert wider_dtype(torch.float32, torch.bfloat16) == torch.float32


def test_fp16_trouble_reloads_the_last_checkpoint_and_continues_in_bf16(corpus, tmp_path, monkeypatch, native_bf16,
                                                                        capsys):
    poison(monkeypatch, {torch.float16}, when=lambda step: step >= 5)
    assert train_pretrain.main(flags(corpus, tmp_path, "fallback", **FP16_RUN)) == 0
    run = tmp_path / "fallback"
    [event] = events(run)
    assert event == {**event, "step": 8, "from": "float16", "to": "bfloat16",
                     "reload": "checkpoints/step_00000004"}, event
    assert "3 consecutive steps had non-finite gradients" in event["reason"]
    assert "Falling back from float16 to bfloat16" in capsys.readouterr().err
    # the steps after the checkpoint are trained again, now in bf16, all applied, to the end
    records = read_metrics(run)
    assert [r["step"] for r in records] == [2, 4, 6, 8, 6, 8, 10, 12]
    assert all(r["loss"] is not None for r in records[4:]) and records[-1]["skipped_steps"] == 0
    resolved = json.loads((run / "train_config.json").read_text())["resolved"]
    assert resolved["dtype"] == "bfloat16" and resolved["precision_fallback"] == [event_without_time(event)]
    assert info(run)["dtype"] == "bfloat16" and info(run)["step"] == 12

    # the same as training to step 4 in fp16, then resuming from that checkpoint in bf16
    stop_at(monkeypatch, 4)
    assert train_pretrain.main(flags(corpus, tmp_path, "by_hand", **FP16_RUN)) == 0
    monkeypatch.undo()
    assert train_pretrain.main(flags(corpus, tmp_path, "by_hand", **{**FP16_RUN, "dtype": "bfloat16"},
                                     resume=True)) == 0
    a, b = weights(run), weights(tmp_path / "by_hand")
    assert all(torch.equal(a[k], b[k]) for k in a)


def event_without_time(event: dict) -> dict:
    return {k: v for k, v in event.items() if k not in ("time", "event")}


def test_a_resumed_run_keeps_the_precision_it_fell_back_to(corpus, tmp_path, monkeypatch, native_bf16, capsys):
    """A requeued job repeats the original command (--dtype float16): the resume continues in bf16, and ends
    with the same weights as the run that was never interrupted."""
    poison(monkeypatch, {torch.float16}, when=lambda step: step >= 5)
    assert train_pretrain.main(flags(corpus, tmp_path, "straight", **FP16_RUN)) == 0
    stop_at(monkeypatch, 10)  # after the fallback: checkpoint 10 was trained in bf16
    assert train_pretrain.main(flags(corpus, tmp_path, "requeued", **FP16_RUN)) == 0
    run = tmp_path / "requeued"
    assert info(run)["step"] == 10 and info(run)["dtype"] == "bfloat16"
    assert [e["step"] for e in info(run)["precision_fallback"]] == [8]
    monkeypatch.undo()
    poison(monkeypatch, {torch.float16}, when=lambda step: step >= 5)  # fp16 would still fail
    capsys.readouterr()
    assert train_pretrain.main(flags(corpus, tmp_path, "requeued", **FP16_RUN, resume=True)) == 0
    assert "resuming in bfloat16: this run fell back to it from float16 at step 8" in capsys.readouterr().err
    assert len(events(run)) == 1  # no second fallback
    resolved = json.loads((run / "train_config.json").read_text())["resolved"]
    assert resolved["dtype"] == "bfloat16" and len(resolved["precision_fallback"]) == 1
    a, b = weights(tmp_path / "straight"), weights(run)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_without_a_checkpoint_the_run_restarts_from_its_initial_weights(corpus, tmp_path, monkeypatch, native_bf16):
    poison(monkeypatch, {torch.float16})
    run_flags = dict(FP16_RUN, max_steps=6, save_interval=100)
    assert train_pretrain.main(flags(corpus, tmp_path, "fallback", **run_flags)) == 0
    [event] = events(tmp_path / "fallback")
    assert event["step"] == 2 and event["reload"] == "initial weights"
    assert train_pretrain.main(flags(corpus, tmp_path, "bf16", **{**run_flags, "dtype": "bfloat16"})) == 0
    a, b = weights(tmp_path / "fallback"), weights(tmp_path / "bf16")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_fallbacks_chain_to_fp32_then_the_run_stops(corpus, tmp_path, monkeypatch, native_bf16, capsys):
    poison(monkeypatch, {torch.float16, torch.bfloat16, torch.float32}, when=lambda step: step >= 5)
    assert train_pretrain.main(flags(corpus, tmp_path, "run", **FP16_RUN)) == 1
    assert [(e["from"], e["to"]) for e in events(tmp_path / "run")] == [("float16", "bfloat16"),
                                                                       ("bfloat16", "float32")]
    err = capsys.readouterr().err
    assert "error: 3 consecutive steps had non-finite gradients; stopping without saving" in err
    assert "Try a lower --learning_rate." in err  # in fp32 a wider --dtype is no advice
    assert info(tmp_path / "run")["step"] == 4  # nothing saved from the broken stretches


def test_on_nonfinite_stop_exits_1_without_falling_back(corpus, tmp_path, monkeypatch, capsys):
    poison(monkeypatch, {torch.float16}, when=lambda step: step >= 5)
    assert train_pretrain.main(flags(corpus, tmp_path, "run", **FP16_RUN, on_nonfinite="stop")) == 1
    assert events(tmp_path / "run") == []
    assert "--dtype bfloat16 or float32" in capsys.readouterr().err
    assert info(tmp_path / "run")["step"] == 4 and info(tmp_path / "run")["dtype"] == "float16"


def test_a_collapsed_fp16_loss_scale_triggers_the_fallback(corpus, tmp_path, monkeypatch, native_bf16):
    """Every other step overflows: never 2 bad steps in a row, but each halves the scale from 2**16; after the
    17th (step 34) it is 0.5."""
    poison(monkeypatch, {torch.float16}, when=lambda step: step % 2 == 1)
    run_flags = dict(FP16_RUN, max_steps=36, save_interval=100, log_interval=2)
    assert train_pretrain.main(flags(corpus, tmp_path, "run", **run_flags)) == 0
    [event] = events(tmp_path / "run")
    assert event["step"] == 34 and "the fp16 loss scale fell to 0.5 (below 1)" in event["reason"]
    assert info(tmp_path / "run")["dtype"] == "bfloat16"


def test_a_backend_that_cannot_switch_precision_stops_with_the_resume_command(corpus, tmp_path, monkeypatch,
                                                                                native_bf16, capsys):
    """DeepSpeed builds its precision into the engine: the fallback becomes advice to resume in bf16."""
    monkeypatch.setattr(TorchBackend, "can_switch_precision", False)
    poison(monkeypatch, {torch.float16}, when=lambda step: step >= 5)
    assert train_pretrain.main(flags(corpus, tmp_path, "run", **FP16_RUN)) == 1
    assert "continue with --resume --dtype bfloat16" in capsys.readouterr().err
    assert events(tmp_path / "run") == []
