"""Clean and deduplicate a JSONL corpus before tokenization, in one streaming pass.

    python -m dataset.clean --data_path raw.jsonl --out clean.jsonl [--min_chars 50] [--threshold 0.8]
    python -m dataset.clean --data_path raw.jsonl --out clean.jsonl --split sentences --min_chars 20 --max_chars 500

Records are {"text": ...} (pretraining) or {"conversations": [{"role", "content"}, ...]} (SFT); the kind is
detected from the file's first valid record unless --kind says it. Other fields are kept as they are.

Each text (each turn, for conversations) goes through, in this order:
  1. HTML: <script>/<style> blocks and comments removed; tags of known HTML elements removed, but only in a text
     that shows real HTML (a closing tag, an attribute, <br>/<p>/<hr>), so `a < b`, `vector<int>` and
     `prog <input> <output>` survive; `&amp;`-style entities (with their `;`) decoded.
  2. Unicode normalisation (NFKC by default; NFC or none).
  3. Control/format characters dropped (\\x00, \\x1b, zero-width space, BOM, lone surrogates...); \\t and
     newlines kept, and ZWJ/ZWNJ kept because emoji sequences and Persian/Indic spelling need them.
  4. Whitespace: CRLF/CR to LF, trailing spaces stripped, runs of blank lines capped (--max_blank_lines).
With --split sentences, each text is then split into sentences (see split_sentences), those outside
[--min_chars, --max_chars] are dropped and the rest re-joined; conversations are refused, since dropping
sentences from a turn corrupts the dialogue.
Then the record is dropped if it is empty, left with no sentence (--split sentences), outside
[--min_chars, --max_chars] (total characters after cleaning; not with --split sentences), an exact duplicate
(hash of the whitespace-collapsed text) or a near-duplicate (MinHash LSH over character shingles,
Jaccard >= --threshold) of an earlier kept record. The first occurrence is kept.

Memory is the duplicate index (a 16-byte hash, a signature and the LSH buckets per kept record), never the corpus.
The output is written to a temporary file and renamed into place; a report goes to stdout and <out>.report.json.
"""
from __future__ import annotations

import argparse
import functools
import hashlib
import html
import html.entities
import json
import re
import sys
import time
import unicodedata
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np
from datasketch import MinHash, MinHashLSH

from common.errors import ConfigError
from dataset.jsonl import DataError, SkipReport, check_path, iter_raw_lines, parse_line, read_records, write_atomic
from dataset.token_cache import GOLDEN_GAMMA, splitmix64

STEPS = ("html_tags", "html_entities", "unicode", "control_chars", "whitespace")
DROP_REASONS = ("bad_line", "empty_after_cleaning", "too_short", "too_long", "exact_duplicate", "near_duplicate")


@dataclass
class CleanOptions:
    """How clean_text rewrites a text."""

    unicode_form: str = "NFKC"  # "NFKC", "NFC" or "none"
    keep_cjk_punct: bool = True  # under NFKC, leave Chinese full-width punctuation (，！？…) as it is
    strip_html: bool = True
    max_blank_lines: int = 2

    def __post_init__(self) -> None:
        if self.unicode_form not in ("NFKC", "NFC", "none"):
            raise ValueError(f"unicode_form must be NFKC, NFC or none, got {self.unicode_form!r}")
        if self.max_blank_lines < 0:
            raise ValueError("max_blank_lines must be >= 0")


# ---------------------------------------------------------------------------------------------------- HTML
# Only names of real HTML elements count as tags: `<T>`, `<stdin>`, `<MyComponent />` and `<foo>_<bar>` are
# ordinary text in code and docs. Block elements become a line break so "one<br>two" does not glue words;
# inline ones vanish so "un<b>believ</b>able" stays one word.
_BLOCK_TAGS = frozenset("""
    address article aside blockquote body br caption center dd details dialog div dl dt fieldset figcaption
    figure footer form frame frameset h1 h2 h3 h4 h5 h6 head header hgroup hr html iframe legend li main menu
    nav noframes ol option p pre section select summary table tbody textarea tfoot thead title tr ul
""".split())
_CELL_TAGS = frozenset(("td", "th"))  # a cell boundary is a space: cells of a row stay on one line
_INLINE_TAGS = frozenset("""
    a abbr acronym area audio b base bdi bdo big button canvas cite code col colgroup data del dfn em embed
    font i img input ins kbd label link map mark meta nobr object param picture q rp rt ruby s samp small
    source span strike strong sub sup svg time track tt u var video wbr script style noscript
""".split())
# Tags that are HTML on their own, without a closing tag or an attribute to vouch for them.
_SELF_EVIDENT_TAGS = frozenset(("br", "p", "hr"))
_TAG_NAMES = "|".join(sorted(_BLOCK_TAGS | _CELL_TAGS | _INLINE_TAGS, key=len, reverse=True))
# An attribute is `name=value`, or a bare name only from HTML's boolean attributes: otherwise `if a<b and c>d`
# would read as the tag <b> with attributes "and" and "c".
_VALUE_ATTR = r"""\s+[A-Za-z_:@][-\w:.@]*\s*=\s*(?:"[^"]{0,4000}"|'[^']{0,4000}'|[^\s"'=<>`]{1,4000})"""
_BOOL_ATTR = (r"\s+(?:allowfullscreen|async|autofocus|autoplay|checked|controls|default|defer|disabled|hidden"
              r"|ismap|itemscope|loop|multiple|muted|nomodule|novalidate|nowrap|open|readonly|required"
              r"|reversed|selected)(?=[\s/>])")
