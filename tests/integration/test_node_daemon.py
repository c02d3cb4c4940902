"""connect() with no socket: one node daemon per user, shared by local ranks, gone once idle; embedded=True stays private.

Every test points ACTCACHE_DIR and XDG_RUNTIME_DIR at a fresh temp dir (a short
path, so the socket lives in it) and stops whatever node daemon it left.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

import actcache_client as ac
from actcache.codec import DType, TensorSpec, decode_entry, encode_entry
from actcache.errors import ConfigError, DaemonUnavailable
from actcache.node import NodeDaemon, peer_pid, stop_daemon, wait_exit

pytestmark = pytest.mark.slow  # seconds per test: make test runs them, make test-fast does not

FP = bytes(range(16))
SPEC = [TensorSpec(DType.float32, (4,))]


def entry(i: int) -> bytes:
    return encode_entry(SPEC, [np.full(4, i, dtype=np.float32)])


def payload_of(value) -> bytes:
    """The tensor bytes of an entry (the daemon may store and serve it in another codec)."""
    return bytes(decode_entry(value)[1])


@pytest.fixture
def node(monkeypatch):
    root = Path(tempfile.mkdtemp(prefix="acn-"))
    monkeypatch.setenv("ACTCACHE_DIR", str(root / "cache"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(root / "run"))
    monkeypatch.delenv("ACTCACHE_SOCKET", raising=False)
    monkeypatch.delenv("ACTCACHE_BUDGET", raising=False)
    monkeypatch.setenv("ACTCACHE_IDLE_TIMEOUT", "120")  # no test waits for this one; a leftover ends on its own
    node = NodeDaemon.from_env()
    assert node.socket == root / "cache" / "daemon.sock"
    yield node
    try:
        stop_daemon(node.socket)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def starts(node: NodeDaemon) -> int:
    """How many times a daemon was started in ``node.dir``."""
    return node.log_path.read_text().count(" started by pid ")


def _rank(rank: int, barrier, results) -> None:
    """One local rank: connect at the same moment as the other, store its sample, read the other's."""
    import actcache_client as ac
    from actcache.node import NodeDaemon, peer_pid

    barrier.wait(60)
    with ac.connect(namespace="shared", strict=True) as conn:
        conn.store(FP, 1, [rank], [0], lambda: [entry(rank)])
        conn.flush()
        barrier.wait(60)  # both puts acknowledged
        values = conn.lookup(FP, 1, [0, 1], [0, 0])
        results.put((rank, peer_pid(NodeDaemon.from_env().socket), [payload_of(v) for v in values]))


def test_two_ranks_connecting_at_once_share_one_node_daemon(node):
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    ranks = [ctx.Process(target=_rank, args=(r, barrier, results)) for r in range(2)]
    for p in ranks:
        p.start()
    got = sorted(results.get(timeout=240) for _ in ranks)
    for p in ranks:
        p.join(60)
        assert p.exitcode == 0
    (_, pid0, seen0), (_, pid1, seen1) = got
    assert pid0 == pid1 and pid0 is not None  # one daemon...
    assert starts(node) == 1  # ...started once
    assert seen0 == seen1 == [payload_of(entry(0)), payload_of(entry(1))]  # each rank reads what the other stored
    with ac.connect(namespace="shared", strict=True) as later:  # kept after both ranks left
        assert peer_pid(node.socket) == pid0
        assert [payload_of(v) for v in later.lookup(FP, 1, [1], [0])] == [payload_of(entry(1))]


def test_the_node_daemon_stays_while_used_and_exits_once_idle(node, monkeypatch):
    monkeypatch.setenv("ACTCACHE_IDLE_TIMEOUT", "3")
    with ac.connect(strict=True) as conn:
        pid = peer_pid(node.socket)
        assert not wait_exit(pid, 4)  # no call for longer than the timeout, but the connection's lease holds it
        conn.store(FP, 1, [7], [0], lambda: [entry(7)])
        conn.flush()
    assert wait_exit(pid, 60)  # bounded: idle 3 s after the connection closed
    assert not node.socket.exists()
    log = node.log_path.read_text()
    assert "no call for 3 s (--idle-timeout): stopping" in log and "actcache daemon stopped" in log
    with ac.connect(strict=True) as again:  # started again on demand, with what was stored
        assert peer_pid(node.socket) != pid
        assert [payload_of(v) for v in again.lookup(FP, 1, [7], [0])] == [payload_of(entry(7))]


