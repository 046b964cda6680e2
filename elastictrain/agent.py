"""ElasticTrainAgent: torchrun's ``LocalElasticAgent`` with events and an exit-code policy.

What it adds, each by overriding one of the agent's documented steps
(``_rendezvous``, ``_initialize_workers``, ``_monitor_workers``,
``_restart_workers``, ``_stop_workers``, ``_shutdown``):

* **events** in the run's event log, beside the workers':
  ``agent.attempt_started`` (restart count, ranks, pids), ``agent.worker_failed``
  (exit code or signal, and what the code means), ``agent.restart`` (reason:
  failure or membership change), ``agent.membership_changed`` (old/new world
  size), ``agent.signal_forwarded`` / ``agent.workers_stopped`` (a notice to the
  launcher and how the workers ended), ``agent.preempted``, ``agent.fatal``;
* **Ctrl-C is a notice**: SIGINT to the launcher reaches the workers as SIGTERM, so
  they take a final snapshot and the launcher exits 75 (``elastictrain demo`` relies
  on the same path);
* **no restart** of a group whose workers exited 75 (preempted after a final
  snapshot: the node is going away) or 78 (fatal: a restart cannot fix it);
* **the first failing worker's error**, from torchrun's per-worker error file that
  the worker's excepthook fills (``runtime.record_failure``), on
  ``agent.worker_failed`` (``first: true``) and in the launcher's summary;
* **a crash loop stops the run**: ``launch.crash_loop_failures`` attempts in a row
  whose first failure is the same error at the same place and step end the run with
  78 (``agent.crash_loop``) instead of burning the remaining restarts;
* **SIGKILL, not SIGTERM,** to stop the remaining workers for a restart (after a
  failure or on a membership change). Our workers read SIGTERM as a preemption
  notice: they would not die on it but try to save and exit 75 (which another
  node's agent could take for a real preemption), or, blocked in a collective
  with a dead peer, not run the handler at all until torchrun's 30 s grace ends.
  A group being restarted has nothing worth saving, and even a clean Python
  exit after ``import torch`` takes seconds (docs/preemption.md), which every
  recovery would pay. Survivors of a preemption (a peer exited 75) are left to finish;
* **a snapshot before a membership change**: when a node joins (torchrun restarts a
  healthy group at the new size), the agent first asks its workers for a snapshot of
  the step they are at (``snapshot/restart_save.py``) and stops them once each is ready
  (saved, or closing), or after ``launch.rescue_timeout_s`` (``agent.saved_before_restart``);
* **a rescue finishes first**: a survivor writing the last step to node memory
  (``snapshot/rescue.py``) is killed only once it is done, or after
  ``launch.rescue_timeout_s`` (``agent.rescue_waited``, ``agent.rescue_timeout``);
* **a worker stuck in its exit is ended**: once a peer exited 0, a worker whose
  process tree uses no CPU for ``exit_timeout_s`` (stopped, or deadlocked in a
  destructor) is SIGKILLed instead of waited for without bound; one that had agreed
  the run's end (``runend``) finished, anything else is a failure that restarts;
* **repeated notices ignored** while workers save after the launcher was
  signalled (a second SIGTERM would abort torchrun's graceful wait and orphan
  workers mid-snapshot), and the workers' exit codes recorded afterwards;
* **the exit barrier waits for live nodes only** (``_exit_barrier``,
  :mod:`elastictrain.exitbarrier`): a node lost after the run's agreed end does not hold
  the survivors for torchrun's 300 s; ``agent.exit_barrier_short`` says how many agents
  were gone;
* **a finished run takes no one in** (``_nodes_waiting``): torchrun restarts a healthy
  group when a node waits in the rendezvous; once this node's workers agreed the run's
  end, a node arriving then is not taken in (it reads the finished job as the others
  leave) and a rendezvous store that is gone (its host ended or was lost after the end)
  does not end a script still working after ``close()``
  (``agent.join_after_end_ignored``, ``agent.rendezvous_lost_after_end``);
* **workers forked from a standby** (``launch.standby``): a process started with the
  agent imports torch once, and every worker group, first and restarted, is forked
  from it (``_start_workers``; :mod:`elastictrain.standby`); ``agent.standby_ready``
  says what it imported, ``agent.attempt_started`` how each group started.

torchrun's ``launch_agent`` builds ``LocalElasticAgent`` by name; :func:`installed`
points that name at this class in the launcher process for the duration of
the run (torchrun has no hook for the agent class).
"""

