"""Training reads the daemon's stream of its pushed order: freeze changes, re-plans, ranks, workers, resume."""

from __future__ import annotations

import struct
import uuid

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import actcache_client as ac
from actcache.errors import DaemonUnavailable
from actcache.testing import wait_until

N, BATCH = 96, 16


def mlp() -> ac.StagedModel:
    torch.manual_seed(0)
    return ac.from_sequential(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3)))


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(N, 8, generator=g), torch.randint(0, 3, (N,), generator=g))


def namespace() -> str:
    return f"t-{uuid.uuid4().hex[:8]}"


def forward_epoch(model: ac.CachedForward, loader: ac.CachedLoader, *, on_batch=None) -> None:
    """One epoch of forward passes (the weights stay as they are, so fingerprints stay valid)."""
    with torch.no_grad():
        for batch in loader:
            x, _ = batch.data
            model(batch.ids, x, variant=batch.variant)
            if on_batch is not None:
                on_batch(batch.position)


def cached_loader(model, **options) -> ac.CachedLoader:
    options.setdefault("shuffle", True)
    options.setdefault("generator", torch.Generator().manual_seed(1))
    return ac.CachedLoader(DataLoader(ac.IndexedDataset(data()), batch_size=BATCH, **options), model)


def test_a_cached_epoch_is_served_by_the_stream_ready_when_asked(daemon):
    with ac.connect(daemon.socket, namespace=namespace(), strict=True) as conn:
        model = ac.CachedForward(mlp(), conn)
        loader = cached_loader(model)
        model.set_frozen(2)
        forward_epoch(model, loader)  # stores every entry
        before = conn.rpc().stats()
        forward_epoch(model, loader)
        forward_epoch(model, loader)  # its order was pushed halfway through the previous epoch
        after = conn.rpc().stats()
        assert conn.stats.gets == 0 and conn.stats.streamed == 3 * N and conn.stats.hits == 2 * N
        assert model.times.cached_samples == 2 * N and model.times.prefix_samples == 3 * N
        epochs = model.epoch_counters()
        assert [e.epoch for e in epochs] == [0, 1, 2]
        assert [e.times.cached_samples for e in epochs] == [0, N, N]
        assert [e.times.computed_samples for e in epochs] == [N, 0, 0]
        assert all(e.times.prefix_samples == N for e in epochs)
        assert [e.entries["hits"] for e in epochs] == [0, N, N]
        assert sum(e.entries["puts"] for e in epochs) == N  # asynchronous: counted when the daemon acknowledged
        ns = conn.config.namespace
        ready = [p.counters.ready_on_ask for p in after.prefetch if p.namespace == ns][0] - \
            [p.counters.ready_on_ask for p in before.prefetch if p.namespace == ns][0]
        assert ready > 0
        # pushes: the second epoch's at its start (the first one stored entries), then each next epoch's
        # halfway through the one before, adopted at its start without a second push
        # (the next epoch's push runs beside the step: wait for it)
        wait_until(lambda: conn.rpc().stats().schedules_total - before.schedules_total == 3, what="3 pushes")


def test_a_freeze_change_mid_epoch_re_pushes_the_rest_and_a_same_target_replan_keeps_it(daemon):
    with ac.connect(daemon.socket, namespace=namespace(), strict=True) as conn:
        model = ac.CachedForward(mlp(), conn)
        loader = cached_loader(model)
        model.set_frozen(3)
        forward_epoch(model, loader)  # depth-3 entries
        model.set_frozen(2)
        forward_epoch(model, loader)  # depth-2 entries
        pushes = conn.rpc().stats().schedules_total
        hits, gets = model.times.cached_samples, conn.stats.gets

        def switch(position: int) -> None:
            if position == 1:
                model.set_frozen(2)  # the same target: the stream goes on
                assert conn.rpc().stats().schedules_total == pushes + 1
            if position == 2:
                model.set_frozen(3)  # another depth: the rest of the epoch is pushed again

        forward_epoch(model, loader, on_batch=switch)
        # the epoch's push, the re-push at the new depth, and the next epoch's (halfway, at batch 3)
        wait_until(lambda: conn.rpc().stats().schedules_total == pushes + 3, what="3 pushes")
        assert model.times.cached_samples - hits == N  # every batch hit, before and after the switch
        assert conn.stats.gets == gets


