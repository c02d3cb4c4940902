"""Entries stored in 16 bits: half the bytes, their own keys, cast back when served, audits still pass."""

from __future__ import annotations

import uuid

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import actcache_client as ac
from actcache.errors import ConfigError
from tests.integration.test_skip_loads import train_epoch

pytestmark = pytest.mark.slow  # seconds per test: make test runs them, make test-fast does not

N = 64


def wide() -> ac.StagedModel:
    torch.manual_seed(0)
    return ac.from_sequential(nn.Sequential(nn.Linear(8, 256), nn.ReLU(), nn.Linear(256, 4)))


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(N, 8, generator=g), torch.randint(0, 4, (N,), generator=g))


def train(connection, epochs=2, **options):
    staged = wide()
    model = ac.CachedForward(staged, connection, **options)
    dataset = data()
    loader = ac.CachedLoader(DataLoader(ac.IndexedDataset(dataset, targets=dataset.tensors[1]), batch_size=16,
                                        shuffle=True, generator=torch.Generator().manual_seed(1)), model)
    opt = torch.optim.SGD(staged.parameters(), lr=0.05)
    model.set_frozen(2)
    losses: list[float] = []
    for _ in range(epochs):
        train_epoch(model, loader, opt, losses)
        if connection is not None:
            connection.flush(timeout_s=30)
    return losses, model


def test_half_precision_entries_are_smaller_keyed_apart_and_served_back_in_full_precision(daemon):
    off = train(None)[0]
    with ac.connect(daemon.socket, namespace=f"t-{uuid.uuid4().hex[:8]}", strict=True) as conn:
        full, full_model = train(conn)
        full_bytes = conn.stats.bytes_written
        half, model = train(conn, store_dtype=torch.float16, audit=ac.AuditConfig(first_samples=N, every=1))
        half_bytes = conn.stats.bytes_written - full_bytes
    epochs = model.epoch_counters()
    assert [e.times.cached_samples for e in epochs] == [0, N]  # the full-precision entries were not served
    assert half_bytes < 0.6 * full_bytes
    assert model.times.audited_samples == N  # every served entry audited in strict mode: none differed
    assert max(abs(a - b) for a, b in zip(off, full)) <= 1e-5
    assert max(abs(a - b) for a, b in zip(off, half)) <= 1e-2  # rounded activations, close losses
    assert model.fingerprint(2) != full_model.fingerprint(2)


def test_store_dtype_is_checked():
    with pytest.raises(ConfigError, match="store_dtype"):
        ac.CachedForward(wide(), store_dtype=torch.int8)
