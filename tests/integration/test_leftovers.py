"""kill -9 during a shared-memory Fetch, of the client, the daemon or both: nothing to clean up by hand.

A client process (conftest.start_holder) Fetches a schedule through shared
memory and holds the slots of its first batch (the ring is full, so the
daemon waits for it to release them); it also reads the first frame of a
second shared-memory Fetch whose segment it never maps, so a segment name
exists in the shm dir at the moment of the kill. Then SIGKILL hits the
client, the daemon, or both (daemon first). In every case:

- a daemon that survives notices the dead client: both segments are gone
  and it keeps serving; it then stops cleanly;
- the next daemon start on the same cache dir and socket path works without
  any cleanup (no "address in use", no lock error), and afterwards no
  ``actcache-*`` segment is left in the shm dir (those of a killed daemon
  are removed at start);
- a new client Schedules and Fetches bit-exact entries, with misses in
  place, on the bytes and on the shared-memory data plane.
"""

import numpy as np
import pytest

from actcache.shm import pid_alive
from actcache.testing import DaemonProcess, wait_until
from tests.integration.conftest import SHM_FP as FP
from tests.integration.conftest import SMALL_RING as RING
from tests.integration.conftest import (
    fetched,
    holds_its_tensor,
    kill_9,
    put_range,
    segments,
    start_holder,
)

pytestmark = pytest.mark.slow  # seconds per test: make test runs them, make test-fast does not

STORED = 300  # ~300 KiB of entries: more than the 64 KiB ring holds


def check_schedule_and_fetch(daemon: DaemonProcess, schedule_id: str) -> None:
    """A new client pushes an order of stored and never-stored ids and Fetches it on both data planes."""
    order = np.random.default_rng(7).permutation(STORED + 40).astype(np.uint64)  # ids >= STORED: misses
    with daemon.client(timeout_s=20) as client:
        ns = client.open("leftovers", create=False).namespace_id
        for plane, kwargs in (("bytes", {}), ("shared_memory", {"shared_memory": True, "ring_bytes": RING})):
            client.schedule(ns, FP, 1, f"{schedule_id}-{plane}", order)
            got, planes = fetched(client, ns, f"{schedule_id}-{plane}", **kwargs)
            assert planes == {plane}
            assert [(pos, sid) for pos, sid, _, _ in got] == list(enumerate(order.tolist()))
            for _, sid, _, value in got:
                if sid < STORED:
                    assert value is not None and holds_its_tensor(value, sid), f"entry {sid} is wrong ({plane})"
                else:
                    assert value is None, f"id {sid} was never stored but was served ({plane})"


def dead_segments(shm_dir) -> list[str]:
    return [n for n in segments(shm_dir) if not pid_alive(int(n.split("-")[1]))]


@pytest.mark.parametrize("killed", ["client", "daemon", "both"])
def test_kill_9_during_a_shared_memory_fetch_then_restart_needs_no_cleanup(tmp_path, shm_dir, killed):
    daemon = DaemonProcess(tmp_path / "cache", tmp_path / "daemon.sock", env={"ACTCACHE_SHM_DIR": str(shm_dir)})
    daemon.start()
    holder = None
    try:
        with daemon.client(timeout_s=20) as client:
            ns = client.open("leftovers").namespace_id
            put_range(client, ns, range(STORED))
            for schedule_id in ("held", "unmapped"):
                client.schedule(ns, FP, 1, schedule_id, np.arange(STORED, dtype=np.uint64))
        holder = start_holder(daemon.target, ns, "held", "unmapped")
        first_pid = daemon.pid
        assert any(n.startswith(f"actcache-{first_pid}-") for n in segments(shm_dir))  # the unmapped one
        if killed in ("daemon", "both"):
            daemon.kill()
        if killed in ("client", "both"):
            kill_9(holder)
        if killed == "client":
            wait_until(lambda: segments(shm_dir) == [], what="the daemon removing the dead client's segments")
            with daemon.client(timeout_s=20) as client:
                wait_until(lambda: client.stats().prefetch_buffered_bytes == 0, what="read-ahead memory freed")
            check_schedule_and_fetch(daemon, "alive")
            assert "Traceback" not in daemon.log_tail(400), daemon.log_tail(80)
            assert daemon.stop() == 0, daemon.log_tail()
        else:
            assert dead_segments(shm_dir), "the killed daemon left no segment: the restart cleans nothing up"
        daemon.start()  # same directory and socket path, no manual cleanup
        assert daemon.pid != first_pid
        assert segments(shm_dir) == [], "segments of a killed daemon survived the restart"
        check_schedule_and_fetch(daemon, "restarted")
        assert segments(shm_dir) == []
        assert "Traceback" not in daemon.log_tail(400), daemon.log_tail(80)
        assert daemon.stop() == 0, daemon.log_tail()
    finally:
        if holder is not None:
            kill_9(holder)
        daemon.kill()
