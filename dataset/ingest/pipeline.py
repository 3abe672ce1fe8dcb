"""The ingest itself: every file read (formats/), each document split (split.py) into records that are cleaned and
deduplicated as `python -m dataset.clean` does, told their language (language.py), some held out, written
atomically with a report of what was read, skipped and kept."""
from __future__ import annotations

import hashlib
import json
import sys
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Iterator

from common.config import option
from common.errors import ConfigError, DataError
from dataset.clean import CleanOptions, CleanStats, Deduper, clean_records, report_path
from dataset.jsonl import SkipReport, write_atomic

from .formats import extract_file, file_format
from .formats.base import Extracted, Unreadable
from .language import detect_language
from .split import split_document
from .walk import find_files, regular_file_size

HELD = "_heldout"  # a record's mark, in the pipeline only, that its document is held out
_LANGUAGE_BLOCK = 256  # records cleaned before their languages are told (see lines() in ingest)


@dataclass
class IngestOptions:
    """How files become records."""

    title: ClassVar[str] = "records"
    max_chars: int = option(8000, "longer documents are split into records at paragraph boundaries")
    min_chars: int = option(20, "records shorter than this after cleaning are dropped")
    encoding: str | None = option(None, "the encoding of text files that are not UTF-8 (e.g. gb18030, cp1252); "
                                        "without it such files are skipped, with the reason", metavar="ENCODING")
    skip_bad_lines: bool = option(False, "JSONL: skip and count bad lines (without it, a file with a bad line is "
                                         "skipped, naming it)")
    heldout: float = option(0.0, "share of documents (whole files, EPUB chapters, JSONL lines; chosen by a hash of "
                                 "their name) written to <out stem>.heldout.jsonl instead, to measure the adapted "
                                 "model on (train_pretrain.py --eval_data_path)", metavar="SHARE")
    near_dedup: bool = option(True, "near-duplicates dropped too (--no-near_dedup: exact deduplication only)",
                              aliases=("--no_near_dedup",))
    threshold: float = option(0.8, "Jaccard similarity that counts as a near-duplicate")
    # MinHash's settings, as dataset.clean has them: in a --config file only
    shingle_size: int = option(5, "characters per shingle", hidden=True)
    num_perm: int = option(128, "MinHash permutations", hidden=True)
    seed: int = option(1, "MinHash seed", hidden=True)

    def __post_init__(self) -> None:
        if not 1 <= self.min_chars <= self.max_chars:
            raise ConfigError(f"need 1 <= --min_chars <= --max_chars, got {self.min_chars} and {self.max_chars}")
        if not 0.0 < self.threshold <= 1.0:
            raise ConfigError(f"--threshold must be in (0, 1], got {self.threshold}")
        if not 0.0 <= self.heldout < 1.0:
            raise ConfigError(f"--heldout must be in [0, 1), got {self.heldout}")


# ------------------------------------------------------------------------------------------------ held out
def heldout_path(out: str | Path) -> Path:
    """Where --heldout documents go: corpus.jsonl -> corpus.heldout.jsonl."""
    out = Path(out)
    return out.with_name(f"{out.stem}.heldout{out.suffix or '.jsonl'}")


def is_heldout(where: str, share: float) -> bool:
    """Whether the document at `where` (a file, `file#chapter`, `file:line`) is held out: a hash of its name
    against the share, so a document's parts stay together and the choice does not depend on the rest."""
    digest = hashlib.sha256(where.encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big") < share * 2**64


# ------------------------------------------------------------------------------------------------ pipeline
@dataclass
class FormatStats:
    """One format's files, what they gave and what reading them took."""

    files: int = 0
    read: int = 0
    skipped: int = 0
    bytes: int = 0
    pages: int = 0
    pages_without_text: int = 0
    documents: int = 0
    chars: int = 0
    seconds: float = 0.0

    def summary(self) -> dict[str, Any]:
        d = asdict(self)
        d["seconds"] = round(self.seconds, 3)
        d["mb_per_s"] = round(self.bytes / 1e6 / self.seconds, 3) if self.seconds else None
        if self.pages:
            d["pages_per_s"] = round(self.pages / self.seconds, 1) if self.seconds else None
        return d


@dataclass
class IngestStats:
    formats: dict[str, FormatStats] = field(default_factory=lambda: defaultdict(FormatStats))
    unsupported: Counter = field(default_factory=Counter)
    skipped: list[str] = field(default_factory=list)  # "file: reason"
    textless_pages: list[str] = field(default_factory=list)  # "file: pages 3, 7" (PDF pages read as nothing)
    split_documents: int = 0
    languages: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))
    extract_s: float = 0.0
    language_s: float = 0.0


