"""Reading Prometheus multiprocess folders (TokenSpeed's metrics, which it serves nowhere)."""

import subprocess
import sys

from e2e_test.infra.cluster import metrics

WRITER = """
import os, sys
os.environ["PROMETHEUS_MULTIPROC_DIR"] = sys.argv[1]
from prometheus_client import Counter, Histogram
labels = {"model_name": "m", "app_key": "a"}
c = Counter("tokenspeed:request_success", "ok", labelnames=list(labels))
h = Histogram("tokenspeed:iteration_tokens_total", "step tokens", labelnames=list(labels),
              buckets=[1.0, 64.0, 512.0])
c.labels(**labels).inc(3)
for v in (300, 1, 1):
    h.labels(**labels).observe(v)
"""


def test_read_multiproc_dir_sums_what_processes_wrote(tmp_path):
    # Two engine processes writing into one folder, as TokenSpeed's scheduler and servicer do.
    for _ in range(2):
        subprocess.run([sys.executable, "-c", WRITER, str(tmp_path)], check=True)
    s = metrics.read_multiproc_dir(str(tmp_path))
    assert metrics.total(s, "tokenspeed:request_success_total") == 6
    assert metrics.total(s, "tokenspeed:iteration_tokens_total_sum") == 604
    assert metrics.total(s, "tokenspeed:iteration_tokens_total_count") == 6
    assert metrics.total(s, "tokenspeed:request_success_total", model_name="m") == 6


def test_empty_folder_reads_as_no_samples(tmp_path):
    assert metrics.read_multiproc_dir(str(tmp_path)) == {}
