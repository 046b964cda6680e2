"""A whole node lost: node loss → first resumed step, and the steps lost, by where the
restore reads from.

Two agents ("nodes") on this machine, one worker each, as ``elastictrain chaos --faults
node`` runs them (elastictrain/chaos/nodes.py: a rendezvous store of its own, a memory
directory per node). The worker is the demo's model (CharGPT with AdamW, about 1.4 MB
of state) plus ``--size-mb`` of ballast (a buffer DDP leaves alone), with durable
snapshots every ``DURABLE_EVERY`` steps and memory snapshots every ``MEMORY_EVERY``.
At step ``LOSE_AT`` every rank waits for its saves in flight (durable step 20 and
memory step 24 are committed everywhere), then idles in one small all-reduce every
20 ms, so the survivor meets its peer's loss through a collective, as in training. The
harness then SIGKILLs every process of node 1 (by the marker in their environment),
wipes its memory directory and, for the modes that replace it, starts a new agent
with an empty memory directory at once. Modes:

* ``durable-local``: replaced, restored from durable storage on the local disk;
* ``durable-s3``: replaced, restored from durable storage on moto's S3 server;
* ``shrink``: not replaced (``--nnodes 1:2``): the survivor restores from its own
  memory copy;
* ``peer``: replaced, and the new node receives the memory copy from its peer
  (``snapshot.memory_replicas`` ≥ 1): only where that setting exists, else skipped
  with a line saying so. Where it exists the durable modes run with it at 0.

Figures per mode (median [min-max] over ``--reps``): node loss → the first step the new
world completes (rank 0's record), ``restore()`` inside the worker (its
``snapshot.loaded`` duration), the tier read, and the steps lost (``LOSE_AT`` less the
step resumed from), and when each stage after the loss was reached (from the agents'
and rank 0's events). With the peer feature present, also the step rate with
``memory_replicas`` 1 ÷ 0 (steps 3..``LOSE_AT`` of the peer and durable-local runs:
across runs, so a rough figure; scripts/bench_peer.py measures it interleaved) and,
with ``--netns`` (the whole benchmark in a network namespace of its own, so the
loopback carries its traffic alone), the bytes per step and node that the peer runs'
loopback carried over steps 1..``LOSE_AT`` beyond the durable-local runs' (the same
training; the difference is the boundary records sent to the other node).

    python scripts/bench_nodeloss.py --size-mb 0 --reps 3
    python scripts/bench_nodeloss.py --size-mb 0 1024 --reps 3 --json docs/bench-nodeloss.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from benchlib import fmt, load_average, noisy, ratio_spread, spread, spreads_ratio, write_json

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # elastictrain from this checkout, like the workers

from elastictrain.chaos.dataonce import read_records  # noqa: E402
from elastictrain.chaos.job import events_of  # noqa: E402
from elastictrain.chaos.nodes import NodeJob  # noqa: E402
from elastictrain.core.config import SnapshotConfig  # noqa: E402
from elastictrain.launcher.spawn import DEFAULT_RDZV_CONF, LaunchSpec  # noqa: E402

DURABLE_EVERY, MEMORY_EVERY, LOSE_AT, END_AT = 10, 4, 27, 30
MODES = ("durable-local", "durable-s3", "shrink", "peer")
START_TIMEOUT_S = 600.0  # a stage's wait (--timeout-s): 1 GiB to moto under load is slow
BUCKET = "bench-nodeloss"
PEER_SETTING = "memory_replicas"


def peer_available() -> bool:
    """Whether this elastictrain has the peer memory setting (restore from peers)."""
    return PEER_SETTING in SnapshotConfig.model_fields


# ---------------------------------------------------------------------------------------
# worker side (run by torchrun)
# ---------------------------------------------------------------------------------------
def worker(size_mb: int, storage: str, records: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import elastictrain as et
    from elastictrain.demo.model import CharGPT, GPTConfig
    from elastictrain.demo.records import SampleRecorder

    torch.set_num_threads(1)
    rt = et.init()
    try:
        torch.manual_seed(0)
        config = GPTConfig(vocab_size=64)
        model = CharGPT(config)
        if size_mb:  # state to save and load, not to train
            model.register_buffer("ballast", torch.full((size_mb << 20,), 7, dtype=torch.uint8))
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
                model, ["ballast"])
        ddp = DistributedDataParallel(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        snap = et.SnapshotManager(storage, model=ddp, optimizer=opt, ctx=rt.ctx,
                                  every_steps=DURABLE_EVERY, memory_every=MEMORY_EVERY, keep=2)
        info = snap.restore()
        recorder = SampleRecorder.open(records, rt)
        generator = torch.Generator().manual_seed(rt.rank)
        while snap.step_count < END_AT:
            x = torch.randint(0, 64, (8, config.block_size), generator=generator)
            _, loss = ddp(x, x)  # next-token loss on its own tokens: work, not learning
            loss.backward()
            opt.step()
            opt.zero_grad()
            recorder.record(snap.step_count + 1, 0, [])
            snap.step()
            if snap.step_count == LOSE_AT and info.from_step is None:
                snap.wait()  # durable 20 and memory 24 committed on every node
                Path(records, f"parked-rank{rt.rank}").touch()  # for the harness to act
                flag = torch.zeros(1)
                while True:  # until the harness takes a node: a collective fails
                    dist.all_reduce(flag)
                    time.sleep(0.02)
        snap.close()
        recorder.close()
    finally:
        et.shutdown()


# ---------------------------------------------------------------------------------------
# one node loss
# ---------------------------------------------------------------------------------------
def lose_a_node(mode: str, size_mb: int, work: Path, storage: str,
                storage_env: dict[str, str], timeout_s: float = START_TIMEOUT_S) -> dict[str, Any]:
    """Run the job, lose node 1 after step LOSE_AT, measure the recovery."""
    records = work / "records"
    replace = mode != "shrink"
    rdzv_id = f"nodeloss-{uuid.uuid4().hex[:8]}"

    def spec_for(node_dir: Path, port: int) -> LaunchSpec:
        return LaunchSpec(nproc_per_node=1, script=__file__,
                          script_args=["--worker", str(size_mb), storage, str(records)],
                          nnodes="2:2" if replace else "1:2", max_restarts=3,
                          rdzv_endpoint=f"127.0.0.1:{port}", rdzv_id=rdzv_id,
                          rdzv_conf=f"{DEFAULT_RDZV_CONF},is_host=0",
                          log_dir=str(node_dir / "torchelastic"),
                          events_dir=str(node_dir / "events"))

    env = {"OMP_NUM_THREADS": "1", "ELASTICTRAIN_STORAGE__URL": storage, **storage_env,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO),
                                                       os.environ.get("PYTHONPATH")]))}
    if peer_available():
        env[f"ELASTICTRAIN_SNAPSHOT__{PEER_SETTING.upper()}"] = "1" if mode == "peer" else "0"
    # Memory directories on a tmpfs, as on a real node.
    job = NodeJob(work, uuid.uuid4().hex, env, spec_for,
                  shm_base=Path("/dev/shm") / f"bench-nodeloss-{uuid.uuid4().hex[:8]}")
    lo_before = loopback_bytes()
    try:
        job.start(2)
        wait_for(lambda: parked(records), timeout_s, job, "step LOSE_AT")
        lo_parked = loopback_bytes()  # steps 1..LOSE_AT: the same work in every mode
        victim = job.current(1)
        job.freeze(victim)
        job.kill(victim)
        lost_ts = time.time()
        if replace:
            job.add(1)
        first = wait_for(lambda: first_new_step(records, lost_ts), timeout_s, job,
                         "the first resumed step")
        wait_for(lambda: not job.running(), timeout_s, job, "the end", running=False)
        events = [e for n in job.nodes for e in events_of(n.job.events_dir)]
    finally:
        job.close()
    resume = [e for e in events if e.get("event") == "resume" and e.get("rank") == 0
              and e.get("from_step") is not None and float(e["ts"]) > lost_ts]
    loaded = [e for e in events if e.get("event") == "snapshot.loaded" and e.get("rank") == 0
              and float(e["ts"]) > lost_ts]
    steps_rate = step_rate(records, lost_ts)
    return {"mode": mode, "size_mb": size_mb,
            "loss_to_first_step_s": round(first - lost_ts, 3),
            "breakdown_s": breakdown(events, lost_ts),
            "restore_s": float(loaded[0]["duration_s"]) if loaded else None,
            "tier": resume[0].get("tier") if resume else None,
            "resumed_from": resume[0].get("from_step") if resume else None,
            "lost_steps": LOSE_AT - int(resume[0]["from_step"]) if resume else None,
            "step_rate_before": steps_rate,
            "memory_snapshots": sum(1 for e in events if e.get("event") == "snapshot.committed"
                                    and e.get("tier") == "memory"),
            "loopback_bytes_before_loss": lo_parked - lo_before}


def breakdown(events: list[dict[str, Any]], lost_ts: float) -> dict[str, float | None]:
    """Seconds after the loss when each stage was first reached: a survivor's agent saw
    its worker fail, a new agent's standby was ready (replaced modes), an agent started
    the new attempt (rendezvous done), rank 0's worker started, and it resumed."""
    def first(name: str, **match: Any) -> float | None:
        found = [float(e["ts"]) for e in events if e.get("event") == name
                 and float(e["ts"]) > lost_ts and all(e.get(k) == v for k, v in match.items())]
        return round(min(found) - lost_ts, 3) if found else None

    return {"failure_detected": first("agent.failure_detected"),
            "new_agent_standby_ready": first("agent.standby_ready"),
            "attempt_started": first("agent.attempt_started"),
            "worker_started": first("worker.start", rank=0),
            "resumed": first("resume", rank=0)}


