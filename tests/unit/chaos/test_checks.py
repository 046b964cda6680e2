"""The post-trial checks hold on a good trial and fail on each kind of bad one."""
from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from elastictrain.chaos import checks
from elastictrain.core import layout
from elastictrain.snapshot.durable.commit import persist_snapshot
from elastictrain.snapshot.format.manifest import SnapshotMeta
from elastictrain.snapshot.format.reader import read_manifest
from elastictrain.storage import open_store


def ev(name: str, ts: float, **fields: Any) -> dict[str, Any]:
    return {"event": name, "ts": ts, "rank": 0, **fields}


def save(root: Path, step: int, payload: Any = None) -> None:
    meta = SnapshotMeta(run_id="t", step=step, epoch=0, world_size=1, checksum_algorithm="crc32")
    persist_snapshot(open_store(str(root)), payload or {"w": torch.ones(4) * step}, meta)


def test_completed_needs_a_final_exit_zero() -> None:
    assert checks.check_completed([75, 0], timed_out=False) is None
    assert "did not finish" in str(checks.check_completed([0, 1], timed_out=False))
    assert "timed out" in str(checks.check_completed([0], timed_out=True))


def test_digest_must_match_the_clean_run() -> None:
    events = [ev("params.digest", 1, param_digest="aa"), ev("params.digest", 2, param_digest="bb")]
    assert checks.check_digest(events, "bb") is None  # the last close counts
    assert "!= clean run's" in str(checks.check_digest(events, "aa"))
    assert "no params.digest" in str(checks.check_digest([], "aa"))


def test_snapshots_must_verify_and_load(tmp_path: Path) -> None:
    save(tmp_path, 10)
    save(tmp_path, 20)
    store = open_store(str(tmp_path))
    assert checks.check_snapshots(store) is None
    payload = f"{layout.step_dir(20)}/{read_manifest(store, 20).objects[0].name}"
    data = bytearray(store.read_bytes(payload))
    data[len(data) // 2] ^= 0xFF
    store.write_bytes(payload, bytes(data))
    assert "step 20 does not verify" in str(checks.check_snapshots(store))
    assert "no committed snapshot" in str(checks.check_snapshots(open_store(str(tmp_path / "x"))))


def test_lost_steps_resume_from_the_newest_commit() -> None:
    base = [ev("resume", 1, from_step=None, lost_steps=0),
            ev("snapshot.staged", 2, snapshot_step=10),
            ev("snapshot.committed", 3, snapshot_step=10)]
    good = [*base, ev("resume", 5, from_step=10, lost_steps=7)]
    assert checks.check_lost_steps(good, 10, [0], [0.0]) is None
    older = [*base, ev("resume", 5, from_step=None, lost_steps=17)]
    assert "although step 10 was committed" in str(checks.check_lost_steps(older, 10, [0], [0.0]))
    too_many = [*base, ev("resume", 5, from_step=10, lost_steps=12)]
    assert "allowed 10" in str(checks.check_lost_steps(too_many, 10, [0], [0.0]))
    # A save of step 20 in flight when the worker died: its steps may be lost too.
    in_flight = [*base, ev("snapshot.staged", 4, snapshot_step=20),
                 ev("resume", 5, from_step=10, lost_steps=15)]
    assert checks.check_lost_steps(in_flight, 10, [0], [0.0]) is None


def test_a_memory_copy_set_aside_at_restore_is_no_newer_commit() -> None:
    base = [ev("resume", 1, from_step=None, lost_steps=0),
            ev("snapshot.committed", 2, snapshot_step=10, tier="durable"),
            ev("snapshot.committed", 3, snapshot_step=14, tier="memory")]
    set_aside = [*base, ev("snapshot.memory_set_aside", 4.5, snapshot_step=14),
                 ev("resume", 5, from_step=10, lost_steps=5)]
    assert checks.check_lost_steps(set_aside, 10, [0], [0.0]) is None
    ignored = [*base, ev("resume", 5, from_step=10, lost_steps=5)]  # memory 14 was good
    assert "although step 14 was committed" in str(
        checks.check_lost_steps(ignored, 10, [0], [0.0]))
    # 13 was pruned when 14 committed (the memory tier keeps one), then 14 set aside.
    pruned = [*base[:2], ev("snapshot.committed", 2.5, snapshot_step=13, tier="memory"),
              base[2], ev("snapshot.pruned", 3.1, snapshot_step=13, tier="memory"),
              ev("snapshot.memory_set_aside", 4.5, snapshot_step=14),
              ev("resume", 5, from_step=10, lost_steps=5)]
    assert checks.check_lost_steps(pruned, 10, [0], [0.0]) is None
    # A finished run removes its memory directory; a relaunch then resumes from durable.
    finished = [*base, ev("snapshot.memory_removed", 4, reason="finished"),
                ev("resume", 5, from_step=10, lost_steps=4)]
    assert checks.check_lost_steps(finished, 10, [0], [0.0]) is None
    # A copy committed again after it went counts again.
    again = [*finished[:-1], ev("snapshot.committed", 4.5, snapshot_step=14, tier="memory"),
             ev("resume", 5, from_step=10, lost_steps=4)]
    assert "although step 14" in str(checks.check_lost_steps(again, 10, [0], [0.0]))


def test_nothing_may_be_lost_after_a_preemption_exit() -> None:
    events = [ev("resume", 1, from_step=None, lost_steps=0),
              ev("snapshot.committed", 3, snapshot_step=13),
              ev("resume", 11, from_step=13, lost_steps=0)]
    assert checks.check_lost_steps(events, 10, [75, 0], [0.0, 10.0]) is None
    events[-1]["lost_steps"] = 2
    assert "after a preemption exit (75)" in str(
        checks.check_lost_steps(events, 10, [75, 0], [0.0, 10.0]))
    assert checks.check_lost_steps(events, 10, [1, 0], [0.0, 10.0]) is None  # not a notice


@pytest.mark.parametrize("where", ["event", "log", "snapshot", "output"])
def test_a_planted_secret_is_found_anywhere(tmp_path: Path, where: str) -> None:
    secret = f"chaos-secret-{uuid.uuid4().hex}"
    (tmp_path / "events").mkdir()
    (tmp_path / "events" / "attempt000-rank0.jsonl").write_text('{"event": "worker.start"}\n')
    save(tmp_path / "storage", 10)
    assert checks.check_secret(secret, tmp_path, ["clean output"]) is None
    texts = ["clean output"]
    if where == "event":
        (tmp_path / "events" / "attempt000-rank0.jsonl").write_text(f'{{"opts": "{secret}"}}\n')
    elif where == "log":
        (tmp_path / "launcher.log").write_text(f"Traceback ... secret={secret}\n")
    elif where == "snapshot":
        save(tmp_path / "storage", 20, {"w": torch.ones(2), "extras": {"k": secret}})
    else:
        texts.append(f"error: {secret}")
    assert checks.check_secret(secret, tmp_path, texts) is not None


