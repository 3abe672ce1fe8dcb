"""Mixture-of-experts training: the step-global balancing loss, loss-free bias balancing, logging, exact resume,
every training script, and (slow) DDP with idle experts and DeepSpeed ZeRO-2."""
from __future__ import annotations

import pytest
import torch
from test_dpo_training import dpo_flags, pairs  # noqa: F401 (a fixture)
from test_train import flags, straight_and_resumed, weights

import train_distillation
import train_dpo
import train_full_sft
import train_lora
import train_pretrain
from common.errors import ConfigError
from model import load_model
from model.config import config_from_flags
from trainer_utils import loop as loop_mod
from trainer_utils.routing import RouterBalance
from trainer_utils.stages import parse_train_config

from conftest import ROOT, read_metrics, train_through_an_empty_step

MOE = dict(num_experts=4, num_experts_per_tok=2, num_shared_experts=1, moe_intermediate_size=48)


def moe_flags(corpus, tmp_path, run="moe", **over) -> list[str]:
    return flags(corpus, tmp_path, run, **{**MOE, **over})


def trainer_for(corpus, tmp_path, **over) -> loop_mod.Trainer:
    config = parse_train_config("pretrain", moe_flags(corpus, tmp_path, **over), "")
    return loop_mod.Trainer(loop_mod.Session(config, "pretrain"))


def step_gradients(trainer: loop_mod.Trainer, micro: list) -> list[torch.Tensor]:
    """The gradients of one training step on `micro` (the optimizer is not stepped)."""
    trainer.optimizer.zero_grad(set_to_none=True)
    n_valid = sum(trainer.objective.count(b) for b in micro).float()
    trainer.router.start_step(torch.tensor(float(sum(b[0].numel() for b in micro))))
    trainer.train_step(micro, n_valid)
    return [p.grad.clone() for p in trainer.model.parameters()]


def test_the_balancing_loss_is_the_switch_loss_over_the_whole_step(corpus, tmp_path):
    """With the LM loss's gradients subtracted, the step's gradients are those of
    coef * mean over layers of E * sum_e f_e * P_e, f and P over every token of the step."""
    coef = 0.5
    trainer = trainer_for(corpus, tmp_path, router_aux_loss_coef=coef)
    batch = trainer.session.train_data.batch(trainer.session.train_data.global_indices(0, 4))
    with_aux = step_gradients(trainer, [batch])
    trainer.model.config.router_aux_loss_coef = 0.0
    lm_only = step_gradients(trainer, [batch])

    model = trainer.model
    model.zero_grad(set_to_none=True)
    _, router = model(batch[0], return_router=True)
    f = router.counts / router.counts.sum(-1, keepdim=True)
    P = router.prob_sum / router.tokens
    (coef * (model.config.num_experts * (f * P).sum(-1)).mean()).backward()
    for p, a, b in zip(model.parameters(), with_aux, lm_only):
        expected = p.grad if p.grad is not None else torch.zeros_like(a)
        torch.testing.assert_close(a - b, expected, atol=1e-7, rtol=1e-4)
    assert model.layers[0].mlp.gate.weight.grad.abs().sum() > 0


def test_the_logged_balance_is_the_step_value_under_accumulation(corpus, tmp_path):
    """One batch of 8, or 2 micro-batches of 4: the first step's logged balance and z-loss are the same number
    (the logged value is the step's, whatever the split), and so is the loss."""
    common = dict(max_steps=1, log_interval=1, eval_interval=100, save_interval=100, router_z_loss_coef=1e-3)
    assert train_pretrain.main(moe_flags(corpus, tmp_path, "big", batch_size=8, **common)) == 0
    assert train_pretrain.main(moe_flags(corpus, tmp_path, "acc", batch_size=4, accumulation_steps=2,
                                         **common)) == 0
    a, b = read_metrics(tmp_path / "big")[0], read_metrics(tmp_path / "acc")[0]
    for key in ("loss", "router_balance", "router_z", "aux_loss"):
        assert a[key] == pytest.approx(b[key], rel=1e-5), key
    assert a["router_load"] == b["router_load"]


def test_router_metrics_are_logged_apart_from_the_loss(corpus, tmp_path):
    assert train_pretrain.main(moe_flags(corpus, tmp_path, max_steps=4, router_z_loss_coef=1e-3)) == 0
    records = read_metrics(tmp_path / "moe")
    for r in records:
        assert len(r["router_load"]) == 2 and all(len(row) == 4 for row in r["router_load"])
        assert all(sum(row) == pytest.approx(1, abs=1e-3) for row in r["router_load"])
        assert r["router_max_load"] == pytest.approx(max(r["router_max_load_layers"]))
        assert r["router_max_load"] >= 1 and r["router_dropped"] == 0
        assert 0 < min(r["router_entropy"]) and max(r["router_entropy"]) <= torch.log(torch.tensor(4.0)) + 1e-6
        assert r["router_balance"] >= 1 - 1e-3  # E * sum f*P is 1 at uniform routing
        assert r["aux_loss"] == pytest.approx(0.01 * r["router_balance"] + 1e-3 * r["router_z"], rel=1e-3)
        assert 8 < r["loss"] < 9  # the LM loss at the start, about ln 6400 = 8.76