from __future__ import annotations

import inspect
import json
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch.distributed.launcher.api as launcher_api
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

from elastictrain import runend
from elastictrain.config import LaunchDefaults
from elastictrain.errors import (
    EXIT_FATAL,
    EXIT_HANG,
    EXIT_OK,
    EXIT_PREEMPTED,
    EXIT_PREEMPTED_UNSAVED,
    ElasticTrainError,
)
from elastictrain.exitbarrier import (
    exit_barrier,
    job_finished,
    mark_job_finished,
    rendezvous_participants,
    stay_for_waiting_nodes,
)
from elastictrain.failure import ERROR_FIELDS, fix_line
from elastictrain.log import bind, get_logger
from elastictrain.proctree import tree_cpu_ticks
from elastictrain.rescue_marks import (
    armed_pids,
    clear_save_marks,
    listening_pids,
    ready_pids,
    request_save,
    rescuing_pids,
)
from elastictrain.standby.client import Standby
from elastictrain.standby.context import starting_from

log = get_logger("elastictrain.agent")

NOTICE_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
RENDEZVOUS_RETRIES = 2  # rounds an agent joins again after a rank exchange timed out
# torch >= 2.12 passes torchrun's --shutdown-timeout to _shutdown; 2.11 has neither.
_SHUTDOWN_TAKES_TIMEOUT = "timeout" in inspect.signature(LocalElasticAgent._shutdown).parameters
PREEMPTED = (EXIT_PREEMPTED, EXIT_PREEMPTED_UNSAVED)  # the group agreed to stop: no restart


def preempted_outcome(codes: Any) -> str | None:
    """``preempted`` (75), ``preempted_unsaved`` (76: any rank says the final snapshot
    did not commit) or None, from the workers' exit codes."""
    if EXIT_PREEMPTED_UNSAVED in codes:
        return "preempted_unsaved"
    return "preempted" if EXIT_PREEMPTED in codes else None


class WorkersPreempted(SignalException):
    """Workers exited 75 or 76: the group stops and the launcher exits with that code.

    A ``SignalException`` on purpose: torchrun then leaves the rendezvous open,
    as when the agent itself is signalled, so the resumed job can reuse its id;
    any other exception closes it for good (etcd keeps that state).
    """


class WorkersFatal(Exception):
    """A worker exited 78 (fatal): do not restart."""


def describe_exit(exitcode: int) -> str:
    """What a worker's exit code means to the launcher."""
    if exitcode in PREEMPTED:
        return str(preempted_outcome([exitcode]))
    if exitcode == EXIT_FATAL:
        return "fatal"
    if exitcode == EXIT_HANG:
        return "hang"
    return "signal" if exitcode < 0 else "error"


# Errors a worker raises for a fault outside its script (errors.PeerNodeLost): never a
# crash loop, however often they repeat.
EXTERNAL_ERRORS = frozenset({"PeerNodeLost"})


