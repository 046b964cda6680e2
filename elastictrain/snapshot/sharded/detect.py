"""Whether a model is sharded, without importing what saves sharded state.

DCP and DTensor take about a second to import on a small CPU, in every worker at every
restart; a DDP job never needs them, so the manager asks this module first and imports
the sharded savers only for a sharded model.
"""

from __future__ import annotations

import sys

from torch import nn


def has_dtensor_params(model: nn.Module) -> bool:
    """Whether ``model`` is sharded (FSDP2 / any DTensor layout): its parameters are
    DTensors. No parameter can be one unless ``torch.distributed.tensor`` was imported
    (``fully_shard`` and ``distribute_tensor`` import it), so it is not imported here."""
    dtensor_module = sys.modules.get("torch.distributed.tensor")
    if dtensor_module is None:
        return False
    dtensor = dtensor_module.DTensor
    return any(isinstance(p, dtensor) for p in model.parameters())
