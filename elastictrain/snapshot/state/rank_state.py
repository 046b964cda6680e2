"""Per-rank state: the objects passed as ``state=`` (anything with ``state_dict()`` /
``load_state_dict()``, such as torchdata's ``StatefulDataLoader``) and
``rank_extras``, each rank's own (docs/elastic-resume.md#per-rank-state).

Each rank's part travels in its entry of the RNG list every save gathers (key
``rank_state``), so it reaches every tier the RNG states reach; a snapshot without
the key (older, or of a job without per-rank state) restores as before. The payload
also names what the ranks saved (``rank_state`` at its top level), so a restore at
another world size knows it without every rank's entry.

At another world size a rank's state has no rank to go back to: the restore refuses,
unless each object concerned has a ``load_state_dict_resized(state, saved_world_size)``
method (the one protocol): it is then called with the state the same rank number
saved, or None on a rank that did not exist before.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from elastictrain.core.errors import ConfigError, ResumeMismatchError
from elastictrain.snapshot.format.loadable import check_key, check_leaf, registered_types

RESIZED_METHOD = "load_state_dict_resized"
_EXTRAS = "rank_extras"


class RankState:
    """The user's per-rank objects (by name) and values (``extras``) of this rank.

    Raises:
        ConfigError: an object lacks ``state_dict`` or ``load_state_dict``.
    """

    def __init__(self, objects: dict[str, Any] | None) -> None:
        self.objects = dict(objects or {})
        for name, obj in self.objects.items():
            if not (callable(getattr(obj, "state_dict", None))
                    and callable(getattr(obj, "load_state_dict", None))):
                raise ConfigError(
                    f"state[{name!r}] is a {type(obj).__name__}, which has no state_dict() "
                    "and load_state_dict(); fix: pass only objects that have both")
        self.extras: dict[str, Any] = {}

    @property
    def active(self) -> bool:
        """Whether this rank has per-rank state to save."""
        return bool(self.objects or self.extras)

    def capture(self) -> dict[str, Any] | None:
        """This rank's states, copied (a loader's own dicts change as it runs), checked to
        load under ``torch.load(weights_only=True)``; None when there is nothing.

        Raises:
            UnsafeStateError: naming the object (or ``rank_extras``) and the type.
        """
        if not self.active:
            return None
        states = {name: copy.deepcopy(obj.state_dict()) for name, obj in self.objects.items()}
        for name, state in states.items():
            _check_loadable(state, f"state[{name!r}]")
        extras = dict(self.extras)
        _check_loadable(extras, _EXTRAS)
        return {"objects": states, "extras": extras}

    def check_resumable(self, payload: dict[str, Any], world_size: int) -> None:
        """Refuse (ResumeMismatchError, one line) a snapshot whose per-rank state cannot
        be handed out at ``world_size``, before anything is applied."""
        saved_world = payload.get("world_size")
        held = payload.get("rank_state")
        if not held or saved_world is None or saved_world == world_size:
            return
        for name in held.get("objects", []):
            if not hasattr(self.objects.get(name), RESIZED_METHOD):
                raise ResumeMismatchError(
                    f"state[{name!r}] was saved per rank at world size {saved_world} and "
                    f"cannot be split for world size {world_size}; fix: resume with "
                    f"{saved_world} ranks, or give it a {RESIZED_METHOD}(state, "
                    "saved_world_size) method (docs/elastic-resume.md#per-rank-state)")
        if held.get("extras"):
            raise ResumeMismatchError(
                f"snap.rank_extras were saved per rank at world size {saved_world} and "
                f"cannot be split for world size {world_size}; fix: resume with "
                f"{saved_world} ranks, or keep such values in snap.extras")

    def apply(self, entry: dict[str, Any] | None, saved: dict[str, Any] | None,
              saved_world: int, world_size: int) -> None:
        """Load this rank's saved ``entry`` (its RNG entry; None: the snapshot holds none
        for this rank). ``saved``: the payload's ``rank_state`` (what any rank saved).
        Objects the snapshot has no state for keep theirs."""
        held = _own_copy((entry or {}).get("rank_state") or {})
        states = held.get("objects") or {}
        if saved_world != world_size:
            for name in (saved or {}).get("objects", []):
                obj = self.objects.get(name)
                if hasattr(obj, RESIZED_METHOD):
                    getattr(obj, RESIZED_METHOD)(states.get(name), saved_world)
            self.extras = {}
            return
        for name, obj in self.objects.items():
            if name in states:
                obj.load_state_dict(states[name])
        self.extras = dict(held.get("extras") or {})


def saved_names(entries: list[Any]) -> dict[str, Any] | None:
    """What the ranks' entries hold of per-rank state, for the payload's top level
    (None: nothing, as in a snapshot of a job without any)."""
    names: set[str] = set()
    extras = False
    for entry in entries:
        held = entry.get("rank_state") if isinstance(entry, dict) else None
        if held:
            names.update(held["objects"])
            extras = extras or bool(held["extras"])
    if not names and not extras:
        return None
    return {"objects": sorted(names), "extras": extras}


def _own_copy(value: Any) -> Any:
    """``value`` with every tensor in memory of its own: loaded ones are views into a
    snapshot's slabs, which an object would keep alive, and which ``Generator.set_state``
    misreads (it ignores a view's offset, as ``torch.set_rng_state`` does: rng.py)."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if type(value) is dict:
        return {key: _own_copy(item) for key, item in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_own_copy(item) for item in value)
    return value


def _check_loadable(value: Any, where: str) -> None:
    """Raise UnsafeStateError, its path starting at ``where`` (``state['loader']``)."""
    _walk(value, (where,), registered_types())


def _walk(value: Any, path: tuple[Any, ...], registered: frozenset[type]) -> None:
    if isinstance(value, torch.Tensor):
        return
    if type(value) in (dict, list, tuple):
        is_dict = isinstance(value, dict)
        for key, item in (value.items() if is_dict else enumerate(value)):
            if is_dict:
                check_key(key, path)
            _walk(item, (*path, key), registered)
        return
    check_leaf(value, path, registered)
