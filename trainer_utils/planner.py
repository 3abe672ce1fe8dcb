"""Which model to pretrain in the time you have: `python -m model --plan --time_budget 2h [--data_path F]`, and
what `train_pretrain.py --preset auto` trains.

The candidates are the depth family (`--preset depth-N`, model/config.py: one knob, every other dimension derived
from it), or the presets named. A candidate's tokens per second are measured by taking real training steps on this
device, as train_pretrain.py takes them (pretraining's optimizer, the precision policy's dtype, the recipe's batch
of random tokens); what the budget buys is those tokens per second times TRAINING_SHARE of it, counting at most
MAX_EPOCHS passes over the data (repeating data beyond ~4 epochs adds little: Muennighoff et al. 2023). The loss
model (trainer_utils/loss_model.py, fitted on short runs of the bundled corpus) turns a model's size and those
tokens into the validation loss it can expect at the end, and the plan picks the candidate that expects the lowest:
a larger model learns more from each token, a smaller one reads more of them in the same time.

Only a few candidates are timed: the cheapest first, then the best expected and its two neighbours, again until
they are all timed (or too slow to time). The others are estimated from the FLOP rate of the timed candidate
nearest them in FLOPs per token. Memory is model/memory.py's estimate except on CUDA, where the timed step's peak
is measured.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from common.device import NEWTON_SCHULZ_STEPS, choose_dtype, dtype_name, parse_device, precision_policy, timed
from common.errors import ConfigError, DataError
from dataset.config import parse_source
from model import PocketLM
from model.config import DEPTH_PREFIX, MAX_DEPTH, get_preset
from model.memory import estimate_memory, hidden_matrix_shapes

from .backend import Comm, TorchBackend
from .budget import format_duration
from .checkpoint import latest_checkpoint
from .config import AUTO_PRESET, OptimConfig, TrainConfig
from .distributed import detect_env
from .loss_model import FIT_DATA, FIT_RESULTS, FIT_SIZES, RECIPE, SHIPPED, LossModel, recipe_flags
from .metrics import flops_per_token
from .objectives import LanguageModeling
from .optim import optimizer_for
from .routing import RouterBalance
from .runtime import Precision, tune_allocator
from .step import Step

MAX_EPOCHS = 4
TRAINING_SHARE = 0.9  # of a budget spent in training steps: setting up, evaluations and checkpoints take the rest
OPTIMIZER = "muon"  # pretraining's default (--optimizer auto without DeepSpeed)
MEMORY_SHARE = 0.85  # of the device's memory a plan may fill (the allocator, the CUDA context, fragmentation)
BATCHES = tuple(b for b in (16, 8, 4, 2, 1) if b <= RECIPE["batch_size"])  # the recipe's, else the largest that fits
# The fewest tokens per parameter of the loss model's runs (depth 6 for 120 steps: 0.041), rounded down: a model
# that would read fewer in the budget lies where the model's size term promises what no run showed (a large model
# on a few epochs of a small corpus), so it is not picked
MIN_TOKENS_PER_PARAMETER = 0.04
AUTO_MIN_SECONDS = 1.0  # of timed steps per candidate when a run plans itself (its budget pays for them)...
AUTO_TIMING_SHARE = 0.005  # ...or this share of a short budget (72 s: 0.36 s a candidate; two steps at least)
MAX_ROUNDS = 12  # of timing the best expected candidate and its neighbours (each round times at most three)
SAMPLE_BYTES = 2 << 20  # of --data_path read to estimate its tokens
VOCAB_SIZE = 6400  # the shipped tokenizer's, which the trainers give a new model


def family() -> list[str]:
    """The depth family's presets, every depth."""
    return [f"{DEPTH_PREFIX}{depth}" for depth in range(1, MAX_DEPTH + 1)]


