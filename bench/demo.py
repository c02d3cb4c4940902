"""The actcache demo: start a daemon, store a few thousand activation entries, read them back.

    make demo        (or: python bench/demo.py --entries 4000)
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from actcache.codec import DType, TensorSpec, decode_entry, encode_entry
from actcache.testing import run_daemon

FINGERPRINT = bytes(range(16))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=4000)
    parser.add_argument("--batch", type=int, default=200)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    # Post-ReLU conv activations: about half zeros, like a real frozen prefix's output.
    base = np.maximum(rng.standard_normal((args.batch, 64, 16, 16), dtype=np.float32), 0)
    with run_daemon() as daemon:
        client = daemon.client()
        ns = client.open("demo").namespace_id
        print(f"daemon pid {daemon.pid} on {daemon.socket}")
        t0, stored, raw = time.perf_counter(), 0, 0
        for start in range(0, args.entries, args.batch):
            ids = range(start, min(start + args.batch, args.entries))
            items = [(i, 0, encode_entry([TensorSpec(DType.float32, base[0].shape)], [base[i % args.batch] + i])) for i in ids]
            raw += sum(base[0].nbytes for _ in ids)
            stored += client.put(ns, FINGERPRINT, 3, items).stored_bytes
        put_s = time.perf_counter() - t0
        t0, checked = time.perf_counter(), 0
        for start in range(0, args.entries, args.batch):
            ids = list(range(start, min(start + args.batch, args.entries)))
            for i, value in zip(ids, client.get(ns, FINGERPRINT, 3, ids)):
                header, payload = decode_entry(value)
                restored = np.frombuffer(payload, np.float32).reshape(header.specs[0].shape)
                if not np.array_equal(restored, base[i % args.batch] + i):
                    raise SystemExit(f"entry {i} came back different")
                checked += 1
        get_s = time.perf_counter() - t0
        misses = client.get(ns, FINGERPRINT, 3, [args.entries + 1, args.entries + 2])
        stats = client.stats()
    mib = raw / 2**20
    print(f"put  {args.entries} entries, {mib:.0f} MiB raw -> {stored / 2**20:.0f} MiB stored (zstd), "
          f"{put_s:.2f} s, {mib / put_s:.0f} MiB/s")
    print(f"get  {checked} entries bit-exact, {get_s:.2f} s, {mib / get_s:.0f} MiB/s; unknown ids -> {misses} (misses)")
    print(f"daemon counted {stats.hits_total} hits, {stats.misses_total} misses; stopped cleanly")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
