"""Proof that disaggregation really moved data, from structured signals (Prometheus), not logs.

PD (vLLM): for long, unique prompts sent through the gateway, exactly (`vllm_transfer_problems`):
the decode workers' counter `vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}`
grows by the prompt tokens and `local_compute` by 0 (decode recomputed nothing), the prefill
workers computed every prompt token, and over NIXL the decode received the bytes of every
block that holds a prompt token, the last partial block included: sum_i ceil(p_i / B) blocks
x B tokens x the KV bytes of one token (layers x K,V x KV heads x head dim x dtype bytes, from
the model's config.json; B from the worker's `vllm:cache_config_info`). The H200 records fit
this and nothing less: 1438 prompt tokens in 4 requests moved 33,914,880 B = 92 blocks x 16 x
23,040 B (SmolLM2-135M: 30 x 2 x 3 x 64 x 2 B), where full blocks alone are at most 89. A
run that answers 200 without the transfer fails.
"""

from __future__ import annotations

import json
import math
import random
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from . import metrics
from .errors import HarnessError

SRC = "vllm:prompt_tokens_by_source_total"
WORDS = ("river stone lantern orbit maple copper violet harbor meadow signal quartz ember "
         "falcon tundra velvet canyon").split()


@dataclass
class TransferProof:
    requests: int
    prompt_tokens: int
    decode_external: float
    decode_local_compute: float
    decode_local_cache_hit: float
    prefill_local_compute: float
    nixl_bytes: float
    nixl_transfers: float
    failed_transfers: float
    prompt_tokens_each: list = field(default_factory=list)   # per request, from its usage
    nixl: bool = True                   # the workers' connector is NIXL (bytes are counted)
    block_size: int | None = None       # tokens per KV block (the decode's cache_config_info)
    kv_bytes_per_token: int | None = None   # from config.json and the KV dtype
    kv_layout: dict = field(default_factory=dict)   # what kv_bytes_per_token came from
    tp: int = 1                         # decode tensor parallel size

    @property
    def external_fraction(self) -> float:
        return self.decode_external / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def expected_blocks(self) -> int | None:
        if not self.block_size or not self.prompt_tokens_each:
            return None
        return sum(math.ceil(p / self.block_size) for p in self.prompt_tokens_each)

    @property
    def expected_bytes(self) -> int | None:
        if self.expected_blocks is None or not self.kv_bytes_per_token:
            return None
        return self.expected_blocks * self.block_size * self.kv_bytes_per_token

    def to_dict(self) -> dict:
        return {**asdict(self), "external_fraction": round(self.external_fraction, 4),
                "expected_blocks": self.expected_blocks, "expected_bytes": self.expected_bytes}


DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4,
               "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "fp8_inc": 1}


def kv_bytes_per_token(config: dict, dtype: str) -> tuple[int, dict]:
    """The KV cache bytes of one token of a decoder-only model: layers x (K, V) x KV heads x
    head dim x dtype bytes, from its config.json (`text_config` for a multimodal one). Pure."""
    c = config.get("text_config") or config
    heads = c["num_attention_heads"]
    layout = {"num_hidden_layers": c["num_hidden_layers"],
              "num_key_value_heads": c.get("num_key_value_heads") or heads,
              "head_dim": c.get("head_dim") or c["hidden_size"] // heads,
              "dtype": dtype}
    if dtype not in DTYPE_BYTES:
        raise HarnessError(f"KV dtype {dtype!r}: its size is unknown (known: "
                           f"{', '.join(DTYPE_BYTES)})")
    layout["dtype_bytes"] = DTYPE_BYTES[dtype]
    return (layout["num_hidden_layers"] * 2 * layout["num_key_value_heads"]
            * layout["head_dim"] * layout["dtype_bytes"]), layout


def cache_config(samples: dict) -> dict:
    """The labels of vLLM's `vllm:cache_config_info` gauge (block_size, cache_dtype, ...)."""
    for name, labels in samples:
        if name == "vllm:cache_config_info":
            return dict(labels)
    return {}