def parked(records: Path) -> bool:
    """Both ranks passed step LOSE_AT with their saves committed, and idle in the
    all-reduce (each touched its mark after ``snap.wait()``)."""
    return len(list(records.glob("parked-rank*"))) >= 2


def first_new_step(records: Path, after_ts: float) -> float | None:
    found = [float(r["ts"]) for r in read_records(records)
             if float(r["ts"]) > after_ts and int(r["rank"]) == 0]
    return min(found) if found else None


def step_rate(records: Path, before_ts: float) -> float | None:
    """Steps per second of rank 0 over steps 3..LOSE_AT (start-up and the park left out)."""
    ts = {int(r["step"]): float(r["ts"]) for r in read_records(records)
          if int(r["rank"]) == 0 and float(r["ts"]) < before_ts}
    if 3 not in ts or LOSE_AT not in ts:
        return None
    return (LOSE_AT - 3) / (ts[LOSE_AT] - ts[3])


def wait_for(predicate: Any, timeout_s: float, job: NodeJob, what: str,
             running: bool = True) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if running and not job.running():
            raise RuntimeError(f"every agent exited before {what}; see {job.workdir}")
        time.sleep(0.02)
    raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def loopback_bytes() -> int:
    """Bytes received on ``lo`` (this network namespace's loopback) so far."""
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, fields = line.partition(":")
        if name.strip() == "lo":
            return int(fields.split()[0])
    return 0


