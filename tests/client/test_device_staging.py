import pytest
import torch

from actcache_client.transport._device_staging import CopyTimer, HostRing, Stager
from actcache_client.transport._tensors import collate_entries, encode_samples


class FakeEvent:
    """Stands in for torch.cuda.Event (CUDA is not available here): records synchronize calls."""

    def __init__(self) -> None:
        self.synchronized = False

    def synchronize(self) -> None:
        self.synchronized = True


def test_ring_reuses_a_slot_only_after_its_event_completed():
    ring = HostRing(2)
    events = []
    for step in range(5):
        slot = ring.acquire()
        assert slot == step % 2
        if step >= 2:
            assert events[step - 2].synchronized  # the copy that last read this slot finished first
        t = ring.alloc((4, 8), torch.float32)
        t.fill_(step)
        events.append(FakeEvent())
        ring.release(events[-1])


def test_ring_allocations_are_aligned_views_and_grow():
    ring = HostRing(2)
    ring.acquire()
    first = [ring.alloc((3,), torch.float32), ring.alloc((5,), torch.int64)]  # empty slot: one-off memory
    ring.release(None)
    for _ in range(2):  # both slots grow to the largest batch at their next acquire
        ring.acquire()
        b, c = ring.alloc((3,), torch.float32), ring.alloc((5,), torch.int64)
        ring.release(None)
    assert c.data_ptr() - b.data_ptr() == 64  # carved from one slot, 64-byte aligned
    assert b.data_ptr() != first[0].data_ptr()
    with pytest.raises(RuntimeError, match="before acquire"):
        HostRing(2).alloc((1,), torch.float32)


def test_cpu_stager_collates_into_fresh_memory_each_batch():
    stager = Stager("cpu")
    x = torch.randn(4, 3)
    first = stager.to_device(collate_entries(encode_samples(x), alloc=stager.allocator()))
    second = stager.to_device(collate_entries(encode_samples(x * 2), alloc=stager.allocator()))
    assert torch.equal(first, x) and torch.equal(second, x * 2)  # the second batch did not overwrite the first


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA unavailable: pinned ring and side-stream copies need a GPU")
def test_cuda_stager_copies_through_pinned_ring():
    stager = Stager("cuda")
    x = torch.randn(8, 16)
    for _ in range(6):
        out = stager.to_device(collate_entries(encode_samples(x), alloc=stager.allocator()))
        assert out.is_cuda and torch.equal(out.cpu(), x)


class FakeTimingEvent:
    """Stands in for torch.cuda.Event(enable_timing=True): completes when the test says so."""

    clock_ms = 0.0

    def __init__(self) -> None:
        self.done = False
        self.at_ms: float | None = None

    def record(self) -> None:
        self.at_ms = FakeTimingEvent.clock_ms

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, end: "FakeTimingEvent") -> float:
        return end.at_ms - self.at_ms


def test_copy_timer_reports_completed_copies_in_order_without_waiting():
    events: list[FakeTimingEvent] = []

    def new_event() -> FakeTimingEvent:
        events.append(FakeTimingEvent())
        return events[-1]

    timer = CopyTimer(new_event)
    for nbytes, ms in ((1 << 20, 2.0), (4 << 20, 4.0)):
        start = timer.start()
        FakeTimingEvent.clock_ms += ms
        timer.stop(start, nbytes)
    assert timer.readings() == []  # nothing completed yet: no reading, no wait
    events[1].done = True  # the first copy's end event
    assert timer.readings() == [(1 << 20, 0.002)]
    events[3].done = True
    assert timer.readings() == [(4 << 20, 0.004)]
    assert timer.readings() == []


def test_cpu_stager_has_no_copies_to_report():
    stager = Stager("cpu")
    stager.to_device(torch.ones(2))
    assert stager.copy_readings() == []
