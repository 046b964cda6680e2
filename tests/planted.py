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


def rewrite_payload(store: Store, step: int, change: Any) -> None:
    """Replace the model of the committed replicated snapshot of ``step`` with
    ``change(name, tensor)`` of each of its tensors, checksummed anew under the same
    manifest (its loss, run and attempt kept): the bytes verify, the state is another."""
    from elastictrain.snapshot.format.reader import read_manifest

    manifest = read_manifest(store, step)
    [entry] = manifest.objects
    path = f"{layout.step_dir(step)}/{entry.name}"
    payload = torch.load(io.BytesIO(store.read_bytes(path)), weights_only=True)
    payload["model"] = {name: change(name, tensor) for name, tensor in payload["model"].items()}
    buf = io.BytesIO()
    torch.save(payload, buf)
    data = buf.getvalue()
    store.write_bytes(path, data)
    entry = ObjectEntry(name=entry.name, size_bytes=len(data),
                        checksum=checksum_bytes(data, manifest.checksum_algorithm))
    rewritten = manifest.model_copy(update={"objects": [entry], "signature": None})
    store.write_bytes(f"{layout.step_dir(step)}/{layout.MANIFEST}", rewritten.to_json())
