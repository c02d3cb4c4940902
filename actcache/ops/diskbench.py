"""``actcache bench disk``: what the cache's filesystem and LMDB deliver, to size a node.

In a temp directory inside DIR, 1 MiB blocks over a file of --size are written, then read O_DIRECT,
buffered cold and warm; then LMDB put and random get, cold and warm. The verdict compares LMDB's cold
get with the disk's O_DIRECT random read. MB/s is 10^6 bytes per second.
"""

from __future__ import annotations

import mmap
import os
import random
import shutil
import sys
import tempfile
import time
from contextlib import suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from actcache.errors import ConfigError
from actcache.ops.clean import BENCH_PREFIX

__all__ = ["BLOCK_BYTES", "DiskReport", "Phase", "run_disk_bench"]

BLOCK_BYTES = 1 << 20
_DROP_CACHES = Path("/proc/sys/vm/drop_caches")
_VALUES_PER_TXN = 64


@dataclass(frozen=True)
class Phase:
    name: str  # machine name, e.g. "read_random_direct"
    label: str  # e.g. "read random"
    access: str  # O_DIRECT, buffered, lmdb
    cache: str  # disk, cold, warm, or "-" for writes
    bytes: int
    seconds: float

    @property
    def mb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e6


@dataclass
class DiskReport:
    dir: str
    filesystem: dict[str, str]
    size_bytes: int
    o_direct: bool
    page_cache_dropped: bool
    cold_method: str
    notes: list[str] = field(default_factory=list)
    phases: list[Phase] = field(default_factory=list)
    lmdb_cold_vs_disk: float | None = None
    verdict: str = ""

    def phase(self, name: str) -> Phase | None:
        return next((p for p in self.phases if p.name == name), None)

    def to_json(self) -> dict:
        out = asdict(self)
        out["block_bytes"] = BLOCK_BYTES
        out["phases"] = [{**asdict(p), "mb_per_s": round(p.mb_per_s, 1)} for p in self.phases]
        return out

    def table(self) -> str:
        from actcache.daemon.config import format_size

        fs = self.filesystem
        return "\n".join([
            f"actcache bench disk: {self.dir} ({fs['type']} on {fs['device']}, mounted at {fs['mount']}), "
            f"{format_size(self.size_bytes)} in 1 MiB blocks",
            f"O_DIRECT: {'yes' if self.o_direct else 'no'}; cold: {self.cold_method}",
            *[f"note: {n}" for n in self.notes],
            "",
            f"{'phase':<20} {'access':<9} {'cache':<6} {'MB/s':>9} {'MiB':>7} {'seconds':>8}",
            *[f"{p.label:<20} {p.access:<9} {p.cache:<6} {p.mb_per_s:>9.1f} {p.bytes / 2**20:>7.0f} {p.seconds:>8.2f}"
              for p in self.phases],
            "",
            f"verdict: {self.verdict}",
        ])


