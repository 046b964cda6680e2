"""How elastictrain's costs grow with the world size: one small job at 2 to 32 ranks.

    python scripts/bench_scale.py --json bench-scale.json --plot bench-scale.png
    python scripts/bench_scale.py --sizes 2 8 --quick          # a smoke test

Per world size N the same job runs under two ``elastictrain run`` agents (N/2 workers
each, a c10d rendezvous on 127.0.0.1, gloo): a ``Linear(16, 16)`` under DDP plus a fixed
ballast per rank (``--ballast-kb``: a replicated buffer, and for the sharded saves one
DTensor with that many bytes per rank), so the bytes are the same at every N and only
the number of ranks changes. Attempt 0 measures, between barriers:

* the step time with ``manager.step()`` and without it (alternating blocks of steps);
* replicated saves and sharded saves, to local disk and to S3 (a moto server in a child
  process): blocking time (``save()`` returns) and commit latency (durable), and the
  storage operations of the third save (steady state: a save plus the retention that
  follows it);
* a restore of each kind (a fresh manager), its time and storage operations;
* bytes each rank receives at a save (the RNG states gathered for the writer);
* memory per rank: resident set and PSS (``/proc/self/smaps_rollup``; PSS shares the
  standby's copy-on-write pages among the processes that map them, so the sum of PSS
  counts them once).

Then rank N-1 is SIGKILLed by PID; the agents restart every worker, which restores the
newest local snapshot: kill → first resumed step, with its parts from the agents' and
workers' events (detection, agent rendezvous, process group init, restore agreement,
load). Then both agents get SIGTERM: notice → final snapshot committed.

Storage operations are counted twice: on local disk at the ``Store`` interface (one call
= one operation: ``list_dir`` LIST, ``exists``/``size`` HEAD, reads GET, writes PUT,
``delete`` DELETE, ``rename`` RENAME) and on S3 as the HTTP requests the moto server
received, per access key (each rank signs with its own key), so both are per rank.
Events written per attempt are counted from the event files. One run per size: the
figures are single measurements (the step times are medians of their blocks); quote the
load average beside them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pickle
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

T_START = time.time()  # first thing: a worker's start as seen by itself

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import (  # noqa: E402
    free_port,
    load_average,
    noisy,
    read_json,
    rounded,
    write_json,
)

REPO = Path(__file__).resolve().parents[1]
BUCKET = "scale"
SIZES = (2, 4, 8, 16, 32)
AGENTS = 2
STEP_PAUSE_S = 0.02  # the job's compute per step in the steady phases (leaves CPU free)
TIMEOUT_S = 900.0


# ---------------------------------------------------------------------------------------
# Storage operations on local disk: a Store that logs each call (one file per process)
# ---------------------------------------------------------------------------------------
_OPS = {"list_dir": "LIST", "exists": "HEAD", "size": "HEAD", "read_bytes": "GET",
        "open_read": "GET", "read_into": "GET", "write_bytes": "PUT", "open_write": "PUT",
        "delete": "DELETE", "rename": "RENAME", "check_writable": "PUT"}


class LoggedStore:
    """Forwards to a Store and appends ``time rank OP`` per call to ``ops-<pid>.log``."""

    def __init__(self, inner: Any, log_dir: str, rank: int) -> None:
        self.inner, self.log_dir, self.rank = inner, log_dir, rank

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or "inner" not in self.__dict__:
            raise AttributeError(name)
        attr = getattr(self.inner, name)
        op = _OPS.get(name)
        if op is None:
            return attr

        def logged(*args: Any, **kwargs: Any) -> Any:
            with open(Path(self.log_dir) / f"ops-{os.getpid()}.log", "a") as f:
                f.write(f"{time.time():.6f} {self.rank} {op}\n")
            return attr(*args, **kwargs)
        return logged


def read_local_ops(log_dir: Path) -> list[tuple[float, str, str]]:
    found = []
    for file in log_dir.glob("ops-*.log"):
        for line in file.read_text().splitlines():
            t, rank, op = line.split()
            found.append((float(t), f"rank{rank}", op))
    return found


# ---------------------------------------------------------------------------------------
# S3: moto in a child process, counting requests per access key
# ---------------------------------------------------------------------------------------
_CREDENTIAL = re.compile(r"Credential=([^/]+)/")


def s3_op(method: str, query: str) -> str:
    if method == "GET" and "list-type" in query:
        return "LIST"
    if method == "POST" and "delete" in query:
        return "DELETE"  # DeleteObjects: one request, up to 1000 keys
    return {"GET": "GET", "HEAD": "HEAD", "PUT": "PUT", "DELETE": "DELETE",
            "POST": "POST"}.get(method, method)


def serve_moto(port: int) -> None:
    """(child process) moto's S3 app behind a counter; ``GET /__ops`` returns the log."""
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import WSGIRequestHandler, run_simple

    app = DomainDispatcherApplication(create_backend_app)
    seen: list[tuple[float, str, str]] = []
    lock = threading.Lock()

    def counted(environ: dict[str, Any], start_response: Any) -> Any:
        if environ.get("PATH_INFO") == "/__ops":
            with lock:
                body = json.dumps(seen).encode()
            start_response("200 OK", [("Content-Type", "application/json")])
            return [body]
        key = _CREDENTIAL.search(environ.get("HTTP_AUTHORIZATION", ""))
        with lock:
            seen.append((time.time(), key.group(1) if key else "?",
                         s3_op(environ["REQUEST_METHOD"], environ.get("QUERY_STRING", ""))))
        return app(environ, start_response)

    class Quiet(WSGIRequestHandler):
        def log(self, *args: Any) -> None:
            pass

    run_simple("127.0.0.1", port, counted, threaded=True, request_handler=Quiet)


