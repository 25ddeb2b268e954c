"""Chat through the gateway on every selected topology: plain and streaming, usage counts."""

import pytest

from e2e_test.infra.load import load

pytestmark = pytest.mark.e2e


def test_chat_non_streaming(cluster, record):
    r = cluster.client.post("/v1/chat/completions", json={
        "model": cluster.model_name, "max_tokens": 16, "temperature": 0,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]})
    assert r.status_code == 200, r.text[:300]
    body = r.json()
    usage = body["usage"]
    assert body["choices"][0]["message"]["content"].strip()
    assert usage["prompt_tokens"] > 0 and 0 < usage["completion_tokens"] <= 16
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    record["chat"] = {"text": body["choices"][0]["message"]["content"], "usage": usage}


def test_chat_streaming(cluster, record):
    rep = load.run(cluster.gateway_url, [load.Request("/v1/chat/completions", {
        "model": cluster.model_name, "max_tokens": 16, "temperature": 0,
        "messages": [{"role": "user", "content": "Count from one to five."}]})],
        concurrency=1, stream=True)
    res = rep.results[0]
    assert res.ok, f"{res.status} {res.error}"
    assert res.chunks > 1 and res.text.strip()
    assert 0 < res.output_tokens <= 16 and res.prompt_tokens > 0
    assert res.ttft_s is not None and res.ttft_s <= res.latency_s
    record["chat_stream"] = res.to_dict()
