"""How much memory one training step needs, before training: parameters, gradients, AdamW state, activations.

    python -m model --estimate --preset minimind-26m --batch_size 8 --max_seq_len 512 --dtype bfloat16

The estimate follows, tensor by tensor, what model/model.py saves for backward and what trainer_utils/loop.py
keeps alive (eager PyTorch, one process, dropout 0). N = batch_size * seq_len tokens, d = hidden_size,
f = intermediate_size, H = attention heads, V = vocabulary, L = layers, P = parameters; a = 2 bytes for
activations under bf16/fp16 autocast, 4 in fp32.

Held for the whole run, and the gradients
    parameters     4P                  fp32 master weights: autocast casts copies, never the weights themselves
    buffers        8 * max_position_embeddings * head_dim        the RoPE cos/sin tables
    AdamW state    8P + 4 per tensor   exp_avg, exp_avg_sq and a step counter, all fp32
    gradients      4P                  fp32 like the parameters, from backward until the optimizer step

Saved for backward by one block, per token (an op keeps only what its gradient formula reads):
    residual       4d + 4d    the block input x and x + attention (the embedding and residual adds stay fp32)
    each norm      4d + 4     RMSNorm runs in fp32 and keeps x * rsqrt(mean(x^2)) and the rsqrt
                              (LayerNorm keeps 8 bytes: its mean and 1/std)
    norm outputs   fp32: 4d per norm, shared by q/k/v (and by gate/up). Autocast: a*d per linear reading it,
                   because each linear casts its input anew (3 for attention, 2 for SwiGLU, 1 for GELU)
    attention      4 * a*d + 4H   q after RoPE, k and v after the GQA repeat (d wide), the output, and the
                   fp32 log-sum-exp of the flash kernel; the T x T attention weights are never stored. RoPE's
                   products keep the cos/sin tables, not q or k, so the projections' outputs are freed.
    MLP            SwiGLU 4 * a*f (gate, silu(gate), up, their product); GELU 2 * a*f (its input and output)
    weight copies  autocast only, per block rather than per token: the a-byte copy of every linear weight,
                   which the matmul keeps for its input's gradient

Around the blocks: the ids of learned positions (8 bytes each), the final norm (its input, what it keeps, its
output or autocast copy), the lm_head's weight copy (autocast), and the loss's fp32 log-softmax (4V per token).
The logits (aV per token) are saved by no op: they live until the loss is computed, then only the loss is kept.
Gradient checkpointing keeps only each block's input (4d per token); backward recomputes one block at a time.

The peak is what is held for the whole run plus the largest of five moments of the step:
    forward end           everything saved, and the logits (checkpointing under autocast: also every block's
                          cast weights, which autocast caches until the forward leaves it)
    loss backward         everything saved, and 8V per token: the gradients of the log-probabilities and of the
                          logits, both fp32 and dense over the vocabulary
    last block backward   all blocks' saved tensors, the gradients made so far (lm_head, final
                          norm), and the MLP backward's working set: the incoming gradient (4d per token), the
                          down projection's fp32 weight gradient (4df; under autocast its a-byte weight copy
                          is released by then), and 2 * a*f per token for the gradients of silu(gate) and up
                          (GELU: 1 * a*f)
    first block backward  the same inside block 0: one block's saved tensors, but every other block's gradients
    end of backward       every gradient, and with tied embeddings two V x d fp32 tensors: the
                          embedding's dense gradient and its sum with the lm_head's (added out of place)
It is the peak of a step after the first: from then on AdamW's state is there through forward and backward (the
first step's peak is no higher). With accumulation steps, the gradients are alive through every micro-batch
after the first.

A mixture of experts (cfg.moe: E routed experts of width e = moe_intermediate_size, k chosen per token, S shared)
replaces the MLP's terms; the rest of the block and the moments are the same. P is the total (every expert), so
parameters, gradients and AdamW state follow from it; each layer's routing bias is a buffer (4E bytes). What the
portable path of model.model.MoE saves (CPU; CUDA outside bf16), per token:
    router         4E + 8k        fp32 probabilities (softmax) and the chosen experts (int64, for the gather)
                   + 4k + 4       norm_topk_prob: the chosen probabilities and their sum (the division)
                   + 4E + 4       the fp32 router logits and their logsumexp, kept by the z-loss statistic that the
                                  loop's router loss differentiates (with router_z_loss_coef 0 too)
    norm output    fp32: 4d, shared as for a dense MLP. Autocast: a*d per linear reading it (the router, and the
                   shared experts' gate and up)
    dispatch       8k + 8k        int64: the gather's index (order // k) and the un-permuting inverse
    token copies   fp32 4kd       the k copies in expert order (flat[order // k]); each expert's gate and up read
                   autocast 2akd  its rows: under autocast each casts them anew and the fp32 gather is not kept
    experts        4 * a*k*e      SwiGLU's gate, silu(gate), up and product for each (token, choice)
    combine        a*kd + a*k     the un-permuted outputs and the gate weights cast to their dtype
    shared         4 * a*S*e      a dense SwiGLU MLP S*e wide
    weight copies  autocast, per block: a * (dE + 3Eed + 3dSe). An expert's weights are a slice of the stacked
                   tensor (gate_proj[i], no leaf), which autocast casts at every call and never caches: under
                   checkpointing only the router's and shared experts' copies stay in the cache
None of this depends on the routing: the experts' rows add up to N*k however they are shared out.
Backward inside the block: the gradient from above (4d per token) throughout, and the largest of
    shared experts        first (their ops are the newest): a dense MLP's working set, width S*e. After them
                          their weight gradients stay, and their fp32 gradient of the norm output (4d per token)
                          until the router's joins it; their saved tensors and copies are freed
    combine               2 * a*kd per token: the gradients of the expert outputs and of the gate weights
    second expert's down  the experts run backward one by one, the last first. The gradient of a slice of a
      weight gradient     stacked weight is a zero-filled fp32 tensor of the whole stack (4Eed) with the
                          slice's gradient (4ed) copied in; the E of a stack are summed into one. Here the three
                          stacks' sums (12Eed), a new zero-filled one and the slice's gradient are all there, and
                          the un-permuted outputs' gradient (a*kd per token); the first expert's saved tensors are
                          freed (and under autocast its weight copies and token casts, and this expert's down copy),
                          its gradient of its rows is held (4d per row)
The last assumes balanced routing, N*k/E rows per expert: each row more (fewer) that the first expert to run
backward (the last one, E - 1) received lowers (raises) the peak by 4*a*e - 4d bytes. With 2 x 64 tokens on a
fresh router, 30 to 80 rows instead of 64: up to 0.7% of the 2-layer models' peaks.

Not modelled, each well under 1% of the total for the presets: the autocast copies of the RoPE tables
(O(seq_len) per block), checkpointing's saved RNG state, and oneDNN's scratch buffers for bf16 matmuls on CPU.
Not covered: torch.compile (it fuses ops and saves less), DDP (gradient buckets add about one more copy of the
gradients), DeepSpeed ZeRO (it shards the optimizer state), dropout > 0, and the MoE's grouped-matmul path (CUDA
with bf16 autocast; not measured, no GPU here: it casts the token copies once, a*kd rather than 2akd per token,
and makes one gradient per stack without the zero-filled ones, so there the estimate should be somewhat high).

Checked against measured peaks (tests/test_memory.py; measure_step_peak profiles every allocation of one step
on CPU): 2-layer models within 0.25% in fp32 and 3.5% in bf16; minimind-26m at batch 8 x 512 within 0.12%.
Mixtures of experts (2 layers, d 128, 4 experts top-2, with and without a shared expert): within 0.3% in fp32 and
0.2% in bf16/fp16, with checkpointing too; -1.1% with accumulation in fp32 (routing, above, and the tied
embedding's gradient that each later micro-batch's backward holds until the embedding's own arrives, 4Vd, which
the formula leaves out). minimind-26m-moe at batch 8 x 512 in bf16: within 0.1%, with checkpointing 0.03%.
"""
from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, Iterator, NamedTuple

