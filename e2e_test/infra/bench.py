"""A/B characterization: the same workload against two topologies of the same model.

Workload: N requests of `isl` random prompt tokens (token ids, so the length is exact) and
`osl` output tokens (ignore_eos), Poisson arrivals at `rate` req/s (inf: all at once), at most
`max_concurrency` in flight, `warmup` requests first, then `reps` repetitions. Reported per
topology as mean ± std over the repetitions: request throughput, output token throughput,
TTFT, TPOT, ITL, end-to-end latency, failed requests; then the delta B vs A per metric.
"""

from __future__ import annotations

import json
import math
import random
import statistics
from dataclasses import asdict, dataclass

from . import load
from .cluster import results_root

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


# Common short English words: about one token each for Llama-style tokenizers. The gateway
# takes text prompts only, so the input length is approximate; the measured mean prompt
# length (from the usage counts) is reported next to the results.
WORDS = ("time year people way day man thing woman life child world school state family "
         "student group country problem hand part place case week company system program "
         "question work government number night point home water room mother area money "
         "story fact month lot right study book eye job word business issue side kind head "
         "house service friend father power hour game line end member law car city name").split()


def workload(model: str, cfg: BenchConfig, n: int, seed: int) -> list[load.Request]:
    rnd = random.Random(seed)
    return [load.Request("/v1/completions", {
        "model": model, "prompt": " ".join(rnd.choice(WORDS) for _ in range(cfg.isl)),
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


def run_topology(cluster, cfg: BenchConfig, log=print) -> dict:
    if cfg.warmup:
        load.run(cluster.gateway_url, workload(cluster.model_name, cfg, cfg.warmup, 10_000),
                 concurrency=cfg.max_concurrency, stream=True)
    runs = []
    for r in range(cfg.reps):
        rep = load.run(cluster.gateway_url, workload(cluster.model_name, cfg, cfg.n, cfg.seed + r),
                       concurrency=cfg.max_concurrency, stream=True, rate=cfg.rate,
                       seed=cfg.seed + r, watchdog=cluster.watchdog("bench"))
        m = measure(rep)
        m["client_overhead_ms"] = rep.client_overhead_s * 1000
        runs.append(m)
        first_error = next((f"; first error: {e.status} {e.error[:120]}" for e in rep.errors), "")
        log(f"  {cluster.topology.name} rep {r + 1}/{cfg.reps}: "
            + ", ".join(f"{k} {v:.1f}" for k, v in m.items()) + first_error)
    agg = {}
    for k in METRICS + ("isl_measured", "client_overhead_ms"):
        xs = [m[k] for m in runs if not math.isnan(m[k])]
        agg[k] = {"mean": statistics.fmean(xs) if xs else float("nan"),
                  "std": statistics.stdev(xs) if len(xs) > 1 else 0.0}
    return {"topology": cluster.topology.name, "runs": runs, "agg": agg,
            "ready_s": dict(cluster.timing.workers)}


def table(a: dict, b: dict) -> str:
    lines = [f"| metric | {a['topology']} | {b['topology']} | delta |", "|---|---|---|---|"]
    for k in METRICS + ("isl_measured", "client_overhead_ms"):
        ma, mb = a["agg"][k], b["agg"][k]
        if k == "failed":
            delta = f"{mb['mean'] - ma['mean']:+.1f}"
        elif ma["mean"] and not math.isnan(ma["mean"]):
            delta = f"{100 * (mb['mean'] - ma['mean']) / ma['mean']:+.1f}%"
        else:
            delta = "n/a"
        lines.append(f"| {k} | {ma['mean']:.2f} ± {ma['std']:.2f} | "
                     f"{mb['mean']:.2f} ± {mb['std']:.2f} | {delta} |")
    return "\n".join(lines)


def ab(make_cluster, topo_a: str, topo_b: str, cfg: BenchConfig, log=print) -> dict:
    out = {"config": {**asdict(cfg), "rate": str(cfg.rate)}}
    for key, topo in (("a", topo_a), ("b", topo_b)):
        log(f"bench: starting {topo}")
        with make_cluster(topo) as c:
            out[key] = run_topology(c, cfg, log)
        out[key]["teardown"] = c.teardown_report.verdict()
    out["table"] = table(out["a"], out["b"])
    path = results_root() / f"bench-{topo_a}-vs-{topo_b}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2, default=str))
    out["path"] = str(path)
    return out
