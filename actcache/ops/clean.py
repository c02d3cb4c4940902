"""``actcache clean``: reclaim what a crashed daemon (or tool) left behind.

Reclaimers, each ``(CleanTarget) -> Iterable[Finding]`` registered with ``@reclaimer``,
leave anything a live process uses alone, and say so. While they run, ``clean`` holds
the cache directory's lock when no daemon does, so none starts under their feet; when
a daemon holds it, ``CleanTarget.daemon_pid`` says which. A reclaimer that raises
becomes a FAILED finding; the others still run.
"""

from __future__ import annotations

import enum
import errno
import functools
import shutil
import socket
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from actcache.daemon.store import LOCK_NAME, DirLock, holder_pid
from actcache.errors import ConfigError
from actcache.shm import pid_alive

__all__ = [
    "Action",
    "BENCH_PREFIX",
    "CleanTarget",
    "Finding",
    "RECLAIMERS",
    "clean",
    "reclaimer",
]

#: Temp directories of ``actcache bench disk`` are named ``BENCH_PREFIX<pid>-<random>``.
BENCH_PREFIX = ".actcache-bench-"


class Action(enum.Enum):
    REMOVED = "removed"  # a leftover was deleted
    CLEARED = "cleared"  # stale state inside a live file was reset
    KEPT = "kept"  # something in use (or not ours) was left alone
    OK = "ok"  # nothing to reclaim
    FAILED = "failed"  # the reclaimer raised


@dataclass(frozen=True, kw_only=True)
class CleanTarget:
    """What to clean: a daemon socket path and/or a cache directory."""

    socket: Path | None
    dir: Path | None
    #: True while a daemon holds ``dir``'s lock (then ``daemon_pid`` is its recorded pid, if any).
    daemon_live: bool = False
    daemon_pid: int | None = None


@dataclass(frozen=True, kw_only=True)
class Finding:
    reclaimer: str
    action: Action
    path: str
    detail: str


Reclaimer = Callable[[CleanTarget], Iterable[Finding]]
RECLAIMERS: list[Reclaimer] = []


def reclaimer(fn: Reclaimer) -> Reclaimer:
    """Register ``fn`` to run on every ``actcache clean``, after the ones registered before it."""
    RECLAIMERS.append(fn)
    return fn


def clean(*, socket_path: Path | None, directory: Path | None, reclaimers: Iterable[Reclaimer] | None = None) -> list[Finding]:
    """Run every reclaimer on the socket and directory; returns what each found and did."""
    if directory is not None and not directory.is_dir():
        raise ConfigError(f"--dir {directory} is not a directory; pass the daemon's cache directory")
    has_store = directory is not None and any((directory / n).exists() for n in (LOCK_NAME, "data.mdb"))
    store_dir = directory if has_store else None
    lock = None if store_dir is None else DirLock.try_acquire(store_dir)
    live = store_dir is not None and lock is None
    target = CleanTarget(
        socket=socket_path, dir=directory, daemon_live=live,
        daemon_pid=holder_pid(store_dir) if store_dir is not None and lock is None else None,
    )
    findings: list[Finding] = []
    try:
        for fn in RECLAIMERS if reclaimers is None else reclaimers:
            try:
                findings.extend(fn(target))
            except Exception as exc:  # one broken reclaimer must not stop the others
                where = str(target.dir or target.socket or "")
                findings.append(Finding(reclaimer=fn.__name__, action=Action.FAILED, path=where, detail=repr(exc)))
    finally:
        if lock is not None:
            lock.release()
    return findings


@reclaimer
def stale_socket(target: CleanTarget) -> Iterable[Finding]:
    """Remove the daemon socket when nothing listens on it (a crash left it); keep a live one."""
    path = target.socket
    if path is None:
        return
    found = functools.partial(Finding, reclaimer="socket", path=str(path))
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        yield found(action=Action.OK, detail="no socket file")
        return
    if not stat.S_ISSOCK(mode):
        yield found(action=Action.KEPT, detail="not a socket; left alone (remove it yourself if it is not needed)")
        return
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(str(path))
        except OSError as exc:
            if exc.errno != errno.ECONNREFUSED:
                yield found(action=Action.KEPT, detail=f"cannot probe it ({exc.strerror}); left alone")
                return
            path.unlink(missing_ok=True)
            yield found(action=Action.REMOVED, detail="stale: nothing is listening on it")
            return
    yield found(action=Action.KEPT, detail="live: a daemon is accepting connections on it")


@reclaimer
def stale_lmdb_readers(target: CleanTarget) -> Iterable[Finding]:
    """Clear LMDB reader slots of dead processes (``reader_check``) when no daemon holds the directory:
    each pins old pages (the file grows), and enough of them exhaust ``max_readers``."""
    if target.dir is None:
        return
    found = functools.partial(Finding, reclaimer="lmdb readers", path=str(target.dir / "data.mdb"))
    if not (target.dir / "data.mdb").exists():
        yield found(action=Action.OK, detail="no store in this directory")
        return
    if target.daemon_live:
        who = f"pid {target.daemon_pid}" if target.daemon_pid else "a daemon"
        yield found(action=Action.KEPT, detail=f"{who} holds the directory; its reader slots are left alone")
        return
    import lmdb

    env = lmdb.open(str(target.dir), readonly=True, max_dbs=8, max_readers=1024)
    try:
        cleared = env.reader_check()
    finally:
        env.close()
    if cleared:
        plural = "s" if cleared != 1 else ""
        yield found(action=Action.CLEARED, detail=f"{cleared} stale reader slot{plural} of dead processes")
    else:
        yield found(action=Action.OK, detail="no stale reader slots")


@reclaimer
def bench_leftovers(target: CleanTarget) -> Iterable[Finding]:
    """Remove temp directories of ``actcache bench disk`` runs whose process is gone."""
    if target.dir is None:
        return
    for leftover in sorted(target.dir.glob(f"{BENCH_PREFIX}*")):
        found = functools.partial(Finding, reclaimer="bench", path=str(leftover))
        pid = leftover.name[len(BENCH_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and pid_alive(int(pid)):
            yield found(action=Action.KEPT, detail=f"bench pid {pid} is running")
            continue
        shutil.rmtree(leftover)
        yield found(action=Action.REMOVED, detail="left by a bench run that died")


@reclaimer
def stale_shm_segments(target: CleanTarget) -> Iterable[Finding]:
    """Remove shared-memory segments (``/dev/shm/actcache-<pid>-*``) of dead daemons; live ones are reported
    only for the daemon holding ``--dir`` (segments are host-wide)."""
    from actcache.shm import shm_dir, stale_segments

    found = False
    for path, pid, stale in stale_segments():
        if stale:
            path.unlink(missing_ok=True)
            found = True
            yield Finding(reclaimer="shm", action=Action.REMOVED, path=str(path), detail=f"left by daemon pid {pid}, which died")
        elif pid == target.daemon_pid:
            found = True
            yield Finding(reclaimer="shm", action=Action.KEPT, path=str(path), detail=f"daemon pid {pid} is running")
    if not found and target.dir is not None:
        yield Finding(reclaimer="shm", action=Action.OK, path=str(shm_dir()), detail="no stale shared-memory segments")
