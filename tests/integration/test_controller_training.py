"""The freeze controller driving real training with a real daemon: Egeria on CIFAR images, resume."""

from __future__ import annotations

import uuid

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import actcache_client as ac
from actcache_client.freeze import EgeriaConfig, EgeriaPolicy, FreezeController, ReferenceConfig, StaticPolicy
from tests.cifar import cifar_subset

pytestmark = pytest.mark.slow  # seconds per test: make test runs them, make test-fast does not

MAX_STEPS = 3000  # a bound on the loop, not an expectation: the freeze usually comes after a few hundred
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                reason="CUDA unavailable: the GPU variant needs a GPU"))]


def small_cnn() -> ac.StagedModel:
    return ac.from_sequential(small_net(), groups=[3, 3, 3, 3])


def small_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10),
    )


def loader_for(dataset, model) -> ac.CachedLoader:
    return ac.CachedLoader(DataLoader(ac.IndexedDataset(dataset), batch_size=32, shuffle=True,
                                      generator=torch.Generator().manual_seed(1)), model)


def run_epoch(loader, cached, opt, ctl) -> int:
    steps = 0
    for batch in loader:
        x, y = batch.data
        out = cached(batch.ids, x, variant=batch.variant)
        loss = nn.functional.cross_entropy(out, y.to(out.device))
        opt.zero_grad()
        loss.backward()
        opt.step()
        ctl.step(loss, epoch=batch.epoch)
        steps += 1
    return steps


@pytest.mark.parametrize("device", DEVICES)
def test_egeria_freezes_a_stage_of_a_cnn_on_real_images_without_waiting_for_the_reference(daemon, tmp_path, device):
    dataset, source = cifar_subset(per_class=32)
    staged = small_cnn().to(device)  # on CUDA the reference process still gets CPU copies of the stages
    with ac.connect(daemon.socket, namespace=f"egeria-{uuid.uuid4().hex[:8]}", strict=True) as conn:
        cached = ac.CachedForward(staged, conn)
        loader = loader_for(dataset, cached)
        opt = torch.optim.SGD(staged.parameters(), lr=0.05, momentum=0.9)
        policy = EgeriaPolicy(EgeriaConfig(window=3))
        with FreezeController(cached, opt, policy, eval_every=4, timeline=str(tmp_path / "timeline.jsonl"),
                              reference=ReferenceConfig(max_cpu_percent=None)) as ctl:
            steps = 0
            while ctl.frozen == 0 and steps < MAX_STEPS:
                steps += run_epoch(loader, cached, opt, ctl)
            assert ctl.frozen >= 1, f"no freeze in {steps} steps on {source} data: {ctl.reference_stats}"
            assert ctl.step_count == steps  # every step ran: the loop never waited for a reading
            stats = ctl.reference_stats
            # Stage 0 froze on plasticity: 3 calibrating + W low readings at least.
            assert stats.readings >= 3 + 3 and stats.submitted >= stats.readings
            intervals = stats.submitted + stats.skipped_full + stats.skipped_busy
            assert intervals <= ctl.evaluations + 1  # at most one probe (or counted skip) per interval
            records = ctl.timeline.records
            freeze = next(r for r in records if r.get("decision") == "freeze_next")
            assert freeze["signal"] == "plasticity" and freeze["stage"] == 0 and freeze["frozen"] == 1
            assert freeze["active_param_share"] < 1.0 and freeze["smoothed"] is not None
            built = [r for r in records if r["event"] == "reference"]
            assert built and built[0]["stage"] == 0 and built[0]["ms_per_batch"] > 0
            print(f"{source}: froze stage 0 at step {freeze['step']}; reference {stats}")
        # The frozen prefix is now served from the cache: stored in one epoch, hit in the next.
        for _epoch in range(2):
            conn.flush(timeout_s=30)
            hits = conn.stats.hits
            for batch in loader:
                x, y = batch.data
                loss = nn.functional.cross_entropy(cached(batch.ids, x), y.to(device))
                opt.zero_grad()
                loss.backward()
                opt.step()
        assert conn.stats.hits - hits == len(dataset)


