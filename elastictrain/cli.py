"""The ``elastictrain`` command: parse → build a config → call the library.

Exit codes, one rule for every command: 0 done; 1 failed (``verify``: a corrupt
snapshot or none verifies; ``chaos``: a trial failed; ``run``: restarts used up; a
storage error); 2 bad input (the command line, a storage location that is malformed,
missing or not a directory, a step that is not there); 75/76 preempted, resume me; 78
only for a fatal run (``run``, ``demo``): do not retry.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from elastictrain.core import log as et_log
from elastictrain.core.errors import (
    EXIT_FATAL,
    EXIT_READER_GONE,
    EXIT_USAGE,
    ConfigError,
    ElasticTrainError,
    StorageNotFoundError,
)
from elastictrain.core.helpformat import HelpFormatter, SuggestingParser

if TYPE_CHECKING:
    from elastictrain.runlog.accounting.split import Split
    from elastictrain.storage.api import Store

# Commands that start a run: only they may end with 78 (a fatal run, do not retry).
_RUNS = ("demo", "chaos")

EXIT_CODES = """\
exit codes:
  0    done
  1    failed: a corrupt snapshot (snapshots verify), a failed trial (chaos),
       restarts used up (run), a storage error
  2    bad input: the command line, a storage location that is malformed, missing
       or not a directory, a step that does not exist
  75   preempted, a final snapshot committed: the same command resumes (run, demo)
  76   preempted, the final snapshot did not commit: the same command resumes from
       the newest committed one (run)
  78   fatal run, do not retry: a worker exited 78 (bad config, resume mismatch,
       access denied), or run's own settings are invalid (run, demo)
  128+N  stopped by signal N (run, demo)
"""


def _version() -> str:
    try:
        return metadata.version("elastictrain")
    except metadata.PackageNotFoundError:  # run from a source tree that is not installed
        return "unknown (not installed)"


def _demo(args: argparse.Namespace) -> int:
    from elastictrain.demo.runner import DemoOptions, print_result, run_demo
    from elastictrain.storage.locations import parse_storage_options
    from elastictrain.view.live import view_wanted

    opts = DemoOptions(storage=args.storage, nproc=args.nproc, steps=args.steps,
                       snapshot_every=args.snapshot_every, keep=args.keep,
                       kill_at=args.kill_at, seed=args.seed, events_dir=args.events_dir,
                       nnodes=args.nnodes, kill_node_at=args.kill_node_at,
                       add_node_at=args.add_node_at, batch_size=args.batch_size,
                       global_batch_size=args.global_batch_size, samples=args.samples,
                       record_samples=args.record_samples,
                       live=view_wanted(json_output=args.json, quiet=args.quiet),
                       storage_options=parse_storage_options(args.storage_options))
    result = run_demo(opts)
    print_result(result, as_json=args.json)
    return result.exit_code


def _snapshots(args: argparse.Namespace) -> int:
    from elastictrain.storage.locations import open_from_cli
    from elastictrain.view import ops

    if getattr(args, "memory", False):  # node memory, not a storage
        return ops.list_memory(as_json=args.json)
    if args.storage is None:
        print("elastictrain snapshots list: give a storage, or --memory", file=sys.stderr)
        return 2
    store = open_from_cli(args.storage, args.storage_options)
    if args.snap_cmd == "list":
        rows = ops.list_snapshots(store)
    elif args.snap_cmd == "verify":
        rows = ops.verify_snapshots(store, args.step)
    elif args.snap_cmd == "inspect":
        row = ops.inspect_snapshot(store, args.step)
        print(json.dumps(row) if args.json else ops.format_inspect(row))
        return 0
    elif args.snap_cmd == "export":
        row = ops.export_snapshot(store, args.out, step=args.step, fmt=args.format,
                                  with_optimizer=args.with_optimizer, force=args.force)
        print(json.dumps(row) if args.json else ops.format_row(row))
        return 0
    else:
        rows = ops.prune_snapshots(store, args.keep, dry_run=args.dry_run)
    if not rows and args.snap_cmd in ("list", "verify"):
        print(ops.nothing_found(store), file=sys.stderr)
        if args.json:
            ops.print_rows(rows, as_json=True)  # still one JSON document on stdout: []
        return 1 if args.snap_cmd == "verify" else 0
    ops.print_rows(rows, as_json=args.json)
    return 1 if args.snap_cmd == "verify" and ops.verify_failed(rows) else 0


def _copy_events(store: Store, into: Path) -> Path:
    """The event files at ``store``'s root, copied into ``into``."""
    for name in store.list_dir(""):
        if name.endswith(".jsonl"):
            (into / name).write_bytes(store.read_bytes(name))
    return into