class ElasticTrainAgent(LocalElasticAgent):
    """torchrun's local agent plus events, exit-code policy and notice forwarding.

    ``outcome`` is ``"preempted"`` or ``"fatal"`` once the agent decided to stop
    for that reason (None otherwise); the launcher maps it to its exit code.
    """

    latest: ElasticTrainAgent | None = None
    exit_timeout_s: float = 60.0  # set by installed() from launch.exit_timeout_s
    standby_preload: tuple[str, ...] | None = None  # None: no standby (launch.standby)
    rescue_dir: Path | None = None  # where survivors mark a rescue (rescue_marks.py)
    rescue_timeout_s: float = 30.0
    rescue_start_timeout_s: float = 5.0
    end_dir: Path | None = None  # where workers mark the run's agreed end (runend.py)
    shutdown_timeout_s: float | None = None  # the notice grace; None: torchrun's
    crash_loop_failures: int = 2  # set by installed() from launch.crash_loop_failures

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.standby: Standby | None = None
        self._started_by: str | None = None
        self._standby_announced = False
        if self.standby_preload is not None:
            # Started now, so its imports run during the first rendezvous.
            self.standby = Standby(self.standby_preload)
            self.standby.start()
        self.outcome: str | None = None
        self.worker_exit_codes: dict[int, int | None] = {}
        self._world_size: int | None = None
        self._restart_stop = False
        self._killed: set[int] = set()  # survivors this agent SIGKILLed after a failure
        self._detected = False  # a failure of the current attempt was reported
        self._rendezvous_s: float | None = None
        self._exit_watch: dict[int, tuple[int | None, float]] = {}  # pid -> CPU ticks, since
        self._exit_checked = 0.0
        self._end_logged = False  # agent.failed_after_end was logged for this attempt
        self._finished = False  # see finished
        # The first failing worker's error of the newest failed attempt (its summary),
        # and the crash-loop count: identical failures in a row (_check_crash_loop).
        self.failure: dict[str, Any] | None = None
        self._loop_signature: tuple[str, ...] | None = None
        self._loop_count = 0
        self.rendezvous_error: str | None = None  # why the rendezvous ended this launcher
        self._store_lost_after_end = False
        self._join_after_end_logged = False
        # torchrun's monitor loop asks the handler itself (it has no step to override).
        handler = self._worker_group.spec.rdzv_handler
        ask_store = handler.num_nodes_waiting
        handler.num_nodes_waiting = lambda: self._nodes_waiting(ask_store)  # type: ignore[method-assign]
        ElasticTrainAgent.latest = self

    @property
    def finished(self) -> bool:
        """This node's workers all ended the run (exit 0, or past the agreed end:
        ``runend``): a notice while the agent waits for the other nodes, or while a
        script works on after ``close()``, is no failure (a relaunch would only re-run
        the end from an older snapshot)."""
        codes = self._worker_codes()
        ended = runend.ended_pids(self.end_dir) if self.end_dir is not None else set()
        return self._finished or (bool(codes) and all(
            code == 0 or pid in ended for pid, code in codes.items()))

    def _past_the_end(self) -> bool:
        """A worker of this node marked the run's agreed end: every rank reached it."""
        if self.end_dir is None:
            return False
        return bool(set(self._worker_codes()) & runend.ended_pids(self.end_dir))

    def _nodes_waiting(self, ask_store: Callable[[], int]) -> int:
        """How many nodes wait to join, for torchrun's membership restart: 0 once the run
        ended here. After the end a joining node would only restart a finished group,
        and the store may be gone with the node that hosted it; this node's workers,
        perhaps still evaluating or writing files, are left to end on their own."""
        if not self._past_the_end():
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
        return int(spec.max_restarts - self._remaining_restarts)

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
        if self.end_dir is not None:
            runend.clear(self.end_dir)
        if self.rescue_dir is not None:
            clear_save_marks(self.rescue_dir)
        self._end_logged = False
        super()._initialize_workers(worker_group)
        self._detected = False
        self._exit_watch.clear()
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
        with starting_from(standby, self._on_group_start):
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
        if self.end_dir is None:
            return None
        codes = self._worker_codes()
        failed = {pid: code for pid, code in codes.items() if code not in (None, 0)}
        if not failed or not set(failed) <= runend.ended_pids(self.end_dir):
            return None
        if not self._end_logged:
            self._end_logged = True
            log.warning("agent.failed_after_end", exit_codes={str(p): c for p, c in
                                                              sorted(failed.items())})
        if any(code is None for code in codes.values()):
            return RunResult(state=WorkerState.HEALTHY)
        self._finished = True
        return RunResult(state=WorkerState.SUCCEEDED,
                         return_values={w.global_rank: None for w in worker_group.workers})

    def _on_failures(self, failures: dict[int, ProcessFailure]) -> None:
        errors = {rank: self._worker_error(rank, f) for rank, f in failures.items()
                  if f.pid not in self._killed}
        reported = {rank: e for rank, e in errors.items() if e is not None}
        # The worker that failed first says why; the others mostly fail because it did.
        first = min(reported, key=lambda r: (float(reported[r].get("ts") or 0.0), r),
                    default=None)
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
        self.failure = reported[first] if first is not None else None
        codes = sorted({int(f.exitcode) for f in failures.values()})
        # A 75 means the whole world agreed and the writer committed before any rank
        # exited (workers pass a barrier first); a 78 cannot be healed by a restart.
        preempted = preempted_outcome(codes)
        if preempted is not None:
            self.outcome = preempted
            log.warning("agent.preempted", exit_codes=codes, outcome=preempted)
            raise WorkersPreempted(f"workers exited {codes} ({preempted})", signal.SIGTERM)
        if EXIT_FATAL in codes:
            self.outcome = "fatal"
            log.error("agent.fatal", exit_codes=codes)
            raise WorkersFatal("a worker exited 78 (fatal, not restarted)")
        self._check_crash_loop()

    def _worker_error(self, rank: int, failure: ProcessFailure) -> dict[str, Any] | None:
        """What the worker wrote to its error file before it died (runtime.record_failure),
        with its rank and output file; None when it wrote nothing (a signal, an OOM kill,
        a script without ``elastictrain.init``)."""
        data = getattr(failure, "error_file_data", None)
        ours = data.get("elastictrain") if isinstance(data, dict) else None
        if not isinstance(ours, dict):
            return None
        stderrs = getattr(self._pcontext, "stderrs", None) or {}
        output = stderrs.get(failure.local_rank) if isinstance(stderrs, dict) else None
        return {**ours, "worker_rank": rank, "output_file": str(output) if output else None}

    def _check_crash_loop(self) -> None:
        """Stop (exit 78) once ``crash_loop_failures`` attempts in a row failed first with
        the same error at the same place and the same step: no progress, and a restart
        would fail the same way. A failure at a later step (progress) or another error
        starts the count over; a failure without a reported error (a signal) resets it,
        and so does the loss of another node (``PeerNodeLost``): the fleet's fault, not
        the script's, which two losses in a row at one step must not turn into a stop."""
        error = self.failure
        signature = None if error is None or error.get("error") in EXTERNAL_ERRORS else tuple(
            str(error.get(k)) for k in ("error", "message", "where", "failed_step"))
        if signature is not None and signature == self._loop_signature:
            self._loop_count += 1
        else:
            self._loop_signature, self._loop_count = signature, int(signature is not None)
        if error is None or not self.crash_loop_failures or \
                self._loop_count < self.crash_loop_failures:
            return
        self.outcome = "crash_loop"
        log.error("agent.crash_loop", failures=self._loop_count,
                  worker_rank=error.get("worker_rank"),
                  **{k: error.get(k) for k in ERROR_FIELDS},
                  fix=fix_line(error))
        raise WorkersFatal(f"crash loop: {self._loop_count} attempts failed with the same "
                           f"error at the same step ({error.get('error')} at "
                           f"{error.get('where')})")

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        healthy = worker_group.state == WorkerState.HEALTHY
        log.info("agent.restart", reason="membership_change" if healthy else "failure",
                 from_restart_count=self.restart_count(),
                 remaining_restarts=self._remaining_restarts)
        if healthy:
            self._save_before_restart()
        super()._restart_workers(worker_group)

    def _save_before_restart(self) -> None:
        """Ask the healthy workers for a snapshot of the step they are at and wait until
        every running one that listens is ready (saved, then waiting to be stopped; or
        closing, or taking no step) and none writes a rescue (a peer node was lost while
        this group looked healthy: the rescue is what the new group resumes from), or for
        ``launch.rescue_timeout_s``: the new group resumes where this one stood."""
        if self.rescue_dir is None:
            return
        try:
            request_save(self.rescue_dir)
        except OSError as error:  # the node's tmpfs refused the file: restart as torchrun
            log.warning("agent.save_before_restart_failed", error=str(error)[:300])
            return
        started = time.monotonic()
        while True:
            running = {pid for pid, code in self._worker_codes().items() if code is None}
            listening = listening_pids(self.rescue_dir) & running
            ready = ready_pids(self.rescue_dir) & listening
            rescuing = rescuing_pids(self.rescue_dir) & running
            elapsed = time.monotonic() - started
            if (ready == listening and not rescuing) or elapsed >= self.rescue_timeout_s:
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
        self._in_exit_barrier = True
        try:
            mark_job_finished(handler)  # for a node that joins once the others have gone
            outcome = exit_barrier(self._store, world, self._exit_barrier_timeout,
                                   lambda: rendezvous_participants(handler))
            if outcome.ended == "gone":
                log.warning("agent.exit_barrier_short", arrived=outcome.arrived,
                            live=outcome.live, group_world_size=world,
                            waited_s=round(outcome.waited_s, 3))
        except SignalException:
            raise
        except Exception as error:  # torchrun's barrier logs and goes on, too
            log.warning("agent.exit_barrier_failed", error=str(error)[:300])
        finally:
            self._in_exit_barrier = False

    def joined_closed_rendezvous(self) -> int:
        """The exit code of a launcher that found the job's rendezvous closed (its other
        agents ended and shut it): 0 when one of them recorded that the run finished (a
        replacement started as the job ended has nothing left to do), else 1."""
        if job_finished(self._worker_group.spec.rdzv_handler):
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
        codes = self._worker_codes()
        ended = runend.ended_pids(self.end_dir) if self.end_dir is not None else set()
        # One past the agreed end failed no run (``_failed_after_the_end``): its peers
        # here are left to finish.
        failed = {c for pid, c in codes.items() if c not in (None, 0) and pid not in ended}
        live = [pid for pid, c in codes.items() if c is None]
        if failed and not self._detected:
            self._detected = True  # the moment the agent saw it: recovery's "detection"
            log.warning("agent.failure_detected", exit_codes=sorted(failed), running=live)
        if failed and live and preempted_outcome(failed) is None and self._pcontext is not None:
            self._wait_for_rescues(live)
            self._killed.update(live)
            self._pcontext.close(death_sig=signal.SIGKILL, timeout=30)

    def _wait_for_rescues(self, live: list[int]) -> None:
        """A survivor writing a rescue (the failed step's predecessor, to node memory:
        snapshot/rescue.py) is stopped only once it is done, or after
        ``launch.rescue_timeout_s``: the restart resumes from what it writes. A survivor
        armed for a rescue that has not met its error yet (its peer's death reaches it
        through a collective, a moment after the agent saw it) gets up to
        ``launch.rescue_start_timeout_s`` to begin one."""
        if self.rescue_dir is None:
            return
        started = time.monotonic()
        while True:
            running = {pid for pid, code in self._worker_codes().items()
                       if code is None} & set(live)
            busy = rescuing_pids(self.rescue_dir) & running
            unstarted = armed_pids(self.rescue_dir) & running - busy
            elapsed = time.monotonic() - started
            if not ((busy and elapsed < self.rescue_timeout_s)
                    or (unstarted and elapsed < self.rescue_start_timeout_s)):
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
        codes = self._worker_codes()
        live = [pid for pid, code in codes.items() if code is None]
        if 0 not in codes.values() or not live or self._pcontext is None:
            return
        stuck = []
        for pid, ticks in tree_cpu_ticks(live).items():
            seen = self._exit_watch.get(pid)
            if seen is None or seen[0] != ticks:
                self._exit_watch[pid] = (ticks, now)
            elif now - seen[1] >= self.exit_timeout_s:
                stuck.append(pid)
        if stuck:
            log.warning("agent.worker_stuck_at_exit", pids=stuck,
                        idle_s=round(self.exit_timeout_s, 1),
                        exit_codes={str(pid): code for pid, code in codes.items()})
            self._killed.update(stuck)
            self._pcontext.close(death_sig=signal.SIGKILL, timeout=30)

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
        if notice and self.shutdown_timeout_s is not None:
            # Ours, not torchrun's 30 s: a torch without --shutdown-timeout passes 30.
            timeout = int(self.shutdown_timeout_s)
        with _ignoring(NOTICE_SIGNALS) if notice else nullcontext():
            if _SHUTDOWN_TAKES_TIMEOUT:
                super()._shutdown(death_sig, timeout)
            else:  # torch 2.11: its _shutdown waits 30 s; the grace is applied here
                if self._pcontext is not None:
                    self._pcontext.close(death_sig, timeout)
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
        error_files = getattr(self._pcontext, "error_files", None) or {}
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
        return getattr(self._pcontext, "subprocess_handlers", None) or {}

    def _worker_codes(self) -> dict[int, int | None]:
        """pid -> exit code (None while running) of the current workers."""
        return {h.proc.pid: h.proc.poll() for h in self._handlers().values()}


