"""The ``train.progress`` event: a loss tensor that requires grad is read without torch's
warning (it would reach the terminal through rank 0's output in the run view)."""

from __future__ import annotations

import warnings

import torch
from structlog.testing import capture_logs

from elastictrain.snapshot.schedule.progress import ProgressReport


def test_a_loss_that_requires_grad_is_logged_without_a_warning() -> None:
    now = [0.0]
    report = ProgressReport(1.0, lambda: now[0])
    loss = (torch.ones(2, requires_grad=True) * 0.5).sum()
    now[0] = 2.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with capture_logs() as logs:
            report.step(loss)
    assert [(e["event"], e["loss"]) for e in logs] == [("train.progress", 1.0)]
