"""The warm-spawn launcher (engines/launchers/e2e_warm_spawn.py) with real processes.

A stand-in entry point (pure multiprocessing, no engine) sets a variable, switches to spawn
and starts a child whose module takes 0.5 s to import, as TokenSpeed's servicer starts its
scheduler. Through the launcher the child's imports are done before the request (the warmed
interpreter ran it, with the late variable, the pipe it was given and its exit code); without
it (the negative control) they come after. Another target spawns as usual.

The order is made by handshakes, not by sleeping: the stand-in's modules leave a mark file
(`imported.PID`, `keyed.PID`, ...) in STAND_IN_MARKS, and an entry point given STAND_IN_AWAIT
waits for another process's mark (the waiting interpreter's) before its request.
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
from e2e_test.infra.reports import time_report

LAUNCHERS = Path(launchers.__file__).parent

TARGET = """
import functools, gc, os, sys, time

def mark(what):                 # a file that says this process got here (STAND_IN_AWAIT)
    if os.environ.get("STAND_IN_MARKS"):
        open(os.path.join(os.environ["STAND_IN_MARKS"], f"{what}.{os.getpid()}"), "w").close()

time.sleep(0.5)                 # a heavy import
IMPORTED_AT = time.time()
mark("imported")
GC_AT_IMPORT = gc.isenabled()
ENV_AT_IMPORT = {k: os.environ.get(k) for k in ("STAND_IN_EARLY", "STAND_IN_DEF")}
KEYED = {}

@functools.lru_cache()
def key():                      # a hash of installed files, cached for the process
    KEYED["at"] = time.time()
    mark("keyed")
    return "k"

def broken():
    raise FileNotFoundError("libtriton.so")

@functools.lru_cache()
def slow_key():                 # one that takes longer than the parent's wait for the child
    KEYED["slow_started"] = time.time()
    mark("slow_started")
    time.sleep(float(os.environ.get("STAND_IN_SLOW", "2.0")))
    KEYED["slow_done"] = time.time()
    return "s"

def work(conn, code):
    run_at = time.time()
    keyed_before = KEYED.get("at")
    slow = {"slow_started": KEYED.get("slow_started"), "slow_done_at_run": KEYED.get("slow_done")}
    if os.environ.get("STAND_IN_WAIT_SLOW"):   # so that calls beside end, and say so
        while "slow_done" not in KEYED and time.time() < run_at + 10:
            time.sleep(0.05)
        time.sleep(0.2)
    key()                       # the target's own first use
    conn.send({"imported_at": IMPORTED_AT, "late": os.environ.get("STAND_IN_LATE"),
               "early": os.environ.get("STAND_IN_EARLY"), "pid": os.getpid(),
               "ppid": os.getppid(), "gc_at_import": GC_AT_IMPORT,
               "gc_at_run": gc.isenabled(), "frozen": gc.get_freeze_count(),
               "keyed_before": keyed_before, "key_misses": key.cache_info().misses,
               "env_at_import": ENV_AT_IMPORT, "def": os.environ.get("STAND_IN_DEF"),
               "run_at": run_at, **slow})
    conn.close()
    sys.exit(code)

def other(conn):
    conn.send({"imported_at": IMPORTED_AT, "pid": os.getpid(), "gc_at_import": GC_AT_IMPORT})
    conn.close()
"""

ENTRY = """
import json, multiprocessing as mp, os, sys, time
import stand_in_target

if __name__ == "__main__":
    os.environ["STAND_IN_LATE"] = "late"
    # as TokenSpeed's servicer sets CUDA_DEVICE_MAX_CONNECTIONS, and setdefaults others
    os.environ["STAND_IN_EARLY"] = os.environ.get("STAND_IN_EARLY_SET", "early")
    os.environ.setdefault("STAND_IN_DEF", "d")
    mp.set_start_method("spawn", force=True)
    if os.environ.get("STAND_IN_AWAIT"):   # its own imports, meanwhile: then another's mark
        marks, mine = os.environ["STAND_IN_MARKS"], f".{os.getpid()}"
        deadline, found = time.time() + 30, []
        while not found and time.time() < deadline:
            found = [f for f in os.listdir(marks)
                     if f.startswith(os.environ["STAND_IN_AWAIT"] + ".") and not f.endswith(mine)]
            time.sleep(0.02)
        if found and os.environ.get("STAND_IN_AWAIT_EXIT"):   # and that process's end
            os.waitid(os.P_PID, int(found[0].rsplit(".", 1)[1]), os.WEXITED | os.WNOWAIT)
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
    (tmp_path / "marks").mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(LAUNCHERS), str(tmp_path), os.environ.get("PYTHONPATH", "")]),
        "STAND_IN_MARKS": str(tmp_path / "marks")}
    return tmp_path, env


