"""The rescue's record connections at setup (snapshot/memory/record_links.py): every
connection's hello is read side by side, so one that connects and says nothing (a
stray client, a stuck process of an earlier attempt) holds up no source of ours."""

from __future__ import annotations

import socket
import time

import pytest

from elastictrain.snapshot.memory import record_links
from elastictrain.snapshot.memory.record_links import _HELLO, _MAGIC, _accept

TOKEN = b"t" * 16


def test_a_silent_connection_holds_up_no_source(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(record_links, "CONNECT_TIMEOUT_S", 20.0)
    listener = socket.create_server(("127.0.0.1", 0), backlog=4)
    address = listener.getsockname()
    silent = socket.create_connection(address)  # connects first, never says a word
    wrong = socket.create_connection(address)
    wrong.sendall(_HELLO.pack(_MAGIC, b"x" * 16, 0))  # another attempt's token
    good = socket.create_connection(address)
    good.sendall(_HELLO.pack(_MAGIC, TOKEN, 1))
    try:
        started = time.monotonic()
        accepted = _accept(listener, TOKEN, {1})
        assert set(accepted) == {1}
        assert time.monotonic() - started < 10  # not the silent one's 20 s
        accepted[1].sendall(b"ok")  # the accepted side is a blocking, working socket
        assert good.recv(2) == b"ok"
        for sock in accepted.values():
            sock.close()
    finally:
        for sock in (silent, wrong, good, listener):
            sock.close()
