"""The prefetcher: pushed schedules, their readers, the shared memory budget and the thread pools.

Per pushed order a reader walks it ahead of its Fetch within a share of
``prefetch_bytes``, dropping each entry once served; no LRU
(docs/design/prefetch.md). Turns: a reader with a consumer (attached) may
always read, one without (the next epoch, pushed early) only while no
attached reader of its namespace reads, and it gives its bytes back to an
attached reader that cannot get them. A live schedule pins its generation
in ``store.generations``, so a put over a budget never reclaims what it is
about to read.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from actcache.daemon.config import PrefetchConfig
from actcache.daemon.prefetch._budget import MemoryBudget
from actcache.daemon.prefetch._readahead import ENDED, ReaderSnapshot, ReaderState
from actcache.daemon.prefetch._reader import ScheduleReader
from actcache.daemon.prefetch._schedule import PrefetchCounters, Schedule
from actcache.daemon.store import PageCacheGuess, Store
from actcache.errors import DaemonUnavailable, FetchAborted, InvalidRequest, ScheduleNotFound
from actcache.keys import group_prefix

__all__ = ["MAX_SCHEDULES_PER_NAMESPACE", "PrefetchStats", "Prefetcher", "ScheduleStatus"]

log = logging.getLogger(__name__)

MAX_SCHEDULES_PER_NAMESPACE = 64
# Groups whose page-cache guess is kept for their next schedule (the most recently read).
_GUESSES_KEPT = 64


@dataclass(frozen=True, slots=True)
class ScheduleStatus:
    """A live schedule: its reader's positions (None between Fetches) and its counters."""

    namespace_id: int
    schedule_id: str
    length: int
    reader: ReaderSnapshot | None
    counters: dict[str, float]


@dataclass(frozen=True, slots=True)
class PrefetchStats:
    """Everything Stats reports about prefetching, taken at one instant."""

    budget_bytes: int
    buffered_bytes: int
    max_buffered_bytes: int
    schedules_total: int
    fetches_total: int
    schedules: list[ScheduleStatus]
    #: namespace id -> counters of its live and finished schedules together.
    namespaces: dict[int, dict[str, float]]


