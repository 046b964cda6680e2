"""A real S3 server for tests: moto's HTTP app on 127.0.0.1, stoppable like a crash.

This is the app that ``moto_server`` and ``moto.server.ThreadedMotoServer`` serve,
in a threaded werkzeug server in the test process, plus two things tests need:

* ``stop()`` behaves like a crash: the listening socket closes (new connections
  are refused) and every connection in flight is cut. moto keeps its state in
  this process's memory, so ``start()`` on the same port serves the same
  buckets and objects: a store whose front end went away and came back. That
  is what lets a test assert what an outage did and did not commit.
* ``faults`` injects what a real store does under stress, in front of moto and
  over real HTTP: ``503 SlowDown`` throttling, error responses, connections
  dropped before or after moto processed the request, and requests held until
  the test lets them go (to stop the server in the middle of an upload).

Clients are real: s3fs, botocore and aiohttp parse real responses.
"""

from __future__ import annotations

import json
import socket
import struct
import sys
import threading
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs

from werkzeug.serving import ThreadedWSGIServer, WSGIRequestHandler

from tests.helpers import free_port

# Distinctive fake credentials: tests grep every output for them.
FAKE_KEY = "AKIAELASTICTRAINFAKE7"
FAKE_SECRET = "et-fake-secret-Zq9Xw3Vb7Nm2Lk5Jh8Gf"


@dataclass(frozen=True)
class Request:
    """What the server saw of one request (never the Authorization header)."""

    method: str
    path: str
    query: dict[str, list[str]]
    if_none_match: str | None
    status: int | None = None

    @property
    def op(self) -> str:
        """The S3 operation, from method and query (enough for tests)."""
        q = self.query
        if self.method == "POST" and "uploads" in q:
            return "CreateMultipartUpload"
        if self.method == "PUT" and "partNumber" in q:
            return "UploadPart"
        if self.method == "POST" and "uploadId" in q:
            return "CompleteMultipartUpload"
        if self.method == "DELETE" and "uploadId" in q:
            return "AbortMultipartUpload"
        if self.method == "GET" and "list-type" in q:
            return "ListObjectsV2"
        return {"PUT": "PutObject", "GET": "GetObject", "HEAD": "HeadObject",
                "DELETE": "DeleteObject", "POST": "Post"}.get(self.method, self.method)

    @property
    def part(self) -> int | None:
        return int(self.query["partNumber"][0]) if "partNumber" in self.query else None


@dataclass
class Hold:
    """A request parked until ``release()``; ``arrived`` is set when it is parked."""

    arrived: threading.Event = field(default_factory=threading.Event)
    released: threading.Event = field(default_factory=threading.Event)
    forward: bool = False  # on release: pass it on to moto (True) or cut it (False)

    def release(self, forward: bool | None = None) -> None:
        if forward is not None:
            self.forward = forward
        self.released.set()


@dataclass
class _Rule:
    match: Callable[[Request], bool]
    action: str  # "error", "drop", "drop_after", "hold"
    times: int
    status: int = 503
    code: str = "SlowDown"
    message: str = "Please reduce your request rate."
    hold: Hold | None = None


