"""Direct preference optimisation on (chosen, rejected) pairs against the start model (train_dpo.py).

Its `prepare` hook is the reference pass: the --init_from model's log-probability of every pair, computed once
(by rank 0, under this run's precision) and cached beside each file's token cache, keyed by the reference's
weights and the precision; every rank then reads them, and a resume finds them there. With sharded weights
(a backend where no rank holds the whole model) this pass would need every rank: it loads its own full copy of
the reference, so it does not depend on the trained model's sharding.
"""
from __future__ import annotations

import hashlib
import io
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from common.config import option
from common.device import dtype_name
from common.files import file_sha256, write_atomic
from dataset.config import DataConfig
from dataset.kinds import PAIRS, DataKind
from model.checkpoint import load_model
from model.loading import ADAPTER_WEIGHTS_NAME, LORA_CONFIG_NAME, WEIGHTS_NAME, is_lora_dir

from ..context import RunContext, SetupContext
from ..objectives import DPO, Objective, sequence_log_probs
from .base import Stage


def weights_sha256(model_dir: Path) -> str:
    """A digest of the weights a model dir holds: its model.safetensors, or a LoRA run's base and adapters."""
    if not is_lora_dir(model_dir):
        return file_sha256(model_dir / WEIGHTS_NAME)
    # the adapters and lora.json, which holds the base's own sha256
    parts = [file_sha256(model_dir / ADAPTER_WEIGHTS_NAME), file_sha256(model_dir / LORA_CONFIG_NAME)]
    return hashlib.sha256("".join(parts).encode()).hexdigest()


@dataclass
class DPOOptions:
    """What DPO optimises: the preference loss of the policy against the frozen start model."""

    title: ClassVar[str] = "DPO"
    beta: float = option(0.1, "how strongly the policy is held to the reference: the inverse temperature of the "
                              "log-ratio margins (larger: closer)", above=0)
    label_smoothing: float = option(0.0, "share of preference labels assumed wrong (conservative DPO)", at_least=0,
                                    below=0.5)


class PreferenceOptimization(Stage):
    name = "dpo"
    script = "train_dpo.py"
    defaults: ClassVar[dict[str, Any]] = dict(data_path=["dataset/demo/dpo_demo.jsonl"], batch_size=8,
                                              learning_rate=5e-6)
    options = DPOOptions
    features = frozenset({"conversations", "adapters"})
    needs_init = True
    memory_rows = 2  # a batch holds both answers of each pair

    def data_kind(self, data: DataConfig) -> DataKind:
        return PAIRS

    def objective(self, setup: SetupContext) -> Objective:
        return DPO(setup.options.beta, setup.options.label_smoothing)

    def prepare(self, ctx: RunContext) -> None:
        backend, precision, train = ctx.backend, ctx.precision, ctx.train_data
        datasets = [*getattr(train, "parts", [train]), *(v.data for v in ctx.val_sets)]
        key = f"{weights_sha256(ctx.init_dir)[:16]}-{dtype_name(precision.dtype)}"
        paths = [ds.cache_path / f"reference-{ds.split}-{key}.npy" for ds in datasets]
        missing = [(ds, path) for ds, path in zip(datasets, paths) if not path.is_file()]
        if missing and backend.is_main:
            t0 = time.perf_counter()
            reference, _ = load_model(ctx.init_dir, device=ctx.device)  # a LoRA run's adapters merged in
            for ds, path in missing:
                values = np.zeros((ds.num_examples, 2), dtype=np.float32)
                # training-sized batches: larger ones measured slower on CPU (25 s against 21.5 s for the demo)
                for indices, x, y in ds.all_pairs_batches(ctx.config.optim.batch_size):
                    logp = sequence_log_probs(reference, x.to(ctx.device), y.to(ctx.device),
                                              precision.autocast).cpu().numpy()
                    values[indices, 0], values[indices, 1] = logp[:len(indices)], logp[len(indices):]
                with io.BytesIO() as buffer:
                    np.save(buffer, values)
                    write_atomic(path, buffer.getvalue())
            del reference
            pairs = sum(ds.num_examples for ds, _ in missing)
            print(f"reference log-probs of {pairs:,} pairs computed once in {time.perf_counter() - t0:.1f}s "
                  f"({ctx.init_dir}, {dtype_name(precision.dtype)}), cached as {paths[0].name}", file=sys.stderr)
        backend.barrier()
        for ds, path in zip(datasets, paths):
            ds.set_reference(np.load(path))
