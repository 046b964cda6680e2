"""The command line of ``elastictrain run``: torchrun's own parser with elastictrain's options,
its help text (usage, description, exit codes, torchrun's options summarised)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from elastictrain.core.config import LaunchDefaults
from elastictrain.core.errors import (
    ElasticTrainError,
)

if TYPE_CHECKING:  # the agent imports torch's launcher: only when a run starts
    pass

# Kept importable for callers of the walking skeleton; the value lives in config.

NO_VIEW = "--no-view"
VIEW_RANKS = "--view-ranks"


# -- torchrun's command line with our defaults ----------------------------------------------
RUN_USAGE = ("elastictrain run [options] SCRIPT [ARGS ...]\n"
             "       elastictrain run [options] -m MODULE [ARGS ...]")

RUN_DESCRIPTION = """\
Start this node's workers of a training job under torchrun with elastictrain's
agent and defaults. A failed worker group is restarted (--max-restarts) and
resumes from the newest snapshot; SIGTERM, SIGUSR1 or Ctrl-C to the launcher
is passed to the workers as a preemption notice (a final snapshot, then exit
75); a worker that exits 78, or the same error at the same place attempt
after attempt (a crash loop), ends the run without more restarts. On a
terminal a live view shows the run and rank 0's output (--view-ranks), and
the workers' output goes to files. A failed run ends with a summary naming
the first failing worker's error, its traceback's end and its log.

Every option below may also be set as PET_<OPTION> in the environment (e.g.
PET_NNODES=1:2), as with torchrun. Defaults marked "elastictrain" come from the
[launch] settings (ELASTICTRAIN_LAUNCH__* or the config file) and replace
torchrun's own."""

RUN_EXIT_CODES = """\
exit codes:
  0    finished
  1    failed: the restarts are used up; the summary shows the first failing
       worker's error and its log
  2    usage error: a bad option, a script that does not exist, several nodes
       without --rdzv-endpoint
  75   preempted, a final snapshot committed: the same command resumes from it
  76   preempted, the final snapshot did not commit: the same command resumes
       from the newest committed one
  78   fatal, do not retry: invalid settings, a worker exited 78 (bad
       config, resume mismatch, access denied), or a crash loop (the same error
       at the same place in launch.crash_loop_failures attempts in a row)
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
    own.add_argument(VIEW_RANKS, metavar="RANKS", help=_VIEW_RANKS_HELP)
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


_VIEW_RANKS_HELP = ("the local ranks whose output (stdout and stderr: your print()s) the "
                    "live view shows, each line prefixed by its rank: 0,1, all or none "
                    "(default: 0); every rank's output is in its files either way, and "
                    "without the view it goes to the terminal as with torchrun")


def torchrun_parser() -> argparse.ArgumentParser:
    """torchrun's own argument parser (its options, ``PET_*`` variables included), named
    for our command, with our ``--no-view`` and our help text."""
    from torch.distributed.run import get_args_parser

    # parents= copies torchrun's actions, -h among them: its help action prints ours.
    parser = _RunParser(prog="elastictrain run", parents=[get_args_parser()],
                        add_help=False)
    # Ours, not torchrun's: main takes it out of the command line before torchrun parses it.
    parser.add_argument(NO_VIEW, action="store_true", help=_NO_VIEW_HELP)
    parser.add_argument(VIEW_RANKS, metavar="RANKS", default="0", help=_VIEW_RANKS_HELP)
    for action in parser._actions:  # name them in argparse's errors as the usage does
        if action.dest in ("training_script", "training_script_args"):
            action.metavar = "SCRIPT" if action.dest == "training_script" else "ARGS"
    return parser
