"""Retrying storage operations: which faults are transient, and how long to wait.

Three layers retry S3 requests, each for what only it can see: botocore retries
one HTTP request (its retry mode and ``AWS_MAX_ATTEMPTS`` apply), s3fs retries
throttling it recognises, and this policy retries a whole operation (a PUT, a
part of a multipart upload, a listing) with exponential backoff and jitter, and
logs ``storage.retry`` so an operator sees a flaky store. Faults a retry cannot
fix (a missing bucket or object, denied access, rejected credentials) fail on
the first attempt.
"""

from __future__ import annotations

import errno
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from elastictrain.log import get_logger
from elastictrain.storage import s3

T = TypeVar("T")

log = get_logger("elastictrain.storage")

# Jitter has its own generator: drawing from the process-global ``random`` would
# shift the user's Python RNG stream on every retry and break bit-exact resume.
_JITTER = random.Random()

_TRANSIENT_ERRNOS = frozenset({errno.EIO, errno.EAGAIN, errno.ETIMEDOUT, errno.ECONNRESET,
                               errno.ECONNREFUSED, errno.EBUSY, errno.EREMOTEIO})
_PERMANENT = (FileNotFoundError, PermissionError, FileExistsError, IsADirectoryError,
              NotADirectoryError)


def is_transient(exc: BaseException) -> bool:
    """Whether retrying the operation that raised ``exc`` can succeed."""
    verdict = s3.is_transient(exc)
    if verdict is not None:
        return verdict
    if isinstance(exc, _PERMANENT):
        return False
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    return isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with jitter: attempt ``n`` waits about
    ``backoff_s * 2**n`` (between half and all of it), at most ``max_backoff_s``."""

    retries: int = 5
    backoff_s: float = 0.2
    max_backoff_s: float = 20.0

    def delay(self, attempt: int) -> float:
        ceiling = min(self.backoff_s * (2**attempt), self.max_backoff_s)
        # Jitter spreads retries of many ranks/parts so they do not throttle in lockstep.
        return ceiling * _JITTER.uniform(0.5, 1.0)

    def run(self, fn: Callable[[], T], *, op: str, where: str) -> tuple[T, int]:
        """Call ``fn`` until it succeeds or fails permanently; return (result, retries).

        Raises:
            The last exception, untranslated, with ``retries_used`` set on it.
        """
        attempt = 0
        while True:
            try:
                return fn(), attempt
            except Exception as exc:
                if attempt >= self.retries or not is_transient(exc):
                    exc.retries_used = attempt  # type: ignore[attr-defined]
                    raise
                delay = self.delay(attempt)
                log.warning("storage.retry", op=op, path=where, attempt=attempt + 1,
                            retries=self.retries, delay_s=round(delay, 3),
                            error_type=type(exc).__name__, error_code=s3.error_code(exc))
                time.sleep(delay)
                attempt += 1
