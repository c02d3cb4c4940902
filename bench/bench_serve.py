"""Serve throughput: tensors a client receives through Schedule/Fetch, against the raw in-process limit.

    python bench/bench_serve.py [--quick] [--mib-per-shape 1024] [--json out.json]

For three activation shapes (conv after ReLU 64x32x32 fp32, conv after ReLU
256x8x8 fp16, transformer hidden state 128x384 bf16) it stores
``--mib-per-shape`` of realistic entries through the daemon (``--encoding
auto``, the default: lz4 where it saves 30%, else raw; ``--encoding raw``
stores them all raw), then measures
samples/s and MB/s (of tensor bytes) for:

- raw: an in-process loop over the same LMDB, in the same order: ``get``,
  ``decode_entry`` (checksum verified, zstd decompressed) and
  ``torch.frombuffer``: the raw limit, single-threaded;
- served: ``RpcClient.schedule`` then ``fetch_batches``, each entry turned
  into a torch tensor (``decode_entry(verify=False)``: the daemon verified it;
  the entries arrive uncompressed, so this is a view);
- shm: the same through the shared-memory data plane
  (``fetch_batches(shared_memory=True)``: the frames carry slot descriptors,
  the tensors are views into the ring);

warm (page cache hot, after an untimed pass; the warm runs of a shape share
one connection, as a trainer keeps one, so each shared-memory run reuses the
ring the one before it used) and cold (page cache dropped and the daemon
restarted before the run, so nothing is mapped), with the
ratio served/raw and the CPU seconds per GB of tensors (daemon + client
for served runs: on a busy machine the CPU cost is the steadier figure).
Before the cold served runs (bytes path, then shared memory, each from a
dropped page cache and a restarted daemon) it measures the disk's O_DIRECT
random 1 MiB read MB/s (queue depth 1) on a scratch file on the same
filesystem; ``cold_serve_vs_disk`` divides the served MB/s (tensor bytes,
as the client receives them) by that figure; the "disk-read MB/s"
column shows the stored bytes per second the daemon read. The replay row
is that read pattern alone: the values' extents in ``data.mdb``, located
beforehand, read from a dropped page cache in schedule order by one
thread that hints the kernel 64 values ahead and ``pread``s each (no
lookup, checksum, decode or hand-off): what this disk gives for these
reads, against which ``cold_serve_vs_replay`` sets the cold shared-memory
path. Last, the
prefetch hit ratio (entries ready when the consumer asked, from the
daemon's counters, over the last 80% of the run) with a cold cache,
``--prefetch-bytes 32MiB`` and a consumer paced at half the cold served
rate (slower than the disk and than the serve path).

The figure lines at the end: ``serve_ratio_shm`` and ``serve_ratio_bytes``
(warm, worst of the three shapes), ``cold_serve_vs_disk`` and
``cold_serve_vs_disk_shm`` (cold, worst shape, bytes path and shared
memory), ``prefetch_hit_ratio`` (worst shape), ``serve_cpu_vs_codec``
(warm shared memory, worst shape: the daemon's CPU-s per GB served over the
stored entries' own checksum + decode CPU-s per GB, measured in-process)
and ``cold_serve_vs_limit`` (cold shared memory, worst shape: served MB/s
over the smaller of the disk's O_DIRECT MB/s, in raw bytes, and what the
node's cores decode of the stored codec), ``cold_serve_vs_replay`` (cold
shared memory over the replay row, worst shape). The daemon's CPU is the sum of
its threads' run times (``/proc/<pid>/task/*/sched``, ns resolution) where
the kernel gives them and no thread ended during the run, else its 10 ms
ticks; ``serve_cpu_vs_codec`` takes it over the three warm shared-memory
runs together (a 64 MiB warm stream costs the daemon 1-3 ticks). Each warm path is timed three times,
taking turns with the others, and reported by its median run. Sample
(``--quick``, 2-core VM, load average ~1)::

    shape                     path    state   samples/s    MB/s  disk-read MB/s  O_DIRECT MB/s  CPU s/GB   ratio
    conv_relu_fp32_64x32x32   raw     warm        10137    2657                                     0.38
                              served  warm         4038    1059             685                     1.27    0.40
                              shm     warm         6555    1718            1111                     0.83    0.65
                              codec   lz4/raw: 0.334 CPU-s/GB (checksum + decode); the daemon spent 0.745 (2.2x)
                              raw     cold         3918    1027                                     0.58
                              served  cold         2369     621             402           1836      2.06    0.60
                              shm     cold         2798     733             474           1836      1.59    0.71
                              paced   cold         1184     310   hit ratio 1.0000 (stalls 0.000 s)
    conv_relu_fp16_256x8x8    raw     warm        90226    2957                                     0.34
                              served  warm        19752     647             648                     2.01    0.22
                              shm     warm        29999     983             985                     1.30    0.33
                              codec   raw: 0.055 CPU-s/GB (checksum + decode); the daemon spent 1.043 (18.8x)
                              raw     cold        16658     546                                     0.59
                              served  cold         8741     286             287           1187      3.52    0.52
                              shm     cold         8886     291             292           1187      2.90    0.53
                              paced   cold         4369     143   hit ratio 1.0000 (stalls 0.000 s)
    transformer_bf16_128x384  raw     warm        48803    4797                                     0.21
                              served  warm        11983    1178            1179                     1.33    0.25
                              shm     warm        14529    1428            1429                     0.87    0.30
                              codec   raw: 0.039 CPU-s/GB (checksum + decode); the daemon spent 0.746 (19.0x)
                              raw     cold         5393     530                                     0.45
                              served  cold         5643     555             555           1124      2.51    1.05
                              shm     cold         6322     621             622           1124      2.09    1.17
                              paced   cold         2820     277   hit ratio 1.0000 (stalls 0.000 s)
    compression (raw/stored): conv_relu_fp32_64x32x32 1.55, conv_relu_fp16_256x8x8 1.00, transformer_bf16_128x384 1.00
    3 shapes x 64 MiB in 12 s on 2 cores (load average 0.8 before, 1.3 after); ...
    figure: serve_ratio_shm = 0.298
    figure: serve_ratio_bytes = 0.219
    figure: cold_serve_vs_disk = 0.241
    figure: cold_serve_vs_disk_shm = 0.245
    figure: prefetch_hit_ratio = 1.0000
    figure: serve_cpu_vs_codec = 18.99
    figure: cold_serve_vs_limit = 0.246

With entry format 2 (xxh3 checksums, lz4 only where it saves 30%) the
served paths carry 2x the MB/s of format 1 with zstd-1 and CRC32 (shared
memory, warm: 983-1718 MB/s against 443-768; CPU 0.8-1.3 s/GB against
2.0-3.4), and ``cold_serve_vs_disk`` went from 0.10 to 0.24. The ratios to
the raw loop fell because the raw loop sped up 4-7x more: with nothing to
decompress it is an LMDB get and a view. What serving costs now is the
daemon's Python per entry (a lookup, a ``pread``, a slot, a frame entry),
19x the checksum's own cost on raw 16 KiB entries: batching that work per
frame is what is left to reach ``serve_ratio_shm`` 0.9.

Cold, against the replay (``--quick``, three runs on this VM): raw fp16
entries are served at 0.67-0.89 of it, raw bf16 at 0.67-0.73 and lz4 fp32
maps at 0.50-0.57 (the replay does not decode them). The raw shapes are
not CPU-bound here: over a 512 MiB cold fp16 stream one of the two cores
stays idle (/proc/stat) and the reader thread is busy all the time, with
about 30 us of CPU per entry (80% of it in the kernel: readahead, the copy
out of the page cache, page faults on the map) and about 30% of its time
in WILLNEED calls (blocked while the disk queue is full). The disk
counters show the same bytes read as the replay and about 100 requests in
flight on average against the replay's 43, and about 9% more requests:
the one-page reads that the probes' residency checks start. Moving the WILLNEED calls, or
the reads, off the reader thread onto other threads served no faster here.

Format 1 (zstd-1 and CRC32 on every entry), for the record: Serving is CPU-bound on this machine. The raw loop verifies and
decompresses (checksum + zstd: 1.5-1.6 CPU-s/GB measured on these
entries) on one thread. Served entries add the reader (a lookup and a
``pread`` each), the frames and, on the bytes path, gRPC's send and
receive; the Fetch thread verifies each frame's entries, decompresses them
a batch per zstd call and writes them to the shared-memory slots (a pool
thread takes part of a large frame). Small entries pay per entry: 32 KiB
fp16 entries cost about 3.2-3.6 CPU-s/GB through shared memory (daemon +
client), and every thread that gives up the interpreter lock for a system
call waits to take it back. Cold, the reader looks entries up 64 ahead and
hints the kernel to read them (probes), then reads each with a ``pread``;
the --quick store (37-105 MiB per shape) is small enough that the raw
loop's memory map reads it all sequentially with readahead. Two cores
cannot decompress faster than about 1.3 GB/s, so cold_serve_vs_disk stays
far below 0.7 here for compressed entries.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "client")]

from bench_cold_read import drop_page_cache, odirect_read_mbps  # noqa: E402  (same directory)

from actcache.codec import CHECKSUMS, DType, TensorSpec, decode_entry, decompress_payload, encode_entry, parse_header  # noqa: E402
from actcache.keys import encode_keys  # noqa: E402
from actcache.malloc import tune_malloc  # noqa: E402
from actcache.testing import DaemonProcess, run_daemon  # noqa: E402

FP = bytes(range(16))
HIT_BUDGET = "32MiB"
# Warm runs per path; each path's row is its median run.
WARM_REPEATS = 3
# Values the replay loop hints ahead of its reads (64 and 1024 read alike on this VM's disk).
REPLAY_AHEAD = 64


@dataclass(frozen=True)
class Shape:
    name: str
    dtype: DType
    shape: tuple[int, ...]
    make: Callable[[np.random.Generator, int], np.ndarray]  # (rng, count) -> array of `count` samples

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _relu(rng: np.random.Generator, count: int, shape: tuple[int, ...], dtype) -> np.ndarray:
    x = rng.standard_normal((count, *shape), dtype=np.float32)
    # Per-channel bias makes some channels mostly dead and others mostly alive, as after BN + ReLU.
    x += rng.normal(0.0, 0.7, (1, shape[0]) + (1,) * (len(shape) - 1)).astype(np.float32)
    return np.maximum(x, 0).astype(dtype)


def _bf16_hidden(rng: np.random.Generator, count: int) -> np.ndarray:
    x = rng.standard_normal((count, 128, 384), dtype=np.float32)
    x *= rng.lognormal(0.0, 0.5, (1, 1, 384)).astype(np.float32)  # a few large feature dims, as in LayerNorm output
    bits = x.view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)  # round to nearest even bf16


SHAPES = [
    Shape("conv_relu_fp32_64x32x32", DType.float32, (64, 32, 32), lambda r, n: _relu(r, n, (64, 32, 32), np.float32)),
    Shape("conv_relu_fp16_256x8x8", DType.float16, (256, 8, 8), lambda r, n: _relu(r, n, (256, 8, 8), np.float16)),
    Shape("transformer_bf16_128x384", DType.bfloat16, (128, 384), _bf16_hidden),
]


def populate(client, ns: int, shape: Shape, depth: int, count: int) -> int:
    """Store ``count`` entries; returns their stored bytes."""
    rng = np.random.default_rng(depth)
    per_put = max(1, (16 << 20) // shape.nbytes)
    stored = 0
    for start in range(0, count, per_put):
        n = min(per_put, count - start)
        data = shape.make(rng, n)
        items = [(start + i, 0, encode_entry([TensorSpec(shape.dtype, shape.shape)], [data[i]])) for i in range(n)]
        stored += client.put(ns, FP, depth, items).stored_bytes
    return stored


def torch_dtype(dtype: DType):
    import torch

    return {DType.float32: torch.float32, DType.float16: torch.float16, DType.bfloat16: torch.bfloat16}[dtype]


def raw_run(store_dir: Path, keys: list[bytes], shape: Shape) -> dict:
    """The raw limit: one thread, get + decode (verified) + torch.frombuffer, in schedule order."""
    import lmdb
    import torch

    tdtype, count = torch_dtype(shape.dtype), math.prod(shape.shape)
    env = lmdb.open(str(store_dir), readonly=True, lock=False, max_dbs=8)
    try:
        db = env.open_db(b"entries", create=False)
        cpu0 = time.process_time()
        t0 = time.perf_counter()
        nbytes = 0
        with env.begin(db=db) as txn:
            for key in keys:
                header, raw = decode_entry(txn.get(key))
                tensor = torch.frombuffer(raw, dtype=tdtype, count=count).view(shape.shape)
                nbytes += tensor.numel() * tensor.element_size()
        seconds = time.perf_counter() - t0
        cpu = time.process_time() - cpu0
    finally:
        env.close()
    return {"samples_per_s": len(keys) / seconds, "MBps": nbytes / seconds / 1e6, "seconds": seconds,
            "cpu_s_per_GB": cpu / (nbytes / 1e9)}


def replay_run(store_dir: Path, keys: list[bytes], shape: Shape) -> dict:
    """What the disk gives for this read pattern: the values' extents in ``data.mdb`` (located first,
    untimed), then, from a dropped page cache, one thread hinting the kernel ``REPLAY_AHEAD`` values
    ahead (``POSIX_FADV_WILLNEED``) and reading each with one ``pread``, in schedule order: the cold
    serve path's reads with nothing else (no lookup, checksum, decode or hand-off). ``MBps`` counts
    the tensor bytes those values hold, ``read_MBps`` the bytes read."""
    import lmdb

    from actcache.daemon.store import ReadSession, ValueFile

    env = lmdb.open(str(store_dir), readonly=True, lock=False, max_dbs=8)
    try:
        value_file = ValueFile(store_dir / "data.mdb", env.stat()["psize"])
        with env.begin(db=env.open_db(b"entries", create=False), buffers=True) as txn:
            session = ReadSession(txn, value_file)
            extents = [session.locate(key) for key in keys]
        value_file.close()
    finally:
        env.close()
    spans = [(e.read_start, e.read_bytes) for e in extents if e is not None and e.inline is None]
    drop_page_cache()
    fd = os.open(store_dir / "data.mdb", os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        buf = memoryview(bytearray(max((n for _, n in spans), default=1)))
        t0 = time.perf_counter()
        cpu0 = time.process_time()
        for offset, size in spans[:REPLAY_AHEAD]:
            os.posix_fadvise(fd, offset, size, os.POSIX_FADV_WILLNEED)
        for i, (offset, size) in enumerate(spans):
            if i + REPLAY_AHEAD < len(spans):
                os.posix_fadvise(fd, *spans[i + REPLAY_AHEAD], os.POSIX_FADV_WILLNEED)
            os.preadv(fd, [buf[:size]], offset)
        seconds = time.perf_counter() - t0
        cpu = time.process_time() - cpu0
    finally:
        os.close(fd)
    nbytes = len(spans) * shape.nbytes
    return {"samples_per_s": len(spans) / seconds, "MBps": nbytes / seconds / 1e6, "seconds": seconds,
            "read_MBps": sum(n for _, n in spans) / seconds / 1e6, "cpu_s_per_GB": cpu / (nbytes / 1e9)}


def codec_run(store_dir: Path, keys: list[bytes]) -> dict:
    """The chosen codec's and checksum's own CPU-s per GB of raw bytes on the stored entries: the checksum
    and the decompression of each, headers parsed beforehand (the C-level work serving cannot avoid)."""
    import lmdb

    env = lmdb.open(str(store_dir), readonly=True, lock=False, max_dbs=8)
    try:
        with env.begin(db=env.open_db(b"entries", create=False)) as txn:
            values = [memoryview(bytes(txn.get(key))) for key in keys]
    finally:
        env.close()
    work = [(CHECKSUMS[h.checksum.name], h.codec, v[h.header_len :], h.raw_len) for v in values
            for h in [parse_header(v)]]
    cpu0 = time.process_time()
    for checksum, codec, payload, raw_len in work:
        checksum(payload)
        decompress_payload(codec, payload, raw_len)
    cpu = time.process_time() - cpu0
    codecs = sorted({codec.name for _, codec, _, _ in work})
    return {"cpu_s_per_GB": cpu / (sum(w[3] for w in work) / 1e9), "codecs": codecs}


def served_run(daemon: DaemonProcess, ns: int, depth: int, order: np.ndarray, shape: Shape, schedule_id: str,
               pace_per_s: float | None = None, stats_at: float | None = None, shared_memory: bool = False,
               client=None) -> dict:
    """Push ``order`` and receive it as torch tensors; optionally paced, with Stats taken at a fraction of the run.
    ``client``: a connection kept across runs, as a trainer keeps one (else a new one for this run)."""
    import torch

    tdtype, count = torch_dtype(shape.dtype), math.prod(shape.shape)
    with contextlib.nullcontext(client) if client is not None else daemon.client(timeout_s=600) as client:
        before = _ns_counters(client, ns)
        marks = []
        cpu0 = (_process_cpu(daemon.pid), time.process_time())
        t0 = time.perf_counter()
        client.schedule(ns, FP, depth, schedule_id, order)
        received = nbytes = 0
        for batch in client.fetch_batches(ns, schedule_id, shared_memory=shared_memory):
            if shared_memory and batch.data_plane != "shared_memory":
                raise SystemExit("the daemon did not take the shared-memory path")
            for value in batch.values:
                if value is None:
                    raise SystemExit(f"entry missing at position {batch.start}; the bench stores every sample")
                header, raw = decode_entry(value, verify=False)
                tensor = torch.frombuffer(raw, dtype=tdtype, count=count).view(shape.shape)
                nbytes += tensor.numel() * tensor.element_size()
                received += 1
                if stats_at is not None and received == int(len(order) * stats_at):
                    marks.append(_ns_counters(client, ns))
            if pace_per_s:
                ahead = received / pace_per_s - (time.perf_counter() - t0)
                if ahead > 0:
                    time.sleep(ahead)
        seconds = time.perf_counter() - t0
        cpu1 = (_process_cpu(daemon.pid), time.process_time())
        after = _ns_counters(client, ns)
    gb, daemon_cpu = nbytes / 1e9, _cpu_between(cpu0[0], cpu1[0])
    out = {"samples_per_s": received / seconds, "MBps": nbytes / seconds / 1e6, "seconds": seconds, "GB": gb,
           "daemon_cpu_s": daemon_cpu,
           "read_MBps": (after["read_bytes"] - before["read_bytes"]) / seconds / 1e6,
           "daemon_cpu_s_per_GB": daemon_cpu / gb, "client_cpu_s_per_GB": (cpu1[1] - cpu0[1]) / gb}
    out["cpu_s_per_GB"] = out["daemon_cpu_s_per_GB"] + out["client_cpu_s_per_GB"]
    if marks:
        served = (after["hits"] + after["misses"]) - (marks[0]["hits"] + marks[0]["misses"])
        out["hit_ratio"] = (after["ready_on_ask"] - marks[0]["ready_on_ask"]) / served if served else float("nan")
        out["stall_seconds"] = after["stall_seconds"] - marks[0]["stall_seconds"]
    return out


def _median(runs: list[dict]) -> dict:
    """The run with the median MB/s."""
    return sorted(runs, key=lambda r: r["MBps"])[len(runs) // 2]


@dataclass(frozen=True)
class CpuReading:
    """A process's CPU time: user + system in clock ticks, and each thread's run time (ns resolution,
    ``/proc/<pid>/task/<tid>/sched``; None where the kernel does not give it)."""

    ticks_s: float
    threads: dict[int, float] | None


def _process_cpu(pid: int) -> CpuReading:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    ticks_s = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    threads: dict[int, float] | None = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            line = next(s for s in (task / "sched").read_text().splitlines() if s.startswith("se.sum_exec_runtime"))
        except (OSError, StopIteration):  # the thread ended meanwhile, or no sched file: ticks only
            threads = None
            break
        threads[int(task.name)] = float(line.split(":")[1]) / 1e3  # the file says milliseconds
    return CpuReading(ticks_s, threads)


def _cpu_between(before: CpuReading, after: CpuReading) -> float:
    """CPU seconds between two readings: the threads' run times when no thread ended in between (an
    ended thread's time leaves its task entry), else the 10 ms ticks (a 64 MiB warm stream costs the
    daemon 1-3 of them)."""
    if before.threads is not None and after.threads is not None and before.threads.keys() <= after.threads.keys():
        return sum(t - before.threads.get(tid, 0.0) for tid, t in after.threads.items())
    return after.ticks_s - before.ticks_s


def _ns_counters(client, ns: int) -> dict:
    stats = client.stats()
    name = next(n.name for n in stats.namespaces if n.namespace_id == ns)
    for row in stats.prefetch:
        if row.namespace == name:
            c = row.counters
            return {"hits": c.hits, "misses": c.misses, "ready_on_ask": c.ready_on_ask, "read_bytes": c.read_bytes,
                    "stall_seconds": c.stall_seconds}
    return {"hits": 0, "misses": 0, "ready_on_ask": 0, "read_bytes": 0, "stall_seconds": 0.0}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="64 MiB per shape (under a minute)")
    parser.add_argument("--mib-per-shape", type=int, default=1024, help="tensor MiB stored per shape")
    parser.add_argument("--dir", type=Path, help="where the cache lives (default: a temp dir under /var/tmp)")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    parser.add_argument("--encoding", default="auto", help="the daemon's --encoding for the stored entries")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="The given buffer is not writable")  # the views are only read
    tune_malloc()  # as a training process receiving Fetch streams should (see actcache/malloc.py)
    import torch  # noqa: F401  (imported before any timed run)
    mib = 64 if args.quick else args.mib_per_shape
    cold = drop_page_cache()
    if not cold:
        print("cannot write /proc/sys/vm/drop_caches (needs root): skipping the cold runs and measuring the "
              "prefetch hit ratio warm")
    rows: list[dict] = []
    started = time.perf_counter()
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(dir=args.dir or "/var/tmp", prefix="actcache-serve-") as tmp:
        cache = Path(tmp) / "cache"
        scratch = Path(tmp) / "odirect.bin"
        with open(scratch, "wb") as f:
            block = os.urandom(8 << 20)
            for _ in range((256 if args.quick else 1024) // 8):
                f.write(block)
            os.fsync(f.fileno())
        with run_daemon("--encoding", args.encoding, cache_dir=cache) as daemon:
            with daemon.client(timeout_s=600) as client:
                plan = []
                for depth, shape in enumerate(SHAPES, start=1):
                    count = (mib << 20) // shape.nbytes
                    ns = client.open(f"serve-{depth}").namespace_id
                    stored = populate(client, ns, shape, depth, count)
                    order = np.random.default_rng(100 + depth).permutation(count).astype(np.uint64)
                    plan.append((shape, ns, depth, order, stored))
                # Warm-up of the serve path (threads, channels): an untimed small run.
                shape, ns, depth, order, _ = plan[0]
                served_run(daemon, ns, depth, order[:64], shape, "warmup")
            print(f"{'shape':<26}{'path':<8}{'state':<6}{'samples/s':>11}{'MB/s':>8}{'disk-read MB/s':>16}"
                  f"{'O_DIRECT MB/s':>15}{'CPU s/GB':>10}{'ratio':>8}")
            for shape, ns, depth, order, stored in plan:
                keys = encode_keys(ns, FP, depth, order)
                compression = len(order) * shape.nbytes / stored
                raw_run(cache, keys, shape)  # untimed: loads the page cache
                runs: dict[str, list[dict]] = {"raw": [], "served": [], "shm": []}
                # One connection for the warm runs, as a trainer keeps one: its shared-memory ring is
                # reused from run to run, as from epoch to epoch (a new one is faulted in, then unmapped).
                with daemon.client(timeout_s=600) as trainer:
                    served_run(daemon, ns, depth, order, shape, "warmup-pass", client=trainer)
                    served_run(daemon, ns, depth, order, shape, "warmup-shm", shared_memory=True, client=trainer)
                    for rep in range(WARM_REPEATS):  # taking turns, so a drift in the machine's load hits all three
                        runs["raw"].append(raw_run(cache, keys, shape))
                        runs["served"].append(served_run(daemon, ns, depth, order, shape, f"warm{rep}", client=trainer))
                        runs["shm"].append(served_run(daemon, ns, depth, order, shape, f"warm-shm{rep}",
                                                      shared_memory=True, client=trainer))
                warm_raw, warm, warm_shm = (_median(runs[path]) for path in ("raw", "served", "shm"))
                codec = codec_run(cache, keys)
                row = {"shape": shape.name, "entries": len(order), "entry_bytes": shape.nbytes,
                       "compression": compression, "warm_raw": warm_raw, "warm_served": warm,
                       "warm_ratio": warm["MBps"] / warm_raw["MBps"], "codec": codec}
                _print(shape.name, "raw", "warm", warm_raw)
                _print("", "served", "warm", warm, ratio=row["warm_ratio"])
                # The daemon's CPU over all the warm shared-memory runs: 3x the bytes per 10 ms tick of one run.
                shm_cpu = sum(r["daemon_cpu_s"] for r in runs["shm"]) / sum(r["GB"] for r in runs["shm"])
                row.update(warm_shm=warm_shm, warm_shm_ratio=warm_shm["MBps"] / warm_raw["MBps"],
                           daemon_cpu_s_per_GB=shm_cpu, cpu_vs_codec=shm_cpu / codec["cpu_s_per_GB"])
                _print("", "shm", "warm", warm_shm, ratio=row["warm_shm_ratio"])
                print(f"{'':<26}codec   {'/'.join(codec['codecs'])}: {codec['cpu_s_per_GB']:.3f} CPU-s/GB (checksum + "
                      f"decode); the daemon spent {shm_cpu:.3f} over the {len(runs['shm'])} shm runs "
                      f"({row['cpu_vs_codec']:.1f}x)", flush=True)
                if cold:
                    daemon.stop()
                    drop_page_cache()
                    cold_raw = raw_run(cache, keys, shape)
                    disk = odirect_read_mbps(scratch, total_bytes=min(256, max(64, mib)) << 20)
                    replay = replay_run(cache, keys, shape)
                    drop_page_cache()
                    daemon.start()
                    cold_served = served_run(daemon, ns, depth, order, shape, "cold")
                    daemon.stop()
                    drop_page_cache()
                    daemon.start()
                    cold_shm = served_run(daemon, ns, depth, order, shape, "cold-shm", shared_memory=True)
                    row.update(cold_raw=cold_raw, cold_served=cold_served, cold_shm=cold_shm, disk_odirect_MBps=disk,
                               cold_replay=replay, cold_vs_replay=cold_shm["MBps"] / replay["MBps"],
                               cold_ratio=cold_served["MBps"] / cold_raw["MBps"],
                               cold_shm_ratio=cold_shm["MBps"] / cold_raw["MBps"],
                               cold_vs_disk=cold_served["MBps"] / disk, cold_shm_vs_disk=cold_shm["MBps"] / disk)
                    # What the node could serve cold: the disk, or what its cores decode of the chosen codec.
                    decode_limit = os.cpu_count() * 1e3 / codec["cpu_s_per_GB"]  # MB/s of raw bytes
                    row["cold_vs_limit"] = cold_shm["MBps"] / min(disk * compression, decode_limit)
                    _print("", "raw", "cold", cold_raw)
                    _print("", "replay", "cold", replay, disk=disk)
                    _print("", "served", "cold", cold_served, disk=disk, ratio=row["cold_ratio"])
                    _print("", "shm", "cold", cold_shm, disk=disk, ratio=row["cold_shm_ratio"])
                daemon.stop()
                drop_page_cache()
                base = row.get("cold_served", warm)
                pace = 0.5 * base["samples_per_s"]
                hit_daemon = DaemonProcess(cache, daemon.socket.parent / "hit.sock",
                                           ["--prefetch-bytes", HIT_BUDGET, "--max-entry-bytes", "16MiB"])
                hit_daemon.start()
                try:
                    paced = served_run(hit_daemon, ns, depth, order, shape, "paced", pace_per_s=pace, stats_at=0.2)
                finally:
                    code = hit_daemon.stop()
                    if code != 0:
                        raise SystemExit(f"daemon exited with code {code}\n{hit_daemon.log_tail()}")
                row["paced"] = dict(paced, pace_samples_per_s=pace)
                print(f"{'':<26}{'paced':<8}{'cold' if cold else 'warm':<6}{paced['samples_per_s']:>11.0f}"
                      f"{paced['MBps']:>8.0f}   hit ratio {paced['hit_ratio']:.4f} "
                      f"(stalls {paced['stall_seconds']:.3f} s)", flush=True)
                rows.append(row)
                daemon.start()
    serve_ratio = min(r["warm_ratio"] for r in rows)
    shm_ratio = min(r["warm_shm_ratio"] for r in rows)
    cold_vs_disk = min(r["cold_vs_disk"] for r in rows) if cold else float("nan")
    cold_shm_vs_disk = min(r["cold_shm_vs_disk"] for r in rows) if cold else float("nan")
    hit_ratio = min(r["paced"]["hit_ratio"] for r in rows)
    cpu_vs_codec = max(r["cpu_vs_codec"] for r in rows)
    cold_vs_limit = min(r["cold_vs_limit"] for r in rows) if cold else float("nan")
    cold_vs_replay = min(r["cold_vs_replay"] for r in rows) if cold else float("nan")
    print("compression (raw/stored): " + ", ".join(f"{r['shape']} {r['compression']:.2f}" for r in rows))
    print(f"{len(rows)} shapes x {mib} MiB in {time.perf_counter() - started:.0f} s on {os.cpu_count()} cores "
          f"(load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after); hit ratio with "
          f"--prefetch-bytes {HIT_BUDGET}, consumer paced at half the {'cold' if cold else 'warm'} served rate")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    print(f"figure: serve_ratio_shm = {shm_ratio:.3f}")
    print(f"figure: serve_ratio_bytes = {serve_ratio:.3f}")
    print(f"figure: cold_serve_vs_disk = {cold_vs_disk:.3f}")
    print(f"figure: cold_serve_vs_disk_shm = {cold_shm_vs_disk:.3f}")
    print(f"figure: prefetch_hit_ratio = {hit_ratio:.4f}")
    print(f"figure: serve_cpu_vs_codec = {cpu_vs_codec:.2f}")
    print(f"figure: cold_serve_vs_limit = {cold_vs_limit:.3f}")
    print(f"figure: cold_serve_vs_replay = {cold_vs_replay:.3f}")
    return 0


def _print(name: str, path: str, state: str, r: dict, disk: float | None = None, ratio: float | None = None) -> None:
    read = f"{r['read_MBps']:>16.0f}" if "read_MBps" in r else f"{'':>16}"
    disk_s = f"{disk:>15.0f}" if disk else f"{'':>15}"
    ratio_s = f"{ratio:>8.2f}" if ratio is not None else ""
    print(f"{name:<26}{path:<8}{state:<6}{r['samples_per_s']:>11.0f}{r['MBps']:>8.0f}{read}{disk_s}"
          f"{r['cpu_s_per_GB']:>10.2f}{ratio_s}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
