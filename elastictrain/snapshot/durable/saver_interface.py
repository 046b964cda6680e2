"""What the manager asks of a saver: the one interface of ``Saver`` (replicated state,
written by one rank per tier) and ``ShardedSaver`` (every rank writes its shards).

The manager never asks which saver it holds; a difference between the two is a
property or a method here (whether copies behind are still made, how the newest
snapshot is loaded).
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

from elastictrain.core.config import SnapshotConfig

if TYPE_CHECKING:
    from torch import nn

    from elastictrain.snapshot.durable.persister import SaveHandle
    from elastictrain.snapshot.durable.restore import LoadedSnapshot, MemoryFirst
    from elastictrain.snapshot.format.manifest import SnapshotMeta
    from elastictrain.snapshot.format.views import InPlace
    from elastictrain.storage.api import Store
    from elastictrain.worker.dist import DistContext


@dataclass(frozen=True)
class SaverSettings:
    """How one saver writes: each tier and the rescue have their own (``for_durable``,
    ``for_memory``, ``for_rescue``), derived from the snapshot settings."""

    keep: int
    mode: Literal["sync", "async"]
    persister: Literal["thread", "process"]
    max_consecutive_failures: int
    retry_backoff_s: float
    persister_priority: Literal["low", "normal"] = "normal"
    persist_max_bytes_per_s: float | None = None  # background writes only

    @classmethod
    def for_durable(cls, config: SnapshotConfig) -> SaverSettings:
        rate = None if config.persist_max_mb_s is None else config.persist_max_mb_s * 1e6
        return cls(config.keep, config.mode, config.persister,
                   config.max_consecutive_failures, config.retry_backoff_s,
                   config.persister_priority, rate)

    @classmethod
    def for_memory(cls, config: SnapshotConfig) -> SaverSettings:
        """Keep one, always in the background, one try: a memory save that failed (a
        full tmpfs) is not retried with a back-off the next one would wait for; the
        next memory save is the retry. Not paced: a memory snapshot is what a rescue or
        a peer falls back to, so it should be complete soon."""
        return cls(1, "async", config.persister, 1, config.retry_backoff_s,
                   config.persister_priority)

    @classmethod
    def for_rescue(cls, config: SnapshotConfig) -> SaverSettings:
        """Keep one, written before the failing process exits (in the caller)."""
        return cls(1, "sync", config.persister, config.max_consecutive_failures,
                   config.retry_backoff_s)


class ShardedMemoryLoad(Protocol):
    """A sharded model's restore from the nodes' memory (sharded/memory_restore.py),
    asked before durable storage."""

    touched: bool  # a memory load failed after it changed the model

    def load(self, durable: Store, group: Any | None, model: nn.Module,
             optimizer: Any | None) -> LoadedSnapshot | None:
        """(all ranks) The newest memory step newer than durable, loaded; None when the
        durable restore must run instead."""


@dataclass(frozen=True)
class LoadRequest:
    """What a restore needs besides the saver's own store and objects: the faster tier
    to ask first, composed by the manager (the saver knows no other tier)."""

    ctx: DistContext
    restore_mode: str
    in_place: InPlace
    memory_first: MemoryFirst | None = None  # replicated state: node memory's load
    sharded_memory: ShardedMemoryLoad | None = None  # a sharded model's memory tier


class SnapshotSaver(Protocol):
    """One tier's save pipeline: back-pressure, stage, persist in the background.

    The manager calls, in this order: ``wait_in_flight`` (back-pressure),
    ``failed_step``/``take_failure`` (a failed persist, agreed and raised on every
    rank), ``save``, ``fence`` (before the saved tensors change again), and at the end
    ``wait``/``close``.
    """

    store: Store

    @property
    def copy_behind(self) -> bool:
        """Whether a save may still copy the tensors it is told to defer behind the
        loop (False for a saver that never does, or once a copy raced its source)."""

    @property
    def saves_model_and_optimizer(self) -> bool:
        """True when the saver takes model and optimizer state itself (from every
        rank) and loads them itself: the state handed to ``save`` holds the rest."""

    def warm_up(self) -> None:
        """Start what the first save would wait for (a persister process)."""

    def prepare_ahead(self, make_state: Callable[[], Any]) -> None:
        """Allocate staging off the training loop, once."""

    def wait_in_flight(self, step: int) -> None:
        """Back-pressure: wait for the save in flight (never raises)."""

    def failed_step(self) -> int:
        """The step of the last save if it failed and was not yet reported, else 0."""

    def take_failure(self) -> BaseException | None:
        """The last save's failure if not yet reported; reported from now on."""

    def save(self, state: Any, meta: SnapshotMeta, started: float | None = None,
             defer: AbstractSet[int] = frozenset()) -> SaveHandle:
        """Stage ``state`` and start persisting it (``defer``: ``data_ptr()`` of tensors
        to copy behind, honoured only while ``copy_behind``)."""

    def fence(self) -> float:
        """Return once the copies the last save deferred are done; the seconds waited."""

    def wait(self) -> None:
        """Block until the last save is durable; raise its failure if not yet reported."""

    def hurry(self) -> None:
        """The run is ending: the save in flight and every later one at full speed."""

    def close(self) -> None:
        """Wait for the save in flight and release what the saver started."""

    def load_newest(self, request: LoadRequest) -> LoadedSnapshot | None:
        """The newest snapshot that verifies on every rank, loaded; None if none."""
