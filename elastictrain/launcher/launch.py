"""``elastictrain run``: torchrun with elastictrain's defaults, exit codes and agent events.

A thin layer over ``torch.distributed.run``, never a fork of it:

1. **Options.** The command line is torchrun's and is parsed by torchrun's own
   parser (``torch.distributed.run.get_args_parser``), ``PET_*`` variables
   included. For the options neither sets, we add elastictrain's defaults from
   config (``[launch]`` / ``ELASTICTRAIN_LAUNCH__*``): restarts, monitor
   interval, c10d rendezvous with tuned keep-alive, a SIGTERM→SIGKILL grace
   for workers above torchrun's 30 s (torchrun's own ``--shutdown-timeout``),
   and SIGUSR1 among the signals the launcher forwards. The launcher's
   environment carries ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
   (:func:`elastictrain.core.env.launcher_environ`).
2. **The agent.** :class:`~elastictrain.launcher.agent.ElasticTrainAgent` subclasses
   torchrun's ``LocalElasticAgent`` and is the agent torchrun's ``launch_agent``
   builds in this process. It writes agent events to
   ``<events dir>/agent-<launch>-<host>-<pid>.jsonl`` beside the workers' logs, does not
   restart a group whose workers exited 75 (preempted after a final snapshot)
   or 78 (fatal), and stops the rest of a failed group with SIGKILL because our
   workers read SIGTERM as a preemption notice (details in ``agent.py``).
3. **Exit codes** (README "Exit codes"): 0 finished; 75 preempted, resume me;
   78 fatal, do not retry; 2 usage error; 1 restarts used up; 128+N the
   launcher was killed by signal N without a final snapshot.
4. **The live view** on a terminal (``--no-view``: off): the run's events drawn
   in one status area, the job's output in files meanwhile, a summary at the end
   (:mod:`elastictrain.view.run`, docs/live-view.md).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import functools
import gc
import os
import re
import signal
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from elastictrain.core.config import LaunchDefaults, Settings
from elastictrain.core.env import END_DIR_VAR, getenv, launcher_environ
from elastictrain.core.errors import (
    EXIT_FATAL,
    EXIT_OK,
    ConfigError,
    ElasticTrainError,
)
from elastictrain.launcher.exits import failure_summary, launch_meaning, outcome_name, usage_error
from elastictrain.launcher.run_args import (
    check_script,
    given_options,
    shutdown_timeout_s,
    take_no_view,
    take_view_ranks,
    torchrun_argv,
)
from elastictrain.launcher.run_help import torchrun_parser

if TYPE_CHECKING:  # the agent imports torch's launcher: only when a run starts
    from elastictrain.launcher.agent import ElasticTrainAgent



# How long past torchrun's --shutdown-timeout (the workers' time to save after a notice)
# the launcher may take to end before its grace watch ends it (gracewatch.py).
GRACE_MARGIN_S = 10.0


def run_torchrun(argv: Sequence[str], launch: LaunchDefaults,
                 rescue_dir: Path | None = None, *, shutdown_timeout_s: float,
                 notices: frozenset[int]) -> tuple[int, ElasticTrainAgent | None]:
    """Run torchrun's ``main`` with our agent in this process; return our exit code and
    the agent torchrun built (None if it built none). After a notice among ``notices``
    it ends within ``shutdown_timeout_s`` plus ``GRACE_MARGIN_S``, whatever it is
    waiting in."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import (
        RendezvousClosedError,
        RendezvousConnectionError,
    )
    from torch.distributed.run import main as torchrun_main

    from elastictrain.handoff import end_marks
    from elastictrain.launcher import gracewatch
    from elastictrain.launcher.agent import WorkersFatal
    from elastictrain.launcher.agent_settings import AgentSettings
    from elastictrain.launcher.install import installed, on_grace_expired
    from elastictrain.launcher.policy import outcome_exit_code

    gc.freeze()  # as in a worker (runtime.init): the imports leave the collector's view
    with end_marks.end_dir() as end_dir, \
            installed(AgentSettings.of(launch, rescue_dir, end_dir,
                                       shutdown_timeout_s)) as built, \
            gracewatch.watching(shutdown_timeout_s + GRACE_MARGIN_S, notices,
                                lambda signum: on_grace_expired(built.agent, signum)):
        os.environ[END_DIR_VAR] = str(end_dir)  # the workers inherit it
        agent = None
        try:
            torchrun_main(list(argv))
            return _after_closing(EXIT_OK, built.agent), built.agent
        except RendezvousClosedError:
            agent = built.agent
            return (1 if agent is None else agent.joined_closed_rendezvous()), agent
        except RendezvousConnectionError as exc:
            agent = built.agent
            return (1 if agent is None else agent.rendezvous_unreachable(exc)), agent
        except SignalException as exc:
            agent = built.agent
            if agent is not None and agent.finished:
                return EXIT_OK, agent  # signalled while waiting for the other nodes
            outcome = None if agent is None else agent.outcome
            return outcome_exit_code(outcome, int(exc.sigval)), agent
        except WorkersFatal:
            return _after_closing(EXIT_FATAL, built.agent), built.agent
        except ChildFailedError:
            return _after_closing(1, built.agent), built.agent
        except KeyboardInterrupt:  # Ctrl-C before torchrun handles signals: no worker yet
            return 128 + signal.SIGINT, built.agent


