"""The checks after a chaos trial. Each returns None when it holds, else the reason.

They read only what an operator has: the launchers' exit codes, the run's event
log, the storage root, the processes still running and the files the run wrote.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from pathlib import Path
from typing import Any

from elastictrain.core.errors import EXIT_PREEMPTED, ElasticTrainError
from elastictrain.snapshot.format.reader import verify_snapshot
from elastictrain.storage import Store
from elastictrain.view import ops


def _named(events: Iterable[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [e for e in events if e.get("event") == name]


def _rank0(events: Iterable[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [e for e in _named(events, name) if e.get("rank") == 0]


def final_digest(events: Sequence[dict[str, Any]]) -> str | None:
    """The digest the last ``SnapshotManager.close()`` logged (events in time order)."""
    found = _named(events, "params.digest")
    return str(found[-1]["param_digest"]) if found else None


def check_completed(exit_codes: Sequence[int], *, timed_out: bool) -> str | None:
    """The last launch exited 0 (the earlier ones ended as the schedule implied)."""
    if timed_out:
        return "timed out (a hang nothing turned into a restart?)"
    if not exit_codes or exit_codes[-1] != 0:
        return f"launcher exit codes {list(exit_codes)}: the run did not finish"
    return None


def check_digest(events: Sequence[dict[str, Any]], expected: str | None) -> str | None:
    """The final parameters are bit-identical to the clean run's."""
    actual = final_digest(events)
    if actual is None:
        return "no params.digest event: SnapshotManager.close() never ran to the end"
    if actual != expected:
        return f"param digest {actual[:12]}… != clean run's {str(expected)[:12]}…"
    return None


def check_replicas(events: Sequence[dict[str, Any]]) -> str | None:
    """Every rank held one state wherever the job compared them: the ranks that
    resumed together (one attempt, one step) report one ``state_digest``, and the run's
    end found its replicas equal (``run.finished``; None where the state is sharded)."""
    groups: dict[tuple[Any, ...], set[str]] = {}
    for e in _named(events, "resume"):
        if e.get("state_digest") is not None:
            # One group of ranks: the job's attempt where the memory tier names one,
            # else one launcher's attempt (a single node's ranks).
            group = ((e["attempt"],) if e.get("attempt") is not None
                     else (e.get("launch_id"), e.get("restart_count")))
            groups.setdefault((*group, e.get("from_step")), set()).add(str(e["state_digest"]))
    apart = sorted((str(k[-1]), sorted(v)) for k, v in groups.items() if len(v) > 1)
    if apart:
        return f"ranks resumed on different states: {apart}"
    if any(e.get("replicas_equal") is False for e in _named(events, "run.finished")) or \
            _named(events, "run.replicas_diverged"):
        return "the replicas ended apart"
    return None


def check_snapshots(store: Store) -> str | None:
    """Every committed snapshot verifies (ops.verify_snapshots) and loads."""
    try:
        rows = ops.verify_snapshots(store)
        bad = [r for r in rows if r.get("status") != "ok"]
        if bad:
            return f"snapshot step {bad[0].get('step')} does not verify: {bad[0].get('reason')}"
        if not rows:
            return "no committed snapshot"
        for row in rows:
            verify_snapshot(store, int(row["step"]), load=True)
    except ElasticTrainError as exc:  # corrupt, unreadable or unloadable
        return f"snapshots do not load: {type(exc).__name__}: {exc}"
    return None