def _clear_marks(cwd):
    for f in (Path(cwd) / "marks").glob("*"):
        f.unlink()


def _run(argv, env, cwd):
    _clear_marks(cwd)
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
                    {**env, "STAND_IN_AWAIT": "imported"}, tmp)
    first, second = out["first"], out["second"]
    assert out["argv"] == ["--flag", "x"]
    # Warm: its import was done (its mark awaited) before the request.
    assert first["imported_at"] < first["started"], (first, err)
    assert first["pid"] == first["popen_pid"] and first["ppid"] == out["parent"]
    assert first["late"] == "late" and first["early"] == "early"  # the parent's env then
    assert first["env_at_import"]["STAND_IN_EARLY"] == "early"    # and what the imports saw
    assert first["exitcode"] == 3
    # Its imports ran with the collector off, then frozen; the target runs with it on.
    assert first["gc_at_import"] is False and first["gc_at_run"] is True
    assert first["frozen"] > 0
    assert f"e2e_warm_spawn (pid {first['pid']}): imports" in err
    assert "(1 preloaded, collector off)" in err
    # the variables the parent's environment had otherwise than the child after its imports
    assert "differs in: STAND_IN_DEF, STAND_IN_LATE" in err
    # Another target: a spawn as usual, imported after its start.
    assert second["imported_at"] > second["started"] and second["pid"] != first["pid"]
    assert second["exitcode"] == 0 and second["gc_at_import"] is True
    # No --call: the target filled its cache itself.
    assert first["keyed_before"] is None and first["key_misses"] == 1
    assert "calls" not in err


def test_negative_control_without_the_launcher_the_child_imports_after_the_request(stand_in):
    tmp, env = stand_in
    out, _ = _run([sys.executable, "-m", "stand_in_entry", "--flag", "x"], env, tmp)
    assert out["first"]["imported_at"] > out["first"]["started"]
    assert out["first"]["late"] == "late" and out["first"]["exitcode"] == 3
    assert out["first"]["keyed_before"] is None


def test_a_variable_the_imports_saw_otherwise_spawns_as_usual(stand_in):
    """The entry point sets a --child-env variable to another value than the child's imports
    saw (its arguments asked for it): the waiting interpreter is not used, the launcher names
    the variable, and a spawned child imports with the entry point's value."""
    tmp, env = stand_in
    out, err = _run([sys.executable, "-m", "e2e_warm_spawn", "--run", "stand_in_entry",
                     "--target", "stand_in_target:work", "--preload", "stand_in_target",
                     "--child-env", "STAND_IN_EARLY=early", "--"],
                    {**env, "STAND_IN_AWAIT": "imported", "STAND_IN_EARLY_SET": "other"}, tmp)
    first = out["first"]
    assert first["imported_at"] > first["started"], (first, err)   # a fresh spawn
    assert first["env_at_import"]["STAND_IN_EARLY"] == "other" and first["exitcode"] == 3
    assert ("not using the waiting interpreter" in err and "its imports saw another value of "
            "STAND_IN_EARLY ('early', the parent's now 'other')" in err), err
    assert "): imports" not in err.split("not using")[1]   # the waiting one took nothing


