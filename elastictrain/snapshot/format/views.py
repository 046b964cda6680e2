"""A nested state as a skeleton of views into a few flat storages, and back.

Staged and loaded states keep their tensors in a few large storages (slabs).
Moving such a state to another process (the persister) or another rank
(restore by broadcast) then means moving a handful of storages once, plus a
small picklable skeleton that says which view of which storage each tensor is.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class ViewRef:
    """A tensor as a view into storage number ``storage`` (offset, size, stride in
    elements of ``dtype``)."""

    storage: int
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


def map_leaves(tree: Any, leaf: Callable[[Any], Any]) -> Any:
    """``tree`` rebuilt through its dicts, lists and tuples, with ``leaf`` applied to
    everything else (the one walk of a state's structure)."""
    if isinstance(tree, dict):
        return {k: map_leaves(v, leaf) for k, v in tree.items()}
    if isinstance(tree, list):
        return [map_leaves(v, leaf) for v in tree]
    if isinstance(tree, tuple):
        return tuple(map_leaves(v, leaf) for v in tree)
    return leaf(tree)


def to_views(state: Any, key_of: Callable[[torch.UntypedStorage], int]) -> Any:
    """``state`` with every non-empty tensor replaced by a ViewRef; ``key_of`` names
    (and typically collects) each tensor's storage."""
    def view(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.untyped_storage().nbytes() > 0:
            return ViewRef(key_of(value.untyped_storage()), int(value.storage_offset()),
                           tuple(value.shape), tuple(value.stride()), value.dtype)
        return value

    return map_leaves(state, view)


def from_views(skeleton: Any, storages: Mapping[int, torch.Tensor]) -> Any:
    """Rebuild the state from a skeleton and its storages (as uint8 tensors); no copies."""
    def tensor(value: Any) -> Any:
        if isinstance(value, ViewRef):
            base = storages[value.storage].untyped_storage()
            return torch.empty(0, dtype=value.dtype).set_(base, value.offset, value.size,
                                                          value.stride)
        return value

    return map_leaves(skeleton, tensor)


def as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole storage (shares memory)."""
    return torch.empty(0, dtype=torch.uint8).set_(storage)


class StorageIndex:
    """Numbers storages in order of first use (a ``key_of`` for ``to_views``)."""

    def __init__(self) -> None:
        self.storages: list[torch.UntypedStorage] = []
        self._keys: dict[int, int] = {}

    def __call__(self, storage: torch.UntypedStorage) -> int:
        ptr = storage.data_ptr()
        if ptr not in self._keys:
            self._keys[ptr] = len(self.storages)
            self.storages.append(storage)
        return self._keys[ptr]


StatePath = tuple[Any, ...]  # keys from the state's root to one value, e.g. ("model", "w")


@dataclass
class InPlace:
    """Existing tensors a read may fill directly, by their path in the state.

    ``precheck`` sees the state's structure first (tensors as ViewRefs, every other
    value as saved); if it raises, nothing is placed (the caller checks the verified
    state again and reports it then). ``touched`` turns true once a byte has landed
    in one of the tensors: they hold unverified bytes from then on.
    """

    targets: Mapping[StatePath, torch.Tensor]
    precheck: Callable[[Any], None] | None = None
    touched: bool = False
