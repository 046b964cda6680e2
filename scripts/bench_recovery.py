"""Recovery and preemption timings under real torchrun, against a bare torchrun cold start.

For each state size (``--size-mb``, 0 = the demo model alone, ~1.4 MB with AdamW):

1. **bare**: plain ``torchrun`` (no elastictrain) starts 2 workers that build the same
   model (demo CharGPT plus a ``size_mb`` ballast buffer) under DDP and take one step:
   launch → first completed step.
2. **recovery**: ``elastictrain run`` starts the same job using elastictrain; it snapshots
   step 2 and idles at step 3; we SIGKILL rank 1 by PID and time kill → first completed
   step after the resume, broken down from the agent's and workers' events:
   detection, stopping survivors, restart (agent rendezvous + spawn), process start,
   imports, worker rendezvous (process group), model build, snapshot load, first step.
   Twice per repetition: workers forked from the standby (the default) and, as the
   baseline in the same run, new interpreters (``launch.standby=false``).
3. **preemption**: with the resumed job training, SIGTERM to the launcher; time notice →
   final snapshot committed (and → launcher exit 75), against a 30 s grace period.

Also measured: the cost of the one small all-reduce per step that carries the time
trigger and the preemption flag (gloo, 2 ranks), and the snapshot's raw read time
(``read()`` of the payload: warm, then cold after ``posix_fadvise(DONTNEED)``).

Goals: recovery <= 1.3 x (bare cold start + raw read); final snapshot well inside 30 s;
issue 11: kill → first resumed step <= 1.5 s on the demo model, and <= 1.1 x (1.5 s +
the raw read of the snapshot) with a larger state. Each figure is the median of
``--reps`` repetitions (min-max beside the totals). Other jobs on the machine make
every figure noisy; compare ratios from one run.

    python scripts/bench_recovery.py                       # demo model, table
    python scripts/bench_recovery.py --size-mb 0 1024 --json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchlib import load_average, noisy, read_json, rounded

T_START = time.time()  # first thing: a worker's process start as seen by itself

REPO = Path(__file__).resolve().parents[1]
GRACE_S = 30.0
GOAL_RATIO = 1.3
GOAL_DEMO_S = 1.5  # issue 11: kill -> first resumed step on the demo model
GOAL_LARGE_RATIO = 1.1  # issue 11: larger states, against GOAL_DEMO_S + raw read
MODES = {"standby": "true", "new_processes": "false"}  # launch.standby
SAVE_AT, PAUSE_AT = 2, 3  # attempt 0 commits step 2, then idles after step 3


# ---------------------------------------------------------------------------------------
# worker side (run by torchrun): imports happen here, inside the timed region
# ---------------------------------------------------------------------------------------
def _build(size_mb: int) -> tuple[Any, Any, Any, Any]:
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from elastictrain.demo.corpus import CharDataset, CharVocab, encode_tensor
    from elastictrain.demo.model import CharGPT, GPTConfig
    from elastictrain.demo.windows import load_corpus_text

    torch.set_num_threads(1)
    text = load_corpus_text()
    vocab = CharVocab(text)
    config = GPTConfig(vocab_size=len(vocab))
    data = CharDataset(encode_tensor(vocab, text), config.block_size)
    torch.manual_seed(0)
    model = CharGPT(config)
    if size_mb:
        # Ballast: state to save and load, not to train; DDP leaves it alone.
        model.register_buffer("ballast", torch.full((size_mb << 20,), 7, dtype=torch.uint8))
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ["ballast"])
    ddp = DistributedDataParallel(model, broadcast_buffers=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return ddp, opt, data, torch


def _step(ddp: Any, opt: Any, data: Any, torch: Any, i: int) -> None:
    x, y = zip(*(data[(i * 8 + k) % len(data)] for k in range(8)), strict=True)
    _, loss = ddp(torch.stack(x), torch.stack(y))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


def _write(out: Path, name: str, record: dict[str, Any]) -> None:
    tmp = out / f".{name}.tmp"
    tmp.write_text(json.dumps(record))
    tmp.replace(out / name)  # atomic: the harness polls for the file


def worker_bare(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    t_imported = time.time()
    dist.init_process_group("gloo")
    t_joined = time.time()
    ddp, opt, data, torch = _build(args.ballast_mb)
    t_model = time.time()
    _step(ddp, opt, data, torch, 0)
    t_step = time.time()
    _write(Path(args.out), f"bare-rank{dist.get_rank()}.json",
           {"t_start": T_START, "t_imported": t_imported, "t_joined": t_joined,
            "t_model": t_model, "t_first_step": t_step})
    dist.destroy_process_group()


def worker_et(args: argparse.Namespace) -> None:
    import elastictrain as et

    t_imported = time.time()
    rt = et.init(et.load_settings(storage={"url": args.storage}))
    t_joined = time.time()
    ddp, opt, data, torch = _build(args.ballast_mb)
    t_model = time.time()
    snap = et.SnapshotManager(args.storage, model=ddp, optimizer=opt, ctx=rt.ctx,
                              every_steps=10**9,  # saves only where this script asks
                              progress_dir=Path(args.out) / "progress")
    info = snap.restore()
    t_restored = time.time()
    out, attempt, rank = Path(args.out), rt.env.restart_count, rt.rank
    if attempt == 0 and rank == 0:
        _write(out, "allreduce.json", _time_allreduce(rt.ctx))
    elif attempt == 0:
        _time_allreduce(rt.ctx)
    try:
        _train(snap, ddp, opt, data, torch, out, attempt, rank,
               {"t_start": T_START, "t_imported": t_imported, "t_joined": t_joined,
                "t_model": t_model, "t_restored": t_restored,
                "from_step": info.from_step, "lost_steps": info.lost_steps})
    finally:
        et.shutdown()


def _time_allreduce(ctx: Any, n: int = 300) -> dict[str, Any]:
    """The per-step agreement: one all-reduce of 3 int64 (time due, notice, notice age)."""
    for _ in range(20):
        ctx.all_reduce_max([0, 0, 0])
    samples = []
    for _ in range(n):
        t = time.perf_counter()
        ctx.all_reduce_max([0, 0, 0])
        samples.append(time.perf_counter() - t)
    return {"mean_us": round(statistics.mean(samples) * 1e6, 1),
            "p50_us": round(statistics.median(samples) * 1e6, 1),
            "p90_us": round(sorted(samples)[int(n * 0.9)] * 1e6, 1)}


def _train(snap: Any, ddp: Any, opt: Any, data: Any, torch: Any, out: Path, attempt: int,
           rank: int, timing: dict[str, Any]) -> None:
    durations: list[float] = []
    while True:
        t = time.perf_counter()
        _step(ddp, opt, data, torch, snap.step_count)
        snap.step()  # the final snapshot and exit 75 happen in here on a notice
        durations.append(time.perf_counter() - t)
        if len(durations) == 1:
            _write(out, f"attempt{attempt}-rank{rank}.json",
                   {**timing, "t_first_step": time.time(), "first_step": snap.step_count})
        if len(durations) == 21:
            _write(out, f"steps-attempt{attempt}-rank{rank}.json",
                   {"step_ms": round(statistics.median(durations[1:]) * 1e3, 2)})
        if attempt == 0 and snap.step_count == SAVE_AT:
            snap.save().wait()
        if attempt == 0 and snap.step_count == PAUSE_AT:
            _write(out, f"paused-rank{rank}.json", {"step": snap.step_count})
            while True:  # idle until the harness kills rank 1 (the agent then kills us)
                time.sleep(1)


# ---------------------------------------------------------------------------------------
# harness side
# ---------------------------------------------------------------------------------------
def _env(work: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"TMPDIR": str(work), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
                "PYTHONPATH": os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]),
                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    env.update(extra)
    return env


def _start(cmd: list[str], work: Path, log: str, **env: str) -> subprocess.Popen[bytes]:
    with open(work / log, "wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=work,
                                env=_env(work, **env), start_new_session=True)


def _stop(proc: subprocess.Popen[bytes], events_dir: Path | None = None) -> None:
    """Kill the launcher's session, then any worker it left (workers have their own
    sessions), by the PIDs their ``worker.start`` events recorded."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    for event in _events(events_dir) if events_dir else []:
        if event.get("event") == "worker.start":
            kill_if_ours(int(event["pid"]), str(Path(__file__).name))


