"""SnapshotManager.close() logs the final parameters' digest, the one chaos compares."""

from __future__ import annotations

from pathlib import Path

import torch
from structlog.testing import capture_logs

from elastictrain.snapshot.format.digest import param_digest
from elastictrain.snapshot.manager import SnapshotManager


def test_close_logs_the_digest_of_the_unwrapped_model(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    manager = SnapshotManager(str(tmp_path), model=model, every_steps=1)
    with capture_logs() as logs:
        manager.close()
    digests = [e["param_digest"] for e in logs if e["event"] == "params.digest"]
    assert digests == [param_digest(model)]
    with torch.no_grad():
        model.weight[0, 0] += 1e-6  # any bit changes the digest
    assert param_digest(model) != digests[0]
