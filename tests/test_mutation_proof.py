"""Negative controls for every pass/fail branch of e2e_test/infra/verdicts/proof.py that a
mutant showed no other unit test caught (docs/mutation.md): smg's PD failure counters, an
explicit head_dim, the verdict's message, and the functions that talk HTTP (post_all,
legs_traffic) against a gateway served in this process, read through metrics text as smg
and vLLM write it."""

from __future__ import annotations

import types

import httpx
import pytest
from local_http import serve

from e2e_test.infra.cluster import metrics
from e2e_test.infra.engines.vllm import SRC
from e2e_test.infra.errors import HarnessError
from e2e_test.infra.verdicts import proof

SEL = proof.SELECTIONS


def smg(prefill=0.0, decode=0.0, bootstrap=0.0, transfer=0.0, overload=0.0, liveness=0.0):
    """A scrape of smg 1.13's /metrics with these counters (metrics text, parsed)."""
    lab = 'connection_mode="http",model="m",policy="round_robin"'
    return metrics.parse(
        f'{SEL}{{{lab},worker_type="prefill"}} {prefill}\n'
        f'{SEL}{{{lab},worker_type="decode"}} {decode}\n'
        f'smg_pd_bootstrap_failures_total {bootstrap}\n'
        f'smg_pd_kv_transfer_failures_total {transfer}\n'
        f'smg_worker_overload_fallback_total{{stage="selection"}} {overload}\n'
        f'smg_worker_overload_fallback_total{{stage="other"}} 5\n'
        f'smg_worker_liveness_fallback_total{{stage="selection"}} {liveness}\n')


def test_kv_transfer_and_bootstrap_failures_are_counted_and_fail_the_proof():
    g = proof.gateway_dispatch(smg(bootstrap=1), smg(prefill=4, decode=4, bootstrap=2,
                                                      transfer=2))
    assert g == {"gateway_encode_selections": 0, "gateway_prefill_selections": 4,
                 "gateway_decode_selections": 4, "gateway_transfer_failures": 3}
    assert proof.dispatch_problems(types.SimpleNamespace(**g), 4) == [
        "the gateway counted 3 bootstrap/transfer failures"]
    ok = proof.gateway_dispatch(smg(), smg(prefill=4, decode=4))
    assert proof.dispatch_problems(types.SimpleNamespace(**ok), 4) == []


def test_veto_fallback_pairs_count_for_both_legs_in_a_pd_gateway_only():
    before, after = smg(), smg(prefill=1, decode=1, overload=2, liveness=1)
    g = proof.gateway_dispatch(before, after, pd=True)
    assert (g["gateway_prefill_selections"], g["gateway_decode_selections"],
            g["gateway_fallback_pairs"]) == (4, 4, 3)
    assert proof.dispatch_problems(types.SimpleNamespace(**g), 4) == []
    plain = proof.gateway_dispatch(before, after)
    assert "gateway_fallback_pairs" not in plain and plain["gateway_prefill_selections"] == 1
    assert proof.dispatch_problems(types.SimpleNamespace(**plain), 4) == [
        "the gateway picked prefill 1 and decode 1 times for 4 requests"]


@pytest.mark.parametrize("prefill, decode, ok", [(4, 4, True), (3, 4, False), (4, 3, False)])
def test_each_leg_must_be_picked_for_every_request(prefill, decode, ok):
    g = proof.gateway_dispatch(smg(), smg(prefill=prefill, decode=decode))
    assert (proof.dispatch_problems(types.SimpleNamespace(**g), 4) == []) == ok


