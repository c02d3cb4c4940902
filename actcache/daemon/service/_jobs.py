"""Which jobs opened each namespace: for operators asking "whose entries are these?".

Per namespace, the last ``MAX_JOBS_PER_NAMESPACE`` distinct jobs (``OpenRequest.job``:
host, pid, start time, data id) with their first and last Open, in memory only.
Recorded at Open only: later requests carry a handle the jobs share. Thread-safe.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Callable

from actcache.errors import InvalidRequest

__all__ = ["Job", "MAX_JOBS_PER_NAMESPACE", "NamespaceJobs"]

MAX_JOBS_PER_NAMESPACE = 32
_MAX_TEXT = 256


@dataclass(frozen=True, slots=True)
class Job:
    """A job that opened a namespace, as last seen."""

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
    """The last ``MAX_JOBS_PER_NAMESPACE`` jobs of each namespace, least recently opened first."""

    def __init__(self, *, limit: int = MAX_JOBS_PER_NAMESPACE, clock: Callable[[], float] = time.time) -> None:
        self.limit = limit
        self._clock = clock
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
            return job

    def of(self, namespace_id: int) -> list[Job]:
        """The namespace's jobs, least recently opened first."""
        with self._lock:
            return list(self._jobs.get(namespace_id, {}).values())
