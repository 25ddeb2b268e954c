"""Log classification, and ManagedProcess with real short-lived children (python -c ...)."""

import os
import signal
import sys
import time

import psutil
import pytest

from e2e_test.infra.lifecycle.process import (
    ManagedProcess,
    classify_log,
    first_error,
    last_traceback,
)

# -- classify_log / first_error / last_traceback ---------------------------------------------------

CUDA_OOM = """\
INFO 05-01 10:00:01 [gpu_model_runner.py:1800] Loading model weights took 14.99 GiB
ERROR 05-01 10:00:05 [core.py:586] EngineCore failed to start.
Traceback (most recent call last):
  File "/venv/lib/python3.12/site-packages/vllm/v1/worker/gpu_model_runner.py", line 2010, in profile_run
    hidden_states = self._dummy_run(self.max_num_tokens)
torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which 1.06 GiB is free.
RuntimeError: Engine core initialization failed. See root cause above.
"""

NCCL = """\
INFO 05-01 10:00:01 [parallel_state.py:1064] rank 0 in world size 2 is assigned as DP rank 0
Traceback (most recent call last):
  File "/venv/lib/python3.12/site-packages/torch/distributed/c10d_logger.py", line 81, in wrapper
torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1970, unhandled system error (run with NCCL_DEBUG=INFO for details), NCCL version 2.21.5
"""

ADDRESS_IN_USE = """\
INFO:     Started server process [4242]
INFO:     Waiting for application startup.
INFO:     Application startup complete.
ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', 20001): address already in use
INFO:     Waiting for application shutdown.
"""

IMPORT = """\
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "/venv/lib/python3.12/site-packages/vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py", line 42, in <module>
    from nixl._api import nixl_agent as NixlWrapper
ModuleNotFoundError: No module named 'nixl'
"""

PLAIN = """\
INFO 05-01 10:00:01 [api_server.py:1000] vLLM API server version 0.11.0
Traceback (most recent call last):
  File "/venv/lib/python3.12/site-packages/vllm/engine/arg_utils.py", line 1200, in create_engine_config
    raise ValueError(f"bad value")
ValueError: x
"""


@pytest.mark.parametrize("text,kind,line", [
    (CUDA_OOM, "cuda_oom", CUDA_OOM.splitlines()[5]),
    (NCCL, "nccl", NCCL.splitlines()[3]),
    (ADDRESS_IN_USE, "address_in_use", ADDRESS_IN_USE.splitlines()[3]),
    (IMPORT, "import", "ModuleNotFoundError: No module named 'nixl'"),
    ("Traceback (most recent call last):\n  File \"x.py\", line 1\n"
     + "ImportError: cannot import name 'foo' from 'bar'\n",
     "import", "ImportError: cannot import name 'foo' from 'bar'"),
    (PLAIN, "error", "ValueError: x"),
    ("OSError: [Errno 98] Address already in use\n", "address_in_use",
     "OSError: [Errno 98] Address already in use"),
    ("worker died\nKilled\n", "oom", "Killed"),
])
def test_classify_log(text, kind, line):
    assert classify_log(text) == (kind, line)


def test_classify_log_prefers_the_root_cause():
    # The OOM line beats the later generic RuntimeError line.
    kind, line = classify_log(CUDA_OOM)
    assert kind == "cuda_oom"
    assert line.startswith("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate")
    assert classify_log(PLAIN + NCCL)[0] == "nccl"


def test_classify_log_nothing():
    assert classify_log("INFO all good\n  indented ValueError: not at line start\n") is None
    assert classify_log("") is None


def test_classify_log_truncates_long_lines():
    kind, line = classify_log("ValueError: " + "x" * 1000)
    assert kind == "error" and len(line) == 300


def test_last_traceback():
    assert last_traceback("no traceback here") == ""
    tb = last_traceback(IMPORT + "\nnoise\n" + PLAIN)
    assert tb.startswith("Traceback (most recent call last)")
    assert tb.splitlines()[-1] == "ValueError: x"
    assert "nixl" not in tb
    assert len(last_traceback(PLAIN, max_lines=2).splitlines()) == 2


# A spawned child that failed before its parent's "See root cause above" (vLLM's engine core):
# the root cause is the log's first traceback, the last one names none.
CHILD_FAILED = """\
(APIServer pid=7) INFO 12-06 06:35:30 [api_utils.py:286] non-default args: {'port': 20226}
Traceback (most recent call last):
  File "/usr/lib/python3.11/multiprocessing/spawn.py", line 132, in _main
    self = reduction.pickle.load(from_parent)
  File "/usr/lib/python3.11/multiprocessing/synchronize.py", line 115, in __setstate__
    self._semlock = _multiprocessing.SemLock._rebuild(*state)
FileNotFoundError: [Errno 2] No such file or directory
Traceback (most recent call last):
  File "/venv/lib/python3.11/site-packages/vllm/v1/engine/utils.py", line 1431, in wait_for_engine_startup
    raise RuntimeError(
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
"""


