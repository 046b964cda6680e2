"""The node-memory tier as the manager runs it (``snapshot.memory_every``): this node's
memory directory (snapshot/memory/memory.py) and the saver that writes it (replicated state:
on the node's local rank 0; sharded state: on every rank, its parts replicated to
buddy nodes, snapshot/sharded/memory_save.py); what a restore learns from it; its
removal when the run finished.

A memory snapshot that fails is logged, never raised: durable storage is the truth,
and training goes on with durable snapshots (``memory.Health`` says so once).
"""

from __future__ import annotations

import functools
from collections.abc import Set as AbstractSet
from typing import TYPE_CHECKING, Any

from torch import nn

from elastictrain.core.config import SnapshotConfig
from elastictrain.core.errors import SnapshotWriteFailed
from elastictrain.core.log import bind, get_logger
from elastictrain.snapshot.durable.restore import MemoryFirst
from elastictrain.snapshot.durable.saver import Saver
from elastictrain.snapshot.durable.saver_interface import SaverSettings
from elastictrain.snapshot.format.manifest import SnapshotMeta
from elastictrain.snapshot.memory import memory, peer_transport, rescue
from elastictrain.snapshot.memory.memory_load import load_memory
from elastictrain.snapshot.memory.peer_restore import PeerCopies
from elastictrain.snapshot.memory.record_links import RecordLinks, connect_record_links
from elastictrain.snapshot.state import attempt
from elastictrain.storage import Store
from elastictrain.worker.dist import DistContext

if TYPE_CHECKING:  # imported where used: DCP costs a DDP worker's start-up a second
    from elastictrain.snapshot.sharded.memory_restore import ShardedMemory
    from elastictrain.snapshot.sharded.memory_save import ShardedMemorySaver

log = get_logger("elastictrain.snapshot")


