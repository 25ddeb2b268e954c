"""Bursts through the gateway: within capacity everything answers; against a small engine
window with admission configured, the gateway sheds the excess and nothing times out.

Before any burst the window preflight reads every serving worker's resolved window: unknown,
or below the burst with no admission configured, fails at once with the numbers (instead of
a burst that waits on a bootstrap deadlock)."""

import time

import pytest

from e2e_test.infra.cluster.cluster import results_root
from e2e_test.infra.cluster.gateway import Admission
from e2e_test.infra.load import bursts
from e2e_test.infra.specs import settings

pytestmark = pytest.mark.e2e
BURST_N = settings.get("E2E_BURST_N")
WINDOW = settings.get("E2E_BURST_WINDOW")
PREFLIGHT_FAIL_S = 10.0   # a window that cannot take the burst fails within this


def _save(record, res: bursts.BurstResult, cluster):
    png = bursts.histogram(res, results_root() / "bursts" / f"{cluster.name}-{res.name}.png")
    summary = res.summary()
    summary["histogram"] = str(png) if png else None
    record.setdefault("bursts", {})[res.name] = summary
    print(f"{res.name} on {cluster.topology.name}: {summary['status_counts']} "
          f"latency {summary['latency_s']} refusals {summary['refusal_latency_s']} "
          f"window {summary['effective_window']} client {summary['client_overhead_ms']} ms/req")
    return summary


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_burst_within_capacity(cluster, record, stream):
    record["window_preflight"] = bursts.preflight(cluster, BURST_N, admission=None)
    res = bursts.burst(cluster.gateway_url, cluster.model_name, n=BURST_N, max_tokens=32,
                       stream=stream, name=f"within-capacity-{'stream' if stream else 'plain'}",
                       watchdog=cluster.watchdog("burst"))
    w = cluster.workers[0]
    res.effective_window = bursts.effective_window(w.url, w.process.log_text(),
                                                   engine=cluster.driver)
    _save(record, res, cluster)
    bursts.check_within_capacity(res)


def _window_case(cluster, record):
    """A burst against the shared small-window topology (profile `window`: --max-num-seqs at
    E2E_BURST_WINDOW, eager) through a second gateway with admission configured: admission
    is a gateway setting, so the workers need no boot of their own for it."""
    admission = Admission(max_concurrent_requests=WINDOW, queue_size=WINDOW,
                          queue_timeout_secs=settings.get("E2E_QUEUE_TIMEOUT_S"))
    c = cluster
    n = max(BURST_N, 4 * WINDOW)
    if c.topology.kind == "regular":
        _preflight_negative_control(c, record, n)
    with c.extra_gateway(admission, name="gateway-admission") as g:
        record["window_preflight"] = bursts.preflight(c, n, admission)
        res = bursts.burst(g.url, c.model_name, n=n, max_tokens=64,
                           name=f"versus-window-{c.topology.name}", metrics_url=g.metrics_url,
                           watchdog=c.watchdog("burst"))
    w = c.workers[-1]
    res.effective_window = bursts.effective_window(w.url, w.process.log_text(), engine=c.driver)
    res.admission = vars(admission)
    record["gateway"] = {"name": g.name, "argv": g.argv}
    _save(record, res, c)
    verdict = bursts.check_admission(res, admission)
    record["bursts"][res.name]["verdict"] = verdict
    bursts.check_effective_window(res.effective_window, WINDOW, w.name)


def _preflight_negative_control(c, record, n):
    """The same small-window topology, asked for the burst with no admission: the preflight
    must refuse at once, naming the window and the burst (and nothing is sent)."""
    t0 = time.monotonic()
    with pytest.raises(bursts.WindowError) as ei:
        bursts.preflight(c, n, admission=None)
    took = time.monotonic() - t0
    msg = str(ei.value)
    record["window_preflight_negative"] = {"error": msg, "seconds": round(took, 3)}
    print(f"window preflight without admission: refused in {took:.2f} s: {msg}")
    assert f"a burst of {n}" in msg and f"the window is {WINDOW}" in msg, msg
    assert "configure admission" in msg, msg
    assert took < PREFLIGHT_FAIL_S, f"preflight took {took:.1f} s"


@pytest.mark.cluster_profile("window")
@pytest.mark.topology_kinds("regular")
def test_burst_versus_window(cluster, record):
    """The seed case on one worker: the gateway says no, quickly and legibly."""
    _window_case(cluster, record)


@pytest.mark.cluster_profile("window")
@pytest.mark.topology_kinds("pd")
def test_pd_burst_versus_window(cluster, record):
    """On 1p1d a burst larger than the decode window is shed or queued by the gateway and
    every admitted request completes: never an engine-side (bootstrap) timeout."""
    _window_case(cluster, record)
