"""A/B characterization: the same workload against two topologies of the same model.

Workload: N requests of `isl` prompt words and `osl` output tokens (ignore_eos), Poisson
arrivals at `rate` req/s (inf: all at once), at most `max_concurrency` in flight, `warmup`
requests first on each side, then `reps` rounds. Both topologies are up at once and the
repetitions are interleaved, so drift (a warming cache, a noisy neighbour) hits both sides:
each round runs A, B and A again (the control arm, A against A), alternating which A comes
first. Reported per topology as mean ± std over the repetitions: request throughput, output
token throughput, TTFT, TPOT, ITL, end-to-end latency, failed requests; then per metric the
delta B vs A with its 95 % Welch interval, the control arm's delta, and a verdict (better,
worse, or no detectable difference at ±x %, x from the control arm; see abstats.py).

Request shapes (SHAPES): the same prompts asked as a completion or as a chat message, with or
without the chosen tokens' logprobs. Arm B may differ from A in its shape instead of its
topology (`bench --a 1 --b 1 --shape chat --shape-b chat-logprobs`): then one topology serves
both arms, interleaved the same way, and the verdict says what the shape costs per step
(on eager TokenSpeed 0.1.0 through smg every shape costs alike, its launch work: docs/bench.md,
"Request shapes: what an API costs per step").
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import statistics
from dataclasses import asdict, dataclass

from ..cluster.cluster import results_root
from ..errors import ConfigError
from . import abstats, load

METRICS = ("req_per_s", "out_tok_per_s", "ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "failed")


@dataclass(frozen=True)
class BenchConfig:
    n: int = 16
    isl: int = 1024
    osl: int = 128
    rate: float = math.inf
    max_concurrency: int = 8
    warmup: int = 2
    reps: int = 3
    seed: int = 0
    shape: str = "completions"      # SHAPES: how each prompt is asked


# Common short English words: about one token each for Llama-style tokenizers. The gateway
# takes text prompts only, so the input length is approximate; the measured mean prompt
# length (from the usage counts) is reported next to the results.
WORDS = ("time year people way day man thing woman life child world school state family "
         "student group country problem hand part place case week company system program "
         "question work government number night point home water room mother area money "
         "story fact month lot right study book eye job word business issue side kind head "
         "house service friend father power hour game line end member law car city name").split()


# shape -> (path, the body's fields besides model, max_tokens, temperature and ignore_eos,
# given the prompt). logprobs: the chosen token's only (completions `logprobs: 0`, chat
# `top_logprobs: 0`), what the comparison oracle asks of an engine on that API.
SHAPES = {
    "completions": ("/v1/completions", lambda p: {"prompt": p}),
    "completions-logprobs": ("/v1/completions", lambda p: {"prompt": p, "logprobs": 0}),
    "chat": ("/v1/chat/completions",
             lambda p: {"messages": [{"role": "user", "content": p}]}),
    "chat-logprobs": ("/v1/chat/completions",
                      lambda p: {"messages": [{"role": "user", "content": p}],
                                 "logprobs": True, "top_logprobs": 0}),
}


def check_shape(shape: str) -> str:
    if shape not in SHAPES:
        raise ConfigError(f"bench: unknown request shape {shape!r} (one of "
                          f"{', '.join(SHAPES)})")
    return shape


def workload(model: str, cfg: BenchConfig, n: int, seed: int,
             shape: str | None = None) -> list[load.Request]:
    """n requests of cfg.isl random words and cfg.osl output tokens, asked in `shape`
    (default cfg.shape); the same seed gives the same prompts in every shape."""
    path, fields = SHAPES[check_shape(shape or cfg.shape)]
    rnd = random.Random(seed)
    return [load.Request(path, {
        "model": model, **fields(" ".join(rnd.choice(WORDS) for _ in range(cfg.isl))),
        "max_tokens": cfg.osl, "temperature": 0, "ignore_eos": True}, tag=i) for i in range(n)]


def measure(rep: load.RunReport) -> dict:
    ok = rep.ok
    mean = lambda xs: statistics.fmean(xs) if xs else float("nan")  # noqa: E731
    itl = [g for r in ok for g in r.itl_s]
    return {
        "req_per_s": len(ok) / rep.wall_s if rep.wall_s else 0.0,
        "out_tok_per_s": sum(r.output_tokens for r in ok) / rep.wall_s if rep.wall_s else 0.0,
        "ttft_ms": 1000 * mean([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_ms": 1000 * mean([r.tpot_s for r in ok if r.tpot_s is not None]),
        "itl_ms": 1000 * mean(itl),
        "e2e_ms": 1000 * mean([r.latency_s for r in ok]),
        "failed": float(len(rep.errors)),
        "isl_measured": mean([r.prompt_tokens for r in ok]),
    }


def warm(cluster, cfg: BenchConfig, shape: str | None = None) -> None:
    if cfg.warmup:
        load.run(cluster.gateway_url,
                 workload(cluster.model_name, cfg, cfg.warmup, 10_000, shape),
                 concurrency=cfg.max_concurrency, stream=True)


def one_rep(cluster, cfg: BenchConfig, r: int, label: str, log=print,
            shape: str | None = None) -> dict:
    """One repetition on one side; round r uses the same prompts on every arm."""
    rep = load.run(cluster.gateway_url,
                   workload(cluster.model_name, cfg, cfg.n, cfg.seed + r, shape),
                   concurrency=cfg.max_concurrency, stream=True, rate=cfg.rate,
                   seed=cfg.seed + r, watchdog=cluster.watchdog("bench"))
    m = measure(rep)
    m["client_overhead_ms"] = rep.client_overhead_s * 1000
    first_error = next((f"; first error: {e.status} {e.error[:120]}" for e in rep.errors), "")
    log(f"  {label} rep {r + 1}/{cfg.reps}: "
        + ", ".join(f"{k} {v:.1f}" for k, v in m.items()) + first_error)
    return m


def aggregate(runs: list[dict]) -> dict:
    agg = {}
    for k in METRICS + ("isl_measured", "client_overhead_ms"):
        xs = [m[k] for m in runs if not math.isnan(m[k])]
        agg[k] = {"mean": statistics.fmean(xs) if xs else float("nan"),
                  "std": statistics.stdev(xs) if len(xs) > 1 else 0.0}
    return agg


def run_topology(cluster, cfg: BenchConfig, log=print) -> dict:
    """All repetitions on one topology, back to back (no interleaving, no control arm)."""
    warm(cluster, cfg)
    runs = [one_rep(cluster, cfg, r, cluster.topology.name, log) for r in range(cfg.reps)]
    return {"topology": cluster.topology.name, "runs": runs, "agg": aggregate(runs),
            "ready_s": dict(cluster.timing.workers)}


def schedule(reps: int) -> list[list[str]]:
    """The arms of each round: A B A' then A' B A, alternating, so neither A arm is always
    the first of a round."""
    return [["a", "b", "control"] if r % 2 == 0 else ["control", "b", "a"] for r in range(reps)]


def verdicts(a_runs: list[dict], b_runs: list[dict], ctl_runs: list[dict]) -> dict:
    return {k: abstats.verdict(k, [m[k] for m in a_runs], [m[k] for m in b_runs],
                               [m[k] for m in ctl_runs]).to_dict() for k in METRICS}


def _fmt_delta(d: dict) -> str:
    if d["delta"] is None or math.isnan(d["delta"]):
        return "n/a"
    u = " %" if d["unit"] == "%" else ""
    return f"{d['delta']:+.1f}{u} [{d['lo']:+.1f}, {d['hi']:+.1f}]"


def table(a: dict, b: dict, control: dict | None = None, verdict: dict | None = None) -> str:
    """Mean ± std per side and the delta B vs A; with the control arm and verdicts, also the
    delta's 95 % interval, the control's delta (A' vs A) and the verdict per metric."""
    if control is not None and verdict is not None:
        lines = [(f"| metric | {a['topology']} (A) | {b['topology']} (B) | control A' | "
                  "B vs A, 95 % CI | A' vs A, 95 % CI | verdict |"), "|" + "---|" * 7]
    else:
        lines = [f"| metric | {a['topology']} | {b['topology']} | delta |", "|---|---|---|---|"]
    for k in METRICS + ("isl_measured", "client_overhead_ms"):
        ma, mb = a["agg"][k], b["agg"][k]
        if control is not None and verdict is not None:
            mc = control["agg"][k]
            v = verdict.get(k)
            lines.append(f"| {k} | {ma['mean']:.2f} ± {ma['std']:.2f} | "
                         f"{mb['mean']:.2f} ± {mb['std']:.2f} | {mc['mean']:.2f} ± {mc['std']:.2f}"
                         f" | {_fmt_delta(v['b_vs_a']) if v else ''} | "
                         f"{_fmt_delta(v['control_vs_a']) if v else ''} | "
                         f"{v['text'] if v else '(not judged)'} |")
            continue
        if k == "failed":
            delta = f"{mb['mean'] - ma['mean']:+.1f}"
        elif ma["mean"] and not math.isnan(ma["mean"]):
            delta = f"{100 * (mb['mean'] - ma['mean']) / ma['mean']:+.1f}%"
        else:
            delta = "n/a"
        lines.append(f"| {k} | {ma['mean']:.2f} ± {ma['std']:.2f} | "
                     f"{mb['mean']:.2f} ± {mb['std']:.2f} | {delta} |")
    return "\n".join(lines)


def arm_names(topo_a: str, topo_b: str, shape_a: str, shape_b: str) -> tuple[str, str]:
    """What the table calls each arm: the topology, and the shape where the arms' shapes
    differ."""
    if shape_a == shape_b:
        return topo_a, topo_b
    return f"{topo_a} {shape_a}", f"{topo_b} {shape_b}"


def ab(make_cluster, topo_a: str, topo_b: str, cfg: BenchConfig, log=print,
       shape_b: str | None = None) -> dict:
    """Both topologies up at once, rounds of A B A' interleaved (see schedule), verdicts per
    metric against the control arm's noise floor. B's requests take `shape_b` (default A's,
    cfg.shape); where B is A's topology in another shape, one topology serves both arms.
    Keys: config, a, b (as before: topology, runs, agg, ready_s, teardown; shape), control
    (A's second arm), order, verdicts, table, path."""
    shape_a = check_shape(cfg.shape)
    shape_b = check_shape(shape_b or shape_a)
    if topo_a == topo_b and shape_a == shape_b:
        raise ConfigError(f"bench: A and B are both {topo_a} asked as {shape_a}: nothing to "
                          "compare (give another --b or --shape-b)")
    name_a, name_b = arm_names(topo_a, topo_b, shape_a, shape_b)
    shared = topo_a == topo_b
    out = {"config": {**asdict(cfg), "rate": str(cfg.rate), "shape_b": shape_b}}
    clusters = {}
    with contextlib.ExitStack() as stack:
        for key, topo in (("a", topo_a),) if shared else (("a", topo_a), ("b", topo_b)):
            log(f"bench: starting {topo}")
            clusters[key] = stack.enter_context(make_cluster(topo))
        if shared:
            clusters["b"] = clusters["a"]
        warm(clusters["a"], cfg, shape_a)
        warm(clusters["b"], cfg, shape_b)     # shared: the same topology, B's shape
        runs: dict[str, list[dict]] = {"a": [], "b": [], "control": []}
        order = schedule(cfg.reps)
        for r, arms in enumerate(order):
            for arm in arms:
                c = clusters["b" if arm == "b" else "a"]
                label = {"a": f"A {name_a}", "b": f"B {name_b}", "control": f"A' {name_a}"}[arm]
                runs[arm].append(one_rep(c, cfg, r, label, log,
                                         shape_b if arm == "b" else shape_a))
        for key, arm_name in (("a", name_a), ("b", name_b), ("control", name_a)):
            c = clusters["b" if key == "b" else "a"]
            out[key] = {"topology": arm_name, "shape": shape_b if key == "b" else shape_a,
                        "runs": runs[key], "agg": aggregate(runs[key]),
                        "ready_s": dict(c.timing.workers)}
        out["order"] = order
    for key in ("a", "b"):
        out[key]["teardown"] = clusters[key].teardown_report.verdict()
    out["verdicts"] = verdicts(runs["a"], runs["b"], runs["control"])
    out["table"] = table(out["a"], out["b"], out["control"], out["verdicts"])
    stem = f"bench-{topo_a}-vs-{topo_b}" + ("" if shape_a == shape_b
                                             else f"-{shape_a}-vs-{shape_b}")
    path = results_root() / f"{stem}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2, default=str))
    out["path"] = str(path)
    return out
