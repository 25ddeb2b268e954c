"""Overlapped bring-up, measured: the next topology (dp2) booting while `1`'s GSM8K pass of
32 runs, against the same in series; compiled workers, the shared compile cache. Prints one
JSON line per round (serial, overlapped, serial, overlapped). docs/cpu-lanes.md has the figures.

    E2E_DATASET_DIR=../shared/datasets python scripts/bench_overlap.py
"""
import json
import threading
import time

from e2e_test.infra.cluster.cluster import Cluster
from e2e_test.infra.verdicts.evals import gsm8k


def serial():
    t0 = time.monotonic()
    with Cluster(topology="1", backend="cpu") as c:
        tb = time.monotonic()
        gsm8k.run(c.gateway_url, c.model_name, n=32)
        te = time.monotonic() - tb
    t1 = time.monotonic()
    with Cluster(topology="dp2", backend="cpu"):
        tn = time.monotonic() - t1
    return {"mode": "serial", "eval_s": round(te, 1), "next_boot_s": round(tn, 1),
            "eval_plus_next_s": round(te + tn, 1), "total_s": round(time.monotonic() - t0, 1)}


def overlapped():
    t0 = time.monotonic()
    with Cluster(topology="1", backend="cpu") as c:
        d = Cluster(topology="dp2", backend="cpu")
        box = {}

        def boot():
            s = time.monotonic()
            d.start()
            box["boot"] = time.monotonic() - s
        tb = time.monotonic()
        th = threading.Thread(target=boot)
        th.start()
        gsm8k.run(c.gateway_url, c.model_name, n=32)
        te = time.monotonic() - tb
        th.join()
        both = time.monotonic() - tb
    d.stop()
    return {"mode": "overlapped", "eval_s": round(te, 1), "next_boot_s": round(box["boot"], 1),
            "eval_plus_next_s": round(both, 1), "total_s": round(time.monotonic() - t0, 1)}


if __name__ == "__main__":
    import argparse
    argparse.ArgumentParser(prog="python scripts/bench_overlap.py", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    for f in (serial, overlapped, serial, overlapped):
        print(json.dumps(f()), flush=True)
