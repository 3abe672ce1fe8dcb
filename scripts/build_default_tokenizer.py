"""Build PocketLM's shipped default tokenizer (model/tokenizer/) from a measured EN/ZH mix, and measure it.

    python scripts/fetch_zh_docs.py                     # modern Chinese (Debian's documentation), into dataset/zh_docs/
    python scripts/build_default_tokenizer.py --data_path CORPUS.jsonl dataset/zh_docs/zh_docs.jsonl
                                                        # the shipped mix, into model/tokenizer/
    python scripts/build_default_tokenizer.py --data_path CORPUS.jsonl dataset/zh_docs/zh_docs.jsonl \\
        --zh_share 0.5 --out_dir /tmp/tok --compare /path/to/minimind/model

Input (--data_path, required) is JSONL files of {"text", "source", "lang"} documents ("lang" "en" or "zh"): a
corpus of your own and the modern Chinese of scripts/fetch_zh_docs.py. The shipped tokenizer was built from the
226 MB EN+ZH benchmark corpus (pretrain_bench.jsonl, not shipped: English prose, the kernel's and Python's
documentation, chinese-poetry, the Chinese Union Version Bible and the kernel documentation's zh_CN, gathered from
public package registries; docs/tokenizer.md). `python -m dataset.ingest` makes such a file from your own
documents (it detects each record's "lang"). Every document is put on the train or the held-out side by a stable
hash of its text (sha1), so the split does not depend on file order and a duplicated document always lands on
the same side. The training text is a mix of three groups, each reached by sampling its documents (a stable hash
again) or, for a group smaller than its share, repeating them:

    en          English documents                               (1 - zh_share) of --train_mb
    zh-classic  Chinese documents from classical sources          zh_share x (1 - zh_modern_share)
                (the corpus's chinese-poetry: source "poetry:...")
    zh-modern   every other Chinese document                      zh_share x zh_modern_share

After the mix come the training documents of --add_train (default: the bundled demo pretraining corpus), each
once: the documents the trainer would train on, not the ones its validation split (--val_fraction and
--split_seed, the trainer's defaults) holds out, and none that shares text with the held-out text below (the
demo corpus is cut from the same public sources): a document goes if any 32 characters of it (WINDOW) equal one
of the held-out texts' 32-character windows at multiples of 32, so every shared passage of 63 characters or more
is caught. A tokenizer packs best the text it has seen; without them the demo recipe trains worse than with the
previous default, which was trained on the whole benchmark corpus, half of whose text is in the demo's.

A byte-level BPE (dataset.tokenizer.train_bpe) is trained on that text, saved with save_tokenizer and scored on
text it never saw (UTF-8 bytes and characters per token, ratios of totals):

    en, zh            the held-out documents of each language
    zh-modern         the held-out documents of the modern Chinese sources
    chat-en, chat-zh  the bundled SFT conversations (dataset/demo/sft_demo.jsonl: chatterbot, Debian's and
                      Python's FAQs; sources no tokenizer here trains on), their messages' text

and, by kind of text (KINDS), on the held-out documents of a few sources and on the demo corpus it serves
(all of it, so not held out). --compare DIR scores another tokenizer (MiniMind's model/ directory, say) on the
same text. The numbers and everything needed to reproduce them go to <out_dir>/compression.json.
scripts/sweep_tokenizer_mix.py trains the mix (without the added documents) over a grid; the defaults below are
the point of its best region that also trains the demo as well as the previous default (docs/tokenizer.md).

The train side is held in memory while the mix is drawn (about 1 GB for the 226 MB corpus).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import Any, Iterable, Iterator

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from common.files import file_sha256  # noqa: E402
from dataset.config import DataConfig  # noqa: E402
from dataset.jsonl import DataError, SkipReport, check_path, read_records  # noqa: E402
from dataset.token_cache import in_validation  # noqa: E402
from dataset.tokenizer import (  # noqa: E402
    DEFAULT_TOKENIZER_DIR,
    SPECIAL_TOKENS,
    Tokenizer,
    TokenizerError,
    save_tokenizer,
    train_bpe,
)

CHAT_PATH = ROOT / "dataset" / "demo" / "sft_demo.jsonl"
DEMO_PRETRAIN_PATH = ROOT / "dataset" / "demo" / "pretrain_demo.jsonl"
CLASSICAL_SOURCES = ("poetry",)  # source prefixes (before ":") of classical Chinese
GROUPS = ("en", "zh-classic", "zh-modern")
# the shipped mix (scripts/sweep_tokenizer_mix.py, bench/ablations/demo-tokenizer.yaml, docs/tokenizer.md)
ZH_SHARE = 0.55
ZH_MODERN_SHARE = 0.6
TRAIN_MB = 70.0
WINDOW = 32  # characters: an added document sharing 2 x WINDOW - 1 characters with held-out text is left out
# held-out documents by kind of text, for the by-kind table: (lang, source prefixes); the demo corpus by lang
KINDS = {
    "English prose (Austen, Moby-Dick, Shakespeare, SOTU, KJV, WEB)":
        ("en", ("austen", "mobydick", "shakespeare", "sotu", "kjv", "web")),
    "English technical (kernel and Python documentation)": ("en", ("linux-docs", "python-docs")),
    "Chinese technical (the kernel documentation's zh_CN)": ("zh", ("linux-docs-zh",)),
    "Chinese Bible (CUV)": ("zh", ("cuv",)),
    "classical Chinese poetry": ("zh", ("poetry",)),
}
SAMPLES = ("Hello, PocketLM! The quick brown fox jumps over the lazy dog.",
           "你好，世界。床前明月光，疑是地上霜。",
           "emoji 👩‍💻🚀🎉 and mixed 中文 text\n\twith <|im_end|> inside")


def text_hash(text: str, salt: bytes = b"") -> float:
    """A stable number in [0, 1) for a text (sha1 of salt + UTF-8 text, its first 8 bytes)."""
    return int.from_bytes(hashlib.sha1(salt + text.encode("utf-8")).digest()[:8], "big") / 2**64


def is_heldout(text: str, heldout_percent: float) -> bool:
    """True for about heldout_percent % of texts, decided by the sha1 of the UTF-8 text (stable across runs)."""
    return text_hash(text) < heldout_percent / 100


def tokenizer_name(directory: str | Path) -> str:
    """How a compared tokenizer is named in tables: its directory, or the one above a "model" directory
    (MiniMind's tokenizer lives in its repository's model/)."""
    path = Path(directory)
    return path.parent.name if path.name == "model" else path.name


def group_of(record: dict[str, Any]) -> str:
    """The mix group of a document: en, zh-classic or zh-modern (other languages: their own name)."""
    lang = str(record.get("lang", "unknown"))
    if lang != "zh":
        return lang
    classic = str(record.get("source", "")).split(":")[0] in CLASSICAL_SOURCES
    return "zh-classic" if classic else "zh-modern"


@dataclass
class Split:
    """The corpus divided: train texts by mix group, held-out records, and what was read."""

    train: dict[str, list[str]] = field(default_factory=dict)
    heldout: list[dict[str, Any]] = field(default_factory=list)
    files: list[dict[str, Any]] = field(default_factory=list)
    skipped: int = 0


def read_split(paths: Iterable[str | Path], heldout_percent: float, skip_bad_lines: bool = False) -> Split:
    """Read every file once into the train and held-out sides (DataError names a bad file and line)."""
    split = Split()
    for path in map(check_path, paths):
        report = SkipReport()
        for _, record in read_records(path, "text", skip_bad_lines=skip_bad_lines, report=report):
            if is_heldout(record["text"], heldout_percent):
                split.heldout.append(record)
            else:
                split.train.setdefault(group_of(record), []).append(record["text"])
        if report.total:
            print(report.summary())
        split.skipped += report.total
        split.files.append({"file": path.name, "bytes": path.stat().st_size, "sha256": file_sha256(path),
                            "skipped_lines": report.total})
    return split


def group_targets(zh_share: float, zh_modern_share: float, train_mb: float) -> dict[str, float]:
    """Training bytes wanted from each group."""
    total = train_mb * 1e6
    return {"en": (1 - zh_share) * total, "zh-classic": zh_share * (1 - zh_modern_share) * total,
            "zh-modern": zh_share * zh_modern_share * total}


def draw(texts: list[str], target_bytes: float) -> Iterator[str]:
    """About target_bytes of `texts`: each text `whole` times, plus once more when its hash falls under the
    fraction left (a sample when the group is larger than its target, repetitions when smaller)."""
    have = sum(len(t.encode("utf-8")) for t in texts)
    if have == 0 or target_bytes <= 0:
        return
    whole, fraction = divmod(target_bytes / have, 1.0)
    for text in texts:
        for _ in range(int(whole) + (text_hash(text, b"mix") < fraction)):
            yield text


def passage_index(texts: Iterable[str], width: int = WINDOW) -> set[str]:
    """The texts' `width`-character windows that start at multiples of `width`: any passage of 2 x width - 1
    characters or more holds one of them whole."""
    return {t[i:i + width] for t in texts for i in range(0, len(t) - width + 1, width)}


def shares_passage(text: str, index: set[str], width: int = WINDOW) -> bool:
    """True if a window of `text` at any offset is in `index` (a passage of 2 x width - 1 characters shared)."""
    return any(text[i:i + width] in index for i in range(len(text) - width + 1))


@dataclass
class Added:
    """The documents added after the mix, and what was left out of them."""

    texts: list[str] = field(default_factory=list)
    files: list[dict[str, Any]] = field(default_factory=list)


def added_documents(paths: Iterable[str | Path], val_fraction: float, split_seed: int,
                    protected: Iterable[str]) -> Added:
    """The documents of `paths` a training run would train on (its validation split, by line number, left out)
    that share no passage with the `protected` (held-out) text."""
    index = passage_index(protected)
    added = Added()
    for path in map(check_path, paths):
        records = list(read_records(path, "text"))
        is_val = in_validation(np.array([n for n, _ in records], dtype=np.int64), val_fraction, split_seed)
        train = [r["text"] for (_, r), val in zip(records, is_val) if not val]
        kept = [t for t in train if not shares_passage(t, index)]
        added.texts += kept
        added.files.append({"file": path.name, "sha256": file_sha256(path), "docs": len(records),
                            "validation_docs": int(is_val.sum()), "sharing_heldout_text": len(train) - len(kept),
                            "added_docs": len(kept), "added_bytes": sum(len(t.encode("utf-8")) for t in kept)})
    return added


def mix(split: Split, targets: dict[str, float], drawn: Counter | None = None) -> Iterator[str]:
    """The training texts of a mix, group by group; `drawn` counts the bytes each group gave."""
    for group in GROUPS:
        for text in draw(split.train.get(group, []), targets[group]):
            if drawn is not None:
                drawn[group] += len(text.encode("utf-8"))
            yield text


def chat_texts(path: str | Path = CHAT_PATH) -> dict[str, list[str]]:
    """The SFT conversations' text (their messages joined by newlines), by language: chat-en, chat-zh."""
    out: dict[str, list[str]] = {}
    for _, record in read_records(path, "conversations"):
        text = "\n".join(m["content"] for m in record["conversations"] if m.get("content"))
        out.setdefault(f"chat-{record.get('lang', 'unknown')}", []).append(text)
    return out


