"""Model and optimizer state through DCP's ``get_state_dict`` / ``set_state_dict``.

The supported way to get sharded state: with FSDP2 every tensor is a DTensor
whose local part is this rank's shard, keyed by parameter name (the optimizer
state too), so the layout can change between save and load.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict


def current_state(model: nn.Module, optimizer: Any | None) -> dict[str, Any]:
    """This rank's model (and optimizer) state: ``{"model": …, "optimizer": …}``."""
    optimizers = [optimizer] if optimizer is not None else []
    model_state, optim_state = get_state_dict(model, optimizers)
    state: dict[str, Any] = {"model": model_state}
    if optimizer is not None:
        state["optimizer"] = optim_state
    return state


def apply_state(model: nn.Module, optimizer: Any | None, state: dict[str, Any]) -> None:
    """Load what DCP read into ``state`` (from ``current_state``) into model and optimizer."""
    optimizers = [optimizer] if optimizer is not None else []
    set_state_dict(model, optimizers, model_state_dict=state["model"],
                   optim_state_dict=state.get("optimizer", {}))
