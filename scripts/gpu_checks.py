"""The GPU path in one command: what elastictrain promises on CUDA, checked and timed on
a machine with a GPU, printed as one JSON object (figures: docs/benchmarks.md#on-a-gpu).

    python scripts/gpu_checks.py [--dry] [--only NAME ...] [--out FILE]

Checks, each in its own processes, each ``ok`` or not with its figures:

* ``snapshot``: a user's loop (``restore()``, then ``step()``; a save every 100
  steps) on a CUDA model + AdamW of ``--snapshot-mb`` parameters: save
  blocking (the first save against the later ones: pinned staging must be ready
  before the first save is due), durable-after, a synchronous ``torch.save`` + fsync of
  the same state, and a restore into a fresh CUDA model that must be equal;
* ``ddp_restart``: a DDP job on NCCL under ``elastictrain run`` (workers forked by the
  standby, which must not have touched CUDA), a worker SIGKILLed, the group re-formed
  and resumed: final parameters equal to a clean run's;
* ``fsdp2_restart``: the same with FSDP2 (``fully_shard``);
* ``cuda_stall``: a kernel that spins past the watchdog's timeout: the watchdog
  fires, the worker exits 71, the restart finishes equal to a clean run;
* ``notice_during_save``: SIGTERM while a save of CUDA state persists: exit 75 with a
  final snapshot, and the next launch resumes from it, losing no step;
* ``sense_check``: a snapshot saved with a NaN parameter (its checksums verify), the
  worker killed after it: the restore is found wrong in its first step on the GPU
  (``snapshot.suspect``), set aside, and the run finishes from the one before, equal to
  a clean run.

``--dry`` (or no GPU) runs the same checks on CPU with gloo and two workers, small:
CI runs it so the command stays correct on machines without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # elastictrain from this checkout, installed or not
from benchlib import events_named  # noqa: E402  (scripts/, beside this file)

JOB = REPO / "scripts" / "gpu_job.py"
EXIT_PREEMPTED = 75


class Checks:
    """Shared settings of one run of the checks."""

    def __init__(self, dry: bool, workdir: Path, snapshot_mb: int) -> None:
        self.dry = dry
        self.workdir = workdir
        self.snapshot_mb = snapshot_mb
        self.nproc = 2 if dry else max(1, torch.cuda.device_count())
        # Small on CPU; on a GPU, large enough that a save takes measurable time.
        self.job_args = ["--width=64", "--layers=2"] if dry else ["--width=2048",
                                                                  "--layers=4"]
        self._clean: dict[str, str] = {}

    def launch(self, name: str, job_args: list[str], timeout_s: float,
               env: dict[str, str] | None = None) -> tuple[int, Path, Path]:
        """``elastictrain run`` the job to its end: (exit code, storage root, events)."""
        root, events = self.workdir / name / "store", self.workdir / name / "events"
        root.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "elastictrain.cli", "run",
               f"--nproc-per-node={self.nproc}", "--max-restarts=2",
               f"--log-dir={self.workdir / name / 'logs'}", str(JOB), str(root),
               *self.job_args, *job_args]
        paths = [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
        full_env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths),
                    "PYTHONUNBUFFERED": "1", "ELASTICTRAIN_LOG__EVENTS_DIR": str(events),
                    **(env or {})}
        with open(self.workdir / name / "launcher.log", "ab") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env,
                                    start_new_session=True, cwd=self.workdir)
            try:
                code = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                raise TimeoutError(f"{name}: no end within {timeout_s:.0f} s") from None
        return code, root, events

    def result(self, root: Path) -> dict[str, Any]:
        path = root / "result.json"
        return json.loads(path.read_text()) if path.exists() else {}

    def clean_digest(self, name: str, extra: list[str]) -> str:
        """The final parameters of an uninterrupted run (one per job variant)."""
        key = " ".join(extra)
        if key not in self._clean:
            code, root, _ = self.launch(f"{name}-clean", ["--steps=40", *extra], 300)
            if code != 0:
                raise RuntimeError(f"{name}: the clean run exited {code}")
            self._clean[key] = str(self.result(root)["digest"])
        return self._clean[key]


def check_snapshot(checks: Checks) -> dict[str, Any]:
    """In this process: blocking of each save of a user's loop, durable-after, restore."""
    from elastictrain.snapshot.manager import SnapshotManager
    from elastictrain.worker.dist import DistContext

    device = torch.device("cpu" if checks.dry else "cuda")
    width, batch = (512, 64) if checks.dry else (8192, 1024)
    layers = max(1, checks.snapshot_mb * 2**20 // (width * width * 4))

    def build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
        model = model.to(device)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4)

    def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        model(torch.randn(batch, width, device=device)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()

    # A save every ~3.6 s on an H200 (36 ms steps), above the time to persist 3 GB
    # (~2.4 s): later saves measure staging, not back-pressure from the one before.
    every = 5 if checks.dry else 100
    ctx = DistContext(0, 1, 0, "gloo", device, False)
    root = checks.workdir / "snapshot"
    model, opt = build(0)
    snap = SnapshotManager(str(root / "et"), model=model, optimizer=opt, ctx=ctx,
                           every_steps=every, keep=2, mode="async")
    started = time.perf_counter()
    snap.restore()
    restore_returned = time.perf_counter() - started
    blocking: list[float] = []
    durable: list[float] = []
    step_s: list[float] = []
    while snap.step_count < every * 4:
        t0 = time.perf_counter()
        train_step(model, opt)
        t1 = time.perf_counter()
        handle = snap.step()
        t2 = time.perf_counter()
        if handle is None:
            step_s.append(t1 - t0)
            continue
        blocking.append(t2 - t1)
        handle.add_done_callback(durable_since(t1, durable))
    snap.wait()
    expected = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    expected_opt = [v.detach().cpu().clone() for s in opt.state.values()
                    for v in s.values() if isinstance(v, torch.Tensor)]
    snap.close()
    state_mb = sum(p.numel() * 4 * 3 for p in model.parameters()) / 2**20
    sync: list[float] = []
    for i in range(2):
        t0 = time.perf_counter()
        with open(root / f"torch_save{i}.pt", "wb") as f:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, f)
            f.flush()
            os.fsync(f.fileno())
        sync.append(time.perf_counter() - t0)
    fresh, fresh_opt = build(1)
    restore_snap = SnapshotManager(str(root / "et"), model=fresh, optimizer=fresh_opt,
                                   ctx=ctx, every_steps=10**9, mode="async")
    t0 = time.perf_counter()
    info = restore_snap.restore()
    if device.type == "cuda":
        torch.cuda.synchronize()
    restore_s = time.perf_counter() - t0
    params_equal = all(torch.equal(expected[k], v.detach().cpu())
                       for k, v in fresh.state_dict().items())
    got_opt = [v.detach().cpu() for s in fresh_opt.state.values()
               for v in s.values() if isinstance(v, torch.Tensor)]
    opt_equal = len(got_opt) == len(expected_opt) and all(
        torch.equal(a, b) for a, b in zip(expected_opt, got_opt, strict=True))
    on_device = all(p.device.type == device.type for p in fresh.parameters())
    restore_snap.close()
    later = statistics.median(blocking[1:])
    first_ok = blocking[0] <= max(2 * later, later + 0.02)
    return {
        # A timing is part of the verdict only on a GPU: on a busy CPU (CI) it is noise.
        "ok": bool((first_ok or checks.dry) and params_equal and opt_equal and on_device
                   and info.from_step == every * 4),
        "state_mb": round(state_mb), "every_steps": every,
        "step_s_median": round(statistics.median(step_s), 4),
        "restore_call_returned_s": round(restore_returned, 4),
        "first_save_blocking_s": round(blocking[0], 4),
        "later_saves_blocking_s": [round(b, 4) for b in blocking[1:]],
        "first_save_as_later": first_ok,
        "durable_after_s_median": round(statistics.median(durable), 3) if durable else None,
        "torch_save_sync_s": [round(s, 3) for s in sync],
        "blocking_vs_sync": round(later / statistics.median(sync), 4),
        "restore_s": round(restore_s, 3), "restored_step": info.from_step,
        "params_equal": params_equal, "optimizer_equal": opt_equal,
        "restored_on_device": on_device,
    }


