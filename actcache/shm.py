"""The same-host shared-memory data plane of Fetch (docs/design/shared-memory.md): one ring per stream.

The daemon creates ``<shm dir>/actcache-<daemon pid>-<random>`` (mode 0600) and copies each served
entry, decoded, into a slot of the ring; frames carry the segment's path (first frame) and per entry
its offset and length (0 = a miss), or, a frame of columns, where each of its tensors starts
(``column_starts``). Segment layout (little-endian uint64 words, data from ``HEADER_BYTES``)::

    0  magic  b"ACTSHM1\\0"
    8  capacity    size of the data area                                  (daemon writes)
    16 released    schedule position: every entry before it is released  (client writes)
    24 mapped      1 once the client has mapped                           (client writes)
    32 waiting     1 + the position the client waits for a frame of; 0: none (client writes)

Invariants:

- a slot is reused only after the client released it: the daemon writes ``[p, p + n)`` only if
  ``p + n - freed <= ring_bytes``; a slot that would cross the end starts at the beginning;
- ``released`` only grows and only the client writes it (one aligned 8-byte word: never torn);
- no deadlock: when the ring is full, the daemon first sends what it has written, then polls
  ``released`` while the call is alive; an entry larger than the ring travels in the frame's payload,
  and so do the entries at the position the client waits for (``waiting``) when the ring is full: the
  client holds views of every earlier slot (columns) and releases none until it gets that frame.
- the ring is outside the prefetch budget.

Reuse: a ring is parked by the daemon (``ParkedRings``) only once its handler returned and kept by the
client (``SegmentPool``) only once its stream ended and no view of it is alive (``ClientSegment.hold``),
so no two streams share one and no stream overwrites what a view still shows. Crash safety: the
daemon unlinks the segment once it sees ``mapped``; a killed daemon's are removed at the next start.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import struct
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

from actcache.errors import InvalidRequest

__all__ = ["COLUMN_ALIGN", "ClientSegment", "DEFAULT_RING_BYTES", "HEADER_BYTES", "PREFIX", "SegmentPool", "ShmRing",
           "SlotRun", "column_starts", "pid_alive", "remove_stale", "shm_dir", "stale_segments"]

PREFIX = "actcache-"
HEADER_BYTES = 4096
DEFAULT_RING_BYTES = 8 << 20  # small rings stay in the CPU cache
# An idle ring serves a Fetch asking for up to this many times less (a larger ring costs nothing).
REUSE_SLACK = 2
MIN_RING_BYTES = 64 << 10
MAX_RING_BYTES = 4 << 30
_MAGIC = b"ACTSHM1\0"
_RELEASED, _MAPPED, _WAITING = 16, 24, 32
#: Where a column starts (segment offsets; the segment is page-aligned): tensors viewed there compute as
#: they do in fresh memory, and any dtype may view them.
COLUMN_ALIGN = 64


def shm_dir() -> Path:
    """Where segments live: ``$ACTCACHE_SHM_DIR``, else ``/dev/shm``."""
    return Path(os.environ.get("ACTCACHE_SHM_DIR") or "/dev/shm")


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid runs (one we may not signal counts; a zombie, dead but not yet reaped
    by its parent, does not: it holds no memory, locks or files)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"  # the state follows the parenthesised name
    except (OSError, IndexError):
        return True


def stale_segments(directory: Path | None = None, *, also_pid: int | None = None) -> Iterable[tuple[Path, int, bool]]:
    """``(path, daemon pid, stale)`` per segment; stale = its daemon pid is dead (or is ``also_pid``)."""
    directory = directory or shm_dir()
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return
    for name in names:
        pid = name[len(PREFIX):].split("-", 1)[0]
        if name.startswith(PREFIX) and pid.isdigit():
            yield directory / name, int(pid), int(pid) == also_pid or not pid_alive(int(pid))


def remove_stale(directory: Path | None = None) -> list[Path]:
    """Remove segments left by dead daemons (at daemon start; this pid's own names are stale too)."""
    removed = []
    for path, _, stale in stale_segments(directory, also_pid=os.getpid()):
        if stale:
            with contextlib.suppress(FileNotFoundError):  # removed by another process meanwhile
                path.unlink()
                removed.append(path)
    return removed


def column_starts(nbytes: Sequence[int], count: int, start: int, stop: int) -> list[int] | None:
    """Segment offsets of the columns of ``count`` entries holding tensors of ``nbytes`` bytes each, laid out
    in ``[start, stop)`` one after the other from ``COLUMN_ALIGN`` boundaries; None if they do not fit."""
    at, starts = start, []
    for n in nbytes:
        at = -(-at // COLUMN_ALIGN) * COLUMN_ALIGN
        starts.append(at)
        at += count * n
    return starts if at <= stop else None


def reusable(ring_bytes: int, asked: int) -> bool:
    """Whether an idle ring of ``ring_bytes`` serves a Fetch asking for ``asked`` (``ShmRing.size_for``)."""
    return asked <= ring_bytes <= REUSE_SLACK * asked


class ShmRing:
    """The daemon's side of one stream's ring (used by one thread: the Fetch handler)."""

    def __init__(self, ring_bytes: int, start: int, directory: Path | None = None) -> None:
        #: Exactly the size asked, so frames of a batch that tile it never straddle its end (see SlotRun).
        self.ring_bytes = self.size_for(ring_bytes)
        #: The data area, whole pages (a later stream may use less of it: ``restart``).
        self.capacity = -(-self.ring_bytes // mmap.PAGESIZE) * mmap.PAGESIZE
        self.path = (directory or shm_dir()) / f"{PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, HEADER_BYTES + self.capacity)
            self._mm = mmap.mmap(fd, HEADER_BYTES + self.capacity)
        except BaseException:
            os.unlink(self.path)
            raise
        finally:
            os.close(fd)
        self._view = memoryview(self._mm)
        self._mm[:8] = _MAGIC
        struct.pack_into("<QQQ", self._mm, 8, self.capacity, start, 0)
        self._write = 0  # monotonic byte position of the next slot
        self._freed = 0  # monotonic bytes the client has released
        self._slots: deque[tuple[int, int]] = deque()  # (schedule position, monotonic end) of live slots
        self.unlinked = False

    @staticmethod
    def size_for(ring_bytes: int) -> int:
        """The ring size a request for ``ring_bytes`` gets (0: the default)."""
        return min(max(ring_bytes or DEFAULT_RING_BYTES, MIN_RING_BYTES), MAX_RING_BYTES)

    @property
    def client_mapped(self) -> bool:
        return bool(struct.unpack_from("<Q", self._mm, _MAPPED)[0])

    def restart(self, start: int, ring_bytes: int = 0) -> None:
        """Serve a new stream from position ``start`` in the first ``ring_bytes`` of the data area (0: all)."""
        self.ring_bytes = min(ring_bytes or self.capacity, self.capacity)
        self._write = self._freed = 0
        self._slots.clear()
        struct.pack_into("<Q", self._mm, _RELEASED, start)
        struct.pack_into("<Q", self._mm, _WAITING, 0)

    def poll(self) -> None:
        """Free the slots the client released; unlink the segment once the client has mapped it."""
        released, mapped = struct.unpack_from("<QQ", self._mm, _RELEASED)
        while self._slots and self._slots[0][0] < released:
            self._freed = self._slots.popleft()[1]
        if mapped and not self.unlinked:
            self.unlink()

    def stalled(self, position: int) -> bool:
        """Whether the client waits for the frame at ``position`` (holding every slot before it)."""
        return struct.unpack_from("<Q", self._mm, _WAITING)[0] == position + 1

    def has_room(self, size: int) -> bool:
        """Whether a slot of ``size`` bytes fits now."""
        return self._room(self._run_need(1, size)[0])

    def _check_size(self, size: int) -> None:
        if size > self.ring_bytes:
            raise InvalidRequest(f"an entry of {size} bytes does not fit the shared-memory ring of {self.ring_bytes} bytes")

    def _room(self, need: int) -> bool:
        """Whether ``need`` more bytes fit now (after taking the client's releases, if they did not)."""
        if self._write + need - self._freed > self.ring_bytes:
            self.poll()
        return self._write + need - self._freed <= self.ring_bytes

    def alloc(self, position: int, size: int) -> int | None:
        """Segment offset of a new slot of ``size`` bytes for the entry at ``position``; None while full."""
        blocks = self.alloc_run(position, 1, size)
        return blocks[0][0] if blocks else None

    def alloc_run(self, position: int, count: int, size: int) -> list[tuple[int, int]] | None:
        """Consecutive slots of ``size`` bytes for the ``count`` entries at ``position`` on: one block, or
        two when the run wraps. ``(segment offset, entries)`` per block; None while they do not fit."""
        self._check_size(size)
        at = self._write % self.ring_bytes
        need, before_end = self._run_need(count, size)
        if not self._room(need):
            return None
        gap = need - count * size
        ends = [self._write + (i + 1) * size + (gap if i >= before_end else 0) for i in range(count)]
        self._write += need
        self._slots.extend(zip(range(position, position + count), ends))
        blocks = [(HEADER_BYTES + at, before_end)] if before_end else []
        return blocks + [(HEADER_BYTES, count - before_end)] if before_end < count else blocks

    def alloc_block(self, position: int, count: int, size: int) -> int | None:
        """``alloc_run`` when the run does not wrap: the segment offset of its one block; None (nothing
        allocated) when it would wrap or does not fit now."""
        if count < 1 or size < 1 or self._run_need(count, size)[1] < count:
            return None
        blocks = self.alloc_run(position, count, size)
        return blocks[0][0] if blocks else None

    def _run_need(self, count: int, size: int) -> tuple[int, int]:
        """``(bytes, slots before the end)`` of a run of ``count`` slots of ``size``, with any gap at the end."""
        left = self.ring_bytes - self._write % self.ring_bytes
        before_end = min(count, left // size)
        return count * size + (left - before_end * size if before_end < count else 0), before_end

    def view(self, offset: int, size: int) -> memoryview:
        """The writable bytes of the slot at ``offset`` (from ``alloc``)."""
        return self._view[offset : offset + size]

    def wait_frame_room(self, nbytes: int, slot_bytes: int, alive: Callable[[], bool], patience_s: float, *,
                        uniform: bool = False, position: int | None = None) -> bool:
        """Wait up to ``patience_s`` for a frame of ``nbytes`` in slots of up to ``slot_bytes`` (all of it
        when ``uniform``) to fit whole, or for the client to release every slot, or to wait for the frame
        at ``position`` (``stalled``); False if ``alive()`` fails first. Why: a frame cut short ends
        mid-batch, which the client copies in two parts."""
        if uniform and 0 < nbytes <= self.ring_bytes and nbytes % slot_bytes == 0:
            need = self._run_need(nbytes // slot_bytes, slot_bytes)[0]
        else:  # a slot never wraps: allow one slot of gap at the end
            need = min(nbytes + slot_bytes, self.ring_bytes)
        deadline = time.monotonic() + patience_s

        def fits() -> bool:
            self.poll()
            return (not self._slots or self._write - self._freed + need <= self.ring_bytes or time.monotonic() > deadline
                    or position is not None and self.stalled(position))

        return _poll_until(fits, alive)

    def wait_room(self, size: int, alive: Callable[[], bool], position: int | None = None) -> bool:
        """Wait until a slot of ``size`` bytes fits, or the client waits for the frame at ``position``
        (``stalled``); False if ``alive()`` fails first."""
        self._check_size(size)
        return _poll_until(lambda: self.has_room(size) or position is not None and self.stalled(position), alive)

    def wait_mapped(self, alive: Callable[[], bool]) -> None:
        """Return once the client has mapped the segment (then unlinked), or once ``alive()`` is false."""
        def mapped() -> bool:
            self.poll()
            return self.unlinked

        _poll_until(mapped, alive)

    def unlink(self) -> None:
        """Remove the name (safe from any thread, any number of times); mappings stay valid."""
        self.unlinked = True
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def close(self) -> None:
        self.unlink()
        _unmap(self._view, self._mm)


def _poll_until(done: Callable[[], bool], alive: Callable[[], bool]) -> bool:
    """Poll ``done()`` while ``alive()``, backing off from 50 us to 2 ms; False if ``alive()`` failed first."""
    delay = 50e-6
    while not done():
        if not alive():
            return False
        time.sleep(delay)
        delay = min(delay * 2, 2e-3)
    return True


class ClientSegment:
    """The client's mapping of a stream's segment: views into it and the release counter.

    Invariant: ``release`` never passes the first position of a live hold, so the daemon never writes
    over bytes a caller still views (a hold lives as long as the object it was given: a weak reference).
    """

    def __init__(self, path: str) -> None:
        self.path = path
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        if size < HEADER_BYTES or mm[:8] != _MAGIC:
            mm.close()
            raise OSError(f"{path} is not an actcache shared-memory segment")
        self._mm = mm
        self.view = memoryview(mm)
        #: The ring's size (the segment less its header): a Fetch asking for this size may reuse it.
        self.ring_bytes = size - HEADER_BYTES
        #: Called before the mapping goes (a client that page-locked it for a device unlocks it there).
        self.on_close: list[Callable[[], None]] = []
        #: Whether the client page-locked the mapping for a device (None: not tried).
        self.page_locked: bool | None = None
        self._holds: deque[tuple[int, weakref.ref]] = deque()  # (first position, holder), by position
        struct.pack_into("<Q", mm, _MAPPED, 1)

    def hold(self, position: int, holder: object) -> None:
        """Keep the slots from ``position`` on while ``holder`` (weakly referenced) is alive."""
        self._holds.append((position, weakref.ref(holder)))

    def held(self) -> bool:
        """Whether a holder is alive (then the segment must not serve another stream)."""
        self._drop_dead()
        return bool(self._holds)

    def release(self, position: int) -> None:
        """Every entry before schedule ``position`` is consumed: the daemon may reuse its slot, up to the
        first position still held."""
        self._drop_dead()
        if self._holds:
            position = min(position, min(at for at, _ in self._holds))
        struct.pack_into("<Q", self._mm, _RELEASED, position)

    def waiting(self, position: int | None) -> None:
        """Say the client waits for the frame at ``position`` (None: for none)."""
        struct.pack_into("<Q", self._mm, _WAITING, 0 if position is None else position + 1)

    def _drop_dead(self) -> None:
        self._holds = deque(h for h in self._holds if h[1]() is not None)

    def close(self) -> None:
        hooks, self.on_close = self.on_close, []
        for hook in hooks:
            hook()
        _unmap(self.view, self._mm)


def _unmap(view: memoryview, mm: mmap.mmap) -> None:
    """Drop a mapping; views still exported keep it until they go."""
    with contextlib.suppress(BufferError, ValueError):
        view.release()
        mm.close()


@dataclass(frozen=True)
class SlotRun:
    """Entries of one size in consecutive slots of a segment: entry ``i`` is the ``size`` bytes at
    ``offset + i * size`` of ``segment.view`` (a batch of them moves in one copy)."""

    segment: ClientSegment
    offset: int
    size: int

    def skip(self, entries: int) -> "SlotRun":
        """The run from its entry ``entries`` on."""
        return SlotRun(self.segment, self.offset + entries * self.size, self.size)


class SegmentPool:
    """The client's segments whose streams have ended, offered for reuse by its next Fetch (thread-safe):
    a new ring costs a mapping and its page faults. At most ``keep`` wait; the oldest goes first."""

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self._idle: deque[ClientSegment] = deque()
        self._lock = threading.Lock()

    def take(self, ring_bytes: int) -> ClientSegment | None:
        """The most recently ended segment whose ring may serve a Fetch asking for ``ring_bytes``
        (``reusable``; None if none waits); the caller returns it or closes it."""
        with self._lock:
            for segment in reversed(self._idle):
                if reusable(segment.ring_bytes, ring_bytes):
                    self._idle.remove(segment)
                    return segment
            return None

    def put(self, segment: ClientSegment) -> None:
        with self._lock:
            self._idle.append(segment)
            dropped = [self._idle.popleft() for _ in range(len(self._idle) - self.keep)]
        for old in dropped:
            old.close()

    def paths(self) -> list[str]:
        """The waiting segments' paths, oldest first."""
        with self._lock:
            return [segment.path for segment in self._idle]

    def clear(self) -> None:
        with self._lock:
            dropped, self._idle = list(self._idle), deque()
        for old in dropped:
            old.close()
