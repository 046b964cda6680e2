"""Which run a storage holds: the run id that every launch on it goes by.

A job's snapshots live in its storage, and every launch on that storage resumes from
them, so the storage *is* the job: a relaunch after Ctrl-C, a preemption or a requeue
continues it. The first launch whose manager accepts the storage records its run id in
``RUN`` (a create-only write, after the manager's checks: a refused storage gets
nothing written); every later launch adopts that id, so their events share one directory
(``events/<run id>/``, launches told apart by ``launch_id``) and ``status`` and
``goodput`` read the whole job. A run id the user names (``ELASTICTRAIN_RUN_ID``, or
``run_id=`` to the manager) is used as given.

The marker is a convenience, never a reason to stop training: a marker that cannot be
read or written leaves this launch under its own id (with a warning), and a marker
that is not ours (not JSON, no id) is left untouched.
"""

from __future__ import annotations

import json
import re
import time
import uuid

from elastictrain.core.errors import StorageConflictError, StorageError, StorageNotFoundError
from elastictrain.core.log import get_logger
from elastictrain.runlog.events import launch_id
from elastictrain.storage import Store

log = get_logger("elastictrain.runlog")

RUN_MARKER = "RUN"
# torchrun's run id when none was given (``--rdzv-id`` defaults to "none"), and the
# worker's without a launcher: not names a second launch could tell apart.
UNNAMED = frozenset({"", "none", "local"})
# A run id names a directory: what a marker written by someone else may not smuggle in.
_SAFE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def generated_run_id() -> str:
    """A fresh run id (``et-<UTC time>-<6 hex>``)."""
    return f"et-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{uuid.uuid4().hex[:6]}"


def storage_run_id(store: Store, proposed: str, *, named: bool = False) -> str:
    """The run id of the job in ``store``: the one its marker records, else ``proposed``
    (an unnamed one replaced by one made from this launch's id, the same for every
    worker of the launch). Reads only: :func:`record_run_id` writes the marker once the
    manager has accepted the storage. With ``named`` (the user chose ``proposed``) it is
    returned as given."""
    if named:
        return proposed
    if proposed in UNNAMED:
        proposed = f"et-{launch_id()}"
    return _read(store) or proposed


def record_run_id(store: Store, run_id: str) -> None:
    """Record ``run_id`` as the storage's run unless one is recorded already (a
    create-only write: the first launch wins, and one that is not ours stays)."""
    body = json.dumps({"run_id": run_id, "created": time.time()}).encode()
    try:
        store.write_bytes(RUN_MARKER, body, if_absent=True)
    except StorageConflictError:
        return  # recorded already (this run's, an earlier launch's, or not ours)
    except (StorageError, OSError) as exc:
        log.warning("run.marker_unwritable", error=str(exc)[:300])


def _read(store: Store) -> str | None:
    try:
        data = json.loads(store.read_bytes(RUN_MARKER))
    except StorageNotFoundError:
        return None
    except (StorageError, OSError) as exc:
        log.warning("run.marker_unreadable", error=str(exc)[:300])
        return None
    except ValueError:
        log.warning("run.marker_foreign", path=RUN_MARKER,
                    reason="not JSON; left as it is")
        return None
    run_id = data.get("run_id") if isinstance(data, dict) else None
    if not isinstance(run_id, str) or not _SAFE_ID.fullmatch(run_id):
        log.warning("run.marker_foreign", path=RUN_MARKER,
                    reason="no usable run_id; left as it is")
        return None
    return run_id
