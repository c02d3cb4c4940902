"""Training on a GPU with the frozen prefix served by a real daemon: pinned staging, side-stream copies.

These need CUDA and are skipped without it; the same logic runs on CPU in
tests/client/test_device_staging.py (fake events) and the CPU training tests.
"""

from __future__ import annotations

import gc
import time
import uuid
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import actcache_client as ac
from actcache.shm import MIN_RING_BYTES, ClientSegment, ShmRing, SlotRun
from actcache.testing import run_daemon
from actcache_client.models import resnet20
from actcache_client.transport._device_staging import Stager
from actcache_client.transport._tensors import collate_entries, encode_samples
from tests.integration import test_training as cpu

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="CUDA unavailable: GPU staging and training need a GPU")

N, BATCH = 256, 32


@pytest.fixture
def deterministic():
    """Bitwise-repeatable kernels, so cache-on and cache-off runs can be compared closely."""
    saved = (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark,
             torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark,
     torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32) = saved


@pytest.fixture
def tf32():
    """PyTorch's default on CUDA for convolutions, for matrix products too: float32 computed in TF32."""
    saved = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = True
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def train(connection, epochs: int = 3, *, frozen: int = 5, audit: ac.AuditConfig | bool = True):
    """ResNet-20 on CUDA, ``frozen`` stages frozen from the start; losses, final weights and the model."""
    torch.manual_seed(0)
    staged = ac.from_resnet(resnet20()).to("cuda")
    model = ac.CachedForward(staged, connection, audit=audit)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(N, 3, 32, 32, generator=g), torch.randint(0, 10, (N,), generator=g))
    loader = ac.CachedLoader(
        DataLoader(ac.IndexedDataset(data, targets=data.tensors[1]), batch_size=BATCH, shuffle=True,
                   generator=torch.Generator().manual_seed(1), pin_memory=True),
        model,
    )
    opt = torch.optim.SGD([p for p in staged.parameters() if p.requires_grad], lr=0.05)
    model.set_frozen(frozen)
    losses = []
    for _ in range(epochs):
        for batch in loader:
            out = model(batch)
            assert out.is_cuda
            loss = nn.functional.cross_entropy(out, batch.data[1].to("cuda", non_blocking=True))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        if connection is not None:
            connection.flush(timeout_s=30)
    return losses, staged, model


def test_cuda_training_with_the_cache_matches_recomputing(daemon, deterministic):
    off_losses, off_staged, _ = train(None)
    with ac.connect(daemon.socket, namespace=f"t-{uuid.uuid4().hex[:8]}", strict=True) as conn:
        on_losses, on_staged, model = train(conn)
        epochs = model.epoch_counters()
    assert max(abs(a - b) for a, b in zip(off_losses, on_losses)) < 1e-4
    for (name, p), q in zip(off_staged.state_dict().items(), on_staged.state_dict().values()):
        assert torch.allclose(p.float(), q.float(), atol=1e-4), name
    # Epochs after the first are served whole from the daemon's stream, without loading their inputs.
    for epoch in epochs[1:]:
        assert epoch.times.cached_samples == N
        assert epoch.times.raw_loaded == epoch.times.audited_samples
    assert model.times.audited_samples > 0  # audits recomputed hits on the GPU and found them equal (strict)
    assert model.stager.ring_copies > 0  # served batches went to the GPU straight out of the shared-memory ring


def test_cuda_audits_accept_entries_computed_in_tf32_at_another_batch_size(daemon, tf32):
    """Stored from batches of 32, audited 8 at a time: TF32 kernels differ, the entries are still the same."""
    audit = ac.AuditConfig(first_samples=0, every=4, group=8)
    with ac.connect(daemon.socket, namespace=f"t-{uuid.uuid4().hex[:8]}", strict=True) as conn:
        _, _, model = train(conn, epochs=2, frozen=10, audit=audit)  # strict: a flagged entry raises
        served = model.epoch_counters()[1].times
    assert served.cached_samples == N
    assert served.audited_samples == N // 4