def _write_plot(split: Split, target: str, storage_options: str | None) -> None:
    """The plot to a local file, or to an object (``--plot s3://bucket/run/plot.png``)."""
    from elastictrain.runlog.accounting.plot import plot_split
    from elastictrain.runlog.events import is_remote
    from elastictrain.storage.locations import open_from_cli

    if not is_remote(target):
        plot_split(split, target)
        return
    parent, _, name = target.rstrip("/").rpartition("/")
    store = open_from_cli(parent, storage_options)
    with tempfile.TemporaryDirectory(prefix="elastictrain-plot-") as tmp:
        store.write_bytes(name, plot_split(split, Path(tmp) / name).read_bytes())


def _goodput(args: argparse.Namespace) -> int:
    from elastictrain.runlog.accounting.split import format_split, split_run
    from elastictrain.runlog.events import is_remote
    from elastictrain.runlog.goodput import (
        compute_goodput,
        one_figure,
        run_events_location,
    )
    from elastictrain.storage.locations import check_location, open_from_cli

    remote = is_remote(args.events_dir)
    if remote:
        store = open_from_cli(args.events_dir, args.storage_options)
    else:
        store = None
        check_location(args.events_dir, "storage or events directory",
                           "a run's storage root, or its events directory "
                           "<storage>/events/<run id>")
    # A storage root (what the script gave SnapshotManager) stands for its newest run.
    events_dir = run_events_location(args.events_dir, store)
    if remote and events_dir != args.events_dir:
        store = open_from_cli(events_dir, args.storage_options)
    with tempfile.TemporaryDirectory(prefix="elastictrain-goodput-") as copy:
        # On object storage the run's event files are read once into a local copy:
        # the same files, so the same figures and split as the run's local events.
        local = events_dir if store is None else _copy_events(store, Path(copy))
        try:
            report = compute_goodput(local)
            split = split_run(local)
        except FileNotFoundError as exc:
            raise ConfigError(str(exc).replace(str(local), events_dir)) from None
    if args.plot:
        _write_plot(split, args.plot, args.storage_options)
    if args.json:
        print(json.dumps({**one_figure(report, split), "events_dir": events_dir,
                          "split": split.to_dict()}))
    else:
        print(format_split(split))
        print("".join(f"  note: {note}\n" for note in report.notes), end="")
    return 0


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def _chaos(args: argparse.Namespace) -> int:
    import signal

    from elastictrain.chaos.noderun import run_node_chaos
    from elastictrain.chaos.report import format_json, format_table
    from elastictrain.chaos.runner import ChaosOptions, run_chaos
    from elastictrain.chaos.schedule import parse_kinds

    command = args.command_line[1:] if args.command_line[:1] == ["--"] else args.command_line
    opts = ChaosOptions(trials=args.trials, seed=args.seed, first=args.first,
                        faults=parse_kinds(args.faults), nproc=args.nproc, workdir=args.storage,
                        script=command[0] if command else None, script_args=command[1:],
                        steps=args.steps, snapshot_every=args.snapshot_every,
                        nodes=args.nodes, replace=args.replace,
                        memory_every=args.memory_every, samples=args.samples,
                        peer={"auto": None, "yes": True, "no": False}[args.peer_memory])
    # A SIGTERM (a scheduler's, a `timeout`'s) unwinds like Ctrl-C: the harness's own
    # cleanup then stops every process it started (agents, workers, rendezvous store).
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    report = run_node_chaos(opts) if "node" in opts.faults else run_chaos(opts)
    print(format_json(report) if args.json else format_table(report))
    return 0 if report.passed else 1


def _status(args: argparse.Namespace) -> int:
    from elastictrain.view.status import follow, open_status, show

    status = open_status(args.storage, args.storage_options, args.run_id)
    if not args.follow:
        show(status, json_output=args.json)
        return 0
    return 0 if follow(status, json_output=args.json, timeout_s=args.timeout) else 1


def _port(text: str) -> int:
    """A TCP port number (a usage error otherwise)."""
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port (1 to 65535)")
    return int(text)


