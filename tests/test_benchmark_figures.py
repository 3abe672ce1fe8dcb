"""Every figure in docs/benchmarks.md comes from a source that its section cites.

The page is read section by section: the text under each heading (the part above the first ``##`` included), up to
the next heading. A section cites its sources by naming them anywhere in its text:

- a results file or folder under ``bench/results/`` (``bench/results/x.json``; ``bench/results/learning/demo/``:
  every file in it); ``bench/results/`` alone and templates (``tasks-<task>-<cores>core.json``) cite nothing;
- an entry of ``dev/LOG.md``, by a link to its heading (``../dev/LOG.md#2026-12-05--...``): that entry's text
  alone, not the whole log.

Every numeral in the section's prose and tables is a figure; code (inline and fenced: commands, flags, paths) and
identifiers with digits in them (``mini-30m``, ``d256``, ``avx512_bf16``) are not prose. A figure passes when a
cited source holds it at the precision the page shows (103.43 quoted as 103.4), in the figure's unit:

- a figure's unit is the one written after it, or, in a table, the one its column's header names (a tokens/s
  column); a figure without one is a count or a plain ratio;
- a JSON field's unit is its key's: ``*_s`` and ``seconds`` are seconds (0.1318 backs 131.8 ms, 727.7 backs
  12 min), ``*_per_s`` a rate, ``*_gb``/``*_mb`` a size, ``*_ms``/``*_us`` what they say; other fields are plain
  (counts, fractions, ratios), and back a figure without a unit, a ratio (×) or a percentage (0.272 backs 27%);
- a number written in text (Markdown, the log, a string in a JSON file) has the unit written after it: 3.6 ms in
  the log backs 3.6 ms, not 3.6 s; any written number backs a figure without a unit.

A ratio (×) or a percentage may also be computed from a JSON file, from two times or two rates: one field of two
records that differ in one setting (bf16 against fp32 tokens/s of one preset, as a ratio, a share or a change
|a / b - 1|), or two numbers of one record in the same unit (a run's wall time over its budget, as a ratio or a
share). Text backs figures directly only: a paragraph holds too many numbers for their ratios to prove anything.

Numbers that do not report a measurement are left out before the check; that allowlist (``SETTINGS``) is a short
list of patterns, each a kind of number that a reader sets, or that names or bounds something:

- the machine and software: ``2-core``, ``2 cores``, ``1 torch thread``, ``PyTorch 2.13``, ``Zen 4``; dates;
- model sizes in parameters (``26M``, ``4.6M``): a preset's, which its shape fixes (``python -m model``);
- the shape of a run as given to it: ``batch 8 × 256``, ``16 × 256``, ``32-token``/``32-row``/``10-minute``
  sizes, ``fastest of 3``, ``median of 15``, ``blocks of 256``, time limits (``420 s budget``,
  ``killed 10 s after``);
- goals and bounds, which say what a measurement must meet, not what it was: ``at least 98%``, ``at most 2%``,
  ``≤ 3%``, ``under 1%``, ``inside 8 minutes``, ``the goal is 90-105%``, ``20 pages/s or more``.

A measured value never goes in that list: it goes in a results file (or the log), and the section cites it. A
number in a section that cites nothing, and is not in that list, fails.
"""
from __future__ import annotations

import itertools
import json
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "benchmarks.md"
RESULTS = ROOT / "bench" / "results"
LOG = ROOT / "dev" / "LOG.md"