# The spaces around a tag are part of the match so "foo <br> bar" becomes "foo\nbar", not "foo \n bar".
_TAG_RE = re.compile(
    rf"(?P<pre>[ \t]*)<(?P<close>/)?(?P<name>{_TAG_NAMES})(?![-\w])(?P<attrs>(?:{_VALUE_ATTR}|{_BOOL_ATTR})*)"
    rf"\s*(?P<self>/)?>(?P<post>[ \t]*)", re.IGNORECASE)
# Script and style bodies are code, never prose, so they go with their tags, as do comments.
_RAW_OPEN_RE = re.compile(r"<!--|<(script|style|noscript)(?![-\w])[^>]*>", re.IGNORECASE)
_RAW_CLOSE_RES = {name: re.compile(rf"</{name}\s*>", re.IGNORECASE) for name in ("script", "style", "noscript")}
_RAW_CLOSE_RES["!--"] = re.compile("-->")
_DOCTYPE_RE = re.compile(r"<!doctype\s[^<>]*>", re.IGNORECASE)
# Only `;`-terminated references: html.unescape also decodes legacy names without `;` by prefix, which turns
# "&notation" into "¬ation" and "?a=1&copy=2" into "?a=1©=2".
_ENTITY_RE = re.compile(r"&(?:#[0-9]{1,7}|#[xX][0-9a-fA-F]{1,6}|[A-Za-z][A-Za-z0-9]{1,31});")


def _remove_raw_blocks(text: str) -> str:
    """Drop comments and script/style/noscript blocks with their content; an unclosed one is left alone."""
    # A loop rather than one `<script>.*?</script>` regex: that rescans to the end of the text for every
    # unclosed opening tag, quadratic on a page with many of them.
    parts, pos, search_from, unclosed = [], 0, 0, set()
    while m := _RAW_OPEN_RE.search(text, search_from):
        name = (m[1] or "!--").lower()
        close = None if name in unclosed else _RAW_CLOSE_RES[name].search(text, m.end())
        if close is None:
            unclosed.add(name)  # no closing tag after this one, so none after any later one either
            search_from = m.end()
            continue
        parts.append(text[pos:m.start()])
        pos = search_from = close.end()
    parts.append(text[pos:])
    return "".join(parts)


def _is_html_evidence(m: re.Match) -> bool:
    return bool(m["close"] or m["self"] or "=" in m["attrs"] or m["name"].lower() in _SELF_EVIDENT_TAGS)


def _tag_replacement(m: re.Match) -> str:
    name = m["name"].lower()
    if name in _BLOCK_TAGS:
        return "\n"
    if name in _CELL_TAGS:
        return " "
    return m["pre"] + m["post"]  # an inline tag keeps the spacing around it: "a <b>bold</b> word"


def strip_html_tags(text: str) -> str:
    """Remove script/style blocks, comments and HTML tags (only where the text really contains HTML)."""
    if "<" not in text:
        return text
    text = _DOCTYPE_RE.sub("", _remove_raw_blocks(text))
    # One tag that could only be HTML licenses stripping the rest; a text whose only "tags" are bare
    # `<input>`/`<data>` is a usage line or a placeholder, not markup.
    if not any(_is_html_evidence(m) for m in _TAG_RE.finditer(text)):
        return text
    return _TAG_RE.sub(_tag_replacement, text)


def _decode_entity(m: re.Match) -> str:
    ref = m.group()
    if ref[1] == "#":
        return html.unescape(ref)  # numeric: html maps invalid code points (NUL, C1) the way browsers do
    return html.entities.html5.get(ref[1:], ref)  # unknown names (`&foo;`) stay as written


def unescape_entities(text: str) -> str:
    """Decode `;`-terminated HTML character references (`&amp;`, `&#39;`, `&#x4e2d;`)."""
    return _ENTITY_RE.sub(_decode_entity, text) if "&" in text else text


# ------------------------------------------------------------------------------------------------- Unicode
# NFKC rewrites Chinese full-width punctuation to ASCII (，→, ！→! …→...), so a model trained on the output writes
# Chinese with ASCII punctuation. By default the marks Chinese text actually uses are protected
# (--ascii_cjk_punct turns that off).
_CJK_PUNCT = "！（），：；？～…"
_CJK_PUNCT_SPLIT = re.compile(f"([{_CJK_PUNCT}]+)")


