"""Preemption notices and the agreement to stop; the final snapshot is the manager's.

Spot capacity is reclaimed with a notice (AWS about 2 minutes, GCP and Azure
about 30 seconds). A notice is any of:

* a signal to this worker (``preempt.signals``, default SIGTERM and SIGUSR1),
  sent by the scheduler or forwarded by ``elastictrain run`` when the launcher
  itself is signalled;
* a file appearing at ``preempt.file``;
* a cloud metadata endpoint ``preempt.url`` answering with a pending action
  (AWS spot ``instance-action``, GCP ``preempted``, Azure scheduled events),
  polled by local rank 0 of each node.

Lifecycle of one notice, on every rank::

    quiet ──notice (signal / file / url, on any rank)──▶ noticed (locally)
    noticed ──step boundary: one small all-reduce (MAX)──▶ agreed (all ranks)
    agreed ──SnapshotManager: wait for the save in flight, save this step──▶
        committed ──``preempt.saved``──▶ exit 75 (EXIT_PREEMPTED: resume me elsewhere)
        not committed ──``preempt.failed``──▶ exit 76 (EXIT_PREEMPTED_UNSAVED)

Agreement rides on the all-reduce :class:`SnapshotManager` already does at each
step boundary for its time trigger, so preemption costs no extra collective:
each rank contributes ``[noticed, notice_age_ms]`` and MAX gives every rank the
same decision and the age of the earliest notice, which is what the grace
period is measured against.

Signal handlers only record the notice (no logging, no locks: a handler runs
between two bytecodes of whatever the main thread was doing, possibly inside
the logger); the ``preempt.notice`` event is written at the step boundary.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any
from urllib.parse import urlsplit

from elastictrain.core.config import PreemptConfig
from elastictrain.core.errors import EXIT_PREEMPTED
from elastictrain.core.log import get_logger

log = get_logger("elastictrain.preempt")

# What a metadata endpoint answers when nothing is pending (besides HTTP 404).
_QUIET_BODIES = {"", "false", "none", "null"}
_HTTP_TIMEOUT_S = 2.0


class PreemptedExit(SystemExit):
    """Raised out of ``SnapshotManager.step()`` after the final snapshot of a notice.

    A ``SystemExit`` so that ``except Exception`` in a training loop does not
    swallow it while ``finally`` blocks (``elastictrain.shutdown()``) still run;
    the process exits with :data:`~elastictrain.core.errors.EXIT_PREEMPTED` when the
    final snapshot committed, :data:`~elastictrain.core.errors.EXIT_PREEMPTED_UNSAVED`
    when it did not.
    """

    def __init__(self, code: int = EXIT_PREEMPTED) -> None:
        super().__init__(code)


@dataclass(frozen=True)
class Notice:
    """The first notice this process saw."""

    source: str  # "signal", "file" or "url"
    detail: str
    at: float  # time.monotonic() when it was seen


@dataclass(frozen=True)
class StopRequest:
    """All ranks agreed to stop at this step boundary."""

    notice_age_s: float  # age of the earliest notice on any rank, at agreement
    agreed_at: float  # time.monotonic() on this rank
    local: Notice | None  # this rank's own notice, if it saw one
    grace_period_s: float


class PreemptionWatcher:
    """Collects notices from signals, a file and a metadata URL.

    Args:
        config: sources and grace period.
        poll: run the file / URL poller in this process (local rank 0 of a node;
            one poller per node is enough because ranks agree on any notice).
    """

    def __init__(self, config: PreemptConfig, *, poll: bool = True) -> None:
        self.config = config
        self._poll = poll and (config.file is not None or config.url is not None)
        self._notice: Notice | None = None
        self._logged = False
        self._previous: dict[int, Any] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._url_checker = (
            MetadataChecker(config.url, config.url_style) if config.url else None
        )

    # -- lifecycle ---------------------------------------------------------------------
    def start(self) -> PreemptionWatcher:
        """Install the signal handlers and start the poller thread (if any)."""
        self._install_signals()
        if self._poll:
            context = contextvars.copy_context()  # events keep run_id, rank, ...
            self._thread = threading.Thread(target=context.run, args=(self._poll_loop,),
                                            name="elastictrain-preempt", daemon=True)
            self._thread.start()
        return self

    def close(self, *, restore_signals: bool = True) -> None:
        """Stop polling and (by default) put the previous signal handlers back."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=_HTTP_TIMEOUT_S + 1)
            self._thread = None
        if not restore_signals:
            return
        for signum, handler in self._previous.items():
            with contextlib.suppress(ValueError):  # not the main thread: the process is ending
                signal.signal(signum, handler)
        self._previous.clear()

    # -- notices -----------------------------------------------------------------------
    @property
    def notice(self) -> Notice | None:
        return self._notice

    def notify(self, source: str, detail: str) -> None:
        """Record a notice (the first one wins). Safe to call from a signal handler."""
        if self._notice is None:
            self._notice = Notice(source, detail, time.monotonic())

    def flags(self) -> list[int]:
        """This rank's contribution to the step-boundary all-reduce: [noticed, age_ms]."""
        notice = self._notice
        if notice is None:
            return [0, 0]
        age_ms = int((time.monotonic() - notice.at) * 1000)
        if not self._logged:
            self._logged = True
            log.warning("preempt.notice", source=notice.source, detail=notice.detail,
                        age_s=round(age_ms / 1000, 3), grace_period_s=self.config.grace_period_s)
        return [1, age_ms]

    def agreed(self, reduced: Sequence[int]) -> StopRequest | None:
        """The stop decision from the all-reduced ``flags()`` (same on every rank)."""
        if not reduced or not reduced[0]:
            return None
        notice = self._notice
        if notice is not None and not self._logged:
            # Our own notice came during the all-reduce a peer's notice decided: say so
            # now, as the next step boundary (where flags() would) never comes.
            self._logged = True
            log.warning("preempt.notice", source=notice.source, detail=notice.detail,
                        age_s=round(time.monotonic() - notice.at, 3),
                        grace_period_s=self.config.grace_period_s)
        return StopRequest(notice_age_s=reduced[1] / 1000, agreed_at=time.monotonic(),
                           local=self._notice, grace_period_s=self.config.grace_period_s)

    # -- sources -----------------------------------------------------------------------
    def _install_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            log.warning("preempt.signals_unavailable", reason="not the main thread",
                        fix="call elastictrain.init() from the main thread")
            return
        for name in self.config.signals:
            signum = getattr(signal, name)
            self._previous[signum] = signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.notify("signal", signal.Signals(signum).name)

    def _poll_loop(self) -> None:
        while not self._stop.is_set() and self._notice is None:
            found = self.poll_once()
            if found is not None and self._notice is None:
                self._logged = True  # logged here, now, rather than at the step boundary
                self.notify(*found)
                log.warning("preempt.notice", source=found[0], detail=found[1], age_s=0.0,
                            grace_period_s=self.config.grace_period_s)
                return
            self._stop.wait(self.config.poll_interval_s)

    def poll_once(self) -> tuple[str, str] | None:
        """Check the file and the URL once; ``(source, detail)`` if either gives notice."""
        if self.config.file is not None and os.path.exists(self.config.file):
            return "file", self.config.file
        if self._url_checker is not None:
            detail = self._url_checker.check()
            if detail is not None:
                return "url", detail
        return None


