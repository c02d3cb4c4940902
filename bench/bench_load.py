"""Mixed load on one daemon: client processes put, get and stat for a fixed time.

    python bench/bench_load.py [--quick] [--processes 8] [--seconds 60] [--entry-kib 64] [--json FILE]

Each client process opens the namespace, waits for the others, then loops
until ``--seconds`` have passed or it has done ``--max-ops`` operations:
40% put (``--batch`` entries under random ids of a shared key space, so
processes overwrite each other's keys), 50% get (``--batch`` random ids;
ids not written yet are misses) and 10% stats. An entry's tensor is derived
from its id, so every hit is decoded (CRC, zstd) and compared with what it
must hold; a mismatch or any failed call counts as an error. The daemon
(actcache.testing.run_daemon: a Unix socket in a temp dir, default flags)
has its RSS sampled every 100 ms.

Output: one row per operation with count, ops/s, MB/s (raw tensor bytes) and
p50/p99 latency, the daemon's RSS, then two machine-readable lines:

    figure: load_errors = N
    figure: load_p99_ms = X      (p99 over every operation)

Sample (2 cores shared with other work, load average ~5; default 60 s run):

    8 processes x 60 s, 64 KiB entries, batch 8, 4096 keys, Unix socket
    op        count    ops/s    MB/s   p50 ms   p99 ms
    put        6091      101      53     34.9    101.2
    get        7370      123      59     18.0     50.6
    stats      1476       25       0     10.2     33.9
    all       14937      248             23.1     78.5
    gets: 53944 hits, 5016 misses; elapsed 60.1 s
    daemon RSS: start 41 MiB, max 231 MiB, end 221 MiB
    figure: load_errors = 0
    figure: load_p99_ms = 78.5

Exit code 1 when there were errors.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import random
import shlex
import sys
import threading
import time
from pathlib import Path

import numpy as np
import psutil

from actcache.codec import DType, TensorSpec, decode_entry, encode_entry
from actcache.rpc_client import RpcClient
from actcache.testing import run_daemon

FP = bytes(range(32, 48))
DEPTH = 2
OPS = ("put", "get", "stats")
WEIGHTS = (0.4, 0.5, 0.1)


def tensor_of(sample_id: int, n: int) -> np.ndarray:
    """The float32 tensor an id stands for: post-ReLU-like, about half zeros."""
    rng = np.random.default_rng(sample_id)
    return np.maximum(rng.standard_normal(n, dtype=np.float32), 0)


def _worker(target: str, worker: int, args: dict, start, results) -> None:
    rng = random.Random(worker)
    n = args["entry_kib"] * 1024 // 4
    spec = [TensorSpec(DType.float32, (n,))]
    lat: dict[str, list[float]] = {op: [] for op in OPS}
    nbytes = {op: 0 for op in OPS}
    errors: list[str] = []
    hits = misses = 0
    with RpcClient(target, timeout_s=60, retries=0) as client:
        ns = client.open("load").namespace_id
        start.wait(timeout=300)  # every process is connected: go
        deadline = time.monotonic() + args["seconds"]
        for _ in range(args["max_ops"]):
            if time.monotonic() >= deadline:
                break
            op = rng.choices(OPS, WEIGHTS)[0]
            ids = [rng.randrange(args["keys"]) for _ in range(args["batch"])]
            try:
                if op == "put":
                    items = [(i, 0, encode_entry(spec, [tensor_of(i, n)])) for i in ids]
                    t0 = time.perf_counter()
                    client.put(ns, FP, DEPTH, items)
                    lat[op].append(time.perf_counter() - t0)
                    nbytes[op] += len(ids) * n * 4
                elif op == "get":
                    t0 = time.perf_counter()
                    values = client.get(ns, FP, DEPTH, ids)
                    lat[op].append(time.perf_counter() - t0)
                    for i, value in zip(ids, values):
                        if value is None:
                            misses += 1
                            continue
                        hits += 1
                        nbytes[op] += n * 4
                        if bytes(decode_entry(value)[1]) != tensor_of(i, n).tobytes():
                            errors.append(f"get: entry {i} does not hold its tensor")
                else:
                    t0 = time.perf_counter()
                    client.stats()
                    lat[op].append(time.perf_counter() - t0)
            except Exception as exc:  # every failure is counted and reported, none stops the run
                errors.append(f"{op}: {type(exc).__name__}: {exc}")
    results.put({"worker": worker, "lat": lat, "bytes": nbytes, "errors": errors, "hits": hits, "misses": misses})


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10 s instead of 60")
    parser.add_argument("--processes", type=int, default=8)
    parser.add_argument("--seconds", type=float, help="duration of the load (default 60, --quick 10)")
    parser.add_argument("--max-ops", type=int, default=100_000, help="operations per process at most")
    parser.add_argument("--entry-kib", type=int, default=64, help="raw tensor bytes per entry, KiB")
    parser.add_argument("--batch", type=int, default=8, help="entries per put / ids per get")
    parser.add_argument("--keys", type=int, default=4096, help="size of the shared key space")
    parser.add_argument("--json", type=Path, help="also write the results as JSON here")
    args = parser.parse_args(argv)
    seconds = args.seconds if args.seconds is not None else (10.0 if args.quick else 60.0)
    config = {"seconds": seconds, "max_ops": args.max_ops, "entry_kib": args.entry_kib, "batch": args.batch,
              "keys": args.keys}
    print("command: python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv or sys.argv[1:])]))
    print(f"{args.processes} processes x {seconds:.0f} s, {args.entry_kib} KiB entries, batch {args.batch}, "
          f"{args.keys} keys, Unix socket")
    ctx = multiprocessing.get_context("spawn")
    start, results = ctx.Barrier(args.processes + 1), ctx.Queue()
    with run_daemon() as daemon:
        proc = psutil.Process(daemon.pid)
        rss = {"start": proc.memory_info().rss, "max": 0}
        stop_sampling = threading.Event()

        def sample() -> None:
            while not stop_sampling.wait(0.1):
                rss["max"] = max(rss["max"], proc.memory_info().rss)

        workers = [ctx.Process(target=_worker, args=(daemon.target, w, config, start, results))
                   for w in range(args.processes)]
        for p in workers:
            p.start()
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        start.wait(timeout=300)  # after every process has connected and opened the namespace
        t0 = time.perf_counter()
        reports, errors = [], []
        for _ in workers:
            try:
                reports.append(results.get(timeout=seconds + 120))
            except Exception:
                errors.append("a client process did not report within the time bound")
                break
        elapsed = time.perf_counter() - t0
        for p in workers:
            p.join(30)
            if p.exitcode is None:
                p.kill()
                p.join()
            if p.exitcode != 0:
                errors.append(f"client process {p.pid} exited with {p.exitcode}")
        stop_sampling.set()
        sampler.join()
        rss["end"] = proc.memory_info().rss
        rss["max"] = max(rss["max"], rss["end"])
    errors += [e for r in reports for e in r["errors"]]
    all_lat: list[float] = []
    rows = []
    print(f"{'op':<7}{'count':>8}{'ops/s':>9}{'MB/s':>8}{'p50 ms':>9}{'p99 ms':>9}")
    for op in OPS:
        lat = [x * 1e3 for r in reports for x in r["lat"][op]]
        all_lat += lat
        nbytes = sum(r["bytes"][op] for r in reports)
        row = {"op": op, "count": len(lat), "ops_per_s": len(lat) / elapsed, "MBps": nbytes / elapsed / 1e6,
               "p50_ms": percentile(lat, 50), "p99_ms": percentile(lat, 99)}
        rows.append(row)
        print(f"{op:<7}{row['count']:>8}{row['ops_per_s']:>9.0f}{row['MBps']:>8.0f}{row['p50_ms']:>9.1f}{row['p99_ms']:>9.1f}")
    hits, misses = sum(r["hits"] for r in reports), sum(r["misses"] for r in reports)
    p99 = percentile(all_lat, 99)
    print(f"all    {len(all_lat):>8}{len(all_lat) / elapsed:>9.0f}{'':>8}{percentile(all_lat, 50):>9.1f}{p99:>9.1f}")
    print(f"gets: {hits} hits, {misses} misses; elapsed {elapsed:.1f} s")
    print(f"daemon RSS: start {rss['start'] / 2**20:.0f} MiB, max {rss['max'] / 2**20:.0f} MiB, "
          f"end {rss['end'] / 2**20:.0f} MiB")
    for message in errors[:10]:
        print(f"error: {message}")
    print(f"figure: load_errors = {len(errors)}")
    print(f"figure: load_p99_ms = {p99:.1f}")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "errors": errors, "rss": rss, "elapsed_s": elapsed,
                                         "processes": args.processes, **config}, indent=2))
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
