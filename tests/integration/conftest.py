"""Fixtures and helpers shared by the integration tests.

- ``daemon`` / ``client``: one daemon for a test module, a client per test.
- Shared-memory Fetch (tests/integration/test_shm_fetch.py, test_leftovers.py,
  test_fuzz.py): entries whose tensor is derived from their sample id
  (``put_range``, ``tensor_of``), a fetch that copies what it receives
  (``fetched``), the ``actcache-*`` segments of a shm dir (``segments``,
  ``shm_dir``), and a client process holding ring slots (``start_holder``).
"""

from __future__ import annotations

import faulthandler
import os
import subprocess
import sys
import tempfile
import textwrap

import numpy as np
import pytest

from actcache.codec import DType, TensorSpec, decode_entry, encode_entry
from actcache.shm import PREFIX
from actcache.testing import DaemonProcess, run_daemon

SHM_FP = bytes(range(16))
SHM_SPEC = [TensorSpec(DType.float32, (16, 16))]  # 1 KiB raw
SMALL_RING = 64 << 10  # the smallest ring: about 60 of those entries


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test that used a daemon reports its log's tail and where its threads and this process's were."""
    outcome = yield
    report = outcome.get_result()
    daemon = getattr(item, "funcargs", {}).get("daemon")
    if report.when == "call" and report.failed and isinstance(daemon, DaemonProcess):
        log = daemon.log_tail()  # before the dump, which the daemon writes to its log too
        report.sections.append(("daemon log", log))
        report.sections.append(("daemon threads at the failure", daemon.thread_dump() or "(none written)"))
        with tempfile.TemporaryFile("w+") as dump:
            faulthandler.dump_traceback(dump, all_threads=True)
            dump.seek(0)
            report.sections.append(("test process threads at the failure", dump.read()))


@pytest.fixture(scope="module")
def daemon():
    with run_daemon() as d:
        yield d


@pytest.fixture
def client(daemon):
    with daemon.client(timeout_s=20) as c:
        yield c


def tensor_of(sample_id: int) -> np.ndarray:
    """The 16x16 float32 tensor stored under ``sample_id``."""
    return np.random.default_rng(sample_id).standard_normal((16, 16), dtype=np.float32)


def put_range(client, ns, ids, *, fingerprint: bytes = SHM_FP, depth: int = 1) -> None:
    """Store ``tensor_of(i)`` for every id in ``ids``."""
    client.put(ns, fingerprint, depth, [(i, 0, encode_entry(SHM_SPEC, [tensor_of(i)])) for i in ids])


# A distinctive raw payload (an 8 KiB uint8 tensor) to find again in data.mdb: store it with --encoding raw.
MARKER_SPEC = [TensorSpec(DType.uint8, (8192,))]
MARKER = bytes(range(256)) * 32


def flip_marker_byte(cache_dir) -> None:
    """Corrupt the stored entry whose payload is MARKER (the daemon is stopped): flip one of its bytes."""
    path = cache_dir / "data.mdb"
    data = bytearray(path.read_bytes())
    where = data.find(MARKER)
    assert where > 0, "the marker entry is not stored raw in data.mdb"
    data[where + 100] ^= 0xFF
    path.write_bytes(bytes(data))


def holds_its_tensor(value, sample_id: int) -> bool:
    """A fetched (uncompressed) entry holds exactly ``tensor_of(sample_id)``."""
    return bytes(decode_entry(value)[1]) == tensor_of(sample_id).tobytes()


def fetched(client, ns, schedule_id, **kwargs) -> tuple[list[tuple[int, int, int, bytes | None]], set[str]]:
    """Every ``(position, sample_id, variant, value copy or None)`` of a Fetch, and the data planes it used."""
    out, planes = [], set()
    for batch in client.fetch_batches(ns, schedule_id, **kwargs):
        planes.add(batch.data_plane)
        out.extend((pos, sid, var, None if v is None else bytes(v)) for pos, sid, var, v in batch)
    return out, planes


def segments(directory) -> list[str]:
    """Names of the shared-memory segments in ``directory``."""
    return sorted(n for n in os.listdir(directory) if n.startswith(PREFIX))


@pytest.fixture
def shm_dir(tmp_path):
    """A directory for the daemon's segments (pass ``ACTCACHE_SHM_DIR`` in its env)."""
    d = tmp_path / "shm"
    d.mkdir()
    return d


_HOLDER = textwrap.dedent("""
    import sys, time
    import grpc
    from actcache._proto import actcache_pb2 as pb
    from actcache.rpc import method
    from actcache.rpc_client import RpcClient

    target, ns, schedule_id, unmapped = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    client = RpcClient(target)
    batches = client.fetch_batches(ns, schedule_id, shared_memory=True, ring_bytes=65536, max_frame_bytes=4096)
    next(batches)  # the segment is mapped and this batch's slots are held (never released)
    calls = []
    if unmapped:  # a second stream whose segment this process never maps
        channel = grpc.insecure_channel(target)
        fetch = channel.unary_stream(method("Fetch"), request_serializer=pb.FetchRequest.SerializeToString)
        calls.append(fetch(pb.FetchRequest(namespace_id=ns, schedule_id=unmapped, shared_memory=True,
                                           ring_bytes=65536, max_frame_bytes=4096)))
        next(calls[0])
    print("holding", flush=True)
    time.sleep(600)
""")


def start_holder(target: str, ns: int, schedule_id: str, unmapped_schedule_id: str = "") -> subprocess.Popen:
    """A client process that Fetches ``schedule_id`` through shared memory (ring of 64 KiB, 4 KiB frames),
    holds the slots of its first batch and sleeps; with ``unmapped_schedule_id`` it also opens a second
    shared-memory Fetch and reads its first frame without mapping the segment. Returns once it holds them."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, target, str(ns), schedule_id, unmapped_schedule_id],
                              stdout=subprocess.PIPE, env=env)
    line = holder.stdout.readline().strip()
    if line != b"holding":
        holder.kill()
        holder.wait()
        holder.stdout.close()
        raise AssertionError(f"the holder client did not start holding (printed {line!r}, exit {holder.returncode})")
    return holder


def kill_9(proc: subprocess.Popen) -> None:
    """SIGKILL a process started by a test and reap it."""
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()