def test_first_error_is_the_first_traceback():
    line, block = first_error(CHILD_FAILED)
    assert line == 2 and block == "\n".join(CHILD_FAILED.splitlines()[1:7])
    # negative control: the last traceback names no cause
    assert "SemLock" not in last_traceback(CHILD_FAILED)
    assert last_traceback(CHILD_FAILED).splitlines()[-1].startswith("RuntimeError: Engine core")


def test_first_error_of_an_error_record_carries_its_traceback():
    """vLLM's logger.exception: every line of the record has its prefix; a line of another
    process in between is left out."""
    rec = "(EngineCore pid=9) ERROR 12-06 06:36:55 [core.py:1510] "
    text = (CHILD_FAILED.splitlines()[0] + "\n" + rec + "EngineCore failed to start.\n"
            + rec + "Traceback (most recent call last):\n"
            + rec + '  File "/venv/vllm/v1/engine/core.py", line 1500, in run_engine_core\n'
            + "(APIServer pid=7) INFO 12-06 06:36:55 [api_server.py:1] waiting for the engine\n"
            + rec + "    engine_core = EngineCoreProc(*args, **kwargs)\n"
            + rec + "ValueError: not enough KV cache space\n"
            + rec + "trailing text of the next record\n")
    line, block = first_error(text)
    assert line == 2
    assert block.splitlines() == [ln for ln in text.splitlines()[1:7] if "APIServer" not in ln]


def test_first_error_keeps_a_long_tracebacks_exception_line():
    frames = "".join(f'  File "m.py", line {i}, in f{i}\n    f{i + 1}()\n' for i in range(40))
    line, block = first_error("INFO start\nTraceback (most recent call last):\n" + frames
                              + "ValueError: deep\nINFO after\n", max_lines=10)
    assert line == 2 and len(block.splitlines()) == 10
    assert block.splitlines()[-2:] == ["... 73 lines ...", "ValueError: deep"]


def test_first_error_without_a_traceback_or_error_record():
    assert first_error(ADDRESS_IN_USE) == (4, ADDRESS_IN_USE.splitlines()[3])   # `ERROR:    `
    assert first_error("worker died\nKilled\n") == (2, "Killed")                # classify_log
    # negative controls: a clean log, an error only mentioned inside a line
    assert first_error("INFO all good\n  indented ValueError: not at line start\n") is None
    assert first_error("(APIServer pid=7) WARNING 12-06 [system_utils.py:255] fd limit errors "
                       "like `OSError: [Errno 24] Too many open files`\n") is None


# -- ManagedProcess with real children --------------------------------------------------------

def py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


@pytest.fixture
def spawn(tmp_path):
    """Start `python -c code` as a ManagedProcess; whatever a failed test left is stopped."""
    started = []

    def start(name: str, code: str, env: dict | None = None) -> ManagedProcess:
        p = ManagedProcess(name, py(code), env or {}, tmp_path / f"{name}.log").start()
        started.append(p)
        return p

    yield start
    for p in started:
        p.stop(grace=0.5)


def logged(p: ManagedProcess, line: str) -> bool:
    """The child printed `line` (the log's first line is the argv, which may contain it)."""
    return line in p.log_text().splitlines()[1:]


def wait_for(predicate, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"condition not met within {timeout} s")


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_exit_code_and_log(tmp_path):
    log = tmp_path / "logs" / "w.log"       # the folder is created on start
    p = ManagedProcess("w", py("import sys; print('hello from child'); sys.exit(3)"), {},
                       log).start()
    wait_for(lambda: not p.alive())
    assert p.exit_code == 3
    report = p.stop(grace=1)
    assert (report.name, report.exit_code, report.escalated, report.survivors) == (
        "w", 3, False, [])
    text = log.read_text()
    assert text.startswith(f"# w: {sys.executable} -c ")
    assert "hello from child" in text
    assert p.log_tail(1) == "hello from child"


