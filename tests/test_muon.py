"""--optimizer muon: which parameters Muon takes, one optimizer made of two, schedule, DDP, defaults, refusals
(exact resume: tests/test_train.py)."""
from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch
from test_train import flags, weights

import train_pretrain
from common.errors import ConfigError
from model import PocketLM
from trainer_utils.config import OptimConfig
from trainer_utils.muon import NS_COEFFICIENTS, Muon, newton_schulz
from trainer_utils.optim import MuonWithAdamW, WarmupCosine, build_optimizer, optimizer_for
from trainer_utils.stages import parse_train_config

from conftest import ROOT, fake_cpu, read_metrics, tiny_config

CPU = torch.device("cpu")


def muon(model: torch.nn.Module, lr: float = 1e-3, muon_lr: float | None = 4e-3) -> MuonWithAdamW:
    return build_optimizer(model, "muon", lr, 0.1, (0.9, 0.95), 0.9, CPU, muon_lr=muon_lr)


def owners(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, str]:
    """parameter name -> "muon" / "adamw" (the group that holds it)."""
    group_of = {id(p): g["owner"] for g in optimizer.param_groups for p in g["params"]}
    return {name: group_of[id(p)] for name, p in model.named_parameters()}


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randint(0, model.config.vocab_size, (2, 16), generator=g)
        model(x).float().logsumexp(-1).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def test_muon_takes_the_blocks_matrices_and_adamw_the_rest():
    cfg = tiny_config(tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2, num_shared_experts=1)
    model = PocketLM(cfg)
    got = owners(model, muon(model))
    on_muon = sorted(n for n, o in got.items() if o == "muon")
    assert all(n.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
                           "shared_experts.gate_proj.weight", "shared_experts.up_proj.weight",
                           "shared_experts.down_proj.weight")) for n in on_muon), on_muon
    assert len(on_muon) == cfg.num_hidden_layers * 7
    # embeddings, untied head, norms, routers and the 3-D expert stacks stay on AdamW
    for name in ("embed_tokens.weight", "lm_head.weight", "norm.weight", "layers.0.mlp.gate.weight",
                 "layers.0.mlp.experts.gate_proj", "layers.0.input_layernorm.weight"):
        assert got[name] == "adamw", name
    dense = PocketLM(tiny_config())
    assert sum(o == "muon" for o in owners(dense, muon(dense)).values()) == 2 * 7  # q k v o gate up down


needs_torch_muon = pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon is new in 2.9")


@needs_torch_muon
def test_one_optimizer_steps_exactly_like_torch_muon_and_adamw_side_by_side(monkeypatch):
    """The combined optimizer is a bookkeeping layer over our Muon, whose steps (bf16 Newton-Schulz, where bf16 is
    native) equal torch.optim.Muon + AdamW run apart."""
    fake_cpu(monkeypatch, bf16=True)
    model = PocketLM(tiny_config())
    reference = copy.deepcopy(model)
    combined = muon(model, lr=1e-3, muon_lr=4e-3)
    hidden = [p for g in combined.param_groups if g["owner"] == "muon" for p in g["params"]]
    hidden_ids = {id(p) for p in hidden}
    by_name = dict(model.named_parameters())
    ref_params = dict(reference.named_parameters())
    ref_hidden = [ref_params[n] for n, p in by_name.items() if id(p) in hidden_ids]
    ref_rest = [ref_params[n] for n, p in by_name.items() if id(p) not in hidden_ids]
    apart = [torch.optim.Muon(ref_hidden, lr=4e-3, weight_decay=0.1, momentum=0.95, nesterov=True,
                              adjust_lr_fn="match_rms_adamw"),
             torch.optim.AdamW(ref_rest, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0, fused=True)]

    class Both:
        def step(self):
            for o in apart:
                o.step()

        def zero_grad(self, set_to_none=True):
            for o in apart:
                o.zero_grad(set_to_none=set_to_none)

    train(model, combined, 3)
    train(reference, Both(), 3)
    for (name, a), b in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(a, b), name


