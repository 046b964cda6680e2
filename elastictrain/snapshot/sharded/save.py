"""Sharded save: every rank stages its shards, persists in the background, one commit.

Call order (every rank, at the same step)::

    saver.save(train_state, meta)   # wait for the save in flight (back-pressure) →
                                    # get_state_dict → copy shards into reusable CPU
                                    # buffers (snapshot.staged) → DCP in a thread:
                                    #   plan (metadata collectives) → write own object →
                                    #   results gathered to rank 0 → rank 0 commits,
                                    #   then retention → the outcome to every rank
    saver.failed_step()             # agreed by the manager at its next collective
    saver.close()

The background collectives (DCP's plan exchange and result gather) run on a
dedicated gloo group created once, never on the training group, so they cannot
interleave with the training loop's collectives. A failure on any rank reaches
every rank: DCP gathers every rank's write outcome before the coordinator
commits and sends the outcome back to all.
"""

from __future__ import annotations

import contextvars
import copy
import io
import time
import uuid
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as torch_dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.tensor import DTensor

from elastictrain.core import layout
from elastictrain.core.errors import SnapshotCorrupt, SnapshotWriteFailed
from elastictrain.core.log import get_logger
from elastictrain.snapshot.durable.persister import SaveHandle, SaveState
from elastictrain.snapshot.durable.restore import LoadedSnapshot
from elastictrain.snapshot.durable.retention import prune
from elastictrain.snapshot.durable.saver import InFlightSave, background_pace
from elastictrain.snapshot.durable.saver_interface import LoadRequest, SaverSettings
from elastictrain.snapshot.format.manifest import Manifest, SnapshotMeta
from elastictrain.snapshot.sharded.commit import commit_sharded
from elastictrain.snapshot.sharded.dcp_io import (
    RankPart,
    StoreWriter,
    describe_failure,
    dump_metadata,
)
from elastictrain.snapshot.sharded.restore import load_newest_sharded
from elastictrain.snapshot.sharded.state import current_state
from elastictrain.storage.api import Store
from elastictrain.worker.dist import DistContext

log = get_logger("elastictrain.snapshot")


def background_group(ctx: DistContext) -> Any | None:
    """A gloo group for snapshot collectives off the training thread (every rank calls
    this once, at the same point); None in a single process."""
    return torch_dist.new_group(backend="gloo") if ctx.initialized else None


class _ReusedStaging:
    """DCP stager that copies state into CPU buffers allocated once and reused
    (the next save waits for the previous one, so they are free again).

    Buffers are allocated empty, shard by shard: torch's own helper
    (``_create_cpu_state_dict``) deep-copies each CPU DTensor first, so the first
    save would hold the state twice.
    """

    _synchronize_after_execute = False
    should_synchronize_after_execute = False

    def __init__(self) -> None:
        self._buffers: dict[str, Any] | None = None
        self.nbytes = 0

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        if self._buffers is None:
            self._buffers = _empty_like(state_dict)
            self.nbytes = _local_bytes(self._buffers)
        staged = _copy_into(state_dict, self._buffers)
        assert isinstance(staged, dict)
        return staged

    def synchronize_staging(self) -> None:
        return None

    def close(self) -> None:
        self._buffers = None


