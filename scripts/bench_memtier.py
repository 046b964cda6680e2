"""Node-memory tier benchmark: what a memory snapshot costs the training loop.

    python scripts/bench_memtier.py [--size-mb 256] [--saves 5] [--steps 20] [--rounds 3]
                                    [--dir /tmp] [--memory-dir /dev/shm] [--json [FILE]]

Setup (printed with the results): the MLP + AdamW state of ``bench_snapshot.py``
(``Trainer``) sized to ``--size-mb``, trained on one core, in one process
(``SnapshotManager`` without a process group). All figures come from the same run.

* ``blocking_ratio_vs_sync``: the time ``SnapshotManager.step()`` blocks the loop on a
  step that takes a memory snapshot (staging; the previous memory persist has
  finished), over one synchronous ``torch.save`` + fsync + rename to ``--dir``
  (``bench_snapshot.SyncTorchSave``), ``--saves`` of each; ``…_overlap_copy``: the
  same with ``snapshot.overlap_copy`` (plus the next optimizer step's wait for the
  copy behind; ``--batch`` rows per step set how much compute it can hide behind);
* ``step_rate_ratio_memory_every_step``: the loop's step rate with a memory snapshot
  every step (back-pressure included: a step waits while the previous memory
  persist still runs) over its rate without snapshots, ``--steps`` steps per
  round, ``--rounds`` alternating rounds;
* ``restore_memory_vs_durable``: ``restore()`` from the memory tier over
  ``restore()`` of the same state from ``--dir`` with a cold page cache;
* with ``--recovery-reps N`` (0: skipped), under real torchrun (``elastictrain run``,
  2 gloo workers, a model of ``--size-mb`` ballast, durable every 2 steps): rank 1 is
  SIGKILLed by PID while the job idles after step 3, and kill → first completed step
  after the resume is timed with the memory tier on (resumes from memory step 3)
  and off (from durable step 2): ``kill_to_first_step_memory_vs_durable``.

Ratios are ``median [min-max]`` (benchlib.ratio_spread). ``--json`` (``-`` or no
FILE: stdout) writes every figure and its spread. Figures: docs/memory-tier.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from bench_recovery import _poll, _start, _stop
from bench_snapshot import SyncTorchSave, Trainer, evict
from benchlib import CallTimer, fmt, load_average, noisy, ratio_spread, spread, write_json

from elastictrain.core import layout
from elastictrain.core import log as et_log
from elastictrain.snapshot.manager import SnapshotManager


def _manager(trainer: Trainer, durable: Path, memory: Path | None,
             every_steps: int | None, overlap: bool = False) -> SnapshotManager:
    extra: dict[str, Any] = ({"memory_every": 1, "memory_dir": str(memory)}
                             if memory is not None else {})
    return SnapshotManager(str(durable), model=trainer.model, optimizer=trainer.opt,
                           every_steps=every_steps, progress_every_s=None, run_id="bench",
                           overlap_copy=overlap, **extra)


def memory_blocking(trainer: Trainer, root: Path, mem: Path, saves: int,
                    overlap: bool) -> list[float]:
    """Seconds the loop blocks per memory snapshot: ``step()``, plus with ``overlap``
    the wait of the optimizer's next step for the copy behind."""
    snap = _manager(trainer, root / f"durable-{overlap}", mem / f"o{overlap:d}", None, overlap)
    trainer.step()
    snap.step()  # warm-up: staging slabs and the persister thread
    snap.wait()
    assert snap._memory is not None
    fence = CallTimer(snap._fence, "wait")  # the optimizer's step pre-hook calls it
    blocked = []
    for _ in range(saves):
        trainer.step()
        started = time.perf_counter()
        snap.step()
        step_s = time.perf_counter() - started
        fenced = fence.total_s
        trainer.step()  # its optimizer step waits for the copy behind, if any is left
        blocked.append(step_s + fence.total_s - fenced)
        snap.wait()  # the next measured snapshot finds no persist in flight
    snap.close()
    return blocked


