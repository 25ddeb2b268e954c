"""The load driver: N requests through the gateway, concurrently, every outcome recorded.

`run(base_url, requests, concurrency)` sends OpenAI-style requests (chat or completions,
streaming or not) with async httpx and returns one RequestResult per request: HTTP status, the
error body, retry-after, time to first token, end-to-end latency, output tokens and the text.
A transport error or an HTTP error is an error, never a wrong answer. A Watchdog fails the run
when in-flight requests make no progress (no token, no completion) for its window.
"""

from __future__ import annotations

import asyncio
import json
import math
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Callable

import httpx

from ..cluster import progress as progress_lines
from ..errors import StallError, WorkerDied
from ..verdicts.oracle import merge_stream_logprobs


@dataclass
class Request:
    path: str                  # /v1/chat/completions or /v1/completions
    body: dict
    tag: object = None         # caller's id for the request (e.g. a dataset row index)


@dataclass
class RequestResult:
    index: int
    tag: object = None
    status: int | None = None          # HTTP status, None for a transport error
    error: str = ""                    # "" when ok
    error_code: str = ""               # e.g. smg's admission_queue_full
    retry_after: str | None = None
    text: str = ""
    output_tokens: int = 0
    prompt_tokens: int = 0
    ttft_s: float | None = None
    latency_s: float = 0.0
    start_s: float = 0.0               # relative to the run's start
    chunks: int = 0
    itl_s: list[float] = field(default_factory=list)   # gaps between streamed chunks
    logprobs: dict | None = None       # the choice's `logprobs` (streamed chunks merged)
    # When the error was read (s after the request's start: a streamed error event or an error
    # status), before the connection's close; None without an error or for a transport error
    error_read_s: float | None = None

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("logprobs", None)
        d["tag"] = str(self.tag) if self.tag is not None else None
        return d


class Progress:
    """When a run last moved; `streaming` (where given) is set at its first streamed chunk."""

    def __init__(self, streaming: threading.Event | None = None):
        self.inflight = 0
        self.last = time.monotonic()
        self.streaming = streaming

    def tick(self) -> None:
        self.last = time.monotonic()

    def chunk(self) -> None:
        """A streamed chunk arrived."""
        self.tick()
        if self.streaming is not None:
            self.streaming.set()


@dataclass
class Watchdog:
    """Fail when requests are in flight and nothing progressed for `window_s` seconds.

    `diagnose()` is called (in a thread) when it fires; what it returns goes into the error:
    which role looks stuck, the worker metrics, where the stack dumps are."""
    window_s: float = 60.0
    what: str = "run"
    diagnose: Callable[[], str] | None = None
    # Polled every second: returns a message when the run must stop at once (a worker died).
    check: Callable[[], str | None] | None = None
    # The error for what `check` returned (a known upstream crash is an UpstreamBug).
    died: Callable[[str], Exception] = WorkerDied
    # Polled every `engine_poll_s` in a thread: a counter of work the engines did (prompt and
    # generated tokens). A rise counts as progress even before the client sees a token (a
    # long prefill queue in PD), so only a real stop of the engines trips the window.
    engine_progress: Callable[[], float | None] | None = None
    engine_poll_s: float = 5.0
    fired_at: float | None = None


@dataclass
class RunReport:
    results: list[RequestResult]
    wall_s: float
    client_overhead_s: float = 0.0     # the driver's own CPU seconds per request
    # The driver's event loop late by more than LOOP_STALL_S: [at s after the run's start,
    # late by s]. While late it reads nothing, so every time it took then is late by as much.
    loop_stalls: list = field(default_factory=list)

    @property
    def ok(self) -> list[RequestResult]:
        return [r for r in self.results if r.ok]

    @property
    def errors(self) -> list[RequestResult]:
        return [r for r in self.results if not r.ok]

    def status_counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.results:
            key = str(r.status) if r.status is not None else "transport"
            if r.error_code:
                key += f" {r.error_code}"
            out[key] = out.get(key, 0) + 1
        return dict(sorted(out.items()))

    def summary(self) -> dict:
        ok = self.ok
        lat = [r.latency_s for r in ok]
        ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
        toks = sum(r.output_tokens for r in ok)
        return {
            "n": len(self.results), "ok": len(ok), "errors": len(self.errors),
            "status_counts": self.status_counts(), "wall_s": round(self.wall_s, 3),
            "req_per_s": round(len(ok) / self.wall_s, 3) if self.wall_s else 0.0,
            "out_tok_per_s": round(toks / self.wall_s, 2) if self.wall_s else 0.0,
            "output_tokens": toks,
            "latency_s": percentiles(lat), "ttft_s": percentiles(ttft),
            "client_overhead_ms": round(self.client_overhead_s * 1000, 3),
        }