def _read(path: Path, opts: IngestOptions, stats: IngestStats, bad_lines: SkipReport,
          warn: Any) -> Extracted | None:
    fmt = file_format(path)
    if fmt is None:
        stats.unsupported[path.suffix.lower() or "(no suffix)"] += 1
        return None
    fs = stats.formats[fmt]
    fs.files += 1
    start = time.perf_counter()
    try:
        size = regular_file_size(path)
        extracted = extract_file(path, opts.encoding, opts.skip_bad_lines, bad_lines)
    except Unreadable as e:
        fs.skipped += 1
        stats.skipped.append(f"{path}: {e}")
        warn(f"skipped {path}: {e}")
        return None
    finally:
        took = time.perf_counter() - start
        fs.seconds += took
        stats.extract_s += took
    fs.read += 1
    fs.bytes += size
    fs.pages += extracted.pages
    if extracted.pages_without_text:
        many = len(extracted.pages_without_text) > 1
        fs.pages_without_text += len(extracted.pages_without_text)
        named = f"{path}: page{'s' if many else ''} " + ", ".join(map(str, extracted.pages_without_text))
        stats.textless_pages.append(named)
        warn(f"{named} of {extracted.pages} {'have' if many else 'has'} no text layer (images: their text is not "
             "read; OCR the file to keep it)")
    fs.documents += len(extracted.documents)
    fs.chars += sum(len(d.text) for d in extracted.documents)
    return extracted


def make_report(inputs: list[str], out: Path, found: int, opts: IngestOptions, stats: IngestStats,
                clean_stats: CleanStats, bad_lines: SkipReport, heldout: int, elapsed: float) -> dict[str, Any]:
    """What an ingest did, as <out>.report.json holds it: files by format, skips, records, languages, times."""
    return {
        "inputs": [str(i) for i in inputs],
        "output": str(out),
        "files": {"found": found, "read": sum(f.read for f in stats.formats.values()),
                  "skipped": len(stats.skipped), "other_types": sum(stats.unsupported.values())},
        "by_format": {fmt: fs.summary() for fmt, fs in sorted(stats.formats.items())},
        "other_types": dict(sorted(stats.unsupported.items())),
        "skipped": stats.skipped,
        "pages_without_text": stats.textless_pages,
        "bad_lines": {"total": bad_lines.total, "reasons": dict(bad_lines.counts), "first": bad_lines.examples},
        "records": {"from_documents": clean_stats.records, "kept": clean_stats.kept,
                    "documents_split": stats.split_documents},
        "heldout": {"output": str(heldout_path(out)), "records": heldout} if opts.heldout else None,
        "dropped": {r: clean_stats.dropped.get(r, 0)
                    for r in ("empty_after_cleaning", "too_short", "exact_duplicate", "near_duplicate")},
        "chars": {"extracted": clean_stats.chars_in, "kept": clean_stats.chars_out},
        "languages": {lang: dict(c) for lang, c in sorted(stats.languages.items(), key=lambda kv: -kv[1]["chars"])},
        "elapsed_s": round(elapsed, 3),
        "extract_s": round(stats.extract_s, 3),
        "language_s": round(stats.language_s, 3),
        "options": asdict(opts),
    }