class Prefetcher:
    """Schedules by (namespace, schedule_id), one reader each, sharing one budget and two pools.

    Invariants (under the budget's condition, asserted in tests through
    ``stats()``): every reader has ``start <= served <= ready <= read <=
    len(order)``; ``budget.used`` is the sum of the readers' bytes and
    ``used <= max_used <= limit``; at most one reader per schedule is
    registered, a schedule pushed again cancels its old reader before the
    new one starts; a reader takes budget only while reading, and attached
    or its namespace has no attached reader still reading.
    """

    def __init__(self, store: Store, config: PrefetchConfig) -> None:
        self.store = store
        self.config = config
        self.budget = MemoryBudget(config.prefetch_bytes)
        self._cond = self.budget.cond  # one condition for the registry, the turns and the budget
        # The Fetch thread decodes its frames itself; these threads take part of each large frame.
        self._decode = (
            ThreadPoolExecutor(config.decode_threads - 1, thread_name_prefix="actcache-decode")
            if config.decode_threads > 1 else None
        )
        self._probe = (
            ThreadPoolExecutor(config.probe_threads, thread_name_prefix="actcache-probe")
            if config.probe_threads and store.config.explicit_reads else None
        )
        self._schedules: dict[tuple[int, str], Schedule] = {}
        self._readers: dict[tuple[int, str], ScheduleReader] = {}
        # Whether a group's values are in the page cache, kept from one schedule (epoch) to the next:
        # a new reader of a warm group starts warm instead of reading its first values one by one.
        self._guesses: OrderedDict[tuple[int, bytes, int], PageCacheGuess] = OrderedDict()
        self._finished: dict[int, PrefetchCounters] = {}
        self._all_readers: set[ScheduleReader] = set()
        self.schedules_total = 0
        self.fetches_total = 0
        self._closed = False

    def push(self, schedule: Schedule, *, read_ahead: bool = True) -> bool:
        """Register ``schedule`` (replacing one of the same id) and start reading it (``read_ahead``; else its
        first Fetch does); True if it replaced one."""
        key = (schedule.namespace_id, schedule.schedule_id)
        with self._cond:
            self._check_open()
            old = self._schedules.pop(key, None)
            old_reader = self._readers.pop(key, None)
            evicted = self._evict_for(schedule.namespace_id)
            self._schedules[key] = schedule
            self.store.generations.pin(_generation(schedule))  # unpinned by _retire
            reader = self._new_reader(schedule, 0, attached=False) if read_ahead else None
            self.schedules_total += 1
            self._update_turns()
        if old_reader is not None:
            old_reader.cancel(FetchAborted(
                f"schedule {schedule.schedule_id!r} was replaced by a new push; Fetch it again"))
        if old is not None:
            self._retire(old)
        for evicted_schedule, evicted_reader in evicted:
            if evicted_reader is not None:
                evicted_reader.cancel(None)
            self._retire(evicted_schedule)
        if reader is not None:
            reader.begin()
        return old is not None

    def attach(self, namespace_id: int, schedule_id: str, start: int) -> ScheduleReader:
        """The reader that serves a Fetch of the schedule from ``start`` (reusing the one reading ahead)."""
        key = (namespace_id, schedule_id)
        with self._cond:
            self._check_open()
            schedule = self._schedules.get(key)
            if schedule is None:
                raise ScheduleNotFound(
                    f"namespace {namespace_id} has no schedule {schedule_id!r}: it was never pushed, or it was "
                    "served to its end; push it (Schedule) before fetching it"
                )
            if start > len(schedule):
                raise InvalidRequest(
                    f"Fetch start {start} is past the end of schedule {schedule_id!r} ({len(schedule)} entries)")
            self.fetches_total += 1
            self.store.generations.read(_generation(schedule))
            current = self._readers.get(key)
            if (current is not None and not current.attached and not current.reclaimed and current.start == start
                    and current.state not in (ReaderState.CANCELLED, ReaderState.FAILED)):
                current.attached = True
                reader, old, taken = current, None, True
            else:
                reader, old, taken = self._new_reader(schedule, start, attached=True), current, False
            self._update_turns()
        if taken:
            with reader.cond:  # wake it if it waits for a consumer
                reader.cond.notify_all()
            return reader
        if old is not None:
            old.cancel(FetchAborted(
                f"a newer Fetch of schedule {schedule_id!r} (from position {start}) took over this stream"
            ))
        reader.begin()
        return reader

    def close(self) -> None:
        """Cancel every reader (their consumers get UNAVAILABLE) and stop the pools."""
        with self._cond:
            self._closed = True
            readers = list(self._all_readers)
        for reader in readers:
            reader.cancel(DaemonUnavailable(
                f"the daemon is shutting down; after it restarts, push schedule {reader.schedule.schedule_id!r} "
                f"again and Fetch from position {reader.served}"
            ))
        for reader in readers:
            reader.join(5.0)
        if self._decode is not None:
            self._decode.shutdown(wait=True, cancel_futures=True)
        if self._probe is not None:
            self._probe.shutdown(wait=True, cancel_futures=True)

    def stats(self) -> PrefetchStats:
        with self._cond:
            live = [(s, self._readers.get((s.namespace_id, s.schedule_id))) for s in self._schedules.values()]
            totals = {ns: c.copy() for ns, c in self._finished.items()}
            used, max_used = self.budget.used, self.budget.max_used
            counts = (self.schedules_total, self.fetches_total)
        statuses = []
        for schedule, reader in live:
            counters = schedule.counters.snapshot()
            statuses.append(ScheduleStatus(schedule.namespace_id, schedule.schedule_id, len(schedule),
                                           reader.snapshot() if reader is not None else None, counters))
            totals.setdefault(schedule.namespace_id, PrefetchCounters()).add(**counters)
        namespaces = {ns: c.snapshot() for ns, c in totals.items()}
        return PrefetchStats(self.budget.limit, used, max_used, *counts, statuses, namespaces)

    def _check_open(self) -> None:
        if self._closed:
            raise DaemonUnavailable("the daemon is shutting down; retry against the restarted daemon")

    def _new_reader(self, schedule: Schedule, start: int, *, attached: bool) -> ScheduleReader:
        """Create and register a reader; caller holds ``_cond`` and calls ``begin()`` after releasing it."""
        group = (schedule.namespace_id, schedule.fingerprint, schedule.depth)
        guess = self._guesses.pop(group, None) or PageCacheGuess()
        self._guesses[group] = guess
        while len(self._guesses) > _GUESSES_KEPT:
            self._guesses.popitem(last=False)
        reader = ScheduleReader(
            schedule, start, store=self.store, budget=self.budget, decode_pool=self._decode,
            probe_pool=self._probe, probe_bytes=self.config.probe_bytes, attached=attached,
            on_change=self._on_change, on_starved=self._reclaim_for, guess=guess,
        )
        self._readers[(schedule.namespace_id, schedule.schedule_id)] = reader
        self._all_readers.add(reader)
        return reader

    def _reclaim_for(self, starved: ScheduleReader, need: int) -> None:
        """``starved`` has a consumer and cannot get ``need`` bytes: readers without one give theirs back."""
        with self._cond:
            idle = sorted(((self.budget.held(r), r) for r in self._all_readers if not r.attached and r is not starved),
                          key=lambda pair: pair[0], reverse=True)
            victims, freed = [], 0
            for held, reader in idle:
                if held == 0 or self.budget.used - freed + need <= self.budget.limit:
                    break
                reader.reclaimed = True  # a Fetch arriving now starts a new reader: this one is cancelled
                victims.append(reader)
                freed += held
        for reader in victims:
            log.info("schedule %r gives back its read-ahead to schedule %r, whose consumer waits; it is read "
                     "again when fetched", reader.schedule.schedule_id, starved.schedule.schedule_id)
            reader.cancel(None)

    def _evict_for(self, namespace_id: int) -> list[tuple[Schedule, ScheduleReader | None]]:
        """Make room for one more schedule in the namespace: unregister the oldest ones nobody is fetching
        (with their readers, to cancel). Caller holds ``_cond``."""
        mine = [s for (ns, _), s in self._schedules.items() if ns == namespace_id]
        evicted: list[tuple[Schedule, ScheduleReader | None]] = []
        for schedule in mine:  # dicts keep push order: oldest first
            if len(mine) - len(evicted) < MAX_SCHEDULES_PER_NAMESPACE:
                break
            reader = self._readers.get((namespace_id, schedule.schedule_id))
            if reader is None or not reader.attached:
                del self._schedules[(namespace_id, schedule.schedule_id)]
                self._readers.pop((namespace_id, schedule.schedule_id), None)
                evicted.append((schedule, reader))
                log.info("namespace %d holds %d schedules; released the oldest unfetched one, %r",
                         namespace_id, MAX_SCHEDULES_PER_NAMESPACE, schedule.schedule_id)
        return evicted

    def _retire(self, schedule: Schedule) -> None:
        """Fold a schedule's counters into its namespace's totals once it is gone; unpin its generation."""
        self.store.generations.unpin(_generation(schedule))
        with self._cond:
            self._finished.setdefault(schedule.namespace_id, PrefetchCounters()).add(**schedule.counters.snapshot())

    def _update_turns(self) -> None:
        """Recompute which readers may read and which count for the fair share. Caller holds ``_cond``."""
        busy = {
            r.schedule.namespace_id for r in self._readers.values()
            if r.attached and r.state in (ReaderState.WAITING, ReaderState.READING)
        }
        for reader in self._all_readers:
            reader.allowed = reader.attached or reader.schedule.namespace_id not in busy
            self.budget.set_active(reader, reader.allowed and reader.state is ReaderState.READING)
        self._cond.notify_all()

    def _on_change(self, reader: ScheduleReader) -> None:
        """A reader changed state: update turns; forget ended readers; retire fully served schedules."""
        key = (reader.schedule.namespace_id, reader.schedule.schedule_id)
        retired = None
        cancel = False
        with self._cond:
            state = reader.state
            if state in ENDED:
                self._all_readers.discard(reader)
                self.budget.set_active(reader, False)
                if self._readers.get(key) is reader:
                    del self._readers[key]
                    if state is ReaderState.DONE:
                        retired = self._schedules.pop(key, None)
                    cancel = state is ReaderState.FAILED and not reader.attached
            self._update_turns()
        if cancel:  # nobody will collect the error: free its memory; a later Fetch reads again
            reader.cancel(None)
        if retired is not None:
            self._retire(retired)


def _generation(schedule: Schedule) -> bytes:
    """The (namespace, fingerprint) prefix of the generation a schedule reads."""
    return group_prefix(schedule.namespace_id, schedule.fingerprint)
