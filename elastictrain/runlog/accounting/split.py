"""Split a run's wall time into causes that close to 100%, attempt by attempt.

Every second from the first event of the run (the launcher's or rank 0's) to the
last lands in exactly one cause:

* ``productive``: training steps that survive into the final state;
* ``lost_work``: steps trained and then lost to a failure (redone after it);
* ``snapshot_blocking``: the loop blocked staging a snapshot, waiting for the
  one in flight or for its copy behind (``snapshot.staged``, ``snapshot.backpressure``,
  ``snapshot.copy_wait``), per tier;
* ``restore``: loading a snapshot (``snapshot.loaded``);
* ``restart``: failure detection, process start, imports, rendezvous, model build,
  teardown: everything before ``resume`` or between attempts while a launch was up;
* ``between_launches``: no launch of the run was up (after Ctrl-C, a preemption or a
  lost job, until the next launch on the same storage started: a requeue waiting to
  be scheduled, a user relaunching by hand);
* ``preempt_drain``: from a preemption notice to the final snapshot (``preempt.saved``);
* ``hang``: no progress until the watchdog fired (``watchdog.fired``);
* ``suspect``: training on a restored snapshot that turned out to make no sense
  (``snapshot.suspect``): the whole training window of that attempt, thrown away with it.

An attempt's training window runs from its ``resume`` to its end: its last event,
or later when the next attempt's ``resume`` reports steps trained after it (a
SIGKILL leaves no event), extrapolated at the attempt's step rate. The window less
its blocking, drain and hang spans is stepping time; the share of its steps that
the next attempt redid is lost work, the last stretch of the window.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastictrain.runlog.accounting.attempts import Event, read_agent_events, read_attempts

CAUSES = ("productive", "lost_work", "snapshot_blocking", "restore", "restart",
          "between_launches", "preempt_drain", "hang", "suspect")
DEFAULT_TIER = "durable"  # snapshots name no tier yet: there is one


@dataclass(frozen=True)
class Span:
    """``cause`` from ``start`` to ``end`` (epoch seconds); ``tier`` for snapshot blocking."""

    cause: str
    start: float
    end: float
    tier: str | None = None

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass
class Attempt:
    """One worker process lifetime on rank 0, with its spans and marks."""

    index: int
    start: float
    end: float
    from_step: int | None
    to_step: int
    lost_steps: int
    ended_by: str
    spans: list[Span] = field(default_factory=list)
    commits: list[tuple[float, int, str]] = field(default_factory=list)  # ts, step, tier
    launch: str | None = None  # the launch (``launch_id``) it belongs to


@dataclass
class Split:
    """The whole run: wall time, seconds per cause, and the attempts behind them."""

    start: float
    end: float
    seconds: dict[str, float]
    blocking_by_tier: dict[str, float]
    attempts: list[Attempt]

    @property
    def wall_s(self) -> float:
        return self.end - self.start

    def to_dict(self) -> dict[str, Any]:
        wall = self.wall_s or 1.0
        return {
            "wall_s": round(self.wall_s, 3),
            "seconds": {c: round(s, 3) for c, s in self.seconds.items()},
            "fractions": {c: round(s / wall, 4) for c, s in self.seconds.items()},
            "snapshot_blocking_by_tier": {t: round(s, 4)
                                          for t, s in self.blocking_by_tier.items()},
            "attempts": [{"index": a.index, "start_s": round(a.start - self.start, 3),
                          "end_s": round(a.end - self.start, 3), "from_step": a.from_step,
                          "to_step": a.to_step, "lost_steps": a.lost_steps,
                          "ended_by": a.ended_by, "launch": a.launch}
                         for a in self.attempts],
        }


def split_run(events_dir: str | Path) -> Split:
    """Account every second of one run's wall time to a cause.

    Raises:
        FileNotFoundError: no rank-0 event files there (names the directory and the fix).
    """
    raw = read_attempts(events_dir)
    if not raw:
        raise FileNotFoundError(
            f"{events_dir}: no attempt*-rank0.jsonl event files; fix: point at a run's "
            "events directory, e.g. <storage>/events/<run id>")
    agent = read_agent_events(events_dir)
    rates = [r for r in (_step_time(events) for events in raw) if r is not None]
    fallback_rate = sorted(rates)[len(rates) // 2] if rates else 0.0
    attempts: list[Attempt] = []
    for i, events in enumerate(raw):
        attempts.append(_attempt(i, events, raw[i + 1:], agent, fallback_rate))
        attempts[-1].launch = events[0].get("launch_id")
    start = min([attempts[0].start] + [e["ts"] for e in agent])
    end = max([attempts[-1].end] + [e["ts"] for e in agent])
    _fill_gaps(attempts, start, end, _launch_spans(attempts, agent))
    for attempt in attempts:
        attempt.spans = [span for span in attempt.spans if span.end > span.start]
    seconds = dict.fromkeys(CAUSES, 0.0)
    tiers: dict[str, float] = {}
    for attempt in attempts:
        for span in attempt.spans:
            seconds[span.cause] += span.seconds
            if span.tier is not None:
                tiers[span.tier] = tiers.get(span.tier, 0.0) + span.seconds
    return Split(start, end, seconds, tiers, attempts)


def _resume(events: list[Event]) -> Event | None:
    return next((e for e in events if e.get("event") == "resume"), None)


def _stepped(events: list[Event]) -> list[Event]:
    return [e for e in events if isinstance(e.get("step"), int)]


def _step_time(events: list[Event]) -> float | None:
    """Seconds per step in this attempt, from its resume to its last stepped event."""
    resume = _resume(events)
    if resume is None:
        return None
    from_step = int(resume.get("from_step") or 0)
    last = max(_stepped(events), key=lambda e: (e["step"], e["ts"]))
    if last["step"] <= from_step or last["ts"] <= resume["ts"]:
        return None
    return (last["ts"] - resume["ts"]) / (last["step"] - from_step)


def _attempt(index: int, events: list[Event], later: list[list[Event]],
             agent: list[Event], fallback_rate: float) -> Attempt:
    start, last_ts = events[0]["ts"], events[-1]["ts"]
    next_start = later[0][0]["ts"] if later else None
    resume = _resume(events)
    commits = [(e["ts"], int(e["snapshot_step"]), str(e.get("tier") or DEFAULT_TIER))
               for e in events if e.get("event") == "snapshot.committed"]
    ended_by = _ended_by(events, agent, start, next_start)
    if resume is None:  # died before training: all of it was start-up
        return Attempt(index, start, last_ts, None, 0, 0, ended_by,
                       [Span("restart", start, last_ts)], commits)
    from_step = int(resume.get("from_step") or 0)
    stepped = _stepped(events)
    last = max(stepped, key=lambda e: (e["step"], e["ts"]))
    high = int(last["step"])
    # The first later attempt that got to train says what survived: one killed in
    # start-up (before its resume) restored nothing and lost nothing of its own; one
    # that found its restore suspect kept nothing (the next one fell back further).
    next_resume = next((r for r, later_events in zip(map(_resume, later), later, strict=True)
                        if r is not None and not _suspect(later_events)), None)
    if next_resume is not None and next_resume.get("lost_steps") is not None:
        high = max(high, int(next_resume.get("from_step") or 0)
                   + int(next_resume["lost_steps"]))
    rate = _step_time(events) or fallback_rate
    end = max(last_ts, last["ts"] + (high - int(last["step"])) * rate)
    if next_start is not None:
        end = min(end, next_start)
    end = max(end, last_ts)
    kept = _kept_step(events, next_resume, ended_by, from_step, commits)
    lost = max(0, min(high - kept, high - from_step))
    spans = _startup_spans(events, start, resume["ts"])
    kept_at = next((float(e["ts"]) for e in events if e.get("event") == "snapshot.staged"
                    and e.get("snapshot_step") == kept), None)
    window = _window_spans(events, resume["ts"], end, high - from_step, lost, kept_at)
    if _suspect(events):  # its work stood on a state that made no sense: all of it goes
        window = [Span("suspect", w.start, w.end) if w.cause in ("productive", "lost_work")
                  else w for w in window]
    spans += window
    return Attempt(index, start, end, from_step or None, high, lost, ended_by, spans, commits)


def _suspect(events: list[Event]) -> bool:
    return any(e.get("event") == "snapshot.suspect" for e in events)


def _kept_step(events: list[Event], next_resume: Event | None, ended_by: str,
               from_step: int, commits: list[tuple[float, int, str]]) -> int:
    """The step this attempt's work survives to: where the next attempt resumed, or
    all of it when the run finished, or the last commit when the run ended here."""
    if next_resume is not None:
        return int(next_resume.get("from_step") or 0)
    if ended_by in ("finished", "preempted"):
        return max(int(e["step"]) for e in _stepped(events))
    return max([from_step] + [step for _, step, _ in commits])


def _startup_spans(events: list[Event], start: float, resume_ts: float) -> list[Span]:
    """Start-up before ``resume``: the snapshot load is restore, the rest restart."""
    loaded = next((e for e in events if e.get("event") == "snapshot.loaded"), None)
    if loaded is None:
        return [Span("restart", start, resume_ts)]
    r_end = min(max(float(loaded["ts"]), start), resume_ts)
    r_start = max(start, r_end - float(loaded.get("duration_s") or 0.0))
    return [Span("restart", start, r_start), Span("restore", r_start, r_end),
            Span("restart", r_end, resume_ts)]


def _window_spans(events: list[Event], begin: float, end: float, trained: int, lost: int,
                  kept_at: float | None) -> list[Span]:
    """The training window: blocking, drain and hang spans as logged; the time between
    them is stepping, productive up to the snapshot the work survives to (``kept_at``,
    when it was staged here) or else the steps' share, lost after it."""
    marked: list[Span] = []
    for e in events:
        name = e.get("event")
        if name == "snapshot.staged":
            marked.append(_ending("snapshot_blocking", e, "duration_s", e.get("tier")))
        elif name in ("snapshot.backpressure", "snapshot.copy_wait"):
            marked.append(_ending("snapshot_blocking", e, "wait_s", e.get("tier")))
        elif name in ("preempt.saved", "preempt.failed"):
            marked.append(_ending("preempt_drain", e, "duration_s"))
        elif name == "watchdog.fired":
            marked.append(_ending("hang", e, "idle_s"))
    spans: list[Span] = []
    cursor = begin
    for span in sorted(marked, key=lambda s: s.start):
        s, t = max(span.start, cursor), min(span.end, end)
        if t > s:
            spans.append(Span(span.cause, s, t, span.tier))
            cursor = t
    gaps, cursor = [], begin
    for span in spans:
        if span.start > cursor:
            gaps.append((cursor, span.start))
        cursor = span.end
    if end > cursor:
        gaps.append((cursor, end))
    stepping = sum(b - a for a, b in gaps)
    if lost == 0:
        productive_left = stepping
    elif kept_at is not None:
        productive_left = sum(min(b, kept_at) - a for a, b in gaps if a < kept_at)
    else:
        productive_left = stepping * (1 - lost / trained) if trained > 0 else stepping
    for a, b in gaps:
        take = min(b - a, max(productive_left, 0.0))
        if take > 0:
            spans.append(Span("productive", a, a + take))
        if b - a - take > 0:
            spans.append(Span("lost_work", a + take, b))
        productive_left -= take
    return spans