def evaluation_sets(split: Split, chat: dict[str, list[str]]) -> dict[str, list[str]]:
    """The texts each held-out measure is taken over, by name (en, zh, zh-modern, chat-en, chat-zh)."""
    sets: dict[str, list[str]] = {}
    for record in split.heldout:
        sets.setdefault(str(record.get("lang", "unknown")), []).append(record["text"])
        if group_of(record) == "zh-modern":
            sets.setdefault("zh-modern", []).append(record["text"])
    return {**sets, **chat}


def kind_sets(split: Split, demo_path: str | Path = DEMO_PRETRAIN_PATH) -> dict[str, list[str]]:
    """The texts of the by-kind table: held-out documents of each KINDS entry, and the whole demo corpus by
    language (what the demo trains on; its training documents are in the tokenizer's training text)."""
    sets: dict[str, list[str]] = {name: [] for name in KINDS}
    for record in split.heldout:
        source = str(record.get("source", "")).split(":")[0]
        for name, (lang, sources) in KINDS.items():
            if record.get("lang") == lang and source in sources:
                sets[name].append(record["text"])
    for _, record in read_records(demo_path, "text"):
        sets.setdefault(f"the demo pretraining corpus, {record.get('lang', 'unknown')}", []).append(record["text"])
    return {name: texts for name, texts in sets.items() if texts}