def test_embedded_daemon_is_private_and_leaves_nothing(node):
    with ac.connect(embedded=True, strict=True) as a, ac.connect(embedded=True, strict=True) as b:
        assert a.target != b.target and str(node.dir) not in a.target
        a.store(FP, 1, [1], [0], lambda: [entry(1)])
        a.flush()
        assert [payload_of(v) for v in a.lookup(FP, 1, [1], [0])] == [payload_of(entry(1))]
        assert b.lookup(FP, 1, [1], [0]) == [None]
        where = Path(a.target.removeprefix("unix:")).parent
    assert not where.exists()  # daemon stopped, temp dir removed
    assert not node.dir.exists()  # the node daemon was never involved


def test_embedded_takes_no_socket(node):
    with pytest.raises(ConfigError, match="embedded=True"):
        ac.connect("/x.sock", embedded=True)


def test_a_stale_socket_or_a_killed_daemon_does_not_block_a_start(node):
    node.dir.mkdir(mode=0o700)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(node.socket))
    stale.close()  # the file stays, nobody listens: what a crash leaves
    with ac.connect(strict=True) as conn:
        pid = peer_pid(node.socket)
        conn.store(FP, 1, [3], [0], lambda: [entry(3)])
        conn.flush()
        os.kill(pid, signal.SIGKILL)
        assert wait_exit(pid, 60)
    assert node.socket.exists()  # left behind by the kill
    with ac.connect(strict=True) as conn:
        assert peer_pid(node.socket) not in (None, pid)
        # an acknowledged put survives kill -9
        assert [payload_of(v) for v in conn.lookup(FP, 1, [3], [0])] == [payload_of(entry(3))]
    assert starts(node) == 2


def test_a_daemon_that_cannot_start_is_a_fallback_or_in_strict_mode_an_error(node, monkeypatch):
    monkeypatch.setenv("ACTCACHE_BUDGET", "lots")  # the daemon refuses to start (exit 2)
    refused = r"exited with code 2(.|\n)*--budget must be a size .*got 'lots' \(from ACTCACHE_BUDGET\)"
    with pytest.raises(DaemonUnavailable, match=refused):
        ac.connect(strict=True)
    with pytest.warns(ac.CacheFallbackWarning, match="unavailable"):
        conn = ac.connect()
    with conn:
        assert conn.lookup(FP, 1, [1], [0]) is None  # training recomputes
        assert conn.stats.fallbacks["unavailable"] >= 1
    assert starts(node) == 2 and peer_pid(node.socket) is None


def actcache(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "actcache", *args], capture_output=True, text=True, timeout=120)


def test_actcache_stop_stops_the_node_daemon(node):
    with ac.connect(strict=True):
        pid = peer_pid(node.socket)
    out = actcache("stop")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"stopped the daemon on {node.socket} (pid {pid})"
    assert wait_exit(pid, 0) and not node.socket.exists()
    out = actcache("stop", "--socket", str(node.socket))
    assert out.returncode == 0 and "nothing to stop" in out.stdout


def test_an_embedded_daemon_stops_when_its_trainer_is_killed(node):
    """SIGKILL runs no exit handler in the trainer; its embedded daemon sees its parent gone and stops."""
    script = ("import time, actcache_client as ac\n"
              "c = ac.connect(embedded=True, strict=True)\n"
              "print(c.target, flush=True)\n"
              "time.sleep(120)\n")
    trainer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        target = trainer.stdout.readline().strip()
        pid = peer_pid(Path(target.removeprefix("unix:")))
        assert pid is not None and pid != trainer.pid
        assert not wait_exit(pid, 1.0)  # serving while the trainer lives
        trainer.kill()
        trainer.wait()
        assert wait_exit(pid, 30.0), "the embedded daemon outlived its killed trainer"
        leftover = Path(target.removeprefix("unix:")).parent
        assert leftover.exists()  # nobody ran the trainer's exit handler
        with ac.connect(embedded=True, strict=True):  # the next embedded daemon's start removes it
            assert not leftover.exists()
    finally:
        trainer.kill()
        trainer.wait()
        trainer.stdout.close()
