"""ActCacheCallback on a real Lightning Trainer (CPU): the examples' losses with and without the cache,
resume from a checkpoint, validation, the served rows, a FreezeController deciding, and a two-process DDP run
(gloo)."""

from __future__ import annotations

import difflib
import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning", reason="the lightning extra (actcache[lightning]) is not installed")

import lightning as L  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from actcache.errors import ConfigError  # noqa: E402
from actcache.testing import run_daemon  # noqa: E402
from actcache_client.freeze import StaticPolicy  # noqa: E402
from actcache_client.integrations.lightning import ActCacheCallback  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SIZE, EPOCHS = 256, 3  # 4 steps of 64 per epoch; frozen (stem + layer1) from epoch 1
TINY = ["--size", str(SIZE), "--epochs", str(EPOCHS), "--freeze-at", "1"]

# lightning 2.6's _pytree calls a torch API that this torch deprecates.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated:FutureWarning"),
]



def _example(name: str):
    spec = importlib.util.spec_from_file_location(f"examples_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def daemon():
    with run_daemon() as d:
        yield d


@pytest.fixture
def node(daemon, monkeypatch):
    """connect() (the callback's default) reaches the test's daemon."""
    monkeypatch.setenv("ACTCACHE_SOCKET", str(daemon.socket))
    return daemon


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """The plain example's run: its own freezing callback, no cache."""
    _, model = _example("lightning_train").main([*TINY, "--root", str(tmp_path_factory.mktemp("plain"))])
    return model


def _callback(trainer: L.Trainer) -> ActCacheCallback:
    (callback,) = [c for c in trainer.callbacks if isinstance(c, ActCacheCallback)]
    return callback


def test_the_example_with_actcache_trains_exactly_as_without_and_serves_the_frozen_rows(plain, node, tmp_path,
                                                                                          monkeypatch):
    example = _example("lightning_train_actcache")
    shapes: list[tuple[int, int]] = []

    class Recording(example.DigitsModule):
        def training_step(self, batch, batch_idx):
            x, y = batch
            shapes.append((x.shape[0], y.shape[0]))
            return super().training_step(batch, batch_idx)

    monkeypatch.setattr(example, "DigitsModule", Recording)
    trainer, model = example.main([*TINY, "--root", str(tmp_path)])
    assert model.losses == plain.losses  # bit-equal, step by step
    assert model.val_losses == plain.val_losses
    assert len(shapes) == EPOCHS * SIZE // 64 and all(shape == (64, 64) for shape in shapes)
    assert "process_dataloader" not in vars(trainer.strategy)  # the callback gave the strategy its own back
    counters = _callback(trainer).cache.model.epoch_counters()
    # Only the training batches of the frozen epochs went through the cache: validation never did.
    assert sum(c.times.prefix_samples for c in counters) == (EPOCHS - 1) * SIZE
    assert counters[-1].times.cached_samples == SIZE  # the second frozen epoch is served entirely
    last = counters[-1].times  # the inputs the cache served were not loaded, but for the few the audit checks
    assert last.raw_loaded == last.audited_samples < SIZE // 4


def test_a_loader_shuffled_by_the_global_generator_gives_the_same_orders_with_the_cache(node, tmp_path, monkeypatch):
    runs = []
    for name in ("lightning_train", "lightning_train_actcache"):
        example = _example(name)

        def shuffled(self, digits=example.Digits):  # DataLoader(shuffle=True): the order from torch's global RNG
            return DataLoader(digits(slice(0, self.size)), batch_size=self.batch_size, shuffle=True)

        monkeypatch.setattr(example.DigitsModule, "train_dataloader", shuffled)
        runs.append(example.main([*TINY, "--root", str(tmp_path / name)]))
    (_, plain), (trainer, cached) = runs
    assert cached.losses == plain.losses and cached.val_losses == plain.val_losses
    assert _callback(trainer).cache.model.epoch_counters()[-1].times.cached_samples == SIZE


def test_a_run_resumed_from_its_checkpoint_matches_the_uninterrupted_run(plain, node, tmp_path):
    example = _example("lightning_train_actcache")
    args = ["--size", str(SIZE), "--freeze-at", "1", "--root", str(tmp_path / "run")]
    _, first = example.main([*args, "--epochs", "2"])
    (saved,) = (tmp_path / "run" / "checkpoints").glob("*.ckpt")
    checkpoint = saved.rename(tmp_path / "stopped.ckpt")  # Lightning warns of a checkpoint dir not empty
    trainer, second = example.main([*args, "--epochs", str(EPOCHS), "--resume", str(checkpoint)])
    assert first.losses + second.losses == plain.losses
    callback = _callback(trainer)
    assert callback.loader.epoch == EPOCHS - 1 and callback.cache.frozen == 4
    (resumed,) = callback.cache.model.epoch_counters()
    assert resumed.epoch == EPOCHS - 1 and resumed.times.cached_samples == SIZE  # served what the first run stored


def test_the_actcache_example_is_the_plain_one_with_two_lines_changed():
    plain, cached = ((EXAMPLES / f"{name}.py").read_text().splitlines()
                     for name in ("lightning_train", "lightning_train_actcache"))
    diff = [line for line in difflib.unified_diff(plain, cached, lineterm="", n=0)
            if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    assert diff == [
        "+from actcache_client.integrations.lightning import ActCacheCallback",
        "-        callbacks=[FreezeStem(args.freeze_at)],",
        "+        callbacks=[ActCacheCallback(freeze_at_epoch=args.freeze_at, depth=4)],",
    ]


def test_a_run_resumed_mid_epoch_goes_on_with_the_loaders_position_and_the_freeze(node, tmp_path):
    example = _example("lightning_train_actcache")

    def fit(root: Path, ckpt_path: str | None = None) -> list[float]:
        L.seed_everything(0, verbose=False)
        model = example.DigitsModule(SIZE)
        every = L.pytorch.callbacks.ModelCheckpoint(dirpath=root, every_n_train_steps=2, save_top_k=-1)
        trainer = L.Trainer(max_epochs=EPOCHS, accelerator="cpu", logger=False, enable_progress_bar=False,
                            enable_model_summary=False, callbacks=[ActCacheCallback(freeze_at_epoch=1, depth=4), every])
        trainer.fit(model, ckpt_path=ckpt_path)
        return model.losses

    whole = fit(tmp_path / "run")
    # Step 6 is the second of epoch 1's four: Lightning skips on_train_epoch_start when it resumes there.
    checkpoint = (tmp_path / "run" / "epoch=1-step=6.ckpt").rename(tmp_path / "stopped.ckpt")
    for other in (tmp_path / "run").iterdir():  # Lightning warns of a checkpoint dir not empty
        other.unlink()
    assert fit(tmp_path / "run", str(checkpoint)) == whole[6:]


class _FreezeAfterStep(L.Callback):
    """Stem and layer1 stop training after optimizer step ``at``: what StaticPolicy(stages=4, at_step=at) decides."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step >= self.at:
            for m in (pl_module.net.conv1, pl_module.net.bn1, pl_module.net.layer1):
                m.requires_grad_(False).eval()


def _fit(root: Path, callbacks: list[L.Callback], *, epochs: int = EPOCHS,
         ckpt_path: str | None = None) -> tuple[L.Trainer, list[float]]:
    L.seed_everything(0, verbose=False)
    model = _example("lightning_train").DigitsModule(SIZE)
    trainer = L.Trainer(max_epochs=epochs, accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=root, callbacks=callbacks)
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer, model.losses


def test_without_depth_a_short_run_says_once_that_it_is_too_short_and_trains_as_without_actcache(
        node, tmp_path, caplog):
    _, plain = _fit(tmp_path / "plain", [])
    callback = ActCacheCallback()
    trainer, losses = _fit(tmp_path / "auto", [callback])
    (message,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("actcache: not freezing")]
    assert "a run of 12 steps is too short" in message
    assert callback.controller.total_steps == trainer.estimated_stepping_batches == EPOCHS * SIZE // 64
    assert callback.controller.step_count == 12 and callback.controller.changes == [] and callback.cache.frozen == 0
    assert losses == plain
    assert callback.cache.model.planner.config.total_epochs == EPOCHS  # the cost model knows the run's length


def test_a_policy_drives_the_freeze_and_the_cache_keeps_the_run_of_the_same_freeze_by_hand(node, tmp_path):
    _, by_hand = _fit(tmp_path / "plain", [_FreezeAfterStep(2)])
    callback = ActCacheCallback(policy=StaticPolicy(stages=4, at_step=2), eval_every=1)
    _, losses = _fit(tmp_path / "auto", [callback])
    assert losses == by_hand  # bit-equal, step by step
    assert callback.controller.changes == [(2, 0, 4)] and callback.controller.step_count == 12
    assert callback.cache.model.epoch_counters()[-1].times.cached_samples == SIZE  # the last epoch is served


def test_a_resumed_run_goes_on_with_the_controllers_state(node, tmp_path):
    def callback() -> ActCacheCallback:
        # Without the cost model: it plans the 2-epoch first part apart from the whole run, and the partial plan it
        # picks computes half of each batch as a smaller batch, whose convolutions round the last bits differently.
        return ActCacheCallback(policy=StaticPolicy(stages=4, at_step=5), eval_every=1, planner=None)

    _, whole = _fit(tmp_path / "whole", [callback()])
    _, first = _fit(tmp_path / "run", [callback()], epochs=2)
    (saved,) = (tmp_path / "run" / "checkpoints").glob("*.ckpt")
    checkpoint = saved.rename(tmp_path / "stopped.ckpt")  # Lightning warns of a checkpoint dir not empty
    resumed = callback()
    _, second = _fit(tmp_path / "run", [resumed], ckpt_path=str(checkpoint))
    assert first + second == whole  # frozen from the resumed run's first step: a fresh controller freezes later
    assert resumed.controller.changes == [(5, 0, 4)] and resumed.controller.step_count == 12


def test_depth_and_a_controller_setting_together_are_refused():
    with pytest.raises(ConfigError, match="pass depth= .* or policy= .*not both"):
        ActCacheCallback(depth=4, policy=StaticPolicy(stages=4, at_step=5))
    with pytest.raises(ConfigError, match=r"freeze_at_epoch=1\) needs depth="):
        ActCacheCallback(freeze_at_epoch=1)


class _TwoNets(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.student = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
        self.teacher = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))


def test_the_callback_asks_which_network_when_it_cannot_tell(tmp_path):
    trainer = L.Trainer(accelerator="cpu", logger=False, default_root_dir=tmp_path)
    with pytest.raises(ConfigError, match='several of _TwoNets.*pass module="<attribute>"'):
        ActCacheCallback(depth=1).setup(trainer, _TwoNets(), "fit")
    with pytest.raises(ConfigError, match="_TwoNets has no attribute 'net'"):
        ActCacheCallback(depth=1, module="net").setup(trainer, _TwoNets(), "fit")
    with pytest.raises(ConfigError, match="depth must be >= 1"):
        ActCacheCallback(depth=0)


def _start_example(name: str, args: list[str], env: dict[str, str], script: Path | None = None) -> subprocess.Popen:
    """The example (or ``script`` in its place) in a session of its own: its DDP launcher starts the other rank
    in that session."""
    return subprocess.Popen([sys.executable, str(script or EXAMPLES / f"{name}.py"), *args], env=env, text=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)


def _finish(run: subprocess.Popen) -> str:
    """The run's stderr once it has ended with exit status 0 (AssertionError with its tail otherwise)."""
    _, stderr = run.communicate(timeout=240)
    assert run.returncode == 0, stderr[-3000:]
    return stderr


def test_under_plain_ddp_the_callback_names_the_strategy_that_follows_a_freeze(node, tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    run = _start_example("lightning_train_actcache", [*TINY, "--devices", "1", "--strategy", "ddp",
                                                      "--root", str(tmp_path)], env)
    _, stderr = run.communicate(timeout=240)
    assert run.returncode != 0
    assert 'use Trainer(strategy="ddp_find_unused_parameters_true")' in stderr


# The actcache example with the cost model off: on these 8x8 images caching saves a few percent, within the noise
# of its measurements on a busy host, so the default may decline to cache now and then; this test is about the ranks.
ALWAYS_CACHE = """
import functools, sys
sys.path.insert(0, {examples!r})
import lightning_train_actcache as example
example.ActCacheCallback = functools.partial(example.ActCacheCallback, planner=None)
if __name__ == "__main__":
    example.main()
"""


def test_two_ddp_processes_train_as_without_the_cache_and_each_caches_what_it_consumes(tmp_path):
    ddp = ["--devices", "2", "--strategy", "ddp_find_unused_parameters_true"]
    results = {}
    always = tmp_path / "always_cache.py"  # run by its DDP launcher again for the second rank
    always.write_text(ALWAYS_CACHE.format(examples=str(EXAMPLES)))
    with run_daemon() as daemon:  # one daemon for the node, shared by the two ranks
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "ACTCACHE_SOCKET": str(daemon.socket)}
        names = ("lightning_train", "lightning_train_actcache")
        runs = [_start_example(name, [*TINY, *ddp, "--root", str(tmp_path / name),
                                      "--out", str(tmp_path / name / "RANK.json")], env,
                               script=always if name == "lightning_train_actcache" else None) for name in names]
        try:
            for name, run in zip(names, runs):  # the two runs at once: most of their time is starting up
                _finish(run)
                results[name] = [json.loads((tmp_path / name / f"{rank}.json").read_text()) for rank in range(2)]
        finally:
            for run in runs:
                if run.poll() is None:  # a run failed: end the other one and its second rank
                    os.killpg(run.pid, signal.SIGKILL)
                    run.communicate()
        with daemon.client() as client:
            stats = client.stats()
    plain, cached = results["lightning_train"], results["lightning_train_actcache"]
    for rank in range(2):
        assert cached[rank]["losses"] == plain[rank]["losses"] and len(plain[rank]["losses"]) == EPOCHS * 2
        assert cached[rank]["val_losses"] == plain[rank]["val_losses"]
    assert plain[0]["losses"] != plain[1]["losses"]  # each rank trained on its own half of the data
    # Epoch 1 stored each sample once (each rank the half it consumed); epoch 2 was served.
    assert stats.puts_total == SIZE and stats.hits_total >= SIZE
