"""Ingest benchmark: extraction quality on the bundled example folder, whose files were rendered from known text,
and reading speed per format.

    python bench/bench_ingest.py [--folder dataset/demo/documents] [--repeats 3]

Quality: `python -m dataset.ingest`'s records are grouped back by the file they came from and compared with that
file's reference text (dataset/demo/documents_reference.jsonl, scripts/build_documents_demo.py), with whitespace
removed from both (where a layout wrapped a line is not content) as multisets of character 8-grams:
  recovered   = reference n-grams found in the extraction / reference n-grams      (goal >= 98% per file)
  boilerplate = extracted n-grams not in the reference / extracted n-grams         (goal <= 2% per file)
Speed: the fastest of --repeats ingests of the folder, per format pages/s (PDF) and MB/s. Cleaning: ingest's
splitting, cleaning, deduplication and writing of a JSONL corpus (--clean_data, the demo pretraining file; its
reading and language detection left out) against `python -m dataset.clean` on the records ingest wrote (the
same text, in the same records), in turns. Writes bench/results/ingest-<cores>core.json, the CPU named with its
kind.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.portable import portable  # noqa: E402
from common.device import cpu_description  # noqa: E402
from dataset.clean import clean_file  # noqa: E402
from dataset.ingest.pipeline import IngestOptions, ingest  # noqa: E402

N = 8


def ngrams(text: str, n: int = N) -> Counter:
    s = "".join(text.split())
    return Counter(s[i:i + n] for i in range(len(s) - n + 1))


def overlap(reference: str, extracted: str) -> dict[str, float]:
    """The share of the reference's n-grams recovered, and the share of the extraction's that are not in it."""
    ref, ext = ngrams(reference), ngrams(extracted)
    common = sum((ref & ext).values())
    return {"recovered": common / max(1, sum(ref.values())),
            "boilerplate": 1 - common / max(1, sum(ext.values()))}


def source_file(source: str, folder: Path) -> str:
    """The file a record came from, relative to the folder (without an EPUB's #chapter or a JSONL's :line)."""
    path = source.split("#", 1)[0]
    path = path.rsplit(":", 1)[0] if path.rsplit(":", 1)[-1].isdigit() else path
    return Path(path).relative_to(folder).as_posix()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--folder", default=str(ROOT / "dataset" / "demo" / "documents"))
    p.add_argument("--reference", default=None, help="default: <folder>_reference.jsonl")
    p.add_argument("--clean_data", default=str(ROOT / "dataset" / "demo" / "pretrain_demo.jsonl"))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None, help="default: bench/results/ingest-<cores>core.json")
    args = p.parse_args(argv)
    folder = Path(args.folder)
    ref_path = Path(args.reference or f"{folder}_reference.jsonl")
    refs = {r["file"]: r["text"] for r in map(json.loads, ref_path.read_text(encoding="utf-8").splitlines())
            if "file" in r}

    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus.jsonl"
        runs, ingest_clean, clean_runs = [], [], []
        for _ in range(args.repeats):
            runs.append(ingest([str(folder)], corpus, IngestOptions(), progress=False))
        records = [json.loads(line) for line in corpus.read_text(encoding="utf-8").splitlines()]
        for _ in range(args.repeats):
            r = ingest([args.clean_data], Path(tmp) / "ingested.jsonl", IngestOptions(), progress=False)
            ingest_clean.append(r["elapsed_s"] - r["extract_s"] - r["language_s"])
            start = time.perf_counter()
            clean_file(Path(tmp) / "ingested.jsonl", Path(tmp) / "cleaned.jsonl")
            clean_runs.append(time.perf_counter() - start)

    texts = defaultdict(list)
    for r in records:
        texts[source_file(r["source"], folder)].append(r["text"])
    quality = {}
    for name, reference in sorted(refs.items()):
        quality[name] = {k: round(v, 4) for k, v in overlap(reference, "\n\n".join(texts.get(name, []))).items()}
    worst_recovered = min(q["recovered"] for q in quality.values())
    worst_boilerplate = max(q["boilerplate"] for q in quality.values())

    best = min(runs, key=lambda r: r["elapsed_s"])
    by_format = {}
    for fmt in best["by_format"]:
        fastest = min((r["by_format"][fmt] for r in runs), key=lambda s: s["seconds"])
        by_format[fmt] = {k: fastest[k] for k in ("files", "bytes", "pages", "chars", "seconds", "mb_per_s",
                                                   "pages_per_s") if k in fastest}
    ingest_clean_s = min(ingest_clean)
    result = {
        "machine": cpu_description(),
        "cores": os.cpu_count(),
        "folder": portable(folder),
        "files": len(refs),
        "ngram": N,
        "worst_recovered": worst_recovered,
        "worst_boilerplate": worst_boilerplate,
        "quality_by_file": quality,
        "by_format": by_format,
        "cleaning": {"data": portable(args.clean_data), "ingest_s": round(ingest_clean_s, 3),
                     "dataset_clean_s": round(min(clean_runs), 3),
                     "ratio": round(ingest_clean_s / min(clean_runs), 3)},
        "repeats": args.repeats,
    }
    for name, q in quality.items():
        flag = "" if q["recovered"] >= 0.98 and q["boilerplate"] <= 0.02 else "   <-- below goal"
        print(f"{name:<48} recovered {100 * q['recovered']:6.2f}%  boilerplate {100 * q['boilerplate']:5.2f}%{flag}")
    print(f"worst: recovered {100 * worst_recovered:.2f}% (goal >= 98%), boilerplate "
          f"{100 * worst_boilerplate:.2f}% (goal <= 2%)")
    for fmt, s in by_format.items():
        pages = f", {s['pages_per_s']:,.0f} pages/s" if s.get("pages_per_s") else ""
        print(f"{fmt:<9} {s['files']:>3} files {s['bytes'] / 1e6:6.2f} MB  {s['mb_per_s'] or 0:8.2f} MB/s{pages}")
    print(f"cleaning {Path(args.clean_data).name}: ingest {ingest_clean_s:.3f} s, dataset.clean "
          f"{min(clean_runs):.3f} s ({result['machine']})")
    out = Path(args.out or ROOT / "bench" / "results" / f"ingest-{os.cpu_count()}core.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
