"""The rescue's record stream between nodes (snapshot/memory/peer_records.py) over real
connections (socket pairs, and the links ``connect_record_links`` opens): every record
arrives and reads as the buddy's own; the training thread never waits for a target that
stopped reading or is gone; a connection that does not open with this attempt's token
is closed unread."""

from __future__ import annotations

import os
import socket
import threading
import time
import zlib
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from elastictrain.snapshot.memory import peer_records, record_links, rescue
from elastictrain.snapshot.memory.peer_records import _ENVELOPE, RecordStream
from elastictrain.snapshot.memory.record_links import (
    _HELLO,
    _MAGIC,
    RecordLinks,
    _accept,
    connect_record_links,
    read_exactly,
)
from elastictrain.snapshot.memory.rescue import SLOT_BYTES, BoundaryRecord, read_record
from tests.helpers import wait_for

ATTEMPT = (2, 0, -1)


def _boundary_dirs(tmp_path: Path) -> tuple[Path, Path]:
    a, b = tmp_path / "a" / "boundary", tmp_path / "b" / "boundary"
    a.mkdir(parents=True, mode=0o700)
    b.mkdir(parents=True, mode=0o700)
    return a, b


def _linked() -> tuple[RecordLinks, RecordLinks]:
    """Rank 0 (node A) and rank 1 (node B), each sending its records to the other."""
    a_out, b_in = socket.socketpair()
    b_out, a_in = socket.socketpair()
    return (RecordLinks(outgoing={1: a_out}, incoming={1: a_in}),
            RecordLinks(outgoing={0: b_out}, incoming={0: b_in}))


