"""The prefetcher: pushed schedules, their readers, the frames they serve, and the memory budget.

A ``Schedule`` (a pushed order) is read ahead of its consumer by a
``ScheduleReader`` within the shared read-ahead budget; Fetch takes its
entries as ``ServedBatch`` frames, or, warm over shared memory, reads
them itself (``DirectRun``). The middle layer: it uses ``store`` and
is used by ``service``.
"""

from actcache.daemon.prefetch._frames import DirectRun
from actcache.daemon.prefetch._prefetcher import MAX_SCHEDULES_PER_NAMESPACE, Prefetcher, PrefetchStats, ScheduleStatus
from actcache.daemon.prefetch._schedule import PrefetchCounters, ScheduleBuilder, unpack_ids, unpack_variants

__all__ = ["DirectRun", "MAX_SCHEDULES_PER_NAMESPACE", "PrefetchCounters", "PrefetchStats", "Prefetcher",
           "ScheduleBuilder", "ScheduleStatus", "unpack_ids", "unpack_variants"]
