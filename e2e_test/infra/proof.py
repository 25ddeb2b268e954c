"""Proof that disaggregation really moved data, from structured signals (Prometheus), not logs.

PD (vLLM): for long, unique prompts sent through the gateway, the decode workers' counter
`vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}` must grow by (nearly) the
prompt tokens, their `local_compute` share must stay small (decode did not recompute the
prompt), and the prefill workers must have computed the prompts. A run that answers 200
without the transfer fails.
"""

from __future__ import annotations

import random
import uuid
from dataclasses import asdict, dataclass

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

    @property
    def external_fraction(self) -> float:
        return self.decode_external / self.prompt_tokens if self.prompt_tokens else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "external_fraction": round(self.external_fraction, 4)}


def long_unique_prompt(words: int = 300, seed: int | None = None) -> str:
    rnd = random.Random(seed)
    body = " ".join(rnd.choice(WORDS) for _ in range(words))
    return f"[{uuid.uuid4().hex}] {body}\nIn one sentence, what is this list about?"


def _scrape_all(workers) -> list[dict]:
    return [w.metrics() for w in workers]


def _sum_delta(before: list[dict], after: list[dict], name: str, **labels) -> float:
    return sum(metrics.delta(b, a, name, **labels) for b, a in zip(before, after))


def _post_all(cluster, what: str, path: str, bodies) -> list[dict]:
    """POST each body through the gateway; any non-200 or empty answer fails the proof.
    Returns each answer's usage."""
    usages = []
    for i, body in enumerate(bodies):
        r = cluster.client.post(path, json=body)
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


def pd_transfer(cluster, n: int = 4, min_external_fraction: float = 0.9,
                max_local_fraction: float = 0.1) -> TransferProof:
    decode, prefill = cluster.role("decode"), cluster.role("prefill")
    if not decode or not prefill:
        raise HarnessError(f"topology {cluster.topology.name} has no prefill/decode roles")
    b_d, b_p = _scrape_all(decode), _scrape_all(prefill)
    prompt_tokens = sum(u["prompt_tokens"] for u in _post_all(
        cluster, "PD proof", "/v1/completions",
        ({"model": cluster.model_name, "prompt": long_unique_prompt(seed=i), "max_tokens": 8,
          "temperature": 0} for i in range(n))))
    a_d, a_p = _scrape_all(decode), _scrape_all(prefill)
    proof = TransferProof(
        requests=n, prompt_tokens=prompt_tokens,
        decode_external=_sum_delta(b_d, a_d, SRC, source="external_kv_transfer"),
        decode_local_compute=_sum_delta(b_d, a_d, SRC, source="local_compute"),
        decode_local_cache_hit=_sum_delta(b_d, a_d, SRC, source="local_cache_hit"),
        prefill_local_compute=_sum_delta(b_p, a_p, SRC, source="local_compute"),
        nixl_bytes=_sum_delta(b_d, a_d, "vllm:nixl_bytes_transferred_sum"),
        nixl_transfers=_sum_delta(b_d, a_d, "vllm:nixl_bytes_transferred_count"),
        failed_transfers=_sum_delta(b_d, a_d, "vllm:nixl_num_failed_transfers_total"),
    )
    problems = []
    if proof.external_fraction < min_external_fraction:
        problems.append(f"decode received KV for only {proof.decode_external:.0f} of "
                        f"{prompt_tokens} prompt tokens")
    if proof.decode_local_compute > max_local_fraction * prompt_tokens:
        problems.append(f"decode recomputed {proof.decode_local_compute:.0f} prompt tokens")
    if proof.prefill_local_compute < 0.5 * prompt_tokens:
        problems.append(f"prefill computed only {proof.prefill_local_compute:.0f} prompt tokens")
    if proof.failed_transfers:
        problems.append(f"{proof.failed_transfers:.0f} failed KV transfers")
    return _verdict("PD transfer proof", cluster, problems, proof)


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


def pd_transfer_tokenspeed(cluster, n: int = 4,
                           min_prefill_fraction: float = 0.9) -> TokenSpeedPDProof:
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
    problems = _dispatch_problems(proof, n)
    if proof.prefill_forward_tokens < min_prefill_fraction * prompt_tokens:
        problems.append(f"prefill ran only {proof.prefill_forward_tokens:.0f} of "
                        f"{prompt_tokens} prompt tokens forward")
    if proof.decode_success < n:
        problems.append(f"decode finished only {proof.decode_success:.0f} of {n} requests "
                        "successfully")
    if proof.decode_generation_tokens <= 0:
        problems.append("decode generated no tokens")
    return _verdict("PD transfer proof (tokenspeed)", cluster, problems, proof)


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
    if not new:
        raise HarnessError(f"AFD FFN proof failed on {name}: {n} completions "
                           f"({completion_tokens} tokens) through the gateway, but the FFN "
                           f"server wrote no new step trace in {', '.join(map(str, dirs))} "
                           f"(one is due every {every} FFN steps) ({proof.to_dict()})")
    return proof