def percentiles(xs: list[float], ps=(50, 90, 99)) -> dict:
    if not xs:
        return {}
    s = sorted(xs)
    out = {f"p{p}": round(s[min(len(s) - 1, max(0, math.ceil(p / 100 * len(s)) - 1))], 4)
           for p in ps}
    out["mean"] = round(statistics.fmean(s), 4)
    out["max"] = round(s[-1], 4)
    return out


def _error_code(body: str) -> str:
    try:
        j = json.loads(body)
    except ValueError:
        return ""
    err = j.get("error", j) if isinstance(j, dict) else {}
    if isinstance(err, dict):
        for k in ("code", "type"):
            if isinstance(err.get(k), str) and err[k]:
                return err[k]
    return ""


def extract_text(choice: dict) -> str:
    if "message" in choice:
        return choice["message"].get("content") or ""
    if "delta" in choice:
        return choice["delta"].get("content") or ""
    return choice.get("text") or ""


async def _one(client: httpx.AsyncClient, i: int, req: Request, stream: bool, t_run: float,
               progress: Progress, timeout: float) -> RequestResult:
    res = RequestResult(index=i, tag=req.tag)
    body = dict(req.body)
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    t0 = time.monotonic()
    res.start_s = t0 - t_run
    progress.inflight += 1
    try:
        if stream:
            async with client.stream("POST", req.path, json=body, timeout=timeout) as r:
                res.status = r.status_code
                res.retry_after = r.headers.get("retry-after")
                if r.status_code != 200:
                    text = (await r.aread()).decode("utf-8", "replace")
                    res.error, res.error_code = text[:500] or f"HTTP {r.status_code}", _error_code(text)
                    res.error_read_s = time.monotonic() - t0
                    return res
                parts = []
                lp_parts = []
                last_chunk = None
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    try:
                        chunk = json.loads(data)
                    except ValueError:
                        res.error = f"bad SSE chunk: {data[:200]}"
                        res.error_read_s = time.monotonic() - t0
                        return res
                    if "error" in chunk:
                        res.error = json.dumps(chunk["error"])[:500]
                        res.error_code = _error_code(data)
                        res.error_read_s = time.monotonic() - t0
                        return res
                    progress.chunk()
                    for ch in chunk.get("choices") or []:
                        if ch.get("logprobs"):
                            lp_parts.append(ch["logprobs"])
                        t = extract_text(ch)
                        if t:
                            now = time.monotonic()
                            if res.ttft_s is None:
                                res.ttft_s = now - t0
                            else:
                                res.itl_s.append(now - last_chunk)
                            last_chunk = now
                            parts.append(t)
                            res.chunks += 1
                    if chunk.get("usage"):
                        res.output_tokens = chunk["usage"].get("completion_tokens", 0) or 0
                        res.prompt_tokens = chunk["usage"].get("prompt_tokens", 0) or 0
                res.text = "".join(parts)
                if lp_parts:
                    res.logprobs = merge_stream_logprobs(lp_parts)
                if not res.output_tokens:
                    res.error = "stream ended without usage counts"
        else:
            r = await client.post(req.path, json=body, timeout=timeout)
            res.status = r.status_code
            res.retry_after = r.headers.get("retry-after")
            if r.status_code != 200:
                res.error, res.error_code = r.text[:500] or f"HTTP {r.status_code}", _error_code(r.text)
                res.error_read_s = time.monotonic() - t0
                return res
            j = r.json()
            choices = j.get("choices") or []
            if not choices:
                res.error = f"no choices in response: {r.text[:200]}"
                return res
            res.text = extract_text(choices[0])
            res.logprobs = choices[0].get("logprobs")
            usage = j.get("usage") or {}
            res.output_tokens = usage.get("completion_tokens", 0) or 0
            res.prompt_tokens = usage.get("prompt_tokens", 0) or 0
            res.ttft_s = time.monotonic() - t0
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"[:500] or type(e).__name__
    except ValueError as e:
        res.error = f"bad JSON: {e}"[:500]
    finally:
        res.latency_s = time.monotonic() - t0
        progress.inflight -= 1
        progress.tick()
    return res


