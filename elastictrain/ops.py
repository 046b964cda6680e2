"""Operator tooling behind ``elastictrain snapshots …``: list, verify, inspect, prune."""

from __future__ import annotations

import json
import sys
from typing import Any

from elastictrain.config import load_settings
from elastictrain.errors import ConfigError, SnapshotCorrupt
from elastictrain.snapshot.manifest import SHARDED_FORMAT_VERSION
from elastictrain.snapshot.reader import newest_first, read_manifest, verify_snapshot
from elastictrain.snapshot.retention import prune
from elastictrain.snapshot.sharded.commit import parts_by_rank
from elastictrain.storage import Store, open_store


def parse_storage_options(text: str | None, flag: str = "--storage-options") -> dict[str, Any]:
    """The JSON object given on the command line ({} when absent). The error never
    quotes the text: it may hold a secret."""
    if not text:
        return {}
    try:
        options = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{flag} is not JSON ({exc.msg} at character {exc.pos}); fix: pass "
                          'a JSON object such as \'{"anon": true}\'') from None
    if not isinstance(options, dict):
        raise ConfigError(f"{flag} must be a JSON object, got a {type(options).__name__}; "
                          'fix: pass a JSON object such as \'{"anon": true}\'')
    return options


def open_from_cli(url: str, storage_options_json: str | None) -> Store:
    """The store at ``url`` with every storage setting applied: ``ELASTICTRAIN_STORAGE__*``
    and the config file, then ``--storage-options`` (and fsspec's ``FSSPEC_S3_*``)."""
    storage: dict[str, Any] = {"url": url}
    options = parse_storage_options(storage_options_json)
    if options:
        storage["storage_options"] = options
    return open_store(load_settings(storage=storage).storage)


def list_snapshots(store: Store) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for c in newest_first(store):
        if c.manifest is None:
            rows.append({"step": c.step, "status": "partial", "reason": c.problem})
            continue
        m = c.manifest
        rows.append({"step": c.step, "status": "committed", "epoch": m.epoch,
                     "world_size": m.world_size, "size_bytes": m.total_bytes,
                     "created_at": m.created_at})
    return rows


def verify_snapshots(store: Store, step: int | None = None) -> list[dict[str, Any]]:
    """One row per snapshot (newest first, or just ``step``): ok or corrupt. A read
    error is raised, never reported as corruption."""
    rows = []
    for c in newest_first(store):
        if step is not None and c.step != step:
            continue
        if c.manifest is None:
            rows.append({"step": c.step, "status": "corrupt", "reason": c.problem})
            continue
        try:
            m = verify_snapshot(store, c.step, manifest=c.manifest).manifest
            rows.append({"step": c.step, "status": "ok", "size_bytes": m.total_bytes,
                         "checksum": m.checksum_algorithm})
        except SnapshotCorrupt as exc:
            rows.append({"step": c.step, "status": "corrupt", "reason": str(exc)})
    return rows


def nothing_found(store: Store, step: int | None = None) -> str:
    """The one line printed when there is no snapshot to list or verify."""
    what = f"no snapshot of step {step}" if step is not None else "no snapshots"
    return (f"{what} under {store.url}; fix: check the storage URL (the run root a job "
            "wrote with --storage, which holds snapshots/)")


def inspect_snapshot(store: Store, step: int) -> dict[str, Any]:
    manifest = read_manifest(store, step)
    row = {"status": "committed", **manifest.model_dump()}
    if manifest.format_version == SHARDED_FORMAT_VERSION:
        row["parts"] = parts_by_rank(manifest)
    return row


def prune_snapshots(store: Store, keep: int) -> list[dict[str, Any]]:
    if keep < 1:
        raise ConfigError(f"--keep={keep}: must be >= 1; the newest verified snapshot is "
                          "never deleted")
    newest = next((r["step"] for r in verify_snapshots(store) if r["status"] == "ok"), None)
    if newest is None:
        return [{"status": "nothing pruned", "reason": "no verified snapshot"}]
    pruned = prune(store, keep, newest)
    return [{"step": s, "status": "pruned"} for s in pruned] + [
        {"step": newest, "status": "kept (newest verified)"}]


def print_rows(rows: list[dict[str, Any]], as_json: bool) -> None:
    if as_json:
        sys.stdout.write(json.dumps(rows) + "\n")
        return
    for row in rows:
        sys.stdout.write("  ".join(f"{k}={v}" for k, v in row.items()) + "\n")

