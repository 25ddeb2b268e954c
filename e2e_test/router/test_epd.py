"""EPD topologies (TokenSpeed behind smg's EPD mode): the encoder ran for every image request
and its output reached prefill; text-only chat still answers."""

import pytest

from e2e_test.infra import proof

pytestmark = [pytest.mark.e2e, pytest.mark.topology_kinds("epd")]


def test_epd_encoder_proof(cluster, record):
    if "multimodal" not in cluster.spec.features:
        pytest.skip(f"{cluster.model_name} is not multimodal")
    p = proof.epd_encoder_ran(cluster)
    record["epd_proof"] = p.to_dict()
    print(f"EPD proof: {p.to_dict()}")


def test_epd_image_chat_streams(cluster, record):
    if "multimodal" not in cluster.spec.features:
        pytest.skip(f"{cluster.model_name} is not multimodal")
    from e2e_test.infra import load
    body = proof.image_chat_body(cluster.model_name, "What is in this picture?",
                                 proof.random_png_data_uri(7), max_tokens=16)
    rep = load.run(cluster.gateway_url, [load.Request("/v1/chat/completions", body)],
                   concurrency=1, stream=True)
    res = rep.results[0]
    assert res.ok, f"{res.status} {res.error}"
    assert res.output_tokens > 0 and res.prompt_tokens > 0
    record["epd_image_stream"] = res.to_dict()
