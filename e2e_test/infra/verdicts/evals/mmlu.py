"""MMLU through the gateway: 5-shot with the subject's dev exemplars, letter extraction.

Prompt (lm-eval's mmlu format): "The following are multiple choice questions (with answers)
about {subject}.\\n\\n" + exemplars "{question}\\nA. ..\\nB. ..\\nC. ..\\nD. ..\\nAnswer: X\\n\\n"
+ the question ending in "Answer:". Greedy, 2 tokens; the first A-D letter is the prediction.
The sample is spread evenly over the test file (which is sorted by subject), deterministically.
"""

from __future__ import annotations

import re

from ...load import load
from ..datasets import MMLURow, load_mmlu
from ..oracle import TOP_K
from . import EvalResult, collect

LETTER = re.compile(r"\b([ABCD])\b")


def extract(output: str) -> str | None:
    """The first standalone A-D in the first 20 characters ("B", " B.", "(C)", "Answer: D")."""
    m = LETTER.search(output.strip()[:20])
    return m.group(1) if m else None


def format_question(row: MMLURow, with_answer: bool) -> str:
    body = row.question.strip() + "\n" + "".join(
        f"{letter}. {choice}\n" for letter, choice in zip("ABCD", row.choices))
    return body + ("Answer: " + row.answer + "\n\n" if with_answer else "Answer:")


def build_prompt(row: MMLURow, shots: list[MMLURow]) -> str:
    subject = row.subject.replace("_", " ")
    head = f"The following are multiple choice questions (with answers) about {subject}.\n\n"
    return head + "".join(format_question(s, True) for s in shots) + format_question(row, False)


def sample(rows: list, n: int) -> list:
    if n >= len(rows):
        return list(rows)
    step = len(rows) / n
    return [rows[int(i * step)] for i in range(n)]


CHARS_PER_TOKEN = 3.0   # conservative: English MMLU text runs ~4 characters per token


def fitted_prompt(row: MMLURow, shots: list[MMLURow], max_prompt_tokens: int | None) -> str:
    """Drop exemplars (last first) until the prompt fits the model's context."""
    k = len(shots)
    while True:
        prompt = build_prompt(row, shots[:k])
        if max_prompt_tokens is None or k == 0 or len(prompt) <= CHARS_PER_TOKEN * max_prompt_tokens:
            return prompt
        k -= 1


def requests(model: str, n: int, k_shot: int = 5, max_prompt_tokens: int | None = None,
             logprobs: int | None = TOP_K) -> tuple[list, list]:
    """`logprobs`: top-k per generated token, for the comparison oracle (None: none asked)."""
    dev: dict[str, list[MMLURow]] = {}
    for r in load_mmlu("dev"):
        dev.setdefault(r.subject, []).append(r)
    rows = sample(load_mmlu("test"), n)
    reqs = [load.Request("/v1/completions", {
        "model": model,
        "prompt": fitted_prompt(row, dev.get(row.subject, [])[:k_shot], max_prompt_tokens),
        "max_tokens": 2, "temperature": 0, **({"logprobs": logprobs} if logprobs is not None else {})},
        tag=i) for i, row in enumerate(rows)]
    return reqs, rows


def run(base_url: str, model: str, n: int = 64, concurrency: int = 16, k_shot: int = 5,
        watchdog: load.Watchdog | None = None,
        max_prompt_tokens: int | None = None, logprobs: int | None = TOP_K) -> EvalResult:
    reqs, rows = requests(model, n, k_shot, max_prompt_tokens, logprobs)
    report = load.run(base_url, reqs, concurrency=concurrency, stream=True, watchdog=watchdog)

    def score(r):
        pred = extract(r.text)
        return pred, pred == rows[r.tag].answer

    return collect("mmlu", report, score)
