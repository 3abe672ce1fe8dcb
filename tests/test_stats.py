"""Per-layer attention entropy and activation statistics (model/stats.py) against independent computations."""
from __future__ import annotations

import math

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_train import flags

import train_full_sft
import train_pretrain
from model import PocketLM, load_model
from model.stats import attention_probs, layer_stats
from trainer_utils.data import eval_batches
from trainer_utils.session import Session
from trainer_utils.stages import parse_train_config

from conftest import strict_records, tiny_config

T = 16


def left_padded(x: torch.Tensor, pad: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row b of x with its first pad[b] tokens made padding: (ids, attention_mask, position_ids), as generate()
    builds them (position = number of real tokens before)."""
    mask = torch.ones_like(x)
    for b, p in enumerate(pad):
        mask[b, :p] = 0
    x = x.masked_fill(mask == 0, 0)
    return x, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def capture(model: PocketLM, kind: str, *args, **kwargs) -> list[tuple[tuple, torch.Tensor]]:
    """(inputs, output) of every module of `kind` ("self_attn", "mlp" or "block") during one eval forward."""
    modules = [getattr(b, kind) if kind != "block" else b for b in model.layers]
    seen: list[tuple[tuple, torch.Tensor]] = []
    handles = [m.register_forward_hook(lambda m, a, out: seen.append((a, out))) for m in modules]
    with torch.no_grad():
        model.eval()(*args, **kwargs)
    for h in handles:
        h.remove()
    return seen


def naive_probs(attn, x: torch.Tensor, positions: torch.Tensor | None, allowed: torch.Tensor,
                theta: float) -> torch.Tensor:
    """Attention weights from the weights by hand: explicit per-pair RoPE rotation, query head h reading KV head
    h // (H / KV), softmax over the allowed keys only."""
    B, S, _ = x.shape
    H, KV, D = attn.n_heads, attn.n_kv_heads, attn.head_dim
    q = torch.nn.functional.linear(x, attn.q_proj.weight, attn.q_proj.bias).view(B, S, H, D)
    k = torch.nn.functional.linear(x, attn.k_proj.weight, attn.k_proj.bias).view(B, S, KV, D)
    if positions is not None:  # rotate each pair (j, j + D/2) of position p by p * theta^(-2j/D)
        freq = theta ** (-torch.arange(D // 2, dtype=torch.float64) * 2 / D)
        angle = positions.double()[..., None, None] * freq  # (B, S, 1, D/2)
        cos, sin = angle.cos().float(), angle.sin().float()

        def rotate(t):
            a, b = t[..., : D // 2], t[..., D // 2:]
            return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
        q, k = rotate(q), rotate(k)
    probs = torch.zeros(B, H, S, S)
    for b in range(B):
        for h in range(H):
            scores = q[b, :, h] @ k[b, :, h // (H // KV)].T / math.sqrt(D)
            scores = scores.masked_fill(~allowed[b], float("-inf"))
            probs[b, h] = scores.softmax(-1)
    return probs


CASES = [("llama", None), ("llama", [0, 5]), ("gpt2", None), ("gpt2", [3, 0])]


@pytest.mark.parametrize("style,pad", CASES)
def test_probs_match_a_naive_computation(style, pad):
    cfg = tiny_config(style)
    model = PocketLM(cfg)
    x = torch.randint(1, 256, (2, T))
    kwargs = {}
    allowed = torch.ones(T, T, dtype=torch.bool).tril().expand(2, T, T)
    positions = torch.arange(T).expand(2, T)
    if pad is not None:
        x, mask, positions = left_padded(x, pad)
        kwargs = dict(attention_mask=mask, position_ids=positions)
        allowed = allowed & mask[:, None, :].bool()
    for (args, _), attn in zip(capture(model, "self_attn", x, **kwargs), [b.self_attn for b in model.layers]):
        probs, _ = attention_probs(attn, *args[:3])
        expected = naive_probs(attn, args[0], positions if style == "llama" else None, allowed, cfg.rope_theta)
        real = torch.ones(2, T, dtype=torch.bool) if pad is None else kwargs["attention_mask"].bool()
        # padding queries are excluded from every statistic: compare the real ones
        torch.testing.assert_close(probs.transpose(1, 2)[real], expected.transpose(1, 2)[real], atol=1e-5, rtol=0)


@pytest.mark.parametrize("style,pad", CASES)
def test_probs_reproduce_the_real_attention_output(style, pad):
    model = PocketLM(tiny_config(style))
    x = torch.randint(1, 256, (2, T))
    kwargs = {}
    if pad is not None:
        x, mask, positions = left_padded(x, pad)
        kwargs = dict(attention_mask=mask, position_ids=positions)
    for i, (args, output) in enumerate(capture(model, "self_attn", x, **kwargs)):
        attn = model.layers[i].self_attn
        probs, _ = attention_probs(attn, *args[:3])
        _, _, v = attn.qkv(args[0], args[1])
        v = v.repeat_interleave(attn.n_heads // attn.n_kv_heads, dim=1)
        y = attn.o_proj((probs @ v).transpose(1, 2).reshape(2, T, -1))
        torch.testing.assert_close(y, output, atol=1e-5, rtol=0)


@pytest.mark.parametrize("style", ["llama", "gpt2"])
def test_uniform_attention_has_entropy_log_of_attendable_keys(style):
    model = PocketLM(tiny_config(style))
    for block in model.layers:  # zero queries: every score is 0, so each query spreads evenly over its keys
        torch.nn.init.zeros_(block.self_attn.q_proj.weight)
        if block.self_attn.q_proj.bias is not None:
            torch.nn.init.zeros_(block.self_attn.q_proj.bias)
    x, mask, positions = left_padded(torch.randint(1, 256, (2, T)), [0, 6])
    stats = layer_stats(model, x, attention_mask=mask, position_ids=positions)
    # the real query with j real tokens before it sees j + 1 keys
    entropies = [math.log(j + 1) for n in (T, T - 6) for j in range(n)]
    expected = sum(entropies) / len(entropies)
    for layer in range(2):
        assert stats.attn_entropy[layer] == pytest.approx(expected, abs=1e-5)
        assert stats.head_entropy[layer] == pytest.approx([expected] * 4, abs=1e-5)
        assert stats.attn_entropy_norm[layer] == pytest.approx(1.0, abs=1e-5)
        # one value per head and real query that has a choice (>= 2 keys)
        queries = stats.query_entropy_norm[layer]
        assert queries.shape == (4 * (T - 1 + T - 6 - 1),)
        torch.testing.assert_close(queries, torch.ones_like(queries), atol=1e-5, rtol=0)


def test_peaked_attention_has_low_entropy():
    model = PocketLM(tiny_config())
    attn = model.layers[0].self_attn
    with torch.no_grad():
        attn.q_proj.weight.mul_(1000)  # huge scores: near one-hot attention
    stats = layer_stats(model, torch.randint(0, 256, (2, T)))
    assert stats.attn_entropy_norm[0] < 0.2 < 0.9 < stats.attn_entropy_norm[1]
    assert stats.attn_entropy[0] < stats.attn_entropy[1]


@pytest.mark.parametrize("pad", [None, [0, 5]])
def test_activation_statistics_match_the_hooked_outputs(pad):
    model = PocketLM(tiny_config())
    x = torch.randint(1, 256, (2, T))
    kwargs, real = {}, torch.ones(2, T, dtype=torch.bool)
    if pad is not None:
        x, mask, positions = left_padded(x, pad)
        kwargs, real = dict(attention_mask=mask, position_ids=positions), mask.bool()
    stats = layer_stats(model, x, **kwargs)

    def rms(out):
        return out[real].pow(2).mean().sqrt().item()
    for i, (_, (out, _router)) in enumerate(capture(model, "block", x, **kwargs)):
        assert stats.act_rms[i] == pytest.approx(rms(out), rel=1e-5)
        assert stats.act_max[i] == pytest.approx(out[real].abs().max().item(), rel=1e-6)
        torch.testing.assert_close(stats.token_rms[i], out[real].pow(2).mean(-1).sqrt())
    for i, (_, out) in enumerate(capture(model, "self_attn", x, **kwargs)):
        assert stats.attn_out_rms[i] == pytest.approx(rms(out), rel=1e-5)
    for i, (_, out) in enumerate(capture(model, "mlp", x, **kwargs)):
        assert stats.mlp_out_rms[i] == pytest.approx(rms(out), rel=1e-5)


def test_padding_is_left_out():
    """A left-padded row gives the statistics of the same row unpadded: padding queries (which attend only to
    themselves, entropy 0) and padding tokens would otherwise pull every mean."""
    model = PocketLM(tiny_config())
    row = torch.randint(1, 256, (1, T - 6))
    x, mask, positions = left_padded(torch.cat([torch.zeros(1, 6, dtype=torch.long), row], dim=1), [6])
    padded = layer_stats(model, x, attention_mask=mask, position_ids=positions).flat()
    plain = layer_stats(model, row).flat()
    assert all(math.isfinite(v) for v in padded.values())
    assert padded == pytest.approx(plain, rel=1e-4, abs=1e-6)


def test_layer_stats_leaves_the_model_as_it_was():
    model = PocketLM(tiny_config(dropout=0.5))
    x = torch.randint(0, 256, (2, T))
    with torch.no_grad():
        before = model.eval()(x)
    model.train()
    model.layers[1].mlp.eval()  # a mixed state must come back as it was, not as all-train
    modes = {name: m.training for name, m in model.named_modules()}
    first = layer_stats(model, x)
    assert {name: m.training for name, m in model.named_modules()} == modes
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert torch.is_grad_enabled()
    # dropout is off during the pass: repeated calls agree, and agree with an eval-mode model
    assert layer_stats(model, x).flat() == first.flat() == layer_stats(model.eval(), x).flat()
    with torch.no_grad():
        torch.testing.assert_close(model(x), before, atol=0, rtol=0)

    model.train()
    with pytest.raises(ValueError, match="max_position_embeddings"):  # a failing forward cleans up too
        layer_stats(model, x, position_ids=torch.full((2, T), 10_000))
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert model.training and all(m.training for m in model.layers[0].modules())


def test_flat_and_histograms():
    model = PocketLM(tiny_config())
    stats = layer_stats(model, torch.randint(0, 256, (3, T)))
    flat = stats.flat()
    kinds = ["attn_entropy", "attn_entropy_norm", "attn_entropy_min_head", "act_rms", "act_max", "attn_out_rms",
             "mlp_out_rms"]
    assert set(flat) == {f"{k}/layer{i}" for k in kinds for i in range(2)}
    assert all(type(v) is float and math.isfinite(v) for v in flat.values())
    assert flat["attn_entropy_min_head/layer1"] == min(stats.head_entropy[1])
    hists = stats.histograms()
    sizes = {"attn_entropy_heads": 4, "attn_entropy_queries": 3 * 4 * (T - 1), "act_rms_tokens": 3 * T}
    assert {k: tuple(v.shape) for k, v in hists.items()} == {f"{k}/layer{i}": (n,) for k, n in sizes.items()
                                                             for i in range(2)}
    assert all(v.device.type == "cpu" and v.dtype == torch.float32 for v in hists.values())


def test_under_bf16_autocast():
    model = PocketLM(tiny_config())
    x = torch.randint(0, 256, (2, T))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = layer_stats(model, x).flat()
    full = layer_stats(model, x).flat()
    assert low == pytest.approx(full, rel=0.05)


def test_all_padding_is_refused():
    model = PocketLM(tiny_config())
    with pytest.raises(ValueError, match="real"):
        layer_stats(model, torch.zeros(1, 4, dtype=torch.long), attention_mask=torch.zeros(1, 4, dtype=torch.long))


# ----------------------------------------------------------------------------------------------- in training
def stats_in_training(stage: str, argv: list[str], run_dir) -> tuple[list[dict], torch.Tensor, torch.Tensor | None]:
    """Train; return the logged stats rows, the fixed batch (first two validation sequences) and its padding
    mask as the trainer builds it (SFT: the trailing pad ids of each row; pretraining: none)."""
    assert (train_full_sft if stage == "sft" else train_pretrain).main(argv) == 0
    rows = [r for r in strict_records(run_dir) if "attn_entropy/layer0" in r]
    session = Session(parse_train_config(stage, [a for a in argv if a != "--overwrite"] + ["--resume"], ""), stage)
    x, _ = next(eval_batches(session.val_sets[0].data, 2, 1, 0, 1))
    real = None
    if stage == "sft":
        pad = session.tokenizer.pad_id
        real = torch.stack([torch.arange(x.shape[1]) < int((row != pad).nonzero().max()) + 1 for row in x]).long()
    return rows, x, real


def test_training_logs_the_stats_of_a_fixed_validation_batch_at_each_evaluation(corpus, tmp_path):
    argv = flags(corpus, tmp_path, max_steps=8, eval_interval=4, use_tensorboard=True)
    rows, x, _ = stats_in_training("pretrain", argv, tmp_path / "run")
    assert [r["step"] for r in rows] == [4, 8]
    for r in rows:
        for i in (0, 1):
            assert 0 < r[f"attn_entropy_norm/layer{i}"] <= 1 and r[f"act_rms/layer{i}"] > 0
    # the numbers are layer_stats of the final weights on the fixed batch
    expected = layer_stats(load_model(tmp_path / "run")[0], x).flat()
    assert rows[-1] == {**rows[-1], **{k: pytest.approx(v, abs=1e-4) for k, v in expected.items()}}
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"), size_guidance={"histograms": 0})
    histograms = events.Reload().Tags()["histograms"]
    assert {"attn_entropy_heads/layer1", "attn_entropy_queries/layer0", "act_rms_tokens/layer1"} <= set(histograms)


def test_sft_stats_leave_the_padding_out(corpus, tmp_path):
    argv = flags(corpus, tmp_path, data_path=corpus["sft"], max_steps=2, eval_interval=2, val_fraction=0.3)
    [row], x, real = stats_in_training("sft", argv, tmp_path / "run")
    assert (real == 0).any(), "the fixed batch should hold a padded row"
    model = load_model(tmp_path / "run")[0]
    expected, with_padding = layer_stats(model, x, attention_mask=real).flat(), layer_stats(model, x).flat()
    assert row == {**row, **{k: pytest.approx(v, abs=1e-4) for k, v in expected.items()}}
    moved = [k for k in expected if with_padding[k] != pytest.approx(expected[k], rel=1e-3)]
    assert len(moved) > len(expected) / 2, "counting the padding would have changed most of the statistics"
    rows, _, _ = stats_in_training("sft", argv + ["--overwrite", "--no-layer_stats"], tmp_path / "run")
    assert rows == []