def _ending(cause: str, event: Event, duration_field: str, tier: Any = None) -> Span:
    ts = float(event["ts"])
    duration = float(event.get(duration_field) or 0.0)
    return Span(cause, ts - duration, ts,
                str(tier or DEFAULT_TIER) if cause == "snapshot_blocking" else None)


def _ended_by(events: list[Event], agent: list[Event], start: float,
              next_start: float | None) -> str:
    """Why the attempt ended, from its own last words or, for a silent death, the
    launcher's report of the failed worker."""
    names = {e.get("event") for e in events}
    for name, cause in (("snapshot.suspect", "suspect snapshot"),
                        ("run.finished", "finished"), ("preempt.saved", "preempted"),
                        ("preempt.failed", "preempted, final snapshot failed"),
                        ("watchdog.fired", "hang (watchdog)"), ("demo.kill", "SIGKILL (demo)")):
        if name in names:
            return cause
    for e in agent:
        before_next = next_start is None or e["ts"] < next_start
        if e.get("event") == "agent.worker_failed" and e["ts"] >= start and before_next:
            return str(e.get("signal") or f"exit {e.get('exit_code')}")
    # The worker's own last word when no launcher's events are beside (plain torchrun).
    error = next((e for e in events if e.get("event") in ("worker.failed", "worker.error")),
                 None)
    if error is not None:
        return f"{error.get('error')} at {error.get('where')}"
    return "failed (no event)" if next_start is not None else "ended (no event)"


