"""Reduce a run's events into its current state: one reducer for every view.

The live view, ``elastictrain status`` and its ``--json`` all read a
:class:`RunState`; nothing here touches a terminal or storage.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from elastictrain.core.errors import SnapshotSuspect
from elastictrain.runlog.launches import job_launch

RATE_WINDOW_S = 10.0  # the step rate is measured over this much recent wall time


def attempts_text(restarts: int) -> str:
    """``2 (1 restart)``: the attempts of a run that restarted ``restarts`` times."""
    return f"{restarts + 1} ({restarts} restart{'' if restarts == 1 else 's'})"


@dataclass
class Line:
    """One event worth a line in a view."""

    ts: float
    # "failure", "restart", "resume", "membership", "preempt", "snapshot", "memory", "end"
    kind: str
    text: str

    def to_dict(self) -> dict[str, Any]:
        return {"ts": self.ts, "kind": self.kind, "text": self.text}


@dataclass
class RunState:
    """What the events of one run say so far.

    Args:
        total_steps: the run's target step when the caller knows it (the demo).
        max_lines: how many recent event lines are kept.
    """

    total_steps: int | None = None
    max_lines: int = 200
    run_id: str | None = None
    attempt: int = 0  # torchrun's restart count inside the current launch
    launch: str | None = None  # the newest launch seen (a relaunch on the same storage)
    launches: int = 0
    world_size: int | None = None
    step: int = 0
    rank_steps: dict[int, int] = field(default_factory=dict)
    loss: float | None = None
    loss_step: int | None = None  # the step the loss was reported at (train.progress)
    last_snapshot: dict[str, Any] | None = None
    first_ts: float | None = None
    last_ts: float | None = None
    finished: str | None = None  # "finished", "preempted", "fatal", … once the run ended
    lost_steps: int = 0  # summed over the resumes (rank 0's)
    # The step of the final snapshot: after a notice, or at a finished run's close()
    final_snapshot: int | None = None
    events: int = 0
    agent_seen: bool = False  # launched by elastictrain run/demo: the agent logs the end
    ended: bool = False  # nothing more will be written (the launcher or, without one, rank 0)
    lines: deque[Line] = field(default_factory=deque)
    # What of the node-memory tier is off now (a full /dev/shm): what -> the error.
    memory_degraded: dict[str, str] = field(default_factory=dict)
    # Restored snapshots that made no sense and were set aside: step -> why.
    suspects: dict[int, str] = field(default_factory=dict)
    _samples: deque[tuple[float, int]] = field(default_factory=deque)
    _notice_ts: float | None = None
    _resumed_at: int = 0  # the step the current attempt resumed from
    _failure_shown: tuple[Any, ...] | None = None  # the error whose traceback was shown
    _worker_named: bool = False  # a worker's event named the run (see apply)
    # Each launch id seen (a node's launcher) -> the job launch it belongs to (1, 2, ...),
    # and the newest restart count of its workers (an older one's line is a late one).
    _launch_of: dict[str, int] = field(default_factory=dict)
    _restarts: dict[object, int] = field(default_factory=dict)

    def apply(self, event: dict[str, Any]) -> None:
        """Fold one event into the state (events of a run, in time order)."""
        self.events += 1
        ts = float(event.get("ts") or 0.0)
        self.first_ts = ts if self.first_ts is None else min(self.first_ts, ts)
        self.last_ts = ts if self.last_ts is None else max(self.last_ts, ts)
        # The workers' run id wins: they adopt the one their storage names (a relaunch's
        # launcher starts under an id of its own before it can know the storage).
        run_id, by_worker = event.get("run_id"), event.get("role") != "agent"
        if run_id and (by_worker or not self._worker_named):
            self.run_id = run_id
            self._worker_named = self._worker_named or by_worker
        name = str(event.get("event", ""))
        launch = event.get("launch_id")
        if isinstance(launch, str):
            launch = job_launch(launch)
            if launch not in self._launch_of:
                # Another node's launcher of the same job, or, once the job's launch has
                # visibly ended (its launcher exited, the run finished or took its final
                # snapshot), the next launch on the same storage.
                over = self.ended or self.finished is not None or \
                    self.final_snapshot is not None
                if self.launch is None or over:
                    self._new_launch(launch)
                self._launch_of[launch] = self.launches
            if self._launch_of[launch] < self.launches:
                return  # a late line of an earlier launch: its state is history
        if event.get("role") == "agent":
            self.agent_seen = True
            self.ended = self.ended or name == "agent.finished"
        elif name == "run.finished" and not self.agent_seen:
            self.ended = True
        restart_count = event.get("restart_count")
        if name == "agent.attempt_started" and isinstance(restart_count, int):
            self._new_attempt(restart_count, event.get("world_size"), ts)
        elif event.get("role") != "agent" and isinstance(restart_count, int):
            if restart_count > self.attempt:
                self._new_attempt(restart_count, event.get("world_size"), ts)
            if restart_count >= self._restarts.get(launch, 0):  # not a late line
                self._restarts[launch] = restart_count
                self._worker_event(name, event, ts)
        handler = _LINES.get(name)
        if handler is not None:
            line = handler(self, event)
            if line is not None:
                self._add_line(ts, *line)

    def _new_launch(self, launch: str) -> None:
        """A launch of the job after the earlier ones on the same storage: attempts count
        from 0 again; the steps lost across it are counted by its resume."""
        self.launch, self.launches = launch, self.launches + 1
        self.attempt, self._resumed_at = 0, 0
        self._samples.clear()
        self.rank_steps.clear()
        self.finished, self.final_snapshot, self.ended = None, None, False

    def _new_attempt(self, attempt: int, world_size: Any, ts: float) -> None:
        if attempt != self.attempt:
            self._samples.clear()  # the rate of one attempt; a restart starts it over
            self.rank_steps.clear()
            self._resumed_at = 0
        self.attempt = max(self.attempt, attempt)
        if isinstance(world_size, int):
            self.world_size = world_size

    def _worker_event(self, name: str, event: dict[str, Any], ts: float) -> None:
        rank, step, world = event.get("rank"), event.get("step"), event.get("world_size")
        if isinstance(world, int):
            self.world_size = world
        if isinstance(rank, int) and isinstance(step, int):
            # A resume may go back in steps; any other event only moves a rank forward.
            self.rank_steps[rank] = step if name == "resume" else \
                max(step, self.rank_steps.get(rank, 0))
            self.step = max(self.rank_steps.values())
            if name == "resume":
                # Where the attempt starts (worker.start's step 0 and the resume's jump
                # are no progress); the rate counts from the attempt's first step on.
                self._samples.clear()
                self._resumed_at = self.step
            elif self.step > self._resumed_at:
                self._sample(ts, self.step)
        if name == "train.progress" and event.get("loss") is not None:
            self.loss = float(event["loss"])
            self.loss_step = step if isinstance(step, int) else None
        elif name == "snapshot.committed":
            self.last_snapshot = {"step": event.get("snapshot_step"), "ts": ts,
                                  "size_bytes": event.get("size_bytes"),
                                  "tier": event.get("tier"),
                                  "duration_s": event.get("duration_s")}

    def _sample(self, ts: float, step: int) -> None:
        self._samples.append((ts, step))
        while self._samples and ts - self._samples[0][0] > RATE_WINDOW_S:
            self._samples.popleft()

    def _add_line(self, ts: float, kind: str, text: str) -> None:
        self.lines.append(Line(ts, kind, text))
        while len(self.lines) > self.max_lines:
            self.lines.popleft()

    # -- derived -------------------------------------------------------------------------
    @property
    def rate(self) -> float | None:
        """Steps per second over the recent window of the current attempt."""
        if len(self._samples) < 2:
            return None
        (t0, s0), (t1, s1) = self._samples[0], self._samples[-1]
        return (s1 - s0) / (t1 - t0) if t1 > t0 and s1 > s0 else None

    def snapshot_age_s(self, now: float | None = None) -> float | None:
        if self.last_snapshot is None:
            return None
        return max(0.0, (now or time.time()) - float(self.last_snapshot["ts"]))

    def loss_text(self) -> str:
        """The newest reported loss, with its step when the run has moved on since
        (progress is reported every ``snapshot.progress_every_s``)."""
        if self.loss is None:
            return ""
        if self.loss_step is None or self.loss_step == self.step:
            return f"loss {self.loss:.4f}"
        return f"loss {self.loss:.4f} at step {self.loss_step}"

    def failures(self) -> list[Line]:
        return [line for line in self.lines if line.kind == "failure"]

    def to_dict(self, now: float | None = None) -> dict[str, Any]:
        """The state as plain JSON-able values (``status --json``)."""
        age = self.snapshot_age_s(now)
        return {
            "run_id": self.run_id, "attempt": self.attempt, "attempts": self.attempt + 1,
            "launch": self.launch, "launches": max(1, self.launches),
            "world_size": self.world_size, "step": self.step, "total_steps": self.total_steps,
            "rank_steps": {str(r): s for r, s in sorted(self.rank_steps.items())},
            "rate_steps_s": None if self.rate is None else round(self.rate, 3),
            "loss": self.loss, "loss_step": self.loss_step,
            "last_snapshot": None if self.last_snapshot is None else {
                **self.last_snapshot, "age_s": None if age is None else round(age, 1)},
            "finished": self.finished, "lost_steps": self.lost_steps,
            "final_snapshot": self.final_snapshot,
            "memory_degraded": dict(self.memory_degraded),
            "suspects": {str(step): why for step, why in sorted(self.suspects.items())},
            "first_ts": self.first_ts, "last_ts": self.last_ts,
            "events": self.events,
            "failures": [line.to_dict() for line in self.failures()],
            "lines": [line.to_dict() for line in self.lines],
        }


# -- one line per event that matters ---------------------------------------------------------
_Out = tuple[str, str] | None


def _worker_failed(state: RunState, e: dict[str, Any]) -> _Out:
    how = f"killed by {e['signal']}" if e.get("signal") else \
        f"exited {e.get('exit_code')} ({e.get('meaning')})"
    if e.get("error") == SnapshotSuspect.__name__:  # planned: the line above says why
        return "restart", (f"worker rank {e.get('worker_rank')} {how}: its restore was "
                           "suspect, so the group restarts from the snapshot before")
    if e.get("error"):  # the worker's own error (its error file or output, read by the agent)
        how += f": {e['error']} at {e.get('where')}"
    return "failure", f"worker rank {e.get('worker_rank')} {how}" + _failure_detail(state, e)


def _failure_detail(state: RunState, e: dict[str, Any]) -> str:
    """Under the first failing worker's line: the end of its traceback and its log, once
    for an error seen again attempt after attempt."""
    if not e.get("first") or not (e.get("traceback") or e.get("output_file")):
        return ""
    shown = (e.get("error"), e.get("where"), e.get("failed_step"))
    if shown == state._failure_shown:
        return " (the same error as before)"
    state._failure_shown = shown
    lines = [str(line).rstrip() for line in e.get("traceback") or []]
    if e.get("output_file"):
        lines.append(f"log: {e['output_file']}")
    return "".join(f"\n  {line}" for line in lines)


def _crash_loop(state: RunState, e: dict[str, Any]) -> _Out:
    when = "before any step" if e.get("before_init") else f"step {e.get('failed_step')}"
    return "failure", (f"crash loop: {e.get('failures')} attempts failed with {e.get('error')} "
                       f"at {e.get('where')} ({when}); not restarted")


def _demo_kill(state: RunState, e: dict[str, Any]) -> _Out:
    return "failure", f"demo kills rank {e.get('rank')} ({e.get('signal')}) at step {e.get('step')}"


def _restart(state: RunState, e: dict[str, Any]) -> _Out:
    reason = str(e.get("reason", "failure")).replace("_", " ")
    return "restart", (f"restart after {reason}, attempt {e.get('from_restart_count')}, "
                       f"{e.get('remaining_restarts')} restarts left")


def _resume(state: RunState, e: dict[str, Any]) -> _Out:
    if e.get("rank") != 0:
        return None  # every rank resumes from the same step: one line per attempt
    state.lost_steps += int(e.get("lost_steps") or 0)
    world = e.get("world_size")
    if e.get("from_step") is None:
        return "resume", f"attempt {e.get('restart_count')}: fresh start at world size {world}"
    text = (f"attempt {e.get('restart_count')}: resumed from step {e['from_step']} "
            f"(lost {e.get('lost_steps') if e.get('lost_steps') is not None else '?'} steps)")
    if e.get("world_size_changed"):
        text += f", world size {e.get('saved_world_size')} -> {world}"
    return "resume", text


def _membership(state: RunState, e: dict[str, Any]) -> _Out:
    return "membership", (f"membership change: world size {e.get('old_world_size')} -> "
                          f"{e.get('new_world_size')}")


def _notice(state: RunState, e: dict[str, Any]) -> _Out:
    first = state._notice_ts is None
    state._notice_ts = state._notice_ts or float(e.get("ts") or 0.0)
    if not first:
        return None  # each rank logs the notice it saw; one line is enough
    return "preempt", (f"preemption notice ({e.get('source')}), grace "
                       f"{e.get('grace_period_s')} s")


def _signal_forwarded(state: RunState, e: dict[str, Any]) -> _Out:
    received, sent = e.get("received"), e.get("signal")
    who = "Ctrl-C (SIGINT)" if received == "SIGINT" else str(received)
    if sent in ("SIGTERM", "SIGUSR1"):
        return "preempt", (f"{who} to the launcher: asking the workers for a final "
                           f"snapshot ({sent}, up to {e.get('grace_s')} s)")
    return "failure", f"{who} to the launcher: workers stopped with {sent}"


def _preempt_saved(state: RunState, e: dict[str, Any]) -> _Out:
    if isinstance(e.get("snapshot_step"), int):
        state.final_snapshot = e["snapshot_step"]
    if e.get("rank") not in (0, None):
        return None  # every rank commits the same step: one line
    return "preempt", (f"final snapshot of step {e.get('snapshot_step')} committed "
                       f"{e.get('duration_s')} s after the notice")


def _watchdog(state: RunState, e: dict[str, Any]) -> _Out:
    return "failure", (f"watchdog fired on rank {e.get('rank')}: no progress for "
                       f"{e.get('idle_s')} s in {e.get('phase')} (last step {e.get('last_step')})")


def _snapshot_failed(state: RunState, e: dict[str, Any]) -> _Out:
    then = f"retrying in {e.get('retry_in_s')} s" if e.get("will_retry") else "giving up"
    return "failure", (f"snapshot {e.get('snapshot_step')} failed (try {e.get('attempt')}): "
                       f"{e.get('error_type')}, {then}")


def _snapshot_corrupt(state: RunState, e: dict[str, Any]) -> _Out:
    return "failure", f"snapshot {e.get('snapshot_step')} corrupt: {e.get('action')}"


def _snapshot_suspect(state: RunState, e: dict[str, Any]) -> _Out:
    step = e.get("snapshot_step")
    if isinstance(step, int):
        state.suspects[step] = str(e.get("reason"))
    then = (f"restarting from step {e.get('restore_next')}" if e.get("action") != "stopped"
            else "stopped (exit 78)")
    return "failure", (f"snapshot {step} ({e.get('tier')}) suspect after its restore, at "
                       f"step {e.get('at_step')}: {e.get('reason')}; set aside, {then}")


def _memory_degraded(state: RunState, e: dict[str, Any]) -> _Out:
    what = str(e.get("what"))
    if what in state.memory_degraded:
        return None  # every rank says it: one line until it comes back
    state.memory_degraded[what] = str(e.get("error"))
    return "memory", (f"node memory tier off ({what}): {e.get('error')}; training goes on "
                      "with durable snapshots")


def _memory_recovered(state: RunState, e: dict[str, Any]) -> _Out:
    if state.memory_degraded.pop(str(e.get("what")), None) is None:
        return None
    return "memory", f"node memory tier back ({e.get('what')})"


def _memory_set_aside(state: RunState, e: dict[str, Any]) -> _Out:
    return "memory", (f"memory copy of step {e.get('snapshot_step')} set aside on rank "
                      f"{e.get('rank')} ({e.get('status')}): {e.get('action')}")


def _rescued(state: RunState, e: dict[str, Any]) -> _Out:
    return "snapshot", (f"rank {e.get('rank')} rescued step {e.get('snapshot_step')} to node "
                        f"memory after {e.get('error')}")


def _run_finished(state: RunState, e: dict[str, Any]) -> _Out:
    state.finished = state.finished or "finished"
    state.step = max(state.step, int(e.get("final_step") or 0))
    if e.get("final_loss") is not None:
        state.loss = float(e["final_loss"])
    saved = e.get("snapshot_step")
    if isinstance(saved, int):
        state.final_snapshot = saved
    at = f"training finished at step {e.get('final_step')}"
    return "end", at if not isinstance(saved, int) else f"{at}, snapshot of step {saved}"


def _agent_end(state: RunState, e: dict[str, Any]) -> _Out:
    outcome = str(e.get("outcome") or ("preempted" if e.get("event") == "agent.preempted"
                                       else "fatal"))
    state.finished = outcome
    if e.get("event") == "agent.finished":
        return "end", f"launcher exited {e.get('exit_code')} ({outcome})"
    return ("preempt" if outcome == "preempted" else "failure"), \
        f"workers exited {e.get('exit_codes')}: {outcome}, no restart"


_LINES = {
    "agent.worker_failed": _worker_failed, "demo.kill": _demo_kill,
    "agent.restart": _restart, "resume": _resume,
    "agent.membership_changed": _membership, "preempt.notice": _notice,
    "agent.signal_forwarded": _signal_forwarded,
    "preempt.saved": _preempt_saved, "watchdog.fired": _watchdog,
    "snapshot.failed": _snapshot_failed, "snapshot.corrupt": _snapshot_corrupt,
    "snapshot.suspect": _snapshot_suspect,
    "run.finished": _run_finished, "agent.preempted": _agent_end,
    "agent.fatal": _agent_end, "agent.finished": _agent_end,
    "agent.crash_loop": _crash_loop,
    "snapshot.memory_degraded": _memory_degraded,
    "snapshot.memory_recovered": _memory_recovered,
    "snapshot.memory_set_aside": _memory_set_aside, "snapshot.rescued": _rescued,
}
