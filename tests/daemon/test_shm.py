"""The shared-memory ring: slot allocation, release, wrap, naming and stale segments."""

import mmap
import os
import subprocess
import sys
import threading

import pytest

from actcache.daemon.service._shm_fetch import ParkedRings
from actcache.errors import InvalidRequest
from actcache.shm import HEADER_BYTES, MIN_RING_BYTES, ClientSegment, ShmRing, pid_alive, remove_stale
from actcache.testing import wait_until


@pytest.fixture
def ring(tmp_path):
    r = ShmRing(MIN_RING_BYTES, start=10, directory=tmp_path)
    yield r
    r.close()


def test_a_slot_is_reused_only_after_the_client_released_it(ring):
    client = ClientSegment(str(ring.path))
    size = MIN_RING_BYTES // 4
    offsets = [ring.alloc(10 + i, size) for i in range(4)]
    assert offsets == [HEADER_BYTES + i * size for i in range(4)]
    assert ring.alloc(14, size) is None  # full: nothing released yet
    client.release(11)  # position 10 consumed
    assert ring.alloc(14, size) == HEADER_BYTES  # its slot, and only its
    assert ring.alloc(15, size) is None
    client.release(13)
    assert ring.alloc(15, size) == HEADER_BYTES + size


def test_an_entry_never_crosses_the_end_of_the_ring(ring):
    client = ClientSegment(str(ring.path))
    big = MIN_RING_BYTES * 3 // 4
    assert ring.alloc(10, big) == HEADER_BYTES
    assert ring.alloc(11, big) is None
    client.release(11)
    assert ring.alloc(11, big) == HEADER_BYTES  # the gap at the end goes with it
    with pytest.raises(InvalidRequest, match="does not fit the shared-memory ring"):
        ring.alloc(12, MIN_RING_BYTES + 1)


def test_a_run_of_slots_is_one_block_or_two_where_the_ring_wraps_and_is_released_slot_by_slot(ring):
    client = ClientSegment(str(ring.path))
    size = MIN_RING_BYTES // 8 - 16  # 8 slots fit, with a 128-byte gap at the end
    assert ring.alloc_run(10, 3, size) == [(HEADER_BYTES, 3)]  # positions 10..12
    assert ring.alloc_run(13, 4, size) == [(HEADER_BYTES + 3 * size, 4)]  # 13..16: 7 of 8 slots taken
    assert ring.alloc_run(17, 2, size) is None  # one slot and the gap left: not room for two
    client.release(11)  # position 10 consumed
    assert ring.alloc_run(17, 2, size) == [(HEADER_BYTES + 7 * size, 1), (HEADER_BYTES, 1)]  # 17 at the end, 18 at the start
    assert ring.alloc(19, size) is None  # 11..18 fill the ring
    client.release(12)  # 11 alone: its slot is free, though the rest of its run was not released with it
    assert ring.alloc(19, size) == HEADER_BYTES + size
    assert ring.alloc(20, size) is None
    with pytest.raises(InvalidRequest, match="does not fit the shared-memory ring"):
        ring.alloc_run(21, 1, MIN_RING_BYTES + 1)


def test_a_ring_of_whole_frames_never_splits_one(tmp_path):
    slot, per_frame = 16464, 8  # not a divisor of a page or a MiB
    frame = slot * per_frame
    ring = ShmRing(4 * frame, start=0, directory=tmp_path)
    client = ClientSegment(str(ring.path))
    assert ring.ring_bytes == 4 * frame and ring.capacity % mmap.PAGESIZE == 0
    for k in range(12):  # three turns of the ring; the client has not released the last three frames written
        if k >= 4:  # exactly a frame free: room for a frame of uniform slots (a wait would end at once:
            # the call reads as ended), not for a frame that must allow a slot of gap
            assert ring.wait_frame_room(frame, slot, lambda: False, patience_s=30, uniform=True)
            assert not ring.wait_frame_room(frame, slot, lambda: False, patience_s=30)
        assert ring.alloc_run(k * per_frame, per_frame, slot) == [(HEADER_BYTES + (k % 4) * frame, per_frame)]
        client.release(max(k - 2, 0) * per_frame)
    ring.close()


def test_a_reused_ring_serves_a_smaller_request_in_its_first_bytes(tmp_path):
    ring = ShmRing(3 * MIN_RING_BYTES, start=0, directory=tmp_path)
    ring.restart(100, 2 * MIN_RING_BYTES)
    assert ring.ring_bytes == 2 * MIN_RING_BYTES and ring.capacity == 3 * MIN_RING_BYTES
    size = MIN_RING_BYTES // 2
    assert [ring.alloc(100 + i, size) for i in range(4)] == [HEADER_BYTES + i * size for i in range(4)]
    assert ring.alloc(104, size) is None  # the stream's ring is full, though the data area is not
    ring.restart(200)
    assert ring.ring_bytes == 3 * MIN_RING_BYTES  # all of it
    ring.close()