def check_lost_steps(events: Sequence[dict[str, Any]], interval: int,
                     exit_codes: Sequence[int], launch_ts: Sequence[float]) -> str | None:
    """Each resume starts from the newest committed snapshot; it loses at most the
    snapshot interval plus the steps whose save was in flight or failed; and the
    first resume after a preemption exit (75) loses nothing."""
    committed = [(float(e["ts"]), int(e["snapshot_step"]), str(e.get("tier")))
                 for e in _rank0(events, "snapshot.committed")]
    gone = _memory_copies_gone(events)
    staged = [(float(e["ts"]), int(e["snapshot_step"]))
              for e in _rank0(events, "snapshot.staged")]
    seen_launches: set[int] = set()
    for resume in _rank0(events, "resume"):
        ts, start = float(resume["ts"]), int(resume.get("from_step") or 0)
        newest = max((s for t, s, tier in committed if t < ts and not (
            tier == "memory" and any(t < g <= ts and step in (s, None) for g, step in gone))),
            default=0)
        if start < newest:
            return f"resumed from step {start} although step {newest} was committed"
        launch = sum(1 for t in launch_ts if t <= ts) - 1
        first_of_launch = launch not in seen_launches
        seen_launches.add(launch)
        lost = resume.get("lost_steps")
        if lost is None:
            continue
        if first_of_launch and launch > 0 and exit_codes[launch - 1] == EXIT_PREEMPTED:
            if lost != 0:
                return f"lost {lost} steps after a preemption exit (75); expected 0"
            continue
        in_flight = max((s for t, s in staged if t < ts), default=0)
        allowed = interval + max(0, in_flight - start)
        if lost > allowed:
            return f"lost {lost} steps resuming from step {start} (allowed {allowed})"
    return None


def _memory_copies_gone(events: Sequence[dict[str, Any]]) -> list[tuple[float, int | None]]:
    """When a node-memory copy went, and of which step (None: all of them): pruned (the
    memory tier keeps one), set aside at a restore (found bad: a memory_corrupt fault),
    or removed with the memory directory at the end of a finished run. A resume after
    that rightly goes back to durable storage."""
    gone: list[tuple[float, int | None]] = []
    for e in events:
        name = e.get("event")
        step = e.get("snapshot_step")
        if ((name == "snapshot.pruned" and e.get("tier") == "memory")
                or name == "snapshot.memory_set_aside") and isinstance(step, int):
            gone.append((float(e["ts"]), step))
        elif name == "snapshot.memory_removed":
            gone.append((float(e["ts"]), None))
    return gone


def check_leftovers(pids: Sequence[int]) -> str | None:
    """No process of the run is left."""
    return f"processes left running: {sorted(pids)}" if pids else None


def check_secret(secret: str, root: Path, texts: Iterable[str] = ()) -> str | None:
    """``secret`` appears in no file under ``root`` and in none of ``texts``."""
    needle = secret.encode()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        if needle in path.read_bytes():
            return f"the planted credential appears in {path}"
    if any(secret in t for t in texts):
        return "the planted credential appears in the command's output"
    return None


def check_private(root: Path, planted: Collection[Path] = ()) -> str | None:
    """No file or directory the run keeps in node memory (under the trial's stand-in
    for /dev/shm) is open to other users: directories 0700, files 0600. ``planted``:
    what the harness itself made open (a degraded node's root), not the run."""
    for path in sorted(root.rglob("*")):
        if path.name == "filler" or path.is_symlink() or path in planted:
            continue
        mode = path.stat().st_mode & 0o777
        if mode & 0o077:
            return f"{path} has mode {mode:04o}: other users may read it"
    return None


def check_memory_left(root: Path) -> str | None:
    """Nothing of the run is left in node memory once it ended (close() removes its
    memory directory, the launcher its rescue marks)."""
    # A degraded node's memory directory is named apart (chaos/nodes.py): "memory".
    left = sorted(str(p) for p in [*root.glob("elastictrain-*/*"), *root.glob("memory")])
    return f"left in node memory after the run: {left}" if left else None


def check_neighbour(code: int | None) -> str | None:
    """The second run on the node finished from a fresh start (0): it never loaded the
    trial's memory snapshot (3), and nothing of its own was removed under it."""
    if code is None or code == 0:
        return None
    return f"the second run on the node exited {code} (3: it loaded another run's snapshot)"