def _launch_spans(attempts: list[Attempt], agent: list[Event]) -> list[tuple[float, float]]:
    """From the first to the last event of each launch (its agents' and workers')."""
    spans: dict[str, tuple[float, float]] = {}

    def cover(launch: object, first: float, last: float) -> None:
        key = str(launch)
        low, high = spans.get(key, (first, last))
        spans[key] = (min(low, first), max(high, last))

    for attempt in attempts:
        cover(attempt.launch, attempt.start, attempt.end)
    for event in agent:
        cover(event.get("launch_id"), event["ts"], event["ts"])
    return sorted(spans.values())


def _gap_spans(start: float, end: float, launches: list[tuple[float, float]]) -> list[Span]:
    """``start``..``end`` as restart while a launch was up, between launches otherwise."""
    spans: list[Span] = []
    cursor = start
    for low, high in launches:
        if high <= cursor or low >= end:
            continue
        if low > cursor:
            spans.append(Span("between_launches", cursor, low))
        spans.append(Span("restart", max(cursor, low), min(end, high)))
        cursor = min(end, high)
    if end > cursor:
        spans.append(Span("between_launches" if launches else "restart", cursor, end))
    return [span for span in spans if span.end > span.start]


def _fill_gaps(attempts: list[Attempt], start: float, end: float,
               launches: list[tuple[float, float]]) -> None:
    """Time before, between and after attempts is restart (detection, launch, teardown),
    or between launches where no launch was up; each gap goes on the lane of the attempt
    it leads to (the last one: after it)."""
    cursor = start
    for attempt in attempts:
        if attempt.start > cursor:
            attempt.spans[:0] = _gap_spans(cursor, attempt.start, launches)
        cursor = max(cursor, attempt.end)
    if end > cursor:
        attempts[-1].spans += _gap_spans(cursor, end, launches)