def _after_closing(code: int, agent: ElasticTrainAgent | None) -> int:
    """torchrun closed the rendezvous: a node waiting to join reads that before this
    launcher (perhaps the rendezvous store's host) goes (exitbarrier.py)."""
    if agent is not None:
        with contextlib.suppress(Exception):  # never turn an ended run into a failure
            agent.stay_for_waiting_nodes()
    return code


def _configure_agent_log(settings: Settings, run_id: str) -> None:
    """Agent events go to ``<events dir>/agent-<launch>-<host>-<pid>.jsonl`` beside the
    workers' (``elastictrain.runlog.events``)."""
    from elastictrain.core import log as et_log
    from elastictrain.runlog import events

    host = socket.gethostname()
    launch = events.launch_id()
    # whole_dir: the agent outlives SIGKILLed workers and uploads their files too.
    sink = events.open_sink(settings, run_id, events.agent_file_name(host, os.getpid(), launch),
                            whole_dir=True)
    et_log.configure(settings.log.level, json_output=settings.log.json_output,
                     events_file=sink.path, upload=sink.upload)
    et_log.bind(run_id=run_id, role="agent", host=host, rank=None, world_size=None,
                restart_count=0, launch_id=launch, step=None)


def main(argv: Sequence[str] | None = None) -> int:
    """``elastictrain run [torchrun options] SCRIPT [ARGS]``: returns the exit code.

    On a terminal (and without ``--no-view`` or torchrun's ``--tee``) the run is shown in
    a live view while the job's output goes to files (``elastictrain.view.run``).

    Raises:
        ConfigError: bad settings or an unusable combination of options.
    """
    from elastictrain.core.config import load_settings
    from elastictrain.launcher.gather import gather
    from elastictrain.runlog.events import LAUNCH_ID_VAR, new_launch_id, run_events_dir
    from elastictrain.view.live import view_wanted

    argv = list(sys.argv[1:] if argv is None else argv)
    no_view, argv = take_no_view(argv)
    view_ranks, argv = take_view_ranks(argv)
    try:  # the command line first: its errors are usage errors (2)
        check_script(torchrun_parser().parse_args(argv))
        ranks = view_output_ranks(view_ranks)
    except ConfigError as exc:
        return usage_error(exc)
    settings = load_settings()  # validated before any worker starts (ConfigError: 78)
    try:
        full = torchrun_argv(argv, settings.launch, os.environ, settings.run_id)
    except ConfigError as exc:  # a command-line problem, not a config file one
        return usage_error(exc)
    args, given = given_options(torchrun_parser(), full, os.environ)
    settings.launch.standby_preload = standby_modules(settings.launch.standby_preload,
                                                      args.training_script_args)
    # One launch id for this launcher and its workers: a requeue or relaunch of the
    # same run is a new launch in the event log (elastictrain.runlog.events). A program
    # that starts the launcher (the demo) may name it, to tell its events apart.
    launch = getenv(LAUNCH_ID_VAR) or new_launch_id()
    environ = launcher_environ({LAUNCH_ID_VAR: launch})
    if settings.launch.standby:  # before this process changes its environment
        _fork_standby(args, settings.launch, environ)
    os.environ.update(environ)
    run_id = str(args.rdzv_id)
    # --tee asks for the workers' output on the terminal, where it would tear the view.
    events_dir = run_events_dir(settings, run_id)
    if not view_wanted(quiet=no_view) or "tee" in given:
        code, agent = _run(full, args, settings, run_id)
        gathered = gather(events_dir, launch, settings)
        why = failure_summary(agent, None if gathered is None else
                              functools.partial(gathered.path_of, events_dir))
        if code != EXIT_OK and why:
            print(f"elastictrain run: exit {code}: {launch_meaning(code, agent)}\n"
                  + "\n".join(why),
                  file=sys.stderr, flush=True)
        return code
    from elastictrain.view.run import RunOutput, run_view, summary, worker_log_args

    added, log_dir = worker_log_args(given, args.log_dir, events_dir, launch)
    output = RunOutput(events_dir, log_dir, events_dir / f"launcher-{launch}.log")
    with run_view(output, run_id, launch, ranks) as view:
        code, agent = _run(added + full, args, settings, run_id)
    gathered = gather(events_dir, launch, settings)
    if gathered is not None:  # the summary names where the files are now
        output = gathered.output_of(events_dir, output)
    why = failure_summary(agent, None if gathered is None else functools.partial(
        gathered.path_of, events_dir)) if code != EXIT_OK else []
    print("\n".join([summary(view.state, code, launch_meaning(code, agent), output), *why]),
          flush=True)
    return code


