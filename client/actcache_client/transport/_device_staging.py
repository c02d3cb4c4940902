"""Host-to-device staging of cached batches: a ring of reusable pinned buffers and a side stream.

On CUDA, cached entries are collated into a page-locked slot of the ring (or, lying in consecutive
shared-memory slots, copied straight from the Fetch ring: ``ring_to_device``) and copied with
``non_blocking=True`` on a side stream, timed for the cost model; the compute stream waits for the copy.
Without CUDA, each batch is collated into fresh host memory and used in place: the tensors the model keeps for
backward must not be overwritten.
"""

from __future__ import annotations

import os
import time
from collections import deque
from typing import Any, Callable, Protocol, TypeVar

import torch
from torch import Tensor

from actcache.errors import ConfigError, LifecycleError
from actcache.shm import ClientSegment, SlotRun
from actcache_client.transport._state import State, map_state, state_bytes, tensors_of
from actcache_client.transport._tensors import RowCopier

__all__ = ["CopyTimer", "HostEvent", "HostRing", "Stager", "page_lock"]

Allocator = Callable[[tuple[int, ...], torch.dtype], Tensor]


class Completion(Protocol):
    """The event of an asynchronous copy (``torch.cuda.Event``, ``HostEvent``): wait until it completes."""

    def synchronize(self) -> None: ...


_S = TypeVar("_S", bound=State)


