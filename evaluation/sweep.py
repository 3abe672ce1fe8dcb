"""Decoding sweep: vary one sampling setting, sample every prompt at each value, and score what comes out.

    eval_model.py --checkpoint out/<run> --sweep temperature=0.6:1.2:0.1 --out sweep.json --plot sweep.png

Each value of the swept setting (the other settings stay fixed) gets the same N samples per prompt, drawn from
the same seed, and three numbers, all over token ids:
    self-ppl    exp(mean NLL) of the generated tokens under the model's raw distribution (temperature 1, no
                top-k / top-p / repetition penalty), each sample conditioned on its prompt; token-weighted over
                all samples of the setting. Low = the text is what the model itself finds likely.
    distinct-2  unique bigrams / all bigrams, pooled over all samples of the setting (a bigram never spans two
                samples). Low = the samples say the same things, within or across samples.
    rep-3gram   per sample, the fraction of its trigrams that already occurred earlier in the same sample;
                averaged over the samples that have a trigram. High = the text loops.
The best setting is the lowest self-ppl among those whose rep-3gram rate stays at or under a threshold: the most
model-like text that does not loop. Tokenizer steps come in as callables (model/ does not import dataset/).
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import math
import typing
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from common.config import BOUNDS
from common.errors import ConfigError
from common.tokens import IGNORE_INDEX
from model.generate import SamplingConfig, generate
from model.model import PocketLM

SWEEPABLE = ("temperature", "top_k", "top_p", "repetition_penalty")
MAX_VALUES = 100  # a typo such as step 0.001 for 0.1 would otherwise run for hours


# --------------------------------------------------------------------------- the spec
@dataclass(frozen=True)
class SweepSpec:
    """The swept setting and its values, ascending."""

    parameter: str
    values: tuple[float, ...] | tuple[int, ...]

    def label(self, value: float) -> str:
        """`value` as the table and plot show it: 0.7 (not 0.7000000000000001), and 1.0 beside 0.9 (not 1)."""
        texts = [number(v) for v in self.values]
        if isinstance(value, int) or any("e" in t for t in texts):
            return number(value)
        places = max(1, *(len(t.partition(".")[2]) for t in texts))
        return f"{value:.{places}f}"


def number(value: float) -> str:
    """A setting's value as people write it: 0.7, 1.0, 1e-05, 40 (never 0.7000000000000001 or 4e+01)."""
    if isinstance(value, int):
        return str(value)
    text = f"{value:g}"
    return text + ".0" if text.lstrip("-").isdigit() else text  # a float stays recognisable as one


def parse_sweep(spec: str) -> SweepSpec:
    """`NAME=START:STOP:STEP` (STOP included when the steps land on it) or `NAME=V1,V2,...` as a SweepSpec.

    Ranges are computed in decimal arithmetic, so 0.6:1.2:0.1 ends at exactly 1.2 (not 1.1 or 1.2000000000000002).
    ConfigError (one line, naming the spec) for an unknown setting, a malformed or empty range, a value of the
    wrong kind (top_k takes whole numbers) or outside the setting's bounds (those of `SamplingConfig`).
    """
    where = f"--sweep {spec}"
    name, eq, body = spec.partition("=")
    name = name.strip()
    if not eq or not body.strip():
        raise ConfigError(f"{where}: expected NAME=START:STOP:STEP or NAME=V1,V2,... with NAME one of "
                          f"{', '.join(SWEEPABLE)}")
    if name not in SWEEPABLE:
        near = difflib.get_close_matches(name, SWEEPABLE, n=1, cutoff=0.4)
        hint = f" (did you mean {near[0]}?)" if near else ""
        raise ConfigError(f"{where}: cannot sweep {name!r}{hint}; choose one of {', '.join(SWEEPABLE)}")
    if ":" in body:
        values = _decimal_range(body, where)
    else:
        values = [_decimal(v, where) for v in body.split(",")]
        repeated = sorted({str(v) for v in values if values.count(v) > 1})
        if repeated:
            raise ConfigError(f"{where}: {', '.join(repeated)} given more than once")
    if len(values) > MAX_VALUES:
        raise ConfigError(f"{where}: {len(values)} values; at most {MAX_VALUES} per sweep (a larger step?)")
    kind = typing.get_type_hints(SamplingConfig)[name]
    if kind is int:
        fractional = [str(v) for v in values if v != v.to_integral_value()]
        if fractional:
            raise ConfigError(f"{where}: {name} takes whole numbers, got {fractional[0]}")
    typed = sorted(int(v) if kind is int else float(v) for v in values)
    for value in typed:
        _check_bounds(name, value, where)
    return SweepSpec(name, tuple(typed))


