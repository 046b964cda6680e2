"""Export benchmark: the peak memory of ``elastictrain snapshots export`` against the
naive way, at one model size.

    python scripts/bench_export.py [--size-mb 1024] [--width 4096] [--rounds 3]
                                   [--kinds replicated sharded] [--dir /tmp] [--json [FILE]]

Setup (printed with the results):

* the model: ``--size-mb`` of float32 weights in ``Linear(width, width, bias=False)``
  layers (``--width 4096``: 64 MiB per tensor, the largest tensor), no optimizer;
* its snapshot, made once per kind in a process of its own: ``replicated`` by a
  ``SnapshotManager`` in one process (one ``state.pt``); ``sharded`` by FSDP2 on a
  one-rank gloo group (DCP objects, chunks assembled by the export as at any world
  size);
* every measurement in a fresh process: it imports torch, elastictrain (the export's
  modules, DCP's among them) and safetensors, takes its resident memory (``VmRSS``),
  resets the kernel's peak
  (``/proc/self/clear_refs``), does the work, and reads the peak (``VmHWM``); the
  figure is peak minus start, over the model's bytes. The page cache is not part of a
  process's resident memory, so the figure is what the process itself holds;
* methods: ``export-safetensors`` and ``export-torch`` (``elastictrain.export``), and
  for the replicated snapshot the naive ways: ``naive-torch``, ``torch.load`` of the
  whole payload then ``torch.save`` of its model, and ``naive-safetensors``,
  ``torch.load`` then ``safetensors.torch.save_file`` (of clones: ``save_file`` refuses
  tensors that share memory, and the payload keeps the model's tensors as views of one
  buffer);
* ``--rounds`` rounds, the methods in turn within each; median [min-max] per method,
  and the 1-minute load average before and after each round (the machine's load).

``--json FILE`` (``-`` or no FILE: stdout) writes ``{"setup", "kinds": {kind: {method:
{"growth_over_model", "growth_mib", "duration_s"}}}, "load"}``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchlib import fmt, free_port, load_average, spread, write_json

METHODS = {"replicated": ["export-safetensors", "export-torch", "naive-torch",
                          "naive-safetensors"],
           "sharded": ["export-safetensors", "export-torch"]}


def build_model(size_mb: int, width: int) -> Any:
    import torch

    layers = model_bytes(size_mb, width) // (width * width * 4)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False, device="meta")
                                  for _ in range(layers)])
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    return model


def make_snapshot(kind: str, root: str, size_mb: int, width: int) -> None:
    """(a process of its own) one snapshot of the model under ``root``."""
    import torch
    import torch.distributed as dist

    from elastictrain.core import log as et_log
    from elastictrain.snapshot.manager import SnapshotManager
    from elastictrain.worker.dist import DistContext

    et_log.configure("warning")
    torch.manual_seed(0)
    model = build_model(size_mb, width)
    ctx = None
    if kind == "sharded":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)
        mesh = init_device_mesh("cpu", (1,))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        ctx = DistContext(0, 1, 0, "gloo", torch.device("cpu"), True)
    snap = SnapshotManager(root, model=model, ctx=ctx, mode="sync", every_steps=1000)
    snap.save().wait()
    snap.close()
    if dist.is_initialized():
        dist.destroy_process_group()


def _status_kib(field: str) -> int:
    found = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    assert found, field
    return int(found.group(1))


def child(method: str, root: str, out: str) -> dict[str, float]:
    """(a fresh process) run one method; its resident memory's growth and duration."""
    import safetensors.torch
    import torch

    import elastictrain
    import elastictrain.snapshot.export.api
    import elastictrain.snapshot.export.sharded  # imports: before the start
    from elastictrain.core import log as et_log

    et_log.configure("warning")
    start_kib = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # the peak starts from now
    started = time.perf_counter()
    if method.startswith("export-"):
        elastictrain.export(root, out, format=method.removeprefix("export-"), force=True)
    else:
        (payload,) = Path(root).glob("snapshots/step_*/state*.pt")
        model = torch.load(payload, weights_only=True, map_location="cpu")["model"]
        if method == "naive-torch":
            torch.save({"model": model}, out)
        else:
            safetensors.torch.save_file({k: v.clone() for k, v in model.items()}, out)
    duration = time.perf_counter() - started
    return {"growth_bytes": (_status_kib("VmHWM") - start_kib) * 1024.0,
            "duration_s": duration, "start_mib": start_kib / 1024}


