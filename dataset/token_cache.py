"""Tokenize once: parallel, streaming preparation of a JSONL file into memory-mapped token arrays.

A cache lives next to the data (`<data>.pocketlm-cache/<kind>-<key>/`, or `<cache_dir>/<data name>-<path hash>/
<kind>-<key>/` under --cache_dir, one folder per file) and holds, per split ("train", "val"):
    <split>.bin   token ids, uint16 (uint32 when the vocabulary exceeds 65536)
    <split>.idx   uint64 offsets: document d is tokens [idx[d], idx[d+1])
    <split>.lbl   (SFT, DPO) uint8, 1 where the token is a training target
    <split>.seg   (DPO only) uint32 rows (prompt, chosen, rejected): the token counts of pair d's three parts
and meta.json, written last. The key hashes the tokenizer and the settings; meta.json records the source
file's size, mtime and sha256, so a changed file or tokenizer rebuilds and an unchanged one is reused at once.

A DPO pair is stored once as its shared prompt followed by both answers: document d is
    prompt | chosen answer | rejected answer
where the prompt is the template's ids of every turn before the last, and each answer is the ids of its final
assistant turn, header to trailing newline, exactly as `Tokenizer.encode_chat` renders the whole conversation
(so row "prompt + answer" is the very sequence SFT would train on). Label flags mark only the final answer's
content and its <|im_end|>; earlier assistant turns in the prompt are context. A pair is too long when prompt +
its longer answer exceeds max_seq_len + 1 tokens. overlong="drop" drops it; "truncate" first drops the oldest
prompt turns (the prompt then starts at a later user turn, always keeping the last one), then cuts the answers'
ends to fit; a pair that would keep no answer token, or whose cut answers became identical, is dropped. Both
count in meta.json's stats ("truncated", "dropped_too_long").

Preparation streams: the main process reads raw lines and hands bounded chunks to worker processes, which
parse, validate and tokenize; at most a few chunks are in flight, so memory does not grow with the corpus.
It builds into a temporary directory renamed into place only when complete, under a file lock, so an
interrupted run, or two ranks preparing at once, can never leave a cache that looks complete.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import multiprocessing as mp
import os
import shutil
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from common.files import file_sha256

from .jsonl import DEFAULT_MAX_LINE_BYTES, DataError, SkipReport, check_path, iter_raw_lines, parse_line, write_atomic
from .kinds import CONVERSATIONS, PAIRS, RECORDS, TEXT, CachedKind
from .tokenizer import Tokenizer

CACHE_VERSION = 1
DEFAULT_SPLIT_SEED = 42  # the validation split's seed unless --split_seed says otherwise
CHUNK_BYTES = 2 * 1024 * 1024  # raw JSONL per task: large enough to amortise IPC, small enough to bound memory
SPLITS = ("train", "val")


# ---------------------------------------------------------------------------- helpers
def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


GOLDEN_GAMMA = np.uint64(0x9E3779B97F4A7C15)  # splitmix64's increment: 2**64 / golden ratio


def splitmix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer over a uint64 array (wrapping arithmetic): a cheap, well-mixed 64-bit hash."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def in_validation(linenos: np.ndarray, fraction: float, seed: int) -> np.ndarray:
    """Deterministic per-document split: a splitmix64 hash of (seed, line number) against the fraction.

    Depends only on the line, not on how many other lines were skipped, so the split is stable.
    """
    if fraction <= 0:
        return np.zeros(len(linenos), dtype=bool)
    with np.errstate(over="ignore"):
        z = splitmix64(linenos.astype(np.uint64) + np.uint64(seed) * GOLDEN_GAMMA)
    return (z >> np.uint64(11)).astype(np.float64) / float(1 << 53) < fraction


def gather_ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Indices of the concatenated ranges [starts[i], starts[i] + lengths[i]), without a Python loop."""
    shift = starts - (np.cumsum(lengths) - lengths)
    return np.repeat(shift, lengths) + np.arange(int(lengths.sum()))


def concat_ids(docs: list[list[int]], dtype: np.dtype) -> np.ndarray:
    return np.concatenate([np.asarray(d, dtype=dtype) for d in docs]) if docs else np.zeros(0, dtype)


def cache_root(data_path: Path, cache_dir: str | Path | None = None) -> Path:
    """Where data_path's caches go: its own folder under cache_dir (several files share a --cache_dir, and the
    key, which hashes the settings, is the same for each), or beside it (default_cache_root)."""
    if cache_dir is None:
        return default_cache_root(data_path)
    return Path(cache_dir) / _folder_of(data_path)


