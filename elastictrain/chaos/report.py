"""The chaos report: a table for people, one JSON object for machines."""

from __future__ import annotations

import json

from elastictrain.chaos.runner import ChaosReport, TrialResult

_COLUMNS = ("trial", "seed", "faults injected", "restarts", "result", "why")


def format_table(report: ChaosReport) -> str:
    """One row per trial, then a summary line."""
    rows = [(str(t.trial), str(t.seed), _injected(t), str(t.restarts),
             "pass" if t.passed else "FAIL", "; ".join(t.failures)) for t in report.trials]
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c)
              for i, c in enumerate(_COLUMNS)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(_COLUMNS, widths, strict=True)).rstrip()]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip()
              for r in rows]
    passed = sum(t.passed for t in report.trials)
    kinds = by_kind(report)
    if kinds:
        lines.append("by fault kind (trials where it was injected): " + ", ".join(
            f"{kind} {c['passed']}/{c['trials']} passed" for kind, c in kinds.items()))
    lines.append(f"{passed}/{len(report.trials)} trials passed; clean run "
                 f"{report.clean_wall_s:.1f}s, digest {str(report.clean_digest)[:12]}…, "
                 f"workdir {report.workdir}")
    return "\n".join(lines)


# Notes of a node trial that say what followed a loss, not a fault (chaos/noderun.py).
NOT_FAULTS = frozenset({"replaced", "replacement", "orphan", "digest not compared",
                        "kept memory wiped"})


def by_kind(report: ChaosReport) -> dict[str, dict[str, int]]:
    """Per fault kind, the trials where it was actually injected and how many passed
    (a fault drawn for after the job ended counts for none)."""
    counts: dict[str, dict[str, int]] = {}
    for trial in report.trials:
        kinds = {note.split(":", 1)[0] for note in trial.injected if "not injected" not in note}
        if trial.storage_faults_injected:
            kinds.add("storage")
        if "node" in kinds:  # a node trial's variants (chaos/noderun.py's notes)
            lost = next(n for n in trial.injected if n.startswith("node:"))
            kinds.add("node silent" if "held" in lost else "node abrupt")
            kinds.add("node replaced" if "replaced" in kinds else "node not replaced")
            if "start-up" in lost:
                kinds.add("node start-up")
            if "after the run's agreed end" in lost:
                kinds.add("node after the end")
            if "memory kept" in lost:
                kinds.add("node memory kept")
        kinds -= NOT_FAULTS
        for kind in kinds:
            count = counts.setdefault(kind, {"trials": 0, "passed": 0})
            count["trials"] += 1
            count["passed"] += int(trial.passed)
    return dict(sorted(counts.items()))


def _injected(trial: TrialResult) -> str:
    parts = list(trial.injected)
    if trial.storage_faults_injected:
        parts.append(f"{trial.storage_faults_injected} storage faults")
    return "; ".join(parts) or "none"


def format_json(report: ChaosReport) -> str:
    return json.dumps({**report.to_dict(), "by_kind": by_kind(report)})
