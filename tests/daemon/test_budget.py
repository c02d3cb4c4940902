"""The shared prefetch budget: never above its limit, fair shares, blocking waits that can be stopped."""

import threading

import pytest

from actcache.daemon.prefetch._budget import MemoryBudget


def activate(budget, *holders):
    with budget.cond:
        for h in holders:
            budget.set_active(h, True)


def test_fair_share_and_limit():
    budget = MemoryBudget(100)
    activate(budget, "a", "b")
    assert budget.try_acquire("a", 50)
    assert not budget.try_acquire("a", 1)  # above its share of 50
    assert budget.try_acquire("b", 50)
    assert not budget.try_acquire("b", 1)  # above the limit
    assert budget.used == budget.max_used == 100
    budget.release("a", 50)
    assert (budget.used, budget.held("a"), budget.held("b")) == (50, 0, 50)


def test_an_entry_larger_than_the_share_still_progresses_one_at_a_time():
    budget = MemoryBudget(100)
    activate(budget, "a", "b", "c", "d")  # share 25
    assert budget.try_acquire("a", 60)
    assert not budget.try_acquire("a", 10)
    assert not budget.try_acquire("b", 60)  # would exceed the limit
    assert budget.try_acquire("b", 40)


def test_inactive_holders_get_nothing():
    budget = MemoryBudget(100)
    assert not budget.try_acquire("a", 1)
    activate(budget, "a")
    assert budget.try_acquire("a", 100)


def test_blocking_acquire_waits_for_a_release_or_a_stop():
    budget = MemoryBudget(100)
    activate(budget, "a", "b")
    assert budget.try_acquire("a", 60)
    granted, stop = [], threading.Event()
    waiter = threading.Thread(target=lambda: granted.append(budget.acquire("b", 50, stop.is_set)))
    waiter.start()
    budget.release("a", 20)  # b may now take 50 (its share), 40 + 50 <= 100
    waiter.join(10)
    assert granted == [True] and budget.used == 90
    stopped = threading.Thread(target=lambda: granted.append(budget.acquire("b", 50, stop.is_set)))
    stopped.start()
    stop.set()
    budget.wake()
    stopped.join(10)
    assert granted == [True, False] and budget.used == 90


def test_releasing_more_than_held_is_a_bug():
    budget = MemoryBudget(10)
    activate(budget, "a")
    budget.try_acquire("a", 5)
    with pytest.raises(AssertionError, match="releasing 6 bytes but the holder has 5"):
        budget.release("a", 6)
