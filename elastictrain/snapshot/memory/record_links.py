"""The connections the rescue's boundary records travel on between nodes
(snapshot/memory/peer_records.py): one TCP connection from each rank to each of its record
targets, opened once at manager setup.

Why not the memory tier's gloo group: a record crosses every step, and each gloo send
and receive wakes threads on both sides that a training step already keeps busy; a
record written to a socket from the training thread is one system call there and one
wakeup of the receiving thread. Measured in docs/memory-tier.md#figures-across-nodes.

Setup is a collective (every rank calls ``connect_record_links`` together): each rank
listens on the address its host reaches the job's master by, the addresses and a token
of this attempt are all-gathered, each rank connects to its targets and accepts its
sources. A connection whose first bytes are not this attempt's token and an expected
source's rank is closed unread: nothing another run (or anyone else) sends is kept.
A target that cannot be reached within ``CONNECT_TIMEOUT_S`` gets no records (logged);
the job goes on.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import secrets
import selectors
import socket
import struct
import time
from dataclasses import dataclass, field

from elastictrain.core.log import get_logger
from elastictrain.worker.dist import DistContext

log = get_logger("elastictrain.snapshot")

CONNECT_TIMEOUT_S = 30.0
_HELLO = struct.Struct("<8s16si")  # magic, this attempt's token, the sending rank
_MAGIC = b"ETRECv1\0"


@dataclass
class RecordLinks:
    """This rank's connections: ``outgoing[target]`` and ``incoming[source]``."""

    outgoing: dict[int, socket.socket] = field(default_factory=dict)
    incoming: dict[int, socket.socket] = field(default_factory=dict)

    def close(self) -> None:
        for sock in (*self.outgoing.values(), *self.incoming.values()):
            with contextlib.suppress(OSError):
                sock.close()
        self.outgoing.clear()
        self.incoming.clear()


def reachable_host() -> str:
    """The address of this host that other nodes of the job reach it by: the source
    address of the route to the job's master (``MASTER_ADDR``). Where that is a loopback
    address (the master is this host and its name resolves to 127.0.1.1, as Debian's
    ``/etc/hosts`` has it), the source address of the default route instead, if there is
    one; a loopback address only when nothing else routes (then the job is on one host)."""
    found = [address for destination in (os.environ.get("MASTER_ADDR"), _ANY_PUBLIC)
             if destination and (address := _route_source(destination)) is not None]
    for address in found:
        if not ipaddress.ip_address(address).is_loopback:
            return address
    return found[0] if found else socket.gethostbyname(socket.gethostname())


# A public address to ask the routing table about; nothing is ever sent to it.
_ANY_PUBLIC = "192.0.2.1"  # TEST-NET-1 (RFC 5737): routed by the default route only


def _route_source(destination: str) -> str | None:
    """The local address the kernel would send from to ``destination`` (a UDP socket's
    ``connect`` picks the route and sends nothing), or None without a route."""
    try:
        family, _, _, _, address = socket.getaddrinfo(destination, 9,
                                                      type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(address)
            return str(probe.getsockname()[0])
    except OSError:
        return None


def connect_record_links(ctx: DistContext, targets: list[int],
                         sources: list[int]) -> RecordLinks:
    """(all ranks, together) Connect to ``targets`` and accept ``sources``."""
    host = reachable_host()
    listener = socket.create_server((host, 0), family=_family(host), backlog=max(1, len(sources)))
    try:
        port = listener.getsockname()[1]
        token = secrets.token_bytes(16) if ctx.rank == 0 else b""
        found = ctx.all_gather_object((host, port, token))
        token = found[0][2]
        links = RecordLinks()
        for target in targets:
            target_host, target_port, _ = found[target]
            sock = _connect(target_host, target_port, _HELLO.pack(_MAGIC, token, ctx.rank))
            if sock is None:
                log.warning("snapshot.records_unlinked", target=target,
                            address=f"{target_host}:{target_port}")
                continue
            links.outgoing[target] = sock
        links.incoming = _accept(listener, token, set(sources))
    finally:
        listener.close()
    missing = sorted(set(sources) - set(links.incoming))
    if missing:
        log.warning("snapshot.records_unlinked", sources=missing)
    return links


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _connect(host: str, port: int, hello: bytes) -> socket.socket | None:
    try:
        sock = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S)
        sock.sendall(hello)
    except OSError:
        return None
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a record goes at once
    return sock


def _accept(listener: socket.socket, token: bytes, expected: set[int]) -> dict[int, socket.socket]:
    """The connections of ``expected`` sources, until each came or the time is up.
    Every connection's hello is read as its bytes come, side by side: one that
    connects and sends nothing holds up no other."""
    accepted: dict[int, socket.socket] = {}
    hellos: dict[socket.socket, bytearray] = {}
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    listener.setblocking(False)
    with selectors.DefaultSelector() as ready:
        ready.register(listener, selectors.EVENT_READ)
        while set(accepted) != expected:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for key, _ in ready.select(left):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                if sock is listener:
                    with contextlib.suppress(BlockingIOError, InterruptedError):
                        conn, _ = listener.accept()
                        conn.setblocking(False)
                        hellos[conn] = bytearray()
                        ready.register(conn, selectors.EVENT_READ)
                    continue
                source = _read_hello(sock, hellos[sock], token)
                if source is None:
                    continue  # more of its hello to come
                ready.unregister(sock)
                del hellos[sock]
                if source < 0 or source not in expected or source in accepted:
                    sock.close()  # not this attempt's, or not a source of ours: never read
                    continue
                sock.setblocking(True)
                accepted[source] = sock
        for sock in hellos:  # never said who it is in time
            sock.close()
    return accepted


def _read_hello(sock: socket.socket, got: bytearray, token: bytes) -> int | None:
    """Read what has come of ``sock``'s hello into ``got``: its sending rank once whole
    and this attempt's, -1 for a connection that ended or is not, None until whole."""
    try:
        chunk = sock.recv(_HELLO.size - len(got))
    except (BlockingIOError, InterruptedError):
        return None
    except OSError:
        return -1
    if not chunk:
        return -1
    got += chunk
    if len(got) < _HELLO.size:
        return None
    magic, sent_token, rank = _HELLO.unpack(bytes(got))
    if magic != _MAGIC or not secrets.compare_digest(sent_token, token):
        return -1
    return int(rank)


def read_exactly(sock: socket.socket, size: int) -> bytes:
    data = bytearray(size)
    read_into(sock, memoryview(data))
    return bytes(data)


def read_into(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock``; EOFError when the connection ends first."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise EOFError("the connection ended")
        got += n