def _both(*calls: Any) -> None:
    threads = [threading.Thread(target=call, daemon=True) for call in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
        assert not t.is_alive()


def test_records_reach_the_buddy_node_and_read_as_its_own(tmp_path: Path) -> None:
    """Rank 1 (node B) streams its boundary records; rank 0 (node A) keeps them in A's
    boundary directory, where the rescue reads them as it reads A's own."""
    a, b = _boundary_dirs(tmp_path)
    failures: list[BaseException] = []
    links_a, links_b = _linked()
    on_a = RecordStream(links_a, 0, a, failures.append)
    on_b = RecordStream(links_b, 1, b, failures.append)
    record = BoundaryRecord(b, 1, ATTEMPT, lambda: [])
    for step in (1, 2, 3):
        data = record.record(step)
        assert data is not None
        on_b.publish(data)
    wait_for(lambda: read_record(a, 1, 3, ATTEMPT) is not None, 60, "step 3's record on A")
    # A record as long as a slot allows (many devices' CUDA states) goes whole too.
    payload = os.urandom(SLOT_BYTES - rescue._HEADER.size)
    long = rescue._HEADER.pack(rescue._MAGIC, 4, *ATTEMPT, len(payload),
                               zlib.crc32(payload)) + payload
    on_b.publish(long)
    _both(on_b.close, on_a.close)  # each ends on the other's end message
    assert (a / "rank1").read_bytes()[:len(long)] == long  # step 4: slot 0
    assert not failures
    assert on_a.received == {1: 4} and on_b.sent == 4
    # The same bytes in the same slot, which the rescue reads as it reads a local record.
    slot = slice(SLOT_BYTES, 2 * SLOT_BYTES)  # step 3's
    assert (a / "rank1").read_bytes()[slot] == (b / "rank1").read_bytes()[slot]
    assert read_record(a, 1, 3, ATTEMPT) is not None
    assert read_record(a, 1, 3, (2, 1, -1)) is None  # another attempt's: never passes


def test_a_target_that_stops_reading_never_blocks_and_messages_stay_whole(
        tmp_path: Path) -> None:
    """Nobody reads node A's connection: publishing returns at once all the same, and
    the records that found the connection full are skipped. Once the target reads
    again, the message in flight finishes and the newest record follows, whole."""
    a, _ = _boundary_dirs(tmp_path)
    out, unread = socket.socketpair()
    stream = RecordStream(RecordLinks(outgoing={1: out}), 0, a, lambda exc: None)
    record = BoundaryRecord(a, 0, ATTEMPT, lambda: [])

    def publish(step: int) -> None:
        data = record.record(step)
        assert data is not None
        stream.publish(data)

    for step in range(1, 401):  # ~13 kB each: far more than the connection holds
        publish(step)
    skipped = stream._outgoing[0].skipped
    assert stream.sent == 400 and 0 < skipped < 400
    went = 400 - skipped  # the last of them only in part
    assert _read_steps(unread, went - 1) == list(range(1, went))
    publish(401)  # the target read: the one in flight finishes, then this one
    assert _read_steps(unread, 2) == [went, 401]
    closer = threading.Thread(target=stream.close, daemon=True)
    closer.start()
    assert _ENVELOPE.unpack(read_exactly(unread, _ENVELOPE.size))[0] == 0  # the end
    closer.join(60)
    assert not closer.is_alive()


def _read_steps(sock: socket.socket, count: int) -> list[int]:
    """The steps of the next ``count`` messages, each checked whole."""
    steps = []
    for _ in range(count):
        kind, rank, length = _ENVELOPE.unpack(read_exactly(sock, _ENVELOPE.size))
        body = read_exactly(sock, length)
        assert kind == 1 and rank == 0 and rescue.record_length(body) == length
        steps.append(rescue._HEADER.unpack_from(body)[1])
    return steps


def test_a_target_that_is_gone_stops_the_sending_not_the_loop(tmp_path: Path) -> None:
    a, _ = _boundary_dirs(tmp_path)
    out, peer = socket.socketpair()
    peer.close()  # the target's node died
    stream = RecordStream(RecordLinks(outgoing={1: out}), 0, a, lambda exc: None)
    record = BoundaryRecord(a, 0, ATTEMPT, lambda: [])
    with capture_logs() as logs:
        for step in (1, 2, 3):
            data = record.record(step)
            assert data is not None
            stream.publish(data)
        stream.close()
    stopped = [e for e in logs if e["event"] == "snapshot.records_stopped"]
    assert [(e["direction"], e["target"]) for e in stopped] == [("send", 1)]


def test_a_source_that_vanishes_is_reported_with_what_it_sent(tmp_path: Path) -> None:
    """The source's connection ends without its end message (its node was killed): the
    receiver says so, with the records it had (what the node-chaos checks read)."""
    a, b = _boundary_dirs(tmp_path)
    links_a, links_b = _linked()
    with capture_logs() as logs:
        on_a = RecordStream(links_a, 0, a, lambda exc: None)
        on_b = RecordStream(links_b, 1, b, lambda exc: None)
        record = BoundaryRecord(b, 1, ATTEMPT, lambda: [])
        for step in (1, 2):
            data = record.record(step)
            assert data is not None
            on_b.publish(data)
        wait_for(lambda: on_a.received[1] == 2, 60, "both records on A")
        links_b.close()  # killed: no end message, the kernel closes its connections
        wait_for(lambda: any(e["event"] == "snapshot.records_stopped" for e in logs), 60,
                 "the receiver's report")
        on_a.close()
    (stopped,) = [e for e in logs if e["event"] == "snapshot.records_stopped"]
    assert (stopped["direction"], stopped["source"], stopped["received"]) == ("receive", 1, 2)


def test_a_source_frozen_after_the_end_holds_close_no_longer_than_the_end_wait(
        tmp_path: Path) -> None:
    """The source's node stopped after the run's agreed end, its connection still open
    (a frozen or unreachable machine: no reset, no end message): close() gives up on it
    after END_WAIT_S, not CLOSE_TIMEOUT_S, so a watchdog shorter than the latter does
    not fire in the teardown of a finished run."""
    a, b = _boundary_dirs(tmp_path)
    links_a, links_b = _linked()
    on_a = RecordStream(links_a, 0, a, lambda exc: None)
    record = BoundaryRecord(b, 1, ATTEMPT, lambda: [])
    data = record.record(1)
    assert data is not None
    links_b.outgoing[0].sendall(_ENVELOPE.pack(1, 1, len(data)) + data)  # then silence
    wait_for(lambda: on_a.received[1] == 1, 60, "the record on A")
    started = time.monotonic()
    on_a.close()
    waited = time.monotonic() - started
    links_b.close()
    assert waited < peer_records.CLOSE_TIMEOUT_S / 2


def test_a_connection_without_this_attempts_token_is_closed_unread() -> None:
    token = os.urandom(16)
    listener = socket.create_server(("127.0.0.1", 0))
    address = listener.getsockname()
    foreign = socket.create_connection(address)  # another run, or anyone
    foreign.sendall(_HELLO.pack(_MAGIC, os.urandom(16), 1))
    stranger = socket.create_connection(address)  # right token, not a source of ours
    stranger.sendall(_HELLO.pack(_MAGIC, token, 5))
    ours = socket.create_connection(address)
    ours.sendall(_HELLO.pack(_MAGIC, token, 1))
    try:
        accepted = _accept(listener, token, {1})
        assert list(accepted) == [1]
        foreign.settimeout(10)
        stranger.settimeout(10)
        assert foreign.recv(1) == b"" and stranger.recv(1) == b""  # closed by the receiver
    finally:
        for sock in (listener, foreign, stranger, ours, *accepted.values()):
            sock.close()


class _ThreadCtx:
    """Rank ``rank`` of a job whose ranks are threads of this process."""

    def __init__(self, rank: int, shared: dict[int, Any], barrier: threading.Barrier) -> None:
        self.rank, self._shared, self._barrier = rank, shared, barrier

    def all_gather_object(self, obj: Any) -> list[Any]:
        self._shared[self.rank] = obj
        self._barrier.wait(30)
        return [self._shared[r] for r in sorted(self._shared)]


@pytest.mark.parametrize("ranks", [2, 3])
def test_every_rank_links_to_its_targets_and_from_its_sources(ranks: int,
                                                              monkeypatch: Any) -> None:
    """A ring of ``ranks`` nodes, one rank each: rank r sends to r+1; the hello carries
    the token rank 0 drew, so every link is accepted."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    shared: dict[int, Any] = {}
    barrier = threading.Barrier(ranks)
    links: dict[int, RecordLinks] = {}

    def link(rank: int) -> None:
        ctx = _ThreadCtx(rank, shared, barrier)
        links[rank] = connect_record_links(ctx, [(rank + 1) % ranks],  # type: ignore[arg-type]
                                           [(rank - 1) % ranks])

    _both(*[lambda r=r: link(r) for r in range(ranks)])
    try:
        for rank in range(ranks):
            assert list(links[rank].outgoing) == [(rank + 1) % ranks]
            assert list(links[rank].incoming) == [(rank - 1) % ranks]
        links[0].outgoing[1].sendall(b"x")
        assert links[1].incoming[0].recv(1) == b"x"  # the very connection, end to end
    finally:
        for one in links.values():
            one.close()



@pytest.mark.parametrize(("routes", "expected"), [
    ({"master": "10.0.0.5", record_links._ANY_PUBLIC: "10.0.0.5"}, "10.0.0.5"),
    # the master is this host, its name resolving to a loopback address: the default
    # route's source is what other hosts reach
    ({"master": "127.0.1.1", record_links._ANY_PUBLIC: "10.0.0.7"}, "10.0.0.7"),
    ({"master": "127.0.0.1"}, "127.0.0.1"),  # no default route: one host
    ({"master": None, record_links._ANY_PUBLIC: "10.0.0.7"}, "10.0.0.7"),
])
def test_the_address_other_nodes_reach_is_never_loopback_when_another_routes(
        routes: dict[str, str | None], expected: str, monkeypatch: Any) -> None:
    monkeypatch.setenv("MASTER_ADDR", "master")
    monkeypatch.setattr(record_links, "_route_source", lambda dest: routes.get(dest))
    assert record_links.reachable_host() == expected
