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
import gc
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, NoReturn

from elastictrain.core.config import LaunchDefaults, Settings
from elastictrain.core.env import END_DIR_VAR, launcher_environ
from elastictrain.core.errors import (
    EXIT_FATAL,
    EXIT_OK,
    EXIT_PREEMPTED,
    EXIT_PREEMPTED_UNSAVED,
    EXIT_USAGE,
    ConfigError,
    ElasticTrainError,
)

if TYPE_CHECKING:  # the agent imports torch's launcher: only when a run starts
    from elastictrain.launcher.agent import ElasticTrainAgent

# Kept importable for callers of the walking skeleton; the value lives in config.
DEFAULT_RDZV_CONF = LaunchDefaults().rdzv_conf
EVENTS_DIR_VAR = "ELASTICTRAIN_LOG__EVENTS_DIR"
NO_VIEW = "--no-view"
_UNSET = object()


# -- launching a torchrun agent process (the demo, tests, benchmarks) ----------------------
@dataclass
class LaunchSpec:
    """One torchrun invocation: workers per node, nodes, restarts and rendezvous."""

    nproc_per_node: int
    module: str | None = None
    script: str | None = None
    script_args: Sequence[str] = ()
    nnodes: str = "1"
    max_restarts: int = 3
    monitor_interval_s: float = 0.1
    rdzv_backend: str = "c10d"
    rdzv_endpoint: str = "127.0.0.1:0"
    rdzv_id: str = "elastictrain"
    rdzv_conf: str = DEFAULT_RDZV_CONF
    log_dir: str | None = None
    shutdown_timeout_s: int | None = None
    events_dir: str | None = None
    extra_torchrun_args: list[str] = field(default_factory=list)

    def argv(self) -> list[str]:
        """torchrun's command-line arguments for this spec."""
        args = [
            f"--nnodes={self.nnodes}",
            f"--nproc-per-node={self.nproc_per_node}",
            f"--max-restarts={self.max_restarts}",
            f"--monitor-interval={self.monitor_interval_s}",
            f"--rdzv-backend={self.rdzv_backend}",
            f"--rdzv-endpoint={self.rdzv_endpoint}",
            f"--rdzv-id={self.rdzv_id}",
            f"--rdzv-conf={self.rdzv_conf}",
        ]
        if self.log_dir:
            args.append(f"--log-dir={self.log_dir}")
        if self.shutdown_timeout_s is not None:
            args.append(f"--shutdown-timeout={self.shutdown_timeout_s}")
        args += self.extra_torchrun_args
        if self.module:
            args += ["-m", self.module]
        elif self.script:
            args.append(self.script)
        else:
            raise ValueError("LaunchSpec needs a module or a script")
        return args + list(self.script_args)


