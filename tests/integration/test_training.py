"""Training real small models with the frozen prefix served by a real daemon process."""

from __future__ import annotations

import itertools
import threading
import time
import uuid

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import actcache_client as ac
from actcache.errors import DaemonUnavailable, PermissionDenied
from actcache.testing import run_daemon
from actcache_client.bert import collate_tokens
from actcache_client.models import resnet20
from tests.client.tiny_bert import TinyBertForSequenceClassification
from tests.integration.test_skip_loads import train_epoch

pytestmark = pytest.mark.slow  # seconds per test: make test runs them, make test-fast does not

N = 96


def cnn() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(),
        nn.Flatten(), nn.Linear(16 * 8 * 8, 10),
    )


def image_data(n: int = N) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 3, 16, 16, generator=g), torch.randint(0, 10, (n,), generator=g))


class TextData(torch.utils.data.Dataset):
    """Sentences of 3..12 tokens with a label."""

    def __init__(self, n: int = N) -> None:
        g = torch.Generator().manual_seed(0)
        self.lengths = torch.randint(3, 12, (n,), generator=g)
        self.tokens = torch.randint(1, 50, (n, 12), generator=g)
        self.labels = torch.randint(0, 3, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        return self.tokens[i, : self.lengths[i]], self.labels[i]


def pad_collate(items):
    longest = max(len(t) for t, _ in items)
    ids = torch.zeros(len(items), longest, dtype=torch.int64)
    mask = torch.zeros(len(items), longest, dtype=torch.int64)
    for row, (t, _) in enumerate(items):
        ids[row, : len(t)] = t
        mask[row, : len(t)] = 1
    return (ids, mask), torch.stack([y for _, y in items])


class PairData(torch.utils.data.Dataset):
    """Sentence pairs: [CLS] a [SEP] b [SEP] with segment 1 on b [SEP], 5..11 tokens, a label."""

    def __init__(self, n: int = N) -> None:
        g = torch.Generator().manual_seed(0)
        self.lengths = torch.randint(1, 5, (n, 2), generator=g)
        self.tokens = torch.randint(3, 50, (n, 8), generator=g)
        self.labels = torch.randint(0, 3, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        a, b = self.lengths[i].tolist()
        ids = torch.cat([torch.tensor([1]), self.tokens[i, :a], torch.tensor([2]), self.tokens[i, a : a + b],
                         torch.tensor([2])])
        types = torch.cat([torch.zeros(a + 2, dtype=torch.int64), torch.ones(b + 1, dtype=torch.int64)])
        return (ids, types), self.labels[i]


def namespace() -> str:
    return f"t-{uuid.uuid4().hex[:8]}"


def train(make_staged, dataset, *, connection, epochs=3, freeze=((1, 3),), varlen=None, collate=None,
          augment=None, variants=None, lr=0.05, on_step=None, device="cpu"):
    """Train with a static freeze schedule ((epoch, depth), ...); returns per-step losses and the staged model."""
    torch.manual_seed(0)
    staged = make_staged().to(device)
    model = ac.CachedForward(staged, connection, varlen=varlen)
    loader = ac.CachedLoader(
        DataLoader(ac.IndexedDataset(dataset, augment=augment), batch_size=16, shuffle=True,
                   generator=torch.Generator().manual_seed(1), collate_fn=collate),
        model, variants=variants,
    )
    opt = torch.optim.SGD(staged.parameters(), lr=lr)
    schedule, losses = dict(freeze), []
    for epoch in range(epochs):
        if epoch in schedule:
            model.set_frozen(schedule[epoch])
        staged.train()
        for batch in loader:
            x, y = batch.data
            loss = nn.functional.cross_entropy(model(batch.ids, x, variant=batch.variant), y.to(device))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
            if on_step:
                on_step(len(losses))
        if connection is not None:
            connection.flush(timeout_s=30)
    return losses, staged, model


def assert_same_training(a, b, atol=1e-5):
    (la, sa, _), (lb, sb, _) = a, b
    assert len(la) == len(lb)
    assert max(abs(x - y) for x, y in zip(la, lb)) <= atol
    for (name, p), q in zip(sa.state_dict().items(), sb.state_dict().values()):
        assert torch.allclose(p.float(), q.float(), atol=atol), name


MODELS = {
    "sequential-cnn": (lambda: ac.from_sequential(cnn(), groups=[3, 3, 2, 2]), image_data, {}),
    "resnet20": (lambda: ac.from_resnet(resnet20()), lambda: image_data(64), {"freeze": ((1, 5),)}),
    "tiny-bert": (lambda: ac.from_bert(TinyBertForSequenceClassification(n_layers=3)), TextData,
                  {"varlen": ac.VarLen(), "collate": pad_collate, "freeze": ((1, 2),)}),
    "tiny-bert-pairs": (lambda: ac.from_bert(TinyBertForSequenceClassification(n_layers=3)), PairData,
                        {"varlen": ac.VarLen(), "collate": collate_tokens, "freeze": ((1, 1),)}),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_cache_on_and_off_train_identically(daemon, name):
    make, data, options = MODELS[name]
    off = train(make, data(), connection=None, **options)
    with ac.connect(daemon.socket, namespace=namespace(), strict=True) as conn:
        on = train(make, data(), connection=conn, **options)
        assert conn.stats.hits > 0 and conn.stats.puts > 0
        assert on[2].times.cached_samples == conn.stats.hits
    assert_same_training(off, on)


def test_sentence_pairs_skip_loading_what_is_served(daemon):
    """(input_ids, attention_mask, token_type_ids) states from collate_tokens under IndexedDataset(targets=):
    once the embeddings are stored no pair is loaded, and training is the same as without the cache."""

    def run(connection):
        torch.manual_seed(0)
        staged = ac.from_bert(TinyBertForSequenceClassification(n_layers=2))
        model = ac.CachedForward(staged, connection, varlen=ac.VarLen(), audit=False)
        data = PairData()
        loader = ac.CachedLoader(DataLoader(ac.IndexedDataset(data, targets=data.labels), batch_size=16, shuffle=True,
                                            generator=torch.Generator().manual_seed(1), collate_fn=collate_tokens),
                                 model)
        opt = torch.optim.SGD(staged.parameters(), lr=0.05)
        model.set_frozen(1)
        losses, loaded = [], []
        for _ in range(3):
            before = loader.raw_items_loaded
            train_epoch(model, loader, opt, losses)
            loaded.append(loader.raw_items_loaded - before)
            if connection is not None:
                connection.flush(timeout_s=30)
        return losses, loaded

    off, off_loaded = run(None)
    with ac.connect(daemon.socket, namespace=namespace(), strict=True) as conn:
        on, on_loaded = run(conn)
    assert (off_loaded, on_loaded) == ([N, N, N], [N, 0, 0])
    assert max(abs(a - b) for a, b in zip(off, on)) <= 1e-5


def test_partial_hits_merge_in_batch_order(daemon):
    staged = ac.from_sequential(cnn(), groups=[3, 3, 2, 2])
    with ac.connect(daemon.socket, namespace=namespace(), strict=True) as conn:
        model = ac.CachedForward(staged, conn, stream=False)
        model.set_frozen(2)
        x = image_data(16).tensors[0]
        ids = torch.arange(100, 116)
        model.prefix(ids[::2], x[::2])  # caches the even half
        conn.flush()
        merged = model.prefix(ids, x)
        assert model.times.cached_samples == 8 and model.times.computed_samples == 16
        with torch.no_grad():
            expected = staged.run(x, 0, 2)
        assert torch.allclose(merged, expected, atol=1e-6)


def test_deeper_freeze_is_seeded_from_shallower_entries(daemon):
    make, data, _ = MODELS["resnet20"]
    with ac.connect(daemon.socket, namespace=namespace(), strict=True) as conn:
        on = train(make, data(), connection=conn, epochs=3, freeze=((0, 2), (2, 4)))
        # epoch 0 computes depth 2, epoch 1 hits it, epoch 2 seeds depth 4 from depth 2
        assert on[2].times.seeded_samples == 64
        assert on[2].times.computed_samples == 64
    off = train(make, data(), connection=None, epochs=3, freeze=((0, 2), (2, 4)))
    assert_same_training(off, on)


def test_unfreeze_changes_fingerprint_and_never_serves_stale_entries(daemon):
    make, data, _ = MODELS["sequential-cnn"]
    with ac.connect(daemon.socket, namespace=namespace(), strict=True) as conn:
        _, _, model = train(make, data(), connection=conn, epochs=2, freeze=((0, 2),))
        before = model.fingerprint()
        model.set_frozen(0)
        with torch.no_grad():
            next(model.model.stages[0].parameters()).add_(0.1)
        model.set_frozen(2)
        assert model.fingerprint() != before
        hits = conn.stats.hits
        x = image_data(16).tensors[0]
        model.prefix(torch.arange(16), x)
        assert conn.stats.hits == hits  # nothing served for the new weights


def test_variants_cache_k_augmentations(daemon):
    def augment(item, generator):
        x, y = item
        if torch.rand((), generator=generator) < 0.5:
            x = x.flip(-1)
        return x + 0.1 * torch.randn(x.shape, generator=generator), y

    make, data, _ = MODELS["sequential-cnn"]
    off = train(make, data(), connection=None, epochs=4, freeze=((0, 2),), augment=augment, variants=2)
    with ac.connect(daemon.socket, namespace=namespace(), strict=True) as conn:
        on = train(make, data(), connection=conn, epochs=4, freeze=((0, 2),), augment=augment, variants=2)
        assert conn.stats.puts == 2 * N  # two variants per sample, written in epochs 0 and 1
        assert conn.stats.hits == 2 * N  # epochs 2 and 3 reuse them
    assert_same_training(off, on)


def test_random_augmentation_without_variants_is_not_cached(daemon):
    make, data, _ = MODELS["sequential-cnn"]
    with ac.connect(daemon.socket, namespace=namespace(), strict=True) as conn:
        with pytest.warns(ac.UncacheableDataWarning, match="no variants=K"):
            train(make, data(), connection=conn, epochs=2, freeze=((0, 2),), augment=lambda item, g: item)
        assert conn.stats.puts == 0 and conn.stats.gets == conn.stats.streamed == 0


def test_daemon_killed_mid_epoch_training_completes_and_hits_resume(tmp_path):
    make, data, _ = MODELS["sequential-cnn"]
    off = train(make, data(), connection=None, epochs=6)
    with run_daemon(cache_dir=tmp_path / "cache") as daemon:
        with ac.connect(daemon.socket, namespace="survivor", backoff_s=0.05, timeout_s=2) as conn:
            hits_after_restart = {}

            def chaos(step):  # 6 steps an epoch; epoch 1 (steps 7-12) stores its entries
                if step == 15:  # mid-epoch 2
                    daemon.kill()
                if step == 20:  # epoch 3: back up with the same directory
                    daemon.start()
                    hits_after_restart["before"] = conn.stats.hits
                    # past gRPC's reconnect backoff (at most 1 s, +20% jitter): the channel tries again
                    time.sleep(1.5)

            with pytest.warns(ac.CacheFallbackWarning, match="unavailable"):
                on = train(make, data(), connection=conn, epochs=6, on_step=chaos)
            assert conn.stats.fallbacks["unavailable"] >= 1
            assert conn.stats.hits > hits_after_restart["before"]  # same fingerprints hit again
    assert_same_training(off, on)


def test_strict_mode_raises_when_the_daemon_is_gone(tmp_path):
    with run_daemon(cache_dir=tmp_path / "c") as daemon:
        conn = ac.connect(daemon.socket, namespace="strict", strict=True, timeout_s=2)
        model = ac.CachedForward(ac.from_sequential(cnn(), groups=[3, 3, 2, 2]), conn, stream=False)
        model.set_frozen(2)
        x = image_data(4).tensors[0]
        model.prefix(torch.arange(4), x)
        daemon.kill()
        with pytest.raises(DaemonUnavailable):
            model.prefix(torch.arange(4), x)
        conn.close()


def test_a_strict_client_waits_for_a_restarting_daemon(tmp_path):
    with run_daemon(cache_dir=tmp_path / "c") as daemon:
        with ac.connect(daemon.socket, namespace="restart", strict=True, timeout_s=60) as conn:
            assert conn.lookup(b"0" * 16, 1, [0], [0]) == [None]
            daemon.stop()
            restart = threading.Timer(1.5, daemon.start)  # past the client's own retries (< 0.5 s)
            restart.start()
            try:
                assert conn.lookup(b"0" * 16, 1, [0], [0]) == [None]
            finally:
                restart.join()


def test_a_strict_client_gives_up_on_a_daemon_gone_after_its_timeout(tmp_path):
    with run_daemon(cache_dir=tmp_path / "c") as daemon:
        with ac.connect(daemon.socket, namespace="gone", strict=True, timeout_s=2) as conn:
            assert conn.lookup(b"0" * 16, 1, [0], [0]) == [None]
            daemon.stop()
            t0 = time.monotonic()
            with pytest.raises(DaemonUnavailable, match=rf"(?s){daemon.socket}.*within 2 s.*actcache serve"):
                conn.lookup(b"0" * 16, 1, [0], [0])
            assert time.monotonic() - t0 >= 2


def test_loader_orders_distributed_ranks_workers_and_resume(daemon):
    dataset = ac.IndexedDataset(image_data(40))
    seen = []
    for rank in range(2):
        sampler = DistributedSampler(dataset, num_replicas=2, rank=rank, shuffle=True, seed=3)
        loader = ac.CachedLoader(DataLoader(dataset, batch_size=6, sampler=sampler, drop_last=True, num_workers=2,
                                            persistent_workers=True))
        for epoch in range(2):
            loader.set_epoch(epoch)
            ids = [b.ids.tolist() for b in loader]
            assert all(len(b) == 6 for b in ids) and len(ids) == 3
            seen.append((rank, epoch, list(itertools.chain(*ids))))
    for epoch in range(2):
        r0, r1 = (set(ids) for rank, e, ids in seen if e == epoch)
        assert not r0 & r1
    assert seen[0][2] != seen[1][2]  # set_epoch reshuffles

    loader = ac.CachedLoader(DataLoader(dataset, batch_size=8, shuffle=True, num_workers=2))
    full = []
    for i, batch in enumerate(loader):
        full.append(batch.ids.tolist())
        if i == 1:
            state = loader.state_dict()
            break
    resumed = ac.CachedLoader(DataLoader(dataset, batch_size=8, shuffle=True))
    resumed.load_state_dict(state)
    rest = [b.ids.tolist() for b in resumed]
    assert sorted(itertools.chain(*full, *rest)) == list(range(40))
    assert len(rest) == 3 and rest[0] == state["order"][2]


@pytest.fixture
def one_thread():
    """Measured compute times must not depend on how busy the other core is."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("throttle_mbps, expected", [(None, "cache"), (0.05, "recompute")])
def test_cost_model_follows_the_daemon_speed(throttle_mbps, expected, tmp_path, one_thread):
    """ResNet-20 with 9 of 11 stages frozen: a heavy prefix and 16 KiB entries. At full speed caching
    wins by far; at 0.05 MB/s a fetch costs ~330 ms per sample, and even the best partial plan gains
    less than the 10% this run asks for, so the planner recomputes. (Over a Unix socket no Get probes the
    write epoch's entries: a Get is not the stream's shared-memory path, the stream's own frames time it.)"""
    args = ["--throttle-read-mbps", str(throttle_mbps)] if throttle_mbps else []
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 10, (8,), generator=g))
    with run_daemon(*args, cache_dir=tmp_path / "c") as daemon, ac.connect(daemon.socket, namespace="plan") as conn:
        planner = ac.CachePlanner(ac.PlannerConfig(total_epochs=20, min_gain=0.1))
        plans = []
        planner.listeners.append(lambda k, plan: plans.append(plan))
        model = ac.CachedForward(ac.from_resnet(resnet20()), conn, planner=planner)
        loader = ac.CachedLoader(DataLoader(ac.IndexedDataset(data), batch_size=4, shuffle=True), model)
        model.set_frozen(9)
        for _ in range(4):  # write epoch, read epochs (the stream's waits time the fetch), then re-plan
            for batch in loader:
                x, y = batch.data
                nn.functional.cross_entropy(model(batch.ids, x), y).backward()
            conn.flush(timeout_s=30)
        assert plans and plans[-1].mode.value == expected, plans[-1].reason
        if expected == "cache":
            assert conn.stats.hits > 0


def test_a_write_epoch_over_a_unix_socket_sends_no_read_probe(tmp_path, one_thread):
    """The stream comes over shared memory there: a Get of the entries just written would time another path."""
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 10, (8,), generator=g))
    with run_daemon(cache_dir=tmp_path / "c") as daemon, ac.connect(daemon.socket, namespace="probe") as conn:
        model = ac.CachedForward(ac.from_resnet(resnet20()), conn,
                                 planner=ac.CachePlanner(ac.PlannerConfig(total_epochs=4)))
        loader = ac.CachedLoader(DataLoader(ac.IndexedDataset(data), batch_size=4, shuffle=True), model)
        model.set_frozen(9)
        for batch in loader:
            x, y = batch.data
            nn.functional.cross_entropy(model(batch.ids, x), y).backward()
        conn.flush(timeout_s=30)
        assert conn.stats.puts == 8
        assert (conn.stats.gets, conn.stats.timed_bytes) == (0, 0)