async def _report_progress(label: str, tasks: list) -> None:
    """ "label: n/N done, t s" every E2E_PROGRESS_S; ends by itself when every task is done."""
    lines = progress_lines.LoadProgress(label, len(tasks))
    if not lines.every:
        return
    while not all(t.done() for t in tasks):
        await asyncio.sleep(min(1.0, lines.every))
        lines.tick(sum(t.done() for t in tasks))


# The driver's own lateness: a tick due every LOOP_TICK_S that comes more than LOOP_STALL_S late
# is a stall of the driver itself (the GIL held elsewhere, no CPU, a blocking call in the loop).
LOOP_TICK_S = 0.05
LOOP_STALL_S = 0.25


async def _watch_loop(stalls: list, t_run: float) -> None:
    """Append [at s after t_run, late by s] to `stalls` for every tick of this event loop that
    came more than LOOP_STALL_S late; runs until cancelled."""
    prev = time.monotonic()
    while True:
        await asyncio.sleep(LOOP_TICK_S)
        now = time.monotonic()
        late = now - prev - LOOP_TICK_S
        if late > LOOP_STALL_S:
            stalls.append([round(prev + LOOP_TICK_S - t_run, 3), round(late, 3)])
        prev = now


async def run_async(base_url: str, requests: list[Request], concurrency: int = 16,
                    stream: bool = False, timeout: float = 600.0,
                    watchdog: Watchdog | None = None, rate: float = math.inf,
                    seed: int = 0, label: str | None = None,
                    streaming: threading.Event | None = None) -> RunReport:
    """`rate` requests/s with Poisson arrivals (inf: all at once), at most `concurrency` in
    flight. Progress lines (n/N done) are labelled `label`, else the watchdog's `what`. The
    report's `loop_stalls` are this event loop's own (_watch_loop), from the first request.
    `streaming` is set when the first streamed chunk arrives (a fault aimed mid-run waits for
    it: test_faults.py)."""
    stalls: list = []
    lag = asyncio.ensure_future(_watch_loop(stalls, time.monotonic()))
    try:
        rep = await _run_async(base_url, requests, concurrency, stream, timeout, watchdog, rate,
                               seed, label, streaming)
    finally:
        lag.cancel()
    rep.loop_stalls = stalls
    return rep


