"""Child process for the restore memory test: peak resident memory of restoring a
snapshot from S3, over the state's size. Run in its own process so that neither the
moto server nor the writer's copy of the state is counted.

    python -m tests.processes.storage.restore_memory_probe ENDPOINT URL {restore|whole}

``restore`` is elastictrain's restore (rank 0's read in any mode); ``whole`` is the
read-everything-then-deserialize baseline (``read_bytes`` + ``torch.load``). Prints
one JSON object: state bytes and the peak RSS growth during the restore (VmHWM,
reset just before it through /proc/self/clear_refs).
"""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import torch

from elastictrain.snapshot.durable.restore import load_newest
from elastictrain.snapshot.format.reader import read_manifest
from elastictrain.storage import FsspecStore
from elastictrain.worker.dist import DistContext
from tests.s3server import FAKE_KEY, FAKE_SECRET


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def main(endpoint: str, url: str, how: str) -> None:
    options = {"key": FAKE_KEY, "secret": FAKE_SECRET, "client_kwargs": {"endpoint_url": endpoint}}
    store = FsspecStore(url, options)
    manifest = read_manifest(store, 1)  # warm up: clients, service models, connections
    torch.load(io.BytesIO(_tiny()), weights_only=True)  # and torch.load's code paths
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current RSS
    baseline = _status_kib("VmRSS")
    if how == "restore":
        loaded = load_newest(store, DistContext(0, 1, 0, "gloo", torch.device("cpu"), False))
        assert loaded is not None and loaded.step == 1
    else:
        data = store.read_bytes(f"snapshots/step_000000000001/{manifest.objects[0].name}")
        state = torch.load(io.BytesIO(data), weights_only=True)
        assert "w0" in state
    peak = _status_kib("VmHWM")
    print(json.dumps({"state_bytes": manifest.total_bytes,
                      "peak_growth_bytes": (peak - baseline) * 1024}))


def _tiny() -> bytes:
    buf = io.BytesIO()
    torch.save({"x": torch.zeros(1)}, buf)
    return buf.getvalue()


if __name__ == "__main__":
    main(*sys.argv[1:4])
