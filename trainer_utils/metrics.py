"""Observability: metrics.jsonl, a progress bar, optional wandb / tensorboard, and MFU from a peak-FLOPs table."""
from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import torch

from common.device import synchronize
from common.files import METRICS_NAME

if TYPE_CHECKING:
    from model import ModelConfig

# Dense bf16/fp16 tensor-core peak (FLOP/s, no sparsity) by substring of torch.cuda.get_device_name().
# Consumer cards list the fp32-accumulate rate, which is what PyTorch's bf16 matmuls use. Order matters:
# the first matching key wins, so more specific names come first.
PEAK_FLOPS: dict[str, float] = {
    # the NVL (PCIe, air-cooled) parts run lower clocks than the SXM ones: 835 vs 989 TFLOP/s dense
    "H200 NVL": 835e12, "H100 NVL": 835e12,
    "H200": 989e12, "H100 PCIe": 756e12, "H100": 989e12, "H800": 989e12, "GH200": 989e12,
    "B200": 2250e12, "A100": 312e12, "A800": 312e12, "A6000": 155e12, "A40": 150e12, "A30": 165e12,
    "A10G": 70e12, "A10": 125e12, "L40S": 362e12, "L40": 181e12, "L4": 121e12, "V100": 125e12, "T4": 65e12,
    "RTX 5090": 209e12, "RTX 5080": 113e12, "RTX 4090": 165e12, "RTX 4080": 97.5e12, "RTX 4070 Ti": 80e12,
    "RTX 4070": 58e12, "RTX 4060": 30e12, "RTX 3090 Ti": 80e12, "RTX 3090": 71e12, "RTX 3080": 59.5e12,
    "RTX 3070": 40.6e12, "RTX 3060": 25.6e12, "RTX 2080 Ti": 53.8e12,
}


def peak_flops(device: torch.device) -> float | None:
    """Peak FLOP/s of the device, or None when unknown (CPU, unlisted GPU): MFU is then omitted, not 0."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_FLOPS.items() if k in name), None)


def flops_per_token(config: "ModelConfig", seq_len: int) -> float:
    """Training FLOPs per token (PaLM appendix B): 6 per weight that multiplies an activation, plus
    12·L·d·T for the attention scores. The output projection counts even when it is tied to the embedding:
    at vocab 6400 it is ~15% of the 26M model's matmul work, while the input lookup costs nothing. A mixture of
    experts counts the experts a token uses (active parameters), not all of them."""
    matmul_weights = config.num_parameters(non_embedding=True, active=True) + config.vocab_size * config.hidden_size
    return 6 * matmul_weights + 12 * config.num_hidden_layers * config.hidden_size * seq_len


class TrainClock:
    """Seconds spent training so far: wall time minus the pauses for evaluation and checkpoints, so runs that
    evaluate more often (or on a slower disk) still compare by the time their training took."""

    def __init__(self, device: torch.device, start_s: float = 0.0) -> None:
        self.device, self.start_s = device, start_s  # start_s: the time a resumed run had already trained
        self.t0, self.paused_s, self.paused_at = time.perf_counter(), 0.0, None

    def elapsed(self) -> float:
        """Training seconds so far (frozen during a pause)."""
        now = self.paused_at if self.paused_at is not None else time.perf_counter()
        return self.start_s + now - self.t0 - self.paused_s

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        """Time inside the block is not training time."""
        if self.paused_at is not None:  # inside another pause already
            yield
            return
        synchronize(self.device)  # the queued training work belongs before the pause
        self.paused_at = time.perf_counter()
        try:
            yield
        finally:
            self.paused_s += time.perf_counter() - self.paused_at
            self.paused_at = None


class MetricsLogger:
    """Writes every record to metrics.jsonl and mirrors it to the progress bar, wandb and tensorboard (rank 0)."""

    def __init__(self, run_dir: Path, enabled: bool, total_steps: int, start_step: int, config: dict[str, Any],
                 use_wandb: bool = False, wandb_project: str = "pocketlm", use_tensorboard: bool = False) -> None:
        self.enabled, self.run_dir = enabled, run_dir
        self.file = self.bar = self.wandb = self.tb = None
        if not enabled:
            return
        from tqdm import tqdm

        run_dir.mkdir(parents=True, exist_ok=True)
        self.file = open(run_dir / METRICS_NAME, "a", buffering=1)
        self.bar = tqdm(total=total_steps, initial=start_step, desc=run_dir.name, dynamic_ncols=True,
                        file=sys.stderr, disable=None)
        if use_wandb:
            import wandb
            # Offline unless the user configured an API key: nothing leaves the machine by surprise.
            mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
            self.wandb = wandb.init(project=wandb_project, name=run_dir.name, dir=str(run_dir), config=config,
                                    mode=mode, resume="allow", id=run_dir.name.replace("/", "-"))
        if use_tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log(self, record: dict[str, Any], bar_fields: tuple[str, ...] = ()) -> None:
        if not self.enabled:
            return
        # Strict JSON: a non-finite number (a diverged grad norm) is written as null, never as a bare NaN.
        record = {"time": round(time.time(), 3),
                  **{k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}}
        self.file.write(json.dumps(record, allow_nan=False) + "\n")
        step = record.get("step", 0)
        numeric = {k: v for k, v in record.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("step", "time")}
        if self.wandb is not None:
            self.wandb.log(numeric, step=step)
        if self.tb is not None:
            for k, v in numeric.items():
                self.tb.add_scalar(k, v, step)
        if self.bar is not None and bar_fields:
            self.bar.set_postfix({k: _fmt(record[k]) for k in bar_fields if record.get(k) is not None}, refresh=False)

    def log_rows(self, name: str, step: int, rows: list[dict[str, Any]]) -> None:
        """Records of one kind (samples, probe results) at `step`: appended to <name>.jsonl in the run
        directory, and shown as a table in TensorBoard and wandb."""
        if not self.enabled or not rows:
            return
        with open(self.run_dir / f"{name}.jsonl", "a", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps({"step": step, **row}, ensure_ascii=False, allow_nan=False) + "\n")
        columns = list(rows[0])
        if self.tb is not None:
            table = [f"| {' | '.join(columns)} |", f"|{'---|' * len(columns)}"]
            table += [f"| {' | '.join(str(r[c]).replace('|', '/').replace(chr(10), ' ') for c in columns)} |"
                      for r in rows]
            self.tb.add_text(name, "\n".join(table), step)
        if self.wandb is not None:
            import wandb
            self.wandb.log({name: wandb.Table(columns=columns, data=[[r[c] for c in columns] for r in rows])},
                           step=step)

    def log_histograms(self, step: int, values: dict[str, torch.Tensor]) -> None:
        """Distributions (per-head attention entropy, per-token activation RMS) as TensorBoard / wandb
        histograms; metrics.jsonl holds their summaries."""
        if not self.enabled or not values:
            return
        if self.tb is not None:
            for name, v in values.items():
                self.tb.add_histogram(name, v.float(), step)
        if self.wandb is not None:
            import wandb
            self.wandb.log({name: wandb.Histogram(v.float().numpy()) for name, v in values.items()}, step=step)

    def set_total(self, total: int) -> None:
        """The progress bar's end moved (a time budget's re-plan)."""
        if self.bar is not None:
            self.bar.total = total
            self.bar.refresh()

    def advance(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def message(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None and not self.bar.disable:
            self.bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.file is not None:
            self.file.close()
        if self.wandb is not None:
            self.wandb.finish()
        if self.tb is not None:
            self.tb.close()


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1e-2 or abs(v) >= 1e4 else f"{v:.4f}"[:7]
    return str(v)