def on_grace_expired(signum: int) -> tuple[list[int], int]:
    """For ``gracewatch``: the process groups to SIGKILL (the current workers, each in
    its own session, and the standby) and the launcher's exit code: 75/76 when the
    workers settled their final snapshot, else that of a launcher killed by ``signum``."""
    agent = ElasticTrainAgent.latest
    if agent is None:
        return [], 128 + signum
    codes = agent._worker_codes()
    groups = [pid for pid, code in codes.items() if code is None]
    if agent.standby is not None and agent.standby.pid is not None:
        groups.append(agent.standby.pid)
    if agent.finished:
        return groups, EXIT_OK  # stuck in the exit barrier, waiting for the other nodes
    outcome = preempted_outcome(codes.values()) or agent.outcome
    code = {"preempted": EXIT_PREEMPTED,
            "preempted_unsaved": EXIT_PREEMPTED_UNSAVED}.get(str(outcome), 128 + signum)
    return groups, code


@contextmanager
def _ignoring(signals: Sequence[signal.Signals]) -> Iterator[None]:
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in signals}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


@contextmanager
def installed(launch: LaunchDefaults | None = None, rescue_dir: Path | None = None,
              end_dir: Path | None = None, shutdown_timeout_s: float | None = None
              ) -> Iterator[type[ElasticTrainAgent]]:
    """Make torchrun's ``launch_agent`` build :class:`ElasticTrainAgent` (this process),
    ending workers stuck in their exit after ``launch.exit_timeout_s`` without CPU use
    and starting workers from a standby when ``launch.standby``."""
    launch = launch or LaunchDefaults()
    original = getattr(launcher_api, "LocalElasticAgent", None)
    if original is not LocalElasticAgent:
        raise ElasticTrainError(
            "torch.distributed.launcher.api no longer builds LocalElasticAgent by name; "
            "fix: run plain torchrun (no agent events; exit 1 instead of 75 on preemption) "
            "and report the torch version")
    launcher_api.LocalElasticAgent = ElasticTrainAgent  # type: ignore[misc]
    ElasticTrainAgent.exit_timeout_s = launch.exit_timeout_s
    ElasticTrainAgent.rescue_dir = rescue_dir
    ElasticTrainAgent.end_dir = end_dir
    ElasticTrainAgent.shutdown_timeout_s = shutdown_timeout_s
    ElasticTrainAgent.rescue_timeout_s = launch.rescue_timeout_s
    ElasticTrainAgent.rescue_start_timeout_s = launch.rescue_start_timeout_s
    ElasticTrainAgent.crash_loop_failures = launch.crash_loop_failures
    ElasticTrainAgent.standby_preload = tuple(launch.standby_preload) if launch.standby else None
    ElasticTrainAgent.latest = None
    try:
        yield ElasticTrainAgent
    finally:
        launcher_api.LocalElasticAgent = original  # type: ignore[misc]
        ElasticTrainAgent.standby_preload = None
        ElasticTrainAgent.rescue_dir = None
        ElasticTrainAgent.end_dir = None
        ElasticTrainAgent.shutdown_timeout_s = None
        if ElasticTrainAgent.latest is not None:
            ElasticTrainAgent.latest.close_standby()
