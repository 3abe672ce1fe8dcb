"""The PocketLM decoder: a Llama-style transformer (GPT-2-style by config switches) in one readable file.

Read top-down: norms -> rotary positions -> attention (with GQA and a preallocated KV cache) -> MLP (dense, or a
mixture of experts) -> block -> the model. Parameter names follow the Hugging Face Llama layout
(`layers.0.self_attn.q_proj.weight`, ...; QK-norm's `self_attn.q_norm.weight` as in Qwen3), so exporting is a
rename and MiniMind checkpoints, which use the same names, load as they are.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from common.device import capabilities

from .config import ModelConfig


# ----------------------------------------------------------------------------- norms
class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32: under bf16 autocast the mean of squares would lose precision."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def make_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.hidden_size, cfg.norm_eps)
    return nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps, bias=cfg.bias)


# ------------------------------------------------------------------ rotary positions
def rope_tables(head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape (max_positions, head_dim), computed once in fp32.

    The "rotate_half" layout (frequencies repeated over both halves of the head) is the Hugging Face Llama
    convention, so exported weights need no permutation of q/k rows. `scaling` (ModelConfig.rope_scaling) stretches
    the frequencies for contexts longer than the trained one, as transformers computes them.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    attention_factor = 1.0
    if scaling is not None:
        inv_freq, attention_factor = scaled_frequencies(inv_freq, head_dim, theta, scaling)
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    if attention_factor == 1.0:
        return angles.cos(), angles.sin()
    # Scaling cos and sin scales queries and keys alike, so every attention logit by attention_factor squared:
    # YaRN's temperature, which keeps attention as sharp over the longer context as it was over the trained one.
    return angles.cos() * attention_factor, angles.sin() * attention_factor


def scaled_frequencies(inv_freq: torch.Tensor, head_dim: int, theta: float, scaling: dict[str, Any]
                       ) -> tuple[torch.Tensor, float]:
    """RoPE frequencies under `scaling` and the factor cos/sin are multiplied by (transformers'
    _compute_linear_scaling_rope_parameters and _compute_yarn_parameters, same defaults).

    linear: every frequency divided by the factor, i.e. positions interpolated into the trained range.
    yarn: frequencies that turn many times within the original context (wavelengths short beside it) keep their
    value, since the model has seen their every phase; those that turn less than once there are interpolated like
    linear's; a ramp between beta_fast and beta_slow rotations blends the two.
    """
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv_freq / factor, 1.0
    original = scaling["original_max_position_embeddings"]

    def dim_for(rotations: float) -> float:  # the dimension whose wavelength fits `rotations` times in `original`
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_for(scaling.get("beta_fast", 32)), dim_for(scaling.get("beta_slow", 1))
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a step instead of a ramp, without dividing by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp  # 1 for the fast dimensions, which keep their frequency
    # in transformers' order of operations, so the tables agree to the last bit
    interpolated = 1.0 / (factor * theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    return interpolated * (1 - kept) + inv_freq * kept, yarn_attention_factor(scaling)


def yarn_mscale(factor: float, m: float = 1.0) -> float:
    """YaRN's attention temperature for a context stretched `factor` times: 0.1 m ln(factor) + 1."""
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def yarn_attention_factor(scaling: dict[str, Any]) -> float:
    """What a YaRN scaling multiplies cos and sin by: its attention_factor, else (as transformers does)
    mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are given (DeepSeek), else mscale(factor)."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, m, m_all = float(scaling["factor"]), scaling.get("mscale"), scaling.get("mscale_all_dim")
    return yarn_mscale(factor, m) / yarn_mscale(factor, m_all) if m and m_all else yarn_mscale(factor)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def interleave_rope_rows(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rows of a q or k projection (or of its LoRA B) reordered within each head from rotate_half's rotation pairs
    (i, i + D/2) to the interleaved pairs (2i, 2i + 1) that llama.cpp and ERNIE 4.5 rotate: what their exports
    write. q and k get the same permutation, so every attention score q.k is unchanged."""
    return w.reshape(-1, 2, head_dim // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


def rotate_half_rows(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Inverse of interleave_rope_rows (importing an interleaved layout)."""
    return w.reshape(-1, head_dim // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (B, H, T, D) queries or keys by their positions' angles; cos/sin are (B or 1, 1, T, D)."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + rotate_half(x) * sin


# ------------------------------------------------------------------------- KV cache
class KVCache:
    """Keys and values of every layer, preallocated for the whole generation and filled in place.

    Growing the cache with torch.cat would copy it on every decoded token (quadratic traffic); writing into a
    fixed buffer keeps each step O(current length). Keys are stored before GQA expansion, so the cache holds
    num_key_value_heads, not num_attention_heads.
    """

    def __init__(self, cfg: ModelConfig, batch_size: int, max_len: int,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        if max_len > cfg.max_position_embeddings:
            raise ValueError(f"a KV cache of {max_len} positions exceeds max_position_embeddings "
                             f"({cfg.max_position_embeddings})")
        shape = (cfg.num_hidden_layers, batch_size, cfg.num_key_value_heads, max_len, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.max_len = max_len
        self.length = 0  # number of positions already stored

    @staticmethod
    def dtype_for(model: nn.Module, device: torch.device) -> torch.dtype:
        """The dtype the model's keys and values come in: autocast's where it is on (an fp32 cache of bf16 keys
        would take twice the memory and a cast at every step), else the weights'."""
        if torch.is_autocast_enabled(device.type):
            return torch.get_autocast_dtype(device.type)
        return next(model.parameters()).dtype

    def take_rows(self, other: KVCache, rows: torch.Tensor) -> None:
        """Fill this cache from another's rows (row b <- other's row rows[b]): what it holds, and its length."""
        n = other.length
        self.k[:, :, :, :n] = other.k[:, rows, :, :n]
        self.v[:, :, :, :n] = other.v[:, rows, :, :n]
        self.length = n

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this step's (B, KV, T, D) keys/values for `layer`; return everything cached so far."""
        start, end = self.length, self.length + k.shape[2]
        self.k[layer, :, :, start:end] = k
        self.v[layer, :, :, start:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]


# ------------------------------------------------------------------------ attention
def set_attention_policy() -> None:
    """On CUDA, let SDPA choose flash, memory-efficient or math attention, never cuDNN's.

    On Hopper with a recent cuDNN PyTorch may prefer cuDNN attention, which builds a graph per (batch, query
    length, key length): KV-cache decoding (one more key every token) and variable-length SFT batches would
    build a new one at almost every call. Flash serves training and prefill (causal, no mask); decoding with a
    mask goes to the memory-efficient kernel. bench/gpu_check.sh reports the kernel actually dispatched."""
    torch.backends.cuda.enable_cudnn_sdp(False)


class Attention(nn.Module):
    """Multi-head causal self-attention with grouped-query heads, rotary positions and SDPA (and QK-norm when
    cfg.qk_norm)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        d, kv = cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim
        self.q_proj = nn.Linear(d, d, bias=cfg.bias)
        self.k_proj = nn.Linear(d, kv, bias=cfg.bias)
        self.v_proj = nn.Linear(d, kv, bias=cfg.bias)
        self.o_proj = nn.Linear(d, d, bias=cfg.bias)
        # QK-norm (Qwen3, OLMo 2, modded-nanogpt): each head's query and key RMS-normalised over head_dim, with a
        # learned weight shared by the heads. A logit q.k / sqrt(D) is then at most sqrt(D) * max|w_q| * max|w_k|,
        # however large the projections grow: attention cannot saturate into one-hot weights (whose gradients
        # vanish), which is what lets higher learning rates train stably.
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.dropout = cfg.dropout
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def qkv(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries (B, H, T, D) and keys, values (B, KV, T, D) of x, positions applied; before cache and GQA.

        A method of its own so that model/stats.py recomputes attention weights from exactly these q and k.
        """
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:  # per head, before RoPE: where Qwen3 (and so the export) normalises
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        return q, k, v

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                mask: torch.Tensor | None, cache: KVCache | None) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.qkv(x, rope)
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)
        # GQA: each KV head serves n_heads / n_kv_heads query heads. Expanding here (rather than SDPA's
        # enable_gqa) keeps every SDPA backend, flash included, eligible.
        rep = self.n_heads // self.n_kv_heads
        if rep > 1 and T == 1 and mask is not None:
            # One decoded token: the rep query heads of a KV head become rep query rows against it, the same
            # dot products without copying the whole cache rep times at every token (which took a third of
            # the time of a batched decode on a CPU). Head j * rep + r is row r of KV head j, as expanded.
            q, mask = q.reshape(B, self.n_kv_heads, rep, self.head_dim), mask.expand(-1, -1, rep, -1)
        elif rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        # mask=None means "plain causal over this chunk": the fast is_causal path used in training.
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                           dropout_p=self.dropout if self.training else 0.0)
        y = y.reshape(B, self.n_heads, T, self.head_dim)  # a folded decode's rows back to heads
        y = y.transpose(1, 2).reshape(B, T, -1)
        return self.resid_dropout(self.o_proj(y))


