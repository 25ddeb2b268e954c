"""A KV-content probe: a long prompt (about 2k tokens) hides a random pass code that the model
must copy at the end. Through a disaggregated topology the code exists for the decode only in
the transferred KV, so a wrong or partial transfer loses it (smg's test_pd_topologies.py does
the same). Whether a model copies reliably is measured on `1` first: only codes that the
baseline reproduced are required of the topology under test.
"""

from __future__ import annotations

import random
import re

from .. import load
from ..oracle import TOP_K

WORDS = ["river", "stone", "amber", "field", "lantern", "copper", "meadow", "harbor", "violet", "signal", "quiet", "orchard", "thunder", "marble", "canyon", "willow", "ember", "frost", "saddle", "beacon"]


def code(i: int) -> str:
    rnd = random.Random(1000 + i)
    return "-".join(str(rnd.randint(0, 9)) for _ in range(6))


def prompt(i: int, words: int = 1500) -> str:
    """~1.3 tokens a word: 1500 filler words make a prompt of about 2k tokens."""
    rnd = random.Random(i)
    filler = [rnd.choice(WORDS) for _ in range(words)]
    at = rnd.randint(words // 4, 3 * words // 4)
    secret = f". The pass code is {code(i)}. "
    text = " ".join(filler[:at]) + secret + " ".join(filler[at:])
    return f"Remember the pass code in this text.\n\n{text}.\n\nWhat is the pass code? The pass code is"


def requests(model: str, n: int = 8, max_tokens: int = 16,
             logprobs: int = TOP_K) -> list[load.Request]:
    return [load.Request("/v1/completions", {
        "model": model, "prompt": prompt(i), "max_tokens": max_tokens, "temperature": 0,
        "logprobs": logprobs}, tag=i) for i in range(n)]


def reproduced(i: int, text: str) -> bool:
    digits = re.sub(r"[^0-9]", "", text)
    return digits.startswith(code(i).replace("-", ""))
