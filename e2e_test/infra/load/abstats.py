"""A/B statistics: Welch intervals for a delta of means, a noise floor from a control arm, and
a verdict per metric. Pure; used by bench.py.

The unit is the repetition (one mean per repetition and arm): requests inside one repetition
share a batch and are not independent samples.

Verdict for B against A on a metric, with x the noise floor that the control arm (A against A,
measured in the same interleaved run) sets:
  x = the largest |relative delta| inside the control arm's 95 % interval;
  "better" / "worse"  when B's 95 % interval for the delta excludes 0 and |delta| > x, the
                      direction read from the metric (throughput up is better, latency up is
                      worse);
  "no detectable difference at ±x %" otherwise.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass

HIGHER_IS_BETTER = {"req_per_s": True, "out_tok_per_s": True, "ttft_ms": False,
                    "tpot_ms": False, "itl_ms": False, "e2e_ms": False, "failed": False}
ABSOLUTE = {"failed"}      # counts that are 0 on a good run: deltas in units, not percent


# ---------------------------------------------------------------- Student t quantile

def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the regularized incomplete beta (Lentz), as in Numerical Recipes."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        de = d * c
        h *= de
        if abs(de - 1.0) < 1e-14:
            break
    return h


def _betai(a: float, b: float, x: float) -> float:
    if x <= 0:
        return 0.0
    if x >= 1:
        return 1.0
    lbt = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) \
        + b * math.log1p(-x)
    if x < (a + 1) / (a + b + 2):
        return math.exp(lbt) * _betacf(a, b, x) / a
    return 1.0 - math.exp(lbt) * _betacf(b, a, 1 - x) / b


def t_cdf(t: float, df: float) -> float:
    p = 0.5 * _betai(df / 2, 0.5, df / (df + t * t))
    return 1 - p if t > 0 else p


def t_ppf(q: float, df: float) -> float:
    """Quantile of Student's t by bisection on the CDF (df may be fractional: Welch)."""
    if math.isinf(df) or df > 1e7:
        return statistics.NormalDist().inv_cdf(q)
    lo, hi = -1e3, 1e3
    for _ in range(200):
        mid = (lo + hi) / 2
        if t_cdf(mid, df) < q:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


# ---------------------------------------------------------------- deltas and verdicts

@dataclass
class Delta:
    mean_a: float
    mean_b: float
    delta: float          # relative (%) or absolute (ABSOLUTE metrics)
    lo: float
    hi: float
    unit: str             # "%" or "" (absolute)
    df: float


def welch_delta(xa: list[float], xb: list[float], relative: bool = True,
                conf: float = 0.95) -> Delta:
    """Delta of means B - A with its Welch interval; relative to A's mean when `relative`
    (the interval is the difference interval scaled by 1/mean_a: A's own uncertainty in the
    denominator is left out, a small effect next to the repetition spread)."""
    xa = [x for x in xa if x is not None and not math.isnan(x)]
    xb = [x for x in xb if x is not None and not math.isnan(x)]
    if not xa or not xb:
        return Delta(math.nan, math.nan, math.nan, math.nan, math.nan, "%" if relative else "",
                     math.nan)
    ma, mb = statistics.fmean(xa), statistics.fmean(xb)
    va = statistics.variance(xa) if len(xa) > 1 else 0.0
    vb = statistics.variance(xb) if len(xb) > 1 else 0.0
    se2 = va / len(xa) + vb / len(xb)
    diff = mb - ma
    if se2 > 0:
        num = se2 ** 2
        den = ((va / len(xa)) ** 2 / (len(xa) - 1) if len(xa) > 1 and va else 0.0) + \
              ((vb / len(xb)) ** 2 / (len(xb) - 1) if len(xb) > 1 and vb else 0.0)
        df = num / den if den else math.inf
        half = t_ppf(0.5 + conf / 2, df) * math.sqrt(se2)
    else:
        df, half = math.inf, 0.0
    lo, hi = diff - half, diff + half
    if relative:
        if ma == 0:
            return Delta(ma, mb, math.nan, math.nan, math.nan, "%", df)
        s = 100.0 / abs(ma)
        return Delta(ma, mb, diff * s, lo * s, hi * s, "%", df)
    return Delta(ma, mb, diff, lo, hi, "", df)


def noise_floor(ctl: Delta) -> float:
    """The largest |delta| the control arm (A against A) cannot tell from zero."""
    if math.isnan(ctl.lo):
        return math.nan
    return max(abs(ctl.lo), abs(ctl.hi))


@dataclass
class Verdict:
    metric: str
    verdict: str          # "better" | "worse" | "no detectable difference"
    floor: float          # x: the noise floor (same unit as the delta)
    unit: str
    b: Delta
    control: Delta

    def text(self) -> str:
        if self.verdict == "no detectable difference":
            x = "n/a" if math.isnan(self.floor) else f"{self.floor:.1f}"
            return f"no detectable difference at ±{x}" + (" %" if self.unit == "%" else "")
        return self.verdict

    def to_dict(self) -> dict:
        return {"metric": self.metric, "verdict": self.verdict, "text": self.text(),
                "noise_floor": self.floor, "unit": self.unit, "b_vs_a": asdict(self.b),
                "control_vs_a": asdict(self.control)}


def verdict(metric: str, a: list[float], b: list[float], control: list[float],
            conf: float = 0.95) -> Verdict:
    relative = metric not in ABSOLUTE
    d = welch_delta(a, b, relative, conf)
    c = welch_delta(a, control, relative, conf)
    x = noise_floor(c)
    if relative and math.isnan(d.delta) and d.mean_a == 0 == d.mean_b:
        d = welch_delta(a, b, False, conf)   # both arms 0 (e.g. no failures): no change
    call = "no detectable difference"
    if not math.isnan(d.lo) and not math.isnan(x) and (d.lo > 0 or d.hi < 0) \
            and abs(d.delta) > x:
        up_good = HIGHER_IS_BETTER.get(metric, True)
        call = "better" if (d.delta > 0) == up_good else "worse"
    return Verdict(metric, call, x, d.unit, d, c)
