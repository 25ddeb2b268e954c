"""Idle verification logic (infra/cluster/idle.py) on canned metrics: a fake cluster object stands in
for real workers here only; the real check runs in e2e_test/router/test_serving_faults.py."""

import types

import pytest

from e2e_test.infra.cluster import idle
from e2e_test.infra.cluster.idle import IdleError, Load
from e2e_test.infra.engines import tokenspeed, vllm


def _samples(running, waiting, kv, prefix="vllm"):
    return {(f"{prefix}:num_requests_running", (("engine", "0"),)): running,
            (f"{prefix}:num_requests_waiting", (("engine", "0"),)): waiting,
            (f"{prefix}:kv_cache_usage_perc", (("engine", "0"),)): kv}


class FakeWorker:
    def __init__(self, name, role, series):
        self.name = name
        self.entry = types.SimpleNamespace(role=role)
        self.process = object()
        self._series = list(series)

    def metrics(self, timeout=3.0):
        s = self._series[0] if len(self._series) == 1 else self._series.pop(0)
        if isinstance(s, Exception):
            raise s
        return s


def fake_cluster(workers, builder=vllm):
    return types.SimpleNamespace(workers=workers, driver=builder.ENGINE, gateway=None,
                                 engine="vllm", topology=types.SimpleNamespace(name="1p1d"))


def test_engine_modules_name_their_gauges():
    assert set(vllm.IDLE_GAUGES) == set(tokenspeed.IDLE_GAUGES) == {
        "running", "waiting", "kv_cache_usage"}
    assert all(v.startswith("vllm:") for v in vllm.IDLE_GAUGES.values())
    assert all(v.startswith("tokenspeed:") for v in tokenspeed.IDLE_GAUGES.values())


def test_idle_cluster_passes_at_once():
    c = fake_cluster([FakeWorker("prefill-0", "prefill", [_samples(0, 0, 0.0)]),
                      FakeWorker("decode-0", "decode", [_samples(0, 0, 0.0)])])
    rep = idle.wait_idle(c, timeout=1, gateway=False)
    assert rep.polls == 1 and [x.name for x in rep.loads] == ["prefill-0", "decode-0"]


def test_busy_role_fails_naming_role_and_numbers():
    c = fake_cluster([FakeWorker("prefill-0", "prefill", [_samples(0, 0, 0.031)]),
                      FakeWorker("decode-0", "decode", [_samples(1, 2, 0.0)])])
    with pytest.raises(IdleError) as exc:
        idle.wait_idle(c, timeout=0.3, poll_s=0.1, gateway=False)
    line = str(exc.value).splitlines()[0]
    assert "not idle" in line and "1p1d" in line
    assert "prefill-0 (kv_cache_usage 0.0310" in line
    assert "decode-0 (running 1, waiting 2)" in line


def test_no_worker_to_read_is_an_error_not_idle():
    """Every worker stopped, or of a role whose idle check is skipped: the gateway alone
    (or nothing) was read, which passed."""
    stopped = FakeWorker("worker-0", "worker", [_samples(0, 0, 0.0)])
    stopped.process = None
    skipped = FakeWorker("encode-0", tokenspeed.IDLE_SKIP_ROLES[0], [_samples(0, 0, 0.0)])
    for c in (fake_cluster([stopped]), fake_cluster([skipped], builder=tokenspeed)):
        with pytest.raises(IdleError, match=r"1p1d \(vllm\): no running worker to read"):
            idle.wait_idle(c, timeout=1, gateway=False)


def test_settles_after_a_few_polls():
    c = fake_cluster([FakeWorker("worker-0", "worker",
                                 [_samples(1, 0, 0.01), _samples(0, 0, 0.002),
                                  _samples(0, 0, 0.0)])])
    rep = idle.wait_idle(c, timeout=5, poll_s=0.01, gateway=False)
    assert rep.polls == 3


def test_missing_gauge_and_dead_endpoint_are_not_idle():
    no_kv = _samples(0, 0, 0.0)
    no_kv.pop(("vllm:kv_cache_usage_perc", (("engine", "0"),)))
    c = fake_cluster([FakeWorker("worker-0", "worker", [no_kv]),
                      FakeWorker("worker-1", "worker", [ConnectionError("refused")])])
    with pytest.raises(IdleError) as exc:
        idle.wait_idle(c, timeout=0, gateway=False)
    line = str(exc.value).splitlines()[0]
    assert "worker-0 (reports no vllm:kv_cache_usage_perc)" in line
    assert "worker-1 (metrics not answering" in line


def test_skipped_roles_and_engine_without_gauges():
    c = fake_cluster([FakeWorker("encode-0", "encode", [ConnectionError("no metrics")]),
                      FakeWorker("decode-0", "decode",
                                 [_samples(0, 0, 0.0, prefix="tokenspeed")])],
                     builder=tokenspeed)
    assert idle.wait_idle(c, timeout=0, gateway=False).polls == 1
    with pytest.raises(IdleError, match="names no idle gauges"):
        idle.wait_idle(fake_cluster([], builder=types.SimpleNamespace(
            ENGINE=types.SimpleNamespace(idle_gauges=None, idle_skip_roles=()))), timeout=0)


def test_gateway_in_flight_counts():
    assert Load("gateway", "gateway", active=2).problems() == ["in flight 2"]
    assert Load("gateway", "gateway", active=0).problems() == []


def test_selections_by_worker_type():
    from e2e_test.infra.load import serving_faults as sf
    lab = (("connection_mode", "http"), ("model", "m"), ("policy", "round_robin"))
    fake = types.SimpleNamespace(gateway_metrics=lambda: {
        ("smg_worker_selection_total", lab + (("worker_type", "decode"),)): 4.0,
        ("smg_worker_selection_total", lab + (("worker_type", "prefill"),)): 3.0,
        ("smg_worker_requests_active", lab): 1.0})
    assert sf.selections(fake) == {"decode": 4.0, "prefill": 3.0}
