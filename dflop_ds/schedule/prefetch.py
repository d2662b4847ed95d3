"""Compute the next items of a sequence in a background thread, with errors and overruns
surfacing in the caller instead of hanging it."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class ScheduleTimeoutError(TimeoutError, RuntimeError):
    """A schedule (or an exact solve) took longer than its deadline; the message names which."""


class _Failure:
    def __init__(self, error: BaseException) -> None:
        self.error = error


_DONE = object()


def _timeout_message(what: str, timeout_s: float) -> str:
    return (
        f"scheduling {what} took longer than schedule_timeout_s={timeout_s:g} s: the partitioner or"
        " solver is stuck or far too slow (raise dflop.sampler.schedule_timeout_s if it is merely slow)"
    )


def run_with_deadline(fn: Callable[[], V], timeout_s: float | None, what: str) -> V:
    """``fn()``, or :class:`ScheduleTimeoutError` naming ``what`` when it has not returned after
    ``timeout_s`` seconds (``None``: wait as long as it takes). An overrunning ``fn`` is left to
    finish in a daemon thread; its result is discarded."""
    if timeout_s is None:
        return fn()
    box: dict[str, object] = {}

    def work() -> None:
        try:
            box["value"] = fn()
        except BaseException as error:  # noqa: BLE001 - handed to the caller
            box["error"] = error

    thread = threading.Thread(target=work, name="dflop-deadline", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise ScheduleTimeoutError(_timeout_message(what, timeout_s))
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]


class BackgroundMap(Generic[K, V]):
    """Iterate ``fn(key)`` over ``keys``, computing up to ``depth`` results ahead in a thread.

    Results come back in key order. An exception raised by ``fn`` is re-raised in the consuming
    thread (with the original as its cause); a worker that dies without a result is reported
    instead of waited on forever; with ``timeout_s``, a consumer that has waited that long for
    one result gets :class:`ScheduleTimeoutError` naming ``describe(key)``. ``close()`` (or
    leaving a ``with`` block) stops the worker.
    """

    def __init__(
        self,
        fn: Callable[[K], V],
        keys: Iterable[K],
        depth: int = 1,
        poll_s: float = 1.0,
        timeout_s: float | None = None,
        describe: Callable[[K], str] = repr,
    ) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self._fn = fn
        self._keys = list(keys)
        self._delivered = 0
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._poll_s = poll_s if timeout_s is None else min(poll_s, max(timeout_s / 4, 0.01))
        self._timeout_s = timeout_s
        self._describe = describe
        self._thread = threading.Thread(target=self._work, name="dflop-scheduler", daemon=True)
        self._thread.start()

    def _put(self, item: object) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=self._poll_s)
                return True
            except queue.Full:
                continue
        return False

    def _work(self) -> None:
        try:
            for key in self._keys:
                if not self._put(self._fn(key)):
                    return
        except BaseException as error:  # noqa: BLE001 - handed to the consumer
            self._put(_Failure(error))
            return
        self._put(_DONE)

    def __iter__(self) -> Iterator[V]:
        return self

    def _waiting_for(self) -> str:
        if self._delivered < len(self._keys):
            return self._describe(self._keys[self._delivered])
        return "the end of the keys"

    def __next__(self) -> V:
        timeout_s = self._timeout_s
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            try:
                item = self._queue.get(timeout=self._poll_s)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    raise RuntimeError("the background scheduling thread stopped without a result") from None
                if timeout_s is not None and deadline is not None and time.monotonic() >= deadline:
                    self.close()
                    raise ScheduleTimeoutError(_timeout_message(self._waiting_for(), timeout_s)) from None
        if item is _DONE:
            raise StopIteration
        if isinstance(item, _Failure):
            raise RuntimeError(f"background scheduling of {self._waiting_for()} failed: {item.error}") from item.error
        self._delivered += 1
        return item

    def close(self, wait_s: float = 0.0) -> None:
        """Stop the worker thread: it finishes the item it is computing, then exits. With
        ``wait_s > 0``, wait up to that long for it to be gone (before a process exits, so no
        thread is mid-computation while the interpreter tears down)."""
        self._stop.set()
        if wait_s > 0 and self._thread is not threading.current_thread():
            self._thread.join(timeout=wait_s)

    def __enter__(self) -> BackgroundMap[K, V]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
