"""elastictrain: fault-tolerant, elastic training for PyTorch DDP under torchrun.

Public API::

    rt = elastictrain.init()                       # logging + process group
    sampler = elastictrain.ElasticSampler(len(ds), batch_size, rt.rank, rt.world_size)
    snap = elastictrain.SnapshotManager(url, model=ddp, optimizer=opt, sampler=sampler,
                                        ctx=rt.ctx)
    snap.restore(); ...; snap.step(); ...; snap.close(); elastictrain.shutdown()
"""

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
from elastictrain.version import __version__

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
