"""GSM8K through the gateway, scored like lm-eval's `gsm8k` task (strict-match).

Prompt: 5 few-shot exemplars from the train split ("Question: ...\\nAnswer: ...\\n\\n"), then the
question; greedy, until "Question:", at most 256 tokens. Strict match: the number after the
first "#### " in the output; prediction and reference drop ",", "$" and a trailing ".".
"""

from __future__ import annotations

import re

from ...load import load
from ..datasets import GSM8KRow, load_gsm8k
from ..oracle import TOP_K
from . import EvalResult, collect

STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_IGNORE = [re.compile(r","), re.compile(r"\$"), re.compile(r"(?s).*#### "), re.compile(r"\.$")]
STOP = ["Question:", "</s>", "<|im_end|>"]


def normalize(s: str) -> str:
    for rx in _IGNORE:
        s = rx.sub("", s)
    return s.strip()


def extract(output: str) -> str | None:
    m = STRICT.search(output)
    return m.group(1) if m else None


def is_correct(output: str, reference: str) -> bool:
    pred = extract(output)
    return pred is not None and normalize(pred) == normalize(reference)


def fewshot_prefix(train: list[GSM8KRow], k: int = 5) -> str:
    return "".join(f"Question: {r.question}\nAnswer: {r.answer}\n\n" for r in train[:k])


def build_prompt(prefix: str, row: GSM8KRow) -> str:
    return f"{prefix}Question: {row.question}\nAnswer:"


def requests(model: str, n: int, k_shot: int = 5, max_tokens: int = 256,
             logprobs: int | None = TOP_K, shot_offset: int = 0) -> tuple[list, list]:
    """`logprobs`: top-k per generated token, for the comparison oracle (None: none asked).
    `shot_offset`: take the exemplars from that train row on (the oracle's negative control
    asks with other exemplars)."""
    test = load_gsm8k("test")[:n]
    prefix = fewshot_prefix(load_gsm8k("train")[shot_offset:], k_shot)
    extra = {"logprobs": logprobs} if logprobs is not None else {}
    reqs = [load.Request("/v1/completions", {
        "model": model, "prompt": build_prompt(prefix, row), "max_tokens": max_tokens,
        "temperature": 0, "stop": STOP, **extra}, tag=i) for i, row in enumerate(test)]
    return reqs, test


def run(base_url: str, model: str, n: int = 32, concurrency: int = 16, k_shot: int = 5,
        max_tokens: int = 256, watchdog: load.Watchdog | None = None,
        logprobs: int | None = TOP_K) -> EvalResult:
    reqs, rows = requests(model, n, k_shot, max_tokens, logprobs)
    report = load.run(base_url, reqs, concurrency=concurrency, stream=True, watchdog=watchdog)

    def score(r):
        return extract(r.text), is_correct(r.text, rows[r.tag].reference)

    return collect("gsm8k", report, score)