def kill_if_ours(pid: int, needle: str) -> None:
    """SIGKILL ``pid`` if it is still one of our workers (its command line has ``needle``)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return
    if needle in cmdline:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _poll(predicate: Any, timeout: float, what: str,
          proc: subprocess.Popen[bytes] | None = None) -> Any:
    """Poll a condition every 10 ms (fails fast if ``proc`` ended first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the launcher exited {proc.returncode} before {what}; "
                               "see the logs in the work directory (--keep)")
        time.sleep(0.01)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")


def _events(directory: Path) -> list[dict[str, Any]]:
    found = []
    for file in sorted(directory.glob("*.jsonl")):
        for line in file.read_text().splitlines():
            try:
                found.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return found


def _first(evs: list[dict[str, Any]], name: str, **match: Any) -> dict[str, Any] | None:
    for e in evs:
        if e.get("event") == name and all(e.get(k) == v for k, v in match.items()):
            return e
    return None


def _worker_cmd(mode: str, out: Path, size_mb: int, storage: Path) -> list[str]:
    return [str(Path(__file__).resolve()), "--worker-mode", mode, "--out", str(out),
            "--ballast-mb", str(size_mb), "--storage", str(storage)]


def bench_bare(work: Path, size_mb: int, nproc: int) -> dict[str, float]:
    out = work / "bare"
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           "--monitor-interval=0.1", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0",
           f"--log-dir={work / 'bare-logs'}", *_worker_cmd("bare", out, size_mb, work / "x")]
    t0 = time.time()
    proc = _start(cmd, work, "bare.log")
    try:
        _poll(lambda: all((out / f"bare-rank{r}.json").exists() for r in range(nproc)), 600,
              "the bare first step", proc)
        proc.wait(timeout=300)
    finally:
        _stop(proc)
    recs = [read_json(out / f"bare-rank{r}.json") or {} for r in range(nproc)]
    last = max(recs, key=lambda r: r["t_first_step"])
    return {"total_s": last["t_first_step"] - t0,
            "launch_to_process_s": last["t_start"] - t0,
            "imports_s": last["t_imported"] - last["t_start"],
            "rendezvous_s": last["t_joined"] - last["t_imported"],
            "model_build_s": last["t_model"] - last["t_joined"],
            "first_step_s": last["t_first_step"] - last["t_model"]}