@dataclass
class Stats:
    """Running totals for one text set: documents, characters, UTF-8 bytes, tokens."""

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


def measure(tok: Tokenizer, sets: dict[str, list[str]], batch_size: int = 256) -> dict[str, dict[str, float | int]]:
    """Each set's totals, encoded as the training pipeline encodes (special strings stay text)."""
    out = {}
    for name, texts in sets.items():
        stats = Stats()
        for start in range(0, len(texts), batch_size):
            batch = texts[start:start + batch_size]
            for text, ids in zip(batch, tok.encode_batch(batch)):
                stats.add(text, len(ids))
        out[name] = stats.as_dict()
    return out


def geometric_mean_bpt(comp: dict[str, dict[str, float | int]]) -> float:
    """One number for 'best together': the geometric mean of the sets' bytes per token."""
    values = [float(s["bytes_per_token"]) for s in comp.values()]
    return math.exp(sum(map(math.log, values)) / len(values))


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


def print_table(comp: dict[str, dict[str, float | int]], compared: dict[str, dict[str, dict]] | None = None) -> None:
    others = list(compared or {})
    w = max(10, *map(len, comp))
    print(f"{'held-out':<{w}} {'docs':>7} {'chars':>11} {'bytes':>11} {'tokens':>10} {'chars/tok':>9} "
          f"{'bytes/tok':>9}" + "".join(f" {name[:14]:>14}" for name in others))
    for name, s in comp.items():
        print(f"{name:<{w}} {s['docs']:>7,} {s['chars']:>11,} {s['bytes']:>11,} {s['tokens']:>10,} "
              f"{s['chars_per_token']:>9.3f} {s['bytes_per_token']:>9.3f}"
              + "".join(f" {compared[o][name]['bytes_per_token']:>14.3f}" for o in others))


