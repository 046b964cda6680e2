"""``elastictrain snapshots list --memory``: what this user holds in this node's memory
(the memory tier's directories under ``/dev/shm/elastictrain-<uid>``), by which run."""

from __future__ import annotations

import sys
from typing import Any

from elastictrain.snapshot import memory


def memory_rows() -> list[dict[str, Any]]:
    """One row per memory directory: its run and storage, steps held, bytes, and whether
    a live process holds it (else how long it has been idle: the sweep's measure)."""
    return [{"path": str(h.path), "run_id": h.run_id, "storage": h.storage,
             "steps": ",".join(str(s) for s in h.steps) or "-", "size_bytes": h.size_bytes,
             "in_use": h.in_use, "idle_s": round(h.idle_s, 1)}
            for h in memory.held()]


def list_memory(as_json: bool) -> int:
    from elastictrain import ops

    rows = memory_rows()
    if not rows and not as_json:
        print(f"nothing held in node memory under {memory.user_root()}", file=sys.stderr)
        return 0
    ops.print_rows(rows, as_json)
    return 0