# Numbers that are settings, names or bounds, not measurements (see the module docstring): (pattern, what it is).
SETTINGS: list[tuple[str, str]] = [
    (r"\b\d{4}-\d{2}-\d{2}\b", "a date"),
    (r"\b\d+-core\b|\b\d+ cores?\b|\b\d+ (?:torch )?threads?\b", "the machine's cores and threads"),
    (r"\b(?:PyTorch|Python|torch|Zen) \d+(?:\.\d+)*", "a software version or a CPU's generation"),
    (r"(?<![\w.,])\d+(?:\.\d+)?M\b", "a model's size in parameters"),
    (r"\b\d+-(?=[a-z])", "a size given to a run: a 32-token prompt, a 10-minute check"),
    (r"\bbatch(?: size)? \d+(?: × \d[\d,]*)?\b|\b\d[\d,]* × \d[\d,]*\b", "a batch's shape: batch 8 × 256"),
    (r"\b(?:fastest|best|median) of \d+\b|\bblocks of \d+\b", "how a run is repeated or batched"),
    (r"\b\d+ s budget\b|\bkilled \d+ s after\b", "a time limit given to a run"),
    (r"(?:[≤≥]|\bat least|\bat most|\bunder|\binside|\bgoal is) ?[\d.,]+(?:[-–][\d.,]+)?", "a goal or a bound"),
    (r"\b[\d.,]+ ?\S+ or more\b", "a goal or a bound"),
]
NUMBER = re.compile(r"(?<![\w.,/])(?<![A-Za-z_]-)(\d{1,3}(?:,\d{3})+|\d+)(?:\.(\d+))?(?:e(-?\d+))?")
UNIT = r"\s?(%|×|x\b|ms\b|µs\b|us\b|s\b|min\b|minutes\b|k\b|[A-Za-z]+/s\b|MB\b|GB\b|GiB\b)"
SAME_UNIT = {"x": "×", "us": "µs", "minutes": "min"}
# A figure's unit -> the JSON fields that may back it: (the field's unit, by its key; the scale from it to the page).
FIELDS: dict[str, list[tuple[str, float]]] = {
    "s": [("s", 1), ("ms", 1e-3)], "ms": [("s", 1e3), ("ms", 1)], "µs": [("s", 1e6), ("µs", 1)],
    "min": [("s", 1 / 60)], "rate": [("rate", 1)], "size": [("size", 1)], "%": [("", 100)], "×": [("", 1)],
    "k": [("", 1e-3), ("rate", 1e-3)],
}
RATIOS = {"×", "%"}
MEASURED = {"s", "rate"}  # the units whose ratios are figures: times and rates
CITED_FILE = re.compile(r"bench/results/[\w./<>-]*[\w/>]")
CITED_LOG_ENTRY = re.compile(r"dev/LOG\.md#([\w-]+)")


@dataclass(frozen=True)
class Figure:
    """A number as the page shows it: its text, value, last digit shown (0.01 for 0.58, 1e-05 for 3e-5), unit
    (normalised) and line."""
    text: str
    value: float
    step: float
    unit: str
    line: str


@dataclass(frozen=True)
class Number:
    """A number of a source: its value and unit, and whether it was written in text (its unit as written) or is a
    JSON field (its unit from the key)."""
    value: float
    unit: str
    written: bool


@dataclass
class Record:
    """A JSON object: its settings (its string and boolean fields, and its name in its parent), its numeric fields
    by key, and the numbers written in its strings."""
    settings: dict[str, object]
    fields: dict[str, Number]
    written: list[Number]


@dataclass
class Source:
    """A cited source: its numbers, and (JSON) its records, whose ratios may back a figure."""
    name: str
    numbers: list[Number]
    records: list[Record]


def normal_unit(unit: str) -> str:
    """One spelling per unit (x is ×, us is µs); every rate (tokens/s, MB/s) is "rate", every size "size"."""
    if unit.endswith("/s"):
        return "rate"
    if unit in {"MB", "GB", "GiB"}:
        return "size"
    return SAME_UNIT.get(unit, unit)


def key_unit(key: str) -> str:
    """A JSON field's unit, read from its key: tokens_per_s a rate, wall_s seconds, peak_mem_gb a size..."""
    key = key.lower()
    for unit, pattern in (("rate", r"(^|_)per_s($|_)"), ("µs", r"(^|_)us($|_)"), ("ms", r"(^|_)ms($|_)"),
                          ("s", r"(^|_)s($|_)|seconds"), ("size", r"(^|_)(gb|mb|gib)($|_)")):
        if re.search(pattern, key):
            return unit
    return ""


def strip_code(text: str) -> str:
    """The text with fenced blocks, inline code and link targets taken out."""
    text = re.sub(r"^(```|~~~).*?^\1[^\n]*$", "", text, flags=re.S | re.M)
    text = re.sub(r"(`+)([^`]+?)\1", " ", text)
    return re.sub(r"\]\([^)]*\)", "]", text)


def sections(page: str) -> list[tuple[str, str]]:
    """(heading, text) of each section: the text under a heading (not one inside a code fence), up to the next
    heading of any level."""
    out: list[tuple[str, list[str]]] = []
    fence = ""
    for line in page.splitlines():
        marker = re.match(r"\s*(```|~~~)", line)
        if marker and (not fence or marker.group(1) == fence):
            fence = "" if fence else marker.group(1)
        if not fence and re.match(r"#{1,6} ", line):
            out.append((line.lstrip("#").strip(), []))
        elif out:
            out[-1][1].append(line)
    return [(heading, "\n".join(body)) for heading, body in out if "".join(body).strip()]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading (as tests/test_readme.py computes it)."""
    text = heading.replace("`", "").replace("*", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def log_entries() -> dict[str, str]:
    """The entries of dev/LOG.md by their anchors."""
    return {slug(heading): body for heading, body in sections(LOG.read_text(encoding="utf-8"))}


def parse_number(match: re.Match[str]) -> float:
    """The value of a NUMBER match (thousands separators and exponents allowed)."""
    value = float(match.group(1).replace(",", "") + (f".{match.group(2)}" if match.group(2) else ""))
    return value * 10 ** int(match.group(3)) if match.group(3) else value


def last_digit(match: re.Match[str]) -> float:
    """The place of a NUMBER match's last digit: 0.01 for 0.58, 1 for 1,987, 1e-05 for 3e-5."""
    return 10.0 ** (int(match.group(3) or 0) - len(match.group(2) or ""))