def durable_since(started: float, out: list[float]) -> Callable[[Any], None]:
    """A save's done-callback that records the seconds since ``started``."""
    return lambda _handle: out.append(time.perf_counter() - started)


def restart_check(checks: Checks, name: str, extra: list[str]) -> dict[str, Any]:
    """Kill a worker at step 25 (snapshots every 10): resumed from 20, equal to clean."""
    clean = checks.clean_digest(name, extra)
    t0 = time.perf_counter()
    code, root, ev = checks.launch(name, ["--steps=40", "--kill-at=25", *extra], 300)
    wall = time.perf_counter() - t0
    result = checks.result(root)
    started_by = [e.get("started_by") for e in events_named(ev, "agent.attempt_started")]
    expected_backend = "gloo" if checks.dry else "nccl"
    ok = (code == 0 and result.get("digest") == clean and result.get("restart_count") == 1
          and result.get("resumed_from") == 20 and result.get("backend") == expected_backend
          and not result.get("cuda_initialized_before_init")
          and started_by == ["standby", "standby"])
    return {"ok": ok, "exit_code": code, "wall_s": round(wall, 1),
            "equal_to_clean_run": result.get("digest") == clean,
            "attempts_started_by": started_by, **result}


def check_ddp_restart(checks: Checks) -> dict[str, Any]:
    return restart_check(checks, "ddp_restart", [])


