"""Fixtures shared by the harness's own unit tests."""

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def pytest_configure(config):
    """Bytecode is written while the unit tests run, also where the caller's environment sets
    PYTHONDONTWRITEBYTECODE: the run starts a few hundred Python processes over the same
    modules (its xdist workers, the pytest and `python -m e2e_test` runs that tests start), and
    without .pyc files each compiles its imports from source and pytest rewrites the asserts
    of every module it imports again: under PYTHONDONTWRITEBYTECODE that was about a quarter
    of the run's CPU time (collecting tests/ alone 5.1 CPU-s a process, 60 % of it in
    rewriting). Set here, in each process before it collects, and in the environment that
    the workers and the tests' subprocesses inherit; the files go to __pycache__ (git
    ignores them), as without the variable."""
    sys.dont_write_bytecode = False
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)


def _real_dataset_dir() -> Path | None:
    """The offline dataset copies: $E2E_DATASET_DIR, else ../shared/datasets (CI layout)."""
    candidates = [os.environ.get("E2E_DATASET_DIR"), REPO.parent / "shared" / "datasets",
                  REPO / "shared" / "datasets", "/work/shared/datasets"]
    for c in candidates:
        if c and (Path(c) / "gsm8k" / "test.jsonl").is_file():
            return Path(c)
    return None


@pytest.fixture
def real_datasets(monkeypatch) -> Path:
    """Point the loaders at the real GSM8K/MMLU copies (skips where there are none)."""
    d = _real_dataset_dir()
    if d is None:
        pytest.skip("no offline dataset copies (set E2E_DATASET_DIR)")
    monkeypatch.setenv("E2E_DATASET_DIR", str(d))
    return d


@pytest.fixture
def fake_gpus(monkeypatch):
    """NVML lists GPUs 0-7 (a machine with eight): device lists given to the planner are
    checked against that instead of this machine, where NVML may see none (then any given
    GPU id is an error)."""
    from e2e_test.infra.specs import devices
    monkeypatch.setattr(devices, "nvml_inventory", lambda: tuple(range(8)))
    return tuple(range(8))


@pytest.fixture(autouse=True)
def _whole_machine_per_test(monkeypatch):
    """Under `pytest -n N` each xdist worker's environment says which share of the devices it
    leases (devices.xdist_share). The unit tests plan and collect on their own, in this process
    or in a pytest they start, and expect the machine's whole core list, as outside xdist: the
    worker count is removed for each test (the worker id stays: it keeps the workers' port
    slices apart, ports.py)."""
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT", raising=False)
