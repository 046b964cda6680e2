"""What the memory tier across nodes costs a training step, and what a copy from a peer
node costs a restore (docs/memory-tier.md#across-nodes).

Step rate: the demo (``elastictrain run -m elastictrain.demo.worker``, CPU, gloo) on two
``elastictrain run`` agents on this machine standing for two nodes, one worker each,
each with a memory directory of its own; the memory tier on with its rescue (a memory
snapshot every 100000 steps: none is taken while measuring, so what differs is the
boundary records alone), ``snapshot.memory_replicas`` = 1 (every step's record also
streamed to the other node) against 0 (records kept on the node). Rate: rank 0's
``train.progress`` events, steps over seconds from the first event to the last (the
start and rendezvous are outside the window). The two configurations alternate, in
turn first, ``--rounds`` times; the ratio is replicas=1 over replicas=0.

Step cost in one job: ``--micro``: two gloo workers (torchrun) train an MLP (``--width``) with a
gradient all-reduce each step and write a boundary record each step; blocks of
``--block-steps`` steps alternate between the records crossing to the other rank as the
manager sends them (before the optimizer step, which waits for the other rank's record
of the step; at the boundary, compared with the one sent) and not, in the same
processes (what the machine's other work does to the rate falls on both alike).
Ratio: step time without over with (≥ 0.97 is the target).

Copy: ``--copy-mb``: one process pair (torchrun, two gloo workers) sends a committed
memory snapshot of that size from one memory directory to another and verifies it
(snapshot/memory/peer_restore.py), against reading and verifying the same snapshot from the
local memory directory alone.

Sharded state: ``--sharded``: two gloo workers (torchrun) train an FSDP2 model
(``--size-mb`` of parameters in Linear(1024, 1024) layers, AdamW: the state is three
times that, half on each rank), each rank with a memory directory of its own (so each
is a node of its own), a memory snapshot every ``--memory-every`` steps and no durable
one while measuring. ``snapshot.memory_replicas`` = 1 (each rank's part also goes to
the other node, in the background) against 0 (parts kept on the node), fresh processes
for each, alternating, ``--rounds`` times. Reported: the bytes each node sends per
snapshot, the time its background exchange takes, and the step time (steps after the
first two snapshots) replicas=0 over replicas=1 (the step rate with ÷ without).

    python scripts/bench_peer.py --steps 400 --rounds 3 --json
    python scripts/bench_peer.py --micro --rounds 20
    python scripts/bench_peer.py --copy-mb 256 --rounds 3
    python scripts/bench_peer.py --sharded --size-mb 64 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import (
    events_named,
    fmt,
    free_port,
    load_average,
    noisy,
    ratio_spread,
    spread,
    write_json,
)

from elastictrain.launcher.spawn import DEFAULT_RDZV_CONF, LaunchSpec, start_torchrun

RUN_TIMEOUT_S = 900


def run_demo(work: Path, steps: int, replicas: int) -> dict[str, Any]:
    """One two-node demo run; rank 0's step rate and the records streamed."""
    port, run_id = free_port(), f"peer-{uuid.uuid4().hex[:8]}"
    storage = work / "storage"
    procs = []
    for node in (0, 1):
        events = work / f"node{node}"
        events.mkdir(parents=True)
        spec = LaunchSpec(nproc_per_node=1, module="elastictrain.demo.worker",
                          script_args=[f"--storage={storage}", f"--steps={steps}",
                                       "--snapshot-every=100000", "--memory-every=100000",
                                       f"--events-dir={events}"],
                          nnodes="2", max_restarts=0, rdzv_endpoint=f"127.0.0.1:{port}",
                          rdzv_id=run_id, rdzv_conf=f"{DEFAULT_RDZV_CONF},is_host={1 - node}",
                          log_dir=str(events / "torchelastic"), events_dir=str(events))
        log = open(events / "launcher.log", "wb")  # noqa: SIM115 - the child holds it
        procs.append(start_torchrun(spec, stdout=log.fileno(), extra_env={
            "OMP_NUM_THREADS": "1", "ELASTICTRAIN_SNAPSHOT__PROGRESS_EVERY_S": "0.5",
            "ELASTICTRAIN_SNAPSHOT__MEMORY_REPLICAS": str(replicas),
            "ELASTICTRAIN_SNAPSHOT__MEMORY_DIR": str(work / f"mem{node}")}))
        log.close()
    try:
        codes = [p.wait(timeout=RUN_TIMEOUT_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    if codes != [0, 0]:
        raise RuntimeError(f"the demo failed ({codes}); see {work}/node*/launcher.log")
    progress = sorted((e for e in events_named(work / "node0", "train.progress") if e["rank"] == 0),
                      key=lambda e: e["ts"])
    first, last = progress[0], progress[-1]
    closed = events_named(work, "snapshot.records_closed")
    return {"steps_per_s": (last["step"] - first["step"]) / (last["ts"] - first["ts"]),
            "window_steps": last["step"] - first["step"],
            "records_sent": sorted(int(e["sent"]) for e in closed)}


def bench_steps(args: argparse.Namespace, report: dict[str, Any]) -> None:
    rates: dict[int, list[float]] = {1: [], 0: []}
    sent: list[list[int]] = []
    for r in range(args.rounds):
        for replicas in ((1, 0) if r % 2 == 0 else (0, 1)):
            with tempfile.TemporaryDirectory(prefix="bench-peer-") as tmp:
                result = run_demo(Path(tmp), args.steps, replicas)
            rates[replicas].append(result["steps_per_s"])
            if replicas:
                sent.append(result["records_sent"])
            print(f"round {r} replicas={replicas}: {result['steps_per_s']:.2f} steps/s "
                  f"({result['window_steps']} steps), records sent {result['records_sent']}, "
                  f"load {load_average():.2f}", flush=True)
    report["steps"] = {"steps_per_s_replicas_1": spread(rates[1]),
                       "steps_per_s_replicas_0": spread(rates[0]),
                       "ratio": ratio_spread(rates[1], rates[0]), "records_sent": sent}
    print(f"step rate, records to the other node / kept on the node: "
          f"{fmt(report['steps']['ratio'])}")


COPY_WORKER = r'''
import os, sys, time, json
from pathlib import Path
import torch, torch.distributed as dist
from elastictrain.worker.dist import DistContext
from elastictrain.snapshot.memory.peer_restore import send_copy, receive_copy
from elastictrain.snapshot.memory.peer_transport import GlooTransport
from elastictrain.snapshot.format.reader import verify_snapshot
from elastictrain.storage.fsspec_store import FsspecStore
dist.init_process_group("gloo")
rank = dist.get_rank()
transport = GlooTransport.create()
src, out = Path(sys.argv[1]), Path(sys.argv[2])
step = int(sys.argv[3])
dist.barrier()
started = time.perf_counter()
if rank == 0:
    send_copy(transport, FsspecStore(str(src), private=True), step, 1)
else:
    store = FsspecStore(str(out), private=True)
    assert receive_copy(transport, store, step, 0)
    verify_snapshot(store, step, load=True)  # what the restore then does on this node
copy_s = time.perf_counter() - started
dist.barrier()
local_s = None
if rank == 0:
    started = time.perf_counter()
    verify_snapshot(FsspecStore(str(src), private=True), step, load=True)
    local_s = time.perf_counter() - started
print(json.dumps({"rank": rank, "copy_s": copy_s, "local_s": local_s}), flush=True)
dist.destroy_process_group()
'''


MICRO_WORKER = r'''
import json, os, sys, time
from pathlib import Path
import torch, torch.distributed as dist
from elastictrain.worker.dist import DistContext
from elastictrain.snapshot.memory.peer_records import RecordStream
from elastictrain.snapshot.memory.record_links import connect_record_links
from elastictrain.snapshot.memory.rescue import BoundaryRecord, same_states
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
ctx = DistContext(rank, 2, rank, "gloo", torch.device("cpu"), True)
links = connect_record_links(ctx, [1 - rank], [1 - rank])
where = Path(sys.argv[1]) / f"boundary{rank}"
where.mkdir(mode=0o700)
rounds, block, width = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh(),
                            torch.nn.Linear(width, width))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
x = torch.randn(32, width)
record = BoundaryRecord(where, rank, (2, 0, -1), lambda: list(model.parameters()))
stream = RecordStream(links, rank, where, print)
times = {"with": [], "without": []}
step = 0
for r in range(2 * rounds + 1):
    mode = "with" if r % 2 else "without"
    started = time.perf_counter()
    for _ in range(block):
        loss = model(x).pow(2).mean()
        loss.backward()
        flat = torch.cat([p.grad.view(-1) for p in model.parameters()])
        dist.all_reduce(flat)
        if mode == "with":  # as the manager's optimizer-step pre-hook does
            sent = record.capture(step + 1, pre_step=True)
            stream.publish(sent, pre_step=True)
            stream.wait_pre_step(step + 1, 60.0)
        opt.step()
        opt.zero_grad()
        step += 1
        data = record.record(step)
        if mode == "with" and not same_states(sent, data):
            stream.publish(data)
    if r:  # the first block warms up
        times[mode].append((time.perf_counter() - started) / block)
stream.close()
print(json.dumps({"rank": rank, "times": times, "sent": stream.sent}), flush=True)
dist.destroy_process_group()
'''


def bench_micro(args: argparse.Namespace, report: dict[str, Any]) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-peer-micro-", dir="/dev/shm") as tmp:
        worker = Path(tmp) / "micro_worker.py"
        worker.write_text(MICRO_WORKER)
        result = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
             f"--master-port={free_port()}", str(worker), tmp, str(args.rounds),
             str(args.block_steps), str(args.width)],
            capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
            env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = [json.loads(x) for x in result.stdout.splitlines() if x.startswith("{")]
    if result.returncode != 0 or len(lines) != 2:
        raise RuntimeError(result.stderr[-3000:])
    times = next(x for x in lines if x["rank"] == 0)["times"]
    rate = ratio_spread(times["without"], times["with"])
    report["micro"] = {"step_s_with": spread(times["with"]),
                       "step_s_without": spread(times["without"]),
                       "rate_with_over_without": rate, "block_steps": args.block_steps,
                       "width": args.width,
                       "records_sent": [x["sent"] for x in lines]}
    print(f"step time with the stream {fmt(spread(times['with']), 5)} s, without "
          f"{fmt(spread(times['without']), 5)} s; step rate with / without: {fmt(rate)}; "
          f"records sent {[x['sent'] for x in lines]}")


SHARDED_WORKER = r'''
import json, sys, time
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
import elastictrain as et
tmp, replicas, steps, size_mb, every = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), \
    int(sys.argv[4]), int(sys.argv[5])
torch.set_num_threads(1)
rt = et.init()
rank = rt.ctx.rank
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(max(1, size_mb // 4))])
mesh = init_device_mesh("cpu", (rt.world_size,))
for layer in model:
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
snap = et.SnapshotManager(f"{tmp}/durable", model=model, optimizer=opt, every_steps=10**6,
                          memory_every=every, memory_dir=f"{tmp}/mem{rank}",
                          memory_replicas=replicas, progress_dir=False)
snap.restore()
x = torch.randn(8, 1024)
times = []
for _ in range(steps):
    started = time.perf_counter()
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    snap.step()
    times.append(time.perf_counter() - started)
snap.wait()
replications = list(snap._node_memory.saver.replications)
snap.close()
with open(f"{tmp}/result{rank}.json", "w") as out:  # two ranks' stdout can interleave
    json.dump({"rank": rank, "step_s": times[2 * every:], "replications": replications}, out)
et.shutdown()
'''


def run_sharded(work: Path, args: argparse.Namespace, replicas: int) -> dict[str, Any]:
    worker = work / "sharded_worker.py"
    worker.write_text(SHARDED_WORKER)
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
         f"--master-port={free_port()}", str(worker), str(work), str(replicas),
         str(args.steps), str(args.size_mb), str(args.memory_every)],
        capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
        env={**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    if result.returncode != 0:
        raise RuntimeError(result.stderr[-3000:])
    lines = [json.loads((work / f"result{rank}.json").read_text()) for rank in (0, 1)]
    rank0 = lines[0]
    step_s = sum(rank0["step_s"]) / len(rank0["step_s"])  # the snapshot steps included
    sent = [int(b) for x in lines for _, b, _ in x["replications"]]
    exchange = [float(d) for x in lines for _, _, d in x["replications"]]
    return {"step_s": step_s, "bytes_sent": sent, "exchange_s": exchange}


def bench_sharded(args: argparse.Namespace, report: dict[str, Any]) -> None:
    step_s: dict[int, list[float]] = {1: [], 0: []}
    sent: list[int] = []
    exchange: list[float] = []
    for r in range(args.rounds):
        for replicas in ((1, 0) if r % 2 == 0 else (0, 1)):
            with tempfile.TemporaryDirectory(prefix="bench-peer-sharded-",
                                             dir="/dev/shm") as tmp:
                result = run_sharded(Path(tmp), args, replicas)
            step_s[replicas].append(result["step_s"])
            if replicas:
                sent += result["bytes_sent"]
                exchange += result["exchange_s"]
            print(f"round {r} replicas={replicas}: mean step {result['step_s']:.3f} s, "
                  f"sent per node per snapshot {sorted(set(result['bytes_sent']))} B, "
                  f"exchange {fmt(spread(result['exchange_s'] or [0.0]))} s, "
                  f"load {load_average():.2f}", flush=True)
    report["sharded"] = {
        "size_mb": args.size_mb, "memory_every": args.memory_every, "steps": args.steps,
        "step_s_replicas_1": spread(step_s[1]), "step_s_replicas_0": spread(step_s[0]),
        "rate_ratio": ratio_spread(step_s[0], step_s[1]),
        "bytes_sent_per_node_per_snapshot": spread([float(b) for b in sent]),
        "exchange_s": spread(exchange)}
    print(f"sharded, {args.size_mb} MB of parameters: each node sends "
          f"{fmt(report['sharded']['bytes_sent_per_node_per_snapshot'], 0)} B per snapshot "
          f"in {fmt(report['sharded']['exchange_s'])} s; step rate replicas=1 / 0: "
          f"{fmt(report['sharded']['rate_ratio'])}")


def bench_copy(args: argparse.Namespace, report: dict[str, Any]) -> None:
    import torch

    from elastictrain.snapshot.durable.commit import persist_snapshot
    from elastictrain.snapshot.format.manifest import SnapshotMeta
    from elastictrain.storage.fsspec_store import FsspecStore
    copies, locals_ = [], []
    with tempfile.TemporaryDirectory(prefix="bench-peer-copy-", dir="/dev/shm") as tmp:
        src = Path(tmp) / "held"
        state = {"w": torch.randn(args.copy_mb * 2**18)}
        persist_snapshot(FsspecStore(str(src), private=True), state,
                         SnapshotMeta("bench", 7, 0, 2, "crc32"))
        worker = Path(tmp) / "copy_worker.py"
        worker.write_text(COPY_WORKER)
        for r in range(args.rounds):
            out = Path(tmp) / f"recv{r}"
            result = subprocess.run(
                [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                 f"--master-port={free_port()}", str(worker), str(src), str(out), "7"],
                capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
                env={**os.environ, "OMP_NUM_THREADS": "1"})
            lines = [json.loads(x) for x in result.stdout.splitlines() if x.startswith("{")]
            if result.returncode != 0 or len(lines) != 2:
                raise RuntimeError(result.stderr[-3000:])
            receiver = next(x for x in lines if x["rank"] == 1)
            sender = next(x for x in lines if x["rank"] == 0)
            copies.append(receiver["copy_s"])
            locals_.append(sender["local_s"])
            shutil.rmtree(out, ignore_errors=True)
            print(f"round {r}: copy+verify+load {receiver['copy_s']:.3f} s, local "
                  f"verify+load {sender['local_s']:.3f} s, load {load_average():.2f}",
                  flush=True)
    report["copy"] = {"size_mb": args.copy_mb, "copy_and_load_s": spread(copies),
                      "local_load_s": spread(locals_), "ratio": ratio_spread(copies, locals_)}
    print(f"restore of {args.copy_mb} MB from a peer / from this node's memory: "
          f"{fmt(report['copy']['ratio'])}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--copy-mb", type=int, default=0, help="measure a peer copy instead")
    p.add_argument("--micro", action="store_true", help="the step cost in one job instead")
    p.add_argument("--block-steps", type=int, default=50)
    p.add_argument("--width", type=int, default=1024, help="--micro: the MLP's width")
    p.add_argument("--sharded", action="store_true", help="an FSDP2 model's replication")
    p.add_argument("--size-mb", type=int, default=64, help="--sharded: MB of parameters")
    p.add_argument("--memory-every", type=int, default=5, help="--sharded: memory interval")
    p.add_argument("--json", nargs="?", const="bench_peer.json", default=None)
    args = p.parse_args()
    load_before = load_average()
    report: dict[str, Any] = {"load_before": load_before, "cpus": os.cpu_count(),
                              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    if args.sharded:
        bench_sharded(args, report)
    elif args.copy_mb:
        bench_copy(args, report)
    elif args.micro:
        bench_micro(args, report)
    else:
        bench_steps(args, report)
    report["load_after"] = load_average()
    report["noisy"] = noisy(load_before, report["load_after"], None)
    print(f"load {load_before:.2f} -> {report['load_after']:.2f}"
          f"{' (NOISY)' if report['noisy'] else ''}")
    if args.json:
        write_json(args.json, report)


if __name__ == "__main__":
    main()