def start_torchrun(spec: LaunchSpec, stdout: IO[str] | int | None = None,
                   extra_env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Start an ``elastictrain run`` launcher process (in its own session, so it can be
    killed as a unit) and return it; the caller waits for it."""
    env = dict(extra_env or {})
    if spec.events_dir:
        env[EVENTS_DIR_VAR] = spec.events_dir
    return subprocess.Popen(
        [sys.executable, "-m", "elastictrain.launcher.launch", *spec.argv()],
        env=launcher_environ(env),
        stdout=stdout,
        stderr=subprocess.STDOUT if stdout is not None else None,
        start_new_session=True,
    )


# -- torchrun's command line with our defaults ----------------------------------------------
RUN_USAGE = ("elastictrain run [options] SCRIPT [ARGS ...]\n"
             "       elastictrain run [options] -m MODULE [ARGS ...]")

RUN_DESCRIPTION = """\
Start this node's workers of a training job under torchrun with elastictrain's
agent and defaults. A failed worker group is restarted (--max-restarts) and
resumes from the newest snapshot; SIGTERM, SIGUSR1 or Ctrl-C to the launcher
is passed to the workers as a preemption notice (a final snapshot, then exit
75); a worker that exits 78 ends the run at once, without restarts. On a
terminal a live view shows the run and the workers' output goes to files.

Every option below may also be set as PET_<OPTION> in the environment (e.g.
PET_NNODES=1:2), as with torchrun. Defaults marked "elastictrain" come from the
[launch] settings (ELASTICTRAIN_LAUNCH__* or the config file) and replace
torchrun's own."""

RUN_EXIT_CODES = """\
exit codes:
  0    finished
  1    failed: the restarts are used up; the workers' errors are in their output
  2    usage error: a bad option, a script that does not exist, several nodes
       without --rdzv-endpoint
  75   preempted, a final snapshot committed: the same command resumes from it
  76   preempted, the final snapshot did not commit: the same command resumes
       from the newest committed one
  78   fatal, do not retry: invalid settings, or a worker exited 78 (bad
       config, resume mismatch, access denied)
  128+N  the launcher was killed by signal N"""

# Our one-line summaries of torchrun's options (its own texts are in `torchrun --help`).
_TORCHRUN_SUMMARIES = {
    "nnodes": ("N|MIN:MAX", "nodes in the job: a number, or a range for an elastic job"),
    "nproc_per_node": ("N", "workers on this node: a number, or auto, cpu, gpu, xpu"),
    "standalone": (None, "a single-node job with a rendezvous of its own on a free port "
                   "(elastictrain's rendezvous defaults are then not added)"),
    "start_method": ("METHOD", "how worker processes are created: spawn, fork or "
                     "forkserver"),
    "event_log_handler": ("NAME", "where torchelastic's own events go (a registered "
                          "handler)"),
    "role": ("NAME", "the role name given to this node's workers"),
    "module": (None, "SCRIPT is a module name, run as with python -m"),
    "no_python": (None, "SCRIPT is a program to run, not a Python file"),
    "run_path": (None, "run SCRIPT (an absolute path) with runpy.run_path in the "
                 "worker's interpreter"),
    "log_dir": ("DIR", "where the workers' output files and torchelastic's logs go "
                "(with the live view: <events dir>/torchelastic; else a new temporary "
                "directory)"),
    "redirects": ("SPEC", "send the workers' output to files in the log dir: 0 none, 1 "
                  "stdout, 2 stderr, 3 both, or per local rank as 0:1,1:2 (with the live "
                  "view: 3)"),
    "tee": ("SPEC", "like --redirects, and keep the output on the terminal too (turns the "
            "live view off)"),
    "local_ranks_filter": ("RANKS", "show only these local ranks' output on the terminal, "
                           "e.g. 0,1 (the files keep every rank's)"),
    "duplicate_stdout_filters": ("WORDS", "copy the stdout lines that contain one of these "
                                 "comma-separated words to a file of their own"),
    "duplicate_stderr_filters": ("WORDS", "the same for stderr"),
    "node_rank": ("N", "this node's rank, for the static rendezvous only"),
    "master_addr": ("HOST", "node 0's address, for the static rendezvous only"),
    "master_port": ("PORT", "node 0's port, for the static rendezvous only"),
    "local_addr": ("HOST", "the address other nodes reach this node at (default: found "
                   "from the host name)"),
    "logs_specs": ("NAME", "a LogsSpecs entry point that decides where logs go"),
    "numa_binding": ("MODE", "bind each worker to the CPUs near its GPU: node, socket, "
                     "exclusive or core-complex"),
    "virtual_local_rank": (None, "every worker sees LOCAL_RANK=0 and only its own GPU, "
                           "as device 0"),
}


def _elastictrain_options(launch: LaunchDefaults, run_id: str | None
                          ) -> dict[str, tuple[str | None, str]]:
    """The torchrun options whose defaults elastictrain sets, with those defaults."""
    return {
        "max_restarts": ("N", f"restarts of the worker group before the run fails "
                         f"(default, elastictrain: {launch.max_restarts}; torchrun: 0)"),
        "monitor_interval": ("SECONDS", "how often the agent checks its workers (default, "
                             f"elastictrain: {launch.monitor_interval_s})"),
        "shutdown_timeout": ("SECONDS", "how long workers may take between SIGTERM and "
                             "SIGKILL when the launcher is stopped: their final snapshot "
                             "is written meanwhile (default, elastictrain: "
                             f"{launch.shutdown_timeout_s}; torchrun: 30, or "
                             "TORCH_ELASTIC_SHUTDOWN_TIMEOUT when set)"),
        "signals_to_handle": ("SIGNALS", "the signals the launcher passes on to the "
                              "workers as a notice (default, elastictrain: "
                              f"{launch.signals_to_handle})"),
        "rdzv_backend": ("NAME", "rendezvous backend: c10d, etcd, static... (default, "
                         f"elastictrain: {launch.rdzv_backend}; torchrun: static)"),
        "rdzv_endpoint": ("HOST:PORT", "where the rendezvous is hosted; several nodes need "
                          "it, the same on every node (default, elastictrain, one node: "
                          "127.0.0.1:0, a free port)"),
        "rdzv_conf": ("K=V,...", "rendezvous settings (default, elastictrain, c10d: "
                      f"{launch.rdzv_conf})"),
        "rdzv_id": ("ID", "the job's id, the same on every node, and the run id of its "
                    "events (default, elastictrain: "
                    + (f"the run_id setting, {run_id}" if run_id else
                       "a new et-DATE-TIME-XXXXXX on one node; torchrun's 'none' on several")
                    + ")"),
    }


def run_help() -> str:
    """``elastictrain run --help``: elastictrain's launcher, its defaults (the settings in
    effect, else the built-in ones) and exit codes, then torchrun's other options."""
    from torch.distributed.run import get_args_parser

    from elastictrain.core.config import load_settings
    from elastictrain.core.helpformat import HelpFormatter

    try:
        settings = load_settings()
        launch, run_id = settings.launch, settings.run_id
    except ElasticTrainError:  # --help still works with invalid settings
        launch, run_id = LaunchDefaults(), None
    ours = _elastictrain_options(launch, run_id)
    shown = argparse.ArgumentParser(prog="elastictrain run", usage=RUN_USAGE,
                                    description=RUN_DESCRIPTION, epilog=RUN_EXIT_CODES,
                                    formatter_class=HelpFormatter, add_help=False)
    own = shown.add_argument_group("elastictrain options")
    own.add_argument("-h", "--help", action="store_true", help="show this help and exit")
    own.add_argument(NO_VIEW, action="store_true", help=_NO_VIEW_HELP)
    defaults = shown.add_argument_group("torchrun options with elastictrain's defaults")
    others = shown.add_argument_group("torchrun's other options",
                                      "torchrun's defaults; their full texts: torchrun --help")
    for action in get_args_parser()._actions:
        if not action.option_strings or action.dest == "help":
            continue
        # torchrun's --snake_case spellings still parse; the help shows one spelling.
        names = [o for o in action.option_strings if "_" not in o] or action.option_strings
        if action.dest in ours:
            group, (metavar, text) = defaults, ours[action.dest]
        else:
            group = others
            metavar, text = _TORCHRUN_SUMMARIES.get(
                action.dest, ("VALUE", "see torchrun --help"))
            if action.default is not None and action.default is not False and (
                    action.default not in ("", [])):
                text += f" (default: {action.default})"
        if action.nargs == 0:
            group.add_argument(*names, action="store_true", help=text)
        else:
            group.add_argument(*names, metavar=metavar or "VALUE", help=text)
    return shown.format_help()


class _RunParser(argparse.ArgumentParser):
    """torchrun's parser under our name, with our help and a short usage line."""

    def format_help(self) -> str:
        return run_help()

    def format_usage(self) -> str:
        return f"usage: {RUN_USAGE}\n"


_NO_VIEW_HELP = ("no live view on a terminal: the workers' output and the launcher's log "
                 "stay on the terminal, as with torchrun (default: the view on a terminal, "
                 "none when the output is not one)")


def torchrun_parser() -> argparse.ArgumentParser:
    """torchrun's own argument parser (its options, ``PET_*`` variables included), named
    for our command, with our ``--no-view`` and our help text."""
    from torch.distributed.run import get_args_parser

    # parents= copies torchrun's actions, -h among them: its help action prints ours.
    parser = _RunParser(prog="elastictrain run", parents=[get_args_parser()],
                        add_help=False)
    # Ours, not torchrun's: main takes it out of the command line before torchrun parses it.
    parser.add_argument(NO_VIEW, action="store_true", help=_NO_VIEW_HELP)
    for action in parser._actions:  # name them in argparse's errors as the usage does
        if action.dest in ("training_script", "training_script_args"):
            action.metavar = "SCRIPT" if action.dest == "training_script" else "ARGS"
    return parser


def check_script(args: argparse.Namespace) -> None:
    """Refuse a script that is not there before any worker starts: torchrun would start
    every worker only for each to fail on it, and restart them.

    Raises:
        ConfigError: names the script and the fix.
    """
    if args.module:  # a module name: only the worker's interpreter can resolve it
        return
    script = str(args.training_script)
    if args.no_python and not args.run_path:
        if shutil.which(script) is None:
            raise ConfigError(f"program {script!r} not found (--no-python runs SCRIPT as a "
                              "program); fix: give its path or a name on PATH")
        return
    if not Path(script).is_file():
        where = "" if Path(script).is_absolute() else f" (relative to {os.getcwd()})"
        raise ConfigError(f"script {script!r} does not exist{where}; fix: check the path "
                          "of the training script")


def take_no_view(argv: Sequence[str]) -> tuple[bool, list[str]]:
    """Whether ``--no-view`` is among the launcher's options, and ``argv`` without it
    (the script's own arguments are left alone)."""
    args = torchrun_parser().parse_args(list(argv))
    n_options = len(argv) - len(args.training_script_args) - 1
    options = list(argv[:n_options])
    return NO_VIEW in options, [a for a in options if a != NO_VIEW] + list(argv[n_options:])


def _given(parser: argparse.ArgumentParser, argv: Sequence[str],
           environ: Mapping[str, str]) -> tuple[argparse.Namespace, set[str]]:
    """Parse ``argv`` and return it with the option names set on the command line or
    through torchrun's ``PET_<NAME>`` variables."""
    parsed_args = parser.parse_args(list(argv))
    dests = set(vars(parsed_args)) - {"training_script", "training_script_args"}
    probe = argparse.Namespace(**dict.fromkeys(dests, _UNSET))
    # argparse applies a default only where the namespace has no value yet, so
    # whatever is no longer _UNSET came from the command line.
    parsed = parser.parse_args(list(argv), namespace=probe)
    given = {d for d in dests if getattr(parsed, d) is not _UNSET}
    given |= {d for d in dests if f"PET_{d.upper()}" in environ}
    return parsed_args, given


def torchrun_argv(argv: Sequence[str], defaults: LaunchDefaults,
                  environ: Mapping[str, str] | None = None,
                  run_id: str | None = None) -> list[str]:
    """``argv`` with elastictrain's defaults added for the options the user left unset.

    Raises:
        ConfigError: a multi-node c10d rendezvous without an endpoint.
    """
    environ = os.environ if environ is None else environ
    args, given = _given(torchrun_parser(), argv, environ)
    added: list[str] = []

    def add(dest: str, option: str, value: object) -> None:
        if dest not in given:
            added.append(f"{option}={value}")

    add("max_restarts", "--max-restarts", defaults.max_restarts)
    add("monitor_interval", "--monitor-interval", defaults.monitor_interval_s)
    if "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" not in environ and torchrun_knows("--shutdown-timeout"):
        add("shutdown_timeout", "--shutdown-timeout", defaults.shutdown_timeout_s)
    add("signals_to_handle", "--signals-to-handle", defaults.signals_to_handle)
    if not args.standalone:  # --standalone picks its own c10d rendezvous
        backend = args.rdzv_backend if "rdzv_backend" in given else defaults.rdzv_backend
        add("rdzv_backend", "--rdzv-backend", backend)
        single_node = _max_nodes(args.nnodes) == 1
        if backend == "c10d":
            if "rdzv_endpoint" not in given and not single_node:
                raise ConfigError(
                    f"--nnodes={args.nnodes} needs --rdzv-endpoint (or PET_RDZV_ENDPOINT); "
                    "fix: pass HOST:PORT of the node that hosts the c10d store, the same on "
                    "every node")
            add("rdzv_endpoint", "--rdzv-endpoint", "127.0.0.1:0")
            add("rdzv_conf", "--rdzv-conf", defaults.rdzv_conf)
        if run_id or single_node:
            add("rdzv_id", "--rdzv-id", run_id or _generated_run_id())
    return added + list(argv)


def torchrun_knows(option: str) -> bool:
    """Whether this torch's torchrun has ``option`` (``--shutdown-timeout`` came after
    torch 2.11: without it the agent applies ``launch.shutdown_timeout_s`` itself)."""
    from torch.distributed.run import get_args_parser

    return any(option in action.option_strings for action in get_args_parser()._actions)


def shutdown_timeout_s(args: argparse.Namespace, launch: LaunchDefaults,
                       environ: Mapping[str, str]) -> float:
    """The workers' SIGTERM -> SIGKILL grace: torchrun's ``--shutdown-timeout`` where it
    has one, else ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` or ``launch.shutdown_timeout_s``."""
    given = getattr(args, "shutdown_timeout", None)
    if given is not None:
        return float(given)
    return float(environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", launch.shutdown_timeout_s))


def _max_nodes(nnodes: str) -> int:
    try:
        return int(str(nnodes).split(":")[-1])
    except ValueError as exc:
        raise ConfigError(f"--nnodes={nnodes!r} is not N or MIN:MAX; fix: e.g. --nnodes=1:2"
                          ) from exc


def _generated_run_id() -> str:
    return f"et-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"


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
    from elastictrain.launcher.agent import AgentSettings, WorkersFatal, installed, on_grace_expired
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
    et_log.configure(settings.log.level, settings.log.json_output, sink.path, upload=sink.upload)
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
    from elastictrain.runlog.events import LAUNCH_ID_VAR, new_launch_id, run_events_dir
    from elastictrain.view.live import view_wanted

    argv = list(sys.argv[1:] if argv is None else argv)
    no_view, argv = take_no_view(argv)
    try:  # the command line first: its errors are usage errors (2)
        check_script(torchrun_parser().parse_args(argv))
    except ConfigError as exc:
        return _usage_error(exc)
    settings = load_settings()  # validated before any worker starts (ConfigError: 78)
    try:
        full = torchrun_argv(argv, settings.launch, os.environ, settings.run_id)
    except ConfigError as exc:  # a command-line problem, not a config file one
        return _usage_error(exc)
    args, given = _given(torchrun_parser(), full, os.environ)
    settings.launch.standby_preload = standby_modules(settings.launch.standby_preload,
                                                      args.training_script_args)
    # One launch id for this launcher and its workers: a requeue or relaunch of the
    # same run is a new launch in the event log (elastictrain.runlog.events).
    launch = new_launch_id()
    environ = launcher_environ({LAUNCH_ID_VAR: launch})
    if settings.launch.standby:  # before this process changes its environment
        _fork_standby(args, settings.launch, environ)
    os.environ.update(environ)
    run_id = str(args.rdzv_id)
    # --tee asks for the workers' output on the terminal, where it would tear the view.
    if not view_wanted(quiet=no_view) or "tee" in given:
        code, agent = _run(full, args, settings, run_id)
        why = failure_summary(agent)
        if code != EXIT_OK and why:
            print(f"elastictrain run: exit {code}: {_launch_meaning(code, agent)}\n"
                  + "\n".join(why),
                  file=sys.stderr, flush=True)
        return code
    from elastictrain.view.run import RunOutput, run_view, summary, worker_log_args

    events_dir = run_events_dir(settings, run_id)
    added, log_dir = worker_log_args(given, args.log_dir, events_dir)
    output = RunOutput(events_dir, log_dir, events_dir / f"launcher-{launch}.log")
    with run_view(output, run_id, launch) as view:
        code, agent = _run(added + full, args, settings, run_id)
    why = failure_summary(agent) if code != EXIT_OK else []
    print("\n".join([summary(view.state, code, _launch_meaning(code, agent), output), *why]),
          flush=True)
    return code


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


def _launch_meaning(code: int, agent: ElasticTrainAgent | None) -> str:
    """What this launch's exit code means: ``exit_meaning``, unless the rendezvous ended
    it before its workers ever ran (then no restart was used up)."""
    if code != EXIT_OK and agent is not None and agent.rendezvous_error is not None:
        return "failed in the rendezvous, not in the workers"
    return exit_meaning(code)


def _usage_error(exc: ConfigError) -> int:
    print(f"elastictrain run: error: {exc}", file=sys.stderr)
    return EXIT_USAGE


def failure_summary(agent: ElasticTrainAgent | None) -> list[str]:
    """Lines naming the first failing worker's error of the last failed attempt, its
    log and a fix, and the crash loop if that stopped the run (``elastictrain.runlog.failure``);
    none when no worker reported an error (killed by a signal, preempted)."""
    from elastictrain.runlog.failure import failure_lines

    if agent is None:
        return []
    if agent.rendezvous_error is not None:
        return [agent.rendezvous_error]
    loop = agent.settings.crash_loop_failures if agent.outcome == "crash_loop" else None
    return failure_lines(agent.failure, loop)


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
             outcome="crash_loop" if crash_loop else _outcome(code),
             wall_s=round(time.monotonic() - started, 3))
    return code, agent


def _outcome(code: int) -> str:
    return {EXIT_OK: "finished", EXIT_PREEMPTED: "preempted",
            EXIT_PREEMPTED_UNSAVED: "preempted_unsaved", EXIT_FATAL: "fatal",
            1: "failed"}.get(code, "signalled")


def exit_meaning(code: int) -> str:
    """What the launcher's exit code tells the user (docs/exit-codes.md)."""
    meanings = {
        EXIT_OK: "finished",
        1: "failed: torchrun's restarts are used up; the workers' errors are in their output",
        EXIT_USAGE: "usage error",
        EXIT_PREEMPTED: "stopped after a final snapshot; the same command resumes from it",
        EXIT_PREEMPTED_UNSAVED: "stopped, the final snapshot did not commit; the same "
                                "command resumes from the newest committed one",
        EXIT_FATAL: "fatal, a restart cannot fix it (bad config, resume mismatch, access "
                    "denied, or the same error again and again: a crash loop): see the "
                    "workers' output; do not retry",
    }
    if code in meanings:
        return meanings[code]
    if code - 128 in signal.valid_signals():
        # Not "no final snapshot": a second Ctrl-C during the save ends the launcher
        # with 130 although the workers' snapshot committed (the view shows which).
        return (f"the launcher was stopped by {signal.Signals(code - 128).name}; the same "
                "command resumes from the newest committed snapshot")
    return "failed"


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
