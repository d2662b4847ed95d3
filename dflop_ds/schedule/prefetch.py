"""Compute the next items of a sequence in a background thread, with errors surfacing in the caller."""

from __future__ import annotations

import queue
import threading
from typing import Callable, Generic, Iterable, Iterator, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class _Failure:
    def __init__(self, error: BaseException) -> None:
        self.error = error


_DONE = object()


class BackgroundMap(Generic[K, V]):
    """Iterate ``fn(key)`` over ``keys``, computing up to ``depth`` results ahead in a thread.

    Results come back in key order. An exception raised by ``fn`` is re-raised in the consuming
    thread (with the original as its cause); a worker that dies without a result is reported
    instead of waited on forever. ``close()`` (or leaving a ``with`` block) stops the worker.
    """

    def __init__(self, fn: Callable[[K], V], keys: Iterable[K], depth: int = 1, poll_s: float = 1.0) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self._fn = fn
        self._keys = keys
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._poll_s = poll_s
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

    def __next__(self) -> V:
        while True:
            try:
                item = self._queue.get(timeout=self._poll_s)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    raise RuntimeError("the background scheduling thread stopped without a result") from None
        if item is _DONE:
            raise StopIteration
        if isinstance(item, _Failure):
            raise RuntimeError(f"background scheduling failed: {item.error}") from item.error
        return item  # type: ignore[return-value]

    def close(self, wait_s: float = 0.0) -> None:
        """Stop the worker thread: it finishes the item it is computing, then exits. With
        ``wait_s > 0``, wait up to that long for it to be gone (before a process exits, so no
        thread is mid-computation while the interpreter tears down)."""
        self._stop.set()
        if wait_s > 0 and self._thread is not threading.current_thread():
            self._thread.join(timeout=wait_s)

    def __enter__(self) -> "BackgroundMap[K, V]":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
