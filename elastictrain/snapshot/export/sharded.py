"""A sharded (FSDP2 / DCP) snapshot's state as full tensors, one at a time.

DCP's metadata lists every tensor of the saved state with its full size and the chunks
the ranks saved of it; our storage data says where each chunk's bytes lie (object,
offset, length, checksum: ``sharded/dcp_io.py``). A full tensor is allocated, each of
its chunks read and checked against its checksum and copied in (a chunk that is one
contiguous range of the full tensor, as FSDP2's row shards are, is read straight into
it), and the tensor handed on before the next is read. The same whatever the world
size that saved it: the chunks say where they go.

DCP flattens the state it saves (``optimizer.state.0.weight.exp_avg``); the planner's
mapping, saved with the metadata, gives each flattened name its path in the original
state (``("optimizer", "state", "0.weight", "exp_avg")``), from which the tree is rebuilt.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from elastictrain.core import layout
from elastictrain.core.errors import SnapshotCorrupt, SnapshotUnloadable, StorageNotFoundError
from elastictrain.snapshot.export.contents import TensorRef, put
from elastictrain.snapshot.format.checksum import checksum_bytes
from elastictrain.snapshot.format.manifest import Manifest
from elastictrain.snapshot.format.reader import verify_snapshot
from elastictrain.snapshot.format.sharded_reader import object_of, read_object
from elastictrain.snapshot.format.tensorbytes import tensor_bytes
from elastictrain.snapshot.sharded.dcp_io import ItemLocation, parse_metadata
from elastictrain.storage.api import Store

_PARTS = ("model", "optimizer")


@dataclass(frozen=True)
class _Saved:
    """A tensor DCP saved: its flattened name and the chunks that make it up."""

    fqn: str
    chunks: tuple[ChunkStorageMetadata, ...]


class ShardedSource:
    """The model and optimizer of a format-2 snapshot, as full tensors.

    Call order: ``tree`` (at once) → ``tensors(wanted)`` → ``finish()`` → ``close()``.
    The whole snapshot is verified first (every object against the manifest, as
    ``elastictrain snapshots verify`` does); each chunk is checked again as it is read.

    Raises (from the constructor):
        SnapshotCorrupt: a part is missing, truncated or fails its checksum.
        SnapshotUnloadable: the metadata verifies but does not say how to rebuild the
            state (saved without DCP's flattening).
        StorageError: a read failed (after the store's retries).
    """

    def __init__(self, store: Store, manifest: Manifest) -> None:
        self._store = store
        self._dir = layout.step_dir(manifest.step)
        self._where = f"{store.url}/{self._dir}"
        self._algorithm = manifest.checksum_algorithm
        self._files = contextlib.ExitStack()
        self._open: dict[str, BinaryIO] = {}
        verify_snapshot(store, manifest.step, manifest=manifest)
        data = read_object(store, manifest, object_of(manifest, "dcp-", self._where))
        self._metadata: Metadata = parse_metadata(data, self._where)
        self._locations: dict[MetadataIndex, ItemLocation] = self._metadata.storage_data
        self.tree: dict[str, Any] = {}
        for fqn, path in self._paths().items():
            if path and path[0] in _PARTS:
                put(self.tree, tuple(path), self._value(fqn))

    def order(self, wanted: list[TensorRef]) -> list[TensorRef]:
        """The order ``tensors`` reads them in: the tree's."""
        return list(wanted)

    def tensors(self, wanted: list[TensorRef]) -> Iterator[tuple[TensorRef, torch.Tensor]]:
        """Each wanted tensor, whole and contiguous; the caller owns it."""
        for ref in wanted:
            yield ref, self._assemble(ref)

    def finish(self) -> None:
        """Nothing left to check: every chunk was checked as it was read."""

    def close(self) -> None:
        self._files.close()
        self._open.clear()

    def _paths(self) -> dict[str, tuple[Any, ...]]:
        mappings = self._metadata.planner_data
        if not isinstance(mappings, dict) or not mappings:
            raise SnapshotUnloadable(f"{self._where}: the DCP metadata has no mapping from "
                                     "flattened names to the state (saved unflattened?), "
                                     "so the state cannot be rebuilt; fix: restore it into "
                                     "the model with SnapshotManager.restore")
        return {str(k): tuple(v) for k, v in mappings.items()}

    def _value(self, fqn: str) -> Any:
        """A TensorRef for a saved tensor; a small non-tensor value, read and loaded."""
        saved = self._metadata.state_dict_metadata.get(fqn)
        if isinstance(saved, TensorStorageMetadata):
            return TensorRef(saved.properties.dtype, tuple(saved.size),
                             _Saved(fqn, tuple(saved.chunks)))
        if isinstance(saved, BytesStorageMetadata):
            data = self._read(self._location(MetadataIndex(fqn)))
            return torch.load(io.BytesIO(data), weights_only=True)
        raise SnapshotCorrupt(f"{self._where}: the DCP metadata maps {fqn!r} to no saved item")

    def _assemble(self, ref: TensorRef) -> torch.Tensor:
        saved: _Saved = ref.where
        full = torch.empty(ref.shape, dtype=ref.dtype)
        covered = 0
        for chunk in sorted(saved.chunks, key=lambda c: tuple(c.offsets)):
            if _numel(chunk.sizes) == 0:
                continue  # a rank that holds none of it
            location = self._location(MetadataIndex(saved.fqn, chunk.offsets))
            rows = _rows_of(full, chunk)
            if rows is not None:  # one range of the full tensor: read straight into it
                self._read_into(location, tensor_bytes(rows))
            elif location.length:
                part = torch.frombuffer(self._read(location), dtype=ref.dtype)
                _region(full, chunk).copy_(part.reshape(tuple(chunk.sizes)))
            covered += _numel(chunk.sizes)
        if covered != full.numel():
            raise SnapshotCorrupt(f"{self._where}: the chunks of {saved.fqn} hold {covered} "
                                  f"of its {full.numel()} elements")
        return full

    def _location(self, index: MetadataIndex) -> ItemLocation:
        location = self._locations.get(index)
        if location is None:
            raise SnapshotCorrupt(f"{self._where}: no saved bytes for {index.fqn} at "
                                  f"{tuple(index.offset or ())}")
        return location

    def _read(self, location: ItemLocation) -> bytearray:
        """The item's bytes, checked against its checksum."""
        buffer = bytearray(location.length)
        self._read_into(location, memoryview(buffer))
        return buffer

    def _read_into(self, location: ItemLocation, into: memoryview) -> None:
        """Read the item into ``into`` (its exact size) and check its checksum."""
        where = f"{self._where}/{location.object_name}"
        if into.nbytes != location.length:
            raise SnapshotCorrupt(f"{where}: item at offset {location.offset} has "
                                  f"{location.length} bytes, its tensor {into.nbytes}")
        source = self._file(location.object_name)
        source.seek(location.offset)
        got = 0
        while got < location.length:
            n = source.readinto(into[got:])  # type: ignore[attr-defined]
            if not n:
                break
            got += n
        if got != location.length:
            raise SnapshotCorrupt(f"{where}: item at offset {location.offset} has {got} of "
                                  f"{location.length} bytes (truncated?)")
        actual = checksum_bytes(into, self._algorithm)
        if actual != location.checksum:
            raise SnapshotCorrupt(f"{where}: item at offset {location.offset}: "
                                  f"{self._algorithm} {actual} != {location.checksum}")

    def _file(self, name: str) -> BinaryIO:
        if name not in self._open:
            if not layout.is_sharded_object(name):
                raise SnapshotCorrupt(f"{self._where}: the metadata names object {name!r}")
            path = f"{self._dir}/{name}"
            try:
                self._open[name] = self._files.enter_context(self._store.open_read(path))
            except StorageNotFoundError as exc:
                raise SnapshotCorrupt(f"{self._store.url}/{path}: missing ({exc})") from exc
        return self._open[name]


def _numel(sizes: Any) -> int:
    count = 1
    for n in sizes:
        count *= int(n)
    return count


def _region(full: torch.Tensor, chunk: ChunkStorageMetadata) -> torch.Tensor:
    """The part of ``full`` that ``chunk`` covers (a view)."""
    region = full
    for dim, (offset, size) in enumerate(zip(chunk.offsets, chunk.sizes, strict=True)):
        region = region.narrow(dim, int(offset), int(size))
    return region


def _rows_of(full: torch.Tensor, chunk: ChunkStorageMetadata) -> torch.Tensor | None:
    """The chunk as one contiguous range of ``full`` (a flat view), or None when its
    elements are not one range (a split along another dimension than the first)."""
    if full.dim() == 0:
        return full.reshape(-1)
    if any(int(o) for o in chunk.offsets[1:]) or \
            tuple(int(s) for s in chunk.sizes[1:]) != tuple(full.shape[1:]):
        return None
    return _region(full, chunk).reshape(-1)
