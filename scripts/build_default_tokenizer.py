"""Build PocketLM's shipped default tokenizer (model/tokenizer/) and measure its compression.

    python scripts/build_default_tokenizer.py                     # defaults below
    python scripts/build_default_tokenizer.py --data_path bench.jsonl --out_dir /tmp/tok

Input is a benchmark JSONL file, one {"text", "source", "lang"} document per line. Documents are split into
train and held-out by a stable hash of their text (sha1), so the split does not depend on file order and a
duplicated document always lands on the same side. A byte-level BPE (dataset.tokenizer.train_bpe) is trained
on the train part only, saved with save_tokenizer, and then scored on the held-out part: characters per token
and UTF-8 bytes per token, per "lang" (en, zh) and overall, as ratios of totals (sum of characters / sum of
tokens). The numbers and everything needed to reproduce them go to <out_dir>/compression.json.

The file is read twice, streaming (once to train, once to score); no more than one batch of held-out
documents is held in memory.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common.files import file_sha256  # noqa: E402
from dataset.jsonl import DataError, SkipReport, check_path, read_records  # noqa: E402
from dataset.tokenizer import (  # noqa: E402
    DEFAULT_TOKENIZER_DIR,
    SPECIAL_TOKENS,
    Tokenizer,
    TokenizerError,
    save_tokenizer,
    train_bpe,
)

DEFAULT_DATA_PATH = "/work/data/bench/pretrain_bench.jsonl"
SAMPLES = ("Hello, PocketLM! The quick brown fox jumps over the lazy dog.",
           "你好，世界。床前明月光，疑是地上霜。",
           "emoji 👩‍💻🚀🎉 and mixed 中文 text\n\twith <|im_end|> inside")


def is_heldout(text: str, heldout_percent: float) -> bool:
    """True for about heldout_percent % of texts, decided by the sha1 of the UTF-8 text (stable across runs)."""
    h = int.from_bytes(hashlib.sha1(text.encode("utf-8")).digest()[:8], "big")
    return h < heldout_percent / 100 * 2**64


def iter_split(path: str | Path, heldout: bool, heldout_percent: float, skip_bad_lines: bool,
               report: SkipReport | None = None) -> Iterator[dict[str, Any]]:
    """The records of one side of the split (held-out if `heldout`, else train), in file order."""
    for _, record in read_records(path, "text", skip_bad_lines=skip_bad_lines, report=report):
        if is_heldout(record["text"], heldout_percent) == heldout:
            yield record


@dataclass
class Stats:
    """Running totals for one language: documents, characters, UTF-8 bytes, tokens."""

    docs: int = 0
    chars: int = 0
    bytes: int = 0
    tokens: int = 0

    def add(self, text: str, n_tokens: int) -> None:
        self.docs += 1
        self.chars += len(text)
        self.bytes += len(text.encode("utf-8"))
        self.tokens += n_tokens

    def as_dict(self) -> dict[str, float | int]:
        return {**self.__dict__, "chars_per_token": round(self.chars / max(self.tokens, 1), 4),
                "bytes_per_token": round(self.bytes / max(self.tokens, 1), 4)}


@dataclass
class Compression:
    """Per-language Stats plus an "all" row."""

    by_lang: dict[str, Stats] = field(default_factory=dict)

    def add(self, lang: str, text: str, n_tokens: int) -> None:
        for key in (lang, "all"):
            self.by_lang.setdefault(key, Stats()).add(text, n_tokens)

    def as_dict(self) -> dict[str, dict[str, float | int]]:
        keys = sorted(k for k in self.by_lang if k != "all") + ["all"]
        return {k: self.by_lang[k].as_dict() for k in keys if k in self.by_lang}


def measure(tok: Tokenizer, records: Iterator[dict[str, Any]], batch_size: int = 256) -> Compression:
    """Encode records (as the training pipeline does: special strings stay text) and total per "lang"."""
    result = Compression()
    batch: list[dict[str, Any]] = []

    def flush() -> None:
        for rec, ids in zip(batch, tok.encode_batch([r["text"] for r in batch])):
            result.add(str(rec.get("lang", "unknown")), rec["text"], len(ids))
        batch.clear()

    for record in records:
        batch.append(record)
        if len(batch) == batch_size:
            flush()
    flush()
    return result


def check_tokenizer(tok: Tokenizer, vocab_size: int) -> None:
    """The invariants the rest of PocketLM relies on; raise TokenizerError if one fails."""
    if tok.vocab_size != vocab_size:
        raise TokenizerError(f"{tok.path}: vocab size {tok.vocab_size}, expected {vocab_size}")
    if (tok.eot_id, tok.im_start_id, tok.im_end_id) != (0, 1, 2):
        raise TokenizerError(f"{tok.path}: special token ids are {(tok.eot_id, tok.im_start_id, tok.im_end_id)}"
                             f", expected {list(SPECIAL_TOKENS)} at 0, 1, 2")
    for sample in SAMPLES:
        if tok.decode(tok.encode(sample)) != sample:
            raise TokenizerError(f"{tok.path}: round trip failed for {sample!r}")


def print_table(comp: dict[str, dict[str, float | int]]) -> None:
    print(f"{'held-out':<8} {'docs':>7} {'chars':>12} {'bytes':>12} {'tokens':>11} {'chars/tok':>9} "
          f"{'bytes/tok':>9}")
    for lang, s in comp.items():
        print(f"{lang:<8} {s['docs']:>7,} {s['chars']:>12,} {s['bytes']:>12,} {s['tokens']:>11,} "
              f"{s['chars_per_token']:>9.3f} {s['bytes_per_token']:>9.3f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data_path", default=DEFAULT_DATA_PATH, help='JSONL with {"text", "lang"} documents')
    p.add_argument("--out_dir", default=str(DEFAULT_TOKENIZER_DIR))
    p.add_argument("--heldout_percent", type=float, default=2.0,
                   help="share of documents (by text hash) kept out of training and used for scoring")
    p.add_argument("--vocab_size", type=int, default=6400)
    p.add_argument("--min_frequency", type=int, default=2, help="merges seen fewer times are not learned")
    p.add_argument("--model_max_length", type=int, default=32768)
    p.add_argument("--skip_bad_lines", action="store_true", help="skip and count malformed lines")
    args = p.parse_args(argv)
    if not 0 < args.heldout_percent < 100:
        p.error("--heldout_percent must be between 0 and 100 (exclusive)")
    if args.vocab_size < 256 + len(SPECIAL_TOKENS):
        p.error("--vocab_size must cover the 256 byte tokens plus the special tokens")

    try:
        data = check_path(args.data_path)
        train_report = SkipReport()  # both passes read every line; count bad ones once
        train_docs: Counter[str] = Counter()  # per lang, filled while the trainer consumes the generator

        def train_texts() -> Iterator[str]:
            for rec in iter_split(data, False, args.heldout_percent, args.skip_bad_lines, train_report):
                train_docs[str(rec.get("lang", "unknown"))] += 1
                yield rec["text"]

        t0 = time.perf_counter()
        bpe = train_bpe(train_texts(), args.vocab_size, args.min_frequency, SPECIAL_TOKENS)
        train_seconds = time.perf_counter() - t0
        out = save_tokenizer(bpe, args.out_dir, args.model_max_length)
        tok = Tokenizer(out)
        check_tokenizer(tok, args.vocab_size)

        t0 = time.perf_counter()
        comp = measure(tok, iter_split(data, True, args.heldout_percent, args.skip_bad_lines)).as_dict()
        measure_seconds = time.perf_counter() - t0
    except (DataError, TokenizerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if train_report.total:
        print(train_report.summary())

    import tokenizers

    summary = {
        "tokenizer_sha256": tok.sha256,
        "vocab_size": tok.vocab_size,
        "special_tokens": {t: i for i, t in enumerate(SPECIAL_TOKENS)},
        "corpus": {"file": Path(args.data_path).name, "bytes": data.stat().st_size, "sha256": file_sha256(data),
                   "skipped_lines": train_report.total},
        "split": {"method": "sha1(utf-8 text) first 8 bytes as big-endian int < heldout_percent/100 * 2**64",
                  "heldout_percent": args.heldout_percent,
                  "train_docs": {**dict(sorted(train_docs.items())), "all": sum(train_docs.values())},
                  "heldout_docs": {k: v["docs"] for k, v in comp.items()}},
        "training": {"algorithm": "byte-level BPE (dataset.tokenizer.train_bpe)", "vocab_size": args.vocab_size,
                     "min_frequency": args.min_frequency, "model_max_length": args.model_max_length,
                     "tokenizers_version": tokenizers.__version__},
        "heldout_compression": comp,
    }
    (Path(out) / "compression.json").write_text(json.dumps(summary, indent=2, ensure_ascii=False) + "\n")

    print(f"wrote {out}/ (vocab {tok.vocab_size}, sha256 {tok.sha256[:12]}); "
          f"trained on {sum(train_docs.values()):,} docs in {train_seconds:.1f}s, "
          f"scored {comp.get('all', {}).get('docs', 0):,} held-out docs in {measure_seconds:.1f}s")
    print_table(comp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