# ---------------------------------------------------------------------------------------
# the runs and the report
# ---------------------------------------------------------------------------------------
def run_mode(mode: str, size_mb: int, args: argparse.Namespace, endpoint: str | None,
             base: Path) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix=f"{mode}-{size_mb}-", dir=base))
    if mode == "durable-s3":
        assert endpoint is not None
        options = {"key": "bench", "secret": "bench",  # moto takes any: placeholders
                   "client_kwargs": {"endpoint_url": endpoint}}
        prefix = f"s3://{BUCKET}/{work.name}"
        env = {"ELASTICTRAIN_STORAGE__STORAGE_OPTIONS": json.dumps(options)}
        storage = prefix
    else:
        storage, env = str(work / "storage"), {}
    load_before = load_average()
    result = lose_a_node(mode, size_mb, work, storage, env, args.timeout_s)
    load_after = load_average()
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return {**result, "load_avg_before": round(load_before, 2),
            "load_avg_after": round(load_after, 2),
            "noisy": noisy(load_before, load_after, None)}


def summarise(runs: list[dict[str, Any]], size_mb: int, netns: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode in MODES:
        rows = [r for r in runs if r["mode"] == mode and r["size_mb"] == size_mb]
        if not rows:
            continue
        out[mode] = {
            "loss_to_first_step_s": spread([r["loss_to_first_step_s"] for r in rows]),
            "restore_s": spread([r["restore_s"] for r in rows if r["restore_s"] is not None]
                                or [float("nan")]),
            "lost_steps": sorted({r["lost_steps"] for r in rows}, key=str),
            "tiers": sorted({str(r["tier"]) for r in rows}),
        }
    base = [r["loss_to_first_step_s"] for r in runs
            if r["mode"] == "durable-local" and r["size_mb"] == size_mb]
    for mode in ("durable-s3", "shrink", "peer"):
        rows = [r["loss_to_first_step_s"] for r in runs
                if r["mode"] == mode and r["size_mb"] == size_mb]
        if rows and base:
            out[mode]["vs_durable_local"] = ratio_spread(rows, base)
    peer = [r for r in runs if r["mode"] == "peer" and r["size_mb"] == size_mb]
    local = [r for r in runs if r["mode"] == "durable-local" and r["size_mb"] == size_mb]
    rate_p = [r["step_rate_before"] for r in peer if r["step_rate_before"]]
    rate_l = [r["step_rate_before"] for r in local if r["step_rate_before"]]
    if rate_p and rate_l:  # across runs, so the machine's load drifts weigh in
        out["step_rate_replicas_1_vs_0"] = ratio_spread(rate_p, rate_l)
    if peer and local and netns:  # else the loopback counts the machine's other traffic
        # Both train steps 1..LOSE_AT alike before the loss: what the peer runs carried
        # beyond that is what crosses nodes for them, per step and node.
        base = statistics.median(q["loopback_bytes_before_loss"] for q in local)
        out["extra_bytes_per_step_per_node"] = spread(
            [(p["loopback_bytes_before_loss"] - base) / LOSE_AT / 2 for p in peer])
    return out


def table(report: dict[str, Any]) -> str:
    lines = []
    for size, summary in report["summary"].items():
        lines.append(f"state: demo model + {size} MiB ballast")
        lines.append(f"  {'mode':14} {'loss -> first step (s)':28} {'restore() (s)':26} "
                     f"{'tier':10} lost steps")
        for mode in MODES:
            if mode in summary:
                row = summary[mode]
                lines.append(f"  {mode:14} {fmt(row['loss_to_first_step_s'], 2):28} "
                             f"{fmt(row['restore_s'], 3):26} {','.join(row['tiers']):10} "
                             f"{row['lost_steps']}")
        for mode in MODES:
            rows = [r["breakdown_s"] for r in report["runs"]
                    if r["mode"] == mode and str(r["size_mb"]) == size and "breakdown_s" in r]
            medians = {k: statistics.median(found) for k in (rows[0] if rows else {})
                       if (found := [v[k] for v in rows if v[k] is not None])}
            if medians:
                lines.append(f"  {mode} (median s after the loss): "
                             + ", ".join(f"{k} {v:.2f}" for k, v in medians.items()))
        for key in ("step_rate_replicas_1_vs_0", "extra_bytes_per_step_per_node"):
            if key in summary:
                lines.append(f"  {key}: {fmt(summary[key], 3)}")
    lines += report["skipped"]
    lines.append(f"load average {report['load_avg_start']} -> {report['load_avg_end']}")
    return "\n".join(lines)


DASH, TIMES = "\u2013", "\u00d7"  # the pages' range dash and multiplication sign


def doc_table(parts: list[str]) -> str:
    """docs/benchmarks.md's table from saved reports' runs, ``FILE:RUN`` each, in order:
    a row per mode with its spread; the last column divides by durable-local, or, in a
    run without it, divides peer by durable-s3."""
    def secs(s: dict[str, float], digits: int) -> str:
        return f"{s['median']:.{digits}f} s [{s['min']:.{digits}f}{DASH}{s['max']:.{digits}f}]"

    def ratio(s: dict[str, float]) -> str:
        return f"{s['median']:.2f} [{s['min']:.2f}{DASH}{s['max']:.2f}]"

    lines = ["| state | mode | node loss → first step | `restore()` | read | steps lost | "
             "÷ durable-local |", "|---|---|---|---|---|---|---|"]
    shown_sizes: set[str] = set()
    for part in parts:
        path, run = part.rsplit(":", 1)
        for size, summary in json.loads(Path(path).read_text())[run]["summary"].items():
            state = "demo model" if size == "0" else f"{int(size) / 1024:g} GiB"
            for mode in (m for m in MODES if m in summary):
                row = summary[mode]
                lost = row["lost_steps"]
                memory = row["tiers"] == ["memory"]
                read = ("memory (rescued step)" if memory and lost == [0]
                        else ",".join(row["tiers"]))
                if mode == "durable-local":
                    versus = "1"
                elif "vs_durable_local" in row:
                    versus = ratio(row["vs_durable_local"])
                elif mode == "peer" and "durable-s3" in summary:
                    versus = ratio(spreads_ratio(row["loss_to_first_step_s"],
                                                   summary["durable-s3"]["loss_to_first_step_s"]))
                    versus = versus.replace(" [", f" {TIMES} durable-s3 [", 1)
                else:
                    versus = ""
                steps = ", ".join(str(n) for n in lost)
                cells = ["" if state in shown_sizes else state, mode,
                         secs(row["loss_to_first_step_s"], 1), secs(row["restore_s"], 2),
                         read, f"**{steps}**" if lost == [0] else steps, versus]
                lines.append("|" + "|".join(f" {c} " if c else " " for c in cells) + "|")
                shown_sizes.add(state)
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mb", type=int, nargs="+", default=[0],
                   help="ballast beside the demo model, MiB (0: the demo's size)")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json", metavar="FILE", help="write the report here")
    p.add_argument("--workdir", default=None, help="where the runs go (default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep each run's directory")
    p.add_argument("--timeout-s", type=float, default=START_TIMEOUT_S,
                   help="the longest wait for each stage: the loss, the first resumed step, "
                   "the end (default 600)")
    p.add_argument("--netns", action="store_true",
                   help="run in a network namespace of its own (root): the loopback "
                   "traffic is then the benchmark's alone")
    p.add_argument("--table", nargs="+", metavar="FILE:RUN",
                   help="print docs/benchmarks.md's table from saved reports' runs")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    if sys.argv[1:2] == ["--worker"]:
        worker(int(sys.argv[2]), sys.argv[3], sys.argv[4])
        return
    args = parse_args(argv)
    if args.table:
        print(doc_table(args.table))
        return
    if args.netns and not os.environ.get("BENCH_NODELOSS_NETNS"):
        command = [sys.executable, __file__, *(a for a in sys.argv[1:] if a != "--netns")]
        os.execvp("unshare", ["unshare", "--net", "--", "sh", "-c",
                              'ip link set lo up && BENCH_NODELOSS_NETNS=1 exec "$@"', "sh",
                              *command])
    skipped = []
    modes = list(args.modes)
    if "peer" in modes and not peer_available():
        modes.remove("peer")
        skipped.append("peer: skipped: this elastictrain has no snapshot."
                       f"{PEER_SETTING} setting (no restore from peers' memory; a lost node "
                       "falls back to durable storage); step-rate and bytes-sent figures "
                       "need it too")
    base = Path(args.workdir or tempfile.mkdtemp(prefix="bench-nodeloss-"))
    base.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"load_avg_start": round(load_average(), 2), "runs": [],
                              "skipped": skipped, "lose_at": LOSE_AT,
                              "durable_every": DURABLE_EVERY, "memory_every": MEMORY_EVERY,
                              "netns": bool(os.environ.get("BENCH_NODELOSS_NETNS"))}
    from bench_s3 import moto_server

    with moto_server() as endpoint:
        if "durable-s3" in modes:
            import s3fs

            s3fs.S3FileSystem(key="bench", secret="bench",
                              client_kwargs={"endpoint_url": endpoint}).mkdir(BUCKET)
        for size in args.size_mb:
            for rep in range(args.reps):
                for mode in modes:  # interleaved: load drifts hit every mode alike
                    row = run_mode(mode, size, args, endpoint, base)
                    row["rep"] = rep
                    report["runs"].append(row)
                    print(f"{mode} {size} MiB rep {rep}: {row['loss_to_first_step_s']:.2f}s "
                          f"to the first step, tier {row['tier']}, lost {row['lost_steps']} "
                          f"(load {row['load_avg_before']})", file=sys.stderr)
    report["load_avg_end"] = round(load_average(), 2)
    report["summary"] = {str(size): summarise(report["runs"], size, report["netns"])
                         for size in args.size_mb}
    print(table(report))
    if args.json:
        write_json(args.json, report)
    if not args.workdir:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
