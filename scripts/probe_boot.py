"""Where a boot's seconds go, on real topologies (a diagnostic, not a verdict).

    source scripts/gpu_lane.sh tokenspeed probe      # on a runner: the lane's environment
    python3 scripts/probe_boot.py --engine tokenspeed --topologies 1,1p1d [--requests 4]
    python3 scripts/probe_boot.py --analyze DIR      # here: the timeline of what came back
    python3 scripts/probe_boot.py --first-forward DIR   # each worker's first forward, by cost

Boots each topology alone, one after another, with py-spy recording every worker's processes
from its launch (`record --pid --subprocesses --idle --nonblocking`, speedscope format, so the
samples keep their order), then sends --requests chat completions through its gateway one after
another, timing each, and stops it. Writes $OUT/probe-boot.json (each topology's Cluster.timing
with its worker phases, the requests' latencies and statuses, the gateway's readiness probes that
failed) and $OUT/spy.tar.xz (one speedscope file per worker, its logs beside them); $OUT
defaults to /tmp/probe-out.

`--analyze DIR` reads those back and prints, per worker process and thread that was busy, the
frames it spent each second of its boot in (the innermost frame of the project's or the
engine's code under the most samples of that second), so a boot says whether its seconds went to
imports, a compile, a collective's init, a host allocation or a sleep.
"""
import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from collections import Counter
from pathlib import Path

import httpx

sys.path.insert(0, os.getcwd())

OUT = Path(os.environ.get("OUT", "/tmp/probe-out"))


def probe(a) -> int:
    from e2e_test.__main__ import cluster_from_args
    from e2e_test.infra.cluster import cluster as cluster_mod
    from e2e_test.infra.cluster import signals as lifecycle
    from e2e_test.infra.cluster.diagnostics import pyspy_exe

    lifecycle.install()
    spy_exe = pyspy_exe()
    if a.spy_s > 0 and spy_exe is None:
        print("probe_boot: py-spy is not installed (or give --spy-s 0)", file=sys.stderr)
        return 2
    OUT.mkdir(parents=True, exist_ok=True)
    spy_dir = Path("/tmp/probe-spy")
    shutil.rmtree(spy_dir, ignore_errors=True)
    spy_dir.mkdir(parents=True)
    spies: list[subprocess.Popen] = []
    orig_launch = cluster_mod.Cluster._launch

    extra_env = dict(kv.split("=", 1) for kv in a.env)

    def launch(self, w):
        if extra_env:
            w.command = dataclasses.replace(w.command, env={**w.command.env, **extra_env})
        orig_launch(self, w)
        if a.spy_s <= 0:
            return
        f = spy_dir / f"{self.topology.name}-{w.name}.json"
        with open(f.with_suffix(".err"), "w") as err:     # Popen keeps its own copy
            spies.append(subprocess.Popen(
                [spy_exe, "record", "--pid", str(w.process.pid), "--subprocesses", "--idle",
                 "--nonblocking", "--rate", str(a.rate), "--duration", str(a.spy_s),
                 "--format", "speedscope", "--output", str(f)],
                stdout=subprocess.DEVNULL, stderr=err))

    cluster_mod.Cluster._launch = launch
    report = {"engine": a.engine, "topologies": {}}
    for topo in a.topologies.split(","):
        a.topology = topo
        c = cluster_from_args(a, results_dir=spy_dir / f"cluster-{topo}")
        t0 = time.monotonic()
        entry: dict = {}
        try:
            c.start()
            entry["start_s"] = round(time.monotonic() - t0, 2)
            reqs = []
            with httpx.Client(timeout=120) as h:
                for i in range(a.requests):
                    r0 = time.monotonic()
                    try:
                        r = h.post(f"{c.gateway_url}/v1/chat/completions", json={
                            "model": c.model_name, "max_tokens": 16, "temperature": 0,
                            "messages": [{"role": "user", "content": f"Count to {i + 3}."}]})
                        reqs.append({"status": r.status_code,
                                     "s": round(time.monotonic() - r0, 3)})
                    except httpx.HTTPError as e:
                        reqs.append({"error": repr(e), "s": round(time.monotonic() - r0, 3)})
            entry["requests"] = reqs
        except Exception as e:            # noqa: BLE001 - a probe reports what it saw
            entry["error"] = repr(e)[:2000]
        finally:
            entry["timing"] = json.loads(json.dumps(c.timing.__dict__, default=str))
            for p in spies:
                try:
                    p.wait(timeout=a.spy_s + 30)
                except subprocess.TimeoutExpired:
                    p.kill()
            spies.clear()
            c.stop(verify_strict=False)
        report["topologies"][topo] = entry
        print(topo, json.dumps({k: v for k, v in entry.items() if k != "timing"}), flush=True)
        print(topo, "phases", json.dumps(entry["timing"].get("phases")), flush=True)
        print(topo, "gateway_ready_s", entry["timing"].get("gateway_ready_s"),
              "total_ready_s", entry["timing"].get("total_ready_s"), flush=True)
    (OUT / "probe-boot.json").write_text(json.dumps(report, indent=1))
    with tarfile.open(OUT / "spy.tar.xz", "w:xz", preset=1) as tar:
        tar.add(spy_dir, arcname="spy")
    return 0


