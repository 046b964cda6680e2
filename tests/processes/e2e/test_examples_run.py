"""The two training-loop examples, unmodified, under real launchers: an epoch-based
Trainer class (examples/epoch_trainer.py) and a GPT pretraining loop with token shards,
DataLoader workers, gradient accumulation under ``no_sync``, fp16 with a GradScaler and
an evaluation that saves on a new best (examples/llm_pretrain.py); the GPT loop with
virtual shards, lost at 2 ranks and relaunched at 1, ends on a 2-rank run's weights.

For each: rank 1 SIGKILLed at a random step (every rank parked there first, after its
save in flight committed: tests/processes/e2e/user_script_hook) under ``elastictrain
run`` and under torchrun ends on the uninterrupted run's weights; a job lost at a
random step and relaunched at another world size trains every sample exactly once
(the examples' ``--record-samples`` ledgers). The random step is in the failure message.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.accounting import assert_each_sample_once, surviving_steps
from tests.helpers import REPO, events, started, wait_for

pytestmark = pytest.mark.distributed

HOOK = str(REPO / "tests" / "processes" / "e2e" / "user_script_hook")
TRAINER = str(REPO / "examples" / "epoch_trainer.py")
LLM = str(REPO / "examples" / "llm_pretrain.py")
SAMPLES = 192  # the trainer's: 12 steps an epoch at 2 ranks of 8
TRAINER_ARGS = ["--epochs=3", f"--samples={SAMPLES}", "--batch-size=8",
                "--save-every-steps=5"]
SEQ, VAL = 16, 8
LLM_ARGS = [f"--seq-len={SEQ}", "--width=32", "--heads=2", "--layers=1",
            "--micro-batch=2", "--global-batch=8", "--steps=24", "--save-every=5",
            "--eval-every=8", f"--val-samples={VAL}", "--precision=fp16", "--warmup=4"]
LLM_SAMPLES = 120 + VAL  # tokens.bin holds (LLM_SAMPLES * SEQ + 1) tokens


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """DataLoader workers hand tensors over a Unix socket made in TMPDIR, whose path must
    stay under 108 bytes: the launches get a short directory, not the test's own."""
    path = Path(tempfile.mkdtemp(prefix="et-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _write_tokens(tmp_path: Path) -> Path:
    path = tmp_path / "tokens.bin"
    rng = np.random.default_rng(0)
    rng.integers(0, 512, LLM_SAMPLES * SEQ + 1, dtype=np.uint16).tofile(path)
    return path


def _job(example: str, tmp_path: Path) -> list[str]:
    tmp_path.mkdir(exist_ok=True)
    if example == "trainer":
        return [TRAINER, str(tmp_path / "ckpt"), *TRAINER_ARGS]
    compiled = ["--compile", "--precision=bf16"] if example == "llm-compiled" else []
    return [LLM, str(tmp_path / "ckpt"), f"--data={_write_tokens(tmp_path)}", *LLM_ARGS,
            *compiled]


def _launch(launcher: str, nproc: int, job: list[str], tmp_path: Path, log: str,
            short_tmp: Path, *,
            restarts: int = 1, park_at: int | None = None,
            record: bool = False) -> Any:
    """The launch as a context (``started``): the process, stopped on leaving."""
    if record:
        job = [*job, f"--record-samples={tmp_path / 'rec'}"]
    if launcher == "run":
        cmd = [sys.executable, "-m", "elastictrain.cli", "run", "--no-view",
               f"--nproc-per-node={nproc}", f"--max-restarts={restarts}",
               f"--log-dir={tmp_path / 'logs'}", *job]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nproc}", f"--max-restarts={restarts}",
               "--monitor-interval=0.1", f"--log-dir={tmp_path / 'logs'}", *job]
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "ET_TEST_PARK_DIR": str(tmp_path),
           "PYTHONPATH": os.pathsep.join([HOOK, str(REPO)]), "TMPDIR": str(short_tmp)}
    if park_at is not None:
        env["ET_TEST_PARK_AT"] = str(park_at)
    return started(cmd, tmp_path, log, **env)


def _finished(tmp_path: Path) -> dict[str, Any]:
    (finished,) = events(tmp_path / "ckpt" / "events", "run.finished")
    return finished


def _uninterrupted(example: str, tmp_path: Path, short_tmp: Path) -> dict[str, Any]:
    # Under elastictrain run: its workers fork from one process that imported torch (the
    # suite's time); the launcher makes no difference to the weights.
    ctx = _launch("run", 2, _job(example, tmp_path), tmp_path, "reference.log", short_tmp)
    with ctx as proc:
        assert proc.wait(timeout=900) == 0, (tmp_path / "reference.log").read_text()[-3000:]
    return _finished(tmp_path)


def _park_and_kill(tmp_path: Path, proc: Any, log: str, kill_at: int) -> None:
    """Wait for every rank to park after step ``kill_at`` and SIGKILL rank 1."""
    parked = [tmp_path / f"parked-rank{r}" for r in (0, 1)]
    wait_for(lambda: all(p.exists() for p in parked) or proc.poll() is not None, 900,
             f"both ranks to park at step {kill_at}")
    assert proc.poll() is None, (tmp_path / log).read_text()[-3000:]
    os.kill(int(parked[1].read_text()), signal.SIGKILL)


