"""Records sent before the optimizer step (snapshot/memory/peer_records.py ``wait_pre_step``),
over real socket pairs: a rank's step waits for its sources' records of that step, and
for no source that sends none; a source whose connection ends, or whose record does not
come in time, raises ``PeerNodeLost`` before the step changes anything."""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

import pytest

from elastictrain.core.errors import PeerNodeLost
from elastictrain.snapshot.memory.peer_records import RecordStream
from elastictrain.snapshot.memory.record_links import RecordLinks
from elastictrain.snapshot.memory.rescue import (
    BoundaryRecord,
    read_record,
    same_states,
    write_peer_record,
)
from tests.helpers import wait_for

ATTEMPT = (2, 0, -1)


def _streams(tmp_path: Path) -> tuple[RecordStream, RecordStream, RecordLinks,
                                      BoundaryRecord, Path]:
    """Rank 0 on node A, rank 1 on node B, each a source of the other; B's record."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(mode=0o700)
    b.mkdir(mode=0o700)
    a_out, b_in = socket.socketpair()
    b_out, a_in = socket.socketpair()
    links_b = RecordLinks(outgoing={0: b_out}, incoming={0: b_in})
    on_a = RecordStream(RecordLinks(outgoing={1: a_out}, incoming={1: a_in}), 0, a,
                        lambda exc: None)
    on_b = RecordStream(links_b, 1, b, lambda exc: None)
    return on_a, on_b, links_b, BoundaryRecord(b, 1, ATTEMPT, lambda: []), a


def _pre_step(stream: RecordStream, record: BoundaryRecord, step: int) -> bytes:
    data = record.capture(step, pre_step=True)
    assert data is not None
    stream.publish(data, pre_step=True)
    return data


def _first(on_a: RecordStream, on_b: RecordStream, record_b: BoundaryRecord) -> bytes:
    """B's first pre-step record (step 1), once A has it: from then on A waits for B's
    (before its first one arrives, A does not know B sends them)."""
    data = _pre_step(on_b, record_b, 1)
    wait_for(lambda: on_a.received[1] == 1, 60, "B's first record on A")
    return data


def test_a_step_waits_for_the_sources_record_of_it_and_no_longer(tmp_path: Path) -> None:
    on_a, on_b, _, record_b, a = _streams(tmp_path)
    on_a.wait_pre_step(1, timeout_s=0.2)  # B has sent none yet: not waited for
    _first(on_a, on_b, record_b)
    on_a.wait_pre_step(1, timeout_s=30)
    # Kept as B's record of step 1, read only where pre-step records are trusted.
    assert read_record(a, 1, 1, ATTEMPT, pre_step_ok=True) is not None
    assert read_record(a, 1, 1, ATTEMPT) is None
    sent = threading.Timer(0.3, _pre_step, (on_b, record_b, 2))
    sent.start()
    started = time.monotonic()
    on_a.wait_pre_step(2, timeout_s=30)  # until B's record of step 2 came
    assert time.monotonic() - started >= 0.25
    sent.join()
    threads = [threading.Thread(target=s.close) for s in (on_a, on_b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)


def test_a_source_whose_connection_ends_raises_before_the_step(tmp_path: Path) -> None:
    """B's node dies after its all-reduce of step 2 and before its record of 2 left."""
    on_a, on_b, links_b, record_b, _ = _streams(tmp_path)
    _first(on_a, on_b, record_b)
    links_b.close()  # killed: the kernel closes its connections, no end message
    started = time.monotonic()
    with pytest.raises(PeerNodeLost, match=r"rank\(s\) \[1\].*step 2.*connection ended"):
        on_a.wait_pre_step(2, timeout_s=30)
    assert time.monotonic() - started < 10  # at the connection's end, not the timeout
    on_a.close()


def test_a_source_whose_record_came_before_its_loss_lets_the_step_go(tmp_path: Path) -> None:
    """B sent its record of step 2 and then died: step 2 goes on here (the rescue then
    commits it, with B's record)."""
    on_a, on_b, links_b, record_b, _ = _streams(tmp_path)
    _first(on_a, on_b, record_b)
    _pre_step(on_b, record_b, 2)
    links_b.close()
    on_a.wait_pre_step(2, timeout_s=30)
    with pytest.raises(PeerNodeLost):
        on_a.wait_pre_step(3, timeout_s=30)
    on_a.close()


def test_a_frozen_source_raises_after_the_timeout(tmp_path: Path) -> None:
    on_a, on_b, links_b, record_b, _ = _streams(tmp_path)
    _first(on_a, on_b, record_b)
    started = time.monotonic()
    with pytest.raises(PeerNodeLost, match=r"no record within 0\.5 s"):
        on_a.wait_pre_step(2, timeout_s=0.5)  # B is silent, its connection open
    assert time.monotonic() - started >= 0.5
    links_b.close()
    on_a.close()


