"""The validation loss a pretraining run can expect from its size and its tokens, fitted to short runs:

    L(N, D) = E + A / N^alpha + B / D^beta

N is the model's parameters, D the tokens it trains on (with its schedule completed at D), L the final validation
loss in nats per token (Hoffmann et al. 2022, "approach 3"). E is what no model or data can remove (the text's own
entropy, for this tokenizer); the two other terms are what a larger model and more tokens each take away.

The fit minimises the Huber loss of the residuals of log L (robust to an odd run; Huber's delta 1e-3 as Hoffmann
et al.), over log A, alpha, log B, beta and log E, so each stays positive: the objective is evaluated on a grid of
starting points at once, and L-BFGS polishes the best few (the grid guards against the local minima a single
start falls into: Besiroglu et al. 2024 found Hoffmann et al.'s own fit ended in one).
"""
from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import asdict, dataclass, fields
from typing import Any, Sequence

import torch

HUBER_DELTA = 1e-3
# What the shipped loss model was fitted on (bench/fit_loss_model.py): every run a model of the depth family
# (--preset depth-N) trained on the bundled corpus with these settings, its schedule completed at its last step.
# Two peak rates: Muon's for the hidden matrices, and twice that for what AdamW trains (the embedding and the norms:
# in a small model the embedding is most of its parameters, and it learns faster at the higher rate); Muon's is for
# a width of 256 (depth 4), and a model of another width takes it in inverse proportion (dev/LOG.md)
RECIPE = {"learning_rate": 8e-3, "muon_lr": 4e-3, "muon_base_width": 256, "warmup_steps": 20, "batch_size": 16}
# the recipe's schedule: the batch is the plan's to choose
SCHEDULE = ("learning_rate", "muon_lr", "muon_base_width", "warmup_steps")
FIT_DATA = "dataset/demo/pretrain_demo.jsonl"
FIT_CONTEXT = 256  # tokens a sequence: the depth family's context
FIT_RESULTS = "bench/results/loss-model-demo.json"  # the fit: its runs, constants and residuals
FIT_SIZES = (53_568, 9_442_944)  # the fewest and most non-embedding parameters of its runs (depths 1 and 6)
# The starting grid: exponents from flat to steep, log-constants over the range small models give.
GRID = {"log_a": (0.0, 5.0, 10.0, 15.0, 20.0), "alpha": (0.1, 0.3, 0.5, 0.8, 1.2),
        "log_b": (0.0, 5.0, 10.0, 15.0, 20.0), "beta": (0.1, 0.3, 0.5, 0.8, 1.2),
        "log_e": (-1.0, 0.0, 0.5, 1.0, 1.5)}
POLISHED = 8  # the best grid points L-BFGS starts from


def recipe_flags() -> list[str]:
    """The recipe's schedule as train_pretrain.py's arguments: ["--learning_rate", "0.008", ...]."""
    return [word for key in SCHEDULE for word in (f"--{key}", f"{RECIPE[key]:g}")]


@dataclass(frozen=True)
class LossModel:
    """L(N, D) = E + A / N^alpha + B / D^beta, in nats per token."""

    E: float
    A: float
    alpha: float
    B: float
    beta: float

    def loss(self, n: float, d: float) -> float:
        """The final validation loss of a model of `n` parameters trained on `d` tokens."""
        return self.E + self.A / n ** self.alpha + self.B / d ** self.beta

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LossModel:
        return cls(**{k: float(d[k]) for k in ("E", "A", "alpha", "B", "beta")})


CONSTANTS = len(fields(LossModel))  # E, A, alpha, B, beta: a fit needs as many runs


@dataclass(frozen=True)
class Fit:
    """A fitted loss model and how well it fits its points: each point's relative error (predicted / actual - 1)."""

    model: LossModel
    relative_errors: tuple[float, ...]

    @property
    def worst(self) -> float:
        """The largest relative error, either way."""
        return max(map(abs, self.relative_errors))


def _log_predicted(theta: torch.Tensor, log_n: torch.Tensor, log_d: torch.Tensor) -> torch.Tensor:
    """log L for each parameter row of theta (log_a, alpha, log_b, beta, log_e) at every point: (rows, points)."""
    log_a, alpha, log_b, beta, log_e = theta.unbind(-1)
    terms = torch.stack([log_a[:, None] - alpha[:, None] * log_n, log_b[:, None] - beta[:, None] * log_d,
                         log_e[:, None].expand(-1, log_n.numel())])
    return torch.logsumexp(terms, dim=0)


def _objective(theta: torch.Tensor, log_n: torch.Tensor, log_d: torch.Tensor, log_l: torch.Tensor) -> torch.Tensor:
    """The summed Huber loss of each row's log residuals: (rows,)."""
    residual = _log_predicted(theta, log_n, log_d) - log_l
    return torch.nn.functional.huber_loss(residual, torch.zeros_like(residual), reduction="none",
                                          delta=HUBER_DELTA).sum(-1)


