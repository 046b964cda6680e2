"""The rescue across nodes (docs/memory-tier.md#across-nodes): every rank's step-boundary
record (its RNG states at the boundary, ~13 kB) also reaches ``snapshot.memory_replicas``
other nodes, so that when a node dies a survivor on another node holds every rank's
record of the last step and can commit it (snapshot/rescuer.py).

Each rank writes its record of every step to a connection per target
(snapshot/memory/record_links.py) from the training thread: one non-blocking send, nothing
waits for the network, and no thread of ours wakes on the sending side. A record the
connection cannot take whole at once (the target stopped reading: its buffers are full)
finishes at the next step, and the records in between are not sent to that target (its
rescue then lacks them and skips). Each rank receives its sources' records in one
thread per source, written into this node's boundary directory as ``rank<source>``,
exactly as that rank wrote its own (slot ``step % 2``, checksummed, its attempt in the
header): the rescue reads them as it reads local ones. A record still in flight when
its node dies never arrives: the survivor then lacks it and skips the rescue (never
commits a state with a wrong RNG).

Before its optimizer step, a rank also sends its record of the step it is about to
complete (``publish(pre_step=True)``) and waits until each of its sources' records of
that step has arrived (``wait_pre_step``): so no node completes a step before every
other node's record of it is on its way, and a node that dies after its last
all-reduce of a step leaves the survivors at the step before, with every record of it.

At the end (``close``) every sender sends an end message, and every receiver ends on
its sources' end (or their connection's end): no thread is left receiving when the
connections close. A receiver whose source died ends with the error of its receive; a
send to a target that is gone stops the records to it (logged once), never the loop.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path

from elastictrain.core.errors import PeerNodeLost
from elastictrain.core.localfiles import open_private
from elastictrain.core.log import get_logger
from elastictrain.snapshot.memory.record_links import RecordLinks, read_exactly, read_into
from elastictrain.snapshot.memory.rescue import (
    SLOT_BYTES,
    record_length,
    record_step,
    write_peer_record,
)

log = get_logger("elastictrain.snapshot")

_ENVELOPE = struct.Struct("<iii")  # kind, sending rank, record length
# A record taken at the boundary; one taken before the optimizer step (its sender waits
# for its sources' ones); the sender sends no more of those; the sender's end.
_RECORD, _PRE_STEP, _PRE_STEP_OFF, _END = 1, 2, 3, 0
CLOSE_TIMEOUT_S = 10.0  # for the last sends to a node that is there
# For the other nodes' ends. The stream ends only after the run's agreed end, when no
# rescue reads these records; the wait only makes the received counts complete.
END_WAIT_S = 2.0
_PENDING_POLL_S = 0.005  # how often a wait pushes on a message its connection held back
# What a connection queues for a target that does not read (a target waiting for our
# records reads them each step; one that stops reading for good is not waiting).
_KEEP_MAX_BYTES = 1 << 20


class _Outgoing:
    """One target's connection and the tail of a message it has not taken yet."""

    def __init__(self, target: int, sock: socket.socket) -> None:
        self.target, self.sock = target, sock
        sock.setblocking(False)
        self.unsent = memoryview(b"")
        self.skipped = 0  # records not sent while a message waited for the connection

    def offer(self, message: bytes, *, keep: bool = False) -> None:
        """Send ``message`` if the previous one is through, as much as goes now; else
        drop it, or with ``keep`` queue it behind the previous one (a record its
        target waits for)."""
        if self.unsent and not self.flush():
            if keep and len(self.unsent) < _KEEP_MAX_BYTES:
                self.unsent = memoryview(bytes(self.unsent) + message)
            else:
                self.skipped += 1
            return
        self.unsent = memoryview(message)
        self.flush()

    def flush(self) -> bool:
        """Send what is left of the message; True when none is left."""
        if not self.unsent:
            return True
        try:
            sent = self.sock.send(self.unsent)
        except BlockingIOError:
            return False
        self.unsent = self.unsent[sent:]
        return not self.unsent


