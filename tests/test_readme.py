"""The front pages (README.md, README_zh.md) and the reference in docs/: a short English front page, relative
links and #anchors that resolve, no docs page that nothing links to, commands that exist with the flags they
show, and the same commands on both front pages. Reads Markdown only; nothing is trained."""
from __future__ import annotations

import re
import shlex
from functools import lru_cache
from pathlib import Path

import pytest
from test_docs import ENTRY_POINTS, EXTERNAL, flags_of

from conftest import ROOT

README = ROOT / "README.md"
README_ZH = ROOT / "README_zh.md"
FRONT_PAGES = [README, README_ZH]
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [*FRONT_PAGES, *DOCS]
MAX_FRONT_PAGE_LINES = 250
# Programs whose command lines are checked: ours run by python (the environment's, or .venv's by its path), by a
# launcher or by a shell, and make targets; a command may start with VAR=value settings.
ENV_SETTINGS = r"(?:[A-Z_][A-Z0-9_]*=\S*\s+)*"
PYTHONS = {"python", "python3", ".venv/bin/python"}
COMMAND_START = re.compile(rf"^{ENV_SETTINGS}(python3?|\.venv/bin/python|torchrun|deepspeed|make|bash|sh)\s")
LAUNCHERS = {"torchrun", "deepspeed"}
SHELLS = {"bash", "sh"}
SHELL_OPERATORS = {"|", "||", "&&", ";", ">", ">>", "<"}
# Fenced blocks whose lines may be commands: shell blocks and untagged ones (transcripts, `$ ` prompts).
SHELL_FENCES = {"", "bash", "sh", "shell", "console"}
FENCE = re.compile(r"^\s*(```+|~~~+)\s*([\w+-]*)")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
INLINE_CODE = re.compile(r"(`+)(.+?)\1")


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def split_fences(text: str) -> tuple[list[str], list[tuple[str, list[tuple[int, str]]]]]:
    """(the page's lines with fenced code blanked out, [(info string, [(line number, line), ...]) per block])."""
    prose, blocks, block, marker = [], [], None, ""
    for number, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if block is None and m:
            marker, block = m.group(1), (m.group(2).lower(), [])
            prose.append("")
        elif block is not None and re.fullmatch(re.escape(marker[0]) + "{%d,}" % len(marker), line.strip()):
            blocks.append(block)
            block = None
            prose.append("")
        elif block is not None:
            block[1].append((number, line))
            prose.append("")
        else:
            prose.append(line)
    assert block is None, "unclosed code fence"
    return prose, blocks


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text lower-cased, punctuation other than - and _ dropped (letters of
    any script kept), each space a hyphen."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    prose, _ = split_fences(path.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    out = set()
    for line in prose:
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every Markdown link and image outside code."""
    prose, _ = split_fences(path.read_text(encoding="utf-8"))
    return [(number, m.group(1)) for number, line in enumerate(prose, 1)
            for m in LINK.finditer(INLINE_CODE.sub("", line))]


def is_relative(target: str) -> bool:
    return not re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) and not target.startswith("//")


def resolve(page: Path, target: str) -> tuple[Path, str]:
    path, _, anchor = target.partition("#")
    return (page if not path else (page.parent / path).resolve()), anchor


def linked_docs(page: Path) -> set[Path]:
    return {path for path in (resolve(page, t)[0] for _, t in links(page) if is_relative(t))
            if path.parent == ROOT / "docs" and path.suffix == ".md"}


def commands(path: Path) -> list[tuple[int, str]]:
    """(line number, command line) of every python / torchrun / make command the page shows: lines of shell code
    blocks (continuations joined, a `$ ` prompt dropped) and inline code spans."""
    prose, blocks = split_fences(path.read_text(encoding="utf-8"))
    found = []
    for info, lines in blocks:
        if info not in SHELL_FENCES:
            continue
        pending, start = "", 0
        for number, line in lines:
            stripped = line.strip()
            if not pending:
                start = number
                stripped = stripped[2:] if stripped.startswith("$ ") else stripped
            if stripped.endswith("\\"):
                pending += stripped[:-1] + " "
                continue
            full, pending = pending + stripped, ""
            if COMMAND_START.match(full):
                found.append((start, full))
    for number, line in enumerate(prose, 1):
        found += [(number, m.group(2).strip()) for m in INLINE_CODE.finditer(line)
                  if COMMAND_START.match(m.group(2).strip())]
    return found


def argv_of(command: str) -> list[str]:
    """The command's words, without a trailing comment or leading VAR=value settings, up to the first shell
    operator."""
    words = shlex.split(command, comments=True)
    cut = next((i for i, w in enumerate(words) if w in SHELL_OPERATORS), len(words))
    words = words[:cut]
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
        words = words[1:]
    return words


def make_targets() -> set[str]:
    targets = set()
    for line in (ROOT / "Makefile").read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.\-][A-Za-z0-9_.\- ]*?)\s*:(?!=)", line)
        if m:
            targets.update(t for t in m.group(1).split() if not t.startswith("."))
    return targets


@pytest.fixture(scope="module")
def entry_flags() -> dict[str, set[str]]:
    with pytest.MonkeyPatch.context() as monkeypatch:
        return {name: flags_of(main, monkeypatch) for name, main in ENTRY_POINTS.items()}


def unknown_flags(words: list[str], accepted: set[str]) -> list[str]:
    """The --flags among words that the parser does not accept. A --no-x form counts when the parser lists it, or,
    for a parser that lists no --no- forms at all, when it has --x."""
    lists_negatives = any(f.startswith("--no-") for f in accepted)
    bad = []
    for word in words:
        flag = word.strip("[](),").split("=", 1)[0]
        if not flag.startswith("--") or flag == "--" or "..." in flag:
            continue
        negative_of_known = flag.startswith("--no-") and not lists_negatives and f"--{flag[5:]}" in accepted
        if flag in accepted or flag in EXTERNAL or negative_of_known:
            continue
        bad.append(flag)
    return bad


def problems_of(argv: list[str], entry_flags: dict[str, set[str]], targets: set[str]) -> list[str]:
    """What is wrong with one command line: a script, module or make target that does not exist, or a flag
    its entry point does not accept. Other programs' commands are not ours to check."""
    if not argv:
        return []
    program, args = argv[0], argv[1:]
    if program == "make":
        return [f"no make target {t!r}" for t in args if "=" not in t and not t.startswith("-") and t not in targets]
    if program in SHELLS:
        return [] if not args or (ROOT / args[0]).is_file() else [f"no script {args[0]}"]
    if program in LAUNCHERS:
        script = next((i for i, a in enumerate(args) if a.endswith(".py")), None)
        return ["no script after the launcher"] if script is None else script_problems(args[script:], entry_flags)
    if program not in PYTHONS or not args:
        return []
    if args[0] == "-m":
        if len(args) < 2:
            return ["python -m without a module"]
        module, rest = args[1], args[2:]
        top = module.split(".")[0]
        if not ((ROOT / top).is_dir() or (ROOT / f"{top}.py").exists()):
            return []  # another program's module (pytest, pip, ...)
        if module not in ENTRY_POINTS:
            path = ROOT / module.replace(".", "/")
            return [] if path.with_suffix(".py").exists() or (path / "__main__.py").exists() else [
                f"no module {module}"]
        return flag_problems(module, rest, entry_flags)
    if args[0].endswith(".py"):
        return script_problems(args, entry_flags)
    return []


