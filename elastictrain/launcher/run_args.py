"""torchrun's command line with elastictrain's defaults: the options a user did not set
filled in from ``[launch]``, the script checked, the run id and the workers' grace."""

from __future__ import annotations

import argparse
import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from elastictrain.core.config import LaunchDefaults
from elastictrain.core.errors import (
    ConfigError,
)

if TYPE_CHECKING:  # the agent imports torch's launcher: only when a run starts
    pass

# Kept importable for callers of the walking skeleton; the value lives in config.

from elastictrain.launcher.run_help import NO_VIEW, VIEW_RANKS, torchrun_parser
from elastictrain.runlog.run_marker import generated_run_id

_UNSET = object()

# The options that shape the job: given after the script they reach the script, and
# the job would silently run with one worker, no restarts or another rendezvous.
SHAPING_OPTIONS = ("--nproc-per-node", "--nproc_per_node", "--nnodes", "--max-restarts",
                   "--max_restarts", "--standalone", "--rdzv-backend", "--rdzv_backend",
                   "--rdzv-endpoint", "--rdzv_endpoint", "--rdzv-id", "--rdzv_id",
                   "--node-rank", "--node_rank", "--master-addr", "--master_addr",
                   "--master-port", "--master_port", NO_VIEW,
                   VIEW_RANKS)


def check_script(args: argparse.Namespace) -> None:
    """Refuse a script that is not there, or a job-shaping option placed after it,
    before any worker starts: torchrun would start every worker only for each to fail
    on it, and restart them (or run a job of another shape).

    Raises:
        ConfigError: names the script or the option, and the fix.
    """
    for arg in args.training_script_args:
        option = str(arg).split("=", 1)[0]
        if option in SHAPING_OPTIONS:
            raise ConfigError(
                f"{option} comes after the script {args.training_script}, so it would go "
                f"to the script, not to the launcher; fix: put it before the script "
                f"(elastictrain run {option} ... {args.training_script} ARGS)")
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


def take_view_ranks(argv: Sequence[str]) -> tuple[str, list[str]]:
    """``--view-ranks`` among the launcher's options (default ``0``), and ``argv``
    without it (the script's own arguments are left alone)."""
    args = torchrun_parser().parse_args(list(argv))
    n_options = len(argv) - len(args.training_script_args) - 1
    options, kept, value = list(argv[:n_options]), [], "0"
    while options:
        option = options.pop(0)
        if option == VIEW_RANKS and options:
            value = options.pop(0)
        elif option.startswith(f"{VIEW_RANKS}="):
            value = option.split("=", 1)[1]
        else:
            kept.append(option)
    return value, kept + list(argv[n_options:])


def given_options(parser: argparse.ArgumentParser, argv: Sequence[str],
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
    args, given = given_options(torchrun_parser(), argv, environ)
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
            add("rdzv_id", "--rdzv-id", run_id or generated_run_id())
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