def written_numbers(text: str) -> list[Number]:
    """Every number written in a piece of text, with the unit written after it (the second's, for a range)."""
    out = []
    for m in NUMBER.finditer(text):
        unit = re.match(r"(?:[-–]\d[\d,.]*)?" + UNIT, text[m.end():])
        out.append(Number(parse_number(m), normal_unit(unit.group(1)) if unit else "", True))
    return out


def json_records(data: object) -> tuple[list[Number], list[Record]]:
    """(numbers, records) of a JSON document. A list of numbers holds repeats of one measurement: they back
    figures, but are no record's fields."""
    numbers: list[Number] = []
    records: list[Record] = []

    def walk(node: object, name: str) -> None:
        if isinstance(node, list):
            for item in node:
                walk(item, name)
            numbers.extend(Number(float(x), key_unit(name), False) for x in node if is_number(x))
            numbers.extend(n for x in node if isinstance(x, str) for n in written_numbers(x))
            return
        if not isinstance(node, dict):
            return
        record = Record({"": name}, {}, [])
        for key, value in node.items():
            if is_number(value):
                record.fields[key] = Number(float(value), key_unit(key), False)
            elif isinstance(value, (str, bool)):
                record.settings[key] = value
                record.written.extend(written_numbers(value) if isinstance(value, str) else [])
            else:
                walk(value, key)
        numbers.extend([*record.fields.values(), *record.written])
        records.append(record)

    walk(data, "")
    return numbers, records


def is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def read_source(path: Path) -> Source:
    """A results file's numbers: JSON (and JSON lines) by field, key and record; any other file as text."""
    text = path.read_text(encoding="utf-8")
    name = str(path.relative_to(ROOT))
    if path.suffix == ".json":
        return Source(name, *json_records(json.loads(text)))
    if path.suffix == ".jsonl":
        return Source(name, *json_records([json.loads(line) for line in text.splitlines() if line.strip()]))
    return Source(name, written_numbers(text), [])


def cited_sources(text: str) -> list[Source]:
    """The sources a section cites: results files and folders under bench/results/, and dev/LOG.md entries."""
    out = []
    for cited in sorted(set(CITED_FILE.findall(text))):
        path = ROOT / cited
        if path.resolve() == RESULTS.resolve() or "<" in cited:
            continue
        assert path.exists(), f"cited, but there is no {cited}"
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix != ".png") if path.is_dir() else [path]
        out.extend(read_source(p) for p in files)
    entries = log_entries()
    for anchor in sorted(set(CITED_LOG_ENTRY.findall(text))):
        assert anchor in entries, f"cited, but dev/LOG.md has no entry #{anchor}"
        out.append(Source(f"dev/LOG.md#{anchor}", written_numbers(entries[anchor]), []))
    return out


def is_separator(line: str) -> bool:
    """Whether a line is blank or a table's separator row (|---|--:|)."""
    return re.fullmatch(r"\s*\|?[\s|:-]*", line) is not None


def cells(line: str) -> list[str]:
    """A line's table cells; a line of prose is one cell."""
    return line.strip().strip("|").split("|") if line.lstrip().startswith("|") else [line]


def column_units(header: str) -> list[str]:
    """The unit each column of a table states in its header (tokens/s: a rate), or ""."""
    return [normal_unit(m.group()) if (m := re.search(r"[A-Za-z]+/s\b", cell)) else "" for cell in cells(header)]


def figures(text: str) -> list[Figure]:
    """The figures of a section's prose and tables: every number outside code, settings and names. A number in a
    table cell without a unit of its own takes its column's (a tokens/s column's 13,418 is a rate)."""
    out = []
    lines = strip_code(text).splitlines()
    units: list[str] = []
    for i, line in enumerate(lines):
        if is_separator(line):
            continue
        if i + 1 < len(lines) and line.lstrip().startswith("|") and re.fullmatch(r"\s*\|[\s|:-]*", lines[i + 1]):
            units = column_units(line)
        for pattern, _ in SETTINGS:
            line = re.sub(pattern, lambda m: " " * len(m.group()), line)
        for column, cell in enumerate(cells(line)):
            default = units[column] if line.lstrip().startswith("|") and column < len(units) else ""
            for m, number in zip(NUMBER.finditer(cell), written_numbers(cell)):
                out.append(Figure(m.group(), number.value, last_digit(m), number.unit or default, line.strip()))
    return out