def script_problems(args: list[str], entry_flags: dict[str, set[str]]) -> list[str]:
    script, rest = args[0], args[1:]
    if not (ROOT / script).is_file():
        return [f"no script {script}"]
    return flag_problems(script, rest, entry_flags) if script in ENTRY_POINTS else []


def flag_problems(entry: str, rest: list[str], entry_flags: dict[str, set[str]]) -> list[str]:
    own, passed_on = (rest[:rest.index("--")], rest[rest.index("--") + 1:]) if "--" in rest else (rest, [])
    problems = [f"{entry} has no {flag}" for flag in unknown_flags(own, entry_flags[entry])]
    problems += value_problems(entry, own)
    if passed_on:  # python -m launch.slurm ... -- train_pretrain.py ...: the rest is the launched script's
        problems += script_problems(passed_on, entry_flags) if passed_on[0].endswith(".py") else []
    return problems


@lru_cache(maxsize=1)  # the recipes are read once, not once per command line
def recipe_data_files() -> dict[str, str]:
    """{file name: the path the recipes give it} for the data files the recipes train on (dataset/...)."""
    found = {}
    for recipe in (ROOT / "recipes").glob("*.yaml"):
        for path in re.findall(r"^\s*data_path:\s*(\S+)", recipe.read_text(), re.M):
            if path.startswith("dataset/") and not path.startswith("dataset/demo/"):
                found[Path(path).name] = path
    return found


def value_problems(entry: str, args: list[str]) -> list[str]:
    """What is wrong with the values of a command's flags: a recipe or DeepSpeed file that does not exist, a preset
    that is not one, or a recipe's data file named at another path than the recipes put it (a command copied from
    one page would then not find the file the walkthrough downloaded)."""
    from model.config import ConfigError, preset_fields
    problems, data_files = [], recipe_data_files()
    files = ("--config", "--deepspeed") if entry.startswith("train_") else ()
    for flag, value in zip(args, args[1:]):
        if "..." in value or value.isupper():  # a placeholder: PRESET, ...
            continue
        if flag in files and not (ROOT / value).is_file():
            problems.append(f"{flag} {value}: no such file")
        if flag == "--preset" and value != "auto":
            try:
                preset_fields(value)
            except ConfigError:
                problems.append(f"--preset {value}: no such preset")
    for value in args:
        name = Path(value.split(":")[0]).name
        if name in data_files and value.split(":")[0] != data_files[name]:
            problems.append(f"{value}: the recipes and the walkthrough put it at {data_files[name]}")
    return problems


