"""A KV-content probe: a long prompt (about 2k tokens) hides a random pass code that the model
must copy at the end. Through a disaggregated topology the code exists for the decode only in
the transferred KV, so a wrong or partial transfer loses it (smg's test_pd_topologies.py does
the same). Whether a model copies reliably is measured on `1` first: only codes that the
baseline reproduced are required of the topology under test, and a baseline that copied none
is an error (`recall_problems`): a probe that cannot fail proves nothing. A position `1`
copied none of is named in the record (`untested_kinds`).

Odd items put the code at the prompt's very end, followed only by " The pass code is" (a few
tokens): the code lies in the prompt's last KV block (the partial one, whose transfer the
vLLM proof counts), or straddles it and the block before when that last block holds fewer
tokens than the suffix. Even items hide it mid-text.
"""

from __future__ import annotations

import random
import re

from ...load import load
from ..oracle import TOP_K, NoEvidenceError

WORDS = ["river", "stone", "amber", "field", "lantern", "copper", "meadow", "harbor", "violet", "signal", "quiet", "orchard", "thunder", "marble", "canyon", "willow", "ember", "frost", "saddle", "beacon"]


def code(i: int) -> str:
    rnd = random.Random(1000 + i)
    return "-".join(str(rnd.randint(0, 9)) for _ in range(6))


def at_tail(i: int) -> bool:
    """Whether item i's code sits in the prompt's last block (odd items)."""
    return i % 2 == 1


def prompt(i: int, words: int = 1500) -> str:
    """~1.3 tokens a word: 1500 filler words make a prompt of about 2k tokens."""
    rnd = random.Random(i)
    filler = [rnd.choice(WORDS) for _ in range(words)]
    if at_tail(i):
        text = " ".join(filler)
        return (f"Remember the pass code at the end of this text.\n\n{text}.\n\nWhat is the "
                f"pass code? The pass code is {code(i)}. The pass code is")
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


def recall_problems(baseline_copied: list, copied: list, n: int, topology: str) -> list[str]:
    """The recall verdict: every code `1` copied must come back through `topology`. A
    baseline that copied no code tests nothing: an error (NoEvidenceError), not a pass. A
    kind that `1` never copied (mid-text, or tail) is not checked for copying (untested_kinds
    names it for the record); the oracle still compares every item token by token. Pure."""
    if not baseline_copied:
        raise NoEvidenceError(f"recall: `1` copied none of the {n} pass codes: the probe "
                              f"cannot fail on {topology}, nothing was tested")
    lost = sorted(set(baseline_copied) - set(copied))
    if not lost:
        return []
    kinds = ", ".join("tail" if at_tail(i) else "mid-text" for i in lost)
    return [f"pass codes that `1` copied and {topology} did not: items {lost} ({kinds})"]


def stable_codes(baseline: dict, control_passes: list) -> tuple[list, list]:
    """(stable, unstable): the pass codes `1` copied in its baseline pass (index -> text)
    and also in every pass of its control arm (the same prompts again on the same server),
    and those it copied in the baseline only. A code `1` itself does not copy every time is
    not a KV test: an item that begins at a near-tie (' ' or ' a', 0.125 nats apart, on vLLM
    0.26 on an H200) loses its code in the control pass exactly as 1p1d does.
    Only stable codes are required of a disaggregated topology; the oracle still compares
    every item token by token. Pure."""
    copied = sorted(i for i, t in baseline.items() if reproduced(i, t))
    stable = [i for i in copied
              if all(reproduced(i, p[i]) for p in control_passes if i in p)
              and all(i in p for p in control_passes)]
    return stable, sorted(set(copied) - set(stable))


def untested_kinds(baseline_copied: list) -> list[str]:
    """The code positions `1` copied none of (their copying is not checked): with TokenSpeed's
    chat-shaped passes SmolLM2 copies tail codes and no mid-text one. Pure."""
    kinds = {at_tail(i) for i in baseline_copied}
    return [name for tail, name in ((False, "mid-text"), (True, "tail (last block)"))
            if tail not in kinds]