class RecordStream:
    """This rank's records to its targets; its sources' records into ``directory``.

    Args:
        links: the connections (snapshot/memory/record_links.py); the stream owns them.
        failed: called with an error when a received record cannot be written (a full
            tmpfs: the rescue is off until one can).
    """

    def __init__(self, links: RecordLinks, rank: int, directory: Path,
                 failed: Callable[[BaseException], None]) -> None:
        self._links, self._rank = links, rank
        self._directory, self._failed = directory, failed
        self._outgoing = [_Outgoing(target, sock) for target, sock in links.outgoing.items()]
        self.sent = 0  # records handed to every target's connection (tests, figures)
        self.received: dict[int, int] = dict.fromkeys(links.incoming, 0)
        self.pre_step = True  # this rank sends records before its optimizer steps
        # Per source: the newest step of a pre-step record received, while the source
        # sends them (from its first one to its "no more", its end or its loss).
        self._pre_step_seen: dict[int, int] = {}
        self._lost: dict[int, str] = {}  # sources whose connection ended before their end
        self._arrived = threading.Condition()
        self._receivers = [threading.Thread(target=self._receive_loop, args=(src, sock),
                                            daemon=True, name=f"elastictrain-records-{src}")
                           for src, sock in links.incoming.items()]
        for thread in self._receivers:
            thread.start()

    def publish(self, record: bytes, *, pre_step: bool = False) -> None:
        """(training thread) Send ``record`` to every target; nothing waits. A
        ``pre_step`` record is never dropped: its targets wait for it."""
        if not self._outgoing:
            return
        kind = _PRE_STEP if pre_step else _RECORD
        self._send(_ENVELOPE.pack(kind, self._rank, len(record)) + record, keep=pre_step)
        self.sent += 1

    def stop_pre_step(self) -> None:
        """(training thread) Send no more pre-step records; the targets stop waiting
        for this rank's."""
        if self.pre_step:
            self.pre_step = False
            self._send(_ENVELOPE.pack(_PRE_STEP_OFF, self._rank, 0), keep=True)

    def _send(self, message: bytes, *, keep: bool) -> None:
        for out in list(self._outgoing):
            try:
                out.offer(message, keep=keep)
            except OSError as exc:  # the target's node is gone
                self._stop_sending(out, exc)

    def wait_pre_step(self, step: int, timeout_s: float) -> None:
        """(training thread) Until every source that sends pre-step records has sent its
        record of ``step`` (or no longer sends them).

        Raises:
            PeerNodeLost: a source's connection ended before its end (its node died), or
                its record did not come within ``timeout_s`` (its node is frozen or
                gone without a word).
        """
        deadline = time.monotonic() + timeout_s
        with self._arrived:
            while True:
                behind = sorted(s for s, seen in self._pre_step_seen.items() if seen < step)
                if not behind:
                    return
                lost = [source for source in behind if source in self._lost]
                if lost:
                    raise PeerNodeLost(lost, step, self._lost[lost[0]])
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PeerNodeLost(behind, step, f"no record within {timeout_s:.1f} s")
                # A message of ours that the connection did not take whole is pushed on
                # while we wait: the source may be waiting for it.
                pending = self._flush_pending()
                self._arrived.wait(min(left, _PENDING_POLL_S) if pending else left)

    def _flush_pending(self) -> bool:
        """Send on what our connections did not take yet; True while some is left."""
        pending = False
        for out in list(self._outgoing):
            try:
                pending |= not out.flush()
            except OSError as exc:
                self._stop_sending(out, exc)
        return pending

    def close(self) -> None:
        """Finish the messages in flight and send the end; wait (bounded) for the
        sources' ends; close the connections."""
        for out in list(self._outgoing):
            try:
                out.sock.settimeout(CLOSE_TIMEOUT_S)
                out.sock.sendall(out.unsent)
                out.sock.sendall(_ENVELOPE.pack(_END, self._rank, 0))
                out.sock.shutdown(socket.SHUT_WR)
            except OSError as exc:
                self._stop_sending(out, exc)
        deadline = time.monotonic() + END_WAIT_S
        for source, thread in zip(self.received, self._receivers, strict=True):
            # A source that sent nothing (it records no boundaries: its memory tier did
            # not open) may send no end either: its connection's close ends the receiver.
            if self.received[source]:
                thread.join(max(0.0, deadline - time.monotonic()))
        log.info("snapshot.records_closed", sent=self.sent,
                 targets=sorted(self._links.outgoing), received=dict(self.received),
                 skipped={out.target: out.skipped for out in self._outgoing if out.skipped})
        self._links.close()

    def _stop_sending(self, out: _Outgoing, exc: BaseException) -> None:
        """A target is gone: its node's survivors rescue nothing from this rank."""
        self._outgoing.remove(out)
        log.info("snapshot.records_stopped", direction="send", target=out.target,
                 sent=self.sent, error=f"{type(exc).__name__}: {str(exc)[:200]}")

    def _receive_loop(self, source: int, sock: socket.socket) -> None:
        fd: int | None = None
        try:  # without the file, the records are still read: this rank's steps wait on them
            fd = open_private(self._directory / f"rank{source}", os.O_RDWR | os.O_CREAT)
        except OSError as exc:
            self._failed(exc)
        body = bytearray(SLOT_BYTES)
        try:
            while True:
                kind, _, sent_length = _ENVELOPE.unpack(read_exactly(sock, _ENVELOPE.size))
                if kind == _PRE_STEP_OFF:
                    self._pre_step_done(source)
                    continue
                if kind not in (_RECORD, _PRE_STEP) or not 0 < sent_length <= SLOT_BYTES:
                    return  # its end (or nothing we know)
                view = memoryview(body)[:sent_length]
                read_into(sock, view)
                if record_length(view) != sent_length:
                    continue
                step = record_step(view)
                try:
                    if fd is not None:
                        write_peer_record(fd, bytes(view))
                except OSError as exc:  # not kept here (a full tmpfs), but it came
                    self._failed(exc)
                self.received[source] += 1
                if kind == _PRE_STEP and step is not None:
                    with self._arrived:
                        self._pre_step_seen[source] = step
                        self._arrived.notify_all()
        except (OSError, EOFError) as exc:  # the connection ended before the end message:
            # the source is gone (its node died)
            with self._arrived:
                self._lost[source] = f"its connection ended ({type(exc).__name__})"
                self._arrived.notify_all()
            log.info("snapshot.records_stopped", direction="receive", source=source,
                     received=self.received[source],
                     error=f"{type(exc).__name__}: {str(exc)[:200]}")
        finally:
            self._pre_step_done(source)
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)

    def _pre_step_done(self, source: int) -> None:
        """``source`` sends no more pre-step records: nobody waits for its."""
        with self._arrived:
            if source not in self._lost:
                self._pre_step_seen.pop(source, None)
            self._arrived.notify_all()
