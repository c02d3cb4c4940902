import pytest
import torch

from actcache_client.staging import HostRing, Stager
from actcache_client.tensors import collate_entries, encode_samples


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
    a = ring.alloc((3,), torch.float32)  # slot is empty: one-off memory, the slot grows next time
    ring.alloc((5,), torch.int64)  # the same allocations as below, so the grown slots hold both
    ring.release(None)
    ring.acquire()
    ring.release(None)
    ring.acquire()
    b = ring.alloc((3,), torch.float32)
    c = ring.alloc((5,), torch.int64)
    assert b.data_ptr() % 64 == 0 and c.data_ptr() % 64 == 0
    assert c.data_ptr() - b.data_ptr() >= 12
    assert a.shape == b.shape == (3,)
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
