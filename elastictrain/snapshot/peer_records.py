"""The rescue across nodes (docs/memory-tier.md#across-nodes): every rank's step-boundary
record (its RNG states at the boundary, ~13 kB) also reaches ``snapshot.memory_replicas``
other nodes, so that when a node dies a survivor on another node holds every rank's
record of the last step and can commit it (snapshot/rescuer.py).

Each rank sends its newest record to its targets (``NodeMap.record_targets``) from a
thread of its own, and receives its sources' records in one thread per source, written
into this node's boundary directory as ``rank<source>``, exactly as that rank wrote its
own (slot ``step % 2``, checksummed, its attempt in the header): the rescue reads them
as it reads local ones. The training loop only hands over the bytes; nothing waits for
the network. A record still in flight when its node dies never arrives: the survivor
then lacks it and skips the rescue (never commits a state with a wrong RNG).

At the end (``close``) every sender sends an end message, and every receiver ends on
its sources' end: no thread is left receiving when the process group goes away. A
receiver whose source died ends with the error of its receive.
"""

from __future__ import annotations

import contextlib
import os
import struct
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from elastictrain.localfiles import open_private
from elastictrain.log import get_logger
from elastictrain.snapshot.peer_transport import TAG_RECORDS, PeerTransport
from elastictrain.snapshot.rescue import SLOT_BYTES, record_length, write_peer_record

log = get_logger("elastictrain.snapshot")

_ENVELOPE = struct.Struct("<iii")  # kind, sending rank, record length
_RECORD, _END = 1, 0
# A record travels in one message of this size (the RNG states of python, torch CPU,
# numpy and a few CUDA devices take about 13 kB); a longer one (up to a slot) sends
# the rest in a second message.
MESSAGE_BYTES = 16 * 1024
CLOSE_TIMEOUT_S = 10.0


class RecordStream:
    """This rank's records to its targets; its sources' records into ``directory``.

    Args:
        failed: called with an error when a received record cannot be written (a full
            tmpfs: the rescue is off until one can).
    """

    def __init__(self, transport: PeerTransport, rank: int, targets: list[int],
                 sources: list[int], directory: Path,
                 failed: Callable[[BaseException], None]) -> None:
        self._transport, self._rank, self._targets = transport, rank, targets
        self._directory, self._failed = directory, failed
        self._cond = threading.Condition()
        self._latest: bytes | None = None
        self._closing = False
        self.sent = 0  # records sent to every target (tests, figures)
        self.received: dict[int, int] = dict.fromkeys(sources, 0)
        self._sender = threading.Thread(target=self._send_loop, daemon=True,
                                        name="elastictrain-records-send")
        self._receivers = [threading.Thread(target=self._receive_loop, args=(src,),
                                            daemon=True, name=f"elastictrain-records-{src}")
                           for src in sources]
        if targets:
            self._sender.start()
        for thread in self._receivers:
            thread.start()

    def publish(self, record: bytes) -> None:
        """(training thread) The newest record; one not yet sent is replaced by it."""
        with self._cond:
            self._latest = record
            self._cond.notify()

    def close(self) -> None:
        """Send what is pending and the end message; wait (bounded) for the sources'."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        if self._sender.is_alive():
            self._sender.join(CLOSE_TIMEOUT_S)
        for source, thread in zip(self.received, self._receivers, strict=True):
            # A source that sent nothing (it records no boundaries: its memory tier did
            # not open) sends no end either; its receiver ends with the process group.
            if self.received[source]:
                thread.join(CLOSE_TIMEOUT_S)
        log.info("snapshot.records_closed", sent=self.sent, targets=self._targets,
                 received=dict(self.received))

    def _next(self) -> bytes | None:
        with self._cond:
            while self._latest is None and not self._closing:
                self._cond.wait()
            record, self._latest = self._latest, None
            return record

    def _send_loop(self) -> None:
        raw = bytearray(_ENVELOPE.size + SLOT_BYTES)
        buffer, view = torch.frombuffer(raw, dtype=torch.uint8), memoryview(raw)
        message = buffer[:MESSAGE_BYTES]
        try:
            while (record := self._next()) is not None:
                _ENVELOPE.pack_into(view, 0, _RECORD, self._rank, len(record))
                end = _ENVELOPE.size + len(record)
                view[_ENVELOPE.size:end] = record
                for target in self._targets:
                    self._transport.send(message, target, TAG_RECORDS)
                    if end > MESSAGE_BYTES:
                        self._transport.send(buffer[MESSAGE_BYTES:end], target, TAG_RECORDS)
                self.sent += 1
            _ENVELOPE.pack_into(view, 0, _END, self._rank, 0)
            for target in self._targets:
                self._transport.send(message, target, TAG_RECORDS)
        except Exception as exc:  # a target is gone: its node's survivors rescue nothing
            log.info("snapshot.records_stopped", direction="send", targets=self._targets,
                     error=f"{type(exc).__name__}: {str(exc)[:200]}")

    def _receive_loop(self, source: int) -> None:
        raw = bytearray(_ENVELOPE.size + SLOT_BYTES)
        buffer, view = torch.frombuffer(raw, dtype=torch.uint8), memoryview(raw)
        message = buffer[:MESSAGE_BYTES]
        try:
            fd = open_private(self._directory / f"rank{source}", os.O_RDWR | os.O_CREAT)
        except OSError as exc:
            self._failed(exc)
            return
        try:
            while True:
                self._transport.recv(message, source, TAG_RECORDS)
                kind, _, sent_length = _ENVELOPE.unpack_from(view)
                if kind != _RECORD or not 0 < sent_length <= SLOT_BYTES:
                    return
                end = _ENVELOPE.size + sent_length
                if end > MESSAGE_BYTES:
                    self._transport.recv(buffer[MESSAGE_BYTES:end], source, TAG_RECORDS)
                body = view[_ENVELOPE.size:end]
                length = record_length(body)
                if length == sent_length:
                    try:
                        write_peer_record(fd, bytes(body))
                    except OSError as exc:
                        self._failed(exc)
                    self.received[source] += 1
        except Exception as exc:  # the source is gone (its node died) or the group
            log.info("snapshot.records_stopped", direction="receive", source=source,
                     received=self.received[source],
                     error=f"{type(exc).__name__}: {str(exc)[:200]}")
        finally:
            with contextlib.suppress(OSError):
                os.close(fd)
