"""Train a byte-level BPE tokenizer (HF `tokenizers`) on {"text"} / {"conversations"} JSONL files.

    python train_tokenizer.py --data_path dataset/demo/pretrain_demo.jsonl --vocab_size 6400 --out_dir my_tok

Writes tokenizer.json + tokenizer_config.json (ChatML chat template) loadable by
transformers.AutoTokenizer.from_pretrained(out_dir).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Iterator

from dataset.jsonl import DataError, SkipReport, read_records
from dataset.tokenizer import SPECIAL_TOKENS, Tokenizer, TokenizerError, save_tokenizer, train_bpe


def iter_texts(paths: list[str], skip_bad_lines: bool, report: SkipReport, max_chars: int | None) -> Iterator[str]:
    """Every document's text, or every turn's content for conversation records, up to max_chars in total."""
    budget = max_chars if max_chars is not None else float("inf")
    for path in paths:
        for _, record in read_records(path, "any", skip_bad_lines=skip_bad_lines, report=report):
            texts = [record["text"]] if "text" in record else [t["content"] for t in record["conversations"]]
            for text in texts:
                if budget <= 0:
                    return
                budget -= len(text)
                yield text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data_path", nargs="+", default=["dataset/demo/pretrain_demo.jsonl"],
                   help="one or more .jsonl files with {'text'} or {'conversations'} records")
    p.add_argument("--vocab_size", type=int, default=6400)
    p.add_argument("--min_frequency", type=int, default=2, help="merges seen fewer times are not learned")
    p.add_argument("--extra_special_tokens", nargs="*", default=[],
                   help=f"special tokens added after {list(SPECIAL_TOKENS)}")
    p.add_argument("--max_chars", type=int, default=None, help="stop reading after this many characters")
    p.add_argument("--model_max_length", type=int, default=32768)
    p.add_argument("--skip_bad_lines", action="store_true", help="skip and count malformed lines")
    p.add_argument("--out_dir", required=True)
    args = p.parse_args(argv)
    if args.vocab_size < 256 + len(SPECIAL_TOKENS) + len(args.extra_special_tokens):
        p.error("--vocab_size must cover the 256 byte tokens plus the special tokens")

    report = SkipReport()
    try:
        texts = iter_texts(args.data_path, args.skip_bad_lines, report, args.max_chars)
        tok = train_bpe(texts, args.vocab_size, args.min_frequency,
                        list(SPECIAL_TOKENS) + args.extra_special_tokens)
        out = save_tokenizer(tok, args.out_dir, args.model_max_length)
        check = Tokenizer(out)
    except (DataError, TokenizerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if report.total:
        print(report.summary())
    sample = "Hello, PocketLM! 你好，世界。"
    assert check.decode(check.encode(sample)) == sample, "round trip failed"
    print(f"wrote {Path(out) / 'tokenizer.json'} (vocab {check.vocab_size}, sha256 {check.sha256[:12]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