@needs_torch_muon
@pytest.mark.parametrize("shape", [(48, 48), (96, 32), (32, 96), (5, 300)], ids=["square", "tall", "wide", "thin"])
def test_newton_schulz_in_bf16_is_torchs_bit_for_bit(shape):
    from torch.optim._muon import _zeropower_via_newtonschulz
    g = torch.randn(shape)
    assert torch.equal(newton_schulz(g, torch.bfloat16), _zeropower_via_newtonschulz(g, NS_COEFFICIENTS, 5, 1e-7))


# Relative Frobenius error of each precision against the same iteration in fp64 (measured on random matrices:
# fp32 ~1e-6, fp16 ~2e-3, bf16 ~1.6e-2, i.e. each format's rounding, amplified a few times by five steps).
NS_TOLERANCE = {torch.float32: 1e-5, torch.float16: 6e-3, torch.bfloat16: 4e-2}


@pytest.mark.parametrize("dtype", list(NS_TOLERANCE), ids=str)
@pytest.mark.parametrize("shape", [(64, 64), (128, 32), (32, 128)], ids=["square", "tall", "wide"])
def test_newton_schulz_matches_an_fp64_reference(dtype, shape):
    # a gradient whose singular values spread over 1.5 decades
    m, n = shape
    u, v = torch.linalg.qr(torch.randn(m, min(m, n)))[0], torch.linalg.qr(torch.randn(n, min(m, n)))[0]
    g = u @ torch.diag(10 * torch.logspace(-1.5, 0, min(m, n))) @ v.T
    reference = newton_schulz(g.double(), torch.float64)
    got = newton_schulz(g, dtype)
    assert got.dtype == dtype and got.shape == g.shape
    assert ((got.double() - reference).norm() / reference.norm()).item() < NS_TOLERANCE[dtype]
    # it orthogonalises: the 30x spread of singular values becomes ~[0.68, 1.13] (Muon's S' ~ Uniform(0.5, 1.5))
    s = torch.linalg.svdvals(got.double())
    assert s.min() > 0.6 and s.max() < 1.2


def test_fp16_newton_schulz_scales_before_the_cast():
    """Gradients of 1e-6 are below fp16's normal range (6e-5): scaled to norm 1 first, they lose nothing."""
    g = torch.randn(64, 128)
    reference = newton_schulz(g.double(), torch.float64)
    tiny = newton_schulz(g * 1e-6, torch.float16).double()
    assert ((tiny - reference).norm() / reference.norm()).item() < NS_TOLERANCE[torch.float16]


@pytest.mark.parametrize("bf16,expected,steps", [(True, torch.bfloat16, 5), (False, torch.float32, 3)],
                         ids=["native-bf16", "avx2-only"])
def test_newton_schulz_runs_in_the_policys_precision(monkeypatch, bf16, expected, steps):
    """An AVX2-only CPU emulates bf16 at ~1% of fp32's speed: there the iteration runs in fp32, and three times
    instead of torch's five (where it is a quarter of the step, fewer learned more per second)."""
    fake_cpu(monkeypatch, bf16)
    optimizer = muon(PocketLM(tiny_config()))
    assert optimizer.muon.ns_dtype == expected
    assert [g["ns_steps"] for g in optimizer.param_groups if g["owner"] == "muon"] == [steps]
    seen = []
    monkeypatch.setattr("trainer_utils.muon.newton_schulz",
                        lambda g, dtype, n, *a: seen.append((dtype, n)) or g.to(dtype))
    train(optimizer_model := PocketLM(tiny_config()), muon(optimizer_model), 1)
    assert seen and set(seen) == {(expected, steps)}


@needs_torch_muon
def test_state_saved_under_torch_muon_resumes_here():
    """Checkpoints written before this Muon (torch.optim.Muon inside) load and continue exactly."""
    model = PocketLM(tiny_config())
    hidden = [p for n, p in model.named_parameters() if p.ndim == 2 and "embed" not in n]
    theirs = torch.optim.Muon(hidden, lr=1e-2, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    train(model, theirs, 2)
    twin = copy.deepcopy(model)
    twin_hidden = [p for n, p in twin.named_parameters() if p.ndim == 2 and "embed" not in n]
    ours = Muon(twin_hidden, lr=1e-2, weight_decay=0.1, adjust_lr_fn="match_rms_adamw", ns_dtype=torch.bfloat16)
    ours.load_state_dict(copy.deepcopy(theirs.state_dict()))
    train(model, theirs, 2, seed=1)
    train(twin, ours, 2, seed=1)
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)


