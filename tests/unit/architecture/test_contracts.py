"""The package's dependency rules (docs/architecture.md), checked on its import graph
with grimp (import-linter's engine): each part imports only parts below it, the launcher
never imports the worker's or the snapshots' code, no cycle between parts, and the
package root holds only the entry points and the public API. Every import counts, at
module level or inside a function."""

from __future__ import annotations

import grimp
import pytest

from tests.helpers import REPO

PACKAGE = "elastictrain"
SOURCE = REPO / PACKAGE

# Highest first: a part may import the parts after it, never one before it. chaos and
# demo are tools side by side (chaos runs the demo).
LAYERS: list[grimp.Layer | str] = [
    "cli",
    grimp.Layer("chaos", "demo", independent=False),
    "launcher",
    "view",
    "runtime",  # the public API's init() / shutdown()
    "snapshot",
    "worker",
    "runlog",
    "storage",
    "handoff",
    "core",
]
PARTS = {"cli", "chaos", "demo", "launcher", "view", "runtime", "snapshot", "worker",
         "runlog", "storage", "handoff", "core", "__main__", "version"}
ROOT_MODULES = {"__init__.py", "__main__.py", "cli.py", "runtime.py", "version.py"}


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph(PACKAGE, cache_dir=None)


def _routes(illegal: set[grimp.PackageDependency]) -> list[str]:
    return sorted(f"{d.importer} -> {d.imported} via {sorted(r.heads)}..{sorted(r.tails)}"
                  for d in illegal for r in d.routes)


def test_every_part_imports_only_parts_below_it(graph: grimp.ImportGraph) -> None:
    illegal = graph.find_illegal_dependencies_for_layers(layers=LAYERS, containers={PACKAGE})
    assert _routes(illegal) == []


@pytest.mark.parametrize("forbidden", ["worker", "snapshot", "runtime"])
def test_the_launcher_never_imports_the_workers_code(graph: grimp.ImportGraph,
                                                     forbidden: str) -> None:
    chain = graph.find_shortest_chain(f"{PACKAGE}.launcher", f"{PACKAGE}.{forbidden}",
                                      as_packages=True)
    assert chain is None, chain


def test_every_module_is_in_a_part(graph: grimp.ImportGraph) -> None:
    loose = sorted(m for m in graph.modules if m != PACKAGE and m.split(".")[1] not in PARTS)
    assert loose == []


def test_the_root_holds_the_entry_points_and_the_public_api_only() -> None:
    assert {p.name for p in SOURCE.glob("*.py")} <= ROOT_MODULES


def test_no_module_is_over_600_lines() -> None:
    long = {str(p.relative_to(SOURCE)): n for p in SOURCE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 600}
    assert long == {}


# snapshot/, highest first: the manager and its parts at snapshot/'s root compose the
# tiers (they hand the durable restore the memory tier's load); the export reads what
# the tiers below wrote (an operator's tool: none of them imports it); sharded state
# rides on the memory and durable tiers; every tier stands on the state it saves, its
# schedule and the format.
SNAPSHOT_LAYERS: list[grimp.Layer | str] = [
    grimp.Layer("manager", "manager_setup", "node_memory", "rescuer", "copy_fence",
                "preempt_exit", "fallback", independent=False),
    "export",  # reads committed snapshots, replicated and sharded; no tier imports it
    "sharded",
    "memory",
    "durable",
    "schedule",
    "state",
    "format",
]


def test_no_snapshot_tier_imports_a_tier_above_it(graph: grimp.ImportGraph) -> None:
    container = f"{PACKAGE}.snapshot"
    illegal = graph.find_illegal_dependencies_for_layers(layers=SNAPSHOT_LAYERS,
                                                         containers={container})
    found = {(head.removeprefix(f"{container}."), tail.removeprefix(f"{container}."))
             for d in illegal for r in d.routes for head in r.heads for tail in r.tails}
    assert found == set()
