"""smg gateway argv builder and worker registration bodies (no gateway is started).

Each argv is also fed to smg's own argument parser (pure Python, nothing is launched) to check
that smg reads it the way the harness means it.
"""

import sys

import pytest

from e2e_test.infra.cluster.gateway import (
    Admission,
    GatewayConfig,
    GatewayWorker,
    build_argv,
    pinned,
)
from e2e_test.infra.errors import ConfigError

HEAD = [sys.executable, "-m", "smg", "launch", "--host", "127.0.0.1", "--port", "30000",
        "--prometheus-host", "127.0.0.1", "--prometheus-port", "30001", "--log-level", "info",
        "--shutdown-grace-period-secs", "1"]


def cfg(kind, *workers, **kw):
    return GatewayConfig(kind=kind, workers=tuple(workers), port=30000, prometheus_port=30001,
                         **kw)


def smg_reads(argv: list[str]):
    """What smg makes of our argv (its parser only; nothing starts)."""
    launch_router = pytest.importorskip("smg.launch_router")
    assert argv[:4] == [sys.executable, "-m", "smg", "launch"]
    return launch_router.parse_router_args(argv[4:])


def test_regular():
    argv = build_argv(cfg("regular", GatewayWorker("http://127.0.0.1:20001"),
                          GatewayWorker("http://127.0.0.1:20002")))
    assert argv == HEAD + ["--worker-urls", "http://127.0.0.1:20001", "http://127.0.0.1:20002",
                           "--policy", "round_robin"]
    a = smg_reads(argv)
    assert (a.host, a.port, a.prometheus_host, a.prometheus_port) == (
        "127.0.0.1", 30000, "127.0.0.1", 30001)
    assert a.worker_urls == ["http://127.0.0.1:20001", "http://127.0.0.1:20002"]
    assert (a.policy, a.pd_disaggregation, a.dp_aware) == ("round_robin", False, False)
    # smg's drain settle is min(5, grace / 2) s: 1 makes it 0 (docs/lifecycle.md, the stop).
    assert a.shutdown_grace_period_secs == 1


def test_dp_aware_with_policy():
    argv = build_argv(cfg("dp", GatewayWorker("http://127.0.0.1:20001"), dp_aware=True,
                          policy="cache_aware"))
    assert argv == HEAD + ["--worker-urls", "http://127.0.0.1:20001", "--policy", "cache_aware",
                           "--dp-aware"]
    a = smg_reads(argv)
    assert (a.worker_urls, a.policy, a.dp_aware) == (["http://127.0.0.1:20001"], "cache_aware",
                                                     True)


def test_pd_dynamic_nixl_workers():
    p = GatewayWorker("http://127.0.0.1:21000", "prefill", kv_connector="NixlConnector")
    d = GatewayWorker("http://127.0.0.1:21002", "decode", kv_connector="NixlConnector")
    assert p.register_dynamically and d.register_dynamically
    argv = build_argv(cfg("pd", p, d))
    # NIXL workers come through POST /workers: static --prefill/--decode would make smg run
    # them in passthrough.
    assert argv == HEAD + ["--pd-disaggregation", "--prefill-policy", "round_robin",
                           "--decode-policy", "round_robin"]
    assert "--prefill" not in argv and "--decode" not in argv and "--worker-urls" not in argv
    a = smg_reads(argv)
    assert a.pd_disaggregation and a.prefill_urls == [] and a.decode_urls == []


def test_pd_static_workers_with_bootstrap_port():
    workers = (GatewayWorker("grpc://127.0.0.1:31000", "prefill", bootstrap_port=31001,
                             runtime_type="tokenspeed"),
               GatewayWorker("grpc://127.0.0.1:31010", "prefill", bootstrap_port=31011,
                             runtime_type="tokenspeed"),
               GatewayWorker("grpc://127.0.0.1:32000", "decode", runtime_type="tokenspeed"))
    assert not any(w.register_dynamically for w in workers)
    assert cfg("pd", *workers).dynamic() == []      # a PD worker answers smg's shallow probe
    argv = build_argv(cfg("pd", *workers))
    assert argv == HEAD + ["--pd-disaggregation",
                           "--prefill", "grpc://127.0.0.1:31000", "31001",
                           "--prefill", "grpc://127.0.0.1:31010", "31011",
                           "--decode", "grpc://127.0.0.1:32000",
                           "--prefill-policy", "round_robin", "--decode-policy", "round_robin"]
    a = smg_reads(argv)
    assert a.prefill_urls == [("grpc://127.0.0.1:31000", 31001),
                              ("grpc://127.0.0.1:31010", 31011)]
    assert a.decode_urls == ["grpc://127.0.0.1:32000"]


