"""Snapshots set aside as suspect: restored, they made no sense (sense_check.py).

A suspect snapshot is kept, never deleted, and never restored again: it moves out of
``snapshots/`` into a folder of its own beside the record of why::

    <root>/suspect/step_000000001200-<token>/SUSPECT.json   the record (written first)
    <root>/suspect/step_000000001200-<token>/snapshot/      the snapshot's objects

Out of ``snapshots/``, no restore, retention or later save of the same step sees it (a
save of that step after the fallback writes a new snapshot, it does not meet the old
one; format/commitmark.move_committed moves it). A record without a
moved snapshot is a memory-tier copy (node memory is a cache: its copies of the step
and later are dropped) or a step whose durable copy was already gone.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import asdict, dataclass
from datetime import datetime, timezone

from elastictrain.core import layout
from elastictrain.core.errors import StorageError
from elastictrain.core.log import get_logger
from elastictrain.snapshot.format.commitmark import is_committed, move_committed
from elastictrain.snapshot.format.reader import list_snapshot_dirs
from elastictrain.storage.api import Store

log = get_logger("elastictrain.snapshot")

RECORD = "SUSPECT.json"


@dataclass(frozen=True)
class SuspectRecord:
    """Why one restored snapshot was set aside."""

    step: int  # the snapshot's step
    tier: str  # where it was restored from: "durable" or "memory"
    reason: str  # what made no sense, in words
    at_step: int  # the training step at which it showed
    loss: float | None  # the loss that showed it (None: a parameter, or none given)
    recorded_loss: float | None  # the loss recorded with the snapshot
    run_id: str
    launch_id: str | None
    time: str = ""
    moved_to: str | None = None  # the snapshot's objects now (None: nothing moved)
    # Set aside because it was taken after the restore of that suspect step.
    descends_from: int | None = None

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), indent=2, sort_keys=True).encode()


def set_aside(store: Store, record: SuspectRecord) -> SuspectRecord:
    """Record why ``record.step`` is suspect, then move its durable snapshot (if one is
    committed there) out of ``snapshots/``. Returns the record as written."""
    folder = f"{layout.SUSPECT}/step_{record.step:012d}-{uuid.uuid4().hex[:8]}"
    moving = is_committed(store, record.step)
    written = SuspectRecord(**{**asdict(record),
                               "time": datetime.now(timezone.utc).isoformat(),
                               "moved_to": f"{folder}/snapshot" if moving else None})
    store.write_bytes(f"{folder}/{RECORD}", written.to_json())
    if moving:
        move_committed(store, record.step, f"{folder}/snapshot")
    return written


def suspects(store: Store) -> list[SuspectRecord]:
    """Every record under ``suspect/``, oldest step first; unreadable ones are skipped
    with a warning (they never decide anything alone)."""
    found = []
    for folder in store.list_dir(layout.SUSPECT):
        try:
            data = json.loads(store.read_bytes(f"{layout.SUSPECT}/{folder}/{RECORD}"))
            found.append(SuspectRecord(**data))
        except (StorageError, ValueError, TypeError) as error:
            log.warning("snapshot.suspect_unreadable", folder=folder, error=str(error)[:200])
    return sorted(found, key=lambda r: (r.step, r.time))


def in_a_row(store: Store) -> tuple[list[SuspectRecord], int | None]:
    """The restores found suspect above the newest committed snapshot (the fallbacks
    since the run last trained past them; their descendants not counted) and that
    snapshot's step (None: none committed)."""
    # Newest first: the first committed one is the head (no marker below it is read).
    head = next((s for s in list_snapshot_dirs(store) if is_committed(store, s)), None)
    return [r for r in suspects(store) if r.descends_from is None
            and (head is None or r.step > head)], head
