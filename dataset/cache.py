"""`python -m dataset.cache`: prepare the token caches of training files ahead of training (e.g. on a login node
before a cluster job), exactly as the trainers would (the cache itself: dataset/token_cache.py).

    python -m dataset.cache --data_path clean.jsonl --tokenizer my_tokenizer
    python -m dataset.cache --data_path dataset/demo/sft_demo.jsonl --kind sft --max_seq_len 512
"""
from __future__ import annotations

import sys

from common.config import parse_config
from common.errors import PocketLMError

from .config import CacheConfig, prepare_data
from .tokenizer import DEFAULT_TOKENIZER_DIR, Tokenizer


def main(argv: list[str] | None = None) -> int:
    """`python -m dataset.cache`: prepare a cache ahead of training (e.g. on a login node before a cluster job).

    Takes the trainers' data flags with the trainers' defaults, so the cache it builds is the one
    `train_pretrain.py` / `train_full_sft.py` reuse for the same --data_path.
    """
    try:
        cfg = parse_config(CacheConfig, argv, main.__doc__)
        tokenizer = Tokenizer(cfg.data.tokenizer or DEFAULT_TOKENIZER_DIR)
        prepared = prepare_data(cfg.data, tokenizer, cfg.target.kind, cfg.target.max_seq_len,
                                log=lambda m: print(m, file=sys.stderr))
    except PocketLMError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for _, cache in prepared:
        print(f"cache: {cache.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
