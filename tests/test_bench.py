"""The A/B bench's pure parts: workload shape, per-run metrics, the table."""

import math
import random

from e2e_test.infra.load import abstats, bench, load


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


# ---------------------------------------------------------------- A/B verdicts (synthetic)


def test_t_quantiles_match_the_tables():
    assert math.isclose(abstats.t_ppf(0.975, 4), 2.7764, abs_tol=1e-3)
    assert math.isclose(abstats.t_ppf(0.975, 30), 2.0423, abs_tol=1e-3)
    assert math.isclose(abstats.t_ppf(0.975, 1), 12.706, abs_tol=1e-2)
    assert math.isclose(abstats.t_ppf(0.025, 10), -2.2281, abs_tol=1e-3)


def test_welch_interval_covers_a_known_difference():
    d = abstats.welch_delta([10.0, 11.0, 9.0], [20.0, 21.0, 19.0])
    assert math.isclose(d.delta, 100.0) and d.lo < 100 < d.hi and d.lo > 0 and d.unit == "%"
    z = abstats.welch_delta([0.0, 0.0], [0.0, 0.0], relative=False)
    assert z.delta == 0 and z.lo == 0 == z.hi


def _arm(mean, sd, n, rnd):
    return [rnd.gauss(mean, sd) for _ in range(n)]


def test_shifted_b_is_called_and_a_against_a_is_not():
    rnd = random.Random(7)
    a, ctl = _arm(100, 2, 5, rnd), _arm(100, 2, 5, rnd)
    slower = _arm(80, 2, 5, rnd)          # 20 % less throughput, 20 % less latency
    assert abstats.verdict("req_per_s", a, slower, ctl).verdict == "worse"
    assert abstats.verdict("e2e_ms", a, slower, ctl).verdict == "better"
    faster = _arm(125, 2, 5, rnd)
    assert abstats.verdict("out_tok_per_s", a, faster, ctl).verdict == "better"
    assert abstats.verdict("ttft_ms", a, faster, ctl).verdict == "worse"
    # negative control: B drawn from A's own distribution is no detectable difference
    same = abstats.verdict("req_per_s", a, _arm(100, 2, 5, rnd), ctl)
    assert same.verdict == "no detectable difference"
    assert same.text().startswith("no detectable difference at ±") and same.text().endswith(" %")
    assert 0 < same.floor < 10


def test_a_shift_inside_the_control_noise_is_not_called():
    """A noisy control arm widens the floor: a 3 % shift it cannot resolve stays undecided."""
    rnd = random.Random(3)
    a, ctl = _arm(100, 6, 3, rnd), _arm(100, 6, 3, rnd)
    v = abstats.verdict("req_per_s", a, [x * 1.03 for x in a], ctl)
    assert v.verdict == "no detectable difference" and v.floor > 3


def test_failures_are_judged_in_counts():
    assert abstats.verdict("failed", [0, 0, 0], [0, 0, 0], [0, 0, 0]).text() == \
        "no detectable difference at ±0.0"
    assert abstats.verdict("failed", [0, 0, 0], [3, 4, 3], [0, 0, 0]).verdict == "worse"


def test_schedule_interleaves_and_alternates_the_a_arms():
    assert bench.schedule(3) == [["a", "b", "control"], ["control", "b", "a"],
                                 ["a", "b", "control"]]


class _FakeCluster:
    """A stand-in for Cluster in this unit test of the bench's orchestration (pure logic: no
    engine, no gateway); the load is replaced by synthetic numbers below."""

    def __init__(self, topo):
        self.topology = type("T", (), {"name": topo})()
        self.timing = type("Tm", (), {"workers": {"worker-0": 1.0}})()
        self.teardown_report = type("R", (), {"verdict": lambda self: "clean in 0.1 s"})()
        self.gateway_url, self.model_name = f"http://{topo}", "m"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def watchdog(self, what):
        return None


def test_ab_interleaves_keeps_the_json_keys_and_judges(monkeypatch, tmp_path):
    monkeypatch.setenv("E2E_RESULTS_DIR", str(tmp_path))
    calls, rnd = [], random.Random(1)

    def fake_run(url, reqs, **kw):
        calls.append(url)
        slow = 1.5 if url == "http://dp2" else 1.0
        res = [_res(i, ttft=0.1 * slow * rnd.uniform(0.98, 1.02), lat=1.0 * slow)
               for i in range(len(reqs))]
        return load.RunReport(res, wall_s=2.0 * slow * rnd.uniform(0.98, 1.02))

    monkeypatch.setattr(bench.load, "run", fake_run)
    cfg = bench.BenchConfig(n=4, warmup=1, reps=4)
    out = bench.ab(_FakeCluster, "1", "dp2", cfg, log=lambda *a: None)
    assert calls[2:8] == ["http://1", "http://dp2", "http://1"] * 2   # after the 2 warm-ups
    assert {"config", "a", "b", "control", "order", "verdicts", "table", "path"} <= set(out)
    assert {"topology", "runs", "agg", "ready_s", "teardown"} <= set(out["a"])
    assert len(out["a"]["runs"]) == len(out["b"]["runs"]) == len(out["control"]["runs"]) == 4
    assert out["verdicts"]["req_per_s"]["verdict"] == "worse"
    assert out["verdicts"]["ttft_ms"]["verdict"] == "worse"
    assert out["verdicts"]["failed"]["verdict"] == "no detectable difference"
    assert out["table"].splitlines()[1] == "|---|---|---|---|---|---|---|"
    assert "| req_per_s |" in out["table"] and "| worse |" in out["table"]
    assert (tmp_path / "bench-1-vs-dp2.json").is_file()


