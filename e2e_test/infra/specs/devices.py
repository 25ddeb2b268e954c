"""The machine's devices, in one place: the NVML session (`nvml()`, the only place NVML is
opened), the GPU inventory, this process's CPU affinity, the device-list parser, the compact
core list (0-2,5), the pytest-xdist split of an ordered device list, and the checks of given
ids against the machine (SettingError, one line).

Nothing here reads the harness's variables: callers pass the text or the ids.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

from ..errors import ConfigError, SettingError


@contextmanager
def nvml():
    """An NVML session: yields the pynvml module, initialized, or None where NVML cannot be
    used (nvidia-ml-py missing, no driver); shut down again on the way out."""
    try:
        import pynvml
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - ImportError, NVMLError_LibraryNotFound, ...
        pynvml = None
    if pynvml is None:
        yield None
        return
    try:
        yield pynvml
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass


def nvml_inventory() -> tuple[int, ...]:
    """The GPU ids NVML lists; () where it lists none or cannot be used."""
    with nvml() as n:
        if n is None:
            return ()
        try:
            return tuple(range(n.nvmlDeviceGetCount()))
        except Exception:  # noqa: BLE001
            return ()


def gpu_free_share(devices) -> dict[int, float] | None:
    """Each device's free memory as a share of its total (NVML), or None where NVML cannot
    say (the lane-level placement then boots one topology after another)."""
    if not devices:
        return {}
    with nvml() as n:
        if n is None:
            return None
        try:
            out = {}
            for d in devices:
                info = n.nvmlDeviceGetMemoryInfo(n.nvmlDeviceGetHandleByIndex(d))
                out[d] = round(info.free / info.total, 4)
            return out
        except Exception:  # noqa: BLE001
            return None


def nvml_why() -> str:
    """Why NVML lists no GPU here, in words."""
    try:
        import pynvml
    except ImportError:
        return "nvidia-ml-py is not installed: pip install -e ."
    try:
        pynvml.nvmlInit()
    except Exception as e:  # noqa: BLE001 - NVMLError_LibraryNotFound, DriverNotLoaded, ...
        return f"NVML: {str(e) or type(e).__name__}"
    try:
        return f"NVML lists {pynvml.nvmlDeviceGetCount()} GPU(s)"
    finally:
        pynvml.nvmlShutdown()


def affinity() -> tuple[int, ...]:
    """This process's CPU cores."""
    return tuple(sorted(os.sched_getaffinity(0)))


def parse_ids(raw: str) -> tuple[int, ...]:
    """'0, 2,4' -> (0, 2, 4): distinct ids >= 0; ValueError(why) otherwise."""
    items = [t.strip() for t in raw.split(",") if t.strip()]
    if not items:
        raise ValueError("empty list")
    try:
        devs = tuple(int(t) for t in items)
    except ValueError:
        raise ValueError("device ids must be integers") from None
    if any(d < 0 for d in devs):
        raise ValueError("device ids must be >= 0")
    dup = sorted({d for d in devs if devs.count(d) > 1})
    if dup:
        raise ValueError(f"duplicate device(s) {dup}")
    return devs


def parse_device_list(text: str, source: str) -> tuple[int, ...]:
    """parse_ids with a ConfigError naming `source` (CUDA_VISIBLE_DEVICES, --devices)."""
    try:
        return parse_ids(text)
    except ValueError as e:
        if str(e) == "empty list":
            raise ConfigError(f"{source}: empty device list") from None
        raise ConfigError(f"{source}={text!r}: {e}") from None


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


def rank_core_lists(cores: tuple[int, ...], ranks: int) -> str:
    """A worker's cores split into one list per rank, joined by `|`: the form
    VLLM_CPU_OMP_THREADS_BIND takes for a tensor-parallel worker on CPU (rank r binds the r-th
    list); the first ranks take one more core on a remainder. One rank: core_list."""
    if ranks <= 1:
        return core_list(cores)
    if len(cores) < ranks:
        raise ConfigError(f"{ranks} ranks need a core each; got {len(cores)} "
                          f"({','.join(map(str, cores))})")
    share, extra = divmod(len(cores), ranks)
    out, pos = [], 0
    for r in range(ranks):
        take = share + (1 if r < extra else 0)
        out.append(core_list(tuple(cores[pos:pos + take])))
        pos += take
    return "|".join(out)


_SHARED = False


def share_between_workers() -> None:
    """This pytest-xdist worker takes the whole list, as every other worker does: its
    topologies share the devices by memory (pytest -n auto --dist loadgroup; coboot.assign)
    instead of taking a slice each."""
    global _SHARED
    _SHARED = True


def xdist_share(devices: tuple[int, ...], environ: dict | None = None) -> tuple[int, ...]:
    """Under pytest-xdist (-n N) each worker leases its own slice of the ordered list:
    worker k of N gets every N-th device starting at k, so topologies tested in parallel
    never share a device (or CPU core). Without xdist, or where the workers share the
    devices by memory (share_between_workers): the whole list."""
    env = os.environ if environ is None else environ
    if _SHARED:
        return devices
    try:
        count = int(env.get("PYTEST_XDIST_WORKER_COUNT", "1"))
        k = int(env.get("PYTEST_XDIST_WORKER", "gw0").lstrip("gw"))
    except ValueError:
        return devices
    if count <= 1:
        return devices
    share = devices[k % count::count]
    if not share:
        raise ConfigError(f"pytest-xdist worker gw{k} of {count} gets none of the "
                          f"{len(devices)} device(s) {','.join(map(str, devices))}; "
                          f"use at most -n {len(devices)}")
    return share


def _ranges(ids) -> str:
    return core_list(tuple(ids)) or "(none)"


def check_cpu_ids(cores, source: str, text: str | None = None, present=affinity) -> None:
    have = present()
    missing = [c for c in cores if c not in have]
    if missing:
        raise SettingError(f"{source}={text or ','.join(map(str, cores))!r}: core(s) "
                           f"{','.join(map(str, missing))} not in this process's CPU affinity; "
                           f"accepts ids among {_ranges(have)}")


def check_gpu_ids(devices, source: str, text: str | None = None, present=None) -> None:
    """GPU ids must be ones NVML lists. Where NVML lists none (no driver, no GPU, or
    nvidia-ml-py missing) no id can be checked, so any id is an error, never a silent pass."""
    have = tuple((present or nvml_inventory)())
    if not have:
        raise SettingError(f"{source}={text or ','.join(map(str, devices))!r}: GPU id(s) "
                           f"cannot be checked, NVML sees no GPU here ({nvml_why()}); "
                           "accepts ids of GPUs NVML lists (or --backend cpu for CPU cores)")
    missing = [d for d in devices if d not in have]
    if missing:
        raise SettingError(f"{source}={text or ','.join(map(str, devices))!r}: GPU(s) "
                           f"{','.join(map(str, missing))} not present; accepts ids among "
                           f"{_ranges(have)} (NVML)")
