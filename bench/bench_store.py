"""Put/get throughput of the store: in-process vs through the daemon, same run.

    python bench/bench_store.py [--quick] [--total-mib 512] [--encoding auto] [--device cpu|cuda]

Entries are post-ReLU-like float32 activations (about half zeros). For each
entry size it prints one row per path with MB/s (of raw tensor bytes) and
entries/s: in the daemon's process, through the daemon with puts in a
shared-memory segment (PutShared, what a client on the Unix socket uses), and
through the daemon with puts in gRPC messages (what a TCP client uses); then
the daemon/in-process ratios and the shared-memory/messages put ratio. The
store is host-side: ``--device`` is accepted for a uniform command line and
changes nothing. Sample (2-core VM, --quick, 2026-11-29)::

    size     path              put MB/s  put ent/s  get MB/s  get ent/s
    256 KiB  in-process     ...
    256 KiB  daemon, shm    ...
    256 KiB  daemon, bytes  ...
    figure: shm_put_vs_bytes = 1.xx
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from actcache.codec import DType, TensorSpec, encode_entry
from actcache.daemon.config import StoreConfig
from actcache.daemon.store import Store
from actcache.testing import run_daemon

FP = bytes(16)
BATCH_BYTES = 8 << 20


def make_entries(entry_bytes: int, count: int) -> list[bytes]:
    rng = np.random.default_rng(0)
    n = entry_bytes // 4
    base = np.maximum(rng.standard_normal(n, dtype=np.float32), 0)
    # Distinct entries (so LMDB stores real bytes) from a few rolled copies of one sample.
    return [encode_entry([TensorSpec(DType.float32, (n,))], [np.roll(base, i * 7)]) for i in range(count)]


def run(put, get, entries: list[bytes], entry_bytes: int) -> dict[str, float]:
    per_batch = max(1, BATCH_BYTES // entry_bytes)
    t0 = time.perf_counter()
    for start in range(0, len(entries), per_batch):
        put([(start + i, 0, e) for i, e in enumerate(entries[start : start + per_batch])])
    put_s = time.perf_counter() - t0
    order = np.random.default_rng(1).permutation(len(entries)).tolist()
    t0 = time.perf_counter()
    for start in range(0, len(order), per_batch):
        values = get(order[start : start + per_batch])
        assert all(v is not None for v in values)
    get_s = time.perf_counter() - t0
    raw = len(entries) * entry_bytes
    return {"put_MBps": raw / put_s / 1e6, "put_eps": len(entries) / put_s,
            "get_MBps": raw / get_s / 1e6, "get_eps": len(entries) / get_s}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="128 MiB per size (under a minute)")
    parser.add_argument("--total-mib", type=int, default=512)
    parser.add_argument("--encoding", default="auto", help="the daemon's --encoding")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="accepted; the store is host-side")
    args = parser.parse_args()
    total = (128 if args.quick else args.total_mib) << 20
    rows: list[dict] = []
    ratios: list[float] = []
    print(f"{'size':<9}{'path':<16}{'put MB/s':>10}{'put ent/s':>11}{'get MB/s':>10}{'get ent/s':>11}")
    for entry_bytes in (256 << 10, 1 << 20):
        entries = make_entries(entry_bytes, total // entry_bytes)
        with tempfile.TemporaryDirectory() as tmp:
            store = Store(StoreConfig(dir=Path(tmp), encoding=args.encoding))
            ns = store.open_namespace("bench").id
            local = run(lambda items, store=store, ns=ns: store.put(ns, FP, 1, items),
                        lambda ids, store=store, ns=ns: store.get(ns, FP, 1, [(i, 0) for i in ids]), entries, entry_bytes)
            store.close()
        remote = {}
        for plane, shared in (("shm", True), ("bytes", False)):  # one daemon each: a fresh store, as in-process
            with run_daemon("--encoding", args.encoding) as daemon, \
                    daemon.client(timeout_s=120, shared_puts=shared) as client:
                ns = client.open("bench").namespace_id
                remote[plane] = run(lambda items, ns=ns, client=client: client.put(ns, FP, 1, items),
                                    lambda ids, ns=ns, client=client: client.get(ns, FP, 1, ids), entries, entry_bytes)
                assert (client.put_plane_detail == "") == shared, client.put_plane_detail
        label = f"{entry_bytes >> 10} KiB"
        for path, r in (("in-process", local), ("daemon, shm", remote["shm"]), ("daemon, bytes", remote["bytes"])):
            print(f"{label:<9}{path:<16}{r['put_MBps']:>10.0f}{r['put_eps']:>11.0f}{r['get_MBps']:>10.0f}{r['get_eps']:>11.0f}")
            rows.append({"entry_bytes": entry_bytes, "path": path, **r})
        put_ratio, get_ratio = remote["shm"]["put_MBps"] / local["put_MBps"], remote["shm"]["get_MBps"] / local["get_MBps"]
        planes = remote["shm"]["put_MBps"] / remote["bytes"]["put_MBps"]
        print(f"{label:<9}{'ratio':<16}daemon, shm/in-process: put {put_ratio:.2f}, get {get_ratio:.2f}; "
              f"put shm/bytes {planes:.2f}")
        rows.append({"entry_bytes": entry_bytes, "path": "ratio", "put": put_ratio, "get": get_ratio,
                     "put_shm_vs_bytes": planes})
        ratios.append(planes)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    print(f"figure: shm_put_vs_bytes = {min(ratios):.2f}")  # the smaller of the sizes' ratios
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
