"""Ranks sharing one stdout (a Slurm log, a pod log) must never merge two events into one
line: each event is one write of the line with its newline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, child_env

pytestmark = pytest.mark.processes

WRITERS = 8
EVENTS = 2000

CHILD = """
import sys
from elastictrain.core import log
log.configure("info", json_output=True, stream=sys.stderr)
log.bind(rank=int(sys.argv[1]))
logger = log.get_logger("elastictrain")
for i in range(int(sys.argv[2])):
    logger.info("test.line", i=i, pad="x" * 100)
"""


def test_concurrent_writers_on_one_pipe_give_whole_json_lines(tmp_path: Path) -> None:
    # PYTHONUNBUFFERED=1 as under torchrun: every write() is a syscall of its own.
    env = child_env(tmp_path, PYTHONPATH=str(REPO))
    read_end, write_end = os.pipe()  # one pipe, as ranks share a job's stdout
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(rank), str(EVENTS)],
                              stdout=write_end, stderr=write_end, env=env)
             for rank in range(WRITERS)]
    os.close(write_end)
    # Small reads keep the pipe full, so writers block and wake mid-event: where an
    # event takes two writes, another writer's line lands between them.
    chunks = []
    with os.fdopen(read_end, "rb", buffering=0) as reader:
        while chunk := reader.read(32):
            chunks.append(chunk)
    for proc in procs:
        assert proc.wait(timeout=300) == 0
    lines = b"".join(chunks).decode().splitlines()
    bad = [line for line in lines if not _is_event(line)]
    assert not bad, f"{len(bad)} merged or torn lines, e.g. {bad[0][:300]!r}"
    seen = {(e["rank"], e["i"]) for e in map(json.loads, lines)}
    assert len(seen) == WRITERS * EVENTS


def _is_event(line: str) -> bool:
    try:
        return json.loads(line)["event"] == "test.line"
    except (json.JSONDecodeError, KeyError, TypeError):
        return False