def _argv_value(argv: list[str], flag: str) -> str | None:
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def kv_dtype(cache_dtype: str | None, argv: list[str], config: dict) -> str:
    """The KV cache's dtype: the cache's own when set, else the model's (--dtype, else
    config.json's torch_dtype)."""
    if cache_dtype and cache_dtype != "auto":
        return cache_dtype
    d = _argv_value(argv, "--dtype")
    if d and d != "auto":
        return d
    c = config.get("text_config") or config
    return str(config.get("torch_dtype") or c.get("torch_dtype") or config.get("dtype")
               or "bfloat16").replace("torch.", "")


def vllm_transfer_problems(p: TransferProof) -> list[str]:
    """What the numbers of a vLLM PD proof show that an exact transfer would not. Pure
    (tests/test_proof_exact.py holds it against the recorded H200 figures)."""
    problems = []
    if p.prompt_tokens <= 0 or p.requests <= 0:
        return [(f"no prompt tokens sent ({p.requests} requests, {p.prompt_tokens} tokens): "
                 "nothing was proved")]
    if p.prompt_tokens_each and sum(p.prompt_tokens_each) != p.prompt_tokens:
        problems.append(f"the requests' prompt tokens {p.prompt_tokens_each} do not add up to "
                        f"{p.prompt_tokens}")
    if p.decode_external != p.prompt_tokens:
        problems.append(f"decode received KV for {p.decode_external:.0f} of {p.prompt_tokens} "
                        "prompt tokens")
    if p.decode_local_compute:
        problems.append(f"decode recomputed {p.decode_local_compute:.0f} prompt tokens")
    if p.prefill_local_compute != p.prompt_tokens:
        problems.append(f"prefill computed {p.prefill_local_compute:.0f} of {p.prompt_tokens} "
                        "prompt tokens")
    if p.failed_transfers:
        problems.append(f"{p.failed_transfers:.0f} failed KV transfers")
    if not p.nixl:
        return problems
    if p.tp == 1 and p.nixl_transfers != p.requests:
        problems.append(f"{p.nixl_transfers:.0f} NIXL transfers for {p.requests} requests")
    if not p.block_size or not p.kv_bytes_per_token or not p.prompt_tokens_each:
        problems.append("the bytes cannot be checked: block size "
                        f"{p.block_size}, KV bytes per token {p.kv_bytes_per_token}, "
                        f"per-request prompt tokens {p.prompt_tokens_each or 'unknown'}")
    elif p.nixl_bytes != p.expected_bytes:
        got = p.nixl_bytes / (p.block_size * p.kv_bytes_per_token)
        problems.append(f"NIXL moved {p.nixl_bytes:.0f} B ({got:g} blocks), expected "
                        f"{p.expected_bytes} B = {p.expected_blocks} blocks (every block "
                        f"holding a prompt token) x {p.block_size} tokens x "
                        f"{p.kv_bytes_per_token} B per token")
    return problems


def blocks_range(total_tokens: int, requests: int, block_size: int) -> tuple[int, int]:
    """The block counts sum_i ceil(p_i / B) that `requests` prompts of `total_tokens` in all
    can make (each p_i >= 1): what a record that kept only the total allows. Pure."""
    lo = math.ceil(total_tokens / block_size)
    hi = (total_tokens + requests * (block_size - 1)) // block_size
    return lo, min(hi, total_tokens)


def long_unique_prompt(words: int = 300, seed: int | None = None) -> str:
    rnd = random.Random(seed)
    body = " ".join(rnd.choice(WORDS) for _ in range(words))
    return f"[{uuid.uuid4().hex}] {body}\nIn one sentence, what is this list about?"


def _scrape_all(workers) -> list[dict]:
    return [w.metrics() for w in workers]