class Faults:
    """WSGI middleware in front of moto: records requests and injects faults."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.requests: list[Request] = []
        self._rules: list[_Rule] = []
        self._holds: list[Hold] = []
        self._lock = threading.Lock()

    # -- programming faults ---------------------------------------------------------
    def throttle(self, match: Callable[[Request], bool], times: int) -> None:
        """Answer ``503 SlowDown`` to the next ``times`` matching requests."""
        self._add(_Rule(match, "error", times))

    def error(self, match: Callable[[Request], bool], status: int, code: str,
              message: str = "injected", times: int = 1) -> None:
        """Answer an S3 error response to the next ``times`` matching requests."""
        self._add(_Rule(match, "error", times, status, code, message))

    def drop(self, match: Callable[[Request], bool], times: int, after: bool = False) -> None:
        """Cut the connection of the next ``times`` matching requests, before moto sees
        them, or ``after`` moto processed them (the response is lost)."""
        self._add(_Rule(match, "drop_after" if after else "drop", times))

    def hold(self, match: Callable[[Request], bool], times: int = 1,
             forward: bool = False) -> Hold:
        """Park the next ``times`` matching requests until the Hold is released."""
        hold = Hold(forward=forward)
        self._add(_Rule(match, "hold", times, hold=hold))
        return hold

    def clear(self) -> None:
        with self._lock:
            self._rules.clear()
            self.requests.clear()
        self.release_all()

    def release_all(self) -> None:
        with self._lock:
            holds, self._holds = self._holds, []
        for hold in holds:
            hold.release(forward=False)

    def seen(self, match: Callable[[Request], bool] = lambda r: True) -> list[Request]:
        with self._lock:
            return [r for r in self.requests if match(r)]

    def _add(self, rule: _Rule) -> None:
        with self._lock:
            self._rules.append(rule)
            if rule.hold is not None:
                self._holds.append(rule.hold)

    def _take(self, request: Request) -> _Rule | None:
        with self._lock:
            for rule in self._rules:
                if rule.times > 0 and rule.match(request):
                    rule.times -= 1
                    return rule
        return None

    # -- WSGI ------------------------------------------------------------------------
    def __call__(self, environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        request = Request(environ["REQUEST_METHOD"], environ.get("PATH_INFO", ""),
                          parse_qs(environ.get("QUERY_STRING", ""), keep_blank_values=True),
                          environ.get("HTTP_IF_NONE_MATCH"))
        index = self._record(request)
        rule = self._take(request) if not request.path.startswith("/moto-api") else None
        if rule is None:
            return self._pass(environ, start_response, index)
        if rule.action == "error":
            self._set_status(index, rule.status)
            return _error_response(start_response, rule.status, rule.code, rule.message)
        if rule.action == "hold":
            assert rule.hold is not None
            rule.hold.arrived.set()
            rule.hold.released.wait(timeout=300)
            if rule.hold.forward:
                return self._pass(environ, start_response, index)
        if rule.action == "drop_after":
            b"".join(self.app(environ, lambda *a, **k: lambda data: None))
        return _cut(environ, start_response)

    def _record(self, request: Request) -> int:
        with self._lock:
            self.requests.append(request)
            return len(self.requests) - 1

    def _set_status(self, index: int, status: int) -> None:
        with self._lock:
            if index < len(self.requests):
                old = self.requests[index]
                self.requests[index] = Request(old.method, old.path, old.query,
                                               old.if_none_match, status)

    def _pass(self, environ: dict[str, Any], start_response: Any,
              index: int) -> Iterable[bytes]:
        def recording_start_response(status: str, headers: Any, exc_info: Any = None) -> Any:
            self._set_status(index, int(status.split()[0]))
            return start_response(status, headers, exc_info)

        result: Iterable[bytes] = self.app(environ, recording_start_response)
        return result


def _error_response(start_response: Any, status: int, code: str, message: str) -> list[bytes]:
    body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
            f"<Message>{message}</Message><RequestId>injected</RequestId></Error>").encode()
    start_response(f"{status} {code}", [("Content-Type", "application/xml"),
                                        ("Content-Length", str(len(body)))])
    return [body]


def _abort_connection(sock: socket.socket) -> None:
    """Reset a connection as the kernel does for a crashed process: linger 0 makes the
    close send RST. (A plain shutdown sends FIN, and a client still sending a body
    then hangs for minutes on TCP timers, which is not what a crash looks like.)"""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.shutdown(socket.SHUT_RDWR)  # wakes a handler thread blocked in recv
    except OSError:
        pass


def _cut(environ: dict[str, Any], start_response: Any) -> list[bytes]:
    """Drop the client's connection without an answer, as a crashed server would."""
    sock = environ.get("werkzeug.socket")
    if sock is not None:
        _abort_connection(sock)
    # werkzeug then fails to write this response and treats it as a dropped connection.
    start_response("500 Cut", [("Content-Length", "0")])
    return []


class _QuietHandler(WSGIRequestHandler):
    def log(self, type: str, message: str, *args: Any) -> None:
        pass  # no access log on the test's stderr


class _Server(ThreadedWSGIServer):
    """Tracks open connections so that ``cut_all`` can drop them like a crash."""

    def __init__(self, host: str, port: int, app: Any) -> None:
        self.open_connections: set[socket.socket] = set()
        self._conn_lock = threading.Lock()
        super().__init__(host, port, app, handler=_QuietHandler)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._conn_lock:
            self.open_connections.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._conn_lock:
            self.open_connections.discard(request)
        super().shutdown_request(request)

    def log(self, type: str, message: str, *args: Any) -> None:
        pass  # cut connections make werkzeug report errors we caused on purpose

    def cut_all(self) -> None:
        with self._conn_lock:
            connections = list(self.open_connections)
        for conn in connections:
            _abort_connection(conn)


