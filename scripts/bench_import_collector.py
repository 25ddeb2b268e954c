"""Benchmark: a worker launcher's imports with Python's garbage collector off (the default of
launchers/e2e_warm_spawn.py) against on (`--collector-on`, the control); with `--compare
device`, with the GPU visible against hidden (`CUDA_VISIBLE_DEVICES=`, collector off both
ways): whether K interpreters that each create a CUDA context a quarter into their imports
(TokenSpeed, docs/lanes.md) import slower side by side than without a device.

Each round starts K launchers at once (K interpreters importing side by side, as a lane's
topologies booted together do), each running MODULE's import statements ahead and then the
module with `--help` (it parses its arguments and exits), alternating off and on round by
round. It reports, per mode, the median of the launchers' own `imports N s ahead` lines and
of the processes' walls.

    python scripts/bench_import_collector.py --module vllm.entrypoints.openai.api_server \\
        --parallel 1 --rounds 3
    python scripts/bench_import_collector.py --module smg_grpc_servicer.tokenspeed \\
        --parallel 10 --rounds 2 --json out.json
    python scripts/bench_import_collector.py --module smg_grpc_servicer.tokenspeed \\
        --parallel 10 --rounds 2 --compare device
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from e2e_test.infra.engines import LAUNCHERS
from e2e_test.infra.lifecycle.reaper import extend_pythonpath

LINE = re.compile(r"imports ([0-9.]+) s ahead of \S+ \((\d+) import statements, (\d+) failed, "
                  r"collector (on|off)\)")


# --compare: the two modes of each round, and what each changes (collector on, device hidden)
MODES = {"collector": (("off", {}), ("on", {"collector_on": True})),
         "device": (("visible", {}), ("hidden", {"hide_device": True}))}


def one_round(module: str, k: int, collector_on: bool, python: str,
              hide_device: bool = False) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": extend_pythonpath(LAUNCHERS)}
    if hide_device:
        env["CUDA_VISIBLE_DEVICES"] = ""
    argv = [python, "-m", "e2e_warm_spawn", "--run", module,
            *(["--collector-on"] * collector_on), "--", "--help"]
    t0 = time.monotonic()
    procs = [subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True) for _ in range(k)]
    out = []
    for p in procs:
        _, err = p.communicate(timeout=600)
        wall = time.monotonic() - t0
        m = LINE.search(err)
        if not m:
            raise SystemExit(f"no imports line from the launcher (rc {p.returncode}):\n{err[-2000:]}")
        if int(m.group(3)):
            raise SystemExit(f"{m.group(3)} import statements of {module} failed:\n{err[-2000:]}")
        out.append({"imports_s": float(m.group(1)), "wall_s": round(wall, 2), "rc": p.returncode})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--module", required=True)
    ap.add_argument("--parallel", type=int, default=1, help="launchers at once (K)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of each mode")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--compare", choices=sorted(MODES), default="collector",
                    help="collector: off against on; device: the GPU visible against hidden")
    ap.add_argument("--json", help="write the figures here")
    a = ap.parse_args()
    if a.parallel < 1 or a.rounds < 1:
        raise SystemExit("--parallel and --rounds must be at least 1")
    (a_name, a_kw), (b_name, b_kw) = MODES[a.compare]
    runs: dict[str, list[dict]] = {a_name: [], b_name: []}
    for r in range(a.rounds):         # alternating which mode goes first, round by round
        for mode, kw in ((a_name, a_kw), (b_name, b_kw))[::1 if r % 2 == 0 else -1]:
            got = one_round(a.module, a.parallel, kw.get("collector_on", False), a.python,
                            hide_device=kw.get("hide_device", False))
            runs[mode] += got
            print(f"round {r + 1} {a.compare} {mode}: imports "
                  f"{', '.join(str(g['imports_s']) for g in got)} s", flush=True)
    summary = {}
    for mode, got in runs.items():
        summary[mode] = {"n": len(got),
                         "imports_median_s": round(statistics.median(g["imports_s"] for g in got), 2),
                         "wall_median_s": round(statistics.median(g["wall_s"] for g in got), 2)}
    x, y = summary[a_name]["imports_median_s"], summary[b_name]["imports_median_s"]
    print(f"{a.module}, {a.parallel} at once, {a.rounds} rounds each: imports median "
          f"{x} s with the {a.compare} {a_name} against {y} s {b_name}"
          f"{f' ({100 * (x - y) / y:+.0f} %)' if y else ''}; "
          f"walls {summary[a_name]['wall_median_s']} s against {summary[b_name]['wall_median_s']} s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"module": a.module, "parallel": a.parallel, "rounds": a.rounds,
                       "compare": a.compare, "summary": summary, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
