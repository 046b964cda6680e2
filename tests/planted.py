"""Snapshots written straight into a store's committed layout (tests only): a valid
manifest and checksum over whatever ``torch.save`` makes of a state, bypassing every
check the writer makes at save time."""

from __future__ import annotations

import io
from typing import Any

import torch

from elastictrain.core import layout
from elastictrain.snapshot.format.checksum import checksum_bytes
from elastictrain.snapshot.format.manifest import Manifest, ObjectEntry
from elastictrain.storage.api import Store


def plant_snapshot(store: Store, step: int, state: Any, world_size: int = 1) -> None:
    """Commit ``state`` as the snapshot of ``step``: payload first, manifest last."""
    buf = io.BytesIO()
    torch.save(state, buf)
    data = buf.getvalue()
    name = layout.PAYLOAD if store.supports_rename else layout.payload_name("00ff")
    store.write_bytes(f"{layout.step_dir(step)}/{name}", data)
    manifest = Manifest(run_id="planted", step=step, epoch=0, world_size=world_size,
                        torch_version=torch.__version__, elastictrain_version="planted",
                        checksum_algorithm="crc32",
                        objects=[ObjectEntry(name=name, size_bytes=len(data),
                                             checksum=checksum_bytes(data, "crc32"))])
    store.write_bytes(f"{layout.step_dir(step)}/{layout.MANIFEST}", manifest.to_json())