def test_writes_land_where_the_client_reads_and_mapping_unlinks_the_name(ring):
    off = ring.alloc(10, 5)
    ring.view(off, 5)[:] = b"hello"
    client = ClientSegment(str(ring.path))
    assert bytes(client.view[off : off + 5]) == b"hello"
    assert ring.path.exists()
    ring.poll()
    assert not ring.path.exists()  # the client's mapping keeps the memory
    assert bytes(client.view[off : off + 5]) == b"hello"


def test_remove_stale_keeps_segments_of_live_pids(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    (tmp_path / f"actcache-{dead_pid}-00").write_bytes(b"")
    (tmp_path / f"actcache-{os.getppid()}-00").write_bytes(b"")
    (tmp_path / "other-file").write_bytes(b"")
    removed = remove_stale(tmp_path)
    assert [p.name for p in removed] == [f"actcache-{dead_pid}-00"]
    assert sorted(os.listdir(tmp_path)) == sorted([f"actcache-{os.getppid()}-00", "other-file"])


def _waiter(ring, nbytes, slot_bytes, patience_s=30.0, alive=lambda: True):
    """Run wait_frame_room in a thread; its result lands in the returned list."""
    result: list[bool] = []
    thread = threading.Thread(target=lambda: result.append(ring.wait_frame_room(nbytes, slot_bytes, alive, patience_s)))
    thread.start()
    return thread, result


def test_a_frame_waits_for_room_for_all_of_it_while_earlier_frames_are_held(ring):
    client = ClientSegment(str(ring.path))
    slot = MIN_RING_BYTES // 8
    for i in range(8):  # two frames of four slots fill the ring; the client holds them
        ring.alloc(10 + i, slot)
    thread, result = _waiter(ring, 3 * slot, slot)  # a frame of three slots needs four (one of gap at the end)
    client.release(12)  # two slots free
    thread.join(0.2)
    assert thread.is_alive() and not result
    client.release(14)  # four
    thread.join(10)
    assert result == [True]


def test_a_frame_stops_waiting_once_everything_is_released_the_client_holds_on_or_the_call_ends(ring):
    client = ClientSegment(str(ring.path))
    ring.alloc(10, MIN_RING_BYTES // 2)
    thread, result = _waiter(ring, 2 * MIN_RING_BYTES, 1024)  # larger than the ring: what fits, once all is free
    client.release(11)
    thread.join(10)
    assert result == [True]
    ring.alloc(11, MIN_RING_BYTES // 2)
    assert ring.wait_frame_room(MIN_RING_BYTES // 2, 1024, lambda: True, patience_s=0.05)  # held: after its patience
    assert not ring.wait_frame_room(MIN_RING_BYTES // 2, 1024, lambda: False, patience_s=30)  # the call ended


def test_parked_rings_are_taken_by_name_and_size_and_restart_at_the_new_position(tmp_path):
    parked = ParkedRings()
    ring = ShmRing(MIN_RING_BYTES, start=0, directory=tmp_path)
    client = ClientSegment(str(ring.path))
    ring.alloc(0, 1024)
    client.release(1)
    parked.park(ring)
    assert parked.take(str(ring.path), 2 * MIN_RING_BYTES) is None  # another size: stays parked
    assert parked.take("elsewhere", MIN_RING_BYTES) is None
    assert parked.take(str(ring.path), MIN_RING_BYTES) is ring and len(parked) == 0
    ring.restart(500)
    assert ring.alloc(500, MIN_RING_BYTES) == HEADER_BYTES  # empty again
    assert ring.alloc(501, 1) is None  # and nothing before 500 counts as released
    client.release(501)
    assert ring.alloc(501, 1) == HEADER_BYTES
    parked.close()
    ring.close()


def test_parked_rings_are_closed_over_their_byte_cap_after_their_idle_time_and_at_close(tmp_path):
    rings = [ShmRing(MIN_RING_BYTES, start=0, directory=tmp_path) for _ in range(4)]
    parked = ParkedRings(idle_s=0.3, max_bytes=2 * MIN_RING_BYTES)
    for ring in rings[:3]:
        parked.park(ring)
    assert rings[0]._mm.closed and len(parked) == 2  # over the cap: the oldest went
    wait_until(lambda: len(parked) == 0, 10, "idle rings closed")  # by the janitor thread
    assert all(r._mm.closed for r in rings[:3])
    parked.close()
    parked.park(rings[3])  # after close: closed at once
    assert rings[3]._mm.closed and len(parked) == 0


def test_a_zombie_process_counts_as_dead_and_a_running_one_as_alive():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert pid_alive(child.pid)
        child.kill()  # not reaped until wait(): a zombie meanwhile
        wait_until(lambda: not pid_alive(child.pid), timeout=10, what="the killed child read as dead")
    finally:
        child.kill()
        child.wait()
    assert not pid_alive(child.pid)
