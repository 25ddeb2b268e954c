"""Negative controls for every pass/fail branch of e2e_test/infra/cluster/idle.py that a mutant
showed no other unit test caught (docs/mutation.md): the gateway's in-flight count read from a
/metrics page served in this process (gateway_load, and snapshot's gateway half, which could
break silently), the KV bound at its edge, and each line of the verdict. The workers are the
canned-metrics stand-ins of tests/test_idle.py."""

from __future__ import annotations

import types

import pytest
from local_http import serve
from test_idle import FakeWorker, _samples, fake_cluster

from e2e_test.infra.cluster import gateway as gw
from e2e_test.infra.cluster import idle
from e2e_test.infra.cluster.idle import IdleError, Load

SMG_PAGE = (f'# TYPE {gw.ACTIVE_REQUESTS} gauge\n'
            f'{gw.ACTIVE_REQUESTS}{{worker="http://a"}} 1\n'
            f'{gw.ACTIVE_REQUESTS}{{worker="http://b"}} 2\n'
            'smg_http_requests_total 40\n')


def _page(text):
    return {("GET", "/metrics"): lambda body, n: (200, text, {})}


def test_gateway_load_sums_smgs_in_flight_requests():
    with serve(_page(SMG_PAGE)) as srv:
        ld = idle.gateway_load(types.SimpleNamespace(gateway_metrics_url=srv.url + "/metrics"))
    assert (ld.name, ld.role, ld.active, ld.error) == ("gateway", "gateway", 3.0, "")
    assert ld.problems() == ["in flight 3"]
    with serve(_page("smg_http_requests_total 40\n")) as srv:   # no worker served yet
        ld = idle.gateway_load(types.SimpleNamespace(gateway_metrics_url=srv.url + "/metrics"))
    assert ld.active is None and ld.problems() == []


def test_gateway_metrics_not_answering_is_not_idle():
    with serve({}) as srv:                                          # 404
        ld = idle.gateway_load(types.SimpleNamespace(gateway_metrics_url=srv.url + "/metrics"))
    assert ld.error.startswith("metrics not answering (HTTPStatusError: Client error '404")
    assert len(ld.error) <= len("metrics not answering (HTTPStatusError: )") + 120
    assert ld.problems() == [ld.error] and ld.describe() == f"gateway: {ld.error}"


def _cluster_with_gateway(url, *workers):
    c = fake_cluster(list(workers) or [FakeWorker("worker-0", "worker", [_samples(0, 0, 0.0)])])
    c.gateway = object()
    c.gateway_metrics_url = url
    return c


def test_snapshot_reads_the_gateway_and_wait_idle_fails_on_its_in_flight_count():
    with serve(_page(SMG_PAGE)) as srv:
        c = _cluster_with_gateway(srv.url + "/metrics")
        loads = idle.snapshot(c)
        assert [(x.name, x.active) for x in loads] == [("worker-0", None), ("gateway", 3.0)]
        with pytest.raises(IdleError) as e:
            idle.wait_idle(c, timeout=0)
        assert str(e.value).splitlines() == [
            "topology 1p1d (vllm): not idle 0 s after traffic: gateway (in flight 3)",
            "every role: worker-0: running 0, waiting 0, kv_cache_usage 0; gateway: in flight 3"]
        assert [x.name for x in idle.snapshot(c, gateway=False)] == ["worker-0"]
        assert idle.wait_idle(c, timeout=0, gateway=False).polls == 1
        c.gateway = None                            # no gateway started: nothing to read
        assert [x.name for x in idle.snapshot(c)] == ["worker-0"]


def test_a_gateway_that_drained_passes():
    page = f'{gw.ACTIVE_REQUESTS}{{worker="http://a"}} 0\n'
    with serve(_page(page)) as srv:
        rep = idle.wait_idle(_cluster_with_gateway(srv.url + "/metrics"), timeout=0)
    assert rep.polls == 1 and rep.loads[-1].active == 0.0


@pytest.mark.parametrize("kv, idle_", [(0.0005, True), (0.00051, False)])
def test_kv_bound_is_inclusive(kv, idle_):
    assert idle.KV_IDLE_MAX == 0.0005
    ld = Load("w", "decode", running=0, waiting=0, kv_cache_usage=kv)
    assert (ld.problems() == []) == idle_
    if not idle_:
        assert ld.problems() == ["kv_cache_usage 0.0005 (> 0.0005)"]
    assert Load("w", "decode", kv_cache_usage=0.2).problems(kv_max=0.2) == []


def test_problems_and_description_name_every_number():
    ld = Load("decode-0", "decode", running=1, waiting=0, kv_cache_usage=0.5, active=2)
    assert ld.problems(0.1) == ["running 1", "in flight 2", "kv_cache_usage 0.5000 (> 0.1)"]
    assert ld.describe() == ("decode-0: running 1, waiting 0, kv_cache_usage 0.5, "
                             "in flight 2")
    assert Load("g", "gateway", error="down").problems() == ["down"]
    assert idle.busy([ld, Load("w", "worker", running=0)], 0.1) == [
        "decode-0 (running 1, in flight 2, kv_cache_usage 0.5000 (> 0.1))"]


