"""Cold reads of LMDB values: the map versus explicit reads, next to the disk's O_DIRECT speed.

    python bench/bench_cold_read.py [--quick] [--store-mib 2048] [--read-mib 1024] [--value-kib 160] [--reps 3]

Builds a store of incompressible values, then for each method drops the page
cache (needs root), reads ``--read-mib`` of values in a random order in a
fresh process (pages mapped by a live process survive a cache drop) and
prints MB/s of value bytes. Right before every method run it measures the
disk's O_DIRECT random 1 MiB read MB/s on a scratch file on the same
filesystem, because this disk's speed drifts by 2-3x over minutes; the ratio
to that figure is what compares across rows. Methods:

    map-readahead   txn.get + copy, env readahead on (the store before explicit reads)
    map-random      txn.get + copy, env readahead off (MADV_RANDOM)
    explicit        cursor lookup + one pread per value, one thread
    explicit-advise lookups run ahead of the reads, POSIX_FADV_WILLNEED on each extent
    explicit-probes lookups on a pool of threads (each in its own read txn) + WILLNEED,
                    the reader then looks up again (cached) and preads (the prefetcher's method)

Sample (2 cores, virtio disk, --store-mib 2048 --read-mib 1024 --value-kib 160 --reps 3;
median of reps, ratio = method / O_DIRECT measured just before it)::

    store 13107 values of 160 KiB (2048 MiB); reading 6553 in a random order
    method               MB/s  O_DIRECT MB/s   ratio   (median of 3)
    map-readahead         417            919    0.46
    map-random             39            885    0.04
    explicit              290            790    0.37
    explicit-advise       305            916    0.33
    explicit-probes      1014           1169    0.85
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
FP = bytes(16)
METHODS = ["map-readahead", "map-random", "explicit", "explicit-advise", "explicit-probes"]


def drop_page_cache() -> bool:
    """Drop clean page-cache pages (root only); False when not permitted."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        return True
    except OSError:
        return False


