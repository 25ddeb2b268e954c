"""diagnostics.nested_failure: a nested pytest session's failure message opens with the first
error of the worker that failed (process.first_error of its log), not only the output's tail.
Synthetic outputs and logs shaped as real ones (no engine starts)."""

import json

from e2e_test.infra.cluster import diagnostics

PY = "/root/.pyenv/versions/3.11.7/lib/python3.11"
VLLM = "/venv/lib/python3.11/site-packages/vllm"

# A vLLM worker whose engine core died at its start: the spawned child could not open its
# parent's semaphore (SemLock._rebuild; this traceback is the one Python 3.11 prints for a
# spawn child whose /dev/shm semaphore was removed), then the API server raised "See root cause
# above", and at its exit a finalizer failed the same way.
SEMLOCK = f"""\
Traceback (most recent call last):
  File "<string>", line 1, in <module>
  File "{PY}/multiprocessing/spawn.py", line 122, in spawn_main
    exitcode = _main(fd, parent_sentinel)
               ^^^^^^^^^^^^^^^^^^^^^^^^^^
  File "{PY}/multiprocessing/spawn.py", line 132, in _main
    self = reduction.pickle.load(from_parent)
           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
  File "{PY}/multiprocessing/synchronize.py", line 115, in __setstate__
    self._semlock = _multiprocessing.SemLock._rebuild(*state)
                    ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
FileNotFoundError: [Errno 2] No such file or directory
"""
ROOT_CAUSE_ABOVE = f"""\
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "{VLLM}/entrypoints/openai/api_server.py", line 1900, in <module>
    uvloop.run(run_server(args))
  File "{VLLM}/v1/engine/core_client.py", line 480, in __init__
    with launch_core_engines(vllm_config, executor_class, log_stats) as (engine_manager,
  File "{VLLM}/v1/engine/utils.py", line 1431, in wait_for_engine_startup
    raise RuntimeError(
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {{'EngineCore': 1}}
"""
FINALIZER = f"""\
Traceback (most recent call last):
  File "{PY}/multiprocessing/util.py", line 300, in _run_finalizers
    finalizer()
  File "{PY}/multiprocessing/synchronize.py", line 87, in _cleanup
    sem_unlink(name)
FileNotFoundError: [Errno 2] No such file or directory
"""


def info(n: int, pid: int = 14784) -> str:
    return "".join(f"(APIServer pid={pid}) INFO 12-06 06:35:{i % 60:02d} [api_utils.py:286] "
                   f"non-default args: {{'host': '127.0.0.1', 'port': 20226, 'model': "
                   f"'/root/.cache/e2e_test/models/SmolLM2-135M-Instruct', 'line': {i}}}\n"
                   for i in range(n))


def worker_log(n_after: int = 30) -> str:
    return ("# worker-0: /venv/bin/python -m vllm.entrypoints.openai.api_server --port 20226\n"
            + info(12) + SEMLOCK + ROOT_CAUSE_ABOVE + FINALIZER
            + "".join(f"{PY}/multiprocessing/resource_tracker.py:254: UserWarning: "
                      f"resource_tracker: There appear to be {i} leaked semaphore objects to "
                      "clean up at shutdown\n  warnings.warn('resource_tracker: There appear "
                      "to be %d '\n" for i in range(n_after)))


def cluster_dir(results, name="vllm-1-14779-1", topology="1", log=None):
    d = results / "clusters" / name
    (d / "logs").mkdir(parents=True)
    (d / "logs" / "worker-0.log").write_text(worker_log() if log is None else log)
    (d / "cluster.json").write_text(json.dumps({
        "name": name, "engine": "vllm", "topology": topology,
        "workers": [{"name": "worker-0", "log": str(d / "logs" / "worker-0.log")}]}))
    return d


def session_output(error: str, n_tests: int = 6) -> str:
    """A nested `pytest -v` whose topology `1` did not start: each of its tests fails at setup
    with the same error, and the ERRORS section and the short summary end the output."""
    tests = [f"e2e_test/router/test_evals.py::test_eval[vllm-1-{i}]" for i in range(n_tests)]

    def rule(title):
        return f" {title} ".center(80, "=") + "\n"
    head = (rule("test session starts") + "boot schedule: together: E2E_BOOT_SCHEDULE=together\n"
            + "".join(f"{t} ERROR\n" for t in tests))
    errors = "".join(
        f"____________ ERROR at setup of {t.split('::')[1]} ____________\n"
        "    def get(self, key, make) -> Cluster:\n"
        ">       raise self.failed[key]\n"
        + "".join(f"E   {ln}\n" for ln in error.splitlines())
        + "e2e_test/pytest_plugin.py:461: StartupError\n" for t in tests)
    summary = (rule("short test summary info")
               + "".join(f"ERROR {t} - e2e_test.infra.errors.StartupError: topology 1 (vllm)"
                         ": worker-0 exited whi...\n" for t in tests)
               + rule(f"{n_tests} errors in 97.31s"))
    return head + rule("ERRORS") + errors + summary


