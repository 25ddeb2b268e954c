"""Proof that disaggregation really moved data, from structured signals (Prometheus), not logs:
what every engine's proof shares.

Each engine's own proofs live with the engine (Engine.pd_proof / epd_proof / ffn_proof):
the PD transfer counters of vLLM in engines/vllm.py, TokenSpeed's PD and EPD proofs in
engines/tokenspeed.py, the AFD FFN step traces in engines/afd.py. Here: the KV bytes of one
token from a model's config.json, the block counts a prompt makes, the unique prompts and
images the proofs send, the gateway's (smg's) dispatch counters, and the helpers that scrape
workers, post through the gateway and turn problems into a verdict.
"""

from __future__ import annotations

import math
import random
import time
import uuid
from dataclasses import asdict, dataclass, field
from types import SimpleNamespace

import httpx

from ..cluster import metrics
from ..errors import HarnessError

WORDS = ("river stone lantern orbit maple copper violet harbor meadow signal quartz ember "
         "falcon tundra velvet canyon").split()


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


def _argv_value(argv: list[str], flag: str) -> str | None:
    """The value of `flag` in `argv` as argparse takes it: the last one given (a model's
    --dtype followed by the user's extra args' --dtype is the user's)."""
    found = None
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            found = argv[i + 1]
        elif a.startswith(flag + "="):
            found = a.split("=", 1)[1]
    return found


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


def scrape_all(workers) -> list[dict]:
    return [w.metrics() for w in workers]


def sum_delta(before: list[dict], after: list[dict], name: str, **labels) -> float:
    return sum(metrics.delta(b, a, name, **labels) for b, a in zip(before, after))


def post_all(cluster, what: str, path: str, bodies, url: str | None = None) -> list[dict]:
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


def verdict(what: str, cluster, problems: list[str], proof):
    if problems:
        raise HarnessError(f"{what} failed on {cluster.topology.name}: "
                           + "; ".join(problems) + f" ({proof.to_dict()})")
    return proof


SELECTIONS = "smg_worker_selection_total"
# smg 1.13.0 counts a PD pair that its veto fallback picked (every open worker of a leg vetoed
# by the overload guard or the liveness tracker: routers/common/placement.rs relaxed_pair,
# "Veto fallback") under smg_worker_overload_fallback_total or
# smg_worker_liveness_fallback_total{stage="selection"} only, not under
# smg_worker_selection_total, while its single-worker fallback counts both (placement.rs
# overload_fallback). The load monitor's poll (every 10 s) during a burst sets a prefill's
# overload veto for the next 10 s (waiting requests 15-16 over smg's default threshold of 8):
# every request of a PD proof inside that window is such a pick, and a proof counting
# selections alone sees none (both engines, on an H200). In a PD gateway
# these counters at stage "selection" come from that path only (the single-worker fallback
# serves regular gateways), so each is one prefill and one decode picked.
FALLBACKS = ("smg_worker_overload_fallback_total", "smg_worker_liveness_fallback_total")


def gateway_dispatch(before: dict, after: dict, pd: bool = False) -> dict:
    """smg's per-role worker selections and its PD/EPD failure counters, as deltas. `pd`: the
    gateway routes prefill/decode pairs, so its veto-fallback picks count for both legs
    (FALLBACKS), and `gateway_fallback_pairs` says how many there were."""
    out = {**{f"gateway_{role}_selections": metrics.delta(before, after, SELECTIONS,
                                                          worker_type=role)
              for role in ("encode", "prefill", "decode")},
           "gateway_transfer_failures": (
               metrics.delta(before, after, "smg_pd_bootstrap_failures_total")
               + metrics.delta(before, after, "smg_pd_kv_transfer_failures_total"))}
    if pd:
        pairs = sum(metrics.delta(before, after, name, stage="selection") for name in FALLBACKS)
        out["gateway_prefill_selections"] += pairs
        out["gateway_decode_selections"] += pairs
        out["gateway_fallback_pairs"] = pairs
    return out


def dispatch_evidence(before: dict, after: dict, later: dict) -> dict:
    """Where smg's selections did not move: its HTTP request count over the same window, and
    the selections by role from `before` to a scrape taken `later`. Pure."""
    return {"http_requests": metrics.delta(before, after, "smg_http_requests_total"),
            "selections_1s_later": {r: metrics.delta(before, later, SELECTIONS, worker_type=r)
                                    for r in ("prefill", "decode")}}


def dispatch_problems(proof, n: int) -> list[str]:
    problems = []
    if proof.gateway_prefill_selections < n or proof.gateway_decode_selections < n:
        problems.append(f"the gateway picked prefill {proof.gateway_prefill_selections:.0f} and "
                        f"decode {proof.gateway_decode_selections:.0f} times for {n} requests")
    if proof.gateway_transfer_failures:
        problems.append(f"the gateway counted {proof.gateway_transfer_failures:.0f} bootstrap/"
                        "transfer failures")
    return problems


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