def test_shapes_ask_the_same_prompts_each_its_way():
    """Every shape: the same prompt (same seed), ignore_eos and temperature 0; chat as one user
    message; logprobs of the chosen token only, the way the oracle asks each API."""
    cfg = bench.BenchConfig(isl=16, osl=8)
    got = {s: bench.workload("m", cfg, 2, seed=3, shape=s) for s in bench.SHAPES}
    prompt = got["completions"][0].body["prompt"]
    for s, reqs in got.items():
        b = reqs[0].body
        assert (b["max_tokens"], b["temperature"], b["ignore_eos"]) == (8, 0, True), s
        text = b["prompt"] if "prompt" in b else b["messages"][0]["content"]
        assert text == prompt, s
    assert got["completions"][0].path == "/v1/completions"
    assert "logprobs" not in got["completions"][0].body
    assert got["completions-logprobs"][0].body["logprobs"] == 0
    assert got["chat"][0].path == "/v1/chat/completions"
    assert got["chat"][0].body["messages"] == [{"role": "user", "content": prompt}]
    assert "logprobs" not in got["chat"][0].body
    assert (got["chat-logprobs"][0].body["logprobs"],
            got["chat-logprobs"][0].body["top_logprobs"]) == (True, 0)


def test_unknown_shape_and_an_arm_against_itself_fail_before_any_cluster():
    import pytest

    from e2e_test.infra.errors import ConfigError
    started = []

    def make(topo):
        started.append(topo)
        return _FakeCluster(topo)

    with pytest.raises(ConfigError, match=r"unknown request shape 'chat-lp' \(one of "):
        bench.ab(make, "1", "1", bench.BenchConfig(shape="chat-lp"), log=lambda *a: None)
    with pytest.raises(ConfigError, match="A and B are both 1 asked as chat: nothing"):
        bench.ab(make, "1", "1", bench.BenchConfig(shape="chat"), log=lambda *a: None)
    assert started == []


def test_ab_of_two_shapes_on_one_topology(monkeypatch, tmp_path):
    """B differs in its shape only: one topology serves A, B and A' (started once), each arm's
    requests in its own shape, and a shape that costs more per request is called worse."""
    monkeypatch.setenv("E2E_RESULTS_DIR", str(tmp_path))
    started, paths, rnd = [], [], random.Random(2)

    def make(topo):
        started.append(topo)
        return _FakeCluster(topo)

    def fake_run(url, reqs, **kw):
        paths.append(reqs[0].path)
        slow = 4.0 if reqs[0].body.get("logprobs") else 1.0
        res = [_res(i, ttft=0.1 * rnd.uniform(0.98, 1.02), lat=1.0 * slow * rnd.uniform(0.98, 1.02))
               for i in range(len(reqs))]
        return load.RunReport(res, wall_s=2.0 * slow * rnd.uniform(0.98, 1.02))

    monkeypatch.setattr(bench.load, "run", fake_run)
    cfg = bench.BenchConfig(n=4, warmup=1, reps=4, shape="chat")
    out = bench.ab(make, "1", "1", cfg, log=lambda *a: None, shape_b="chat-logprobs")
    assert started == ["1"]
    assert set(paths) == {"/v1/chat/completions"}
    assert (out["a"]["topology"], out["b"]["topology"]) == ("1 chat", "1 chat-logprobs")
    assert (out["a"]["shape"], out["b"]["shape"], out["control"]["shape"]) == (
        "chat", "chat-logprobs", "chat")
    assert out["verdicts"]["e2e_ms"]["verdict"] == "worse"
    assert (tmp_path / "bench-1-vs-1-chat-vs-chat-logprobs.json").is_file()


def test_the_probe_script_parses_its_arguments():
    """scripts/probe_shapes.py (a diagnostic on a real topology) imports the harness and says
    its options without starting anything."""
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, str(root / "scripts" / "probe_shapes.py"), "--help"],
                       cwd=root, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "--concs" in r.stdout and "--engine" in r.stdout