def test_an_explicit_head_dim_is_used_not_the_hidden_size_over_heads():
    """Qwen3-style: 16 heads of 128 over a hidden size of 1024 (1024 / 16 = 64 would halve it)."""
    cfg = {"num_hidden_layers": 2, "num_attention_heads": 16, "num_key_value_heads": 8,
           "hidden_size": 1024, "head_dim": 128}
    per_token, layout = proof.kv_bytes_per_token(cfg, "bfloat16")
    assert per_token == 2 * 2 * 8 * 128 * 2 == 8192
    assert layout == {"num_hidden_layers": 2, "num_key_value_heads": 8, "head_dim": 128,
                      "dtype": "bfloat16", "dtype_bytes": 2}
    mm = {"text_config": dict(cfg, num_key_value_heads=None), "hidden_size": 7}
    assert proof.kv_bytes_per_token(mm, "float32")[0] == 2 * 2 * 16 * 128 * 4
    with pytest.raises(HarnessError, match=r"^KV dtype 'int3': its size is unknown \(known: "
                                           r"bfloat16, float16, half"):
        proof.kv_bytes_per_token(cfg, "int3")


def test_sum_delta_sums_every_workers_counter_by_label():
    before = [{(SRC, (("source", "local_compute"),)): 10.0}, {}]
    after = [{(SRC, (("source", "local_compute"),)): 30.0,
              (SRC, (("source", "external_kv_transfer"),)): 99.0},
             {(SRC, (("source", "local_compute"),)): 5.0}]
    assert proof.sum_delta(before, after, SRC, source="local_compute") == 25.0
    assert proof.sum_delta(before, after, SRC) == 124.0


def test_verdict_passes_the_proof_through_or_fails_naming_every_problem():
    c = types.SimpleNamespace(topology=types.SimpleNamespace(name="1p1d"))
    p = proof.LegsProof(4, {"prefill-0": {"role": "prefill"}})
    assert proof.verdict("PD legs", c, [], p) is p
    with pytest.raises(HarnessError) as e:
        proof.verdict("PD legs", c, ["a", "b"], p)
    assert str(e.value) == ("PD legs failed on 1p1d: a; b ({'requests': 4, 'legs': "
                            "{'prefill-0': {'role': 'prefill'}}, 'gateway': {}})")


# -- post_all and legs_traffic against a gateway in this process -------------------------------

def _completions(bad=None):
    """Answers each completion with usage; `bad`: {call number: (status, body)}."""
    def complete(body, n):
        if bad and n in bad:
            return bad[n][0], bad[n][1], {}
        return 200, {"choices": [{"text": "x"}], "usage": {"prompt_tokens": n + 10}}, {}
    return {("POST", "/v1/completions"): complete}


def _cluster(url, **kw):
    c = types.SimpleNamespace(client=httpx.Client(base_url=url, timeout=7.0),
                              topology=types.SimpleNamespace(name="1p1d", kind="pd"),
                              model_name="m", **kw)
    return c


def test_post_all_returns_each_usage_and_fails_on_a_bad_answer():
    with serve(_completions()) as srv:
        c = _cluster(srv.url)
        assert proof.post_all(c, "PD", "/v1/completions", [{"a": 1}, {"a": 2}]) == [
            {"prompt_tokens": 10}, {"prompt_tokens": 11}]
        assert proof.post_all(c, "PD", "/v1/completions", [{"a": 3}], url=srv.url) == [
            {"prompt_tokens": 12}]
    assert [b for _, _, b in srv.calls] == [{"a": 1}, {"a": 2}, {"a": 3}]
    with serve(_completions({1: (500, "engine died")})) as srv, \
            pytest.raises(HarnessError, match=r"^PD request 1: HTTP 500 engine died$"):
        proof.post_all(_cluster(srv.url), "PD", "/v1/completions", [{}, {}])
    with serve(_completions({0: (200, {"choices": []})})) as srv, \
            pytest.raises(HarnessError, match=r"^EPD request 0: no choices in "
                                              r'\{"choices": \[\]\}$'):
        proof.post_all(_cluster(srv.url), "EPD", "/v1/completions", [{}])