def test_cuda_stager_never_overwrites_a_slot_still_being_copied():
    """Many distinct batches through a 2-slot pinned ring, none synchronised until the end."""
    stager = Stager("cuda", slots=2)
    batches = [torch.full((64, 256, 256), float(i)) for i in range(12)]  # 16 MiB each: copies take a while
    moved = [stager.to_device(collate_entries(encode_samples(x), alloc=stager.allocator())) for x in batches]
    torch.cuda.synchronize()
    for i, out in enumerate(moved):
        assert out.is_cuda and bool((out == float(i)).all()), i
    readings = stager.copy_readings()
    assert readings and all(nbytes == 64 * 256 * 256 * 4 and seconds > 0 for nbytes, seconds in readings)


def test_stagers_copy_batches_straight_out_of_a_reused_shared_memory_ring():
    """Two CachedForwards on one connection take turns with one reused ring, mapped again each time."""
    ring = ShmRing(MIN_RING_BYTES, start=0)  # in shared memory, as the daemon makes them
    size, count = 1024, 8
    offset = ring.alloc(0, size * count)
    ring.view(offset, size * count)[:] = bytes(range(256)) * (size * count // 256)
    first, second = Stager("cuda"), Stager("cuda")
    for _ in range(2):
        segment = ClientSegment(str(ring.path))
        rows = [stager.ring_to_device(SlotRun(segment, offset, size), count)[0] for stager in (first, second)]
        assert torch.equal(rows[0], rows[1]) and rows[0].cpu().flatten()[:256].tolist() == list(range(256))
        del segment, rows
        gc.collect()
    torch.zeros(1, device="cuda").add_(1)  # no CUDA error left behind for a kernel launch
    assert first.ring_copies == second.ring_copies == 2
    ring.close()


@pytest.mark.parametrize("name", ["sequential-cnn", "tiny-bert"])
def test_cuda_freeze_changes_seeding_and_unfreeze_train_as_without_the_cache(daemon, deterministic, name):
    """Deeper freezes seeded from shallower entries, an unfreeze and a refreeze, on the GPU (text: VarLen)."""
    make, data, options = cpu.MODELS[name]
    options = {k: v for k, v in options.items() if k != "freeze"}
    freeze = ((0, 1), (1, 2), (3, 0), (4, 2))
    off = cpu.train(make, data(), connection=None, epochs=6, freeze=freeze, device="cuda", **options)
    with ac.connect(daemon.socket, namespace=f"t-{uuid.uuid4().hex[:8]}", strict=True) as conn:
        on = cpu.train(make, data(), connection=conn, epochs=6, freeze=freeze, device="cuda", **options)
        assert conn.stats.hits > 0
        assert on[2].times.seeded_samples > 0  # depth 2 started from the depth-1 entries
    cpu.assert_same_training(off, on, atol=1e-4)


def test_cuda_daemon_killed_mid_epoch_training_completes(tmp_path, deterministic):
    make, data, _ = cpu.MODELS["sequential-cnn"]
    off = cpu.train(make, data(), connection=None, epochs=6, device="cuda")
    with run_daemon(cache_dir=tmp_path / "cache") as daemon:
        with ac.connect(daemon.socket, namespace="survivor", backoff_s=0.05, timeout_s=2) as conn:
            def chaos(step):  # 6 steps an epoch; epoch 1 stores its entries, epoch 2 reads them
                if step == 15:
                    daemon.kill()
                if step == 20:
                    daemon.start()
                    time.sleep(1.5)  # past gRPC's reconnect backoff

            with pytest.warns(ac.CacheFallbackWarning, match="unavailable"):
                on = cpu.train(make, data(), connection=conn, epochs=6, on_step=chaos, device="cuda")
            assert conn.stats.fallbacks["unavailable"] >= 1
    cpu.assert_same_training(off, on, atol=1e-4)


def test_cuda_two_models_on_one_connection_take_turns_with_its_rings(daemon):
    """bench_step's pattern: two CachedForwards share a connection, so a ring one stream used is reused by
    the other's; every epoch after the fill is served whole."""
    torch.manual_seed(0)
    staged = ac.from_resnet(resnet20()).to("cuda")
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(N, 3, 32, 32, generator=g), torch.randint(0, 10, (N,), generator=g))
    with ac.connect(daemon.socket, namespace=f"t-{uuid.uuid4().hex[:8]}", strict=True) as conn:
        models = [ac.CachedForward(staged, conn), ac.CachedForward(staged, conn, audit=False)]
        loaders = [ac.CachedLoader(DataLoader(ac.IndexedDataset(data, targets=data.tensors[1]), batch_size=BATCH,
                                              shuffle=True, generator=torch.Generator().manual_seed(i),
                                              pin_memory=True), m) for i, m in enumerate(models)]
        for m in models:
            m.set_frozen(10)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            with torch.no_grad():
                for batch in loaders[0]:  # fills the cache
                    models[0](batch)
                conn.flush(timeout_s=30)
                for _ in range(3):
                    for model, loader in zip(models, loaders):
                        for batch in loader:
                            assert model(batch).is_cuda
        torch.cuda.synchronize()
        for model in models:
            assert [e.times.cached_samples for e in model.epoch_counters()][-3:] == [N, N, N]
            assert model.stager.ring_copies > 0


