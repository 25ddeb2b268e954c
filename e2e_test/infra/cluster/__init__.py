"""A topology up behind the gateway: the Cluster (cluster), smg (gateway), idleness after
traffic (idle), what a stuck run shows (diagnostics), progress lines (progress), Prometheus files
(metrics) and the signals that tear every live cluster down (signals)."""