def test_the_fetch_reading_is_the_rate_the_step_received_from_a_throttled_daemon(tmp_path, one_thread):
    """A daemon serving 2 MB/s and a step that waits for it: the rate the step received (each frame over the
    time since the one before: the wait and the work it overlapped) is the bytes of the served epoch over
    its time, and the planner takes the fetch speed no lower."""
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 3, 32, 32, generator=g), torch.randint(0, 10, (64,), generator=g))
    with run_daemon("--throttle-read-mbps", "2", cache_dir=tmp_path / "c") as daemon, \
            ac.connect(daemon.socket, namespace="rate") as conn:
        model = ac.CachedForward(ac.from_resnet(resnet20()), conn)
        loader = ac.CachedLoader(DataLoader(ac.IndexedDataset(data), batch_size=8), model)
        model.set_frozen(9)
        for _epoch in range(3):  # the write epoch, a served one (frames sized to its entries), then the measured one
            before, t0 = (conn.stats.received_bytes, conn.stats.received_seconds, conn.stats.bytes_read), None
            for batch in loader:
                t0 = t0 or time.perf_counter()  # from the first frame's arrival
                x, y = batch.data
                nn.functional.cross_entropy(model(batch.ids, x), y).backward()
            elapsed = time.perf_counter() - t0
            conn.flush(timeout_s=30)
        s = conn.stats
        received = (s.received_bytes - before[0]) / (s.received_seconds - before[1])
        assert s.hits == 128 and received < 2.2e6  # no faster than the daemon serves
        assert received == pytest.approx((s.bytes_read - before[2]) / elapsed, rel=0.25)
        planner = ac.CachePlanner(ac.PlannerConfig(prior_fetch_bytes_per_s=1e3))
        for stage in range(9):
            planner.record_stage(stage, 1e-3, 8, 16 << 10)
        planner.observe(s)
        assert planner.measurements(9).fetch_bytes_per_s >= 0.99 * received  # waits alone may read faster