def _decimal(text: str, where: str) -> Decimal:
    try:
        value = Decimal(text.strip())
    except InvalidOperation:
        raise ConfigError(f"{where}: {text.strip()!r} is not a number") from None
    if not value.is_finite():
        raise ConfigError(f"{where}: {text.strip()} is not a finite number")
    return value


def _decimal_range(body: str, where: str) -> list[Decimal]:
    parts = body.split(":")
    if len(parts) != 3:
        raise ConfigError(f"{where}: a range is START:STOP:STEP, e.g. 0.6:1.2:0.1")
    start, stop, step = (_decimal(p, where) for p in parts)
    if step <= 0:
        raise ConfigError(f"{where}: the step must be > 0, got {step}")
    if stop < start:
        raise ConfigError(f"{where}: the range runs upwards; STOP {stop} is below START {start}")
    count = int((stop - start) // step) + 1  # exact in Decimal: no value lost or added to float rounding
    if count > MAX_VALUES:
        raise ConfigError(f"{where}: {count} values; at most {MAX_VALUES} per sweep (a larger step?)")
    return [start + i * step for i in range(count)]


def _check_bounds(name: str, value: float, where: str) -> None:
    """The bounds `--NAME` itself has (e.g. 0 < top_p <= 1), declared once on SamplingConfig."""
    meta = next(f.metadata for f in dataclasses.fields(SamplingConfig) if f.name == name)
    for key, within, sign in BOUNDS:
        bound = meta[key]
        if bound is not None and not within(value, bound):
            raise ConfigError(f"{where}: {name} must be {sign} {bound}, got {number(value)}")


# ---------------------------------------------------------------------------- metrics
def distinct_n(samples: Sequence[Sequence[int]], n: int = 2) -> float:
    """Unique n-grams / all n-grams, pooled over samples (no n-gram spans two samples); NaN with no n-grams.

    [[1, 2, 1, 2]] has bigrams (1,2) (2,1) (1,2): 2 unique of 3. [[1, 2], [1, 2]] has 1 unique of 2.
    """
    grams = [tuple(s[i:i + n]) for s in samples for i in range(len(s) - n + 1)]
    return len(set(grams)) / len(grams) if grams else math.nan


def repeated_ngram_rate(ids: Sequence[int], n: int = 3) -> float:
    """The fraction of a sample's n-grams that already occurred earlier in it; NaN when it has none.

    [1, 2, 3, 1, 2, 3] has trigrams (1,2,3) (2,3,1) (3,1,2) (1,2,3): the last repeats the first, so 1/4.
    """
    seen: set[tuple[int, ...]] = set()
    repeats = total = 0
    for i in range(len(ids) - n + 1):
        gram = tuple(ids[i:i + n])
        repeats += gram in seen
        total += 1
        seen.add(gram)
    return repeats / total if total else math.nan


def mean_repeated_ngram_rate(samples: Sequence[Sequence[int]], n: int = 3) -> float:
    """repeated_ngram_rate averaged over the samples that have at least one n-gram (each sample counts once,
    however long); NaN when none has."""
    rates = [r for r in (repeated_ngram_rate(s, n) for s in samples) if not math.isnan(r)]
    return sum(rates) / len(rates) if rates else math.nan


@torch.inference_mode()
def continuation_nll(model: PocketLM, prompts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]],
                     batch_size: int = 16) -> tuple[float, int]:
    """(summed NLL in nats, token count) of each continuation given its prompt, under the model's raw
    next-token distribution (log-softmax of the logits: no temperature, filter or penalty).

    Rows are prompt + continuation, right-padded: with causal attention, padding after a row's end cannot change
    its logits, and positions start at 0 in every row as they did in generation.
    """
    device = next(model.parameters()).device
    rows = [(list(p), list(c)) for p, c in zip(prompts, continuations) if c]  # an empty sample has nothing to score
    nats, tokens = 0.0, 0
    for start in range(0, len(rows), batch_size):
        chunk = rows[start:start + batch_size]
        width = max(len(p) + len(c) for p, c in chunk) - 1
        x = torch.zeros((len(chunk), width), dtype=torch.long)
        y = torch.full((len(chunk), width), IGNORE_INDEX, dtype=torch.long)
        for r, (p, c) in enumerate(chunk):
            ids = p + c
            x[r, :len(ids) - 1] = torch.tensor(ids[:-1])
            y[r, len(p) - 1:len(ids) - 1] = torch.tensor(c)  # the position before each generated token predicts it
        logits = model(x.to(device)).float()  # fp32 loss even for a bf16 model
        nats += F.cross_entropy(logits.flatten(0, 1), y.to(device).flatten(), ignore_index=IGNORE_INDEX,
                                reduction="sum").item()
        tokens += sum(len(c) for _, c in chunk)
    return nats, tokens


