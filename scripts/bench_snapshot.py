"""Snapshot benchmark: elastictrain async vs torch.save and DCP async_save, in one run.

    python scripts/bench_snapshot.py [--sizes 64 256 1024 4096] [--saves 3] [--dir /tmp]
                                     [--json [FILE]] [--plot FILE.png]

Setup (printed with the results):

* state: an MLP (Linear 1024x1024 layers) plus its AdamW state, sized to
  ``--size-mb`` of tensor bytes; the training loop trains that same model
  (forward, backward, AdamW step) on ONE core (``torch.set_num_threads(1)``),
  leaving the other core to background work, as a GPU job leaves its CPU
  mostly idle;
* saves run in one process, rank 0 of a 1-rank gloo group: the comparison is
  about what a save costs the writer's training loop. Restore runs on 2 ranks
  (gloo, ``torch.multiprocessing``) so both restore modes mean something;
* same storage for everything: a fresh directory under ``--dir``, removed at
  the end;
* per method: one warm-up save (one-time costs: buffer allocation, helper
  start; reported separately), then ``--saves`` measured saves, each followed
  by training until it is durable and a few steps without a save.

Methods: (a) ``torch.save`` + fsync + rename on rank 0, torch's defaults
(blocking: what most scripts do); (b) ``torch.distributed.checkpoint.async_save``
in process mode (its faster mode here) and in thread mode; (c) elastictrain
async with the thread and the process persister (the configured default is
marked), both copying parameters and optimizer state behind the loop (the default
``overlap_copy``: their blocking adds the wait of the optimizer's next steps for the
copy), and the thread persister copying at once (``overlap_copy=false``,
``blocking_ratio_vs_sync_copy_at_once``). How much a copy behind hides depends on the
step's compute:
``--batch`` sets the rows per step (default 8: a step far shorter than the copy).
Baselines: a raw write+fsync and a raw read of the same bytes.

Persist time runs from the state staged (save returned; a copy behind: copied) to
durable. ``persist_vs_raw_write`` is the median over the measured saves of a raw write
made just before each save ÷ that save's persist: this disk writes 1 GiB in 0.6 s or,
in a slow mode that comes and goes within seconds, in 2.5-3 s, so a baseline taken
minutes apart says little (``persist_vs_raw_write_unpaired`` keeps that ratio). Step
rate during a persist counts the steps inside [save returned, durable], partial steps
by the fraction that overlaps, against the rate of the steps outside any save in the
same method's run (same machine load). A calibration runs first: the step rate with a
plain busy-loop process beside the loop (~100% when a core is really free; less means
every step-rate figure is pessimistic, and the output says NOISY). Restore is compared
with a raw read of the payload by one process (``restore_vs_raw_read``, the headline)
and by both ranks at once (``restore_vs_raw_read_all_ranks``, like for like with
"each").

Each size is one run of everything below; ``--sizes`` gives the scaling curve: a
table per size, then one line per size with blocking, durable-after, persist and
restore throughput against the raw baselines of the same run, as medians with
[min-max] (every figure is measured >= 3 times: ``--saves``, ``--restore-reps``).

``--json FILE`` (``-`` or no FILE: stdout) writes ``{"sizes_mb", "points": [...]}``,
one object per size: ``blocking_ratio_vs_sync``,
``step_rate_ratio_during_persist``, ``persist_vs_raw_write``,
``restore_vs_raw_read`` (+ ``_warm``, ``_all_ranks``),
``staging_bytes_over_state_bytes``, ``targets`` (met or not), ``setup``,
``methods`` (per-method figures, with ``spread``), ``restore_s`` (+ ``restore_spread_s``),
``staging``, ``curve`` (the throughputs). ``--plot FILE.png`` draws the curve
(needs ``pip install 'elastictrain[plot]'``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp
from benchlib import (
    CallTimer,
    busy_loop_ratio,
    fmt,
    free_port,
    load_average,
    memory_copy_ratio,
    noisy,
    plot_curve,
    spread,
    write_json,
)

from elastictrain.core import layout
from elastictrain.core import log as et_log
from elastictrain.core.config import SnapshotConfig
from elastictrain.snapshot.durable.restore import resolve_mode
from elastictrain.snapshot.manager import SnapshotManager
from elastictrain.snapshot.state.staging import StagingBuffers
from elastictrain.storage import open_store

TARGETS = {"blocking_ratio_vs_sync": ("<=", 0.02),
           "step_rate_ratio_during_persist": (">=", 0.95),
           "step_rate_ratio_during_persist_paced": (">=", 0.95),
           "persist_vs_raw_write": (">=", 0.90), "restore_vs_raw_read": ("<=", 1.25),
           "restore_vs_raw_read_warm": ("<=", 1.25),
           "restore_vs_raw_read_1rank": ("<=", 1.25),
           "restore_vs_raw_read_1rank_warm": ("<=", 1.25),
           "restore_peak_rss_over_state": ("<=", 1.20),
           "staging_bytes_over_state_bytes": ("<=", 1.10)}
MIB = 1 << 20
WIDTH = 1024
GAP_STEPS = 3


# -- the training loop --------------------------------------------------------------
@dataclass
class Trainer:
    """The model, its AdamW state and a one-core training step; records step intervals."""

    model: torch.nn.Module
    opt: torch.optim.Optimizer
    x: torch.Tensor
    steps: list[tuple[float, float]] = field(default_factory=list)
    fwd_bwd_s: list[float] = field(default_factory=list)  # forward + backward of each step

    @classmethod
    def build(cls, size_mb: float, seed: int = 0, batch: int = 8) -> Trainer:
        torch.manual_seed(seed)
        width = WIDTH if size_mb >= 48 else 256
        params = size_mb * 2**20 / 4 / 3  # AdamW keeps two more tensors per parameter
        layers = max(1, round(params / (width * width + width)))
        model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        return cls(model, opt, torch.randn(batch, width))

    def step(self) -> None:
        started = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        self.model(self.x).pow(2).mean().backward()
        self.fwd_bwd_s.append(time.perf_counter() - started)
        self.opt.step()
        self.steps.append((started, time.perf_counter()))

    def state_bytes(self) -> int:
        tensors = list(self.model.state_dict().values())
        tensors += [t for s in self.opt.state.values() for t in s.values()
                    if isinstance(t, torch.Tensor)]
        return sum(t.numel() * t.element_size() for t in tensors)


# -- one save, as each method does it -----------------------------------------------
@dataclass
class Pending:
    """A save in progress: ``finished_at`` is set (perf_counter) once it is durable."""

    done: Callable[[], bool]
    finished_at: Callable[[], float | None]
    finish: Callable[[], None] = lambda: None
    # When the bytes to write were ready (a copy behind: once copied), if after save()
    # returned: the persist (write) time counts from there.
    staged_at: Callable[[], float | None] = lambda: None


class SyncTorchSave:
    name = "torch.save+fsync (sync)"

    def __init__(self, root: Path, trainer: Trainer) -> None:
        self.dir, self.trainer = root / "sync", trainer
        self.dir.mkdir()

    def save(self, step: int) -> Pending:
        path, tmp = self.dir / "ckpt.pt", self.dir / "ckpt.pt.tmp"
        with open(tmp, "wb") as f:
            torch.save({"model": self.trainer.model.state_dict(),
                        "optimizer": self.trainer.opt.state_dict(), "step": step}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        now = time.perf_counter()
        return Pending(lambda: True, lambda: now)

    def close(self) -> None:
        return None


class DcpAsyncSave:
    def __init__(self, root: Path, trainer: Trainer, mode: str) -> None:
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        self.name = f"dcp.async_save ({mode})"
        self.dir, self.trainer = root / f"dcp-{mode}", trainer
        self.dir.mkdir()
        self.kind = AsyncCheckpointerType(mode)
        self.previous: Path | None = None

    def save(self, step: int) -> Pending:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, opt_sd = get_state_dict(self.trainer.model, self.trainer.opt)
        target = self.dir / f"step_{step}"
        future = dcp.async_save({"model": model_sd, "optim": opt_sd}, checkpoint_id=str(target),
                                async_checkpointer_type=self.kind)
        upload: Any = getattr(future, "upload_completion", future)
        finished: list[float] = []
        upload.add_done_callback(lambda _: finished.append(time.perf_counter()))

        def finish() -> None:
            upload.result()
            if self.previous is not None:
                shutil.rmtree(self.previous, ignore_errors=True)
            self.previous = target

        return Pending(upload.done, lambda: finished[0] if finished else None, finish)

    def close(self) -> None:
        return None


class ElasticTrainAsync:
    def __init__(self, root: Path, trainer: Trainer, persister: str, default: bool,
                 copy_at_once: bool = False, paced_mb_s: float | None = None) -> None:
        self.name = (f"elastictrain async ({persister}){', copy at once' if copy_at_once else ''}"
                     f"{f', paced {paced_mb_s:g} MB/s' if paced_mb_s else ''}"
                     f"{' [default]' if default else ''}")
        self.trainer = trainer
        suffix = ("-at-once" if copy_at_once else "") + (f"-paced{paced_mb_s:g}"
                                                         if paced_mb_s else "")
        self.manager = SnapshotManager(str(root / f"et-{persister}{suffix}"),
                                       model=trainer.model, optimizer=trainer.opt,
                                       every_steps=10**9, keep=1, mode="async",
                                       persister=persister,
                                       overlap_copy=False if copy_at_once else "auto",
                                       persist_max_mb_s=paced_mb_s)
        self._fenced = 0.0
        # The optimizer's step pre-hook calls the fence: timed around that call.
        self._fence = CallTimer(self.manager._fence, "wait")
        # The persist of a copy behind is handed over once its copy is done: the
        # persister's submit, timed from the first save on (it starts with that one).
        self._submit: CallTimer | None = None

    def ready(self) -> None:
        """The user's first ``manager.step()`` after an optimizer step: it allocates the
        staging slabs in the background (the first save then blocks like the later ones)."""
        self.manager.step()

    def save(self, step: int) -> Pending:
        self.manager.step_count = step
        submits = self._submit.calls if self._submit is not None else 0
        handle = self.manager.save()
        finished: list[float] = []
        handle.add_done_callback(lambda _: finished.append(time.perf_counter()))
        submit = self._submit
        if submit is None:
            self._submit = CallTimer(self.manager._saver.persister, "submit")

        def staged_at() -> float | None:
            return submit.last_started if submit is not None and submit.calls > submits else None

        return Pending(handle.done, lambda: finished[0] if finished else None,
                       lambda: _wait(handle), staged_at)

    def fence_wait_s(self) -> float:
        """Seconds the optimizer's steps waited at the fence for copies behind since the
        last call: blocking that happens after save() returned."""
        total = self._fence.total_s
        waited, self._fenced = total - self._fenced, total
        return waited

    def close(self) -> None:
        self.staging_bytes = self.manager._saver.staging.nbytes
        self.manager.close()
        self.manager._saver.staging = StagingBuffers()  # free the slabs: the next method's
        # peak RSS should not include this one's staging memory


def _wait(handle: Any) -> None:
    handle.wait()


# -- measuring a method -------------------------------------------------------------
@dataclass
class SaveFigures:
    blocking_s: float
    durable_s: float
    persist_s: float
    window: tuple[float, float]
    copied_after_s: float = 0.0  # a copy behind: how long after save() returned it ended


@dataclass
class MethodResult:
    name: str
    blocking_s: float
    durable_s: float
    persist_s: float
    first_blocking_s: float
    first_durable_s: float
    step_rate_ratio_during_persist: float | None
    persist_vs_raw_write: float  # median over saves of (raw write just before) / persist
    persist_vs_raw_write_unpaired: float  # median raw write around the method / median persist
    raw_write_s: float
    paired_raw_write_s: list[float]
    peak_rss_mb: float
    helper_peak_rss_mb: float
    saves: list[dict[str, float]]
    spread: dict[str, dict[str, float]]


def measure(method: Any, trainer: Trainer, saves: int, root: Path,
            raw_write_initial_s: float) -> MethodResult:
    """Warm-up save + ``saves`` measured saves; the raw write baseline is taken right
    before and after the method (the load of a shared machine drifts)."""
    raw_before = raw_write_s(root, trainer.state_bytes(), repeats=1)
    reset_peak_rss()
    trainer.steps.clear()
    trainer.step()
    getattr(method, "ready", lambda: None)()  # as a training loop would, before any save
    for _ in range(GAP_STEPS - 1):
        trainer.step()
    figures = []
    paired_raw = []  # a raw write right before each measured save: this disk has a slow
    # mode that comes and goes within seconds (1 GiB in 0.6 s or in 2.5-3 s), so the
    # persist is compared with a write made in the same moment
    for i in range(saves + 1):
        if i:
            paired_raw.append(raw_write_s(root, trainer.state_bytes(), repeats=1))
        started = time.perf_counter()
        pending = method.save(step=i + 1)
        returned = time.perf_counter()
        while not pending.done():
            trainer.step()
        pending.finish()
        durable = pending.finished_at() or time.perf_counter()
        durable = max(durable, returned)
        staged = min(max(pending.staged_at() or returned, returned), durable)
        figures.append(SaveFigures(returned - started, durable - started, durable - staged,
                                   (returned, durable), staged - returned))
        for _ in range(GAP_STEPS):
            trainer.step()
        # A copy behind blocks the optimizer's next step instead: add that wait.
        fence = getattr(method, "fence_wait_s", lambda: 0.0)()
        figures[-1].blocking_s += fence
    peak, helper = peak_rss_mb(), helpers_peak_rss_mb()
    method.close()
    raws = [raw_before, raw_write_s(root, trainer.state_bytes(), repeats=1), raw_write_initial_s]
    raw = statistics.median(raws)
    measured = figures[1:]
    blocking = statistics.median(f.blocking_s for f in measured)
    durable = statistics.median(f.durable_s for f in measured)
    persist = statistics.median(f.persist_s for f in measured)
    background = persist > 0.01 * durable
    own = [f.persist_s if background else f.blocking_s for f in measured]
    return MethodResult(
        name=method.name, blocking_s=blocking, durable_s=durable, persist_s=persist,
        first_blocking_s=figures[0].blocking_s, first_durable_s=figures[0].durable_s,
        step_rate_ratio_during_persist=step_rate_ratio(trainer.steps, [f.window for f in figures])
        if background else None,
        persist_vs_raw_write=statistics.median(r / t for r, t in zip(paired_raw, own,
                                                                      strict=True)),
        persist_vs_raw_write_unpaired=raw / (persist if background else blocking),
        raw_write_s=raw, paired_raw_write_s=paired_raw,
        peak_rss_mb=peak, helper_peak_rss_mb=helper,
        saves=[{k: round(v, 4) for k, v in asdict(f).items() if k != "window"} for f in measured],
        spread={"blocking_s": spread([f.blocking_s for f in measured]),
                "durable_s": spread([f.durable_s for f in measured]),
                "persist_s": spread([f.persist_s for f in measured]), "raw_write_s": spread(raws)})


def step_rate_ratio(steps: list[tuple[float, float]],
                    windows: list[tuple[float, float]]) -> float | None:
    """Steps per second inside the persist windows (partial steps by overlap) over the
    rate of the steps that overlap no window."""
    inside, inside_time = 0.0, sum(e - s for s, e in windows)
    outside = [e - s for s, e in steps if not any(s < we and e > ws for ws, we in windows)]
    for s, e in steps:
        inside += sum(max(0.0, min(e, we) - max(s, ws)) for ws, we in windows) / (e - s)
    if not outside or inside_time <= 0:
        return None
    return (inside / inside_time) / (len(outside) / sum(outside))


# -- baselines ----------------------------------------------------------------------
def raw_write_s(root: Path, nbytes: int, repeats: int = 3) -> float:
    data: Any = torch.randint(0, 256, (nbytes,), dtype=torch.uint8).numpy()
    times = []
    for _ in range(repeats):
        path = root / "raw.bin"
        started = time.perf_counter()
        with open(path, "wb") as f:
            f.write(memoryview(data))
            f.flush()
            os.fsync(f.fileno())
        times.append(time.perf_counter() - started)
        path.unlink()
    return statistics.median(times)


def evict(path: str) -> None:
    """Drop a file's pages from the page cache (a cold read without root rights)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def raw_read_s(path: str, cold: bool) -> float:
    if cold:
        evict(path)
    started = time.perf_counter()
    with open(path, "rb") as f:
        data = f.read()
    elapsed = time.perf_counter() - started
    del data
    return elapsed


