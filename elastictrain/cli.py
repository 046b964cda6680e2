"""The ``elastictrain`` command: parse → build a config → call the library.

Exit codes: 0 finished; 2 usage error; 75 preempted after a final snapshot
(resume me); 78 fatal, do not retry (bad config, unusable storage).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

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
    ops.print_rows(rows, args.json)
    return 1 if any(r.get("status") == "corrupt" for r in rows) and args.snap_cmd == "verify" else 0


def _goodput(args: argparse.Namespace) -> int:
    from elastictrain.goodput import compute_goodput, format_report

    try:
        report = compute_goodput(args.events_dir)
    except FileNotFoundError as exc:
        raise ConfigError(str(exc)) from None
    if args.json:
        print(json.dumps(report.to_dict()))
    else:
        print(format_report(report))
    return 0


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
                   "elastictrain's defaults: elastictrain run [torchrun options] SCRIPT [ARGS]")

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
                            ("verify", "check every payload against its manifest"),
                            ("inspect", "one snapshot's manifest"),
                            ("prune", "keep the newest --keep verified snapshots")]:
        cmd = snap_sub.add_parser(name, help=help_text)
        cmd.add_argument("storage", help="run root: a directory or URL (s3://bucket/run)")
        cmd.add_argument("--storage-options", default=None,
                         help="JSON object passed to fsspec (e.g. endpoint, profile)")
        cmd.add_argument("--json", action="store_true")
        if name in ("verify", "inspect"):
            cmd.add_argument("--step", type=int, default=None, required=name == "inspect")
        if name == "prune":
            cmd.add_argument("--keep", type=int, required=True)
    snaps.set_defaults(func=_snapshots)

    goodput = sub.add_parser("goodput", help="how much of a run's wall time was training")
    goodput.add_argument("events_dir", help="a run's events directory "
                         "(<storage>/events/<run id>)")
    goodput.add_argument("--json", action="store_true")
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
        from elastictrain.launch import cli_main

        sys.exit(cli_main(argv[1:]))
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code = args.func(args)
    except ConfigError as exc:
        print(f"elastictrain: error: {exc}", file=sys.stderr)
        code = EXIT_USAGE if args.command == "demo" else exc.exit_code
    except ElasticTrainError as exc:
        print(f"elastictrain: error: {exc}", file=sys.stderr)
        code = exc.exit_code
    except KeyboardInterrupt:
        code = 130
    sys.exit(code)




if __name__ == "__main__":
    main()