def normalize_unicode(text: str, form: str = "NFKC", keep_cjk_punct: bool = True) -> str:
    """Unicode-normalise text to `form` ("NFKC", "NFC" or "none")."""
    if form == "none" or unicodedata.is_normalized(form, text):
        return text
    if form == "NFKC" and keep_cjk_punct:
        # The protected marks are starters with no decomposition that combines with a neighbour, so
        # normalising the runs between them equals normalising the whole text, less those marks.
        parts = _CJK_PUNCT_SPLIT.split(text)
        return "".join(p if i % 2 else unicodedata.normalize(form, p) for i, p in enumerate(parts))
    return unicodedata.normalize(form, text)


# ------------------------------------------------------------------------------------- control characters
_KEEP_CONTROL = frozenset("\t\n\r\u200c\u200d")  # \r is turned into \n by the whitespace step, not deleted


@functools.lru_cache(maxsize=1)
def _control_re() -> re.Pattern:
    # Built from this Python's Unicode database rather than a hand list, so new format characters are covered.
    # Cc, Cf and Cs live only in planes 0, 1 and 14: scanning those (~150k code points, not 1.1M) is ~5x faster.
    ranges: list[list[int]] = []
    for cp in (*range(0x20000), *range(0xE0000, 0xF0000)):
        ch = chr(cp)
        if ch in _KEEP_CONTROL or unicodedata.category(ch) not in ("Cc", "Cf", "Cs"):
            continue
        if ranges and ranges[-1][1] == cp - 1:
            ranges[-1][1] = cp
        else:
            ranges.append([cp, cp])
    cls = "".join(f"\\U{a:08x}" if a == b else f"\\U{a:08x}-\\U{b:08x}" for a, b in ranges)
    return re.compile(f"[{cls}]+")


def remove_control_chars(text: str) -> str:
    """Drop control (Cc), format (Cf) and lone-surrogate characters, keeping \\t, \\n, \\r, ZWJ and ZWNJ."""
    # Vertical tab and form feed separate lines or pages; deleting them would glue two lines into one.
    text = text.replace("\x0b", "\n").replace("\x0c", "\n")
    return _control_re().sub("", text)


# ------------------------------------------------------------------------------------------------ whitespace
_TRAILING_WS_RE = re.compile(r"[^\S\n]+$", re.MULTILINE)


@functools.lru_cache(maxsize=8)
def _blank_run_re(max_blank_lines: int) -> re.Pattern:
    return re.compile("\n{%d,}" % (max_blank_lines + 2))


def tidy_whitespace(text: str, max_blank_lines: int = 2) -> str:
    """Normalise line ends, strip trailing spaces, cap runs of blank lines, trim blank lines at both ends."""
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\u2028", "\n").replace("\u2029", "\n\n")
    text = _TRAILING_WS_RE.sub("", text)
    # The default of 2 keeps PEP 8's two blank lines between top-level definitions in code samples.
    text = _blank_run_re(max_blank_lines).sub("\n" * (max_blank_lines + 1), text)
    # Leading spaces of the first line are kept: they may be code indentation.
    return text.lstrip("\n").rstrip()


def clean_text(text: str, opts: CleanOptions | None = None) -> tuple[str, list[str]]:
    """Run every cleaning step on one text; return the result and the names of the steps that changed it."""
    opts = opts or CleanOptions()
    changed: list[str] = []

    def step(name: str, new: str) -> str:
        if new != text:
            changed.append(name)
        return new

    # HTML first, so entity-decoded characters (&nbsp;, &#x200b;) still go through normalisation and the
    # control filter; decoding after tag stripping keeps an escaped "&lt;p&gt;" as the literal text "<p>".
    if opts.strip_html:
        text = step("html_tags", strip_html_tags(text))
        text = step("html_entities", unescape_entities(text))
    text = step("unicode", normalize_unicode(text, opts.unicode_form, opts.keep_cjk_punct))
    text = step("control_chars", remove_control_chars(text))
    text = step("whitespace", tidy_whitespace(text, opts.max_blank_lines))
    return text, changed


# ------------------------------------------------------------------------------------------------- sentences
SPLIT_MODES = ("none", "sentences")
# Words that end in "." without ending the sentence, written as they appear (matched case-sensitively, so the
# lower-case word "no." still ends "I said no."). A single capital letter ("J. K. Rowling") counts as an initial.
ABBREVIATIONS = frozenset("""
    Mr. Mrs. Ms. Dr. Prof. Rev. St. Mt. Jr. Sr. Gen. Col. Capt. Lt. Sgt. Gov. Sen.
    e.g. E.g. i.e. I.e. etc. vs. cf. al. approx. ca. Fig. No. Vol. pp. Ch. Eq.
    U.S. U.K. U.N. E.U. Inc. Ltd. Co. Corp. a.m. p.m.
""".split())
_CLOSERS = "\"'”’)）」』》】]"
_OPENERS = "\"'“‘(（「『《【["
_CJK_TERMINATORS = "。！？"
# A run of terminators ("?!", "...", "。”") with the closing quotes and brackets that belong to its sentence.
_TERMINATOR_RE = re.compile(rf"[.!?{_CJK_TERMINATORS}]+[{re.escape(_CLOSERS)}]*")
_CJK_CHAR_RE = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]")  # kana and ideographs