def check_fsdp2_restart(checks: Checks) -> dict[str, Any]:
    return restart_check(checks, "fsdp2_restart", ["--fsdp"])


def check_cuda_stall(checks: Checks) -> dict[str, Any]:
    timeout_s = 5 if checks.dry else 10
    clean = checks.clean_digest("cuda_stall", [])
    t0 = time.perf_counter()
    code, root, ev = checks.launch(
        "cuda_stall", ["--steps=40", "--stall-at=15"], 150,
        {"ELASTICTRAIN_WATCHDOG__TIMEOUT_S": str(timeout_s)})
    wall = time.perf_counter() - t0
    result = checks.result(root)
    fired = events_named(ev, "watchdog.fired")
    codes = [e.get("exit_code") for e in events_named(ev, "agent.worker_failed")]
    ok = (code == 0 and bool(fired) and 71 in codes and result.get("digest") == clean
          and result.get("resumed_from") == 10)
    return {"ok": ok, "exit_code": code, "wall_s": round(wall, 1),
            "watchdog_timeout_s": timeout_s, "watchdog_fired": len(fired),
            "worker_exit_codes": codes, "equal_to_clean_run": result.get("digest") == clean,
            "resumed_from": result.get("resumed_from")}


def check_notice_during_save(checks: Checks) -> dict[str, Any]:
    clean = checks.clean_digest("notice", [])
    code, root, ev = checks.launch("notice", ["--steps=40", "--notice-at=20"], 300)
    notice_path = root / "notice.json"
    notice = json.loads(notice_path.read_text()) if notice_path.exists() else {}
    final = events_named(ev, "preempt.saved")
    code2, _, _ = checks.launch("notice", ["--steps=40"], 300)
    result = checks.result(root)
    ok = (code == EXIT_PREEMPTED and code2 == 0 and result.get("digest") == clean
          and result.get("resumed_from") in (20, 21) and notice.get("in_flight") is True)
    return {"ok": ok, "first_exit_code": code, "relaunch_exit_code": code2,
            "save_in_flight_at_notice": notice.get("in_flight"),
            "final_snapshot_events": len(final), "resumed_from": result.get("resumed_from"),
            "equal_to_clean_run": result.get("digest") == clean}


