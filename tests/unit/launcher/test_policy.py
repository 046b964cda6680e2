"""The agent's failure policy against a table of cases: what the agent saw (exit codes,
end marks, rescue and save marks, CPU ticks, reported errors) to what it does. No
process is started: the policy is a pure function (elastictrain/launcher/policy.py)."""

from __future__ import annotations

from typing import Any

import pytest

from elastictrain.launcher.policy import (
    AfterEnd,
    CrashLoop,
    ExitWatch,
    Verdict,
    Workers,
    after_the_end,
    describe_exit,
    first_failure,
    on_failures,
    rescue_wait_over,
    restart_reason,
    save_wait_over,
    signalled_exit_code,
    survivors_to_stop,
)

RUNNING = None


@pytest.mark.parametrize(("codes", "ended", "finished", "past_end", "after_end", "stop"), [
    # all running: nothing to do
    ({1: RUNNING, 2: RUNNING}, set(), False, False, None, []),
    # all exited 0: finished
    ({1: 0, 2: 0}, set(), True, False, None, []),
    # one failed, one running, before the end: stop the survivor
    ({1: 1, 2: RUNNING}, set(), False, False, None, [2]),
    # killed by a signal (negative code): the same
    ({1: -9, 2: RUNNING}, set(), False, False, None, [2]),
    # one failed after the agreed end, its peer still writes files: wait for it
    ({1: 1, 2: RUNNING}, {1, 2}, True, True, AfterEnd.WAIT, []),
    # the same, its peer not yet at the end: not stopped either
    ({1: 1, 2: RUNNING}, {1}, False, True, AfterEnd.WAIT, []),
    # failed after the end, the other exited 0: the group succeeded
    ({1: -9, 2: 0}, {1}, True, True, AfterEnd.SUCCEEDED, []),
    # one failed after the end, the other failed before it: a real failure
    ({1: 1, 2: 1}, {1}, False, True, None, []),
    # preempted (75) with a peer finishing its final save: nobody is stopped
    ({1: 75, 2: RUNNING}, set(), False, False, None, []),
    ({1: 76, 2: RUNNING}, set(), False, False, None, []),
    # no worker yet
    ({}, set(), False, False, None, []),
])
def test_what_the_workers_did_decides_what_the_agent_does(
        codes: dict[int, int | None], ended: set[int], finished: bool, past_end: bool,
        after_end: AfterEnd | None, stop: list[int]) -> None:
    workers = Workers(codes, frozenset(ended))
    assert workers.finished() is finished
    assert workers.past_the_end() is past_end
    assert after_the_end(workers) is after_end
    # Checked whatever after_the_end says: a worker may exit between the agent's reads.
    assert survivors_to_stop(workers) == stop


@pytest.mark.parametrize(("codes", "error", "verdict"), [
    ([75], None, Verdict.PREEMPTED),
    ([-9, 75], None, Verdict.PREEMPTED),
    ([75, 76], None, Verdict.PREEMPTED_UNSAVED),  # any rank unsaved: unsaved
    ([1, 78], None, Verdict.FATAL),
    ([78, 75], None, Verdict.PREEMPTED),  # the world agreed to stop first
    ([1], None, Verdict.RESTART),
    ([-9], None, Verdict.RESTART),
    ([71], None, Verdict.RESTART),  # a hang: the watchdog's exit restarts
])
def test_a_failed_attempt_restarts_unless_it_cannot_help(
        codes: list[int], error: dict[str, Any] | None, verdict: Verdict) -> None:
    assert on_failures(codes, error, CrashLoop(2)) is verdict


def _error(step: int, message: str = "Numpy is not available",
           kind: str = "RuntimeError") -> dict[str, Any]:
    return {"error": kind, "message": message, "where": "onepass.py:282", "failed_step": step}


def _early(message: str = "No module named 'tokenizers'", where: str = "job.py:4",
           kind: str = "ModuleNotFoundError") -> dict[str, Any]:
    """A failure before init(), as the agent reads it from the worker's output."""
    return {"error": kind, "message": message, "where": where, "failed_step": None,
            "before_init": True}


