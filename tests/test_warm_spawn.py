"""The warm-spawn launcher (engines/launchers/e2e_warm_spawn.py) with real processes.

A stand-in entry point (pure multiprocessing, no engine) sets a variable, switches to spawn
and starts a child whose module takes 1 s to import, as TokenSpeed's servicer starts its
scheduler. Through the launcher the child's imports are done before the request (the warmed
interpreter ran it, with the late variable, the pipe it was given and its exit code); without
it (the negative control) they come after. Another target spawns as usual.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from e2e_test.infra.engines import launchers

LAUNCHERS = Path(launchers.__file__).parent

TARGET = """
import os, sys, time
time.sleep(1.0)                 # a heavy import
IMPORTED_AT = time.time()

def work(conn, code):
    conn.send({"imported_at": IMPORTED_AT, "late": os.environ.get("STAND_IN_LATE"),
               "early": os.environ.get("STAND_IN_EARLY"), "pid": os.getpid(),
               "ppid": os.getppid()})
    conn.close()
    sys.exit(code)

def other(conn):
    conn.send({"imported_at": IMPORTED_AT, "pid": os.getpid()})
    conn.close()
"""

ENTRY = """
import json, multiprocessing as mp, os, sys, time
import stand_in_target

if __name__ == "__main__":
    os.environ["STAND_IN_LATE"] = "late"
    mp.set_start_method("spawn", force=True)
    time.sleep(float(os.environ.get("STAND_IN_SLEEP", "1.5")))  # its own imports, meanwhile
    out = {"argv": sys.argv[1:], "parent": os.getpid()}
    for name, target, args in (("first", stand_in_target.work, (3,)),
                               ("second", stand_in_target.other, ())):
        r, w = mp.Pipe(duplex=False)
        started = time.time()
        p = mp.Process(target=target, args=(w, *args))
        p.start()
        w.close()
        got = r.recv()
        p.join(30)
        out[name] = {**got, "started": started, "popen_pid": p.pid, "exitcode": p.exitcode}
    print("RESULT " + json.dumps(out), flush=True)
"""


@pytest.fixture
def stand_in(tmp_path):
    (tmp_path / "stand_in_target.py").write_text(textwrap.dedent(TARGET))
    (tmp_path / "stand_in_entry.py").write_text(textwrap.dedent(ENTRY))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(LAUNCHERS), str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    return tmp_path, env


def _run(argv, env, cwd):
    proc = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=60,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):]), proc.stderr


def test_warm_child_imported_before_the_request_and_runs_the_target(stand_in):
    tmp, env = stand_in
    out, err = _run([sys.executable, "-m", "e2e_warm_spawn", "--run", "stand_in_entry",
                     "--target", "stand_in_target:work", "--preload", "stand_in_target",
                     "--child-env", "STAND_IN_EARLY=early", "--", "--flag", "x"],
                    {**env, "STAND_IN_SLEEP": "3"}, tmp)
    first, second = out["first"], out["second"]
    assert out["argv"] == ["--flag", "x"]
    # Warm: its 1 s import was done while the entry point slept, before the request.
    assert first["imported_at"] < first["started"], (first, err)
    assert first["pid"] == first["popen_pid"] and first["ppid"] == out["parent"]
    assert first["late"] == "late" and first["early"] is None  # the parent's env at the request
    assert first["exitcode"] == 3
    assert f"e2e_warm_spawn (pid {first['pid']}): imports" in err
    # the variables the parent's environment had otherwise than the child after its imports
    assert "differs in: STAND_IN_EARLY, STAND_IN_LATE" in err
    # Another target: a spawn as usual, imported after its start.
    assert second["imported_at"] > second["started"] and second["pid"] != first["pid"]
    assert second["exitcode"] == 0


def test_negative_control_without_the_launcher_the_child_imports_after_the_request(stand_in):
    tmp, env = stand_in
    out, _ = _run([sys.executable, "-m", "stand_in_entry", "--flag", "x"], env, tmp)
    assert out["first"]["imported_at"] > out["first"]["started"]
    assert out["first"]["late"] == "late" and out["first"]["exitcode"] == 3


def test_an_unused_waiting_interpreter_ends_with_its_parent(stand_in, tmp_path):
    tmp, env = stand_in
    (tmp / "stand_in_idle.py").write_text("import time\nif __name__ == '__main__':\n"
                                          "    time.sleep(3)\n")
    p = subprocess.Popen([sys.executable, "-m", "e2e_warm_spawn", "--run", "stand_in_idle",
                          "--target", "stand_in_target:work", "--preload", "stand_in_target",
                          "--"], env=env, cwd=tmp)
    deadline = time.monotonic() + 10
    while not (kids := psutil.Process(p.pid).children()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(kids) == 1, kids  # the waiting interpreter
    assert p.wait(30) == 0
    kids[0].wait(10)  # raises psutil.TimeoutExpired if it outlived its parent
    assert not kids[0].is_running()


def test_a_dead_waiting_interpreter_falls_back_to_spawn(stand_in):
    tmp, env = stand_in
    (tmp / "stand_in_crash.py").write_text("import os\nos._exit(9)\n")
    # the entry point waits long enough for the interpreter to have died on a loaded machine
    out, err = _run([sys.executable, "-m", "e2e_warm_spawn", "--run", "stand_in_entry",
                     "--target", "stand_in_target:work", "--preload", "stand_in_crash",
                     "--"], {**env, "STAND_IN_SLEEP": "4"}, tmp)
    assert "not using the waiting interpreter" in err and "it is gone" in err
    assert out["first"]["imported_at"] > out["first"]["started"]  # a plain spawn
    assert out["first"]["exitcode"] == 3 and out["first"]["late"] == "late"
