"""How many steps `make demo` trains here: the recipes' own where training runs in a reduced precision the device
computes natively (a GPU, a CPU with AVX512-BF16/AMX), fewer on a CPU that trains in fp32, so the demo stays
within its 10 minutes on 2 cores there too.

    python scripts/demo_plan.py 450 150     # prints "450 150", or the fp32 plan, and says why on stderr

A CPU without native bf16 (AMD before Zen 4, Intel before Cooper Lake and Sapphire Rapids) trains in fp32
(common/device.py), where a demo pretraining step takes 1.9x as long: 1.62 s against 0.86 s, measured on a
2-core Xeon as it is and with its kernels held to AVX2 (MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2
ATEN_CPU_CAPABILITY=avx2), where `make demo` took 591 s with all the steps and 592 s with half of them (the
tokenizer, data preparation and evaluation take ~3.5 minutes there); with 40% of them, 479 s.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from common.device import parse_device, precision_policy  # noqa: E402

# the share of the recipes' steps an fp32 CPU trains (pretraining's cosine schedule still runs to its end)
FP32_SHARE = 0.4


def plan(pretrain_steps: int, sft_steps: int) -> tuple[int, int, str | None]:
    """The steps to train, and the note to print when they differ from the recipes'."""
    device = parse_device("auto")
    policy = precision_policy(device)
    if device.type != "cpu" or policy.train != torch.float32:
        return pretrain_steps, sft_steps, None
    short = max(1, round(pretrain_steps * FP32_SHARE)), max(1, round(sft_steps * FP32_SHARE))
    return (*short, f"note: {policy.reason}: the demo trains {short[0]} pretraining and {short[1]} SFT steps "
                    f"instead of {pretrain_steps} and {sft_steps}, to stay within 10 minutes on 2 cores "
                    "(make demo DEMO_PRETRAIN_STEPS=N DEMO_SFT_STEPS=M trains those; the losses will be higher "
                    "than docs/demo.md's)")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    as_given = "--as-given" in args  # steps the user chose: trained as they are
    steps = [a for a in args if a != "--as-given"]
    if len(steps) != 2 or not all(a.isdigit() and int(a) > 0 for a in steps):
        print("usage: python scripts/demo_plan.py PRETRAIN_STEPS SFT_STEPS [--as-given]", file=sys.stderr)
        return 2
    pretrain, sft, note = (int(steps[0]), int(steps[1]), None) if as_given else plan(int(steps[0]), int(steps[1]))
    if note:
        print(note, file=sys.stderr)
    print(pretrain, sft)
    return 0


if __name__ == "__main__":
    sys.exit(main())
