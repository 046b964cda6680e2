"""DCP storage I/O over elastictrain's Store, with a checksum per write item.

DCP plans which rank writes which chunk and reshards on load; this module only
moves bytes. Each writing rank streams its items, packed back to back as raw
tensor bytes (no pickle), into one object ``rank<R>-<token>.distcp``; every item
records (object, offset, length, checksum, dtype, shape). On load each item is
read by its byte range and verified before DCP copies it into the target shard,
so a rank that reads a slice of another rank's object checks exactly the bytes
it uses, and never holds more than one item beyond its own shard.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    _MEM_FORMAT_ENCODING,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from elastictrain.core.config import ChecksumAlgorithm
from elastictrain.core.errors import SnapshotCorrupt, StorageError
from elastictrain.snapshot.durable.pacing import Pace, PacedWriter
from elastictrain.snapshot.format.checksum import HashingWriter, checksum_bytes
from elastictrain.snapshot.format.tensorbytes import tensor_bytes
from elastictrain.storage.api import Store


@dataclass(frozen=True)
class ItemLocation:
    """Where one DCP write item lives: a byte range of one rank's object."""

    object_name: str
    offset: int
    length: int
    checksum: str
    dtype: str | None  # None for a bytes item (non-tensor state)
    shape: tuple[int, ...]


@dataclass(frozen=True)
class RankPart:
    """What one rank wrote, handed to the coordinator by DCP's ``finish``."""

    rank: int
    object_name: str
    size_bytes: int
    checksum: str
    items: tuple[ItemLocation, ...]


_METADATA_GLOBALS: list[Any] = [
    Metadata, MetadataIndex, TensorStorageMetadata, BytesStorageMetadata, ChunkStorageMetadata,
    TensorProperties, StorageMeta, ItemLocation, _MEM_FORMAT_ENCODING, torch.Size,
    torch.memory_format, torch.layout,
]


def dump_metadata(metadata: Metadata) -> bytes:
    """DCP's global plan as bytes (``torch.save``: loadable with ``weights_only=True``)."""
    buffer = io.BytesIO()
    torch.save(metadata, buffer)
    return buffer.getvalue()


def parse_metadata(data: bytes, where: str) -> Metadata:
    """The inverse of ``dump_metadata``; only DCP's plain metadata classes are allowed."""
    try:
        with torch.serialization.safe_globals(_METADATA_GLOBALS):
            metadata = torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:
        raise SnapshotCorrupt(f"{where}: DCP metadata does not load "
                              f"({type(exc).__name__}: {exc})") from exc
    if not isinstance(metadata, Metadata):
        raise SnapshotCorrupt(f"{where}: DCP metadata is a {type(metadata).__name__}")
    return metadata


def describe_failure(exc: BaseException) -> str:
    """One line per failed rank for DCP's CheckpointException (its str() holds tracebacks)."""
    if not isinstance(exc, CheckpointException):
        return f"{type(exc).__name__}: {exc}"
    return "; ".join(f"rank {rank}: {type(error).__name__}: {error}"
                     for rank, (error, _trace) in sorted(exc.failures.items()))


def _raw_bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    return tensor_bytes(flat)


def _narrow(tensor: torch.Tensor, offsets: torch.Size, lengths: torch.Size) -> torch.Tensor:
    """The part of a saved chunk that a load request asks for (resharding)."""
    for dim, (offset, length) in enumerate(zip(offsets, lengths, strict=True)):
        if length < tensor.size(dim):
            tensor = tensor.narrow(dim, offset, length)
    return tensor