@pytest.mark.slow
def test_two_ranks_with_workers_stream_their_own_orders_and_resume_mid_epoch(daemon):
    dataset = ac.IndexedDataset(data())
    with ac.connect(daemon.socket, namespace=namespace(), strict=True) as conn:
        def rank_loader(rank: int, model):
            sampler = DistributedSampler(dataset, num_replicas=2, rank=rank, shuffle=True, seed=3)
            return ac.CachedLoader(DataLoader(dataset, batch_size=8, sampler=sampler, num_workers=2,
                                              persistent_workers=True), model)

        ranks = [ac.CachedForward(mlp(), conn) for _ in range(2)]
        loaders = [rank_loader(r, m) for r, m in enumerate(ranks)]
        for m in ranks:
            m.set_frozen(2)
        for epoch in range(2):
            for m, loader in zip(ranks, loaders):
                loader.set_epoch(epoch)
                forward_epoch(m, loader)
        assert sum(m.times.cached_samples for m in ranks) == N  # the second epoch hit on both ranks
        assert conn.stats.gets == 0

        # rank 0 stops after 2 batches of epoch 2 and resumes in a new loader and model
        loaders[0].set_epoch(2)
        with torch.no_grad():
            for i, batch in enumerate(loaders[0]):
                ranks[0](batch.ids, batch.data[0])
                if i == 1:
                    state = loaders[0].state_dict()
                    break
        resumed = ac.CachedForward(mlp(), conn)
        loader = rank_loader(0, resumed)
        loader.load_state_dict(state)
        resumed.set_frozen(2)
        forward_epoch(resumed, loader)
        assert resumed.times.cached_samples == resumed.times.prefix_samples == N // 2 - 16
        assert conn.stats.gets == 0


@pytest.mark.parametrize("generator", [True, False])
@pytest.mark.parametrize("workers", [0, 2])
def test_the_wrapped_loaders_order_is_kept(daemon, generator, workers):
    """The same seed gives the same batches with and without actcache."""
    dataset = ac.IndexedDataset(data())

    def plain_loader():
        torch.manual_seed(5)
        return DataLoader(dataset, batch_size=BATCH, shuffle=True, num_workers=workers, persistent_workers=workers > 0,
                          generator=torch.Generator().manual_seed(1) if generator else None)

    plain = plain_loader()
    expected = [[ids.tolist() for ids, _ in plain] for _ in range(3)]
    after_plain = torch.rand(())
    with ac.connect(daemon.socket, namespace=namespace(), strict=True) as conn:
        model = ac.CachedForward(mlp(), conn)  # mlp() seeds the global RNG: before plain_loader() seeds it again
        loader = ac.CachedLoader(plain_loader(), model)
        got = [[b.ids.tolist() for b in loader] for _ in range(3)]
    assert got == expected
    assert torch.equal(torch.rand(()), after_plain)  # the global RNG advanced alike


def test_a_miss_after_the_next_epoch_was_pushed_makes_it_push_again(daemon):
    """One batch per epoch: the next epoch's order is pushed before the step runs; its misses then
    discard that push, and the next epoch pushes again once the entries are stored."""
    with ac.connect(daemon.socket, namespace=namespace(), strict=True) as conn:
        model = ac.CachedForward(mlp(), conn)
        loader = ac.CachedLoader(DataLoader(ac.IndexedDataset(data()), batch_size=N, shuffle=True,
                                            generator=torch.Generator().manual_seed(1)), model)
        model.set_frozen(2)
        for _ in range(3):
            forward_epoch(model, loader)
        assert [e.times.cached_samples for e in model.epoch_counters()] == [0, N, N]


