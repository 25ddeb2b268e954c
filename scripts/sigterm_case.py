"""Experiment, not a lane (issue 22, the SIGTERM case on a GPU): a Python-API driver holding
`1` is sent SIGTERM, as `timeout` sends it; its handler tears the topology down, and the
teardown report (cluster/cluster.json) says how long GPU memory took to come back
(gpu_settle_s) or names who holds it. Run by scripts/sigterm_case.sh, which sends the signal
and records nvidia-smi around it."""
import argparse
import time

from e2e_test.infra.cluster import signals as lifecycle
from e2e_test.infra.cluster.cluster import Cluster

p = argparse.ArgumentParser(prog="python scripts/sigterm_case.py", description=__doc__)
p.add_argument("out", help="folder for the cluster's results and the `ready` stamp")
out = p.parse_args().out
lifecycle.install()
with Cluster(topology="1", backend="cuda", results_dir=out + "/cluster") as c:
    r = c.chat("Say OK.", max_tokens=8)
    print("READY", c.timing.total_ready_s, repr(r["choices"][0]["message"]["content"]), flush=True)
    with open(out + "/ready", "w") as f:
        f.write(str(time.time()))
    time.sleep(600)