def bench_elastic(work: Path, size_mb: int, nproc: int, standby: str) -> dict[str, Any]:
    out, storage, ev = work / "et", work / "storage", work / "events"
    out.mkdir(parents=True)
    cmd = [sys.executable, "-m", "elastictrain.cli", "run", f"--nproc-per-node={nproc}",
           "--max-restarts=2", f"--log-dir={work / 'et-logs'}",
           *_worker_cmd("et", out, size_mb, storage)]
    proc = _start(cmd, work, "launcher.log", ELASTICTRAIN_LOG__EVENTS_DIR=str(ev),
                  ELASTICTRAIN_LAUNCH__STANDBY=standby)
    try:
        _poll(lambda: all((out / f"attempt0-rank{r}.json").exists() for r in range(nproc)),
              600, "attempt 0's first step", proc)
        manifest = storage / "snapshots" / f"step_{SAVE_AT:012d}" / "MANIFEST.json"
        _poll(manifest.exists, 600, "the snapshot of step 2", proc)
        _poll(lambda: all((out / f"paused-rank{r}.json").exists() for r in range(nproc)),
              600, "attempt 0 to idle at step 3", proc)
        victim = _poll(lambda: _first(_events(ev), "worker.start", rank=1), 60, "rank 1's pid")
        t_kill = time.time()
        os.kill(int(victim["pid"]), signal.SIGKILL)
        _poll(lambda: all(read_json(out / f"attempt1-rank{r}.json") for r in range(nproc)),
              600, "the first step after the resume", proc)
        resumed = read_json(out / "attempt1-rank0.json") or {}
        _poll(lambda: read_json(out / "steps-attempt1-rank0.json"), 600, "20 steps after resume",
              proc)
        t_notice = time.time()
        os.kill(proc.pid, signal.SIGTERM)
        code = proc.wait(timeout=600)
        t_exit = time.time()
    finally:
        _stop(proc, ev)
    evs = _events(ev)
    recovery = _recovery(evs, out, nproc, t_kill)
    recovery["resumed_from"] = resumed.get("from_step")
    recovery["started_by"] = started_by(evs)
    saved = [e for e in evs if e.get("event") == "preempt.saved"]
    final_step = saved[0]["snapshot_step"] if saved else None
    committed = _first(evs, "snapshot.committed", snapshot_step=final_step)
    payload = storage / "snapshots" / f"step_{SAVE_AT:012d}" / "state.pt"
    return {
        "recovery": recovery,
        "preemption": {
            "launcher_exit_code": code,
            "final_step": final_step,
            "notice_to_committed_s": committed["ts"] - t_notice if committed else None,
            "notice_to_saved_all_ranks_s": max(e["ts"] for e in saved) - t_notice
            if saved else None,
            "notice_to_launcher_exit_s": t_exit - t_notice,
            "final_save_s": max(e["save_s"] for e in saved) if saved else None,
            "grace_period_s": GRACE_S,
        },
        "allreduce_per_step": read_json(out / "allreduce.json"),
        "step_ms": (read_json(out / "steps-attempt1-rank0.json") or {}).get("step_ms"),
        "snapshot_bytes": payload.stat().st_size if payload.exists() else None,
        "raw_read": _raw_read(payload) if payload.exists() else None,
    }


