"""Work that must run when the interpreter begins to exit, before its thread pools stop.

``atexit`` is too late for network I/O: by then ``concurrent.futures`` refuses new
work ("cannot schedule new futures after interpreter shutdown"), and an asyncio HTTP
client that resolves a host name in a thread pool (aiohttp, under s3fs) fails every
request. Python runs the hooks of ``threading._register_atexit`` first, in reverse
order of registration, before that refusal; a hook registered after the thread pools
exist runs before they stop. Python 3.9+ has it (a private name: where it is missing
the hook falls back to ``atexit``)."""

from __future__ import annotations

import atexit
import threading
from collections.abc import Callable


def before_interpreter_shutdown(hook: Callable[[], None]) -> None:
    """Run ``hook`` at the interpreter's exit, while thread pools still take work."""
    register = getattr(threading, "_register_atexit", None)
    if register is None:
        atexit.register(hook)
        return
    try:
        register(hook)
    except RuntimeError:  # the interpreter is already shutting down
        atexit.register(hook)