def default_cache_root(data_path: Path) -> Path:
    """`<data>.pocketlm-cache` beside the data, or a per-user cache when that directory is read-only."""
    if os.access(data_path.parent, os.W_OK):
        return data_path.parent / f"{data_path.name}.pocketlm-cache"
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pocketlm" / _folder_of(data_path)


def _folder_of(data_path: Path) -> str:
    """A data file's folder in a cache directory that other files share: its name and a hash of its full path."""
    return f"{data_path.name}-{hashlib.sha256(str(data_path.resolve()).encode()).hexdigest()[:16]}"


# ----------------------------------------------------------------------- chunk encoders
# Run in worker processes: each gets (first_lineno, [(lineno, raw bytes), ...]) and returns arrays.
_WORKER: dict[str, Any] = {}


def _init_worker(tokenizer_path: str, settings: dict[str, Any]) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # parallelism comes from the worker processes
    _WORKER["tok"] = Tokenizer(tokenizer_path)
    _WORKER["settings"] = settings


@dataclass
class Encoded:
    """One chunk's output: per-document token arrays plus line numbers and per-line problems."""

    linenos: np.ndarray  # (D,) source line of each kept document
    lengths: np.ndarray  # (D,) tokens per document
    ids: np.ndarray  # concatenated tokens
    labels: np.ndarray | None  # SFT, DPO: concatenated 0/1 target flags
    errors: list[tuple[int, str]]  # (lineno, reason) of bad lines
    stats: dict[str, int]  # kind-specific counters (e.g. truncated conversations)
    segments: np.ndarray | None = None  # DPO: (D, 3) token counts of prompt, chosen and rejected answer


def encode_pretrain_chunk(lines: list[tuple[int, bytes]]) -> Encoded:
    tok: Tokenizer = _WORKER["tok"]
    texts, linenos, errors = [], [], []
    for lineno, raw in lines:
        try:
            texts.append(parse_line(raw, RECORDS[TEXT])["text"])
            linenos.append(lineno)
        except ValueError as e:
            errors.append((lineno, str(e)))
    docs = tok.encode_batch(texts)
    for d in docs:
        d.append(tok.eot_id)  # documents are joined (and ended) by <|endoftext|>
    # the text's UTF-8 bytes, for its bytes per token (how well the tokenizer compresses it: compression_note)
    text_bytes = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)
    return Encoded(np.asarray(linenos, dtype=np.int64), np.asarray([len(d) for d in docs], dtype=np.int64),
                   concat_ids(docs, token_dtype(tok.vocab_size)), None, errors, {"text_bytes": text_bytes})


def encode_sft_chunk(lines: list[tuple[int, bytes]]) -> Encoded:
    tok: Tokenizer = _WORKER["tok"]
    limit = _WORKER["settings"]["max_seq_len"] + 1  # inputs and shifted targets share one extra token
    drop_overlong = _WORKER["settings"]["overlong"] == "drop"
    linenos, all_ids, all_labels, errors = [], [], [], []
    stats = {"truncated": 0, "dropped_too_long": 0}
    for lineno, raw in lines:
        try:
            conv = parse_line(raw, RECORDS[CONVERSATIONS])["conversations"]
        except ValueError as e:
            errors.append((lineno, str(e)))
            continue
        ids, labelled, turn_ends = tok.encode_chat(conv)
        if len(ids) > limit:
            # Keep the longest prefix of whole turns that fits and still ends in an assistant answer.
            keep = max((end for end, turn in zip(turn_ends, conv) if end <= limit and turn["role"] == "assistant"),
                       default=0)
            if drop_overlong or keep == 0:
                stats["dropped_too_long"] += 1
                continue
            stats["truncated"] += 1
            ids, labelled = ids[:keep], labelled[:keep]
        linenos.append(lineno)
        all_ids.append(ids)
        all_labels.append(labelled)
    return Encoded(np.asarray(linenos, dtype=np.int64), np.asarray([len(d) for d in all_ids], dtype=np.int64),
                   concat_ids(all_ids, token_dtype(tok.vocab_size)), concat_ids(all_labels, np.dtype(np.uint8)),
                   errors, stats)