def ingest(inputs: list[str], out: str | Path, opts: IngestOptions | None = None, progress: bool = True,
           warn: Any = None) -> dict[str, Any]:
    """Read every file under `inputs` into `out` (atomically) and write <out>.report.json; return the report.

    Raises DataError when an input does not exist or no record is left (the output is then not written)."""
    from tqdm import tqdm

    opts = opts or IngestOptions()
    out = Path(out)
    if out.is_dir():
        raise DataError(f"{out}: is a folder, expected an output .jsonl path")
    files = find_files(inputs, exclude=[out, report_path(out), heldout_path(out)])
    if not files:
        raise DataError(f"{', '.join(map(str, inputs))}: no files found")
    bar = tqdm(files, unit="file", desc="ingest", disable=not progress, file=sys.stderr, dynamic_ncols=True)
    warn = warn or (lambda msg: tqdm.write(msg, file=sys.stderr))  # above the bar, not through it
    stats, clean_stats, bad_lines = IngestStats(), CleanStats(), SkipReport()
    deduper = Deduper(opts.near_dedup, opts.shingle_size, opts.num_perm, opts.threshold, opts.seed)
    start = time.perf_counter()

    def records() -> Iterator[tuple[int, dict[str, Any]]]:
        for path in bar:
            extracted = _read(path, opts, stats, bad_lines, warn)
            for doc in extracted.documents if extracted else []:
                chunks = split_document(doc.text, opts.max_chars)
                stats.split_documents += len(chunks) > 1
                held = is_heldout(doc.where, opts.heldout)
                for part, chunk in enumerate(chunks, 1):
                    yield 0, {"text": chunk, "source": doc.where, "part": part, HELD: held}

    heldout: list[bytes] = []  # a small share: kept in memory, written after the corpus

    def labelled(block: list[dict[str, Any]]) -> Iterator[bytes]:
        at = time.perf_counter()
        langs = [detect_language(record["text"]) for record in block]
        stats.language_s += time.perf_counter() - at
        for record, lang in zip(block, langs):
            held = record.pop(HELD)
            record["lang"] = lang
            stats.languages[lang]["records"] += 1
            stats.languages[lang]["chars"] += len(record["text"])
            line = json_line(record)
            if held:
                heldout.append(line)
            else:
                yield line

    def lines() -> Iterator[bytes]:
        # No HTML stripping: the readers already took the text out of its markup, so what looks like a tag or
        # an entity in it ("<b>", "&gt;" in a page about HTML) is content. One deduplication for both outputs:
        # a held-out record that repeats a training one is dropped, as any duplicate.
        # Languages are told a block of records at a time: the language model's tables and the deduplication's
        # index each stay in the CPU's caches through a block, where one record of each in turn evicted the
        # other's (cleaning took 1.3x as long interleaved with language detection as without it).
        block: list[dict[str, Any]] = []
        for record in clean_records(records(), CleanOptions(strip_html=False), deduper, opts.min_chars, None,
                                    clean_stats):
            block.append(record)
            if len(block) == _LANGUAGE_BLOCK:
                yield from labelled(block)
                block = []
        yield from labelled(block)

    try:
        write_atomic(out, lines())
    finally:
        bar.close()
    if opts.heldout:
        write_atomic(heldout_path(out), heldout)
    if clean_stats.kept == len(heldout):  # nothing to train on (or nothing at all)
        out.unlink()  # written just above
        heldout_path(out).unlink(missing_ok=True)
        why = f"; skipped: {'; '.join(stats.skipped[:3])}" if stats.skipped else ""
        raise DataError(f"no text kept from {len(files)} files under {', '.join(map(str, inputs))}{why}")
    report = make_report(inputs, out, len(files), opts, stats, clean_stats, bad_lines, len(heldout),
                         time.perf_counter() - start)
    write_atomic(report_path(out), json_line(report, indent=2))
    return report


def json_line(value: Any, indent: int | None = None) -> bytes:
    """`value` as UTF-8 JSON and a line break. A file name that is not UTF-8 reaches Python as surrogates, which UTF-8
    cannot encode: they are written as JSON's \\udcXX escapes, which read back as the same name."""
    return (json.dumps(value, ensure_ascii=False, indent=indent) + "\n").encode("utf-8", "backslashreplace")


def format_report(report: dict[str, Any]) -> str:
    """The report as a few human-readable lines."""
    f, r, c = report["files"], report["records"], report["chars"]
    rows = [f"ingested {', '.join(report['inputs'])} -> {report['output']}",
            f"  files: {f['found']:,} found, {f['read']:,} read, {f['skipped']:,} skipped, "
            f"{f['other_types']:,} of other types"]
    for fmt, s in report["by_format"].items():
        speed = f"{s['mb_per_s']:.2f} MB/s" if s["mb_per_s"] else "-"
        pages = f", {s['pages']:,} pages ({s['pages_per_s']:,.0f}/s)" if s.get("pages") else ""
        rows.append(f"    {fmt:<9}{s['read']:>6,} read {s['skipped']:>5,} skipped  {s['chars']:>12,} chars  "
                    f"{speed}{pages}")
    if report["other_types"]:
        rows.append("  other types (not read): " + ", ".join(f"{k} {n:,}" for k, n in report["other_types"].items()))
    if report["pages_without_text"]:
        rows.append(f"  PDF pages without text (not read): {'; '.join(report['pages_without_text'])}")
    if report["bad_lines"]["total"]:
        rows.append(f"  bad JSONL lines skipped: {report['bad_lines']['total']:,} "
                    f"({'; '.join(report['bad_lines']['first'])})")
    rows.append(f"  records: {r['from_documents']:,} from the documents ({r['documents_split']:,} documents split), "
                f"{r['kept']:,} kept")
    if report["heldout"]:
        rows.append(f"  held out: {report['heldout']['records']:,} of them -> {report['heldout']['output']}")
    rows.append("  dropped: " + ", ".join(f"{k} {n:,}" for k, n in report["dropped"].items()))
    rows.append(f"  chars: {c['extracted']:,} extracted, {c['kept']:,} kept")
    rows.append("  languages: " + ", ".join(f"{lang} {s['records']:,} records / {s['chars']:,} chars"
                                              for lang, s in report["languages"].items()))
    rows.append(f"  {report['elapsed_s']:.1f} s ({report['extract_s']:.1f} s reading files, "
                f"{report['language_s']:.1f} s telling languages); "
                f"report: {report_path(report['output'])}")
    return "\n".join(rows)
