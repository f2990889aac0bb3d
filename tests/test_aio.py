"""shim/aio.py: waits that never end before the work they wait for (docs/design/crash-safety.md
(Cancellation))."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from shim.aio import run_to_end, undo_to_end, wait_out


async def test_wait_out_outlasts_repeated_cancellations_and_returns_the_last() -> None:
    release = asyncio.Event()

    async def work() -> str:
        await release.wait()
        return "done"

    work_task = asyncio.ensure_future(work())
    waiter = asyncio.ensure_future(wait_out(work_task))
    for _ in range(3):  # the caller cancelled three times while the work runs
        await asyncio.sleep(0)
        waiter.cancel()
        await asyncio.sleep(0)
        assert not waiter.done()
    release.set()
    cancelled = await waiter
    assert isinstance(cancelled, asyncio.CancelledError)
    assert work_task.result() == "done"  # its outcome stays in it


async def test_wait_out_leaves_the_works_own_error_in_it() -> None:
    async def fails() -> None:
        raise ValueError("its own")

    task = asyncio.ensure_future(fails())
    assert await wait_out(task) is None
    with pytest.raises(ValueError, match="its own"):
        task.result()


async def test_a_cancelled_run_to_end_returns_only_after_its_thread() -> None:
    stop = threading.Event()
    ended: list[float] = []

    def blocking() -> None:
        stop.wait(5)
        time.sleep(0.2)  # still working after the stop signal
        ended.append(time.monotonic())

    call = asyncio.ensure_future(run_to_end(blocking, stop=stop))
    await asyncio.sleep(0.05)
    call.cancel()
    await asyncio.sleep(0.05)
    call.cancel()  # a second cancellation does not let it leave early either
    with pytest.raises(asyncio.CancelledError):
        await call
    assert stop.is_set() and ended and ended[0] <= time.monotonic()


async def test_undo_to_end_raises_the_callers_cancellation_after_the_undo() -> None:
    done: list[str] = []

    async def undo() -> None:
        await asyncio.sleep(0.1)
        done.append("undone")

    call = asyncio.ensure_future(undo_to_end(undo()))
    await asyncio.sleep(0.01)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert done == ["undone"]