def test_cuda_grad_norms_of_a_stage_without_gradients_are_zero_beside_the_gpu_ones():
    from actcache_client.freeze.autofreeze import GradNormAccumulator

    used, unused = nn.Linear(2, 2).cuda(), nn.Linear(2, 2).cuda()
    acc = GradNormAccumulator([used, unused])
    for p in used.parameters():
        p.grad = torch.ones_like(p)
    acc.add()
    assert acc.norms() == [6.0, 0.0]


def test_cuda_the_planners_clock_times_stages_with_events():
    """Stage times for the cost model are taken as the device runs the kernels, not at their launch."""
    stager = Stager("cuda")
    began = stager.clock.start()
    assert isinstance(began, torch.cuda.Event)
    x = torch.randn(4096, 4096, device="cuda")
    for _ in range(4):
        x = x @ x / 4096
    stager.clock.stop(began, "matmuls")
    torch.cuda.synchronize()
    ((payload, seconds),) = stager.clock.readings()
    assert payload == "matmuls" and seconds > 0


def _count_syncs(run) -> int:
    """Synchronising CUDA calls made by ``run()`` (torch's sync debug mode warns on each)."""
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def test_cuda_a_served_step_syncs_the_host_no_more_than_the_users_loop(daemon):
    """The loop moves its batch with x.to("cuda"); the served steps add no host sync to the loop's own."""
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(N, 3, 32, 32, generator=g), torch.randint(0, 10, (N,), generator=g))

    def epoch(net, loader, opt):
        for x, y in loader:
            loss = nn.functional.cross_entropy(net(x.to("cuda", non_blocking=True)), y.to("cuda", non_blocking=True))
            opt.zero_grad()
            loss.backward()
            opt.step()

    counts = []
    for cached in (False, True):
        torch.manual_seed(0)
        net = resnet20().cuda()
        opt = torch.optim.SGD(net.parameters(), lr=0.05)
        loader = DataLoader(data, batch_size=BATCH, pin_memory=True)
        with ac.connect(daemon.socket, namespace=f"t-{uuid.uuid4().hex[:8]}", strict=True) as conn:
            if cached:
                cache = ac.ActCache(net, conn, planner=None, audit=False)
                loader = cache.wrap(loader)
                cache.freeze(5)
            else:
                for m in (net.conv1, net.bn1, *net.layer1):
                    m.requires_grad_(False).eval()
            epoch(net, loader, opt)  # fills the cache
            conn.flush(timeout_s=30)
            torch.cuda.synchronize()
            counts.append(_count_syncs(lambda net=net, loader=loader, opt=opt: epoch(net, loader, opt)))
            if cached:
                assert conn.stats.hits == N
    assert counts[1] <= counts[0], counts


def test_cuda_a_shared_memory_ring_is_page_locked_once_and_unlocked_before_it_is_unmapped():
    ring = ShmRing(MIN_RING_BYTES, start=0)
    size, count = 1024, 8
    offset = ring.alloc(0, size * count)
    ring.view(offset, size * count)[:] = bytes(range(256)) * (size * count // 256)
    segment = ClientSegment(str(ring.path))
    stager = Stager("cuda")
    for _ in range(2):
        rows, done = stager.ring_to_device(SlotRun(segment, offset, size), count)
        done.synchronize()
    assert segment.page_locked and len(segment.on_close) == 1  # registered once, for both copies
    assert torch.frombuffer(segment.view, dtype=torch.uint8, count=1).is_pinned()
    assert bytes(rows.cpu().flatten().numpy()) == bytes(ring.view(offset, size * count))
    segment.close()  # unregisters, then unmaps
    ring.close()
