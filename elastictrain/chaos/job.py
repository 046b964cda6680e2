"""One training job under ``elastictrain run``, as chaos launches, signals and relaunches it.

Every process of a trial carries ``ETCHAOS_RUN=<trial marker>/<launch>`` in its
environment (children inherit it, torchrun's workers included), so the job's
processes are found by PID in ``/proc`` even when they have not logged yet,
and a process left behind after the trial cannot hide.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

from elastictrain.chaos.schedule import StorageFaults
from elastictrain.core.proc import stat_fields
from elastictrain.launcher.spawn import LaunchSpec, start_torchrun
from elastictrain.runlog.events_read import read_events

MARKER_VAR = "ETCHAOS_RUN"


def events_of(events_dir: Path) -> list[dict[str, Any]]:
    """Every event of a run (workers' and agents' files), in time order."""
    found = [e for p in sorted(events_dir.rglob("*.jsonl")) for e in read_events(p)]
    return sorted(found, key=lambda e: float(e.get("ts") or 0.0))


# How long the kill of a trial's processes goes on finding new ones (see kill_marked).
KILL_ROUNDS_S = 10.0


def kill_marked(marker: str, timeout_s: float) -> list[int]:
    """SIGKILL (after a SIGCONT, for a stopped one) every process marked ``marker``, in
    rounds until none is left or ``timeout_s`` passed; returns the PIDs signalled. One
    round is not enough: a process forking while the round lists /proc (a standby
    starting a worker, torchrun its next group) has a child the list did not see."""
    killed: list[int] = []
    deadline = time.monotonic() + timeout_s
    while (left := processes_with_marker(marker)) and time.monotonic() < deadline:
        for pid in left:
            signal_pid(pid, signal.SIGCONT)
            if signal_pid(pid, signal.SIGKILL) and pid not in killed:
                killed.append(pid)
        time.sleep(0.01)  # a SIGKILLed process takes a moment to leave /proc
    return killed


def processes_with_marker(marker: str) -> list[int]:
    """PIDs of live processes (not zombies) marked ``marker`` or ``marker/…``."""
    needle = f"{MARKER_VAR}={marker}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            state = stat_fields(entry.name)[0]
        except (OSError, IndexError):
            continue  # gone, or not ours to read
        if state not in ("Z", "X") and any(
                v == needle or v.startswith(needle + b"/") for v in environ.split(b"\0")):
            found.append(int(entry.name))
    return found


def trial_env(storage: str, secret: str, watchdog_timeout_s: float,
              storage_faults: StorageFaults | None, seed: int) -> dict[str, str]:
    """The environment every run of a trial shares (its launchers and their workers)."""
    env = {
        "OMP_NUM_THREADS": "1",
        "ELASTICTRAIN_STORAGE__URL": storage,
        # A fake credential in the storage options (the local store ignores it):
        # the trial fails if it shows up in any output or event.
        "ELASTICTRAIN_STORAGE__STORAGE_OPTIONS": json.dumps(
            {"key": "AKIACHAOSEXAMPLE", "secret": secret}),
        "ELASTICTRAIN_WATCHDOG__TIMEOUT_S": str(watchdog_timeout_s),
        # A stopped rank during startup holds its peers in the rendezvous or before
        # the first step: fail those attempts in seconds, not minutes.
        "ELASTICTRAIN_WATCHDOG__STARTUP_TIMEOUT_S": "30",
        "ELASTICTRAIN_DIST__INIT_TIMEOUT_S": "30",
        # A rank stopped after its peers finished: the agent ends it after this long.
        "ELASTICTRAIN_LAUNCH__EXIT_TIMEOUT_S": "15",
    }
    if storage_faults is not None:
        env["ELASTICTRAIN_STORAGE__FAULTS"] = json.dumps({**asdict(storage_faults), "seed": seed})
    return env


def signal_pid(pid: int, sig: signal.Signals) -> bool:
    """Send ``sig`` to ``pid``; False if it is already gone."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return False
    return True


@dataclass
class Job:
    """A job's launches: the same command, the same storage, a new launcher each time.

    Args:
        spec: the torchrun invocation (``elastictrain run`` with the project's settings).
        env: extra environment for the launcher and its workers.
        workdir: the trial's directory (events, launcher log, torchrun's scratch).
        marker: unique to the trial; launch ``i`` is marked ``<marker>/<i>``.
    """

    spec: LaunchSpec
    env: dict[str, str]
    workdir: Path
    marker: str
    exit_codes: list[int] = field(default_factory=list)
    _proc: subprocess.Popen[bytes] | None = None
    _started_ts: float = 0.0
    _log: IO[str] | None = None

    @property
    def events_dir(self) -> Path:
        return self.workdir / "events"

    @property
    def launches(self) -> int:
        return len(self.exit_codes) + (1 if self._proc is not None else 0)

    def launch(self) -> None:
        """Start a launcher (the previous one must have ended)."""
        assert self._proc is None
        self.events_dir.mkdir(parents=True, exist_ok=True)
        if self._log is None:
            self._log = open(self.workdir / "launcher.log", "a")  # noqa: SIM115 - closed by close()
        env = {**self.env, MARKER_VAR: f"{self.marker}/{self.launches}",
               "TMPDIR": str(self.workdir)}
        self._started_ts = time.time()
        self._proc = start_torchrun(self.spec, stdout=self._log, extra_env=env)

    def poll(self) -> int | None:
        """The launcher's exit code once it ended (recorded in ``exit_codes``), else None."""
        if self._proc is None:
            return self.exit_codes[-1] if self.exit_codes else None
        code = self._proc.poll()
        if code is not None:
            self.exit_codes.append(code)
            self._proc = None
        return code

    @property
    def launcher_pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def worker_pids(self) -> dict[int, int]:
        """rank → PID of the current attempt's live workers (from ``worker.start``)."""
        if self._proc is None:
            return {}
        starts = [e for e in events_of(self.events_dir)
                  if e.get("event") == "worker.start" and float(e["ts"]) >= self._started_ts]
        if not starts:
            return {}
        attempt = max(int(e["restart_count"]) for e in starts)
        live = set(processes_with_marker(f"{self.marker}/{self.launches - 1}"))
        return {int(e["rank"]): int(e["pid"]) for e in starts
                if int(e["restart_count"]) == attempt and int(e["pid"]) in live}

    def kill_job(self) -> list[int]:
        """SIGKILL the launcher and every process of this launch (by PID); wait for the
        launcher. Returns the PIDs killed."""
        assert self._proc is not None
        pids = [self._proc.pid]
        signal_pid(self._proc.pid, signal.SIGKILL)
        pids += kill_marked(f"{self.marker}/{self.launches - 1}", KILL_ROUNDS_S)
        self._proc.wait()
        self.poll()
        return pids

    def wait_gone(self, timeout_s: float) -> list[int]:
        """Wait until no process of the trial is left; return those still there."""
        deadline = time.monotonic() + timeout_s
        while (left := processes_with_marker(self.marker)) and time.monotonic() < deadline:
            time.sleep(0.1)  # polling a condition (processes exiting), with a deadline
        return left

    def close(self) -> None:
        """Stop whatever is left of the trial (SIGCONT a stopped rank, then SIGKILL)."""
        if self._proc is not None and self._proc.poll() is None:
            signal_pid(self._proc.pid, signal.SIGKILL)
        kill_marked(self.marker, KILL_ROUNDS_S)
        if self._proc is not None:
            self._proc.wait()
            self.poll()
        if self._log is not None:
            self._log.close()
            self._log = None
