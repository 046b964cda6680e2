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

    opts = DemoOptions(storage=args.storage, nproc=args.nproc, steps=args.steps,
                       snapshot_every=args.snapshot_every, keep=args.keep,
                       kill_at=args.kill_at, seed=args.seed, events_dir=args.events_dir,
                       nnodes=args.nnodes, kill_node_at=args.kill_node_at,
                       add_node_at=args.add_node_at, batch_size=args.batch_size,
                       global_batch_size=args.global_batch_size, samples=args.samples,
                       record_samples=args.record_samples,
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
        return 1 if args.snap_cmd == "verify" else 0
    ops.print_rows(rows, args.json)
    failed = any(r.get("status") == "corrupt" for r in rows)
    return 1 if failed and args.snap_cmd == "verify" else 0


def _goodput(args: argparse.Namespace) -> int:
    from elastictrain.accounting.split import format_split, split_run
    from elastictrain.goodput import compute_goodput

    try:
        report = compute_goodput(args.events_dir)
        split = split_run(args.events_dir)
    except FileNotFoundError as exc:
        raise ConfigError(str(exc)) from None
    if args.plot:
        from elastictrain.accounting.plot import plot_split

        plot_split(split, args.plot)
    if args.json:
        print(json.dumps({**report.to_dict(), "split": split.to_dict()}))
    else:
        print(format_split(split))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="elastictrain", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    # `run` hands its whole command line to torchrun's parser (see main); listed for --help.
    sub.add_parser("run", add_help=False, help="torchrun with elastictrain's defaults: "
                   "elastictrain run [torchrun options] SCRIPT [ARGS] (exit 75: preempted)")

    demo = sub.add_parser("demo", help="train a small GPT under torchrun, kill it, resume it")
    demo.add_argument("--storage", default="./elastictrain-demo",
                      help="snapshot location: a directory, file://, memory-less URL (s3://…)")
    demo.add_argument("--nproc", type=int, default=2, help="workers (default 2, CPU, gloo)")
    demo.add_argument("--steps", type=int, default=300)
    demo.add_argument("--snapshot-every", type=int, default=25)
    demo.add_argument("--keep", type=int, default=3, help="snapshots to retain")
    demo.add_argument("--kill-at", type=int, action="append", default=[], metavar="STEP",
                      help="SIGKILL a worker at STEP (repeatable; attempt i kills at the i-th)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--events-dir", default=None, help="where event logs go (default: "
                      "<storage>/events for local storage)")
    demo.add_argument("--storage-options", default=None, metavar="JSON",
                      help="JSON object passed to fsspec, e.g. "
                      '\'{"client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"}}\'; '
                      "leave credentials to the environment (AWS_*, a profile, a role)")
    demo.add_argument("--json", action="store_true", help="print one JSON object on stdout")
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

    goodput = sub.add_parser("goodput", help="how much of a run's wall time was training")
    goodput.add_argument("events_dir", help="a run's events directory "
                         "(<storage>/events/<run id>)")
    goodput.add_argument("--json", action="store_true")
    goodput.add_argument("--plot", metavar="FILE.png", help="draw the timeline and the split "
                         "(needs elastictrain[plot])")
    goodput.set_defaults(func=_goodput)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run"]:
        from elastictrain.launch import cli_main

        sys.exit(cli_main(argv[1:]))
    parser = build_parser()
    args = parser.parse_args(argv)
    et_log.configure()  # events this process logs go to stderr: stdout is for --json
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