def test_egeria_gets_its_readings_from_a_network_that_serves_its_prefix_in_place(daemon, tmp_path):
    """The user's loop calls its own network: the stage adapters the probe compares never run there."""
    dataset, source = cifar_subset(per_class=32)
    net = small_net()
    with ac.connect(daemon.socket, namespace=f"inplace-{uuid.uuid4().hex[:8]}", strict=True) as conn:
        cache = ac.ActCache(net, conn, stages=ac.from_sequential(net, groups=[3, 3, 3, 3]))
        loader = cache.wrap(DataLoader(dataset, batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(1)))
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        with FreezeController(cache.model, opt, EgeriaPolicy(EgeriaConfig(window=3)), eval_every=4,
                              reference=ReferenceConfig(max_cpu_percent=None)) as ctl:
            steps, probed_at_1 = 0, None
            while (probed_at_1 is None or ctl.reference_stats.submitted == probed_at_1) and steps < MAX_STEPS:
                for x, y in loader:
                    loss = nn.functional.cross_entropy(net(x), y)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    ctl.step(loss, epoch=loader.epoch)
                    steps += 1
                    if ctl.frozen == 1 and probed_at_1 is None:
                        probed_at_1 = ctl.reference_stats.submitted
            stats = ctl.reference_stats
            assert ctl.frozen >= 1, f"no freeze in {steps} steps on {source} data: {stats}"
            freeze = next(r for r in ctl.timeline.records if r.get("decision") == "freeze_next")
            assert freeze["stage"] == 0 and freeze["signal"] == "plasticity" and stats.readings >= 3 + 3
            # Stage 1's probe came from the prefix served inside the network.
            assert stats.submitted > probed_at_1, f"no probe of stage 1 in {steps} steps: {stats}"


def test_a_resumed_run_keeps_its_frozen_prefix_and_its_cache(daemon, tmp_path):
    dataset, _ = cifar_subset(per_class=8)
    namespace = f"resume-{uuid.uuid4().hex[:8]}"
    with ac.connect(daemon.socket, namespace=namespace, strict=True) as conn:
        staged = small_cnn()
        cached = ac.CachedForward(staged, conn)
        opt = torch.optim.SGD(staged.parameters(), lr=0.05, momentum=0.9)
        ctl = FreezeController(cached, opt, StaticPolicy(stages=2, at_step=2), eval_every=1)
        loader = loader_for(dataset, cached)
        run_epoch(loader, cached, opt, ctl)  # 3 steps: frozen at step 2, entries stored from step 3
        run_epoch(loader, cached, opt, ctl)  # the rest of the entries
        conn.flush(timeout_s=30)
        checkpoint = {"model": staged.state_dict(), "opt": opt.state_dict(), "ctl": ctl.state_dict()}
        torch.save(checkpoint, tmp_path / "ckpt.pt")
        fingerprint = cached.weights_fingerprint()
    checkpoint = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    with ac.connect(daemon.socket, namespace=namespace, strict=True) as conn:
        staged = small_cnn()
        staged.load_state_dict(checkpoint["model"])
        cached = ac.CachedForward(staged, conn)
        opt = torch.optim.SGD(staged.parameters(), lr=0.05, momentum=0.9)
        opt.load_state_dict(checkpoint["opt"])
        ctl = FreezeController(cached, opt, StaticPolicy(stages=2, at_step=2), eval_every=1)
        ctl.load_state_dict(checkpoint["ctl"])
        assert ctl.frozen == 2 and cached.weights_fingerprint() == fingerprint
        run_epoch(loader_for(dataset, cached), cached, opt, ctl)
        assert conn.stats.hits == len(dataset) and conn.stats.misses == 0