@dataclass
class PresetRow:
    """One candidate's line of the plan."""

    name: str
    parameters: int
    non_embedding: int  # the loss model's N
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
    expected_loss: float | None = None  # the loss model's, after trained_tokens

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
    """A timed step: seconds of its forward and backward, and of its update (whose Newton-Schulz work scales with
    the matrices, not the tokens: the two are estimated from FLOP rates of their own)."""

    backward_s: float
    update_s: float
    peak_bytes: int | None  # measured on CUDA

    @property
    def step_s(self) -> float:
        return self.backward_s + self.update_s


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
    return sum(steps * (4 * m * m * n + 2 * m ** 3) for m, n in map(sorted, hidden_matrix_shapes(cfg)))


@dataclass
class Work:
    """What one step of a candidate computes: its forward and backward's FLOPs, its update's Newton-Schulz FLOPs."""

    cfg: Any
    backward_flops: float
    update_flops: float

    def seconds(self, timed_work: Work, t: StepTime) -> float:
        """This step's seconds at the FLOP rates of another candidate's timed step."""
        update_rate = timed_work.update_flops / max(t.update_s, 1e-9) if timed_work.update_flops else math.inf
        return self.backward_flops * t.backward_s / timed_work.backward_flops + self.update_flops / update_rate


def plan(budget_s: float, device_name: str = "auto", data_path: str | list[str] | None = None,
         presets: list[str] | None = None, seq_len: int | None = None, max_step_s: float = 20.0,
         min_seconds: float = 2.0, dtype: str = "auto", loss_model: LossModel = SHIPPED,
         tokenizer_dir: str | None = None) -> tuple[list[PresetRow], PresetRow | None, str, str]:
    """The rows of every candidate (the depth family, or `presets`), cheapest step first; the one that expects
    the lowest final loss (None when none fits); why; and the plan's header. Sequences are seq_len tokens, or
    each candidate's context (what the trainers use by default); steps are timed in `dtype` (the trainers'
    --dtype: auto is the precision policy's); the data's tokens are counted with `tokenizer_dir`'s tokenizer
    (default: the shipped one)."""
    configs = {n: get_preset(n, vocab_size=VOCAB_SIZE) for n in presets or family()}  # unknown: ConfigError now
    device = parse_device(device_name)
    choice = choose_dtype(dtype, device, "train")
    precision = Precision(device, choice.dtype)
    memory = device_memory(device)
    paths = [parse_source(spec).path for spec in ([data_path] if isinstance(data_path, str) else data_path or [])]
    n_data = sum(data_tokens(Path(p), tokenizer_dir and Path(tokenizer_dir)) for p in paths) or None
    rows, work = candidates(configs, seq_len, memory, choice.dtype, precision_policy(device).newton_schulz_steps)
    fitting = [r for r in rows if r.fits]
    times: dict[str, StepTime] = {}
    best = None
    for _ in range(MAX_ROUNDS if fitting else 0):
        # the cheapest first; then the best expected and its neighbours, unless their steps are too long to time
        todo = [fitting[0]] if best is None else [
            r for r in fitting[max(0, fitting.index(best) - 1):fitting.index(best) + 2]
            if r.name not in times and 3 * estimated_step_s(work[r.name], work, times) <= max_step_s]
        if not todo:
            break
        for r in todo:
            times[r.name] = time_steps(work[r.name].cfg, device, precision, r.batch_size, r.seq_len, min_seconds)
        for r in fitting:
            settle(r, work, times, budget_s, n_data, loss_model)
        best = recommend(rows)
    header = (f"time budget {format_duration(budget_s)} on {device} ({dtype_name(choice.dtype)}: {choice.reason}); "
              f"{TRAINING_SHARE:.0%} of it in training steps"
              + (f"; {', '.join(paths)}: about {n_data / 1e6:,.1f}M tokens (estimated from the first "
                 f"{SAMPLE_BYTES >> 20} MB of each file)" if n_data else ""))
    return rows, best, why(best, rows), header


