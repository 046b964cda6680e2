"""Imported by a test's standby (as a preload module): right after its next fork, in
the standby, stop or kill the standby itself (``ET_TEST_STANDBY_AFTER_FORK`` = ``stop``
or ``kill``): a standby that forked a worker and never answered, every time."""

from __future__ import annotations

import os
import signal

_SIGNALS = {"stop": signal.SIGSTOP, "kill": signal.SIGKILL}
_action = os.environ.get("ET_TEST_STANDBY_AFTER_FORK", "")
if _action in _SIGNALS:
    os.register_at_fork(after_in_parent=lambda: os.kill(os.getpid(), _SIGNALS[_action]))
