"""Names in a run's storage root. See DESIGN.md "Snapshot layout".

    <root>/snapshots/step_000000001200/state.pt       payload (torch.load weights_only)
                                   or state-<token>.pt on object stores (one per writer)
    <root>/snapshots/step_000000001200/MANIFEST.json  written last: the commit marker
    <root>/snapshots/.partial-step_…-<id>/            local staging dir, renamed on commit
    <root>/events/                                    per-attempt JSON-lines event logs
    <root>/suspect/step_…-<id>/                       set-aside snapshots (durable/suspects.py)
"""

from __future__ import annotations

import re

SNAPSHOTS = "snapshots"
SUSPECT = "suspect"
MANIFEST = "MANIFEST.json"
PAYLOAD = "state.pt"
PARTIAL_PREFIX = ".partial-"

_STEP_DIR = re.compile(r"^step_(\d{12})$")
_PAYLOAD_NAME = re.compile(r"^state(-[0-9a-f]{1,32})?\.pt$")
# The names snapshot/sharded/commit.py and dcp_io.StoreWriter give a sharded snapshot's
# objects.
_SHARDED_OBJECT_NAME = re.compile(
    r"^(rank\d{5}-[0-9a-f]{1,32}\.distcp|dcp-[0-9a-f]{1,32}\.metadata|train-[0-9a-f]{1,32}\.pt)$")


def step_dir(step: int) -> str:
    """Relative path of the snapshot of ``step`` (zero-padded: sorts lexically)."""
    if step < 0 or step >= 10**12:
        raise ValueError(f"step={step} is outside [0, 10**12)")
    return f"{SNAPSHOTS}/step_{step:012d}"


def parse_step(name: str) -> int | None:
    """The step of a ``step_…`` directory name, or None for anything else."""
    match = _STEP_DIR.match(name)
    return int(match.group(1)) if match else None


def partial_dir(step: int, token: str) -> str:
    """A unique staging directory for a local commit-by-rename."""
    return f"{SNAPSHOTS}/{PARTIAL_PREFIX}step_{step:012d}-{token}"


def is_partial(name: str) -> bool:
    return name.startswith(PARTIAL_PREFIX)


def payload_name(token: str | None = None) -> str:
    """The payload object's name: ``state.pt``, or ``state-<token>.pt`` where there is
    no rename (object stores), so two writers of one step never overwrite each
    other's payload and the manifest that wins names exactly one of them."""
    return PAYLOAD if token is None else f"state-{token}.pt"


def is_payload(name: str) -> bool:
    """Whether ``name`` is a payload object name (and safe to join to a path)."""
    return _PAYLOAD_NAME.match(name) is not None


def is_sharded_object(name: str) -> bool:
    """Whether ``name`` is a sharded snapshot's object: a rank's part, the DCP metadata or
    the training state (retention deletes those no committed manifest names)."""
    return _SHARDED_OBJECT_NAME.match(name) is not None