# ---------------------------------------------------------------------------- the sweep
@dataclass
class SettingResult:
    """One value of the swept setting: its samples (ids, `samples_per_prompt` rows per prompt, prompt-major)
    and their scores."""

    value: float
    samples: list[list[int]]
    self_ppl: float
    distinct_2: float
    repeated_trigram_rate: float
    mean_tokens: float  # generated tokens per sample
    ended: float  # fraction of samples that stopped at a stop token before max_new_tokens

    def scores(self) -> dict[str, float | None]:
        """The numbers of the JSON report; NaN (nothing to measure) becomes null."""
        return {k: (None if math.isnan(v) else v) for k, v in (
            ("self_ppl", self.self_ppl), ("distinct_2", self.distinct_2),
            ("repeated_trigram_rate", self.repeated_trigram_rate), ("mean_tokens", self.mean_tokens),
            ("ended", self.ended))}


def score_setting(model: PocketLM, value: float, rows: Sequence[Sequence[int]], samples: list[list[int]],
                  max_new_tokens: int, batch_size: int = 16) -> SettingResult:
    """The metrics of one setting's samples (`rows[i]` is the prompt of `samples[i]`)."""
    nats, tokens = continuation_nll(model, rows, samples, batch_size)
    return SettingResult(
        value=value, samples=samples, self_ppl=math.exp(nats / tokens) if tokens else math.nan,
        distinct_2=distinct_n(samples, 2), repeated_trigram_rate=mean_repeated_ngram_rate(samples, 3),
        mean_tokens=sum(map(len, samples)) / len(samples),
        ended=sum(len(s) < max_new_tokens for s in samples) / len(samples))