def view_output_ranks(spec: str) -> frozenset[int] | None:
    """``--view-ranks`` as the local ranks the view shows the output of (None: all).

    Raises:
        ConfigError: a value that is not one (a usage error).
    """
    from elastictrain.view.output import parse_ranks

    try:
        return parse_ranks(spec)
    except ValueError as exc:
        raise ConfigError(f"{exc}; fix: e.g. --view-ranks 0,1") from exc


def standby_modules(preload: list[str], script_args: Sequence[str]) -> list[str]:
    """``launch.standby_preload``, plus the client of each object store whose URL the
    script's arguments name (``s3://bucket/ckpt``, ``--storage=s3://…``)."""
    from elastictrain.core.config import STORAGE_CLIENTS

    schemes = {m.group(1).lower() for arg in script_args
               for m in re.finditer(r"(?<![\w+.-])([A-Za-z][\w+.-]*)://", arg)}
    clients = [STORAGE_CLIENTS[s] for s in sorted(schemes) if s in STORAGE_CLIENTS]
    return [*preload, *(c for c in dict.fromkeys(clients) if c not in preload)]


def _fork_standby(args: argparse.Namespace, launch: LaunchDefaults,
                  environ: dict[str, str]) -> None:
    """Import what the agent needs of torch, then fork the standby from this process
    (``standby.client.fork_from_launcher``), so that it does not import torch again.

    Called from ``main`` before it changes the environment (``fork_from_launcher``), and
    before the live view, the event log or any thread starts, with no ``with`` block
    open: a worker forked from the standby leaves through ``main``'s callers by
    ``SystemExit``."""
    import torch.distributed.run  # noqa: F401  # the agent's; imported here for both

    from elastictrain.launcher.standby.client import fork_from_launcher

    if args.no_python or args.run_path:
        return  # not a command the standby runs (standby.context.python_argv)
    module = ["-m"] if args.module else []
    title = " ".join([sys.executable, "-u", *module, args.training_script,
                      *args.training_script_args])
    fork_from_launcher(launch.standby_preload, title, environ)


def _run(full: list[str], args: argparse.Namespace, settings: Settings, run_id: str
         ) -> tuple[int, ElasticTrainAgent | None]:
    """Run torchrun with the agent's events around it; return the exit code and the
    agent torchrun built."""
    from elastictrain.core.log import get_logger

    _configure_agent_log(settings, run_id)
    log = get_logger("elastictrain.agent")
    started = time.monotonic()
    grace_s = shutdown_timeout_s(args, settings.launch, os.environ)
    log.info("agent.start", pid=os.getpid(), nnodes=args.nnodes,
             nproc_per_node=args.nproc_per_node, max_restarts=args.max_restarts,
             monitor_interval_s=args.monitor_interval, rdzv_backend=args.rdzv_backend,
             rdzv_endpoint=args.rdzv_endpoint, shutdown_timeout_s=grace_s,
             signals_to_handle=args.signals_to_handle, entrypoint=args.training_script)
    from elastictrain.handoff.rescue_marks import launch_marks

    notices = frozenset(int(signal.Signals[name.strip()])
                        for name in str(args.signals_to_handle).split(",") if name.strip())
    with launch_marks() as marks:  # where survivors mark a rescue (agent waits)
        code, agent = run_torchrun(full, settings.launch, marks,
                                   shutdown_timeout_s=grace_s, notices=notices)
    crash_loop = agent is not None and agent.outcome == "crash_loop" and code == EXIT_FATAL
    log.info("agent.finished", exit_code=code,
             outcome="crash_loop" if crash_loop else outcome_name(code),
             wall_s=round(time.monotonic() - started, 3))
    return code, agent


def cli_main(argv: Sequence[str] | None = None) -> int:
    """``main`` with elastictrain errors as one line on stderr and their exit code."""
    try:
        return main(argv)
    except ElasticTrainError as exc:
        print(f"elastictrain run: error: {exc}", file=sys.stderr)
        return exc.exit_code


def exit_launcher(code: int) -> NoReturn:
    """End the launcher process with ``code`` once Python's ``atexit`` work is done (the
    event log's last upload, logging's flush), without the interpreter's teardown.

    After torchrun's agent has finished, tearing down torch's native state at exit could
    destroy a still-running C++ thread and abort the process ("terminate called without
    an active exception", exit -6 instead of 75: seen once in the suite). Nothing is
    left to tear down by then: the workers are stopped and the events are written.
    """
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_launcher(cli_main())