# -- memory -------------------------------------------------------------------------
def _status_kb(pid: int | str, key: str) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return float(line.split()[1])
    except OSError:
        pass
    return 0.0


def reset_peak_rss() -> None:
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM (Linux)


def peak_rss_mb() -> float:
    return _status_kb("self", "VmHWM") / 1024


def helpers_peak_rss_mb() -> float:
    """Peak RSS of this process's live children (persister helpers, DCP's process)."""
    total = 0.0
    for task in Path("/proc/self/task").iterdir():
        for pid in (task / "children").read_text().split():
            total += _status_kb(pid, "VmHWM")
    return total / 1024


def staging_flatness(root: Path, size_mb: float, saves: int, persister: str) -> dict[str, Any]:
    """Staging memory and RSS over many saves of a small state."""
    trainer = Trainer.build(size_mb, seed=1)
    trainer.step()
    manager = SnapshotManager(str(root / "flat"), model=trainer.model, optimizer=trainer.opt,
                              every_steps=10**9, keep=1, persister=persister)
    nbytes, allocations, rss = [], [], []
    for i in range(saves):
        manager.step_count = i + 1
        manager.save().wait()
        trainer.step()
        nbytes.append(manager._saver.staging.nbytes)
        allocations.append(manager._saver.staging.allocations)
        rss.append(_status_kb("self", "VmRSS") / 1024)
    manager.close()
    state = trainer.state_bytes()
    return {"size_mb": size_mb, "saves": saves, "persister": persister, "state_bytes": state,
            "staging_bytes_min": min(nbytes), "staging_bytes_max": max(nbytes),
            "staging_over_state": max(nbytes) / state,
            "allocations_first": allocations[0], "allocations_last": allocations[-1],
            "flat": min(nbytes) == max(nbytes) and allocations[0] == allocations[-1],
            "rss_growth_mb_save2_to_last": round(rss[-1] - rss[1], 1)}


