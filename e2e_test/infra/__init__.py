"""The harness library: usable from a Python prompt, without pytest.

Sub-packages by purpose:
  specs/      what a run is: topology, model registry, plan, weights, devices, settings
  engines/    each engine's knowledge behind one interface (vllm, tokenspeed, afd)
  lifecycle/  processes, their readiness, reaper, teardown, launchers, simulated hosts, ports
  cluster/    the Cluster, the gateway, idleness, diagnostics, progress, metrics, signals
  load/       requests, bursts, serving faults, the A/B bench, cycles
  verdicts/   the comparison oracle, comparisons, evals and datasets, the proofs' shared parts
  reports/    result files, markdown report and verdict lines, HTML and time reports, the
              browser check
and beside them errors.py, stats.py and startup.py (the start-up check over all of them).
"""
