"""Page-locking shared-memory segments for the CUDA driver, with a fake driver that keeps the real one's rules:
a range registers once per process, and a failed call stays as the runtime's last error until read."""

import enum
import gc
import warnings

import pytest

from actcache.shm import MIN_RING_BYTES, ClientSegment, ShmRing
from actcache_client._page_lock import PageLocks


class FakeError(enum.IntEnum):
    success = 0
    already_registered = 712


class FakeDriver:
    cudaError = FakeError

    def __init__(self, refuse: bool = False) -> None:
        self.refuse = refuse
        self.ranges: dict[int, int] = {}  # base -> size, registered
        self.calls: list[str] = []
        self.last_error = FakeError.success

    def cudaHostRegister(self, base: int, size: int, flags: int) -> FakeError:
        self.calls.append("register")
        if self.refuse or any(b < base + size and base < b + s for b, s in self.ranges.items()):
            self.last_error = FakeError.already_registered
            return self.last_error
        self.ranges[base] = size
        return FakeError.success

    def cudaHostUnregister(self, base: int) -> FakeError:
        self.calls.append("unregister")
        del self.ranges[base]
        return FakeError.success

    def clear_error(self) -> None:
        self.last_error = FakeError.success


class FakeEvent:
    def __init__(self, driver: FakeDriver) -> None:
        self.driver = driver

    def synchronize(self) -> None:
        self.driver.calls.append("copy done")


@pytest.fixture
def ring(tmp_path):
    r = ShmRing(MIN_RING_BYTES, start=0, directory=tmp_path)
    yield r
    r.close()


def test_a_segment_is_registered_once_for_every_stager_and_unregistered_after_its_last_copy(ring):
    driver = FakeDriver()
    locks = PageLocks(driver, driver.clear_error)
    segment = ClientSegment(str(ring.path))
    assert locks.lock(segment) and locks.lock(segment)  # two CachedForwards taking turns with one reused ring
    locks.copied(segment, FakeEvent(driver))
    assert driver.calls == ["register"]
    segment.close()
    assert driver.calls == ["register", "copy done", "unregister"]
    assert driver.ranges == {}


def test_a_segment_collected_without_close_is_unregistered_so_its_address_can_register_again(ring):
    driver = FakeDriver()
    locks = PageLocks(driver, driver.clear_error)
    segment = ClientSegment(str(ring.path))
    assert locks.lock(segment)
    del segment
    gc.collect()
    assert driver.ranges == {} and driver.calls == ["register", "unregister"]
    again = ClientSegment(str(ring.path))
    assert locks.lock(again)
    again.close()


def test_a_refused_registration_clears_the_runtime_error_warns_once_and_collates_on_the_host(ring):
    driver = FakeDriver(refuse=True)
    locks = PageLocks(driver, driver.clear_error)
    segment = ClientSegment(str(ring.path))
    with pytest.warns(RuntimeWarning, match=r"could not page-lock .* \(CUDA error 712\)"):
        assert not locks.lock(segment)
    assert driver.last_error is FakeError.success  # the next kernel launch's check finds nothing
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not locks.lock(segment)
    assert driver.calls == ["register"]
    segment.close()
    assert driver.calls == ["register"]