def fit(points: Sequence[tuple[float, float, float]]) -> Fit:
    """The loss model of (parameters, tokens, final validation loss) points. ValueError for fewer than 5 points
    (5 constants) or a point that is not positive and finite."""
    if len(points) < CONSTANTS:
        raise ValueError(f"a loss model has {CONSTANTS} constants: fitting it needs at least {CONSTANTS} runs, got "
                         f"{len(points)}")
    if not all(math.isfinite(x) and x > 0 for p in points for x in p):
        raise ValueError("every point's parameters, tokens and loss must be positive and finite")
    n, d, loss = (torch.tensor(column, dtype=torch.float64) for column in zip(*points))
    log_n, log_d, log_l = n.log(), d.log(), loss.log()
    grid = torch.tensor(list(itertools.product(*GRID.values())), dtype=torch.float64)
    starts = grid[_objective(grid, log_n, log_d, log_l).argsort()[:POLISHED]]
    best, best_value = None, math.inf
    for start in starts:
        theta = start.clone().requires_grad_(True)
        optimizer = torch.optim.LBFGS([theta], max_iter=500, tolerance_change=1e-15, line_search_fn="strong_wolfe")

        def closure() -> torch.Tensor:
            optimizer.zero_grad()
            value = _objective(theta[None], log_n, log_d, log_l)[0]
            value.backward()
            return value

        optimizer.step(closure)
        value = _objective(theta.detach()[None], log_n, log_d, log_l)[0].item()
        if value < best_value:
            best, best_value = theta.detach(), value
    log_a, alpha, log_b, beta, log_e = best.tolist()
    model = LossModel(E=math.exp(log_e), A=math.exp(log_a), alpha=alpha, B=math.exp(log_b), beta=beta)
    errors = tuple(model.loss(*p[:2]) / p[2] - 1 for p in points)
    return Fit(model, errors)


# The fit of FIT_RESULTS (21 runs of depths 1-6, 0.5-3.9M tokens (up to 3.6 epochs), fp32: depths 2-6 within 2.4%,
# depth 1 within 3.4%): what the planner expects of a run. A test keeps these the file's. Re-fit with
# bench/fit_loss_model.py (docs/training.md, "The loss model") when the family, the recipe or the corpus changes.
SHIPPED = LossModel(E=3.261331, A=72.342362, alpha=0.430987, B=28808.406786, beta=0.784389)


@dataclass(frozen=True)
class Progress:
    """Where a run's validation loss is on its way: at a share f of its planned steps, about ratio(f) times the
    loss model's final loss for the tokens trained so far, L(N, D so far). (The loss model fits the curve itself:
    at this schedule the annealing and the tokens still to come nearly cancel.) Measured on runs of the fit's recipe
    at every tenth of their steps, where they had trained at least `min_tokens` (the fewest any fitted run trained
    on: below that the model extrapolates): `ratios` the median run's, `tolerances` how far the runs spread around
    it (each run's curve is read against the loss model, so its spread holds the model's error on each size it was
    fitted on). A model outside the fitted sizes (FIT_SIZES) gets `beyond` more: the model's worst error on these
    runs. Before the first share, or before min_tokens, nothing is expected."""

    min_tokens: float
    shares: tuple[float, ...]
    ratios: tuple[float, ...]
    tolerances: tuple[float, ...]
    beyond: float

    def expected(self, model: LossModel, n: float, tokens: float, tokens_end: float) -> tuple[float, float] | None:
        """(the validation loss expected, its relative tolerance) of a model of `n` parameters after `tokens` of a
        run planned for `tokens_end`; None too early in the run."""
        f = tokens / tokens_end
        if f < self.shares[0] or tokens < self.min_tokens:
            return None
        extrapolated = not FIT_SIZES[0] <= n <= FIT_SIZES[1]
        return (interpolate(self.shares, self.ratios, f) * model.loss(n, tokens),
                interpolate(self.shares, self.tolerances, f) + (self.beyond if extrapolated else 0.0))


def interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """ys at x, linear between the points (xs ascending, x at least xs[0]); past the last, the last."""
    if x >= xs[-1]:
        return ys[-1]
    i = bisect.bisect_right(xs, x)  # xs[i - 1] <= x < xs[i]
    w = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
    return ys[i - 1] + w * (ys[i] - ys[i - 1])


# The progress of the fit's 15 runs of 240 steps or more, evaluated every tenth of their steps, against SHIPPED
# (FIT_RESULTS, "progress"), read where they had trained at least the 491,520 tokens of the fit's shortest
# runs; the tolerances add 2% for another precision or seed to the runs' spread (which holds the model's error on
# each of them: 2.4% at most, depth 4 at 960 steps, what a model outside the fitted sizes gets on top). A test keeps
# these the file's.
PROGRESS = Progress(min_tokens=491_520, shares=(0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0),
                    ratios=(1.0277, 1.0205, 1.0209, 1.01, 1.0134, 1.0044, 1.0021, 0.998, 0.9999),
                    tolerances=(0.047, 0.044, 0.047, 0.042, 0.046, 0.042, 0.04, 0.041, 0.044), beyond=0.024)
