"""examples/fsdp_resumable.py (FSDP2, AdamW, scheduler, ElasticSampler): a worker under
plain torchrun is SIGKILLed by PID after a sharded snapshot committed; the job
relaunched at the same size ends bit-exact with an uninterrupted run, relaunched
at another size trains exactly the same samples at every step (2 → 1, 1 → 2 → 3). The
runs to the end go through ``elastictrain run`` (one torch import per node, not per
worker: the suite's time)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from elastictrain.core import layout
from tests.helpers import REPO, free_port, pid_alive, started, wait_for

pytestmark = pytest.mark.distributed

STEPS = 24
EXAMPLE = REPO / "examples" / "fsdp_resumable.py"


def torchrun(nproc: int, storage: Path, record: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
            f"--master-port={free_port()}", "--max-restarts=0", str(EXAMPLE), str(storage),
            "--every=5", f"--record={record}", *args]


def run_to_end(tmp_path: Path, nproc: int, storage: Path, record: Path,
               steps: int = STEPS) -> dict[str, Any]:
    name = f"{record.name}.log"
    cmd = [sys.executable, "-m", "elastictrain.cli", "run", "--no-view",
           f"--nproc-per-node={nproc}", "--max-restarts=0", f"--log-dir={tmp_path / 'logs'}",
           str(EXAMPLE), str(storage), "--every=5", f"--record={record}", f"--steps={steps}"]
    with started(cmd, tmp_path, name) as proc:
        try:
            code = proc.wait(timeout=240)
        except subprocess.TimeoutExpired:
            code = None
    assert code == 0, f"elastictrain run --nproc-per-node={nproc} ended {code}:\n" + \
        (tmp_path / name).read_text()[-4000:]
    return dict(json.loads((record / "final.json").read_text()))


def samples_per_step(record: Path) -> dict[int, list[int]]:
    """The global samples of each step (the last record of a step wins: a redone step)."""
    lines = (record / "steps.jsonl").read_text().splitlines()
    return {r["step"]: r["samples"] for r in map(json.loads, lines)}


@pytest.fixture(scope="module")
def fsdp_uninterrupted(
        tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], dict[int, Any]]:
    """An uninterrupted 2-rank run: its final parameters and its samples per step."""
    tmp = tmp_path_factory.mktemp("reference")
    final = run_to_end(tmp, 2, tmp / "store", tmp / "rec")
    steps = samples_per_step(tmp / "rec")
    assert sorted(steps) == list(range(1, STEPS + 1))
    return final, steps


@pytest.mark.timeout(600)
def test_sigkill_then_resume_bit_exact_and_at_one_rank(
        tmp_path: Path, fsdp_uninterrupted: tuple[dict[str, Any], dict[int, Any]]) -> None:
    ref_final, ref_steps = fsdp_uninterrupted
    storage, killed = tmp_path / "store", tmp_path / "killed"
    manifest = storage / layout.step_dir(10) / layout.MANIFEST
    with started(torchrun(2, storage, killed, f"--steps={STEPS}", "--stall-after=12"),
                 tmp_path, "killed.log", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1") as proc:
        wait_for(lambda: manifest.exists() and (killed / "pid-rank1").exists(), 180,
                 "the sharded snapshot of step 10")
        victim = int((killed / "pid-rank1").read_text())
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: proc.poll() is not None, 120, "torchrun to give up after the kill")
        assert proc.returncode != 0 and not pid_alive(victim)
    assert not (killed / "final.json").exists()
    shutil.copytree(storage, tmp_path / "store1")

    same = run_to_end(tmp_path, 2, storage, tmp_path / "same")
    assert same["resumed_from"] == 10
    assert same["params_sha256"] == ref_final["params_sha256"]  # bit-exact
    assert samples_per_step(tmp_path / "same") == {s: ref_steps[s] for s in range(11, 25)}

    shrunk = run_to_end(tmp_path, 1, tmp_path / "store1", tmp_path / "shrunk")
    assert (shrunk["resumed_from"], shrunk["world_size"]) == (10, 1)
    assert samples_per_step(tmp_path / "shrunk") == {s: ref_steps[s] for s in range(11, 25)}


@pytest.mark.timeout(600)
def test_grow_one_to_two_to_three_keeps_data_order(
        tmp_path: Path, fsdp_uninterrupted: tuple[dict[str, Any], dict[int, Any]]) -> None:
    _, ref_steps = fsdp_uninterrupted
    storage = tmp_path / "store"
    first = run_to_end(tmp_path, 1, storage, tmp_path / "w1", steps=10)
    grown = run_to_end(tmp_path, 2, storage, tmp_path / "w2", steps=15)
    grown3 = run_to_end(tmp_path, 3, storage, tmp_path / "w3", steps=STEPS)
    assert (first["resumed_from"], grown["resumed_from"], grown3["resumed_from"]) == \
        (None, 10, 15)
    seen = {**samples_per_step(tmp_path / "w1"), **samples_per_step(tmp_path / "w2"),
            **samples_per_step(tmp_path / "w3")}
    assert seen == ref_steps