def test_worker_metrics_errors_are_named_and_cut():
    w = FakeWorker("worker-0", "worker", [ValueError("x" * 300)])
    ld = idle.worker_load(w, {"running": "vllm:num_requests_running"})
    assert ld.error == "metrics not answering (ValueError: " + "x" * 120 + ")"
    assert (ld.name, ld.role) == ("worker-0", "worker")


def test_report_to_dict_rounds_seconds_and_keeps_loads():
    rep = idle.IdleReport(1.23456, 3, [Load("w", "worker", running=0.0)])
    assert rep.to_dict() == {"seconds": 1.235, "polls": 3, "loads": [
        {"name": "w", "role": "worker", "running": 0.0, "waiting": None,
         "kv_cache_usage": None, "active": None, "error": ""}]}


def test_wait_idle_waits_its_timeout_then_names_what_stayed_busy(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(idle.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(idle.time, "sleep", lambda s: clock.__setitem__(0, clock[0] + s))
    c = fake_cluster([FakeWorker("worker-0", "worker", [_samples(1, 0, 0.0)])])
    with pytest.raises(IdleError, match="not idle 30 s after traffic: worker-0 "
                                        r"\(running 1\)"):
        idle.wait_idle(c, gateway=False)
    assert clock[0] == pytest.approx(30.0)          # default timeout, polled every 0.25 s
    assert idle.DEFAULT_TIMEOUT_S == 30.0


def test_each_scrape_is_bounded_by_3_s_by_default(monkeypatch):
    seen = []
    real = idle.metrics.scrape

    def spy_scrape(url, timeout=5.0):
        seen.append(timeout)
        return real(url, timeout=timeout)
    monkeypatch.setattr(idle.metrics, "scrape", spy_scrape)
    with serve(_page(SMG_PAGE)) as srv:
        c = types.SimpleNamespace(gateway_metrics_url=srv.url + "/metrics")
        idle.gateway_load(c)
        idle.gateway_load(c, timeout=0.5)
    assert seen == [3.0, 0.5]
    w = FakeWorker("worker-0", "worker", [_samples(0, 0, 0.0)])
    asked = []
    w.metrics = lambda timeout=99.0: asked.append(timeout) or _samples(0, 0, 0.0)
    idle.worker_load(w, {"running": "vllm:num_requests_running"})
    assert asked == [3.0]


def test_missing_gauges_are_all_named():
    w = FakeWorker("worker-0", "worker", [{}])
    ld = idle.worker_load(w, {"running": "a_running", "waiting": "a_waiting"})
    assert ld.error == "reports no a_running, a_waiting"


def test_snapshot_errors_say_why_idleness_cannot_be_verified():
    none = fake_cluster([], builder=types.SimpleNamespace(
        ENGINE=types.SimpleNamespace(idle_gauges={}, idle_skip_roles=())))
    with pytest.raises(IdleError) as e:
        idle.snapshot(none)
    assert str(e.value) == ("engine 'vllm' names no idle gauges (Engine.idle_gauges in its "
                            "engine module): idleness cannot be verified")
    with pytest.raises(IdleError) as e:
        idle.snapshot(fake_cluster([]))
    assert str(e.value) == ("topology 1p1d (vllm): no running worker to read (none started, or "
                            "every role's idle check skipped): idleness cannot be verified")


def test_wait_idle_applies_its_kv_bound_and_names_every_busy_role():
    c = fake_cluster([FakeWorker("a", "prefill", [_samples(0, 0, 0.1)]),
                      FakeWorker("b", "decode", [_samples(2, 0, 0.0)])])
    with pytest.raises(IdleError) as e:
        idle.wait_idle(c, timeout=0, gateway=False)
    assert str(e.value).splitlines()[0] == (
        "topology 1p1d (vllm): not idle 0 s after traffic: a (kv_cache_usage 0.1000 (> "
        "0.0005)); b (running 2)")
    c = fake_cluster([FakeWorker("a", "prefill", [_samples(0, 0, 0.1)])])
    rep = idle.wait_idle(c, timeout=0, kv_max=0.2, gateway=False)
    assert rep.polls == 1 and isinstance(rep.seconds, float) and 0 <= rep.seconds < 5
    assert rep.to_dict()["seconds"] == round(rep.seconds, 3)


def test_wait_idle_polls_every_quarter_second_by_default(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(idle.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(idle.time, "sleep", lambda s: clock.__setitem__(0, clock[0] + s))
    w = FakeWorker("worker-0", "worker", [_samples(1, 0, 0.0)])
    calls = []
    w.metrics = lambda timeout=3.0: calls.append(clock[0]) or _samples(1, 0, 0.0)
    with pytest.raises(IdleError):
        idle.wait_idle(fake_cluster([w]), timeout=2, gateway=False)
    assert calls == [i * 0.25 for i in range(9)]
