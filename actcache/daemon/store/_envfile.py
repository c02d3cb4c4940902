"""Opening the store's LMDB files safely, and what to do with files that are damaged or foreign.

Before the store touches the map, ``open_env`` checks what LMDB itself does not: that ``data.mdb``
is as long as its meta page says (reading past the end would SIGBUS the daemon), that the main
database holds only actcache's named databases (a foreign LMDB is refused before any write), and
that no earlier run marked the directory damaged (``actcache.damaged``, written when a read or
commit met a broken page). These raise UnusableStore: the store then refuses to start
(``--on-corrupt refuse``) or moves the files aside and starts empty (``--on-corrupt move-aside``).
Other failures (permissions, a busy lock) are StoreError and never move anything.
"""

from __future__ import annotations

import logging
import os
import time
from itertools import islice
from pathlib import Path

import lmdb

from actcache.errors import StoreError

__all__ = ["DAMAGE_ERRORS", "DB_NAMES", "UnusableStore", "damaged", "move_aside", "open_env"]

log = logging.getLogger(__name__)

DB_NAMES = (b"entries", b"namespaces", b"groups", b"meta", b"secrets", b"generations")
DAMAGED_MARKER = "actcache.damaged"
_FILES = ("data.mdb", "lock.mdb", DAMAGED_MARKER)
# LMDB errors that mean the file's contents are wrong, not that the machine is.
DAMAGE_ERRORS = (lmdb.InvalidError, lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.VersionMismatchError,
                 lmdb.IncompatibleError, lmdb.BadValsizeError, lmdb.PanicError)


class UnusableStore(Exception):
    """The directory's LMDB files are damaged or not an actcache store (message says which)."""


def open_env(directory: Path, *, map_size: int, sync: bool, readahead: bool = True) -> lmdb.Environment:
    """Open and check the environment in ``directory``; raises UnusableStore or StoreError."""
    marker = directory / DAMAGED_MARKER
    if marker.exists():
        raise UnusableStore(f"{directory} was marked damaged by an earlier run: {marker.read_text().strip()}")
    data = directory / "data.mdb"
    try:
        env = lmdb.open(str(directory), map_size=max(map_size, _size(data)), max_dbs=8, max_readers=1024,
                        sync=sync, metasync=sync, readahead=readahead, meminit=False)
    except DAMAGE_ERRORS as exc:
        raise UnusableStore(
            f"{data} is not a valid LMDB file ({exc}); it was damaged or written by another program") from None
    except lmdb.Error as exc:
        raise StoreError(f"cannot open the store in {directory}: {exc}") from exc
    try:
        pages = env.info()["last_pgno"] + 1
        needed = pages * env.stat()["psize"]
        if _size(data) < needed:
            raise UnusableStore(f"{data} is {_size(data)} bytes but its meta page counts {pages} pages "
                                f"({needed} bytes); the file was truncated")
        with env.begin() as txn:
            keys = map(bytes, txn.cursor().iternext(keys=True, values=False))
            foreign = list(islice((key for key in keys if key not in DB_NAMES), 5))
        if foreign:
            raise UnusableStore(f"{data} is an LMDB database of another program (its main database holds keys "
                                f"such as {foreign}, actcache keeps only {[n.decode() for n in DB_NAMES]})")
    except BaseException as exc:
        env.close()
        if isinstance(exc, DAMAGE_ERRORS):
            raise UnusableStore(f"{data} is damaged: {exc}") from None
        raise
    return env


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def move_aside(directory: Path) -> list[Path]:
    """Rename the store's files to ``NAME.corrupt-<UTC time>``; returns the new paths."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    moved = []
    for name in _FILES:
        src = directory / name
        if not src.exists():
            continue
        dst, n = directory / f"{name}.corrupt-{stamp}", 1
        while dst.exists():
            dst, n = directory / f"{name}.corrupt-{stamp}-{n}", n + 1
        src.rename(dst)
        moved.append(dst)
    return moved


def damaged(directory: Path, what: str, exc: Exception) -> StoreError:
    """The error for ``what`` ("a read", "a write") meeting a damaged LMDB file, after recording the damage
    so that the next start refuses or moves the file aside."""
    marker, reason = directory / DAMAGED_MARKER, f"{what} failed: {exc}"
    if not marker.exists():
        try:
            tmp = marker.with_suffix(".tmp")
            tmp.write_text(f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} {reason}\n")
            os.replace(tmp, marker)
            log.error("the store in %s is damaged (%s); marked it in %s", directory, reason, marker)
        except OSError as error:
            log.error("cannot write %s (%s); the store is damaged: %s", marker, error, reason)
    return StoreError(f"the LMDB file in {directory} is damaged ({exc}); restart the daemon with "
                      "--on-corrupt move-aside to start with an empty cache")
