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


def pd_transfer(cluster, n: int = 4, min_external_fraction: float = 0.9,
                max_local_fraction: float = 0.1) -> TransferProof:
    decode, prefill = cluster.role("decode"), cluster.role("prefill")
    if not decode or not prefill:
        raise HarnessError(f"topology {cluster.topology.name} has no prefill/decode roles")
    b_d, b_p = _scrape_all(decode), _scrape_all(prefill)
    prompt_tokens = 0
    for i in range(n):
        r = cluster.client.post("/v1/completions", json={
            "model": cluster.model_name, "prompt": long_unique_prompt(seed=i), "max_tokens": 8,
            "temperature": 0})
        if r.status_code != 200:
            raise HarnessError(f"PD proof request {i}: HTTP {r.status_code} {r.text[:200]}")
        prompt_tokens += r.json()["usage"]["prompt_tokens"]
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
    if problems:
        raise HarnessError(f"PD transfer proof failed on {cluster.topology.name}: "
                           + "; ".join(problems) + f" ({proof.to_dict()})")
    return proof
