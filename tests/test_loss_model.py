"""The loss model (trainer_utils/loss_model.py): its fit recovers known constants from curves made with them, stays
near them through noise and an odd run, and refuses what it cannot fit."""
from __future__ import annotations

import itertools
import math
import random

import pytest

from trainer_utils.loss_model import Fit, LossModel, fit

# Hoffmann et al. 2022's fitted constants (their Table A3 / equation 10), at the sizes a CPU trains
CHINCHILLA = LossModel(E=1.69, A=406.4, alpha=0.34, B=410.7, beta=0.28)
SIZES = (2e5, 1e6, 4e6, 1.6e7)
TOKENS = (1e6, 4e6, 1.6e7, 6.4e7)


def curves(model: LossModel, noise: float = 0.0, seed: int = 0) -> list[tuple[float, float, float]]:
    rng = random.Random(seed)
    return [(n, d, model.loss(n, d) * (1 + rng.gauss(0, noise))) for n, d in itertools.product(SIZES, TOKENS)]


def test_the_model_is_its_formula_by_hand():
    model = LossModel(E=2.0, A=100.0, alpha=0.5, B=1000.0, beta=0.5)
    assert model.loss(1e4, 1e6) == pytest.approx(2.0 + 100 / 100 + 1000 / 1000)  # 4.0
    assert LossModel.from_dict(model.to_dict()) == model


def test_the_fit_recovers_the_constants_of_exact_curves():
    """To a millionth (the fit is in float64: in float32 it would be off by 2.5e-6)."""
    found = fit(curves(CHINCHILLA)).model
    for name, value in CHINCHILLA.to_dict().items():
        assert getattr(found, name) == pytest.approx(value, rel=1e-6), name


def test_the_fit_scales_with_the_loss():
    """Losses a twentieth as large (all below 1: 0.29 to 0.83): E, A and B a twentieth, the exponents the same."""
    points = [(n, d, loss / 20) for n, d, loss in curves(CHINCHILLA)]
    assert max(loss for _, _, loss in points) < 1
    found = fit(points).model
    for name, value in CHINCHILLA.to_dict().items():
        assert getattr(found, name) == pytest.approx(value / 20 if name in "EAB" else value, rel=1e-5), name


def test_a_noisy_fit_predicts_sizes_and_tokens_it_never_saw():
    """1% noise on every run: the model still predicts a run twice as large and a run four times as long within 2%."""
    result = fit(curves(CHINCHILLA, noise=0.01, seed=1))
    assert isinstance(result, Fit) and result.worst < 0.03
    for n, d in ((3.2e7, 6.4e7), (1.6e7, 2.56e8), (5e5, 2e6)):
        assert result.model.loss(n, d) == pytest.approx(CHINCHILLA.loss(n, d), rel=0.02)


def test_one_odd_run_barely_moves_the_fit():
    """A run 15% worse than its curve (a bad seed, a spike): the Huber loss keeps the others' fit."""
    points = curves(CHINCHILLA)
    n, d, loss = points[5]
    points[5] = (n, d, loss * 1.15)
    result = fit(points)
    assert result.relative_errors[5] == pytest.approx(1 / 1.15 - 1, abs=0.01)  # the odd run stands out...
    others = [e for i, e in enumerate(result.relative_errors) if i != 5]
    assert max(map(abs, others)) < 0.01  # ...and every other run is still fitted


@pytest.mark.parametrize("points, message", [
    ([(1e6, 1e6, 3.0)] * 4, "^a loss model has 5 constants: fitting it needs at least 5 runs, got 4$"),
    ([(1e6, 1e6, 3.0)] * 4 + [(1e6, 0.0, 3.0)], "^every point's parameters, tokens and loss must be positive and "
                                                 "finite$"),
    ([(1e6, 1e6, 3.0)] * 4 + [(1e6, 1e6, math.nan)], "positive and finite"),
])
def test_what_cannot_be_fitted_is_refused(points, message):
    with pytest.raises(ValueError, match=message):
        fit(points)
