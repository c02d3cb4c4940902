"""The cache directory's advisory lock: one Store (one daemon) per directory."""

import os

import pytest

from actcache.daemon.config import StoreConfig
from actcache.daemon.store import Store
from actcache.daemon.store._dirlock import LOCK_NAME, DirLock, holder_pid
from actcache.errors import ConfigError


def test_second_store_on_a_directory_is_refused_naming_the_holder(tmp_path):
    first = Store(StoreConfig(dir=tmp_path))
    try:
        assert holder_pid(tmp_path) == os.getpid()
        with pytest.raises(ConfigError, match=rf"in use by another actcache daemon \(pid {os.getpid()}, holding .*{LOCK_NAME}\)"):
            Store(StoreConfig(dir=tmp_path))
    finally:
        first.close()
    Store(StoreConfig(dir=tmp_path)).close()  # released on close


def test_lock_is_released_by_a_failed_open(tmp_path):
    (tmp_path / "data.mdb").write_bytes(b"not an lmdb file" * 1000)
    with pytest.raises(Exception, match="not a valid LMDB file"):
        Store(StoreConfig(dir=tmp_path))
    lock = DirLock.try_acquire(tmp_path)
    assert lock is not None
    lock.release()


def test_try_acquire_returns_none_while_held_and_release_is_idempotent(tmp_path):
    lock = DirLock.acquire(tmp_path)
    assert lock.held and DirLock.try_acquire(tmp_path) is None
    lock.release()
    lock.release()
    assert not lock.held
    again = DirLock.try_acquire(tmp_path)
    assert again is not None
    again.release()
