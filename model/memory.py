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
    Muon state     4M + AdamW's on the rest    --optimizer muon: one fp32 momentum buffer for the M parameters of
                   the hidden matrices; the optimizer step adds, for one matrix at a time, its Newton-Schulz
                   working set (an fp32 momentum blend, bf16 iterates, Gram matrices), below the end of backward
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
    QK-norm        (4 + a) * (d + kv) + 4 * (H + KV)    qk_norm (KV key heads, kv = KV * head_dim wide): RMSNorm
                   keeps the fp32 q and k (under autocast, their fp32 casts), the rsqrt of each head and the
                   normalised q and k (autocast: their a-byte casts). They leave the norms in fp32, so RoPE casts
                   no tables and SDPA casts q and k as before.
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
                   + 4E + 4       router_z_loss_coef > 0: the fp32 router logits and their logsumexp, kept by the
                                  z-loss (with 0 its statistic is made without a graph and keeps nothing)
    norm output    fp32: 4d, shared as for a dense MLP. Autocast: a*d per linear reading it (the router, and the
                   shared experts' gate and up)
    dispatch       8k + 8k        int64: the inverse permutation, kept by the gather (model.model.Dispatch), and
                                  the order, kept by the un-permute (a Dispatch by the inverse)
    token copies   a*kd           the k copies in expert order, one tensor whose slices each expert's gate and up
                                  read; under autocast the tokens are cast once, before the gather
    experts        4 * a*k*e      SwiGLU's gate, silu(gate), up and product for each (token, choice)
    combine        a*kd + a*k     the un-permuted outputs and the gate weights cast to their dtype
    shared         4 * a*S*e      a dense SwiGLU MLP S*e wide
    weight copies  autocast, per block: a * (dE + 3Eed + 3dSe). Experts.forward casts each stacked weight once,
                   all E experts together (its slices' matmuls keep it); the copy is its own, not autocast's
                   cache: under checkpointing only the router's and shared experts' copies stay cached
None of this depends on the routing: the experts' rows add up to N*k however they are shared out.
Backward inside the block, beyond its saved tensors and the gradients made so far: the gradient from above (4d
per token) throughout, under autocast its a-byte cast for the MoE's output until the combine has read it (a*d),
and the largest of these moments, in the order they come:
    z-loss                its nodes run first: its logits and logsumexp go, the logits' gradient (4E per token)
                          waits for the router's
    shared experts        a dense MLP's working set, width S*e. After them their weight gradients stay, and their
                          fp32 gradient of the norm output (4d per token) until the router's joins it; their saved
                          tensors and copies are freed
    combine               2 * a*kd + a*k per token: the gradients of the expert outputs and of their product with
                          the gate weights, and its sum over d. The un-permute's gather then puts the first in
                          expert order (a*kd, held until the last expert) and frees the order and the combine's
                          saved tensors; the gate weights' gradient (4k, fp32) waits for the router's
    each expert           the last first, R = N*k/E rows (a*ed: one expert's slice of a weight gradient). Its
                          down projection's weight gradient and its product's gradient, turned into the gradients
                          of silu(gate) and up: a*ed + 2 * a*e*R (the product and its factors then go); up's weight
                          gradient and its rows' gradient: 2 * a*ed + a*d*R - a*e*R; gate's and the rows' second
                          gradient: 3 * a*ed + 2 * a*d*R - 3 * a*e*R. Each expert leaves three weight-gradient
                          slices and its rows' gradient (a*d*R) and frees its saved tensors (4 * a*e*R); the last
                          one frees the outputs' gradient, the token copies and (autocast) the stacks' copies
    rows joined           the rows' gradients and their concatenation (2 * a*kd per token)
    weight gradients      each stack's slices stacked (UnbindBackward: a*Eed), under autocast then cast to fp32
                          (4Eed), down, up, gate: at the gate's, two fp32 stack gradients, the a-byte stack and its
                          cast, (12 + a) * Eed (fp32: the stack beside its slices). Accumulating, each is added in
                          place and freed: 4Eed + 3 * a*Eed at the first, every slice still there
    dispatch              the rows' gradient gathered by the inverse permutation beside it (2 * a*kd per token),
                          then summed over each token's k copies (a*d)
With gradient checkpointing the block is first recomputed, up to its last saved tensor, with the gradient from
above alive; beyond what is saved, the MoE's forward keeps the fp32 router logits (unless the z-loss saves them),
under autocast the fp32 norm output (nothing saves it), the tokens' a-byte cast (the gather saves its index,
not its source) and the gate weights in fp32 (4k; the combine saves their cast). Its largest moment is the
experts' outputs and their concatenation (2 * a*kd per token; the un-permute's gather, next, holds as much),
before the combine's tensors; or, when shared experts or a z-loss keep the recomputation going past the
combine, its (N, k, d) product and their sum over k (a*kd + a*d), and with shared experts their output added to
the routed one (3 * a*d).
The experts' moments assume balanced routing: an expert that received more rows than N*k/E has a larger one
(2 * a*e per row more). They are seldom the peak (2 experts top-1 with e = 4d; 4 experts top-2 with e = 3d and a
z-loss at batch 4 x 64; both checkpointed, fp32: -1.1% to +1.0% from run to run); the presets' and the tests'
peaks are the combine's, the recomputation's or the weight gradients', which the routing does not move.

Not modelled, each well under 1% of the total for the presets: the autocast copies of the RoPE tables
(O(seq_len) per block), checkpointing's saved RNG state, and oneDNN's scratch buffers for bf16 matmuls on CPU.
Not covered: torch.compile (it fuses ops and saves less), DDP (gradient buckets add about one more copy of the
gradients), DeepSpeed ZeRO (it shards the optimizer state), dropout > 0, and the MoE's grouped-matmul path (CUDA
with bf16 autocast; not measured, no GPU here: it saves the same tensors, but makes each stack's weight gradient
in one piece rather than expert by expert, so where an expert's moment is the peak the estimate should be high).

Checked against measured peaks (tests/test_memory.py; measure_step_peak profiles every allocation of one step
on CPU): 2-layer models within 0.25% in fp32 and 3.5% in bf16; minimind-26m at batch 8 x 512 within 0.12%.
With QK-norm the activations are exact in fp32 and bf16, the peaks as close as without it (2-layer models: 0.0% to
+0.5% in fp32, -0.5% in bf16 with checkpointing).
Mixtures of experts (2 layers, d 128, 4 experts top-2, with and without a shared expert, with a z-loss, with
checkpointing; and shapes whose peak is the combine's or the recomputation's): within 0.03% in fp32 and 0.08% in
bf16/fp16 (the RoPE tables' casts); -0.48% with accumulation in fp32 (the tied embedding's gradient that each
later micro-batch's backward holds until the embedding's own arrives, 4Vd, which the formula leaves out).
minimind-26m-moe at batch 8 x 512 in bf16: -0.08% (at the loss backward), with checkpointing -0.02% (in the
first block's recomputation).
"""
from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, Iterator, NamedTuple

import torch

from common.device import dtype_name, synchronize
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
    optimizer_name: str = "adamw"  # whose state `optimizer` counts: adamw, or muon (+ AdamW on the rest)

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
    def state_name(self) -> str:
        return "Muon state" if self.optimizer_name == "muon" else "AdamW state"

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
                (self.state_name, self.optimizer, "Muon momentum of the hidden matrices + AdamW's on the rest, fp32"
                 if self.optimizer_name == "muon" else "exp_avg + exp_avg_sq, fp32"),
                ("activations", self.activations, f"saved for backward: {saved} + final norm and loss{copies}"),
                ("logits", self.logits, "until the loss is computed"),
                ("total (peak)", self.peak, f"at the {self.peak_moment}: parameters + buffers + {self.state_name} + "
                                            f"{fmt(self.moments[self.peak_moment])}")]
        out = [f"memory for one training step: {self.label}"]
        out += [f"  {name:<14}{fmt(n):>11}  {note}" for name, n, note in rows]
        out.append(f"  held beyond parameters + buffers + {self.state_name}, at each moment that may be the peak:")
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
    block += 2 if cfg.qk_norm else 0  # q_norm, k_norm
    return (1 + (cfg.position_embedding == "learned") + cfg.num_hidden_layers * block + norm
            + (not cfg.tie_word_embeddings))


def hidden_matrix_shapes(cfg: ModelConfig) -> list[tuple[int, int]]:
    """The (out, in) shapes of the hidden matrices --optimizer muon orthogonalises (trainer_utils/optim.py
    is_hidden_matrix), in closed form: each block's attention projections (q, k, v, o) and its dense MLP (a mixture
    of experts: the shared experts' MLP, one of num_shared_experts x moe_intermediate_size; routers and the 3-D
    expert stacks stay on AdamW). Building even a meta-device model to read them takes ~0.1 s a config, which a
    plan over 48 depths paid on every run."""
    d, kv = cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim
    if cfg.moe:
        f = cfg.moe_intermediate_size * cfg.num_shared_experts
        mlp = [(f, d), (f, d), (d, f)] if f else []
    else:
        f = cfg.intermediate_size
        mlp = [(f, d), (f, d), (d, f)] if cfg.mlp == "swiglu" else [(f, d), (d, f)]
    return [(d, d), (kv, d), (kv, d), (d, d), *mlp] * cfg.num_hidden_layers


def muon_matrices(cfg: ModelConfig) -> tuple[int, int]:
    """(parameters, tensors) of the hidden matrices (hidden_matrix_shapes)."""
    shapes = hidden_matrix_shapes(cfg)
    return sum(m * n for m, n in shapes), len(shapes)


class MoEBlock(NamedTuple):
    """What one mixture-of-experts MLP adds to its block (bytes for all N tokens; module docstring, "Mixture of
    experts")."""

    saved: int  # saved for backward, besides the post-attention norm's output (fp32) or its casts (autocast)
    norm_output_readers: int  # linears that read the norm's output: the router, and the shared experts' gate, up
    weights: int  # elements of its weights that a linear reads (autocast copies one a-byte copy of each)
    cached_weights: int  # ... of them, those autocast caches: leaves (router, shared experts), not expert slices
    working_set: int  # the largest moment of its backward, beyond the block's saved tensors and earlier gradients
    largest: str  # which moment that is (moe_block's names)


def expert_moments(held: int, E: int, e: int, d: int, a: int, Nk: int, stack_copy: int) -> dict[str, int]:
    """The moments of the routed experts' backward (`held`: bytes beyond the saved tensors when it begins;
    `stack_copy`: one weight stack's autocast copy). The last expert first, Nk / E rows each. Inside one: the
    down projection's weight gradient (a*ed, a slice of its stack's) and its product's gradient, which becomes
    the gradients of silu(gate) and up (step 2, the product and its factors freed); up's weight gradient and its
    rows' gradient (a*d per row; step 3); silu's backward; gate's weight gradient and its rows' second gradient,
    added into the first (step 5). An expert leaves three weight-gradient slices and its rows' gradient, and
    frees its saved tensors; the last one frees the outputs' gradient (in its down projection) and the gathered
    tokens (in its gate), and under autocast each stack's weight copy as its last slice is done with (down, up,
    gate)."""
    rows, moments = Nk // E, {}
    for i in range(E):  # i experts done, expert E - 1 - i running
        last = i == E - 1
        base = held + i * (3 * a * e * d + a * d * rows - 4 * a * e * rows) - (a * d * Nk if last else 0)
        freed = stack_copy if last else 0  # the down projection's copy; at step 5, up's too
        moments[f"expert {E - 1 - i} step 2"] = base + a * e * d + 2 * a * e * rows - freed
        moments[f"expert {E - 1 - i} step 3"] = base + 2 * a * e * d + a * d * rows - a * e * rows - freed
        moments[f"expert {E - 1 - i} step 5"] = base + 3 * a * e * d + 2 * a * d * rows - 3 * a * e * rows - 2 * freed
    return moments


def moe_block(cfg: ModelConfig, N: int, a: int, accumulating: bool, recomputed: bool) -> MoEBlock:
    """The saved tensors and backward working set of model.model.MoE, traced op by op (module docstring)."""
    d, E, k, e = cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
    fs = cfg.num_shared_experts * e  # the shared experts: one dense SwiGLU MLP this wide
    autocast = a < 4
    z_loss = cfg.router_z_loss_coef > 0  # otherwise the z statistic is computed without a graph
    Nk = N * k  # (token, choice) pairs; an expert gets Nk / E of them when routing is balanced

    # ---- saved in forward
    # router: probs (softmax, fp32), the choices (int64, for the gather), the gathered weights and their sum
    # (normalising division), and with a z-loss the fp32 router logits and their logsumexp
    router = (4 * E * N + 8 * Nk + ((4 * Nk + 4 * N) if cfg.norm_topk_prob else 0)
              + ((4 * E * N + 4 * N) if z_loss else 0))
    dispatch = 8 * Nk + 8 * Nk  # int64: the gather's inverse permutation, and the un-permute's (the order)
    # the tokens' k copies in expert order, one tensor whose slices the experts' gate and up read: a-byte, as
    # under autocast the tokens are cast once, before the gather
    gathered = a * d * Nk
    experts = 4 * a * e * Nk  # SwiGLU: gate, silu(gate), up and their product, per (token, choice)
    combine = a * d * Nk + a * Nk  # the un-permuted outputs and the gate weights (cast to their dtype)
    shared = 4 * a * fs * N
    saved = router + dispatch + gathered + experts + combine + shared
    weights = d * E + 3 * E * e * d + 3 * d * fs
    cached_weights = d * E + 3 * d * fs  # the stacks' copies are Experts.forward's own, not autocast's
    shared_casts = (2 * a * d * N + 3 * a * d * fs) if autocast and fs else 0  # their norm-output casts, copies

    # ---- backward, relative to the block's saved tensors and the gradients made so far; the gradient arriving
    # from above (4d per token) is there throughout, and under autocast its a-byte cast for the MoE's output
    # (the residual add's backward) until the combine's backward has read it.
    incoming = 4 * d * N
    out_grad = a * d * N if autocast else 0
    # checkpointing: the block is recomputed first, up to its last saved tensor. Alive besides what is saved:
    # the fp32 router logits (unless the z-loss saves them), the gate weights in fp32 under autocast (the
    # combine saves their cast), and under autocast the fp32 norm output (which nothing saves) and the tokens'
    # a-byte cast (the gather saves its index, not its source). The largest moments: the experts' outputs
    # joined into one tensor (Experts.forward's cat; the un-permute's gather, next, holds as much), when the
    # combine's, the shared experts' and the z-loss's tensors are not made yet; if shared experts or a z-loss
    # keep the recomputation going past the combine, its (N, k, d) product and the sum over k; and with shared
    # experts, their output added to the routed one (three a*d tensors per token).
    moments = {}
    if recomputed:
        alive = (out_grad + ((4 + a) * d * N + 4 * Nk if autocast else 0)  # flat, its cast, fp32 gate weights
                 + (-4 * N if z_loss else 4 * E * N))  # the logsumexp is not made yet / the logits are alive
        later = shared + shared_casts  # the shared experts run after the combine
        moments["recomputed forward"] = max(
            [alive - later - a * d * Nk - (a * Nk if autocast else 0) + 2 * a * d * Nk]
            + ([alive - later + a * d * Nk + a * d * N] if fs or z_loss else [])
            + ([alive + 3 * a * d * N] if fs else []))
    # The z-loss's nodes run first: its logits and their logsumexp go, the logits' gradient (4E per token)
    # waits for the router's.
    held = -4 * N if z_loss else 0
    # the shared experts next (their nodes are newer than the routed path's): a dense MLP's working set inside
    # them; after them their gradients stay (unless accumulated into existing ones) and so does their gradient
    # of the norm output, waiting for the router's; their saved tensors and weight copies are gone.
    if fs:
        moments["shared experts"] = held + out_grad + 4 * d * fs - (a * d * fs if autocast else 0) + 2 * a * fs * N
        held += (0 if accumulating else 3 * 4 * d * fs) + 4 * d * N - shared - shared_casts
    # the combine: the gradients of the un-permuted outputs and of their product with the gate weights, summed
    # over d into the weights' gradient (fp32 once cast back); the un-permute's gather then puts the outputs'
    # gradient in expert order; its saved order and the combine's saved tensors are freed
    moments["combine"] = held + out_grad + 2 * a * d * Nk + a * Nk
    held += a * d * Nk + 4 * Nk - combine - 8 * Nk
    # the experts, the last first (expert_moments)
    stack_copy = a * E * e * d if autocast else 0  # one stack's weight copy
    moments.update(expert_moments(held, E, e, d, a, Nk, stack_copy))
    # after them: three stacks of weight-gradient slices and the rows' gradients (joined into one tensor, a*d
    # per pair: a moment with both); the outputs' gradient, gathered tokens, saved tensors and copies are gone
    held += 3 * a * E * e * d - gathered - experts - 3 * stack_copy
    moments["rows' gradients joined"] = held + a * d * Nk
    # each stack's gradient: its slices stacked (UnbindBackward), under autocast cast to fp32 (ToCopyBackward);
    # down, up, then gate. The largest moment is the last one: two fp32 gradients made, the third being cast
    # from its a-byte stack (fp32: stacked beside its slices). Accumulating, each is added into the existing
    # gradient and freed: the largest moment is the first, with every slice still there.
    weight_grads = (3 * a + 4) * E * e * d if accumulating else (12 + a) * E * e * d
    moments["expert weight gradients"] = held - 3 * a * E * e * d + weight_grads
    held += (0 if accumulating else 12 * E * e * d) - 3 * a * E * e * d
    # the dispatch's backward: the rows' gradient gathered by the inverse permutation (a*d per pair) beside it,
    # then summed over each token's k copies (a*d per token)
    moments["dispatch backward"] = held + a * d * Nk + (a * d * N if k > 1 else 0)
    largest = max(moments, key=moments.__getitem__)
    return MoEBlock(saved, 1 + (2 if fs else 0), weights, cached_weights, incoming + moments[largest], largest)


def checked_inputs(cfg: ModelConfig, batch_size: int, seq_len: int, dtype: str | torch.dtype,
                   accumulation_steps: int, optimizer: str) -> str:
    """The dtype's name, once every input is one the estimate models (ConfigError naming the one that is not)."""
    if optimizer not in ("adamw", "muon"):
        raise ConfigError(f"optimizer {optimizer!r}; the estimate knows adamw and muon")
    if isinstance(dtype, torch.dtype):
        dtype = dtype_name(dtype)
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
    return dtype


def persistent_state(cfg: ModelConfig, optimizer: str) -> tuple[int, int]:
    """Bytes of the buffers (RoPE's tables, the routing biases) and of the optimizer's state, both fp32."""
    P = cfg.num_parameters()
    buffers = 2 * 4 * cfg.max_position_embeddings * cfg.head_dim if cfg.position_embedding == "rope" else 0
    buffers += 4 * cfg.num_experts * cfg.num_hidden_layers  # each MoE layer's routing bias
    if optimizer == "muon":  # a momentum buffer for each hidden matrix; AdamW's two moments and step on the rest
        matrices, tensors = muon_matrices(cfg)
        return buffers, 4 * matrices + 2 * 4 * (P - matrices) + 4 * (parameter_tensors(cfg) - tensors)
    return buffers, 2 * 4 * P + 4 * parameter_tensors(cfg)


def block_saved(cfg: ModelConfig, N: int, a: int, moe: MoEBlock | None, norm: int) -> tuple[int, int]:
    """What one block saves for backward (bytes for all N tokens; a norm keeps `norm` besides its input), and the
    autocast copies of its linear weights (biases aside) among them."""
    d, f, H = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads
    kv = cfg.num_key_value_heads * cfg.head_dim
    autocast, swiglu = a < 4, cfg.mlp == "swiglu"
    mlp_linears = moe.norm_output_readers if moe else 2 if swiglu else 1
    # fp32: one norm output shared by its linears; autocast: one a-byte copy per linear
    norm_outputs = a * d * N * (3 + mlp_linears) if autocast else 2 * 4 * d * N
    attention = 4 * a * d * N + 4 * H * N
    if cfg.qk_norm:  # per query / key head: the fp32 input (autocast: a cast), its rsqrt, the output (a-byte cast)
        attention += (4 + a) * (d + kv) * N + 4 * (H + cfg.num_key_value_heads) * N
    mlp = moe.saved if moe else (4 if swiglu else 2) * a * f * N
    block_weights = 2 * d * d + 2 * d * kv + (moe.weights if moe else (3 if swiglu else 2) * d * f)
    weight_copies = a * block_weights if autocast else 0
    return 2 * 4 * d * N + 2 * norm + norm_outputs + attention + mlp + weight_copies, weight_copies


def estimate_memory(cfg: ModelConfig, batch_size: int, seq_len: int, dtype: str | torch.dtype = "float32",
                    grad_checkpointing: bool = False, accumulation_steps: int = 1,
                    name: str | None = None, optimizer: str = "adamw") -> MemoryEstimate:
    """Estimate the bytes one training step of PocketLM(cfg) keeps alive (see the module docstring).

    dtype is the autocast dtype ("float32": none), as a name or a torch.dtype (the trainer's Precision.dtype);
    optimizer is "adamw" or "muon" (trainer_utils/optim.py: Muon on the hidden matrices, AdamW on the rest).
    """
    dtype = checked_inputs(cfg, batch_size, seq_len, dtype, accumulation_steps, optimizer)
    N, d, f, L = batch_size * seq_len, cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    V, a = cfg.vocab_size, DTYPE_BYTES[dtype]
    autocast = a < 4
    swiglu = cfg.mlp == "swiglu"
    P = cfg.num_parameters()
    parameters = gradients = 4 * P
    buffers, optimizer_state = persistent_state(cfg, optimizer)

    accumulating = accumulation_steps > 1
    moe = moe_block(cfg, N, a, accumulating, grad_checkpointing) if cfg.moe else None
    mlp_linears = moe.norm_output_readers if moe else 2 if swiglu else 1
    norm = N * (4 * d + 4 if cfg.norm == "rmsnorm" else 8)  # what a norm keeps besides its input
    block_input = 4 * d * N
    block, block_weight_copies = block_saved(cfg, N, a, moe, norm)

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
                          parameters, buffers, gradients, optimizer_state, activations, weight_copies,
                          saved_per_block, logits, moments, cfg.num_experts, cfg.num_experts_per_tok if moe else 0,
                          cfg.num_shared_experts if moe else 0, cfg.num_parameters(active=True), optimizer)


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
                      *holders: torch.nn.Module | torch.optim.Optimizer) -> int | None:
    """Peak bytes of live tensors during one call of `step` (a whole training step) on `device`.

    CUDA: the allocator's peak, reset first. CPU: the bytes `holders` hold before the call, plus the highest
    running sum of the allocations and frees that torch.profiler records during it. Exact (it is what the
    allocator was asked for), but profiling slows that step, so measure one step, not every one. MPS: None (the
    step runs unmeasured): Metal's allocator keeps no peak and the CPU profiler does not see its allocations.
    """
    if device.type == "mps":
        step()
        return None
    if device.type == "cuda":
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        synchronize(device)
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
