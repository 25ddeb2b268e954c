"""Processes from start to end: a worker's process (process), how it tells it is ready
(readiness), the reaper and its guardian (reaper), the teardown verdict (teardown), the
launchers and the WorkerCommand they start (launcher: this host; ray_launcher: the nodes of a Ray
cluster), simulated hosts (simhosts) and ports (ports)."""
