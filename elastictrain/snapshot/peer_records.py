"""The rescue across nodes (docs/memory-tier.md#across-nodes): every rank's step-boundary
record (its RNG states at the boundary, ~13 kB) also reaches ``snapshot.memory_replicas``
other nodes, so that when a node dies a survivor on another node holds every rank's
record of the last step and can commit it (snapshot/rescuer.py).

Each rank writes its record of every step to a connection per target
(snapshot/record_links.py) from the training thread: one non-blocking send, nothing
waits for the network, and no thread of ours wakes on the sending side. A record the
connection cannot take whole at once (the target stopped reading: its buffers are full)
finishes at the next step, and the records in between are not sent to that target (its
rescue then lacks them and skips). Each rank receives its sources' records in one
thread per source, written into this node's boundary directory as ``rank<source>``,
exactly as that rank wrote its own (slot ``step % 2``, checksummed, its attempt in the
header): the rescue reads them as it reads local ones. A record still in flight when
its node dies never arrives: the survivor then lacks it and skips the rescue (never
commits a state with a wrong RNG).

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

from elastictrain.localfiles import open_private
from elastictrain.log import get_logger
from elastictrain.snapshot.record_links import RecordLinks, read_exactly, read_into
from elastictrain.snapshot.rescue import SLOT_BYTES, record_length, write_peer_record

log = get_logger("elastictrain.snapshot")

_ENVELOPE = struct.Struct("<iii")  # kind, sending rank, record length
_RECORD, _END = 1, 0
CLOSE_TIMEOUT_S = 10.0  # for the last sends to a node that is there
# For the other nodes' ends. The stream ends only after the run's agreed end, when no
# rescue reads these records; the wait only makes the received counts complete.
END_WAIT_S = 2.0


class _Outgoing:
    """One target's connection and the tail of a message it has not taken yet."""

    def __init__(self, target: int, sock: socket.socket) -> None:
        self.target, self.sock = target, sock
        sock.setblocking(False)
        self.unsent = memoryview(b"")
        self.skipped = 0  # records not sent while a message waited for the connection

    def offer(self, message: bytes) -> None:
        """Send ``message`` if the previous one is through, as much as goes now."""
        if self.unsent and not self._flush():
            self.skipped += 1
            return
        self.unsent = memoryview(message)
        self._flush()

    def _flush(self) -> bool:
        """Send what is left of the message; True when none is left."""
        try:
            sent = self.sock.send(self.unsent)
        except BlockingIOError:
            return False
        self.unsent = self.unsent[sent:]
        return not self.unsent


class RecordStream:
    """This rank's records to its targets; its sources' records into ``directory``.

    Args:
        links: the connections (snapshot/record_links.py); the stream owns them.
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
        self._receivers = [threading.Thread(target=self._receive_loop, args=(src, sock),
                                            daemon=True, name=f"elastictrain-records-{src}")
                           for src, sock in links.incoming.items()]
        for thread in self._receivers:
            thread.start()

    def publish(self, record: bytes) -> None:
        """(training thread) Send ``record`` to every target; nothing waits."""
        if not self._outgoing:
            return
        message = _ENVELOPE.pack(_RECORD, self._rank, len(record)) + record
        for out in list(self._outgoing):
            try:
                out.offer(message)
            except OSError as exc:  # the target's node is gone
                self._stop_sending(out, exc)
        self.sent += 1

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
        try:
            fd = open_private(self._directory / f"rank{source}", os.O_RDWR | os.O_CREAT)
        except OSError as exc:
            self._failed(exc)
            return
        body = bytearray(SLOT_BYTES)
        try:
            while True:
                kind, _, sent_length = _ENVELOPE.unpack(read_exactly(sock, _ENVELOPE.size))
                if kind != _RECORD or not 0 < sent_length <= SLOT_BYTES:
                    return
                view = memoryview(body)[:sent_length]
                read_into(sock, view)
                if record_length(view) == sent_length:
                    try:
                        write_peer_record(fd, bytes(view))
                    except OSError as exc:
                        self._failed(exc)
                    self.received[source] += 1
        except (OSError, EOFError) as exc:  # the connection ended before the end message:
            # the source is gone (its node died)
            log.info("snapshot.records_stopped", direction="receive", source=source,
                     received=self.received[source],
                     error=f"{type(exc).__name__}: {str(exc)[:200]}")
        finally:
            with contextlib.suppress(OSError):
                os.close(fd)
