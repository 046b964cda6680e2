"""elastictrain: fault-tolerant, elastic training for PyTorch DDP under torchrun.

Public API::

    rt = elastictrain.init()                       # logging + process group
    sampler = elastictrain.ElasticSampler(len(ds), batch_size, rt.rank, rt.world_size)
    # token shards for a language model: ds = elastictrain.TokenDataset(paths, seq_len),
    # ElasticSampler(..., fingerprint=ds.fingerprint)
    snap = elastictrain.SnapshotManager(url, model=ddp, optimizer=opt, sampler=sampler,
                                        ctx=rt.ctx)
    snap.restore(); ...; snap.step(); ...; snap.close(); elastictrain.shutdown()
    elastictrain.export(url, "model.safetensors")  # a verified snapshot's model, one file

The names are imported on first use (PEP 562), so that the ``elastictrain`` command's
operator subcommands (status, goodput, snapshots, events) and any ``elastictrain.*``
module that needs no torch start without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from elastictrain.version import __version__

if TYPE_CHECKING:
    from elastictrain.core.config import Settings, load_settings
    from elastictrain.core.errors import (
        ConfigError,
        ElasticTrainError,
        SnapshotCorrupt,
        StorageError,
    )
    from elastictrain.runtime import init, shutdown
    from elastictrain.snapshot.export.api import export
    from elastictrain.snapshot.manager import ResumeInfo, SnapshotManager
    from elastictrain.worker.data import ElasticSampler, Micro, MicroBatchSampler, optimizer_steps
    from elastictrain.worker.session import Runtime
    from elastictrain.worker.shard_sum import ShardSum
    from elastictrain.worker.tokens import TokenDataset

# Public name → the module that defines it.
_HOMES = {
    "Settings": "elastictrain.core.config",
    "load_settings": "elastictrain.core.config",
    "ElasticSampler": "elastictrain.worker.data",
    "Micro": "elastictrain.worker.data",
    "MicroBatchSampler": "elastictrain.worker.data",
    "optimizer_steps": "elastictrain.worker.data",
    "TokenDataset": "elastictrain.worker.tokens",
    "ShardSum": "elastictrain.worker.shard_sum",
    "ConfigError": "elastictrain.core.errors",
    "ElasticTrainError": "elastictrain.core.errors",
    "SnapshotCorrupt": "elastictrain.core.errors",
    "StorageError": "elastictrain.core.errors",
    "Runtime": "elastictrain.worker.session",
    "init": "elastictrain.runtime",
    "shutdown": "elastictrain.runtime",
    "ResumeInfo": "elastictrain.snapshot.manager",
    "SnapshotManager": "elastictrain.snapshot.manager",
    "export": "elastictrain.snapshot.export.api",
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
    "ShardSum",
    "SnapshotCorrupt",
    "SnapshotManager",
    "StorageError",
    "TokenDataset",
    "__version__",
    "export",
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