def test_a_tmp_folder_of_its_own_is_removed_at_stop(tmp_path):
    """WorkerCommand.tmp_env: the child finds a short folder of its own in that variable,
    leaves a Unix socket in it (as vLLM's ZMQ IPC does under VLLM_RPC_BASE_PATH), and the
    folder is gone after its stop; each process gets another."""
    code = ("import os, socket, time; d = os.environ['E2E_T_DIR']; "
            "s = socket.socket(socket.AF_UNIX); s.bind(os.path.join(d, 'x' * 36)); "
            "print(d, flush=True); time.sleep(60)")
    a = ManagedProcess("a", py(code), {}, tmp_path / "a.log", tmp_env="E2E_T_DIR").start()
    b = ManagedProcess("b", py(code), {}, tmp_path / "b.log", tmp_env="E2E_T_DIR").start()
    try:
        wait_for(lambda: len(a.log_text().splitlines()) > 1 and len(b.log_text().splitlines()) > 1)
        folder = a.log_text().splitlines()[1]
        assert folder == a.tmp_dir != b.tmp_dir and os.path.isdir(b.tmp_dir)
        assert os.listdir(folder) == ["x" * 36] and len(folder) < 60     # AF_UNIX: 107
        assert a.stop(grace=1).survivors == []
        assert not os.path.exists(folder) and a.tmp_dir is None
        assert os.listdir(b.tmp_dir)                   # the other's is its own
    finally:
        a.stop(grace=0.5)
        b.stop(grace=0.5)
    assert b.tmp_dir is None
    # negative control: without tmp_env the variable is not set, and nothing is made
    c = ManagedProcess("c", py("import os; print(os.environ.get('E2E_T_DIR'))"), {},
                       tmp_path / "c.log").start()
    wait_for(lambda: not c.alive())
    c.stop(grace=1)
    assert c.log_text().splitlines()[1:] == ["None"] and c.tmp_dir is None


def test_a_note_is_the_logs_second_line_before_the_childs_output(tmp_path):
    """The harness's own line (WorkerCommand.log_note) follows the command's, in one line
    whatever it holds; without one the child's output follows the command at once."""
    log = tmp_path / "n.log"
    p = ManagedProcess("n", py("print('child')"), {}, log, note="e2e: a\nb").start()
    wait_for(lambda: not p.alive())
    p.stop(grace=1)
    assert log.read_text().splitlines()[1:] == ["e2e: a b", "child"]
    bare = tmp_path / "b.log"
    q = ManagedProcess("b", py("print('child')"), {}, bare).start()
    wait_for(lambda: not q.alive())
    q.stop(grace=1)
    assert bare.read_text().splitlines()[1:] == ["child"]


def test_env_overrides_are_added_to_the_inherited_env(spawn, monkeypatch):
    monkeypatch.setenv("E2E_TEST_INHERITED", "yes")
    p = spawn("env", "import os; print(os.environ['E2E_TEST_INHERITED'], "
                     "os.environ['E2E_TEST_MARKER'])", {"E2E_TEST_MARKER": "abc"})
    wait_for(lambda: not p.alive())
    p.stop(grace=1)
    assert p.exit_code == 0
    assert "yes abc" in p.log_text()


def test_failure_summary(spawn, tmp_path):
    p = spawn("prefill-0", "print('loading', flush=True); raise ValueError('boom')")
    wait_for(lambda: not p.alive())
    summary = p.failure_summary()
    head, *rest = summary.splitlines()
    assert head == "prefill-0 exited while starting (exit code 1): [error] ValueError: boom"
    assert rest[0] == f"argv: {sys.executable} -c print('loading', flush=True); " \
                      "raise ValueError('boom')"
    assert rest[1] == f"log: {tmp_path / 'prefill-0.log'}"
    assert "last traceback:" in summary and "log tail:" in summary
    assert "first error" not in summary        # its only traceback is the last one
    p.stop(grace=1)


def test_failure_summary_names_a_first_error_that_the_last_traceback_does_not(spawn):
    p = spawn("worker-0", "import traceback\ntry:\n    open('/nonexistent/sem')\n"
                          "except OSError:\n    traceback.print_exc()\n"
                          "raise RuntimeError('failed. See root cause above.')")
    wait_for(lambda: not p.alive())
    summary = p.failure_summary()
    first = summary.split("first error (line ")[1].split("\nlast traceback:")[0]
    assert first.splitlines()[-1].startswith("FileNotFoundError: [Errno 2]")
    assert summary.split("last traceback:\n")[1].splitlines()[2] == \
        "RuntimeError: failed. See root cause above."
    p.stop(grace=1)


