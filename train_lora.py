"""LoRA fine-tuning: SFT that trains small low-rank adapters on a frozen model (MiniMind's train_lora.py).

    python train_lora.py --init_from out/sft-minimind-26m --data_path identity.jsonl
    python train_lora.py --init_from out/sft-minimind-26m --lora_rank 8 --lora_targets q_proj v_proj gate_proj

Defaults: rank 16, alpha 32, adapters on q_proj, k_proj, v_proj and o_proj (also gate_proj, up_proj, down_proj).
Only the adapters are trained and saved; each checkpoint names the model it adapts (path and sha256).
eval_model.py and model.convert load the run like any other; `python -m model.convert --merge_lora out/<run>
--out_dir DIR` writes a plain checkpoint with the adapters folded in. Flags: --help.
"""
from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    # Imported here: tokenizer worker processes re-import this file and must not pay for loading PyTorch.
    from trainer_utils.driver import main as train

    return train("lora", argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
