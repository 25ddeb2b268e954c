"""Start/stop a topology over and over; count what each cycle left behind.

After every cycle: processes of the cluster still alive, listening ports the harness had
allocated, /dev/shm entries that were not there before the first cycle, and the cycle's own
teardown verdict (GPU memory, what could not be verified): any of them makes the run not ok.
"""

from __future__ import annotations

import time

from ..lifecycle import teardown


def run_cycles(make_cluster, n: int, log=print) -> dict:
    shm_before = teardown.shm_snapshot()
    rows = []
    for i in range(1, n + 1):
        t0 = time.monotonic()
        c = make_cluster()
        with c:
            reply = c.chat("Say OK.", max_tokens=2)
            assert reply["choices"], reply
        rep = c.teardown_report
        left_procs = sum(len(p.tree()) for p in [c.gateway] + [w.process for w in c.workers] if p)
        row = {"cycle": i, "ready_s": c.timing.topology_ready_s,
               "teardown_s": rep.seconds, "escalated": rep.escalated,
               "processes_left": left_procs,
               "ports_listening": len(teardown.listening_ports(c.allocated_ports) or []),
               "new_shm": len(teardown.shm_snapshot() - shm_before),
               "shm_removed_by_harness": len(rep.shm_removed),
               "teardown_ok": rep.ok, "teardown": rep.verdict(),
               "wall_s": round(time.monotonic() - t0, 1)}
        rows.append(row)
        log(f"cycle {i}/{n}: ready {row['ready_s']} s, teardown {row['teardown_s']} s, "
            f"processes left {row['processes_left']}, ports listening {row['ports_listening']}, "
            f"new /dev/shm {row['new_shm']} (harness removed {row['shm_removed_by_harness']}), "
            f"teardown {row['teardown']}")
    totals = {k: sum(r[k] for r in rows) for k in ("processes_left", "ports_listening")}
    totals["new_shm"] = len(teardown.shm_snapshot() - shm_before)
    totals["teardowns_not_clean"] = sum(not r["teardown_ok"] for r in rows)
    return {"cycles": n, "rows": rows, "totals": totals, "ok": not any(totals.values())}
