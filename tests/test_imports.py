"""The project's import graph: no circles, dependencies pointing down (docs/layout.md), shared constants once.

Every import statement counts, module level or inside a function (a function-level import is how a circle
hides). Imports under `if TYPE_CHECKING:` never run; they are counted where the test says so: the training code
has no circle even through its type hints (stages and components see trainer_utils/context.py, a leaf, not the
loop that calls them).
"""
from __future__ import annotations

import ast
import re

from conftest import PACKAGES, ROOT


def project_modules() -> dict[str, object]:
    modules = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def import_graph(hints: bool = False) -> dict[str, set[str]]:
    """{module: the project modules it imports}; with `hints`, the imports for type hints only too."""
    modules = project_modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        hints_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                      and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING") for n in ast.walk(node)}
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        deps: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in hints_only and not hints:
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(package[:len(package) - node.level + 1]) if node.level else ""
                module = ".".join(p for p in (base, node.module or "") if p)
                targets = [module, *(f"{module}.{a.name}" for a in node.names)]
            else:
                continue
            deps.update(t for t in targets if t in modules and t != name)
        graph[name] = deps
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circles():
    assert circles(import_graph()) == []


def test_no_import_circles_even_through_type_hints():
    assert circles(import_graph(hints=True)) == []


def test_stages_and_components_see_the_run_through_its_context():
    """Neither imports the loop or the session, not even for a type hint; context.py imports nothing of
    trainer_utils at run time."""
    graph = import_graph(hints=True)
    hooks = [m for m in graph if m.startswith(("trainer_utils.stages", "trainer_utils.components"))]
    assert len(hooks) > 10
    assert [(m, d) for m in hooks for d in graph[m] if d in ("trainer_utils.loop", "trainer_utils.session")] == []
    assert [d for d in import_graph()["trainer_utils.context"] if d.startswith("trainer_utils")] == []


def test_the_circle_finder_finds_one():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# The rooms and the arrows allowed between them (docs/layout.md): each package may import the ones listed, and
# only those; everything may import common/, which imports nothing of the project.
MAY_IMPORT = {
    "common": (),
    "model": ("common",),
    "dataset": ("common",),
    "evaluation": ("common", "model"),
    "export": ("common", "model"),
    "serving": ("common", "model", "dataset"),
    "trainer_utils": ("common", "model", "dataset", "evaluation"),
    "launch": ("common",),
}


def test_every_package_has_its_place():
    assert sorted(MAY_IMPORT) == sorted(PACKAGES)


def arrows_not_allowed(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """The imports from one package into another that MAY_IMPORT does not list. A package's __main__ is an entry
    point like the top-level scripts (`python -m model --plan` times training steps): nothing imports it
    (test_nothing_imports_an_entry_point), so what it imports makes no package depend on another."""
    return sorted((m, d) for m, deps in graph.items() if not m.endswith(".__main__") for d in deps
                  if d.split(".")[0] != m.split(".")[0] and d.split(".")[0] not in MAY_IMPORT[m.split(".")[0]])


def test_dependencies_point_down():
    assert arrows_not_allowed(import_graph()) == []


def test_an_arrow_up_is_found():
    graph = {"model.model": {"common.errors", "evaluation.scoring"}, "evaluation.scoring": {"model.model"},
             "model.__main__": {"trainer_utils.planner"}}
    assert arrows_not_allowed(graph) == [("model.model", "evaluation.scoring")]


def test_nothing_imports_an_entry_point():
    assert sorted((m, d) for m, deps in import_graph().items() for d in deps if d.endswith(".__main__")) == []


def test_shared_constants_are_defined_once():
    defined: dict[str, list[str]] = {}
    for path in project_modules().values():
        for name in re.findall(r"^([A-Z][A-Z0-9_]+)\s*(?::[^=]+)?=", path.read_text(), re.M):
            defined.setdefault(name, []).append(str(path.relative_to(ROOT)))
    twice = {name: paths for name, paths in defined.items() if len(paths) > 1}
    assert twice == {}


def test_the_layout_page_shows_these_arrows():
    """docs/layout.md's map of rooms and arrows is MAY_IMPORT: a change to one must reach the other."""
    shown = dict(re.findall(r"^(\w+)/\s+-> (.+)$", (ROOT / "docs" / "layout.md").read_text(), re.M))
    assert {room: sorted(r.rstrip("/") for r in arrows.split()) if arrows != "nothing of the project" else []
            for room, arrows in shown.items()} == {room: sorted(arrows) for room, arrows in MAY_IMPORT.items()}
