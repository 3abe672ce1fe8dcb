"""Direct preference optimisation: prefer the chosen answer over the rejected one, relative to the start model.

    python train_dpo.py --init_from out/sft-minimind-26m                       # bundled demo preference pairs
    python train_dpo.py --init_from out/sft-minimind-26m --data_path dpo.jsonl --lora_rank 16

Data: {"chosen": [messages...], "rejected": [messages...]} sharing every turn but the final assistant answer
(MiniMind's format). Loss per pair: -log sigmoid(beta * ((log pi_c - log ref_c) - (log pi_r - log ref_r))), with
--beta (0.1) and --label_smoothing (0). The reference is the --init_from model; its log-probabilities are computed
once before training and cached beside the token cache, keyed by its weights. Full fine-tuning, or LoRA adapters
with --lora_rank N. Logged: loss, reward accuracy and margin, chosen and rejected rewards, policy log-probs.
Flags: --help.
"""
from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    # Imported here: tokenizer worker processes re-import this file and must not pay for loading PyTorch.
    from trainer_utils.driver import main as train

    return train("dpo", argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
