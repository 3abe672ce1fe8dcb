"""Fit the loss model (trainer_utils/loss_model.py) to short pretraining runs of the bundled corpus.

    python bench/fit_loss_model.py                                       # depths 2-5 at 120, 240, 480 steps, fp32
    python bench/fit_loss_model.py --depths 2 3 4 --steps 120 240 --out /tmp/fit.json
    python bench/fit_loss_model.py --holdout 6:240 4:720          # and predict runs left out of the fit
    python bench/fit_loss_model.py --depths 1 2 3 4 --steps 120 240 480 960 \
        --more 5:120 5:240 5:480 6:120 6:240                         # the shipped fit (FIT_RESULTS)
    python bench/fit_loss_model.py --depths 3 4 --steps 480 --model bench/results/loss-model-demo.json \
        --out /tmp/check.json                                      # runs tested against the shipped fit

Every run is a model of the depth family (`--preset depth-N`, model/config.py: 64 x depth wide, heads of 64, two
key-value heads where the heads divide by two, QK-norm, context 256) trained with the recipe's settings
(loss_model.RECIPE: Muon's matrices at learning rate 4e-3 x 256 / width, the embedding and norms at 8e-3, 20
warm-up steps, 16 sequences a step) for a given number of steps, its schedule completed there, in a process of its own
(train_pretrain.py), evaluated --evals times on its way (its curve). A run's point is (non-embedding parameters,
tokens trained on, final validation loss); the fit, its constants and each point's relative error are written to
--out, with the progress table of the curves of the runs of at least --progress_steps steps (where a run's
validation loss is at each tenth of its steps, against the model: what the on-track check expects). --more runs
(DEPTH:STEPS) are fitted beside the grid of --depths x --steps. --model tests the runs against a recorded fit
instead of fitting them. --holdout runs are trained the same way but left out of the fit: their predicted and actual
losses test it beyond the sizes and lengths it saw. A run already done (its metrics.jsonl in --runs_dir has its last
step) is read, not trained again, so an interrupted fit continues where it stopped (unless it was trained with other
settings than the recipe's: then it is trained again). The losses do not depend on the machine (fp32, one process);
the time each run took does, and is recorded with the machine.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from common.device import cpu_model  # noqa: E402
from common.files import METRICS_NAME  # noqa: E402
from model.config import DEPTH_PREFIX, get_preset  # noqa: E402
from trainer_utils.loss_model import CONSTANTS, FIT_CONTEXT, FIT_DATA, RECIPE, LossModel, fit, recipe_flags  # noqa: E402

DATA = ROOT / FIT_DATA
SHARES = tuple(k / 10 for k in range(1, 11))  # of a run's steps, where its curve is read for the progress table
# what another precision or seed moves a run by, beyond the fit's runs (all fp32, one seed): CI's make demo in bf16
# ended 1.6% above the loss the first fit expected of it
ELSEWHERE = 0.02


def family_config(depth: int):
    """The depth family's model of `depth` layers (the shipped tokenizer's vocabulary)."""
    return get_preset(f"{DEPTH_PREFIX}{depth}", vocab_size=6400)


def trained_with_recipe(run_dir: Path) -> bool:
    """Whether the run in `run_dir` was trained with the recipe as it is now (a run of an earlier recipe is
    trained again, not fitted)."""
    try:
        optim = json.loads((run_dir / "train_config.json").read_text())["optim"]
    except (OSError, ValueError, KeyError):
        return False
    return all(optim.get(key) == value for key, value in RECIPE.items())


def last_record(run_dir: Path, steps: int) -> dict | None:
    """The final evaluation and the last log record of a finished run, merged, with its "curve": the validation
    loss at every evaluation, [step, loss] (None: not finished)."""
    path = run_dir / METRICS_NAME
    if not path.is_file() or not trained_with_recipe(run_dir):
        return None
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    final = [r for r in records if r.get("step") == steps]
    if not any("val_loss" in r for r in final) or not any("tokens_seen" in r for r in final):
        return None
    curve = [[r["step"], r["val_loss"]] for r in records if "val_loss" in r]
    return {**{k: v for r in final for k, v in r.items()}, "curve": curve}


def train(depth: int, steps: int, runs_dir: Path, dtype: str, evals: int) -> tuple[dict, float | None]:
    """The finished run of `depth` for `steps` steps (trained now unless it is done); its record and seconds."""
    name = f"depth{depth}-steps{steps}"
    record = last_record(runs_dir / name, steps)
    if record is not None:
        return record, None
    argv = [sys.executable, str(ROOT / "train_pretrain.py"), "--data_path", str(DATA),
            "--preset", f"{DEPTH_PREFIX}{depth}", "--dtype", dtype,
            *recipe_flags(), "--batch_size", str(RECIPE["batch_size"]), "--max_steps", str(steps),
            "--eval_interval", str(max(1, steps // evals)),
            "--log_interval", str(steps), "--no-checkpoints", "--sample_prompts", "none", "--probes", "none",
            "--out_dir", str(runs_dir), "--run_name", name, "--overwrite"]
    t0 = time.perf_counter()
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{name}: train_pretrain.py failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    record = last_record(runs_dir / name, steps)
    if record is None:
        raise SystemExit(f"{name}: no final evaluation in {runs_dir / name / 'metrics.jsonl'}")
    return record, time.perf_counter() - t0


def run_point(depth: int, steps: int, args: argparse.Namespace) -> dict:
    """One run's point and what it took, trained now unless it is done."""
    cfg = family_config(depth)
    record, seconds = train(depth, steps, args.runs_dir, args.dtype, args.evals)
    r = {"depth": depth, "steps": steps, "parameters": cfg.num_parameters(non_embedding=True),
         "parameters_total": cfg.num_parameters(), "tokens": record["tokens_seen"], "val_loss": record["val_loss"],
         "val_bpb": record.get("val_bpb"), "seconds": None if seconds is None else round(seconds, 1),
         "curve": record["curve"]}
    print(f"depth {depth} ({r['parameters'] / 1e6:.2f}M non-embedding), {steps} steps, {r['tokens'] / 1e6:.2f}M "
          f"tokens: val loss {r['val_loss']:.4f}" + (f" ({seconds:.0f} s)" if seconds else " (done before)"),
          flush=True)
    return r


