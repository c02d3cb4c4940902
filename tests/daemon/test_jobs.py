"""actcache.daemon.service._stats: the jobs that opened each namespace, bounded, in memory."""

import pytest

from actcache.daemon.service._stats import NamespaceJobs
from actcache.errors import InvalidRequest


def test_jobs_are_recorded_per_namespace_with_first_and_last_open():
    now = [100.0]
    jobs = NamespaceJobs(clock=lambda: now[0])
    jobs.record(1, pid=7, host="node1", start_time=50.0, data_id="cifar-v1")
    now[0] = 160.0
    jobs.record(2, pid=8, host="node1", start_time=55.0, data_id="")
    jobs.record(1, pid=7, host="node1", start_time=50.0, data_id="cifar-v1")
    [job] = jobs.of(1)
    assert (job.pid, job.host, job.start_time, job.data_id) == (7, "node1", 50.0, "cifar-v1")
    assert (job.first_seen, job.last_seen, job.opens) == (100.0, 160.0, 2)
    assert [j.pid for j in jobs.of(2)] == [8]
    assert jobs.of(3) == []


def test_the_last_jobs_are_kept_least_recently_opened_first():
    jobs = NamespaceJobs(limit=3)
    for pid in range(5):
        jobs.record(1, pid=pid, host="h", start_time=0.0, data_id="")
    jobs.record(1, pid=2, host="h", start_time=0.0, data_id="")  # opened again: now the most recent
    assert [j.pid for j in jobs.of(1)] == [3, 4, 2]
    # Another process with the same pid (a restart) is another job.
    jobs.record(1, pid=4, host="h", start_time=1.0, data_id="")
    assert [(j.pid, j.start_time) for j in jobs.of(1)] == [(4, 0.0), (2, 0.0), (4, 1.0)]


def test_overlong_descriptions_are_refused():
    with pytest.raises(InvalidRequest, match="JobInfo.host is 300 characters; at most 256"):
        NamespaceJobs().record(1, pid=1, host="h" * 300, start_time=0.0, data_id="")
