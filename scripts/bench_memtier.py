"""Node-memory tier benchmark: what a memory snapshot costs the training loop.

    python scripts/bench_memtier.py [--size-mb 256] [--saves 5] [--steps 20] [--rounds 3]
                                    [--dir /tmp] [--memory-dir /dev/shm] [--json [FILE]]

Setup (printed with the results): the MLP + AdamW state of ``bench_snapshot.py``
(``Trainer``) sized to ``--size-mb``, trained on one core, in one process
(``SnapshotManager`` without a process group). All figures come from the same run.

* ``blocking_ratio_vs_sync``: the time ``SnapshotManager.step()`` blocks the loop on a
  step that takes a memory snapshot (staging; the previous memory persist has
  finished), over one synchronous ``torch.save`` + fsync + rename to ``--dir``
  (``bench_snapshot.SyncTorchSave``), ``--saves`` of each;
* ``step_rate_ratio_memory_every_step``: the loop's step rate with a memory snapshot
  every step (back-pressure included: a step waits while the previous memory
  persist still runs) over its rate without snapshots, ``--steps`` steps per
  round, ``--rounds`` alternating rounds;
* ``restore_memory_vs_durable``: ``restore()`` from the memory tier over
  ``restore()`` of the same state from ``--dir`` with a cold page cache.

Ratios are ``median [min-max]`` (benchlib.ratio_spread). ``--json`` (``-`` or no
FILE: stdout) writes every figure and its spread. Figures: docs/memory-tier.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from bench_snapshot import SyncTorchSave, Trainer, evict
from benchlib import fmt, load_average, noisy, ratio_spread, spread, write_json

from elastictrain import log as et_log
from elastictrain.snapshot import layout
from elastictrain.snapshot.manager import SnapshotManager


def _manager(trainer: Trainer, durable: Path, memory: Path | None,
             every_steps: int | None) -> SnapshotManager:
    extra: dict[str, Any] = ({"memory_every": 1, "memory_dir": str(memory)}
                             if memory is not None else {})
    return SnapshotManager(str(durable), model=trainer.model, optimizer=trainer.opt,
                           every_steps=every_steps, progress_every_s=None, run_id="bench",
                           **extra)


def blocking(trainer: Trainer, root: Path, mem: Path, saves: int) -> dict[str, list[float]]:
    """Seconds ``step()`` blocks on a memory-snapshot step, and one sync save each."""
    snap = _manager(trainer, root / "durable", mem, None)
    trainer.step()
    snap.step()  # warm-up: staging slabs and the persister thread
    snap.wait()
    memory_s = []
    for _ in range(saves):
        trainer.step()
        started = time.perf_counter()
        snap.step()
        memory_s.append(time.perf_counter() - started)
        snap.wait()  # the next measured snapshot finds no persist in flight
    snap.close()
    sync = SyncTorchSave(root, trainer)
    sync_s = []
    for i in range(saves):
        started = time.perf_counter()
        sync.save(i)
        sync_s.append(time.perf_counter() - started)
    return {"memory_s": memory_s, "sync_s": sync_s}


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


def run(args: argparse.Namespace, root: Path, mem: Path) -> dict[str, Any]:
    load_before = load_average()
    trainer = Trainer.build(args.size_mb)
    block = blocking(trainer, root, mem / "block", args.saves)
    state = trainer.state_bytes()  # after a step: AdamW's state exists now
    rates = step_rates(trainer, root, mem / "rate", args.steps, args.rounds)
    restore = restores(trainer, root, mem / "restore", args.rounds)
    load_after = load_average()
    return {
        "setup": {"size_mb": args.size_mb, "state_bytes": state, "dir": args.dir,
                  "memory_dir": args.memory_dir, "saves": args.saves, "steps": args.steps,
                  "rounds": args.rounds, "cpus": os.cpu_count(), "torch": torch.__version__,
                  "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                  "load_before": round(load_before, 2), "load_after": round(load_after, 2),
                  "noisy": noisy(load_before, load_after, None)},
        "blocking_ratio_vs_sync": ratio_spread(block["memory_s"], block["sync_s"]),
        "step_rate_ratio_memory_every_step": ratio_spread(rates["memory_steps_per_s"],
                                                          rates["plain_steps_per_s"]),
        "restore_memory_vs_durable": ratio_spread(restore["restore_memory_s"],
                                                  restore["restore_durable_cold_s"]),
        "seconds": {name: spread(values) for name, values in {**block, **restore}.items()},
        "steps_per_s": {name: spread(values) for name, values in rates.items()},
    }


def table(report: dict[str, Any]) -> str:
    s = report["setup"]
    lines = [f"memory tier, {s['size_mb']:g} MB state ({s['state_bytes'] / 2**20:.0f} MiB), "
             f"{s['date']}, load {s['load_before']}→{s['load_after']}"
             f"{' NOISY' if s['noisy'] else ''}",
             f"  {'figure':<42}median [min-max]"]
    for name in ("blocking_ratio_vs_sync", "step_rate_ratio_memory_every_step",
                 "restore_memory_vs_durable"):
        lines.append(f"  {name:<42}{fmt(report[name])}")
    for name, value in {**report["seconds"], **report["steps_per_s"]}.items():
        lines.append(f"  {name:<42}{fmt(value)}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mb", type=float, default=256, help="model + AdamW state in MB")
    p.add_argument("--saves", type=int, default=5, help="measured saves of each kind")
    p.add_argument("--steps", type=int, default=20, help="steps per step-rate round")
    p.add_argument("--rounds", type=int, default=3, help="step-rate and restore rounds")
    p.add_argument("--dir", default=tempfile.gettempdir(), help="durable storage parent")
    p.add_argument("--memory-dir", default="/dev/shm", help="memory tier parent (node-local)")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                   help="write the figures as JSON to FILE (no FILE or -: stdout)")
    args = p.parse_args(argv)
    for name in ("size_mb", "saves", "steps", "rounds"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)}: must be > 0")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
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