def test_a_source_that_stops_sending_them_is_no_longer_waited_for(tmp_path: Path) -> None:
    """B found random numbers drawn between its optimizer step and its boundary: it
    sends its boundary record (which replaces the pre-step one) and no more pre-step
    records; A's steps go on without waiting for it."""
    on_a, on_b, _, record_b, a = _streams(tmp_path)
    sent = _first(on_a, on_b, record_b)
    boundary = record_b.record(1)
    assert boundary is not None and same_states(sent, boundary)
    on_b.publish(boundary)
    on_b.stop_pre_step()
    wait_for(lambda: not on_a._pre_step_seen, 60, "A to hear B sends no more")
    on_a.wait_pre_step(2, timeout_s=0.2)  # not waited for: returns at once
    assert read_record(a, 1, 1, ATTEMPT) is not None  # the boundary record, kept
    threads = [threading.Thread(target=s.close) for s in (on_a, on_b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)


def test_a_pre_step_record_is_queued_not_dropped_when_the_connection_is_full(
        tmp_path: Path) -> None:
    """A target that stopped reading for a while: boundary records are dropped, but a
    record the target waits for is queued and leaves while this rank waits."""
    a = tmp_path / "a"
    a.mkdir(mode=0o700)
    out, unread = socket.socketpair()
    stream = RecordStream(RecordLinks(outgoing={1: out}), 0, a, lambda exc: None)
    record = BoundaryRecord(a, 0, ATTEMPT, lambda: [])
    for step in range(1, 401):  # fills the connection
        data = record.capture(step)
        assert data is not None
        stream.publish(data)
    assert stream._outgoing[0].unsent
    queued = record.capture(401, pre_step=True)
    assert queued is not None
    stream.publish(queued, pre_step=True)
    assert bytes(stream._outgoing[0].unsent).endswith(queued)
    unread.close()
    stream.close()


class _SentRecords:
    """What the Rescuer hands its record stream (a stand-in for the connections)."""

    def __init__(self) -> None:
        self.published: list[tuple[int, bool]] = []
        self.pre_step = True

    def publish(self, record: bytes, pre_step: bool = False) -> None:
        from elastictrain.snapshot.memory.rescue import record_step
        self.published.append((record_step(record) or -1, pre_step))

    def stop_pre_step(self) -> None:
        self.pre_step = False


def test_a_loop_drawing_random_numbers_after_its_optimizer_step_sends_at_the_boundary(
        tmp_path: Path) -> None:
    """The pre-step record holds the boundary's states while nothing draws in between:
    then nothing more is sent and the rank trusts the other nodes' pre-step records of
    that step. A draw in between: the boundary record goes too, and from then on only
    boundary records (``snapshot.records_pre_step_off``)."""
    import random

    from structlog.testing import capture_logs

    from elastictrain.snapshot.rescuer import Rescuer

    record = BoundaryRecord(tmp_path, 0, ATTEMPT, lambda: [])
    rescuer = Rescuer.__new__(Rescuer)
    stream = _SentRecords()
    rescuer._stream, rescuer._pre_step_matched = stream, -1  # type: ignore[assignment]

    def step(number: int, draw: bool) -> None:
        if stream.pre_step:  # as the optimizer's step pre-hook does
            rescuer._pre_step_record = record.capture(number, pre_step=True)
            stream.publish(rescuer._pre_step_record, pre_step=True)
        if draw:
            random.random()
        data = record.capture(number)
        assert data is not None
        rescuer._send_boundary(number, data)

    with capture_logs() as logs:
        step(1, draw=False)
        assert stream.published == [(1, True)] and rescuer._pre_step_matched == 1
        step(2, draw=True)
        assert stream.published[1:] == [(2, True), (2, False)] and not stream.pre_step
        assert rescuer._pre_step_matched == 1  # step 2's pre-step records: not trusted
        step(3, draw=False)
        assert stream.published[3:] == [(3, False)]  # at the boundary only
    assert [e["step"] for e in logs if e["event"] == "snapshot.records_pre_step_off"] == [2]


def test_another_nodes_pre_step_record_is_used_only_where_this_ranks_own_matched(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1 (another node) sent its record of step 4 before its optimizer step; rank 0
    wrote its own at the boundary. The rescue reads rank 1's only if rank 0's own early
    record of step 4 held its boundary's states (else it skips: never a wrong RNG)."""
    from types import SimpleNamespace

    from elastictrain.snapshot import rescuer as rescuer_module
    from elastictrain.snapshot.rescuer import Rescuer

    monkeypatch.setattr(rescuer_module, "PEER_RECORD_WAIT_S", 0.05)
    BoundaryRecord(tmp_path, 0, ATTEMPT, lambda: []).record(4)
    early = BoundaryRecord(tmp_path, 9, ATTEMPT, lambda: []).capture(4, pre_step=True)
    assert early is not None
    fd = os.open(tmp_path / "rank1", os.O_RDWR | os.O_CREAT, 0o600)
    try:  # where and how the receiving thread keeps it
        assert write_peer_record(fd, early) == 4
    finally:
        os.close(fd)
    rescuer = Rescuer.__new__(Rescuer)
    rescuer._ctx = SimpleNamespace(world_size=2)  # type: ignore[assignment]
    rescuer._memory = SimpleNamespace(attempt=ATTEMPT[1])  # type: ignore[assignment]
    rescuer.resumed_from = ATTEMPT[2]
    monkeypatch.setattr(rescuer, "_peer_sources", lambda: {1})
    rescuer._pre_step_matched = 4
    assert all(state is not None for state in rescuer._records(tmp_path, 4))
    rescuer._pre_step_matched = 3  # its own early record of step 4 differed
    assert rescuer._records(tmp_path, 4)[1] is None