class MotoS3:
    """moto's S3 on ``127.0.0.1:<free port>``; see the module docstring."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        from moto.moto_server.werkzeug_app import (
            DomainDispatcherApplication,
            create_backend_app,
        )

        self.host = host
        self.port = 0
        self.faults = Faults(DomainDispatcherApplication(create_backend_app))
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._server is not None

    def start(self) -> None:
        """Listen on the previous port (a restart) or, the first time, a free one."""
        if self._server is not None:
            return
        for _ in range(5):
            port = self.port or free_port()
            try:
                server = _Server(self.host, port, self.faults)
            except SystemExit:  # werkzeug exits on EADDRINUSE: someone took the port
                if self.port:
                    raise
                continue
            self.port = port
            break
        else:
            raise RuntimeError("no free port for the moto server")
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever,
                                        kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Crash-stop: refuse new connections, cut the open ones, drop held requests."""
        if self._server is None:
            return
        server, self._server = self._server, None
        server.shutdown()
        server.server_close()
        self.faults.release_all()
        server.cut_all()
        assert self._thread is not None
        self._thread.join(timeout=30)

    def reset(self) -> None:
        """Forget every bucket and object (moto's ``POST /moto-api/reset``) and all faults."""
        self.faults.clear()
        self._post("/moto-api/reset", b"")
        self.faults.clear()

    def require_auth(self, enabled: bool) -> None:
        """Make moto check credentials (IAM users and keys) or accept anything again."""
        self._post("/moto-api/reset-auth", b"0" if enabled else b"inf")

    def _post(self, path: str, body: bytes) -> Any:
        # text/plain: a form content type would hide the body from moto (request.data).
        request = urllib.request.Request(self.endpoint + path, data=body, method="POST",
                                         headers={"Content-Type": "text/plain"})
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read() or b"{}")

    # -- an admin client, independent of the code under test -------------------------
    def client(self, service: str = "s3", key: str = FAKE_KEY,
               secret: str = FAKE_SECRET) -> Any:
        import boto3

        return boto3.client(service, endpoint_url=self.endpoint, region_name="us-east-1",
                            aws_access_key_id=key, aws_secret_access_key=secret)

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        """Every object key under ``prefix``, listed fresh from the server."""
        pages = self.client().get_paginator("list_objects_v2").paginate(
            Bucket=bucket, Prefix=prefix)
        return sorted(o["Key"] for page in pages for o in page.get("Contents", []))

    def pending_uploads(self, bucket: str) -> list[str]:
        """Keys of multipart uploads started and neither completed nor aborted."""
        uploads = self.client().list_multipart_uploads(Bucket=bucket).get("Uploads", [])
        return sorted(u["Key"] for u in uploads)


@dataclass
class S3Bucket:
    """One test's bucket on the server, with the ways a client can reach it."""

    server: MotoS3
    name: str

    def url(self, prefix: str = "run") -> str:
        return f"s3://{self.name}/{prefix}"

    @property
    def options(self) -> dict[str, Any]:
        """fsspec storage_options with the fake credentials and the endpoint."""
        return {"key": FAKE_KEY, "secret": FAKE_SECRET,
                "client_kwargs": {"endpoint_url": self.server.endpoint}}

    @property
    def env(self) -> dict[str, str]:
        """The same through the usual credential chain (environment variables)."""
        return {"AWS_ACCESS_KEY_ID": FAKE_KEY, "AWS_SECRET_ACCESS_KEY": FAKE_SECRET,
                "AWS_EC2_METADATA_DISABLED": "true"}

    def keys(self, prefix: str = "") -> list[str]:
        return self.server.keys(self.name, prefix)


def moto_session() -> Iterator[MotoS3]:
    """Body of the session fixture: one server per test session."""
    server = MotoS3()
    server.start()
    try:
        yield server
    finally:
        server.stop()


def fresh_bucket(server: MotoS3, name: str = "et-test") -> Iterator[S3Bucket]:
    """Body of the per-test fixture: a reset server, one empty bucket, no cached clients."""
    import s3fs

    server.start()  # a test that stopped it and failed leaves it stopped
    server.reset()
    server.require_auth(False)
    s3fs.S3FileSystem.clear_instance_cache()
    server.client().create_bucket(Bucket=name)  # no region: moto rejects a constraint
    server.faults.clear()
    try:
        yield S3Bucket(server, name)
    finally:
        server.faults.release_all()
        server.start()
        server.require_auth(False)
        s3fs.S3FileSystem.clear_instance_cache()


def assert_no_secret(*texts: str | bytes, where: str = "output") -> None:
    """No fake credential anywhere in ``texts``."""
    for text in texts:
        data = text.encode(errors="replace") if isinstance(text, str) else text
        for secret in (FAKE_KEY, FAKE_SECRET):
            assert secret.encode() not in data, f"credential {secret[:6]}… leaked into {where}"


if __name__ == "__main__":  # pragma: no cover - manual use: python -m tests.s3server
    s = MotoS3()
    s.start()
    print(s.endpoint, file=sys.stderr)
    threading.Event().wait()
