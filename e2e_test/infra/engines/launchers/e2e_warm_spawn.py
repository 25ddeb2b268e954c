"""Warm spawn: a `multiprocessing` spawn child's interpreter started, and its imports done,
before its parent asks for it.

An entry point that starts its engine in a `spawn` child pays for its imports twice, one round
after the other: the parent imports the runtime, then starts a fresh interpreter that imports
it again before it can run. (TokenSpeed 0.1.0: the servicer's process imports the runtime, then
`mp.set_start_method("spawn", force=True)` and starts the scheduler, runtime/entrypoints/
engine.py; fork is no way out, the runtime initialises CUDA at import: tokenspeed_kernel
platform.py current_platform(), called at module level.) This launcher starts that child's
interpreter first and has it import the modules it will need (`--preload`) while the entry
point (`--run`, run as `python -m` would) does its own imports. When the entry point starts a
process whose target is `--target`, the request goes to the waiting interpreter instead of a
new one: the preparation data and pickled process object spawn would write, the file
descriptors the object carries (over a Unix socket, SCM_RIGHTS), and the parent's environment
and open-file limit at that moment (an entry point sets variables before it starts its child,
and spawn would have passed them). Every other process starts as spawn would; so does the
target's if the waiting interpreter has died.

`--child-env NAME=VALUE` sets a variable in the waiting interpreter from its start, for one
the child reads during its imports (a CUDA context created at import reads
CUDA_DEVICE_MAX_CONNECTIONS then); `--child-env-default NAME=VALUE` sets one only where this
environment has none (an entry point's `os.environ.setdefault`). The entry point should set
each of them to the same value before it starts its child: where it does not (its arguments
asked for another), the child's imports saw another value than a spawned child's would, so
that spawn goes as usual, and the launcher says which variable.

`--call MODULE:QUALNAME` names a function of no arguments that the waiting interpreter calls
after its imports, for a cache of the process it fills that the target would fill anyway on its
first use (a hash of installed files that a compiler keys its cache with, kept by
functools.lru_cache); one that raises is counted and reported, and the target fills it as it
would have. `--calls-beside` makes them in a thread of their own, started after the imports,
so that a request which comes meanwhile does not wait for them: the target runs at once, and
its own first use of a cache the thread has not filled yet computes it too (the result is the
same). The child prints one line when it takes the request: how long its imports took, its
calls (before: how long they took; beside: how long they had run by then), when the request
came after the imports (before it, with the calls before the request, the request waited for
them), and which variables of the parent's environment at the request differ from its own
after its imports (applied before the target runs, but not seen by the imports: a variable the
entry point sets from its arguments and a module reads at import would show here). Calls
beside print their own line when they end.

    python -m e2e_warm_spawn --run MODULE [--target MODULE:QUALNAME [--preload MODULE]...
                             [--call MODULE:QUALNAME]... [--calls-beside]
                             [--child-env NAME=VALUE]...]
                             [--hold] [--collector-on] -- ARGS...

Held (`--hold`): the interpreter of the entry point itself is started ahead too, for a restart
known to come (Cluster.restart: a fault test's lost leg). It runs the import statements of
`--run`'s own source, each on its own (its module body is not run: that happens once, as
__main__, as `python -m` runs it), prints one line (how long they took), and waits for one line
on its standard input: `go` runs the entry point as above; end of file (the harness stopped,
or never needed it) exits with status 0 and runs nothing. `--target` may go with it, whose
waiting interpreter is then started ahead as well.

Imports with the collector off. Every round of imports the launcher runs (the waiting
interpreter's `--preload`; the import statements of `--run`'s source, which it runs first,
held or not, before the module itself) runs with Python's cyclic garbage collector disabled,
and what they made is then frozen (`gc.freeze`: later collections skip it) before the
collector is on again. A round of some 6,000 modules (TokenSpeed's runtime) otherwise pays for
collections that traverse everything imported so far, over and over, and finds next to no
garbage (vLLM's API server on 2 cores here: 9 collections of the oldest generation, 672
objects). `--collector-on` keeps it on (the control). The module's own body then runs with
the collector as the interpreter had it.

Standard library only, and importable by this name (its folder goes on PYTHONPATH), because
the waiting interpreter and the pickled references to it resolve it by name.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import io
import os
import pickle
import resource
import runpy
import socket
import struct
import sys
import threading
import time
import traceback
from multiprocessing import context, popen_fork, process, reduction, spawn, util

NAME = "e2e_warm_spawn"
_HEADER = struct.Struct("!Q")

# The descriptors a request carried, in the order the parent's Popen collected them (child).
_INHERITED: list[int] = []


def _collector(on: bool) -> str:
    return f"collector {'on' if on else 'off'}"


@contextlib.contextmanager
def collector_off(off: bool = True):
    """A round of imports with the cyclic garbage collector disabled; then what is alive is
    frozen (gc.freeze: no later collection traverses it) and the collector is as it was.
    `off` False: nothing changes (the control)."""
    was = gc.isenabled()
    if off:
        gc.disable()
    try:
        yield
    finally:
        if off:
            gc.freeze()
            if was:
                gc.enable()


class _DupFd:
    """A file descriptor the pickled process object carries: resolved in the child from the
    ones the request brought (the parent's index into them)."""

    def __init__(self, ind: int):
        self.ind = ind

    def detach(self) -> int:
        return _INHERITED[self.ind]


class Warm:
    """The waiting interpreter, from the parent's side."""

    def __init__(self, preload: list[str], child_env: dict[str, str],
                 collector_on: bool = False, calls: list[str] | None = None,
                 child_env_default: dict[str, str] | None = None, beside: bool = False):
        env = {k: v for k, v in (child_env_default or {}).items() if k not in os.environ}
        env.update(child_env)
        # What the child's imports see of the variables it was given, set or not: the
        # parent's environment must agree at the request (install).
        self.seen = {k: env.get(k, os.environ.get(k))
                     for k in {*child_env, *(child_env_default or {})}}
        self.sock, theirs = socket.socketpair()
        self.sentinel, sentinel_w = os.pipe()
        code = (f"import sys, {NAME} as w; "
                f"sys.exit(w.child_main({theirs.fileno()}, {sentinel_w}, {preload!r}, "
                f"{collector_on!r}, {list(calls or ())!r}, {beside!r}))")
        exe = spawn.get_executable()
        args = [exe, *util._args_from_interpreter_flags(), "-c", code]
        saved = dict(os.environ)
        try:
            os.environ.update(env)
            self.pid = util.spawnv_passfds(exe, args, [theirs.fileno(), sentinel_w])
        finally:
            os.environ.clear()
            os.environ.update(saved)
        theirs.close()
        os.close(sentinel_w)
        self.available = True

    def alive(self) -> bool:
        try:
            pid, _ = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            return False
        return pid == 0

    def close(self) -> None:
        """Unused: its end of the socket closes and it exits."""
        if self.available:
            self.available = False
            self.sock.close()


class WarmPopen(popen_fork.Popen):
    """A spawn Popen that hands the process to the waiting interpreter."""

    method = "spawn"
    DupFd = _DupFd

    def __init__(self, process_obj, warm: Warm):
        self._fds: list[int] = []
        self._warm = warm
        super().__init__(process_obj)

    def duplicate_for_child(self, fd):
        self._fds.append(fd)
        return len(self._fds) - 1

    def _launch(self, process_obj):
        from multiprocessing import resource_tracker
        tracker_fd = resource_tracker.getfd()
        prep = spawn.get_preparation_data(process_obj._name)
        buf = io.BytesIO()
        context.set_spawning_popen(self)
        try:
            reduction.dump(prep, buf)
            reduction.dump(process_obj, buf)
        finally:
            context.set_spawning_popen(None)
        blob = buf.getvalue()
        fds = [tracker_fd, *self._fds]
        header = pickle.dumps({"env": dict(os.environ),
                               "nofile": resource.getrlimit(resource.RLIMIT_NOFILE),
                               "nfds": len(fds), "size": len(blob)})
        w = self._warm
        w.sock.sendall(_HEADER.pack(len(header)) + header)
        reduction.sendfds(w.sock, fds)
        w.sock.sendall(blob)
        self.pid = w.pid
        self.sentinel = w.sentinel
        # The socket stays open as spawn's pipe to the child does: the child's
        # parent_process() is alive until this closes.
        self.finalizer = util.Finalize(self, _close, (self.sentinel, w.sock))


def _close(fd: int, sock: socket.socket) -> None:
    os.close(fd)
    sock.close()


def _matches(process_obj, target: str) -> bool:
    fn = getattr(process_obj, "_target", None)
    return f"{getattr(fn, '__module__', '')}:{getattr(fn, '__qualname__', '')}" == target


def install(warm: Warm, target: str) -> None:
    """Route the first spawn of `target` to `warm` (every other spawn as before)."""
    plain = context.SpawnProcess._Popen

    def _popen(process_obj):
        if warm.available and _matches(process_obj, target):
            warm.available = False
            other = sorted(k for k, v in warm.seen.items() if os.environ.get(k) != v)
            if other:
                why = ("its imports saw another value of " + ", ".join(
                    f"{k} ({warm.seen[k]!r}, the parent's now {os.environ.get(k)!r})"
                    for k in other))
                warm.sock.close()       # unused: it reads the end of its socket and exits
            elif warm.alive():
                try:
                    return WarmPopen(process_obj, warm)
                except OSError as e:
                    why = f"the request failed ({e})"
            else:
                why = "it is gone"
            print(f"{NAME}: not using the waiting interpreter (pid {warm.pid}): {why}; "
                  "spawning as usual", file=sys.stderr, flush=True)
        return plain(process_obj)

    context.SpawnProcess._Popen = staticmethod(_popen)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _receive(sock: socket.socket, box: dict) -> None:
    try:
        (n,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
        header = pickle.loads(_recv_exact(sock, n))
        box["fds"] = reduction.recvfds(sock, header["nfds"])
        box["blob"] = _recv_exact(sock, header["size"])
        box["header"] = header
        box["at"] = time.monotonic()
    except EOFError:
        box["eof"] = True
    except BaseException as e:  # noqa: BLE001 (raised again by the main thread)
        box["error"] = e


def _resolve(spec: str):
    module, _, qualname = spec.partition(":")
    fn = importlib.import_module(module)
    for part in qualname.split("."):
        fn = getattr(fn, part)
    return fn


def _failed(spec: str, e: Exception) -> None:
    print(f"{NAME} (pid {os.getpid()}): call {spec} failed: {type(e).__name__}: {e}",
          file=sys.stderr, flush=True)


def call_ahead(calls: list[str]) -> int:
    """Call each MODULE:QUALNAME with no arguments, its result dropped (what it caches stays);
    how many raised (each reported on one line)."""
    failed = 0
    for spec in calls:
        try:
            _resolve(spec)()
        except Exception as e:  # noqa: BLE001 (the target's own first use fills it then)
            failed += 1
            _failed(spec, e)
    return failed


def calls_beside(calls: list[str], box: dict) -> tuple[threading.Thread, int]:
    """Resolve each MODULE:QUALNAME here (its module imported in this thread, not beside the
    target's), then call them in a daemon thread, which prints one line when it ends: how long
    they took, how many raised, and when that was against the request (`box["at"]`, set by
    the reader). (the thread, how many failed to resolve)."""
    fns, failed = [], 0
    for spec in calls:
        try:
            fns.append((spec, _resolve(spec)))
        except Exception as e:  # noqa: BLE001 (as in call_ahead)
            failed += 1
            _failed(spec, e)

    def run() -> None:
        t0, raised = time.monotonic(), failed
        for spec, fn in fns:
            try:
                fn()
            except Exception as e:  # noqa: BLE001
                raised += 1
                _failed(spec, e)
        end = time.monotonic()
        at = box.get("at")
        when = (f"{end - at:.1f} s after the request came" if at is not None and at <= end
                else "before the request came")
        print(f"{NAME} (pid {os.getpid()}): {len(calls)} calls beside the target: "
              f"{end - t0:.1f} s ({raised} failed), ended {when}", file=sys.stderr, flush=True)

    thread = threading.Thread(target=run, name=f"{NAME} calls", daemon=True)
    thread.start()
    return thread, failed


def child_main(sock_fd: int, sentinel_w: int, preload: list[str],
               collector_on: bool = False, calls: list[str] | None = None,
               beside: bool = False) -> int:
    """The waiting interpreter: import, take the one request, become the spawn child."""
    # sentinel_w stays open for this process's life (the parent's Popen.sentinel ends with
    # it); neither it nor the socket goes to this process's own children.
    os.set_inheritable(sentinel_w, False)
    os.set_inheritable(sock_fd, False)
    t0 = time.monotonic()
    sock = socket.socket(fileno=sock_fd)
    box: dict = {}
    reader = threading.Thread(target=_receive, args=(sock, box), daemon=True)
    reader.start()
    calls = list(calls or ())
    thread = None
    with collector_off(not collector_on):
        for name in preload:
            try:
                importlib.import_module(name)
            except BaseException:  # noqa: BLE001
                # Unpickling the request imports it again, where the error belongs.
                traceback.print_exc()
        imported = time.monotonic()
        if calls and not beside:
            failed = call_ahead(calls)
    if calls and beside:
        thread, _ = calls_beside(calls, box)
    called = time.monotonic()
    reader.join()
    if "eof" in box:
        return 0  # the parent never asked
    if "error" in box:
        raise box["error"]
    header = box["header"]
    env = header["env"]
    # What the parent's environment has that this one, after its own imports, has not: set
    # now, before the target runs, but not seen by the imports.
    changed = sorted(k for k in set(env) | set(os.environ) if env.get(k) != os.environ.get(k))
    os.environ.clear()
    os.environ.update(env)
    soft, hard = header["nofile"]
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    except (ValueError, OSError):
        pass
    if not calls:
        done = ""
    elif beside:
        done = (f"{len(calls)} calls beside the target "
                f"({'ended' if not thread.is_alive() else 'running'} at the request), ")
    else:
        done = f"{len(calls)} calls {called - imported:.1f} s ({failed} failed), "
    lag = box["at"] - imported
    came = (f"{lag:.1f} s after the imports" if lag >= 0 else
            f"{-lag:.1f} s before the imports ended")
    print(f"{NAME} (pid {os.getpid()}): imports {imported - t0:.1f} s, {done}request "
          f"{came} ({len(preload)} preloaded, {_collector(collector_on)}); "
          f"the parent's environment differs in: {', '.join(changed) or 'nothing'}",
          file=sys.stderr, flush=True)
    from multiprocessing import resource_tracker
    fds = box["fds"]
    resource_tracker._resource_tracker._fd = fds[0]
    _INHERITED[:] = fds[1:]
    parent_sentinel = sock.detach()
    fp = io.BytesIO(box["blob"])
    process.current_process()._inheriting = True
    try:
        prep = reduction.pickle.load(fp)
        spawn.prepare(prep)
        obj = reduction.pickle.load(fp)
    finally:
        del process.current_process()._inheriting
    return obj._bootstrap(parent_sentinel)


def parse(argv: list[str]):
    """(options, the entry point's arguments, the child's environment) from the launcher's
    arguments. Pure."""
    ap = argparse.ArgumentParser(prog=NAME)
    ap.add_argument("--run", required=True, help="module to run as __main__")
    ap.add_argument("--target", help="MODULE:QUALNAME of the child to warm")
    ap.add_argument("--preload", action="append", default=[])
    ap.add_argument("--child-env", action="append", default=[])
    ap.add_argument("--child-env-default", action="append", default=[])
    ap.add_argument("--call", action="append", default=[], metavar="MODULE:QUALNAME",
                    help="a function of no arguments the child calls after its imports")
    ap.add_argument("--calls-beside", action="store_true",
                    help="make the calls in a thread beside the target, not before it")
    ap.add_argument("--hold", action="store_true",
                    help="import --run's imports, then wait for `go` on stdin")
    ap.add_argument("--collector-on", action="store_true",
                    help="keep the garbage collector on during the imports (the control)")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    ns = ap.parse_args(argv)
    rest = ns.args[1:] if ns.args[:1] == ["--"] else ns.args
    if not ns.target and (ns.preload or ns.child_env or ns.call or ns.child_env_default):
        ap.error("--preload, --call and --child-env are for the child of --target")
    if ns.calls_beside and not ns.call:
        ap.error("--calls-beside: no --call to make")
    for item in ns.call:
        module, sep, qualname = item.partition(":")
        if not (sep and module and qualname):
            ap.error(f"--call {item!r}: use MODULE:QUALNAME")
    child_env: dict[str, str] = {}
    ns.defaults = {}
    for flag, items, into in (("--child-env", ns.child_env, child_env),
                              ("--child-env-default", ns.child_env_default, ns.defaults)):
        for item in items:
            k, sep, v = item.partition("=")
            if not sep or not k:
                ap.error(f"{flag} {item!r}: use NAME=VALUE")
            into[k] = v
    return ns, rest, child_env


def import_statements(source: str) -> list:
    """The import statements of a module's own body (inside its top-level `try`, `if`,
    `with`), each as a module of its own; not those under `if TYPE_CHECKING` or
    `if __name__ == "__main__"`, nor any inside a function or class. Pure."""
    import ast

    def skipped(test) -> bool:
        text = ast.unparse(test)
        return "TYPE_CHECKING" in text or "__name__" in text

    out = []

    def walk(body) -> None:
        for node in body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                if not (isinstance(node, ast.ImportFrom) and node.module == "__future__"):
                    out.append(ast.Module(body=[node], type_ignores=[]))
            elif isinstance(node, ast.If):
                if not skipped(node.test):
                    walk(node.body)
                    walk(node.orelse)
            elif isinstance(node, (ast.Try, ast.With)):
                walk(node.body)
    walk(ast.parse(source).body)
    return out


def ahead(run: str, collector_on: bool = False) -> tuple[int, int, float]:
    """Run the import statements of module `run`'s own source (collector_off unless
    `collector_on`); (statements, failed, seconds). Its body runs later, as __main__."""
    import importlib.util
    t0 = time.monotonic()
    statements = []
    name = run
    with collector_off(not collector_on):
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations is not None:
            name = f"{run}.__main__"           # a package runs as its __main__, as with -m
            spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin and spec.origin.endswith(".py"):
            with open(spec.origin, encoding="utf-8") as f:
                statements = import_statements(f.read())
        # Relative imports resolve against the module's package, as they would in its body.
        package = name.rpartition(".")[0]
        failed = 0
        for tree in statements:
            try:
                # the module's own import statements, which its body runs anyway
                exec(compile(tree, spec.origin, "exec"),  # noqa: S102
                     {"__name__": f"{NAME}.ahead", "__package__": package})
            except (Exception, SystemExit):  # noqa: BLE001 (its own import raises it again)
                failed += 1
    return len(statements), failed, time.monotonic() - t0


def hold(run: str, stdin_fd: int = 0, collector_on: bool = False) -> bool:
    """Import what module `run` imports, then wait for `go` on `stdin_fd`; whether it came."""
    n, failed, took = ahead(run, collector_on)
    imported = time.monotonic()
    print(f"{NAME} (pid {os.getpid()}): held: imports {took:.1f} s "
          f"({n} import statements of {run}, {failed} failed, "
          f"{_collector(collector_on)}); waiting for go", file=sys.stderr, flush=True)
    line = b""
    while not line.endswith(b"\n"):
        chunk = os.read(stdin_fd, 64)
        if not chunk:
            break
        line += chunk
    if line.strip() != b"go":
        return False
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, stdin_fd)
    os.close(devnull)
    print(f"{NAME} (pid {os.getpid()}): go, {time.monotonic() - imported:.1f} s after the "
          "imports", file=sys.stderr, flush=True)
    return True


def main(argv: list[str] | None = None) -> None:
    ns, rest, child_env = parse(sys.argv[1:] if argv is None else argv)
    warm = None
    if ns.target:
        warm = Warm(ns.preload, child_env, ns.collector_on, ns.call, ns.defaults,
                    ns.calls_beside)
        install(warm, ns.target)
    try:
        if ns.hold:
            if not hold(ns.run, collector_on=ns.collector_on):
                return
        else:
            n, failed, took = ahead(ns.run, ns.collector_on)
            print(f"{NAME} (pid {os.getpid()}): imports {took:.1f} s ahead of {ns.run} ({n} "
                  f"import statements, {failed} failed, "
                  f"{_collector(ns.collector_on)})", file=sys.stderr, flush=True)
        sys.argv = [ns.run, *rest]
        runpy.run_module(ns.run, run_name="__main__", alter_sys=True)
    finally:
        if warm is not None:
            warm.close()


if __name__ == "__main__":
    import e2e_warm_spawn  # this module by its name, so that what pickles refers to it so

    e2e_warm_spawn.main()