def candidates(configs: dict[str, Any], seq_len: int | None, memory: int, dtype: torch.dtype, ns_steps: int
               ) -> tuple[list[PresetRow], dict[str, Work]]:
    """A row for each candidate, cheapest step first, at the recipe's batch or the largest below it that fits in
    `memory` (judged at that batch); and the work of a step of each that fits."""
    rows: list[PresetRow] = []
    work: dict[str, Work] = {}
    for name, cfg in sorted(configs.items(), key=lambda nc: flops_per_token(nc[1], seq_len or nc[1].max_seq_len)):
        seq = seq_len or cfg.max_seq_len
        peaks = {b: estimate_memory(cfg, b, seq, dtype, optimizer=OPTIMIZER).peak for b in BATCHES}
        batch = next((b for b in BATCHES if peaks[b] <= MEMORY_SHARE * memory), None)
        rows.append(PresetRow(name, cfg.num_parameters(), cfg.num_parameters(non_embedding=True), batch or 1, seq,
                              None, False, peaks[batch or 1], False, batch is not None))
        if batch is not None:
            work[name] = Work(cfg, flops_per_token(cfg, seq) * batch * seq, newton_schulz_flops(cfg, ns_steps))
    return rows, work


def estimated_step_s(w: Work, work: dict[str, Work], times: dict[str, StepTime]) -> float:
    """A step's seconds at the FLOP rates of the timed candidate nearest it in FLOPs (by ratio)."""
    nearest = min(times, key=lambda n: abs(math.log(w.backward_flops / work[n].backward_flops)))
    return w.seconds(work[nearest], times[nearest])


def settle(row: PresetRow, work: dict[str, Work], times: dict[str, StepTime], budget_s: float,
           n_data: int | None, loss_model: LossModel) -> None:
    """Fill in a fitting row's speed (measured, or estimated from the nearest timed step) and what it buys."""
    t = times.get(row.name)
    step_s = t.step_s if t is not None else estimated_step_s(work[row.name], work, times)
    row.tokens_per_s, row.speed_measured = row.batch_size * row.seq_len / step_s, t is not None
    if t is not None and t.peak_bytes is not None:
        row.peak_bytes, row.peak_measured = t.peak_bytes, True
    buy(row, budget_s, n_data, loss_model)


def buy(row: PresetRow, budget_s: float, n_data: int | None, loss_model: LossModel = SHIPPED) -> None:
    """Fill in what the budget buys with a candidate that fits: its tokens, those within MAX_EPOCHS of the data
    (n_data tokens; None: unknown, no limit), the epochs the budget would read, and the loss it can expect."""
    row.budget_tokens = row.tokens_per_s * TRAINING_SHARE * budget_s
    row.trained_tokens = min(row.budget_tokens, MAX_EPOCHS * n_data) if n_data else row.budget_tokens
    row.epochs = row.budget_tokens / n_data if n_data else None
    row.expected_loss = loss_model.loss(row.non_embedding, row.trained_tokens)


def recommend(rows: list[PresetRow]) -> PresetRow | None:
    """The candidate that fits and expects the lowest final loss (the first of equals) among those that read at
    least MIN_TOKENS_PER_PARAMETER in the budget (when none does, the one that reads the most); None when none
    fits."""
    fitting = [r for r in rows if r.fits]
    if not fitting:
        return None
    seen = [r for r in fitting if r.tokens_per_parameter >= MIN_TOKENS_PER_PARAMETER]
    return min(seen or [max(fitting, key=lambda r: r.tokens_per_parameter)], key=lambda r: r.expected_loss)


def tokens(x: float) -> str:
    """'1.23B', '4.5M', '12.3K'."""
    return f"{x / 1e9:,.2f}B" if x >= 1e9 else f"{x / 1e6:,.1f}M" if x >= 1e5 else f"{x / 1e3:,.1f}K"