def launched_problems(argv: list[str]) -> list[str]:
    """A training script started by a launcher (torchrun, deepspeed, launch.slurm) with neither --data_path nor
    --config would train the bundled demo corpus on every GPU: a scaling command must name its data."""
    if not argv:
        return []
    launched = argv[0] in LAUNCHERS or argv[1:3] == ["-m", "launch.slurm"]
    script = next((a for a in argv if re.fullmatch(r"train_\w+\.py", a)), None)
    if launched and script and not {"--data_path", "--config"} & set(argv):
        return [f"{script} is launched without --data_path or --config: it would train the demo corpus"]
    return []


def test_front_page_is_short():
    lines = len(README.read_text(encoding="utf-8").splitlines())
    assert lines < MAX_FRONT_PAGE_LINES, f"README.md has {lines} lines; move reference text to docs/"


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_relative_links_resolve(page):
    broken = []
    for number, target in links(page):
        if not is_relative(target):
            continue
        path, anchor = resolve(page, target)
        where = f"{rel(page)}:{number}: {target}"
        if not path.is_relative_to(ROOT) or not path.exists():
            broken.append(f"{where}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{where}: no heading #{anchor} in {rel(path)}")
    assert broken == []


def test_every_docs_page_is_linked_from_both_front_pages():
    assert DOCS, "docs/ has no pages"
    for front in FRONT_PAGES:
        missing = sorted(rel(p) for p in set(DOCS) - linked_docs(front))
        assert missing == [], f"{rel(front)} does not link {missing}"


@pytest.mark.parametrize("page", DOCS, ids=rel)
def test_docs_page_starts_with_a_way_back_and_a_title(page):
    lines = [line for line in page.read_text(encoding="utf-8").splitlines() if line.strip()]
    assert "](../README.md)" in lines[0], f"{rel(page)}: the first line should link back to ../README.md"
    assert lines[1].startswith("# "), f"{rel(page)}: a '# Title' should follow the link back"


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_commands_exist_with_their_flags(page, entry_flags):
    targets = make_targets()
    problems = [f"{rel(page)}:{number}: {command}: {problem}" for number, command in commands(page)
                for problem in problems_of(argv_of(command), entry_flags, targets) + launched_problems(
                    argv_of(command))]
    assert problems == []


def test_the_command_checks_catch_what_the_docs_once_got_wrong(entry_flags):
    """Each rule above, on a command line it must reject and one it must accept."""
    targets = make_targets()

    def problems(command: str) -> list[str]:
        argv = argv_of(command)
        return problems_of(argv, entry_flags, targets) + launched_problems(argv)

    bad = ["torchrun --nproc_per_node 8 train_pretrain.py --data_path pretrain_hq.jsonl",
           "torchrun --nproc_per_node 8 train_pretrain.py --deepspeed launch/ds_zero2.json",
           "python train_pretrain.py --config recipes/no-such-recipe.yaml",
           "python train_pretrain.py --preset minimind-27m",
           "OUT=x bash bench/no_such_check.sh",
           ".venv/bin/python train_pretrain.py --no_such_flag 1",
           "make no-such-target PYTHON=python3.12"]
    good = ["torchrun --nproc_per_node 8 train_pretrain.py --data_path dataset/pretrain_hq.jsonl",
            "python train_pretrain.py --config recipes/minimind-26m-pretrain.yaml --preset minimind-26m",
            "OUT=x bash bench/gpu_check.sh", "make demo PYTHON=python3.12",
            "python -m model.convert --checkpoint minimind.pth --config config.json --out_dir hf_model",
            "python -m launch.slurm --nodes 2 -- train_pretrain.py --data_path dataset/pretrain_hq.jsonl"]
    assert [c for c in bad if not problems(c)] == []
    assert {c: problems(c) for c in good if problems(c)} == {}


def test_front_pages_show_the_same_commands():
    def command_set(page: Path) -> set[str]:
        return {shlex.join(argv_of(c)) for _, c in commands(page) if COMMAND_START.match(c)}

    english, chinese = command_set(README), command_set(README_ZH)
    assert english, "README.md shows no commands"
    assert sorted(english - chinese) == [] and sorted(chinese - english) == [], (
        f"only in README.md: {sorted(english - chinese)}; only in README_zh.md: {sorted(chinese - english)}")