def blocking(trainer: Trainer, root: Path, mem: Path, saves: int) -> dict[str, list[float]]:
    """Seconds the loop blocks per memory snapshot, without and with ``overlap_copy``,
    and per sync save."""
    memory_s = memory_blocking(trainer, root, mem, saves, overlap=False)
    overlap_s = memory_blocking(trainer, root, mem, saves, overlap=True)
    sync = SyncTorchSave(root, trainer)
    sync_s = []
    for i in range(saves):
        started = time.perf_counter()
        sync.save(i)
        sync_s.append(time.perf_counter() - started)
    return {"memory_s": memory_s, "memory_overlap_copy_s": overlap_s, "sync_s": sync_s}


def step_rates(trainer: Trainer, root: Path, mem: Path, steps: int,
               rounds: int) -> dict[str, list[float]]:
    """Steps per second without snapshots and with a memory snapshot every step."""
    snap = _manager(trainer, root / "durable-rate", mem, None)
    plain, memory = [], []
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(steps):
            trainer.step()
        plain.append(steps / (time.perf_counter() - started))
        started = time.perf_counter()
        for _ in range(steps):
            trainer.step()
            snap.step()
        memory.append(steps / (time.perf_counter() - started))
        snap.wait()
    snap.close()
    return {"plain_steps_per_s": plain, "memory_steps_per_s": memory}


def restores(trainer: Trainer, root: Path, mem: Path, reps: int) -> dict[str, list[float]]:
    """``restore()`` seconds of the same state from the memory tier and from ``--dir``
    (cold page cache)."""
    durable, empty = root / "durable-restore", root / "durable-empty"
    snap = _manager(trainer, durable, None, 1)
    trainer.step()
    snap.step()  # a durable snapshot of step 1
    snap.close()
    snap = _manager(trainer, empty, mem, None)
    trainer.step()
    snap.step()  # a memory snapshot of step 1; no close(): that would remove it
    snap.wait()
    from_memory, from_disk = [], []
    for _ in range(reps):
        started = time.perf_counter()
        info = _manager(trainer, empty, mem, None).restore()
        from_memory.append(time.perf_counter() - started)
        assert info.tier == "memory", info
        for path in (durable / layout.SNAPSHOTS).rglob("*"):
            if path.is_file():
                evict(str(path))
        started = time.perf_counter()
        info = _manager(trainer, durable, None, None).restore()
        from_disk.append(time.perf_counter() - started)
        assert info.tier == "durable", info
    return {"restore_memory_s": from_memory, "restore_durable_cold_s": from_disk}


# -- kill → first resumed step under torchrun ------------------------------------------
IDLE_AT, IDLE_TIMEOUT_S = 3, 600.0


