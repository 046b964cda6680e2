"""Token shards consumed exactly once through resizes and a SIGKILL, under real launchers.

tests/processes/e2e/token_job.py trains on a TokenDataset of 97 samples (16 tokens each,
four shards of uneven sizes, one empty, one shorter than a sample) with a DataLoader
worker and a prefetch. Three launches on the same storage: 2 ranks to step 6, 1 rank to
step 12, 3 ranks to step 18, where rank 1 SIGKILLs itself after step 17 (snapshot 15
committed) and the launcher restarts the group, which trains steps 16-18 again. Every
rank records the ids it trained per step, read from the tokens; the steps that survive
must have trained each sample exactly once (plus the documented tail padding). Then a
relaunch over a renamed shard is refused with exit 78 and a one-line error. Under
``elastictrain run`` here, with uint32 tokens; under plain torchrun with uint16 tokens
(a resize, a kill, DataLoader workers, ledgers): the GPT example's tests,
tests/processes/e2e/test_examples_run.py. ``launch`` takes either launcher.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from tests.accounting import assert_each_sample_once, surviving_steps
from tests.helpers import REPO, events, started

pytestmark = pytest.mark.distributed

JOB = str(REPO / "tests" / "processes" / "e2e" / "token_job.py")
SEQ, N = 16, 97  # 97 is prime: every world size leaves an uneven epoch tail
SIZES = [611, 0, 9, 940]  # 1 + 97 * 16 tokens used, a tail of 7 never read


def write_shards(directory: Path, dtype: str) -> None:
    """Token ``t`` of the concatenated space holds the value ``t``."""
    directory.mkdir(parents=True)
    start = 0
    for i, size in enumerate(SIZES):
        np.arange(start, start + size, dtype=np.dtype(dtype).newbyteorder("<")).tofile(
            directory / f"shard{i}.bin")
        start += size


def launch(launcher: str, tmp_path: Path, nproc: int, steps: int, *job_args: str,
           shards: str = "shards", log: str = "launch.log") -> int:
    job = [JOB, str(tmp_path / "ckpt"), str(tmp_path / shards), str(steps),
           f"--record={tmp_path / 'rec'}", *job_args]
    if launcher == "run":
        cmd = [sys.executable, "-m", "elastictrain.cli", "run", "--no-view",
               f"--nproc-per-node={nproc}", "--max-restarts=1",
               f"--log-dir={tmp_path / 'logs'}", *job]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
               "--max-restarts=1", "--monitor-interval=0.1", "--rdzv-backend=c10d",
               "--rdzv-endpoint=127.0.0.1:0", f"--log-dir={tmp_path / 'logs'}", *job]
    with started(cmd, tmp_path, log, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
                 PYTHONPATH=str(REPO),
                 ELASTICTRAIN_LOG__EVENTS_DIR=str(tmp_path / "ev")) as proc:
        code = proc.wait(timeout=240)
    assert code == 0 or log != "launch.log", (tmp_path / log).read_text()[-4000:]
    return code


@pytest.mark.timeout(600)  # three launches and a restart
@pytest.mark.parametrize(("launcher", "dtype"), [("run", "uint32")])
def test_resized_2_1_3_and_killed_each_token_sample_once(tmp_path: Path, launcher: str,
                                                         dtype: str) -> None:
    write_shards(tmp_path / "shards", dtype)
    args = (f"--dtype={dtype}", f"--seq-len={SEQ}")
    launch(launcher, tmp_path, 2, 6, *args)  # cursor 48 (8 per step)
    launch(launcher, tmp_path, 1, 12, *args)  # cursor 72 (4 per step)
    launch(launcher, tmp_path, 3, 18, *args, "--kill-after=17")

    restarted = [(e["rank"], e["from_step"], e["world_size"])
                 for e in events(tmp_path / "ev", "resume") if e["restart_count"] == 1]
    assert sorted(restarted) == [(0, 15, 3), (1, 15, 3), (2, 15, 3)]
    steps = surviving_steps(tmp_path / "rec")
    assert [steps[s].world_size for s in (6, 7, 12, 13, 18)] == [2, 1, 1, 3, 3]
    for redone in (16, 17):  # trained before the kill, and again after the restart
        assert len({e["world"] for e in events(tmp_path / "rec") if e["step"] == redone}) == 2
    # Epoch 0: 48 + 24, then 25 on 3 ranks: two steps of 12 and a tail of 1 padded to 3
    # with the epoch's first 2 samples; epoch 1: steps 16-18, no sample twice.
    assert assert_each_sample_once(steps, N, seed=0, final_step=18) == {0: 2}
    assert [len(steps[s].samples) for s in (13, 14, 15, 16)] == [12, 12, 3, 12]
    assert [steps[s].epoch for s in (15, 16)] == [0, 1]

    if launcher == "run":  # the same shards, one renamed: refused before any step
        (tmp_path / "shards").rename(tmp_path / "renamed")
        (tmp_path / "renamed" / "shard3.bin").rename(tmp_path / "renamed" / "shard9.bin")
        code = launch(launcher, tmp_path, 1, 24, *args, shards="renamed", log="refused.log")
        out = (tmp_path / "refused.log").read_text()
        assert code == 78, out[-4000:]
        assert "ResumeMismatchError: the data's fingerprint (4 shards, 1560 " in out
        assert "fix: resume with the data the snapshot was taken with" in out
        assert max(e["step"] for e in events(tmp_path / "rec")) == 18
