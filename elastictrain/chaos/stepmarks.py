"""What a node trial on a user's script reads in place of the demo's sample records.

A script writes no records, but elastictrain logs a ``train.progress`` event from every
rank's ``SnapshotManager.step()``, carrying the step and the world size. The harness
sets its interval (``snapshot.progress_every_s``) far below a step's time, so each rank
logs every step it trained: one "step mark" per rank and step, in the nodes' event
logs (files on the node's disk, so a lost node's marks stay readable, and a replaced
node's new incarnation logs to a directory of its own). Marks say which steps ran,
when and at what world size; not which samples, so exactly-once data is not checked
for a script.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

# Below any step's time, so train.progress comes every step (the setting must be > 0).
PROGRESS_EVERY_S = "1e-06"


def step_marks(events: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One ``{ts, step, rank, world_size}`` per rank and trained step, in time order:
    the shape of a sample record that the node checks read (ts and step)."""
    marks = [{"ts": float(e["ts"]), "step": int(e["step"]), "rank": e.get("rank"),
              "world_size": int(e.get("world_size") or 0)}
             for e in events
             if e.get("event") == "train.progress" and isinstance(e.get("step"), int)]
    return sorted(marks, key=lambda m: float(m["ts"]))


def unmarked_steps(marks: Sequence[dict[str, Any]]) -> list[int]:
    """Steps up to the highest marked one that no rank marked: the script's
    ``train.progress`` events do not come every step (its own setting won), so the
    marks cannot stand in for the records."""
    seen = {int(m["step"]) for m in marks}
    return sorted(set(range(1, max(seen, default=0) + 1)) - seen)


def final_world_sizes_of(marks: Sequence[dict[str, Any]]) -> set[int]:
    """The world size of the execution of each step that counts: its latest mark (a
    step redone after a resume is marked again, later)."""
    latest: dict[int, int] = {}
    for mark in sorted(marks, key=lambda m: float(m["ts"])):
        latest[int(mark["step"])] = int(mark["world_size"])
    return set(latest.values())


def widest_gap(events: Sequence[dict[str, Any]], *, durable_only: bool) -> int | None:
    """The widest gap in steps between rank 0's consecutive commits (from step 0) in a
    clean run: a script's interval, which it may set itself. Durable only: the bound of
    a resume from durable storage. Any tier: of a resume from memory, whose newest copy
    may be a durable one (a step due for both takes only the durable snapshot).
    None: no such commit."""
    steps = sorted({int(e["snapshot_step"]) for e in events
                    if e.get("event") == "snapshot.committed" and e.get("rank") == 0
                    and not (durable_only and e.get("tier") == "memory")})
    return max(b - a for a, b in itertools.pairwise([0, *steps])) if steps else None
