"""Which model to pretrain in the time you have: `python -m model --plan --time_budget 2h [--data_path F]`.

Each preset takes real training steps on this device, as train_pretrain.py would take them (its default
optimizer, the precision policy's dtype, random tokens of the full context), and the table says what a budget
buys with it: tokens per second, tokens trained in the budget, tokens per parameter, epochs of the data, peak
memory. The recommendation follows the compute-optimal rule of thumb, about TOKENS_PER_PARAMETER training tokens
per parameter (Hoffmann et al. 2022): the preset whose tokens per parameter in the budget is nearest to it, among
those that fit in memory, counting at most MAX_EPOCHS passes over the data (repeating data beyond ~4 epochs adds
little: Muennighoff et al. 2023). Figures are marked measured or estimated: a preset whose step would take too
long to time here is estimated from the FLOP rate measured on the largest preset timed before it, and memory is
model/memory.py's estimate except on CUDA, where the timed step's peak is measured.
"""
from __future__ import annotations

import json
import math
import os
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch

from common.device import NEWTON_SCHULZ_STEPS, choose_dtype, dtype_name, parse_device, precision_policy, timed
from common.errors import ConfigError, DataError
from model import PocketLM
from model.config import PRESETS, get_preset
from model.memory import estimate_memory

from .backend import Comm, TorchBackend
from .budget import format_duration
from .config import OptimConfig
from .metrics import flops_per_token
from .objectives import LanguageModeling
from .optim import is_hidden_matrix, optimizer_for
from .routing import RouterBalance
from .runtime import Precision, tune_allocator
from .step import Step

TOKENS_PER_PARAMETER = 20
MAX_EPOCHS = 4
TRAINING_SHARE = 0.9  # of a budget spent in training steps: setting up, evaluations and checkpoints take the rest
TEST_PRESETS = ("tiny",)  # the tests' model (a 64-wide toy): never a candidate
OPTIMIZER = "muon"  # pretraining's default (--optimizer auto without DeepSpeed)
MEMORY_SHARE = 0.85  # of the device's memory a plan may fill (the allocator, the CUDA context, fragmentation)
BATCHES = (64, 32, 16, 8, 4, 2, 1)  # on a GPU, the largest that fits is timed and recommended
CPU_BATCH = 1  # a CPU times one sequence a step (a full 26M step of 8 x 512 takes ~15 s on 2 cores)...
CPU_BATCHES = (8, 4, 2, 1)  # ...and its tokens/s are those of the largest of these that fits, its command's batch
# A run planned for fewer steps than SHORT_RUN_STEPS gets the demo recipe's settings (recipes/demo-pretrain.yaml):
# QK-norm, which keeps attention logits bounded at a high learning rate, and that learning rate with a short
# warm-up. The presets' default, 5e-4, is for runs of many thousand steps: in 10 minutes on a 2-core CPU (~140
# steps) it left mini-30m at val loss 5.23 (dev/LOG.md, 2026-12-05).
SHORT_RUN_STEPS = 1000
SHORT_RUN_FLAGS = ("--qk_norm", "--learning_rate 4e-3", "--warmup_steps 20")
SAMPLE_BYTES = 2 << 20  # of --data_path read to estimate its tokens
VOCAB_SIZE = 6400  # the shipped tokenizer's, which the trainers give a new model


@dataclass
class PresetRow:
    """One preset's line of the plan."""

    name: str
    parameters: int
    batch_size: int
    seq_len: int
    tokens_per_s: float | None  # None: does not fit
    speed_measured: bool
    peak_bytes: int
    peak_measured: bool
    fits: bool
    budget_tokens: float = 0.0
    trained_tokens: float = 0.0  # within MAX_EPOCHS of the data
    epochs: float | None = None

    @property
    def tokens_per_parameter(self) -> float:
        return self.trained_tokens / self.parameters


