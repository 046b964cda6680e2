"""Test harness for an unmodified user script (tests/processes/e2e/test_user_script_accounting.py):
on ``PYTHONPATH``, Python imports it at start-up in every process of the job.

``ET_TEST_PARK_AT=N`` / ``ET_TEST_PARK_DIR=D``: on the first attempt, after step N
every rank waits for its save in flight to commit, writes ``D/parked-rank<R>`` (its
pid) and waits there to be killed by PID; SIGTERM ends it at once (plain torchrun
stops the survivors with SIGTERM, which a worker would otherwise take for a notice).
With ``ET_TEST_PARK_UNTIL_NOTICE=1`` SIGTERM stays a notice (``elastictrain run``
forwards Ctrl-C to its workers so) and the notice ends the wait: the script trains on
and its next step takes the final snapshot.

``ET_TEST_NO_NUMPY=1``: ``Tensor.numpy()`` raises as in an install without numpy.
"""

from __future__ import annotations

import os

if os.environ.get("ET_TEST_PARK_AT") or os.environ.get("ET_TEST_NO_NUMPY"):
    import signal
    import time
    from pathlib import Path
    from typing import Any

    import torch

    from elastictrain.snapshot.manager import SnapshotManager
    from elastictrain.worker import preempt

    if os.environ.get("ET_TEST_NO_NUMPY"):
        def _no_numpy(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("Numpy is not available")

        torch.Tensor.numpy = _no_numpy  # type: ignore[method-assign]

    park_at = int(os.environ.get("ET_TEST_PARK_AT") or 0)
    original_step = SnapshotManager.step

    def _step(self: SnapshotManager, *args: Any, **kwargs: Any) -> Any:
        handle = original_step(self, *args, **kwargs)
        first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if park_at and self.step_count == park_at and first:
            self.wait()  # the snapshot before the park is committed
            until_notice = os.environ.get("ET_TEST_PARK_UNTIL_NOTICE") == "1"
            if not until_notice:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
            marker = Path(os.environ["ET_TEST_PARK_DIR"]) / f"parked-rank{self.ctx.rank}"
            marker.write_text(str(os.getpid()))
            while True:  # until the test (or the launcher) kills this process
                watcher = preempt.current()
                if until_notice and watcher is not None and watcher.notice is not None:
                    break
                time.sleep(0.05)
        return handle

    SnapshotManager.step = _step  # type: ignore[method-assign]
