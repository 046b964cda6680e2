"""Operator tooling behind ``elastictrain snapshots …``: list, verify, inspect, prune,
export; and ``snapshots list --memory``: what this user holds in this node's memory.

A snapshot directory is in one of three states, named the same by every command:
``committed`` (its manifest is there; ``verify`` then says ``ok`` or ``corrupt``),
``partial`` (no manifest: the write never committed, and restore skips it) or
``corrupt`` (a manifest that does not parse or names another step). ``list`` also shows
the ``suspect`` ones: restored, they made no sense, and they were set aside.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Any

from elastictrain.core import layout
from elastictrain.core.errors import ConfigError, SnapshotCorrupt, StorageNotFoundError
from elastictrain.core.shm import user_root
from elastictrain.snapshot.durable import retention
from elastictrain.snapshot.durable.suspects import suspects
from elastictrain.snapshot.format.manifest import SHARDED_FORMAT_VERSION, Manifest
from elastictrain.snapshot.format.reader import list_snapshot_dirs, read_manifest, verify_snapshot
from elastictrain.snapshot.format.sharded_reader import parts_by_rank
from elastictrain.storage import Store

_STEPS_SHOWN = 10


@dataclass(frozen=True)
class _Dir:
    """One ``step_…`` directory: committed (with its manifest), partial or corrupt."""

    step: int
    state: str
    manifest: Manifest | None = None
    reason: str | None = None


def _snapshot_dirs(store: Store) -> list[_Dir]:
    """Every snapshot directory, newest first, from a fresh listing. Read errors other
    than a missing or invalid manifest are raised."""
    found = []
    for step in list_snapshot_dirs(store):
        try:
            found.append(_Dir(step, "committed", read_manifest(store, step)))
        except SnapshotCorrupt as exc:
            if isinstance(exc.__cause__, StorageNotFoundError):
                found.append(_Dir(step, "partial", reason=_partial_reason(store, step)))
            else:
                found.append(_Dir(step, "corrupt", reason=str(exc)))
    return found


def _partial_reason(store: Store, step: int) -> str:
    return (f"{store.url}/{layout.step_dir(step)}: no {layout.MANIFEST}, so it never "
            "committed (a write cut short or still running); restore skips it")


# What ``list`` calls a committed snapshot: its payload is not read there (``verify``
# reads it), so it is never called good on the strength of its manifest alone.
LISTED_COMMITTED = "unverified"


def list_snapshots(store: Store) -> list[dict[str, Any]]:
    """Every snapshot, newest first, the suspect ones set aside under ``suspect/`` among
    them (kept, never restored: docs/restore.md#checked-for-sense)."""
    rows: list[dict[str, Any]] = []
    for d in _snapshot_dirs(store):
        if d.manifest is None:
            rows.append({"step": d.step, "status": d.state, "reason": d.reason})
            continue
        m = d.manifest
        rows.append({"step": d.step, "status": LISTED_COMMITTED, "epoch": m.epoch,
                     "world_size": m.world_size, "size_bytes": m.total_bytes,
                     "loss": m.loss, "created_at": m.created_at})
    for r in suspects(store):
        rows.append({"step": r.step, "status": "suspect", "reason": r.reason,
                     "at_step": r.at_step, "set_aside_at": r.time,
                     "path": r.moved_to or "-"})
    return sorted(rows, key=lambda row: row["step"], reverse=True)


def verify_snapshots(store: Store, step: int | None = None) -> list[dict[str, Any]]:
    """One row per snapshot (newest first, or just ``step``): ok, corrupt or partial. A
    read error is raised, never reported as corruption.

    Raises:
        ConfigError: ``step`` is not there (the message lists the steps that are).
    """
    dirs = _snapshot_dirs(store)
    if step is not None:
        dirs = [d for d in dirs if d.step == step] or _no_such_step(store, step, dirs)
    rows = []
    for d in dirs:
        if d.manifest is None:
            rows.append({"step": d.step, "status": d.state, "reason": d.reason})
            continue
        try:
            m = verify_snapshot(store, d.step, manifest=d.manifest).manifest
            rows.append({"step": d.step, "status": "ok", "size_bytes": m.total_bytes,
                         "checksum": m.checksum_algorithm})
        except SnapshotCorrupt as exc:
            rows.append({"step": d.step, "status": "corrupt", "reason": str(exc)})
    return rows


def verify_failed(rows: list[dict[str, Any]]) -> bool:
    """``verify`` exits 1 when a snapshot is corrupt or none verifies (nothing to resume
    from); a partial one alone is no failure: restore skips it."""
    statuses = [r.get("status") for r in rows]
    return "corrupt" in statuses or "ok" not in statuses


def _no_such_step(store: Store, step: int, dirs: list[_Dir]) -> list[_Dir]:
    if not dirs:
        raise ConfigError(f"no snapshot of step {step} under {store.url}: there are no "
                          "snapshots there; fix: check the storage URL (the run root a job "
                          "wrote with --storage, which holds snapshots/)")
    shown = ", ".join(str(d.step) if d.state == "committed" else f"{d.step} ({d.state})"
                      for d in dirs[:_STEPS_SHOWN])
    more = f" and {len(dirs) - _STEPS_SHOWN} older" if len(dirs) > _STEPS_SHOWN else ""
    raise ConfigError(f"no snapshot of step {step} under {store.url}; steps there, newest "
                      f"first: {shown}{more}; fix: pass one of them with --step")


def nothing_found(store: Store) -> str:
    """The one line printed when there is no snapshot to list or verify."""
    return (f"no snapshots under {store.url}; fix: check the storage URL (the run root a job "
            "wrote with --storage, which holds snapshots/)")


def inspect_snapshot(store: Store, step: int) -> dict[str, Any]:
    """The manifest of ``step`` as one row.

    Raises:
        ConfigError: ``step`` is not there (the message lists the steps that are).
        SnapshotCorrupt: it is partial or its manifest is invalid.
    """
    found = next((d for d in _snapshot_dirs(store) if d.step == step), None)
    if found is None:
        _no_such_step(store, step, _snapshot_dirs(store))
    assert found is not None
    if found.manifest is None:
        raise SnapshotCorrupt(f"step {step} is {found.state}: {found.reason}")
    manifest = found.manifest
    row = {"status": "committed", **manifest.model_dump()}
    if manifest.format_version == SHARDED_FORMAT_VERSION:
        row["parts"] = parts_by_rank(manifest)
    return row


def format_inspect(row: dict[str, Any]) -> str:
    """``inspect``'s manifest for people: one field a line, payload objects and per-rank
    parts as indented lines (``--json`` keeps the manifest's own form)."""
    scalars = {k: v for k, v in row.items()
               if k not in ("step", "status", "objects", "parts", "signature")}
    lines = [f"step {row['step']}: {row['status']}"]
    lines += [f"  {k}: {'-' if v is None else v}" for k, v in scalars.items()]
    lines.append(f"  signed: {'yes' if row.get('signature') else 'no'}")
    objects = row.get("objects") or []
    lines.append(f"  objects: {len(objects)}, {sum(o['size_bytes'] for o in objects)} bytes")
    for o in objects:
        rank = f"  rank {o['rank']}" if o.get("rank") is not None else ""
        items = f"  {len(o['items'])} items" if o.get("items") else ""
        lines.append(f"    {o['name']}  {o['size_bytes']} bytes  "
                     f"{row.get('checksum_algorithm')} {o['checksum']}{rank}{items}")
    for part in row.get("parts") or []:
        lines.append(f"  rank {part['rank']}: {part['objects']} objects, {part['items']} "
                     f"items, {part['size_bytes']} bytes")
    return "\n".join(lines)


def prune_snapshots(store: Store, keep: int, *, dry_run: bool = False) -> list[dict[str, Any]]:
    """Delete all but the newest ``keep`` snapshots (the newest verified one always
    kept); one row per step deleted and kept, and per partial write or orphan deleted.
    With ``dry_run``, the same rows, nothing deleted."""
    if keep < 1:
        raise ConfigError(f"--keep={keep}: must be >= 1; the newest verified snapshot is "
                          "never deleted")
    newest = next((r["step"] for r in verify_snapshots(store) if r["status"] == "ok"), None)
    if newest is None:
        return [{"status": "nothing pruned", "reason": "no verified snapshot"}]
    plan = retention.plan(store, keep, newest)
    if not dry_run:
        retention.carry_out(store, plan)
    gone = "would delete" if dry_run else "deleted"
    return [{"step": d.step if d.step is not None else "-", "status": f"{gone} ({d.reason})",
             "path": d.path} for d in plan.deletions] + [
        {"step": s, "status": "kept (newest verified)" if s == newest else "kept"}
        for s in plan.kept]


def export_snapshot(store: Store, out: str, *, step: int | None, fmt: str,
                    with_optimizer: bool, force: bool) -> dict[str, Any]:
    """``export``: the model (and optimizer) of a verified snapshot as one file
    (snapshot/export/); one row saying what was written."""
    from elastictrain.snapshot.export.api import export  # torch: this command only

    done = export(store, out, step=step, format=fmt, with_optimizer=with_optimizer,
                  force=force)
    return {"step": done.step, "status": "exported", "format": done.format, "out": done.path,
            "contents": ",".join(done.contents), "tensors": done.tensors,
            "size_bytes": done.size_bytes}


def format_row(row: dict[str, Any]) -> str:
    return "  ".join(f"{k}={v}" for k, v in row.items())


def print_rows(rows: list[dict[str, Any]], *, as_json: bool) -> None:
    if as_json:
        sys.stdout.write(json.dumps(rows) + "\n")
        return
    for row in rows:
        sys.stdout.write(format_row(row) + "\n")


def memory_rows() -> list[dict[str, Any]]:
    """One row per memory directory of this user on this node (the memory tier's
    directories under ``/dev/shm/elastictrain-<uid>``): its run and storage, steps held,
    bytes, and whether a live process holds it (else how long it has been idle: the
    sweep's measure)."""
    from elastictrain.snapshot.memory import memory  # here: the other commands need no torch

    return [{"path": str(h.path), "run_id": h.run_id, "storage": h.storage,
             "steps": ",".join(str(s) for s in h.steps) or "-", "size_bytes": h.size_bytes,
             "in_use": h.in_use, "idle_s": round(h.idle_s, 1)}
            for h in memory.held()]


def list_memory(*, as_json: bool) -> int:
    rows = memory_rows()
    if not rows and not as_json:
        print(f"nothing held in node memory under {user_root()}", file=sys.stderr)
        return 0
    print_rows(rows, as_json=as_json)
    return 0
