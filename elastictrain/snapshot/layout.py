"""Names in a run's storage root. See DESIGN.md "Snapshot layout".

    <root>/snapshots/step_000000001200/state.pt       payload (torch.load weights_only)
    <root>/snapshots/step_000000001200/MANIFEST.json  written last: the commit marker
    <root>/snapshots/.partial-step_…-<id>/            local staging dir, renamed on commit
    <root>/events/                                    per-attempt JSON-lines event logs
"""

from __future__ import annotations

import re

SNAPSHOTS = "snapshots"
EVENTS = "events"
MANIFEST = "MANIFEST.json"
PAYLOAD = "state.pt"
PARTIAL_PREFIX = ".partial-"

_STEP_DIR = re.compile(r"^step_(\d{12})$")


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