def _rendezvous_store(args: argparse.Namespace) -> int:
    from elastictrain.launcher.rdzv_store import serve

    try:
        return serve(args.host, args.port)
    except RuntimeError as error:  # torch's DistNetworkError: the port is taken
        print(f"elastictrain: error: cannot serve {args.host}:{args.port}: "
              f"{str(error).splitlines()[0]}", file=sys.stderr)
        return 1


def _command(sub: Any, name: str, summary: str, description: str,
             epilog: str | None = None) -> argparse.ArgumentParser:
    """A subcommand: ``summary`` in the top-level list, ``description`` in its --help."""
    parser: argparse.ArgumentParser = sub.add_parser(
        name, help=summary, description=description, epilog=epilog,
        formatter_class=HelpFormatter)
    return parser


def _storage_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--storage-options", default=None, metavar="JSON",
                        help="JSON object passed to fsspec, e.g. "
                        '\'{"client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"}}\'; '
                        "keep credentials in the environment (AWS_*, a profile, a role) "
                        "(default: none, the ELASTICTRAIN_STORAGE__* settings apply)")


def _export_options(cmd: argparse.ArgumentParser) -> None:
    cmd.description = (
        "Write the model (with --with-optimizer also the optimizer) of a verified snapshot "
        "to one file, from a replicated (DDP) or sharded (FSDP2) snapshot taken at any "
        "world size, its tensors named as the unwrapped model's state_dict() names them. "
        "The snapshot is read a tensor at a time; the file appears only once complete "
        "and the snapshot verified. Nothing in the storage is written. Docs: "
        "docs/export.md")
    cmd.epilog = ("exit codes: 0 written; 1 the snapshot does not verify (partial, "
                  "missing or damaged) or storage failed; 2 bad input (the storage, a step "
                  "that is not there, --out exists or its directory does not, safetensors "
                  "not installed).")
    cmd.add_argument("--step", type=int, default=None,
                     help="the snapshot's step (default: the newest that verifies)")
    cmd.add_argument("--format", choices=("safetensors", "torch"), required=True,
                     help="safetensors (needs elastictrain[safetensors]) or torch (a "
                     "torch.load(weights_only=True) file of model, optimizer, elastictrain)")
    cmd.add_argument("--out", required=True, metavar="PATH", help="the file to write")
    cmd.add_argument("--with-optimizer", action="store_true",
                     help="also the optimizer's state")
    cmd.add_argument("--force", action="store_true",
                     help="replace --out if it exists (default: refuse)")