def device_memory(device: torch.device) -> int:
    """Bytes a plan may fill: the GPU's memory, or the machine's RAM for a CPU (or MPS, which shares it)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 << 30


def data_tokens(path: Path, tokenizer_dir: Path | None = None) -> int:
    """The tokens of a pretraining JSONL file, estimated from its first SAMPLE_BYTES with the shipped tokenizer
    (DataError naming the file and line for a record that is not a JSON object with a "text")."""
    from dataset.tokenizer import DEFAULT_TOKENIZER_DIR, Tokenizer

    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            sample = f.read(SAMPLE_BYTES)
    except OSError as e:
        raise DataError(f"--data_path {path}: {e.strerror}") from None
    lines = sample.split(b"\n")
    if len(sample) == SAMPLE_BYTES and len(lines) > 1:
        lines = lines[:-1]  # the last line is cut: leave it out of the ratio
    tok = Tokenizer(tokenizer_dir or DEFAULT_TOKENIZER_DIR)
    n_bytes = n_tokens = 0
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            text = json.loads(line)["text"]
            if not isinstance(text, str):
                raise TypeError
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
            raise DataError(f"{path}:{number}: expected a JSON object with a \"text\" string (a pretraining "
                            "record)") from None
        n_bytes += len(line) + 1
        n_tokens += len(tok.encode(text)) + 1  # and the document separator
    if n_bytes == 0:
        raise DataError(f"{path}: no records")
    return round(size * n_tokens / n_bytes)


@dataclass
class StepTime:
    """A timed step: seconds of its forward and backward (which grow with the batch) and of its update (which
    does not: Muon's Newton-Schulz iteration costs the same for any batch)."""

    backward_s: float
    update_s: float
    peak_bytes: int | None  # measured on CUDA

    def step_s(self, batch_ratio: float = 1.0) -> float:
        """A step's seconds at `batch_ratio` times the timed batch."""
        return batch_ratio * self.backward_s + self.update_s


def time_steps(cfg, device: torch.device, precision: Precision, batch: int, seq_len: int,
               min_seconds: float) -> StepTime:
    """A steady step's parts, as pretraining takes them: the loop's forward and backward (trainer_utils/step.py)
    of the next-token loss on random tokens of the whole vocabulary, then the single-process backend's update
    (clipping, the optimizer, clearing the gradients) with pretraining's optimizer at its default settings. After
    a warm-up step; timed until min_seconds and at least 2 steps; the median."""
    step = pretraining_step(cfg, device, precision, batch, seq_len)
    step()  # warm-up: allocation, kernel choice, the optimizer's state
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    parts: list[tuple[float, float]] = []
    while len(parts) < 2 or sum(map(sum, parts)) < min_seconds:
        parts.append((timed(step.backward, device), timed(step.update, device)))
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    del step  # its model and optimizer, before the next preset is built
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return StepTime(statistics.median(b for b, _ in parts), statistics.median(u for _, u in parts), peak)


@dataclass
class PretrainingStep:
    """A pretraining step of a new model on one batch: `backward()` then `update()`, as the loop takes them."""

    step: Step
    backend: TorchBackend
    micro: list[tuple[torch.Tensor, torch.Tensor]]
    n_valid: torch.Tensor

    def backward(self) -> None:
        if self.step.router is not None:  # as the loop does before each step: the step's input tokens
            self.step.router.start_step(self.n_valid)
        self.step.backward(self.micro, self.n_valid)

    def update(self) -> None:
        self.backend.step()

    def __call__(self) -> None:
        self.backward()
        self.update()


def pretraining_step(cfg, device: torch.device, precision: Precision, batch: int, seq_len: int) -> PretrainingStep:
    """A new model of `cfg` on `device`, pretraining's optimizer at its defaults, and a batch of random tokens."""
    model = PocketLM(cfg).to(device)
    optim = OptimConfig(optimizer=OPTIMIZER)
    backend = TorchBackend(Comm(), device, precision, optim.grad_clip)
    wrapped, _ = backend.wrap(model, lambda m: optimizer_for(m, optim, device))
    router = RouterBalance(cfg, backend, device) if cfg.moe else None
    x = torch.randint(0, cfg.vocab_size, (batch, seq_len), device=device)
    return PretrainingStep(Step(model, wrapped, LanguageModeling(), backend, router), backend, [(x, x.roll(-1, 1))],
                           torch.tensor(float(x.numel()), device=device))


def newton_schulz_flops(cfg, steps: int = NEWTON_SCHULZ_STEPS) -> float:
    """FLOPs of one Muon update's Newton-Schulz iterations (`steps` per matrix, each 4 m^2 n + 2 m^3 for an
    m x n matrix with m <= n) over the matrices Muon takes: what an update costs beyond AdamW's few per weight."""
    with torch.device("meta"):
        model = PocketLM(cfg)
    total = 0.0
    for name, p in model.named_parameters():
        if is_hidden_matrix(name, p):
            m, n = sorted(p.shape)
            total += steps * (4 * m * m * n + 2 * m ** 3)
    return total


def plan(budget_s: float, device_name: str = "auto", data_path: str | None = None,
         presets: list[str] | None = None, seq_len: int | None = None, max_step_s: float = 20.0,
         min_seconds: float = 2.0) -> tuple[list[PresetRow], PresetRow | None, str, str]:
    """The rows of every preset, the recommended one (None when none fits), why, and the run header. Sequences
    are seq_len tokens, or each preset's context (what the trainers use by default)."""
    names = presets or [n for n in PRESETS if n not in TEST_PRESETS]
    for n in names:
        get_preset(n)  # an unknown name is a ConfigError now
    device = parse_device(device_name)
    choice = choose_dtype("auto", device, "train")
    precision = Precision(device, choice.dtype)
    memory = device_memory(device)
    n_data = data_tokens(Path(data_path)) if data_path else None
    # from the cheapest step to the dearest, so an estimate scales the nearest measured FLOP rate
    configs = sorted(((n, get_preset(n, vocab_size=VOCAB_SIZE)) for n in names),
                     key=lambda nc: flops_per_token(nc[1], seq_len or nc[1].max_seq_len))
    rows: list[PresetRow] = []
    last: tuple[float, float] | None = None  # the last timed preset's FLOP/s: forward and backward, update
    for name, cfg in configs:
        seq = seq_len or cfg.max_seq_len
        # the batch the command line trains with: the largest that fits (memory judged at that batch); a GPU times
        # that batch, a CPU one sequence, scaled (its forward and backward grow with the batch, its update does not)
        batches = BATCHES if device.type == "cuda" else CPU_BATCHES  # both end at 1
        peaks = {b: estimate_memory(cfg, b, seq, choice.dtype, optimizer=OPTIMIZER).peak for b in batches}
        fitting = [b for b in batches if peaks[b] <= MEMORY_SHARE * memory]
        if not fitting:
            rows.append(PresetRow(name, cfg.num_parameters(), 1, seq, None, False, peaks[1], False, False))
            continue
        batch = fitting[0]
        timed_batch = batch if device.type == "cuda" else CPU_BATCH
        fb_flops = flops_per_token(cfg, seq) * timed_batch * seq
        ns_flops = newton_schulz_flops(cfg, precision_policy(device).newton_schulz_steps)
        if last is not None and (fb_flops / last[0] + ns_flops / last[1]) * 3 > max_step_s:  # too long to time
            t, measured, peak = StepTime(fb_flops / last[0], ns_flops / last[1], None), False, None
        else:
            t = time_steps(cfg, device, precision, timed_batch, seq, min_seconds)
            measured, peak = True, t.peak_bytes
            last = (fb_flops / t.backward_s, ns_flops / max(t.update_s, 1e-9) if ns_flops else float("inf"))
        rows.append(PresetRow(name, cfg.num_parameters(), batch, seq,
                              batch * seq / t.step_s(batch / timed_batch), measured,
                              peak if peak is not None else peaks[batch], peak is not None, True))
    for row in rows:
        if row.fits:
            buy(row, budget_s, n_data)
    best = recommend(rows)
    header = (f"time budget {format_duration(budget_s)} on {device} ({dtype_name(choice.dtype)}: {choice.reason}); "
              f"{TRAINING_SHARE:.0%} of it in training steps"
              + (f"; {data_path}: about {n_data / 1e6:,.1f}M tokens (estimated from its first "
                 f"{SAMPLE_BYTES >> 20} MB)" if n_data else ""))
    return rows, best, why(best, rows, n_data), header


def buy(row: PresetRow, budget_s: float, n_data: int | None) -> None:
    """Fill in what the budget buys with a preset that fits: its tokens, those within MAX_EPOCHS of the data
    (n_data tokens; None: unknown, no limit), and the epochs the budget would read."""
    row.budget_tokens = row.tokens_per_s * TRAINING_SHARE * budget_s
    row.trained_tokens = min(row.budget_tokens, MAX_EPOCHS * n_data) if n_data else row.budget_tokens
    row.epochs = row.budget_tokens / n_data if n_data else None


def recommend(rows: list[PresetRow]) -> PresetRow | None:
    """The preset that fits whose tokens per parameter are nearest TOKENS_PER_PARAMETER (by ratio: 10 and 40 are
    as far from 20); None when none fits."""
    return min((r for r in rows if r.fits), key=lambda r: abs(math.log(r.tokens_per_parameter / TOKENS_PER_PARAMETER)),
               default=None)


def why(best: PresetRow | None, rows: list[PresetRow], n_data: int | None) -> str:
    """The recommendation in words: why not a larger preset, when the budget would buy more than the rule asks."""
    if best is None:
        return "no preset fits in this device's memory even at batch 1"
    tpp = best.tokens_per_parameter
    text = (f"{best.name}: {tpp:.3g} tokens per parameter in the budget, the nearest to the ~{TOKENS_PER_PARAMETER} "
            "of compute-optimal training (Hoffmann et al. 2022)")
    if n_data is not None and best.trained_tokens < best.budget_tokens:
        text += (f"; the data is the limit: the budget would read it {best.epochs:.3g} times, and past "
                 f"{MAX_EPOCHS} epochs repeating adds little, so larger presets would need more text")
    elif tpp < TOKENS_PER_PARAMETER / 4:
        text += "; the budget is short for every preset, so the smallest learns the most"
    elif tpp > TOKENS_PER_PARAMETER * 4:
        larger = sorted((r for r in rows if r.parameters > best.parameters), key=lambda r: r.parameters)
        too_big = [r.name for r in larger if not r.fits]
        nxt = next((r for r in larger if r.fits), None)
        if too_big:
            text += f"; {', '.join(too_big)} {'does' if len(too_big) == 1 else 'do'} not fit in memory"
        if nxt is not None:  # nearer the rule by tokens, yet farther by ratio
            text += (f"; the next larger that fits, {nxt.name}, would train {nxt.tokens_per_parameter:.3g} tokens "
                     "per parameter, farther from it")
        elif not larger:
            text += "; it is the largest preset planned"
    return text


def command(best: PresetRow, budget: str, data_path: str | None) -> str:
    """The train_pretrain.py line that trains the recommendation in the budget."""
    batch = best.batch_size
    epochs = max(1, min(MAX_EPOCHS, math.ceil(best.epochs))) if best.epochs else None
    parts = ["python train_pretrain.py", f"--preset {best.name}", f"--data_path {data_path or 'YOUR.jsonl'}",
             f"--time_budget {budget}", f"--batch_size {batch}"]
    if epochs and epochs > 1:
        parts.append(f"--epochs {epochs}")  # --epochs bounds a budget run: let it use the time
    if best.trained_tokens / (batch * best.seq_len) < SHORT_RUN_STEPS:
        parts.extend(SHORT_RUN_FLAGS)
    return " ".join(parts)


def table(rows: list[PresetRow], best: PresetRow | None) -> str:
    """The plan as a Markdown table; (est.) marks estimated figures."""
    def tokens(x: float) -> str:
        return f"{x / 1e9:,.2f}B" if x >= 1e9 else f"{x / 1e6:,.1f}M" if x >= 1e5 else f"{x / 1e3:,.1f}K"

    lines = ["| preset | params | batch | tokens/s | tokens in budget | tokens/param | epochs of data | peak memory |",
             "|---|--:|--:|--:|--:|--:|--:|--:|"]
    for r in rows:
        mark = " ⭐" if r is best else ""
        memory = f"{r.peak_bytes / 2**30:,.2f} GiB" + ("" if r.peak_measured else " (est.)")
        if not r.fits:
            lines.append(f"| {r.name}{mark} | {r.parameters / 1e6:.1f}M | – | does not fit | – | – | – | {memory} |")
            continue
        speed = f"{r.tokens_per_s:,.0f}" + ("" if r.speed_measured else " (est.)")
        epochs = f"{r.epochs:.2g}" if r.epochs is not None else "–"
        lines.append(f"| {r.name}{mark} | {r.parameters / 1e6:.1f}M | {r.batch_size}×{r.seq_len} | {speed} | "
                     f"{tokens(r.budget_tokens)} | {r.tokens_per_parameter:.3g} | {epochs} | {memory} |")
    return "\n".join(lines)


def main(budget: str, device: str, data_path: str | None, presets: list[str] | None) -> int:
    """`python -m model --plan`: print the table, the recommendation and its command line."""
    from .budget import parse_duration

    if budget is None:
        raise ConfigError("--plan needs --time_budget (90s, 10m, 2h)")
    tune_allocator()  # steps are timed as training takes them
    rows, best, reason, header = plan(parse_duration(budget), device, data_path, presets)
    print(header)
    print(table(rows, best))
    print(f"recommended: {reason}")
    if best is not None:
        print(f"  {command(best, budget, data_path)}")
    print("tokens/s: measured by timing training steps here (est.: scaled from the last measured preset's FLOP rate); "
          "peak memory: model/memory.py's estimate (est.), measured on CUDA")
    return 0
