"""How the comparison oracle's passes ask: the endpoint the engine returns logprobs on, whole or
streamed (comparisons.requests, Engine.logprobs_api, E2E_ORACLE_STREAM). Pure."""

import copy

import pytest

from e2e_test.infra import engines
from e2e_test.infra.verdicts import comparisons


def _engine(name):
    return next(e for e in engines.all_engines() if e.name == name)


@pytest.mark.parametrize("api,path,stream", [
    ("completions", "/v1/completions", False), ("chat", "/v1/chat/completions", False),
    ("completions-stream", "/v1/completions", True),
    ("chat-stream", "/v1/chat/completions", True)])
def test_requests_ask_on_the_endpoint_whole_or_streamed(api, path, stream):
    reqs = comparisons.requests("recall", "m", 3, logprobs=0, api=api)
    assert [r.path for r in reqs] == [path] * 3 and [r.stream for r in reqs] == [stream] * 3
    assert [r.tag for r in reqs] == [0, 1, 2]
    if path.endswith("chat/completions"):
        assert reqs[0].body["logprobs"] is True and reqs[0].body["top_logprobs"] == 0
    shape = comparisons.request_shape(reqs)
    assert shape.endswith(" streamed") == stream, shape


def test_an_unknown_way_to_ask_is_refused():
    with pytest.raises(ValueError, match="logprobs api 'chat-streamed': one of completions, "
                                         "chat, completions-stream, chat-stream"):
        comparisons.requests("recall", "m", 1, api="chat-streamed")


def test_the_driver_says_how_unless_the_setting_does(monkeypatch):
    ts, vllm = _engine("tokenspeed"), _engine("vllm")
    monkeypatch.delenv("E2E_ORACLE_STREAM", raising=False)
    assert (ts.logprobs_api, vllm.logprobs_api) == (
        "chat" + ("-stream" if ts.oracle_stream else ""),
        "completions" + ("-stream" if vllm.oracle_stream else ""))
    monkeypatch.setenv("E2E_ORACLE_STREAM", "1")
    assert (ts.logprobs_api, vllm.logprobs_api) == ("chat-stream", "completions-stream")
    streaming = copy.copy(ts)
    streaming.oracle_stream = True
    monkeypatch.setenv("E2E_ORACLE_STREAM", "0")
    assert streaming.logprobs_api == "chat"
    monkeypatch.setenv("E2E_ORACLE_STREAM", "auto")
    assert streaming.logprobs_api == "chat-stream"