def test_child_env_default_only_where_the_environment_has_none(stand_in):
    """--child-env-default: set for the imports where the launcher's environment lacks it
    (the entry point's setdefault then agrees); a value already there is kept."""
    tmp, env = stand_in
    argv = [sys.executable, "-m", "e2e_warm_spawn", "--run", "stand_in_entry", "--target",
            "stand_in_target:work", "--preload", "stand_in_target",
            "--child-env", "STAND_IN_EARLY=early", "--child-env-default", "STAND_IN_DEF=d", "--"]
    env = {k: v for k, v in env.items() if k != "STAND_IN_DEF"}
    for given, want in ((None, "d"), ("user", "user")):
        e = {**env, "STAND_IN_AWAIT": "imported", **({"STAND_IN_DEF": given} if given else {})}
        out, err = _run(argv, e, tmp)
        first = out["first"]
        assert first["imported_at"] < first["started"], (first, err)   # the warm one
        assert first["env_at_import"]["STAND_IN_DEF"] == want == first["def"]
        assert "not using" not in err and "differs in: STAND_IN_LATE" in err


def test_calls_fill_the_childs_cache_before_the_request(stand_in):
    """`--call`: the waiting interpreter calls it after its imports, before the request; the
    target finds the cache full (no miss of its own). One that raises is counted and named,
    and the target still runs and fills it itself."""
    tmp, env = stand_in
    out, err = _run([sys.executable, "-m", "e2e_warm_spawn", "--run", "stand_in_entry",
                     "--target", "stand_in_target:work", "--preload", "stand_in_target",
                     "--call", "stand_in_target:key", "--"],
                    {**env, "STAND_IN_AWAIT": "keyed"}, tmp)
    first = out["first"]
    assert first["keyed_before"] is not None, (first, err)
    assert first["imported_at"] < first["keyed_before"] < first["started"]
    assert first["key_misses"] == 1               # the call's miss; the target's was a hit
    assert first["exitcode"] == 3
    assert f"e2e_warm_spawn (pid {first['pid']}): imports" in err
    assert "1 calls" in err and "(0 failed)" in err and "(1 preloaded, collector off)" in err
    out, err = _run([sys.executable, "-m", "e2e_warm_spawn", "--run", "stand_in_entry",
                     "--target", "stand_in_target:work", "--preload", "stand_in_target",
                     "--call", "stand_in_target:broken", "--call", "stand_in_target:key",
                     "--call", "stand_in_absent:key", "--"],
                    {**env, "STAND_IN_AWAIT": "keyed"}, tmp)
    first = out["first"]
    assert first["exitcode"] == 3 and first["keyed_before"] is not None
    assert "call stand_in_target:broken failed: FileNotFoundError: libtriton.so" in err
    assert "call stand_in_absent:key failed: ModuleNotFoundError" in err
    assert "3 calls" in err and "(2 failed)" in err


def test_calls_beside_do_not_hold_the_request_back(stand_in):
    """`--calls-beside`: the calls run in a thread started after the imports, and a request
    that comes while they run starts the target at once (the cache not yet filled), their
    own line coming when they end. The negative control, the same call before the request:
    the target starts only after it ended."""
    tmp, env = stand_in
    argv = [sys.executable, "-m", "e2e_warm_spawn", "--run", "stand_in_entry",
            "--target", "stand_in_target:work", "--preload", "stand_in_target",
            "--call", "stand_in_target:slow_key"]
    slow = {**env, "STAND_IN_AWAIT": "slow_started", "STAND_IN_SLOW": "2.0",
            "STAND_IN_WAIT_SLOW": "1"}
    out, err = _run([*argv, "--calls-beside", "--"], slow, tmp)
    first = out["first"]
    assert first["exitcode"] == 3
    assert first["slow_started"] is not None and first["slow_done_at_run"] is None, (first, err)
    assert first["slow_started"] < first["run_at"]
    assert "1 calls beside the target (running at the request), request " in err, err
    assert "1 calls beside the target: 2.0 s (0 failed), ended " in err, err
    assert "s after the request came" in err
    # the time report reads these lines (time_report.warm_spawn_status)
    st = time_report.warm_spawn_status(err)
    assert st["calls_mode"] == "beside" and st["calls_s"] == 2.0 and st["waited_for_calls_s"] == 0
    assert st["beside_ended_after_request_s"] > 1.0 and st["imports_s"] >= 0.5
    # the negative control: made before the request, the call holds it back
    out, err = _run([*argv, "--"], slow, tmp)
    first = out["first"]
    assert first["slow_done_at_run"] is not None, (first, err)
    assert first["slow_done_at_run"] < first["run_at"]
    assert "1 calls 2.0 s (0 failed), request " in err and "beside" not in err
    st = time_report.warm_spawn_status(err)
    assert st["calls_mode"] == "before" and st["waited_for_calls_s"] > 1.0, (st, err)