def build_parser() -> argparse.ArgumentParser:
    parser = SuggestingParser(
        prog="elastictrain", formatter_class=HelpFormatter,
        description="Fault-tolerant, elastic PyTorch training: run jobs under torchrun, "
        "watch them, and manage their snapshots.",
        epilog=EXIT_CODES + "\nEvery command has --help. Docs: docs/cli.md")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}",
                        help="print the installed version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    # `run` hands its whole command line to its own parser (see main); listed for --help.
    sub.add_parser("run", add_help=False, help="run SCRIPT on this node under torchrun with "
                   "elastictrain's agent and defaults (see: elastictrain run --help)")

    demo = _command(
        sub, "demo", "train a small GPT under torchrun, kill it, resume it",
        "Train a small GPT on CPU (gloo) under elastictrain run, kill workers at the steps "
        "given, and show that it resumes from its snapshots. A second run with the same "
        "--storage resumes from the newest snapshot. On a terminal a live view shows the "
        "run; --json or --quiet turn it off.",
        epilog="exit codes: the launcher's (0 finished, 75 stopped by Ctrl-C or SIGTERM after "
        "a final snapshot, 78 fatal, 130/143 a second Ctrl-C/SIGTERM); 2 for any bad input.")
    demo.add_argument("--storage", default="./elastictrain-demo",
                      help="where snapshots and events go: a directory or a URL such as "
                      "s3://bucket/run")
    demo.add_argument("--nproc", type=int, default=2, help="workers (CPU, gloo)")
    demo.add_argument("--steps", type=int, default=300, help="train this many steps")
    demo.add_argument("--snapshot-every", type=int, default=25, metavar="N",
                      help="take a snapshot every N steps")
    demo.add_argument("--keep", type=int, default=3, help="snapshots to keep")
    demo.add_argument("--kill-at", type=int, action="append", default=[], metavar="STEP",
                      help="kill a worker with SIGKILL at STEP; repeat it to kill again "
                      "after each restart (default: no kill)")
    demo.add_argument("--seed", type=int, default=0, help="random seed")
    demo.add_argument("--events-dir", default=None, help="where the event logs go (default: "
                      "STORAGE/events for local storage)")
    _storage_options(demo)
    demo.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    demo.add_argument("--quiet", action="store_true",
                      help="no live view on a terminal, only the summary at the end")
    elastic = demo.add_argument_group("elastic", "world-size changes and batch policy")
    elastic.add_argument("--nnodes", default="1", metavar="N|MIN:MAX",
                         help="agents (nodes) on this machine, e.g. 1:2")
    elastic.add_argument("--kill-node-at", type=int, default=None, metavar="STEP",
                         help="SIGKILL the last node (agent and workers) after STEP "
                         "(default: never)")
    elastic.add_argument("--add-node-at", type=int, default=None, metavar="STEP",
                         help="start a replacement node after STEP at the smaller size "
                         "(default: never)")
    elastic.add_argument("--batch-size", type=int, default=16, help="per-rank (micro-)batch")
    elastic.add_argument("--global-batch-size", type=int, default=None, metavar="G",
                         help="keep G samples per step at any world size by gradient "
                         "accumulation (default: batch size x world size, which changes "
                         "with the world size)")
    elastic.add_argument("--samples", type=int, default=None, metavar="N",
                         help="train on the first N windows of the corpus, for short epochs "
                         "(default: the whole corpus)")
    elastic.add_argument("--record-samples", default=None, metavar="DIR",
                         help="write each rank's sample indices per step to DIR "
                         "(default: not written)")
    demo.set_defaults(func=_demo)

    store = _command(
        sub, "rendezvous-store", "serve the c10d rendezvous store in a process of its own",
        "Serve the c10d rendezvous store that the nodes of a job meet in, so that no "
        "training node holds it and any of them can be lost. Run it on a host that is not "
        "reclaimed; start every node with --rdzv-backend c10d --rdzv-endpoint HOST:PORT "
        "naming it. It runs until SIGTERM or Ctrl-C. Docs: "
        "docs/guide.md#a-rendezvous-no-node-holds",
        epilog="exit codes: 0 stopped by SIGTERM or Ctrl-C; 1 the port could not be served "
        "(in use); 2 bad input.")
    store.add_argument("--host", default="0.0.0.0",
                       help="the address to listen on, every interface by default "
                       "(default: 0.0.0.0)")
    store.add_argument("--port", type=_port, default=29400,
                       help="the port the nodes' --rdzv-endpoint names (default: 29400)")
    store.set_defaults(func=_rendezvous_store)

    snaps = _command(sub, "snapshots", "list, verify, inspect, prune or export a run's "
                     "snapshots",
                     "Read and tidy the snapshots under a run's storage root (the --storage "
                     "of demo or run, which holds snapshots/). A snapshot is committed "
                     "(its manifest is there), partial (no manifest: never committed, "
                     "restore skips it) or corrupt.",
                     epilog="exit codes: 0 done; 1 verify or export found a corrupt "
                     "snapshot or none that verifies, or storage failed; 2 bad input (a "
                     "storage location that is malformed, missing or not a directory, a "
                     "step that is not there).")
    snap_sub = snaps.add_subparsers(dest="snap_cmd", required=True, metavar="ACTION")
    for name, summary in [
            ("list", "every snapshot, newest first: unverified (committed; verify reads "
             "its payload), partial, corrupt or suspect (set aside after a restore that "
             "made no sense)"),
            ("verify", "check every payload against its manifest; exit 1 if any is "
             "corrupt or none verifies"),
            ("inspect", "one snapshot's manifest: versions, world size, payload objects"),
            ("prune", "delete all but the newest --keep verified snapshots"),
            ("export", "write a verified snapshot's model (and optimizer) to one "
             "safetensors or torch file")]:
        cmd = _command(snap_sub, name, summary, summary[0].upper() + summary[1:] + ".")
        cmd.add_argument("storage", nargs="?" if name == "list" else None,
                         help="run root: a directory or a URL (s3://bucket/run)")
        if name == "list":
            cmd.add_argument("--memory", action="store_true",
                             help="what this user holds in this node's memory, by run "
                             "(instead of a storage)")
        _storage_options(cmd)
        cmd.add_argument("--json", action="store_true", help="print JSON on stdout")
        if name == "verify":
            cmd.add_argument("--step", type=int, default=None,
                             help="verify only this step (default: every snapshot)")
        if name == "inspect":
            cmd.add_argument("--step", type=int, required=True,
                             help="the snapshot's step (list shows them)")
        if name == "prune":
            cmd.add_argument("--keep", type=int, required=True,
                             help="verified snapshots to keep, at least 1; partial ones "
                             "newer than the newest verified are kept too")
            cmd.add_argument("--dry-run", action="store_true",
                             help="list what would be deleted and kept; delete nothing")
        if name == "export":
            _export_options(cmd)
    snaps.set_defaults(func=_snapshots)

    chaos = _command(
        sub, "chaos", "run a script cleanly, then under random faults, and check "
        "nothing was lost",
        "Run a training job once without faults, then --trials times under seeded faults "
        "(worker kills, relaunches, preemption notices, stopped workers, storage faults), "
        "and check that every trial ends with the clean run's parameters, verifying "
        "snapshots, no lost steps beyond the snapshot interval and no process left.\n\n"
        "Without a command it runs the built-in demo. With one (after --), every run gets "
        "its own storage directory: write {storage} where the script takes its storage "
        "path, and the harness puts each run's directory there, e.g.\n"
        "  elastictrain chaos --trials 3 -- examples/ddp_resumable.py {storage}\n"
        "A command line without {storage} is refused: the checks read the snapshots in "
        "the run's own directory, which the script would never write.\n\n"
        "--faults node runs the job on --nodes agents and loses one node per trial, on the "
        "demo or on a script, e.g.\n"
        "  elastictrain chaos --faults node --nodes 2 --trials 2 -- examples/ddp_resumable.py "
        "{storage}\n"
        "--faults node,join also brings a lost node that was not replaced back later, "
        "so the job grows back while it trains (with --no-replace: every trial); "
        "--faults node,stale keeps the lost node's memory on half the trials, and the node "
        "comes back on it (snapshots of an attempt the job went on without); "
        "--faults node,degraded starts one node on half the trials with a shared-memory "
        "root its launcher refuses (it runs without rescue marks); --faults node,second "
        "loses a node again once the lost one is back.\n"
        "A script's steps are read from its train.progress events (logged every step "
        "for the trial): every resume is checked (the newest complete copy, the steps "
        "lost), and the digest at full size, but not exactly-once data, which needs the "
        "demo's sample records. Docs: docs/chaos.md",
        epilog="exit codes: 0 every trial passed; 1 a trial failed or the clean run failed; "
        "2 bad input (an option, a script that does not exist, no {storage}); 130/143 "
        "Ctrl-C/SIGTERM, after stopping every process it started.")
    chaos.add_argument("--trials", type=int, default=5,
                       help="trials after the clean run (0: the clean run only)")
    chaos.add_argument("--seed", type=int, default=0, help="trial seeds derive from it")
    chaos.add_argument("--first", type=int, default=0, metavar="K",
                       help="index of the first trial (replay trial K: --first K --trials 1)")
    chaos.add_argument("--faults", default="kill,relaunch,notice,stop,storage",
                       help="fault kinds to draw from, comma-separated")
    chaos.add_argument("--nproc", type=int, default=2, help="workers per run")
    chaos.add_argument("--storage", default=None, metavar="DIR",
                       help="work directory: one storage and event log per run "
                       "(default: a new temporary directory)")
    chaos.add_argument("--steps", type=int, default=60, help="steps of the built-in demo")
    chaos.add_argument("--snapshot-every", type=int, default=10, metavar="N",
                       help="the built-in demo's snapshot interval")
    chaos.add_argument("--nodes", type=int, default=2, choices=(2, 3),
                       help="with --faults node: agents (nodes) of the job, --nproc workers "
                       "each")
    chaos.add_argument("--replace", action=argparse.BooleanOptionalAction, default=None,
                       help="with --faults node: always (--replace) or never (--no-replace) "
                       "start a new node in place of the lost one (default: drawn per trial)")
    chaos.add_argument("--memory-every", type=int, default=3, metavar="N",
                       help="with --faults node: the memory snapshot interval (the demo's "
                       "option; a script gets it as ELASTICTRAIN_SNAPSHOT__MEMORY_EVERY)")
    chaos.add_argument("--samples", type=int, default=600,
                       help="with --faults node: the demo's dataset size (several epochs; "
                       "a script keeps its own)")
    chaos.add_argument("--peer-memory", choices=("auto", "yes", "no"), default="auto",
                       help="with --faults node: whether a node restores from its peers' "
                       "memory and the rescue crosses nodes, which tightens the checks "
                       "(auto: when snapshot.memory_replicas exists and is above 0)")
    chaos.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    chaos.add_argument("command_line", nargs=argparse.REMAINDER, metavar="-- SCRIPT ARGS",
                       help="the training script and its arguments, {storage} among them "
                       "(default: the built-in demo)")
    chaos.set_defaults(func=_chaos)

    goodput = _command(
        sub, "goodput", "how much of a run's wall time was training",
        "Read a run's event logs and split its wall time into training and each cause of "
        "loss (startup, restore, snapshots, recomputed steps, restarts).",
        epilog="exit codes: 0 done; 2 bad input (an events directory that is missing or "
        "not a directory, or holds no event files).")
    goodput.add_argument("events_dir", help="a run's events directory or URL "
                         "(<storage>/events/<run id>, e.g. s3://bucket/run/events/<run id>)")
    _storage_options(goodput)
    goodput.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    goodput.add_argument("--plot", metavar="FILE.png", help="draw the timeline and the split "
                         "to FILE.png (needs elastictrain[plot]; default: no plot)")
    goodput.set_defaults(func=_goodput)

    status = _command(
        sub, "status", "attempt, steps, last snapshot and recent failures of a run",
        "Show a run's state, read from its storage root (events/ and snapshots/): the "
        "attempt, the step, the newest snapshot and recent failures. It works while the "
        "run goes on and after it ended, from any machine that can read the storage.",
        epilog="exit codes: 0 shown (--follow: the run ended); 1 --follow timed out; 2 bad "
        "input (a location that is malformed, missing, not a directory, or holds no run).")
    status.add_argument("storage", help="the run's storage root: a directory or URL "
                        "(s3://bucket/run), as given to demo or run")
    _storage_options(status)
    status.add_argument("--run-id", default=None,
                        help="which run, when several wrote events there (default: newest)")
    status.add_argument("--json", action="store_true", help="print the state as JSON")
    status.add_argument("--follow", action="store_true",
                        help="keep showing the run until it ends (exit 0) or --timeout "
                        "passes (exit 1)")
    status.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                        help="with --follow: give up after this long (default: never)")
    status.set_defaults(func=_status)
    return parser


