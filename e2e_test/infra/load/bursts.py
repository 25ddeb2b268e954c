"""Bursts through the gateway and what they must show.

`burst()` fires N requests at once (fixed output length with ignore_eos, so token counts are
exact). `check_within_capacity()` wants every one 200 with the expected count.
`check_admission()` is the seed case: with smg admission configured, every refusal must come
from the gateway (429 admission_queue_full or 503 admission_queue_timeout, with retry-after),
fast, nothing may hang past the queue timeout, admitted requests complete (at least one
must), no more requests are refused as "queue full" than the capacity leaves, and smg's
`smg_admission_queue_rejected_total` must match what the client counted. A burst with no
result, or with fewer results than requests sent, is an error for both checks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from ..cluster import metrics
from ..cluster.gateway import Admission
from ..errors import HarnessError
from . import load

ADMISSION_CODES = {429: "admission_queue_full", 503: "admission_queue_timeout"}
REJECTED = "smg_admission_queue_rejected_total"


def burst_requests(model: str, n: int, max_tokens: int = 32, prompt_words: int = 40,
                   chat: bool = False) -> list[load.Request]:
    reqs = []
    for i in range(n):
        text = f"Request {i}. Write a short story about a lighthouse keeper. " + \
               "The sea was calm. " * max(0, prompt_words // 4 - 10)
        body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        if chat:
            body["messages"] = [{"role": "user", "content": text}]
            reqs.append(load.Request("/v1/chat/completions", body, tag=i))
        else:
            body["prompt"] = text
            reqs.append(load.Request("/v1/completions", body, tag=i))
    return reqs


@dataclass
class BurstResult:
    name: str
    report: load.RunReport
    expected_tokens: int
    rejected_metric_delta: float | None = None
    effective_window: dict = field(default_factory=dict)
    admission: dict | None = None
    requested: int = 0                 # requests sent (burst() sets it); 0: not known

    def summary(self) -> dict:
        s = self.report.summary()
        refused = [r for r in self.report.results if r.status in ADMISSION_CODES]
        s.update(name=self.name, expected_tokens=self.expected_tokens, requested=self.requested,
                 refusal_latency_s=load.percentiles([r.latency_s for r in refused]),
                 rejected_metric_delta=self.rejected_metric_delta,
                 effective_window=self.effective_window, admission=self.admission)
        return s


def burst(base_url: str, model: str, n: int, max_tokens: int = 32, stream: bool = False,
          name: str = "burst", metrics_url: str | None = None, watchdog=None,
          timeout: float = 300.0, streaming=None) -> BurstResult:
    """`n` requests at once (burst_requests); `streaming`, a threading.Event, is set at the
    first streamed chunk (load.run)."""
    before = metrics.scrape(metrics_url) if metrics_url else None
    rep = load.run(base_url, burst_requests(model, n, max_tokens), concurrency=n,
                   stream=stream, timeout=timeout, watchdog=watchdog, streaming=streaming)
    res = BurstResult(name, rep, max_tokens, requested=n)
    if metrics_url:
        res.rejected_metric_delta = metrics.delta(before, metrics.scrape(metrics_url), REJECTED)
    return res


def _ran(res: BurstResult) -> int:
    """How many requests the burst judged: none is an error (a verdict over nothing), and so
    is a result count other than what was sent."""
    n = len(res.report.results)
    if not n:
        raise HarnessError(f"{res.name}: no request ran: nothing to judge")
    if res.requested and n != res.requested:
        raise HarnessError(f"{res.name}: {n} results for {res.requested} requests sent")
    return n


def check_within_capacity(res: BurstResult) -> None:
    _ran(res)
    bad = [r for r in res.report.results if not r.ok or r.output_tokens != res.expected_tokens]
    if bad:
        r = bad[0]
        raise HarnessError(f"{res.name}: {len(bad)}/{len(res.report.results)} requests not 200 "
                           f"with {res.expected_tokens} tokens; first: status {r.status}, "
                           f"{r.output_tokens} tokens, {r.error[:160]}")


def check_admission(res: BurstResult, admission: Admission, fast_s: float = 1.0,
                    slack_s: float = 60.0) -> dict:
    results = res.report.results
    n = _ran(res)
    problems = []
    refused = [r for r in results if r.status in ADMISSION_CODES]
    other = [r for r in results if not r.ok and r.status not in ADMISSION_CODES]
    if other:
        problems.append(f"{len(other)} request(s) failed other than by admission: "
                        f"{other[0].status} {other[0].error[:160]}")
    for r in refused:
        if r.error_code != ADMISSION_CODES[r.status]:
            problems.append(f"HTTP {r.status} with code {r.error_code!r}, expected "
                            f"{ADMISSION_CODES[r.status]!r}")
            break
        if not r.retry_after:
            problems.append(f"HTTP {r.status} {r.error_code} without a retry-after header")
            break
    full = [r.latency_s for r in refused if r.status == 429]
    if full and max(full) > fast_s:
        problems.append(f"429 refusals not fast: slowest {max(full):.2f} s > {fast_s} s")
    timeouts = [r.latency_s for r in refused if r.status == 503]
    if timeouts and max(timeouts) > admission.queue_timeout_secs + 2.0:
        problems.append(f"503 after {max(timeouts):.1f} s, queue timeout is "
                        f"{admission.queue_timeout_secs} s")
    for r in results:
        if r.ok and r.output_tokens != res.expected_tokens:
            problems.append(f"admitted request {r.index} returned {r.output_tokens} tokens, "
                            f"expected {res.expected_tokens}")
            break
    longest = max((r.latency_s for r in results), default=0)
    if longest > admission.queue_timeout_secs + slack_s:
        problems.append(f"a request took {longest:.1f} s (queue timeout "
                        f"{admission.queue_timeout_secs} s + {slack_s} s slack)")
    admitted_cap = admission.max_concurrent_requests + admission.queue_size
    if n > admitted_cap and not refused:
        problems.append(f"{n} requests against a capacity of {admitted_cap} and "
                        "none was refused")
    # A 429 says the running slots and the queue were all taken. Sent at once, at most
    # n - capacity requests can find them so (fewer where a request ended meanwhile): more
    # is a gateway refusing requests it had room for (every recorded run: exactly 12 of 16
    # against a capacity of 4).
    full_429 = sum(r.status == 429 for r in refused)
    if full_429 > max(n - admitted_cap, 0):
        problems.append(f"{full_429} of {n} refused as queue full, but a capacity of "
                        f"{admitted_cap} ({admission.max_concurrent_requests} running + "
                        f"{admission.queue_size} queued) leaves at most "
                        f"{max(n - admitted_cap, 0)} to find it full")
    if not res.report.ok:
        problems.append("no request was admitted and completed: the admitted path went "
                        "untested")
    if res.rejected_metric_delta is not None and res.rejected_metric_delta != len(refused):
        problems.append(f"{REJECTED} grew by {res.rejected_metric_delta:.0f}, client counted "
                        f"{len(refused)} refusals")
    if problems:
        raise HarnessError(f"{res.name}: " + "; ".join(problems))
    return {"refused": len(refused), "ok": len(res.report.ok),
            "p99_refusal_s": load.percentiles([r.latency_s for r in refused]).get("p99")}


def _window_from_log(log_text: str, **extra) -> dict:
    m = re.search(r"max_num_seqs['\"]?[:=]\s*(\d+)", log_text)
    if m:
        return {"max_num_seqs": int(m.group(1)), "source": "log"}
    return {"max_num_seqs": None, "source": "unknown", **extra}


def effective_window(worker_url: str, log_text: str = "", timeout: float = 5.0,
                     engine=None) -> dict:
    """The engine's resolved running window, read from the worker itself (the worker's
    `engine`, an engines.Engine: Engine.running_window); else the startup log."""
    win = engine.running_window(worker_url, timeout) if engine is not None else None
    if win is None:
        return _window_from_log(log_text)
    if "error" in win:
        return _window_from_log(log_text, error=win["error"])
    return win


def histogram(res: BurstResult, path: Path) -> Path | None:
    """Latency histogram by status, as a PNG (matplotlib, headless)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    groups: dict[str, list[float]] = {}
    for r in res.report.results:
        key = str(r.status) + (f" {r.error_code}" if r.error_code else "")
        groups.setdefault(key, []).append(r.latency_s)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.hist(list(groups.values()), bins=30, label=list(groups.keys()), stacked=True)
    ax.set_xlabel("end-to-end latency (s)")
    ax.set_ylabel("requests")
    ax.set_title(f"{res.name}: {len(res.report.results)} requests")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