def rounds_to(candidate: float, figure: Figure) -> bool:
    """Whether a source's number, written to the figure's last digit, is the figure."""
    return abs(candidate - figure.value) <= 0.5 * figure.step + 1e-9 * max(1.0, abs(figure.value))


def readings(figure: Figure, number: Number) -> list[float]:
    """What a source's number reads as in the figure's unit (none when the units differ)."""
    if number.written:
        return [number.value] if not figure.unit or figure.unit == number.unit else []
    return [number.value * scale for unit, scale in FIELDS.get(figure.unit, [("", 1)]) if unit == number.unit]


def comparable(a: Record, b: Record) -> bool:
    """Whether two records are one comparison: the same fields and settings, one setting's value different
    (bf16 against fp32 of one preset; a dict's "cached" against its "recomputed")."""
    if a.settings.keys() != b.settings.keys() or a.fields.keys() != b.fields.keys():
        return False
    return sum(a.settings[k] != b.settings[k] for k in a.settings) == 1


def ratios(source: Source) -> tuple[list[float], list[float]]:
    """(a / b of one measured field, a time or a rate, in two comparable records; a / b of two numbers of one
    record in one unit, a time or a rate)."""
    across = [a.fields[k].value / b.fields[k].value for a, b in itertools.permutations(source.records, 2)
              if comparable(a, b) for k in a.fields if a.fields[k].unit in MEASURED and b.fields[k].value]
    within = [x.value / y.value for record in source.records
              for x, y in itertools.permutations([*record.fields.values(), *record.written], 2)
              if x.unit == y.unit and x.unit in MEASURED and y.value]
    return across, within


def computed(figure: Figure, sources: list[Source]) -> list[float]:
    """The ratios and percentages the sources' records give, for a figure shown as a ratio or a percentage: a
    percentage as a share (a / b) or, across records, as a change (|a / b - 1|)."""
    if figure.unit not in RATIOS:
        return []
    pairs = [ratios(source) for source in sources]
    across = [r for source_across, _ in pairs for r in source_across]
    within = [r for _, source_within in pairs for r in source_within]
    if figure.unit == "×":
        return across + within
    return [r * 100 for r in across + within] + [abs(r - 1) * 100 for r in across]


def backed(figure: Figure, sources: list[Source]) -> bool:
    """Whether a cited source holds the figure in its unit, or a ratio of two of its JSON numbers gives it."""
    held = (value for source in sources for number in source.numbers for value in readings(figure, number))
    return any(rounds_to(v, figure) for v in held) or any(rounds_to(v, figure) for v in computed(figure, sources))


def unbacked(text: str) -> list[str]:
    """The figures of a section that none of its cited sources backs, as 'figure [unit] in: line'."""
    sources = cited_sources(text)
    return [f"{f.text} [{f.unit}] in: {f.line[:100]}" for f in figures(text) if not backed(f, sources)]


PAGE_SECTIONS = sections(PAGE.read_text(encoding="utf-8"))


@pytest.mark.parametrize("heading,text", PAGE_SECTIONS, ids=[heading for heading, _ in PAGE_SECTIONS])
def test_every_figure_is_backed_by_a_cited_source(heading: str, text: str) -> None:
    assert unbacked(text) == []


def test_an_invented_or_uncited_figure_fails() -> None:
    cited = "(`bench/results/generate-cpu-2core.json`)"
    assert unbacked(f"KV cache 103.4 tokens/s, no cache 34.6 tokens/s (3.0× slower), 1.03× {cited}") == []
    flagged = unbacked(f"KV cache 113.4 tokens/s, 103.4 s, agree to 3e-5 {cited}")  # invented; wrong unit
    assert [f.split(" in:")[0] for f in flagged] == ["113.4 [rate]", "103.4 [s]", "3e-5 []"]
    assert [f.split(" in:")[0] for f in unbacked("KV cache 103.4 tokens/s, on 2 cores")] == ["103.4 [rate]"]


def test_settings_are_not_figures() -> None:
    assert figures("On a 2-core EPYC, PyTorch 2.13, batch 8 × 256, 26M, the goal is 90-105%, `--steps 30`") == []