def fit_pair(prompt_ends: list[int], roles: list[str], answers: list[list[int]], labels: list[list[bool]],
             limit: int) -> tuple[int, list[list[int]], list[list[bool]]] | None:
    """Make a preference pair fit in `limit` tokens (see the module docstring): (tokens cut from the prompt's
    start, the answers, their flags), or None when it cannot be kept.

    prompt_ends[i] is the prompt's length after its turn i (turns are encoded independently, so dropping the
    first turns drops exactly their tokens); roles are the prompt turns' roles.
    """
    prompt_len = prompt_ends[-1]
    # Where the kept prompt may start: its beginning, or any later user turn (never mid-exchange).
    starts = [0] + [prompt_ends[i - 1] for i, role in enumerate(roles) if role == "user" and i > 0]
    longest = max(len(a) for a in answers)
    cut = next((s for s in starts if prompt_len - s + longest <= limit), starts[-1])
    room = limit - (prompt_len - cut)
    if room >= longest:
        return cut, answers, labels
    answers, labels = [a[:room] for a in answers], [f[:room] for f in labels]
    if not all(any(f) for f in labels) or answers[0] == answers[1]:
        return None  # nothing left to learn from, or nothing left to prefer
    return cut, answers, labels


def encode_dpo_chunk(lines: list[tuple[int, bytes]]) -> Encoded:
    tok: Tokenizer = _WORKER["tok"]
    limit = _WORKER["settings"]["max_seq_len"] + 1  # inputs and shifted targets share one extra token
    drop_overlong = _WORKER["settings"]["overlong"] == "drop"
    linenos, docs, flags, segments, errors = [], [], [], [], []
    stats = {"truncated": 0, "dropped_too_long": 0}
    for lineno, raw in lines:
        try:
            record = parse_line(raw, RECORDS[PAIRS])
        except ValueError as e:
            errors.append((lineno, str(e)))
            continue
        # Each whole conversation through encode_chat, so every row is exactly what SFT would train on. The
        # prompt turns are identical (validated) and encoded turn by turn, so their ids are the same in both.
        encoded = [tok.encode_chat(record[name]) for name in ("chosen", "rejected")]
        turn_ends = encoded[0][2]
        start = turn_ends[-2]  # the prompt's length: every turn before the answer
        prompt = encoded[0][0][:start]
        answers = [ids[start:] for ids, _, _ in encoded]
        labels = [labelled[start:] for _, labelled, _ in encoded]  # earlier assistant turns are context only
        if start + max(len(a) for a in answers) > limit:
            fitted = None if drop_overlong else fit_pair(
                turn_ends[:-1], [t["role"] for t in record["chosen"][:-1]], answers, labels, limit)
            if fitted is None:
                stats["dropped_too_long"] += 1
                continue
            stats["truncated"] += 1
            cut, answers, labels = fitted
            prompt = prompt[cut:]
        linenos.append(lineno)
        docs.append(prompt + answers[0] + answers[1])
        flags.append([False] * len(prompt) + labels[0] + labels[1])
        segments.append((len(prompt), len(answers[0]), len(answers[1])))
    return Encoded(np.asarray(linenos, dtype=np.int64), np.asarray([len(d) for d in docs], dtype=np.int64),
                   concat_ids(docs, token_dtype(tok.vocab_size)), concat_ids(flags, np.dtype(np.uint8)),
                   errors, stats, np.asarray(segments, dtype=np.int64).reshape(-1, 3))


ENCODERS: dict[CachedKind, Callable[[list[tuple[int, bytes]]], Encoded]] = {
    TEXT: encode_pretrain_chunk, CONVERSATIONS: encode_sft_chunk, PAIRS: encode_dpo_chunk}


# ------------------------------------------------------------------------------ caches
@dataclass
class TokenCache:
    """A complete, validated cache directory and its metadata."""

    path: Path
    meta: dict[str, Any]

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.meta["dtype"])

    def tokens(self, split: str) -> np.ndarray:
        return self._array(split, "bin", self.dtype)

    def offsets(self, split: str) -> np.ndarray:
        return self._array(split, "idx", np.uint64)

    def labels(self, split: str) -> np.ndarray:
        return self._array(split, "lbl", np.uint8)

    def segments(self, split: str) -> np.ndarray:
        """DPO: (pairs, 3) token counts of each pair's prompt, chosen answer and rejected answer."""
        return self._array(split, "seg", np.uint32).reshape(-1, 3)

    def _array(self, split: str, ext: str, dtype: np.dtype) -> np.ndarray:
        file = self.path / f"{split}.{ext}"
        if file.stat().st_size == 0:  # np.memmap refuses empty files
            return np.zeros(0, dtype=dtype)
        return np.memmap(file, dtype=dtype, mode="r")


def _lines_in_chunks(path: Path, max_line_bytes: int) -> Iterator[tuple[list[tuple[int, bytes]], int]]:
    chunk: list[tuple[int, bytes]] = []
    size = 0
    for lineno, raw in iter_raw_lines(path, max_line_bytes):
        chunk.append((lineno, raw))
        size += len(raw) + 1
        if size >= CHUNK_BYTES:
            yield chunk, size
            chunk, size = [], 0
    if chunk:
        yield chunk, size


