"""The Stats reply: the store's usage, the prefetcher's schedules and counters, and the jobs, in one message."""

from __future__ import annotations

from typing import TYPE_CHECKING

from actcache import __version__
from actcache._proto import actcache_pb2 as pb
from actcache.daemon.prefetch import PrefetchCounters
from actcache.keys import group_prefix

if TYPE_CHECKING:
    from actcache.daemon.prefetch import Prefetcher
    from actcache.daemon.service._jobs import NamespaceJobs
    from actcache.daemon.store import Store

__all__ = ["stats_reply"]


def stats_reply(
    store: Store, prefetcher: Prefetcher, jobs: NamespaceJobs, counters: dict[str, int], uptime_s: float
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
                first_seen=job.first_seen, last_seen=job.last_seen, opens=job.opens,
            )
    for group in store.groups():
        gen = generations.get(group_prefix(group.namespace_id, group.fingerprint))
        reply.groups.add(
            namespace=names.get(group.namespace_id, str(group.namespace_id)), fingerprint=group.fingerprint,
            depth=group.depth, entries=group.entries, bytes=group.bytes,
            last_write_time=(gen and gen.last_write) or 0.0, last_read_time=(gen and gen.last_read) or 0.0,
            reclaimable=bool(gen and gen.dead), live_schedules=gen.pins if gen else 0,
        )
    live: dict[int, list] = {}
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
        agg = live.setdefault(status.namespace_id, [0, 0, 0])
        agg[0] += 1
        agg[1] += row.read_ahead_entries
        agg[2] += row.buffered_bytes
    for ns_id in sorted(prefetch.namespaces):
        schedules, ahead, buffered = live.get(ns_id, (0, 0, 0))
        reply.prefetch.add(
            namespace=names.get(ns_id, str(ns_id)), schedules=schedules, read_ahead_entries=ahead,
            buffered_bytes=buffered, counters=_counters_message(prefetch.namespaces[ns_id]),
        )
    return reply


def _counters_message(snapshot: dict[str, float]) -> pb.PrefetchCounters:
    return pb.PrefetchCounters(hit_ratio=PrefetchCounters.hit_ratio(snapshot), **snapshot)
