"""A chaos trial's node-memory tier: its own stand-in for /dev/shm, and the memory
faults (schedule.MEMORY_FAULTS) injected into it.

The trial's workers find their memory root through ``ELASTICTRAIN_SHM``; with
``shm_full`` that root is a small tmpfs of its own (mounted here: needs root), filled
by a filler file at the fault's time, so the run must finish on durable snapshots.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import sys
from pathlib import Path

from elastictrain.core import layout
from elastictrain.core.env import SHM_VAR
from elastictrain.core.shm import user_root_in
from elastictrain.snapshot.memory import memory

TMPFS_SIZE = "64m"
NEIGHBOUR_STEPS = 200
FILLER = "filler"


class MemoryNode:
    """The trial's tmpfs root, a neighbour run and the filler; ``close`` undoes all."""

    def __init__(self, workdir: Path, kinds: set[str]) -> None:
        self.root = workdir / "shm"
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o1777)  # like /dev/shm: every user's root beside ours
        self.mounted = False
        if "shm_full" in kinds and os.geteuid() == 0:
            subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE},mode=1777",
                            "tmpfs", str(self.root)], check=True)
            self.mounted = True
        self.neighbour: subprocess.Popen[bytes] | None = None
        self.neighbour_code: int | None = None
        self._workdir = workdir

    def inject(self, kind: str, env: dict[str, str]) -> str | None:
        """One memory fault now; what was done (for the trial's report), or None when
        there is nothing to hit yet (no memory snapshot to corrupt: try again later)."""
        if kind == "shm_neighbour":
            return self._start_neighbour(env)
        if kind == "shm_full":
            return self._fill() if self.mounted else "shm_full not injected (needs root)"
        return self._corrupt()

    def _start_neighbour(self, env: dict[str, str]) -> str:
        root = self._workdir / "neighbour"
        child = {**os.environ, **env, SHM_VAR: str(self.root)}
        for name in ("ELASTICTRAIN_STORAGE__URL", "ELASTICTRAIN_STORAGE__FAULTS",
                     "ELASTICTRAIN_RUN_ID", "TORCHELASTIC_RUN_ID"):
            child.pop(name, None)
        log = open(self._workdir / "neighbour.log", "wb")  # noqa: SIM115 - closed below
        with log:
            self.neighbour = subprocess.Popen(
                [sys.executable, "-m", "elastictrain.chaos.neighbour", str(root),
                 str(NEIGHBOUR_STEPS)], stdout=log, stderr=subprocess.STDOUT, env=child,
                cwd=self._workdir, start_new_session=True)
        return f"shm_neighbour: second run pid {self.neighbour.pid} storage {root}"

    def _fill(self) -> str:
        written = 0
        with open(self.root / FILLER, "wb", buffering=0) as f:
            for chunk in (1 << 20, 4096):
                try:
                    while True:
                        written += f.write(b"\0" * chunk)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
        return f"shm_full: filler of {written} bytes"

    def _corrupt(self) -> str | None:
        """Flip bytes in the middle of every committed memory payload of the trial."""
        hit = []
        for held in memory.held(user_root_in(self.root)):
            if held.storage is None or not held.storage.endswith("/storage"):
                continue  # the neighbour's
            for step in held.steps:
                payload = held.path / layout.step_dir(step) / layout.PAYLOAD
                with contextlib.suppress(OSError), open(payload, "r+b") as f:
                    size = f.seek(0, os.SEEK_END)
                    f.seek(size // 2)
                    f.write(b"\xff" * 64)
                    hit.append(step)
        return f"memory_corrupt: payload of step(s) {hit}" if hit else None

    def finish_neighbour(self, timeout_s: float) -> None:
        """Wait for the neighbour run to end (it trains a few seconds), else kill it."""
        if self.neighbour is None:
            return
        try:
            self.neighbour_code = self.neighbour.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.neighbour.pid, 9)
            self.neighbour_code = self.neighbour.wait()

    def close(self) -> None:
        self.finish_neighbour(0.001)
        with contextlib.suppress(OSError):
            (self.root / FILLER).unlink()
        if self.mounted:
            subprocess.run(["umount", str(self.root)], check=False)
            self.mounted = False
