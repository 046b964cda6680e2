"""Sample accounting for the demo: per optimizer step, the samples each rank trained.

With ``--record-samples DIR`` every worker appends one JSON line per optimizer
step to ``DIR/attemptNNN-rankR-pidP.jsonl``::

    {"world": "<id>", "step": 12, "epoch": 0, "rank": 1, "world_size": 2,
     "samples": [...], "ts": ...}

``world`` identifies one formation of the process group (rank 0 draws it and
broadcasts it), so the lines of one attempt can be told apart from those of
a step redone after a restart. A step is recorded after its backward passes and
before its optimizer step: the snapshot of step ``s`` comes after it
(``SnapshotManager.step()``), and so does the boundary record of ``s`` that each
rank sends to the other nodes from inside its optimizer step, without which no
survivor rescues ``s``. A committed or rescued snapshot of ``s`` therefore
implies every rank recorded ``s``. One ``write`` per line, so a SIGKILL leaves
whole lines only.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path

from elastictrain.worker.session import Runtime


class SampleRecorder:
    """Appends this rank's trained samples, one JSON line per optimizer step."""

    def __init__(self, path: Path, world: str, rank: int, world_size: int) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._fixed = {"world": world, "rank": rank, "world_size": world_size}

    @classmethod
    def open(cls, directory: str, rt: Runtime) -> SampleRecorder:
        """Start recording (a collective: every rank must call it, with a directory)."""
        world = rt.ctx.broadcast_object(uuid.uuid4().hex if rt.ctx.is_writer else None)
        name = f"attempt{rt.env.restart_count:03d}-rank{rt.rank}-pid{os.getpid()}.jsonl"
        return cls(Path(directory) / name, str(world), rt.rank, rt.world_size)

    def record(self, step: int, epoch: int, samples: list[int]) -> None:
        line = {**self._fixed, "step": step, "epoch": epoch, "samples": samples,
                "ts": round(time.time(), 6)}
        os.write(self._fd, (json.dumps(line, separators=(",", ":")) + "\n").encode())

    def close(self) -> None:
        os.close(self._fd)