class NodeMemory:
    """Opens this node's memory directory when ``memory_every`` is set.

    Attributes:
        tier: the directory, held; None without the tier or when the node's tmpfs
            refused it (full): the run goes on with durable snapshots.
        store: the tier's store (every rank reads it on restore), or None.
        saver: its saver: replicated state, on the node's local rank 0 only; sharded
            state, on every rank; else None.
        taken_step: the step of the last memory snapshot this attempt took, or -1.
        peers: the other nodes (restore from their memory, the rescue's records), with
            ``memory_replicas`` > 0 on several nodes; else None (replicated state).
        sharded_memory: a sharded model's restore from the nodes' memory, or None.
        attempt: the job's attempt, agreed by every rank (snapshot/state/attempt.py) when the
            tier is configured, also on a rank whose node's directory refused; else None.
    """

    def __init__(self, config: SnapshotConfig, run_id: str, durable: Store,
                 ctx: DistContext, *, sharded: bool, model: nn.Module | None = None,
                 optimizer: Any | None = None) -> None:
        self._config, self._durable, self._ctx = config, durable, ctx
        self.health = memory.Health()
        self.tier: memory.MemoryTier | None = None
        self.store: Store | None = None
        self.saver: Saver | ShardedMemorySaver | None = None
        self.taken_step = -1
        self.peers: PeerCopies | None = None
        self.sharded_memory: ShardedMemory | None = None
        self.attempt: int | None = None
        self._saved = False  # a memory save was started this attempt
        # Who drops and, at the end, removes this node's snapshots: the node's lowest
        # rank (local rank 0 under torchrun; for sharded state, its leader, below).
        self._owner = ctx.local_rank == 0
        self._open(run_id, sharded=sharded)
        if self._config.memory_every is None:
            return
        self._agree_attempt()
        if sharded:
            assert model is not None  # the manager passes a sharded model
            self._open_sharded(model, optimizer)
        else:
            self.peers = self._find_peers()

    def _open(self, run_id: str, *, sharded: bool) -> None:
        if self._config.memory_every is None:
            return
        try:
            self.tier = memory.open_memory_tier(self._config, run_id, self._durable,
                                                sweep_idle=self._ctx.local_rank == 0)
        except OSError as exc:  # the node's tmpfs is full: run on durable snapshots
            self.health.failed("memory directory", exc)
            return
        self.store = self.tier.store
        if self._ctx.local_rank == 0 and not sharded:
            self.saver = Saver(self.tier.store, SaverSettings.for_memory(self._config),
                               tier="memory")

    def _agree_attempt(self) -> None:
        """(every rank) The job's attempt, kept in this node's directory by its first
        local rank (a sharded leader is chosen later: the first local rank is one)."""
        path = self.tier.path if self.tier is not None else None
        self.attempt = attempt.agree(self._ctx, attempt.last_seen(path))
        if path is not None and self._ctx.local_rank == 0:
            try:
                attempt.keep(path, self.attempt)
            except OSError as exc:  # a full tmpfs: the next group may count this one again
                self.health.failed("attempt record", exc)
        bind(attempt=self.attempt)

    def _open_sharded(self, model: nn.Module, optimizer: Any | None) -> None:
        """Every rank saves its parts (every rank calls it together): only when every
        rank's memory directory opened, since every memory save is a collective."""
        from elastictrain.snapshot.sharded.memory_restore import ShardedMemory
        from elastictrain.snapshot.sharded.memory_save import ShardedMemorySaver

        ctx, config = self._ctx, self._config
        missing = int(self.tier is None)
        if ctx.initialized:
            (missing,) = ctx.all_reduce_max([missing])
        if missing or self.tier is None:
            self.store = None  # the durable tier alone (a node's tmpfs refused: degraded)
            return
        nodes = (peer_transport.discover(ctx, str(self.tier.path)) if ctx.initialized
                 else peer_transport.NodeMap((0,)))
        replicas = config.memory_replicas if nodes.count > 1 else 0
        transport = (peer_transport.GlooTransport.create() if replicas > 0 and ctx.initialized
                     else None)
        self.saver = ShardedMemorySaver(self.tier.store, SaverSettings.for_memory(config), ctx,
                                        model, optimizer, nodes, replicas)
        self.sharded_memory = ShardedMemory(self.tier.store, ctx, nodes, transport)
        self._owner = self.sharded_memory.leader

    def memory_first(self) -> MemoryFirst | None:
        """This tier's load for a restore of replicated state (memory/memory_load.py),
        which the durable restore asks first; None without the tier. Every rank gets it
        alike, also one whose node's directory was refused (it holds no snapshot)."""
        if self._config.memory_every is None:
            return None
        return functools.partial(load_memory, self.store, self._ctx, self.peers)

    def _find_peers(self) -> PeerCopies | None:
        """The other nodes and the transport to them (every rank calls it together:
        one all-gather, and a process group when there are several nodes)."""
        ctx = self._ctx
        if self._config.memory_replicas == 0 or not ctx.initialized or ctx.world_size == 1:
            return None
        path = memory.memory_dir(self._config, self._durable.url)
        nodes = peer_transport.discover(ctx, str(path))
        if nodes.count == 1:
            return None
        replicas = self._config.memory_replicas
        links = (connect_record_links(ctx, nodes.record_targets(ctx.rank, replicas),
                                      nodes.record_sources(ctx.rank, replicas))
                 if self._config.rescue else RecordLinks())
        return PeerCopies(ctx, nodes, peer_transport.GlooTransport.create(), links)

    def save(self, state: dict[str, Any], meta: SnapshotMeta, started: float,
             defer: AbstractSet[int]) -> None:
        """(where there is a saver) Report how the last memory save ended, then start
        this one."""
        if self.saver is None:
            return
        failure = self.saver.take_failure()
        if failure is not None:
            log.warning("snapshot.memory_failed", error=str(failure), tier="memory")
            self.health.failed("memory snapshot", failure)
        elif self._saved:  # the last one is done (the caller waited for it)
            self.health.ok("memory snapshot")
        self._saved = True
        self.saver.save(state, meta, started, defer=defer)

    def drop_newer(self, step: int | None) -> None:
        """After every rank loaded ``step``: drop the newer memory snapshots."""
        if self.saver is not None and self.store is not None and self._owner:
            memory.drop_newer(self.store, step)

    def agree_outcome(self, loaded_memory_step: int | None) -> tuple[bool, bool] | None:
        """Whether every node kept its memory tier since the last attempt, and whether
        this restore resumes a rescue (None when no memory tier is configured): what
        the failures since then were (every rank calls it together)."""
        if self._config.memory_every is None:
            return None
        # Every rank takes part, also one whose node's directory refused (a full tmpfs:
        # no tier here), which counts as a node that did not keep its memory.
        tier = self.tier
        rescued = (tier is not None and loaded_memory_step is not None
                   and rescue.was_rescued(tier.boundary, loaded_memory_step))
        # Rescued when the node whose copy was loaded says so (a node that received
        # that copy from it holds no mark).
        lost, rescued_anywhere = self._ctx.all_reduce_max(
            [int(tier is None or not tier.kept), int(rescued)])
        if self.saver is not None and tier is not None:  # every rank has read the mark
            rescue.clear_marks(tier.boundary)
        return not lost, bool(rescued_anywhere)

    def finish_saves(self) -> None:
        """Wait for the memory save in flight (its copies to buddies included) and stop
        the memory saver: before the end agreement, while every peer still listens."""
        if self.saver is not None:
            try:
                self.saver.close()
            except SnapshotWriteFailed as exc:  # durable storage holds the run's result
                log.warning("snapshot.memory_failed", error=str(exc), tier="memory")

    def close(self) -> None:
        """The run finished: remove this node's memory snapshots (only here: after a
        failure the restart needs them)."""
        self.finish_saves()
        if self.saver is not None and self._owner:
            assert self.tier is not None
            memory.remove_all(self.tier)
        elif self.tier is not None:
            self.tier.release()
        elif "memory directory" in self.health.degraded and self._ctx.local_rank == 0:
            memory.remove_if_ours(self._config, self._durable.url)