import torch

from common.errors import ConfigError

from .config import ModelConfig

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
MIB, GIB = 2**20, 2**30


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one training step needs, by kind, and the estimated peak (formula: the module docstring)."""

    # what was estimated
    name: str
    num_parameters: int
    blocks: int
    batch_size: int
    seq_len: int
    dtype: str
    grad_checkpointing: bool
    accumulation_steps: int
    # bytes
    parameters: int
    buffers: int
    gradients: int
    optimizer: int
    activations: int  # saved for backward at the end of the forward, weight copies included
    weight_copies: int  # autocast's copies of the weights among the activations
    per_block: int  # saved by one block (checkpointed: its input)
    logits: int  # alive from the end of the forward until the loss is computed
    moments: dict[str, int]  # what the step holds beyond `persistent` at each moment that may be the peak
    # a mixture of experts: experts per layer, chosen per token, shared; the parameters a token uses
    experts: int = 0
    experts_per_token: int = 0
    shared_experts: int = 0
    active_parameters: int = 0

    @property
    def persistent(self) -> int:
        """Held for the whole run: parameters, buffers and optimizer state."""
        return self.parameters + self.buffers + self.optimizer

    @property
    def peak_moment(self) -> str:
        return max(self.moments, key=self.moments.__getitem__)

    @property
    def peak(self) -> int:
        """The estimated peak bytes of live tensors during a training step."""
        return self.persistent + self.moments[self.peak_moment]

    @property
    def experts_label(self) -> str:
        """'8 experts, top-2 (+1 shared)' for a mixture of experts, '' for a dense model."""
        if not self.experts:
            return ""
        return (f"{self.experts} experts, top-{self.experts_per_token}"
                + (f" +{self.shared_experts} shared" if self.shared_experts else ""))

    @property
    def label(self) -> str:
        params = f"{self.num_parameters / 1e6:.2f}M parameters"
        if self.experts:
            params += f", {self.active_parameters / 1e6:.2f}M active per token: {self.experts_label}"
        return (f"{self.name} ({params}), batch {self.batch_size} x "
                f"{self.seq_len} tokens" + (f" x {self.accumulation_steps} accumulation steps"
                                            if self.accumulation_steps > 1 else "")
                + (", float32" if self.dtype == "float32" else f", {self.dtype} autocast")
                + (", gradient checkpointing" if self.grad_checkpointing else ""))

    def summary(self, measured: int | None = None) -> str:
        """One log line: the estimated peak, beside a measured one when there is one."""
        line = f"memory: estimated peak {fmt(self.peak)} (at the {self.peak_moment})"
        if measured:
            line += f", measured {fmt(measured)} ({self.peak / measured - 1:+.1%})"
        return line

    def lines(self) -> list[str]:
        """The estimate as aligned lines of text (what `python -m model --estimate` prints)."""
        saved = (f"{self.blocks} block inputs x {fmt(self.per_block)} (blocks are recomputed in backward)"
                 if self.grad_checkpointing else f"{self.blocks} blocks x {fmt(self.per_block)}")
        if self.experts and not self.grad_checkpointing:
            saved += f" (each token's {self.experts_per_token} of {self.experts} experts)"
        every = f", all {self.experts} experts of every layer" if self.experts else ""
        every_expert = ", every expert's" if self.experts and not self.grad_checkpointing else ""
        copies = (f" (incl. {fmt(self.weight_copies)} of {self.dtype} weight copies{every_expert})"
                  if self.weight_copies else "")
        buffers = " + ".join(["RoPE cos/sin tables"] * (self.buffers > 4 * self.experts * self.blocks)
                             + ["routing biases"] * bool(self.experts))
        rows = [("parameters", self.parameters, f"fp32 master weights{every}"),
                *([("buffers", self.buffers, buffers)] if self.buffers else []),
                ("gradients", self.gradients, "fp32, from backward to the optimizer step"),
                ("AdamW state", self.optimizer, "exp_avg + exp_avg_sq, fp32"),
                ("activations", self.activations, f"saved for backward: {saved} + final norm and loss{copies}"),
                ("logits", self.logits, "until the loss is computed"),
                ("total (peak)", self.peak, f"at the {self.peak_moment}: parameters + buffers + AdamW state + "
                                            f"{fmt(self.moments[self.peak_moment])}")]
        out = [f"memory for one training step: {self.label}"]
        out += [f"  {name:<14}{fmt(n):>11}  {note}" for name, n, note in rows]
        out.append("  held beyond parameters + buffers + AdamW state, at each moment that may be the peak:")
        out += [f"    {name:<22}{fmt(n):>11}" + ("  <- peak" if name == self.peak_moment else "")
                for name, n in self.moments.items()]
        return out


def fmt(n: int) -> str:
    """Bytes as MiB, or GiB from 1000 MiB on."""
    return f"{n / GIB:.2f} GiB" if n >= 1000 * MIB else f"{n / MIB:.1f} MiB"


def parameter_tensors(cfg: ModelConfig) -> int:
    """How many parameter tensors PocketLM(cfg) has (a tied lm_head counts once): AdamW keeps a step each."""
    norm = 2 if cfg.norm == "layernorm" and cfg.bias else 1
    biased = 2 if cfg.bias else 1
    if cfg.moe:  # attention, the router, the three stacked expert tensors, the shared experts' MLP
        block = 2 * norm + 4 * biased + 1 + 3 + (3 if cfg.num_shared_experts else 0)  # only attention has biases
    else:
        linears = 4 + (3 if cfg.mlp == "swiglu" else 2)
        block = 2 * norm + linears * biased
    return (1 + (cfg.position_embedding == "learned") + cfg.num_hidden_layers * block + norm
            + (not cfg.tie_word_embeddings))


class MoEBlock(NamedTuple):
    """What one mixture-of-experts MLP adds to its block (bytes for all N tokens; module docstring, "Mixture of
    experts")."""

    saved: int  # saved for backward, besides the post-attention norm's output (fp32) or its casts (autocast)
    norm_output_readers: int  # linears that read the norm's output: the router, and the shared experts' gate, up
    weights: int  # elements of its weights that a linear reads (autocast copies one a-byte copy of each)
    cached_weights: int  # ... of them, those autocast caches: leaves (router, shared experts), not expert slices
    working_set: int  # the largest moment of its backward, beyond the block's saved tensors and earlier gradients


def moe_block(cfg: ModelConfig, N: int, a: int, accumulating: bool) -> MoEBlock:
    """The saved tensors and backward working set of model.model.MoE, traced op by op (module docstring)."""
    d, E, k, f = cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
    fs = cfg.num_shared_experts * f  # the shared experts: one dense SwiGLU MLP this wide
    autocast = a < 4
    Nk = N * k  # (token, choice) pairs; an expert gets Nk / E of them when routing is balanced

    # ---- saved in forward
    # router: probs (softmax, fp32), the choices (int64, for the gather), the gathered weights and their sum
    # (normalising division), and for the z-loss statistic the fp32 router logits and their logsumexp
    router = 4 * E * N + 8 * Nk + ((4 * Nk + 4 * N) if cfg.norm_topk_prob else 0) + 4 * E * N + 4 * N
    dispatch = 8 * Nk + 8 * Nk  # int64: the gather's order // k and the un-permuting inverse
    # the tokens' copies in expert order: fp32, one tensor that the gate and up slices of each expert read;
    # autocast: each of the two linears casts its slice anew (the fp32 gather itself is not kept)
    gathered = (2 * a if autocast else 4) * d * Nk
    experts = 4 * a * f * Nk  # SwiGLU: gate, silu(gate), up and their product, per (token, choice)
    combine = a * d * Nk + a * Nk  # the un-permuted outputs and the gate weights (cast to their dtype)
    shared = 4 * a * fs * N
    saved = router + dispatch + gathered + experts + combine + shared
    weights = d * E + 3 * E * f * d + 3 * d * fs
    cached_weights = d * E + 3 * d * fs

    # ---- backward. The gradient arriving from above (4d per token) is there throughout. The shared experts
    # run first (their nodes are the newest): a dense MLP's working set inside them; after them their
    # gradients stay (unless accumulated into existing ones) and so does their gradient of the norm output,
    # waiting for the router's; their saved tensors and weight copies are gone.
    incoming = 4 * d * N
    shared_inside = shared_after = 0
    if fs:
        shared_inside = 4 * d * fs - (a * d * fs if autocast else 0) + 2 * a * fs * N
        shared_after = ((0 if accumulating else 3 * 4 * d * fs) + 4 * d * N - shared
                        - (2 * a * d * N + 3 * a * d * fs if autocast else 0))
    # then the routed experts' combine: it frees the z-loss statistic's logits, and holds two (N, k, d)
    # gradients (of the outputs and, summed next, of the gate weights; then the un-permute's)
    stats = 4 * E * N + 4 * N
    combine_moment = shared_after - stats + 2 * a * d * Nk
    # then expert by expert, the last first. Each indexes its slice of a stacked weight, and the slice's
    # gradient is a zero-filled fp32 tensor as large as the whole stack (E x f x d) with the slice copied in;
    # the E of them are summed into one gradient per stack. The largest moment is the second expert's first
    # weight gradient: the three stacks' sums exist, and the new zero-filled one beside them, with the slice's
    # own gradient. By then the first expert's saved tensors are freed (and under autocast its weight copies,
    # its casts of the gathered tokens, and the second's down weight copy); held: the gradient of the experts'
    # outputs (a*d per pair) and the first expert's gradient of its tokens (fp32); the second's gradient of its
    # product has taken the place of the product
    per_expert = 4 * a * f * Nk // E + ((2 * a * d * Nk // E + 4 * a * f * d) if autocast else 0)
    transient = (4 * E * f * d if E > 1 else 0) + 4 * f * d
    expert_moment = (shared_after - stats - combine - 8 * Nk + a * d * Nk - per_expert + 4 * d * Nk // E
                     + 3 * 4 * E * f * d + transient)
    # (after the experts, joining the tokens' gradients from the experts' slices takes 2 * 4d per pair; the
    # experts moment held more: the gathered copies, the outputs' gradient and the zero-filled stack)
    working_set = incoming + max(shared_inside, combine_moment, expert_moment)
    return MoEBlock(saved, 1 + (2 if fs else 0), weights, cached_weights, working_set)


def estimate_memory(cfg: ModelConfig, batch_size: int, seq_len: int, dtype: str | torch.dtype = "float32",
                    grad_checkpointing: bool = False, accumulation_steps: int = 1,
                    name: str | None = None) -> MemoryEstimate:
    """Estimate the bytes one AdamW training step of PocketLM(cfg) keeps alive (see the module docstring).

    dtype is the autocast dtype ("float32": none), as a name or a torch.dtype (the trainer's Precision.dtype).
    """
    if isinstance(dtype, torch.dtype):
        dtype = str(dtype).removeprefix("torch.")
    if dtype not in DTYPE_BYTES:
        raise ConfigError(f"dtype {dtype!r}; expected one of {sorted(DTYPE_BYTES)}")
    for flag, value in (("batch_size", batch_size), ("seq_len", seq_len), ("accumulation_steps", accumulation_steps)):
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"{flag} must be a positive integer, got {value!r}")
    if seq_len > cfg.max_position_embeddings:
        raise ConfigError(f"seq_len {seq_len} exceeds max_position_embeddings ({cfg.max_position_embeddings})")
    if cfg.dropout:
        raise ConfigError(f"the estimate models dropout 0, got {cfg.dropout} (dropout saves masks, and attention "
                          "dropout moves SDPA to a kernel that stores the T x T weights)")
    N, d, f, L = batch_size * seq_len, cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    V, H, kv = cfg.vocab_size, cfg.num_attention_heads, cfg.num_key_value_heads * cfg.head_dim
    a = DTYPE_BYTES[dtype]
    autocast = a < 4
    swiglu = cfg.mlp == "swiglu"
    P = cfg.num_parameters()

    parameters = gradients = 4 * P
    buffers = 2 * 4 * cfg.max_position_embeddings * cfg.head_dim if cfg.position_embedding == "rope" else 0
    buffers += 4 * cfg.num_experts * L  # each MoE layer's routing bias (fp32)
    optimizer = 2 * 4 * P + 4 * parameter_tensors(cfg)

    # ---- saved for backward by one block (bytes for all N tokens)
    norm = N * (4 * d + 4 if cfg.norm == "rmsnorm" else 8)  # what a norm keeps besides its input
    accumulating = accumulation_steps > 1
    moe = moe_block(cfg, N, a, accumulating) if cfg.moe else None
    mlp_linears = moe.norm_output_readers if moe else 2 if swiglu else 1
    # fp32: one norm output shared by its linears; autocast: one a-byte copy per linear
    norm_outputs = a * d * N * (3 + mlp_linears) if autocast else 2 * 4 * d * N
    attention = 4 * a * d * N + 4 * H * N
    mlp = moe.saved if moe else (4 if swiglu else 2) * a * f * N
    # linear weights, biases aside
    block_weights = 2 * d * d + 2 * d * kv + (moe.weights if moe else (3 if swiglu else 2) * d * f)
    block_weight_copies = a * block_weights if autocast else 0
    block_input = 4 * d * N
    block = 2 * block_input + 2 * norm + norm_outputs + attention + mlp + block_weight_copies

    # ---- around the blocks: learned positions' int64 ids, the final norm (input, state, output or its copy),
    # the lm_head's weight copy, the loss's log-softmax
    position_ids = 8 * seq_len if cfg.position_embedding == "learned" else 0
    head_weight_copy = a * V * d if autocast else 0
    head = position_ids + block_input + norm + (a if autocast else 4) * d * N + head_weight_copy
    log_probs = 4 * V * N
    logits = a * V * N
    saved_per_block = block_input if grad_checkpointing else block
    activations = L * saved_per_block + head + log_probs
    weight_copies = (0 if grad_checkpointing else L * block_weight_copies) + head_weight_copy

    # ---- gradients as backward makes them: lm_head (the tied embedding's) and final norm first, then block by
    # block from the top. With accumulation, the earlier micro-batches' gradients are all there from the start.
    final_norm_params = d * (2 if cfg.norm == "layernorm" and cfg.bias else 1)
    block_params = (cfg.num_parameters(non_embedding=True) - final_norm_params) // L
    head_grads = 4 * (V * d + final_norm_params)
    # inside the MLP's backward: the gradient arriving from above, down_proj's fp32 weight gradient (under
    # autocast its saved weight copy is released by then), and the gradients of silu(gate) and up (GELU: of its
    # input); the gradient of the product replaces the product itself. A mixture of experts: moe_block.
    block_working_set = (moe.working_set if moe else
                         block_input + 4 * d * f - (a * d * f if autocast else 0) + mlp_linears * a * f * N)

    def block_backward(index: int) -> int:
        """Bytes beyond the persistent ones while backward is inside block `index` (0 = the first block)."""
        # blocks below keep their saved tensors (checkpointed: their inputs); this one is whole (recomputed)
        saved = index * saved_per_block + block
        grads = gradients if accumulating else head_grads + (L - 1 - index) * 4 * block_params
        return saved + grads + block_working_set

    # checkpointing under autocast: the forward leaves every block's cast weights in autocast's cache
    # (a mixture of experts' slices of its stacked weights are no leaves: autocast casts them anew each time)
    cached_block_copies = (block_weight_copies - a * (moe.weights - moe.cached_weights) if moe and autocast
                           else block_weight_copies)
    cached_copies = L * cached_block_copies if grad_checkpointing else 0
    earlier = gradients if accumulating else 0  # the earlier micro-batches' gradients
    moments = {
        "forward end": L * saved_per_block + head + logits + cached_copies + earlier,
        "loss backward": activations + 2 * 4 * V * N + (gradients if accumulating else 0),
        "last block backward": block_backward(L - 1),
        "first block backward": block_backward(0),
        # tied: the embedding's dense gradient and its sum with the lm_head's (a new tensor) before the old goes
        "end of backward": gradients + (2 * 4 * V * d if cfg.tie_word_embeddings else block_input),
    }
    return MemoryEstimate(name or "model", P, L, batch_size, seq_len, dtype, grad_checkpointing, accumulation_steps,
                          parameters, buffers, gradients, optimizer, activations, weight_copies, saved_per_block,
                          logits, moments, cfg.num_experts, cfg.num_experts_per_tok if moe else 0,
                          cfg.num_shared_experts if moe else 0, cfg.num_parameters(active=True))