# ------------------------------------------------------------------------------ MLP
class MLP(nn.Module):
    """SwiGLU (silu(gate) * up -> down) for Llama style, or GELU (up -> gelu -> down) for GPT-2 style."""

    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None, bias: bool | None = None) -> None:
        super().__init__()
        d, f = cfg.hidden_size, intermediate_size or cfg.intermediate_size
        bias = cfg.bias if bias is None else bias
        self.gated = cfg.mlp == "swiglu"
        if self.gated:
            self.gate_proj = nn.Linear(d, f, bias=bias)
        self.up_proj = nn.Linear(d, f, bias=bias)
        self.down_proj = nn.Linear(f, d, bias=bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            h = F.silu(self.gate_proj(x)) * self.up_proj(x)
        else:
            h = F.gelu(self.up_proj(x), approximate="tanh")
        return self.dropout(self.down_proj(h))


# ---------------------------------------------------------------- mixture of experts
@dataclass
class RouterStats:
    """What the routers of one forward did, per MoE layer (rows), for the loop's balancing losses and logs.

    counts     (L, E) tokens each expert received (a token counts once per expert it chose), no gradient
    prob_sum   (L, E) router probabilities summed over the tokens: differentiable, the P of the balancing loss
    z_sum      (L,)   sum over tokens of logsumexp(router logits)^2: the router z-loss (differentiable only when
                      router_z_loss_coef > 0: otherwise its graph would keep the logits alive for nothing)
    entropy_sum (L,)  sum over tokens of the router distribution's entropy (nats), no gradient
    tokens     tokens routed per layer
    """

    counts: torch.Tensor
    prob_sum: torch.Tensor
    z_sum: torch.Tensor
    entropy_sum: torch.Tensor
    tokens: int


class Experts(nn.Module):
    """num_experts SwiGLU MLPs with stacked weights, run on tokens already grouped by expert.

    Stacked (E, out, in) tensors rather than E modules: one parameter per kind, which is the layout grouped
    matmuls take. Every expert's weights take part in every forward, even an expert that received no token
    (its matmul has zero rows and its gradient is zero), so DDP's gradient reduction never waits for a
    gradient that was not produced.
    """

    def __init__(self, num_experts: int, d: int, f: int) -> None:
        super().__init__()
        self.gate_proj = nn.Parameter(torch.empty(num_experts, f, d))
        self.up_proj = nn.Parameter(torch.empty(num_experts, f, d))
        self.down_proj = nn.Parameter(torch.empty(num_experts, d, f))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x (N, d) sorted by expert, counts (E,) rows per expert -> (N, d)."""
        if use_grouped_mm(x):
            # one kernel per projection; offsets stay on the device (no host sync)
            x = x.to(torch.bfloat16)  # a no-op under bf16 autocast (MoE.forward cast the tokens)
            offs = counts.cumsum(0).to(torch.int32)
            gate = F.grouped_mm(x, self.gate_proj.to(x.dtype).transpose(1, 2), offs=offs)
            up = F.grouped_mm(x, self.up_proj.to(x.dtype).transpose(1, 2), offs=offs)
            return F.grouped_mm(F.silu(gate) * up, self.down_proj.to(x.dtype).transpose(1, 2), offs=offs)
        # portable path: a slice per expert (the split sizes are one host read per layer). The stacks are cast
        # to x's dtype once and unbound once: indexing a stack per expert would cast each slice separately and
        # give each slice's gradient as a zero-filled copy of the whole stack.
        gates, ups, downs = (w.to(x.dtype).unbind(0) for w in (self.gate_proj, self.up_proj, self.down_proj))
        out = [F.linear(F.silu(F.linear(xs, g)) * F.linear(xs, u), dn)
               for xs, g, u, dn in zip(x.split(counts.tolist()), gates, ups, downs)]
        return torch.cat(out)


def use_grouped_mm(x: torch.Tensor) -> bool:
    """Grouped matmuls where PyTorch has them for the device: CUDA in bf16, on GPUs where bf16 is native (the
    precision policy, common/device.py); its backward is not available on CPU in PyTorch 2.13, and the kernel
    wants 16-byte aligned rows."""
    if not (x.is_cuda and hasattr(F, "grouped_mm") and x.shape[-1] % 8 == 0 and capabilities(x.device).bf16):
        return False
    if torch.is_autocast_enabled("cuda"):  # the matmuls run in the autocast dtype
        return torch.get_autocast_dtype("cuda") == torch.bfloat16
    return x.dtype == torch.bfloat16  # a bf16 model without autocast (inference, serving)


class Dispatch(torch.autograd.Function):
    """rows[order // k]: each of N rows repeated k times in the given order (a permutation of N*k slots).

    Plain indexing would compute the same forward, but its backward is a scatter-add into the N rows (slow on
    CPU, atomic and so non-deterministic on GPU). Knowing the order is a permutation, the backward is a gather
    by its inverse followed by a sum over each row's k copies: deterministic, and no scatter at all.
    """

    @staticmethod
    def forward(ctx, rows: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor, k: int) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        ctx.k = k
        return rows.index_select(0, order // k if k > 1 else order)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        (inverse,) = ctx.saved_tensors
        grad = grad.index_select(0, inverse)
        return grad.view(-1, ctx.k, grad.shape[-1]).sum(1) if ctx.k > 1 else grad, None, None, None


class MoE(nn.Module):
    """A mixture-of-experts MLP: a router picks num_experts_per_tok experts per token, their outputs are summed
    with the router's weights, and shared experts (if any) add their output for every token.

    Dropless: every token reaches every expert it chose; nothing is capped or dropped. Dispatch is a sort, not
    a loop over tokens: the (token, choice) pairs are ordered by expert, each expert runs on its contiguous
    slice, and the outputs are put back in (token, choice) order and summed with the gate weights.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob
        d = cfg.hidden_size
        self.gate = nn.Linear(d, cfg.num_experts, bias=False)  # the router (Mixtral / Qwen2-MoE name)
        self.experts = Experts(cfg.num_experts, d, cfg.moe_intermediate_size)
        # S experts side by side are one S-times-wider MLP. Without biases even when cfg.bias is set, like the
        # routed experts: ModelConfig.num_parameters counts every expert as a bias-free SwiGLU (with cfg.bias the
        # shared experts had biases and the closed-form count fell short of the module's).
        self.shared_experts = (MLP(cfg, cfg.num_shared_experts * cfg.moe_intermediate_size, bias=False)
                               if cfg.num_shared_experts else None)
        # Auxiliary-loss-free balancing (DeepSeek-V3): a per-expert bias added to the scores when choosing the
        # experts, never to the gate weights. The trainer nudges it after each step (router_bias_update_rate);
        # zero otherwise. Persistent: it is part of what the model computes.
        self.register_buffer("router_bias", torch.zeros(cfg.num_experts))
        self.dropout = nn.Dropout(cfg.dropout)
        self.z_loss = cfg.router_z_loss_coef > 0

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Router logits (N, E) -> probabilities (N, E), the chosen experts (N, k) and their gate weights (N, k)."""
        probs = logits.float().softmax(-1)
        choice = (probs + self.router_bias.float()).topk(self.top_k, dim=-1).indices
        weights = probs.gather(-1, choice)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        return probs, choice, weights

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        B, T, d = x.shape
        flat = x.reshape(-1, d)
        N, k = flat.shape[0], self.top_k
        logits = self.gate(flat).float()  # softmax and choice in fp32, as Mixtral and Qwen2-MoE do
        probs, choice, weights = self.route(logits)

        # dispatch: the N*k (token, choice) pairs in expert order
        expert_of = choice.flatten()
        order = expert_of.argsort(stable=True)
        counts = torch.bincount(expert_of, minlength=self.num_experts)
        # under autocast the experts' matmuls run in its dtype: cast the tokens once, before the k-fold gather
        device = flat.device.type
        source = flat.to(torch.get_autocast_dtype(device)) if torch.is_autocast_enabled(device) else flat
        inverse = torch.empty_like(order).scatter_(0, order, torch.arange(N * k, device=order.device))
        y = self.experts(Dispatch.apply(source, order, inverse, k), counts)
        # combine: back to (token, choice) order, then each token's k outputs weighted and summed
        y = Dispatch.apply(y, inverse, order, 1)
        out = self.dropout((y.view(N, k, d) * weights.to(y.dtype).unsqueeze(-1)).sum(1))  # as the dense MLP's
        if self.shared_experts is not None:  # (which applies its own dropout)
            out = out + self.shared_experts(flat)

        with torch.no_grad():
            entropy = -(probs * probs.clamp_min(1e-30).log()).sum()
        with torch.set_grad_enabled(torch.is_grad_enabled() and self.z_loss):
            z = torch.logsumexp(logits, -1).pow(2).sum()
        stats = (counts.float(), probs.sum(0), z, entropy)
        return out.view(B, T, d), stats


# ---------------------------------------------------------------------------- block
class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x)). Returns the new residual stream
    and, for a mixture-of-experts MLP, what its router did (None for a dense MLP)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = make_norm(cfg)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = make_norm(cfg)
        self.mlp = MoE(cfg) if cfg.moe else MLP(cfg)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                mask: torch.Tensor | None, cache: KVCache | None) -> tuple[torch.Tensor, tuple | None]:
        x = x + self.self_attn(self.input_layernorm(x), rope, mask, cache)
        h = self.mlp(self.post_attention_layernorm(x))
        h, router = h if isinstance(h, tuple) else (h, None)
        return x + h, router


# ---------------------------------------------------------------------------- model
def shared_context_mask(segment: torch.Tensor) -> torch.Tensor:
    """The (B, 1, L, L) attention mask (True: may attend) of rows that each hold a shared context and
    continuations of it: `segment` (B, L) is 0 on the context, j >= 1 on continuation j, -1 on padding. The
    context is causal; a continuation sees the context and its own earlier tokens, never another continuation;
    a pad sees only itself (a query that sees nothing would make SDPA return NaN)."""
    L = segment.shape[1]
    order = torch.arange(L, device=segment.device)
    seen = segment[:, None, :]  # the key's segment, for each query row
    mask = (order[None, None, :] <= order[None, :, None]) & (seen >= 0) & \
        ((seen == 0) | (seen == segment[:, :, None]))
    mask |= torch.eye(L, dtype=torch.bool, device=segment.device)[None]
    return mask[:, None]


class PocketLM(nn.Module):
    """Decoder-only language model: token ids (B, T) -> next-token logits (B, T, vocab)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        cfg.validate()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_positions = (nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
                                if cfg.position_embedding == "learned" else None)
        self.dropout = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = make_norm(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        if cfg.position_embedding == "rope":
            # Not persistent: derived from the config, so never stored in (or expected from) a checkpoint.
            cos, sin = rope_tables(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 init: N(0, 0.02) everywhere, residual projections scaled by 1/sqrt(2 * n_layers); norms (QK-norm's
        too) at one.

        Each block adds two residual branches; scaling their output projections keeps the residual stream's
        variance from growing with depth. With zero_init_residual they start at zero instead (modded-nanogpt):
        every block begins as the identity and the model as a bigram model, which trains more stably at high
        learning rates. Gradients still reach every weight from the second step on: the first step's gradient
        of an output projection is not zero (its input is not), and once it is non-zero the branch behind it
        gets gradients too.
        """
        std = self.config.initializer_range
        residual_std = std * (1 / math.sqrt(2 * self.config.num_hidden_layers))

        def init_residual(weight: torch.Tensor) -> None:
            if self.config.zero_init_residual:
                nn.init.zeros_(weight)
            else:
                nn.init.normal_(weight, mean=0.0, std=residual_std)

        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                if name.endswith(("o_proj", "down_proj")):  # the shared experts' down_proj too
                    init_residual(module.weight)
                else:
                    nn.init.normal_(module.weight, mean=0.0, std=std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, Experts):  # each expert initialised as a dense MLP would be
                nn.init.normal_(module.gate_proj, mean=0.0, std=std)
                nn.init.normal_(module.up_proj, mean=0.0, std=std)
                init_residual(module.down_proj)
            elif isinstance(module, (RMSNorm, nn.LayerNorm)):
                nn.init.ones_(module.weight)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)

    def set_gradient_checkpointing(self, enabled: bool = True) -> None:
        """Recompute each block during backward instead of storing its activations (less memory, ~30% slower)."""
        self.config.gradient_checkpointing = enabled

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())  # parameters() yields tied tensors once

    @torch.no_grad()
    def update_router_bias(self, counts: torch.Tensor, rate: float) -> None:
        """Auxiliary-loss-free balancing (DeepSeek-V3, eq. 16): after a step, raise the routing bias of each
        MoE layer's underloaded experts by `rate` and lower the overloaded ones'; counts (L, E) is the step's
        load over every micro-batch and rank, so all ranks make the same update."""
        for layer, c in zip(self.layers, counts):
            bias = layer.mlp.router_bias
            bias += rate * torch.sign(c.mean() - c).to(bias.dtype)
            # only differences between experts change a choice; centring keeps the biases from drifting (more
            # experts below the mean than above would raise them all, step after step, until bf16 rounds them)
            bias -= bias.mean()

    def _attention_mask(self, attention_mask: torch.Tensor | None, start: int, T: int,
                        device: torch.device) -> torch.Tensor | None:
        """Boolean (B or 1, 1, T, start+T) mask, True = may attend; None = plain causal (SDPA fast path).

        attention_mask is the Hugging Face-style (B, start+T) padding mask over cached and new tokens. Causality
        is by cache slot: with left padding a row's slot order is its token order. A 4-D (B, 1, T, start+T)
        attention_mask is used as it is, for attention that is not a plain causal order (several continuations
        after one shared context in one row, each seeing the context and itself: shared_context_mask above).
        """
        if attention_mask is not None and attention_mask.dim() == 4:
            return attention_mask.bool()
        if attention_mask is None and start == 0:
            return None
        q_slot = torch.arange(start, start + T, device=device)[:, None]
        k_slot = torch.arange(start + T, device=device)[None, :]
        allowed = (k_slot <= q_slot)[None, None]
        if attention_mask is not None:
            allowed = allowed & attention_mask[:, None, None, : start + T].bool()
            # A padding query would see no key at all and SDPA would return NaN for it; let it see itself.
            # Real tokens already attend to themselves, so their outputs are unchanged.
            allowed = allowed | (k_slot == q_slot)
        return allowed

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, kv_cache: KVCache | None = None,
                last_only: bool = False, return_router: bool = False, logits_at: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, RouterStats | None]:
        """Logits for every position (or only the last with last_only=True, as prefill needs; or, with a (B, T)
        bool mask logits_at, only where it is True, as (N, vocab) rows in row-major order: scoring needs a few
        positions, and the vocabulary projection of the others would cost as much as a layer); with
        return_router=True, (logits, RouterStats) for a mixture-of-experts model ((logits, None) for a dense one):
        the trainer adds the balancing losses from them.

        position_ids default to consecutive positions after what kv_cache holds; pass them explicitly for
        left-padded batches (position = number of real tokens before it) and with a 4-D attention_mask.
        """
        B, T = input_ids.shape
        start = kv_cache.length if kv_cache is not None else 0
        if kv_cache is not None and start + T > kv_cache.max_len:
            raise ValueError(f"KV cache holds {kv_cache.max_len} positions; {start + T} requested")
        if position_ids is None:
            position_ids = torch.arange(start, start + T, device=input_ids.device)[None]
            contiguous = True
        else:
            contiguous = False
        # With a cache, a position never exceeds its slot (< cache.max_len <= max_position_embeddings), so the
        # check needs no device-to-host read of position_ids on every decoded token.
        if kv_cache is None or contiguous:
            max_pos = start + T - 1 if contiguous else int(position_ids.max())
            if max_pos >= self.config.max_position_embeddings:
                raise ValueError(f"position {max_pos} is beyond max_position_embeddings "
                                 f"({self.config.max_position_embeddings})")

        x = self.embed_tokens(input_ids)
        rope = None
        if self.embed_positions is not None:
            x = x + self.embed_positions(position_ids)
        else:
            if contiguous:  # slicing avoids a gather in the common (training) case
                rope = (self.rope_cos[start:start + T][None, None], self.rope_sin[start:start + T][None, None])
            else:
                rope = (self.rope_cos[position_ids][:, None], self.rope_sin[position_ids][:, None])
        x = self.dropout(x)

        mask = self._attention_mask(attention_mask, start, T, input_ids.device)
        routers = []
        for layer in self.layers:
            if self.config.gradient_checkpointing and self.training and torch.is_grad_enabled():
                # what the router returns comes from the forward; backward's recomputation discards its copy
                x, router = checkpoint(layer, x, rope, mask, kv_cache, use_reentrant=False)
            else:
                x, router = layer(x, rope, mask, kv_cache)
            routers.append(router)
        if kv_cache is not None:
            kv_cache.length += T

        if logits_at is not None:
            x = x[logits_at]
        elif last_only:
            x = x[:, -1:]
        x = self.norm(x)
        logits = self.lm_head(x)
        if not return_router:
            return logits
        if not self.config.moe:
            return logits, None
        counts, prob_sum, z_sum, entropy_sum = (torch.stack(t) for t in zip(*routers))
        return logits, RouterStats(counts, prob_sum, z_sum, entropy_sum, B * T)
