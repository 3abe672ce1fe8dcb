"""Per-layer attention entropy and activation scale of one batch, for spotting attention collapse and blow-up.

`layer_stats` runs one extra no-grad forward with hooks that exist only for that call, so the training forward
(SDPA, KV cache, checkpointing) is untouched. SDPA never materialises attention weights; the hooks recompute
them as softmax(q k^T / sqrt(D) + mask) from the q and k of `Attention.qkv` (the very method the real forward
uses) and the mask the model built, so they cannot drift from the attention the model computes.

Definitions (padding tokens, attention_mask == 0, are left out of every statistic):
    attn_entropy        entropy, in nats, of one query's attention distribution over the keys it may attend to,
                        averaged over heads and queries. A query at position i of a causal sequence sees i + 1
                        keys, so its entropy lies in [0, log(i + 1)].
    attn_entropy_norm   the same entropy divided by log(number of attendable keys): 0 = all weight on one key,
                        1 = uniform. Comparable across positions and sequence lengths; queries that see a single
                        key (position 0) have no choice to make and are left out.
    attn_entropy_min_head  the smallest per-head mean attn_entropy of the layer: one collapsed head shows here
                        while the layer mean still looks healthy.
    act_rms, act_max    RMS over tokens and channels, and max |x|, of the residual stream after the block (the
                        max spots fp16 overflow before it happens).
    attn_out_rms, mlp_out_rms  RMS of what the attention and the MLP branch add to the residual stream.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from .model import Attention, Block, PocketLM


@dataclass
class LayerStats:
    """Statistics of one batch, one list entry per layer (definitions in the module docstring)."""

    attn_entropy: list[float]
    attn_entropy_norm: list[float]
    head_entropy: list[list[float]]  # [layer][head]: mean entropy of each head, in nats
    act_rms: list[float]
    act_max: list[float]
    attn_out_rms: list[float]
    mlp_out_rms: list[float]
    # Distributions for histograms (CPU fp32): attn_entropy_norm of every (head, query) with >= 2 keys, and the
    # RMS of every real token's residual vector after the block.
    query_entropy_norm: list[torch.Tensor] = field(repr=False)
    token_rms: list[torch.Tensor] = field(repr=False)

    def flat(self) -> dict[str, float]:
        """Scalars for a metrics.jsonl row: {"attn_entropy/layer0": 2.31, "act_rms/layer0": 0.98, ...}."""
        per_layer = {"attn_entropy": self.attn_entropy, "attn_entropy_norm": self.attn_entropy_norm,
                     "attn_entropy_min_head": [min(h) for h in self.head_entropy], "act_rms": self.act_rms,
                     "act_max": self.act_max, "attn_out_rms": self.attn_out_rms, "mlp_out_rms": self.mlp_out_rms}
        return {f"{name}/layer{i}": v for name, values in per_layer.items() for i, v in enumerate(values)}

    def histograms(self) -> dict[str, torch.Tensor]:
        """1-D value tensors for TensorBoard / wandb histograms, one of each kind per layer."""
        out: dict[str, torch.Tensor] = {}
        for i, (heads, queries, tokens) in enumerate(zip(self.head_entropy, self.query_entropy_norm, self.token_rms)):
            out[f"attn_entropy_heads/layer{i}"] = torch.tensor(heads)
            out[f"attn_entropy_queries/layer{i}"] = queries
            out[f"act_rms_tokens/layer{i}"] = tokens
        return out


def attention_probs(attn: Attention, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                    mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 attention weights (B, H, T, S) that `attn` applies to its input x, and the boolean mask
    (B or 1, 1, T, S) of attendable keys they were computed under.

    Arguments are those the attention module receives (no KV cache: S == T). mask=None is plain causal, as in
    the model. A query with no attendable key gets all-zero weights rather than SDPA's NaN.
    """
    q, k, _ = attn.qkv(x, rope)
    k = k.repeat_interleave(attn.n_heads // attn.n_kv_heads, dim=1)  # GQA, as in Attention.forward
    T, S = q.shape[2], k.shape[2]
    if mask is None:
        mask = torch.ones(T, S, dtype=torch.bool, device=x.device).tril()[None, None]
    # Entropy needs fp32 scores even when the model runs under bf16/fp16 autocast.
    with torch.autocast(x.device.type, enabled=False):
        scores = (q.float() * attn.head_dim ** -0.5) @ k.float().transpose(-2, -1)  # scale q, not the T x S scores
        probs = scores.masked_fill_(~mask, float("-inf")).softmax(-1)
    return probs.masked_fill(~mask.any(-1, keepdim=True), 0.0), mask


def _masked_mean(values: torch.Tensor, weight: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """Mean of `values` over `dims`, counting only entries where the boolean `weight` is set (NaN if none)."""
    weight = weight.expand_as(values)
    return torch.where(weight, values, 0.0).sum(dims) / weight.sum(dims)


def _rms(x: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """RMS over the real tokens (boolean (B, T)) and all channels of x (B, T, C), computed in fp32."""
    return _masked_mean(x.float().pow(2).mean(-1), real, (0, 1)).sqrt()


@torch.no_grad()
def layer_stats(model: PocketLM, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> LayerStats:
    """Per-layer attention entropy and activation RMS of one forward over input_ids (B, T).

    attention_mask and position_ids are as for PocketLM.forward (left-padded batches pass both). Dropout is off
    during the pass; the model's train/eval modes are restored and no hook is left behind. Memory: one
    (B, H, T, T) fp32 score tensor per layer at a time, so pass a small batch. Runs under the caller's autocast.
    """
    B, T = input_ids.shape
    real = (attention_mask[:, -T:].bool() if attention_mask is not None
            else torch.ones(B, T, dtype=torch.bool, device=input_ids.device))
    if not real.any():
        raise ValueError("layer_stats needs at least one real (non-padding) token")
    per_layer: list[dict[str, torch.Tensor]] = [{} for _ in model.layers]

    def on_attention(i: int):
        def hook(module: Attention, args: tuple, output: torch.Tensor) -> None:
            x, rope, mask = args[:3]
            probs, mask = attention_probs(module, x, rope, mask)
            entropy = -torch.special.xlogy(probs, probs).sum(-1)  # (B, H, T); 0 * log 0 counts as 0
            n_keys = mask.sum(-1).float()  # (B or 1, 1, T)
            query = real[:, None, :]  # (B, 1, T)
            choice = query & (n_keys >= 2)
            s = per_layer[i]
            s["entropy"] = _masked_mean(entropy, query, (0, 1, 2))
            s["head_entropy"] = _masked_mean(entropy, query, (0, 2))
            normalised = entropy / n_keys.log()
            s["entropy_norm"] = _masked_mean(normalised, choice, (0, 1, 2))
            s["query_entropy_norm"] = normalised[choice.expand_as(normalised)]
            s["attn_out_rms"] = _rms(output, real)
        return hook

    def on_mlp(i: int):
        def hook(module: nn.Module, args: tuple, output: torch.Tensor | tuple) -> None:
            output = output[0] if isinstance(output, tuple) else output  # a MoE MLP returns its router's stats too
            per_layer[i]["mlp_out_rms"] = _rms(output, real)
        return hook

    def on_block(i: int):
        def hook(module: Block, args: tuple, output: tuple[torch.Tensor, tuple | None]) -> None:
            output = output[0]
            token_rms = output.float().pow(2).mean(-1).sqrt()[real]
            s = per_layer[i]
            s["act_rms"] = token_rms.pow(2).mean().sqrt()
            s["act_max"] = output.abs()[real].max().float()
            s["token_rms"] = token_rms
        return hook

    modes = {m: m.training for m in model.modules()}
    handles = []
    try:
        for i, block in enumerate(model.layers):
            handles += [block.self_attn.register_forward_hook(on_attention(i)),
                        block.mlp.register_forward_hook(on_mlp(i)),
                        block.register_forward_hook(on_block(i))]
        model.eval()  # no dropout; also keeps gradient checkpointing (which would run each hook twice) off
        model(input_ids, position_ids=position_ids, attention_mask=attention_mask, last_only=True)
    finally:
        for handle in handles:
            handle.remove()
        for module, training in modes.items():
            module.training = training

    def scalars(key: str) -> list[float]:
        return torch.stack([s[key] for s in per_layer]).tolist()  # one host sync per statistic

    return LayerStats(attn_entropy=scalars("entropy"), attn_entropy_norm=scalars("entropy_norm"),
                      head_entropy=scalars("head_entropy"), act_rms=scalars("act_rms"), act_max=scalars("act_max"),
                      attn_out_rms=scalars("attn_out_rms"), mlp_out_rms=scalars("mlp_out_rms"),
                      query_entropy_norm=[s["query_entropy_norm"].cpu() for s in per_layer],
                      token_rms=[s["token_rms"].cpu() for s in per_layer])


class RouterLoad:
    """How a mixture-of-experts model routes real text: per MoE layer, the tokens each expert received and the
    router's mean entropy, over the non-padding tokens of every forward run while it watches.

    Forward hooks on the routers (each layer's `mlp.gate`) re-run `MoE.route` on the logits they produce, so the
    choice is the model's own and the forward is untouched; `observe(mask)` says which positions of the next
    forward are real tokens.
    """

    def __init__(self, model: PocketLM) -> None:
        cfg = model.config
        self.num_experts, self.top_k = cfg.num_experts, cfg.num_experts_per_tok
        self.counts = torch.zeros(cfg.num_hidden_layers, cfg.num_experts, dtype=torch.float64)
        self.entropy = torch.zeros(cfg.num_hidden_layers, dtype=torch.float64)
        self.tokens = 0
        self._real: torch.Tensor | None = None
        self._handles = [layer.mlp.gate.register_forward_hook(self._hook(i, layer.mlp))
                         for i, layer in enumerate(model.layers)]

    def _hook(self, i: int, moe: nn.Module):
        def hook(module: nn.Module, args: tuple, logits: torch.Tensor) -> None:
            real = self._real.to(logits.device) if self._real is not None else slice(None)
            probs, choice, _ = moe.route(logits[real])
            self.counts[i] += torch.bincount(choice.flatten(), minlength=self.num_experts).double().cpu()
            self.entropy[i] += float(-(probs * probs.clamp_min(1e-30).log()).sum())
        return hook

    def observe(self, real: torch.Tensor) -> None:
        """The next forward's (B, T) mask of real (non-padding) tokens."""
        self._real = real.flatten().bool()
        self.tokens += int(self._real.sum())

    def close(self) -> None:
        for h in self._handles:
            h.remove()

    def load(self) -> torch.Tensor:
        """(layers, experts): the fraction of the routing choices each expert received."""
        return self.counts / self.counts.sum(-1, keepdim=True).clamp(min=1)

    def lines(self) -> list[str]:
        """One line per layer: the load of each expert, the most loaded one over the mean, the router entropy."""
        out = [f"router load over {self.tokens} tokens (fraction of the top-{self.top_k} choices per expert; "
               f"uniform = {1 / self.num_experts:.3f}, entropy at most ln {self.num_experts} = "
               f"{torch.log(torch.tensor(float(self.num_experts))):.3f} nats):"]
        for i, (row, h) in enumerate(zip(self.load().tolist(), (self.entropy / max(self.tokens, 1)).tolist())):
            out.append(f"  layer {i}: {' '.join(f'{x:.3f}' for x in row)} | max/mean "
                       f"{max(row) * self.num_experts:.2f} | entropy {h:.3f}")
        return out