def test_pd_static_prefill_without_bootstrap_port():
    argv = build_argv(cfg("pd", GatewayWorker("http://127.0.0.1:1", "prefill"),
                          GatewayWorker("http://127.0.0.1:2", "decode")))
    assert argv[len(HEAD):] == ["--pd-disaggregation", "--prefill", "http://127.0.0.1:1",
                                "--decode", "http://127.0.0.1:2",
                                "--prefill-policy", "round_robin",
                                "--decode-policy", "round_robin"]
    assert smg_reads(argv).prefill_urls == [("http://127.0.0.1:1", None)]


def test_epd():
    argv = build_argv(cfg("epd",
                          GatewayWorker("grpc://127.0.0.1:33000", "encode", bootstrap_port=33001),
                          GatewayWorker("grpc://127.0.0.1:33010", "prefill", bootstrap_port=33011),
                          GatewayWorker("grpc://127.0.0.1:33020", "decode")))
    assert argv == HEAD + ["--epd-disaggregation",
                           "--encode", "grpc://127.0.0.1:33000", "33001",
                           "--prefill", "grpc://127.0.0.1:33010", "33011",
                           "--decode", "grpc://127.0.0.1:33020",
                           "--prefill-policy", "round_robin", "--decode-policy", "round_robin"]
    assert "--pd-disaggregation" not in argv
    a = smg_reads(argv)
    assert a.epd_disaggregation and not a.pd_disaggregation
    assert a.encode_urls == [("grpc://127.0.0.1:33000", 33001)]
    assert a.prefill_urls == [("grpc://127.0.0.1:33010", 33011)]
    assert a.decode_urls == ["grpc://127.0.0.1:33020"]


def test_afd_attention_is_the_only_worker():
    argv = build_argv(cfg("afd", GatewayWorker("http://127.0.0.1:22000")))
    assert argv == HEAD + ["--worker-urls", "http://127.0.0.1:22000", "--policy", "round_robin"]


def test_admission_and_extra_args():
    adm = Admission(max_concurrent_requests=4, queue_size=8, queue_timeout_secs=5.0)
    assert adm.args() == ["--max-concurrent-requests", "4", "--queue-size", "8",
                          "--queue-timeout-secs", "5"]
    argv = build_argv(cfg("regular", GatewayWorker("http://127.0.0.1:1"), admission=adm,
                          extra_args=("--request-timeout-secs", "60")))
    assert argv == HEAD + ["--worker-urls", "http://127.0.0.1:1", "--policy", "round_robin",
                           "--max-concurrent-requests", "4", "--queue-size", "8",
                           "--queue-timeout-secs", "5", "--request-timeout-secs", "60"]
    a = smg_reads(argv)
    assert (a.max_concurrent_requests, a.queue_size, a.queue_timeout_secs) == (4, 8, 5)
    assert Admission(2).args() == ["--max-concurrent-requests", "2", "--queue-size", "0",
                                   "--queue-timeout-secs", "5"]


def test_admission_timeout_must_be_whole_seconds():
    # smg parses --queue-timeout-secs as an int; "0.5" would make it exit at startup.
    with pytest.raises(ConfigError, match="whole number of seconds"):
        Admission(4, queue_timeout_secs=0.5)
    assert Admission(4, queue_timeout_secs=2).args()[-1] == "2"


def test_registration_body():
    nixl = GatewayWorker("http://127.0.0.1:21000", "prefill", kv_connector="NixlConnector")
    assert nixl.registration() == {"url": "http://127.0.0.1:21000", "worker_type": "prefill",
                                   "runtime_type": "vllm", "kv_connector": "NixlConnector"}
    ts = GatewayWorker("grpc://127.0.0.1:31000", "prefill", bootstrap_port=31001,
                       runtime_type="tokenspeed")
    assert ts.registration() == {"url": "grpc://127.0.0.1:31000", "worker_type": "prefill",
                                 "runtime_type": "tokenspeed", "bootstrap_port": 31001}
    assert GatewayWorker("http://127.0.0.1:1").registration() == {
        "url": "http://127.0.0.1:1", "worker_type": "regular", "runtime_type": "vllm"}
    assert not GatewayWorker("http://127.0.0.1:1").register_dynamically


