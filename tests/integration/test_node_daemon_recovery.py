"""A node daemon killed mid-run (SIGKILL: an OOM kill, an upgrade) comes back, and serves what is on disk."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import tempfile
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import actcache_client as ac
from actcache.node import NodeDaemon, peer_pid, stop_daemon, wait_exit

pytestmark = pytest.mark.slow  # seconds per test: make test runs them, make test-fast does not

EPOCHS, KILL_EPOCH = 6, 3


@pytest.fixture
def node(monkeypatch):
    root = Path(tempfile.mkdtemp(prefix="acr-"))
    monkeypatch.setenv("ACTCACHE_DIR", str(root / "cache"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(root / "run"))
    monkeypatch.delenv("ACTCACHE_SOCKET", raising=False)
    monkeypatch.delenv("ACTCACHE_BUDGET", raising=False)
    monkeypatch.setenv("ACTCACHE_IDLE_TIMEOUT", "120")
    yield NodeDaemon.from_env()
    try:
        stop_daemon(NodeDaemon.from_env().socket)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(96, 3, 8, 8, generator=g), torch.randint(0, 10, (96,), generator=g))


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
                         nn.Flatten(), nn.Linear(8 * 64, 10))


def _train(cache: ac.ActCache | None, net: nn.Sequential, on_batch=None) -> list[float]:
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    loader = DataLoader(_data(), batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(1))
    if cache is not None:
        loader = cache.wrap(loader)
    losses = []
    for epoch in range(EPOCHS):
        if epoch == 1:
            if cache is not None:
                cache.freeze(2)
            else:
                net[:2].requires_grad_(False)
        for position, (x, y) in enumerate(loader):
            if on_batch is not None:
                on_batch(epoch, position)
            loss = F.cross_entropy(net(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return losses


def test_a_killed_node_daemon_is_started_again_and_serves_the_entries_on_disk(node, caplog):
    reference = _train(None, _net())
    net = _net()
    cache = ac.ActCache(net, ac.connect(namespace="recovery"), planner=None)  # the cache serves whatever it costs
    back = threading.Event()
    killed: list[int] = []

    def kill_once(epoch: int, position: int) -> None:
        if epoch == KILL_EPOCH and position == 0 and not killed:  # before the next epoch is pushed ahead
            cache.connection.flush()
            pid = peer_pid(node.socket)
            os.kill(pid, signal.SIGKILL)
            assert wait_exit(pid, 60)
            killed.append(pid)
        if epoch == KILL_EPOCH and position == 2:  # an epoch outlasts a daemon start: the next one finds it back
            assert back.wait(60), "the node daemon was not started again"

    class Back(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "node daemon is back" in record.getMessage():
                back.set()

    handler = Back()
    logging.getLogger("actcache_client").addHandler(handler)
    try:
        with caplog.at_level(logging.INFO, logger="actcache_client"):
            with pytest.warns(ac.CacheFallbackWarning, match="unavailable"):
                losses = _train(cache, net, on_batch=kill_once)
    finally:
        logging.getLogger("actcache_client").removeHandler(handler)
    hits = [int(c.entries["hits"]) for c in cache.model.epoch_counters()]
    cache.close()
    assert losses == reference
    assert killed and peer_pid(node.socket) not in (None, killed[0])
    assert hits[:KILL_EPOCH] == [0, 0, 96] and hits[KILL_EPOCH + 1:] == [96] * (EPOCHS - KILL_EPOCH - 1), hits
    assert cache.connection.stats.fallbacks["unavailable"] >= 1
    assert back.is_set()


def test_the_first_call_that_finds_the_daemon_gone_starts_it_again_long_before_the_lease_would_check(node):
    """The lease checks every 40 s here (a third of the 120 s idle timeout): a start within 30 s is the call's."""
    from actcache.codec import DType, TensorSpec, decode_entry, encode_entry

    entry = encode_entry([TensorSpec(DType.float32, (4,))], [torch.arange(4, dtype=torch.float32).numpy()])
    back = threading.Event()
    with ac.connect(namespace="recovery") as conn:
        conn._embedded.on_back = lambda: (conn.resume(), back.set())
        conn.store(bytes(16), 1, [5], [0], lambda: [entry])
        conn.flush()
        pid = peer_pid(node.socket)
        os.kill(pid, signal.SIGKILL)
        assert wait_exit(pid, 60)
        with pytest.warns(ac.CacheFallbackWarning, match="unavailable"):
            assert conn.lookup(bytes(16), 1, [5], [0]) is None  # recomputed; the lease is told
        assert back.wait(30), "the node daemon was not started again"
        [value] = conn.lookup(bytes(16), 1, [5], [0])
        assert bytes(decode_entry(value)[1]) == bytes(decode_entry(entry)[1])  # served from what is on disk
        assert peer_pid(node.socket) not in (None, pid)
