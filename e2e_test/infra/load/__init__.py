"""Traffic through the gateway: requests and the watchdog (load), bursts (bursts), serving
faults (serving_faults), the A/B bench and its statistics (bench, abstats), start/stop cycles
(cycles)."""
