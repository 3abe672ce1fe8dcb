"""Distillation: the loss against a plain reference, KL 0 for a student that is its teacher, and a real run with a
teacher of another width and depth; the teacher must share the student's tokenizer."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from test_train import flags, straight_and_resumed, weights

import train_distillation
import train_pretrain
from model import PocketLM, load_model
from trainer_utils.objectives import Distillation

from conftest import read_metrics, tiny_config


def batch(vocab: int = 256, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (3, 12), generator=g)
    y = torch.randint(0, vocab, (3, 12), generator=g)
    y[0, :5] = -100  # context positions carry no loss
    y[2] = -100  # nor does a whole row
    return x, y


def no_autocast():
    import contextlib
    return contextlib.nullcontext()


def test_a_student_that_is_its_teacher_has_kl_zero():
    model = PocketLM(tiny_config())
    _, kl, _ = Distillation(model, 0.5, 1.5).parts(model, batch(), no_autocast)
    assert abs(float(kl)) < 1e-5


@pytest.mark.parametrize("alpha,temperature", [(0.5, 1.5), (0.0, 2.0), (1.0, 1.0), (0.3, 0.7)])
def test_loss_and_gradient_equal_a_plain_reference(alpha, temperature):
    """The reference: for each target token separately, alpha * -log p_s(label) + (1 - alpha) * T^2 *
    F.kl_div of the softened distributions."""
    torch.manual_seed(0)
    student, teacher = PocketLM(tiny_config()), PocketLM(tiny_config(hidden_size=128, num_hidden_layers=3))
    x, y = batch()
    loss = Distillation(teacher, alpha, temperature)(student, (x, y), no_autocast).loss
    ours = torch.autograd.grad(loss, list(student.parameters()))

    s_logits, t_logits = student(x), teacher(x).detach()
    reference = torch.zeros(())
    for b, t in (y != -100).nonzero().tolist():
        hard = -F.log_softmax(s_logits[b, t], -1)[y[b, t]]
        soft = F.kl_div(F.log_softmax(s_logits[b, t] / temperature, -1),
                        F.log_softmax(t_logits[b, t] / temperature, -1), log_target=True, reduction="sum")
        reference = reference + alpha * hard + (1 - alpha) * temperature ** 2 * soft
    torch.testing.assert_close(loss, reference, rtol=1e-5, atol=1e-5)
    expected = torch.autograd.grad(reference, list(student.parameters()))
    for a, b in zip(ours, expected):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_the_teacher_gets_no_gradient_and_validation_scores_the_student_alone():
    student, teacher = PocketLM(tiny_config()), PocketLM(tiny_config())
    objective = Distillation(teacher, 0.5, 1.5)
    x, y = batch()
    objective(student, (x, y), no_autocast).loss.backward()
    assert all(p.grad is None for p in teacher.parameters()) and not teacher.training
    assert not any(p.requires_grad for p in teacher.parameters())  # frozen, not only run without gradients
    val = objective.evaluate(student, (x, y), no_autocast)
    ce = F.cross_entropy(student(x).flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum")
    torch.testing.assert_close(val.loss, ce)


@pytest.fixture(scope="module")
def teacher(corpus, tmp_path_factory):
    """A wider, deeper model (d128, 3 layers) briefly trained on the corpus."""
    out = tmp_path_factory.mktemp("teacher")
    assert train_pretrain.main(flags(corpus, out, "teacher", hidden_size=128, num_hidden_layers=3, max_steps=6)) == 0
    return out / "teacher"


def test_a_student_learns_from_a_wider_deeper_teacher(corpus, tmp_path, teacher):
    assert train_distillation.main(flags(corpus, tmp_path, "student", teacher=teacher, max_steps=4,
                                         log_interval=2)) == 0
    records = read_metrics(tmp_path / "student")
    assert [r["step"] for r in records] == [2, 4]
    for r in records:  # the loss is the mix of its two logged parts
        assert r["loss"] == pytest.approx(0.5 * r["ce"] + 0.5 * 1.5 ** 2 * r["kl"], rel=1e-4)
        assert r["kl"] > 0
    model, model_dir = load_model(tmp_path / "student")
    assert model.config.hidden_size == 64  # the student's own shape
    info = json.loads((model_dir / "train_info.json").read_text())
    assert (info["prompt_format"], info["method"]) == ("text", "distill")


def test_distillation_on_conversations_saves_a_chat_checkpoint(corpus, tmp_path, teacher):
    assert train_distillation.main(flags(corpus, tmp_path, "student", data_path=corpus["sft"], teacher=teacher,
                                         max_steps=2, alpha=0.2, temperature=2.0)) == 0
    info = json.loads((load_model(tmp_path / "student")[1] / "train_info.json").read_text())
    assert (info["prompt_format"], info["method"]) == ("chat", "distill")


def test_a_teacher_with_another_tokenizer_is_refused(corpus, tmp_path, teacher, capsys):
    other = tmp_path / "other"
    shutil.copytree(load_model(teacher)[1], other)
    tok = json.loads((other / "tokenizer.json").read_text())
    tok["model"]["vocab"]["zzz-not-ours"] = len(tok["model"]["vocab"])
    (other / "tokenizer.json").write_text(json.dumps(tok))
    assert train_distillation.main(flags(corpus, tmp_path, "student", teacher=other, max_steps=2)) == 2
    assert "uses another tokenizer than the student" in capsys.readouterr().err
    assert train_distillation.main(flags(corpus, tmp_path, "student", max_steps=2)) == 2
    assert "train_distillation.py learns from a teacher: pass --teacher" in capsys.readouterr().err


def test_distillation_resumes_bit_exactly(corpus, tmp_path, teacher, monkeypatch):
    straight_and_resumed(monkeypatch, train_distillation.main,
                         lambda run, **o: flags(corpus, tmp_path, run, teacher=teacher, **o), 4)
    a, b = weights(tmp_path / "straight"), weights(tmp_path / "resumed")
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_post_training_in_reduced_precision(corpus, tmp_path, teacher, dtype):
    """Autocast (and fp16's loss scaling) under the distillation and LoRA objectives: finite, applied steps."""
    import train_lora
    assert train_distillation.main(flags(corpus, tmp_path, "distill", teacher=teacher, dtype=dtype,
                                         max_steps=4)) == 0
    assert train_lora.main(flags(corpus, tmp_path, "lora", data_path=corpus["sft"], init_from=teacher, preset=None,
                                 dtype=dtype, max_steps=4)) == 0
    for run in ("distill", "lora"):
        records = read_metrics(tmp_path / run)
        assert all(r["loss"] is not None and r["skipped_steps"] == 0 for r in records), records
