"""Cache identity on a real daemon: other data never meets the same entries, audits catch wrong
content, and superseded generations are dropped."""

from __future__ import annotations

import uuid

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import actcache_client as ac
from actcache.errors import CacheMismatchError
from actcache_client.engine._audit import CacheMismatchWarning
from actcache_client.transport._tensors import encode_samples
from tests.client.test_identity import Scaled
from tests.integration.loops import fit


def mlp() -> ac.StagedModel:
    torch.manual_seed(0)  # the same "pretrained" weights in every job
    return ac.from_sequential(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)))


def random_data(seed: int, n: int = 256) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g))


class Tokenized(Dataset):
    """The same sentences, tokenized to ``max_length`` (truncated, zero-padded)."""

    def __init__(self, max_length: int) -> None:
        g = torch.Generator().manual_seed(3)
        self.tokens = torch.randint(1, 50, (128, 16), generator=g)
        self.labels = torch.randint(0, 4, (128,), generator=g)
        self.max_length = max_length

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        return self.tokens[i, : self.max_length], self.labels[i]


class MeanPool(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=1)


def text_model() -> ac.StagedModel:
    torch.manual_seed(0)
    return ac.from_sequential(nn.Sequential(nn.Embedding(50, 16), MeanPool(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)))


def job(connection, dataset, *, make=mlp, frozen=2, epochs=2, **forward_options):
    """The README's loop: frozen from the start; per-epoch losses, the CachedForward and per-epoch hits."""
    staged = make()
    model = ac.CachedForward(staged, connection, **forward_options)
    loader = ac.CachedLoader(
        DataLoader(ac.IndexedDataset(dataset), batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(1)),
        model,
    )
    model.set_frozen(frozen)
    losses, hits = fit(model, loader, torch.optim.SGD(staged.parameters(), lr=0.05), epochs, connection)
    return losses, model, hits


def groups_of(connection, namespace: str) -> dict[bytes, int]:
    """Entries per fingerprint in ``namespace``, as the daemon reports them."""
    out: dict[bytes, int] = {}
    for g in connection.rpc().stats().groups:
        if g.namespace == namespace:
            out[bytes(g.fingerprint)] = out.get(bytes(g.fingerprint), 0) + g.entries
    return out


@pytest.mark.slow
def test_two_jobs_on_other_data_from_the_same_weights_share_no_entries(daemon):
    """The reproduction: same weights, same namespace ("default"), other data."""
    results = []
    for seed in (10, 11):
        off = job(None, random_data(seed))[0]
        with ac.connect(daemon.socket, strict=True) as conn:
            losses, _, hits = job(conn, random_data(seed))
        assert hits == [0, 256]  # the second job's first epoch gets nothing of the first job's
        assert max(abs(a - b) for a, b in zip(off, losses)) <= 1e-5
        results.append(losses)
    assert results[0] != results[1]


@pytest.mark.parametrize("first, second, make", [
    (Scaled(random_data(5), 1.0), Scaled(random_data(5), 2.0), mlp),
    (Tokenized(8), Tokenized(12), text_model),
], ids=["scale-factor", "max-length"])
def test_the_same_items_preprocessed_otherwise_get_no_hits(daemon, first, second, make):
    namespace = f"t-{uuid.uuid4().hex[:8]}"
    with ac.connect(daemon.socket, namespace=namespace, strict=True) as conn:
        assert job(conn, first, make=make)[2][1] == len(first)  # its own second epoch hits
        assert job(conn, second, make=make, epochs=1)[2] == [0]


def wrong_entries(connection, model: ac.CachedForward, dataset, depth: int) -> None:
    """Store, under the right key, activations of other inputs (as a peer with a bug would)."""
    ns = connection.rpc().open(connection.config.namespace).namespace_id
    x = torch.stack([dataset[i][0] for i in range(len(dataset))]) + 1.0
    with torch.no_grad():
        state = model.model.run(x, 0, depth)
    entries = encode_samples(state)
    connection.rpc().put(ns, model.fingerprint(depth), depth, [(i, 0, e) for i, e in enumerate(entries)])


def primed(conn, dataset):
    """A CachedForward bound to ``dataset`` and frozen at 2, with wrong entries stored under its key."""
    staged = mlp()
    model = ac.CachedForward(staged, conn)
    ac.CachedLoader(DataLoader(ac.IndexedDataset(dataset), batch_size=32), model)
    model.set_frozen(2)
    wrong_entries(conn, model, dataset, 2)
    return model