# -- window preflight ------------------------------------------------------------------------------

class WindowError(HarnessError):
    """A burst would meet an engine window it cannot be sure of, or one too small for it."""


def check_window(windows: dict[str, dict], concurrency: int,
                 admission: Admission | None) -> dict[str, int]:
    """Before a burst of `concurrency` requests: every serving worker's resolved running window
    (`max_num_seqs`) must be known. A stage (regular, prefill, decode: the `stage` key, default
    regular) runs at most the sum of its workers' windows at once. With no admission configured
    every stage must hold the whole burst; with admission, smg must not admit more at once than
    the smallest stage holds. Otherwise a WindowError naming the numbers and the way out.
    Returns each stage's capacity. Pure (tests/test_window_preflight.py)."""
    unknown = [n for n, w in windows.items() if not isinstance(w.get("max_num_seqs"), int)]
    if unknown:
        src = "; ".join(f"{n}: {windows[n].get('source', 'unknown')}"
                        + (f" ({windows[n]['error']})" if windows[n].get("error") else "")
                        for n in unknown)
        raise WindowError(f"window preflight: the running window of {', '.join(unknown)} is "
                          f"unknown ({src}) before a burst of {concurrency}; give the window "
                          "(--max-num-seqs: EngineOptions(max_num_seqs=N), E2E_BURST_WINDOW) "
                          "so it can be checked")
    if not windows:
        raise WindowError("window preflight: no serving worker to read a window from")
    stages: dict[str, int] = {}
    members: dict[str, list[str]] = {}
    for n, w in windows.items():
        st = w.get("stage", "regular")
        stages[st] = stages.get(st, 0) + int(w["max_num_seqs"])
        members.setdefault(st, []).append(f"{n}: {int(w['max_num_seqs'])}")
    stage, cap = min(stages.items(), key=lambda kv: kv[1])
    who = f"{stage} ({', '.join(members[stage])})"
    if admission is None and cap < concurrency:
        raise WindowError(f"window preflight: a burst of {concurrency} with no admission "
                          f"configured, but the window is {cap}: {who} runs at most {cap} "
                          f"request(s) at once (max_num_seqs); configure admission (smg "
                          f"--max-concurrent-requests <= {cap}) or give a window >= "
                          f"{concurrency}")
    if admission is not None and admission.max_concurrent_requests > cap:
        raise WindowError(f"window preflight: smg admits {admission.max_concurrent_requests} at "
                          f"once, but the window is {cap}: {who} (max_num_seqs); set "
                          f"--max-concurrent-requests <= {cap} or give a window >= "
                          f"{admission.max_concurrent_requests}")
    return stages


