"""pytest glue for what a session writes: progress lines past pytest's output capture, one
result record per test (the `record` fixture; a setup or teardown failure reaches it too), the
result files and the time report at the session's end, and the summary table. Under
pytest-xdist each worker sends its records and topologies to the controller, which writes the
files once, and writes its progress lines to `progress-gwN.log` in the results folder.
Loaded by pytest_plugin.py."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import pytest

from .infra.cluster import progress
from .infra.cluster import signals as lifecycle
from .infra.reports import results, time_report
from .infra.reports.index import plain_nodeid
from .infra.specs import settings
from .pytest_state import OUTCOME, RECORD, RECORDED, state
from .pytest_xdist import devices_after, worker


def pytest_configure(config):
    previous = progress.sink            # a nested session (pytester) gives it back at its end
    progress.set_sink(_live_lines(config))
    config.add_cleanup(lambda: progress.set_sink(previous))


_PENDING: list[tuple] = []     # (config, line) of other threads, for the main thread to write


def _live_lines(config):
    """Progress lines (infra/cluster/progress.py) past pytest's output capture: a lane's log shows
    them while a topology boots or an eval runs, not only when a test fails. Only the main
    thread may suspend the capture (pytest's capture is not thread-safe): a line from another
    thread waits in _PENDING until the main thread writes it (flush_lines: at each test's start
    and end, and with the main thread's next line)."""
    def write(line: str) -> None:
        if threading.current_thread() is not threading.main_thread():
            _PENDING.append((config, line))
            return
        flush_lines()
        _write_line(config, line)
    return write


def flush_lines() -> None:
    """Write the other threads' pending progress lines (main thread only)."""
    while _PENDING:
        _write_line(*_PENDING.pop(0))


def _write_line(config, line: str) -> None:
    if worker(config):      # a pytest-xdist worker's output reaches no terminal: its own file
        path = settings.results_dir() / f"progress-{config.workerinput['workerid']}.log"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(f"{time.strftime('%H:%M:%S')} {line}\n")
        return
    capman = config.pluginmanager.get_plugin("capturemanager")
    tr = config.pluginmanager.get_plugin("terminalreporter")
    if capman is None or tr is None:
        print(line, file=sys.stderr, flush=True)
        return
    with capman.global_and_fixture_disabled():
        tr.write_line(line)


def pytest_runtest_logstart(nodeid, location):
    flush_lines()


def pytest_runtest_logfinish(nodeid, location):
    flush_lines()


@pytest.fixture
def record(request):
    """A dict the test fills; written as results/tests/<test>.json with the cluster's facts."""
    rec: dict = {"test": plain_nodeid(request.node.nodeid), "started": time.time()}
    request.node.stash[RECORDED] = True
    request.node.stash[RECORD] = rec
    yield rec
    rec["outcome"] = request.node.stash.get(OUTCOME, "unknown")
    # the topology as handed out (torn down already where the test named `record` first)
    c = getattr(request.node, "_e2e_cluster", None)
    if c is None and "cluster" in request.fixturenames:
        c = request.getfixturevalue("cluster")
    if c is not None:
        rec.setdefault("cluster", c.name)
        rec.update(results.cluster_facts(c))
    state(request.config).records.append(rec)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if rep.when == "call" or (rep.when == "setup" and rep.outcome != "passed"):
        item.stash[OUTCOME] = rep.outcome
    if rep.when == "call":     # the test body's interval, for the time report
        state(item.config).calls.append((rep.start, rep.stop))
    if rep.when == "teardown" and rep.failed and RECORD in item.stash:
        # Failed after its record was taken (the idle check after the test, which runs last):
        # the result files say so too, not only pytest's exit code and junit.
        rec = item.stash[RECORD]
        rec["outcome"] = "error"
        rec["teardown_error"] = _error_line(rep)
    if (rep.when == "setup" and rep.failed and "record" in getattr(item, "fixturenames", ())
            and not item.stash.get(RECORDED, False)):
        # A fixture before `record` failed (a topology that did not start): still leave a
        # result record, so the failure is in the result files and not only in the log.
        ck = getattr(getattr(item, "callspec", None), "params", {}).get("cluster_key") or ()
        state(item.config).records.append({
            "test": plain_nodeid(item.nodeid), "outcome": "error", "started": time.time(),
            **({"engine": ck[0], "topology": str(ck[1])} if len(ck) == 2 else {}),
            "error": _error_line(rep)})


def _error_line(rep) -> str:
    crash = getattr(rep.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(rep.longrepr)
    return text.strip().splitlines()[0][:500] if text and text.strip() else ""


def _part(st) -> dict:
    """This process's records and topologies, as data (a pytest-xdist worker sends them)."""
    clusters = {n: {"timing": vars(c.timing), "entry": time_report.cluster_entry(c),
                    "teardown": c.teardown_report.to_dict() if c.teardown_report else None}
                for n, c in st.clusters.items()}
    bad = [f"{n}: {c.teardown_report.verdict()}" for n, c in st.clusters.items()
           if c.teardown_report is not None and not c.teardown_report.ok]
    return {"records": st.records, "clusters": clusters, "calls": st.calls, "violations": bad}


def pytest_sessionfinish(session, exitstatus):
    lifecycle.teardown_all()        # what a signal left running, stopped and verified first
    config = session.config
    st = state(config)
    part = _part(st)
    if worker(config):      # the controller writes the session's files
        config.workeroutput["e2e"] = json.dumps(part, default=str)
        return
    parts = [part, *st.worker_parts]
    records = [r for p in parts for r in p["records"]]
    clusters = {n: c for p in parts for n, c in p["clusters"].items()}
    bad = [line for p in parts for line in p["violations"]]
    devices = devices_after(config)
    st.teardown_violations = bad + ([devices] if devices else [])
    if st.teardown_violations and settings.ci():
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    if not records and not clusters:
        return   # nothing end-to-end ran (e.g. unit tests only): no summary to write
    st.summary = results.write_session(records, clusters, wall_s=time.monotonic() - st.t0)
    st.time_report = time_report.compute([c["entry"] for c in clusters.values()],
                                         [tuple(c) for p in parts for c in p["calls"]],
                                         st.t0_epoch, time.time())
    if st.assignment is not None:
        st.time_report["assignment"] = st.assignment.to_dict()
    time_report.write(st.time_report, Path(st.summary["dir"]))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    st = state(config)
    for line in st.teardown_violations:
        terminalreporter.write_line(f"TEARDOWN VIOLATION {line}", red=True, bold=True)
    out = st.summary
    if out and out.get("table"):
        terminalreporter.section("e2e results")
        terminalreporter.write_line(out["table"])
        terminalreporter.write_line(f"results: {out['dir']}")
    if st.time_report:
        terminalreporter.write_line(f"time: {time_report.headline(st.time_report)}", bold=True)
        if st.assignment is not None:
            terminalreporter.write_line(f"workers: {st.assignment.reason}")
        for line in (time_report.phases_line(st.time_report),
                     time_report.warm_line(st.time_report)):
            if line:
                terminalreporter.write_line(line)