def _recovery(evs: list[dict[str, Any]], out: Path, nproc: int, t_kill: float
              ) -> dict[str, Any]:
    detected = _first(evs, "agent.failure_detected")
    failed = _first(evs, "agent.worker_failed")
    started = _first(evs, "agent.attempt_started", restart_count=1)
    assert detected and failed and started, "agent events missing"
    recs = [read_json(out / f"attempt1-rank{r}.json") or {} for r in range(nproc)]
    last = max(recs, key=lambda r: r["t_first_step"])
    loaded = [e for e in evs if e.get("event") == "snapshot.loaded"
              and e.get("restart_count") == 1]
    load_s = max((e["duration_s"] for e in loaded), default=None)
    return {
        "total_s": last["t_first_step"] - t_kill,
        "detection_s": detected["ts"] - t_kill,
        "stop_survivors_s": failed["ts"] - detected["ts"],
        "restart_s": started["ts"] - failed["ts"],
        "agent_rendezvous_s": started.get("rendezvous_s"),
        "process_start_s": min(r["t_start"] for r in recs) - started["ts"],
        "imports_s": last["t_imported"] - last["t_start"],
        "worker_rendezvous_s": last["t_joined"] - last["t_imported"],
        "model_build_s": last["t_model"] - last["t_joined"],
        "snapshot_load_s": load_s,
        "restore_total_s": last["t_restored"] - last["t_model"],
        "first_step_s": last["t_first_step"] - last["t_restored"],
        "lost_steps": last.get("lost_steps"),
    }


def started_by(evs: list[dict[str, Any]]) -> str | None:
    """How the agent started the restarted group: ``standby`` or ``popen``."""
    started = _first(evs, "agent.attempt_started", restart_count=1)
    return None if started is None else started.get("started_by")


