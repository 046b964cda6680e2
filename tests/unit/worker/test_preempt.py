"""Preemption notices in one process: signals, file, metadata endpoints (a real HTTP
server on 127.0.0.1), the one all-reduce per step, and the final snapshot + exit 75."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from structlog.testing import capture_logs

import elastictrain as et
from elastictrain.core.config import PreemptConfig
from elastictrain.core.errors import EXIT_PREEMPTED
from elastictrain.snapshot.format.reader import list_snapshot_dirs
from elastictrain.worker import preempt
from tests.helpers import wait_for
from tests.metadata import AWS_PATH, AZURE_PATH, GCP_PATH, Metadata


@pytest.fixture
def metadata() -> Iterator[Metadata]:
    with Metadata() as server:
        yield server


@pytest.mark.parametrize("style,path", [("aws", AWS_PATH), ("gcp", GCP_PATH),
                                        ("azure", AZURE_PATH)])
def test_metadata_styles(metadata: Metadata, style: str, path: str) -> None:
    checker = preempt.MetadataChecker(metadata.base + path, style)
    assert checker.check() is None  # nothing pending (404, FALSE, or only a Freeze event)
    metadata.pending = True
    detail = checker.check()
    assert detail is not None
    assert {"aws": "terminate", "gcp": "TRUE", "azure": "Preempt"}[style] in detail


def test_aws_style_uses_an_imdsv2_token(metadata: Metadata) -> None:
    preempt.MetadataChecker(metadata.base + AWS_PATH, "aws").check()
    assert metadata.requests[0][:2] == ("PUT", "/latest/api/token")
    assert metadata.requests[1][2].get("x-aws-ec2-metadata-token") == "tok-123"


def test_unreachable_endpoint_is_not_a_notice_and_is_logged() -> None:
    from tests.helpers import free_port

    checker = preempt.MetadataChecker(f"http://127.0.0.1:{free_port()}/x", "plain")
    with capture_logs() as logs:
        assert checker.check() is None
        assert checker.check() is None
    failed = [e for e in logs if e["event"] == "preempt.poll_failed"]
    assert len(failed) == 1  # logged once, not on every poll


def test_watcher_polls_url_and_file(metadata: Metadata, tmp_path: Path) -> None:
    notice_file = tmp_path / "notice"
    cfg = PreemptConfig(file=str(notice_file), poll_interval_s=0.05,
                        url=metadata.base + AWS_PATH, url_style="aws")
    watcher = preempt.PreemptionWatcher(cfg, poll=True)
    assert watcher.poll_once() is None
    notice_file.write_text("")
    assert watcher.poll_once() == ("file", str(notice_file))
    notice_file.unlink()
    metadata.pending = True
    with capture_logs() as logs:
        watcher.start()
        try:
            wait_for(lambda: watcher.notice is not None, 10, "the URL notice")
        finally:
            watcher.close()
    assert watcher.notice is not None and watcher.notice.source == "url"
    assert any(e["event"] == "preempt.notice" and e["source"] == "url" for e in logs)


def test_signal_records_a_notice_and_close_restores_the_handler() -> None:
    before = signal.getsignal(signal.SIGUSR1)
    watcher = preempt.PreemptionWatcher(PreemptConfig(), poll=False).start()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        wait_for(lambda: watcher.notice is not None, 5, "the signal notice")
        assert watcher.notice is not None and watcher.notice.detail == "SIGUSR1"
    finally:
        watcher.close()
    assert signal.getsignal(signal.SIGUSR1) == before


def test_flags_and_agreement() -> None:
    watcher = preempt.PreemptionWatcher(PreemptConfig(grace_period_s=20), poll=False)
    assert watcher.flags() == [0, 0]
    assert watcher.agreed([0, 0]) is None
    # a peer saw a notice 1.5 s ago: this rank stops too, with the peer's age
    stop = watcher.agreed([1, 1500])
    assert stop is not None and stop.notice_age_s == 1.5 and stop.local is None
    assert stop.grace_period_s == 20
    watcher.notify("file", "/x")
    watcher.notify("signal", "SIGTERM")  # the first notice wins
    noticed, age_ms = watcher.flags()
    assert noticed == 1 and age_ms >= 0
    assert watcher.notice is not None and watcher.notice.source == "file"


def test_own_notice_arriving_during_the_agreement_is_logged() -> None:
    """Our signal lands between our flags() (no notice yet) and the all-reduce's result
    (a peer's notice): the stop is agreed and our own notice is still reported, once."""
    watcher = preempt.PreemptionWatcher(PreemptConfig(), poll=False)
    with capture_logs() as logs:
        assert watcher.flags() == [0, 0]
        watcher.notify("signal", "SIGTERM")
        stop = watcher.agreed([1, 5])
        watcher.flags()
    assert stop is not None and stop.local is not None
    notices = [e for e in logs if e["event"] == "preempt.notice"]
    assert [(e["source"], e["detail"]) for e in notices] == [("signal", "SIGTERM")]


def test_a_peers_notice_alone_logs_no_notice_here() -> None:
    watcher = preempt.PreemptionWatcher(PreemptConfig(), poll=False)
    with capture_logs() as logs:
        assert watcher.agreed([1, 5]) is not None
    assert not [e for e in logs if e["event"] == "preempt.notice"]


class CountingCtx:
    """A one-rank DistContext stand-in that counts collectives."""

    rank, world_size, local_rank, is_writer, initialized = 0, 1, 0, True, False

    def __init__(self) -> None:
        self.all_reduces: list[list[int]] = []

    def all_reduce_max(self, values: list[int]) -> list[int]:
        self.all_reduces.append(list(values))
        return list(values)

    def agree_any(self, flag: bool) -> bool:
        return bool(self.all_reduce_max([int(flag)])[0])

    def barrier(self) -> None:
        pass

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return obj

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def gather_object(self, obj: Any, dst: int = 0,
                      agree: list[int] | tuple[int, ...] = ()) -> tuple[list[Any], list[int]]:
        return [obj], list(agree)




def test_one_all_reduce_per_step_carries_time_trigger_and_notice(
        tmp_path: Path, watcher: preempt.PreemptionWatcher) -> None:
    ctx = CountingCtx()
    snap = et.SnapshotManager(str(tmp_path), model=torch.nn.Linear(2, 2),
                              ctx=ctx,  # type: ignore[arg-type]
                              every_steps=1000, every_seconds=3600)
    for _ in range(5):
        snap.step()
    assert len(ctx.all_reduces) == 5
    # [time due, failed save's step, memory snapshot due, restart asked, noticed, notice age]
    assert all(len(v) == 6 for v in ctx.all_reduces)
    assert all(v[2] == 0 for v in ctx.all_reduces)  # no memory tier: never a vote


def test_notice_takes_a_final_snapshot_of_this_step_and_exits_75(
        tmp_path: Path, watcher: preempt.PreemptionWatcher) -> None:
    model = torch.nn.Linear(3, 3)
    snap = et.SnapshotManager(str(tmp_path), model=model, every_steps=5)
    for _ in range(7):
        snap.step()
    watcher.notify("file", "/notice")
    with capture_logs() as logs, pytest.raises(SystemExit) as exited:
        snap.step()
    assert exited.value.code == EXIT_PREEMPTED
    assert list_snapshot_dirs(snap.store) == [8, 5]
    saved = [e for e in logs if e["event"] == "preempt.saved"]
    assert len(saved) == 1 and saved[0]["snapshot_step"] == 8
    assert saved[0]["within_grace"] and saved[0]["grace_period_s"] == 30.0
    names = [e["event"] for e in logs]
    assert names.index("preempt.notice") < names.index("snapshot.committed") \
        < names.index("preempt.saved")
    # A fresh manager resumes exactly there: nothing is lost.
    again = et.SnapshotManager(str(tmp_path), model=torch.nn.Linear(3, 3), every_steps=5)
    assert again.restore().from_step == 8


def test_disabled_preemption_installs_nothing() -> None:
    assert preempt.install(PreemptConfig(enabled=False)) is None
    assert preempt.current() is None
