"""The package's import graph, read from its source with ``ast`` (nothing is imported):
no import cycle, and no import that points up the layering (docs/design/layers.md).

Every import counts: at module level, inside a function, or under ``TYPE_CHECKING``.
A module is in the layer of the longest entry of ``LAYERS`` that names it or a package
holding it; it may import its own layer and the layers listed before it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = "elastictrain"
SOURCE = Path(__file__).resolve().parents[2] / PACKAGE

# Lowest first. The root package (its public API) is named by its ``__init__``.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("leaf", (
        "elastictrain.batching", "elastictrain.config", "elastictrain.data",
        "elastictrain.dist", "elastictrain.env", "elastictrain.errors",
        "elastictrain.failure", "elastictrain.gracewatch", "elastictrain.helpformat",
        "elastictrain.localfiles", "elastictrain.log", "elastictrain.preempt",
        "elastictrain.proctree", "elastictrain.handoff", "elastictrain.runend",
        "elastictrain.shm", "elastictrain.version", "elastictrain.watchdog",
        # The names of a snapshot's paths: storage's fault injection targets them.
        "elastictrain.snapshot.layout",
    )),
    ("storage", ("elastictrain.storage", "elastictrain.events", "elastictrain.events_read")),
    ("accounting", ("elastictrain.accounting",)),
    ("snapshot", ("elastictrain.snapshot",)),
    ("ops", ("elastictrain.ops", "elastictrain.goodput", "elastictrain.view")),
    ("runtime", ("elastictrain.runtime", "elastictrain.__init__")),
    ("launch", ("elastictrain.launch", "elastictrain.agent", "elastictrain.exitbarrier",
                "elastictrain.launcher",
                "elastictrain.standby")),
    ("cli", ("elastictrain.cli", "elastictrain.__main__", "elastictrain.chaos",
             "elastictrain.demo")),
]

# Imports that point up and stay for now, each with its reason.
ALLOWED_UP: dict[tuple[str, str], str] = {
    ("elastictrain.snapshot.manager_setup", "elastictrain.runtime"):
        "a manager built without arguments finds what elastictrain.init() set up, once",
    ("elastictrain.snapshot.manager", "elastictrain.runtime"):
        "close() tells the worker's runtime that the run finished (run.finished)",
}


def module_name(path: Path) -> str:
    """A subpackage's ``__init__`` is named by its package; the root's keeps its own
    name, so that its layer is not every module's."""
    parts = path.relative_to(SOURCE.parent).with_suffix("").parts
    if parts[-1] == "__init__" and parts[:-1] != (PACKAGE,):
        parts = parts[:-1]
    return ".".join(parts)


def package_modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(SOURCE.rglob("*.py"))}


def _target(name: str, modules: dict[str, Path]) -> str:
    """The module an imported name is: itself, or the package ``__init__`` it names."""
    return name if name in modules else f"{name}.__init__"


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` imports anywhere in its source."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found |= {_target(a.name, modules) for a in node.names
                      if a.name.split(".")[0] == PACKAGE}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                here = name.removesuffix(".__init__").split(".")
                base = here if is_package else here[:-1]
                base = base[:len(base) - node.level + 1]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            if source.split(".")[0] != PACKAGE:
                continue
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                found.add(submodule if submodule in modules else _target(source, modules))
    found.discard(name)
    return found & set(modules)


def import_graph() -> dict[str, set[str]]:
    modules = package_modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def layer_of(module: str) -> int:
    matches = [(len(entry), rank) for rank, (_, entries) in enumerate(LAYERS)
               for entry in entries if module == entry or module.startswith(entry + ".")]
    if not matches:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS")
    return max(matches)[1]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def upward_imports(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    return {(source, target) for source, targets in graph.items() for target in targets
            if layer_of(target) > layer_of(source)}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph()


def test_the_graph_sees_the_package(graph: dict[str, set[str]]) -> None:
    assert "elastictrain.snapshot.commit" in graph["elastictrain.snapshot.persister"]
    assert "elastictrain.storage" in graph["elastictrain.events"]


def test_no_import_cycle(graph: dict[str, set[str]]) -> None:
    found = cycles(graph)
    assert not found, "modules in an import cycle:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_every_module_has_a_layer(graph: dict[str, set[str]]) -> None:
    for module in graph:
        layer_of(module)


def test_every_layer_entry_names_a_module(graph: dict[str, set[str]]) -> None:
    missing = [entry for _, entries in LAYERS for entry in entries
               if not any(m == entry or m.startswith(entry + ".") for m in graph)]
    assert not missing, f"no such module, drop from LAYERS: {missing}"


def test_no_import_points_up(graph: dict[str, set[str]]) -> None:
    names = [name for name, _ in LAYERS]
    upward = [f"{s} ({names[layer_of(s)]}) imports {t} ({names[layer_of(t)]})"
              for s, t in sorted(upward_imports(graph) - set(ALLOWED_UP))]
    assert not upward, "imports pointing up the layering:\n" + "\n".join(upward)


def test_the_launcher_imports_no_snapshot_module(graph: dict[str, set[str]]) -> None:
    # What it shares with the workers' snapshots is naming: rescue_marks.py, shm.py.
    launcher = ("elastictrain.launch", "elastictrain.agent")
    found = sorted((s, t) for s in launcher for t in graph[s]
                   if t.startswith("elastictrain.snapshot."))
    assert not found, found


def test_every_allowed_upward_import_is_still_there(graph: dict[str, set[str]]) -> None:
    # An arrow that went away leaves ALLOWED_UP and docs/design/layers.md.
    gone = sorted(set(ALLOWED_UP) - upward_imports(graph))
    assert not gone, f"no longer imported, drop from ALLOWED_UP: {gone}"