def _ends_sentence(line: str, m: re.Match) -> bool:
    """Whether the terminator run `m`, which has text after it on the line, ends a sentence."""
    punct = m[0].rstrip(_CLOSERS)
    if any(c in _CJK_TERMINATORS for c in punct):
        return True  # Chinese puts no space after 。！？
    after = line[m.end():]
    if not after[0].isspace():
        # "3.14", "e.g.", "example.com" go on; ASCII !/? right before Chinese is what --ascii_cjk_punct makes
        # of ！？, so it still ends the sentence.
        return punct[-1] in "!?" and bool(_CJK_CHAR_RE.match(after))
    if after.lstrip()[:1].islower():
        return False  # 'He asked "why?" and left', "approx. five": a lower-case word continues the sentence
    if punct == ".":
        words = line[max(0, m.start() - 64):m.start()].split()  # the word before it (not the whole line: O(n^2))
        word = words[-1].lstrip(_OPENERS) if words else ""
        if word + "." in ABBREVIATIONS or (len(word) == 1 and word.isupper()):
            return False
    return True


def _split_line(line: str) -> list[tuple[str, str]]:
    """(whitespace before, sentence) for each sentence of one line; the first whitespace is the indentation."""
    pieces, start = [], 0
    for m in _TERMINATOR_RE.finditer(line):
        if m.end() < len(line) and _ends_sentence(line, m):
            pieces.append(line[start:m.end()])
            start = m.end()
    pieces.append(line[start:])
    pairs = []
    for piece in pieces:
        body = piece.lstrip()
        if body.strip():
            pairs.append((piece[:len(piece) - len(body)], body.rstrip()))
    return pairs


def sentence_pieces(line: str) -> list[str]:
    """One line's sentences, each with the whitespace before it, so that joined they give the line back
    (trailing whitespace aside): for cutting a text at sentence ends without rewriting it."""
    return [space + sentence for space, sentence in _split_line(line)]


def split_sentences(text: str) -> list[str]:
    """Split a text into sentences (English and Chinese), each without the whitespace around it.

    Rules, applied to each line on its own (a newline always ends a sentence):
      - `.`, `!` or `?` (or a run of them: "?!", "...") ends a sentence when whitespace follows, unless the next
        word starts with a lower-case letter, or a lone `.` closes an abbreviation from ABBREVIATIONS
        ("e.g.", "Mr.", "U.S.") or a one-capital-letter initial ("J."). "3.14" and "example.com" never split,
        having no whitespace after the dot.
      - The Chinese terminators `。！？` end a sentence with or without whitespace after them; so do ASCII `!`/`?`
        directly followed by a CJK character (NFKC's rewrite of `！？`). The full-width `；` and `…` do not:
        like `;` in English they join clauses of one sentence.
      - Closing quotes and brackets right after a terminator (" ' ” ’ ) ） 」 』 》 】 ]) stay with its sentence.
    Limits: an abbreviation or a lone capital that really ends a sentence ("... and so on, etc. Then", "Plan B.
    Then") does not split, nor does a sentence whose successor starts in lower case; an unknown abbreviation
    followed by a capital ("Ave. Maria") does split. No language model is behind it: it serves a length filter.
    """
    return [sentence for line in text.split("\n") for _, sentence in _split_line(line)]


def filter_sentences(text: str, min_chars: int = 1, max_chars: int | None = None) -> tuple[str, Counter]:
    """Drop sentences shorter than min_chars or longer than max_chars and re-join the rest.

    Returns the new text and counts of sentences "kept", "too_short" and "too_long". Kept sentences of a line
    are joined with the whitespace that preceded each in the original (the line's indentation for the first);
    lines stay separate. A line left with no sentence is removed, along with the blank lines after it that would
    widen the gap it leaves, so "A\\n\\nB\\n\\nC" without B is "A\\n\\nC". A text that loses nothing is returned
    unchanged; one that loses everything is "".
    """
    counts: Counter = Counter()
    lines: list[str | None] = []  # None: a line every sentence of which was dropped
    for line in text.split("\n"):
        pairs = _split_line(line)
        if not pairs:
            lines.append("")  # a blank line: paragraph structure, kept
            continue
        kept: list[str] = []
        for gap, sentence in pairs:
            if len(sentence) < min_chars:
                verdict = "too_short"
            elif max_chars is not None and len(sentence) > max_chars:
                verdict = "too_long"
            else:
                verdict = "kept"
            counts[verdict] += 1
            if verdict == "kept":
                kept += [gap if kept else pairs[0][0], sentence]
        lines.append("".join(kept) if kept else None)
    if not counts["too_short"] and not counts["too_long"]:
        return text, counts
    out: list[str] = []
    removed_since_text = False
    for line in lines:
        if line is None:
            removed_since_text = True
        elif line:
            out.append(line)
            removed_since_text = False
        elif not (removed_since_text and (not out or not out[-1])):
            out.append(line)  # a blank line, unless it only widens the gap a removed line left
    while out and not out[-1]:
        out.pop()
    return "\n".join(out), counts