class HostRing:
    """``slots`` growable host byte buffers handed out round-robin.

    ``acquire()`` returns the next slot once the event recorded at its last ``release`` has completed
    (invariant: slots in flight <= slots); ``alloc`` carves 64-byte aligned tensors out of it. A batch
    larger than its slot gets one-off memory, and the slot grows to the largest batch seen at its next
    ``acquire``.
    """

    def __init__(self, slots: int = 4, *, pin_memory: bool = False) -> None:
        if slots < 2:
            raise ConfigError(f"HostRing(slots=) needs at least 2 slots, got {slots}")
        self.pin_memory = pin_memory
        self._buffers: list[Tensor] = [torch.empty(0, dtype=torch.uint8) for _ in range(slots)]
        self._events: list[Completion | None] = [None] * slots
        self._next = self._used = self._wanted = 0
        self._current: int | None = None

    def acquire(self) -> int:
        slot = self._next
        event = self._events[slot]
        if event is not None:
            event.synchronize()  # the copy that last read this slot is done
            self._events[slot] = None
        if self._buffers[slot].numel() < self._wanted:
            self._buffers[slot] = torch.empty(self._wanted, dtype=torch.uint8, pin_memory=self.pin_memory)
        self._next = (slot + 1) % len(self._buffers)
        self._current, self._used = slot, 0
        return slot

    def alloc(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        if self._current is None:
            raise LifecycleError("HostRing.alloc called before acquire(); acquire a slot for each batch first")
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        buffer = self._buffers[self._current]
        base = buffer.data_ptr()  # align the address, not the offset: the buffer itself may not be aligned
        start = (base + self._used + 63) // 64 * 64 - base
        self._used = start + nbytes
        self._wanted = max(self._wanted, self._used + 63)  # slack for a regrown buffer's own alignment
        if self._used > buffer.numel():
            # Too small this time: a one-off buffer (never reused); the slot grows at its next acquire.
            return torch.empty(shape, dtype=dtype, pin_memory=self.pin_memory)
        return buffer[start : start + nbytes].view(dtype).view(shape)

    def release(self, event: Completion | None) -> None:
        """Mark the acquired slot busy until ``event`` completes (None: free at once)."""
        if self._current is None:
            raise LifecycleError("HostRing.release called before acquire(); release only the slot acquire() gave")
        self._events[self._current] = event
        self._current = None


class HostEvent:
    """The CPU's degenerate timing event: a ``perf_counter`` stamp, complete as soon as it is recorded
    (the same interface as ``torch.cuda.Event(enable_timing=True)``)."""

    __slots__ = ("_at",)

    def __init__(self) -> None:
        self._at = 0.0

    def record(self, stream: object = None) -> None:
        self._at = time.perf_counter()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def elapsed_time(self, end: "HostEvent") -> float:
        return (end._at - self._at) * 1e3


class CopyTimer:
    """Times asynchronous work (a copy, a stage's kernels) with pairs of events; a reading comes out once
    its work has completed, never by waiting for it.

    ``new_event`` makes a timing event (``torch.cuda.Event(enable_timing=True)`` on CUDA, ``HostEvent``
    on the CPU). ``stop(start, payload)`` tags the interval with what it timed (bytes copied; a callback).
    At most ``max_pending`` intervals are tracked; older ones are dropped unread.
    """

    def __init__(self, new_event: Callable[[], Any], max_pending: int = 64) -> None:
        self._new_event = new_event
        self._pending: deque[tuple[Any, Any, Any]] = deque(maxlen=max_pending)

    def start(self) -> Any:
        event = self._new_event()
        event.record()
        return event

    def stop(self, start: Any, payload: Any) -> None:
        self._pending.append((start, self.start(), payload))  # the end: another event recorded now

    def readings(self) -> list[tuple[Any, float]]:
        """``(payload, seconds)`` of the intervals completed since the last call, oldest first."""
        out = []
        while self._pending and self._pending[0][1].query():
            start, end, payload = self._pending.popleft()
            out.append((payload, start.elapsed_time(end) / 1e3))
        return out


def page_lock(segment: ClientSegment) -> bool:
    """Register a shared-memory segment's mapping with CUDA (``cudaHostRegister``), once per mapping, and
    unregister it before it is unmapped; False if CUDA refused (copies out of it are then staged)."""
    if segment.page_locked is not None:
        return segment.page_locked
    whole = torch.frombuffer(segment.view, dtype=torch.uint8)
    address, nbytes = whole.data_ptr(), whole.numel()
    del whole  # no view of the mapping may outlive it
    cudart = torch.cuda.cudart()
    locked = int(cudart.cudaHostRegister(address, nbytes, 0)) == 0
    segment.page_locked = locked
    if locked:
        segment.on_close.append(lambda: cudart.cudaHostUnregister(address))
    return locked


class Stager:
    """Gives collation an allocator and moves the collated batch state to ``device``."""

    def __init__(self, device: torch.device | str, *, slots: int = 4) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda" and torch.cuda.is_available()
        self._ring = HostRing(slots, pin_memory=True) if self.cuda else None
        self._stream = torch.cuda.Stream(device=self.device) if self.cuda else None
        self._timer = CopyTimer(lambda: torch.cuda.Event(enable_timing=True)) if self.cuda else None
        #: Times device work (a stage's forward, the rest of the step) as the device runs it: CUDA events
        #: on the current stream, whose readings arrive once the work is done; host stamps on the CPU.
        self.clock = CopyTimer(lambda: torch.cuda.Event(enable_timing=True) if self.cuda else HostEvent(),
                               max_pending=256)
        #: Batches copied to the device straight out of a shared-memory ring.
        self.ring_copies = 0
        #: Copies collated rows: on several cores where the node has them (half of them: the rest train).
        self.copier = RowCopier(min(8, (os.cpu_count() or 1) // 2))

    def allocator(self) -> Allocator:
        """An allocator for one batch's host tensors (a ring slot on CUDA, fresh memory otherwise)."""
        if self._ring is None:
            return lambda shape, dtype: torch.empty(shape, dtype=dtype)
        self._ring.acquire()
        return self._ring.alloc

    def to_device(self, state: State) -> State:
        """Copy a host state to the device, ordered before later work on the current stream."""
        if not self.cuda:
            return state if self.device.type == "cpu" else map_state(state, lambda t: t.to(self.device))
        nbytes = state_bytes(state)
        assert self._ring is not None, "made with CUDA"
        moved, done = self._side_copy(lambda: map_state(state, lambda t: t.to(self.device, non_blocking=True)), nbytes)
        self._ring.release(done)
        return moved

    def ring_to_device(self, run: SlotRun, count: int) -> tuple[Tensor, Completion] | None:
        """The ``count`` entries of ``run`` copied straight out of the ring into a (count, entry bytes) uint8
        tensor on the device, and the copy's event; None without CUDA (collate on the host then). The ring
        is page-locked once, so the copy is a DMA on the side stream, not a staged copy through pageable
        memory that holds the host."""
        if not self.cuda:
            return None
        page_lock(run.segment)
        source = torch.frombuffer(run.segment.view, dtype=torch.uint8, count=count * run.size, offset=run.offset)
        rows, done = self._side_copy(lambda: source.to(self.device, non_blocking=True), count * run.size)
        self.ring_copies += 1
        return rows.view(count, run.size), done

    def _side_copy(self, copy: Callable[[], _S], nbytes: int) -> tuple[_S, Completion]:
        """``copy()`` on the side stream, timed, before later work on the current stream; and its event."""
        side, timer = self._stream, self._timer
        assert side is not None and timer is not None, "made with CUDA"
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(side):
            started = timer.start()
            moved = copy()
            timer.stop(started, nbytes)
            done = torch.cuda.Event()
            done.record(side)
        compute.wait_stream(side)
        for t in tensors_of(moved):
            t.record_stream(compute)  # the caching allocator must not reuse it before compute is done
        return moved, done

    def copy_readings(self) -> list[tuple[int, float]]:
        """``(bytes, seconds)`` of host-to-device copies completed since the last call (none on CPU)."""
        return self._timer.readings() if self._timer is not None else []
