"""asyncio helpers for work that must not outlive the operation that started it."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import threading
from collections.abc import Callable, Coroutine, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from shim import errors

T = TypeVar("T")


class Lane:
    """A bounded share of podshim's worker threads for one kind of operation (docs/design/crash-safety.md
    (Cancellation)): the blocking steps of every operation entered here run on this lane's own
    `workers` threads, so a flood of slow restores (an archive that takes minutes to hash) queues
    behind itself instead of taking every thread of the loop's default executor, where a healthy
    CheckpointPod's steps run. At most `max_operations` operations may be inside (running or
    queued for a thread); one more is refused at once with RESOURCE_EXHAUSTED."""

    def __init__(self, name: str, workers: int, max_operations: int) -> None:
        self.name = name
        self.workers = workers
        self.max_operations = max_operations
        self.active = 0
        self._pool: ThreadPoolExecutor | None = None

    @property
    def pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix=f"podshim-{self.name}")
        return self._pool

    @contextlib.contextmanager
    def enter(self) -> Iterator[None]:
        """Run the caller's operation in this lane: every run_to_end inside it (and in tasks it
        starts) uses the lane's threads."""
        if self.active >= self.max_operations:
            raise errors.ResourceExhausted(
                f"{self.active} {self.name} operations are already in progress (at most "
                f"{self.max_operations}); retry when some have ended"
            )
        self.active += 1
        token = _LANE.set(self)
        try:
            yield
        finally:
            _LANE.reset(token)
            self.active -= 1


_LANE: contextvars.ContextVar[Lane | None] = contextvars.ContextVar("podshim_lane", default=None)


async def run_to_end(
    fn: Callable[..., T], /, *args: object, stop: threading.Event | None = None, **kwargs: object
) -> T:
    """Like asyncio.to_thread, but a cancellation (the caller's deadline) waits for the thread to
    finish before it propagates. A thread cannot be stopped from outside: without this, a freeze
    could land after the thaw, or a file be written into output_path after it was cleared.
    `stop`, if given, is set on cancellation so that a cooperative `fn` ends early. Inside a
    Lane (Lane.enter) `fn` runs on the lane's threads; a call still queued there when cancelled
    never runs."""
    loop = asyncio.get_running_loop()
    call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
    lane = _LANE.get()
    queued: Future[T] | None = None
    if lane is None:
        future = loop.run_in_executor(None, call)
    else:
        queued = lane.pool.submit(call)
        future = asyncio.wrap_future(queued, loop=loop)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        if stop is not None:
            stop.set()
        if queued is not None and queued.cancel():
            raise  # it had not started: nothing to wait for
        await wait_out(future)  # its own error is secondary to the cancellation
        raise


async def wait_out(future: asyncio.Future[Any]) -> asyncio.CancelledError | None:
    """Await `future` until it is done, however often the caller is cancelled meanwhile; the
    caller's cancellation (the last one), if any, is returned for it to raise once its own
    clean-up is over. `future`'s outcome (result, error, cancelled) stays in it. The one loop
    behind run_to_end, undo_to_end and every wait that must not end before the work it waits for."""
    cancelled: asyncio.CancelledError | None = None
    while not future.done():
        try:
            await asyncio.shield(future)
        except asyncio.CancelledError as e:
            if not future.cancelled():
                cancelled = e  # the caller's: keep waiting, the work goes on
        except BaseException:  # noqa: BLE001 - the future's own error: it stays in the future
            break
    return cancelled


async def undo_to_end(undo: Coroutine[object, object, None]) -> None:
    """Run an operation's undo (a thaw, a rollback) in a task of its own and return only once it
    has ended, even when the caller is cancelled meanwhile (its deadline, podshim's stop): the
    cancellation propagates after it. Not merely shielded: a shield lets the cancellation leave at
    once, which ends the operation (and releases its locks) while the undo still runs, and a
    second call could start on a pod mid-recovery. The undo's own error is raised, before the
    cancellation."""
    task = asyncio.ensure_future(undo)
    cancelled = await wait_out(task)
    if task.cancelled():
        raise cancelled or asyncio.CancelledError()
    error = task.exception()
    if error is not None:
        raise error
    if cancelled is not None:
        raise cancelled


# the one stop signal of every thread podshim runs (fsutil, crypto, the container tar); defined in
# shim/errors.py, which imports nothing, so the blocking modules need not import asyncio
Stopped = errors.Stopped


class Steps:
    """The blocking steps of one operation, each in a worker thread through run_to_end: when the
    operation is cancelled (its deadline), `cancel` is set, long copies calling check() end
    early (Stopped), and the step is awaited to its end, so nothing writes into a directory
    after the clean-up removed it."""

    def __init__(self) -> None:
        self.cancel = threading.Event()

    async def run(self, fn: Callable[..., T], /, *args: object, **kwargs: object) -> T:
        return await run_to_end(fn, *args, stop=self.cancel, **kwargs)

    def check(self) -> None:
        if self.cancel.is_set():
            raise Stopped("the operation was cancelled")