def exit_code_for(command: str, exc: ElasticTrainError) -> int:
    """The exit code of a command that raised ``exc``: bad input is 2 everywhere, and 78
    (a fatal run) is only for commands that start a run."""
    if isinstance(exc, ConfigError):
        return EXIT_USAGE
    if isinstance(exc, StorageNotFoundError) and command not in _RUNS:
        return EXIT_USAGE  # the location given on the command line (a missing bucket)
    if exc.exit_code == EXIT_FATAL and command not in _RUNS:
        return 1
    return exc.exit_code


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run"]:
        from elastictrain.launcher.launch import cli_main, exit_launcher

        exit_launcher(cli_main(argv[1:]))
    parser = build_parser()
    try:
        args = parser.parse_args(argv)  # --help prints
    except BrokenPipeError:
        sys.exit(_reader_gone())
    # Events this process logs go to stderr (stdout is for --json); the snapshot
    # commands' rows say what they did, so only warnings (a storage retry) join them.
    et_log.configure("warning" if args.command == "snapshots" else "info")
    try:
        code = args.func(args)
    except ElasticTrainError as exc:
        print(f"elastictrain: error: {exc}", file=sys.stderr)
        code = exit_code_for(args.command, exc)
    except KeyboardInterrupt:
        code = 130
    except BrokenPipeError:
        code = _reader_gone()
    sys.exit(code)


def _reader_gone() -> int:
    """The reader of stdout closed it (``| head``): what it read was printed. End quietly
    as a process killed by SIGPIPE would, not with a traceback; stdout now goes nowhere,
    so the interpreter's last flush cannot fail again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return EXIT_READER_GONE


if __name__ == "__main__":
    main()
