"""A tiny HTTP server in the test's own process, for the unit tests of functions that talk HTTP
(tests/test_mutation_*.py): each route answers what the test gives it, and every request it
got is kept, so a test checks both what the function sent and what it made of the answer."""

from __future__ import annotations

import json
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Server:
    def __init__(self, routes):
        # routes: {(method, path): handler(body: dict | None, n: int) -> (status, body, headers)}
        # n counts the calls of that route from 0; body is a dict (sent as JSON) or a str.
        self.routes = routes
        self.calls: list[tuple[str, str, dict | None]] = []
        self.lock = threading.Lock()
        self.url = ""


@contextmanager
def serve(routes):
    srv = Server(routes)

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _answer(self, method):
            path = self.path.split("?", 1)[0]
            n_bytes = int(self.headers.get("content-length") or 0)
            body = json.loads(self.rfile.read(n_bytes)) if n_bytes else None
            with srv.lock:
                n = sum(1 for m, p, _ in srv.calls if (m, p) == (method, path))
                srv.calls.append((method, path, body))
            handler = srv.routes.get((method, path))
            status, out, headers = handler(body, n) if handler else (404, "not found", {})
            data = (json.dumps(out) if not isinstance(out, str) else out).encode()
            self.send_response(status)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._answer("GET")

        def do_POST(self):
            self._answer("POST")

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    srv.url = f"http://127.0.0.1:{httpd.server_address[1]}"
    t = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.02},
                         daemon=True)
    t.start()
    try:
        yield srv
    finally:
        httpd.shutdown()
        httpd.server_close()