def format_split(split: Split) -> str:
    """The split as a table for humans, closing to 100%."""
    wall = split.wall_s or 1.0
    names = {"productive": "productive", "lost_work": "lost work",
             "snapshot_blocking": "snapshot blocking", "restore": "restore",
             "restart": "restarts / start-up", "between_launches": "between launches",
             "preempt_drain": "preemption drain", "hang": "hang (watchdog)",
             "suspect": "suspect restore"}
    lost = sum(a.lost_steps for a in split.attempts)
    launches = len({a.launch for a in split.attempts})
    spans = f"{launches} launches, " if launches > 1 else ""
    lines = [f"goodput {split.seconds['productive'] / wall:.1%} of {split.wall_s:.1f}s wall, "
             f"{spans}{len(split.attempts)} attempts, final step "
             f"{split.attempts[-1].to_step}, {lost} steps lost"]
    for cause in CAUSES:
        secs = split.seconds[cause]
        lines.append(f"  {names[cause]:<22}{secs:9.2f}s  {secs / wall:6.1%}")
        if cause == "snapshot_blocking":
            for tier, tier_s in sorted(split.blocking_by_tier.items()):
                lines.append(f"    tier {tier:<16}{tier_s:9.3f}s")
    ends = ", ".join(f"#{a.index} {a.ended_by}" for a in split.attempts)
    lines.append(f"  attempts: {ends}")
    return "\n".join(lines)
