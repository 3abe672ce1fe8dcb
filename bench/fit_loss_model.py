"""Fit the loss model (trainer_utils/loss_model.py) to short pretraining runs of the bundled corpus.

    python bench/fit_loss_model.py                                       # depths 2-5, 3 lengths each, fp32
    python bench/fit_loss_model.py --depths 2 3 4 --steps 120 240 --out /tmp/fit.json
    python bench/fit_loss_model.py --holdout 6:240 4:720          # and predict runs left out of the fit

Every run is a model of the depth family (`--preset depth-N`, model/config.py: 64 x depth wide, heads of 64, two
key-value heads where the heads divide by two, QK-norm, context 256) trained with the demo recipe's settings
(Muon at learning rate 4e-3, 20 warm-up steps, 16 sequences a step) for a given number of steps, its schedule
completed there, in a process of its own (train_pretrain.py). A run's point is (non-embedding parameters, tokens
trained on, final validation loss); the fit, its constants and each point's relative error are written to --out.
--holdout runs (DEPTH:STEPS) are trained the same way but left out of the fit: their predicted and actual losses
test it beyond the sizes and lengths it saw. A run already done (its metrics.jsonl in --runs_dir has its last step)
is read, not trained again, so an
interrupted fit continues where it stopped. The losses do not depend on the machine (fp32, one process); the time
each run took does, and is recorded with the machine.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from common.device import cpu_model  # noqa: E402
from model.config import DEPTH_PREFIX, get_preset  # noqa: E402
from trainer_utils.loss_model import FIT_DATA, RECIPE, fit  # noqa: E402

DATA = ROOT / FIT_DATA


def family_config(depth: int):
    """The depth family's model of `depth` layers (the shipped tokenizer's vocabulary)."""
    return get_preset(f"{DEPTH_PREFIX}{depth}", vocab_size=6400)


def last_record(run_dir: Path, steps: int) -> dict | None:
    """The final evaluation and the last log record of a finished run, merged, with its "curve": the validation
    loss at every evaluation, [step, loss] (None: not finished)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
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
            "--learning_rate", str(RECIPE["learning_rate"]), "--warmup_steps", str(RECIPE["warmup_steps"]),
            "--batch_size", str(RECIPE["batch_size"]), "--max_steps", str(steps),
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depths", type=int, nargs="+", default=[2, 3, 4, 5])
    parser.add_argument("--steps", type=int, nargs="+", default=[120, 240, 480],
                        help="run lengths (16 x 256 tokens a step: 0.5, 1 and 2M tokens by default)")
    parser.add_argument("--holdout", nargs="*", default=[], metavar="DEPTH:STEPS",
                        help="runs to predict, left out of the fit")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--evals", type=int, default=10, help="evaluations in a run (its curve; the last at its end)")
    parser.add_argument("--runs_dir", type=Path, default=ROOT / "out" / "loss-model")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "loss-model-demo.json")
    args = parser.parse_args()
    holdout = [tuple(map(int, h.split(":"))) for h in args.holdout]
    runs = [run_point(depth, steps, args) for depth in args.depths for steps in args.steps]
    result = fit([(r["parameters"], r["tokens"], r["val_loss"]) for r in runs])
    for r, error in zip(runs, result.relative_errors):
        r["predicted"] = round(result.model.loss(r["parameters"], r["tokens"]), 4)
        r["relative_error"] = round(error, 4)
    held = [run_point(depth, steps, args) for depth, steps in holdout]
    for r in held:
        r["predicted"] = round(result.model.loss(r["parameters"], r["tokens"]), 4)
        r["relative_error"] = round(r["predicted"] / r["val_loss"] - 1, 4)
        print(f"held out: depth {r['depth']}, {r['steps']} steps: predicted {r['predicted']:.4f}, actual "
              f"{r['val_loss']:.4f} ({r['relative_error']:+.2%})")
    report = {"machine": cpu_model(), "cores": os.cpu_count(), "dtype": args.dtype, "data": str(DATA.relative_to(ROOT)),
              "family": f"{DEPTH_PREFIX}N", "recipe": RECIPE, "parameters": "non-embedding",
              "model": {k: round(v, 6) for k, v in result.model.to_dict().items()},
              "worst_relative_error": round(result.worst, 4), "runs": runs, "held_out": held}
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    m = result.model
    print(f"L(N, D) = {m.E:.3f} + {m.A:.4g} / N^{m.alpha:.3f} + {m.B:.4g} / D^{m.beta:.3f}; worst relative error "
          f"{result.worst:.2%}; written to {args.out}")


if __name__ == "__main__":
    main()
