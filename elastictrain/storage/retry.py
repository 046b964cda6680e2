"""Retrying failed operations: the one retry policy, and which storage faults are transient.

:class:`RetryPolicy` is how often, and after how long a wait, an operation that
failed is tried again: a storage request here, a whole snapshot persist in
:mod:`elastictrain.snapshot.durable.persister`.

On S3, three layers retry, each for what only it can see: botocore retries one
HTTP request (its retry mode and ``AWS_MAX_ATTEMPTS`` apply), s3fs retries
throttling it recognises, and the store's policy retries a whole operation (a PUT,
a part of a multipart upload, a listing) with exponential backoff and jitter, and
logs ``storage.retry`` so an operator sees a flaky store. Which faults are worth a
retry is the backend's call (``Backend.is_transient``, passed in by the backend that
runs the operation); faults a retry cannot fix (a missing bucket or object, denied
access, rejected credentials) fail on the first attempt.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from elastictrain.core.log import get_logger

T = TypeVar("T")

log = get_logger("elastictrain.storage")

# Jitter has its own generator: drawing from the process-global ``random`` would
# shift the user's Python RNG stream on every retry and break bit-exact resume.
_JITTER = random.Random()

# A storage operation's longest wait between tries.
STORAGE_MAX_DELAY_S = 20.0


@dataclass(frozen=True)
class RetryPolicy:
    """Up to ``max_consecutive_failures`` tries in a row. After failure ``k`` (1, 2, …)
    the next try waits ``backoff_s * 2**(k-1)``, at most ``max_delay_s``; with
    ``jitter``, a random part of that, between half and all of it."""

    max_consecutive_failures: int = 3
    backoff_s: float = 0.5
    max_delay_s: float = 30.0  # an outage can outlast many retries: keep trying often
    jitter: bool = False
    # What waits between tries: a test hands in its own clock and reads the waits.
    sleep: Callable[[float], None] = field(default=time.sleep, compare=False, repr=False)

    @classmethod
    def for_storage(cls, retries: int, backoff_s: float,
                    sleep: Callable[[float], None] = time.sleep) -> RetryPolicy:
        """A store's policy: ``retries`` tries after the first, jittered so that many
        ranks and upload parts retrying at once do not throttle the store in lockstep."""
        return cls(retries + 1, backoff_s, max_delay_s=STORAGE_MAX_DELAY_S, jitter=True,
                   sleep=sleep)

    @property
    def retries(self) -> int:
        """Tries after the first."""
        return self.max_consecutive_failures - 1

    def delay_s(self, failures: int) -> float:
        """The wait before the next try after ``failures`` failed ones (1, 2, …)."""
        ceiling = float(min(self.max_delay_s, self.backoff_s * 2 ** (failures - 1)))
        return ceiling * _JITTER.uniform(0.5, 1.0) if self.jitter else ceiling

    def run(self, fn: Callable[[], T], *, op: str, where: str,
            transient: Callable[[BaseException], bool],
            error_code: Callable[[BaseException], str | None]) -> tuple[T, int]:
        """Call a storage operation ``fn`` until it succeeds, fails with a fault that is
        not ``transient``, or has failed ``max_consecutive_failures`` times; return
        (result, retries). Each retry logs ``storage.retry`` (with ``error_code``'s
        reading of the fault).

        Raises:
            The last exception, untranslated, with ``retries_used`` set on it.
        """
        failures = 0
        while True:
            try:
                return fn(), failures
            except Exception as exc:
                failures += 1
                if failures >= self.max_consecutive_failures or not transient(exc):
                    exc.retries_used = failures - 1  # type: ignore[attr-defined]
                    raise
                delay = self.delay_s(failures)
                log.warning("storage.retry", op=op, path=where, attempt=failures,
                            retries=self.retries, delay_s=round(delay, 3),
                            error_type=type(exc).__name__,
                            error_code=error_code(exc))
                self.sleep(delay)
