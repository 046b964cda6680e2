"""ElasticTrainAgent: torchrun's ``LocalElasticAgent`` with events and an exit-code policy.

It overrides the agent's documented steps (``_rendezvous``, ``_initialize_workers``,
``_monitor_workers``, ``_restart_workers``, ``_stop_workers``, ``_shutdown``) to log
``agent.*`` events, forward notices, stop failed groups with SIGKILL, wait for rescues
and saves, end workers stuck in their exit and start workers from a standby; what it
does on a failure is decided by ``policy.py`` and carried out here. The whole list, with
the reasons: docs/architecture.md, "What the launcher's agent adds to torchrun's".
"""

from __future__ import annotations

import inspect
import json
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext, suppress
from pathlib import Path
from typing import Any

from torch.distributed import DistStoreError
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousGracefulExitError,
)

from elastictrain.core.errors import (
    EXIT_OK,
)
from elastictrain.core.log import bind, get_logger
from elastictrain.handoff import end_marks
from elastictrain.handoff.rescue_marks import (
    armed_pids,
    clear_save_marks,
    listening_pids,
    ready_pids,
    request_save,
    rescuing_pids,
)
from elastictrain.launcher import torch_hooks
from elastictrain.launcher.agent_settings import AgentSettings
from elastictrain.launcher.exitbarrier import (
    exit_barrier,
    job_finished,
    mark_job_finished,
    record_read_closed,
    rendezvous_participants,
    stay_for_waiting_nodes,
)
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
    preempted_outcome,
    rescue_wait_over,
    restart_reason,
    save_wait_over,
    survivors_to_stop,
)
from elastictrain.launcher.proctree import tree_cpu_ticks
from elastictrain.launcher.standby.client import Standby
from elastictrain.launcher.standby.context import start_processes_with
from elastictrain.runlog.failure import ERROR_FIELDS, error_from_output_file, fix_line

log = get_logger("elastictrain.agent")

NOTICE_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
RENDEZVOUS_RETRIES = 2  # rounds an agent joins again after a rank exchange timed out
# torch >= 2.12 passes torchrun's --shutdown-timeout to _shutdown; 2.11 has neither.
_SHUTDOWN_TAKES_TIMEOUT = "timeout" in inspect.signature(LocalElasticAgent._shutdown).parameters


class WorkersPreempted(SignalException):
    """Workers exited 75 or 76: the group stops and the launcher exits with that code.

    A ``SignalException`` on purpose: torchrun then leaves the rendezvous open,
    as when the agent itself is signalled, so the resumed job can reuse its id;
    any other exception closes it for good (etcd keeps that state).
    """


class WorkersFatal(Exception):
    """A worker exited 78 (fatal): do not restart."""