def test_a_stream_that_closing_cuts_short_is_no_fallback(daemon, caplog, recwarn):
    """The next epoch's stream, read ahead in a thread, fails once the connection closes under it: closing
    is no failure of the cache (no warning, no count; no raise in strict mode)."""
    conn = ac.connect(daemon.socket, namespace=namespace(), strict=True)
    model = ac.CachedForward(mlp(), conn)
    loader = cached_loader(model)
    model.set_frozen(2)
    forward_epoch(model, loader)
    forward_epoch(model, loader)  # pushes the next epoch's order halfway, and opens its stream ahead
    conn.close()
    conn.fallback(DaemonUnavailable("Stream removed (Channel closed!)"))  # what the thread ahead then reports
    assert conn.stats.fallbacks == {}
    assert not [r for r in caplog.records if "recomputing" in r.getMessage()]
    assert not [w for w in recwarn if issubclass(w.category, ac.CacheFallbackWarning)]


def test_the_shared_memory_ring_holds_a_few_batches_within_bounds_and_frames_hold_one():
    from actcache_client.transport._epoch_stream import _MAX_RING, _MIN_RING, _sizes

    assert _sizes([b"x" * 16384] * 128 + [None], 128) == (8 << 20, 2 << 20)  # 4 batches of 128 x 16 KiB
    assert _sizes([b"x" * 16464] * 128, 128) == (4 * 128 * 16464, 128 * 16464)  # whole frames, not whole MiB
    ring, frame = _sizes([b"x" * 100], 32)
    assert frame == 3200 and ring % frame == 0 and _MIN_RING <= ring < _MIN_RING + frame
    assert _sizes([None, None], 32) is None  # nothing to go by: the sizes stay
    assert _sizes([b"x" * (1 << 20)], 512)[0] == _MAX_RING


def test_held_slots_are_released_only_after_their_copy_completes(daemon):
    """A batch copied asynchronously out of the ring (CUDA) is held: the stream waits for the copy's
    event before it asks for the next frame, which releases the batch's slots to the daemon."""
    from actcache_client.transport._epoch_stream import EpochStream, Target

    with ac.connect(daemon.socket, namespace=namespace(), strict=True) as conn:
        model = ac.CachedForward(mlp(), conn)
        loader = cached_loader(model, shuffle=False)
        model.set_frozen(2)
        forward_epoch(model, loader)  # stores every entry
        conn.flush(timeout_s=30)
        batches = [list(range(lo, lo + BATCH)) for lo in range(0, N, BATCH)]
        stream = EpochStream(conn)
        stream.push(Target(model.fingerprint(2), 2, 1.0), 0, batches, 0)
        for position, ids in enumerate(batches):  # the first stream learns the entries' size: frames of one batch
            stream.take(position, ids)
        stream.push(Target(model.fingerprint(2), 2, 1.0), 0, batches, 0)
        assert len(stream.take(0, batches[0])) == BATCH
        run = stream.run
        assert run is not None  # hits of one size in consecutive slots

        class Copy:
            """Stands in for the CUDA event of a copy still reading the batch's slots."""

            released_then: int | None = None

            def synchronize(self) -> None:
                Copy.released_then = struct.unpack_from("<Q", run.segment.view, 16)[0]  # the segment's `released`

        stream.hold(Copy())
        with daemon.client() as client:  # the frames the ring holds arrive meanwhile

            def served() -> int:  # a schedule served to its end is retired from Stats (a reused ring held it all)
                return next((s.served for s in client.stats().schedules if s.schedule_id == stream.schedule_id), N)

            wait_until(lambda: served() > BATCH, what="frames beyond the held batch")
        assert len(stream.take(1, batches[1])) == BATCH
        assert Copy.released_then is not None and Copy.released_then < BATCH  # batch 0 still held when it waited
        stream.hold(Copy())
        Copy.released_then = None
        stream.close()
        assert Copy.released_then is not None  # closing (the ring goes back for reuse) waits too