def test_muon_trains_on_a_pytorch_without_torch_optim_muon(corpus, tmp_path, monkeypatch):
    """PyTorch before 2.9 has no torch.optim.Muon; ours does not need it."""
    monkeypatch.delattr(torch.optim, "Muon", raising=False)
    argv = flags(corpus, tmp_path, max_steps=6, log_interval=2, eval_interval=100, optimizer="muon",
                 learning_rate=3e-3)
    assert train_pretrain.main(argv) == 0
    losses = [r["loss"] for r in read_metrics(tmp_path / "run")]
    assert losses[-1] < losses[0], losses


def test_muon_refuses_what_it_cannot_orthogonalise():
    with pytest.raises(ValueError, match="2-D parameters only"):
        Muon([torch.nn.Parameter(torch.zeros(3))])
    with pytest.raises(ValueError, match="adjust_lr_fn"):
        Muon([torch.nn.Parameter(torch.zeros(3, 3))], adjust_lr_fn="bigger")
    with pytest.raises(ValueError, match="takes a matrix"):
        newton_schulz(torch.zeros(2, 3, 4))


def test_the_schedule_scales_muons_learning_rate_and_logs_the_base_one():
    model = PocketLM(tiny_config())
    optimizer = muon(model, lr=1e-3, muon_lr=5e-3)
    schedule = WarmupCosine(optimizer, 1e-3, 1e-4, warmup=2, total=10)
    for step in range(10):
        lr = schedule.lr_at(step)
        assert schedule.lr == pytest.approx(lr)
        for group in optimizer.param_groups:
            assert group["lr"] == pytest.approx(lr * (5.0 if group["owner"] == "muon" else 1.0))
        schedule.step()
    default = muon(PocketLM(tiny_config()), lr=2e-3, muon_lr=None)  # default: the same learning rate
    assert {g["lr"] for g in default.param_groups} == {2e-3}