# -- restore on 2 ranks -------------------------------------------------------------
def restore_worker(rank: int, world: int, port: int, root: str, size_mb: float, reps: int,
                   out: str) -> None:
    torch.set_num_threads(1)
    et_log.configure(level="warning", stream=sys.stderr)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from elastictrain.worker.dist import DistContext

    ctx = DistContext(rank, world, rank, "gloo", torch.device("cpu"), True)
    trainer = Trainer.build(size_mb)
    payload = next(iter(Path(root).rglob(layout.PAYLOAD)))
    state = payload.stat().st_size
    results: dict[str, list[float]] = {}
    modes = ("each", "broadcast") if world > 1 else ("each",)
    for cold in (True, False):
        tag = "cold" if cold else "warm"
        for _ in range(reps):
            dist.barrier()
            if rank == 0:
                results.setdefault(f"raw_read_{tag}", []).append(raw_read_s(str(payload), cold))
            if cold and rank == 0:
                evict(str(payload))
            dist.barrier()
            elapsed = torch.tensor([raw_read_s(str(payload), cold=False)])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # every rank reads, as "each" does
            results.setdefault(f"raw_read_all_ranks_{tag}", []).append(float(elapsed))
            for mode in modes:
                manager = SnapshotManager(root, model=trainer.model, optimizer=trainer.opt,
                                          ctx=ctx, restore_mode=mode, every_steps=10**9)
                # A restarted worker has an empty optimizer: the previous repetition's
                # state would otherwise count in this one's peak memory.
                trainer.opt.state.clear()
                gc.collect()
                if cold and rank == 0:
                    evict(str(payload))
                base_rss = _status_kb("self", "VmRSS") / 1024
                reset_peak_rss()
                dist.barrier()
                started = time.perf_counter()
                manager.restore()
                elapsed = torch.tensor([time.perf_counter() - started,
                                        (peak_rss_mb() - base_rss) * MIB / state])
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank
                results.setdefault(f"restore_{mode}_{tag}", []).append(float(elapsed[0]))
                results.setdefault(f"restore_rss_growth_{mode}_{tag}", []).append(
                    float(elapsed[1]))
                # restore() starts allocating the first save's staging in the background:
                # let it end here, not pile up over the repetitions or outlive the process.
                manager.close()
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def measure_restore(root: Path, size_mb: float, reps: int, world: int) -> dict[str, list[float]]:
    """Restore and raw-read times (seconds, every repetition) and the peak RSS growth of
    the worst rank over the payload's bytes, from ``world`` gloo ranks in fresh processes."""
    out = root.parent / f"restore-{world}.json"
    torch_mp.start_processes(restore_worker,
                             args=(world, free_port(), str(root), size_mb, reps, str(out)),
                             nprocs=world, join=True, start_method=FRESH_PROCESS)
    return dict(json.loads(out.read_text()))


