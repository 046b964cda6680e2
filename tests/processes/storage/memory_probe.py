"""Child process for the memory test: how much Python memory does persisting a state
take beyond the state itself? Run in its own process so that the moto server (in
the test process) is not counted.

    python -m tests.processes.storage.memory_probe ENDPOINT BUCKET STATE_MB PART_MB CONCURRENCY

Prints one JSON object: the tracemalloc peak while elastictrain persists the
state, and the peak of s3fs's own buffered writer (``fs.open(…, "wb")``) on the
same bytes, which keeps up to a 50 MB block: what a full second copy looks like.
"""

from __future__ import annotations

import json
import sys
import tracemalloc

import torch

from elastictrain.snapshot.durable.commit import persist_snapshot, serialize_payload
from elastictrain.snapshot.format.manifest import SnapshotMeta
from elastictrain.storage import FsspecStore
from tests.s3server import FAKE_KEY, FAKE_SECRET

MIB = 2**20


def main(endpoint: str, bucket: str, state_mb: int, part_mb: int, concurrency: int) -> None:
    options = {"key": FAKE_KEY, "secret": FAKE_SECRET, "client_kwargs": {"endpoint_url": endpoint}}
    store = FsspecStore(f"s3://{bucket}/probe", options, part_size_bytes=part_mb * MIB,
                        multipart_threshold_bytes=part_mb * MIB, upload_concurrency=concurrency)
    # torch allocates tensor storage outside Python's allocator: tracemalloc sees only
    # the copies the write path makes, which is what this measures.
    state = {f"w{i}": torch.randn(state_mb * MIB // 4 // 8) for i in range(8)}
    store.check_writable()  # warm up: clients, service models, connection pool
    meta = SnapshotMeta(run_id="probe", step=1, epoch=0, world_size=1, checksum_algorithm="crc32")

    tracemalloc.start()
    manifest = persist_snapshot(store, state, meta)
    _, ours = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert manifest is not None

    fs = store.fs
    tracemalloc.start()
    with fs.open(f"{bucket}/probe/buffered.pt", "wb") as f:
        serialize_payload(state, f, "crc32")
    _, buffered = tracemalloc.get_traced_memory()
    tracemalloc.stop()

    etag = fs.info(f"{store.root}/snapshots/step_000000000001/{manifest.objects[0].name}")["ETag"]
    print(json.dumps({"state_bytes": manifest.total_bytes, "peak_bytes": ours,
                      "buffered_peak_bytes": buffered, "etag": etag}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *(int(a) for a in sys.argv[3:6]))