def predict(runs: list[dict], model: LossModel) -> None:
    """Each run's predicted final loss and its relative error (predicted / actual - 1), written into it."""
    for r in runs:
        r["predicted"] = round(model.loss(r["parameters"], r["tokens"]), 4)
        r["relative_error"] = round(model.loss(r["parameters"], r["tokens"]) / r["val_loss"] - 1, 4)


def progress(runs: list[dict], model: LossModel, model_error: float, min_tokens: int) -> dict | None:
    """The progress table (trainer_utils/loss_model.py Progress) of the runs' curves: at each share of a run's steps,
    the median run's validation loss over the model's L(N, tokens so far), read only where the tokens so far are at
    least `min_tokens` (the fewest any fitted run trained on: below that the model extrapolates, and a curve's early
    points say more about that than about the run), and the largest relative distance of a run from it plus
    ELSEWHERE (these runs share one seed and fp32). Each run is read against the model, so that distance already
    holds the model's error on the run's size; `model_error`, the model's worst error on these runs, is what a model
    of a size outside them gets on top ("beyond"). Shares with fewer than two such points are left out; None when
    none has two."""
    tokens_per_step = RECIPE["batch_size"] * FIT_CONTEXT
    ratios: dict[float, list[float]] = {f: [] for f in SHARES}
    for r in runs:
        points = {step: loss for step, loss in r.get("curve", [])}
        for f in SHARES:
            step = round(f * r["steps"])
            if step in points and step * tokens_per_step >= min_tokens:
                ratios[f].append(points[step] / model.loss(r["parameters"], step * tokens_per_step))
    kept = {f: v for f, v in ratios.items() if len(v) >= 2}
    if not kept:
        return None
    median = [statistics.median(v) for v in kept.values()]
    spread = [max(abs(q / m - 1) for q in v) for v, m in zip(kept.values(), median)]
    return {"runs": len(runs), "min_tokens": min_tokens, "shares": list(kept),
            "points": [len(v) for v in kept.values()], "ratios": [round(m, 4) for m in median],
            "tolerances": [round(x + ELSEWHERE, 3) for x in spread], "beyond": round(model_error, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depths", type=int, nargs="+", default=[2, 3, 4, 5])
    parser.add_argument("--steps", type=int, nargs="+", default=[120, 240, 480],
                        help="run lengths (16 x 256 tokens a step: 0.5, 1 and 2M tokens by default)")
    parser.add_argument("--more", nargs="*", default=[], metavar="DEPTH:STEPS",
                        help="runs fitted beside the grid of --depths x --steps")
    parser.add_argument("--holdout", nargs="*", default=[], metavar="DEPTH:STEPS",
                        help="runs to predict, left out of the fit")
    parser.add_argument("--progress_steps", type=int, default=240,
                        help="the progress table is read from the runs of at least this many steps")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--evals", type=int, default=10, help="evaluations in a run (its curve; the last at its end)")
    parser.add_argument("--runs_dir", type=Path, default=ROOT / "out" / "loss-model")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "loss-model-demo.json")
    parser.add_argument("--model", type=Path, help="a recorded fit (its \"model\") to test the runs against, "
                                                   "instead of fitting them")
    args = parser.parse_args()
    more, holdout = ([tuple(map(int, h.split(":"))) for h in given] for given in (args.more, args.holdout))
    fitted = [(depth, steps) for depth in args.depths for steps in args.steps] + more
    if not args.model and len(fitted) < CONSTANTS:  # said before hours of training, not after
        parser.error(f"the loss model has {CONSTANTS} constants: fitting it needs at least {CONSTANTS} runs "
                     f"(--depths x --steps, and --more), got {len(fitted)}")
    runs = [run_point(depth, steps, args) for depth, steps in fitted]
    if args.model:
        recorded = json.loads(args.model.read_text())
        model, min_tokens = LossModel.from_dict(recorded["model"]), min(r["tokens"] for r in recorded["runs"])
    else:
        model = fit([(r["parameters"], r["tokens"], r["val_loss"]) for r in runs]).model
        min_tokens = min(r["tokens"] for r in runs)
    predict(runs, model)
    # the progress table: of the runs long enough for a curve the on-track check would read (the shortest ones are
    # where the additive model misses most, at their end), with their worst error
    long_runs = [r for r in runs if r["steps"] >= args.progress_steps]
    model_error = max((abs(r["relative_error"]) for r in long_runs), default=0.0)
    held = [run_point(depth, steps, args) for depth, steps in holdout]
    predict(held, model)
    for r in held:
        print(f"held out: depth {r['depth']}, {r['steps']} steps: predicted {r['predicted']:.4f}, actual "
              f"{r['val_loss']:.4f} ({r['relative_error']:+.2%})")
    worst = max(abs(r["relative_error"]) for r in runs)
    report = {"machine": cpu_model(), "cores": os.cpu_count(), "dtype": args.dtype, "data": str(DATA.relative_to(ROOT)),
              "family": f"{DEPTH_PREFIX}N", "recipe": RECIPE, "parameters": "non-embedding",
              **({"model_from": str(args.model)} if args.model else {}),
              "model": {k: round(v, 6) for k, v in model.to_dict().items()},
              "worst_relative_error": round(worst, 4),
              "progress": progress(long_runs, model, model_error, min_tokens), "progress_steps": args.progress_steps,
              "runs": runs,
              "held_out": held}
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"L(N, D) = {model.E:.3f} + {model.A:.4g} / N^{model.alpha:.3f} + {model.B:.4g} / D^{model.beta:.3f}; "
          f"worst relative error {worst:.2%}; written to {args.out}")


if __name__ == "__main__":
    main()