class FixedPlanner(ac.CachePlanner):
    """A planner that always answers one plan, to test how CachedForward applies plans."""

    def __init__(self, fixed):
        super().__init__()
        self.fixed = fixed

    def needs_replan(self, k):
        return self.current is None

    def plan_for(self, k):
        self.current = self.fixed
        return self.fixed


def test_plan_with_shallower_depth_and_a_subset_is_applied(daemon):
    from actcache_client.cost_model import Plan, PlanMode, cached_subset

    plan = Plan(mode=PlanMode.CACHE, cache_depth=2, recompute_stages=(2, 4), cached_fraction=0.5,
                expected_step_s=0.0, baseline_step_s=0.0, write_epoch_extra_s=0.0, reason="test")
    make, data, _ = MODELS["resnet20"]
    off = train(make, data(), connection=None, epochs=3, freeze=((0, 4),))
    subset = sum(cached_subset(i, 0.5) for i in range(64))
    with ac.connect(daemon.socket, namespace=namespace(), strict=True) as conn:
        torch.manual_seed(0)
        staged = make()
        model = ac.CachedForward(staged, conn, planner=FixedPlanner(plan))
        loader = ac.CachedLoader(DataLoader(ac.IndexedDataset(data()), batch_size=16, shuffle=True,
                                            generator=torch.Generator().manual_seed(1)), model)
        opt = torch.optim.SGD(staged.parameters(), lr=0.05)
        losses = []
        model.set_frozen(4)
        for _ in range(3):
            for batch in loader:
                x, y = batch.data
                loss = nn.functional.cross_entropy(model(batch.ids, x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.item())
            conn.flush(timeout_s=30)
        assert conn.stats.puts == subset  # only the subset, only once, at depth 2
        assert conn.stats.hits == 2 * subset
        groups = [(g.depth, g.entries) for g in conn.rpc().stats().groups if g.namespace == conn.config.namespace]
        assert groups == [(2, subset)]
    assert_same_training(off, (losses, staged, model))


def test_protected_namespace_survives_a_daemon_restart(tmp_path):
    make, data, _ = MODELS["sequential-cnn"]
    with run_daemon(cache_dir=tmp_path / "c") as daemon:
        with ac.connect(daemon.socket, namespace="private", secret="s3cret", strict=True) as conn:
            train(make, data(), connection=conn, epochs=2, freeze=((0, 2),))
            hits = conn.stats.hits
            assert hits == N
            daemon.stop()
            daemon.start()  # handles of protected namespaces last one daemon run: the client opens again
            train(make, data(), connection=conn, epochs=1, freeze=((0, 2),))
            assert conn.stats.hits == hits + N
        with ac.connect(daemon.socket, namespace="private", secret="wrong", strict=True) as other:
            with pytest.raises(PermissionDenied):
                other.lookup(b"0" * 16, 2, [0], [0])
