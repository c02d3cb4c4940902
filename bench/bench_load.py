"""Mixed load on one daemon: client processes put, get, stat, push schedules and Fetch them, for a fixed time.

    python bench/bench_load.py [--quick] [--processes 8] [--seconds 60] [--entry-kib 64] [--fetch-ids 64] [--json FILE]

Each client process opens the namespace, waits for the others, then loops
until ``--seconds`` have passed or it has done ``--max-ops`` operations,
drawing each one at random:

- 35% put: ``--batch`` entries under random ids of a shared key space
  (``--keys``), so processes overwrite each other's keys;
- 40% get: ``--batch`` random ids (ids not written yet are misses);
- 5% stats;
- 10% fetch and 10% fetch_shm: push a schedule of ``--fetch-ids`` random ids
  (one "schedule" operation), then Fetch it whole on the bytes data plane
  (fetch) or the shared-memory one (fetch_shm; the default 8 MiB ring).

An entry's tensor is derived from its id, so every hit is decoded and
compared with what it must hold. Errors: a failed call, a hit with the wrong
tensor, a miss for an id the process had put (acknowledged) or read before
the call (nothing is ever deleted here), a Fetch whose entries are not the
pushed ids in order or that came on the other data plane, and a
shared-memory segment of the daemon left in the shm dir once every stream
has ended. The daemon (actcache.testing.run_daemon: a Unix socket in a temp
dir, default flags) has its RSS sampled every 100 ms.

Output: one row per operation with count, ops/s, MB/s (raw tensor bytes
read or written) and p50/p99 latency (a fetch: from the request to its last
entry), the entries read by get/fetch/fetch_shm, the daemon's RSS, then two
machine-readable lines:

    figure: load_errors = N      (errors over every operation)
    figure: load_p99_ms = X      (p99 over every operation)

Since Schedule and Fetch joined the mix, "every operation" includes the
pushes and the whole Fetch streams (64 entries of 64 KiB each by default),
so load_p99_ms is not comparable with runs of the put/get/stats mix.

Sample (2 cores shared with other work, load average ~2.9; default 60 s run):

    command: python bench/bench_load.py
    8 processes x 60 s, 64 KiB entries, batch 8, 64 ids per schedule, 4096 keys, Unix socket
    op           count    ops/s    MB/s   p50 ms   p99 ms
    put           2599       43      23     45.1    104.0
    get           2882       48      20     23.4     63.9
    stats          379        6       0     12.7     47.6
    schedule      1457       24       0     27.7     77.0
    fetch          742       12      42     82.7    179.6
    fetch_shm      715       12      39     75.5    182.9
    all           8774      146             34.8    147.3
    entries read: get 18559 hits + 4497 misses, fetch 38225 hits + 9263 misses, fetch_shm 35874 hits + 9886 misses; elapsed 60.1 s
    daemon RSS: start 61 MiB, max 327 MiB, end 326 MiB
    figure: load_errors = 0
    figure: load_p99_ms = 147.3

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
from actcache.shm import stale_segments
from actcache.testing import run_daemon

FP = bytes(range(32, 48))
DEPTH = 2
#: Operations drawn at random, and their weights; a fetch first pushes its schedule.
DRAWN = ("put", "get", "stats", "fetch", "fetch_shm")
WEIGHTS = (0.35, 0.4, 0.05, 0.1, 0.1)
#: Rows of the report: every drawn operation, and the Schedule push of each fetch.
OPS = ("put", "get", "stats", "schedule", "fetch", "fetch_shm")
#: Operations that read entries, whose hits and misses are counted.
READS = ("get", "fetch", "fetch_shm")


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
    entries = {op: {"hits": 0, "misses": 0} for op in READS}
    errors: list[str] = []
    known: set[int] = set()  # ids this process put (acknowledged) or read: never a miss afterwards

    def check(op: str, ids: list[int], values: list) -> None:
        """Every hit holds its id's tensor; an id known to be stored is never a miss."""
        for i, value in zip(ids, values):
            if value is None:
                entries[op]["misses"] += 1
                if i in known:
                    errors.append(f"{op}: entry {i} was stored before the call but came back as a miss")
                continue
            entries[op]["hits"] += 1
            nbytes[op] += n * 4
            if bytes(decode_entry(value)[1]) != tensor_of(i, n).tobytes():
                errors.append(f"{op}: entry {i} does not hold its tensor")
            known.add(i)

    with RpcClient(target, timeout_s=60, retries=0) as client:
        ns = client.open("load").namespace_id
        start.wait(timeout=300)  # every process is connected: go
        deadline = time.monotonic() + args["seconds"]
        for k in range(args["max_ops"]):
            if time.monotonic() >= deadline:
                break
            op = rng.choices(DRAWN, WEIGHTS)[0]
            size = args["fetch_ids"] if op.startswith("fetch") else args["batch"]
            ids = [rng.randrange(args["keys"]) for _ in range(size)]
            try:
                if op == "put":
                    items = [(i, 0, encode_entry(spec, [tensor_of(i, n)])) for i in ids]
                    t0 = time.perf_counter()
                    client.put(ns, FP, DEPTH, items)
                    lat[op].append(time.perf_counter() - t0)
                    nbytes[op] += len(ids) * n * 4
                    known.update(ids)
                elif op == "get":
                    t0 = time.perf_counter()
                    values = client.get(ns, FP, DEPTH, ids)
                    lat[op].append(time.perf_counter() - t0)
                    check(op, ids, values)
                elif op == "stats":
                    t0 = time.perf_counter()
                    client.stats()
                    lat[op].append(time.perf_counter() - t0)
                else:  # push an order, then Fetch it whole on the bytes or the shared-memory data plane
                    schedule_id, plane = f"w{worker}-{k}", "shared_memory" if op == "fetch_shm" else "bytes"
                    t0 = time.perf_counter()
                    reply = client.schedule(ns, FP, DEPTH, schedule_id, ids)
                    lat["schedule"].append(time.perf_counter() - t0)
                    if reply.length != len(ids):
                        errors.append(f"schedule: {schedule_id} holds {reply.length} ids, {len(ids)} were pushed")
                    got = []
                    t0 = time.perf_counter()
                    for batch in client.fetch_batches(ns, schedule_id, shared_memory=op == "fetch_shm"):
                        if batch.data_plane != plane:
                            errors.append(f"{op}: served on the {batch.data_plane} data plane, not {plane}")
                        # shared-memory views are valid until the next batch: copy, as a consumer would
                        got.extend((pos, sid, None if v is None else bytes(v)) for pos, sid, _, v in batch)
                    lat[op].append(time.perf_counter() - t0)
                    if [(pos, sid) for pos, sid, _ in got] != list(enumerate(ids)):
                        errors.append(f"{op}: {schedule_id} came back as {len(got)} entries, "
                                      f"not its {len(ids)} ids in order")
                    check(op, [sid for _, sid, _ in got], [v for _, _, v in got])
            except Exception as exc:  # every failure is counted and reported, none stops the run
                errors.append(f"{op}: {type(exc).__name__}: {exc}")
    results.put({"worker": worker, "lat": lat, "bytes": nbytes, "errors": errors, "entries": entries})


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
    parser.add_argument("--fetch-ids", type=int, default=64, help="ids per pushed schedule (one Fetch each)")
    parser.add_argument("--keys", type=int, default=4096, help="size of the shared key space")
    parser.add_argument("--json", type=Path, help="also write the results as JSON here")
    args = parser.parse_args(argv)
    seconds = args.seconds if args.seconds is not None else (10.0 if args.quick else 60.0)
    config = {"seconds": seconds, "max_ops": args.max_ops, "entry_kib": args.entry_kib, "batch": args.batch,
              "fetch_ids": args.fetch_ids, "keys": args.keys}
    print("command: python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv or sys.argv[1:])]))
    print(f"{args.processes} processes x {seconds:.0f} s, {args.entry_kib} KiB entries, batch {args.batch}, "
          f"{args.fetch_ids} ids per schedule, {args.keys} keys, Unix socket")
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
        # Every stream has ended: none of the daemon's shared-memory segments may be left.
        errors += [f"shared-memory segment {path} left behind"
                   for path, pid, _ in stale_segments() if pid == daemon.pid]
    errors += [e for r in reports for e in r["errors"]]
    all_lat: list[float] = []
    rows = []
    print(f"{'op':<10}{'count':>8}{'ops/s':>9}{'MB/s':>8}{'p50 ms':>9}{'p99 ms':>9}")
    for op in OPS:
        lat = [x * 1e3 for r in reports for x in r["lat"][op]]
        all_lat += lat
        nbytes = sum(r["bytes"][op] for r in reports)
        row = {"op": op, "count": len(lat), "ops_per_s": len(lat) / elapsed, "MBps": nbytes / elapsed / 1e6,
               "p50_ms": percentile(lat, 50), "p99_ms": percentile(lat, 99)}
        rows.append(row)
        print(f"{op:<10}{row['count']:>8}{row['ops_per_s']:>9.0f}{row['MBps']:>8.0f}{row['p50_ms']:>9.1f}{row['p99_ms']:>9.1f}")
    entries = {op: {k: sum(r["entries"][op][k] for r in reports) for k in ("hits", "misses")} for op in READS}
    p99 = percentile(all_lat, 99)
    print(f"{'all':<10}{len(all_lat):>8}{len(all_lat) / elapsed:>9.0f}{'':>8}{percentile(all_lat, 50):>9.1f}{p99:>9.1f}")
    print("entries read: " + ", ".join(f"{op} {e['hits']} hits + {e['misses']} misses" for op, e in entries.items())
          + f"; elapsed {elapsed:.1f} s")
    print(f"daemon RSS: start {rss['start'] / 2**20:.0f} MiB, max {rss['max'] / 2**20:.0f} MiB, "
          f"end {rss['end'] / 2**20:.0f} MiB")
    for message in errors[:10]:
        print(f"error: {message}")
    print(f"figure: load_errors = {len(errors)}")
    print(f"figure: load_p99_ms = {p99:.1f}")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "entries": entries, "errors": errors, "rss": rss,
                                         "elapsed_s": elapsed, "processes": args.processes, **config}, indent=2))
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