class StoreWriter(StorageWriter):
    """DCP ``StorageWriter`` into ``<step dir>/rank<R>-<token>.distcp``, one object per rank.

    Args:
        store: where the run's snapshots live.
        step_dir: the snapshot directory (``snapshots/step_…``).
        token: unique per save attempt, so an earlier crashed attempt's objects are
            never overwritten or mistaken for this one's.
        algorithm: checksum algorithm of the manifest.
        on_finish: runs on the coordinator with DCP's global metadata and every
            rank's part, after all parts are durable (writes the commit).
        pace: this rank's write held to that pace (snapshot/durable/pacing.py).
    """

    def __init__(self, store: Store, step_dir: str, token: str, algorithm: ChecksumAlgorithm,
                 on_finish: Callable[[Metadata, list[RankPart]], None],
                 pace: Pace | None = None) -> None:
        super().__init__()
        self._store, self._dir, self._token = store, step_dir, token
        self._algorithm = algorithm
        self._pace = pace
        self._on_finish = on_finish
        self._rank = 0
        # True once this rank's part is durable, until the coordinator's finish() starts:
        # then the save waits for the other ranks' parts (and, off rank 0, the commit).
        self.waiting_for_peers = False

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        return None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._rank = int(kwargs.get("rank", 0))

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def object_name(self, rank: int) -> str:
        return f"rank{rank:05d}-{self._token}.distcp"

    def write_data(self, plan: SavePlan,
                   planner: SavePlanner) -> Future[list[WriteResult]]:
        name = self.object_name(self._rank)
        results: list[WriteResult] = []
        items: list[ItemLocation] = []
        with self._store.open_write(f"{self._dir}/{name}") as sink:
            whole = HashingWriter(PacedWriter.wrap(sink, self._pace),
                                  self._algorithm)
            for write_item in plan.items:
                shape: tuple[int, ...]
                data = planner.resolve_data(write_item)
                if write_item.type == WriteItemType.BYTE_IO:
                    assert isinstance(data, io.BytesIO)
                    raw: memoryview = data.getbuffer()
                    dtype, shape = None, ()
                else:
                    assert isinstance(data, torch.Tensor)
                    tensor = data.detach().cpu()
                    raw = _raw_bytes(tensor)
                    dtype = str(tensor.dtype).removeprefix("torch.")
                    shape = tuple(tensor.shape)
                offset = whole.bytes_written
                whole.write(raw)
                location = ItemLocation(name, offset, raw.nbytes,
                                        checksum_bytes(raw, self._algorithm), dtype, shape)
                items.append(location)
                results.append(WriteResult(write_item.index, raw.nbytes, location))
            whole.flush()
        part = RankPart(self._rank, name, whole.bytes_written, whole.hexdigest(), tuple(items))
        # The part rides in the first result's storage_data: DCP gathers results to the
        # coordinator, so finish() learns every rank's object without another collective.
        if results:
            results[0] = WriteResult(results[0].index, results[0].size_in_bytes,
                                     (results[0].storage_data, part))
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        self.waiting_for_peers = True
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        self.waiting_for_peers = False  # the coordinator's own commit: its writes count
        parts: list[RankPart] = []
        storage_data: dict[MetadataIndex, ItemLocation] = {}
        for rank_results in results:
            for i, result in enumerate(rank_results):
                location = result.storage_data
                if i == 0:
                    location, part = location
                    parts.append(part)
                storage_data[result.index] = location
        metadata.storage_data = storage_data
        self._on_finish(metadata, parts)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False

    def storage_meta(self) -> StorageMeta | None:
        return None


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that non-tensor items load with
    ``weights_only=True`` (DCP's own ``load_bytes`` unpickles arbitrary objects)."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


class StoreReader(StorageReader):
    """DCP ``StorageReader`` over a Store: ranged reads, each item verified before use.

    Args:
        store: where the run's snapshots live.
        step_dir: the snapshot directory.
        metadata: DCP's global plan, already verified against the manifest.
        algorithm: checksum algorithm of the manifest.
    """

    def __init__(self, store: Store, step_dir: str, metadata: Metadata,
                 algorithm: ChecksumAlgorithm) -> None:
        super().__init__()
        self._store, self._dir = store, step_dir
        self._metadata = metadata
        self._algorithm = algorithm
        self.bytes_read = 0

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        return None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self._metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool,
                              *args: Any, **kwargs: Any) -> None:
        return None

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        storage: dict[MetadataIndex, ItemLocation] = self._metadata.storage_data
        per_object: dict[str, list[ReadItem]] = {}
        for request in plan.items:
            per_object.setdefault(storage[request.storage_index].object_name, []).append(request)
        for name, requests in per_object.items():
            requests.sort(key=lambda r: storage[r.storage_index].offset)
            path = f"{self._dir}/{name}"
            try:
                with self._store.open_read(path) as source:
                    for request in requests:
                        self._read_one(source, path, storage[request.storage_index],
                                       request, planner)
            except StorageError as exc:
                if isinstance(exc, SnapshotCorrupt):
                    raise
                raise StorageError(f"{self._store.url}/{path}: read failed: {exc}") from exc
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _read_one(self, source: Any, path: str, location: ItemLocation, request: ReadItem,
                  planner: LoadPlanner) -> None:
        source.seek(location.offset)
        buffer = bytearray(location.length)
        got = source.readinto(buffer) if location.length else 0
        where = f"{self._store.url}/{path}"
        if got != location.length:
            raise SnapshotCorrupt(f"{where}: item at offset {location.offset} has {got} of "
                                  f"{location.length} bytes (truncated?)")
        actual = checksum_bytes(memoryview(buffer), self._algorithm)
        if actual != location.checksum:
            raise SnapshotCorrupt(f"{where}: item at offset {location.offset}: "
                                  f"{self._algorithm} {actual} != {location.checksum}")
        self.bytes_read += location.length
        if request.type == LoadItemType.BYTE_IO:
            planner.load_bytes(request, io.BytesIO(bytes(buffer)))
            return
        assert location.dtype is not None
        saved = torch.frombuffer(buffer, dtype=torch.uint8) if location.length else \
            torch.empty(0, dtype=torch.uint8)
        tensor = saved.view(getattr(torch, location.dtype)).reshape(location.shape)
        tensor = _narrow(tensor, request.storage_offsets, request.lengths)
        target = planner.resolve_tensor(request).detach()
        if target.size() != tensor.size():
            raise SnapshotCorrupt(f"{where}: item {request.storage_index.fqn} has shape "
                                  f"{tuple(tensor.size())}, the target {tuple(target.size())}")
        target.copy_(tensor)
        planner.commit_tensor(request, target)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False