@pytest.mark.parametrize("width,base,muon_lr,expected", [
    (128, 256, 4e-3, 8e-3),  # half as wide: twice the rate
    (512, 256, 4e-3, 2e-3),
    (256, 256, 4e-3, 4e-3),
    (64, 256, None, 4 * 1e-3),  # no --muon_lr: --learning_rate's, scaled
    (64, None, 4e-3, 4e-3),  # no base width: --muon_lr at any width
])
def test_muon_s_rate_by_width_is_muon_lr_times_base_width_over_the_model_s(width, base, muon_lr, expected):
    """--muon_base_width B: a model of hidden size W trains Muon's matrices at --muon_lr x B / W; AdamW's at
    --learning_rate whatever the width."""
    model = PocketLM(tiny_config(hidden_size=width, num_attention_heads=width // 16, num_key_value_heads=width // 32))
    o = OptimConfig(optimizer="muon", learning_rate=1e-3, muon_lr=muon_lr, muon_base_width=base)
    optimizer = optimizer_for(model, o, CPU)
    rates = {g["owner"]: g["lr"] for g in optimizer.param_groups}
    assert rates == {"muon": pytest.approx(expected, rel=1e-12), "adamw": 1e-3}


def test_state_dict_round_trip_continues_identically():
    model = PocketLM(tiny_config())
    optimizer = muon(model)
    train(model, optimizer, 3)
    state = copy.deepcopy(optimizer.state_dict())
    twin = copy.deepcopy(model)
    twin_optimizer = muon(twin)
    twin_optimizer.load_state_dict(state)
    assert twin_optimizer.muon.state is twin_optimizer.state and twin_optimizer.adamw.state is twin_optimizer.state
    train(model, optimizer, 2, seed=1)
    train(twin, twin_optimizer, 2, seed=1)
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)


def test_fewer_newton_schulz_iterations_are_a_group_setting_that_resumes():
    model = PocketLM(tiny_config())
    three = build_optimizer(model, "muon", 1e-3, 0.1, (0.9, 0.95), 0.9, CPU, muon_ns_steps=3)
    assert [g["ns_steps"] for g in three.param_groups if g["owner"] == "muon"] == [3]
    matrix = next(p for g in three.param_groups if g["owner"] == "muon" for p in g["params"])
    before = matrix.detach().clone()
    matrix.grad = torch.randn(matrix.shape, generator=torch.Generator().manual_seed(0))
    three.step()  # the only gradient: one matrix's first step, whose momentum-blended update is its gradient

    def direction(update: torch.Tensor) -> torch.Tensor:
        return update / update.norm()

    moved = direction(before * (1 - 1e-3 * 0.1) - matrix.detach())
    dtype = three.muon.ns_dtype
    assert torch.allclose(moved, direction(newton_schulz(matrix.grad, dtype, 3).float()), atol=1e-2 if
                          dtype != torch.float32 else 1e-5)
    assert not torch.allclose(moved, direction(newton_schulz(matrix.grad, dtype, 5).float()), atol=1e-2)
    twin = build_optimizer(copy.deepcopy(model), "muon", 1e-3, 0.1, (0.9, 0.95), 0.9, CPU)
    twin.load_state_dict(three.state_dict())  # a resumed run keeps the iterations it started with
    assert [g["ns_steps"] for g in twin.param_groups if g["owner"] == "muon"] == [3]


def test_a_resume_refuses_another_newton_schulz_count(corpus, tmp_path, capsys):
    """The count is the run's (saved with Muon's group): a resume told another one stops instead of silently
    keeping the checkpoint's; the same count, or none, continues."""
    common = dict(max_steps=2, log_interval=1, eval_interval=100, save_interval=1, optimizer="muon")
    assert train_pretrain.main(flags(corpus, tmp_path, muon_ns_steps=4, **common)) == 0
    more = dict(common, max_steps=3, resume=True)
    assert train_pretrain.main(flags(corpus, tmp_path, muon_ns_steps=5, **more)) == 2
    assert "--muon_ns_steps 5: " in capsys.readouterr().err
    assert train_pretrain.main(flags(corpus, tmp_path, muon_ns_steps=4, **more)) == 0
    assert train_pretrain.main(flags(corpus, tmp_path, **dict(more, max_steps=4))) == 0


def test_muon_with_accumulation_matches_a_bigger_batch(corpus, tmp_path):
    common = dict(max_steps=2, log_interval=1, eval_interval=100, save_interval=100, optimizer="muon")
    assert train_pretrain.main(flags(corpus, tmp_path, "big", batch_size=8, **common)) == 0
    assert train_pretrain.main(flags(corpus, tmp_path, "acc", batch_size=4, accumulation_steps=2, **common)) == 0
    # what a lost micro-batch would give: the first half of each step's batch alone
    assert train_pretrain.main(flags(corpus, tmp_path, "half", batch_size=4, **common)) == 0
    big, acc, half = (weights(tmp_path / run) for run in ("big", "acc", "half"))
    for name in big:
        # Newton-Schulz runs in bf16, where gradients equal to ~1e-7 round apart by an ulp: accumulation agrees
        # with the big batch to a small fraction of what a lost micro-batch changes
        assert (acc[name] - big[name]).norm() <= 0.1 * (half[name] - big[name]).norm() + 1e-7, name

def test_muon_learns_a_sample_by_heart(corpus, tmp_path):
    assert train_pretrain.main(flags(corpus, tmp_path, optimizer="muon", max_steps=40, learning_rate=1e-2,
                                     log_interval=5, eval_interval=1000, save_interval=1000)) == 0
    losses = [m["loss"] for m in read_metrics(tmp_path / "run")]
    assert losses[-1] < losses[0] - 2, losses


@pytest.mark.parametrize("argv,message", [
    (["--optimizer", "adamw", "--muon_lr", "0.01"], "--optimizer muon"),
    (["--optimizer", "adamw", "--muon_base_width", "256"], "--optimizer muon"),
    (["--optimizer", "adamw", "--muon_ns_steps", "3"], "--muon_ns_steps sets Muon's Newton-Schulz iterations"),
    (["--optimizer", "muon", "--deepspeed", "launch/ds_zero2.json", "--dtype", "bfloat16"], "DDP"),
])
def test_muon_settings_that_cannot_work_are_refused(argv, message):
    if "--deepspeed" in argv:
        pytest.importorskip("deepspeed")
    with pytest.raises(ConfigError, match=message):
        parse_train_config("pretrain", argv, "").check()


RANK_DUMP = """
import sys, torch
import torch.distributed as dist
sys.path.insert(0, {root!r})
import train_pretrain
from trainer_utils import loop

real_save = loop.Trainer.save
def save_and_dump(self):
    real_save(self)
    if self.state.step == self.total_steps:  # every rank writes the weights it ends with
        torch.save(self.model.state_dict(), {out!r} + f"/rank{{dist.get_rank()}}.pt")
loop.Trainer.save = save_and_dump
sys.exit(train_pretrain.main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_ddp_ranks_end_with_identical_weights_under_muon(corpus, tmp_path):
    script = tmp_path / "dump_ranks.py"
    script.write_text(RANK_DUMP.format(root=str(ROOT), out=str(tmp_path)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    common = dict(optimizer="muon", max_steps=4, save_interval=4, eval_interval=4, log_interval=1)
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
                          str(script), *flags(corpus, tmp_path, "ddp", batch_size=4, **common)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    assert all(torch.equal(r0[k], r1[k]) for k in r0), "ranks diverged"
    # and the two ranks together train what one process does on their combined batch
    assert train_pretrain.main(flags(corpus, tmp_path, "single", batch_size=8, **common)) == 0
    one = weights(tmp_path / "single")
    for name in one:  # (bf16 Newton-Schulz: gradients reduced in another order may round an ulp apart)
        torch.testing.assert_close(r0[name], one[name], atol=1e-4, rtol=0)
    a = [m["loss"] for m in read_metrics(tmp_path / "ddp")]
    b = [m["loss"] for m in read_metrics(tmp_path / "single")]
    assert a == pytest.approx(b, abs=1e-4)


@pytest.mark.parametrize("stage,argv,expected", [
    ("pretrain", [], "muon"),
    ("pretrain", ["--deepspeed", "launch/ds_zero2.json", "--dtype", "bfloat16"], "adamw"),  # where Muon cannot run
    ("pretrain", ["--optimizer", "adamw"], "adamw"),
    ("sft", [], "adamw"),  # fine-tuning keeps AdamW
    ("sft", ["--optimizer", "auto"], "muon"),
])
def test_pretraining_defaults_to_muon_where_it_can_run(stage, argv, expected):
    if "--deepspeed" in argv:
        pytest.importorskip("deepspeed")
    assert parse_train_config(stage, argv, "").optim.optimizer == expected


def test_resuming_with_another_optimizer_names_the_one_to_use(corpus, tmp_path, capsys):
    """A run begun with AdamW (as every pretraining run was before Muon became the default) resumes only as one."""
    assert train_pretrain.main(flags(corpus, tmp_path, max_steps=4, optimizer="adamw")) == 0
    assert train_pretrain.main(flags(corpus, tmp_path, max_steps=8, optimizer="muon", resume=True)) == 2
    assert "trained with --optimizer adamw" in capsys.readouterr().err
    assert train_pretrain.main(flags(corpus, tmp_path, max_steps=8, optimizer="adamw", resume=True)) == 0


def test_a_recipe_s_muon_settings_are_moot_under_another_optimizer(tmp_path):
    """The demo recipe sets Muon's rate; --optimizer adamw on top of it trains every parameter at --learning_rate
    (the recipe's Muon settings recorded as unused), where the same flags typed are refused (above)."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("optim:\n  learning_rate: 8.0e-3\n  muon_lr: 4.0e-3\n  muon_base_width: 256\n"
                      "  muon_ns_steps: 3\n")
    for optimizer in ("adamw", "sgd"):
        o = parse_train_config("pretrain", ["--config", str(recipe), "--optimizer", optimizer], "").optim
        assert ((o.optimizer, o.learning_rate, o.muon_lr, o.muon_base_width, o.muon_ns_steps)
                == (optimizer, 8e-3, None, None, None))
    o = parse_train_config("pretrain", ["--config", str(recipe)], "").optim  # pretraining's auto: Muon
    assert (o.optimizer, o.learning_rate, o.muon_lr, o.muon_base_width, o.muon_ns_steps) == ("muon", 8e-3, 4e-3, 256, 3)
    with pytest.raises(ConfigError, match="--muon_lr sets Muon's learning rate; the optimizer is adamw"):
        parse_train_config("pretrain", ["--config", str(recipe), "--optimizer", "adamw", "--muon_lr", "0.01"], "")
