"""Dead generations on a real daemon: reclaimed before a put is refused, shown by `actcache ls`/`stats`,
their last writes kept across restarts; the jobs of each namespace."""

import json
import os
import re

import pytest

from actcache.codec import DType, TensorSpec, encode_entry
from actcache.errors import BudgetExceeded
from actcache.rpc_client import JobInfo
from actcache.testing import run_daemon
from tests.integration.test_ops import actcache, scrape

pytestmark = pytest.mark.slow  # seconds per test: make test runs them, make test-fast does not

OLD, NEW = b"\x01" * 16, b"\x02" * 16
SPEC = [TensorSpec(DType.uint8, (4000,))]


def values(n: int) -> list[bytes]:
    return [encode_entry(SPEC, [bytes([i % 256]) * 4000]) for i in range(n)]


def size() -> int:
    return len(values(1)[0])


def fingerprints(client, namespace: str) -> set[bytes]:
    return {g.fingerprint for g in client.stats().groups if g.namespace == namespace}


def test_a_full_budget_of_an_old_generation_makes_room_for_the_new_one(tmp_path):
    budget = 10 * size()
    with run_daemon("--budget", str(budget), "--reclaim-after", "0", "--encoding", "raw", "--metrics-port", "0",
                    cache_dir=tmp_path / "c") as d:
        with d.client() as c:
            ns = c.open("train").namespace_id
            c.put(ns, OLD, 3, [(i, 0, v) for i, v in enumerate(values(10))])  # the budget is full
            reply = c.put(ns, NEW, 3, [(i, 0, v) for i, v in enumerate(values(4))])
            assert reply.entries == 4
            assert fingerprints(c, "train") == {NEW}
            stats = c.stats()
            assert stats.used_bytes == 4 * size()
            assert (stats.reclaimed_generations_total, stats.reclaimed_bytes_total) == (1, 10 * size())
            assert c.get(ns, OLD, 3, [0]) == [None]
        log = d.log_path.read_text()
        assert re.search(rf"reclaimed dead generation train/{OLD.hex()}: 10 entries, {10 * size()} bytes", log)
        url = re.search(r"metrics (http://127\.0\.0\.1:\d+/metrics)", log).group(1)
        m = scrape(url)
        assert m[("actcache_reclaimed_generations_total", ())] == 1
        assert m[("actcache_reclaimed_bytes_total", ())] == 10 * size()
        assert m[("actcache_reclaimable_bytes", (("namespace", "train"),))] == 4 * size()  # reclaim-after 0


def test_a_generation_a_live_schedule_reads_is_not_reclaimed(tmp_path):
    with run_daemon("--budget", str(10 * size()), "--reclaim-after", "0", "--encoding", "raw",
                    cache_dir=tmp_path / "c") as d, d.client() as c:
        ns = c.open("train").namespace_id
        c.put(ns, OLD, 3, [(i, 0, v) for i, v in enumerate(values(10))])
        c.schedule(ns, OLD, 3, "epoch-7", list(range(10)))  # pushed, not served yet
        with pytest.raises(BudgetExceeded, match=r"hold 0 bytes \(0 B\) that could be reclaimed, not enough") as info:
            c.put(ns, NEW, 3, [(0, 0, values(1)[0])])
        assert "RESOURCE_EXHAUSTED" in str(info.value)
        assert fingerprints(c, "train") == {OLD}
        [group] = c.stats().groups
        assert (group.reclaimable, group.live_schedules) == (False, 1)
        ls = actcache("ls", "--socket", str(d.socket))
        assert ls.returncode == 0, ls.stderr
        assert re.search(rf"train +{OLD.hex()} +3 +10 .*s ago +\d+s ago  no \(1 live schedule\)", ls.stdout), ls.stdout
        # Served to its end, the schedule is gone and so is what protected the generation.
        assert sum(v is not None for *_, v in c.fetch(ns, "epoch-7")) == 10
        c.put(ns, NEW, 3, [(0, 0, values(1)[0])])
        assert fingerprints(c, "train") == {NEW}


def test_last_write_survives_a_restart_and_the_last_read_is_unknown_after_it(tmp_path):
    with run_daemon("--reclaim-after", "3600", cache_dir=tmp_path / "c") as d:
        with d.client() as c:
            ns = c.open("persist").namespace_id
            c.put(ns, OLD, 1, [(0, 0, values(1)[0])])
            assert c.get(ns, OLD, 1, [0])[0] is not None
            [before] = c.stats().groups
        assert before.last_write_time > 0 and before.last_read_time >= before.last_write_time
        d.stop()
        d.start()
        with d.client() as c:
            [after] = c.stats().groups
    assert after.last_write_time == before.last_write_time
    assert after.last_read_time == 0 and not after.reclaimable  # the restart stands in for the last read


def test_ls_and_stats_show_activity_reclaimable_bytes_and_the_jobs_of_each_namespace(tmp_path):
    with run_daemon("--reclaim-after", "0", "--encoding", "raw", cache_dir=tmp_path / "c") as d:
        with d.client() as c:
            job = JobInfo(pid=4242, host="node-7", start_time=c.stats().now - 7200, data_id="cifar10-v2")
            ns = c.open("vision", job=job).namespace_id
            c.open("vision", job=job)
            c.open("vision", job=JobInfo.current())
            c.put(ns, OLD, 2, [(i, 0, v) for i, v in enumerate(values(3))])

        def run(*args: str) -> str:
            out = actcache(*args, "--socket", str(d.socket))
            assert out.returncode == 0, out.stderr
            return out.stdout

        ls = run("ls")
        assert "WRITTEN" in ls and "READ" in ls and "RECLAIMABLE" in ls
        assert re.search(rf"vision +{OLD.hex()} +2 +3 +[\d.]+ KiB +\d+s ago +-  yes", ls), ls
        assert "jobs of vision: 1 running, 0 ended" in ls
        assert re.search(r"job pid 4242 on node-7, on another host \(running or not: not known here\), started 2h "
                         r"ago, data 'cifar10-v2': opened 2 times", ls), ls
        assert re.search(rf"job pid {os.getpid()} on \S+, running, started", ls), ls
        [row] = json.loads(run("ls", "--json"))
        assert row["last_write"] > 0 and row["last_read"] is None and row["reclaimable"] is True

        stats = run("stats")
        assert re.search(rf"reclaim  {3 * size() / 1024:.1f} KiB in dead generations \(no live schedule\); "
                         r"reclaimed 0 generations", stats), stats
        assert re.search(rf"vision +3 entries +[\d.]+ KiB, {3 * size() / 1024:.1f} KiB reclaimable", stats), stats
        assert "job pid 4242 on node-7" in stats
        data = json.loads(run("stats", "--json"))
        [vision] = [n for n in data["namespaces"] if n["name"] == "vision"]
        assert [j["job"]["pid"] for j in vision["jobs"]][0] == 4242 and len(vision["jobs"]) == 2
        assert int(vision["reclaimable_bytes"]) == 3 * size() == int(data["reclaimable_bytes"])