def _sum_delta(before: list[dict], after: list[dict], name: str, **labels) -> float:
    return sum(metrics.delta(b, a, name, **labels) for b, a in zip(before, after))


def _post_all(cluster, what: str, path: str, bodies, url: str | None = None) -> list[dict]:
    """POST each body through the gateway (or straight to `url`); any non-200 or empty answer
    fails the proof. Returns each answer's usage."""
    usages = []
    for i, body in enumerate(bodies):
        r = (cluster.client.post(path, json=body) if url is None
             else httpx.post(url + path, json=body, timeout=cluster.client.timeout))
        if r.status_code != 200:
            raise HarnessError(f"{what} request {i}: HTTP {r.status_code} {r.text[:200]}")
        if not r.json().get("choices"):
            raise HarnessError(f"{what} request {i}: no choices in {r.text[:200]}")
        usages.append(r.json().get("usage", {}))
    return usages


def _verdict(what: str, cluster, problems: list[str], proof):
    if problems:
        raise HarnessError(f"{what} failed on {cluster.topology.name}: "
                           + "; ".join(problems) + f" ({proof.to_dict()})")
    return proof


def pd_transfer(cluster, n: int = 4, via: str | None = None) -> TransferProof:
    """The vLLM PD proof over `n` fresh prompts through the gateway. `via`: send them
    straight to this URL instead (the proof's negative control: asked of the decode worker
    itself, nothing is transferred, and the proof must fail)."""
    decode, prefill = cluster.role("decode"), cluster.role("prefill")
    if not decode or not prefill:
        raise HarnessError(f"topology {cluster.topology.name} has no prefill/decode roles")
    b_d, b_p = _scrape_all(decode), _scrape_all(prefill)
    each = [u["prompt_tokens"] for u in _post_all(
        cluster, "PD proof", "/v1/completions",
        ({"model": cluster.model_name, "prompt": long_unique_prompt(seed=i), "max_tokens": 8,
          "temperature": 0} for i in range(n)), url=via)]
    a_d, a_p = _scrape_all(decode), _scrape_all(prefill)
    nixl = all(w.command.kv_connector == "NixlConnector" for w in decode + prefill)
    cache = cache_config(a_d[0]) if a_d else {}
    block = int(cache["block_size"]) if str(cache.get("block_size", "")).isdigit() else None
    per_token, layout = None, {}
    config_file = Path(str(getattr(cluster, "model_path", ""))) / "config.json"
    if config_file.is_file():
        config = json.loads(config_file.read_text())
        per_token, layout = kv_bytes_per_token(
            config, kv_dtype(cache.get("cache_dtype"), decode[0].command.argv, config))
    proof = TransferProof(
        requests=n, prompt_tokens=sum(each),
        decode_external=_sum_delta(b_d, a_d, SRC, source="external_kv_transfer"),
        decode_local_compute=_sum_delta(b_d, a_d, SRC, source="local_compute"),
        decode_local_cache_hit=_sum_delta(b_d, a_d, SRC, source="local_cache_hit"),
        prefill_local_compute=_sum_delta(b_p, a_p, SRC, source="local_compute"),
        nixl_bytes=_sum_delta(b_d, a_d, "vllm:nixl_bytes_transferred_sum"),
        nixl_transfers=_sum_delta(b_d, a_d, "vllm:nixl_bytes_transferred_count"),
        failed_transfers=_sum_delta(b_d, a_d, "vllm:nixl_num_failed_transfers_total"),
        prompt_tokens_each=each, nixl=nixl, block_size=block, kv_bytes_per_token=per_token,
        kv_layout=layout, tp=decode[0].entry.tp,
    )
    return _verdict("PD transfer proof", cluster, vllm_transfer_problems(proof), proof)


