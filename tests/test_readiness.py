"""Readiness strategies against real sockets: each one ready on the thing it asks for, and
not ready without it (the negative controls)."""

import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from e2e_test.infra.cluster.readiness import Alive, AllOf, GrpcHealth, HttpGet, PortBound, Step
from e2e_test.infra.lifecycle import ports


class _Health(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 503)
        self.send_header("Content-Length", "0")
        self.end_headers()


@pytest.fixture
def http_port():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv.server_address[1]
    srv.shutdown()
    srv.server_close()


@pytest.fixture
def client():
    with httpx.Client(timeout=2.0) as c:
        yield c


def test_http_get(http_port, client):
    assert HttpGet(http_port, "/health").ready(client)
    assert not HttpGet(http_port, "/not-ready").ready(client)       # 503
    free = ports.allocate(1)[0]
    assert not HttpGet(free).ready(client)                          # nothing listening
    assert "not answering 200" in HttpGet(free).pending()


def test_port_bound_and_grpc_need_a_listener(client):
    free = ports.allocate(1)[0]
    assert not PortBound(free).ready(client)
    assert not GrpcHealth(free).ready(client)
    with socket.socket() as s:
        s.bind(("127.0.0.1", free))
        s.listen()
        assert PortBound(free).ready(client)


def test_all_of_goes_in_order_and_keeps_what_passed(http_port, client):
    calls = []
    free = ports.allocate(1)[0]
    blocked = AllOf(Step("first", lambda: calls.append(1)), HttpGet(free), Alive())
    assert not blocked.ready(client) and not blocked.ready(client)
    assert calls == [1]                                             # a passed step is not rerun
    assert "port" in blocked.pending()
    ok = AllOf(HttpGet(http_port), Alive())
    assert ok.ready(client) and ok.pending() == ""