def test_calls_beside_count_what_fails(stand_in):
    """Beside, as with `before`: one that names no module is counted when it is resolved, before the
    thread; one that raises, in the thread; the target runs either way."""
    tmp, env = stand_in
    out, err = _run([sys.executable, "-m", "e2e_warm_spawn", "--run", "stand_in_entry",
                     "--target", "stand_in_target:work", "--preload", "stand_in_target",
                     "--call", "stand_in_target:broken", "--call", "stand_in_absent:key",
                     "--call", "stand_in_target:slow_key", "--calls-beside", "--"],
                    {**env, "STAND_IN_SLOW": "0.1", "STAND_IN_WAIT_SLOW": "1"}, tmp)
    assert out["first"]["exitcode"] == 3
    assert "call stand_in_absent:key failed: ModuleNotFoundError" in err
    assert "call stand_in_target:broken failed: FileNotFoundError: libtriton.so" in err
    assert "3 calls beside the target: " in err and "(2 failed)" in err, err


@pytest.mark.parametrize("argv, why", [
    (["--run", "m", "--call", "m:f", "--"], "for the child of --target"),
    (["--run", "m", "--target", "m:t", "--call", "m", "--"], "use MODULE:QUALNAME"),
    (["--run", "m", "--target", "m:t", "--call", ":f", "--"], "use MODULE:QUALNAME"),
    (["--run", "m", "--target", "m:t", "--calls-beside", "--"], "no --call to make"),
])
def test_bad_calls_are_refused_before_anything_starts(argv, why, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(LAUNCHERS))
    from e2e_warm_spawn import parse
    with pytest.raises(SystemExit):
        parse(argv)
    assert why in capsys.readouterr().err


