"""Hits are never loaded: with targets known, the loader leaves out the inputs the cache will serve."""

from __future__ import annotations

import gc
import uuid
import weakref

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset
from torch.utils.data._utils.collate import default_collate

import actcache_client as ac

N, BATCH = 96, 16


class Counting(Dataset):
    """Random (input, label) items; counts ``__getitem__`` calls made in this process."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(N, 8, generator=g), torch.randint(0, 3, (N,), generator=g)
        self.calls: list[int] = []

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int):
        self.calls.append(i)
        return self.x[i], self.y[i]


def mlp() -> ac.StagedModel:
    torch.manual_seed(0)
    return ac.from_sequential(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3)))


def setup(connection, data: Counting, *, num_workers=0, **forward_options):
    staged = mlp()
    model = ac.CachedForward(staged, connection, **forward_options)
    dataset = ac.IndexedDataset(data, targets=data.y)
    loader = ac.CachedLoader(
        DataLoader(dataset, batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(1),
                   num_workers=num_workers, persistent_workers=num_workers > 0),
        model,
    )
    return staged, model, loader


def train_epoch(model, loader, opt, losses) -> None:
    for batch in loader:
        loss = nn.functional.cross_entropy(model(batch), batch.data[1])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())


def run(connection, epochs=3, **options):
    data = Counting()
    staged, model, loader = setup(connection, data, **options)
    opt = torch.optim.SGD(staged.parameters(), lr=0.05)
    model.set_frozen(2)
    losses, calls = [], []
    for _ in range(epochs):
        before = len(data.calls)
        train_epoch(model, loader, opt, losses)
        calls.append(len(data.calls) - before)
        if connection is not None:
            connection.flush(timeout_s=30)
    return losses, calls, model, loader


def namespace() -> str:
    return f"t-{uuid.uuid4().hex[:8]}"


@pytest.mark.slow
def test_a_stored_epoch_loads_no_input_and_trains_as_without_the_cache(daemon):
    off, off_calls, _, _ = run(None)
    assert off_calls == [N, N, N]
    with ac.connect(daemon.socket, namespace=namespace(), strict=True) as conn:
        asked = []
        contains = conn.contains
        conn.contains = lambda *a: asked.append(a) or contains(*a)
        on, calls, model, loader = run(conn, audit=False)
    assert calls == [N, 0, 0]
    assert asked == []  # each epoch's push answered which of its entries are stored
    assert max(abs(a - b) for a, b in zip(off, on)) <= 1e-5
    assert model.times.raw_loaded == loader.raw_items_loaded == N
    assert model.times.cached_samples == 2 * N and model.times.prefix_samples == 3 * N


def test_the_first_samples_are_audited_once_per_connection_not_per_epoch(daemon):
    with ac.connect(daemon.socket, namespace=namespace(), strict=True) as conn:
        _, calls, model, _ = run(conn, epochs=4, audit=ac.AuditConfig(first_samples=5, every=40, group=1))
    # epoch 1: 5 first audits and stored samples 40 and 80; then one in 40 as the count runs on
    assert calls == [N, 5 + 2, 2, 3]


def test_audited_samples_are_loaded_like_misses(daemon):
    with ac.connect(daemon.socket, namespace=namespace(), strict=True) as conn:
        _, calls, model, _ = run(conn, epochs=2, audit=ac.AuditConfig(first_samples=5, every=40, group=1))
    # the second epoch: 5 first audits, then one stored sample in 40 of the other 91
    assert model.times.audited_samples == 5 + 91 // 40
    assert calls == [N, model.times.audited_samples]


def test_a_partly_stored_epoch_loads_exactly_the_misses(daemon):
    data = Counting()
    with ac.connect(daemon.socket, namespace=namespace(), strict=True) as conn:
        staged, model, loader = setup(conn, data, audit=False)
        model.set_frozen(2)
        stored = list(range(0, N, 3))
        with torch.no_grad():
            model.prefix(stored, data.x[stored])  # stores a third of the samples
        conn.flush(timeout_s=30)
        data.calls.clear()
        train_epoch(model, loader, torch.optim.SGD(staged.parameters(), lr=0.05), [])
        assert sorted(data.calls) == [i for i in range(N) if i % 3]
        assert model.times.cached_samples == len(stored)


@pytest.mark.slow
def test_workers_persistent_workers_and_resume_skip_the_stored_inputs(daemon):
    with ac.connect(daemon.socket, namespace=namespace(), strict=True) as conn:
        data = Counting()
        staged, model, loader = setup(conn, data, num_workers=2, audit=False)
        model.set_frozen(2)
        opt = torch.optim.SGD(staged.parameters(), lr=0.05)
        train_epoch(model, loader, opt, [])  # stores every entry
        conn.flush(timeout_s=30)
        assert loader.raw_items_loaded == N
        for i, batch in enumerate(loader):  # stop after two batches, then resume in a new loader and model
            with torch.no_grad():
                model(batch)
            if i == 1:
                state = loader.state_dict()
                break
        assert loader.raw_items_loaded == N
        staged, resumed, loader = setup(conn, data, num_workers=2, audit=False)
        loader.load_state_dict(state)
        resumed.set_frozen(2)
        train_epoch(resumed, loader, opt, [])
        assert loader.raw_items_loaded == 0 and resumed.times.cached_samples == N - 2 * BATCH


def test_a_loader_stopped_mid_epoch_is_freed_once_dropped(daemon):
    """No cycle keeps a CachedLoader stopped mid-epoch: it goes (with its DataLoader and their workers, whose
    shutdown takes seconds mid-epoch) as the loop drops it, not whenever the cycle collector runs, on whichever
    thread (the connection's writer, a gRPC call's) that is."""
    gc.disable()
    try:
        with ac.connect(daemon.socket, namespace=namespace(), strict=True) as conn:
            _, model, loader = setup(conn, Counting(), audit=False)
            model.set_frozen(2)
            for i, batch in enumerate(loader):
                model(batch)
                if i == 1:
                    break
            gone = weakref.ref(loader)
            del loader, batch
            assert gone() is None
    finally:
        gc.enable()


def test_inputs_that_cannot_be_served_are_loaded_on_the_spot(daemon):
    """A freeze change after the loader skipped a batch's inputs: the cache has nothing at the new
    depth, so the skipped rows are loaded on the spot and computed; training is as without the cache."""

    def train(connection):
        data = Counting()
        staged, model, loader = setup(connection, data, audit=False)
        opt = torch.optim.SGD(staged.parameters(), lr=0.05)
        model.set_frozen(2)
        losses: list[float] = []
        train_epoch(model, loader, opt, losses)  # stores depth 2
        if connection is not None:
            connection.flush(timeout_s=30)
        for batch in loader:
            if batch.position == 0:
                model.set_frozen(1)  # nothing stored at depth 1, and no shallower depth to seed from
            loss = nn.functional.cross_entropy(model(batch), batch.data[1])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses, model, loader

    off = train(None)[0]
    with ac.connect(daemon.socket, namespace=namespace(), strict=True) as conn:
        on, model, loader = train(conn)
    assert max(abs(a - b) for a, b in zip(off, on)) <= 1e-5
    # batch 0 of the second epoch came without inputs and loaded them on the spot; later batches were
    # dispatched after the freeze change and loaded theirs as usual
    assert loader.raw_items_loaded == 2 * N - BATCH and model.times.raw_loaded == 2 * N


def test_the_users_train_mode_switch_never_reaches_frozen_batchnorm():
    """net.train() after an evaluation (on the original model, not the staged one) must leave the
    frozen stages in eval mode: their BatchNorm statistics stay as they were frozen."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
    model = ac.CachedForward(ac.from_sequential(net, groups=[2, 1, 1]))
    model.set_frozen(1)
    frozen_mean = net[1].running_mean.clone()
    net.eval()
    net.train()  # the user's usual switch back after evaluating
    model(list(range(16)), torch.randn(16, 8))
    assert torch.equal(net[1].running_mean, frozen_mean) and not net[1].training



@pytest.mark.parametrize("targets", [torch.arange(N) * 2, list(range(N)), lambda i: torch.tensor([i, -i])])
def test_a_batch_with_nothing_to_load_gathers_its_targets_at_once(targets):
    data = Counting()
    dataset = ac.IndexedDataset(data, targets=targets, sample_ids=[100 + i for i in range(N)])
    keys = [(i, 0, False) for i in (3, 1, 7)]
    unloaded = dataset.__getitems__(keys)
    item_by_item = [dataset[k] for k in keys]
    assert unloaded.sample_ids == [s for s, _ in item_by_item] == [103, 101, 107]
    assert torch.equal(unloaded.targets, default_collate([item.target for _, item in item_by_item]))
    assert data.calls == []
    assert isinstance(dataset.__getitems__([(3, 0, False), (1, 0, True)]), list)  # one to load: item by item
    assert data.calls == [1]
    loaded = dataset.__getitems__([(i, 0, True) for i in (3, 1)])  # all to load: ids and items at once
    assert loaded.sample_ids == [103, 101] and data.calls == [1, 3, 1]
    assert all(torch.equal(got[0], data.x[i]) and got[1] == data.y[i] for got, i in zip(loaded.items, (3, 1)))