def test_grpc_workers_get_the_model_path_for_smg_tokenizer():
    # smg tokenizes for gRPC workers: it needs the local model folder; HTTP workers do not.
    argv = build_argv(cfg("dp", GatewayWorker("grpc://127.0.0.1:20001",
                                              runtime_type="tokenspeed"),
                          model_path="/models/smol"))
    assert argv == HEAD + ["--model-path", "/models/smol", "--worker-urls",
                           "grpc://127.0.0.1:20001", "--policy", "round_robin"]
    a = smg_reads(argv)
    assert a.model_path == "/models/smol" and a.worker_urls == ["grpc://127.0.0.1:20001"]
    epd = build_argv(cfg("epd", GatewayWorker("grpc://127.0.0.1:1", "encode", bootstrap_port=2),
                         GatewayWorker("grpc://127.0.0.1:3", "prefill", bootstrap_port=4),
                         GatewayWorker("grpc://127.0.0.1:5", "decode"), model_path="/m"))
    assert epd[len(HEAD):len(HEAD) + 3] == ["--model-path", "/m", "--epd-disaggregation"]
    http = build_argv(cfg("regular", GatewayWorker("http://127.0.0.1:1"), model_path="/m"))
    assert "--model-path" not in http


def test_grpc_workers_of_a_regular_gateway_stay_on_the_command_line():
    """Registered through POST /workers with runtime_type, a TokenSpeed `1` worker is listed
    by smg but never served (404 model_not_found): a regular smg started
    with no worker URL builds its HTTP router. A regular gateway keeps its gRPC workers on
    --worker-urls; only kv_connector workers register."""
    a = GatewayWorker("grpc://127.0.0.1:20001", runtime_type="tokenspeed")
    c = cfg("regular", a, model_path="/models/smol")
    assert c.dynamic() == []
    assert build_argv(c) == HEAD + ["--model-path", "/models/smol", "--worker-urls",
                                    "grpc://127.0.0.1:20001", "--policy", "round_robin"]
    nixl = GatewayWorker("http://127.0.0.1:21000", "prefill", kv_connector="NixlConnector")
    assert cfg("pd", nixl, GatewayWorker("http://127.0.0.1:2", "decode")).dynamic() == [nixl]


def test_pinned_is_the_same_gateway_before_one_grpc_worker():
    """A gateway pinned to one worker (Cluster.pinned) keeps its worker's protocol: a gRPC
    worker stays grpc:// on --worker-urls, smg gets the model path to tokenize for it, and a
    disaggregated leg is served as a regular worker (no --prefill, no bootstrap port)."""
    legs = (GatewayWorker("grpc://127.0.0.1:31000", "prefill", bootstrap_port=31001,
                          runtime_type="tokenspeed"),
            GatewayWorker("grpc://127.0.0.1:32000", "decode", runtime_type="tokenspeed"))
    pd = cfg("pd", *legs, model_path="/models/smol", extra_args=("--request-timeout-secs", "60"))
    one = pinned(pd, "grpc://127.0.0.1:31000")
    assert one.workers == (GatewayWorker("grpc://127.0.0.1:31000", runtime_type="tokenspeed"),)
    assert one.dynamic() == []
    argv = build_argv(one)
    assert argv == HEAD + ["--model-path", "/models/smol", "--worker-urls",
                           "grpc://127.0.0.1:31000", "--policy", "round_robin",
                           "--request-timeout-secs", "60"]
    a = smg_reads(argv)
    assert a.worker_urls == ["grpc://127.0.0.1:31000"] and not a.pd_disaggregation
    assert a.model_path == "/models/smol" and a.prefill_urls == [] and a.decode_urls == []
    dp = cfg("dp", GatewayWorker("grpc://127.0.0.1:20001", runtime_type="tokenspeed"),
             GatewayWorker("grpc://127.0.0.1:20002", runtime_type="tokenspeed"),
             model_path="/m", policy="cache_aware")
    assert build_argv(pinned(dp, "grpc://127.0.0.1:20002"))[len(HEAD):] == [
        "--model-path", "/m", "--worker-urls", "grpc://127.0.0.1:20002",
        "--policy", "cache_aware"]


def test_pinned_http_worker_drops_its_kv_connector():
    """A vLLM NIXL leg pinned: on the command line as a plain worker, not POSTed with its
    kv_connector (it serves a plain request itself); an HTTP worker gets no model path."""
    p = GatewayWorker("http://127.0.0.1:21000", "prefill", kv_connector="NixlConnector")
    d = GatewayWorker("http://127.0.0.1:21002", "decode", kv_connector="NixlConnector")
    one = pinned(cfg("pd", p, d, model_path="/m"), p.url)
    assert one.dynamic() == []
    assert build_argv(one)[len(HEAD):] == ["--worker-urls", "http://127.0.0.1:21000",
                                           "--policy", "round_robin"]


def test_pinned_to_a_worker_the_gateway_lacks_is_a_config_error():
    c = cfg("dp", GatewayWorker("http://127.0.0.1:1"), GatewayWorker("http://127.0.0.1:2"))
    with pytest.raises(ConfigError, match=r"no worker http://127.0.0.1:3 behind this gateway "
                                          r"\(workers: http://127.0.0.1:1, http://127.0.0.1:2\)"):
        pinned(c, "http://127.0.0.1:3")