def test_the_loss_excludes_the_router_terms(corpus, tmp_path):
    trainer = trainer_for(corpus, tmp_path, router_aux_loss_coef=100.0)
    batch = trainer.session.train_data.batch(trainer.session.train_data.global_indices(0, 4))
    trainer.router.start_step(torch.tensor(float(batch[0].numel())))
    loss_sum = trainer.train_step([batch], trainer.objective.count(batch).float())
    logits = trainer.model(batch[0])
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[1].flatten(), ignore_index=-100,
                                           reduction="sum")
    torch.testing.assert_close(loss_sum, ce.detach(), rtol=1e-5, atol=1e-4)


def test_resume_is_bit_identical_with_bias_balancing(corpus, tmp_path, monkeypatch):
    over = dict(router_bias_update_rate=0.01, router_aux_loss_coef=0)
    straight_and_resumed(monkeypatch, train_pretrain.main,
                         lambda run, **o: moe_flags(corpus, tmp_path, run, **over, **o), 4)
    a, b = weights(tmp_path / "straight"), weights(tmp_path / "resumed")
    assert any(k.endswith("router_bias") for k in a)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    bias = a["layers.0.mlp.router_bias"]  # moved, and centred
    assert bias.abs().max() > 0 and abs(float(bias.sum())) < 1e-6


def test_bias_balancing_evens_out_the_load(corpus, tmp_path):
    """Without any balancing loss, a router left alone drifts to uneven loads; the loss-free bias pulls them
    back (DeepSeek-V3)."""
    common = dict(max_steps=40, log_interval=10, eval_interval=1000, save_interval=1000, router_aux_loss_coef=0,
                  num_experts=8, num_shared_experts=0, learning_rate=1e-2)
    assert train_pretrain.main(moe_flags(corpus, tmp_path, "free", **common)) == 0
    assert train_pretrain.main(moe_flags(corpus, tmp_path, "bias", router_bias_update_rate=0.05, **common)) == 0
    free = [r["router_max_load"] for r in read_metrics(tmp_path / "free")]
    bias = [r["router_max_load"] for r in read_metrics(tmp_path / "bias")]
    # measured: the most loaded expert at 2.3-4.0x the mean without, 1.5-1.7x with the bias, every window
    assert max(bias) < min(free), (bias, free)


def test_a_skipped_step_leaves_the_routing_bias_alone(corpus, tmp_path, monkeypatch):
    result = train_through_an_empty_step(moe_flags(corpus, tmp_path, max_steps=1, router_bias_update_rate=0.5),
                                         monkeypatch)
    assert result["skipped"] == 1 and result["weights_moved"] == []


def test_router_bias_update_is_the_sign_rule():
    class Stub:
        world_size = 1

        def all_reduce_sum(self, t):
            return t
    from model import PocketLM

    from conftest import tiny_config
    cfg = tiny_config(**MOE, router_bias_update_rate=0.1)
    model = PocketLM(cfg)
    balance = RouterBalance(cfg, Stub(), torch.device("cpu"))
    balance.start_step(torch.tensor(10.0))
    balance.step_counts.copy_(torch.tensor([[9.0, 5, 5, 1], [5, 5, 5, 5]]))
    balance.end_step(model, torch.tensor(False))
    assert model.layers[0].mlp.router_bias.abs().sum() == 0  # not applied: unchanged
    balance.end_step(model, torch.tensor(True))
    assert model.layers[0].mlp.router_bias.tolist() == pytest.approx([-0.1, 0.0, 0.0, 0.1])
    assert model.layers[1].mlp.router_bias.tolist() == [0.0] * 4


def test_gradient_checkpointing_trains_the_same_moe_model(corpus, tmp_path):
    common = dict(max_steps=3, log_interval=1, eval_interval=100, save_interval=100)
    assert train_pretrain.main(moe_flags(corpus, tmp_path, "plain", **common)) == 0
    assert train_pretrain.main(moe_flags(corpus, tmp_path, "ckpt", grad_checkpointing=True, **common)) == 0
    a, b = weights(tmp_path / "plain"), weights(tmp_path / "ckpt")
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=0)
    assert [r["router_load"] for r in read_metrics(tmp_path / "plain")] == \
        [r["router_load"] for r in read_metrics(tmp_path / "ckpt")]