def _frame_name(fr: dict) -> str:
    f = fr.get("file") or ""
    short = "/".join(f.split("/")[-2:]) if f else ""
    return f"{fr.get('name')} ({short}:{fr.get('line')})"


def _speedscopes(path: Path):
    """(file, document) of every speedscope file under `path`."""
    for fpath in sorted(path.rglob("*.json")):
        if fpath.name == "probe-boot.json":
            continue
        try:
            doc = json.loads(fpath.read_text())
        except (ValueError, OSError):
            continue
        if "profiles" in doc:
            yield fpath, doc


def analyze(path: Path, rate: int, top: int) -> int:
    """Per busy thread of every speedscope file under `path`: each second's most sampled
    innermost frame that is not a leaf of the interpreter's own machinery."""
    for fpath, doc in _speedscopes(path):
        frames = doc["shared"]["frames"]
        print(f"=== {fpath.name}")
        for prof in doc["profiles"]:
            samples, weights = prof.get("samples", []), prof.get("weights", [])
            if not samples:
                continue
            buckets: dict[int, Counter] = {}
            t = 0.0
            for stack, w in zip(samples, weights):
                sec = int(t)
                t += w if prof.get("unit") == "seconds" else w / rate
                leaf = _pick(stack, frames)
                buckets.setdefault(sec, Counter())[leaf] += 1
            busy = [s for s, cnt in buckets.items()
                    if not all(_is_idle(k) for k in cnt)]
            if not busy:
                continue
            print(f"--- {prof.get('name')} ({len(samples)} samples, {t:.1f} s)")
            for sec in sorted(buckets):
                cnt = buckets[sec]
                line = "; ".join(f"{k} x{n}" for k, n in cnt.most_common(top))
                print(f"  {sec:3d}s {line}")
    return 0


# The first forward of a worker's scheduler (--first-forward): from its first sample inside one
# of these frames (TokenSpeed's EventLoop._dispatch_forward: a request's forward;
# CudaGraphWrapper.capture: the graph capture's warm-up forwards) to the last before a pause of
# more than half a second; each of its samples counted under the first of FORWARD_COSTS whose
# file or function name matches, innermost first. Only a function's frame counts: py-spy's frame
# of the process (no file) is named by its command line, which can name a function too (the
# launcher's `--call triton.runtime.cache:triton_key`).
FIRST_FORWARD_MARKERS = ("_dispatch_forward", "CudaGraphWrapper.capture")
FORWARD_COSTS = (("CuTe DSL (cute.compile)", "file", "cutlass"),
                 ("triton's cache key", "name", "triton_key"),
                 ("triton", "file", "triton"),
                 ("torch.compile", "file", "torch/_dynamo"),
                 ("torch.compile", "file", "torch/_inductor"))