async def _run_async(base_url: str, requests: list[Request], concurrency: int,
                     stream: bool, timeout: float, watchdog: Watchdog | None, rate: float,
                     seed: int, label: str | None,
                     streaming: threading.Event | None) -> RunReport:
    """run_async's run: the requests, the watchdog's checks, the report."""
    progress = Progress(streaming)
    sem = asyncio.Semaphore(max(1, concurrency))
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency)
    cpu0 = time.process_time()
    t_run = time.monotonic()
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=timeout) as client:

        arrivals = _arrivals(len(requests), rate, seed)

        async def guarded(i: int, req: Request) -> RequestResult:
            delay = arrivals[i] - (time.monotonic() - t_run)
            if delay > 0:
                await asyncio.sleep(delay)
            async with sem:
                return await _one(client, i, req, stream, t_run, progress, timeout)

        tasks = [asyncio.ensure_future(guarded(i, r)) for i, r in enumerate(requests)]
        label = label or (watchdog.what if watchdog is not None else None)
        # held in a local: the loop keeps only a weak reference to a task
        reporter = asyncio.ensure_future(_report_progress(label, tasks)) if label else None
        done_all = asyncio.ensure_future(asyncio.gather(*tasks))
        if watchdog is None:
            results = await done_all
        else:
            engine_seen, engine_poll = None, None
            while True:
                finished, _ = await asyncio.wait({done_all}, timeout=1.0)
                if finished:
                    results = done_all.result()
                    break
                if watchdog.engine_progress:
                    if engine_poll is not None and engine_poll.done():
                        value = engine_poll.result()
                        if value is not None and engine_seen is not None and value > engine_seen:
                            progress.tick()
                        engine_seen = value if value is not None else engine_seen
                        engine_poll = None
                    if engine_poll is None and (time.monotonic() - progress.last
                                                >= watchdog.engine_poll_s or engine_seen is None):
                        engine_poll = asyncio.get_running_loop().run_in_executor(
                            _ENGINE_POLLS, _safe_call, watchdog.engine_progress)
                dead = watchdog.check() if watchdog.check else None
                if dead:
                    watchdog.fired_at = time.monotonic() - t_run
                    done_all.cancel()
                    for t in tasks:
                        t.cancel()
                    # done_all too: its CancelledError, never retrieved, was printed at exit
                    await asyncio.gather(done_all, *tasks, return_exceptions=True)
                    raise watchdog.died(f"{watchdog.what}: {dead}")
                idle = time.monotonic() - progress.last
                if progress.inflight > 0 and idle > watchdog.window_s:
                    watchdog.fired_at = time.monotonic() - t_run
                    inflight = progress.inflight     # cancelling below counts them down to 0
                    diag = ""
                    if watchdog.diagnose:
                        try:
                            diag = await asyncio.to_thread(watchdog.diagnose)
                        except Exception as e:  # diagnostics must not hide the stall
                            diag = f"(diagnostics failed: {e!r})"
                    done_all.cancel()
                    for t in tasks:
                        t.cancel()
                    await asyncio.gather(done_all, *tasks, return_exceptions=True)
                    raise StallError(
                        f"{watchdog.what}: no progress for {idle:.0f} s with "
                        f"{inflight} request(s) in flight (watchdog window "
                        f"{watchdog.window_s:.0f} s)" + (f"; {diag.splitlines()[0]}" if diag else ""),
                        diag)
    if reporter is not None:
        reporter.cancel()
    if watchdog is not None and watchdog.check is not None:
        # Requests that failed fast because a worker died are errors of a dead topology:
        # say so, rather than return a report of transport errors. A killed process closes
        # its sockets before it can be reaped, so after failures look again for a moment.
        failed = any(not r.ok for r in results)
        dead = watchdog.check()
        deadline = time.monotonic() + (2.0 if failed else 0.0)
        while not dead and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
            dead = watchdog.check()
        if dead:
            watchdog.fired_at = time.monotonic() - t_run
            raise watchdog.died(f"{watchdog.what}: {dead}")
    wall = time.monotonic() - t_run
    # The driver's own CPU time per request (this process, all threads): compare it with the
    # latencies to see that the client is not the bottleneck.
    per_request = (time.process_time() - cpu0) / max(1, len(requests))
    return RunReport(list(results), wall, per_request)


# The watchdog's engine polls run here, not in the loop's default executor: asyncio.run joins
# that one at exit, so a poll still waiting for a slow /metrics (Cluster.WORK_SCRAPE_S) would
# hold every run's result, and a stall's error, until it timed out.
_ENGINE_POLLS = ThreadPoolExecutor(max_workers=4, thread_name_prefix="engine-poll")


def _safe_call(fn):
    try:
        return fn()
    except Exception:
        return None


def _arrivals(n: int, rate: float, seed: int) -> list[float]:
    if not rate or math.isinf(rate):
        return [0.0] * n
    import random
    rnd, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rnd.expovariate(rate)
    return out


def run(base_url: str, requests: list[Request], concurrency: int = 16, stream: bool = False,
        timeout: float = 600.0, watchdog: Watchdog | None = None, rate: float = math.inf,
        seed: int = 0, label: str | None = None,
        streaming: threading.Event | None = None) -> RunReport:
    return asyncio.run(run_async(base_url, requests, concurrency, stream, timeout, watchdog,
                                 rate, seed, label, streaming))