# ------------------------------------------------------------------------------------------------- records
def record_kind(record: dict[str, Any]) -> str:
    """"text" or "conversations", for a record that passed the shared reader's validation."""
    return "text" if "text" in record else "conversations"


def clean_record(record: dict[str, Any], opts: CleanOptions | None = None) -> tuple[dict[str, Any], set[str]]:
    """Clean a text or conversations record; other fields (of the record and of each turn) are kept."""
    if record_kind(record) == "text":
        text, changed = clean_text(record["text"], opts)
        return {**record, "text": text}, set(changed)
    steps: set[str] = set()
    turns = []
    for turn in record["conversations"]:
        content, changed = clean_text(turn["content"], opts)
        steps.update(changed)
        turns.append({**turn, "content": content})
    return {**record, "conversations": turns}, steps


def content_length(record: dict[str, Any]) -> int:
    """Characters of text, or of all turns' content together."""
    if record_kind(record) == "text":
        return len(record["text"])
    return sum(len(t["content"]) for t in record["conversations"])


def is_empty(record: dict[str, Any]) -> bool:
    """True for an empty text, or a conversation with an empty user or assistant turn (a blank question or
    answer teaches nothing; an empty system prompt is harmless)."""
    if record_kind(record) == "text":
        return not record["text"]
    return any(not t["content"] and t["role"] != "system" for t in record["conversations"])


def dedup_texts(record: dict[str, Any]) -> tuple[str, str]:
    """(exact key, shingle text) that duplicates are judged on, both whitespace-collapsed.

    For conversations the exact key carries the roles, while the shingle text is the turns' content only:
    role labels shared by every record would pad short chats with common shingles, making "Hi / Good" a
    near-duplicate of "Hi / Fine".
    """
    if record_kind(record) == "text":
        text = " ".join(record["text"].split())
        return text, text
    turns = record["conversations"]
    key = " ".join(" ".join(f"{t['role']}: {t['content']}" for t in turns).split())
    return key, " ".join(" ".join(t["content"] for t in turns).split())


# ------------------------------------------------------------------------------------------------- dedup

def shingle_hashes(text: str, shingle_size: int = 5) -> np.ndarray:
    """Sorted unique 32-bit hashes of the text's overlapping character n-grams (the whole text if shorter).

    Characters, not words, so Chinese (no spaces) shingles as well as English. Vectorised: a polynomial hash
    of each window over the code points, then a splitmix64 finalizer, top 32 bits.
    """
    cps = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32).astype(np.uint64)
    if cps.size == 0:
        return np.empty(0, dtype=np.uint32)
    k = min(shingle_size, cps.size)
    m = cps.size - k + 1
    h = np.zeros(m, dtype=np.uint64)
    for j in range(k):  # uint64 arithmetic wraps, i.e. works modulo 2**64
        h = h * GOLDEN_GAMMA + cps[j:j + m]
    return np.unique((splitmix64(h) >> np.uint64(32)).astype(np.uint32))


def _fmix32(h: np.ndarray) -> np.ndarray:
    # MurmurHash3's finalizer, which datasketch's "affine32" scheme applies to each input hash before permuting.
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> np.uint32(13))
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> np.uint32(16))