def why(best: PresetRow | None, rows: list[PresetRow]) -> str:
    """The recommendation in words: what it expects, what its neighbours in size expect, and what limits it."""
    if best is None:
        return "nothing fits in this device's memory even at batch 1"
    text = (f"{best.name}: the lowest expected validation loss, {best.expected_loss:.2f}, after "
            f"{tokens(best.trained_tokens)} tokens ({best.tokens_per_parameter:.3g} per parameter)")
    by_size = sorted((r for r in rows if r.fits and r is not best), key=lambda r: r.non_embedding)
    smaller = [r for r in by_size if r.non_embedding < best.non_embedding][-1:]
    larger = [r for r in by_size if r.non_embedding > best.non_embedding][:1]
    if smaller or larger:
        text += "; " + ", ".join(f"{r.name} expects {r.expected_loss:.2f} after {tokens(r.trained_tokens)}"
                                 for r in (*smaller, *larger))
    if not larger and any(not r.fits and r.non_embedding > best.non_embedding for r in rows):
        text += "; larger ones do not fit in memory"
    unseen = [r.name for r in rows if r.fits and r.expected_loss < best.expected_loss]
    if unseen:
        text += (f"; {', '.join(unseen)} would expect less, but read fewer than {MIN_TOKENS_PER_PARAMETER:g} tokens "
                 "per parameter, fewer than any run the loss model was fitted on")
    if not FIT_SIZES[0] <= best.non_embedding <= FIT_SIZES[1]:
        text += (f"; at {best.non_embedding:,.0f} non-embedding parameters it is outside the sizes the loss model "
                 f"was fitted on ({FIT_SIZES[0]:,}-{FIT_SIZES[1]:,}): its expected loss is extrapolated")
    if best.trained_tokens < best.budget_tokens:
        text += (f"; the data is the limit: the budget would read it {best.epochs:.3g} times, and past "
                 f"{MAX_EPOCHS} epochs repeating adds little")
    return text


def command(best: PresetRow, budget: str, data_path: str | None) -> str:
    """The train_pretrain.py line that trains the recommendation in the budget, with the settings the loss model
    was fitted with (and QK-norm, which the depth family has and keeps attention bounded at that learning
    rate)."""
    epochs = max(1, min(MAX_EPOCHS, math.ceil(best.epochs))) if best.epochs else None
    parts = ["python train_pretrain.py", f"--preset {best.name}", f"--data_path {data_path or 'YOUR.jsonl'}",
             f"--time_budget {budget}", f"--batch_size {best.batch_size}", *recipe_flags()]
    if epochs and epochs > 1:
        parts.append(f"--epochs {epochs}")  # --epochs bounds a budget run: let it use the time
    if not get_preset(best.name).qk_norm:
        parts.append("--qk_norm")
    return " ".join(parts)


def shown(rows: list[PresetRow], best: PresetRow | None, around: int = 2) -> list[PresetRow]:
    """The rows worth printing: the timed ones, those within `around` of the pick, and the first that does not
    fit (every row when there are few)."""
    if len(rows) <= 2 * around + 4:
        return rows
    fitting = [r for r in rows if r.fits]
    near = set()
    if best is not None:
        i = fitting.index(best)
        near = {r.name for r in fitting[max(0, i - around):i + around + 1]}
    first_too_big = next(([r] for r in rows if not r.fits), [])
    return [r for r in rows if r.name in near or r.speed_measured or r in first_too_big]