def check_effective_window(window: dict, want: int, worker: str = "worker") -> int:
    """After a burst against a topology started with --max-num-seqs `want`: the window the
    worker itself reports must be known and be `want`; an unknown window is a failure, not
    a pass (the burst's verdict depends on it). Pure (tests/test_window_preflight.py)."""
    got = window.get("max_num_seqs")
    if not isinstance(got, int):
        raise WindowError(f"window check: the running window of {worker} is unknown "
                          f"({window.get('source', 'unknown')}"
                          + (f": {window['error']}" if window.get("error") else "")
                          + f") after a burst meant for a window of {want}")
    if got != want:
        raise WindowError(f"window check: {worker} runs a window of {got}, the burst was "
                          f"meant for {want} (--max-num-seqs not applied?)")
    return got


SERVING_STAGES = ("regular", "prefill", "decode")


def read_windows(cluster, tries: int = 3, timeout: float = 10.0) -> dict[str, dict]:
    """Every serving worker's resolved window (effective_window) and stage, by worker name
    (encode and AFD FFN workers hold no running window of requests). A read that failed (a
    timeout of /server_info on a loaded machine) is tried again, `tries` times at most; a
    worker that answers without a window is unknown at once."""
    out = {}
    for w in cluster.workers:
        if w.command.worker_type not in SERVING_STAGES:
            continue
        for _ in range(tries):
            win = effective_window(w.url, w.process.log_text() if w.process else "",
                                   timeout=timeout, engine=cluster.driver)
            if isinstance(win.get("max_num_seqs"), int) or not win.get("error"):
                break
        out[w.name] = {**win, "stage": w.command.worker_type}
    return out


def preflight(cluster, concurrency: int, admission: Admission | None) -> dict[str, int]:
    """Read every worker's window and check it against the burst (check_window)."""
    return check_window(read_windows(cluster), concurrency, admission)
