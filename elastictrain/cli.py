"""The ``elastictrain`` command: parse → build a config → call the library.

Exit codes: 0 finished; 2 usage error; 75 preempted after a final snapshot
(resume me); 76 preempted, final snapshot not committed (resume me from an older
one); 78 fatal, do not retry (bad config, unusable storage).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from elastictrain import log as et_log
from elastictrain.errors import EXIT_USAGE, ConfigError, ElasticTrainError


def _demo(args: argparse.Namespace) -> int:
    from elastictrain.demo.runner import DemoOptions, print_result, run_demo
    from elastictrain.ops import parse_storage_options
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
    print_result(result, args.json)
    return result.exit_code


def _snapshots(args: argparse.Namespace) -> int:
    from elastictrain import ops

    store = ops.open_from_cli(args.storage, args.storage_options)
    if args.snap_cmd == "list":
        rows = ops.list_snapshots(store)
    elif args.snap_cmd == "verify":
        rows = ops.verify_snapshots(store, args.step)
    elif args.snap_cmd == "inspect":
        rows = [ops.inspect_snapshot(store, args.step)]
    else:
        rows = ops.prune_snapshots(store, args.keep)
    if not rows and args.snap_cmd in ("list", "verify"):
        print(ops.nothing_found(store, getattr(args, "step", None)), file=sys.stderr)
        if args.json:
            ops.print_rows(rows, as_json=True)  # still one JSON document on stdout: []
        return 1 if args.snap_cmd == "verify" else 0
    ops.print_rows(rows, args.json)
    failed = any(r.get("status") == "corrupt" for r in rows)
    return 1 if failed and args.snap_cmd == "verify" else 0


def _goodput(args: argparse.Namespace) -> int:
    from elastictrain import ops
    from elastictrain.accounting.split import format_split, split_run
    from elastictrain.events import is_remote
    from elastictrain.goodput import (
        compute_goodput,
        format_report,
        one_figure,
        run_events_location,
    )

    remote = is_remote(args.events_dir)
    store = ops.open_from_cli(args.events_dir, args.storage_options) if remote else None
    # A storage root (what the script gave SnapshotManager) stands for its newest run.
    events_dir = run_events_location(args.events_dir, store)
    if remote and events_dir != args.events_dir:
        store = ops.open_from_cli(events_dir, args.storage_options)
    try:
        report = compute_goodput(events_dir, store)
        # The per-cause split reads local event files (object storage: the totals only).
        split = split_run(events_dir) if store is None else None
    except FileNotFoundError as exc:
        raise ConfigError(str(exc)) from None
    if args.plot and split is not None:
        from elastictrain.accounting.plot import plot_split

        plot_split(split, args.plot)
    if args.json:
        print(json.dumps({**one_figure(report, split), "events_dir": events_dir,
                          "split": split.to_dict() if split is not None else None}))
    else:
        print(format_split(split) if split is not None else format_report(report))
    return 0


def _chaos(args: argparse.Namespace) -> int:
    from elastictrain.chaos.report import format_json, format_table
    from elastictrain.chaos.runner import ChaosOptions, run_chaos
    from elastictrain.chaos.schedule import parse_kinds

    command = args.command_line[1:] if args.command_line[:1] == ["--"] else args.command_line
    opts = ChaosOptions(trials=args.trials, seed=args.seed, first=args.first,
                        faults=parse_kinds(args.faults), nproc=args.nproc, workdir=args.storage,
                        script=command[0] if command else None, script_args=command[1:],
                        steps=args.steps, snapshot_every=args.snapshot_every)
    report = run_chaos(opts)
    print(format_json(report) if args.json else format_table(report))
    return 0 if report.passed else 1


def _status(args: argparse.Namespace) -> int:
    from elastictrain.view.status import follow, open_status, show

    status = open_status(args.storage, args.storage_options, args.run_id)
    if not args.follow:
        show(status, json_output=args.json)
        return 0
    return 0 if follow(status, json_output=args.json, timeout_s=args.timeout) else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="elastictrain",
        description="Fault-tolerant, elastic PyTorch training: run jobs under torchrun, "
        "watch them, and manage their snapshots.",
        epilog="Exit codes: 0 finished, 2 usage error, 75 preempted after a final snapshot "
        "(resume me), 78 fatal (do not retry). Docs: docs/README.md")
    sub = parser.add_subparsers(dest="command", required=True)

    # `run` hands its whole command line to torchrun's parser (see main); listed for --help.
    sub.add_parser("run", add_help=False, help="run SCRIPT under torchrun with restarts and "
                   "elastictrain's defaults, with a live view on a terminal (--no-view: off): "
                   "elastictrain run [--no-view] [torchrun options] SCRIPT [ARGS]")

    demo = sub.add_parser("demo", help="train a small GPT under torchrun, kill it, resume it")
    demo.add_argument("--storage", default="./elastictrain-demo",
                      help="where snapshots and events go: a directory or a URL such as "
                      "s3://bucket/run (default ./elastictrain-demo)")
    demo.add_argument("--nproc", type=int, default=2, help="workers (default 2, CPU, gloo)")
    demo.add_argument("--steps", type=int, default=300, help="train this many steps (default 300)")
    demo.add_argument("--snapshot-every", type=int, default=25, metavar="N",
                      help="take a snapshot every N steps (default 25)")
    demo.add_argument("--keep", type=int, default=3, help="snapshots to keep (default 3)")
    demo.add_argument("--kill-at", type=int, action="append", default=[], metavar="STEP",
                      help="kill a worker with SIGKILL at STEP; repeat it to kill again "
                      "after each restart")
    demo.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    demo.add_argument("--events-dir", default=None, help="where the event logs go (default: "
                      "STORAGE/events for local storage)")
    demo.add_argument("--storage-options", default=None, metavar="JSON",
                      help="JSON object passed to fsspec, e.g. "
                      '\'{"client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"}}\'; '
                      "keep credentials in the environment (AWS_*, a profile, a role)")
    demo.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    demo.add_argument("--quiet", action="store_true",
                      help="no live view on a terminal, only the summary at the end")
    elastic = demo.add_argument_group("elastic", "world-size changes and batch policy")
    elastic.add_argument("--nnodes", default="1", metavar="N|MIN:MAX",
                         help="agents (nodes) on this machine, e.g. 1:2 (default 1)")
    elastic.add_argument("--kill-node-at", type=int, default=None, metavar="STEP",
                         help="SIGKILL the last node (agent and workers) after STEP")
    elastic.add_argument("--add-node-at", type=int, default=None, metavar="STEP",
                         help="start a replacement node after STEP at the smaller size")
    elastic.add_argument("--batch-size", type=int, default=16, help="per-rank (micro-)batch")
    elastic.add_argument("--global-batch-size", type=int, default=None, metavar="G",
                         help="keep G samples per step at any world size (accumulation)")
    elastic.add_argument("--samples", type=int, default=None, metavar="N",
                         help="train on the first N windows of the corpus (short epochs)")
    elastic.add_argument("--record-samples", default=None, metavar="DIR",
                         help="write each rank's sample indices per step to DIR")
    demo.set_defaults(func=_demo)

    snaps = sub.add_parser("snapshots", help="list, verify, inspect or prune snapshots")
    snap_sub = snaps.add_subparsers(dest="snap_cmd", required=True)
    for name, help_text in [("list", "committed and partial snapshots"),
                            ("verify", "check every payload against its manifest; exit 1 if any "
                             "is corrupt or none is found"),
                            ("inspect", "one snapshot's manifest"),
                            ("prune", "keep the newest --keep verified snapshots")]:
        cmd = snap_sub.add_parser(name, help=help_text, description=help_text)
        cmd.add_argument("storage", help="run root: a directory or URL (s3://bucket/run)")
        cmd.add_argument("--storage-options", default=None,
                         help="JSON object passed to fsspec (e.g. endpoint, profile)")
        cmd.add_argument("--json", action="store_true")
        if name in ("verify", "inspect"):
            cmd.add_argument("--step", type=int, default=None, required=name == "inspect")
        if name == "prune":
            cmd.add_argument("--keep", type=int, required=True)
    snaps.set_defaults(func=_snapshots)

    chaos = sub.add_parser("chaos", help="run a script cleanly, then under random faults, "
                           "and check nothing was lost: elastictrain chaos [options] -- "
                           "SCRIPT [ARGS] ({storage} in ARGS: the trial's storage)")
    chaos.add_argument("--trials", type=int, default=5)
    chaos.add_argument("--seed", type=int, default=0, help="trial seeds derive from it")
    chaos.add_argument("--first", type=int, default=0, metavar="K",
                       help="index of the first trial (replay trial K: --first K --trials 1)")
    chaos.add_argument("--faults", default="kill,relaunch,notice,stop,storage",
                       help="fault kinds to draw from (default: all)")
    chaos.add_argument("--nproc", type=int, default=2, help="workers (default 2)")
    chaos.add_argument("--storage", default=None, metavar="DIR",
                       help="work directory: one storage and event log per trial "
                       "(default: a new temporary directory)")
    chaos.add_argument("--steps", type=int, default=60, help="demo only")
    chaos.add_argument("--snapshot-every", type=int, default=10, help="demo only")
    chaos.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    chaos.add_argument("command_line", nargs=argparse.REMAINDER, metavar="-- SCRIPT [ARGS]",
                       help="the training script (default: the built-in demo)")
    chaos.set_defaults(func=_chaos)

    goodput = sub.add_parser("goodput", help="how much of a run's wall time was training")
    goodput.add_argument("events_dir", help="a run's events directory or URL "
                         "(<storage>/events/<run id>, e.g. s3://bucket/run/events/<run id>)")
    goodput.add_argument("--storage-options", default=None, metavar="JSON",
                         help="JSON object passed to fsspec for a URL (endpoint, profile)")
    goodput.add_argument("--json", action="store_true")
    goodput.add_argument("--plot", metavar="FILE.png", help="draw the timeline and the split "
                         "(needs elastictrain[plot])")
    goodput.set_defaults(func=_goodput)

    status = sub.add_parser("status", help="attempt, steps, last snapshot and recent failures "
                            "of a run, read from its storage")
    status.add_argument("storage", help="the run's storage root: a directory or URL "
                        "(s3://bucket/run), as given to demo or run")
    status.add_argument("--storage-options", default=None, metavar="JSON",
                        help="JSON object passed to fsspec (e.g. endpoint, profile)")
    status.add_argument("--run-id", default=None,
                        help="which run, when several wrote events there (default: newest)")
    status.add_argument("--json", action="store_true", help="print the state as JSON")
    status.add_argument("--follow", action="store_true",
                        help="keep showing the run until it ends (exit 0) or --timeout "
                        "passes (exit 1)")
    status.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                        help="with --follow: give up after this long")
    status.set_defaults(func=_status)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run"]:
        from elastictrain.launch import cli_main, exit_launcher

        exit_launcher(cli_main(argv[1:]))
    parser = build_parser()
    args = parser.parse_args(argv)
    et_log.configure()  # events this process logs go to stderr: stdout is for --json
    try:
        code = args.func(args)
    except ConfigError as exc:
        print(f"elastictrain: error: {exc}", file=sys.stderr)
        code = EXIT_USAGE if args.command in ("demo", "chaos") else exc.exit_code
    except ElasticTrainError as exc:
        print(f"elastictrain: error: {exc}", file=sys.stderr)
        code = exc.exit_code
    except KeyboardInterrupt:
        code = 130
    sys.exit(code)




if __name__ == "__main__":
    main()