# -- PD on TokenSpeed -------------------------------------------------------------------------
#
# TokenSpeed's servicer serves no /metrics; with --enable-metrics its engine writes Prometheus
# multiprocess files (the builder points PROMETHEUS_MULTIPROC_DIR at the cluster's state
# folder; Worker.metrics reads them). Its 0.1.0 KV-transfer metrics are no-ops
# (runtime/metrics/collector.py KVTransferMetrics), so the proof combines:
# - the gateway sent every request to a prefill AND a decode worker
#   (smg_worker_selection_total{worker_type=...}) and counted no bootstrap / KV-transfer
#   failure (smg_pd_bootstrap_failures_total, smg_pd_kv_transfer_failures_total);
# - the prefill workers ran the prompts forward (tokenspeed:iteration_tokens_total_sum, the
#   tokens of every scheduler forward step);
# - the decode workers finished every request successfully (tokenspeed:request_success) and
#   generated its tokens. A TokenSpeed decode node cannot recompute a prompt: its extend step
#   only posts the KV receive and returns without a forward pass, and a request whose transfer
#   fails or times out is aborted ("PD/EPD remote transfer failed or timed out"), not served
#   (tokenspeed runtime/engine/event_loop.py, DisaggDecodeExecutor branch and the
#   FailedEvent handling). So a successful decode-side finish means the KV arrived.

TS_PREFIX = "tokenspeed:"


def _gateway_dispatch(before: dict, after: dict) -> dict:
    """smg's per-role worker selections and its PD/EPD failure counters, as deltas."""
    sel = "smg_worker_selection_total"
    return {**{f"gateway_{role}_selections": metrics.delta(before, after, sel, worker_type=role)
               for role in ("encode", "prefill", "decode")},
            "gateway_transfer_failures": (
                metrics.delta(before, after, "smg_pd_bootstrap_failures_total")
                + metrics.delta(before, after, "smg_pd_kv_transfer_failures_total"))}


def _dispatch_problems(proof, n: int) -> list[str]:
    problems = []
    if proof.gateway_prefill_selections < n or proof.gateway_decode_selections < n:
        problems.append(f"the gateway picked prefill {proof.gateway_prefill_selections:.0f} and "
                        f"decode {proof.gateway_decode_selections:.0f} times for {n} requests")
    if proof.gateway_transfer_failures:
        problems.append(f"the gateway counted {proof.gateway_transfer_failures:.0f} bootstrap/"
                        "transfer failures")
    return problems


@dataclass
class TokenSpeedPDProof:
    requests: int
    prompt_tokens: int
    gateway_prefill_selections: float
    gateway_decode_selections: float
    gateway_transfer_failures: float
    prefill_forward_tokens: float
    prefill_finished: float
    decode_success: float
    decode_generation_tokens: float
    decode_prompt_tokens: float

    def to_dict(self) -> dict:
        return asdict(self)


def tokenspeed_transfer_problems(proof: TokenSpeedPDProof, n: int) -> list[str]:
    """Exact checks of a TokenSpeed PD proof. Pure (tests/test_proof_exact.py).

    - the prefill ran every prompt token forward, and at most one more token per request
      (the first token it samples): prompt_tokens <= prefill_forward_tokens <=
      prompt_tokens + n (H200 records: 1558 -> 1562 and 1560 -> 1564 for 4 requests);
    - the decode side counted the whole prompt of every request it finished
      (tokenspeed:prompt_tokens_total == the prompt tokens the gateway reported; records:
      1558/1558, 1560/1560): a decode that got a shorter or another request's prompt differs;
    - the decode finished every request and generated its tokens."""
    problems = _dispatch_problems(proof, n)
    pt = proof.prompt_tokens
    if pt <= 0:
        return problems + ["no prompt tokens sent: nothing was proved"]
    if not pt <= proof.prefill_forward_tokens <= pt + n:
        problems.append(f"prefill ran {proof.prefill_forward_tokens:.0f} tokens forward for "
                        f"{pt} prompt tokens in {n} requests (expected {pt} to {pt + n})")
    if proof.decode_prompt_tokens != pt:
        problems.append(f"decode counted {proof.decode_prompt_tokens:.0f} prompt tokens for "
                        f"the {pt} the prefill was sent")
    if proof.decode_success < n:
        problems.append(f"decode finished only {proof.decode_success:.0f} of {n} requests "
                        "successfully")
    if proof.decode_generation_tokens <= 0:
        problems.append("decode generated no tokens")
    return problems