def train_mix(split: Split, targets: dict[str, float], vocab_size: int, min_frequency: int, out_dir: str | Path,
              model_max_length: int, added: Iterable[str] = ()) -> tuple[Tokenizer, Counter, float]:
    """Train and save the tokenizer of one mix, with the `added` texts after it: (tokenizer, bytes drawn per
    group, seconds)."""
    drawn: Counter = Counter()
    t0 = time.perf_counter()
    bpe = train_bpe(chain(mix(split, targets, drawn), added), vocab_size, min_frequency, SPECIAL_TOKENS)
    seconds = time.perf_counter() - t0
    tok = Tokenizer(save_tokenizer(bpe, out_dir, model_max_length))
    check_tokenizer(tok, vocab_size)
    return tok, drawn, seconds


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The flags, checked (argparse's error and exit 2 for a value out of range)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data_path", nargs="+", required=True, metavar="F.jsonl",
                   help='JSONL files of {"text", "source", "lang"} documents (a corpus of your own, and '
                        'scripts/fetch_zh_docs.py\'s dataset/zh_docs/zh_docs.jsonl)')
    p.add_argument("--out_dir", default=str(DEFAULT_TOKENIZER_DIR))
    p.add_argument("--zh_share", type=float, default=ZH_SHARE, help="share of the training bytes that is Chinese")
    p.add_argument("--zh_modern_share", type=float, default=ZH_MODERN_SHARE,
                   help="share of the Chinese training bytes from modern (not classical) sources")
    p.add_argument("--train_mb", type=float, default=TRAIN_MB, help="training text, in MB (10^6 bytes)")
    trainer = DataConfig()
    p.add_argument("--add_train", nargs="*", default=[str(DEMO_PRETRAIN_PATH)], metavar="F.jsonl",
                   help="JSONL {\"text\"} files whose training documents are added after the mix, each once "
                        "(default: the demo pretraining corpus; none: --add_train with no file)")
    p.add_argument("--val_fraction", type=float, default=trainer.val_fraction,
                   help="the trainer's validation split of --add_train files, left out (the trainer's default)")
    p.add_argument("--split_seed", type=int, default=trainer.split_seed,
                   help="that split's seed (the trainer's default)")
    p.add_argument("--heldout_percent", type=float, default=2.0,
                   help="share of documents (by text hash) kept out of training and used for scoring")
    p.add_argument("--vocab_size", type=int, default=6400)
    p.add_argument("--min_frequency", type=int, default=2, help="merges seen fewer times are not learned")
    p.add_argument("--model_max_length", type=int, default=32768)
    p.add_argument("--compare", nargs="*", default=[], help="other tokenizer directories scored on the same text")
    p.add_argument("--skip_bad_lines", action="store_true", help="skip and count malformed lines")
    args = p.parse_args(argv)
    if not 0 < args.heldout_percent < 100:
        p.error("--heldout_percent must be between 0 and 100 (exclusive)")
    if not (0 <= args.zh_share <= 1 and 0 <= args.zh_modern_share <= 1):
        p.error("--zh_share and --zh_modern_share are shares between 0 and 1")
    if args.train_mb <= 0:
        p.error("--train_mb must be positive")
    if not 0 <= args.val_fraction < 1:
        p.error("--val_fraction must be in [0, 1), as the trainer's")
    if args.vocab_size < 256 + len(SPECIAL_TOKENS):
        p.error("--vocab_size must cover the 256 byte tokens plus the special tokens")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        others = {tokenizer_name(d): Tokenizer(d) for d in args.compare}
        split = read_split(args.data_path, args.heldout_percent, args.skip_bad_lines)
        sets = evaluation_sets(split, chat_texts())
        added = added_documents(args.add_train, args.val_fraction, args.split_seed,
                                (t for texts in sets.values() for t in texts))
        targets = group_targets(args.zh_share, args.zh_modern_share, args.train_mb)
        tok, drawn, train_seconds = train_mix(split, targets, args.vocab_size, args.min_frequency, args.out_dir,
                                              args.model_max_length, added.texts)
        kinds = kind_sets(split)
        comp, by_kind = measure(tok, sets), measure(tok, kinds)
        compared = {name: (measure(other, sets), measure(other, kinds)) for name, other in others.items()}
    except (DataError, TokenizerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    import tokenizers

    summary = {
        "tokenizer_sha256": tok.sha256,
        "vocab_size": tok.vocab_size,
        "special_tokens": {t: i for i, t in enumerate(SPECIAL_TOKENS)},
        "corpus": split.files,
        "split": {"method": "sha1(utf-8 text) first 8 bytes as big-endian int < heldout_percent/100 * 2**64",
                  "heldout_percent": args.heldout_percent,
                  "train_docs": {g: len(t) for g, t in sorted(split.train.items())},
                  "heldout_docs": len(split.heldout)},
        "mix": {"zh_share": args.zh_share, "zh_modern_share": args.zh_modern_share, "train_mb": args.train_mb,
                "classical_sources": list(CLASSICAL_SOURCES),
                "drawn_bytes": dict(drawn), "available_bytes": {
                    g: sum(len(t.encode("utf-8")) for t in split.train.get(g, [])) for g in GROUPS}},
        "added": {"method": "the trainer's validation split left out (in_validation of the line numbers); "
                            f"documents sharing {2 * WINDOW - 1}+ characters with held-out text left out",
                  "val_fraction": args.val_fraction, "split_seed": args.split_seed, "files": added.files},
        "training": {"algorithm": "byte-level BPE (dataset.tokenizer.train_bpe)", "vocab_size": args.vocab_size,
                     "min_frequency": args.min_frequency, "model_max_length": args.model_max_length,
                     "tokenizers_version": tokenizers.__version__},
        "heldout_compression": comp,
        "by_kind": by_kind,
        "compared": {name: {"tokenizer_sha256": others[name].sha256, "heldout_compression": c, "by_kind": k}
                     for name, (c, k) in compared.items()},
    }
    out = Path(args.out_dir)
    (out / "compression.json").write_text(json.dumps(summary, indent=2, ensure_ascii=False) + "\n")
    added_mb = sum(f["added_bytes"] for f in added.files) / 1e6
    print(f"wrote {out}/ (vocab {tok.vocab_size}, sha256 {tok.sha256[:12]}); trained on "
          f"{sum(drawn.values()) / 1e6:.1f} MB ({', '.join(f'{g} {b / 1e6:.1f}' for g, b in drawn.items())}) "
          f"plus {added_mb:.1f} MB added in {train_seconds:.1f}s")
    for f in added.files:
        print(f"added {f['file']}: {f['added_docs']:,} of {f['docs']:,} documents ({f['validation_docs']:,} in the "
              f"validation split, {f['sharing_heldout_text']:,} sharing held-out text)")
    print_table(comp, {name: c for name, (c, _) in compared.items()})
    print_table(by_kind, {name: k for name, (_, k) in compared.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