# -- the run ------------------------------------------------------------------------
# Each method and each restore rank runs in a process of its own, forked from a server
# that imported this script's modules and ran nothing (``main`` sets its preload): as
# fresh as a spawned interpreter, without importing torch again for every one of them.
FRESH_PROCESS = "forkserver"


@dataclass(frozen=True)
class MethodSpec:
    """A save method to build in a fresh process: ``kind`` sync, dcp or elastictrain."""

    kind: str
    mode: str = ""  # dcp: process/thread; elastictrain: the persister
    default: bool = False
    copy_at_once: bool = False
    run: int = 0  # elastictrain's default is measured in several processes
    paced_mb_s: float | None = None  # snapshot.persist_max_mb_s

    def build(self, root: Path, trainer: Trainer) -> Any:
        if self.kind == "sync":
            return SyncTorchSave(root, trainer)
        if self.kind == "dcp":
            return DcpAsyncSave(root, trainer, self.mode)
        return ElasticTrainAsync(root / f"run{self.run}", trainer, self.mode, self.default,
                                 copy_at_once=self.copy_at_once, paced_mb_s=self.paced_mb_s)


def method_process(spec: MethodSpec, size_mb: float, batch: int, saves: int, root: str,
                   out: str) -> None:
    """Measure one method in this (fresh) process: nothing another method allocated,
    dirtied or left running (DCP's process holds ~4.7x the state) is charged to it."""
    torch.set_num_threads(1)
    et_log.configure(level="warning", stream=sys.stderr)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)  # DCP wants a group
    trainer = Trainer.build(size_mb, batch=batch)
    trainer.step()  # AdamW creates its state on the first step
    free_core = busy_loop_ratio(trainer.step)
    # The floor of a persist's memory traffic beside this loop: half the state, copied.
    copy_floor = memory_copy_ratio(trainer.step, max(1, trainer.state_bytes() // 2 // MIB))
    trainer.steps.clear()
    raw_w = raw_write_s(Path(root), trainer.state_bytes())
    method = spec.build(Path(root), trainer)
    result = measure(method, trainer, saves, Path(root), raw_w)
    Path(out).write_text(json.dumps({
        "result": asdict(result), "raw_write_s": raw_w, "free_core": free_core,
        "copy_floor": copy_floor,
        "state_bytes": trainer.state_bytes(),
        "staging_bytes": getattr(method, "staging_bytes", None),
        "fwd_bwd_s": statistics.median(trainer.fwd_bwd_s) if trainer.fwd_bwd_s else None}))
    dist.destroy_process_group()


def measure_apart(spec: MethodSpec, args: argparse.Namespace, root: Path,
                  size_mb: float) -> dict[str, Any]:
    out = (root / f"method-{spec.kind}-{spec.mode}-{spec.copy_at_once}-{spec.run}"
                  f"-{spec.paced_mb_s}.json")
    os.sync()  # no dirty pages of the method before: their write-back is not this one's
    proc = torch_mp.get_context(FRESH_PROCESS).Process(
        target=method_process, args=(spec, size_mb, args.batch, args.saves, str(root), str(out)))
    proc.start()
    proc.join()
    if proc.exitcode != 0:
        raise RuntimeError(f"measuring {spec} failed (exit code {proc.exitcode})")
    found: dict[str, Any] = json.loads(out.read_text())
    found["result"] = MethodResult(**found["result"])
    return found


def run(args: argparse.Namespace, root: Path, size_mb: float) -> dict[str, Any]:
    load_before = load_average()
    default = SnapshotConfig().persister
    dcp = [] if args.skip_dcp else [MethodSpec("dcp", "process"), MethodSpec("dcp", "thread")]
    ours_runs = [MethodSpec("elastictrain", default, True, run=k) for k in range(args.runs)]
    # --paced-mb-s: as many runs of the default persister paced, each right after an
    # unpaced run, so a drift of the machine reaches both alike.
    paced_runs = ([MethodSpec("elastictrain", default, run=k, paced_mb_s=args.paced_mb_s)
                   for k in range(args.runs)] if args.paced_mb_s else [])
    interleaved = [spec for k, ours in enumerate(ours_runs)
                   for spec in (ours, *paced_runs[k:k + 1])]
    other = "process" if default == "thread" else "thread"
    methods = [MethodSpec("sync"), *dcp, *interleaved, MethodSpec("elastictrain", other),
               MethodSpec("elastictrain", "thread", copy_at_once=True)]
    # Every method runs in a fresh process; --order reversed shows whether the order
    # still matters (the disk's and the page cache's state remain shared).
    order = methods if args.order == "listed" else methods[::-1]
    found = {spec: measure_apart(spec, args, root, size_mb) for spec in order}
    state = found[methods[0]]["state_bytes"]
    raw_w = statistics.median(f["raw_write_s"] for f in found.values())
    free_core = min(f["free_core"] for f in found.values())
    runs = [found[spec]["result"] for spec in ours_runs]
    results = [found[spec]["result"] for spec in methods
               if spec not in ours_runs[1:] and spec not in paced_runs[1:]]
    ratios = [r.step_rate_ratio_during_persist for r in runs
              if r.step_rate_ratio_during_persist is not None]
    paced = [found[spec]["result"] for spec in paced_runs]
    paced_ratios = [r.step_rate_ratio_during_persist for r in paced
                    if r.step_rate_ratio_during_persist is not None]
    et_root = root / f"run{ours_runs[-1].run}" / f"et-{default}"
    staging_main = (found[ours_runs[0]]["staging_bytes"] or 0) / state
    fwd_bwd = [found[spec]["fwd_bwd_s"] for spec in ours_runs]
    flat = staging_flatness(root, args.staging_size_mb, args.staging_saves, default)
    gc.collect()
    restore_all = measure_restore(et_root, size_mb, args.restore_reps, 2)
    restore = {k: statistics.median(v) for k, v in restore_all.items()}
    one_all = measure_restore(et_root, size_mb, args.restore_reps, 1)
    one = {k: statistics.median(v) for k, v in one_all.items()}
    load_after = load_average()
    sync = results[0]
    ours = next(r for r in results if r.name.endswith("[default]"))
    at_once = next(r for r in results if "copy at once" in r.name)
    restore_mode = resolve_mode(open_store(str(et_root)), SnapshotConfig().restore_mode)
    # The copy behind that outlasts forward and backward blocks the optimizer's step
    # whatever the rest costs: the floor of the blocking.
    floor = statistics.median(max(0.0, save["copied_after_s"] - (fwd or 0.0))
                              for r, fwd in zip(runs, fwd_bwd, strict=True) for save in r.saves)
    summary = {
        "blocking_ratio_vs_sync": statistics.median(r.blocking_s for r in runs) / sync.blocking_s,
        "blocking_ratio_vs_sync_copy_at_once": at_once.blocking_s / sync.blocking_s,
        "step_rate_ratio_during_persist": statistics.median(ratios) if ratios else None,
        "step_rate_ratio_during_persist_paced": (statistics.median(paced_ratios)
                                                 if paced_ratios else None),
        "persist_vs_raw_write": ours.persist_vs_raw_write,
        "restore_vs_raw_read": restore[f"restore_{restore_mode}_cold"] / restore["raw_read_cold"],
        "restore_vs_raw_read_warm": (restore[f"restore_{restore_mode}_warm"]
                                     / restore["raw_read_warm"]),
        "restore_vs_raw_read_all_ranks": (restore[f"restore_{restore_mode}_cold"]
                                          / restore["raw_read_all_ranks_cold"]),
        "restore_vs_raw_read_1rank": one["restore_each_cold"] / one["raw_read_cold"],
        "restore_vs_raw_read_1rank_warm": one["restore_each_warm"] / one["raw_read_warm"],
        "restore_peak_rss_over_state": max(restore[f"restore_rss_growth_{restore_mode}_{t}"]
                                           for t in ("cold", "warm")),
        "staging_bytes_over_state_bytes": max(flat["staging_over_state"],
                                              staging_main or 0.0),
    }
    return {
        **summary,
        "runs": {"count": len(runs),
                 "step_rate_ratio_during_persist": ratios,
                 "step_rate_ratio_spread": spread(ratios) if ratios else None,
                 "blocking_s": [r.blocking_s for r in runs],
                 "durable_s": [r.durable_s for r in runs],
                 "blocking_floor_s": floor,
                 "blocking_floor_ratio_vs_sync": floor / sync.blocking_s,
                 "fwd_bwd_s": fwd_bwd,
                 "step_rate_ratio_with_memory_copy": [found[spec]["copy_floor"]
                                                      for spec in ours_runs]},
        "paced_runs": {"persist_max_mb_s": args.paced_mb_s, "count": len(paced),
                       "step_rate_ratio_during_persist": paced_ratios,
                       "step_rate_ratio_spread": spread(paced_ratios) if paced_ratios else None,
                       "blocking_s": [r.blocking_s for r in paced],
                       "durable_s": [r.durable_s for r in paced]},
        "targets": {k: {"target": f"{op} {v}", "met": _met(summary.get(k), op, v)}
                    for k, (op, v) in TARGETS.items()},
        "setup": {"size_mb": size_mb, "state_bytes": state, "saves": args.saves,
                  "torch": torch.__version__, "cpus": os.cpu_count(),
                  "training_threads": 1, "save_ranks": 1, "fresh_process_per_method": True,
                  "batch": args.batch, "method_order": args.order,
                  "restore_ranks": 2, "backend": "gloo", "storage": str(root),
                  "default_persister": default, "default_restore_mode": restore_mode,
                  "load_avg_before": load_before, "load_avg_after": load_after,
                  "step_rate_ratio_with_busy_loop": free_core,
                  "step_rate_ratio_with_memory_copy": statistics.median(
                      f["copy_floor"] for f in found.values()),
                  "noisy": noisy(load_before, load_after, free_core)},
        "raw_write_s": raw_w,
        "methods": [asdict(r) for r in results],
        "restore_s": restore,
        "restore_spread_s": {k: spread(v) for k, v in restore_all.items()},
        "restore_1rank_s": one,
        "restore_1rank_spread_s": {k: spread(v) for k, v in one_all.items()},
        "staging": flat,
        "curve": curve_point(state, ours, sync, restore_all, restore_mode),
    }


def throughput(nbytes: int, seconds: dict[str, float]) -> dict[str, float]:
    """MB/s from a time spread (the slowest time gives the lowest rate)."""
    return {"median": nbytes / 1e6 / seconds["median"], "min": nbytes / 1e6 / seconds["max"],
            "max": nbytes / 1e6 / seconds["min"]}


def curve_point(state: int, ours: MethodResult, sync: MethodResult,
                restore: dict[str, list[float]], mode: str) -> dict[str, Any]:
    """One size's point of the scaling curve: seconds and MB/s, each with its spread."""
    return {
        "state_bytes": state,
        "blocking_s": ours.spread["blocking_s"], "durable_s": ours.spread["durable_s"],
        "sync_save_s": sync.spread["blocking_s"],
        "persist_mb_s": throughput(state, ours.spread["persist_s"]),
        "raw_write_mb_s": throughput(state, ours.spread["raw_write_s"]),
        "restore_cold_mb_s": throughput(state, spread(restore[f"restore_{mode}_cold"])),
        "raw_read_cold_mb_s": throughput(state, spread(restore["raw_read_cold"])),
        "restore_warm_mb_s": throughput(state, spread(restore[f"restore_{mode}_warm"])),
        "raw_read_warm_mb_s": throughput(state, spread(restore["raw_read_warm"])),
    }


def _met(value: float | None, op: str, target: float) -> bool | None:
    if value is None:
        return None
    return value <= target if op == "<=" else value >= target



# -- output -------------------------------------------------------------------------
def table(report: dict[str, Any]) -> str:
    setup = report["setup"]
    lines = [
        f"elastictrain snapshot benchmark: {setup['size_mb']} MB state "
        f"({setup['state_bytes'] / 2**20:.0f} MiB of tensors), torch {setup['torch']}, "
        f"{setup['cpus']} CPUs; training loop on {setup['training_threads']} thread, the other "
        "core left to background work",
        f"saves: 1 rank (gloo group of 1), median of {setup['saves']} after a warm-up save; "
        f"restore: {setup['restore_ranks']} ranks over gloo; storage {setup['storage']}",
        f"load average before/after: {setup['load_avg_before']:.2f}/"
        f"{setup['load_avg_after']:.2f}; step rate with a busy-loop process beside the "
        f"loop: {setup['step_rate_ratio_with_busy_loop']:.0%} of without (100%: a core is free)"
        + ("  (NOISY: other work was running)" if setup["noisy"] else ""),
        *([] if setup.get("step_rate_ratio_with_memory_copy") is None else [
            "step rate with a process copying half the state in a loop beside the loop: "
            f"{setup['step_rate_ratio_with_memory_copy']:.0%} of without (the floor of a "
            "persist's memory traffic on this host)"]),
        "",
        f"{'method':40s} {'block s':>8s} {'durable s':>9s} {'persist s':>9s} "
        f"{'steps%':>7s} {'raw wr s':>8s} {'vs raw':>6s} {'unpair':>6s} {'1st blk':>8s} "
        f"{'1st dur':>8s} {'RSS MB':>7s} {'helper':>7s}",
    ]
    for m in report["methods"]:
        rate = m["step_rate_ratio_during_persist"]
        lines.append(
            f"{m['name']:40s} {m['blocking_s']:8.3f} {m['durable_s']:9.3f} {m['persist_s']:9.3f} "
            f"{'blocks' if rate is None else f'{rate:.1%}':>7s} {m['raw_write_s']:8.3f} "
            f"{m['persist_vs_raw_write']:6.2f} {m['persist_vs_raw_write_unpaired']:6.2f} "
            f"{m['first_blocking_s']:8.3f} {m['first_durable_s']:8.3f} {m['peak_rss_mb']:7.0f} "
            f"{m['helper_peak_rss_mb']:7.0f}")
    runs = report["runs"]
    lines += [
        f"default method in {runs['count']} fresh processes: step rate while persisting "
        + ", ".join(f"{x:.1%}" for x in runs["step_rate_ratio_during_persist"])
        + f"; blocking s {', '.join(f'{x:.3f}' for x in runs['blocking_s'])}; durable s "
        + ", ".join(f"{x:.2f}" for x in runs["durable_s"]),
        *([] if not report["paced_runs"]["count"] else [
            f"paced at {report['paced_runs']['persist_max_mb_s']:g} MB/s "
            f"(snapshot.persist_max_mb_s) in {report['paced_runs']['count']} fresh processes, "
            "each right after one above: step rate while persisting "
            + ", ".join(f"{x:.1%}" for x in report["paced_runs"]["step_rate_ratio_during_persist"])
            + "; durable s "
            + ", ".join(f"{x:.2f}" for x in report["paced_runs"]["durable_s"])]),
        f"blocking floor (the copy behind outlasting forward+backward, fwd+bwd "
        f"{', '.join(f'{x:.3f}' for x in runs['fwd_bwd_s'] if x is not None)} s): "
        f"{runs['blocking_floor_s']:.3f} s = {runs['blocking_floor_ratio_vs_sync']:.4f} of "
        "the synchronous save",
    ]
    r, one = report["restore_s"], report["restore_1rank_s"]
    lines += [
        f"raw write+fsync of the state bytes: {report['raw_write_s']:.3f} s at the start; "
        "'raw wr s' is the median of that and one write right before and after each method",
        "persist s: save returned (a copy behind: copied) -> durable; steps%: training step"
        " rate while persisting vs without a save; vs raw: median over the saves of a raw"
        " write made just before each save / its persist (1.00 = as fast as raw); unpair:"
        " 'raw wr s' / the median persist",
        "",
        f"restore (2 ranks, slowest rank)   cold: each {r['restore_each_cold']:.3f} s, "
        f"broadcast {r['restore_broadcast_cold']:.3f} s, raw read {r['raw_read_cold']:.3f} s "
        f"(1 process), {r['raw_read_all_ranks_cold']:.3f} s (both ranks at once)",
        f"                                  warm: each {r['restore_each_warm']:.3f} s, "
        f"broadcast {r['restore_broadcast_warm']:.3f} s, raw read {r['raw_read_warm']:.3f} s "
        f"(1 process), {r['raw_read_all_ranks_warm']:.3f} s (both ranks at once)",
        "restore: from restore() to its return on the slowest rank (discover, read, verify, "
        "load, apply); cold: the payload evicted from the page cache first",
        "restore_vs_raw_read (default mode, cold, vs 1 process): "
        f"{report['restore_vs_raw_read']:.2f}"
        f"; warm: {report['restore_vs_raw_read_warm']:.2f}; vs both ranks reading at once: "
        f"{report['restore_vs_raw_read_all_ranks']:.2f}",
        f"restore (1 rank)                  cold: {one['restore_each_cold']:.3f} s, raw read "
        f"{one['raw_read_cold']:.3f} s ({report['restore_vs_raw_read_1rank']:.2f}); warm: "
        f"{one['restore_each_warm']:.3f} s, raw read {one['raw_read_warm']:.3f} s "
        f"({report['restore_vs_raw_read_1rank_warm']:.2f})",
        "peak RSS growth during restore / payload bytes (worst rank, default mode): "
        f"{report['restore_peak_rss_over_state']:.3f} (1 rank: "
        f"{max(one['restore_rss_growth_each_cold'], one['restore_rss_growth_each_warm']):.3f})",
    ]
    st = report["staging"]
    lines += [
        f"staging over {st['saves']} saves of a {st['size_mb']} MB state ({st['persister']}): "
        f"{st['staging_bytes_max']} bytes for {st['state_bytes']} state bytes "
        f"({st['staging_over_state']:.4f}x), flat={st['flat']}, "
        f"slabs {st['allocations_first']}->{st['allocations_last']}, "
        f"RSS growth save 2->{st['saves']}: {st['rss_growth_mb_save2_to_last']} MB",
        "",
        "summary (elastictrain default vs baselines):",
    ]
    for key, target in report["targets"].items():
        value = report[key]
        shown = "n/a" if value is None else f"{value:.4f}"
        verdict = {True: "met", False: "MISSED", None: "n/a"}[target["met"]]
        lines.append(f"  {key:34s} {shown:>8s}   target {target['target']:8s} {verdict}")
    return "\n".join(lines)


def curve_table(points: list[dict[str, Any]]) -> str:
    """The scaling curve: one line per size, medians with [min-max]."""
    lines = [
        "scaling curve (elastictrain default; medians [min-max]; MB/s = state bytes / time)",
        f"{'size MB':>8s} {'blocking s':>21s} {'sync save s':>21s} {'durable s':>21s} "
        f"{'persist MB/s':>21s} {'raw write MB/s':>21s} {'restore MB/s':>21s} "
        f"{'raw read MB/s':>21s} {'load':>5s} noisy",
    ]
    for p in points:
        c, setup = p["curve"], p["setup"]
        load = max(setup["load_avg_before"], setup["load_avg_after"])
        lines.append(
            f"{setup['size_mb']:8g} {fmt(c['blocking_s']):>21s} {fmt(c['sync_save_s']):>21s} "
            f"{fmt(c['durable_s']):>21s} {fmt(c['persist_mb_s'], 0):>21s} "
            f"{fmt(c['raw_write_mb_s'], 0):>21s} {fmt(c['restore_cold_mb_s'], 0):>21s} "
            f"{fmt(c['raw_read_cold_mb_s'], 0):>21s} {load:5.2f} {setup['noisy']}")
    lines.append("restore and raw read: cold (payload evicted from the page cache), 2 ranks")
    return "\n".join(lines)


def plot(path: str, points: list[dict[str, Any]]) -> None:
    sizes = [p["setup"]["size_mb"] for p in points]
    keys = {"elastictrain persist": "persist_mb_s", "raw write+fsync": "raw_write_mb_s",
            "elastictrain restore (cold)": "restore_cold_mb_s",
            "raw read (cold)": "raw_read_cold_mb_s",
            "elastictrain restore (warm)": "restore_warm_mb_s",
            "raw read (warm)": "raw_read_warm_mb_s"}
    plot_curve(path, "snapshot throughput vs state size (local disk; restore: 2 ranks)", sizes,
               {name: [p["curve"][key] for p in points] for name, key in keys.items()}, "MB/s")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", "--size-mb", dest="sizes", type=float, nargs="+", default=[1024],
                   help="state sizes in MB (model + AdamW), one run each")
    p.add_argument("--saves", type=int, default=3, help="measured saves per method")
    p.add_argument("--runs", type=int, default=3,
                   help="fresh processes measuring the default elastictrain method (the "
                        "step-rate and blocking figures are medians over them)")
    p.add_argument("--batch", type=int, default=8, help="rows per training step (its compute)")
    p.add_argument("--paced-mb-s", type=float, default=None, metavar="RATE",
                   help="also measure the default method with snapshot.persist_max_mb_s=RATE, "
                        "--runs times, each run right after an unpaced one")
    p.add_argument("--staging-saves", type=int, default=50)
    p.add_argument("--staging-size-mb", type=float, default=32)
    p.add_argument("--restore-reps", type=int, default=3)
    p.add_argument("--skip-dcp", action="store_true",
                   help="leave out the dcp.async_save baselines (their process holds ~4.7x "
                        "the state: a 4 GiB state does not fit in 24 GiB with them)")
    p.add_argument("--order", choices=["listed", "reversed"], default="listed",
                   help="the order the save methods run in (reversed: the default method "
                   "last), to tell a method's cost from what the one before it left behind")
    p.add_argument("--dir", default=tempfile.gettempdir(), help="storage parent directory")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                   help="write the curve as JSON to FILE (no FILE or -: stdout)")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="draw the curve")
    p.add_argument("--from-json", nargs="+", default=[], metavar="FILE",
                   help="measure nothing: print and plot the points of earlier --json runs "
                        "(each keeps its own load and noisy flag), e.g. sizes run apart")
    args = p.parse_args(argv)
    for name in ("saves", "runs", "staging_saves", "staging_size_mb", "restore_reps"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)}: must be > 0")
    for size in args.sizes:
        if size <= 0:
            p.error(f"--sizes {size:g}: every size must be > 0 MB")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # By name: Python 3.11's forkserver drops the main script's path, so "__main__" would
    # preload nothing. torch._dynamo: the optimizer's first use imports it (~2 s).
    torch_mp.get_context(FRESH_PROCESS).set_forkserver_preload(["bench_snapshot",
                                                                "torch._dynamo"])
    torch.set_num_threads(1)
    et_log.configure(level="warning", stream=sys.stderr)
    stdout = os.dup(1)
    os.dup2(2, 1)  # helpers and DCP print; stdout carries only the result
    points = sorted((p for f in args.from_json for p in json.loads(Path(f).read_text())["points"]),
                    key=lambda p: p["setup"]["size_mb"])
    try:
        for size in [] if args.from_json else args.sizes:
            root = Path(tempfile.mkdtemp(prefix="elastictrain-bench-", dir=args.dir))
            try:
                points.append(run(args, root, size))
            finally:
                shutil.rmtree(root, ignore_errors=True)
    finally:
        os.dup2(stdout, 1)
    if args.json is not None:
        write_json(args.json, {"sizes_mb": [p["setup"]["size_mb"] for p in points],
                               "points": points})
    if args.json != "-":
        print("\n\n".join(table(p) for p in points), flush=True)
        print("\n" + curve_table(points), flush=True)
    if args.plot:
        plot(args.plot, points)


if __name__ == "__main__":
    main()
