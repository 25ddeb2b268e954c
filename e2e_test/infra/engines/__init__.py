"""Pure command builders: (spec, topology, plan entry, ports, options) -> WorkerCommand.

No process is started here; every builder is unit-tested for its exact argv and env.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Ports:
    """Ports for one worker: `api` serves HTTP (or gRPC); `aux` by purpose."""
    api: int
    aux: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class EngineOptions:
    backend: str = "cpu"               # cpu | cuda
    kv_connector: str = "nixl"         # nixl | example | mooncake (PD)
    kv_shared_path: str = ""           # ExampleConnector storage folder
    enforce_eager: bool = False
    max_num_seqs: int | None = None    # a deliberately small running window
    cpu_kv_cache_gib: int = 2
    protocol: str = "http"             # http | grpc
    extra_args: tuple[str, ...] = ()
    # AFD connector base port (P2pNcclAFDConnector rendezvous). The cluster fills it with the
    # FFN entry's aux "afd" port before building the attention entry; see engines/afd.py.
    afd_port: int | None = None
    # Folder for per-worker state the engine writes (TokenSpeed's Prometheus multiprocess
    # files); the cluster fills it with <cluster dir>/state. Empty: the engine keeps none.
    state_dir: str = ""
    # TokenSpeed PD/EPD: Mooncake transport between workers on one host. "nvlink" =
    # MC_INTRANODE_NVLINK=1 (smg's CI; CUDA IPC), "tcp" = MC_FORCE_TCP=1 (through host memory).
    # With neither, Mooncake picks multi-node NVLink (fabric handles), which does not publish
    # torch's cudaMalloc memory. Env E2E_MOONCAKE_TRANSPORT.
    mooncake_transport: str = "nvlink"
    # Per-worker overrides the cluster sets for TokenSpeed workers packed on one GPU (see
    # engines/tokenspeed.packed_schedule): cumulative memory utilization and start stage.
    gpu_memory_utilization: float | None = None
    start_stage: int = 0


def options_from_env(environ=None, **overrides) -> EngineOptions:
    """EngineOptions from the harness's env (E2E_ENFORCE_EAGER, E2E_MOONCAKE_TRANSPORT,
    E2E_ENGINE_ARGS: extra worker flags, shell-quoted; parsed by settings.py), with explicit
    overrides on top."""
    from .. import settings
    base = {"enforce_eager": settings.get("E2E_ENFORCE_EAGER", environ),
            "mooncake_transport": settings.get("E2E_MOONCAKE_TRANSPORT", environ),
            "extra_args": settings.get("E2E_ENGINE_ARGS", environ)}
    return EngineOptions(**{**base, **overrides})


@dataclass(frozen=True)
class WorkerCommand:
    argv: list[str]
    env: dict[str, str]                # overrides on top of the inherited environment
    protocol: str = "http"             # http | grpc
    health_path: str = "/health"
    worker_type: str = "regular"       # as smg calls the role: regular | prefill | decode | encode
    bootstrap_port: int | None = None  # PD bootstrap port smg must know (TokenSpeed)
    kv_connector: str | None = None    # smg POST /workers kv_connector (vLLM NIXL)
    metadata: dict = field(default_factory=dict)


def core_list(cores: tuple[int, ...]) -> str:
    """0,1,2,5 -> '0-2,5'; the form VLLM_CPU_OMP_THREADS_BIND and taskset accept."""
    parts, run = [], []
    for c in sorted(cores):
        if run and c == run[-1] + 1:
            run.append(c)
        else:
            if run:
                parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = [c]
    if run:
        parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(parts)
