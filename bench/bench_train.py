"""Training throughput per preset: tokens/s, step time, loop overhead, data wait, MFU, peak memory.

    python bench/bench_train.py [--presets tiny mini-30m minimind-26m] [--dtypes float32 bfloat16] [--compile both]

For every (preset, dtype, compile) it measures
  - the bare step: forward + loss + backward + clip + AdamW on one fixed batch, in a tight loop;
  - the real loop: train_pretrain.py in-process on the bundled corpus (data feeding, logging, bookkeeping);
and reports loop overhead = 1 - bare / loop step time (target <= 3%), the data-wait fraction, effective
(non-padding) tokens/s, MFU where the device's peak is known, and peak memory.
"""
from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import train_pretrain  # noqa: E402
from model import PocketLM, get_preset  # noqa: E402
from trainer_utils.metrics import flops_per_token, peak_flops  # noqa: E402
from trainer_utils.optim import build_optimizer  # noqa: E402
from trainer_utils.runtime import DTYPES, Precision  # noqa: E402


def bare_step_seconds(preset: str, dtype: str, compile_model: bool, batch: int, seq: int, steps: int,
                      device: torch.device) -> float:
    """Median time of forward + backward + optimizer step on one fixed batch."""
    torch.manual_seed(0)
    cfg = get_preset(preset, max_seq_len=seq, max_position_embeddings=max(seq, get_preset(preset).max_position_embeddings))
    model = PocketLM(cfg).to(device).train()
    opt = build_optimizer(model, "adamw", 1e-4, 0.1, (0.9, 0.95), 0.9, device)
    precision = Precision(device, DTYPES[dtype])
    fwd = torch.compile(model) if compile_model else model
    x = torch.randint(0, cfg.vocab_size, (batch, seq), device=device)
    y = torch.randint(0, cfg.vocab_size, (batch, seq), device=device)

    def step() -> None:
        with precision.autocast():
            logits = fwd(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum") / y.numel()
        precision.scaler.scale(loss).backward()
        precision.scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        precision.scaler.step(opt)
        precision.scaler.update()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):  # warm-up (and compilation)
        step()
    times = []
    for _ in range(steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def loop_metrics(preset: str, dtype: str, compile_model: bool, batch: int, seq: int, steps: int,
                 out: Path) -> dict:
    """The last logged window of a real train_pretrain.py run (after as many warm-up steps)."""
    run = f"{preset}-{dtype}-{'compile' if compile_model else 'eager'}"
    argv = ["--preset", preset, "--dtype", dtype, "--batch_size", str(batch), "--max_seq_len", str(seq),
            "--max_steps", str(2 * steps), "--log_interval", str(steps), "--eval_interval", "1000000",
            "--save_interval", "1000000", "--out_dir", str(out), "--run_name", run, "--overwrite"]
    if compile_model:
        argv.append("--compile")
    assert train_pretrain.main(argv) == 0
    records = [json.loads(line) for line in open(out / run / "metrics.jsonl") if '"loss"' in line]
    return records[-1]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="+", default=["tiny", "mini-30m", "minimind-26m"])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--compile", choices=("off", "on", "both"), default="both")
    p.add_argument("--batch_size", type=int, default=None, help="default: 8 on CPU, 32 on GPU")
    p.add_argument("--max_seq_len", type=int, default=None, help="default: 256 on CPU, 512 on GPU")
    p.add_argument("--steps", type=int, default=None, help="measured steps (default: 6 on CPU, 30 on GPU)")
    p.add_argument("--out", default=None, help="write the results JSON here")
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gpu = device.type == "cuda"
    batch = args.batch_size or (32 if gpu else 8)
    seq = args.max_seq_len or (512 if gpu else 256)
    steps = args.steps or (30 if gpu else 6)
    compiles = {"off": [False], "on": [True], "both": [False, True]}[args.compile]
    peak = peak_flops(device)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for preset in args.presets:
            for dtype in args.dtypes:
                if dtype == "bfloat16" and gpu and not torch.cuda.is_bf16_supported():
                    continue
                for comp in compiles:
                    if gpu:
                        torch.cuda.reset_peak_memory_stats()
                    bare = bare_step_seconds(preset, dtype, comp, batch, seq, steps, device)
                    loop = loop_metrics(preset, dtype, comp, batch, seq, steps, Path(tmp))
                    cfg = get_preset(preset)
                    row = {"preset": preset, "dtype": dtype, "compile": comp, "batch_size": batch, "seq_len": seq,
                           "bare_step_s": round(bare, 4), "loop_step_s": loop["step_time_s"],
                           "loop_overhead_frac": round(max(0.0, 1 - bare / loop["step_time_s"]), 4),
                           "data_wait_frac": loop["data_wait_frac"], "tokens_per_s": loop["tokens_per_s"]}
                    if peak is not None:
                        fpt = flops_per_token(cfg.num_parameters(non_embedding=True), cfg.num_hidden_layers,
                                              cfg.hidden_size, seq)
                        row["mfu"] = round(fpt * batch * seq / bare / peak, 4)
                    row["peak_mem_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 3) if gpu else \
                        round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)
                    results.append(row)
                    print(json.dumps(row), flush=True)
    report = {"device": torch.cuda.get_device_name() if gpu else "cpu", "threads": torch.get_num_threads(),
              "torch": torch.__version__, "results": results}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
