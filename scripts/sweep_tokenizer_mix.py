"""Sweep the default tokenizer's training mix: train one tokenizer per (zh_share, zh_modern_share) and score each.

    python scripts/sweep_tokenizer_mix.py --data_path CORPUS.jsonl dataset/zh_docs/zh_docs.jsonl \\
        --compare /path/to/minimind/model                                          # the grid below
    python scripts/sweep_tokenizer_mix.py --data_path CORPUS.jsonl dataset/zh_docs/zh_docs.jsonl \\
        --zh_share 0.3 0.5 --zh_modern_share 0.6 --out /tmp/sweep.json

--data_path (required) takes the same JSONL files of {"text", "source", "lang"} documents as
scripts/build_default_tokenizer.py (whose docstring says what the shipped tokenizer was built from).

Every point trains on the same amount of text (--train_mb) drawn as scripts/build_default_tokenizer.py draws it,
and is scored on the same held-out sets; the tokenizers given to --compare, and the shipped one (named "shipped"
and its hash's first 8 digits), are scored beside them. Writes a JSON of every point and a PNG (bytes per token
of each set against the Chinese share, one line per modern share, the compared tokenizers as horizontal
lines), and prints a Markdown table with the geometric mean of the sets' bytes per token, the number the
shipped mix maximises.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from build_default_tokenizer import (  # noqa: E402
    TRAIN_MB,
    chat_texts,
    evaluation_sets,
    geometric_mean_bpt,
    group_targets,
    measure,
    read_split,
    tokenizer_name,
    train_mix,
)

from common.device import cpu_description  # noqa: E402
from dataset.jsonl import DataError  # noqa: E402
from dataset.tokenizer import DEFAULT_TOKENIZER_DIR, Tokenizer, TokenizerError  # noqa: E402

SETS = ("en", "zh", "zh-modern", "chat-en", "chat-zh")


def plot(points: list[dict], compared: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(SETS), figsize=(4 * len(SETS), 3.6), sharex=True)
    for ax, name in zip(axes, SETS):
        for modern in sorted({p["zh_modern_share"] for p in points}):
            line = sorted((p["zh_share"], p["heldout_compression"][name]["bytes_per_token"])
                          for p in points if p["zh_modern_share"] == modern)
            ax.plot(*zip(*line), marker="o", label=f"modern {modern:g}")
        for i, (other, comp) in enumerate(compared.items()):
            ax.axhline(comp[name]["bytes_per_token"], color=f"C{7 + i}", linestyle="--", label=other)
        ax.set_title(name)
        ax.set_xlabel("Chinese share of training bytes")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("bytes per token (higher is better)")
    axes[-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data_path", nargs="+", required=True, metavar="F.jsonl",
                   help='JSONL files of {"text", "source", "lang"} documents, as scripts/build_default_tokenizer.py')
    p.add_argument("--zh_share", nargs="+", type=float, default=[0.3, 0.4, 0.5, 0.6, 0.7])
    p.add_argument("--zh_modern_share", nargs="+", type=float, default=[0.1, 0.3, 0.6, 0.9])
    p.add_argument("--train_mb", type=float, default=TRAIN_MB)
    p.add_argument("--vocab_size", type=int, default=6400)
    p.add_argument("--heldout_percent", type=float, default=2.0)
    p.add_argument("--compare", nargs="*", default=[])
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "tokenizer-mix-sweep.json")
    args = p.parse_args(argv)
    try:
        split = read_split(args.data_path, args.heldout_percent)
        sets = evaluation_sets(split, chat_texts())
        shipped = Tokenizer(DEFAULT_TOKENIZER_DIR)
        compared = {f"shipped {shipped.sha256[:8]}": measure(shipped, sets)}
        for d in args.compare:
            compared[tokenizer_name(d)] = measure(Tokenizer(d), sets)
        points = []
        for modern in args.zh_modern_share:
            for share in args.zh_share:
                with tempfile.TemporaryDirectory() as tmp:
                    targets = group_targets(share, modern, args.train_mb)
                    tok, drawn, seconds = train_mix(split, targets, args.vocab_size, 2, tmp, 32768)
                    comp = measure(tok, sets)
                points.append({"zh_share": share, "zh_modern_share": modern, "train_seconds": round(seconds, 1),
                               "drawn_bytes": dict(drawn), "heldout_compression": comp,
                               "geomean_bytes_per_token": round(geometric_mean_bpt(comp), 4)})
                print(f"zh {share:g} modern {modern:g}: geomean {points[-1]['geomean_bytes_per_token']:.3f} "
                      + " ".join(f"{n} {comp[n]['bytes_per_token']:.3f}" for n in SETS), flush=True)
    except (DataError, TokenizerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {"machine": cpu_description(), "train_mb": args.train_mb, "corpus": split.files, "sets": SETS,
              "compared": compared, "points": points}
    args.out.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    plot(points, compared, args.out.with_suffix(".png"))
    print(f"\nwrote {args.out} and {args.out.with_suffix('.png')}\n")
    print("| zh share | modern share | " + " | ".join(SETS) + " | geomean |")
    print("|--:|--:|" + "--:|" * (len(SETS) + 1))
    for name, comp in compared.items():
        print(f"| {name} | | " + " | ".join(f"{comp[n]['bytes_per_token']:.3f}" for n in SETS)
              + f" | {geometric_mean_bpt(comp):.3f} |")
    for pt in sorted(points, key=lambda q: -q["geomean_bytes_per_token"]):
        comp = pt["heldout_compression"]
        print(f"| {pt['zh_share']:g} | {pt['zh_modern_share']:g} | "
              + " | ".join(f"{comp[n]['bytes_per_token']:.3f}" for n in SETS)
              + f" | {pt['geomean_bytes_per_token']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
