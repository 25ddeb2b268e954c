"""Readiness as small strategies: one class per way of being ready, composed.

A strategy answers `ready(client) -> bool` without blocking for long (the Cluster polls it
next to the process's liveness, so a dead worker fails at once) and says in `pending()` what
it is still waiting for. Engines put one on each WorkerCommand; the gateway's is a composite.

    HttpGet(port, "/health")      an HTTP endpoint answers 200 (vLLM)
    GrpcHealth(port, service)     grpc.health.v1 answers SERVING (TokenSpeed)
    PortBound(port)               something listens on the port (the AFD FFN's rendezvous)
    Alive()                       the process is alive (nothing else to ask)
    ModelServed(url, model, k)    /v1/models lists the model and k chat completions succeed
    AllOf(s1, s2, ...)            each in order; a step once passed is not asked again

The timeouts are named here once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import httpx

from . import ports

POLL_S = 0.25                 # between two polls of a starting process
GATEWAY_READY_S = 120.0       # gateway start -> /health, worker registration, a real completion
GRPC_CHECK_S = 1.0            # one gRPC health call
NOT_LISTED = "/v1/models"     # how probe_ready's answers start while the model is not listed


def probe_ready(base_url: str, model: str, client: httpx.Client) -> tuple[bool, str]:
    """Ready = /v1/models lists the model AND one real chat completion succeeds. While the
    model is not listed (or /v1/models does not answer) the reason starts with NOT_LISTED."""
    try:
        r = client.get(f"{base_url}/v1/models")
        if r.status_code != 200:
            return False, f"{NOT_LISTED} HTTP {r.status_code}"
        ids = [m.get("id") for m in r.json().get("data", [])]
    except (httpx.HTTPError, ValueError) as e:
        return False, f"{NOT_LISTED} {e!r}"
    if model not in ids:
        return False, f"{NOT_LISTED} lists {ids}, not {model!r}"
    try:
        r = client.post(f"{base_url}/v1/chat/completions", json={
            "model": model, "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": "Say OK."}]})
        if r.status_code != 200:
            return False, f"probe chat completion HTTP {r.status_code}: {r.text[:200]}"
        if not r.json().get("choices"):
            return False, "probe chat completion had no choices"
        return True, ""
    except (httpx.HTTPError, ValueError) as e:
        return False, f"probe chat completion {e!r}"


class Readiness(Protocol):
    def ready(self, client: httpx.Client) -> bool: ...

    def pending(self) -> str: ...


@dataclass(frozen=True)
class PortBound:
    """Something listens on the port (the base of the checks that ask a port)."""
    port: int
    host: str = field(default="127.0.0.1", kw_only=True)

    def ready(self, client: httpx.Client | None = None) -> bool:
        return not ports.is_free(self.port, self.host)

    def pending(self) -> str:
        return f"nothing listening on port {self.port}"


@dataclass(frozen=True)
class HttpGet(PortBound):
    path: str = "/health"

    def ready(self, client: httpx.Client) -> bool:
        try:
            return client.get(f"http://{self.host}:{self.port}{self.path}").status_code == 200
        except httpx.HTTPError:
            return False

    def pending(self) -> str:
        return f"{self.path} on port {self.port} not answering 200"


@dataclass(frozen=True)
class GrpcHealth(PortBound):
    """The standard gRPC health check (grpc.health.v1) answers SERVING."""
    service: str = ""

    def ready(self, client: httpx.Client | None = None) -> bool:
        if not super().ready():
            return False
        try:
            import grpc
            from grpc_health.v1 import health_pb2, health_pb2_grpc
        except ImportError:      # no grpc client here: an open port is the best we can tell
            return True
        try:
            with grpc.insecure_channel(f"{self.host}:{self.port}") as ch:
                resp = health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(service=self.service), timeout=GRPC_CHECK_S)
                return resp.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False

    def pending(self) -> str:
        return f"gRPC health on port {self.port} not SERVING"


@dataclass(frozen=True)
class Alive:
    """No API of its own to ask: a live process is a ready one."""

    def ready(self, client: httpx.Client | None = None) -> bool:
        return True

    def pending(self) -> str:
        return ""


@dataclass
class ModelServed:
    """Ready = /v1/models lists the model AND `completions` real chat completions succeeded,
    one after another (one per poll). More than one where a role has several workers behind
    a round-robin gateway: k in a row reach every worker of a role of k or fewer, so no leg's
    first generation is a test's (see legs_to_warm).

    `failures` keeps each probe that failed once the model was listed, with how long it took
    and what the gateway said, so that a slow gateway readiness says why (TokenSpeed 1p1d on
    an H200: the first request through a new prefill-decode pair can outlast smg's 3 s
    prefill silence bound and be answered 504; the retry serves)."""
    base_url: str
    model: str
    completions: int = 1
    last: str = ""
    served: int = 0
    failures: list = field(default_factory=list)

    def ready(self, client: httpx.Client) -> bool:
        if self.served < self.completions:
            t0 = time.monotonic()
            ok, self.last = probe_ready(self.base_url, self.model, client)
            self.served += ok
            if not ok and not self.last.startswith(NOT_LISTED):
                self.failures.append({"after_s": round(time.monotonic() - t0, 2),
                                      "error": self.last[:300]})
        return self.served >= self.completions

    def pending(self) -> str:
        return (f"not serving {self.model!r} ({self.served} of {self.completions} probe "
                f"completions): {self.last}")


def legs_to_warm(worker_types) -> int:
    """Probe completions a gateway needs before a topology counts as ready: the most workers
    of one type behind it (1 for `1` and 1p1d). A worker's first generation can be slow
    (TokenSpeed's disaggregated workers skip their warmup); as a test's first request on a
    cold prefill it can outlast smg's 3 s PD silence bound, smg then retries on the other
    prefill, and the exact KV proof counts both (TokenSpeed 2p2d on an H200: more selections
    and prefill tokens than requests)."""
    counts: dict[str, int] = {}
    for t in worker_types:
        counts[t] = counts.get(t, 0) + 1
    return max(counts.values(), default=1)


@dataclass
class Step:
    """An action that runs once as a step of a composite (e.g. registering workers); it
    returns when done and raises when it cannot be."""
    what: str
    run: Callable[[], None]

    def ready(self, client: httpx.Client | None = None) -> bool:
        self.run()
        return True

    def pending(self) -> str:
        return self.what


class AllOf:
    def __init__(self, *steps):
        self.steps = tuple(steps)
        self._done = 0

    def ready(self, client: httpx.Client) -> bool:
        while self._done < len(self.steps):
            if not self.steps[self._done].ready(client):
                return False
            self._done += 1
        return True

    def pending(self) -> str:
        if self._done >= len(self.steps):
            return ""
        return self.steps[self._done].pending()
