"""The A/B bench's pure parts: workload shape, per-run metrics, the table."""

import math

from e2e_test.infra import bench, load


def _res(i, ok=True, ttft=0.1, lat=1.0, out=10, itl=(0.1, 0.1)):
    return load.RequestResult(index=i, status=200 if ok else 503, error="" if ok else "x",
                              ttft_s=ttft, latency_s=lat, output_tokens=out, prompt_tokens=50,
                              itl_s=list(itl))


def test_workload_is_deterministic_and_sized():
    cfg = bench.BenchConfig(isl=64, osl=8)
    a = bench.workload("m", cfg, 3, seed=1)
    b = bench.workload("m", cfg, 3, seed=1)
    assert [r.body for r in a] == [r.body for r in b]
    assert len(a[0].body["prompt"].split()) == 64
    assert a[0].body["max_tokens"] == 8 and a[0].body["ignore_eos"] is True


def test_measure_counts_failures_and_means():
    rep = load.RunReport([_res(0), _res(1, ttft=0.3, lat=2.0), _res(2, ok=False)], wall_s=2.0)
    m = bench.measure(rep)
    assert m["failed"] == 1.0 and m["req_per_s"] == 1.0 and m["out_tok_per_s"] == 10.0
    assert math.isclose(m["ttft_ms"], 200.0) and math.isclose(m["e2e_ms"], 1500.0)
    assert math.isclose(m["itl_ms"], 100.0) and m["isl_measured"] == 50


def test_table_has_every_metric_with_deltas():
    def side(topo, v):
        return {"topology": topo, "agg": {k: {"mean": v, "std": 0.0} for k in
                                          bench.METRICS + ("isl_measured", "client_overhead_ms")}}
    t = bench.table(side("1", 10.0), side("dp2", 15.0))
    assert "| req_per_s | 10.00 ± 0.00 | 15.00 ± 0.00 | +50.0% |" in t
    assert "| failed | 10.00 ± 0.00 | 15.00 ± 0.00 | +5.0 |" in t
