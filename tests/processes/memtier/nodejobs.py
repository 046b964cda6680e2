"""Real one-process jobs (tests/train_job.py --say --stdin) for the node-memory tier's tests:
started in their own session, talked to through pipes (no sleeps), stopped by PID."""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import REPO, TRAIN_JOB, child_env, kill_session

JOB = TRAIN_JOB
# One process, its own model per storage, memory every step, durable every 100; it says
# where it restored from and parks on stdin.
JOB_OPTIONS = ("--seed=root", "--lr=0.1", "--every=100", "--memory-every=1", "--say", "--stdin")
LINE_TIMEOUT_S = 120.0


class Job:
    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc

    def line(self) -> dict[str, Any]:
        """The job's next JSON line (fails on exit or after a deadline)."""
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], LINE_TIMEOUT_S)
        assert ready, "the job said nothing in time"
        raw = self.proc.stdout.readline()
        assert raw, f"the job exited {self.proc.wait()}: {self.stderr()}"
        return dict(json.loads(raw))

    def go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(b"go\n")
        self.proc.stdin.flush()

    def finish(self) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        return self.proc.wait(timeout=LINE_TIMEOUT_S)

    def stderr(self) -> str:
        assert self.proc.stderr is not None
        if self.proc.poll() is None:
            return ""
        return self.proc.stderr.read().decode(errors="replace")


def as_user_seeing(user: str, paths: list[Path], cmd: list[str]) -> list[str]:
    """``cmd`` run as ``user`` in a mount namespace of its own where ``paths`` can be
    reached: the interpreter and the checkout often live under a directory only root may
    enter (``/root``, a ``mktemp -d``). There, each such directory on the way is covered
    by an empty tmpfs that anyone may enter, with the one entry on the way bound back in;
    modes, owners and every other file stay as they are, for the user and everybody
    else (nothing outside the namespace changes)."""
    steps: list[str] = ["set -e", "stash=$(mktemp -d)"]
    done: set[Path] = set()
    for target in paths:
        resolved = [target, target.resolve()]
        for path in resolved:
            for parent in reversed(path.parents):
                child = path.parts[len(parent.parts)] if len(path.parts) > len(parent.parts) \
                    else None
                if child is None or parent in done or os.stat(parent).st_mode & 0o001:
                    continue
                done.add(parent)
                keep = f"$stash/{len(done)}"
                entry = parent / child
                make = "mkdir" if entry.is_dir() else "touch"
                steps += [f"{make} {keep}", f"mount --bind '{entry}' {keep}",
                          f"mount -t tmpfs -o mode=0755 tmpfs '{parent}'",
                          f"{make} '{entry}'", f"mount --move {keep} '{entry}'"]
    script = "\n".join([*steps, f'exec runuser -u {user} -- "$@"'])
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", *cmd]


class Jobs:
    """Starts jobs; stops what is left of them at the end of the test."""

    def __init__(self, tmp_path: Path, shm: Path) -> None:
        self.tmp_path, self.shm = tmp_path, shm
        self.started: list[Job] = []

    def start(self, root: Path, steps: int, park: int = 0, user: str | None = None,
              cwd: Path | None = None, **env: str) -> Job:
        cmd = [sys.executable, str(JOB), str(root), str(steps), f"--park={park}", *JOB_OPTIONS]
        if user is not None:
            cmd = as_user_seeing(user, [Path(sys.executable), Path(sys.prefix), REPO], cmd)
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, cwd=cwd or self.tmp_path,
                                env=child_env(self.tmp_path, ELASTICTRAIN_SHM=str(self.shm),
                                              PYTHONPATH=str(REPO), **env),
                                start_new_session=True)
        job = Job(proc)
        self.started.append(job)
        return job

    def stop_all(self) -> None:
        for job in self.started:
            kill_session(job.proc)
            for pipe in (job.proc.stdin, job.proc.stdout, job.proc.stderr):
                if pipe is not None:
                    pipe.close()


@pytest.fixture
def shm() -> Iterator[Path]:
    """A stand-in for /dev/shm (a directory every user may create in, sticky, on the
    real tmpfs), so the tests never touch the node's real per-user directories."""
    path = Path("/dev/shm") / f"et-test-{uuid.uuid4().hex[:12]}"
    path.mkdir()
    os.chmod(path, 0o1777)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def jobs(tmp_path: Path, shm: Path) -> Iterator[Jobs]:
    started = Jobs(tmp_path, shm)
    try:
        yield started
    finally:
        started.stop_all()


def stats_under(path: Path) -> dict[Path, os.stat_result]:
    """``lstat`` of ``path`` and of everything under it. An entry removed between
    the listing and its stat is left out: retention prunes the older step after the newer
    one's commit, which a job's ``wait()`` does not wait for."""
    stats = {}
    for entry in [path, *path.rglob("*")]:
        try:
            stats[entry] = entry.lstat()
        except FileNotFoundError:
            continue
    return stats
