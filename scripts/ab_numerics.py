"""Numerics A/B for refactors of the training code: every stage, fp32 and bf16, small and deterministic.

    python scripts/ab_numerics.py record /tmp/before.json      # at the commit before the change
    python scripts/ab_numerics.py record /tmp/after.json       # after it
    python scripts/ab_numerics.py compare /tmp/before.json /tmp/after.json
    python scripts/ab_numerics.py record /tmp/demo.json --demo_recipes     # the demo recipes' first steps instead

`record` trains a tiny pretraining model with Muon, then SFT, LoRA, DPO and distillation on top of it (AdamW), GRPO
from the SFT model (without and with the KL term, and CISPO's loss; rewarded by a term that varies within a
group, so advantages are not all zero; held-out math scored), and a
mixture-of-experts pretraining run, each in float32 and bfloat16 on the bundled demo data, with logging, evaluation,
layer statistics, samples and probes at short intervals, and a resume half-way for pretraining. It keeps each
run's metrics.jsonl (timings dropped), samples and probes, and the sha256 of every final weight file. `compare`
says which differ, value by value: a refactor that leaves the numerics alone shows none.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from common.files import METRICS_NAME  # noqa: E402
from model.loading import resolve_model_dir  # noqa: E402

# what a rerun may change: wall-clock time and the process's memory
TIMING_KEYS = {"tokens_per_s", "step_time_s", "data_wait_frac", "elapsed_s", "peak_rss_gb", "peak_mem_gb", "mfu",
               "time", "memory_measured_gb", "rollout_tokens_per_s"}
COMMON = ["--num_workers", "0", "--batch_size", "4", "--log_interval", "2", "--eval_interval", "4",
          "--save_interval", "4", "--eval_batches", "2", "--probes", "dataset/prompts/probes.tsv",
          "--sample_tokens", "8", "--overwrite"]


def runs(out: Path, dtype: str) -> list[tuple[str, str, list[str]]]:
    """(name, script, flags) of every run, in the order they depend on each other."""
    base = ["--out_dir", str(out), "--dtype", dtype, "--cache_dir", str(out / "cache"), *COMMON]
    pretrain = out / f"pretrain-{dtype}"
    sft = out / f"sft-{dtype}"
    tiny = ["--preset", "tiny", "--max_seq_len", "64"]
    reward = f"exact,{out / 'reward.py'}:score"
    return [
        (f"pretrain-{dtype}", "train_pretrain.py", [*base, *tiny, "--max_steps", "8", "--optimizer", "muon",
                                                    "--learning_rate", "2e-3", "--warmup_steps", "2"]),
        (f"sft-{dtype}", "train_full_sft.py", [*base, "--init_from", str(pretrain), "--max_steps", "6",
                                               "--max_seq_len", "64", "--learning_rate", "1e-3"]),
        (f"lora-{dtype}", "train_lora.py", [*base, "--init_from", str(sft), "--max_steps", "6",
                                            "--max_seq_len", "64", "--lora_rank", "4"]),
        (f"dpo-{dtype}", "train_dpo.py", [*base, "--init_from", str(sft), "--max_steps", "6", "--max_seq_len",
                                          "64", "--learning_rate", "1e-4"]),
        (f"dpo-lora-{dtype}", "train_dpo.py", [*base, "--init_from", str(sft), "--max_steps", "4",
                                               "--max_seq_len", "64", "--lora_rank", "4"]),
        (f"distill-{dtype}", "train_distillation.py", [*base, "--teacher", str(pretrain), *tiny,
                                                       "--hidden_size", "32", "--max_steps", "6"]),
        *[(f"{name}-{dtype}", "train_grpo.py", [*base, "--init_from", str(sft), "--max_steps", "4",
                                                "--batch_size", "2", "--num_generations", "4",
                                                "--max_completion_tokens", "8", "--max_seq_len", "64",
                                                "--learning_rate", "1e-3", "--sample_prompts", "none",
                                                "--eval_tasks", "dataset/demo/math_heldout.jsonl",
                                                "--eval_task_items", "4", "--reward", reward, *extra])
          for name, extra in (("grpo", []), ("grpo-kl", ["--beta", "0.04"]), ("cispo", ["--loss_type", "cispo"]))],
        (f"moe-{dtype}", "train_pretrain.py", [*base, *tiny, "--num_experts", "4", "--num_experts_per_tok", "2",
                                               "--max_steps", "6", "--optimizer", "adamw",
                                               "--router_bias_update_rate", "0.001"]),
    ]


# The demo recipes in the order they start from each other, each with the run its --init_from / --teacher names
DEMO_CHAIN = (("demo-pretrain", "train_pretrain.py", {}),
              ("demo-sft", "train_full_sft.py", {"init_from": "demo-pretrain"}),
              ("demo-lora", "train_lora.py", {"init_from": "demo-sft"}),
              ("demo-dpo", "train_dpo.py", {"init_from": "demo-sft"}),
              ("demo-distill", "train_distillation.py", {"teacher": "demo-pretrain"}),
              ("demo-math-sft", "train_full_sft.py", {"init_from": "demo-sft"}),
              ("demo-grpo", "train_grpo.py", {"init_from": "demo-math-sft"}))


def recipe_runs(out: Path, dtype: str) -> list[tuple[str, str, list[str]]]:
    """The demo recipes as shipped (full-size models, their data and settings), each for its first 3 steps from the
    3-step run of the recipe it starts from, evaluated (and checkpointed) at step 3."""
    base = ["--out_dir", str(out), "--dtype", dtype, "--cache_dir", str(out / "cache"), "--num_workers", "0",
            "--max_steps", "3", "--log_interval", "1", "--eval_interval", "3", "--save_interval", "3",
            "--eval_batches", "2", "--eval_task_items", "8", "--overwrite"]
    def start(flag: str, run: str) -> list[str]:
        return [f"--{flag}", str(out / f"{run}-{dtype}")]
    return [(f"{name}-{dtype}", script, ["--config", f"recipes/{name}.yaml", *base,
                                         *(a for k, v in starts.items() for a in start(k, v))])
            for name, script, starts in DEMO_CHAIN]


def read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING_KEYS} for line in path.open()]


def record(path: Path, dtypes: list[str], demo_recipes: bool = False) -> None:
    results: dict[str, dict] = {}
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        # a reward that differs between a group's completions however little the tiny model has learned (its
        # answers are never right): advantages that are not all zero, so the policy loss moves the weights
        (out / "reward.py").write_text("def score(completion, record):\n    return sum(map(ord, completion)) % 7 / 7\n")
        for dtype in dtypes:
            for name, script, flags in (recipe_runs if demo_recipes else runs)(out, dtype):
                run_name = ["--run_name", name]
                if name.startswith("pretrain"):  # stop half-way, then resume: the resumed half must match too
                    at = flags.index("--max_steps") + 1
                    half = [*flags[:at], "4", *flags[at + 1:]]
                    subprocess.run([sys.executable, script, *half, *run_name], cwd=ROOT, env=env, check=True,
                                   capture_output=True)
                    flags = [f for f in flags if f != "--overwrite"] + ["--resume"]
                done = subprocess.run([sys.executable, script, *flags, *run_name], cwd=ROOT, env=env,
                                      capture_output=True, text=True)
                if done.returncode != 0:
                    sys.exit(f"{name} failed ({done.returncode}):\n{done.stderr[-3000:]}")
                run_dir = out / name
                weights = sorted(resolve_model_dir(run_dir).glob("*.safetensors"))
                if not weights:  # the comparison must not pass for want of anything to compare
                    sys.exit(f"{name}: no weights in {run_dir}'s latest checkpoint")
                results[name] = {
                    "metrics": read_jsonl(run_dir / METRICS_NAME),
                    "samples": read_jsonl(run_dir / "samples.jsonl"),
                    "probes": read_jsonl(run_dir / "probes.jsonl"),
                    "rollouts": read_jsonl(run_dir / "rollouts.jsonl"),
                    "weights": {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in weights},
                }
                print(f"{name}: {len(results[name]['metrics'])} records", file=sys.stderr)
    path.write_text(json.dumps(results, indent=1) + "\n")


def compare(a_path: Path, b_path: Path) -> int:
    a, b = json.loads(a_path.read_text()), json.loads(b_path.read_text())
    differences = 0
    for name in sorted(set(a) | set(b)):
        if name not in a or name not in b:
            print(f"{name}: only in {'the first' if name in a else 'the second'}")
            differences += 1
            continue
        for part in ("metrics", "samples", "probes", "rollouts", "weights"):
            x, y = a[name].get(part, []), b[name].get(part, [])
            if part != "weights":  # a recording made before a timing key was known to be one
                x, y = ([{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rows] for rows in (x, y))
            if x == y:
                continue
            differences += 1
            if part == "weights":
                print(f"{name}: final weights differ")
                continue
            for i, (r, s) in enumerate(zip(x, y)):
                if r != s:
                    keys = sorted(k for k in set(r) | set(s) if r.get(k) != s.get(k))
                    print(f"{name} {part}[{i}]: " + ", ".join(f"{k} {r.get(k)!r} -> {s.get(k)!r}" for k in keys[:6]))
                    break
            if len(x) != len(y):
                print(f"{name} {part}: {len(x)} records against {len(y)}")
    print("identical" if differences == 0 else f"{differences} differences")
    return 1 if differences else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("record")
    r.add_argument("out", type=Path)
    r.add_argument("--dtypes", nargs="+", default=None, help="default: float32 and bfloat16 (--demo_recipes: "
                                                              "float32)")
    r.add_argument("--demo_recipes", action="store_true", help="the demo recipes' first steps instead (their "
                                                                "full-size models)")
    c = sub.add_parser("compare")
    c.add_argument("first", type=Path)
    c.add_argument("second", type=Path)
    args = p.parse_args()
    if args.command == "record":
        record(args.out, args.dtypes or (["float32"] if args.demo_recipes else ["float32", "bfloat16"]),
               args.demo_recipes)
        return 0
    return compare(args.first, args.second)


if __name__ == "__main__":
    sys.exit(main())