# ---------------------------------------------------------------------------------------------- measuring
def measured_peak(device: torch.device) -> int | None:
    """Peak bytes of tensors allocated so far on `device`: the CUDA allocator's statistic; None on CPU.

    The CPU allocator keeps no peak, and the process's peak resident set (ru_maxrss) also counts the
    interpreter, libraries, the data and freed memory malloc keeps, so it is no measure of tensors. For a CPU
    figure, profile one step with measure_step_peak.
    """
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return None


def live_tensor_bytes(*holders: torch.nn.Module | torch.optim.Optimizer) -> int:
    """Bytes of the distinct storages that modules (parameters, their gradients, buffers) and optimizers (state)
    hold now."""
    tensors: list[torch.Tensor] = []
    for h in holders:
        if isinstance(h, torch.optim.Optimizer):
            tensors += [v for state in h.state.values() for v in state.values() if torch.is_tensor(v)]
        else:
            tensors += [*h.parameters(), *h.buffers()]
            tensors += [p.grad for p in h.parameters() if p.grad is not None]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


# What the profiler's C++ side prints about itself on file descriptor 2 (Python cannot redirect it): a line when
# it starts and stops, and a warning for each free of memory allocated before it started.
PROFILER_NOISE = ("profiler_start", "profiler_stop", "Memory block of unknown size was allocated before")