def startup_error(log_path, log: str) -> str:
    """process.failure_summary's text for that log, as StartupError carries it."""
    tail = "\n".join(log.splitlines()[-25:])
    return ("e2e_test.infra.errors.StartupError: topology 1 (vllm): worker-0 exited while "
            "starting (exit code 1): [error] RuntimeError: Engine core initialization failed\n"
            f"argv: /venv/bin/python -m vllm.entrypoints.openai.api_server --port 20226\n"
            f"log: {log_path}\nlast traceback:\n{ROOT_CAUSE_ABOVE}log tail:\n{tail}")


def test_a_failed_start_is_named_by_its_workers_first_error(tmp_path):
    results = tmp_path / "results"
    log = cluster_dir(results) / "logs" / "worker-0.log"
    out = session_output(startup_error(log, log.read_text()))
    # negative control: the tail alone (the message before) holds the later tracebacks only
    assert len(out) > 4000 and "SemLock" not in out[-4000:]
    msg = diagnostics.nested_failure(out, results, 1)
    first, second = msg.splitlines()[:2]
    assert first == "nested pytest exited 1"
    assert second == f"first error of vllm-1-14779-1/worker-0 (line 14 of {log}):"
    block = msg.split("\n", 2)[2].split("\nlast 4000 characters")[0]
    assert block == SEMLOCK.rstrip("\n")
    assert msg.endswith("last 4000 characters of its output:\n" + out[-4000:])


def test_a_worker_that_died_is_found_through_cluster_json(tmp_path):
    """WorkerDied names the worker and its topology, not its log: cluster.json does."""
    results = tmp_path / "results"
    cluster_dir(results, "vllm-dp2-14779-2", "dp2", log=info(3) + (
        "(APIServer pid=1) ERROR 12-06 06:36:55 [core.py:1510] EngineCore failed to start.\n"
        + "".join(f"(APIServer pid=1) ERROR 12-06 06:36:55 [core.py:1510] {ln}\n"
                  for ln in SEMLOCK.splitlines())) + info(3))
    one = cluster_dir(results)                   # `1`: its log has an error, but `1` is fine
    out = session_output("e2e_test.infra.errors.WorkerDied: topology dp2 (vllm): worker-0 "
                         "(pid 14786, node 1 (10.77.0.3)) died: exit code 1") + "x" * 5000
    msg = diagnostics.nested_failure(out, results, 1)
    lines = msg.splitlines()
    assert lines[1].startswith("first error of vllm-dp2-14779-2/worker-0 (line 4 of ")
    assert lines[2].endswith("EngineCore failed to start.")
    assert lines[3].endswith("[core.py:1510] Traceback (most recent call last):")
    assert lines[14].endswith("FileNotFoundError: [Errno 2] No such file or directory")
    assert lines[15] == "last 4000 characters of its output:"
    assert str(one) not in msg


def test_an_output_that_names_no_failed_worker_says_so(tmp_path):
    """Every vLLM log shows an ERROR record at a clean teardown: a log the output does not
    name as a failed worker's is not searched."""
    results = tmp_path / "results"
    cluster_dir(results)
    out = "e2e_test/router/test_chat.py::test_chat_non_streaming[vllm-1] FAILED\n" + \
        "E   AssertionError: 'Paris' not in 'London'\n"
    msg = diagnostics.nested_failure(out, results, 1, tail=2000)
    assert msg.splitlines()[1].startswith("its output names no worker that failed")
    assert "first error" not in msg and msg.endswith(out)


def test_a_named_log_without_an_error_line_says_so(tmp_path):
    results = tmp_path / "results"
    log = cluster_dir(results, log=info(40)) / "logs" / "worker-0.log"
    out = session_output(startup_error(log, log.read_text()))
    msg = diagnostics.nested_failure(out, results, 1)
    assert msg.splitlines()[1] == ("no error line (a traceback, an ERROR record, a known error) "
                                   f"in {log}")


def test_a_log_outside_the_results_folder_is_not_read(tmp_path):
    """The session's own folder only: a path in the output elsewhere is not its worker's."""
    results = tmp_path / "results"
    results.mkdir()
    other = tmp_path / "other.log"
    other.write_text(SEMLOCK)
    msg = diagnostics.nested_failure(f"E   log: {other}\n", results, 1)
    assert "first error" not in msg and "names no worker that failed" in msg
