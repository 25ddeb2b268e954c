"""diagnostics.worker_queues / stuck_role: pure logic over a stand-in cluster (no engine)."""

from types import SimpleNamespace

from e2e_test.infra.cluster import diagnostics
from e2e_test.infra.engines import tokenspeed, vllm


def _cluster(driver):
    return SimpleNamespace(driver=driver, engine=driver.name, workers=[])


def test_queue_gauges_come_from_the_engine_module():
    assert diagnostics.queue_gauges(_cluster(vllm.ENGINE)) == {
        "running": "vllm:num_requests_running", "waiting": "vllm:num_requests_waiting"}
    assert diagnostics.queue_gauges(_cluster(tokenspeed.ENGINE)) == {
        "running": "tokenspeed:num_requests_running",
        "waiting": "tokenspeed:num_requests_waiting"}


def test_stuck_role_names_the_worker_holding_requests():
    q = {"prefill-0": {"running": 0.0, "waiting": 0.0},
         "decode-0": {"running": 3.0, "waiting": 1.0}}
    assert diagnostics.stuck_role(q) == "decode-0 (running 3, waiting 1)"


def test_stuck_role_negative_control_nobody_holds_requests():
    q = {"worker-0": {"running": 0.0, "waiting": 0.0}}
    assert diagnostics.stuck_role(q) == "gateway (no worker holds the requests)"


def test_stuck_role_dead_metrics_and_missing_gauges():
    assert diagnostics.stuck_role({"decode-0": {"error": "ConnectTimeout"}}) == \
        "decode-0 (metrics endpoint not answering)"
    c = _cluster(SimpleNamespace(name="x", idle_gauges=None))
    c.workers = [SimpleNamespace(name="w-0", http_url="http://127.0.0.1:1")]
    q = diagnostics.worker_queues(c)
    assert "names no queue gauges" in diagnostics.stuck_role(q)
