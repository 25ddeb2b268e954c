"""Inputs the EPD proof sends: unique images as data: URIs in OpenAI chat image parts."""

import base64
import io

from e2e_test.infra.verdicts import proof


def test_random_png_is_a_decodable_unique_png():
    from PIL import Image
    a, b = proof.random_png_data_uri(1, size=32), proof.random_png_data_uri(2, size=32)
    assert a.startswith("data:image/png;base64,") and a != b
    assert proof.random_png_data_uri(1, size=32) == a          # deterministic per seed
    img = Image.open(io.BytesIO(base64.b64decode(a.split(",", 1)[1])))
    assert (img.format, img.size, img.mode) == ("PNG", (32, 32), "RGB")


def test_image_chat_body():
    body = proof.image_chat_body("m", "Describe.", "data:image/png;base64,AA", max_tokens=4)
    assert body["model"] == "m" and body["max_tokens"] == 4 and body["temperature"] == 0
    parts = body["messages"][0]["content"]
    assert parts == [{"type": "text", "text": "Describe."},
                     {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]
