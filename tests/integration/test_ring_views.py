"""On the CPU, a streamed batch is used where it lies in the shared-memory ring: views that stay right for as
long as the user keeps them, and training that is bit for bit the training without the cache."""

from __future__ import annotations

import uuid

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import actcache_client as ac
from tests.integration.loops import fit

N, BATCH, WIDTH = 96, 16, 16384  # 64 KiB entries: an epoch (6 MiB) outgrows the smallest ring a stream asks for


def wide() -> ac.StagedModel:
    torch.manual_seed(0)
    return ac.from_sequential(nn.Sequential(nn.Linear(8, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 3)))


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(N, 8, generator=g), torch.randint(0, 3, (N,), generator=g))


def loader_for(model: ac.CachedForward) -> ac.CachedLoader:
    return ac.CachedLoader(DataLoader(ac.IndexedDataset(data()), batch_size=BATCH, shuffle=True,
                                      generator=torch.Generator().manual_seed(1)), model)


def ring_mappings() -> list[tuple[int, int]]:
    """Address ranges of this process's mappings of actcache segments."""
    with open("/proc/self/maps") as f:
        return [tuple(int(a, 16) for a in line.split()[0].split("-")) for line in f if "/actcache-" in line]


def test_kept_batches_are_ring_views_that_stay_right_and_a_ring_they_fill_does_not_stall(daemon):
    """The user keeps every served batch of an epoch: they are views of the ring until it is full of them,
    then the daemon sends the rest in messages (copied); the next epoch streams on and never writes over them."""
    staged = wide()
    kept: list[tuple[list[int], torch.Tensor]] = []
    ids: list[int] = []
    staged.stages[2].register_forward_pre_hook(lambda _, args: kept.append((list(ids), args[0])) if keep else None)
    keep = False
    with ac.connect(daemon.socket, namespace=f"t-{uuid.uuid4().hex[:8]}", strict=True) as conn:
        model = ac.CachedForward(staged, conn)
        loader = loader_for(model)
        model.set_frozen(2)
        for epoch in range(4):
            keep = epoch == 2  # the stream's ring is sized by then: 4 MiB, four batches
            with torch.no_grad():
                for batch in loader:
                    ids[:] = batch.ids
                    model(batch.ids, batch.data[0], variant=batch.variant)
            conn.flush(timeout_s=30)
        assert len(kept) == N // BATCH and model.times.cached_samples == 3 * N
        rings = ring_mappings()
        in_ring = [any(lo <= state.data_ptr() < hi for lo, hi in rings) for _, state in kept]
        assert in_ring == [True] * 4 + [False] * 2
        assert conn.stats.inline_entries == 2 * BATCH
        x = data().tensors[0]
        with torch.no_grad():
            for batch_ids, state in kept:
                assert torch.equal(state, staged.run(x[torch.tensor(batch_ids)], 0, 2))


def test_training_on_ring_views_is_bit_for_bit_the_training_without_the_cache(daemon):
    def train(connection) -> tuple[list[float], list[torch.Tensor]]:
        staged = wide()
        model = ac.CachedForward(staged, connection)
        loader = loader_for(model)
        model.set_frozen(2)
        losses, _ = fit(model, loader, torch.optim.SGD(staged.parameters(), lr=0.05), 3, connection)
        return losses, [p.detach().clone() for p in staged.parameters()]

    with ac.connect(daemon.socket, namespace=f"t-{uuid.uuid4().hex[:8]}", strict=True) as conn:
        cached = train(conn)
        assert conn.stats.hits == 2 * N
    plain = train(None)
    assert cached[0] == plain[0]
    assert all(torch.equal(a, b) for a, b in zip(cached[1], plain[1]))