def _source_info(path: Path, with_hash: bool) -> dict[str, Any]:
    st = path.stat()
    info = {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    if with_hash:
        info["sha256"] = file_sha256(path)
    return info


def _load_if_valid(final: Path, source: Path, tokenizer: Tokenizer) -> TokenCache | None:
    """The cache at `final` if it is complete and matches the current source and tokenizer, else None."""
    meta_file = final / "meta.json"
    if not meta_file.is_file():
        return None
    try:
        meta = json.loads(meta_file.read_text())
    except (json.JSONDecodeError, OSError):
        return None
    if meta.get("version") != CACHE_VERSION or meta["tokenizer"]["sha256"] != tokenizer.sha256:
        return None
    now = _source_info(source, with_hash=False)
    if now["size"] != meta["source"]["size"]:
        return None
    if now["mtime_ns"] != meta["source"]["mtime_ns"]:
        # Touched (copied, checked out) but maybe unchanged: the content hash decides.
        if file_sha256(source) != meta["source"]["sha256"]:
            return None
        meta["source"]["mtime_ns"] = now["mtime_ns"]
        write_atomic(meta_file, json.dumps(meta, indent=2))
    return TokenCache(final, meta)


def prepare(data_path: str | Path, tokenizer: Tokenizer, kind: CachedKind = TEXT, val_fraction: float = 0.0,
            seed: int = DEFAULT_SPLIT_SEED, num_workers: int | None = None, skip_bad_lines: bool = False,
            cache_dir: str | Path | None = None, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
            log: Callable[[str], None] = print, **settings: Any) -> TokenCache:
    """Return the token cache for data_path, building it if missing or stale.

    kind "pretrain" reads {"text"} records; kind "sft" reads {"conversations"} and kind "dpo" reads
    {"chosen", "rejected"} pairs, both needing settings max_seq_len and overlong ("truncate" | "drop"). Bad
    lines raise DataError unless skip_bad_lines.
    `seed` seeds the document-level validation split; it is part of the cache key.
    """
    if kind not in ENCODERS:
        raise ValueError(f"unknown cache kind {kind!r}")
    source = check_path(data_path)
    if source.stat().st_size == 0:
        raise DataError(f"{source}: empty file")
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    settings = {"val_fraction": val_fraction, "seed": seed, **settings}
    key_src = json.dumps({"v": CACHE_VERSION, "kind": kind, "tok": tokenizer.sha256, **settings}, sort_keys=True)
    root = cache_root(source, cache_dir)
    final = root / f"{kind}-{hashlib.sha256(key_src.encode()).hexdigest()[:16]}"

    cache = _load_if_valid(final, source, tokenizer)
    if cache is None:
        root.mkdir(parents=True, exist_ok=True)
        with open(root / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same cache: wait for it
            cache = _load_if_valid(final, source, tokenizer)
            if cache is None:
                for stale in root.glob("*.tmp-*"):  # left by an interrupted run; we hold the lock, nobody owns them
                    shutil.rmtree(stale, ignore_errors=True)
                return _build(source, tokenizer, kind, settings, final, num_workers, skip_bad_lines,
                              max_line_bytes, log)
    splits = cache.meta["splits"]
    log(f"reusing the prepared cache {cache.path} ({splits['train']['tokens']:,} train / "
        f"{splits['val']['tokens']:,} val tokens)")
    return cache


class SplitFiles:
    """The cache's files being written, per split: the token ids (.bin), the document offsets (.idx) and, for the
    kinds that have them, the loss labels (.lbl) and the pair segments (.seg)."""

    def __init__(self, folder: Path, kind: CachedKind) -> None:
        exts = {TEXT: ("bin", "idx"), CONVERSATIONS: ("bin", "idx", "lbl"), PAIRS: ("bin", "idx", "lbl", "seg")}[kind]
        self.files = {(s, e): open(folder / f"{s}.{e}", "wb") for s in SPLITS for e in exts}
        self.offsets = {s: [np.zeros(1, dtype=np.uint64)] for s in SPLITS}
        self.tokens = {s: 0 for s in SPLITS}

    def write(self, enc: Encoded, is_val: np.ndarray) -> None:
        """Append a chunk's documents, each to its split."""
        starts = np.cumsum(enc.lengths) - enc.lengths
        for split, mask in (("train", ~is_val), ("val", is_val)):
            if not mask.any():
                continue
            sel = gather_ranges(starts[mask], enc.lengths[mask])
            enc.ids[sel].tofile(self.files[(split, "bin")])
            if enc.labels is not None:
                enc.labels[sel].tofile(self.files[(split, "lbl")])
            if enc.segments is not None:
                enc.segments[mask].astype(np.uint32).tofile(self.files[(split, "seg")])
            self.offsets[split].append(self.tokens[split] + np.cumsum(enc.lengths[mask]).astype(np.uint64))
            self.tokens[split] += int(enc.lengths[mask].sum())

    def finish(self) -> dict[str, int]:
        """Write the offsets, flush everything to disk and close; the documents per split."""
        docs = {}
        for split in SPLITS:
            idx = np.concatenate(self.offsets[split])
            idx.tofile(self.files[(split, "idx")])
            docs[split] = len(idx) - 1
        for f in self.files.values():
            f.flush()
            os.fsync(f.fileno())
            f.close()
        return docs

    def close(self) -> None:
        for f in self.files.values():
            f.close()


def _publish(tmp: Path, final: Path) -> None:
    """Put a finished cache in place of any older one at `final` (a reader sees the old or the new whole)."""
    old = final.with_name(f"{final.name}.tmp-old-{os.getpid()}")
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def _build(source: Path, tokenizer: Tokenizer, kind: CachedKind, settings: dict[str, Any], final: Path,
           num_workers: int | None, skip_bad_lines: bool, max_line_bytes: int,
           log: Callable[[str], None]) -> TokenCache:
    from tqdm import tqdm

    t0 = time.time()
    tmp = final.with_name(f"{final.name}.tmp-{os.getpid()}")
    tmp.mkdir(parents=True)
    out = SplitFiles(tmp, kind)
    report, stats = SkipReport(), {}
    workers = min(os.cpu_count() or 1, 8) if num_workers is None else num_workers
    if not getattr(sys.modules["__main__"], "__file__", None):
        workers = 0  # spawned workers re-import __main__, impossible for `python -` or a REPL
    pool = None
    try:
        source_info = _source_info(source, with_hash=True)
        encode = ENCODERS[kind]
        if workers > 0:
            # spawn, not fork: safe after CUDA or tokenizer threads started in this process
            pool = mp.get_context("spawn").Pool(workers, _init_worker, (str(tokenizer.path), settings))
        else:
            _init_worker(str(tokenizer.path), settings)
        pending: deque = deque()
        bar = tqdm(total=source.stat().st_size, unit="B", unit_scale=True, desc=f"tokenizing {source.name}",
                   disable=None, file=sys.stderr)

        def consume(enc: Encoded, nbytes: int) -> None:
            for lineno, reason in enc.errors:
                report.reject(source, lineno, reason, skip_bad_lines)
            for k, v in enc.stats.items():
                stats[k] = stats.get(k, 0) + v
            out.write(enc, in_validation(enc.linenos, settings["val_fraction"], settings["seed"]))
            bar.update(nbytes)

        for chunk, nbytes in _lines_in_chunks(source, max_line_bytes):
            if pool is None:
                consume(encode(chunk), nbytes)
                continue
            pending.append((pool.apply_async(encode, (chunk,)), nbytes))
            if len(pending) >= 2 * workers:  # bounded in-flight work keeps memory flat
                result, n = pending.popleft()
                consume(result.get(), n)
        while pending:
            result, n = pending.popleft()
            consume(result.get(), n)
        bar.close()

        docs = out.finish()
        if docs["train"] == 0:
            raise DataError(f"{source}: no usable records for training ({report.summary()})")
        meta = {"version": CACHE_VERSION, "kind": kind, "source": source_info,
                "tokenizer": {"path": str(tokenizer.path), "sha256": tokenizer.sha256,
                              "vocab_size": tokenizer.vocab_size},
                "settings": settings, "dtype": token_dtype(tokenizer.vocab_size).name,
                "splits": {s: {"documents": docs[s], "tokens": out.tokens[s]} for s in SPLITS},
                "skipped": dict(report.counts), "stats": stats, "build_seconds": round(time.time() - t0, 2)}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
        _publish(tmp, final)
    except BaseException:
        out.close()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if pool is not None:
            pool.terminate()
    mb = source_info["size"] / 1e6
    log(f"prepared {source.name}: {meta['splits']['train']['tokens']:,} train / {meta['splits']['val']['tokens']:,} "
        f"val tokens from {docs['train'] + docs['val']:,} records in {meta['build_seconds']:.1f}s "
        f"({mb / max(meta['build_seconds'], 1e-9):.1f} MB/s)" + (f"; {report.summary()}" if report.total else "")
        + (f"; {shown}" if (shown := {k: v for k, v in stats.items() if v and k != "text_bytes"}) else ""))
    return TokenCache(final, meta)