def _raw_read(path: Path) -> dict[str, float]:
    """read() of the payload: warm (page cache, as the restore just saw it), then cold."""
    def read() -> float:
        t = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            while f.read(16 << 20):
                pass
        return time.perf_counter() - t

    warm = read()
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # evict: a cold read
    finally:
        os.close(fd)
    return {"warm_s": warm, "cold_s": read()}


def run_size(size_mb: int, nproc: int, keep: bool, reps: int) -> dict[str, Any]:
    """``reps`` repetitions of: bare cold start, recovery from the standby, recovery
    with new processes (interleaved, so drift on the machine hits all three alike)."""
    work = Path(tempfile.mkdtemp(prefix=f"bench-recovery-{size_mb}mb-"))
    bare: list[dict[str, Any]] = []
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    try:
        for rep in range(reps):
            bare_dir = work / f"bare-{rep}"
            bare_dir.mkdir()
            bare.append(bench_bare(bare_dir, size_mb, nproc))
            for mode, flag in MODES.items():
                runs[mode].append(bench_elastic(work / f"{mode}-{rep}", size_mb, nproc, flag))
    finally:
        if not keep:
            subprocess.run(["rm", "-rf", str(work)], check=False)
    first = runs["standby"][0]
    raw = {k: _median([r["raw_read"][k] for r in runs["standby"] if r["raw_read"]])
           for k in ("warm_s", "cold_s")}
    bare_median = _medians(bare)
    recovery = {mode: _medians([r["recovery"] for r in rs]) for mode, rs in runs.items()}
    totals = {mode: [r["recovery"]["total_s"] for r in rs] for mode, rs in runs.items()}
    speedups = [old / new for old, new in zip(totals["new_processes"], totals["standby"],
                                              strict=True)]
    ratio = recovery["standby"]["total_s"] / (bare_median["total_s"] + raw["warm_s"])
    issue11_budget = (GOAL_DEMO_S if size_mb == 0
                      else GOAL_LARGE_RATIO * (GOAL_DEMO_S + raw["warm_s"]))
    final = first["preemption"]["notice_to_committed_s"]
    return {"size_mb": size_mb, "reps": reps, "bare_cold_start": bare_median,
            "recovery": recovery["standby"],
            "recovery_total_range_s": [min(totals["standby"]), max(totals["standby"])],
            "recovery_new_processes": recovery["new_processes"],
            "recovery_new_processes_total_range_s": [min(totals["new_processes"]),
                                                     max(totals["new_processes"])],
            "standby_speedup": {"median": _median(speedups), "min": min(speedups),
                                "max": max(speedups)},
            "preemption": first["preemption"],
            "allreduce_per_step": first["allreduce_per_step"], "step_ms": first["step_ms"],
            "snapshot_bytes": first["snapshot_bytes"], "raw_read": raw,
            "recovery_ratio": ratio, "issue11_budget_s": issue11_budget,
            "goals": {"recovery_within_1_3x": ratio <= GOAL_RATIO,
                      "issue11_recovery": recovery["standby"]["total_s"] <= issue11_budget,
                      "restarts_forked": all(r["recovery"]["started_by"] == "standby"
                                             for r in runs["standby"]),
                      "final_snapshot_within_grace": final is not None and final <= GRACE_S,
                      "exit_75": all(r["preemption"]["launcher_exit_code"] == 75
                                     for rs in runs.values() for r in rs)},
            "workdir": str(work) if keep else None}


def _median(values: list[float]) -> float:
    return float(statistics.median(values))


