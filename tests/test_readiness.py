"""Readiness strategies against real sockets (ModelServed against a fake round-robin gateway,
httpx.MockTransport): each one ready on the thing it asks for, and not ready without it (the
negative controls)."""

import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from e2e_test.infra.lifecycle.readiness import (
    Alive,
    AllOf,
    GrpcHealth,
    HttpGet,
    NOT_LISTED,
    ModelServed,
    PortBound,
    Step,
    legs_to_warm,
    probe_ready,
)
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


def _round_robin_gateway(legs: int, fail_first: int = 0):
    """A fake gateway (pure logic, httpx.MockTransport): /v1/models lists the model, each
    chat completion goes to the next of `legs` workers round robin; the first `fail_first`
    answer 503. Returns (transport, hits per leg)."""
    hits = [0] * legs
    state = {"next": 0, "n": 0}

    def handle(req: httpx.Request) -> httpx.Response:
        if req.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        state["n"] += 1
        leg = state["next"] % legs
        state["next"] += 1
        hits[leg] += 1
        if state["n"] <= fail_first:
            return httpx.Response(503, text="tokenizer not yet registered")
        return httpx.Response(200, json={"choices": [{"message": {"content": "OK"}}]})
    return httpx.MockTransport(handle), hits


def test_model_served_warms_every_leg_of_a_role():
    """Two prefills behind a round-robin gateway: ready only once two completions succeeded,
    one per poll, so each leg served one before any test (TokenSpeed 2p2d: a test's first
    request on a cold prefill is retried by smg and the KV proof counts both).
    A failed probe does not count."""
    transport, hits = _round_robin_gateway(2, fail_first=1)
    legs = legs_to_warm(["prefill"] * 2 + ["decode"] * 2)
    ready = ModelServed("http://gw", "m", completions=legs)
    with httpx.Client(transport=transport) as c:
        polls = [ready.ready(c) for _ in range(3)]
    assert polls == [False, False, True]
    assert ready.served == 2
    assert hits == [2, 1] and min(hits) >= 1


def test_one_probe_leaves_a_leg_cold_negative_control():
    transport, hits = _round_robin_gateway(2)
    ready = ModelServed("http://gw", "m")          # one completion: what readiness was
    with httpx.Client(transport=transport) as c:
        assert ready.ready(c)
    assert hits == [1, 0]


def test_legs_to_warm():
    assert legs_to_warm(["regular"]) == 1
    assert legs_to_warm(["prefill", "decode"]) == 1
    assert legs_to_warm(["prefill", "decode", "decode"]) == 2
    assert legs_to_warm(["encode", "prefill", "prefill", "prefill", "decode"]) == 3
    assert legs_to_warm([]) == 1


def test_model_served_keeps_the_probes_that_failed():
    """A gateway that lists the model late, then answers the first chat 504 (smg's prefill
    silence verdict on a new PD pair, as TokenSpeed's 1p1d shows): the 504 is kept with its
    reason and duration, the not-yet-listed polls are not (they are the gateway starting)."""
    state = {"models": 0, "chats": 0}

    def handle(req: httpx.Request) -> httpx.Response:
        if req.url.path == "/v1/models":
            state["models"] += 1
            return httpx.Response(200, json={"data": [{"id": "m"}] if state["models"] > 1 else []})
        state["chats"] += 1
        if state["chats"] == 1:
            return httpx.Response(504, text="PD prefill leg produced nothing within 3.0s")
        return httpx.Response(200, json={"choices": [{"message": {"content": "OK"}}]})

    ready = ModelServed("http://gw", "m")
    with httpx.Client(transport=httpx.MockTransport(handle)) as c:
        assert [ready.ready(c) for _ in range(3)] == [False, False, True]
    assert len(ready.failures) == 1
    assert ready.failures[0]["error"].startswith("probe chat completion HTTP 504: PD prefill")
    assert ready.failures[0]["after_s"] >= 0
    # negative control: a gateway that serves the first probe keeps no failure
    transport, _ = _round_robin_gateway(1)
    clean = ModelServed("http://gw", "m")
    with httpx.Client(transport=transport) as c:
        assert clean.ready(c)
    assert clean.failures == []


def test_probe_ready_tells_not_listed_from_a_failed_completion():
    def down(req: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=req)

    with httpx.Client(transport=httpx.MockTransport(down)) as c:
        ok, why = probe_ready("http://gw", "m", c)
    assert not ok and why.startswith(NOT_LISTED)

    def chat_down(req: httpx.Request) -> httpx.Response:
        if req.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        raise httpx.ReadTimeout("slow", request=req)

    with httpx.Client(transport=httpx.MockTransport(chat_down)) as c:
        ok, why = probe_ready("http://gw", "m", c)
    assert not ok and why.startswith("probe chat completion ReadTimeout")
