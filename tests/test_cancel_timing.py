"""serving_faults._drop: the client leaves at once and the load scrape runs alongside, so a
slow scrape cannot delay the cancel (pure asyncio logic; the scrape is a stand-in)."""

import asyncio
import time

from e2e_test.infra import serving_faults as sf


def _case():
    return sf.CancelCase("cancel during prefill", "1p1d", 16, 800)


async def _tokens_after(case, first_s: float):
    """A stream whose first token comes `first_s` after the start: counts chunks as the
    real consumer does, until cancelled."""
    await asyncio.sleep(first_s)
    while True:
        case.chunks_before_cancel += 1
        await asyncio.sleep(0.02)


def _slow_loads(seconds):
    def loads(_cluster):
        time.sleep(seconds)
        return {"prefill-0": {"running": 1.0}}
    return loads


def test_cancel_does_not_wait_for_the_scrape(monkeypatch):
    monkeypatch.setattr(sf, "_loads", _slow_loads(0.5))
    case = _case()

    async def go():
        t0 = time.monotonic()
        task = asyncio.ensure_future(_tokens_after(case, 0.2))
        t_cancel = await sf._drop(None, task, case, t0)
        return t0, t_cancel

    t0, t_cancel = asyncio.run(go())
    assert t_cancel - t0 < 0.1
    assert case.chunks_before_cancel == 0          # the first token was due after the cancel
    assert case.running_at_cancel == {"prefill-0": {"running": 1.0}}


def test_negative_control_scrape_before_cancel_lets_tokens_in(monkeypatch):
    """The order this replaced (scrape, then cancel): the same stream shows tokens before
    the cancel, and the prefill case would have called the prompt too short."""
    monkeypatch.setattr(sf, "_loads", _slow_loads(0.5))
    case = _case()

    async def go():
        t0 = time.monotonic()
        task = asyncio.ensure_future(_tokens_after(case, 0.2))
        case.running_at_cancel = await asyncio.to_thread(sf._loads, None)
        await sf._drop(None, task, case, t0)

    monkeypatch.setattr(sf, "_loads", _slow_loads(0.5))
    asyncio.run(go())
    assert case.chunks_before_cancel > 0