def run_sweep(model: PocketLM, spec: SweepSpec, prompts: Sequence[Sequence[int]], sampling: SamplingConfig,
              samples_per_prompt: int, seed: int, eos_token_ids: Sequence[int] = (), pad_token_id: int = 0,
              batch_size: int = 16, on_result: Callable[[SettingResult], None] | None = None) -> list[SettingResult]:
    """Sample every prompt `samples_per_prompt` times at each value of the spec, the other settings as in
    `sampling` (its seed is ignored for `seed`), and score the samples.

    Every value starts from a generator seeded with `seed` and the same batches, so a value's samples do not
    depend on which other values are swept, and settings differ only by the setting (common random numbers).
    on_result(result) is called as each value finishes (progress).
    """
    if samples_per_prompt < 1 or not prompts:
        raise ConfigError(f"a sweep needs a prompt and samples_per_prompt >= 1, got {len(prompts)} prompts and "
                          f"{samples_per_prompt}")
    device = next(model.parameters()).device
    rows = [list(p) for p in prompts for _ in range(samples_per_prompt)]
    was_training = model.training
    model.eval()
    results = []
    for value in spec.values:
        s = dataclasses.replace(sampling, **{spec.parameter: value})
        generator = torch.Generator(device).manual_seed(seed)
        samples: list[list[int]] = []
        for start in range(0, len(rows), batch_size):
            samples += generate(model, rows[start:start + batch_size], max_new_tokens=s.max_new_tokens,
                                temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                                repetition_penalty=s.repetition_penalty, eos_token_ids=eos_token_ids,
                                pad_token_id=pad_token_id, generator=generator)
        result = score_setting(model, value, rows, samples, s.max_new_tokens, batch_size)
        results.append(result)
        if on_result is not None:
            on_result(result)
    model.train(was_training)
    return results


def best_setting(results: Sequence[SettingResult], max_repeat: float) -> SettingResult | None:
    """The lowest self-ppl among results whose repeated-trigram rate is <= max_repeat (the first on a tie);
    None when none qualifies. A result with nothing to measure (NaN) never qualifies."""
    ok = [r for r in results if r.repeated_trigram_rate <= max_repeat and not math.isnan(r.self_ppl)]
    return min(ok, key=lambda r: r.self_ppl) if ok else None