def table(rows: list[PresetRow], best: PresetRow | None) -> str:
    """The plan as a Markdown table; (est.) marks estimated figures."""
    lines = ["| preset | params | batch | tokens/s | tokens in budget | tokens/param | epochs of data | expected loss "
             "| peak memory |", "|---|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for r in rows:
        mark = " ⭐" if r is best else ""
        memory = f"{r.peak_bytes / 2**30:,.2f} GiB" + ("" if r.peak_measured else " (est.)")
        if not r.fits:
            lines.append(f"| {r.name}{mark} | {r.parameters / 1e6:.1f}M | – | does not fit | – | – | – | – | "
                         f"{memory} |")
            continue
        speed = f"{r.tokens_per_s:,.0f}" + ("" if r.speed_measured else " (est.)")
        epochs = f"{r.epochs:.2g}" if r.epochs is not None else "–"
        lines.append(f"| {r.name}{mark} | {r.parameters / 1e6:.1f}M | {r.batch_size}×{r.seq_len} | {speed} | "
                     f"{tokens(r.budget_tokens)} | {r.tokens_per_parameter:.3g} | {epochs} | {r.expected_loss:.2f} | "
                     f"{memory} |")
    return "\n".join(lines)


FOOTER = (f"tokens/s: measured by timing training steps here (est.: from the FLOP rate of the nearest measured); "
          f"expected loss: the final validation loss the loss model predicts, fitted on {FIT_DATA} with "
          f"{' '.join(recipe_flags())} ({FIT_RESULTS}; other "
          "text has a level of its own, and the pick still weighs size against tokens); peak memory: "
          "model/memory.py's estimate (est.), measured on CUDA")


def main(budget: str, device: str, data_path: str | None, presets: list[str] | None) -> int:
    """`python -m model --plan`: print the table, the recommendation and its command line."""
    from .budget import parse_duration

    if budget is None:
        raise ConfigError("--plan needs --time_budget (90s, 10m, 2h)")
    tune_allocator()  # steps are timed as training takes them
    rows, best, reason, header = plan(parse_duration(budget), device, data_path, presets)
    hidden = len(rows) - len(visible := shown(rows, best))
    print(header)
    print(table(visible, best))
    if hidden:
        print(f"({hidden} more of the depth family, estimated, not shown: --presets NAME ... plans only those)")
    print(f"recommended: {reason}")
    if best is not None:
        print(f"  {command(best, budget, data_path)}")
        print(f"  or: python train_pretrain.py --preset auto --time_budget {budget}"
              + (f" --data_path {data_path}" if data_path else "") + " (plans again, then trains the pick)")
    print(FOOTER)
    return 0


def resolve_auto(config: TrainConfig, stage_name: str, spent_s: float) -> None:
    """--preset auto: set the preset to the plan's pick for what is left of this run's --time_budget (`spent_s`
    is gone), timed on its device in its precision, and print the plan. The run is named <stage>-auto unless
    --run_name names it, so that --resume finds it again: resuming, the model is the run's own, and nothing is
    planned."""
    m, run = config.model, config.run
    if stage_name != "pretrain":
        raise ConfigError("--preset auto sizes a new model for a pretraining run (train_pretrain.py); name a preset "
                          "here")
    run.run_name = run.run_name or f"{stage_name}-{AUTO_PRESET}"
    if run.resume and latest_checkpoint(Path(run.out_dir) / run.run_name) is not None:
        m.preset = None  # the checkpoint's model
        return
    if detect_env().world_size > 1:
        raise ConfigError("--preset auto times candidates in one process; under torchrun, plan first with "
                          "`python -m model --plan --time_budget D` and pass the --preset it recommends")
    budget_s = config.optim.budget_s - spent_s
    if budget_s <= 0:
        raise ConfigError(f"--time_budget {config.optim.time_budget}: setting up took {format_duration(spent_s)}, the "
                          "whole budget, before the plan; give a longer one")
    rows, best, reason, header = plan(budget_s, config.precision.device, config.data.data_path, seq_len=m.max_seq_len,
                                      min_seconds=min(AUTO_MIN_SECONDS, AUTO_TIMING_SHARE * budget_s),
                                      dtype=config.precision.dtype,
                                      tokenizer_dir=config.data.tokenizer)
    if best is None:
        raise ConfigError(f"--preset auto: {reason}")
    print(f"--preset auto: {header}", file=sys.stderr)
    print(table(shown(rows, best), best), file=sys.stderr)
    print(f"--preset auto: {reason}", file=sys.stderr)
    m.preset = best.name
