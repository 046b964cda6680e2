"""Staging: copy training state out of the live model into reusable CPU buffers.

This is the only part of a save that blocks training. Buffers are allocated
once and reused by every later save (a fresh allocation per save is several
times slower, docs/storage.md, and memory would grow), so staging memory stays
at the state's size. ``prepare_async`` allocates them, and faults their pages
in, on a background thread before the first save, so the first save blocks
as briefly as the later ones (docs/performance.md). The same walk checks that every value will
load back under ``weights_only=True`` (:mod:`.loadable`).

Buffers are views into a few large slabs, one per top-level key of the state
and dtype (``model``/float32, ``optimizer``/float32, ``rng``/uint8, …):

* a persister process maps each slab once, so a state with thousands of
  tensors costs a handful of shared-memory file descriptors, not thousands
  (the per-process limit is often 1024);
* ``torch.save`` writes each slab as one record, and a restored optimizer
  keeps only its own slab alive (the model's is copied into the parameters
  and freed), so restore does not hold extra memory.

Slabs are pinned when the state lives on CUDA (fast, asynchronous
device-to-host copies) and live in shared memory when a persister process
reads them, so only their handles cross the process boundary, once.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Set as AbstractSet
from typing import Any

import torch

from elastictrain.core.errors import UnsafeStateError
from elastictrain.snapshot.format.loadable import check_key, check_leaf, registered_types

_ALIGN = 64  # bytes; keeps every view aligned for vectorised copies and dtype views


class StagingBuffers:
    """Reusable CPU copies of every tensor in a nested state (dicts, lists, tuples).

    Args:
        share_memory: allocate slabs in shared memory (for a persister process).
            This wins over pinning: the process must see the bytes and pinned
            memory cannot be handed to another process, so CUDA state then
            stages through pageable shared memory (slower device-to-host copies).

    Attributes:
        allocations: how many slabs were allocated; constant across saves once
            the state's shapes are stable (tests and benchmarks check it).
    """

    def __init__(self, *, share_memory: bool = False) -> None:
        self.share_memory = share_memory
        self._buffers: dict[tuple[Any, ...], torch.Tensor] = {}
        self.allocations = 0
        self.staged = False  # True from the first stage on
        self._preparing: threading.Thread | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of staging memory held (every live slab, padding included)."""
        storages = {b.untyped_storage().data_ptr(): b.untyped_storage().nbytes()
                    for b in self._buffers.values()}
        return sum(storages.values())

    def prepare_async(self, state: Any) -> None:
        """Allocate the buffers ``state`` needs on a background thread, without copying.

        Staging is the same afterwards; only the first ``stage`` gets cheaper: it
        finds its slabs allocated and their pages already mapped (the page faults of a
        fresh slab, pinning it, or creating its shared memory, would otherwise block the
        first save most of its time: docs/performance.md#the-first-save). May be called
        again before the first ``stage`` (at ``restore()``, then once the optimizer's
        state exists): each call allocates only what is still missing, after the one
        before it. The next ``stage`` waits for them. A state that would not load back
        is left alone: the save reports it, as always.
        """
        if self.staged:
            return  # staging allocates what is missing itself from here on
        leaves: dict[tuple[Any, ...], torch.Tensor] = {}
        try:
            _collect(state, (), leaves, registered_types())  # on the caller's thread
        except UnsafeStateError:
            return
        # Not a daemon: a process that exits right after restore() (a run resumed at
        # its last step) waits for the allocation instead of tearing it down midway.
        self._preparing = threading.Thread(target=self._prepare_after,
                                           args=(self._preparing, leaves),
                                           name="et-staging-prepare")
        self._preparing.start()

    def wait_prepared(self) -> None:
        """Wait for the allocation :meth:`prepare_async` started, if any."""
        if self._preparing is not None:
            self._preparing.join()
            self._preparing = None

    def _prepare_after(self, previous: threading.Thread | None,
                       leaves: dict[tuple[Any, ...], torch.Tensor]) -> None:
        if previous is not None:
            previous.join()  # one allocator at a time: both would fill the same paths
        self._allocate_missing(leaves, touch=True)

    def stage(self, state: Any) -> Any:
        """Return ``state`` with every tensor replaced by its staged CPU copy
        (:meth:`stage_deferring` with nothing deferred)."""
        staged, later = self.stage_deferring(state, frozenset())
        assert not later
        return staged

    def stage_deferring(self, state: Any, defer: AbstractSet[int]
                        ) -> tuple[Any, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Like :meth:`stage`, but CPU tensors whose ``data_ptr()`` is in ``defer`` are
        not copied yet: returns the staged state and the ``(buffer, source)`` pairs still
        to copy, which the caller copies before the sources next change (copy behind,
        docs/performance.md).

        Non-tensor leaves (ints, floats, strings) are immutable and returned as
        they are; containers are rebuilt so later mutation of the live state
        does not leak into the staged one. Buffers of paths that are no longer
        in ``state`` are released, so memory follows the state.

        Raises:
            UnsafeStateError: a value or dict key that ``torch.load(weights_only=True)``
                would refuse (checked before anything is copied).
        """
        self.wait_prepared()
        self.staged = True
        leaves: dict[tuple[Any, ...], torch.Tensor] = {}
        _collect(state, (), leaves, registered_types())
        for path in set(self._buffers) - set(leaves):
            del self._buffers[path]
        self._allocate_missing(leaves)
        walk = _Walk(self._buffers, defer)
        staged = walk.visit(state, ())
        if walk.needs_sync:
            torch.cuda.synchronize()
        return staged, walk.later

    def _allocate_missing(self, leaves: dict[tuple[Any, ...], torch.Tensor],
                          *, touch: bool = False) -> None:
        groups: dict[tuple[Any, torch.dtype, bool], list[tuple[Any, ...]]] = defaultdict(list)
        for path, src in leaves.items():
            buf = self._buffers.get(path)
            if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
                top = path[0] if path else None  # one slab per top-level key and dtype
                groups[(top, src.dtype, src.is_cuda)].append(path)
        for (_, dtype, on_cuda), paths in groups.items():
            self._allocate_slab(dtype, on_cuda=on_cuda,
                                items=[(p, leaves[p].shape) for p in paths], touch=touch)

    def _allocate_slab(self, dtype: torch.dtype, *, on_cuda: bool,
                       items: list[tuple[tuple[Any, ...], torch.Size]], touch: bool) -> None:
        itemsize = torch.empty((), dtype=dtype).element_size()
        offsets, total = [], 0
        for _, shape in items:
            offsets.append(total)
            total += _aligned(shape.numel() * itemsize)
        pin = on_cuda and torch.cuda.is_available() and not self.share_memory
        slab = torch.empty(max(total, _ALIGN), dtype=torch.uint8, pin_memory=pin)
        if self.share_memory:
            slab.share_memory_()  # writes every page of the new shared memory
        elif touch:
            slab.zero_()  # fault the pages in now rather than in the first save's copy
        self.allocations += 1
        for (path, shape), offset in zip(items, offsets, strict=True):
            nbytes = shape.numel() * itemsize
            self._buffers[path] = slab[offset:offset + nbytes].view(dtype).view(shape)


class _Walk:
    """One pass of ``stage_deferring``: copies (or defers) each tensor into its buffer."""

    def __init__(self, buffers: dict[tuple[Any, ...], torch.Tensor], defer: AbstractSet[int]
                 ) -> None:
        self.buffers, self.defer = buffers, defer
        self.needs_sync = False
        self.later: list[tuple[torch.Tensor, torch.Tensor]] = []

    def visit(self, node: Any, path: tuple[Any, ...]) -> Any:
        if isinstance(node, torch.Tensor):
            buf = self.buffers[path]
            on_cuda = node.is_cuda
            if not on_cuda and node.data_ptr() in self.defer:
                self.later.append((buf, node.detach()))
            else:
                buf.copy_(node.detach(), non_blocking=on_cuda)
                self.needs_sync = self.needs_sync or on_cuda
            return buf
        if isinstance(node, dict):
            return {k: self.visit(v, (*path, k)) for k, v in node.items()}
        if isinstance(node, list):
            return [self.visit(v, (*path, i)) for i, v in enumerate(node)]
        if isinstance(node, tuple):
            return tuple(self.visit(v, (*path, i)) for i, v in enumerate(node))
        return node


def _aligned(nbytes: int) -> int:
    return (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN


def _collect(node: Any, path: tuple[Any, ...], out: dict[tuple[Any, ...], torch.Tensor],
             registered: frozenset[type]) -> None:
    """Every tensor leaf of ``node`` by path (the same paths ``_walk`` visits); every
    other leaf and dict key must load back under ``weights_only=True``."""
    if isinstance(node, torch.Tensor):
        out[path] = node
    elif isinstance(node, dict):
        for k, v in node.items():
            if type(k) is not str:  # the common key type, checked inline: this walk is hot
                check_key(k, path)
            _collect(v, (*path, k), out, registered)
    elif isinstance(node, (list, tuple)):
        for i, v in enumerate(node):
            _collect(v, (*path, i), out, registered)
    else:
        check_leaf(node, path, registered)