def pd_transfer_tokenspeed(cluster, n: int = 4) -> TokenSpeedPDProof:
    decode, prefill = cluster.role("decode"), cluster.role("prefill")
    if not decode or not prefill:
        raise HarnessError(f"topology {cluster.topology.name} has no prefill/decode roles")
    b_d, b_p, b_g = _scrape_all(decode), _scrape_all(prefill), cluster.gateway_metrics()
    prompt_tokens = sum(u["prompt_tokens"] for u in _post_all(
        cluster, "PD proof", "/v1/chat/completions",
        ({"model": cluster.model_name, "max_tokens": 8, "temperature": 0,
          "messages": [{"role": "user", "content": long_unique_prompt(seed=i)}]}
         for i in range(n))))
    a_d, a_p, a_g = _scrape_all(decode), _scrape_all(prefill), cluster.gateway_metrics()
    gw = _gateway_dispatch(b_g, a_g)
    gw.pop("gateway_encode_selections")
    proof = TokenSpeedPDProof(
        requests=n, prompt_tokens=prompt_tokens, **gw,
        prefill_forward_tokens=_sum_delta(b_p, a_p, TS_PREFIX + "iteration_tokens_total_sum"),
        prefill_finished=_sum_delta(b_p, a_p, TS_PREFIX + "num_requests_total"),
        decode_success=_sum_delta(b_d, a_d, TS_PREFIX + "request_success_total"),
        decode_generation_tokens=_sum_delta(b_d, a_d, TS_PREFIX + "generation_tokens_total"),
        decode_prompt_tokens=_sum_delta(b_d, a_d, TS_PREFIX + "prompt_tokens_total"),
    )
    return _verdict("PD transfer proof (tokenspeed)", cluster,
                    tokenspeed_transfer_problems(proof, n), proof)


# -- EPD on TokenSpeed: the encoder ran for the request --------------------------------------
#
# TokenSpeed's encode worker exports no metric of its own. What shows that the vision encoder
# ran on the encode worker for a request, and its output reached prefill:
# - the gateway dispatched every image item to an encode worker
#   (smg_worker_selection_total{worker_type="encode"} grows by one per image item) and to a
#   prefill and a decode worker, with no bootstrap / transfer failure counted;
# - a prefill node in EPD mode cannot run the tower itself: an item handshaked to an encode
#   worker that reaches the prefill forward without its received embedding raises, and an
#   embedding receive that times out aborts the request (tokenspeed runtime/engine/
#   event_loop.py _assert_epd_embeddings_received; runtime/pd/prefill_executor.py "EPD:
#   prefill aborted request ... (embedding receive timed out)"), so a 200 answer means the
#   embeddings arrived from the encoder;
# - the decode workers finished every request (tokenspeed:request_success), as in PD.
# The builder sets TOKENSPEED_EPD_ENCODE_EMBED_CACHE_MB=0 on encode workers and every proof
# image is new, so no embedding comes from the encoder's cache. The encode worker's INFO line
# "EPD encode: accepted request_id=..." is counted too when its log has it (TokenSpeed may
# reconfigure logging and drop it), as corroboration only.

ENCODE_LOG_LINE = "EPD encode: accepted request_id="


def random_png_data_uri(seed: int, size: int = 256) -> str:
    """A PNG of random pixels (unique per seed) as a data: URI, for multimodal requests."""
    import base64
    import io

    import numpy as np
    from PIL import Image
    rng = np.random.default_rng(seed)
    img = Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def image_chat_body(model: str, text: str, image_uri: str, max_tokens: int = 8) -> dict:
    return {"model": model, "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": text},
                {"type": "image_url", "image_url": {"url": image_uri}}]}]}