def worker(out: Path, storage: str, size_mb: float) -> None:
    """One rank of the recovery job: durable every 2 steps (memory every step when
    ``ELASTICTRAIN_SNAPSHOT__MEMORY_EVERY`` is set); idles after step 3 in attempt 0."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import elastictrain as et

    rt = et.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    model.register_buffer("ballast", torch.ones(int(size_mb * 2**20 / 4)))
    ddp = DDP(model, broadcast_buffers=False)  # the ballast is state, not traffic
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    snap = et.SnapshotManager(storage, model=ddp, optimizer=opt, ctx=rt.ctx, every_steps=2,
                              progress_every_s=None)
    started = time.time()
    info = snap.restore()
    restore_s = time.time() - started
    attempt, rank = rt.env.restart_count, rt.rank
    first = True
    while snap.step_count < IDLE_AT + 1:
        ddp(torch.randn(8, 64)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        snap.step()
        if first:
            first = False
            (out / f"attempt{attempt}-rank{rank}.json").write_text(json.dumps(
                {"t_first_step": time.time(), "from_step": info.from_step, "tier": info.tier,
                 "restore_s": restore_s}))
        if attempt == 0 and snap.step_count == IDLE_AT:
            snap.wait()  # durable step 2 and the memory copy of step 3 are committed
            (out / f"idle-rank{rank}.json").write_text(json.dumps({"pid": os.getpid()}))
            deadline = time.monotonic() + IDLE_TIMEOUT_S
            while time.monotonic() < deadline:  # until the harness kills rank 1
                time.sleep(0.05)
    snap.close()
    et.shutdown()


def recovery_once(work: Path, mem: Path | None, size_mb: float) -> dict[str, Any]:
    """Kill → first completed step after the resume, for one run of the job."""
    work.mkdir(parents=True)
    out, ev = work / "out", work / "events"
    out.mkdir()
    env = {"ELASTICTRAIN_LOG__EVENTS_DIR": str(ev)}
    if mem is not None:
        env.update({"ELASTICTRAIN_SNAPSHOT__MEMORY_EVERY": "1",
                    "ELASTICTRAIN_SNAPSHOT__MEMORY_DIR": str(mem)})
    cmd = [sys.executable, "-m", "elastictrain.cli", "run", "--nproc-per-node=2",
           "--max-restarts=1", f"--log-dir={work / 'logs'}", str(Path(__file__).resolve()),
           "--worker", str(out), str(work / "storage"), f"--size-mb={size_mb}"]
    proc = _start(cmd, work, "launcher.log", **env)
    try:
        idle = [_poll(lambda r=r: _json(out / f"idle-rank{r}.json"), 600, "the idle step", proc)
                for r in range(2)]
        t_kill = time.time()
        os.kill(int(idle[1]["pid"]), signal.SIGKILL)
        firsts = [_poll(lambda r=r: _json(out / f"attempt1-rank{r}.json"), 600,
                        "the first step after the resume", proc) for r in range(2)]
        if proc.wait(timeout=600) != 0:
            raise RuntimeError(f"the recovery job failed; see {work}/launcher.log")
    finally:
        _stop(proc, ev)
    return {"kill_to_first_step_s": max(f["t_first_step"] for f in firsts) - t_kill,
            "restore_s": max(f["restore_s"] for f in firsts),
            "from_step": firsts[0]["from_step"], "tier": firsts[0]["tier"]}


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def recoveries(root: Path, mem: Path, size_mb: float, reps: int) -> dict[str, Any]:
    """Alternating runs with the memory tier on and off; every run checks its tier."""
    runs: dict[str, list[dict[str, Any]]] = {"memory": [], "durable": []}
    for rep in range(reps):
        for tier in ("memory", "durable"):
            got = recovery_once(root / f"recovery-{tier}-{rep}",
                                mem / f"rec-{rep}" if tier == "memory" else None, size_mb)
            expected = (IDLE_AT, "memory") if tier == "memory" else (2, "durable")
            if (got["from_step"], got["tier"]) != expected:
                raise RuntimeError(f"the {tier} run resumed from {got}, not {expected}")
            runs[tier].append(got)
    seconds = {f"{field}_{tier}": [r[field] for r in runs[tier]]
               for tier in runs for field in ("kill_to_first_step_s", "restore_s")}
    return {"kill_to_first_step_memory_vs_durable": ratio_spread(
                seconds["kill_to_first_step_s_memory"], seconds["kill_to_first_step_s_durable"]),
            "seconds": seconds}


def run(args: argparse.Namespace, root: Path, mem: Path) -> dict[str, Any]:
    load_before = load_average()
    trainer = Trainer.build(args.size_mb, batch=args.batch)
    block = blocking(trainer, root, mem / "block", args.saves)
    state = trainer.state_bytes()  # after a step: AdamW's state exists now
    rates = step_rates(trainer, root, mem / "rate", args.steps, args.rounds)
    restore = restores(trainer, root, mem / "restore", args.rounds)
    del trainer
    recovery = (recoveries(root, mem, args.size_mb, args.recovery_reps)
                if args.recovery_reps else None)
    load_after = load_average()
    return {
        "setup": {"size_mb": args.size_mb, "state_bytes": state, "dir": args.dir,
                  "memory_dir": args.memory_dir, "saves": args.saves, "steps": args.steps,
                  "rounds": args.rounds, "cpus": os.cpu_count(), "torch": torch.__version__,
                  "batch": args.batch,
                  "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                  "load_before": round(load_before, 2), "load_after": round(load_after, 2),
                  "noisy": noisy(load_before, load_after, None)},
        "blocking_ratio_vs_sync": ratio_spread(block["memory_s"], block["sync_s"]),
        "blocking_ratio_vs_sync_overlap_copy": ratio_spread(block["memory_overlap_copy_s"],
                                                            block["sync_s"]),
        "step_rate_ratio_memory_every_step": ratio_spread(rates["memory_steps_per_s"],
                                                          rates["plain_steps_per_s"]),
        "restore_memory_vs_durable": ratio_spread(restore["restore_memory_s"],
                                                  restore["restore_durable_cold_s"]),
        "kill_to_first_step_memory_vs_durable": (
            recovery["kill_to_first_step_memory_vs_durable"] if recovery else None),
        "seconds": {name: spread(values) for name, values in
                    {**block, **restore, **(recovery["seconds"] if recovery else {})}.items()},
        "steps_per_s": {name: spread(values) for name, values in rates.items()},
    }


def table(report: dict[str, Any]) -> str:
    s = report["setup"]
    lines = [f"memory tier, {s['size_mb']:g} MB state ({s['state_bytes'] / 2**20:.0f} MiB), "
             f"{s['date']}, load {s['load_before']}→{s['load_after']}"
             f"{' NOISY' if s['noisy'] else ''}",
             f"  {'figure':<42}median [min-max]"]
    for name in ("blocking_ratio_vs_sync", "blocking_ratio_vs_sync_overlap_copy",
                 "step_rate_ratio_memory_every_step",
                 "restore_memory_vs_durable", "kill_to_first_step_memory_vs_durable"):
        if report[name] is not None:
            lines.append(f"  {name:<42}{fmt(report[name])}")
    for name, value in {**report["seconds"], **report["steps_per_s"]}.items():
        lines.append(f"  {name:<42}{fmt(value)}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mb", type=float, default=256, help="model + AdamW state in MB")
    p.add_argument("--saves", type=int, default=5, help="measured saves of each kind")
    p.add_argument("--batch", type=int, default=8, help="rows per training step (its compute)")
    p.add_argument("--steps", type=int, default=20, help="steps per step-rate round")
    p.add_argument("--rounds", type=int, default=3, help="step-rate and restore rounds")
    p.add_argument("--dir", default=tempfile.gettempdir(), help="durable storage parent")
    p.add_argument("--memory-dir", default="/dev/shm", help="memory tier parent (node-local)")
    p.add_argument("--recovery-reps", type=int, default=0,
                   help="kill -> first resumed step runs per tier under torchrun (0: none)")
    p.add_argument("--worker", nargs=2, metavar=("OUT", "STORAGE"), help=argparse.SUPPRESS)
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                   help="write the figures as JSON to FILE (no FILE or -: stdout)")
    args = p.parse_args(argv)
    for name in ("size_mb", "saves", "steps", "rounds"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)}: must be > 0")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(Path(args.worker[0]), args.worker[1], args.size_mb)
        return
    torch.set_num_threads(1)
    et_log.configure(level="warning", stream=sys.stderr)
    root = Path(tempfile.mkdtemp(prefix="elastictrain-bench-", dir=args.dir))
    mem = Path(tempfile.mkdtemp(prefix="elastictrain-bench-", dir=args.memory_dir))
    try:
        report = run(args, root, mem)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(mem, ignore_errors=True)
    if args.json is not None:
        write_json(args.json, report)
    if args.json != "-":
        print(table(report), flush=True)


if __name__ == "__main__":
    main()
