"""actcache.ops.clean: each reclaimer on real leftovers, in-process."""

import os
import signal
import socket
import subprocess
import sys

import pytest

from actcache.daemon.config import StoreConfig
from actcache.daemon.store import Store
from actcache.errors import ConfigError
from actcache.ops.clean import BENCH_PREFIX, Action, Finding, clean


def by_reclaimer(findings, name):
    return [f for f in findings if f.reclaimer == name]


def stale_socket_at(path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))  # bound, never listening: what a killed daemon leaves
    s.close()


def test_stale_socket_is_removed_and_a_listening_one_kept(tmp_path):
    stale = tmp_path / "stale.sock"
    stale_socket_at(stale)
    [f] = clean(socket_path=stale, directory=None)
    assert (f.action, f.reclaimer) == (Action.REMOVED, "socket") and not stale.exists()

    live = tmp_path / "live.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(live))
    server.listen()
    try:
        [f] = clean(socket_path=live, directory=None)
        assert f.action is Action.KEPT and "live" in f.detail and live.exists()
    finally:
        server.close()

    regular = tmp_path / "not-a-socket"
    regular.write_text("x")
    [f] = clean(socket_path=regular, directory=None)
    assert f.action is Action.KEPT and regular.exists()
    [f] = clean(socket_path=tmp_path / "absent.sock", directory=None)
    assert f.action is Action.OK


_DIE_IN_A_READ_TXN = """
import os, signal, sys, lmdb
env = lmdb.open(sys.argv[1], readonly=True, max_dbs=8, max_readers=1024)
txn = env.begin()
txn.get(b"x")
os.kill(os.getpid(), signal.SIGKILL)
"""

_HOLD_OPEN = """
import sys, lmdb
env = lmdb.open(sys.argv[1], readonly=True, max_dbs=8, max_readers=1024)
print("open", flush=True)
sys.stdin.read()
"""


def test_reader_slots_of_dead_processes_are_cleared_when_no_daemon_holds_the_dir(tmp_path):
    Store(StoreConfig(dir=tmp_path)).close()
    # A process keeps the environment open, or the next opener would reset the reader table anyway.
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_OPEN, str(tmp_path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "open"
        died = subprocess.run([sys.executable, "-c", _DIE_IN_A_READ_TXN, str(tmp_path)], timeout=60)
        assert died.returncode == -signal.SIGKILL
        [f] = by_reclaimer(clean(socket_path=None, directory=tmp_path), "lmdb readers")
        assert (f.action, f.detail) == (Action.CLEARED, "1 stale reader slot of dead processes")
        [f] = by_reclaimer(clean(socket_path=None, directory=tmp_path), "lmdb readers")
        assert f.action is Action.OK
    finally:
        holder.stdin.close()
        assert holder.wait(60) == 0
        holder.stdout.close()


def test_a_live_store_is_left_alone_and_named(tmp_path):
    store = Store(StoreConfig(dir=tmp_path))
    try:
        [f] = by_reclaimer(clean(socket_path=None, directory=tmp_path), "lmdb readers")
        assert f.action is Action.KEPT and f"pid {os.getpid()} holds the directory" in f.detail
    finally:
        store.close()


def test_bench_leftovers_of_dead_runs_are_removed(tmp_path):
    dead = tmp_path / f"{BENCH_PREFIX}999999999-abc"
    running = tmp_path / f"{BENCH_PREFIX}{os.getpid()}-def"
    for d in (dead, running):
        d.mkdir()
        (d / "disk.bin").write_bytes(b"x")
    found = {f.path: f.action for f in by_reclaimer(clean(socket_path=None, directory=tmp_path), "bench")}
    assert found == {str(dead): Action.REMOVED, str(running): Action.KEPT}
    assert not dead.exists() and running.exists()


def test_a_failing_reclaimer_is_reported_and_the_others_still_run(tmp_path):
    def broken(target):
        raise OSError("boom")

    def fine(target):
        yield Finding(reclaimer="fine", action=Action.OK, path="", detail="ran")

    found = clean(socket_path=None, directory=tmp_path, reclaimers=[broken, fine])
    assert [(f.reclaimer, f.action) for f in found] == [("broken", Action.FAILED), ("fine", Action.OK)]


def test_a_missing_directory_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="is not a directory"):
        clean(socket_path=None, directory=tmp_path / "nope")
