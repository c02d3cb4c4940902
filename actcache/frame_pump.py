"""A streaming call's messages, received by a thread ahead of the consumer.

Why: gRPC's synchronous API receives a message only when the consumer asks
for it, and hands it over from its polling thread: even when the message
arrived long ago, each ``next`` costs the consumer a round of thread
wake-ups. A thread that asks for the next message as soon as it has the
last one keeps up to ``depth`` of them ready, so a consumer whose next frame
has arrived takes it without waiting.

It pays only when the consumer leaves the interpreter idle between frames (a
step waiting on the GPU); a step that keeps it busy loses to the thread's
turns for the interpreter lock, so ``CachedForward`` receives ahead only on
CUDA.

What stays with the consumer: everything that depends on it having finished
with a frame (the shared-memory plane releases a frame's ring slots only
when the consumer asks for the next frame, never when the pump does).
"""

from __future__ import annotations

import queue
import threading
from typing import Iterable, Iterator, TypeVar

__all__ = ["FramePump"]

T = TypeVar("T")
_END = object()
# How often a pump blocked on a full queue checks whether its consumer went away.
_CLOSED_POLL_S = 0.1


class FramePump(Iterator[T]):
    """Iterate ``messages`` (a gRPC response iterator) in a thread, ``depth`` messages ahead at most.

    Iterating yields them in order and re-raises the iterator's exception
    where it ended; ``close`` stops the thread (cancel the call first, so a
    pending receive returns).
    """

    def __init__(self, messages: Iterable[T], depth: int = 4, name: str = "actcache-frame-pump") -> None:
        self._messages = messages
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._closed = threading.Event()
        self._done = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for message in self._messages:
                if not self._put(message):
                    return
            self._put(_END)
        except BaseException as exc:  # handed to the consumer, raised where the stream ended
            self._put(exc)

    def _put(self, item: object) -> bool:
        while not self._closed.is_set():
            try:
                self._queue.put(item, timeout=_CLOSED_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def __next__(self) -> T:
        if self._done:
            raise StopIteration
        item = self._queue.get()
        if item is _END:
            self._done = True
            raise StopIteration
        if isinstance(item, BaseException):
            self._done = True
            raise item
        return item

    def close(self) -> None:
        """Stop receiving ahead; the thread ends once its pending receive returns."""
        self._done = True
        self._closed.set()
