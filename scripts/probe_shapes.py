"""Where a decode step's time goes, on one real `1` topology (a diagnostic, not a verdict).

    source scripts/gpu_lane.sh tokenspeed probe      # on a runner: the lane's environment
    python3 scripts/probe_shapes.py [--engine tokenspeed --backend cuda --n 6 --osl 64]

Per request shape (bench.SHAPES: completions or chat, with or without the chosen tokens'
logprobs) x streamed or whole x concurrency (--concs): wall time, milliseconds per output token
(each request's latency over its tokens), inter-token gaps when streamed, and the CPU seconds of
every process of the topology (the gateway, each worker's processes) over that run; py-spy
dumps of the worker processes 2 s and 6 s into the whole concurrency-1 runs of completions, chat
and chat-logprobs. Writes $OUT/probe.json and $OUT/probe-stacks.txt ($OUT default
/tmp/probe-out).

On an H200 it shows eager TokenSpeed's scheduler process on the CPU for the whole of every
run, every shape alike, its stacks in the model's Python forward: the eager launch cost, not
logprobs or chat, which CUDA graphs remove (docs/bench.md, "Request shapes: what an API costs
per step"; docs/gpu.md, table "Engine figures").
"""
import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, os.getcwd())
from e2e_test.__main__ import cluster_from_args
from e2e_test.infra.cluster import diagnostics
from e2e_test.infra.load import bench, load
from e2e_test.infra.specs import settings

OUT = Path(os.environ.get("OUT", "/tmp/probe-out"))


def procs(c):
    out = {}
    for p in c.gateway.tree():
        out[f"gateway:{p.pid}:{p.name()}"] = p
    for w in c.workers:
        for p in w.process.tree():
            try:
                out[f"{w.name}:{p.pid}:{p.name()}:{' '.join(p.cmdline()[1:4])[:80]}"] = p
            except psutil.Error:
                pass
    return out


def cpu(ps):
    d = {}
    for k, p in ps.items():
        try:
            t = p.cpu_times()
            d[k] = t.user + t.system
        except psutil.Error:
            d[k] = None
    return d


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=6)
    ap.add_argument("--osl", type=int, default=64)
    ap.add_argument("--isl", type=int, default=256)
    ap.add_argument("--engine", default="tokenspeed")
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--concs", default="1,8")
    a = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    ns = argparse.Namespace(model=settings.raw("E2E_MODEL") or settings.DEFAULT_MODEL,
                            engine=a.engine, topology="1", backend=a.backend, devices=None,
                            enforce_eager=True)
    cfg = bench.BenchConfig(n=a.n, isl=a.isl, osl=a.osl)
    rows = []
    stacks = open(OUT / "probe-stacks.txt", "w")  # noqa: SIM115 (written by the sampler threads, closed at the end)
    t_start = time.time()
    with cluster_from_args(ns) as c:
        print(f"probe: ready after {time.time() - t_start:.1f} s", flush=True)
        ps = procs(c)
        print("probe: processes:", *ps, sep="\n  ", flush=True)
        plan = [(s, st, conc) for conc in map(int, a.concs.split(",")) for s in bench.SHAPES
                for st in (False, True)]
        # warm every shape once
        for s in bench.SHAPES:
            load.run(c.gateway_url, bench.workload(c.model_name, cfg, 2, 999, s), concurrency=2)
        for i, (shape, stream, conc) in enumerate(plan):
            reqs = bench.workload(c.model_name, cfg, a.n if conc == 1 else 4 * a.n, i, shape)
            before = cpu(ps)
            dump = conc == 1 and not stream and shape in ("chat-logprobs", "chat", "completions")

            def sampler(shape=shape, stream=stream, conc=conc):
                for k, (wait, at) in enumerate(((2.0, 2.0), (4.0, 6.0))):
                    time.sleep(wait)
                    d = Path("/tmp/probe-stk") / f"stk-{shape}-{k}"
                    files = diagnostics.stack_dumps(c, d)
                    stacks.write(f"\n######## {shape} stream={stream} conc={conc} "
                                 f"at {at:.0f} s\n")
                    stacks.writelines(f"==== {f.name}\n{f.read_text()}\n" for f in files)
                    stacks.flush()
            th = threading.Thread(target=sampler) if dump else None
            if th:
                th.start()
            t0 = time.time()
            rep = load.run(c.gateway_url, reqs, concurrency=conc, stream=stream)
            wall = time.time() - t0
            if th:
                th.join()
            after = cpu(ps)
            ok = rep.ok
            toks = sum(r.output_tokens for r in ok)
            per_tok = [1000 * r.latency_s / r.output_tokens for r in ok if r.output_tokens]
            itl = [1000 * g for r in ok for g in r.itl_s]
            lp = sum(1 for r in ok if r.logprobs)
            row = {"shape": shape, "stream": stream, "conc": conc, "n": len(reqs),
                   "ok": len(ok), "errors": [f"{e.status} {e.error[:100]}" for e in rep.errors][:3],
                   "wall_s": round(wall, 2), "tokens": toks,
                   "ms_per_token_median": round(statistics.median(per_tok), 2) if per_tok else None,
                   "itl_ms_median": round(statistics.median(itl), 2) if itl else None,
                   "with_logprobs": lp,
                   "cpu_s": {k: round(after[k] - before[k], 2) for k in ps
                             if after.get(k) is not None and before.get(k) is not None
                             and after[k] - before[k] >= 0.05}}
            rows.append(row)
            print(json.dumps(row), flush=True)
    (OUT / "probe.json").write_text(json.dumps(rows, indent=1))
    stacks.close()


if __name__ == "__main__":
    main()