class CannedWorker:
    """A worker whose /metrics answers are recorded text, one per scrape."""

    def __init__(self, name, pages):
        self.name, self.pages = name, list(pages)

    def metrics(self, timeout=5.0):
        return metrics.parse(self.pages.pop(0))


def _src(local=0, external=0):
    return (f'{SRC}{{source="local_compute"}} {local}\n'
            f'{SRC}{{source="external_kv_transfer"}} {external}\n')


OWN = {"prefill": [proof.leg(SRC, {"source": "local_compute"})],
       "decode": [proof.leg(SRC, {"source": "external_kv_transfer"})]}
FOREIGN = {"prefill": [proof.leg(SRC, {"source": "external_kv_transfer"})],
           "decode": [proof.leg(SRC, {"source": "local_compute"})]}


def _legs_cluster(url, pre, dec, gateway_scrapes):
    scrapes = list(gateway_scrapes)
    roles = {"prefill": pre, "decode": dec}
    return _cluster(url, role=lambda r: roles.get(r, []),
                    gateway_metrics=lambda: scrapes.pop(0))


def test_legs_traffic_passes_when_every_leg_worked_in_its_role(monkeypatch):
    monkeypatch.setattr(proof.time, "sleep", lambda s: None)
    with serve(_completions()) as srv:
        c = _legs_cluster(srv.url, [CannedWorker("prefill-0", [_src(), _src(local=700)])],
                          [CannedWorker("decode-0", [_src(), _src(external=700)])],
                          [smg(), smg(prefill=4, decode=4)])
        p = proof.legs_traffic(c, OWN, FOREIGN)
    bodies = [b for _, _, b in srv.calls]
    assert len(bodies) == 4 == p.requests                  # 4 per leg of the larger role
    assert {b["model"] for b in bodies} == {"m"} and len({b["prompt"] for b in bodies}) == 4
    assert p.legs["decode-0"] == {"role": "decode",
                                  f"{SRC}{{source=external_kv_transfer}}": 700.0,
                                  f"{SRC}{{source=local_compute}}": 0.0}
    assert p.gateway["gateway_prefill_selections"] == 4 and p.gateway["gateway_fallback_pairs"] == 0
    assert p.gateway["selection_series"]["after"] == {
        "connection_mode=http,model=m,policy=round_robin,worker_type=prefill": 4.0,
        "connection_mode=http,model=m,policy=round_robin,worker_type=decode": 4.0}


def test_legs_traffic_fails_naming_the_idle_leg_and_the_gateways_short_count(monkeypatch):
    slept = []
    monkeypatch.setattr(proof.time, "sleep", slept.append)
    with serve(_completions()) as srv:
        c = _legs_cluster(srv.url, [CannedWorker("prefill-0", [_src(), _src(local=700)]),
                                    CannedWorker("prefill-1", [_src(), _src()])],
                          [CannedWorker("decode-0", [_src(), _src(external=700)])],
                          [smg(), smg(prefill=8, decode=7, transfer=1), smg(decode=8)])
        with pytest.raises(HarnessError) as e:
            proof.legs_traffic(c, OWN, FOREIGN)
    msg = str(e.value)
    assert msg.startswith(
        "PD legs (8 requests) failed on 1p1d: the gateway picked prefill 8 and decode 7 times "
        "for 8 requests; the gateway counted 1 bootstrap/transfer failures; prefill-1 "
        f"(prefill) took no traffic: {SRC}{{source=local_compute}} did not move (")
    assert slept == [1.0] and len(srv.calls) == 8
    assert "'selections_1s_later': {'prefill': 0.0, 'decode': 8.0}" in msg