@dataclass
class EncoderProof:
    requests: int
    image_items: int
    prompt_tokens: int
    gateway_encode_selections: float
    gateway_prefill_selections: float
    gateway_decode_selections: float
    gateway_transfer_failures: float
    prefill_forward_tokens: float
    decode_success: float
    encode_log_lines: int | None

    def to_dict(self) -> dict:
        return asdict(self)


def epd_encoder_ran(cluster, n: int = 3) -> EncoderProof:
    enc, prefill, decode = cluster.role("encode"), cluster.role("prefill"), cluster.role("decode")
    if not enc or not prefill or not decode:
        raise HarnessError(f"topology {cluster.topology.name} has no encode/prefill/decode roles")

    def enc_lines():
        try:
            return sum(w.process.log_text().count(ENCODE_LOG_LINE) for w in enc)
        except (OSError, AttributeError):   # no process or log yet
            return None
    b_g, b_p, b_d, b_l = (cluster.gateway_metrics(), _scrape_all(prefill), _scrape_all(decode),
                          enc_lines())
    salt = uuid.uuid4().int % 2**31
    prompt_tokens = sum(u["prompt_tokens"] for u in _post_all(
        cluster, "EPD proof", "/v1/chat/completions",
        (image_chat_body(cluster.model_name, f"[{uuid.uuid4().hex[:8]}] Describe the image.",
                         random_png_data_uri(salt + i)) for i in range(n))))
    a_g, a_p, a_d, a_l = (cluster.gateway_metrics(), _scrape_all(prefill), _scrape_all(decode),
                          enc_lines())
    proof = EncoderProof(
        requests=n, image_items=n, prompt_tokens=prompt_tokens, **_gateway_dispatch(b_g, a_g),
        prefill_forward_tokens=_sum_delta(b_p, a_p, TS_PREFIX + "iteration_tokens_total_sum"),
        decode_success=_sum_delta(b_d, a_d, TS_PREFIX + "request_success_total"),
        encode_log_lines=(a_l - b_l) if a_l is not None and b_l is not None else None,
    )
    problems = _dispatch_problems(proof, n)
    if proof.gateway_encode_selections < proof.image_items:
        problems.append(f"the gateway sent {proof.gateway_encode_selections:.0f} of "
                        f"{proof.image_items} image items to an encode worker")
    if proof.decode_success < n:
        problems.append(f"decode finished only {proof.decode_success:.0f} of {n} requests")
    return _verdict("EPD encoder proof", cluster, problems, proof)


# -- AFD: the FFN server really ran the FFN ----------------------------------------------------
#
# The afd-plugin exposes no Prometheus metric, counter or per-step log line on the FFN side
# (its FFN EngineCore runs a connector loop, no scheduler, so vLLM's own counters there stay at
# zero). The one per-step signal it has is its FFN profiler: afd_plugin/compat/profiler.py,
# configured by AFD_GPU_FFN_PROFILER_{ENABLE,WAIT,WARMUP,ACTIVE,REPEAT,SKIP_FIRST,DIR} and
# stepped at the top of every GPUFFNModelRunner.execute_model (afd_plugin/v1/worker/
# ffn_model_runner.py), which the FFN worker loop calls once per control-plane payload from
# Attention (afd_plugin/v1/worker/ffn_worker.py _run_ffn_server_loop), i.e. once per Attention
# forward step. With WAIT=every-2, WARMUP=1, ACTIVE=1, REPEAT=0 (unlimited) torch.profiler's
# TensorBoard handler writes one `<host>_<pid>.<ns>.pt.trace.json` per `every` FFN steps into
# DIR. The plugin's own GPU e2e test proves FFN execution the same way
# (tests/e2e/features/test_profiler_gpu.py: trace files must appear in the FFN dir).
# The cluster sets this env on every AFD FFN server (E2E_AFD_FFN_STEP_TRACE=0 turns it off).