def odirect_read_mbps(path: Path, total_bytes: int = 256 << 20, block: int = 1 << 20) -> float:
    """O_DIRECT random ``block`` reads of ``path`` at queue depth 1, MB/s."""
    size = path.stat().st_size // block * block
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    buf = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT requires
    rng = random.Random(0)
    try:
        t0 = time.perf_counter()
        done = 0
        while done < total_bytes:
            done += os.preadv(fd, [buf], rng.randrange(size // block) * block)
        return done / (time.perf_counter() - t0) / 1e6
    finally:
        os.close(fd)
        buf.close()


def write_scratch(path: Path, size: int) -> None:
    block = os.urandom(8 << 20)
    with open(path, "wb") as f:
        for _ in range(size // len(block)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())


def build_store(directory: Path, store_bytes: int, value_bytes: int) -> int:
    sys.path.insert(0, str(ROOT))
    from actcache.codec import DType, TensorSpec, encode_entry
    from actcache.daemon.config import StoreConfig
    from actcache.daemon.store import Store

    count = store_bytes // value_bytes
    store = Store(StoreConfig(dir=directory, encoding="raw"))
    try:
        ns = store.open_namespace("cold").id
        noise = np.random.default_rng(0).integers(0, 256, value_bytes + 4096, dtype=np.uint8)
        spec = [TensorSpec(DType.uint8, (value_bytes - 64,))]
        batch = []
        for i in range(count):
            shift = (i * 131) % 4096
            batch.append((i, 0, encode_entry(spec, [noise[shift : shift + value_bytes - 64]])))
            if len(batch) * value_bytes >= 32 << 20 or i == count - 1:
                store.put(ns, FP, 1, batch)
                batch = []
    finally:
        store.close()
    return count


def run_method(directory: Path, method: str, count: int, read_count: int, seed: int) -> dict:
    """Read ``read_count`` random values with ``method`` (in this process); returns MB/s."""
    import lmdb

    sys.path.insert(0, str(ROOT))
    from actcache.daemon.store import ReadSession, ValueFile
    from actcache.keys import encode_key

    env = lmdb.open(str(directory), max_dbs=8, readonly=True, lock=False, readahead=method == "map-readahead")
    db = env.open_db(b"entries", create=False)
    order = np.random.default_rng(seed).permutation(count)[:read_count]
    keys = [encode_key(1, FP, 1, int(i), 0) for i in order]
    file = ValueFile(directory / "data.mdb", env.stat()["psize"])
    total = 0
    t0 = time.perf_counter()
    with env.begin(db=db, buffers=True) as txn:
        if method.startswith("map"):
            for key in keys:
                total += len(bytes(txn.get(key)))
        elif method == "explicit":
            session = ReadSession(txn, file)
            for key in keys:
                total += len(session.read(key, session.locate(key)))
        elif method == "explicit-advise":
            session = ReadSession(txn, file)
            ahead: deque = deque()
            nxt = 0
            for i, key in enumerate(keys):
                while nxt < len(keys) and nxt < i + 64:
                    extent = session.locate(keys[nxt])
                    file.advise(extent)
                    ahead.append(extent)
                    nxt += 1
                total += len(session.read(key, ahead.popleft()))
        elif method == "explicit-probes":
            def probe(key: bytes) -> None:
                with env.begin(db=db, buffers=True) as t:
                    extent = ReadSession(t, file).locate(key)
                if extent is not None:
                    file.advise(extent)

            session = ReadSession(txn, file)
            with ThreadPoolExecutor(8) as pool:
                probes: deque = deque()
                nxt = 0
                for i, key in enumerate(keys):
                    while nxt < len(keys) and nxt < i + 64:
                        probes.append(pool.submit(probe, keys[nxt]))
                        nxt += 1
                    probes.popleft()
                    total += len(session.read(key, session.locate(key)))
        else:
            raise SystemExit(f"unknown method {method!r}; choose from {METHODS}")
    seconds = time.perf_counter() - t0
    file.close()
    env.close()
    return {"method": method, "MBps": total / seconds / 1e6, "seconds": seconds, "bytes": total}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="512 MiB store, 256 MiB read, 1 rep")
    parser.add_argument("--store-mib", type=int, default=2048)
    parser.add_argument("--read-mib", type=int, default=1024)
    parser.add_argument("--value-kib", type=int, default=160)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--dir", type=Path, help="where to build the store (default: a temp dir under /var/tmp)")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    parser.add_argument("--_run", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._run:
        directory, method, count, read_count = args._run
        print(json.dumps(run_method(Path(directory), method, int(count), int(read_count), seed=int(time.time()))))
        return 0
    if args.quick:
        args.store_mib, args.read_mib, args.reps = 512, 256, 1
    if not drop_page_cache():
        print("cannot write /proc/sys/vm/drop_caches (needs root): cold reads cannot be measured; skipping")
        return 0
    with tempfile.TemporaryDirectory(dir=args.dir or "/var/tmp", prefix="actcache-cold-") as tmp:
        directory = Path(tmp) / "store"
        value_bytes = args.value_kib << 10
        count = build_store(directory, args.store_mib << 20, value_bytes)
        read_count = min(count, (args.read_mib << 20) // value_bytes)
        scratch = Path(tmp) / "odirect.bin"
        write_scratch(scratch, 1 << 30)
        print(f"store {count} values of {args.value_kib} KiB ({args.store_mib} MiB); reading {read_count} in a random order")
        print(f"{'method':<17}{'MB/s':>8}{'O_DIRECT MB/s':>15}{'ratio':>8}   (median of {args.reps})")
        rows = []
        for method in args.methods.split(","):
            runs = []
            for _ in range(args.reps):
                drop_page_cache()
                disk = odirect_read_mbps(scratch)
                drop_page_cache()
                out = subprocess.run(
                    [sys.executable, __file__, "--_run", str(directory), method, str(count), str(read_count)],
                    check=True, capture_output=True, text=True,
                ).stdout
                result = json.loads(out)
                runs.append((result["MBps"], disk))
            mbps = statistics.median(r[0] for r in runs)
            disk = statistics.median(r[1] for r in runs)
            ratio = statistics.median(r[0] / r[1] for r in runs)
            print(f"{method:<17}{mbps:>8.0f}{disk:>15.0f}{ratio:>8.2f}", flush=True)
            rows.append({"method": method, "MBps": mbps, "odirect_MBps": disk, "ratio": ratio, "runs": runs})
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
