"""elastictrain: fault-tolerant, elastic training for PyTorch DDP under torchrun.

Public API::

    rt = elastictrain.init()                       # logging + process group
    sampler = elastictrain.ElasticSampler(len(ds), batch_size, rt.rank, rt.world_size)
    snap = elastictrain.SnapshotManager(url, model=ddp, optimizer=opt, sampler=sampler,
                                        ctx=rt.ctx)
    snap.restore(); ...; snap.step(); ...; snap.close(); elastictrain.shutdown()

The names are imported on first use (PEP 562), so that the ``elastictrain`` command's
operator subcommands (status, goodput, snapshots, events) and any ``elastictrain.*``
module that needs no torch start without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from elastictrain.version import __version__

if TYPE_CHECKING:
    from elastictrain.config import Settings, load_settings
    from elastictrain.data import ElasticSampler, Micro, MicroBatchSampler, optimizer_steps
    from elastictrain.errors import (
        ConfigError,
        ElasticTrainError,
        SnapshotCorrupt,
        StorageError,
    )
    from elastictrain.runtime import Runtime, init, shutdown
    from elastictrain.snapshot.manager import ResumeInfo, SnapshotManager

# Public name → the module that defines it.
_HOMES = {
    "Settings": "elastictrain.config",
    "load_settings": "elastictrain.config",
    "ElasticSampler": "elastictrain.data",
    "Micro": "elastictrain.data",
    "MicroBatchSampler": "elastictrain.data",
    "optimizer_steps": "elastictrain.data",
    "ConfigError": "elastictrain.errors",
    "ElasticTrainError": "elastictrain.errors",
    "SnapshotCorrupt": "elastictrain.errors",
    "StorageError": "elastictrain.errors",
    "Runtime": "elastictrain.runtime",
    "init": "elastictrain.runtime",
    "shutdown": "elastictrain.runtime",
    "ResumeInfo": "elastictrain.snapshot.manager",
    "SnapshotManager": "elastictrain.snapshot.manager",
}

__all__ = [
    "ConfigError",
    "ElasticSampler",
    "ElasticTrainError",
    "Micro",
    "MicroBatchSampler",
    "ResumeInfo",
    "Runtime",
    "Settings",
    "SnapshotCorrupt",
    "SnapshotManager",
    "StorageError",
    "__version__",
    "init",
    "load_settings",
    "optimizer_steps",
    "shutdown",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'elastictrain' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return __all__
