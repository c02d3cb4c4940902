"""actcache.daemon.store._generations: which generations are dead, and which a put reclaims."""

import struct

import pytest

from actcache.daemon.store._generations import Generation, Generations, plan_reclaim, read_write_time, write_time


def prefix(ns: int, tag: str) -> bytes:
    return struct.pack(">I", ns) + tag.encode().ljust(16, b"_")


def gen(ns: int, tag: str, nbytes: int, last_write: float | None) -> Generation:
    return Generation(prefix(ns, tag), nbytes, last_write, None, 0, True)


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_oldest_written_first_whole_generations_until_the_put_fits():
    dead = [gen(1, "c", 10, 30.0), gen(1, "a", 10, 10.0), gen(1, "b", 10, 20.0)]
    plan = plan_reclaim(dead, own=prefix(1, "new"), namespace=prefix(1, "")[:4], namespace_need=15, daemon_need=0)
    assert plan.fits and [g.prefix for g in plan.victims] == [prefix(1, "a"), prefix(1, "b")]
    assert plan.reclaimable_bytes == 30
    plan = plan_reclaim(dead, own=prefix(1, "new"), namespace=prefix(1, "")[:4], namespace_need=10, daemon_need=0)
    assert [g.prefix for g in plan.victims] == [prefix(1, "a")]  # one whole generation is enough


def test_an_unknown_last_write_counts_as_oldest():
    dead = [gen(1, "a", 10, 10.0), gen(1, "old", 10, None)]
    plan = plan_reclaim(dead, own=b"", namespace=prefix(1, "")[:4], namespace_need=5, daemon_need=0)
    assert [g.prefix for g in plan.victims] == [prefix(1, "old")]


def test_never_the_puts_own_generation():
    dead = [gen(1, "own", 100, 1.0), gen(1, "a", 10, 10.0)]
    plan = plan_reclaim(dead, own=prefix(1, "own"), namespace=prefix(1, "")[:4], namespace_need=5, daemon_need=0)
    assert [g.prefix for g in plan.victims] == [prefix(1, "a")]
    plan = plan_reclaim(dead, own=prefix(1, "own"), namespace=prefix(1, "")[:4], namespace_need=50, daemon_need=0)
    assert not plan.fits and plan.victims == [] and plan.reclaimable_bytes == 10


def test_a_namespace_over_its_budget_reclaims_its_own_generations_only():
    dead = [gen(2, "other", 100, 1.0), gen(1, "a", 10, 10.0)]
    ns = prefix(1, "")[:4]
    plan = plan_reclaim(dead, own=b"", namespace=ns, namespace_need=5, daemon_need=0)
    assert [g.prefix for g in plan.victims] == [prefix(1, "a")]
    plan = plan_reclaim(dead, own=b"", namespace=ns, namespace_need=20, daemon_need=0)
    assert not plan.fits and plan.reclaimable_bytes == 10


def test_the_daemon_budget_takes_the_namespaces_first_then_any_oldest_first():
    dead = [gen(2, "x", 10, 1.0), gen(3, "y", 10, 2.0), gen(1, "a", 10, 10.0)]
    ns = prefix(1, "")[:4]
    # Only the daemon budget: any namespace, oldest first.
    plan = plan_reclaim(dead, own=b"", namespace=ns, namespace_need=0, daemon_need=15)
    assert [g.prefix for g in plan.victims] == [prefix(2, "x"), prefix(3, "y")]
    # Both: the namespace's generation frees room for both budgets, then the oldest of any.
    plan = plan_reclaim(dead, own=b"", namespace=ns, namespace_need=5, daemon_need=15)
    assert [g.prefix for g in plan.victims] == [prefix(1, "a"), prefix(2, "x")]
    plan = plan_reclaim(dead, own=b"", namespace=ns, namespace_need=5, daemon_need=31)
    assert not plan.fits and plan.victims == [] and plan.reclaimable_bytes == 30


def test_a_generation_is_dead_once_unused_for_reclaim_after_and_never_while_scheduled():
    clock = Clock()
    g = Generations(60.0, clock=clock)
    a, b = prefix(1, "a"), prefix(1, "b")
    g.wrote(a, 1000.0)
    clock.now = 1059.0
    assert not g.is_dead(a)
    clock.now = 1060.0
    assert g.is_dead(a)
    g.read(a)  # a read keeps it alive
    assert not g.is_dead(a)
    clock.now += 60
    assert g.is_dead(a)
    g.pin(a)  # a pushed schedule: never dead while it lives
    clock.now += 10_000
    assert not g.is_dead(a)
    g.unpin(a)  # the schedule was served to its end: that was a read
    assert not g.is_dead(a)
    clock.now += 60
    assert g.is_dead(a)
    # Never read since start: the start time stands in for the last read.
    assert g.is_dead(b)  # 1000 + 10_120 s after the start
    fresh = Generations(60.0, clock=clock)
    fresh.load([(b, 1.0)])
    assert not fresh.is_dead(b)
    clock.now += 60
    assert fresh.is_dead(b)


def test_reclaim_after_zero_keeps_only_live_schedules_alive():
    clock = Clock()
    g = Generations(0.0, clock=clock)
    a = prefix(1, "a")
    g.wrote(a, clock.now)
    g.read(a)
    assert g.is_dead(a)
    g.pin(a)
    g.pin(a)
    g.unpin(a)
    assert not g.is_dead(a)  # one schedule still lives
    g.unpin(a)
    assert g.is_dead(a)


def test_snapshot_reports_times_pins_and_deadness():
    clock = Clock()
    g = Generations(60.0, clock=clock)
    a, b = prefix(1, "a"), prefix(2, "b")
    g.load([(a, 900.0)])
    g.pin(b)
    clock.now = 1100.0
    snap = {s.prefix: s for s in g.snapshot({a: 10, b: 20})}
    assert (snap[a].last_write, snap[a].last_read, snap[a].pins, snap[a].dead) == (900.0, None, 0, True)
    assert (snap[b].last_write, snap[b].last_read, snap[b].pins, snap[b].dead) == (None, 1000.0, 1, False)
    assert (snap[b].namespace_id, snap[b].fingerprint) == (2, prefix(2, "b")[4:])
    g.forget(a)
    assert g.last_write(a) is None and g.known() == []


def test_write_times_round_trip():
    assert read_write_time(write_time(1234.5)) == 1234.5
    assert read_write_time(None) is None


@pytest.mark.parametrize("when", [10.0, 5.0])
def test_a_last_write_never_goes_back(when):
    g = Generations(60.0)
    g.wrote(prefix(1, "a"), 8.0)
    g.wrote(prefix(1, "a"), when)
    assert g.last_write(prefix(1, "a")) == max(8.0, when)