def test_router_flags_apply_to_init_from_and_must_agree_on_resume(corpus, tmp_path, capsys):
    assert train_pretrain.main(moe_flags(corpus, tmp_path, "base", max_steps=2)) == 0
    assert train_full_sft.main(flags(corpus, tmp_path, "sft", data_path=corpus["sft"], preset=None, max_steps=2,
                                     init_from=tmp_path / "base", router_aux_loss_coef=0.05)) == 0
    model, _ = load_model(tmp_path / "sft")
    assert model.config.router_aux_loss_coef == 0.05 and model.config.num_experts == 4
    argv = moe_flags(corpus, tmp_path, "base", max_steps=4, resume=True, router_aux_loss_coef=0.2)
    assert train_pretrain.main(argv) != 0
    assert "--router_aux_loss_coef cannot take effect with --resume" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="norm_topk_prob"):
        config_from_flags(parse_train_config(
            "pretrain", moe_flags(corpus, tmp_path, num_experts_per_tok=1, norm_topk_prob=True), "").model)
    top1 = config_from_flags(parse_train_config(
        "pretrain", moe_flags(corpus, tmp_path, num_experts_per_tok=1), "").model)
    assert top1.norm_topk_prob is False  # top-1 defaults to Switch-style weights


def test_every_post_training_script_trains_a_moe_model(corpus, tmp_path, pairs):  # noqa: F811
    assert train_pretrain.main(moe_flags(corpus, tmp_path, "base", max_steps=2)) == 0
    assert train_full_sft.main(flags(corpus, tmp_path, "sft", data_path=corpus["sft"], preset=None, max_steps=2,
                                     init_from=tmp_path / "base", log_interval=1)) == 0
    assert train_lora.main(flags(corpus, tmp_path, "lora", data_path=corpus["sft"], preset=None, max_steps=2,
                                 init_from=tmp_path / "sft", log_interval=1)) == 0
    assert train_dpo.main(dpo_flags(pairs, tmp_path, tmp_path / "sft", max_steps=2)) == 0
    assert train_distillation.main(flags(corpus, tmp_path, "student", teacher=tmp_path / "base", max_steps=2,
                                         log_interval=1, **MOE)) == 0
    for run in ("sft", "lora", "dpo", "student"):
        records = read_metrics(tmp_path / run)
        assert records and all("router_balance" in r and r["router_dropped"] == 0 for r in records), run
    lora_model, _ = load_model(tmp_path / "lora")
    assert lora_model.config.num_experts == 4


# ----------------------------------------------------------------------------- real processes (slow)
@pytest.mark.slow
def test_ddp_with_idle_experts_matches_one_process(corpus, tmp_path):
    """16 experts, top-1, 8 tokens per rank per step: most experts get no token on a rank, yet their (zero)
    gradients are reduced like any other and 2 ranks train exactly what one process trains on both halves
    (which also needs the balancing loss's f over both ranks; its coefficient is large to make that visible)."""
    from test_distributed import args, single, torchrun
    over = dict(num_experts=16, num_experts_per_tok=1, num_shared_experts=0, moe_intermediate_size=32,
                max_seq_len=8, router_aux_loss_coef=1.0, max_steps=4)
    single(args(corpus, tmp_path, "single", batch_size=2, **over))
    torchrun(2, args(corpus, tmp_path, "ddp", batch_size=1, **over))
    ddp = read_metrics(tmp_path / "ddp")
    assert any(0.0 in row for r in ddp for row in r["router_load"])  # idle experts there were
    for a, b in zip(read_metrics(tmp_path / "single"), ddp):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
        assert a["router_balance"] == pytest.approx(b["router_balance"], abs=1e-5)
    wa, wb = weights(tmp_path / "single"), weights(tmp_path / "ddp")
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], atol=1e-5, rtol=0)


@pytest.mark.slow
def test_deepspeed_zero2_trains_and_resumes_a_moe_model(corpus, tmp_path):
    pytest.importorskip("deepspeed")
    from test_distributed import DS_BF16, args, torchrun
    over = {**MOE, "router_bias_update_rate": 0.01}
    torchrun(2, args(corpus, tmp_path, "ds", batch_size=4, **over) + DS_BF16)
    res = torchrun(2, args(corpus, tmp_path, "ds", batch_size=4, max_steps=9, resume=True, **over) + DS_BF16)
    assert "step 9: val_loss" in res.stderr
    records = read_metrics(tmp_path / "ds")
    assert [r["step"] for r in records] == list(range(1, 10))
    assert all(r["router_dropped"] == 0 and r["loss"] < 9 for r in records)
    model, _ = load_model(tmp_path / "ds")
    assert model.layers[0].mlp.router_bias.abs().max() > 0
    # the checkpoint holds the fp32 master weights, not the engine's bf16 copy
    from safetensors.torch import load_file
    saved = load_file(str(tmp_path / "ds/checkpoints/step_00000009/model.safetensors"))
    assert all(t.dtype == torch.float32 for t in saved.values())
    for name in ("layers.0.self_attn.q_proj.weight", "layers.0.mlp.router_bias"):  # neither rounded to bf16
        w = saved[name]
        assert not torch.equal(w, w.bfloat16().float()), name


def test_moe_recipe_parses(tmp_path):
    recipe = ROOT / "recipes" / "demo-moe-pretrain.yaml"
    config = parse_train_config("pretrain", ["--config", str(recipe), "--out_dir", str(tmp_path)], "")
    assert config.model.num_experts and config.model.num_experts > 0