def _run_self(*args: str) -> str:
    done = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True,
                          check=False, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode != 0:
        raise SystemExit(f"bench_export.py {' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return done.stdout


def model_bytes(size_mb: int, width: int) -> int:
    """The bytes of the model ``build_model`` makes."""
    layer = width * width * 4
    return max(1, round(size_mb * 2**20 / layer)) * layer


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    report: dict[str, Any] = {"kinds": {}, "load": []}
    sizes: dict[str, int] = {}
    for kind in args.kinds:
        root = str(work / kind)
        _run_self("--make", kind, root, str(args.size_mb), str(args.width))
        sizes[kind] = model_bytes(args.size_mb, args.width)
    samples: dict[str, dict[str, list[dict[str, float]]]] = {
        kind: {m: [] for m in METHODS[kind]} for kind in args.kinds}
    for round_no in range(args.rounds):
        before = load_average()
        for kind in args.kinds:
            for method in METHODS[kind]:
                out = str(work / f"out-{kind}-{method}")
                result = json.loads(_run_self("--child", method, str(work / kind), out))
                samples[kind][method].append(result)
                os.unlink(out)
        report["load"].append({"round": round_no, "before": before, "after": load_average()})
    for kind, methods in samples.items():
        report["kinds"][kind] = {
            method: {"growth_over_model": spread([r["growth_bytes"] / sizes[kind] for r in rs]),
                     "growth_mib": spread([r["growth_bytes"] / 2**20 for r in rs]),
                     "duration_s": spread([r["duration_s"] for r in rs])}
            for method, rs in methods.items()}
    return report


def setup(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    return {"size_mb": args.size_mb, "largest_tensor_mib": args.width * args.width * 4 / 2**20,
            "rounds": args.rounds, "cpus": os.cpu_count(), "cpu": platform.processor() or
            platform.machine(), "torch": torch.__version__, "python": platform.python_version(),
            "dir": args.dir}


def print_table(report: dict[str, Any]) -> None:
    s = report["setup"]
    print(f"model {s['size_mb']} MiB, largest tensor {s['largest_tensor_mib']:.0f} MiB, "
          f"{s['rounds']} rounds, {s['cpus']} CPUs, torch {s['torch']}")
    for kind, methods in report["kinds"].items():
        print(f"\n{kind}: peak RSS growth over the model's bytes, median [min-max]")
        for method, figures in methods.items():
            print(f"  {method:20s} {fmt(figures['growth_over_model'])}  "
                  f"({fmt(figures['growth_mib'], 0)} MiB, {fmt(figures['duration_s'], 2)} s)")
    loads = ", ".join(f"{r['before']:.2f}->{r['after']:.2f}" for r in report["load"])
    print(f"\nload average per round (before->after): {loads}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mb", type=int, default=1024, help="model size in MiB")
    p.add_argument("--width", type=int, default=4096,
                   help="features of each Linear layer (its weight is the largest tensor)")
    p.add_argument("--rounds", type=int, default=3, help="measurements per method")
    p.add_argument("--kinds", nargs="+", choices=sorted(METHODS),
                   default=["replicated", "sharded"], help="which snapshots to export")
    p.add_argument("--dir", default=tempfile.gettempdir(), help="work directory's parent")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                   help="write the report as JSON (to stdout without FILE)")
    p.add_argument("--table", metavar="JSON", help="print the table of a saved --json report")
    p.add_argument("--make", nargs=4, metavar=("KIND", "ROOT", "SIZE_MB", "WIDTH"),
                   help=argparse.SUPPRESS)
    p.add_argument("--child", nargs=3, metavar=("METHOD", "ROOT", "OUT"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.table:
        print_table(json.loads(Path(args.table).read_text()))
        return
    if args.make:
        kind, root, size_mb, width = args.make
        make_snapshot(kind, root, int(size_mb), int(width))
        return
    if args.child:
        print(json.dumps(child(*args.child)))
        return
    work = Path(tempfile.mkdtemp(prefix="bench-export-", dir=args.dir))
    try:
        report = {"setup": setup(args), **run(args, work)}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json is not None:
        write_json(args.json, report)
    if args.json != "-":
        print_table(report)


if __name__ == "__main__":
    main()