@contextlib.contextmanager
def _profiler_noise_filtered() -> Iterator[None]:
    """Collect what file descriptor 2 receives meanwhile and pass it on afterwards, minus PROFILER_NOISE lines, so
    real warnings and errors of the step still reach the user."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            kept = [line for line in caught.read().decode(errors="replace").splitlines(keepends=True)
                    if not any(noise in line for noise in PROFILER_NOISE)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


def measure_step_peak(step: Callable[[], Any], device: torch.device,
                      *holders: torch.nn.Module | torch.optim.Optimizer) -> int:
    """Peak bytes of live tensors during one call of `step` (a whole training step) on `device`.

    CUDA: the allocator's peak, reset first. CPU: the bytes `holders` hold before the call, plus the highest
    running sum of the allocations and frees that torch.profiler records during it. Exact (it is what the
    allocator was asked for), but profiling slows that step, so measure one step, not every one.
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    before = live_tensor_bytes(*holders)
    with _profiler_noise_filtered(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    # "[memory]" events: +bytes for an allocation, -bytes for a free, each with its time (the host kinds are the
    # ones torch.profiler's own tables count as CPU memory)
    host = (DeviceType.CPU, DeviceType.MKLDNN, DeviceType.IDEEP)
    events = sorted((e for e in prof.profiler.kineto_results.events()
                     if e.name() == "[memory]" and e.device_type() in host), key=lambda e: e.start_ns())
    live = highest = 0
    for e in events:
        live += e.nbytes()
        highest = max(highest, live)
    return before + highest