@pytest.mark.slow
def test_an_audit_catches_wrong_content_drops_it_warns_and_recomputes(daemon):
    dataset, namespace = random_data(20), f"t-{uuid.uuid4().hex[:8]}"
    off = job(None, dataset)[0]
    with ac.connect(daemon.socket, namespace=namespace) as conn:
        fingerprint = primed(conn, dataset).fingerprint(2)
        assert groups_of(conn, namespace) == {fingerprint: len(dataset)}
        with pytest.warns(CacheMismatchWarning, match=fingerprint.hex()):
            losses, model, _ = job(conn, dataset)
        assert model.times.audited_samples > 0 and model.times.audit > 0
        assert max(abs(a - b) for a, b in zip(off, losses)) <= 1e-5  # trained on recomputed activations
        assert conn.stats.dropped_entries >= len(dataset)
        # what the daemon holds now is what the prefix computes: a fresh audited run agrees with it
        again = ac.CachedForward(mlp(), conn, audit=ac.AuditConfig(first_samples=256))
        ac.CachedLoader(DataLoader(ac.IndexedDataset(dataset), batch_size=256), again)
        again.set_frozen(2)
        x = torch.stack([dataset[i][0] for i in range(len(dataset))])
        again.prefix(torch.arange(len(dataset)), x)
        assert again.times.cached_samples == len(dataset) and again.times.audited_samples == len(dataset)


def test_an_audit_mismatch_raises_in_strict_mode(daemon):
    dataset, namespace = random_data(21), f"t-{uuid.uuid4().hex[:8]}"
    with ac.connect(daemon.socket, namespace=namespace, strict=True) as conn:
        model = primed(conn, dataset)
        x = torch.stack([dataset[i][0] for i in range(32)])
        with pytest.raises(CacheMismatchError, match=model.fingerprint(2).hex()):
            model.prefix(torch.arange(32), x)


def test_without_audits_wrong_content_is_served(daemon):
    """The control: audits are what catch it."""
    dataset, namespace = random_data(22), f"t-{uuid.uuid4().hex[:8]}"
    with ac.connect(daemon.socket, namespace=namespace, strict=True) as conn:
        model = primed(conn, dataset)
        model.set_audit(False)
        x = torch.stack([dataset[i][0] for i in range(32)])
        served = model.prefix(torch.arange(32), x)
        with torch.no_grad():
            assert not torch.allclose(served, model.model.run(x, 0, 2), atol=1e-3)


@pytest.mark.parametrize("keep", [False, True])
def test_a_refrozen_prefix_drops_the_generation_it_superseded(daemon, keep):
    dataset, namespace = random_data(30, n=64), f"t-{uuid.uuid4().hex[:8]}"
    with ac.connect(daemon.socket, namespace=namespace, strict=True) as conn:
        _, model, _ = job(conn, dataset, epochs=1, keep_generations=keep)
        old = model.fingerprint(2)
        assert groups_of(conn, namespace) == {old: 64}
        model.set_frozen(0)  # unfreeze and train further: the weights change
        opt = torch.optim.SGD(model.model.parameters(), lr=0.5)
        x, y = random_data(30, n=64).tensors
        nn.functional.cross_entropy(model(torch.arange(64), x), y).backward()
        opt.step()
        model.set_frozen(2)
        assert model.fingerprint(2) != old
        conn.flush(timeout_s=30)
        assert (old in groups_of(conn, namespace)) == keep


def test_the_daemon_lists_the_job_and_its_data(daemon):
    import os

    namespace = f"t-{uuid.uuid4().hex[:8]}"
    with ac.connect(daemon.socket, namespace=namespace, strict=True) as conn:
        model = ac.CachedForward(mlp(), conn)
        ac.CachedLoader(DataLoader(ac.IndexedDataset(random_data(40), data_id="digits-v2"), batch_size=8), model)
        model.set_frozen(2)
        x = random_data(40).tensors[0][:8]
        model.prefix(list(range(8)), x)
        conn.flush(timeout_s=30)
        stats = conn.rpc().stats()
    jobs = [j.job for ns in stats.namespaces if ns.name == namespace for j in ns.jobs]
    assert [(j.pid, j.data_id) for j in jobs] == [(os.getpid(), "digits-v2")]
