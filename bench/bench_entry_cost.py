"""Cost per warm entry: the daemon's Fetch over shared memory against the trainer reading LMDB itself.

    python bench/bench_entry_cost.py [--quick] [--entries 20480] [--rounds 3]

Stores ``--entries`` raw 16 KiB entries (ResNet-20's 64x8x8 fp32 map after
ReLU, the fast depth of bench_step.py) in a real daemon, reads them once to
warm the page cache, then times two ways of turning them into batches of
128, taking turns ``--rounds`` times (each row is its median round):

- ``fetch``: what training does today. The order is pushed with Schedule,
  read back with Fetch over shared memory, and each frame collated into a
  batch tensor (``collate_entries(verify=False)``: the daemon verified it).
- ``direct``: the order read by this process from the daemon's LMDB,
  opened read-only (LMDB allows readers in other processes), one
  ``getmulti`` per batch, collated with ``collate_entries(verify=True)``
  (this process checks every checksum). The daemon does nothing.

Per path: wall µs per entry, and CPU µs per entry of the daemon and of this
process. The figures: ``fetch_us_per_entry``, ``direct_us_per_entry`` and
``direct_vs_fetch`` (their ratio, same run).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import lmdb
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "client")]

from actcache.codec import DType, TensorSpec, encode_entry  # noqa: E402
from actcache.keys import encode_keys  # noqa: E402
from actcache.testing import DaemonProcess, run_daemon  # noqa: E402
from actcache_client.transport._tensors import collate_entries  # noqa: E402

FP = bytes(range(16))
DEPTH, BATCH, SHAPE = 3, 128, (64, 8, 8)


def _process_cpu(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (Linux /proc)."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _store(client, ns: int, count: int) -> None:
    rng = np.random.default_rng(0)
    for start in range(0, count, 1024):
        maps = np.maximum(rng.standard_normal((min(1024, count - start), *SHAPE), dtype=np.float32), 0)
        items = [(start + i, 0, encode_entry([TensorSpec(DType.float32, SHAPE)], [m])) for i, m in enumerate(maps)]
        client.put(ns, FP, DEPTH, items, encoding="raw")


def _timed(daemon: DaemonProcess, read) -> dict[str, float]:
    cpu0, own0, t0 = _process_cpu(daemon.pid), time.process_time(), time.perf_counter()
    entries = read()
    wall, own, cpu = time.perf_counter() - t0, time.process_time() - own0, _process_cpu(daemon.pid) - cpu0
    return {"wall_us": wall / entries * 1e6, "daemon_cpu_us": cpu / entries * 1e6, "client_cpu_us": own / entries * 1e6}


def fetch_round(daemon: DaemonProcess, client, ns: int, order: np.ndarray, tag: str) -> dict[str, float]:
    def read() -> int:
        client.schedule(ns, FP, DEPTH, tag, order)
        entries = 0
        for batch in client.fetch_batches(ns, tag, shared_memory=True, max_frame_bytes=BATCH * 16500):
            collate_entries(batch.values, verify=False)
            entries += len(batch)
        return entries

    return _timed(daemon, read)


def direct_round(daemon: DaemonProcess, env, db, keys: list[bytes]) -> dict[str, float]:
    def read() -> int:
        for start in range(0, len(keys), BATCH):
            with env.begin(db=db, buffers=True) as txn:
                found = dict(txn.cursor().getmulti(keys[start : start + BATCH]))
                collate_entries([found[k] for k in keys[start : start + BATCH]], verify=True)
        return len(keys)

    return _timed(daemon, read)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8,192 entries (a few seconds)")
    parser.add_argument("--entries", type=int, default=20480)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    count = 8192 if args.quick else args.entries
    with run_daemon() as daemon, daemon.client(timeout_s=600) as client:
        ns = client.open("entry-cost").namespace_id
        _store(client, ns, count)
        order = np.random.default_rng(1).permutation(count).astype(np.uint64)
        keys = encode_keys(ns, FP, DEPTH, order)
        env = lmdb.open(str(daemon.dir), readonly=True, lock=True, max_dbs=8, max_readers=1024, map_size=0)
        try:
            db = env.open_db(b"entries", create=False)
            fetch_round(daemon, client, ns, order, "warm-up")  # the page cache holds every entry from here on
            rows: dict[str, list[dict[str, float]]] = {"fetch": [], "direct": []}
            for r in range(args.rounds):  # taking turns, so the machine's load hits both alike
                rows["fetch"].append(fetch_round(daemon, client, ns, order, f"round-{r}"))
                rows["direct"].append(direct_round(daemon, env, db, keys))
        finally:
            env.close()
    print(f"{count} warm raw entries of {np.prod(SHAPE) * 4 // 1024} KiB, batches of {BATCH}, {args.rounds} rounds "
          f"(median); load average {os.getloadavg()[0]:.1f}")
    print(f"{'path':8} {'wall us/entry':>14} {'daemon CPU us':>14} {'client CPU us':>14} {'GB/s':>6}")
    median = {}
    for path, runs in rows.items():
        median[path] = {k: statistics.median(run[k] for run in runs) for k in runs[0]}
        m = median[path]
        print(f"{path:8} {m['wall_us']:14.2f} {m['daemon_cpu_us']:14.2f} {m['client_cpu_us']:14.2f} "
              f"{np.prod(SHAPE) * 4 / m['wall_us'] / 1e3:6.2f}")
    print(f"figure: fetch_us_per_entry = {median['fetch']['wall_us']:.2f}")
    print(f"figure: direct_us_per_entry = {median['direct']['wall_us']:.2f}")
    print(f"figure: direct_vs_fetch = {median['direct']['wall_us'] / median['fetch']['wall_us']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