FFN_STEP_TRACE_ENV = "E2E_AFD_FFN_STEP_TRACE"
FFN_PROFILER_PREFIX = "AFD_GPU_FFN_PROFILER"
FFN_TRACE_EVERY = 8
_TRACE_GLOB = "*.pt.trace.json*"


def ffn_step_trace_enabled(environ: dict | None = None) -> bool:
    from . import settings
    return bool(settings.get(FFN_STEP_TRACE_ENV, environ))


def afd_ffn_step_env(trace_dir, every: int = FFN_TRACE_EVERY) -> dict[str, str]:
    """The FFN server's env for one profiler trace per `every` FFN steps into `trace_dir`."""
    if every < 2:
        raise ValueError("every must be >= 2 (one warmup + one active step per cycle)")
    p = FFN_PROFILER_PREFIX
    return {f"{p}_ENABLE": "1", f"{p}_WAIT": str(every - 2), f"{p}_WARMUP": "1",
            f"{p}_ACTIVE": "1", f"{p}_REPEAT": "0", f"{p}_SKIP_FIRST": "0",
            f"{p}_DIR": str(trace_dir)}


@dataclass
class FfnProof:
    requests: int
    prompt_tokens: int
    completion_tokens: int
    trace_every: int
    traces_before: int
    traces_after: int
    new_traces_by_process: dict
    expected_min_new: int            # floor(steps / every) - 1 for these sequential requests
    kernel_events: int | None        # GPU kernels in the parsed new traces (None: none parsed)
    moe_kernel_events: int | None
    top_kernels: list
    attention_generation_tokens: float

    @property
    def new_traces(self) -> int:
        return self.traces_after - self.traces_before

    def to_dict(self) -> dict:
        return {**asdict(self), "new_traces": self.new_traces}


def _ffn_trace_dirs(cluster) -> list:
    from pathlib import Path
    return [Path(w.command.env[f"{FFN_PROFILER_PREFIX}_DIR"]) for w in cluster.role("ffn")
            if w.command.env.get(f"{FFN_PROFILER_PREFIX}_ENABLE") == "1"
            and w.command.env.get(f"{FFN_PROFILER_PREFIX}_DIR")]


def _traces(dirs) -> set:
    return {f for d in dirs if d.is_dir() for f in d.rglob(_TRACE_GLOB) if f.is_file()}


def _kernel_summary(files, limit: int = 3) -> tuple[int | None, int | None, list]:
    """Kernel events in (at most `limit` of) the new trace files: what the FFN GPU ran."""
    import gzip
    import json
    counts: dict[str, int] = {}
    parsed = 0
    for f in sorted(files, key=lambda p: p.stat().st_mtime)[:limit]:
        try:
            raw = gzip.decompress(f.read_bytes()) if f.suffix == ".gz" else f.read_bytes()
            events = json.loads(raw).get("traceEvents", [])
        except (OSError, ValueError):
            continue        # still being written
        parsed += 1
        for e in events:
            if isinstance(e, dict) and e.get("cat") == "kernel":
                counts[e.get("name", "?")] = counts.get(e.get("name", "?"), 0) + 1
    if not parsed:
        return None, None, []
    top = sorted(counts.items(), key=lambda kv: -kv[1])[:8]
    moe = sum(v for k, v in counts.items() if "moe" in k.lower())
    return sum(counts.values()), moe, [[k[:80], v] for k, v in top]


