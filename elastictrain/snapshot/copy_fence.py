"""Copy behind (``snapshot.overlap_copy``): which tensors a save copies behind the
loop, and the fence, the optimizer's step pre-hook, that waits for those copies
before the optimizer changes them (snapshot/durable/saver.py copies; docs/performance.md)."""

from __future__ import annotations

from typing import Any

from elastictrain.core.config import SnapshotConfig
from elastictrain.core.errors import ConfigError
from elastictrain.snapshot.durable.saver_interface import SnapshotSaver
from elastictrain.snapshot.schedule.save_schedule import SaveSchedule
from elastictrain.snapshot.state.training_state import TrainingState


class CopyFence:
    """Registers the fence on the optimizer when copy behind applies.

    ``overlap_copy="auto"`` applies it where it can (async mode, a torch.optim
    optimizer, a replicated model); ``true`` where it cannot raises ConfigError.

    Args:
        savers: the savers whose copies the fence waits for (the durable one first:
            its wait ends the durable save's cost to the loop, for the schedule).
    """

    def __init__(self, config: SnapshotConfig, train: TrainingState, *, sharded: bool,
                 savers: list[SnapshotSaver], schedule: SaveSchedule) -> None:
        self._train, self._savers, self._schedule = train, savers, schedule
        self._hook = self._register(config, train.optimizer, sharded=sharded)

    def _register(self, config: SnapshotConfig, optimizer: Any, *, sharded: bool) -> Any:
        """The hook's handle (to remove at close), or None where copy behind is off."""
        setting = config.overlap_copy
        if setting is False:
            return None
        register = getattr(optimizer, "register_step_pre_hook", None)
        if setting == "auto" and (register is None or sharded or config.mode == "sync"):
            return None
        if register is None or sharded:
            problem = ("this model is sharded (sharded saves stage every rank at once)"
                       if sharded else "no torch.optim optimizer= was given (its "
                       "step is where the copy is awaited)")
            raise ConfigError(f"snapshot.overlap_copy=true: {problem}; fix: pass a "
                              "torch.optim optimizer or unset snapshot.overlap_copy")
        return register(lambda *_: self.wait())

    @property
    def active(self) -> bool:
        """Whether the optimizer's step waits here (a save's cost then ends here)."""
        return self._hook is not None

    def wait(self) -> None:
        """Before parameters or optimizer state change: the copies behind are done."""
        durable, *others = self._savers
        waited = durable.fence()
        for saver in others:
            saver.fence()
        self._schedule.fenced(waited)

    def deferred(self) -> frozenset[int]:
        """What a save copies behind: parameters and optimizer state (only the
        optimizer's step changes them); buffers and the rest are copied at once.
        Nothing once a copy behind of any tier raced a change of its source: the loop
        changes these tensors outside the optimizer's step."""
        if self._hook is None or not all(saver.copy_behind for saver in self._savers):
            return frozenset()
        return self._train.step_changed_ptrs()

    def remove(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
