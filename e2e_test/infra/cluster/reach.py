"""Which workers a stream of requests reaches, by each worker's own work counters (the
engine's work_counters, read as Cluster.worker_work reads them): the negative control of a
gateway pinned to one worker (Cluster.pinned). A pin that leaks moves another worker's
counters; the same requests through the topology's own gateway must move every worker's, or
the measurement could not see a leak at all.
"""

from __future__ import annotations

import time

import httpx

from ..errors import HarnessError

# After the workers expected to move did: another worker's late counter shows by then (an
# engine records a request's tokens as it finishes it, next to its answer).
SETTLE_S = 1.0
MOVE_TIMEOUT_S = 30.0
POLL_S = 0.25
REQUEST_TIMEOUT_S = 120.0


def _work(cluster) -> dict[str, float]:
    out = {}
    for w in cluster.workers:
        v = cluster.worker_work(w)
        if v is None:
            raise HarnessError(f"{cluster.name}: {w.name} did not answer for its work counters")
        out[w.name] = v
    return out


def work_moved(cluster, url: str, n: int, expect: list[str]) -> dict[str, float]:
    """Send `n` chat completions to `url` one after another (an HTTP error raises), then read
    every worker's work until each worker named in `expect` has moved (or MOVE_TIMEOUT_S has
    passed), and once more SETTLE_S later. Returns worker name -> work done meanwhile."""
    before = _work(cluster)
    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as c:
        for i in range(n):
            r = c.post(f"{url}/v1/chat/completions", json={
                "model": cluster.model_name, "max_tokens": 4, "temperature": 0,
                "messages": [{"role": "user", "content": f"Count to {i + 2}."}]})
            r.raise_for_status()
    deadline = time.monotonic() + MOVE_TIMEOUT_S
    while True:
        moved = {k: v - before[k] for k, v in _work(cluster).items()}
        if all(moved[k] > 0 for k in expect) or time.monotonic() > deadline:
            break
        time.sleep(POLL_S)
    time.sleep(SETTLE_S)
    return {k: v - before[k] for k, v in _work(cluster).items()}


def pin_problems(pinned_to: str, pinned: dict[str, float], unpinned: dict[str, float]) -> list:
    """What is wrong with a pin to worker `pinned_to`, from the work each worker did through
    it (`pinned`) and through the topology's own gateway (`unpinned`): one line each."""
    out = []
    if pinned.get(pinned_to, 0) <= 0:
        out.append(f"pinned to {pinned_to}: it did no work ({pinned})")
    leaked = {k: v for k, v in pinned.items() if k != pinned_to and v != 0}
    if leaked:
        out.append(f"pinned to {pinned_to}: other workers worked too ({leaked})")
    idle = sorted(k for k, v in unpinned.items() if v <= 0)
    if len(unpinned) < 2 or idle:
        out.append(f"unpinned: not every worker worked ({unpinned}), so the measurement "
                   "cannot tell a pin from a gateway that sends everything to one worker")
    return out
