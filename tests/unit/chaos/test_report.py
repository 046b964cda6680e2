"""The chaos report's per-kind summary counts only faults that were injected."""

from __future__ import annotations

import json

from elastictrain.chaos.report import by_kind, format_json, format_table
from elastictrain.chaos.runner import ChaosReport, TrialResult


def trial(index: int, injected: list[str], storage: int, failures: list[str]) -> TrialResult:
    return TrialResult(trial=index, seed=index, faults="", injected=injected, restarts=1,
                       exit_codes=[0], storage_faults_injected=storage, wall_s=1.0,
                       failures=failures)


def test_by_kind_counts_injected_faults_and_their_passes() -> None:
    report = ChaosReport("abc", 1.0, 10, "/tmp/x", [
        trial(0, ["kill: SIGKILL rank0 11", "kill: SIGKILL rank1 12"], 0, []),
        trial(1, ["notice: SIGTERM launcher 13", "stop(rank0)@9.0s not injected (job done)"],
              3, ["digest differs"]),
        trial(2, ["relaunch: SIGKILL launcher+workers [14]"], 0, []),
    ])
    assert by_kind(report) == {"kill": {"trials": 1, "passed": 1},
                               "notice": {"trials": 1, "passed": 0},
                               "relaunch": {"trials": 1, "passed": 1},
                               "storage": {"trials": 1, "passed": 0}}
    assert "notice 0/1 passed" in format_table(report)
    assert json.loads(format_json(report))["by_kind"]["kill"] == {"trials": 1, "passed": 1}


def test_node_trials_are_counted_by_variant() -> None:
    from elastictrain.chaos.report import by_kind
    from elastictrain.chaos.runner import ChaosReport, TrialResult

    def trial(notes: list[str], failures: list[str]) -> TrialResult:
        return TrialResult(trial=0, seed=1, faults="", injected=notes, restarts=1,
                           exit_codes=[0], storage_faults_injected=0, wall_s=1.0,
                           failures=failures)

    report = ChaosReport("d", 1.0, 10, "/w", [
        trial(["node: SIGSTOP node0.0 after step 5 (3 processes), memory wiped, at once, "
               "SIGKILL 3 processes", "replaced: node0.1 started"], []),
        trial(["node: SIGSTOP node1.0 during start-up (2 processes), memory wiped, held 5s, "
               "SIGKILL 2 processes"], ["lost 9 steps"]),
        trial(["node: SIGSTOP node0.0 after step 46, after the run's agreed end (3 processes), "
               "memory wiped, at once, SIGKILL 3 processes",
               "replacement: none started (the job had ended)",
               "digest not compared: the writer's node was lost after the agreed end, before "
               "it logged params.digest"], [])])
    assert by_kind(report) == {
        "node": {"trials": 3, "passed": 2},
        "node abrupt": {"trials": 2, "passed": 2}, "node replaced": {"trials": 1, "passed": 1},
        "node silent": {"trials": 1, "passed": 0},
        "node not replaced": {"trials": 2, "passed": 1},
        "node start-up": {"trials": 1, "passed": 0},
        "node after the end": {"trials": 1, "passed": 1}}