@pytest.mark.parametrize(("limit", "errors", "stops_at"), [
    (2, [_error(0), _error(0)], 1),  # the same error at the same step twice
    (3, [_error(0), _error(0), _error(0)], 2),
    (2, [_error(0), _error(12), _error(12)], 2),  # progress starts the count over
    (2, [_error(0), _error(0, "another"), _error(0, "another")], 2),
    (2, [_error(0), None, _error(0)], None),  # a signal (no report) starts over
    (2, [_error(15, kind="PeerNodeLost")] * 3, None),  # the fleet's fault, not the script's
    (0, [_error(0)] * 5, None),  # 0: never
    # Before init() (read from the worker's output, no step): the same type and place
    (2, [_early(), _early()], 1),
    (3, [_early(), _early(), _early()], 2),
    (2, [_early("port 29500 in use"), _early("port 29501 in use")], 1),  # message aside
    (2, [_early(where="job.py:4"), _early(where="job.py:9"), _early(where="job.py:9")], 2),
    (2, [_early(kind="ImportError"), _early(), _early()], 2),  # another type starts over
    (2, [_early(), _error(0, kind="ModuleNotFoundError")], None),  # init() was reached
    (2, [_early(), None, _early()], None),  # a signal between them
    (0, [_early()] * 5, None),
])
def test_a_crash_loop_is_the_same_error_at_the_same_step(
        limit: int, errors: list[dict[str, Any] | None], stops_at: int | None) -> None:
    loop = CrashLoop(limit)
    verdicts = [on_failures([1], e, loop) for e in errors]
    expected = [Verdict.RESTART] * len(errors)
    if stops_at is not None:
        expected[stops_at] = Verdict.CRASH_LOOP
        verdicts[stops_at + 1:] = expected[stops_at + 1:] = []
    assert verdicts == expected


def test_the_first_reported_error_says_why() -> None:
    assert first_failure({0: {"ts": 5.0}, 1: {"ts": 4.0}, 2: None}) == 1
    assert first_failure({3: {"ts": 4.0}, 1: {"ts": 4.0}}) == 1  # a tie: the lower rank
    assert first_failure({0: None}) is None


@pytest.mark.parametrize(("busy", "unstarted", "elapsed", "over"), [
    ({1}, set(), 1.0, False),  # writing a rescue: wait
    ({1}, set(), 30.0, True),  # up to rescue_timeout_s
    (set(), {1}, 1.0, False),  # armed, not begun: wait
    (set(), {1}, 5.0, True),  # up to rescue_start_timeout_s
    (set(), set(), 0.0, True),  # nothing to wait for
])
def test_the_wait_for_a_rescue(busy: set[int], unstarted: set[int], elapsed: float,
                               over: bool) -> None:
    assert rescue_wait_over(busy, unstarted, elapsed, 30.0, 5.0) is over


@pytest.mark.parametrize(("listening", "ready", "rescuing", "elapsed", "over"), [
    ({1, 2}, {1}, set(), 1.0, False),  # one listening worker has not saved yet
    ({1, 2}, {1, 2}, set(), 1.0, True),
    ({1, 2}, {1, 2}, {2}, 1.0, False),  # a rescue in progress holds the restart
    ({1, 2}, {1}, set(), 30.0, True),  # the limit
    (set(), set(), set(), 0.0, True),  # no worker listens (a script without a manager)
])
def test_the_save_before_a_membership_restart(
        listening: set[int], ready: set[int], rescuing: set[int], elapsed: float,
        over: bool) -> None:
    assert save_wait_over(listening, ready, rescuing, elapsed, 30.0) is over


def test_only_a_healthy_group_restarts_for_a_membership_change() -> None:
    assert restart_reason(group_healthy=True) == "membership_change"
    assert restart_reason(group_healthy=False) == "failure"


def test_a_worker_stuck_in_its_exit_is_found_by_cpu_time_not_wall_time() -> None:
    watch = ExitWatch(timeout_s=60)
    finishing = Workers({1: 0, 2: RUNNING})
    assert watch.stuck(finishing, {2: 100}, now=0) == []
    assert watch.stuck(finishing, {2: 150}, now=59) == []  # it works: the clock restarts
    assert watch.stuck(finishing, {2: 150}, now=118) == []
    assert watch.stuck(finishing, {2: 150}, now=119) == [2]  # 60 s without CPU
    assert watch.stuck(finishing, {}, now=500) == []  # its tree could not be read
    running = Workers({1: RUNNING, 2: RUNNING})  # nobody exited 0: none is watched
    assert ExitWatch(timeout_s=0).stuck(running, {1: 1, 2: 1}, now=0) == []


@pytest.mark.parametrize(("codes", "ended", "outcome", "expected"), [
    ({1: 0, 2: 0}, set(), None, 0),  # finished, waiting for the other nodes
    ({1: RUNNING}, {1}, None, 0),  # past the agreed end, still writing files
    ({1: 75, 2: 75}, set(), None, 75),
    ({1: 76, 2: 75}, set(), None, 76),
    ({1: RUNNING}, set(), "preempted", 75),
    ({1: RUNNING}, set(), None, 128 + 15),
])
def test_the_launchers_code_when_a_signal_ends_it(
        codes: dict[int, int | None], ended: set[int], outcome: str | None,
        expected: int) -> None:
    assert signalled_exit_code(Workers(codes, frozenset(ended)), outcome, 15) == expected


def test_what_each_worker_exit_code_means() -> None:
    assert [describe_exit(c) for c in (75, 76, 78, 71, -9, 1)] == \
        ["preempted", "preempted_unsaved", "fatal", "hang", "signal", "error"]