def test_failure_summary_names_the_signal(spawn):
    p = spawn("w", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    wait_for(lambda: not p.alive())
    assert p.failure_summary().splitlines()[0] == "w exited while starting " \
                                                  "(exit code -9 (signal 9))"
    p.stop(grace=1)


def test_stop_running_child(spawn):
    p = spawn("w", "import time; print('up', flush=True); time.sleep(60)")
    wait_for(lambda: logged(p, "up"))
    assert p.alive() and p.pid > 0
    report = p.stop(grace=5)
    assert not p.alive()
    assert report.exit_code == -signal.SIGTERM
    assert (report.escalated, report.survivors) == (False, [])
    assert report.seconds < 5


def test_sigterm_ignored_escalates_to_sigkill(spawn):
    p = spawn("stubborn", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                          "print('ready', flush=True); time.sleep(60)")
    wait_for(lambda: logged(p, "ready"))
    t0 = time.monotonic()
    report = p.stop(grace=1)
    assert time.monotonic() - t0 < 6
    assert report.escalated is True
    assert report.survivors == []
    assert report.exit_code == -signal.SIGKILL
    assert not p.alive()


# The grandchild ignores SIGTERM, then prints its pid (to the same log) and sleeps.
GRANDCHILD = """
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c",
    "import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print('grandchild', os.getpid(), flush=True); time.sleep(60)"])
{tail}
"""


def grandchild_pid(p: ManagedProcess) -> int:
    line = wait_for(lambda: next((x for x in p.log_text().splitlines()
                                  if x.startswith("grandchild ")), None))
    return int(line.split()[1])


def test_grandchild_in_the_session_is_killed(spawn):
    p = spawn("tree", GRANDCHILD.format(tail="time.sleep(60)"))
    gpid = grandchild_pid(p)
    assert gpid in {q.pid for q in p.tree()}
    report = p.stop(grace=1)
    assert report.survivors == []
    assert report.escalated is True          # the grandchild ignores SIGTERM
    wait_for(lambda: gone(gpid), timeout=5)


def test_grandchild_outliving_its_parent_is_killed(spawn):
    # The leader exits at once; its child stays in the session and must still be found.
    p = spawn("orphan", GRANDCHILD.format(tail=""))
    gpid = grandchild_pid(p)
    wait_for(lambda: not p.alive())
    assert p.exit_code == 0
    assert [q.pid for q in p.tree()] == [gpid]
    report = p.stop(grace=1)
    assert report.survivors == [] and report.escalated is True
    wait_for(lambda: gone(gpid), timeout=5)
    assert p.tree() == []


# A daemon: the child forks a grandchild that calls setsid (its own session, reparented to
# init when the child exits), prints its pid and sleeps. Neither its session nor the tree of
# children leads to it; only the environment it inherited does.
ESCAPEE = """
import os, sys, time
if os.fork() == 0:
    os.setsid()
    print('grandchild', os.getpid(), flush=True)
    time.sleep(60)
    os._exit(0)
time.sleep({parent_s})
"""


@pytest.mark.parametrize("parent_s", [60, 0], ids=["parent-alive", "parent-gone"])
def test_a_descendant_that_left_the_session_is_found_and_stopped(spawn, parent_s):
    """While its parent lives, the stop finds it as a descendant. Once the parent is gone it is
    found only by the worker's tag (reaper.PROC_TAG_ENV): signalled with the tree and named in
    the stop's report. Before the tag it was left running and the teardown said clean."""
    p = spawn("daemon", ESCAPEE.format(parent_s=parent_s))
    gpid = grandchild_pid(p)
    assert os.getsid(gpid) == gpid != p.pid
    if not parent_s:
        wait_for(lambda: not p.alive())
        p.remember_descendants()
        assert gpid not in {q.pid for q in p.tree()}    # all the stop saw before the tag
    report = p.stop(grace=1)
    wait_for(lambda: gone(gpid), timeout=5)
    assert report.survivors == []
    assert [x.split()[:2] for x in report.escaped] == ([] if parent_s else [["pid", str(gpid)]])


def test_unstarted_process():
    p = ManagedProcess("never", ["true"], {}, "/nonexistent/never.log")
    assert (p.pid, p.alive(), p.exit_code) == (-1, False, None)
    assert p.log_text() == ""


def test_child_pythonpath_extends_never_replaces():
    """test_sigterm_while_starting's child: the repo first, the inherited entries kept (on a
    runner whose engines come from PYTHONPATH the child must still import them)."""
    from e2e_test.infra.lifecycle.process import extend_pythonpath
    assert extend_pythonpath("/repo", "/stage/site:/other") == "/repo:/stage/site:/other"
    assert extend_pythonpath("/repo", None) == "/repo"
    assert extend_pythonpath("/repo", "/repo:/x") == "/repo:/x"
