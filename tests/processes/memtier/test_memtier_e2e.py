"""The node-memory tier under real torchrun (``elastictrain run`` agents, gloo, CPU).

(a) One node, two workers, a memory snapshot every step and a durable one every 20:
    after step 25 a worker is SIGKILLed by PID; the restart restores step 25 from
    memory (newer than durable 20) on both ranks, logged with ``tier=memory``, and
    the final parameters are bit-exact with an uninterrupted run.
(c) Rescue: no memory snapshot between durable ones (memory every 1000 steps); rank 1
    SIGKILLs itself in the middle of step 26, between forward and backward. Rank 0's
    backward fails on the dead peer, and rank 0 commits step 25 to node memory
    (``snapshot.rescued``); the restart resumes step 25 from memory, not 20 from
    durable storage, and the final parameters are bit-exact with an uninterrupted run.
    Then the same with 256 MB of state: the rescue outlasts the agent's failure
    detection, and the agent waits for it before it stops the group; and with a survivor
    that meets its error only after the agent saw the death: the agent waits for it to
    begin its rescue.
(b) A node lost (two agents on localhost as two nodes): tests/processes/memtier/test_peer_e2e.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from elastictrain.launcher.spawn import DEFAULT_RDZV_CONF, LaunchSpec, start_torchrun
from elastictrain.snapshot.format.reader import list_snapshot_dirs
from elastictrain.storage import open_store
from tests.helpers import REPO, TRAIN_JOB, events, kill_session, pid_alive, wait_for

pytestmark = pytest.mark.distributed

JOB = TRAIN_JOB
# Its model and batch here; each step bit-exact from the step and the rank (--exact).
JOB_OPTIONS = ("--model=mlp", "--width=32", "--batch=16", "--optimizer=adamw", "--exact")
STEPS, EVERY, PARK = 30, 20, 25


class Agents:
    """``elastictrain run`` launchers started by a test; all stopped by PID at the end."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.procs: list[subprocess.Popen[bytes]] = []
        self.event_dirs: list[Path] = []

    def start(self, name: str, root: Path, mem: Path, *, nproc: int = 1, nnodes: str = "1",
              endpoint: str = "127.0.0.1:0", is_host: int = 1, park: int = 0,
              gates: Path | None = None, extra: tuple[str, ...] = (),
              env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        ev = self.tmp_path / "ev" / name
        ev.mkdir(parents=True)
        spec = LaunchSpec(nproc_per_node=nproc, script=str(JOB), nnodes=nnodes, max_restarts=3,
                          script_args=[str(root), str(STEPS), f"--every={EVERY}", f"--park={park}",
                                       f"--gates={gates or self.tmp_path / 'gates'}",
                                       "--memory-every=1", *JOB_OPTIONS, *extra],
                          rdzv_endpoint=endpoint, rdzv_id=f"memtier-{self.tmp_path.name}",
                          rdzv_conf=f"{DEFAULT_RDZV_CONF},is_host={is_host}",
                          log_dir=str(ev / "torchelastic"), events_dir=str(ev))
        log = open(ev / "launcher.log", "wb")  # noqa: SIM115 - the child holds it
        proc = start_torchrun(spec, stdout=log.fileno(), extra_env={
            "PYTHONPATH": str(REPO), "TMPDIR": str(self.tmp_path), "OMP_NUM_THREADS": "1",
            "ELASTICTRAIN_SNAPSHOT__MEMORY_DIR": str(mem), **(env or {})})
        log.close()
        self.procs.append(proc)
        self.event_dirs.append(ev)
        return proc

    def stop_all(self) -> None:
        for proc in self.procs:
            kill_session(proc)
        for event in events(self.tmp_path / "ev", "worker.start"):
            pid = int(event["pid"])
            if _runs_job(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def _runs_job(pid: int) -> bool:
    try:
        return JOB.name in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False


@pytest.fixture
def agents(tmp_path: Path) -> Iterator[Agents]:
    started = Agents(tmp_path)
    try:
        yield started
    finally:
        started.stop_all()


def _log(agents: Agents) -> str:
    return "\n".join((d / "launcher.log").read_text(errors="replace")[-3000:]
                     for d in agents.event_dirs)


def _digest(ev: Path) -> Any:
    (digest,) = [e["param_digest"] for e in events(ev, "params.digest")]
    return digest


def _memory_committed(ev: Path, step: int, ranks: int) -> bool:
    return len({e["rank"] for e in events(ev, "snapshot.committed")
                if e.get("tier") == "memory" and e["snapshot_step"] == step}) == ranks


def _wait_parked(gates: Path, ranks: int) -> dict[int, int]:
    wait_for(lambda: len(list(gates.glob("rank*.json"))) == ranks, 240, "workers to park")
    found = [json.loads(p.read_text()) for p in gates.glob("rank*.json")]
    return {int(m["rank"]): int(m["pid"]) for m in found}


@pytest.mark.timeout(600)
def test_worker_kill_restores_from_memory_bit_exact(tmp_path: Path, agents: Agents,
                                                   reference_digest: str) -> None:
    gates = tmp_path / "gates"
    run = agents.start("run", tmp_path / "run", tmp_path / "mem", nproc=2, park=PARK,
                       gates=gates)
    ev = tmp_path / "ev" / "run"
    pids = _wait_parked(gates, 2)
    wait_for(lambda: _memory_committed(ev, PARK, 1), 60, "the memory snapshot of step 25")
    wait_for(lambda: [e for e in events(ev, "snapshot.committed")
                      if e.get("tier") == "durable" and e["snapshot_step"] == EVERY],
             60, "the durable snapshot of step 20")
    assert list_snapshot_dirs(open_store(str(tmp_path / "run"))) == [EVERY]
    os.kill(pids[1], signal.SIGKILL)
    wait_for(lambda: not pid_alive(pids[1]), 30, "the killed worker to exit")
    (gates / "go").write_text("")
    assert run.wait(timeout=300) == 0, _log(agents)

    resumes = [e for e in events(ev, "resume") if e["restart_count"] == 1]
    assert sorted((e["rank"], e["from_step"], e["tier"]) for e in resumes) == \
        [(0, PARK, "memory"), (1, PARK, "memory")]
    loaded = [e for e in events(ev, "snapshot.loaded") if e["restart_count"] == 1]
    assert {e["tier"] for e in loaded} == {"memory"} and len(loaded) == 2
    assert _digest(ev) == reference_digest  # bit-exact
    assert not (tmp_path / "mem").exists()  # removed when the run finished


@pytest.mark.timeout(600)
def test_survivor_rescues_the_last_step_of_a_killed_worker(tmp_path: Path, agents: Agents,
                                                           reference_digest: str) -> None:
    run = agents.start("run", tmp_path / "run", tmp_path / "mem", nproc=2,
                       extra=("--memory-every=1000", f"--die-in={PARK + 1}"))
    assert run.wait(timeout=300) == 0, _log(agents)

    ev = tmp_path / "ev" / "run"
    rescued = events(ev, "snapshot.rescued")
    assert [(e["rank"], e["snapshot_step"], e["tier"]) for e in rescued] == \
        [(0, PARK, "memory")]
    resumes = [e for e in events(ev, "resume") if e["restart_count"] == 1]
    assert sorted((e["rank"], e["from_step"], e["tier"]) for e in resumes) == \
        [(0, PARK, "memory"), (1, PARK, "memory")]  # not durable step 20
    assert {e["rescued"] for e in resumes} == {True}
    assert _digest(ev) == reference_digest  # bit-exact
    assert not (tmp_path / "mem").exists()  # removed when the run finished


@pytest.mark.timeout(600)
def test_agent_waits_for_a_rescue_in_progress(tmp_path: Path, agents: Agents) -> None:
    run = agents.start("run", tmp_path / "run", tmp_path / "mem", nproc=2,
                       extra=("--memory-every=1000", f"--die-in={PARK + 1}",
                              "--frozen-mb=256"))
    assert run.wait(timeout=300) == 0, _log(agents)

    _assert_rescue_waited_for(tmp_path / "ev" / "run")


@pytest.mark.timeout(600)
def test_agent_waits_for_a_survivor_that_has_not_met_its_error(tmp_path: Path,
                                                              agents: Agents) -> None:
    """Rank 0 starts the backward that fails on its dead peer only once the agent has
    seen the death: without the armed mark, the agent stops it before it can rescue."""
    run = agents.start("run", tmp_path / "run", tmp_path / "mem", nproc=2,
                       extra=("--memory-every=1000", f"--die-in={PARK + 1}",
                              "--late-survivor"))
    assert run.wait(timeout=300) == 0, _log(agents)
    _assert_rescue_waited_for(tmp_path / "ev" / "run")


def _assert_rescue_waited_for(ev: Path) -> None:
    told = [e for e in events(ev) if "rescue" in str(e.get("event"))
            or e.get("event") == "agent.failure_detected"]
    rescued = events(ev, "snapshot.rescued")
    waited = events(ev, "agent.rescue_waited")
    assert len(rescued) == 1 and len(waited) == 1, told
    assert rescued[0]["snapshot_step"] == PARK and waited[0]["waited_s"] > 0, told
    resumes = [e for e in events(ev, "resume") if e["restart_count"] == 1]
    assert sorted((e["rank"], e["from_step"], e["tier"]) for e in resumes) == \
        [(0, PARK, "memory"), (1, PARK, "memory")]
