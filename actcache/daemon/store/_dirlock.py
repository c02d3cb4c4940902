"""The advisory lock that makes a cache directory belong to one daemon at a time.

A daemon holds ``flock(LOCK_EX)`` on ``DIR/daemon.lock`` while its Store is open, with its pid in
the file. The kernel releases the lock however the process exits (``kill -9`` included), so only
the lock means anything, never the file, which is never deleted (unlinking races with an open).
``actcache clean`` takes the same lock to know that no daemon is live.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from actcache.errors import ConfigError

__all__ = ["DirLock", "LOCK_NAME", "holder_pid"]

LOCK_NAME = "daemon.lock"


class DirLock:
    """An exclusive advisory lock on a cache directory, held until :meth:`release`."""

    def __init__(self, directory: Path, fd: int) -> None:
        self.directory = directory
        self._fd: int | None = fd

    @classmethod
    def try_acquire(cls, directory: Path) -> "DirLock | None":
        """Take the lock and record this pid in it, or return None when another process holds it."""
        fd = os.open(Path(directory) / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BaseException as exc:
            os.close(fd)
            if isinstance(exc, BlockingIOError):
                return None
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return cls(Path(directory), fd)

    @classmethod
    def acquire(cls, directory: Path) -> "DirLock":
        """Take the lock or raise ConfigError naming the process that holds it."""
        lock = cls.try_acquire(directory)
        if lock is None:
            pid = holder_pid(directory)
            who = f"pid {pid}" if pid else "a process whose pid is not recorded"
            raise ConfigError(
                f"cache directory {directory} is in use by another actcache daemon ({who}, holding "
                f"{Path(directory) / LOCK_NAME}); stop that daemon, or pass a different --dir")
        return lock

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Drop the lock (closing the descriptor releases it); idempotent."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def holder_pid(directory: Path) -> int | None:
    """The pid recorded in the directory's lock file (meaningful only while the lock is held)."""
    try:
        text = (Path(directory) / LOCK_NAME).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