def test_legs_traffic_with_n_and_roles_given_and_without_roles():
    with serve(_completions()) as srv:
        w = CannedWorker("worker-0", [_src(), _src(), _src(local=9), _src(local=9)])
        c = _legs_cluster(srv.url, [], [], [smg(), smg(prefill=2, decode=2)])
        c.topology.kind = "regular"
        with pytest.raises(HarnessError) as e:
            proof.legs_traffic(c, OWN, FOREIGN, n=2, roles={"prefill": [w], "decode": [w]},
                               body=lambda i: {"prompt": str(i)})
        assert [b for _, _, b in srv.calls] == [{"prompt": "0"}, {"prompt": "1"}]
        assert "worker-0 (decode) acted as another role" in str(e.value)
        assert "PD legs (2 requests) failed" in str(e.value)
        with pytest.raises(HarnessError, match="^topology 1p1d has no prefill/decode roles$"):
            proof.legs_traffic(_legs_cluster(srv.url, [w], [], []), OWN, FOREIGN)


# -- the small pieces the proofs are built from ------------------------------------------------

@pytest.mark.parametrize("argv, want", [
    ([], None), (["--dtype"], None), (["--foo", "bar"], None), (["--dtype", "half"], "half"),
    (["--dtype=float16"], "float16"), (["--dtype=a=b"], "a=b"),
    (["--dtype", "half", "--dtype=float32"], "float32"), (["--dtype-x=1"], None),
])
def test_argv_value_takes_the_last_value_as_argparse_does(argv, want):
    assert proof._argv_value(argv, "--dtype") == want


@pytest.mark.parametrize("cache, argv, config, want", [
    ("fp8", ["--dtype", "half"], {}, "fp8"),
    ("auto", ["--dtype", "half"], {}, "half"),
    (None, ["--dtype", "auto"], {"torch_dtype": "float32"}, "float32"),
    (None, [], {"text_config": {"torch_dtype": "torch.float16"}}, "float16"),
    (None, [], {"torch_dtype": "bfloat16", "text_config": {"torch_dtype": "float16"}},
     "bfloat16"),
    (None, [], {"dtype": "float16"}, "float16"),
    (None, [], {"text_config": {}}, "bfloat16"),
])
def test_kv_dtype_order(cache, argv, config, want):
    assert proof.kv_dtype(cache, argv, config) == want


def test_head_dim_from_a_hidden_size_that_heads_do_not_divide_is_whole():
    per_token, layout = proof.kv_bytes_per_token(
        {"num_hidden_layers": 1, "num_attention_heads": 3, "hidden_size": 100}, "fp8")
    assert layout["head_dim"] == 33 and isinstance(per_token, int) and per_token == 2 * 3 * 33


def test_labels_and_legs():
    assert proof.leg("c") == ("c", {}) and proof.leg("c", {"a": 1}) == ("c", {"a": 1})
    assert proof._label(("c", {})) == "c"
    assert proof._label(("c", {"b": 2, "a": 1})) == "c{a=1,b=2}"


def test_one_worker_read_as_both_roles_is_named_by_role_and_one_count_is_traffic():
    own = {"prefill": [proof.leg(SRC, {"source": "local_compute"})],
           "decode": [proof.leg(SRC, {"source": "external_kv_transfer"})]}
    b = {(SRC, (("source", "local_compute"),)): 0.0,
         (SRC, (("source", "external_kv_transfer"),)): 0.0}
    a = {(SRC, (("source", "local_compute"),)): 1.0,
         (SRC, (("source", "external_kv_transfer"),)): 1.0}
    legs, problems = proof.legs_problems([("w", "prefill"), ("w", "decode")], [b, b], [a, a],
                                         own, {})
    assert problems == [] and sorted(legs) == ["w as decode", "w as prefill"]


def test_long_unique_prompt():
    a, b = proof.long_unique_prompt(seed=3), proof.long_unique_prompt(seed=3)
    head, body = a.split("] ", 1)
    assert head.startswith("[") and a != b and body == b.split("] ", 1)[1]
    words = body.split("\n")[0].split(" ")
    assert len(words) == 300 and set(words) <= set(proof.WORDS)
    assert body.endswith("\nIn one sentence, what is this list about?")
    assert proof.long_unique_prompt(5, seed=1) != proof.long_unique_prompt(5, seed=2)


