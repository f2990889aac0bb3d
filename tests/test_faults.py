"""Failpoints (shim/faults.py): the spec, the n-th hit, and a sleep on the event loop that a
deadline cancels (a failpoint standing for a slow step must not outlive the caller's deadline)."""

from __future__ import annotations

import asyncio
import time

import pytest

from shim import faults
from shim.errors import Internal


def test_error_on_the_nth_hit_only() -> None:
    fp = faults.Failpoints("a=error@2, b=kill")
    assert fp.points == {"a": "error@2", "b": "kill"}
    fp.hit("a")
    with pytest.raises(Internal, match="failpoint a triggered"):
        fp.hit("a")
    fp.hit("a")
    fp.hit("unarmed")


def test_a_sleep_on_the_loop_is_cancelled_by_the_deadline() -> None:
    fp = faults.Failpoints("slow=sleep:60")

    async def call() -> float:
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.05):
                await fp.hit_async("slow")
        return time.monotonic() - started

    assert asyncio.run(call()) < 30  # cancelled, not slept out


def test_a_sleep_on_the_loop_leaves_the_loop_running() -> None:
    fp = faults.Failpoints("slow=sleep:0.2")

    async def call() -> int:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)

        ticker = asyncio.ensure_future(tick())
        await fp.hit_async("slow")
        ticker.cancel()
        return ticks

    assert asyncio.run(call()) > 1
