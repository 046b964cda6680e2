"""What an exported file holds: the model's state under the names an unwrapped model
gives it, the optimizer's state when asked for, and where it came from.

A source describes a snapshot as a tree (``{"model": {...}, "optimizer": {...}}``) whose
tensors are ``TensorRef`` placeholders: dtype and shape, and where the source finds the
bytes. Nothing is read until a writer asks for each tensor in turn.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from elastictrain.core.errors import ConfigError, SnapshotUnloadable
from elastictrain.snapshot.format.manifest import SHARDED_FORMAT_VERSION, Manifest

Path = tuple[Any, ...]  # keys from the tree's root to one value, e.g. ("model", "0.weight")

# Module names torch puts between a wrapper and the module it wraps: DDP's ``module`` and
# FSDP1's wrapper keep the wrapped module there, ``torch.compile`` keeps it at ``_orig_mod``.
_COMPILED = "_orig_mod"
_WRAPPED = "module"


@dataclass(frozen=True, eq=False)  # compared and hashed by identity: one per tensor
class TensorRef:
    """A tensor of the snapshot, not read yet: its dtype and shape, and ``where`` the
    source finds its bytes (the source's own handle)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    where: Any

    @property
    def nbytes(self) -> int:
        numel = 1
        for n in self.shape:
            numel *= n
        return numel * self.dtype.itemsize


class Source(Protocol):
    """A snapshot's state, read a tensor at a time.

    Call order: ``tree`` (the state, tensors as TensorRef) → ``order(wanted)`` →
    ``tensors(in that order)`` (each tensor whole and contiguous, the caller's to keep or
    drop) → ``finish()`` (raises SnapshotCorrupt unless everything read verified) →
    ``close()`` (always).
    """

    tree: dict[str, Any]

    def order(self, wanted: list[TensorRef]) -> list[TensorRef]: ...
    def tensors(self, wanted: list[TensorRef]) -> Iterator[tuple[TensorRef, torch.Tensor]]: ...
    def finish(self) -> None: ...
    def close(self) -> None: ...


def tensor_refs(tree: Any, path: Path = ()) -> Iterator[tuple[Path, TensorRef]]:
    """(path, ref) of every tensor in ``tree``, in the tree's order."""
    if isinstance(tree, TensorRef):
        yield path, tree
    elif isinstance(tree, dict):
        for key, value in tree.items():
            yield from tensor_refs(value, (*path, key))
    elif isinstance(tree, (list, tuple)):
        for index, value in enumerate(tree):
            yield from tensor_refs(value, (*path, index))


def put(tree: dict[str, Any], path: Path, value: Any) -> None:
    """Set ``value`` at ``path``, making the dicts (a ``str`` key next) and lists (an
    ``int`` key next) on the way."""
    node: Any = tree
    for key, following in itertools.pairwise(path):
        fresh: Any = [] if isinstance(following, int) else {}
        if isinstance(node, list):
            node.extend([None] * (key + 1 - len(node)))
            node[key] = fresh if node[key] is None else node[key]
        else:
            node.setdefault(key, fresh)
        node = node[key]
    if isinstance(node, list):
        node.extend([None] * (path[-1] + 1 - len(node)))
    node[path[-1]] = value


def model_names(names: list[str]) -> dict[str, str]:
    """Each saved name of the model's state → the name an unwrapped, uncompiled model
    gives it: every ``_orig_mod.`` (``torch.compile``, of the model or of a submodule)
    dropped, and a ``module.`` prefix dropped while every name has it (a DDP wrapper's
    own state_dict; a submodule named ``module`` under another name is kept).

    Raises:
        SnapshotUnloadable: two saved names would become one.
    """
    parts = [[p for p in name.split(".") if p != _COMPILED] for name in names]
    while parts and all(len(p) > 1 and p[0] == _WRAPPED for p in parts):
        parts = [p[1:] for p in parts]
    renamed = {name: ".".join(p) for name, p in zip(names, parts, strict=True)}
    if len(set(renamed.values())) != len(renamed):
        clash = sorted(n for n in renamed.values() if list(renamed.values()).count(n) > 1)
        raise SnapshotUnloadable(f"the model's state holds {clash[0]!r} both inside and "
                                 "outside a wrapper's name (module., _orig_mod.), so two "
                                 "tensors would get one name; fix: restore it into the "
                                 "model with SnapshotManager.restore, which keeps the "
                                 "saved names")
    return renamed


def select(tree: dict[str, Any], *, with_optimizer: bool, where: str) -> dict[str, Any]:
    """The part of a source's tree a file holds: ``model`` with its names as an unwrapped
    model gives them, and ``optimizer`` when asked for (its parameter names, where it
    keys state by name, renamed alike).

    Raises:
        SnapshotUnloadable: the snapshot holds no model state.
        ConfigError: the optimizer is asked for and the snapshot holds none.
    """
    model = tree.get("model")
    if not isinstance(model, dict) or not model:
        raise SnapshotUnloadable(f"{where}: the snapshot holds no model state to export; "
                                 "fix: export a snapshot SnapshotManager took with a model")
    names = model_names([str(k) for k in model])
    chosen: dict[str, Any] = {"model": {names[str(k)]: v for k, v in model.items()}}
    if with_optimizer:
        optimizer = tree.get("optimizer")
        if not isinstance(optimizer, dict):
            raise ConfigError(f"{where}: the snapshot holds no optimizer state; fix: export "
                              "without --with-optimizer (with_optimizer=False)")
        chosen["optimizer"] = _renamed_optimizer(optimizer, names)
    return chosen


def _renamed_optimizer(state: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    """An optimizer state keyed by parameter name (a sharded snapshot's) with the model's
    renames applied; one keyed by number (``optimizer.state_dict()``) as it is."""
    per_param = state.get("state")
    if isinstance(per_param, dict):
        state = {**state, "state": {names.get(k, k) if isinstance(k, str) else k: v
                                    for k, v in per_param.items()}}
    groups = state.get("param_groups")
    if isinstance(groups, list):
        state = {**state, "param_groups": [
            {**g, "params": [names.get(p, p) if isinstance(p, str) else p
                             for p in g.get("params", [])]} if isinstance(g, dict) else g
            for g in groups]}
    return state


def describe(manifest: Manifest, *, with_optimizer: bool) -> dict[str, Any]:
    """Where the file came from: step, run, the snapshot's checksums and versions (plain
    values: a torch file's ``elastictrain`` entry, JSON in a safetensors header)."""
    return {
        "step": manifest.step,
        "run_id": manifest.run_id,
        "epoch": manifest.epoch,
        "world_size": manifest.world_size,
        "created_at": manifest.created_at,
        "snapshot_format": ("sharded" if manifest.format_version == SHARDED_FORMAT_VERSION
                            else "replicated"),
        "checksum_algorithm": manifest.checksum_algorithm,
        "checksums": {o.name: o.checksum for o in manifest.objects},
        "torch_version": manifest.torch_version,
        "elastictrain_version": manifest.elastictrain_version,
        "contents": ["model", "optimizer"] if with_optimizer else ["model"],
    }