def test_an_unused_waiting_interpreter_ends_with_its_parent(stand_in, tmp_path):
    tmp, env = stand_in
    (tmp / "stand_in_idle.py").write_text("import sys\nif __name__ == '__main__':\n"
                                          "    sys.stdin.readline()\n")   # ends when told
    p = subprocess.Popen([sys.executable, "-m", "e2e_warm_spawn", "--run", "stand_in_idle",
                          "--target", "stand_in_target:work", "--preload", "stand_in_target",
                          "--"], env=env, cwd=tmp, stdin=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 10
    while not (kids := psutil.Process(p.pid).children()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(kids) == 1, kids  # the waiting interpreter
    p.communicate("\n", timeout=30)
    assert p.returncode == 0
    kids[0].wait(10)  # raises psutil.TimeoutExpired if it outlived its parent
    assert not kids[0].is_running()


def test_a_dead_waiting_interpreter_falls_back_to_spawn(stand_in):
    tmp, env = stand_in
    (tmp / "stand_in_crash.py").write_text(
        "import os\nopen(os.path.join(os.environ['STAND_IN_MARKS'], f'crashed.{os.getpid()}'),"
        " 'w').close()\nos._exit(9)\n")
    # the entry point waits for the interpreter to have died (without reaping it)
    out, err = _run([sys.executable, "-m", "e2e_warm_spawn", "--run", "stand_in_entry",
                     "--target", "stand_in_target:work", "--preload", "stand_in_crash",
                     "--"], {**env, "STAND_IN_AWAIT": "crashed", "STAND_IN_AWAIT_EXIT": "1"},
                    tmp)
    assert "not using the waiting interpreter" in err and "it is gone" in err
    assert out["first"]["imported_at"] > out["first"]["started"]  # a plain spawn
    assert out["first"]["exitcode"] == 3 and out["first"]["late"] == "late"


# -- held (`--hold`): the entry point's own interpreter started ahead -------------------------

HELD = """
import json, os, sys, time
import stand_in_target
BODY_AT = time.time()

if __name__ == "__main__":
    print("RESULT " + json.dumps({"argv": sys.argv[1:], "imported_at": stand_in_target.IMPORTED_AT,
                                  "body_at": BODY_AT, "by_name": "stand_in_held" in sys.modules}),
          flush=True)
"""


def _held(argv, env, cwd):
    """Start a held interpreter, wait for its held line, send `go`:
    (its RESULT, stderr, the held line, when go was sent)."""
    _clear_marks(cwd)
    p = subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    line = p.stderr.readline()
    assert f"e2e_warm_spawn (pid {p.pid}): held: imports" in line, line
    go_at = time.time()
    out, err = p.communicate("go\n", timeout=60)
    assert p.returncode == 0, err
    res = json.loads(next(x for x in out.splitlines() if x.startswith("RESULT "))[7:])
    return res, err, line, go_at


def test_held_imports_ahead_and_runs_the_body_once_at_go(stand_in):
    """The held interpreter runs its module's import statements (stand_in_target's 0.5 s),
    prints its line and waits; `go` runs the module as __main__ (its body once, after the
    go, never under its own name), with the arguments it was started with."""
    tmp, env = stand_in
    (tmp / "stand_in_held.py").write_text(textwrap.dedent(HELD))
    res, err, line, go_at = _held([sys.executable, "-m", "e2e_warm_spawn", "--hold", "--run",
                                   "stand_in_held", "--", "--flag", "x"], env, tmp)
    assert "(2 import statements of stand_in_held, 0 failed, collector off)" in line
    assert res["imported_at"] < go_at < res["body_at"], (res, go_at)
    assert res["argv"] == ["--flag", "x"] and res["by_name"] is False
    assert ": go, " in err


def test_negative_control_unheld_the_imports_come_after_the_start(stand_in):
    tmp, env = stand_in
    (tmp / "stand_in_held.py").write_text(textwrap.dedent(HELD))
    t0 = time.time()
    out, _ = _run([sys.executable, "-m", "e2e_warm_spawn", "--run", "stand_in_held", "--"],
                  env, tmp)
    assert out["imported_at"] >= t0 + 0.5


def test_held_without_go_exits_and_runs_nothing(stand_in):
    """End of input (the harness stopped, or never needed it) or any line but `go`: exit 0,
    the module's body never run."""
    tmp, env = stand_in
    (tmp / "stand_in_held.py").write_text(textwrap.dedent(HELD))
    argv = [sys.executable, "-m", "e2e_warm_spawn", "--hold", "--run", "stand_in_held", "--"]
    for given in ("", "stop\n"):
        proc = subprocess.run(argv, env=env, cwd=tmp, input=given, capture_output=True,
                              text=True, timeout=60, check=False)
        assert proc.returncode == 0 and "RESULT" not in proc.stdout, proc
        assert "held: imports" in proc.stderr and ": go, " not in proc.stderr


def test_held_with_a_warm_child_hands_the_target_over_after_go(stand_in):
    """`--hold` with `--target` (a TokenSpeed servicer's form): the child's interpreter is
    started ahead too, and still takes the target's spawn after the go."""
    tmp, env = stand_in
    out, err, _, _ = _held([sys.executable, "-m", "e2e_warm_spawn", "--hold", "--run",
                            "stand_in_entry", "--target", "stand_in_target:work", "--preload",
                            "stand_in_target", "--", "--flag", "x"],
                           {**env, "STAND_IN_AWAIT": "imported"}, tmp)
    assert out["argv"] == ["--flag", "x"] and out["first"]["exitcode"] == 3
    assert out["first"]["imported_at"] < out["first"]["started"], (out, err)
    assert out["first"]["pid"] == out["first"]["popen_pid"]


def test_import_statements_are_the_module_bodys_own(monkeypatch):
    monkeypatch.syspath_prepend(str(LAUNCHERS))
    from e2e_warm_spawn import import_statements
    src = textwrap.dedent("""
        from __future__ import annotations
        import a, b.c
        from .d import e
        try:
            import f
        except ImportError:
            import g
        if TYPE_CHECKING:
            import h
        if sys.version_info >= (3, 11):
            import i
        else:
            import j
        with ctx():
            import k
        def fn():
            import l
        class C:
            import m
        if __name__ == "__main__":
            import n
    """)
    import ast
    got = [ast.unparse(m) for m in import_statements(src)]
    assert got == ["import a, b.c", "from .d import e", "import f", "import i", "import j",
                   "import k"]


def test_parse_refuses_child_options_without_a_target(monkeypatch):
    monkeypatch.syspath_prepend(str(LAUNCHERS))
    from e2e_warm_spawn import parse
    with pytest.raises(SystemExit):
        parse(["--run", "m", "--preload", "x", "--"])
    ns, rest, _ = parse(["--hold", "--run", "m", "--", "--a", "1"])
    assert ns.hold and ns.target is None and rest == ["--a", "1"]


# -- the collector during the launcher's imports ---------------------------------------------

GC_PROBE = """
import gc
ENABLED = gc.isenabled()
"""

GC_RUN = """
import gc, json, sys
import stand_in_gcprobe

if __name__ == "__main__":
    print("RESULT " + json.dumps({"at_import": stand_in_gcprobe.ENABLED,
                                  "in_body": gc.isenabled(),
                                  "frozen": gc.get_freeze_count()}), flush=True)
"""


@pytest.fixture
def gc_stand_in(stand_in):
    tmp, env = stand_in
    (tmp / "stand_in_gcprobe.py").write_text(textwrap.dedent(GC_PROBE))
    (tmp / "stand_in_gcrun.py").write_text(textwrap.dedent(GC_RUN))
    return tmp, env


def test_the_entry_points_imports_run_ahead_with_the_collector_off_then_frozen(gc_stand_in):
    """Through the launcher the module's imports run ahead with the collector off; what they
    made is frozen and the module's body runs with the collector on."""
    tmp, env = gc_stand_in
    out, err = _run([sys.executable, "-m", "e2e_warm_spawn", "--run", "stand_in_gcrun", "--"],
                    env, tmp)
    assert out == {"at_import": False, "in_body": True, "frozen": out["frozen"]}, out
    assert out["frozen"] > 0
    assert "ahead of stand_in_gcrun (2 import statements, 0 failed, collector off)" in err


def test_negative_controls_collector_on_and_without_the_launcher(gc_stand_in):
    """`--collector-on` (the control) and a plain `python -m`: imported with the collector
    on, nothing frozen."""
    tmp, env = gc_stand_in
    on, err = _run([sys.executable, "-m", "e2e_warm_spawn", "--collector-on", "--run",
                    "stand_in_gcrun", "--"], env, tmp)
    plain, _ = _run([sys.executable, "-m", "stand_in_gcrun"], env, tmp)
    for out in (on, plain):
        assert out == {"at_import": True, "in_body": True, "frozen": 0}, out
    assert "collector on)" in err


def test_the_childs_preload_with_collector_on_keeps_it_on(stand_in):
    tmp, env = stand_in
    out, err = _run([sys.executable, "-m", "e2e_warm_spawn", "--collector-on", "--run",
                     "stand_in_entry", "--target", "stand_in_target:work", "--preload",
                     "stand_in_target", "--"], {**env, "STAND_IN_AWAIT": "imported"}, tmp)
    first = out["first"]
    assert first["imported_at"] < first["started"], (first, err)
    assert first["gc_at_import"] is True and first["frozen"] == 0
    assert "(1 preloaded, collector on)" in err


def test_collector_off_restores_what_it_found(monkeypatch):
    monkeypatch.syspath_prepend(str(LAUNCHERS))
    import gc

    from e2e_warm_spawn import collector_off
    assert gc.isenabled()
    try:
        with collector_off():
            assert not gc.isenabled()
        assert gc.isenabled() and gc.get_freeze_count() > 0
        gc.unfreeze()
        with collector_off(False):
            assert gc.isenabled()
        assert gc.get_freeze_count() == 0
        gc.disable()                 # off before: off after, frozen all the same
        with collector_off():
            pass
        assert not gc.isenabled() and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        gc.enable()