# -- every leg of a PD topology took traffic in its own role ----------------------------------

@dataclass
class LegsProof:
    """Per worker of a PD topology, what its counters moved over `requests` prompts through
    the gateway: {worker: {"role": role, counter: delta, ...}}; `gateway`: smg's own counts
    over the same prompts (gateway_dispatch), with its selection totals before and after by
    every label set, so a count that did not move says which series it read."""
    requests: int
    legs: dict
    gateway: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def leg(name: str, labels: dict | None = None) -> tuple[str, dict]:
    return name, dict(labels or {})


def _label(counter: tuple[str, dict]) -> str:
    name, labels = counter
    return name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(labels.items())) + "}"
                   if labels else "")


def legs_problems(workers, before: list[dict], after: list[dict], own: dict,
                  foreign: dict) -> tuple[dict, list[str]]:
    """workers: [(name, role)] with their scrapes before and after. Pure (tests/test_proof_legs.py)."""
    legs, problems = {}, []
    names = [n for n, _ in workers]
    for (name, role), b, a in zip(workers, before, after):
        row: dict = {"role": role}
        key = name if names.count(name) == 1 else f"{name} as {role}"
        if not own.get(role):           # nothing read for this leg: no pass over nothing
            problems.append(f"{name} ({role}): the engine names no counter of that role's "
                            "own work: whether the leg took traffic cannot be told")
        for c in own.get(role, ()):
            row[_label(c)] = metrics.delta(b, a, c[0], **c[1])
            if row[_label(c)] <= 0:
                problems.append(f"{name} ({role}) took no traffic: {_label(c)} did not move")
        for c in foreign.get(role, ()):
            row[_label(c)] = metrics.delta(b, a, c[0], **c[1])
            if row[_label(c)] != 0:
                problems.append(f"{name} ({role}) acted as another role: {_label(c)} moved "
                                f"by {row[_label(c)]:.0f}")
        legs[key] = row
    return legs, problems


def legs_traffic(cluster, own: dict, foreign: dict, n: int | None = None,
                 path: str = "/v1/completions", body=None,
                 roles: dict | None = None) -> LegsProof:
    """n fresh prompts through the gateway (default 4 per leg of the larger role), then per
    worker the deltas of `own[role]` (its role's counters: each must have moved, or the leg
    took no traffic) and `foreign[role]` (the other role's: each must have stayed put, or the
    leg acted in the wrong role), and the gateway's own count: it picked a prefill and a
    decode worker for every request. Raises HarnessError naming every leg that did not.
    `roles` ({"prefill": [...], "decode": [...]}): the workers read as each role (default:
    the topology's own; the negative control reads a regular worker as both)."""
    roles = roles or {}
    pre = roles.get("prefill") or cluster.role("prefill")
    dec = roles.get("decode") or cluster.role("decode")
    if not pre or not dec:
        raise HarnessError(f"topology {cluster.topology.name} has no prefill/decode roles")
    workers = pre + dec
    n = n or 4 * max(len(pre), len(dec))
    make = body or (lambda i: {"model": cluster.model_name, "prompt": long_unique_prompt(
        words=120, seed=1000 + i), "max_tokens": 4, "temperature": 0})
    named = [(w.name, r) for r, ws in (("prefill", pre), ("decode", dec)) for w in ws]
    before, b_g = scrape_all(workers), cluster.gateway_metrics()
    post_all(cluster, "PD legs", path, (make(i) for i in range(n)))
    after, a_g = scrape_all(workers), cluster.gateway_metrics()
    legs, problems = legs_problems(named, before, after, own, foreign)
    gw = gateway_dispatch(b_g, a_g, pd=cluster.topology.kind == "pd")
    dispatch = dispatch_problems(SimpleNamespace(**gw), n)
    evidence = {}
    if dispatch:
        # Where the picks still fall short: smg's HTTP request counter over the same requests,
        # and the selections in a scrape a second later, tell a count smg skipped from a
        # metrics page that did not move at all. Evidence only: the verdict is the first
        # scrape's.
        time.sleep(1.0)
        evidence = dispatch_evidence(b_g, a_g, cluster.gateway_metrics())
    problems = dispatch + problems
    sel = {when: {",".join(f"{k}={v}" for k, v in labels): value
                  for (name, labels), value in g.items() if name == SELECTIONS}
           for when, g in (("before", b_g), ("after", a_g))}
    return verdict(f"PD legs ({n} requests)", cluster, problems,
                   LegsProof(n, legs, dict(gw, selection_series=sel, **evidence)))

