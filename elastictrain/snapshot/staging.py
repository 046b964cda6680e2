"""Staging: copy training state out of the live model into reusable CPU buffers.

This is the only part of a save that blocks training. Buffers are allocated
on the first save and reused by every later one (a fresh allocation per save
measured ~7x slower here, and memory would grow), so staging memory stays
at the state's size. Buffers are pinned when the state lives on CUDA (fast,
asynchronous device-to-host copies) and can live in shared memory so a
persister process reads them without another copy.
"""

from __future__ import annotations

from typing import Any

import torch


class StagingBuffers:
    """Reusable CPU copies of every tensor in a nested state (dicts, lists, tuples).

    Args:
        share_memory: allocate in shared memory (for a persister process).
    """

    def __init__(self, share_memory: bool = False) -> None:
        self.share_memory = share_memory
        self._buffers: dict[str, torch.Tensor] = {}
        self.allocations = 0  # how many buffers were (re)allocated, for tests and benches

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def stage(self, state: Any) -> Any:
        """Return ``state`` with every tensor replaced by its staged CPU copy.

        Non-tensor leaves (ints, floats, strings) are immutable and returned as
        they are; containers are rebuilt so later mutation of the live state
        does not leak into the staged one.
        """
        needs_sync = [False]
        staged = self._walk(state, "", needs_sync)
        if needs_sync[0]:
            torch.cuda.synchronize()
        return staged

    def _walk(self, node: Any, path: str, needs_sync: list[bool]) -> Any:
        if isinstance(node, torch.Tensor):
            return self._copy(node, path, needs_sync)
        if isinstance(node, dict):
            return {k: self._walk(v, f"{path}/{k}", needs_sync) for k, v in node.items()}
        if isinstance(node, list):
            return [self._walk(v, f"{path}/{i}", needs_sync) for i, v in enumerate(node)]
        if isinstance(node, tuple):
            return tuple(self._walk(v, f"{path}/{i}", needs_sync) for i, v in enumerate(node))
        return node

    def _copy(self, tensor: torch.Tensor, path: str, needs_sync: list[bool]) -> torch.Tensor:
        src = tensor.detach()
        buf = self._buffers.get(path)
        if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
            buf = self._allocate(src)
            self._buffers[path] = buf
        on_cuda = src.is_cuda
        buf.copy_(src, non_blocking=on_cuda)
        needs_sync[0] = needs_sync[0] or on_cuda
        return buf

    def _allocate(self, src: torch.Tensor) -> torch.Tensor:
        self.allocations += 1
        pin = src.is_cuda and torch.cuda.is_available()
        buf = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=pin)
        if self.share_memory and not pin:
            buf.share_memory_()
        return buf