class MetadataChecker:
    """One metadata endpoint, asked "is an interruption pending?".

    Styles (``preempt.url_style``):

    * ``aws``: ``http://169.254.169.254/latest/meta-data/spot/instance-action``
      answers 404 until an action is scheduled, then 200 with JSON
      (``{"action": "terminate", "time": ...}``). An IMDSv2 session token is
      fetched from ``/latest/api/token`` on the same host (IMDSv1 if refused).
    * ``gcp``: ``http://metadata.google.internal/computeMetadata/v1/instance/preempted``
      with ``Metadata-Flavor: Google`` answers ``FALSE`` / ``TRUE``.
    * ``azure``: ``http://169.254.169.254/metadata/scheduledevents?api-version=2020-07-01``
      with ``Metadata: true``: a notice when an event of type ``Preempt`` is listed.
    * ``plain``: 200 with a body other than empty/``false`` is a notice; 404 is not.

    A failed request is never a notice; it is logged (``preempt.poll_failed``),
    first time and then once a minute.
    """

    def __init__(self, url: str, style: str) -> None:
        self.url = url
        self.style = style
        self._token: str | None = None
        self._failures = 0
        self._last_failure_log = -1e9

    def check(self) -> str | None:
        """The notice detail if one is pending, else None."""
        try:
            status, body = self._get()
        except (urllib.error.URLError, OSError, ValueError) as exc:
            self._failed(exc)
            return None
        self._failures = 0
        if status != 200:
            return None
        return self._interpret(body)

    def _headers(self) -> dict[str, str]:
        if self.style == "gcp":
            return {"Metadata-Flavor": "Google"}
        if self.style == "azure":
            return {"Metadata": "true"}
        if self.style == "aws":
            token = self._token or self._fetch_token()
            return {"X-aws-ec2-metadata-token": token} if token else {}
        return {}

    def _get(self) -> tuple[int, str]:
        request = urllib.request.Request(self.url, headers=self._headers())
        try:
            with urllib.request.urlopen(request, timeout=_HTTP_TIMEOUT_S) as response:
                return int(response.status), response.read(65536).decode("utf-8", "replace")
        except urllib.error.HTTPError as exc:
            if exc.code == 401 and self.style == "aws":
                self._token = None  # expired session token: fetch a new one next time
            return int(exc.code), ""

    def _fetch_token(self) -> str | None:
        parts = urlsplit(self.url)
        request = urllib.request.Request(
            f"{parts.scheme}://{parts.netloc}/latest/api/token", method="PUT",
            headers={"X-aws-ec2-metadata-token-ttl-seconds": "21600"})
        try:
            with urllib.request.urlopen(request, timeout=_HTTP_TIMEOUT_S) as response:
                self._token = response.read(4096).decode().strip() or None
        except (urllib.error.URLError, OSError):
            self._token = None  # IMDSv1 (no token) still answers where v2 is optional
        return self._token

    def _interpret(self, body: str) -> str | None:
        text = body.strip()
        if self.style == "azure":
            try:
                events = json.loads(text or "{}").get("Events", [])
            except (json.JSONDecodeError, AttributeError):
                return None
            preempts = [e for e in events
                        if isinstance(e, dict) and e.get("EventType") == "Preempt"]
            return json.dumps(preempts[0])[:500] if preempts else None
        if text.lower() in _QUIET_BODIES:
            return None
        return text[:500]

    def _failed(self, exc: BaseException) -> None:
        self._failures += 1
        now = time.monotonic()
        if now - self._last_failure_log >= 60:
            self._last_failure_log = now
            log.warning("preempt.poll_failed", url=self.url, error=str(exc),
                        error_type=type(exc).__name__, failures=self._failures)


# -- the process-wide watcher (one per worker, like its signal handlers) -----------------
_current: PreemptionWatcher | None = None


def install(config: PreemptConfig, *, poll: bool = True) -> PreemptionWatcher | None:
    """Start the process-wide watcher (``elastictrain.init`` calls this)."""
    global _current
    uninstall()
    if not config.enabled:
        return None
    _current = PreemptionWatcher(config, poll=poll).start()
    return _current


def uninstall(*, restore_signals: bool = True) -> None:
    """Stop the process-wide watcher, if any."""
    global _current
    if _current is not None:
        _current.close(restore_signals=restore_signals)
        _current = None


def current() -> PreemptionWatcher | None:
    """The watcher ``install`` started in this process, if any."""
    return _current