@contextlib.contextmanager
def moto_server(work: Path) -> Iterator[str]:
    port = free_port()
    with open(work / "moto.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--moto",
                                 str(port)], stdout=subprocess.DEVNULL, stderr=log,
                                start_new_session=True)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        _poll(lambda: _reachable(endpoint), 60, "the moto server")
        import boto3

        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                     aws_access_key_id="harness", aws_secret_access_key="x"
                     ).create_bucket(Bucket=BUCKET)
        yield endpoint
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _reachable(endpoint: str) -> bool:
    try:
        urllib.request.urlopen(endpoint + "/__ops", timeout=2).close()
        return True
    except OSError:
        return False


def s3_ops(endpoint: str) -> list[tuple[float, str, str]]:
    with urllib.request.urlopen(endpoint + "/__ops", timeout=30) as r:
        return [tuple(x) for x in json.loads(r.read())]  # type: ignore[misc]


# ---------------------------------------------------------------------------------------
# worker side (run by elastictrain run)
# ---------------------------------------------------------------------------------------
def worker(args: argparse.Namespace) -> None:
    import elastictrain as et

    t_imported = time.time()
    rt = et.init()
    t_joined = time.time()
    import torch
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    out, rank = Path(args.out), rt.rank
    # After the kill, the agent whose worker died counts a restart and the other sees a
    # membership change (its workers' restart count stays 0): the harness's mark decides.
    attempt = 1 if (out / "killed").exists() else 0
    torch.manual_seed(0)
    net = torch.nn.Linear(16, 16)
    ballast = args.ballast_kb << 10
    net.register_buffer("ballast", torch.full((ballast,), 7, dtype=torch.uint8))
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(net, ["ballast"])
    ddp = DistributedDataParallel(net, broadcast_buffers=False)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    gathered = _count_gathered(rt.ctx)
    snap = et.SnapshotManager(_local(args, rank), model=ddp, optimizer=opt,
                              every_steps=10**9, keep=2)
    t_model = time.time()
    info = snap.restore()
    t_restored = time.time()

    def train_step() -> None:
        ddp(torch.randn(4, 16)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    record = {"t_start": T_START, "t_imported": t_imported, "t_joined": t_joined,
              "t_model": t_model, "t_restored": t_restored, "from_step": info.from_step}
    if attempt == 0:
        record.update(_measure(args, rt, snap, ddp, opt, train_step, gathered))
    train_step()
    snap.step()
    record["t_first_step"] = time.time()
    _write(out, f"attempt{attempt}-rank{rank}.json", record)
    while True:  # until the harness kills a worker (attempt 0) or sends a notice (1)
        train_step()
        snap.step()  # on an agreed notice: the final snapshot, then exit 75
        time.sleep(STEP_PAUSE_S)


def _local(args: argparse.Namespace, rank: int, sub: str = "") -> Any:
    from elastictrain.storage import open_store

    root = Path(args.storage) / sub if sub else Path(args.storage)
    return LoggedStore(open_store(str(root)), args.out + "/ops", rank)


def _s3(args: argparse.Namespace, rank: int, prefix: str) -> Any:
    from elastictrain.core.config import StorageConfig

    return StorageConfig(url=f"s3://{BUCKET}/{prefix}", storage_options={
        "key": f"rank{rank}", "secret": "x", "client_kwargs": {"endpoint_url": args.s3}})


class _Gathered:
    """Bytes this rank received through the manager's object collectives at a save."""

    def __init__(self) -> None:
        self.bytes = 0


def _count_gathered(ctx: Any) -> _Gathered:
    """Wrap the context's object collectives (on this instance): count what arrives."""
    counter = _Gathered()
    for name in ("all_gather_object", "gather_object"):
        inner = getattr(ctx, name, None)
        if inner is None:
            continue

        def wrapped(*a: Any, _inner: Any = inner, _name: str = name, **k: Any) -> Any:
            result = _inner(*a, **k)
            objs = result[0] if _name == "gather_object" else result  # (objects, agreed)
            if objs is not None:
                counter.bytes += sum(len(pickle.dumps(o)) for i, o in enumerate(objs)
                                     if i != ctx.rank)
            return result
        setattr(ctx, name, wrapped)
    return counter


def _mark(out: Path, ctx: Any, name: str, t0: float) -> None:
    """(rank 0, after a barrier) the phase ``name`` spans ``t0`` → now."""
    ctx.barrier()
    if ctx.rank == 0:
        with open(out / "phases.jsonl", "a") as f:
            f.write(json.dumps({"phase": name, "t0": t0, "t1": time.time()}) + "\n")
    ctx.barrier()


def _measure(args: argparse.Namespace, rt: Any, snap: Any, ddp: Any, opt: Any,
             train_step: Any, gathered: _Gathered) -> dict[str, Any]:
    import elastictrain as et

    ctx, out, rank = rt.ctx, Path(args.out), rt.rank
    rec: dict[str, Any] = {}
    # 1. step time with and without manager.step(), in alternating blocks
    with_et, without = [], []
    for _ in range(args.blocks):
        for samples, call in ((without, False), (with_et, True)):
            ctx.barrier()
            for _ in range(args.block_steps):
                t = time.perf_counter()
                train_step()
                if call:
                    snap.step()
                samples.append(time.perf_counter() - t)
    rec["step_s"] = {"with": statistics.median(with_et), "without": statistics.median(without)}

    # 2. saves: replicated to local disk and S3, sharded to both; the third is counted
    sharded = _sharded_model(ctx, args.ballast_kb << 10)
    saves = {"replicated_local": et.SnapshotManager(_local(args, rank, "replicated"),
                                                    model=ddp, optimizer=opt,
                                                    every_steps=10**9, keep=2),
             "replicated_s3": et.SnapshotManager(_s3(args, rank, "replicated"), model=ddp,
                                                 optimizer=opt, every_steps=10**9, keep=2),
             "sharded_local": et.SnapshotManager(_local(args, rank, "sharded"), model=sharded,
                                                 every_steps=10**9, keep=2, sharded=True),
             "sharded_s3": et.SnapshotManager(_s3(args, rank, "sharded"), model=sharded,
                                              every_steps=10**9, keep=2, sharded=True)}
    for name, manager in saves.items():
        for i in range(3):
            train_step()
            snap.step()
            manager.step_count = snap.step_count
            gathered.bytes = 0
            ctx.barrier()
            t0 = time.time()
            started = time.perf_counter()
            handle = manager.save()
            blocking = time.perf_counter() - started
            handle.wait()
            durable = time.perf_counter() - started
            if name.startswith("replicated"):
                # Retention runs after the commit, on the persister's thread: its
                # operations belong to this save, not to the next one's window (a
                # sharded save prunes before it is done). The next save starts another.
                manager._saver.close()
            if i == 2:
                rec[f"save_{name}"] = {"blocking_s": blocking, "durable_s": durable,
                                       "gathered_bytes": gathered.bytes}
                _mark(out, ctx, f"save_{name}", t0)
            else:
                ctx.barrier()
    # 3. restores by a fresh manager of each kind
    for name in saves:
        kind = name.split("_")[0]
        store = _local(args, rank, kind) if name.endswith("local") else _s3(args, rank, kind)
        model = sharded if "sharded" in name else ddp
        manager = et.SnapshotManager(store, model=model, every_steps=10**9,
                                     sharded="sharded" in name,
                                     optimizer=None if "sharded" in name else opt)
        ctx.barrier()
        t0 = time.time()
        started = time.perf_counter()
        restored = manager.restore()
        rec[f"restore_{name}"] = {"s": time.perf_counter() - started,
                                  "from_step": restored.from_step}
        _mark(out, ctx, f"restore_{name}", t0)
    rec["memory"] = _memory()
    snap.save().wait()  # what attempt 1 restores
    return rec


def _sharded_model(ctx: Any, nbytes: int) -> Any:
    """A module whose one parameter is a DTensor with ``nbytes`` on each rank."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (ctx.world_size,))
    module = torch.nn.Module()
    local = torch.full((nbytes // 4,), float(ctx.rank))
    module.weight = torch.nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)]),
                                       requires_grad=False)
    return module


def _memory() -> dict[str, int]:
    fields = {}
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        parts = line.split()
        if parts[0] in ("Rss:", "Pss:"):
            fields[parts[0][:-1].lower() + "_kb"] = int(parts[1])
    return fields


def _write(out: Path, name: str, record: dict[str, Any]) -> None:
    tmp = out / f".{name}.tmp"
    tmp.write_text(json.dumps(record))
    tmp.replace(out / name)  # atomic: the harness polls for the file


# ---------------------------------------------------------------------------------------
# harness side
# ---------------------------------------------------------------------------------------
def _poll(predicate: Any, timeout: float, what: str, procs: list[Any] = ()) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        for proc in procs:
            if proc.poll() is not None:
                raise RuntimeError(f"an agent exited {proc.returncode} before {what}")
        time.sleep(0.02)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")


def _events(directory: Path) -> list[dict[str, Any]]:
    """Every event in the directory's files, each tagged with its file's name."""
    from elastictrain.runlog.events_read import read_event_files  # here: workers time their start

    return [{**event, "_file": name} for name, events in read_event_files(directory)
            for event in events]


def _first(evs: list[dict[str, Any]], name: str, **match: Any) -> dict[str, Any] | None:
    for e in evs:
        if e.get("event") == name and all(e.get(k) == v for k, v in match.items()):
            return e
    return None


def run_size(world: int, args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix=f"bench-scale-{world}-", dir=args.dir))
    out, ev, storage = work / "out", work / "events", work / "storage"
    (out / "ops").mkdir(parents=True)
    load_before = load_average()
    started = time.monotonic()
    with moto_server(work) as endpoint:
        agents = _start_agents(world, work, out, ev, storage, endpoint, args)
        try:
            result = _drive(world, agents, out, ev, storage, endpoint)
        finally:
            _stop(agents, ev)
    result.update(world_size=world, agents=AGENTS, wall_s=time.monotonic() - started,
                  load_avg_before=load_before, load_avg_after=load_average())
    if not args.keep:
        subprocess.run(["rm", "-rf", str(work)], check=False)
    else:
        result["workdir"] = str(work)
    return result


def _start_agents(world: int, work: Path, out: Path, ev: Path, storage: Path, endpoint: str,
                  args: argparse.Namespace) -> list[subprocess.Popen[bytes]]:
    port = free_port()
    env = dict(os.environ)
    env.update({"TMPDIR": str(work), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
                "PYTHONPATH": os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]),
                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
                "ELASTICTRAIN_LOG__EVENTS_DIR": str(ev),
                "ELASTICTRAIN_STORAGE__URL": str(storage)})
    cmd = [sys.executable, "-m", "elastictrain.cli", "run", "--no-view",
           f"--nproc-per-node={world // AGENTS}", f"--nnodes={AGENTS}:{AGENTS}",
           "--max-restarts=2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
           f"--rdzv-id=scale-{port}", str(Path(__file__).resolve()),
           "--worker", "--out", str(out), "--storage", str(storage), "--s3", endpoint,
           "--ballast-kb", str(args.ballast_kb), "--blocks", str(args.blocks),
           "--block-steps", str(args.block_steps)]
    agents = []
    for i in range(AGENTS):
        with open(work / f"agent{i}.log", "wb") as log:
            agents.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=work,
                                           env=env, start_new_session=True))
        if i == 0:  # the rendezvous host listens before the others join
            _poll(lambda: _port_open(port), 120, "the first agent's rendezvous port", agents)
    return agents


def _port_open(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _drive(world: int, agents: list[Any], out: Path, ev: Path, storage: Path,
           endpoint: str) -> dict[str, Any]:
    _poll(lambda: all((out / f"attempt0-rank{r}.json").exists() for r in range(world)),
          TIMEOUT_S, "attempt 0's measurements", agents)
    victim = _poll(lambda: _first(_events(ev), "worker.start", rank=world - 1,
                                  restart_count=0), 60, "the last rank's PID")
    (out / "killed").write_text(str(victim["pid"]))
    t_kill = time.time()
    os.kill(int(victim["pid"]), signal.SIGKILL)
    _poll(lambda: all((out / f"attempt1-rank{r}.json").exists() for r in range(world)),
          TIMEOUT_S, "the first step after the resume", agents)
    ops_s3 = s3_ops(endpoint)
    t_notice = time.time()
    for agent in agents:
        agent.send_signal(signal.SIGTERM)
    codes = [agent.wait(timeout=TIMEOUT_S) for agent in agents]
    evs = _events(ev)
    phases = [json.loads(line) for line in (out / "phases.jsonl").read_text().splitlines()]
    records0 = [read_json(out / f"attempt0-rank{r}.json") or {} for r in range(world)]
    records1 = [read_json(out / f"attempt1-rank{r}.json") or {} for r in range(world)]
    ops_local = read_local_ops(out / "ops")  # again: the final snapshot's are in it now
    return {
        "exit_codes": codes,
        "objects": _objects(storage),
        "step": _steps(records0),
        "saves": {p["phase"]: _phase(p, records0, ops_local, ops_s3, world)
                  for p in phases},
        "recovery": _recovery([e for e in evs if e["ts"] >= t_kill], records1, t_kill),
        "preemption": _preemption([e for e in evs if e["ts"] >= t_notice], t_notice),
        "events_per_attempt": _event_counts(evs, t_kill),
        "memory": _memory_totals(records0),
    }


def _objects(storage: Path) -> dict[str, Any]:
    """Sizes of the newest snapshot of each kind on local disk: manifest, objects."""
    found = {}
    for kind, root in (("replicated", storage / "replicated"), ("sharded", storage / "sharded")):
        newest = sorted((root / "snapshots").glob("step_*"))[-1]
        manifest = json.loads((newest / "MANIFEST.json").read_text())
        found[kind] = {"manifest_bytes": (newest / "MANIFEST.json").stat().st_size,
                       "objects": len(manifest["objects"]),
                       "bytes": sum(o["size_bytes"] for o in manifest["objects"]),
                       "training_state_bytes": sum(
                           o["size_bytes"] for o in manifest["objects"]
                           if o["name"].startswith(("train-", "state")))}
    return found


def _steps(records: list[dict[str, Any]]) -> dict[str, Any]:
    with_et = [r["step_s"]["with"] for r in records]
    without = [r["step_s"]["without"] for r in records]
    return {"with_ms": statistics.median(with_et) * 1e3,
            "without_ms": statistics.median(without) * 1e3,
            "overhead_ms": (statistics.median(with_et) - statistics.median(without)) * 1e3}


def _phase(phase: dict[str, Any], records: list[dict[str, Any]], ops_local: list[Any],
           ops_s3: list[Any], world: int) -> dict[str, Any]:
    name = phase["phase"]
    ops = ops_s3 if name.endswith("s3") else ops_local
    inside = [(who, op) for t, who, op in ops if phase["t0"] <= t <= phase["t1"]]
    per_rank: dict[str, Counter[str]] = defaultdict(Counter)
    for who, op in inside:
        per_rank[who][op] += 1
    total: Counter[str] = Counter(op for _, op in inside)
    writer = per_rank.get("rank0", Counter())
    others = [per_rank.get(f"rank{r}", Counter()) for r in range(1, world)]
    other_max = {op: max((c[op] for c in others), default=0)
                 for op in set().union(*others)} if others else {}
    key = name.split("_", 1)[0]
    timings = [r.get(name, {}) for r in records]
    row: dict[str, Any] = {"ops_total": dict(total), "ops_rank0": dict(writer),
                           "ops_other_rank_max": other_max,
                           "ops_per_rank": {k: dict(v) for k, v in sorted(per_rank.items())}}
    if key == "save":
        row.update(blocking_s=max(t["blocking_s"] for t in timings),
                   durable_s=records[0][name]["durable_s"],
                   gathered_bytes_rank0=records[0][name]["gathered_bytes"],
                   gathered_bytes_other_max=max((t["gathered_bytes"] for t in timings[1:]),
                                                default=0))
    else:
        row.update(s=max(t["s"] for t in timings), from_step=records[0][name]["from_step"])
    return row


def _recovery(evs: list[dict[str, Any]], records: list[dict[str, Any]], t_kill: float
              ) -> dict[str, Any]:
    detected = _first(evs, "agent.failure_detected")
    started = [e for e in evs if e.get("event") == "agent.attempt_started"]
    discovered = [e for e in evs if e.get("event") == "snapshot.discovered"]
    last = max(records, key=lambda r: r["t_first_step"])
    load_s = max((e.get("duration_s") or 0.0 for e in discovered), default=0.0)
    restore_s = max(r["t_restored"] - r["t_model"] for r in records)
    return {
        "total_s": last["t_first_step"] - t_kill,
        "detection_s": detected["ts"] - t_kill if detected else None,
        "to_attempt_started_s": max(e["ts"] for e in started) - t_kill if started else None,
        "agent_rendezvous_s": max((e.get("rendezvous_s") or 0.0 for e in started),
                                  default=None),
        "process_start_s": max(r["t_start"] for r in records)
        - max(e["ts"] for e in started) if started else None,
        "process_group_init_s": max(r["t_joined"] - r["t_imported"] for r in records),
        "restore_s": restore_s,
        "restore_agreement_s": restore_s - load_s,
        "load_s": load_s,
        "first_step_s": max(r["t_first_step"] - r["t_restored"] for r in records),
        "from_step": records[0]["from_step"],
    }


def _preemption(evs: list[dict[str, Any]], t_notice: float) -> dict[str, Any]:
    saved = [e for e in evs if e.get("event") == "preempt.saved"]
    step = saved[0].get("snapshot_step") if saved else None
    committed = [e for e in evs if e.get("event") == "snapshot.committed"
                 and e.get("snapshot_step") == step]
    return {"final_step": step,
            "notice_to_committed_s": committed[0]["ts"] - t_notice if committed else None}


def _event_counts(evs: list[dict[str, Any]], t_kill: float) -> dict[str, Any]:
    """Per attempt (the first: before the kill): event files and events written by
    workers and by agents."""
    rows: dict[str, dict[str, Any]] = {}
    for e in evs:
        role = "agent" if e["_file"].startswith("agent-") else "worker"
        attempt = "attempt0" if e["ts"] < t_kill else "attempt1"
        row = rows.setdefault(attempt, {"worker_files": set(), "agent_files": set(),
                                        "worker_events": 0, "agent_events": 0,
                                        "bytes": 0})
        row[f"{role}_files"].add(e["_file"])
        row[f"{role}_events"] += 1
        row["bytes"] += len(json.dumps({k: v for k, v in e.items() if k != "_file"}))
    for row in rows.values():
        row["worker_events_per_file"] = row["worker_events"] / max(1, len(row["worker_files"]))
        row["worker_files"] = len(row["worker_files"])
        row["agent_files"] = len(row["agent_files"])
    return rows


def _memory_totals(records: list[dict[str, Any]]) -> dict[str, Any]:
    rss = [r["memory"]["rss_kb"] for r in records]
    pss = [r["memory"]["pss_kb"] for r in records]
    return {"rss_mb_per_rank_median": statistics.median(rss) / 1024,
            "pss_mb_per_rank_median": statistics.median(pss) / 1024,
            "pss_mb_total": sum(pss) / 1024}


def _stop(agents: list[Any], ev: Path) -> None:
    for agent in agents:
        if agent.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(agent.pid, signal.SIGKILL)
            agent.wait(timeout=60)
    me = Path(__file__).name
    for event in _events(ev) if ev.exists() else []:
        if event.get("event") == "worker.start":
            with contextlib.suppress(OSError):
                if me in Path(f"/proc/{event['pid']}/cmdline").read_bytes().decode(
                        errors="replace"):
                    os.kill(int(event["pid"]), signal.SIGKILL)


# ---------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------
def table(results: list[dict[str, Any]]) -> str:
    lines = [f"{'N':>3} {'kill→step':>9} {'rdzv':>6} {'pg':>6} {'agree':>6} {'load':>6} "
             f"{'notice→commit':>13} {'step+':>7} {'save_blk':>8} {'commit':>7} "
             f"{'ops/save s3':>11} {'ops/restore s3':>14} {'gathered':>9} {'wall':>6}"]
    for r in results:
        rec, s = r["recovery"], r["saves"]
        s3_save = sum(s["save_replicated_s3"]["ops_total"].values())
        s3_restore = sum(s["restore_replicated_s3"]["ops_total"].values())
        lines.append(
            f"{r['world_size']:>3} {rec['total_s']:>9.2f} {rec['agent_rendezvous_s'] or 0:>6.2f} "
            f"{rec['process_group_init_s']:>6.2f} {rec['restore_agreement_s']:>6.3f} "
            f"{rec['load_s']:>6.3f} {r['preemption']['notice_to_committed_s'] or -1:>13.2f} "
            f"{r['step']['overhead_ms']:>6.2f}ms "
            f"{s['save_replicated_local']['blocking_s']:>8.3f} "
            f"{s['save_replicated_local']['durable_s']:>7.3f} {s3_save:>11} {s3_restore:>14} "
            f"{s['save_replicated_local']['gathered_bytes_rank0']:>9} {r['wall_s']:>6.0f}")
    return "\n".join(lines)


def markdown_tables(results: list[dict[str, Any]]) -> tuple[str, str]:
    """The two tables of docs/scale.md, times and counts, one row per world size."""
    def ops(save: dict[str, Any], key: str = "ops_total") -> int:
        return sum(save.get(key, {}).values())

    times = ["| N | kill → first resumed step | agent rendezvous | process group init | "
             "restore agreement | load | notice → final snapshot committed | step without / "
             "with `manager.step()` |", "|---|---|---|---|---|---|---|---|"]
    counts = ["| N | S3 requests: replicated save / restore | sharded save / restore | "
              "busiest rank, sharded restore | RNG bytes received: writer / any other rank | "
              "worker events, attempt after a kill | PSS, all ranks |",
              "|---|---|---|---|---|---|---|"]
    for r in results:
        rec, s, step = r["recovery"], r["saves"], r["step"]
        notice = r["preemption"]["notice_to_committed_s"]
        times.append(
            f"| {r['world_size']} | {rec['total_s']:.2f} s | {rec['agent_rendezvous_s']:.2f} s "
            f"| {rec['process_group_init_s']:.2f} s | {rec['restore_agreement_s']:.3f} s "
            f"| {rec['load_s']:.3f} s | {'-' if notice is None else f'{notice:.2f} s'} "
            f"| {step['without_ms']:.1f} / {step['with_ms']:.1f} ms |")
        sharded_restore = s["restore_sharded_s3"]
        busiest = max(ops(sharded_restore, "ops_rank0"),
                      ops(sharded_restore, "ops_other_rank_max"))
        gathered = s["save_replicated_local"]
        after_kill = r["events_per_attempt"]["attempt1"]["worker_events"]
        times_kb = (f"{gathered['gathered_bytes_rank0'] / 1e3:.0f} kB / "
                    f"{gathered['gathered_bytes_other_max'] / 1e3:.0f}")
        counts.append(
            f"| {r['world_size']} | {ops(s['save_replicated_s3'])} / "
            f"{ops(s['restore_replicated_s3'])} | {ops(s['save_sharded_s3'])} / "
            f"{ops(sharded_restore)} | {busiest} | {times_kb} | {after_kill} "
            f"| {r['memory']['pss_mb_total']:,.0f} MB |")
    return "\n".join(times), "\n".join(counts)


def plot(results: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = [r["world_size"] for r in results]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    ax = axes[0]
    for key, label in (("total_s", "kill → first resumed step"),
                       ("agent_rendezvous_s", "agent rendezvous"),
                       ("process_group_init_s", "process group init"),
                       ("restore_s", "restore (agreement + load)")):
        ax.plot(n, [r["recovery"][key] or 0 for r in results], marker="o", label=label)
    ax.plot(n, [r["preemption"]["notice_to_committed_s"] or 0 for r in results], marker="s",
            label="notice → final snapshot committed")
    ax.set_ylabel("seconds")
    ax.set_title("recovery and preemption")
    ax = axes[1]
    for name in ("save_replicated_s3", "restore_replicated_s3", "save_sharded_s3",
                 "restore_sharded_s3"):
        ax.plot(n, [sum(r["saves"][name]["ops_total"].values()) for r in results],
                marker="o", label=name.replace("_", " ") + ": all ranks")
        ax.plot(n, [max(sum(r["saves"][name]["ops_rank0"].values()),
                        sum(r["saves"][name]["ops_other_rank_max"].values()))
                    for r in results], marker="x", linestyle=":",
                label=name.replace("_", " ") + ": busiest rank")
    ax.set_ylabel("S3 requests")
    ax.set_title("S3 requests per snapshot / restore")
    ax.set_yscale("log")
    ax = axes[2]
    ax.plot(n, [r["saves"]["save_replicated_local"]["gathered_bytes_rank0"] / 1e3
                for r in results], marker="o", label="RNG bytes gathered on the writer (kB)")
    ax.plot(n, [r["saves"]["save_replicated_local"]["gathered_bytes_other_max"] / 1e3
                for r in results], marker="x", label="... on any other rank (kB)")
    ax.plot(n, [r["step"]["overhead_ms"] for r in results], marker="s",
            label="per-step overhead (ms)")
    ax.set_title("per save and per step")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(n, [str(x) for x in n])
        ax.set_xlabel("world size (ranks, 2 agents)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=list(SIZES),
                   help="world sizes (even: two agents)")
    p.add_argument("--ballast-kb", type=int, default=256,
                   help="replicated ballast, and sharded bytes per rank (KiB)")
    p.add_argument("--quick", action="store_true", help="fewer steps (a smoke test)")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON ('-': stdout)")
    p.add_argument("--plot", metavar="PNG")
    p.add_argument("--keep", action="store_true", help="keep the work directories")
    p.add_argument("--dir", default=None, help="where work directories go")
    p.add_argument("--table", metavar="JSON",
                   help="print docs/scale.md's table of times of a saved --json report")
    p.add_argument("--counts", action="store_true", help="with --table: the table of counts")
    p.add_argument("--moto", type=int, help=argparse.SUPPRESS)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--storage", help=argparse.SUPPRESS)
    p.add_argument("--s3", help=argparse.SUPPRESS)
    p.add_argument("--blocks", type=int, default=3, help=argparse.SUPPRESS)
    p.add_argument("--block-steps", type=int, default=10, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.table:
        times, counts = markdown_tables(json.loads(Path(args.table).read_text())["results"])
        print(counts if args.counts else times)
        return None
    if args.moto:
        return serve_moto(args.moto)
    if args.worker:
        return worker(args)
    if any(n % AGENTS or n < AGENTS for n in args.sizes):
        p.error(f"--sizes: each a multiple of {AGENTS} (the agents)")
    if args.quick:
        args.blocks, args.block_steps = 2, 5
    load_before = load_average()
    started = time.monotonic()
    results = []
    for world in args.sizes:
        results.append(rounded(run_size(world, args), 4))
        print(f"N={world}: {results[-1]['wall_s']:.0f} s", file=sys.stderr, flush=True)
    load_after = load_average()
    report = {"bench": "scale", "cpus": os.cpu_count(), "agents": AGENTS,
              "ballast_kb": args.ballast_kb, "torch": _torch_version(),
              "date": time.strftime("%Y-%m-%d"), "load_avg_before": round(load_before, 2),
              "load_avg_after": round(load_after, 2),
              "noisy": noisy(load_before, load_after, None),
              "wall_s": round(time.monotonic() - started, 1), "results": results}
    if args.json:
        write_json(args.json, report)
    if args.json != "-":
        print(table(results))
        print(f"load average before/after {load_before:.2f}/{load_after:.2f}; "
              f"{report['wall_s']:.0f} s in all")
    if args.plot:
        plot(results, args.plot)


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


if __name__ == "__main__":
    main()