def run_disk_bench(
    directory: Path, size: int, *, drop_caches: bool = True, progress: bool = False, seed: int = 0
) -> DiskReport:
    """Measure ``directory``'s filesystem and LMDB; ConfigError for a bad directory or size. ``drop_caches``:
    drop the whole page cache before cold phases where permitted (always: evict the bench's files)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ConfigError(f"--dir {directory} is not a directory; pass a directory on the filesystem to measure")
    blocks = size // BLOCK_BYTES
    if blocks < 4:
        raise ConfigError(f"--size must be at least 4 MiB, got {size} bytes")
    st = os.statvfs(directory)
    free, needed = st.f_bavail * st.f_frsize, int(blocks * BLOCK_BYTES * 1.05) + (64 << 20)
    if free < needed:
        raise ConfigError(
            f"{directory} has {free / 2**30:.1f} GiB free and the bench needs about {needed / 2**30:.1f} GiB "
            "(one file of --size, then an LMDB of --size); pass a smaller --size"
        )
    work = Path(tempfile.mkdtemp(prefix=f"{BENCH_PREFIX}{os.getpid()}-", dir=directory))
    try:
        return _Bench(directory, work, blocks, progress, random.Random(seed), drop_caches).run()
    finally:
        shutil.rmtree(work, ignore_errors=True)


class _Bench:
    def __init__(self, directory: Path, work: Path, blocks: int, progress: bool, rng: random.Random,
                 drop_caches: bool) -> None:
        self.work = work
        self.blocks = blocks
        self.progress = progress
        self.sequential = list(range(blocks))
        self.shuffled = rng.sample(self.sequential, blocks)
        # One page-aligned buffer (O_DIRECT needs alignment), reused: fresh memory would dominate the figures.
        self.buf = mmap.mmap(-1, BLOCK_BYTES)
        self.buf[:] = os.urandom(BLOCK_BYTES)
        dropped = drop_caches and _drop_page_cache()
        if dropped:
            cold = "page cache dropped before each cold phase (/proc/sys/vm/drop_caches, system-wide)"
        elif not drop_caches:
            cold = "bench files evicted with posix_fadvise(DONTNEED); page cache not dropped (--no-drop-caches)"
        else:
            cold = ("bench files evicted with posix_fadvise(DONTNEED); /proc/sys/vm/drop_caches is not writable "
                    "(run as root to drop the whole page cache)")
        self.report = DiskReport(
            dir=str(directory), filesystem=_filesystem_of(directory), size_bytes=blocks * BLOCK_BYTES,
            o_direct=hasattr(os, "O_DIRECT"), page_cache_dropped=dropped, cold_method=cold,
        )

    def run(self) -> DiskReport:
        path = self.work / "disk.bin"
        try:
            self._disk_phases(path)
            path.unlink()
            self._lmdb_phases(self.work / "lmdb")
        finally:
            self.buf.close()
        r = self.report
        disk = r.phase("read_random_direct") or r.phase("read_random_buffered_cold")
        lmdb_cold = r.phase("lmdb_get_random_cold")
        assert disk is not None and lmdb_cold is not None, "_disk_phases and _lmdb_phases ran both"
        what = "O_DIRECT random read" if disk.access == "O_DIRECT" else "buffered cold random read"
        ratio = lmdb_cold.mb_per_s / disk.mb_per_s
        r.lmdb_cold_vs_disk = round(ratio, 3)
        why = ("the daemon's explicit-read prefetch matters here" if ratio < 0.7
               else "LMDB's mmap read path nearly keeps up with this disk; explicit reads gain little here")
        r.verdict = (f"LMDB cold get is {ratio:.2f}x the disk's {what} "
                     f"({lmdb_cold.mb_per_s:.0f} vs {disk.mb_per_s:.0f} MB/s): {why}")
        return r

    def _disk_phases(self, path: Path) -> None:
        refused = self._direct_refused(path)
        if refused:
            self.report.notes.append(f"{refused}: writes are buffered + fsync and the disk reference is the "
                                     "buffered cold read")
        direct = self.report.o_direct = refused is None
        access = "O_DIRECT" if direct else "buffered"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | (os.O_DIRECT if direct else 0), 0o600)
        try:
            for label, order in (("write sequential", self.sequential), ("write random", self.shuffled)):
                self._phase(label, access, "-", order, lambda off: os.pwrite(fd, self._stamp(off), off),
                            finish=lambda: os.fsync(fd))
        finally:
            os.close(fd)
        if direct:
            self._reads(path, "O_DIRECT", "disk")
        self._reads(path, "buffered", "cold", evict=True)
        if self._fits_in_memory():
            self._reads(path, "buffered", "warm")

    def _direct_refused(self, path: Path) -> str | None:
        """Why O_DIRECT cannot be used on ``path``, or None."""
        if not self.report.o_direct:
            return "O_DIRECT is not available on this platform"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
            try:
                os.pwrite(fd, self.buf, 0)
            finally:
                os.close(fd)
        except OSError as exc:
            return f"O_DIRECT refused on {self.report.filesystem['type']} ({exc.strerror})"
        return None

    def _reads(self, path: Path, access: str, cache: str, evict: bool = False) -> None:
        fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if access == "O_DIRECT" else 0))
        try:
            for label, order in (("read sequential", self.sequential), ("read random", self.shuffled)):
                if evict:
                    self._evict(path)
                self._phase(label, access, cache, order, lambda off: os.preadv(fd, [self.buf], off))
        finally:
            os.close(fd)

    def _stamp(self, offset: int) -> mmap.mmap:
        self.buf[:8] = offset.to_bytes(8, "little")  # distinct blocks: no filesystem dedups them
        return self.buf

    def _lmdb_phases(self, path: Path) -> None:
        import lmdb

        def open_env() -> "lmdb.Environment":
            return lmdb.open(str(path), map_size=self.blocks * (BLOCK_BYTES + 8192) + (64 << 20), sync=False,
                             metasync=False, readahead=True, meminit=False, max_readers=16)

        key = lambda i: i.to_bytes(8, "big")  # noqa: E731
        env = open_env()
        try:
            txn = env.begin(write=True)

            def put(offset: int) -> None:  # in sequential order: a commit every _VALUES_PER_TXN blocks
                nonlocal txn
                txn.put(key(offset // BLOCK_BYTES), self._stamp(offset))
                if (offset // BLOCK_BYTES + 1) % _VALUES_PER_TXN == 0:
                    txn.commit()
                    txn = env.begin(write=True)

            def finish() -> None:
                txn.commit()
                env.sync(True)

            self._phase("lmdb put", "lmdb", "-", self.sequential, put, finish=finish)
        finally:
            env.close()
        self._evict(path / "data.mdb")
        env = open_env()  # a fresh map: nothing of the file is mapped into this process
        try:
            for cache in ("cold", "warm"):
                if cache == "warm" and not self._fits_in_memory():
                    break
                with env.begin(buffers=True) as reading:
                    def get(offset: int) -> None:
                        value = reading.get(key(offset // BLOCK_BYTES))
                        assert value is not None, "the put phase stored every key"
                        self.buf[: len(value)] = value  # touch every byte, into a reused buffer

                    self._phase("lmdb get random", "lmdb", cache, self.shuffled, get)
        finally:
            env.close()

    def _phase(self, label: str, access: str, cache: str, order: Sequence[int], op: Callable[[int], object],
               finish: Callable[[], object] | None = None) -> None:
        title = f"{label} {access} {cache}".replace(" -", "")
        started, shown = time.perf_counter(), 0.0
        for done, block in enumerate(order, 1):
            op(block * BLOCK_BYTES)
            now = time.perf_counter()
            if self.progress and (now - shown >= 0.2 or done == len(order)):  # a progress line on a terminal
                shown, rate = now, done * BLOCK_BYTES / max(now - started, 1e-9) / 1e6
                line = f"\r  {title:<32} {done:>6}/{len(order)} MiB {rate:>8.0f} MB/s "
                print(line, end="", file=sys.stderr, flush=True)
        if finish is not None:
            finish()
        seconds = time.perf_counter() - started
        if self.progress:
            print("\r" + " " * 70 + "\r", end="", file=sys.stderr, flush=True)
        name = _phase_name(label, access, cache)
        self.report.phases.append(Phase(name, label, access, cache, len(order) * BLOCK_BYTES, seconds))

    def _evict(self, path: Path) -> None:
        if self.report.page_cache_dropped:
            _drop_page_cache()
        if hasattr(os, "posix_fadvise"):
            with open(path, "rb") as f:
                os.fsync(f.fileno())
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)

    def _fits_in_memory(self) -> bool:
        import psutil

        available = psutil.virtual_memory().available
        if self.report.size_bytes <= 0.8 * available:
            return True
        note = (f"warm phases skipped: --size {self.report.size_bytes / 2**30:.1f} GiB does not fit in 80% of the "
                f"{available / 2**30:.1f} GiB of available memory, so 'warm' reads would come from the disk")
        if note not in self.report.notes:
            self.report.notes.append(note)
        return False


def _phase_name(label: str, access: str, cache: str) -> str:
    """``read random``, ``O_DIRECT``, ``disk`` -> ``read_random_direct``."""
    parts = [label]
    if access != "lmdb":
        parts.append("direct" if access == "O_DIRECT" else "buffered")
    if cache in ("cold", "warm"):
        parts.append(cache)
    return "_".join(parts).replace(" ", "_")


def _drop_page_cache() -> bool:
    """``sync; echo 1 > /proc/sys/vm/drop_caches``; False where not permitted (not root, containers, not Linux)."""
    if not os.access(_DROP_CACHES, os.W_OK):
        return False
    os.sync()
    with suppress(OSError):
        _DROP_CACHES.write_text("1\n")
        return True
    return False


def _filesystem_of(directory: Path) -> dict[str, str]:
    """Type, device and mount point of the filesystem holding ``directory`` (from /proc/self/mounts)."""
    real = os.path.realpath(directory)
    best = {"type": "unknown", "device": "unknown", "mount": "/"}
    with suppress(OSError):  # no /proc: unknown
        for line in Path("/proc/self/mounts").read_text().splitlines():
            device, mount, fstype = (part.encode().decode("unicode_escape") for part in line.split()[:3])
            inside = real == mount or real.startswith(mount.rstrip("/") + "/")
            if inside and len(mount) >= len(best["mount"]):
                best = {"type": fstype, "device": device, "mount": mount}
    return best