class Deduper:
    """Exact and near-duplicate detection over a stream: remembers hashes of the texts it has kept."""

    # A (shingles x num_perm) matrix is built per chunk; chunking caps it at ~8 MB for a long document.
    _CHUNK = 16384
    _BLOCK = 4096  # signatures are stored in blocks of this many rows

    def __init__(self, near_dedup: bool = True, shingle_size: int = 5, num_perm: int = 128,
                 threshold: float = 0.8, seed: int = 1) -> None:
        if shingle_size < 1:
            raise ValueError("shingle_size must be >= 1")
        if not 0.0 < threshold <= 1.0:
            raise ValueError("threshold must be in (0, 1]")
        if num_perm < 2:
            raise ValueError("num_perm must be >= 2")
        self.near_dedup = near_dedup
        self.shingle_size = shingle_size
        self.num_perm = num_perm
        self.threshold = threshold
        self.seed = seed
        self._exact: set[bytes] = set()
        self._count = 0
        if near_dedup:
            # datasketch's default weights (0.5, 0.5) pick 9 bands x 13 rows for t=0.8, which misses 7% of pairs
            # at Jaccard 0.9 and 31% at 0.85. Every candidate is verified below against its stored signature,
            # so false positives only cost a comparison: weight recall (14 x 9: 99.9% at 0.9, 97.5% at 0.85).
            self._lsh = MinHashLSH(threshold=threshold, num_perm=num_perm, weights=(0.1, 0.9))
            self._perms = MinHash(num_perm=num_perm, seed=seed, scheme="affine32").permutations
            self._blocks: list[np.ndarray] = []

    def __len__(self) -> int:
        """Number of texts kept (remembered)."""
        return self._count

    def minhash(self, text: str) -> MinHash:
        """MinHash of the casefolded text's character shingles.

        Equal to MinHash(..., scheme="affine32").update_batch(shingle hashes) with an identity hashfunc (a test
        checks this), computed in numpy: update_batch calls the hash function once per shingle in Python,
        which was half of the run time.
        """
        a, b = self._perms
        sig = np.full(self.num_perm, np.iinfo(np.uint32).max, dtype=np.uint32)
        hv = _fmix32(shingle_hashes(text.casefold(), self.shingle_size))
        for start in range(0, hv.size, self._CHUNK):
            phv = hv[start:start + self._CHUNK, None] * a + b  # uint32 wraparound is the mod 2**32
            np.minimum(sig, phv.min(axis=0), out=sig)
        return MinHash(num_perm=self.num_perm, seed=self.seed, hashvalues=sig, permutations=self._perms,
                       scheme="affine32")

    def _signature(self, key: int) -> np.ndarray:
        return self._blocks[key // self._BLOCK][key % self._BLOCK]

    def _store(self, m: MinHash) -> int:
        key = self._count
        if key % self._BLOCK == 0:
            self._blocks.append(np.empty((self._BLOCK, self.num_perm), dtype=m.hashvalues.dtype))
        self._blocks[-1][key % self._BLOCK] = m.hashvalues
        return key

    def check(self, text: str, shingle_text: str | None = None) -> str | None:
        """Return "exact_duplicate" or "near_duplicate" for a text like one kept before; else remember it, None.

        `text` is hashed for exact matches, `shingle_text` (default: `text`) compared for near ones,
        case-insensitively; both should already be normalised (see dedup_texts).
        """
        digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()
        if digest in self._exact:
            return "exact_duplicate"
        if self.near_dedup:
            m = self.minhash(text if shingle_text is None else shingle_text)
            for key in self._lsh.query(m):
                # LSH returns anything sharing a band; keep only pairs whose estimated Jaccard meets the threshold.
                if np.count_nonzero(self._signature(key) == m.hashvalues) >= self.threshold * self.num_perm:
                    return "near_duplicate"
            key = self._store(m)
            self._lsh.insert(key, m, check_duplication=False)
        self._exact.add(digest)
        self._count += 1
        return None


# ------------------------------------------------------------------------------------------------- pipeline
@dataclass
class CleanStats:
    """Counters for the report."""

    records: int = 0
    kept: int = 0
    dropped: Counter = field(default_factory=Counter)
    modified: Counter = field(default_factory=Counter)
    chars_in: int = 0
    chars_out: int = 0
    # --split sentences: sentences "kept", "too_short", "too_long"; documents that lost some but not all
    # (documents that lost all are dropped["no_sentences_left"]).
    sentences: Counter = field(default_factory=Counter)
    documents_trimmed: int = 0


def _sentence_split_refused() -> ConfigError:
    return ConfigError('--split sentences applies to {"text"} records only: dropping sentences from conversation '
                       "turns would corrupt the dialogues (clean SFT data without --split)")


def clean_records(records: Iterable[tuple[int, dict[str, Any]]], opts: CleanOptions, deduper: Deduper | None,
                  min_chars: int = 1, max_chars: int | None = None,
                  stats: CleanStats | None = None, split: str = "none") -> Iterator[dict[str, Any]]:
    """Clean, filter and deduplicate (line number, record) pairs; yield the kept records, counting into stats.

    With split="none" min_chars/max_chars bound each record's length; with split="sentences" they bound each
    sentence instead (see filter_sentences) and a text left with no sentence is dropped as "no_sentences_left".
    Conversations cannot be split into sentences: ConfigError.
    """
    if split not in SPLIT_MODES:
        raise ConfigError(f"split must be one of {', '.join(SPLIT_MODES)}, got {split!r}")
    by_sentence = split == "sentences"
    stats = stats if stats is not None else CleanStats()
    for _, record in records:
        stats.records += 1
        stats.chars_in += content_length(record)
        cleaned, steps = clean_record(record, opts)
        stats.modified.update(steps)
        emptied = False
        if by_sentence and record_kind(cleaned) != "text":
            raise _sentence_split_refused()
        if by_sentence and cleaned["text"]:
            text, counts = filter_sentences(cleaned["text"], min_chars, max_chars)
            stats.sentences.update(counts)
            emptied = not text
            if text and text != cleaned["text"]:
                stats.documents_trimmed += 1
            cleaned = {**cleaned, "text": text}
        n = content_length(cleaned)
        # Length before dedup, so a rejected record never occupies the duplicate index.
        if is_empty(cleaned):
            reason = "no_sentences_left" if emptied else "empty_after_cleaning"
        elif not by_sentence and n < min_chars:
            reason = "too_short"
        elif not by_sentence and max_chars is not None and n > max_chars:
            reason = "too_long"
        else:
            reason = deduper.check(*dedup_texts(cleaned)) if deduper is not None else None
        if reason:
            stats.dropped[reason] += 1
            continue
        stats.kept += 1
        stats.chars_out += n
        yield cleaned


def detect_kind(path: str | Path, max_lines: int = 1000) -> str:
    """"text" or "conversations" from the first valid record among the first lines; "any" if none is valid."""
    for i, (_, raw) in enumerate(iter_raw_lines(path)):
        if i >= max_lines:
            break
        try:
            return record_kind(parse_line(raw, "any"))
        except ValueError:
            continue
    return "any"  # let read_records report the bad lines in its usual way


def _dump(record: dict[str, Any]) -> bytes:
    try:
        return (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate in a field we do not clean: \u-escape it, still valid JSON
        return (json.dumps(record, ensure_ascii=True) + "\n").encode("ascii")


def clean_file(data_path: str | Path, out: str | Path, kind: str = "auto", skip_bad_lines: bool = False,
               opts: CleanOptions | None = None, near_dedup: bool = True, shingle_size: int = 5,
               num_perm: int = 128, threshold: float = 0.8, seed: int = 1, min_chars: int = 1,
               max_chars: int | None = None, progress_s: float = 10.0, split: str = "none") -> dict[str, Any]:
    """Clean data_path into out (atomically) and write <out>.report.json; return the report.

    Raises DataError for bad input, ConfigError for split="sentences" on conversations.
    """
    opts = opts or CleanOptions()
    data_path, out = check_path(data_path), Path(out)
    if out.is_dir():
        raise DataError(f"{out}: is a directory, expected an output .jsonl path")
    input_bytes = data_path.stat().st_size
    detected = detect_kind(data_path) if kind == "auto" else kind
    if split == "sentences" and detected == "conversations":
        raise _sentence_split_refused()  # before writing anything; clean_records checks each record as well
    deduper = Deduper(near_dedup, shingle_size, num_perm, threshold, seed)
    skips, stats = SkipReport(), CleanStats()
    start = last = time.perf_counter()

    def lines() -> Iterator[bytes]:
        nonlocal last
        records = read_records(data_path, detected, skip_bad_lines=skip_bad_lines, report=skips)
        for record in clean_records(records, opts, deduper, min_chars, max_chars, stats, split):
            yield _dump(record)
            now = time.perf_counter()
            if now - last > progress_s:  # long runs should not look hung
                last = now
                print(f"... {stats.records:,} records, kept {stats.kept:,} ({now - start:.0f} s)", file=sys.stderr)

    write_atomic(out, lines())
    elapsed = time.perf_counter() - start
    reasons = DROP_REASONS
    if split == "sentences":  # only then, so the report of a run without --split keeps its old shape
        at = DROP_REASONS.index("too_long") + 1
        reasons = (*DROP_REASONS[:at], "no_sentences_left", *DROP_REASONS[at:])
    dropped = {r: stats.dropped.get(r, 0) for r in reasons}
    dropped["bad_line"] = skips.total
    report = {
        "input": str(data_path),
        "output": str(out),
        "kind": detected,
        # Non-blank lines: records read plus bad lines skipped (the reader ignores blank lines).
        "input_lines": stats.records + skips.total,
        "kept": stats.kept,
        "dropped_total": sum(dropped.values()),
        "dropped": dropped,
        "bad_line_reasons": dict(skips.counts),
        "bad_line_examples": list(skips.examples),
        # Records changed by each step, counted over all valid input records (including ones dropped later).
        "modified": {s: stats.modified.get(s, 0) for s in STEPS},
        "chars_in": stats.chars_in,
        "chars_out": stats.chars_out,
        "input_bytes": input_bytes,
        "elapsed_s": round(elapsed, 3),
        "records_per_s": round((stats.records + skips.total) / elapsed, 1) if elapsed > 0 else None,
        "mb_per_s": round(input_bytes / 1e6 / elapsed, 3) if elapsed > 0 else None,
        "options": {**asdict(opts), "near_dedup": near_dedup, "shingle_size": shingle_size,
                    "num_perm": num_perm, "threshold": threshold, "seed": seed, "min_chars": min_chars,
                    "max_chars": max_chars, "split": split, "skip_bad_lines": skip_bad_lines},
    }
    if split == "sentences":
        # Counted over every record that reached the filter, including ones later dropped as duplicates.
        report["sentence_filter"] = {
            "sentences_in": sum(stats.sentences.values()),
            "sentences_kept": stats.sentences["kept"],
            "sentences_dropped": {r: stats.sentences[r] for r in ("too_short", "too_long")},
            "documents_trimmed": stats.documents_trimmed,
            "documents_emptied": stats.dropped["no_sentences_left"],
        }
    if near_dedup:
        report["options"]["lsh_bands_rows"] = [deduper._lsh.b, deduper._lsh.r]
    write_atomic(report_path(out), json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    return report


def report_path(out: str | Path) -> Path:
    """Where clean_file writes the JSON report for output `out`."""
    out = Path(out)
    return out.with_name(out.name + ".report.json")


def format_report(report: dict[str, Any]) -> str:
    """The report as a few human-readable lines."""
    n = report["input_lines"]
    pct = (lambda k: f"{100 * k / n:.1f}%") if n else (lambda k: "-")
    rows = [f"cleaned {report['input']} -> {report['output']} ({report['kind']} records)",
            f"  input lines   {n:>10,}",
            f"  kept          {report['kept']:>10,}  {pct(report['kept'])}",
            f"  dropped       {report['dropped_total']:>10,}  {pct(report['dropped_total'])}"]
    rows += [f"    {r:<22}{k:>8,}" for r, k in report["dropped"].items()]
    rows.append("  modified: " + ", ".join(f"{s} {k:,}" for s, k in report["modified"].items()))
    if "sentence_filter" in report:
        sf = report["sentence_filter"]
        rows.append(f"  sentences {sf['sentences_in']:,} -> {sf['sentences_kept']:,} (dropped: "
                    + ", ".join(f"{r} {k:,}" for r, k in sf["sentences_dropped"].items())
                    + f"); documents trimmed {sf['documents_trimmed']:,}, emptied {sf['documents_emptied']:,}")
    rows.append(f"  chars {report['chars_in']:,} -> {report['chars_out']:,}")
    if report["bad_line_examples"]:
        rows.append("  bad lines: " + "; ".join(report["bad_line_examples"]))
    rows.append(f"  {report['elapsed_s']:.2f} s, {report['records_per_s'] or 0:,.0f} records/s, "
                f"{report['mb_per_s'] or 0:.2f} MB/s")
    rows.append(f"  report: {report_path(report['output'])}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dataset.clean", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data_path", required=True, help="input .jsonl with {'text'} or {'conversations'} records")
    p.add_argument("--out", required=True, help="output .jsonl; the report goes to <out>.report.json")
    p.add_argument("--kind", choices=("auto", "text", "conversations"), default="auto",
                   help="record kind; auto detects it from the file's first valid record")
    p.add_argument("--skip_bad_lines", action="store_true", help="skip and count malformed lines")
    p.add_argument("--unicode_form", choices=("NFKC", "NFC", "none"), default="NFKC")
    p.add_argument("--ascii_cjk_punct", action="store_true",
                   help=f"let NFKC turn Chinese full-width punctuation ({_CJK_PUNCT}) into ASCII (kept by default)")
    p.add_argument("--no_strip_html", action="store_true", help="leave HTML tags and entities alone")
    p.add_argument("--max_blank_lines", type=int, default=2, help="longer runs of blank lines are cut to this")
    p.add_argument("--min_chars", type=int, default=1,
                   help="drop records (with --split sentences: sentences) shorter than this after cleaning")
    p.add_argument("--max_chars", type=int, default=None,
                   help="drop records (with --split sentences: sentences) longer than this after cleaning")
    p.add_argument("--split", choices=SPLIT_MODES, default="none",
                   help="sentences: apply --min_chars/--max_chars to each sentence of a {'text'} record and "
                        "re-join the rest (refused for conversations)")
    p.add_argument("--no_near_dedup", action="store_true", help="exact deduplication only")
    p.add_argument("--shingle_size", type=int, default=5, help="characters per MinHash shingle")
    p.add_argument("--num_perm", type=int, default=128, help="MinHash permutations")
    p.add_argument("--threshold", type=float, default=0.8, help="Jaccard similarity that counts as duplicate")
    p.add_argument("--seed", type=int, default=1, help="MinHash permutation seed")
    args = p.parse_args(argv)
    if args.min_chars < 0 or (args.max_chars is not None and args.max_chars < args.min_chars):
        p.error("need 0 <= --min_chars <= --max_chars")
    if args.max_blank_lines < 0:
        p.error("--max_blank_lines must be >= 0")
    if args.shingle_size < 1 or args.num_perm < 2 or not 0.0 < args.threshold <= 1.0:
        p.error("need --shingle_size >= 1, --num_perm >= 2 and 0 < --threshold <= 1")

    opts = CleanOptions(args.unicode_form, not args.ascii_cjk_punct, not args.no_strip_html, args.max_blank_lines)
    return report_or_error(lambda: clean_file(args.data_path, args.out, args.kind, args.skip_bad_lines, opts,
                                              not args.no_near_dedup, args.shingle_size, args.num_perm,
                                              args.threshold, args.seed, args.min_chars, args.max_chars,
                                              split=args.split),
                           args.out, format_report)


def report_or_error(run: Callable[[], dict[str, Any]], out: str, describe: Callable[[dict[str, Any]], str]) -> int:
    """A data command's ending: its report described on stdout (exit 0), or one `error:` line on stderr (exit 2
    for bad input or settings, 1 when the file system fails, naming the file)."""
    try:
        report = run()
    except (ConfigError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        where = e.filename or out  # the output, when the error names no file
        print(f"error: {where}: {e.strerror or e}" if where else f"error: {e.strerror or e}", file=sys.stderr)
        return 1
    # a file name that is not UTF-8 holds surrogates, which stdout cannot encode: shown escaped, as stderr shows them
    print(describe(report).encode("utf-8", "backslashreplace").decode("utf-8"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
