"""The checks of a node trial that the single-agent checks (:mod:`.checks`) do not make:
where each resume after a node loss had to read from, and how many steps it may lose.

What a resume may use follows from the trial's events and the harness's own record of
which node was lost when: a node holds the memory copies its processes committed, less
those pruned, set aside or removed, and nothing once it was lost (its memory wiped)
or before it started (a replacement's memory is empty; one that comes back on the
memory a lost node kept, ``stale``, holds that node's copies). Each copy is known by
the job's attempt that took it and its step. The memory tier's restore rule
(docs/memory-tier.md#which-copy) then says which copy is complete:

* without peer restore, every node of the new world must hold the same newest copy;
* with peer restore (a node restores from its peers' memory), the newest copy that
  some node holds, the newest attempt's first: the nodes without it (new, wiped, a step
  behind, or holding an earlier attempt's) receive it.

Either way the copy must be newer than the newest durable snapshot. A resume that read
durable storage although such a copy existed fails, as does one that went back further
than the newest complete copy. Lost steps are measured from the demo's per-step sample
records (the highest step trained since the previous resume, less the step resumed
from): at most one with a cross-node rescue after an abrupt loss, else the interval of
the tier the resume used, plus the steps of a save that was in flight.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

NODE_KEY = "_node"  # the node incarnation an event came from (added when read)


@dataclass(frozen=True)
class NodeLife:
    """One node incarnation as the harness ran it: started, and lost (frozen) at;
    ``inherits``: the lost incarnation whose kept memory it started on, if any."""

    name: str
    started_ts: float
    lost_ts: float | None
    inherits: str | None = None

    def member_at(self, ts: float) -> bool:
        return self.started_ts < ts and (self.lost_ts is None or self.lost_ts > ts)


@dataclass(frozen=True)
class Expectation:
    """What the job under test can do, so what its resumes may lose.

    Attributes:
        memory_every, durable_every: the two tiers' snapshot intervals, in steps.
        peer_restore: a node without the memory copy restores it from its peers.
        cross_node_rescue: the survivors of a node loss commit the last step.
    """

    memory_every: int
    durable_every: int
    peer_restore: bool = False
    cross_node_rescue: bool = False


@dataclass(frozen=True)
class Loss:
    """A node loss in the trial: when, and whether its peers met silence."""

    ts: float
    silent: bool


Copy = tuple[int, int]  # (the job's attempt that took it, or -1; its step)


def newest_held(events: Sequence[dict[str, Any]], life: NodeLife, ts: float,
                since: float = 0.0) -> Copy | None:
    """The newest memory copy ``life``'s node held when the restore that resumed at
    ``ts`` began (the tier keeps one), with those of the incarnation whose kept memory
    it started on. That restore's own removal of the copies newer than the step it
    chose (``reason=stale``, after ``since``, the previous resume) does not count:
    whether it should have chosen them is what is checked."""
    if not life.member_at(ts):
        return None
    names = {life.name} | ({life.inherits} if life.inherits else set())
    held: dict[int, int] = {}  # step -> attempt
    for e in events:
        if e.get(NODE_KEY) not in names or float(e["ts"]) >= ts:
            continue
        name, step = e.get("event"), e.get("snapshot_step")
        this_restore = e.get("reason") == "stale" and float(e["ts"]) > since
        if name == "snapshot.committed" and e.get("tier") == "memory" and isinstance(step, int):
            attempt = e.get("attempt")
            held[step] = int(attempt) if isinstance(attempt, int) else -1
        elif ((name == "snapshot.pruned" and e.get("tier") == "memory" and not this_restore)
              or name == "snapshot.memory_set_aside") and isinstance(step, int):
            held.pop(step, None)
        elif name == "snapshot.memory_removed":
            held.clear()
    return max(((attempt, step) for step, attempt in held.items()), default=None)


def complete_memory_step(newest: dict[str, Copy | None], *, peer_restore: bool,
                         durable: Copy = (-1, 0)) -> int | None:
    """The memory step every node of a world can restore, newer than the newest
    ``durable`` snapshot (its attempt, its step), or None (see the module)."""
    copies = list(newest.values())
    held = [c for c in copies if c is not None]
    newer = [c for c in held if c[1] > durable[1] and c[0] >= durable[0]]
    if peer_restore:  # the newest copy some node holds: the others receive it
        return max(newer)[1] if newer else None
    if not copies or len(held) != len(copies) or len(set(held)) != 1 or not newer:
        return None
    return held[0][1]


def check_node_resumes(events: Sequence[dict[str, Any]], lives: Sequence[NodeLife],
                       records: Sequence[dict[str, Any]], expect: Expectation,
                       losses: Sequence[Loss] | Loss | None,
                       strict_joins: Sequence[float] = ()) -> str | None:
    """Every resume read from the newest complete copy and lost no more than allowed
    (``losses``: the trial's node losses, in order; ``strict_joins``: when a node
    joined while the job paused, each such join to cost no step)."""
    losses = [losses] if isinstance(losses, Loss) else list(losses or [])
    resumes = sorted((e for e in events if e.get("event") == "resume" and e.get("rank") == 0),
                     key=lambda e: float(e["ts"]))
    durable = [(float(e["ts"]), int(e["snapshot_step"]),
                int(e["attempt"]) if isinstance(e.get("attempt"), int) else -1) for e in events
               if e.get("event") == "snapshot.committed" and e.get("tier") != "memory"]
    previous = 0.0
    for resume in resumes:
        ts = float(resume["ts"])
        start = resume.get("from_step")
        start = 0 if start is None else int(start)
        newest_durable, durable_attempt = max(((s, a) for t, s, a in durable if t < ts),
                                              default=(0, -1))
        members = {life.name: newest_held(events, life, ts, previous) for life in lives
                   if life.member_at(ts)}
        memory_step = complete_memory_step(members, peer_restore=expect.peer_restore,
                                           durable=(durable_attempt, newest_durable))
        expected = memory_step if memory_step is not None else newest_durable
        where = f"the resume at {ts:.2f} (nodes {members}, durable step {newest_durable})"
        if start < expected:
            return f"{where} resumed from step {start} although step {expected} was complete"
        if memory_step is not None and resume.get("tier") != "memory" and start <= memory_step:
            return (f"{where} read durable storage although every node could restore memory "
                    f"step {memory_step}")
        trained = [int(r["step"]) for r in records if previous < float(r["ts"]) < ts]
        # The losses this resume follows: abrupt ones only are rescued across nodes
        # (a silent one ends in the watchdog's kill, which rescues nothing).
        since_last = [loss for loss in losses if previous < loss.ts < ts]
        after_loss = bool(since_last)
        # And only where another node's workers were in the group to rescue it: a job
        # running on the lost node alone (the other node still waiting to join) keeps
        # only what it committed.
        rescue_pending = after_loss and expect.cross_node_rescue and not any(
            loss.silent or group_nodes_at(events, loss.ts) == 1 for loss in since_last)
        if trained:
            lost = max(trained) - start
            in_flight = max((int(e["snapshot_step"]) for e in events
                             if e.get("event") == "snapshot.staged"
                             and previous < float(e["ts"]) < ts), default=0)
            interval = expect.memory_every if resume.get("tier") == "memory" else (
                expect.durable_every)
            allowed = interval + max(0, in_flight - start)
            if rescue_pending and after_loss and not record_in_flight(events, max(trained),
                                                                     previous, ts):
                allowed = 1
            if not after_loss and saved_for_restart(events, previous, ts):
                allowed = 0  # a join: the group saved the step it stood at first
            paused_join = not after_loss and any(previous < t < ts for t in strict_joins)
            if paused_join:
                allowed = 0  # the pause outlasts no rescue timeout: the step is saved
            if paused_join and lost > allowed:
                return (f"{where} lost {lost} steps at a join during a pause (from step "
                        f"{start}; allowed 0)")
            if lost > allowed:
                return f"{where} lost {lost} steps (from step {start}; allowed {allowed})"
        previous = ts
    return None


def group_nodes_at(events: Sequence[dict[str, Any]], ts: float) -> int | None:
    """How many nodes the worker group running at ``ts`` had (its newest
    ``agent.attempt_started`` before then), or None where no group had started."""
    started = [e for e in events
               if e.get("event") == "agent.attempt_started" and float(e["ts"]) < ts]
    if not started:
        return None
    newest = max(started, key=lambda e: float(e["ts"]))
    return int(newest.get("group_world_size") or 1)


def saved_for_restart(events: Sequence[dict[str, Any]], since: float, until: float) -> bool:
    """Whether the group that stopped between ``since`` and ``until`` saved the step it
    stood at for a node that joined (``snapshot.saved_for_restart``) and waited to be
    stopped (no ``snapshot.restart_not_taken``): its restart may lose no step."""
    def within(name: str) -> bool:
        return any(e.get("event") == name and since < float(e["ts"]) < until for e in events)
    return within("snapshot.saved_for_restart") and not within("snapshot.restart_not_taken")


_NO_RECORD = re.compile(r"no record of step (\d+) ")


def record_in_flight(events: Sequence[dict[str, Any]], step: int, since: float,
                     until: float) -> bool:
    """The one loss a cross-node rescue cannot cover where the records go at the step
    boundary (a loop that draws random numbers between its optimizer step and
    ``manager.step()``: ``snapshot.records_pre_step_off``): the lost node's ranks had
    finished ``step`` (its all-reduce let the survivors finish it too) but died before
    their record of it left, so the survivors skipped that step's rescue for want of the
    record, while their stream of the lost node's records had been arriving (so a stream
    that never worked does not pass as this race). Where the records go before the
    optimizer step, no survivor finishes a step without them: no such race."""
    at_boundary = any(e.get("event") == "snapshot.records_pre_step_off"
                      and since < float(e["ts"]) < until for e in events)
    skipped = any(e.get("event") == "snapshot.rescue_skipped" and since < float(e["ts"]) < until
                  and (m := _NO_RECORD.search(str(e.get("reason", "")))) is not None
                  and int(m.group(1)) == step for e in events)
    streamed = any(e.get("event") == "snapshot.records_stopped"
                   and e.get("direction") == "receive" and int(e.get("received") or 0) > 0
                   and since < float(e["ts"]) < until for e in events)
    return at_boundary and skipped and streamed


def check_agents(codes: dict[str, list[int]], lost: set[str], *, timed_out: bool) -> str | None:
    """Every launcher the harness did not kill exited 0 (and none was cut off)."""
    if timed_out:
        return "timed out (a hang nothing turned into a restart?)"
    bad = {name: c for name, c in codes.items() if name not in lost and c != [0]}
    return f"launcher exit codes {bad}: the run did not finish" if bad else None