class ElasticTrainAgent(LocalElasticAgent):
    """torchrun's local agent plus events, exit-code policy and notice forwarding.

    ``outcome`` is ``"preempted"`` or ``"fatal"`` once the agent decided to stop
    for that reason (None otherwise); the launcher maps it to its exit code.
    """

    def __init__(self, settings: AgentSettings, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.settings = settings
        self.standby: Standby | None = None
        self._started_by: str | None = None
        self._standby_announced = False
        if self.settings.standby_preload is not None:
            # Started now, so its imports run during the first rendezvous.
            self.standby = Standby(self.settings.standby_preload)
            self.standby.start()
        self.outcome: str | None = None
        self.worker_exit_codes: dict[int, int | None] = {}
        self._world_size: int | None = None
        self._restart_stop = False
        self._killed: set[int] = set()  # survivors this agent SIGKILLed after a failure
        self._detected = False  # a failure of the current attempt was reported
        self._rendezvous_s: float | None = None
        self._exit_watch = ExitWatch(self.settings.exit_timeout_s)
        self._exit_checked = 0.0
        self._end_logged = False  # agent.failed_after_end was logged for this attempt
        self._finished = False  # see finished
        # The first failing worker's error of the newest failed attempt (its summary),
        # and the crash-loop count: identical failures in a row (_check_crash_loop).
        self.failure: dict[str, Any] | None = None
        self._crash_loop = CrashLoop(self.settings.crash_loop_failures)
        self.rendezvous_error: str | None = None  # why the rendezvous ended this launcher
        self._store_lost_after_end = False
        self._join_after_end_logged = False
        # torchrun's monitor loop asks the handler itself (it has no step to override).
        torch_hooks.answer_nodes_waiting(self._worker_group.spec.rdzv_handler,
                                         self._nodes_waiting)

    @property
    def finished(self) -> bool:
        """This node's workers all ended the run (exit 0, or past the agreed end:
        ``runend``): a notice while the agent waits for the other nodes, or while a
        script works on after ``close()``, is no failure (a relaunch would only re-run
        the end from an older snapshot)."""
        return self._finished or self._workers().finished()

    def _workers(self) -> Workers:
        """The current workers at this look (policy.Workers)."""
        end_dir = self.settings.end_dir
        ended = end_marks.ended_pids(end_dir) if end_dir is not None else set()
        return Workers(self._worker_codes(), frozenset(ended))

    def _nodes_waiting(self, ask_store: Callable[[], int]) -> int:
        """How many nodes wait to join, for torchrun's membership restart: 0 once the run
        ended here. After the end a joining node would only restart a finished group,
        and the store may be gone with the node that hosted it; this node's workers,
        perhaps still evaluating or writing files, are left to end on their own."""
        if not self._workers().past_the_end():
            return ask_store()
        if self._store_lost_after_end:
            return 0
        try:
            waiting = ask_store()
        except (RendezvousConnectionError, DistStoreError) as error:
            self._store_lost_after_end = True  # a lost host does not come back: ask no more
            running = sorted(pid for pid, code in self._worker_codes().items() if code is None)
            log.warning("agent.rendezvous_lost_after_end", running=running,
                        error=str(error.__cause__ or error)[:300])
            return 0
        if waiting and not self._join_after_end_logged:
            self._join_after_end_logged = True
            log.info("agent.join_after_end_ignored", waiting=waiting)
        return 0

    def restart_count(self) -> int:
        """The attempt number torchrun gives workers (TORCHELASTIC_RESTART_COUNT)."""
        spec = self._worker_group.spec
        return int(spec.max_restarts - torch_hooks.remaining_restarts(self))

    # -- events around torchrun's steps --------------------------------------------------
    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        started = time.monotonic()
        for retries_left in range(RENDEZVOUS_RETRIES, -1, -1):
            try:
                super()._rendezvous(worker_group)
                break
            except RendezvousGracefulExitError as error:
                # The rendezvous closed while this node waited beyond --nnodes' maximum:
                # closed as for any other waiting node (torchrun's run() would return
                # no result for it, and its launcher fail on that).
                raise RendezvousClosedError(str(error)) from error
            except DistStoreError as error:
                # A node lost after the round closed and before every agent published
                # its role info: the wait for it times out. Failing here would close the
                # rendezvous for all (a replacement node could never join); a new round
                # forms without the lost node, or with its replacement.
                if retries_left == 0:
                    raise
                log.warning("agent.rendezvous_retried", error=str(error)[:300],
                            retries_left=retries_left)
        self._rendezvous_s = time.monotonic() - started
        world = worker_group.workers[0].world_size if worker_group.workers else None
        if self._world_size is not None and world != self._world_size:
            log.warning("agent.membership_changed", old_world_size=self._world_size,
                        new_world_size=world, group_world_size=worker_group.group_world_size)
        self._world_size = world

    def _initialize_workers(self, worker_group: WorkerGroup) -> None:
        if self.settings.end_dir is not None:
            end_marks.clear(self.settings.end_dir)
        if self.settings.rescue_dir is not None:
            clear_save_marks(self.settings.rescue_dir)
        self._end_logged = False
        super()._initialize_workers(worker_group)
        self._detected = False
        self._exit_watch.reset()
        restart_count = self.restart_count()
        bind(restart_count=restart_count, world_size=self._world_size,
             group_rank=worker_group.group_rank)
        log.info("agent.attempt_started", restart_count=restart_count,
                 group_rank=worker_group.group_rank,
                 group_world_size=worker_group.group_world_size,
                 local_world_size=worker_group.spec.local_world_size,
                 pids={str(w.local_rank): w.id for w in worker_group.workers},
                 ranks=[w.global_rank for w in worker_group.workers],
                 master=f"{worker_group.master_addr}:{worker_group.master_port}",
                 started_by=self._started_by,
                 rendezvous_s=None if self._rendezvous_s is None else round(self._rendezvous_s, 4))

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        standby = self.standby
        if standby is None:
            self._started_by = "popen"
            return super()._start_workers(worker_group)
        with torch_hooks.workers_started_by(
                lambda original: start_processes_with(standby, original, self._on_group_start)):
            return super()._start_workers(worker_group)

    def _on_group_start(self, forked: bool, why_not: str | None) -> None:
        standby = self.standby
        if standby is None:
            return
        if forked and not self._standby_announced:
            self._standby_announced = True
            log.info("agent.standby_ready", pid=standby.pid,
                     from_launcher=standby.info.get("from_launcher"),
                     ready_after_s=standby.info.get("ready_after_s"),
                     preload_s=standby.info.get("preload_s"), modules=list(standby.modules),
                     failed=standby.info.get("failed") or {},
                     absent=standby.info.get("absent") or [],
                     threads=standby.info.get("threads"))
        if not forked:
            log.warning("agent.standby_unavailable", reason=why_not,
                        fix="none needed: these workers start as new processes "
                        "(launch.standby=false starts no standby)")
        self._started_by = "standby" if forked else "popen"

    def close_standby(self) -> None:
        """End the standby process (its workers are not touched)."""
        if self.standby is not None:
            self.standby.close()

    def _monitor_workers(self, worker_group: WorkerGroup) -> Any:
        # A worker killed stuck in its exit may have passed the agreed end: check after.
        self._kill_stuck_at_exit()
        after_end = self._failed_after_the_end(worker_group)
        if after_end is not None:
            return after_end
        self._kill_survivors_of_a_failure()
        self._set_aside_torn_error_files()
        result = super()._monitor_workers(worker_group)
        if result.state == WorkerState.FAILED and result.failures:
            # A worker may exit between the check above and torchrun's own look: past
            # the agreed end, that exit still ends no run.
            after_end = self._failed_after_the_end(worker_group)
            if after_end is not None:
                return after_end
            self._on_failures(result.failures)
        self._finished = result.state == WorkerState.SUCCEEDED
        return result

    def _failed_after_the_end(self, worker_group: WorkerGroup) -> RunResult | None:
        """A worker that failed after every rank agreed the run ended (``runend``) does
        not restart a finished run: its peers here are left to finish (rank 0 may still
        be evaluating or writing files), then the group counts as succeeded. None while
        no worker failed, or one failed before the end: the usual handling."""
        workers = self._workers()
        verdict = after_the_end(workers)
        if verdict is None:
            return None
        if not self._end_logged:
            self._end_logged = True
            log.warning("agent.failed_after_end", exit_codes={str(p): c for p, c in
                                                              sorted(workers.failed.items())})
        if verdict is AfterEnd.WAIT:
            return RunResult(state=WorkerState.HEALTHY)
        self._finished = True
        return RunResult(state=WorkerState.SUCCEEDED,
                         return_values={w.global_rank: None for w in worker_group.workers})

    def _on_failures(self, failures: dict[int, ProcessFailure]) -> None:
        errors = {rank: self._worker_error(rank, f) for rank, f in failures.items()
                  if f.pid not in self._killed}
        first = first_failure(errors)
        for global_rank, failure in sorted(failures.items()):
            code = int(failure.exitcode)
            stopped = failure.pid in self._killed
            error = errors.get(global_rank) or {}
            # ``message`` is the event's own field: "Type: message" once the worker said.
            fields = {k: error.get(k) for k in (*ERROR_FIELDS, "output_file")
                      if k != "message" and error.get(k) is not None}
            # torch keeps a structured error file's message as the dict it read.
            raw = failure.message
            message = (f"{error['error']}: {error['message']}" if error else
                       str(raw.get("message") if isinstance(raw, dict) else raw))
            log.warning("agent.worker_failed" if not stopped else "agent.worker_stopped",
                        worker_rank=global_rank, local_rank=failure.local_rank,
                        pid=failure.pid, exit_code=code,
                        signal=failure.signal_name() if code < 0 else None,
                        meaning="stopped by the agent" if stopped else describe_exit(code),
                        message=message[:300], first=global_rank == first, **fields)
        self._killed.clear()
        self.failure = errors[first] if first is not None else None
        codes = sorted({int(f.exitcode) for f in failures.values()})
        verdict = on_failures(codes, self.failure, self._crash_loop)
        if verdict in (Verdict.PREEMPTED, Verdict.PREEMPTED_UNSAVED):
            self.outcome = verdict.value
            log.warning("agent.preempted", exit_codes=codes, outcome=verdict.value)
            raise WorkersPreempted(f"workers exited {codes} ({verdict.value})", signal.SIGTERM)
        if verdict is Verdict.FATAL:
            self.outcome = "fatal"
            log.error("agent.fatal", exit_codes=codes)
            raise WorkersFatal("a worker exited 78 (fatal, not restarted)")
        if verdict is Verdict.CRASH_LOOP:
            self._stop_crash_loop()

    def _worker_error(self, rank: int, failure: ProcessFailure) -> dict[str, Any] | None:
        """What the worker wrote to its error file before it died (runtime.record_failure;
        before ``init()``, the standby's record), else the last traceback in its stderr
        file (when torchrun redirected it), with its rank and output file; None when
        neither says (a signal, an OOM kill, output on the terminal)."""
        data = getattr(failure, "error_file_data", None)
        ours = data.get("elastictrain") if isinstance(data, dict) else None
        output = torch_hooks.stderr_files(self).get(failure.local_rank)
        if not isinstance(ours, dict):  # died before init(): its traceback, if redirected
            ours = error_from_output_file(str(output)) if output else None
            if ours is None:
                return None
            ours["ts"] = float(getattr(failure, "timestamp", 0) or 0)
        return {**ours, "worker_rank": rank, "output_file": str(output) if output else None}

    def _stop_crash_loop(self) -> None:
        """Stop (exit 78): ``crash_loop_failures`` attempts in a row failed first with the
        same error at the same place and step (policy.CrashLoop)."""
        error = self.failure or {}
        count = self._crash_loop.count
        self.outcome = "crash_loop"
        log.error("agent.crash_loop", failures=count,
                  worker_rank=error.get("worker_rank"),
                  **{k: error.get(k) for k in ERROR_FIELDS},
                  fix=fix_line(error))
        raise WorkersFatal(f"crash loop: {count} attempts failed with the same "
                           f"error at the same step ({error.get('error')} at "
                           f"{error.get('where')})")

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        reason = restart_reason(group_healthy=worker_group.state == WorkerState.HEALTHY)
        log.info("agent.restart", reason=reason,
                 from_restart_count=self.restart_count(),
                 remaining_restarts=torch_hooks.remaining_restarts(self))
        if reason == "membership_change":
            self._save_before_restart()
        super()._restart_workers(worker_group)

    def _save_before_restart(self) -> None:
        """Ask the healthy workers for a snapshot of the step they are at and wait until
        every running one that listens is ready (saved, then waiting to be stopped; or
        closing, or taking no step) and none writes a rescue (a peer node was lost while
        this group looked healthy: the rescue is what the new group resumes from), or for
        ``launch.rescue_timeout_s``: the new group resumes where this one stood."""
        if self.settings.rescue_dir is None:
            return
        try:
            request_save(self.settings.rescue_dir)
        except OSError as error:  # the node's tmpfs refused the file: restart as torchrun
            log.warning("agent.save_before_restart_failed", error=str(error)[:300])
            return
        started = time.monotonic()
        while True:
            running = {pid for pid, code in self._worker_codes().items() if code is None}
            listening = listening_pids(self.settings.rescue_dir) & running
            ready = ready_pids(self.settings.rescue_dir) & listening
            rescuing = rescuing_pids(self.settings.rescue_dir) & running
            elapsed = time.monotonic() - started
            if save_wait_over(listening, ready, rescuing, elapsed, self.settings.rescue_timeout_s):
                break
            time.sleep(0.005)
        if listening or rescuing:
            log.info("agent.saved_before_restart", ready=len(ready), listening=len(listening),
                     running=len(running), rescuing=len(rescuing), waited_s=round(elapsed, 3),
                     timed_out=ready != listening or bool(rescuing))

    def _exit_barrier(self) -> None:
        # torchrun's version waits for every agent of the round, a lost one too.
        group = self._worker_group
        handler = group.spec.rdzv_handler
        world = int(group.group_world_size or 1)  # set by the rendezvous before any start
        try:
            mark_job_finished(handler)  # for a node that joins once the others have gone
            outcome = exit_barrier(torch_hooks.rendezvous_store(self), world,
                                   torch_hooks.exit_barrier_timeout(self),
                                   lambda: rendezvous_participants(handler))
            if outcome.ended == "gone":
                log.warning("agent.exit_barrier_short", arrived=outcome.arrived,
                            live=outcome.live, group_world_size=world,
                            waited_s=round(outcome.waited_s, 3))
        except SignalException:
            raise
        except Exception as error:  # torchrun's barrier logs and goes on, too
            log.warning("agent.exit_barrier_failed", error=str(error)[:300])

    def joined_closed_rendezvous(self) -> int:
        """The exit code of a launcher that found the job's rendezvous closed (its other
        agents ended and shut it): 0 when one of them recorded that the run finished (a
        replacement started as the job ended has nothing left to do), else 1."""
        handler = self._worker_group.spec.rdzv_handler
        finished = job_finished(handler)
        # Only once read: the launchers staying for this node (the store's host among
        # them) may go as soon as this is recorded.
        with suppress(Exception):  # the store's host may be gone already
            record_read_closed(handler)
        if finished:
            log.info("agent.job_already_finished")
            return EXIT_OK
        fix = ("check the other nodes' launchers: a job that finished has nothing left to "
               "do; one that failed or was stopped starts again as a whole (a new --rdzv-id "
               "if the rendezvous backend keeps state, as etcd does)")
        self.rendezvous_error = (
            "the job's rendezvous is closed: its other agents ended (the job finished, "
            f"failed or was stopped) before this node could join; fix: {fix}")
        log.error("agent.rendezvous_closed", fix=fix)
        return 1

    def rendezvous_unreachable(self, error: Exception) -> int:
        """The exit code (1) of a launcher that lost the rendezvous store."""
        endpoint = self._worker_group.spec.rdzv_handler.get_backend()
        self.rendezvous_error = (
            f"the rendezvous store ({endpoint} backend) is unreachable: the launcher that "
            "hosted it ended, or the network to it failed; fix: check the other nodes' "
            "launchers (a job that ended has nothing for this node to join)")
        log.error("agent.rendezvous_unreachable", error=str(error.__cause__ or error)[:300])
        return 1

    def stay_for_waiting_nodes(self, timeout_s: float = 15.0) -> None:
        """Before this launcher exits (the rendezvous is closed by then), let a node that
        waits in the rendezvous read that it closed (exitbarrier.stay_for_waiting_nodes)."""
        waited = stay_for_waiting_nodes(self._worker_group.spec.rdzv_handler, timeout_s)
        if waited >= 0.5:
            log.info("agent.stayed_for_waiting_nodes", waited_s=round(waited, 3))

    # -- stopping workers ----------------------------------------------------------------
    def _kill_survivors_of_a_failure(self) -> None:
        """Once a worker failed, SIGKILL the rest before torchrun's poll would SIGTERM them
        (see the module docstring); a 75 means the others are finishing a final save."""
        workers = self._workers()
        # One past the agreed end failed no run (policy.after_the_end).
        failed, live = workers.failed_before_the_end, workers.running
        if failed and not self._detected:
            self._detected = True  # the moment the agent saw it: recovery's "detection"
            log.warning("agent.failure_detected", exit_codes=sorted(set(failed.values())),
                        running=live)
        live = survivors_to_stop(workers)
        context = torch_hooks.process_context(self)
        if live and context is not None:
            self._wait_for_rescues(live)
            self._killed.update(live)
            context.close(death_sig=signal.SIGKILL, timeout=30)

    def _wait_for_rescues(self, live: list[int]) -> None:
        """A survivor writing a rescue (the failed step's predecessor, to node memory:
        snapshot/memory/rescue.py) is stopped only once it is done, or after
        ``launch.rescue_timeout_s``: the restart resumes from what it writes. A survivor
        armed for a rescue that has not met its error yet (its peer's death reaches it
        through a collective, a moment after the agent saw it) gets up to
        ``launch.rescue_start_timeout_s`` to begin one."""
        if self.settings.rescue_dir is None:
            return
        started = time.monotonic()
        while True:
            running = {pid for pid, code in self._worker_codes().items()
                       if code is None} & set(live)
            busy = rescuing_pids(self.settings.rescue_dir) & running
            unstarted = armed_pids(self.settings.rescue_dir) & running - busy
            elapsed = time.monotonic() - started
            if rescue_wait_over(busy, unstarted, elapsed, self.settings.rescue_timeout_s,
                                self.settings.rescue_start_timeout_s):
                break
            time.sleep(0.005)
        waited = round(time.monotonic() - started, 3)
        if busy:
            log.warning("agent.rescue_timeout", pids=sorted(busy), waited_s=waited)
        elif waited > 0.005:
            log.info("agent.rescue_waited", waited_s=waited,
                     unstarted=sorted(unstarted))

    def _kill_stuck_at_exit(self) -> None:
        """SIGKILL a worker stuck in its exit (see the module docstring).

        Its own watchdog ended with its script and its peers are gone, so only the agent
        can see it. CPU time, not wall time, is the test: rank 0 may still be writing the
        final snapshot (in a thread or a persist process) after its peers exited."""
        now = time.monotonic()
        if now - self._exit_checked < 1.0:  # one /proc walk a second is plenty
            return
        self._exit_checked = now
        workers = self._workers()
        context = torch_hooks.process_context(self)
        if context is None or 0 not in workers.codes.values() or not workers.running:
            return
        codes = workers.codes
        stuck = self._exit_watch.stuck(workers, tree_cpu_ticks(workers.running), now)
        if stuck:
            log.warning("agent.worker_stuck_at_exit", pids=stuck,
                        idle_s=round(self.settings.exit_timeout_s, 1),
                        exit_codes={str(pid): code for pid, code in codes.items()})
            self._killed.update(stuck)
            context.close(death_sig=signal.SIGKILL, timeout=30)

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        self._restart_stop = True
        try:
            self._shutdown(death_sig=signal.SIGKILL)
        finally:
            self._restart_stop = False

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        live = [pid for pid, code in self._worker_codes().items() if code is None]
        forwarding = bool(live) and not self._restart_stop
        received = death_sig
        if forwarding and death_sig == signal.SIGINT:
            # Ctrl-C on the launcher (its workers, in their own sessions, get nothing from
            # the terminal): pass it on as a notice, so they save instead of dying.
            death_sig = signal.SIGTERM
        if forwarding:
            log.warning("agent.signal_forwarded", signal=death_sig.name, received=received.name,
                        pids=live, grace_s=timeout)
        notice = forwarding and death_sig in NOTICE_SIGNALS
        if notice and self.settings.shutdown_timeout_s is not None:
            # Ours, not torchrun's 30 s: a torch without --shutdown-timeout passes 30.
            timeout = int(self.settings.shutdown_timeout_s)
        with _ignoring(NOTICE_SIGNALS) if notice else nullcontext():
            if _SHUTDOWN_TAKES_TIMEOUT:
                super()._shutdown(death_sig, timeout)
            else:  # torch 2.11: its _shutdown waits 30 s; the grace is applied here
                context = torch_hooks.process_context(self)
                if context is not None:
                    context.close(death_sig, timeout)
                super()._shutdown(death_sig)  # the rest of its teardown; closing is idempotent
        if forwarding:
            self.worker_exit_codes = self._worker_codes()
            self.outcome = preempted_outcome(self.worker_exit_codes.values()) or self.outcome
            log.warning("agent.workers_stopped", outcome=self.outcome,
                        exit_codes={str(pid): code for pid, code in
                                    self.worker_exit_codes.items()})

    def _set_aside_torn_error_files(self) -> None:
        """An exited worker's error file that is not JSON (the worker was killed while
        writing it) is moved aside: torch's agent would die reading it (JSONDecodeError)
        instead of restarting the group. The failure then counts by its exit code."""
        error_files = torch_hooks.error_files(self)
        for local_rank, handler in self._handlers().items():
            path = error_files.get(local_rank)
            if path is None or handler.proc.poll() is None:
                continue
            try:
                raw = Path(path).read_bytes()
            except OSError:  # none written: the usual case
                continue
            try:
                json.loads(raw)
            except ValueError:
                Path(path).replace(f"{path}.torn")
                log.warning("agent.error_file_torn", local_rank=local_rank,
                            size_bytes=len(raw), path=f"{path}.torn")

    def _handlers(self) -> dict[int, Any]:
        """local rank -> the current workers' process handlers (none before a start)."""
        return torch_hooks.subprocess_handlers(self)

    def _worker_codes(self) -> dict[int, int | None]:
        """pid -> exit code (None while running) of the current workers."""
        return {h.proc.pid: h.proc.poll() for h in self._handlers().values()}


@contextmanager
def _ignoring(signals: Sequence[signal.Signals]) -> Iterator[None]:
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in signals}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