def afd_ffn_served(cluster, n: int = 4, max_tokens: int = 16, settle_s: float = 10.0,
                   every: int | None = None) -> FfnProof:
    """n sequential completions through the gateway must make the FFN server(s) step: the
    plugin's FFN step traces (see above) must grow. Raises HarnessError otherwise."""
    import time
    from pathlib import Path
    name = cluster.topology.name
    if cluster.topology.kind != "afd" or cluster.topology.native_baseline:
        raise HarnessError(f"topology {name} has no AFD FFN server: the FFN proof does not "
                           "apply")
    ffn = cluster.role("ffn")
    if not ffn:
        raise HarnessError(f"topology {name}: no FFN worker")
    dirs = _ffn_trace_dirs(cluster)
    if not dirs:
        raise HarnessError(f"topology {name}: the FFN servers were started without the "
                           f"plugin's step traces ({FFN_STEP_TRACE_ENV}=0?): nothing to "
                           "measure")
    if every is None:
        env = ffn[0].command.env
        every = (int(env.get(f"{FFN_PROFILER_PREFIX}_WAIT", FFN_TRACE_EVERY - 2))
                 + int(env.get(f"{FFN_PROFILER_PREFIX}_WARMUP", 1))
                 + int(env.get(f"{FFN_PROFILER_PREFIX}_ACTIVE", 1)))
    attention = cluster.role("attention")
    b_att = _scrape_all(attention)
    before = _traces(dirs)
    usages = _post_all(cluster, "AFD FFN proof", "/v1/completions",
                       ({"model": cluster.model_name,
                         "prompt": long_unique_prompt(words=40, seed=i),
                         "max_tokens": max_tokens, "temperature": 0} for i in range(n)))
    prompt_tokens = sum(u.get("prompt_tokens", 0) for u in usages)
    completion_tokens = sum(u.get("completion_tokens", 0) for u in usages)
    # Sequential requests: each is one prefill step plus completion_tokens - 1 decode steps,
    # one FFN step each. A trace is saved when the step after its active step starts.
    expected = max(1, completion_tokens // every - 1)
    deadline = time.monotonic() + settle_s
    after = _traces(dirs)
    while len(after - before) < expected and time.monotonic() < deadline:
        time.sleep(0.5)
        after = _traces(dirs)
    new = after - before
    by_proc: dict[str, int] = {}
    for f in new:
        base = Path(f).name.split(".pt.trace.json", 1)[0]   # <host>_<pid>.<ns>
        proc = base.rsplit(".", 1)[0]                        # <host>_<pid>
        by_proc[proc] = by_proc.get(proc, 0) + 1
    kernels, moe, top = _kernel_summary(new)
    a_att = _scrape_all(attention)
    proof = FfnProof(
        requests=n, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
        trace_every=every, traces_before=len(before), traces_after=len(before) + len(new),
        new_traces_by_process=by_proc, expected_min_new=expected, kernel_events=kernels,
        moe_kernel_events=moe, top_kernels=top,
        attention_generation_tokens=_sum_delta(b_att, a_att, "vllm:generation_tokens_total"))
    problems = afd_trace_problems(proof)
    if problems:
        raise HarnessError(f"AFD FFN proof failed on {name}: {n} completions "
                           f"({completion_tokens} tokens) through the gateway: "
                           + "; ".join(problems) + f" (in {', '.join(map(str, dirs))}) "
                           f"({proof.to_dict()})")
    return proof


def afd_trace_problems(p: FfnProof) -> list[str]:
    """The FFN server(s) must have written the step traces that the requests' steps make:
    at least `expected_min_new` (floor(steps / every) - 1: the last one may not be saved yet),
    not merely one; and a parsed trace must hold GPU kernels. Pure (H200 record: 64 tokens,
    one trace every 8 steps: 8 new, 7 required)."""
    out = []
    if p.completion_tokens <= 0:
        out.append("the requests generated no token: no FFN step to trace")
    if p.new_traces < p.expected_min_new or p.new_traces <= 0:
        out.append(f"{p.new_traces} new FFN step traces, {p.expected_min_new} expected for "
                   f"{p.completion_tokens} steps at one every {p.trace_every}")
    if p.kernel_events == 0:
        out.append("the new FFN traces hold no GPU kernel")
    return out