def _empty_like(state: Any) -> Any:
    if isinstance(state, dict):
        return {k: _empty_like(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_empty_like(v) for v in state]
    if isinstance(state, DTensor):
        return DTensor.from_local(torch.empty_like(state.to_local(), device="cpu"),
                                  state.device_mesh, state.placements, run_check=False,
                                  shape=state.shape, stride=state.stride())
    if isinstance(state, torch.Tensor):
        return torch.empty_like(state, device="cpu")
    return None  # not a tensor: staged by value at each save


def _copy_into(state: Any, buffers: Any) -> Any:
    """``state`` with every tensor replaced by its buffer, refilled (shape-checked)."""
    if isinstance(state, dict):
        return {k: _copy_into(v, buffers[k]) for k, v in state.items()}
    if isinstance(state, list):
        return [_copy_into(v, b) for v, b in zip(state, buffers, strict=True)]
    if isinstance(state, DTensor):
        buffers.to_local().copy_(state.to_local())
        return buffers
    if isinstance(state, torch.Tensor):
        buffers.copy_(state)
        return buffers
    return copy.deepcopy(state)


def _local_bytes(state: Any) -> int:
    if isinstance(state, dict):
        return sum(_local_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_local_bytes(v) for v in state)
    if isinstance(state, torch.Tensor):
        local = state.to_local() if isinstance(state, DTensor) else state
        return int(local.numel() * local.element_size())
    return 0


class ShardedSaver(InFlightSave):
    """Saves model + optimizer shards from every rank through DCP; rank 0 commits.

    The saver interface (saver_interface.py), called on every rank. It takes model
    and optimizer state itself, and loads them itself; it never copies behind (every
    rank stages at once).
    """

    saves_model_and_optimizer = True
    copy_behind = False

    def __init__(self, store: Store, settings: SaverSettings, ctx: DistContext,
                 model: nn.Module, optimizer: Any | None) -> None:
        self.store = store
        self._settings = settings
        self._ctx = ctx
        self._model, self._optimizer = model, optimizer
        self._group = background_group(ctx)
        self._staging = _ReusedStaging()
        self._writer: StoreWriter | None = None
        self._peer_waits = 0
        super().__init__(store)
        self.pace = background_pace(settings, "sync" if settings.mode == "sync" else "thread")

    def warm_up(self) -> None:
        return None

    def fence(self) -> float:
        """Nothing is copied behind: nothing to wait for."""
        return 0.0

    def load_newest(self, request: LoadRequest) -> LoadedSnapshot | None:
        """Load the newest sharded snapshot into the model and optimizer on every rank
        (through the background group); its training state is the payload. With a
        memory tier, a newer step held in the nodes' memory first
        (sharded/memory_restore.py)."""
        if request.sharded_memory is not None:
            loaded = request.sharded_memory.load(self.store, self._group, self._model,
                                                 self._optimizer)
            if loaded is not None:
                return loaded
        loaded = load_newest_sharded(self.store, request.ctx, self._group, self._model,
                                     self._optimizer)
        if loaded is None and request.sharded_memory is not None \
                and request.sharded_memory.touched:
            raise SnapshotCorrupt("a memory snapshot failed half-way through loading into "
                                  "the model and durable storage holds none; fix: start "
                                  "again with an empty memory directory")
        return loaded

    def save(self, train_state: dict[str, Any], meta: SnapshotMeta,
             started: float | None = None,
             defer: AbstractSet[int] = frozenset()) -> SaveHandle:
        """Stage this rank's shards and persist them; returns at once in async mode.

        Args:
            train_state: the replicated rest (step, sampler, RNG, …); rank 0 writes it.
            defer: ignored (``copy_behind`` is False): every rank stages at once.

        Raises:
            SnapshotWriteFailed: the previous save failed (on every rank alike).
        """
        started = time.perf_counter() if started is None else started
        self.wait_in_flight(meta.step)  # the manager has agreed on its outcome already
        state = current_state(self._model, self._optimizer)
        handle = SaveHandle(meta.step)
        committed: list[Manifest | None] = []
        train_bytes = _serialize(train_state) if self._ctx.is_writer else b""
        token = uuid.uuid4().hex[:12]

        # DCP's thread runs the commit and the outcome: with this rank's bound fields
        # (run, rank, step) on their events, as on the training thread's.
        context = contextvars.copy_context()
        timing = {"persist_started": started}  # set again after staging, below

        def on_finish(metadata: Metadata, parts: list[RankPart]) -> None:
            committed.append(self._commit_parts(meta, token, parts, dump_metadata(metadata),
                                                train_bytes, timing["persist_started"]))

        writer = StoreWriter(self.counted_store, layout.step_dir(meta.step), token,
                             meta.checksum_algorithm,
                             lambda metadata, parts: context.run(on_finish, metadata, parts),
                             pace=self.pace)
        self._writer = writer
        kwargs: dict[str, Any] = {"storage_writer": writer, "planner": DefaultSavePlanner(),
                                  "process_group": self._group,
                                  "no_dist": not self._ctx.initialized}
        if self._settings.mode == "sync":
            # Training waits for the write, so the live tensors are written without a copy.
            future: Future[Any] = Future()
            timing["persist_started"] = time.perf_counter()
            try:
                future.set_result(dcp.save(state, **kwargs))
            except BaseException as exc:  # DCP's CheckpointException is a BaseException
                future.set_exception(exc)
        else:  # async_save stages (a blocking copy into our buffers), then persists in a thread
            future = dcp.async_save(state, async_stager=self._staging, **kwargs)  # type: ignore[assignment]
            self._log_staged(meta.step, started)
            timing["persist_started"] = time.perf_counter()
        future.add_done_callback(lambda f: context.run(
            self._finished, handle, f, meta, committed, timing["persist_started"]))
        self._last = handle
        return handle

    def _commit_parts(self, meta: SnapshotMeta, token: str, parts: list[RankPart],
                      metadata_bytes: bytes, train_bytes: bytes,
                      started: float) -> Manifest | None:
        """(rank 0, inside DCP's finish, every part durable) the commit: metadata, training
        state, manifest last; then retention. None if another writer committed first."""
        manifest = commit_sharded(self.counted_store, meta, token, parts, metadata_bytes,
                                  train_bytes)
        if manifest is not None:
            self._committed(meta, manifest, started)
        return manifest

    def _committed(self, meta: SnapshotMeta, manifest: Manifest, started: float) -> None:
        """(rank 0, inside DCP's finish, while the other ranks wait for its outcome) the
        commit's event, then retention: every rank's wait for this save ends together,
        so no rank waits for rank 0's retention in a later training collective."""
        duration = round(time.perf_counter() - started, 4)
        log.info("snapshot.committed", snapshot_step=meta.step, size_bytes=manifest.total_bytes,
                 duration_s=duration, attempts=1, ranks=meta.world_size,
                 throughput_mb_s=round(manifest.total_bytes / max(duration, 1e-9) / 1e6, 1))
        try:
            prune(self.counted_store, self._settings.keep, meta.step)
        except Exception as exc:  # the save is durable; retention retries next time
            log.warning("snapshot.prune_failed", snapshot_step=meta.step, error=str(exc),
                        error_type=type(exc).__name__)

    def _finished(self, handle: SaveHandle, future: Future[Any], meta: SnapshotMeta,
                  committed: list[Manifest | None], started: float) -> None:
        error = future.exception()
        if error is not None:
            reason = describe_failure(error)
            log.error("snapshot.failed", snapshot_step=meta.step, error=reason,
                      error_type=type(error).__name__, will_retry=False,
                      duration_s=round(time.perf_counter() - started, 4))
            handle._finish(SaveState.FAILED, error=SnapshotWriteFailed(
                f"sharded snapshot of step {meta.step} to {self.store.url} failed: {reason}; "
                "fix: make the storage writable and reachable on every rank"))
            return
        manifest = committed[0] if committed else None
        if not self._ctx.is_writer:
            handle._finish(SaveState.COMMITTED)
        elif manifest is None:
            handle._finish(SaveState.SKIPPED)
        else:
            handle._finish(SaveState.COMMITTED, manifest)

    def _progress(self) -> int:
        """This rank's storage progress, and while its own part is durable and it waits
        for the other ranks (their parts; off rank 0, the commit), every look: each of
        those ranks' watchdogs sees whether its own writes move."""
        writer = self._writer
        if writer is not None and writer.waiting_for_peers:
            self._peer_waits += 1
        return super()._progress() + self._peer_waits

    def _log_staged(self, step: int, started: float) -> None:
        log.info("snapshot.staged", snapshot_step=step, size_bytes=self._staging.nbytes,
                 duration_s=round(time.perf_counter() - started, 4), persister="sharded")

    def prepare_ahead(self, make_state: Callable[[], Any]) -> None:
        """Nothing ahead: DCP's stager allocates at the first save (docs/sharded.md)."""
        return None

    def close(self) -> None:
        """Wait for the save in flight (at full speed); raise a failure not yet raised."""
        self.hurry()
        self.wait()


def _serialize(state: dict[str, Any]) -> bytes:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()
