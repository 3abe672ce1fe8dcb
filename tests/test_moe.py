"""Mixture-of-experts MLP: dispatch against a naive per-token loop, router gradients and statistics, idle experts,
gradient checkpointing, KV cache, bf16 autocast, config validation and parameter counts, routing-bias balancing,
init. Every expectation is computed here independently of model/model.py's sort-based dispatch."""
from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F

import model.model as model_module
from common.errors import ConfigError
from model import KVCache, ModelConfig, PocketLM, generate, get_preset, load_model, save_model
from model.model import MoE, RouterStats, use_grouped_mm

from conftest import tiny_config

V = 256  # tiny_config's vocabulary


def moe_config(**overrides) -> ModelConfig:
    """tiny_config (d64, 2 layers) with 4 routed experts, top-2, narrow experts unless overridden."""
    return tiny_config(**{"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, **overrides})


def lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy, in fp32 at least (float64 stays float64)."""
    logits = logits[:, :-1].reshape(-1, logits.shape[-1])
    return F.cross_entropy(logits if logits.dtype == torch.float64 else logits.float(), ids[:, 1:].reshape(-1))


# ------------------------------------------------------------------ 1. dispatch vs a naive loop
def swiglu(v: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """One SwiGLU on one token vector v (d,): gate, up (f, d), down (d, f)."""
    return down @ (F.silu(gate @ v) * (up @ v))


def naive_moe(moe: MoE, x: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, list[list[int]]]:
    """The MoE layer written the slow, obvious way: for each token, the experts with the k largest biased
    probabilities (picked by a Python sort), each run alone on that token, weighted by its unbiased probability
    (renormalised over the chosen ones if asked), plus each shared expert run alone. Returns (output, choices)."""
    B, T, d = x.shape
    E, k, f = moe.num_experts, moe.top_k, moe.experts.gate_proj.shape[1]
    W = moe.gate.weight
    out = torch.zeros_like(x)
    choices = []
    for b in range(B):
        for t in range(T):
            v = x[b, t]
            probs = torch.softmax(W @ v, dim=-1)
            chosen = sorted(range(E), key=lambda e: -(probs[e] + bias[e]).item())[:k]
            choices.append(chosen)
            w = probs[chosen]
            if moe.norm_topk_prob:
                w = w / w.sum()
            y = torch.zeros(d)
            for weight, e in zip(w, chosen):
                y = y + weight * swiglu(v, moe.experts.gate_proj[e], moe.experts.up_proj[e], moe.experts.down_proj[e])
            if moe.shared_experts is not None:
                sh = moe.shared_experts
                for s in range(sh.gate_proj.weight.shape[0] // f):  # each shared expert is an f-wide slice
                    rows = slice(s * f, (s + 1) * f)
                    y = y + swiglu(v, sh.gate_proj.weight[rows], sh.up_proj.weight[rows], sh.down_proj.weight[:, rows])
            out[b, t] = y
    return out, choices


def random_moe(cfg: ModelConfig) -> MoE:
    """An MoE layer with weights scaled so that router probabilities are spread and outputs are O(1)."""
    moe = MoE(cfg)
    d, f = cfg.hidden_size, cfg.moe_intermediate_size
    with torch.no_grad():
        moe.gate.weight.normal_(0, 0.2)
        for name, p in moe.named_parameters():
            if name == "gate.weight":
                continue
            fan_in = p.shape[-1]
            p.normal_(0, 1 / math.sqrt(fan_in))
    assert moe.experts.gate_proj.shape == (cfg.num_experts, f, d)
    return moe


ROUTING = [(1, 1, False), (4, 1, False), (4, 2, True), (4, 2, False), (4, 4, True), (4, 4, False),
           (8, 1, False), (8, 2, True), (8, 2, False), (8, 8, True), (8, 8, False)]


@pytest.mark.parametrize("biased", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("shared", [0, 1, 2])
@pytest.mark.parametrize("experts, top_k, norm", ROUTING)
def test_dispatch_matches_a_naive_per_token_loop(experts, top_k, norm, shared, biased):
    cfg = moe_config(num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=norm, num_shared_experts=shared)
    moe = random_moe(cfg)
    if biased:
        moe.router_bias.copy_(torch.randn(experts) * 0.3)
    for shape in [(3, 7, 64), (1, 1, 64)]:  # 21 tokens (divisible by no E > 1), and a single token
        x = torch.randn(shape)
        with torch.no_grad():
            got, _ = moe(x)
            want, choices = naive_moe(moe, x, moe.router_bias)
        assert got.shape == x.shape and want.abs().mean() > 0.02  # far above the tolerance below
        torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)  # fp32 sums in another order
        if biased and shape[0] > 1 and 1 < experts and top_k < experts:
            # the bias really changes choices here, so the comparison checks where it enters
            _, unbiased = naive_moe(moe, x, torch.zeros(experts))
            assert choices != unbiased


def test_router_bias_changes_choices_but_not_gate_weights():
    """A bias that forces expert 3 into every top-2: its output enters with its unbiased probability."""
    cfg = moe_config(num_experts=4, num_experts_per_tok=2, norm_topk_prob=False)
    moe = random_moe(cfg)
    x = torch.randn(1, 9, 64)
    moe.router_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 10.0]))
    with torch.no_grad():
        got, stats = moe(x)
        want, choices = naive_moe(moe, x, moe.router_bias)
    assert all(3 in c for c in choices)
    assert stats[0][3] == 9  # counts
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # had the bias entered the weights, expert 3 would weigh about 10x its probability: far from `want`
    probs = torch.softmax(x[0] @ moe.gate.weight.T, -1)
    assert probs[:, 3].max() < 0.9


def test_one_expert_top_one_is_the_dense_mlp():
    """E=1, k=1 (unnormalised): the only expert has probability 1, so the layer is that expert's SwiGLU."""
    cfg = moe_config(num_experts=1, num_experts_per_tok=1, norm_topk_prob=False)
    moe = random_moe(cfg)
    dense = model_module.MLP(cfg, cfg.moe_intermediate_size)
    with torch.no_grad():
        dense.gate_proj.weight.copy_(moe.experts.gate_proj[0])
        dense.up_proj.weight.copy_(moe.experts.up_proj[0])
        dense.down_proj.weight.copy_(moe.experts.down_proj[0])
        x = torch.randn(2, 5, 64)
        torch.testing.assert_close(moe(x)[0], dense(x), atol=1e-6, rtol=1e-5)


# ------------------------------------------------------------------ 2. router gradient from the LM loss
@pytest.mark.parametrize("top_k, norm", [(1, False), (2, True), (2, False), (4, False)])
def test_language_model_loss_alone_reaches_the_router(top_k, norm):
    cfg = moe_config(num_experts=4, num_experts_per_tok=top_k, norm_topk_prob=norm, router_aux_loss_coef=0.0,
                     router_z_loss_coef=0.0)
    model = PocketLM(cfg).train()
    ids = torch.randint(0, V, (2, 16))
    lm_loss(model(ids), ids).backward()  # the plain logits: no balancing loss anywhere
    for i in range(cfg.num_hidden_layers):
        grad = model.get_parameter(f"layers.{i}.mlp.gate.weight").grad
        assert grad is not None and grad.abs().max() > 0, f"layer {i}: the router learns nothing from the LM loss"


@pytest.mark.parametrize("top_k, norm", [(1, False), (2, True), (2, False), (4, False)])
def test_router_gradient_matches_finite_differences(top_k, norm):
    """Not only non-zero but right: the autograd derivative of the LM loss along a random direction of a router's
    weights equals a central difference. The model runs in float64 but the router's softmax in fp32, hence a
    step of 1e-3 and a 1e-3 tolerance; a large init keeps the step from changing any routing choice."""
    cfg = moe_config(num_experts=4, num_experts_per_tok=top_k, norm_topk_prob=norm, initializer_range=0.2)
    model = PocketLM(cfg).double().train()
    ids = torch.randint(0, V, (2, 12))
    gate = model.layers[0].mlp.gate.weight
    direction = torch.randn_like(gate)
    logits, stats = model(ids, return_router=True)
    lm_loss(logits, ids).backward()
    analytic = (gate.grad * direction).sum()
    eps = 1e-3
    with torch.no_grad():
        gate += eps * direction
        up, up_stats = model(ids, return_router=True)
        gate -= 2 * eps * direction
        down, down_stats = model(ids, return_router=True)
        gate += eps * direction
    assert torch.equal(up_stats.counts, stats.counts) and torch.equal(down_stats.counts, stats.counts)
    numeric = (lm_loss(up, ids) - lm_loss(down, ids)) / (2 * eps)
    assert analytic.abs() > 1e-2
    torch.testing.assert_close(analytic, numeric, atol=1e-5, rtol=1e-3)


def test_normalised_top_one_is_refused():
    with pytest.raises(ConfigError, match="norm_topk_prob with num_experts_per_tok=1"):
        moe_config(num_experts=4, num_experts_per_tok=1, norm_topk_prob=True)
    with pytest.raises(ConfigError, match="norm_topk_prob"):
        ModelConfig(num_experts=1, num_experts_per_tok=1)  # norm_topk_prob defaults to True


# ------------------------------------------------------------------ 3. idle experts
def test_an_idle_expert_gets_exactly_zero_gradient_and_zero_count():
    cfg = moe_config(num_experts=4, num_experts_per_tok=2, num_shared_experts=1)
    model = PocketLM(cfg).train()
    idle = 2
    for layer in model.layers:
        layer.mlp.router_bias[idle] = -1e4  # never among the top 2
    ids = torch.randint(0, V, (2, 16))
    logits, stats = model(ids, return_router=True)
    lm_loss(logits, ids).backward()
    N, k = ids.numel(), cfg.num_experts_per_tok
    assert stats.counts[:, idle].eq(0).all()
    assert stats.counts.sum(1).tolist() == [N * k] * cfg.num_hidden_layers
    for name, p in model.named_parameters():
        if ".mlp." in name:  # routed and shared experts and the router: all take part in the graph (DDP)
            assert p.grad is not None, name
    for i, layer in enumerate(model.layers):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            grad = getattr(layer.mlp.experts, proj).grad
            assert torch.count_nonzero(grad[idle]) == 0, f"layer {i} {proj}: the idle expert got a gradient"
            busy = [e for e in range(4) if e != idle]
            assert all(grad[e].abs().max() > 0 for e in busy), f"layer {i} {proj}: a busy expert got no gradient"


def test_a_batch_routed_entirely_to_one_expert():
    """The other experts' slices are empty; output still equals the naive loop and all gradients exist."""
    cfg = moe_config(num_experts=4, num_experts_per_tok=1, norm_topk_prob=False)
    moe = random_moe(cfg)
    moe.router_bias.copy_(torch.tensor([0.0, 5.0, 0.0, 0.0]))
    x = torch.randn(2, 3, 64, requires_grad=True)
    out, stats = moe(x)
    assert stats[0].tolist() == [0, 6, 0, 0]
    with torch.no_grad():
        torch.testing.assert_close(out, naive_moe(moe, x, moe.router_bias)[0], atol=1e-5, rtol=1e-5)
    out.sum().backward()
    assert torch.count_nonzero(moe.experts.up_proj.grad[[0, 2, 3]]) == 0
    assert moe.experts.up_proj.grad[1].abs().max() > 0 and x.grad.abs().max() > 0


# ------------------------------------------------------------------ 4. RouterStats
def capture_router_inputs(model: PocketLM) -> list[torch.Tensor]:
    """Register hooks that record each MoE layer's input (the post-attention norm's output)."""
    seen: list[torch.Tensor] = []
    for layer in model.layers:
        layer.mlp.register_forward_pre_hook(lambda _m, args: seen.append(args[0].detach().clone()))
    return seen


def test_router_stats_match_an_independent_computation():
    cfg = moe_config(num_experts=4, num_experts_per_tok=2, num_shared_experts=1, initializer_range=0.1,
                     router_z_loss_coef=1e-3)
    model = PocketLM(cfg).train()
    for layer in model.layers:
        layer.mlp.router_bias.copy_(torch.tensor([0.05, -0.05, 0.1, 0.0]))
    inputs = capture_router_inputs(model)
    ids = torch.randint(0, V, (3, 11))
    _, stats = model(ids, return_router=True)
    assert isinstance(stats, RouterStats)
    L, E, k, N = cfg.num_hidden_layers, cfg.num_experts, cfg.num_experts_per_tok, ids.numel()
    assert stats.tokens == N and len(inputs) == L
    assert stats.counts.shape == stats.prob_sum.shape == (L, E)
    assert stats.z_sum.shape == stats.entropy_sum.shape == (L,)
    for i, (h, layer) in enumerate(zip(inputs, model.layers)):
        logits = h.reshape(-1, cfg.hidden_size).double() @ layer.mlp.gate.weight.detach().double().T
        probs = logits.softmax(-1)
        ranked = (probs + layer.mlp.router_bias.double()).argsort(-1, descending=True)[:, :k]
        counts = torch.bincount(ranked.flatten(), minlength=E)
        assert stats.counts[i].tolist() == counts.tolist()
        torch.testing.assert_close(stats.prob_sum[i].double(), probs.sum(0), atol=1e-5, rtol=1e-5)
        lse = torch.log(torch.exp(logits).sum(-1))
        torch.testing.assert_close(stats.z_sum[i].double(), (lse ** 2).sum(), atol=1e-5, rtol=1e-5)
        entropy = -(probs * probs.log()).sum()
        torch.testing.assert_close(stats.entropy_sum[i].double(), entropy, atol=1e-4, rtol=1e-5)
    # the bias changed some layer's choices (so the counts above really test that it is applied)
    h = inputs[0].reshape(-1, cfg.hidden_size)
    unbiased = torch.bincount((h @ model.layers[0].mlp.gate.weight.detach().T).topk(k).indices.flatten(),
                              minlength=E)
    assert unbiased.tolist() != stats.counts[0].tolist()
    # what the balancing losses are built from is differentiable back to the router; the logs are not
    assert stats.prob_sum.grad_fn is not None and stats.z_sum.grad_fn is not None
    # without a z-loss its graph is not built (it would keep every layer's router logits alive for nothing)
    cfg.router_z_loss_coef = 0.0
    assert PocketLM(cfg)(ids, return_router=True)[1].z_sum.grad_fn is None
    assert not stats.counts.requires_grad and not stats.entropy_sum.requires_grad
    for term in (stats.prob_sum[1, 0], stats.z_sum[1]):
        model.zero_grad()
        term.backward(retain_graph=True)
        assert model.layers[1].mlp.gate.weight.grad.abs().max() > 0


def test_return_router_shapes_for_dense_and_moe():
    ids = torch.randint(0, V, (2, 8))
    dense, moe = PocketLM(tiny_config()).eval(), PocketLM(moe_config()).eval()
    for model in (dense, moe):
        assert isinstance(model(ids), torch.Tensor)
        assert isinstance(model(ids, return_router=False), torch.Tensor)
    logits, stats = dense(ids, return_router=True)
    assert stats is None
    torch.testing.assert_close(logits, dense(ids), atol=0, rtol=0)
    logits, stats = moe(ids, return_router=True)
    torch.testing.assert_close(logits, moe(ids), atol=0, rtol=0)
    assert isinstance(stats, RouterStats) and stats.counts.shape == (2, 4)
    # last_only trims the logits, not the routed tokens
    last, stats = moe(ids, last_only=True, return_router=True)
    assert last.shape == (2, 1, V) and stats.tokens == 16 and stats.counts.sum(1).tolist() == [32, 32]


# ------------------------------------------------------------------ 5. gradient checkpointing
def test_gradient_checkpointing_gives_same_logits_stats_and_gradients(monkeypatch):
    cfg = moe_config(num_experts=4, num_experts_per_tok=2, num_shared_experts=1)
    model = PocketLM(cfg).train()
    ids = torch.randint(0, V, (2, 24))
    calls = []
    real = model_module.checkpoint
    monkeypatch.setattr(model_module, "checkpoint", lambda *a, **kw: calls.append(1) or real(*a, **kw))

    def run(enabled: bool):
        model.zero_grad()
        model.set_gradient_checkpointing(enabled)
        logits, stats = model(ids, return_router=True)
        # LM loss + a Switch-style balancing loss + z-loss: gradients must flow through the stats too
        f = stats.counts / (stats.tokens * cfg.num_experts_per_tok)
        aux = cfg.num_experts * (f * stats.prob_sum / stats.tokens).sum()
        (lm_loss(logits, ids) + 0.1 * aux + 0.01 * stats.z_sum.sum() / stats.tokens).backward()
        return logits.detach(), stats, {n: p.grad.clone() for n, p in model.named_parameters()}

    plain = run(False)
    assert calls == []
    ckpt = run(True)
    assert len(calls) == cfg.num_hidden_layers
    torch.testing.assert_close(ckpt[0], plain[0], atol=1e-6, rtol=1e-5)
    assert torch.equal(ckpt[1].counts, plain[1].counts) and ckpt[1].tokens == plain[1].tokens
    for field in ("prob_sum", "z_sum", "entropy_sum"):
        torch.testing.assert_close(getattr(ckpt[1], field), getattr(plain[1], field), atol=1e-6, rtol=1e-5)
    assert ckpt[1].prob_sum.grad_fn is not None
    for name, grad in plain[2].items():
        torch.testing.assert_close(ckpt[2][name], grad, atol=1e-6, rtol=1e-5, msg=name)


# ------------------------------------------------------------------ 6. KV cache and generation
def test_kv_cache_decode_matches_full_recompute():
    model = PocketLM(moe_config(num_shared_experts=1)).eval()
    ids = torch.randint(0, V, (2, 40))
    full = model(ids)
    cache = KVCache(model.config, 2, 40)
    steps = [model(ids[:, :12], kv_cache=cache)]
    steps += [model(ids[:, t:t + 1], kv_cache=cache) for t in range(12, 40)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=0)


def test_left_padded_prefill_matches_unpadded():
    model = PocketLM(moe_config()).eval()
    prompt = torch.randint(1, V, (1, 9))
    padded = torch.cat([torch.zeros(1, 6, dtype=torch.long), prompt], dim=1)
    mask = torch.cat([torch.zeros(1, 6, dtype=torch.long), torch.ones(1, 9, dtype=torch.long)], dim=1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(padded, position_ids=positions, attention_mask=mask)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[:, 6:], model(prompt), atol=1e-5, rtol=0)


def naive_greedy(model: PocketLM, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding with a full forward of the unpadded sequence per new token."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("use_cache", [True, False])
def test_batched_greedy_generation_matches_a_naive_decode_loop(use_cache):
    # a large init makes the continuations depend on the prompt, and the routing on the token
    model = PocketLM(moe_config(num_shared_experts=1, initializer_range=0.3)).eval()
    prompts = [torch.randint(1, V, (n,)).tolist() for n in (4, 13, 9)]
    want = [naive_greedy(model, p, 12) for p in prompts]
    assert len({tuple(w) for w in want}) == 3
    got = generate(model, prompts, max_new_tokens=12, temperature=0, pad_token_id=0, use_cache=use_cache)
    assert got == want


# ------------------------------------------------------------------ 7. bf16 autocast on CPU
def test_bf16_autocast_forward_backward_close_to_fp32(monkeypatch):
    def no_grouped_mm(*a, **kw):
        raise AssertionError("grouped_mm called on CPU")
    monkeypatch.setattr(F, "grouped_mm", no_grouped_mm, raising=False)
    cfg = moe_config(num_experts=4, num_experts_per_tok=2, num_shared_experts=1, initializer_range=0.1)
    model = PocketLM(cfg).train()
    ids = torch.randint(0, V, (2, 16))

    def run(autocast: bool):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits, stats = model(ids, return_router=True)
        loss = lm_loss(logits, ids) + 0.01 * stats.z_sum.sum() / stats.tokens
        loss.backward()
        return logits.float().detach(), loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    ref, got = run(False), run(True)
    assert got[0].dtype == torch.float32 and torch.isfinite(got[0]).all() and torch.isfinite(got[1])
    rel = ((got[0] - ref[0]).norm() / ref[0].norm()).item()
    assert rel < 0.05, f"bf16 logits differ from fp32 by {rel:.1%}"
    assert abs(got[1] - ref[1]) < 0.02 * ref[1]
    for name in ("layers.0.mlp.gate.weight", "layers.1.mlp.experts.down_proj",
                 "layers.1.mlp.shared_experts.up_proj.weight"):
        g, r = got[2][name], ref[2][name]
        assert torch.isfinite(g).all()
        assert F.cosine_similarity(g.flatten(), r.flatten(), dim=0) > 0.9, name


def test_grouped_mm_is_never_chosen_for_cpu_tensors():
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(8, 64, dtype=dtype)
        assert not use_grouped_mm(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert not use_grouped_mm(x)


# ------------------------------------------------------------------ 8. config, counts, checkpoints
@pytest.mark.parametrize("kwargs, message", [
    (dict(num_experts=4, mlp="gelu"), "mlp='gelu' is not supported with num_experts > 0"),
    (dict(num_experts=4, num_experts_per_tok=5), "num_experts_per_tok must be between 1 and num_experts (4), got 5"),
    (dict(num_experts=4, num_experts_per_tok=0), "num_experts_per_tok must be between 1"),
    (dict(num_experts=1), "num_experts_per_tok must be between 1 and num_experts (1), got 2"),
    (dict(num_experts=4, moe_intermediate_size=0), "moe_intermediate_size must be a positive integer, got 0"),
    (dict(num_experts=-1), "num_experts must be a non-negative integer"),
    (dict(num_experts=4, num_shared_experts=-1), "num_shared_experts must be a non-negative integer"),
    (dict(num_experts=4, router_aux_loss_coef=-0.01), "router_aux_loss_coef must be a non-negative number"),
    (dict(num_experts=4, router_z_loss_coef=-1e-3), "router_z_loss_coef must be a non-negative number"),
    (dict(num_experts=4, router_bias_update_rate=-1e-3), "router_bias_update_rate must be a non-negative number"),
    (dict(num_experts=4, router_aux_loss_coef=float("nan")), "router_aux_loss_coef must be a non-negative number"),
    (dict(router_z_loss_coef=-1.0), "router_z_loss_coef must be a non-negative number"),  # checked for dense too
])
def test_inconsistent_moe_configs_are_rejected(kwargs, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        ModelConfig(**kwargs)


def test_dense_configs_keep_no_expert_width_and_moe_configs_round_trip(tmp_path):
    dense = tiny_config()
    assert not dense.moe and dense.moe_intermediate_size is None
    assert tiny_config(mlp="gelu", num_experts_per_tok=9).moe_intermediate_size is None  # MoE fields idle
    cfg = moe_config(num_experts=8, num_shared_experts=2, norm_topk_prob=False, router_z_loss_coef=1e-3,
                     router_bias_update_rate=1e-3, moe_intermediate_size=None)
    assert cfg.moe and cfg.moe_intermediate_size == cfg.intermediate_size  # defaults to the dense width
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    cfg.save(tmp_path / "config.json")
    back = ModelConfig.load(tmp_path / "config.json")
    assert back == cfg and back.num_experts == 8 and back.norm_topk_prob is False and back.style == "moe"


def count_by_hand(model: PocketLM, active: bool) -> int:
    """Parameters of the instantiated module; active: routed experts counted k/E of the way (the k a token uses)."""
    cfg = model.config
    total = 0
    for name, p in model.named_parameters():
        if ".mlp.experts." in name and active:
            assert p.shape[0] == cfg.num_experts
            total += p[:cfg.num_experts_per_tok].numel()
        else:
            total += p.numel()
    return total


@pytest.mark.parametrize("overrides", [
    dict(), dict(num_shared_experts=2), dict(num_experts=8, num_experts_per_tok=8, norm_topk_prob=False),
    dict(num_experts=1, num_experts_per_tok=1, norm_topk_prob=False), dict(tie_word_embeddings=False),
    dict(num_shared_experts=1, bias=True), dict(norm="layernorm", bias=True, num_shared_experts=1),
])
def test_parameter_counts_match_the_module(overrides):
    cfg = moe_config(**overrides)
    model = PocketLM(cfg)
    assert cfg.num_parameters() == count_by_hand(model, active=False) == model.num_parameters()
    assert cfg.num_parameters(active=True) == count_by_hand(model, active=True)
    # non-embedding: the embedding table is the only tensor left out (tied head)
    if cfg.tie_word_embeddings:
        assert cfg.num_parameters(non_embedding=True) == model.num_parameters() - model.embed_tokens.weight.numel()


def test_active_parameters_by_hand_for_a_moe_layer():
    """Spelled out: attention + 2 norms + router + k routed experts + shared, per layer; then embeddings + norm."""
    cfg = moe_config(num_experts=8, num_experts_per_tok=2, num_shared_experts=1, moe_intermediate_size=48)
    d, kv, L, f = 64, 2 * 16, 2, 48
    attention = 2 * d * d + 2 * d * kv
    expert = 3 * d * f
    per_layer = attention + 2 * d + d * 8 + 2 * expert + 1 * expert
    assert cfg.num_parameters(active=True) == L * per_layer + d + V * d
    assert cfg.num_parameters() == L * (per_layer + 6 * expert) + d + V * d


def test_the_equal_compute_moe_preset_is_active_equal_to_the_dense_one():
    dense, moe = get_preset("minimind-26m"), get_preset("minimind-26m-moe")
    router = moe.num_hidden_layers * moe.hidden_size * moe.num_experts
    assert moe.num_parameters(active=True) == dense.num_parameters() + router
    with torch.device("meta"):
        for cfg in (moe, get_preset("minimind-moe")):
            assert count_by_hand(PocketLM(cfg), active=True) == cfg.num_parameters(active=True)


def test_router_bias_is_saved_and_loaded(tmp_path):
    model = PocketLM(moe_config()).eval()
    names = [n for n in model.state_dict() if n.endswith("router_bias")]
    assert names == ["layers.0.mlp.router_bias", "layers.1.mlp.router_bias"]
    assert not any(n.endswith("router_bias") for n, _ in model.named_parameters())  # a buffer, not trained by SGD
    for layer in model.layers:
        layer.mlp.router_bias.copy_(torch.tensor([0.3, -0.2, 0.0, 0.1]))
    ids = torch.randint(0, V, (2, 10))
    save_model(model, tmp_path / "m")
    loaded, _ = load_model(tmp_path / "m")
    for layer in loaded.layers:
        assert layer.mlp.router_bias.tolist() == pytest.approx([0.3, -0.2, 0.0, 0.1])
    torch.testing.assert_close(loaded(ids), model(ids), atol=0, rtol=0)
    assert loaded.config == model.config


# ------------------------------------------------------------------ 9. loss-free balancing bias
def test_update_router_bias_moves_each_expert_by_the_rate():
    """Overloaded experts go down by the rate, underloaded ones up, those at the mean stay; then each layer's
    biases are centred (only their differences change a choice; the centring keeps them from drifting)."""
    model = PocketLM(moe_config(num_experts=4)).eval()
    start = torch.tensor([[0.5, -0.25, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    for layer, b in zip(model.layers, start):
        layer.mlp.router_bias.copy_(b)
    counts = torch.tensor([[9.0, 1.0, 5.0, 5.0],    # mean 5: expert 0 overloaded, 1 under, 2 and 3 at the mean
                           [2.0, 2.0, 2.0, 10.0]])  # mean 4: three under, one over (the moves do not sum to 0)
    model.update_router_bias(counts, rate=0.125)
    moved = start + 0.125 * torch.tensor([[-1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, -1.0]])
    got = torch.stack([layer.mlp.router_bias for layer in model.layers])
    torch.testing.assert_close(got, moved - moved.mean(1, keepdim=True), atol=1e-7, rtol=0)
    # relative to an expert at the mean (layer 0, expert 2) the overloaded one fell and the underloaded one rose
    # by exactly the rate
    assert got[0, 0] - got[0, 2] == start[0, 0] - start[0, 2] - 0.125
    assert got[0, 1] - got[0, 2] == start[0, 1] - start[0, 2] + 0.125


def test_router_bias_updates_balance_a_skewed_router():
    """A router whose logits favour expert 0 for every token; repeated updates from the layer's own counts
    bring the load near uniform without touching the router weights (deterministic: fixed inputs)."""
    cfg = moe_config(num_experts=4, num_experts_per_tok=2, num_hidden_layers=1, moe_intermediate_size=8)
    model = PocketLM(cfg).eval()
    moe = model.layers[0].mlp
    g = torch.Generator().manual_seed(0)
    u = torch.randn(64, generator=g)
    u = u / u.norm()
    x = torch.randn(1, 128, 64, generator=g) * 0.5 + u  # every token shares the direction u
    with torch.no_grad():
        moe.gate.weight.normal_(0, 0.05, generator=g)
        moe.gate.weight[0] += 3 * u
    weight = moe.gate.weight.detach().clone()

    def load() -> torch.Tensor:
        with torch.no_grad():
            return moe(x)[1][0]

    ideal = 128 * 2 / 4
    start = load()
    assert start[0] >= 1.9 * ideal and start[1:].max() < 0.8 * ideal  # expert 0 is in nearly every token's top 2
    history = []
    for _ in range(250):
        history.append(load())
        model.update_router_bias(history[-1][None], rate=0.005)
    # Sign updates on fixed inputs end in a small limit cycle, not a fixed point: judge the last 20 steps. Expert
    # 0 holds its share at every step; on average every expert is within 15% of its share.
    last = torch.stack(history[-20:])
    assert ((last[:, 0] - ideal).abs() <= 0.1 * ideal).all(), last[:, 0].tolist()
    assert ((last.mean(0) - ideal).abs() <= 0.15 * ideal).all(), last.mean(0).tolist()
    assert (last.sum(1) == 256).all()
    assert moe.router_bias[0] < 0 < moe.router_bias[1:].min() and torch.equal(moe.gate.weight, weight)


# ------------------------------------------------------------------ 10. init
def test_experts_are_initialised_like_the_dense_mlp():
    std = 0.05
    cfg = moe_config(num_experts=8, moe_intermediate_size=512, num_shared_experts=1, initializer_range=std)
    model = PocketLM(cfg)
    residual = std / math.sqrt(2 * cfg.num_hidden_layers)
    for layer in model.layers:
        moe = layer.mlp
        assert torch.count_nonzero(moe.router_bias) == 0
        for proj, want in (("gate_proj", std), ("up_proj", std), ("down_proj", residual)):
            w = getattr(moe.experts, proj).detach()
            for e in range(cfg.num_experts):  # each expert, not only the stack as a whole (torch.empty before)
                assert abs(w[e].std().item() - want) < 0.03 * want, (proj, e)
                assert abs(w[e].mean().item()) < 0.03 * want, (proj, e)
        assert abs(moe.gate.weight.std().item() - std) < 0.1 * std
        assert abs(moe.shared_experts.down_proj.weight.std().item() - residual) < 0.05 * residual
        assert abs(moe.shared_experts.up_proj.weight.std().item() - std) < 0.05 * std
    # the dense MLP of the same config, for comparison: the same two scales
    dense = PocketLM(tiny_config(intermediate_size=512, initializer_range=std)).layers[0].mlp
    assert abs(dense.down_proj.weight.std().item() - residual) < 0.03 * residual
    assert abs(dense.up_proj.weight.std().item() - std) < 0.03 * std
