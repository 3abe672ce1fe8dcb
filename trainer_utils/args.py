"""Command-line flags shared by train_pretrain.py and train_full_sft.py (MiniMind names where one exists)."""
from __future__ import annotations

import argparse

from model.config import PRESETS
from model.inference import resolve_device

STAGE_DEFAULTS = {
    "pretrain": dict(data_path="dataset/demo/pretrain_demo.jsonl", batch_size=32, learning_rate=5e-4,
                     run_name=None),
    "sft": dict(data_path="dataset/demo/sft_demo.jsonl", batch_size=16, learning_rate=5e-5, run_name=None),
}


def build_parser(stage: str, description: str) -> argparse.ArgumentParser:
    d = STAGE_DEFAULTS[stage]
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)

    g = p.add_argument_group("data")
    g.add_argument("--data_path", default=d["data_path"], help="JSONL file (tokenized once, cached beside it)")
    g.add_argument("--tokenizer", default=None, help="tokenizer dir (default: model/tokenizer, or the init "
                                                     "checkpoint's)")
    g.add_argument("--val_fraction", type=float, default=0.005, help="documents held out for validation")
    g.add_argument("--num_workers", type=int, default=None, help="tokenization processes (default: CPUs, ≤8)")
    g.add_argument("--cache_dir", default=None, help="token cache location (default: beside the data)")
    g.add_argument("--skip_bad_lines", action="store_true", help="skip and count malformed lines")
    if stage == "sft":
        g.add_argument("--overlong", choices=("truncate", "drop"), default="truncate",
                       help="conversations over max_seq_len: cut at a turn boundary, or drop")

    g = p.add_argument_group("model")
    g.add_argument("--preset", default="minimind-26m", choices=sorted(PRESETS))
    g.add_argument("--hidden_size", type=int, default=None, help="override the preset")
    g.add_argument("--num_hidden_layers", type=int, default=None, help="override the preset")
    g.add_argument("--max_seq_len", type=int, default=None, help="training context (default: the preset's)")
    g.add_argument("--dropout", type=float, default=None)
    if stage == "sft":
        g.add_argument("--init_from", default=None, help="pretrain run/checkpoint to start from")
    g.add_argument("--grad_checkpointing", action="store_true", help="recompute blocks in backward: less memory")
    g.add_argument("--compile", action="store_true", help="torch.compile the model")

    g = p.add_argument_group("optimization")
    g.add_argument("--epochs", type=int, default=1)
    g.add_argument("--max_steps", type=int, default=None, help="optimizer steps (overrides --epochs)")
    g.add_argument("--batch_size", type=int, default=d["batch_size"], help="per device micro-batch")
    g.add_argument("--accumulation_steps", type=int, default=1)
    g.add_argument("--learning_rate", type=float, default=d["learning_rate"])
    g.add_argument("--min_lr", type=float, default=None, help="end of the cosine (default: learning_rate/10)")
    g.add_argument("--warmup_steps", type=int, default=None)
    g.add_argument("--warmup_ratio", type=float, default=0.01, help="used when --warmup_steps is not given")
    g.add_argument("--weight_decay", type=float, default=0.1)
    g.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    g.add_argument("--beta1", type=float, default=0.9)
    g.add_argument("--beta2", type=float, default=0.95)
    g.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (Nesterov)")
    g.add_argument("--grad_clip", type=float, default=1.0, help="0 disables clipping")
    g.add_argument("--max_bad_steps", type=int, default=10,
                   help="stop after this many consecutive steps skipped for non-finite gradients")
    g.add_argument("--seed", type=int, default=42)

    g = p.add_argument_group("precision and devices")
    g.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    g.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    g.add_argument("--tf32", action=argparse.BooleanOptionalAction, default=True,
                   help="TF32 tensor cores for fp32 matmuls on Ampere+ GPUs (--no-tf32: strict fp32)")
    g.add_argument("--deepspeed", default=None, help="DeepSpeed config JSON (e.g. launch/ds_zero2.json)")
    # The deepspeed launcher appends --local_rank=N; the same value is in $LOCAL_RANK, which is what we read.
    g.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    g.add_argument("--dist_timeout", type=int, default=600,
                   help="seconds a collective may wait for other ranks before failing")

    g = p.add_argument_group("output and logging")
    g.add_argument("--out_dir", default="out")
    g.add_argument("--run_name", default=None, help=f"default: {stage}-<preset>")
    g.add_argument("--resume", action="store_true", help="continue out_dir/run_name from its latest checkpoint")
    g.add_argument("--overwrite", action="store_true", help="delete an existing run of the same name first")
    g.add_argument("--save_interval", type=int, default=500, help="steps between checkpoints")
    g.add_argument("--keep_last", type=int, default=3, help="checkpoints kept")
    g.add_argument("--log_interval", type=int, default=10)
    g.add_argument("--eval_interval", type=int, default=500, help="steps between validation passes")
    g.add_argument("--eval_batches", type=int, default=20, help="validation batches per pass")
    g.add_argument("--use_wandb", action="store_true", help="log to wandb (offline unless WANDB_API_KEY is set)")
    g.add_argument("--wandb_project", default="pocketlm")
    g.add_argument("--use_tensorboard", action="store_true")
    return p


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """Reject inconsistent flags with argparse's usual one-line error."""
    for name in ("batch_size", "accumulation_steps", "epochs", "save_interval", "log_interval", "eval_interval",
                 "keep_last", "max_bad_steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    if args.max_steps is not None and args.max_steps < 1:
        p.error("--max_steps must be >= 1")
    if args.learning_rate <= 0:
        p.error("--learning_rate must be > 0")
    if args.resume and args.overwrite:
        p.error("--resume and --overwrite contradict each other")
    if not 0 <= args.warmup_ratio < 1:
        p.error("--warmup_ratio must be in [0, 1)")
    try:
        resolve_device(args.device)  # before data preparation, not after it
    except ValueError as e:
        p.error(f"--device {args.device}: {e}")
    return args