# torch.compile on CPU generates and builds C++ for every graph: minutes per launch on
# two cores, too long for the suite; ET_TEST_COMPILE=1 adds the LLM loop compiled (bf16).
KILLED = ["trainer", "llm"] + (["llm-compiled"] if os.environ.get("ET_TEST_COMPILE") == "1"
                               else [])


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("example", KILLED)
def test_a_worker_killed_at_a_random_step_ends_on_the_uninterrupted_weights(
        tmp_path: Path, short_tmp: Path, example: str) -> None:
    reference = _uninterrupted(example, tmp_path / "reference", short_tmp)
    final = reference["final_step"]
    for launcher in ("run", "torchrun"):
        where = tmp_path / launcher
        kill_at = random.randint(6, final - 2)
        what = f"{example} under {launcher}, rank 1 killed after step {kill_at}"
        ctx = _launch(launcher, 2, _job(example, where), where, "killed.log", short_tmp,
                      park_at=kill_at)
        with ctx as proc:
            _park_and_kill(where, proc, "killed.log", kill_at)
            assert proc.wait(timeout=900) == 0, what + (where / "killed.log").read_text()[-3000:]
        resumed = [e for e in events(where / "ckpt" / "events", "resume")
                   if e.get("restart_count") == 1]
        assert len(resumed) == 2 and all(
            kill_at - 5 <= e["from_step"] <= kill_at for e in resumed), (what, resumed)
        finished = _finished(where)
        assert finished["final_step"] == final, what
        assert finished["param_digest"] == reference["param_digest"], what


@pytest.mark.timeout(900)
@pytest.mark.parametrize(("example", "launcher", "sizes"),
                         [("trainer", "run", (2, 3)), ("llm", "torchrun", (2, 1))])
def test_a_job_lost_and_relaunched_at_another_size_trains_each_sample_once(
        tmp_path: Path, short_tmp: Path, example: str, launcher: str,
        sizes: tuple[int, int]) -> None:
    kill_at = random.randint(6, 20)
    what = f"{example} lost after step {kill_at} at {sizes[0]} ranks, then {sizes[1]}"
    job = _job(example, tmp_path)
    ctx = _launch(launcher, sizes[0], job, tmp_path, "lost.log", short_tmp, restarts=0,
                  park_at=kill_at, record=True)
    with ctx as proc:
        _park_and_kill(tmp_path, proc, "lost.log", kill_at)
        assert proc.wait(timeout=120) != 0, what  # no restart left: the job is lost
    ctx = _launch(launcher, sizes[1], job, tmp_path, "relaunched.log", short_tmp,
                  record=True)
    with ctx as proc:
        assert proc.wait(timeout=300) == 0, what + (tmp_path / "relaunched.log").read_text()[-3000:]

    resumed = {(e["world_size"], e["from_step"]) for e in events(tmp_path / "ckpt" / "events",
                                                                 "resume") if e["from_step"]}
    assert len(resumed) == 1 and next(iter(resumed))[0] == sizes[1], (what, resumed)
    steps = surviving_steps(tmp_path / "rec")
    final = _finished(tmp_path)["final_step"]
    assert {steps[s].world_size for s in (1, final)} == set(sizes), what
    dataset_len = SAMPLES if example == "trainer" else LLM_SAMPLES - VAL
    assert_each_sample_once(steps, dataset_len, seed=0, final_step=final)


@pytest.mark.timeout(900)
def test_the_llm_loop_with_virtual_shards_ends_on_the_same_bits_at_another_size(
        tmp_path: Path, short_tmp: Path) -> None:
    """``--virtual-shards``: lost at 2 ranks after a random step, relaunched at 1, the
    run ends on the weights of an uninterrupted 2-rank run (fp16 with its GradScaler,
    dropout, gradient clipping; docs/elastic-resume.md#the-same-bits-across-a-resize)."""
    shards = ["--virtual-shards=4"]  # the global batch of 8 in 4 shards of 2
    reference_dir = tmp_path / "reference"
    ctx = _launch("run", 2, [*_job("llm", reference_dir), *shards], reference_dir,
                  "reference.log", short_tmp)
    with ctx as proc:
        assert proc.wait(timeout=600) == 0, (reference_dir / "reference.log").read_text()[-3000:]
    reference = _finished(reference_dir)
    kill_at = random.randint(6, 20)
    what = f"lost after step {kill_at} at 2 ranks, then 1"
    where = tmp_path / "resized"
    job = [*_job("llm", where), *shards]
    with _launch("run", 2, job, where, "lost.log", short_tmp, restarts=0,
                 park_at=kill_at) as proc:
        _park_and_kill(where, proc, "lost.log", kill_at)
        assert proc.wait(timeout=120) != 0, what
    with _launch("run", 1, job, where, "relaunched.log", short_tmp) as proc:
        assert proc.wait(timeout=600) == 0, what + (where / "relaunched.log").read_text()[-3000:]
    resumed = [e for e in events(where / "ckpt" / "events", "resume") if e["from_step"]]
    assert {e["world_size"] for e in resumed} == {1}, (what, resumed)
    finished = _finished(where)
    assert finished["final_step"] == reference["final_step"], what
    assert finished["param_digest"] == reference["param_digest"], what
