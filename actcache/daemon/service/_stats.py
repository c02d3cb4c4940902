"""The Stats reply: the store's usage, the prefetcher's schedules and counters, and the jobs that opened
each namespace (``NamespaceJobs``), in one message."""

from __future__ import annotations

import socket
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable

from actcache import __version__
from actcache._proto import actcache_pb2 as pb
from actcache.daemon.prefetch import PrefetchCounters
from actcache.daemon.service._job_exits import JobExits
from actcache.errors import InvalidRequest
from actcache.keys import group_prefix

if TYPE_CHECKING:
    from actcache.daemon.prefetch import Prefetcher
    from actcache.daemon.store import Store

__all__ = ["Job", "MAX_JOBS_PER_NAMESPACE", "NamespaceJobs", "stats_reply"]

MAX_JOBS_PER_NAMESPACE = 32
_MAX_TEXT = 256


@dataclass(frozen=True, slots=True)
class Job:
    """A job (``OpenRequest.job``) that opened a namespace, as last seen."""

    pid: int
    host: str
    #: When the job's process started (wall clock seconds; 0 = not said).
    start_time: float
    data_id: str
    #: Its first and last Open of the namespace (wall clock seconds), and how many.
    first_seen: float
    last_seen: float
    opens: int = 1


class NamespaceJobs:
    """The last ``MAX_JOBS_PER_NAMESPACE`` distinct jobs of each namespace, least recently opened first,
    recorded at Open (later requests carry a handle the jobs share). Jobs on the daemon's host (``host``) are
    watched until they exit (``exits``). Thread-safe."""

    def __init__(self, *, limit: int = MAX_JOBS_PER_NAMESPACE, clock: Callable[[], float] = time.time,
                 host: str | None = None) -> None:
        self.limit = limit
        self._clock = clock
        self.host = socket.gethostname() if host is None else host
        self.exits = JobExits(clock=clock)
        self._lock = threading.Lock()
        self._jobs: dict[int, OrderedDict[tuple, Job]] = {}

    def record(self, namespace_id: int, *, pid: int, host: str, start_time: float, data_id: str) -> Job:
        """Note an Open of the namespace by this job; returns the job's record."""
        for name, text in (("host", host), ("data_id", data_id)):
            if len(text) > _MAX_TEXT:
                raise InvalidRequest(f"JobInfo.{name} is {len(text)} characters; at most {_MAX_TEXT}")
        now = self._clock()
        key = (host, pid, start_time, data_id)
        with self._lock:
            jobs = self._jobs.setdefault(namespace_id, OrderedDict())
            old = jobs.pop(key, None)
            job = (Job(pid, host, start_time, data_id, now, now) if old is None
                   else replace(old, last_seen=now, opens=old.opens + 1))
            jobs[key] = job
            while len(jobs) > self.limit:
                jobs.popitem(last=False)
        if host == self.host and pid > 0:
            self.exits.watch(pid, start_time)
        return job

    def of(self, namespace_id: int) -> list[Job]:
        """The namespace's jobs, least recently opened first."""
        with self._lock:
            return list(self._jobs.get(namespace_id, {}).values())


def stats_reply(
    store: Store, prefetcher: Prefetcher, jobs: NamespaceJobs, counters: dict[str, Any], uptime_s: float
) -> pb.StatsReply:
    """What ``actcache stats`` and the Stats call show: the live state of the daemon's parts, plus the
    service's request ``counters`` (a snapshot, added to here) and its uptime."""
    names = {}
    prefetch = prefetcher.stats()
    for totals in prefetch.namespaces.values():
        for name in ("hits", "misses", "corrupt", "served_bytes"):
            counters[f"{name}_total"] += totals[name]
    reads = store.read_counts()
    reply = pb.StatsReply(
        used_bytes=store.used_bytes(), budget_bytes=store.config.budget_bytes, map_size_bytes=store.map_size(),
        file_bytes=store.file_bytes(), uptime_seconds=uptime_s, server_version=__version__,
        prefetch_budget_bytes=prefetch.budget_bytes, prefetch_buffered_bytes=prefetch.buffered_bytes,
        prefetch_max_buffered_bytes=prefetch.max_buffered_bytes, schedules_total=prefetch.schedules_total,
        fetches_total=prefetch.fetches_total, explicit_reads_total=reads["explicit_reads"],
        fallback_reads_total=reads["fallback_reads"], cached_copies_total=reads["cached_copies"],
        page_layout_unrecognized_total=store.page_layout_unrecognized,
        reclaimed_generations_total=store.generations.reclaimed_generations,
        reclaimed_bytes_total=store.generations.reclaimed_bytes, reclaim_after_seconds=store.config.reclaim_after_s,
        now=store.generations.now(), **counters,
    )
    generations = {g.prefix: g for g in store.generation_stats()}
    reclaimable: dict[int, int] = {}
    for g in generations.values():
        if g.dead:
            reclaimable[g.namespace_id] = reclaimable.get(g.namespace_id, 0) + g.bytes
    reply.reclaimable_bytes = sum(reclaimable.values())
    for info, entries, nbytes in store.namespaces():
        names[info.id] = info.name
        row = reply.namespaces.add(
            name=info.name, namespace_id=info.id, entries=entries, bytes=nbytes,
            budget_bytes=store.config.namespace_budget_bytes, reclaimable_bytes=reclaimable.get(info.id, 0),
        )
        for job in jobs.of(info.id):
            row.jobs.add(
                job=pb.JobInfo(pid=job.pid, host=job.host, start_time=job.start_time, data_id=job.data_id),
                first_seen=job.first_seen, last_seen=job.last_seen, opens=job.opens, local=job.host == jobs.host,
                ended=jobs.exits.ended(job.pid, job.start_time) or 0.0,
            )
    for group in store.groups():
        gen = generations.get(group_prefix(group.namespace_id, group.fingerprint))
        reply.groups.add(
            namespace=names.get(group.namespace_id, str(group.namespace_id)), fingerprint=group.fingerprint,
            depth=group.depth, entries=group.entries, bytes=group.bytes,
            last_write_time=(gen and gen.last_write) or 0.0, last_read_time=(gen and gen.last_read) or 0.0,
            reclaimable=bool(gen and gen.dead), live_schedules=gen.pins if gen else 0,
        )
    live: dict[int, list] = {}  # namespace id -> its schedules' rows
    for status in prefetch.schedules:
        r = status.reader
        row = reply.schedules.add(namespace=names.get(status.namespace_id, str(status.namespace_id)),
                                  schedule_id=status.schedule_id, length=status.length,
                                  counters=_counters_message(status.counters))
        if r is not None:
            row.state, row.attached = r.state.value, r.attached
            row.start, row.served, row.ready, row.read = r.start, r.served, r.ready, r.read
            row.read_ahead_entries, row.buffered_bytes = r.read_ahead_entries, r.buffered_bytes
        else:
            row.state = "idle"
        live.setdefault(status.namespace_id, []).append(row)
    for ns_id in sorted(prefetch.namespaces):
        rows = live.get(ns_id, [])
        reply.prefetch.add(
            namespace=names.get(ns_id, str(ns_id)), schedules=len(rows),
            read_ahead_entries=sum(r.read_ahead_entries for r in rows),
            buffered_bytes=sum(r.buffered_bytes for r in rows), counters=_counters_message(prefetch.namespaces[ns_id]),
        )
    return reply


def _counters_message(snapshot: dict[str, Any]) -> pb.PrefetchCounters:
    return pb.PrefetchCounters(hit_ratio=PrefetchCounters.hit_ratio(snapshot), **snapshot)