def _medians(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Per key: the median of the numbers; other values from the first record."""
    merged: dict[str, Any] = {}
    for key, value in records[0].items():
        numbers = [r.get(key) for r in records]
        if all(isinstance(n, (int, float)) and not isinstance(n, bool) for n in numbers):
            merged[key] = _median([float(n) for n in numbers])  # type: ignore[arg-type]
        else:
            merged[key] = value
    return merged


def table(results: list[dict[str, Any]]) -> str:
    rows: list[tuple[str, ...]] = []
    for r in results:
        rec, bare, pre = r["recovery"], r["bare_cold_start"], r["preemption"]
        old = r["recovery_new_processes"]
        low, high = r["recovery_total_range_s"]
        old_low, old_high = r["recovery_new_processes_total_range_s"]
        speed = r["standby_speedup"]
        rows += [
            (f"state {r['size_mb']} MB (+demo model), median of {r['reps']}", "standby",
             "new processes"),
            ("bare torchrun cold start → first step", f"{bare['total_s']:.2f} s", ""),
            ("snapshot raw read (warm / cold)",
             f"{r['raw_read']['warm_s']:.3f} / {r['raw_read']['cold_s']:.3f} s",
             f"{(r['snapshot_bytes'] or 0) / 1e6:.0f} MB"),
            ("SIGKILL → first step after resume",
             f"{rec['total_s']:.2f} s [{low:.2f}-{high:.2f}]",
             f"{old['total_s']:.2f} s [{old_low:.2f}-{old_high:.2f}]"),
            ("  new processes ÷ standby", f"{speed['median']:.1f}x "
             f"[{speed['min']:.1f}-{speed['max']:.1f}]", ""),
            ("  issue 11 budget", f"{r['issue11_budget_s']:.2f} s",
             "met" if r["goals"]["issue11_recovery"] else "MISSED"),
            ("  ÷ (bare cold start + raw read)", f"{r['recovery_ratio']:.2f}",
             f"goal ≤ {GOAL_RATIO}"),
        ]
        for key in ("detection_s", "stop_survivors_s", "restart_s", "process_start_s",
                    "imports_s", "worker_rendezvous_s", "model_build_s", "snapshot_load_s",
                    "first_step_s"):
            value, before = rec.get(key), old.get(key)
            rows.append((f"  {key[:-2].replace('_', ' ')}",
                         "-" if value is None else f"{value:.3f} s",
                         "-" if before is None else f"{before:.3f} s"))
        rows += [
            ("notice → final snapshot committed",
             f"{pre['notice_to_committed_s']:.2f} s" if pre["notice_to_committed_s"] else "-",
             f"grace {GRACE_S:.0f} s, exit {pre['launcher_exit_code']}"),
            ("notice → launcher exit", f"{pre['notice_to_launcher_exit_s']:.2f} s", ""),
            ("agreement all-reduce per step (p50)",
             f"{r['allreduce_per_step']['p50_us']:.0f} µs",
             f"step {r['step_ms']} ms"),
        ]
    width = max(len(r[0]) for r in rows) + 2
    return "\n".join(f"{a:<{width}}{b:<22}{c}" for a, b, c in rows)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mb", type=int, nargs="+", default=[0],
                   help="ballast state sizes to run (0: the demo model alone)")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--reps", type=int, default=3, help="repetitions per mode (median)")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.add_argument("--keep", action="store_true", help="keep the work directories")
    p.add_argument("--worker-mode", choices=["bare", "et"], help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--storage", help=argparse.SUPPRESS)
    p.add_argument("--ballast-mb", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker_mode == "bare":
        return worker_bare(args)
    if args.worker_mode == "et":
        return worker_et(args)
    load_before = load_average()
    results = [rounded(run_size(size, args.nproc, args.keep, args.reps), 3)
               for size in args.size_mb]
    load_after = load_average()
    flagged = noisy(load_before, load_after, None)
    if args.json:
        print(json.dumps({"bench": "recovery", "nproc": args.nproc, "cpus": os.cpu_count(),
                          "load_avg_before": round(load_before, 2),
                          "load_avg_after": round(load_after, 2), "noisy": flagged,
                          "results": results}))
    else:
        print(table(results))
        print(f"load average before/after {load_before:.2f}/{load_after:.2f}"
              + ("  (NOISY: other work was running)" if flagged else ""))


if __name__ == "__main__":
    main()
