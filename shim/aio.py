"""asyncio helpers for work that must not outlive the operation that started it."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


async def run_to_end(
    fn: Callable[..., T], /, *args: object, stop: threading.Event | None = None, **kwargs: object
) -> T:
    """Like asyncio.to_thread, but a cancellation (the caller's deadline) waits for the thread to
    finish before it propagates. A thread cannot be stopped from outside: without this, a freeze
    could land after the thaw, or a file be written into output_path after it was cleared.
    `stop`, if given, is set on cancellation so that a cooperative `fn` ends early."""
    loop = asyncio.get_running_loop()
    call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
    future = loop.run_in_executor(None, call)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        if stop is not None:
            stop.set()
        while not future.done():
            try:
                await asyncio.shield(future)
            except asyncio.CancelledError:
                continue  # cancelled again: keep waiting, the thread is still working
            except BaseException:  # noqa: BLE001 - its own error is secondary to the cancellation
                break
        raise