def test_image_chat_body():
    assert proof.image_chat_body("m", "t", "data:x") == {
        "model": "m", "max_tokens": 8, "temperature": 0,
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "t"},
            {"type": "image_url", "image_url": {"url": "data:x"}}]}]}


def test_random_png_is_256_square_of_every_value():
    import base64
    import io

    import numpy as np
    from PIL import Image
    uri = proof.random_png_data_uri(4)
    assert uri == proof.random_png_data_uri(4) and uri.startswith("data:image/png;base64,")
    img = np.asarray(Image.open(io.BytesIO(base64.b64decode(uri.split(",", 1)[1]))))
    assert img.shape == (256, 256, 3) and img.min() == 0 and img.max() == 255


def test_post_all_straight_to_a_url_with_the_clients_timeout(monkeypatch):
    seen = []
    real = httpx.post

    def spy_post(url, **kw):
        seen.append(kw["timeout"])
        return real(url, **kw)
    monkeypatch.setattr(proof.httpx, "post", spy_post)
    with serve(_completions({1: (200, {"choices": [{"text": "x"}]}),
                             2: (503, "b" * 300)})) as srv:
        c = _cluster("http://127.0.0.1:9")           # the client's gateway is not there
        assert proof.post_all(c, "PD", "/v1/completions", [{}, {}], url=srv.url) == [
            {"prompt_tokens": 10}, {}]
        with pytest.raises(HarnessError) as e:
            proof.post_all(c, "PD", "/v1/completions", [{}], url=srv.url)
    assert seen == [httpx.Timeout(7.0)] * 3
    assert str(e.value) == "PD request 0: HTTP 503 " + "b" * 200
    with serve(_completions({0: (200, {"choices": [], "x": "y" * 300})})) as srv, \
            pytest.raises(HarnessError) as e:
        proof.post_all(_cluster(srv.url), "PD", "/v1/completions", [{}])
    assert len(str(e.value)) == len("PD request 0: no choices in ") + 200


def test_legs_traffic_default_prompts_and_its_failure_names_pd_legs(monkeypatch):
    monkeypatch.setattr(proof.time, "sleep", lambda s: None)
    with serve(_completions({0: (500, "down")})) as srv:
        c = _legs_cluster(srv.url, [CannedWorker("prefill-0", [_src(), _src(local=1)])],
                          [CannedWorker("decode-0", [_src(), _src(external=1)])],
                          [smg(), smg(prefill=4, decode=4)])
        with pytest.raises(HarnessError, match="^PD legs request 0: HTTP 500 down$"):
            proof.legs_traffic(c, OWN, FOREIGN)
    (body,) = [b for _, _, b in srv.calls]
    assert {k: v for k, v in body.items() if k != "prompt"} == {
        "model": "m", "max_tokens": 4, "temperature": 0}
    words = body["prompt"].split("] ", 1)[1]
    assert words == proof.long_unique_prompt(120, seed=1000).split("] ", 1)[1]
    with serve(_completions()) as srv:
        c = _legs_cluster(srv.url, [CannedWorker("prefill-0", [_src(), _src(local=1)])],
                          [CannedWorker("decode-0", [_src(), _src(external=1)])],
                          [smg(prefill=1, decode=1), smg(prefill=5, decode=5)])
        p = proof.legs_traffic(c, OWN, FOREIGN)
    assert p.gateway["selection_series"]["before"] == {
        "connection_mode=http,model=m,policy=round_robin,worker_type=prefill": 1.0,
        "connection_mode=http,model=m,policy=round_robin,worker_type=decode": 1.0}
    second = [b for _, _, b in srv.calls][1]["prompt"].split("] ", 1)[1]
    assert second == proof.long_unique_prompt(120, seed=1001).split("] ", 1)[1]
