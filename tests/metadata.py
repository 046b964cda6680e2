"""A cloud metadata server for tests: a real HTTP server on 127.0.0.1 (port 0, so
always free) answering like the AWS spot, GCP and Azure interruption endpoints."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

AWS_PATH = "/latest/meta-data/spot/instance-action"
GCP_PATH = "/computeMetadata/v1/instance/preempted"
AZURE_PATH = "/metadata/scheduledevents?api-version=2020-07-01"


class Metadata:
    """A cloud metadata server: AWS (IMDSv2 token), GCP and Azure paths, switchable."""

    def __init__(self) -> None:
        self.pending = False
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        meta = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_PUT(self) -> None:
                meta.requests.append(("PUT", self.path, self._headers()))
                if self.path == "/latest/api/token":
                    self._reply(200, "tok-123")
                else:
                    self._reply(404, "")

            def do_GET(self) -> None:
                meta.requests.append(("GET", self.path, self._headers()))
                if self.path == "/latest/meta-data/spot/instance-action":
                    if self.headers.get("X-aws-ec2-metadata-token") != "tok-123":
                        self._reply(401, "")
                    elif meta.pending:
                        self._reply(200, json.dumps({"action": "terminate",
                                                     "time": "2026-01-01T00:02:00Z"}))
                    else:
                        self._reply(404, "")
                elif self.path == "/computeMetadata/v1/instance/preempted":
                    ok = self.headers.get("Metadata-Flavor") == "Google"
                    self._reply(200 if ok else 403, "TRUE" if meta.pending else "FALSE")
                elif self.path.startswith("/metadata/scheduledevents"):
                    events = [{"EventId": "e1", "EventType": "Freeze"}]
                    if meta.pending:
                        events.append({"EventId": "e2", "EventType": "Preempt"})
                    self._reply(200, json.dumps({"DocumentIncarnation": 1, "Events": events}))
                else:
                    self._reply(404, "")

            def _headers(self) -> dict[str, str]:
                return {k.lower(): v for k, v in self.headers.items()}

            def _reply(self, code: int, body: str) -> None:
                data = body.encode()
                self.send_response(code)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Metadata:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)
