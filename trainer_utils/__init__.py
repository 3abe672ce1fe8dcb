"""Training machinery shared by the pretrain and SFT scripts: one loop, backends, checkpoints, metrics.

Importing it, before PyTorch is loaded, makes the CPU's waiting threads sleep sooner (share_cores()).
"""
from __future__ import annotations

import os

# GNU OpenMP (PyTorch's thread pool on Linux) has a thread that waits for the others spin this many times before it
# sleeps; its own default, 300,000, holds a core for milliseconds at the end of every parallel region. Beside
# another training process on the same cores (a second run, a test suite) both pools spin while the other needs
# the cores: the demo model's step took 4.1x its time alone there, and 2.2x with 10,000 spins, as fast as before
# alone (2-core Intel Xeon, AVX2 emulated, fp32; bench/bench_sharing.py, dev/LOG.md 2026-12-07).
SPIN_COUNT = "10000"
WAIT_SETTINGS = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")  # the environment's own choice of how OpenMP's threads wait


def share_cores() -> bool:
    """Set GOMP_SPINCOUNT to SPIN_COUNT for this process and those it starts, unless the environment chooses how
    OpenMP waits (GOMP_SPINCOUNT or OMP_WAIT_POLICY). OpenMP reads it once, when PyTorch loads it: called before
    that, it applies; after, it changes nothing here. Returns whether it set it."""
    if any(name in os.environ for name in WAIT_SETTINGS):
        return False
    os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT
    return True


share_cores()