def first_forward(path: Path, rate: int) -> int:
    """Per speedscope file under `path`: the span of its scheduler's first forward and what
    its samples were in (FORWARD_COSTS; the rest `other`)."""
    for fpath, doc in _speedscopes(path):
        frames = doc["shared"]["frames"]
        for prof in doc["profiles"]:
            samples = prof.get("samples", [])
            names = [{frames[i]["name"] for i in st} for st in samples]
            idx = [k for k, n in enumerate(names)
                   if any(m in x for m in FIRST_FORWARD_MARKERS for x in n)]
            if not idx:
                continue
            end = idx[0]
            for k in idx:
                if k - end > rate // 2:
                    break
                end = k
            costs: Counter = Counter()
            for st in samples[idx[0]:end + 1]:
                key = "other"
                for i in reversed(st):
                    fr = frames[i]
                    if not fr.get("file"):
                        continue                 # the process's frame, not a function's
                    hit = next((label for label, where, text in FORWARD_COSTS
                                if text in fr[where if where == "file" else "name"]), None)
                    if hit:
                        key = hit
                        break
                costs[key] += 1
            print(f"=== {fpath.name}: {prof.get('name')}: first forward {idx[0] / rate:.2f}-"
                  f"{end / rate:.2f} s ({(end - idx[0] + 1) / rate:.2f} s)")
            for label, n in costs.most_common():
                print(f"  {n / rate:5.2f} s  {label}")
    return 0


_IDLE = ("select", "poll", "epoll_wait", "wait", "sleep", "_wait_for_tstate_lock", "accept",
         "recv", "read", "acquire", "recv_multipart", "_poll", "get", "run_forever")


def _is_idle(name: str) -> bool:
    return name.split(" ")[0] in _IDLE


def _own(fr: dict) -> bool:
    """A frame of a library's or the engine's code, not the interpreter's import machinery
    or the standard library."""
    f = fr.get("file") or ""
    return bool(f) and not f.startswith("<") and (
        "site-packages" in f or "/lib/python3." not in f)


def _pick(stack: list[int], frames: list[dict]) -> str:
    """The innermost frame of library or engine code on the stack, with the innermost frame
    under it when that is the interpreter's (an import, a sleep, a lock)."""
    if not stack:
        return "(empty)"
    leaf = frames[stack[-1]]
    for i in range(len(stack) - 1, -1, -1):
        fr = frames[stack[i]]
        if _own(fr):
            return _frame_name(fr) if fr is leaf else f"{_frame_name(fr)} > {leaf.get('name')}"
    return _frame_name(leaf)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", default="tokenspeed")
    ap.add_argument("--topologies", default="1,1p1d")
    ap.add_argument("--model", default=os.environ.get("E2E_MODEL", "SmolLM2-135M-Instruct"))
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--devices", default=None)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--rate", type=int, default=100)
    ap.add_argument("--spy-s", type=int, default=45,
                    help="seconds py-spy records from each launch; 0: no py-spy (timings only)")
    ap.add_argument("--env", action="append", default=[], metavar="K=V",
                    help="a variable for every worker, over its builder's (an A/B of a setting)")
    ap.add_argument("--analyze", type=Path, default=None)
    ap.add_argument("--first-forward", type=Path, default=None,
                    help="what each worker's first forward spent its seconds on (py-spy files)")
    ap.add_argument("--top", type=int, default=2)
    a = ap.parse_args()
    if a.analyze:
        return analyze(a.analyze, a.rate, a.top)
    if a.first_forward:
        return first_forward(a.first_forward, a.rate)
    return probe(a)


if __name__ == "__main__":
    sys.exit(main())
