"""ActCache in a plain loop: the loop and its batches stay the user's, and the cache changes no result."""

from __future__ import annotations

import itertools
import sys
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

import actcache_client as ac
from actcache.errors import ConfigError
from actcache_client.models import resnet20

pytestmark = pytest.mark.slow  # seconds per test: make test runs them, make test-fast does not

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


class Images(Dataset):
    """Random 3x8x8 images with a ``targets`` list; ``augment``: a random flip drawn from torch's global RNG."""

    def __init__(self, n: int = 96, augment: bool = False) -> None:
        g = torch.Generator().manual_seed(0)
        self.images = torch.randn(n, 3, 8, 8, generator=g)
        self.targets = torch.randint(0, 10, (n,), generator=g).tolist()
        self.augment = augment

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        x = self.images[i]
        if self.augment and torch.rand(()) < 0.5:
            x = x.flip(-1)
        return x, self.targets[i]


def _sgd_step(net: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> float:
    loss = F.cross_entropy(net(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


def _cached_run(daemon):
    """The reference run's network, optimizer, ActCache and wrapped loader (seeded as ``_train``)."""
    torch.manual_seed(0)
    net = resnet20()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    cache = ac.ActCache(net, _connect(daemon), planner=None)
    loader = cache.wrap(DataLoader(Images(), batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(1)))
    return net, opt, cache, loader


def _connect(daemon) -> ac.Connection:
    return ac.connect(daemon.socket, namespace=f"dropin-{uuid.uuid4().hex[:8]}", strict=True)


def _train(daemon, *, epochs: int = 3, cached: bool = True, dataset: Dataset | None = None, variants: int | None = None,
           change_input: bool = False, sizes: list | None = None, disabled: bool = False,
           planner: ac.CachePlanner | None = None):
    """Losses of a plain loop freezing the stem + layer1 after epoch 0; with ``cached``, through ActCache."""
    torch.manual_seed(0)
    net = resnet20()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    loader = DataLoader(dataset or Images(), batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(1))
    cache = None
    if cached:
        cache = ac.ActCache(net, _connect(daemon), planner=planner)
        loader = cache.wrap(loader, variants=variants)
        if disabled:
            cache.model.loader_side.disable("the comparison run")
    losses = []
    for epoch in range(epochs):
        net.train()
        if epoch >= 1:
            if cache is not None:
                cache.freeze(4)
            else:
                for m in (net.conv1, net.bn1, net.layer1):
                    m.requires_grad_(False).eval()
        for x, y in loader:
            if sizes is not None:
                sizes.append((x.shape[0], len(y)))
            if change_input:
                x = x * 1.0 + 0.0 if epoch == 0 else x + 1.0
            losses.append(_sgd_step(net, opt, x, y))
    return losses, cache, loader


@pytest.fixture(scope="module")
def reference(daemon):
    return _train(daemon, cached=False)[0]


def test_the_cache_serves_the_prefix_and_changes_no_loss(daemon, reference):
    sizes: list = []
    losses, cache, loader = _train(daemon, sizes=sizes)
    assert losses == reference
    assert all(n == 32 and t == 32 for n, t in sizes)  # x keeps the batch size from the first step to the last
    assert cache.connection.stats.hits == 96  # epoch 1 computed and stored the prefix, epoch 2 was served
    assert loader.cached.raw_items_loaded < 3 * 96 - 64  # and most of epoch 2's inputs were not loaded
    cache.close()


def test_a_write_epoch_stores_the_prefix_as_the_network_computes_it(daemon, reference, monkeypatch):
    """The write epoch's frozen prefix comes out of the network's own modules, not the stage adapters; the epoch
    after it is served those entries and trains to the same losses."""
    from actcache_client.engine._assembly import PrefixAssembly

    assembled = []  # frozen prefixes run by the cache's own stage adapters
    compute = PrefixAssembly._compute
    monkeypatch.setattr(PrefixAssembly, "_compute", lambda self, *a, **k: assembled.append(1) or compute(self, *a, **k))
    losses, cache, _ = _train(daemon)
    assert losses == reference
    assert assembled == []  # no planner: no step is timed through them
    assert cache.connection.stats.puts == 96 and cache.connection.stats.hits == 96
    assert cache.model.times.computed_samples == 96 and cache.model.times.cached_samples == 96
    cache.close()


def test_the_write_steps_the_cost_model_times_are_timed_as_the_network_runs_them(daemon, reference, monkeypatch):
    from actcache_client.engine._assembly import PrefixAssembly

    assembled = []  # frozen prefixes run by the cache's own stage adapters
    compute = PrefixAssembly._compute
    monkeypatch.setattr(PrefixAssembly, "_compute", lambda self, *a, **k: assembled.append(1) or compute(self, *a, **k))
    planner = ac.CachePlanner()
    losses, cache, _ = _train(daemon, planner=planner)
    assert losses == reference
    assert assembled == []  # the timed steps too ran the network's own modules
    measured = planner.measurements(4)
    assert measured is not None and all(s > 0 for s in measured.stage_forward_s_per_sample)  # each stage timed
    assert list(measured.entry_bytes_per_sample[1:]) == [16 * 8 * 8 * 4] * 4  # each stage's output: 16x8x8 float32
    assert cache.connection.stats.puts == 96 and cache.connection.stats.hits == 96
    cache.close()


def test_a_declined_cache_lets_the_network_run_its_frozen_modules_and_times_a_few_steps(daemon, monkeypatch):
    from actcache_client.cost_model import PlanMode
    from actcache_client.engine._assembly import PrefixAssembly

    assembled = []  # frozen prefixes run by the cache's own stage adapters (timed for the cost model)
    compute = PrefixAssembly._compute
    monkeypatch.setattr(PrefixAssembly, "_compute", lambda self, *a, **k: assembled.append(1) or compute(self, *a, **k))
    expected = _train(daemon, cached=False, epochs=8)[0]
    planner = ac.CachePlanner(ac.PlannerConfig(min_gain=1.0))  # caching never gains enough: the plan recomputes
    losses, cache, _ = _train(daemon, epochs=8, planner=planner)
    assert losses == expected
    assert cache.model.plan is not None and cache.model.plan.mode is PlanMode.RECOMPUTE
    assert cache.connection.stats.hits == 0
    frozen_steps = 7 * 3
    assert cache.model.times.computed_samples == frozen_steps * 32  # every frozen step counted
    assert 1 <= len(assembled) <= frozen_steps // 4  # the other steps ran the network's own modules
    cache.close()


def test_evaluation_runs_the_network_and_never_touches_the_cache(daemon):
    _, cache, loader = _train(daemon, epochs=2)
    net = cache.net
    cache.connection.flush()  # puts are sent by a writer thread: count them all before looking
    before = (cache.connection.stats.hits, cache.connection.stats.misses, cache.connection.stats.puts)
    net.eval()
    x = Images().images[:16]
    with torch.no_grad():
        served = net(x)
    assert (cache.connection.stats.hits, cache.connection.stats.misses, cache.connection.stats.puts) == before
    assert cache.frozen == 4 and torch.isfinite(served).all()
    cache.close()


def test_an_input_changed_in_the_loop_is_computed_not_served(daemon):
    expected = _train(daemon, cached=False, change_input=True)[0]
    with pytest.warns(ac.ChangedInputWarning, match="Move input transforms into the dataset"):
        losses, cache, _ = _train(daemon, change_input=True)
    assert losses == expected
    cache.close()


def test_random_augmentation_in_getitem_is_cached_per_variant(daemon):
    with pytest.warns(UserWarning, match="pass variants=K"):
        _, cache, loader = _train(daemon, dataset=Images(augment=True), epochs=2)
    assert not loader.cached.cacheable and cache.connection.stats.hits == 0
    cache.close()
    losses, cache, loader = _train(daemon, dataset=Images(augment=True), variants=1)
    assert cache.connection.stats.hits == 96
    cache.close()
    # The same seeded draws with the cache switched off: what the cache served is what the model computes.
    off, cache, _ = _train(daemon, dataset=Images(augment=True), variants=1, disabled=True)
    assert cache.connection.stats.hits == 0 and off == losses
    cache.close()


def test_a_network_wrapped_in_data_parallel_is_unwrapped(daemon):
    cache = ac.ActCache(nn.parallel.DataParallel(resnet20()), _connect(daemon), planner=None)
    assert isinstance(cache.net, type(resnet20()))
    cache.close()


def test_an_unknown_layout_names_the_fix(daemon):
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Linear(4, 4)

    with pytest.raises(ConfigError, match="pass stages=StagedModel"):
        ac.ActCache(Net(), _connect(daemon))


def test_resume_mid_epoch_gives_the_uninterrupted_run(daemon, reference):
    net, opt, cache, loader = _cached_run(daemon)
    losses = []
    for epoch in range(2):  # stop after epoch 1's first batch, as a crash would
        net.train()
        if epoch >= 1:
            cache.freeze(4)
        for x, y in loader:
            losses.append(_sgd_step(net, opt, x, y))
            if epoch == 1:
                break
    checkpoint = {"net": net.state_dict(), "opt": opt.state_dict(), "loader": loader.state_dict()}
    cache.close()

    net = resnet20()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    net.load_state_dict(checkpoint["net"])
    opt.load_state_dict(checkpoint["opt"])
    cache = ac.ActCache(net, _connect(daemon), planner=None)
    loader = cache.wrap(DataLoader(Images(), batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(1)))
    loader.load_state_dict(checkpoint["loader"])
    assert loader.epoch == 1
    for _epoch in range(loader.epoch, 3):
        net.train()
        cache.freeze(4)
        for x, y in loader:
            losses.append(_sgd_step(net, opt, x, y))
    assert losses == reference
    cache.close()


def test_the_readme_quickstart_runs_the_same_with_and_without_actcache(daemon, monkeypatch):
    monkeypatch.setenv("ACTCACHE_SOCKET", str(daemon.socket))
    monkeypatch.syspath_prepend(str(EXAMPLES))
    import plain_loop
    import plain_loop_actcache

    try:
        assert plain_loop_actcache.train(epochs=2, size=128) == plain_loop.train(epochs=2, size=128)
    finally:
        sys.modules.pop("plain_loop", None)
        sys.modules.pop("plain_loop_actcache", None)


def test_a_tensor_given_to_a_cached_forward_names_the_fix():
    from actcache.errors import ConfigTypeError

    model = ac.CachedForward(ac.from_resnet(resnet20()))
    with pytest.raises(ConfigTypeError, match=r"model\(batch\).*ActCache\(net\)"):
        model(torch.randn(2, 3, 8, 8))


def test_staging_a_wrapped_network_names_the_fix():
    with pytest.raises(ConfigError, match=r"DataParallel\(net\)\.module.*ActCache\(net\)"):
        ac.from_resnet(nn.DataParallel(resnet20()))


class DictImages(Images):
    def __getitem__(self, i: int) -> dict:
        x, y = super().__getitem__(i)
        return {"image": x, "label": y}


def test_a_dict_batch_stays_a_dict_and_inputs_names_its_field(daemon):
    net = resnet20()
    loader = DataLoader(DictImages(), batch_size=32)
    cache = ac.ActCache(net, _connect(daemon), planner=None)
    with pytest.raises(ConfigError, match=r"inputs=lambda batch: batch\['image'\]"):
        next(iter(cache.wrap(loader)))
    cache.close()
    cache = ac.ActCache(net, _connect(daemon), inputs=lambda batch: batch["image"], planner=None)
    wrapped = cache.wrap(loader)
    cache.freeze(4)
    for _epoch in range(2):
        for batch in wrapped:
            assert set(batch) == {"image", "label"} and batch["image"].shape[0] == 32
            F.cross_entropy(net(batch["image"]), batch["label"]).backward()
    assert cache.connection.stats.hits == 96
    cache.close()


@pytest.mark.parametrize("held_bytes", [256 << 20, 0], ids=["held", "copied"])
def test_batches_taken_ahead_of_their_forward_are_served_in_order(daemon, reference, monkeypatch, held_bytes):
    """Gradient accumulation as transformers.Trainer does it: two batches drawn, then two forwards; their puts
    held until the loop asks for a batch again, or (past the bytes held at most) copied as they are stored."""
    from actcache_client.engine import _writer

    monkeypatch.setattr(_writer, "_MAX_HELD_BYTES", held_bytes)
    net, opt, cache, loader = _cached_run(daemon)
    losses = []
    for epoch in range(3):
        net.train()
        if epoch >= 1:
            cache.freeze(4)
        batches = iter(loader)
        for first in batches:
            taken = [first, *itertools.islice(batches, 1)]  # up to two batches before running them
            for x, y in taken:
                losses.append(_sgd_step(net, opt, x, y))
    assert losses == reference
    assert cache.connection.stats.hits == 96
    cache.close()


def test_a_metric_on_the_batch_just_trained_on_sees_the_served_rows(daemon):
    """Rows the loader did not load are placeholders; a second forward on the same x is served again."""
    torch.manual_seed(0)
    net = resnet20()
    cache = ac.ActCache(net, _connect(daemon), planner=None)
    loader = cache.wrap(DataLoader(Images(), batch_size=32))
    cache.freeze(4)
    images = Images().images
    for _epoch in range(2):
        for step, (x, _y) in enumerate(loader):
            net.train()
            logits = net(x)
            with torch.no_grad():
                again = net(x)
            net.eval()
            with torch.no_grad():
                evaluated = net(x)
                truth = net(images[step * 32:(step + 1) * 32])
            torch.testing.assert_close(evaluated, truth)
            assert torch.equal(again, logits.detach())
    assert loader.cached.raw_items_loaded < 2 * 96  # some rows of epoch 1 were placeholders
    cache.close()


def test_changing_an_input_with_placeholder_rows_is_an_error_naming_the_fix(daemon):
    net = resnet20()
    cache = ac.ActCache(net, _connect(daemon), planner=None)
    cache.freeze(4)
    for x, _y in cache.wrap(DataLoader(Images(), batch_size=32)):  # the first epoch stores every row
        net(x)
    with pytest.raises(ConfigError, match=r"skip_loads=False"):
        for x, _y in cache.wrap(DataLoader(Images(), batch_size=32)):
            net(x + 1.0)
    with pytest.warns(ac.ChangedInputWarning):
        for x, _y in cache.wrap(DataLoader(Images(), batch_size=32), skip_loads=False):
            net(x + 1.0)
    cache.close()


def test_a_deep_copy_of_the_network_runs_its_own_forward(daemon):
    """An EMA copy or a reference model made while stages are frozen and served computes them itself."""
    import copy

    net = resnet20()
    cache = ac.ActCache(net, _connect(daemon), planner=None)
    cache.freeze(4)
    for x, _y in cache.wrap(DataLoader(Images(), batch_size=32)):
        net(x)
    twin = copy.deepcopy(net).eval()
    assert "forward" in net.conv1.__dict__
    x = Images().images[:8]
    with torch.no_grad():
        torch.testing.assert_close(twin(x), net.eval()(x))
    assert twin.conv1.forward.__self__ is twin.conv1
    cache.close()


def test_a_device_copy_of_the_batch_is_served_without_reading_its_values(daemon, reference, monkeypatch):
    """The loop moves its batch to another device (``meta`` stands in for CUDA: it holds no values, so the
    matching cannot have read them); the served prefix gives the plain loop's losses, torch.equal never runs."""
    torch.manual_seed(0)
    net = resnet20()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    cache = ac.ActCache(net, _connect(daemon), audit=False, planner=None)  # an audit compares values, by design
    loader = cache.wrap(DataLoader(Images(), batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(1)))
    equal_calls = []
    real_equal = torch.equal
    monkeypatch.setattr(torch, "equal", lambda *a: equal_calls.append(1) or real_equal(*a))
    losses = []
    for epoch in range(3):
        net.train()
        if epoch >= 1:
            cache.freeze(4)
        for x, y in loader:
            losses.append(_sgd_step(net, opt, x if epoch == 0 else x.to("meta"), y))
    assert losses == reference
    assert cache.connection.stats.hits == 96 and not equal_calls
    cache.close()


def test_frozen_stages_are_put_in_eval_mode_once_per_freeze_not_per_forward(daemon, monkeypatch):
    net, opt, cache, loader = _cached_run(daemon)
    cache.freeze(4)
    stages = [net.conv1, net.bn1, *net.layer1]  # the stem and layer1's blocks (layer1 itself is no stage)
    frozen = {id(m) for m in stages for m in m.modules()}
    moded = []
    real_train = nn.Module.train
    monkeypatch.setattr(nn.Module, "train", lambda m, mode=True: moded.append(id(m)) or real_train(m, mode))
    for _ in range(2):
        net.train()  # the loop's own call, once per epoch
        for x, y in loader:
            _sgd_step(net, opt, x, y)
    assert not frozen & set(moded)  # net.train() reached them, and left them in eval mode without a call
    assert not any(m.training for stage in stages for m in stage.modules()) and net.layer2.training
    cache.freeze(0)
    net.train()
    assert all(m.training for m in net.modules())
    cache.close()




def test_the_first_frozen_module_is_hooked_only_while_nothing_is_frozen(daemon):
    """While stages are patched their head matches the forwards: the entry module's pre-hook (which makes every
    call of the module take torch's slower dispatch) is off, and back on once nothing is frozen."""
    net, opt, cache, loader = _cached_run(daemon)
    hooked = []
    for depth in (0, 4, 0):
        cache.freeze(depth)
        for x, y in loader:
            hooked.append(len(net.conv1._forward_pre_hooks))
            _sgd_step(net, opt, x, y)
    assert hooked == [1] * 3 + [0] * 3 + [1] * 3  # 96 images, batches of 32
    cache.flush()
    assert cache.connection.stats.puts == 96  # the frozen epoch was a write epoch, served by the patched head
    cache.close()


# dynamo's own tracing reads .grad of a non-leaf tensor while it inspects BatchNorm's input (torch 2.13)
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning")
def test_a_compiled_network_trains_to_the_same_losses_with_the_cache(daemon, reference):
    """``torch.compile(net)`` after ``ActCache(net)``: the served prefix is a clean graph break, the rest is
    compiled (dynamo's ``eager`` backend: the same tracing as inductor, without its minutes of codegen here)."""
    net, opt, cache, loader = _cached_run(daemon)
    compiled = torch.compile(net, backend="eager")
    losses = []
    for epoch in range(3):
        compiled.train()
        if epoch >= 1:
            cache.freeze(4)
        for x, y in loader:
            losses.append(_sgd_step(compiled, opt, x, y))
    assert losses == reference
    assert cache.connection.stats.hits == 96
    cache.close()


def test_the_run_length_given_to_wrap_reaches_the_cost_model(daemon):
    cache = ac.ActCache(resnet20(), _connect(daemon))
    cache.wrap(DataLoader(Images(), batch_size=32), epochs=6)
    assert cache.model.planner is not None and cache.model.planner.config.total_epochs == 6
    with pytest.raises(ConfigError, match="epochs is the run's number of epochs"):
        cache.expect_epochs(0)
    cache.close()


class _AddOneInPlace(nn.Module):
    """Changes its input in place (as ``ReLU(inplace=True)`` does, but not idempotently: served twice, it shows)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.add_(1.0)


def _in_place_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), _AddOneInPlace(),
                         nn.Flatten(), nn.Linear(8 * 8 * 8, 10))


def _in_place_losses(cache_of: Callable[[nn.Module], ac.ActCache] | None) -> tuple[list[float], ac.ActCache | None]:
    net = _in_place_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    loader = DataLoader(Images(), batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(1))
    cache = cache_of(net) if cache_of is not None else None
    if cache is not None:
        loader = cache.wrap(loader)
    losses = []
    for epoch in range(4):
        if epoch == 1:
            if cache is not None:
                cache.freeze(3)
            else:
                net[:3].requires_grad_(False)
        losses += [_sgd_step(net, opt, x, y) for x, y in loader]
    return losses, cache


def test_a_prefix_output_the_step_changes_in_place_is_stored_as_the_prefix_computed_it(daemon, caplog):
    """The write epoch stores the network's own output tensors without copying them, once the step is over; the
    step here adds 1 to them in place: that batch is not stored (a warning), the later ones are copied first,
    and every epoch trains to the losses of the same freeze without the cache."""
    reference, _ = _in_place_losses(None)
    with caplog.at_level("WARNING", logger="actcache_client"):
        losses, cache = _in_place_losses(lambda net: ac.ActCache(net, _connect(daemon), planner=None))
    assert cache is not None
    assert losses == reference
    changed = [r for r in caplog.records if "in place" in r.getMessage()]
    assert len(changed) == 1 and "copied before it is stored" in changed[0].getMessage()
    # epoch 1 stored batches 2 and 3 (the first one changed), epoch 2 stored batch 1: epochs 2 and 3 hit 64 + 96
    assert cache.connection.stats.hits == 64 + 96
    cache.close()


def test_flush_stores_the_output_of_a_step_the_loader_has_not_seen_end(daemon):
    """A write step's output is held until the loop asks for the next batch; ``flush()`` (an epoch's end in a
    multi-rank loop, before the ranks' barrier) sends it and waits until the daemon has stored it."""
    net, opt, cache, loader = _cached_run(daemon)
    for x, y in loader:  # epoch 0: nothing frozen, nothing stored
        _sgd_step(net, opt, x, y)
    cache.freeze(4)
    batches = iter(loader)
    x, y = next(batches)
    _sgd_step(net, opt, x, y)  # its output is held: the loop has not asked for the next batch
    cache.connection.flush()
    assert cache.connection.stats.puts == 0
    cache.flush()
    assert cache.connection.stats.puts == len(y)
    cache.close()
