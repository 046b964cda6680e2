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
