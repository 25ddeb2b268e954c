"""Processes from start to end: a worker's process (process), the reaper and its guardian
(reaper), the teardown verdict (teardown), the launchers (launcher: this host; ray_launcher: the
nodes of a Ray cluster), simulated hosts (simhosts) and ports (ports)."""