# ---------------------------------------------------------------------------- reporting
@dataclass
class SweepReport:
    """A finished sweep with everything needed to reproduce and read it."""

    spec: SweepSpec
    sampling: SamplingConfig  # the fixed settings (the swept one's flag value is not used)
    seed: int
    samples_per_prompt: int
    prompts: list[str]
    max_repeat: float
    results: list[SettingResult]

    @property
    def best(self) -> SettingResult | None:
        return best_setting(self.results, self.max_repeat)

    def fixed(self) -> dict[str, float | int]:
        """The settings that stayed fixed while one was swept."""
        keep = ("temperature", "top_k", "top_p", "repetition_penalty", "max_new_tokens")
        return {k: getattr(self.sampling, k) for k in keep if k != self.spec.parameter}

    def table(self) -> str:
        """The plain-text report: a header line, one row per value, and the verdict."""
        p = self.spec.parameter
        fixed = ", ".join(f"{k} {number(v)}" for k, v in self.fixed().items())
        lines = [f"sweep of {p} over {len(self.results)} values: {len(self.prompts)} prompts x "
                 f"{self.samples_per_prompt} samples, seed {self.seed}; fixed: {fixed}",
                 f"{p:>{max(len(p), 6)}}  {'self-ppl':>9}  {'distinct-2':>10}  {'rep-3gram':>9}  {'tokens':>6}  "
                 f"{'ended':>5}"]
        best = self.best
        for r in self.results:
            lines.append(f"{self.spec.label(r.value):>{max(len(p), 6)}}  {r.self_ppl:>9.3f}  {r.distinct_2:>10.3f}  "
                         f"{r.repeated_trigram_rate:>9.3f}  {r.mean_tokens:>6.1f}  {r.ended:>5.2f}"
                         + ("  <- best" if r is best else ""))
        lines.append(self.verdict())
        return "\n".join(lines)

    def verdict(self) -> str:
        """One line: the best setting and why, or why there is none."""
        p, best = self.spec.parameter, self.best
        if best is not None:
            return (f"best: {p}={self.spec.label(best.value)} (lowest self-ppl {best.self_ppl:.3f} among settings "
                    f"with repeated-trigram rate <= {self.max_repeat:g}; its rate {best.repeated_trigram_rate:.3f})")
        measured = [r for r in self.results if not math.isnan(r.repeated_trigram_rate)]
        if not measured:
            return "best: none (no sample was long enough to have a trigram)"
        least = min(measured, key=lambda r: r.repeated_trigram_rate)
        return (f"best: none (every setting repeats more than {self.max_repeat:g} of its trigrams; the least, "
                f"{least.repeated_trigram_rate:.3f} at {p}={self.spec.label(least.value)}; raise the threshold or "
                f"sweep a wider range)")

    def to_dict(self, decode: Callable[[list[int]], str]) -> dict:
        """The JSON report: spec, fixed settings, prompts, per value its scores and decoded samples, the best."""
        best = self.best
        return {
            "parameter": self.spec.parameter,
            "values": list(self.spec.values),
            "fixed": self.fixed(),
            "seed": self.seed,
            "samples_per_prompt": self.samples_per_prompt,
            "prompts": self.prompts,
            "max_repeat": self.max_repeat,
            "best": None if best is None else best.value,
            "verdict": self.verdict(),
            "results": [{"value": r.value, **r.scores(),
                         "samples": [{"prompt": i // self.samples_per_prompt, "text": decode(ids)}
                                     for i, ids in enumerate(r.samples)]}
                        for r in self.results],
        }

    def write_json(self, path: str | Path, decode: Callable[[list[int]], str], **extra: object) -> None:
        """Write to_dict (after `extra`, e.g. the checkpoint) as strict JSON (null, never NaN)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**extra, **self.to_dict(decode)}, ensure_ascii=False, indent=2, allow_nan=False)
                        + "\n", encoding="utf-8")

    def plot(self, path: str | Path, title: str = "") -> None:
        """Self-ppl (left axis) and rep-3gram / distinct-2 (right axis, 0-1) over the values, the threshold as a
        dashed line and the best setting starred. ConfigError when matplotlib is missing."""
        try:
            import matplotlib
        except ImportError:
            raise ConfigError("--plot needs matplotlib (pip install matplotlib)") from None
        matplotlib.use("Agg")  # no display needed (servers, CI)
        import matplotlib.pyplot as plt

        x = [r.value for r in self.results]
        fig, ax = plt.subplots(figsize=(8, 4.5))
        ax.plot(x, [r.self_ppl for r in self.results], "o-", color="tab:blue", label="self-perplexity")
        ax.set_xlabel(self.spec.parameter)
        ax.set_ylabel("self-perplexity (raw model distribution)", color="tab:blue")
        ax.grid(alpha=0.3)
        right = ax.twinx()
        right.plot(x, [r.repeated_trigram_rate for r in self.results], "s-", color="tab:red",
                   label="repeated-trigram rate")
        right.plot(x, [r.distinct_2 for r in self.results], "^-", color="tab:green", label="distinct-2")
        right.axhline(self.max_repeat, color="tab:red", linestyle="--", linewidth=1,
                      label=f"max repeat {self.max_repeat:g}")
        right.set_ylim(0, 1.05)
        right.set_ylabel("rate")
        best = self.best
        if best is not None:
            ax.plot([best.value], [best.self_ppl], "*", color="gold", markeredgecolor="black", markersize=18,
                    label=f"best: {self.spec.parameter}={self.spec.label(best.value)}", zorder=5)
        handles = ax.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0]
        # below the axes: inside, it would hide the rate curves near 0 or 1
        ax.legend(handles, [h.get_label() for h in handles], loc="upper center", bbox_to_anchor=(0.5, -0.14),
                  ncol=3, fontsize=8, frameon=False)
        ax.set_title(title or f"decoding sweep of {self.spec.parameter}")
        fig.tight_layout()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120, bbox_inches="tight")
        plt.close(fig)