def check_sense(checks: Checks) -> dict[str, Any]:
    """NaN planted before the save of step 20, killed at 25: suspect, resumed from 10."""
    clean = checks.clean_digest("sense_check", [])
    t0 = time.perf_counter()
    code, root, ev = checks.launch("sense_check",
                                   ["--steps=40", "--nan-at=20", "--kill-at=25"], 300)
    wall = time.perf_counter() - t0
    result = checks.result(root)
    suspect = events_named(ev, "snapshot.suspect")
    steps = sorted({int(e["snapshot_step"]) for e in suspect if "snapshot_step" in e})
    ok = (code == 0 and result.get("digest") == clean and steps == [20]
          and result.get("resumed_from") == 10 and len(result.get("suspects", [])) == 1)
    return {"ok": ok, "exit_code": code, "wall_s": round(wall, 1),
            "suspect_steps": steps, "suspect_reasons": sorted({str(e.get("reason"))
                                                                for e in suspect}),
            "equal_to_clean_run": result.get("digest") == clean, **result}


CHECKS: dict[str, Callable[[Checks], dict[str, Any]]] = {
    "snapshot": check_snapshot, "ddp_restart": check_ddp_restart,
    "fsdp2_restart": check_fsdp2_restart, "notice_during_save": check_notice_during_save,
    "sense_check": check_sense,
    "cuda_stall": check_cuda_stall,  # last: a kernel that outlives its process would block
}


def snapshot_table(snapshot: dict[str, Any]) -> str:
    """docs/benchmarks.md's table of the snapshot check, from a saved report's figures."""
    def secs(values: list[float], digits: int) -> str:
        return ", ".join(f"{v:.{digits}f}" for v in values) + " s"

    rows = [
        ("first save blocks", secs([snapshot["first_save_blocking_s"]], 3)),
        ("later saves block", secs(snapshot["later_saves_blocking_s"], 3)),
        ("durable after (median of 4)", secs([snapshot["durable_after_s_median"]], 2)),
        (f"synchronous `torch.save` + fsync of the same state "
         f"({len(snapshot['torch_save_sync_s'])} runs)", secs(snapshot["torch_save_sync_s"], 2)),
        ("save ÷ synchronous", f"{snapshot['blocking_vs_sync']:.3f}"),
        ("verified restore into a fresh CUDA model", secs([snapshot["restore_s"]], 2)),
        ("restored parameters and optimizer state equal, on the GPU",
         "yes" if snapshot["params_equal"] and snapshot["optimizer_equal"]
         and snapshot["restored_on_device"] else "no"),
    ]
    return "\n".join(["| figure | value |", "|---|---|",
                      *(f"| {name} | {value} |" for name, value in rows)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry", action="store_true", help="CPU and gloo, small (CI)")
    parser.add_argument("--only", nargs="*", choices=sorted(CHECKS), default=None)
    parser.add_argument("--snapshot-mb", type=int, default=1024,
                        help="parameters of the snapshot check's model (state: 3x)")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    parser.add_argument("--table", metavar="JSON",
                        help="print the snapshot check's table of a saved report")
    args = parser.parse_args(argv)
    if args.table:
        print(snapshot_table(json.loads(Path(args.table).read_text())["checks"]["snapshot"]))
        return 0
    dry = args.dry or not torch.cuda.is_available()
    workdir = Path(tempfile.mkdtemp(prefix="et-gpu-checks-"))
    checks = Checks(dry, workdir, 4 if dry else args.snapshot_mb)
    report: dict[str, Any] = {
        "dry": dry, "torch": torch.__version__, "workdir": str(workdir),
        "device": "cpu" if dry else torch.cuda.get_device_name(0),
        "nproc_per_node": checks.nproc, "checks": {}}
    for name in args.only or list(CHECKS):
        t0 = time.perf_counter()
        try:
            report["checks"][name] = CHECKS[name](checks)
        except Exception as error:  # one check's failure must not hide the others'
            report["checks"][name] = {"ok": False, "error": f"{type(error).__name__}: {error}"}
        report["checks"][name]["check_s"] = round(time.perf_counter() - t0, 1)
        print(json.dumps({name: report["checks"][name]}), file=sys.stderr, flush=True)
    report["ok"] = all(c["ok"] for c in report["checks"].values())
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
