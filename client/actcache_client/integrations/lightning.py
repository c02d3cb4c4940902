"""Lightning: a callback that freezes a LightningModule's first stages and serves them from actcache.

    from actcache_client.integrations.lightning import ActCacheCallback
    trainer = L.Trainer(max_epochs=10, callbacks=[ActCacheCallback(freeze_at_epoch=2, depth=4)])

The LightningModule, its ``training_step`` and its batches stay as they are.
The callback finds the network among the module's children (or takes
``module="attr"``), builds an ActCache over it in ``setup``, and wraps the
train dataloader where Lightning lets a strategy wrap it
(``Strategy.process_dataloader``: after Lightning has added its
DistributedSampler, before it iterates or restores the loader), so each rank
caches the samples it consumes and a checkpoint carries the loader's state.
At the start of every training epoch it tells the loader the epoch (a
resumed run goes on where it stopped) and, from ``freeze_at_epoch`` on,
freezes ``depth`` stages. Validation runs in eval mode and never touches the
cache.

Under ``strategy="ddp"`` PyTorch's DistributedDataParallel cannot follow
parameters that stop receiving gradients mid-run, with or without actcache;
``strategy="ddp_find_unused_parameters_true"`` can, and ``on_fit_start``
says so before the first step.
"""

from __future__ import annotations

import os
from functools import partial
from typing import Any, Callable, Sequence

try:
    import lightning.pytorch as pl
    from lightning.fabric.utilities.seed import pl_worker_init_function
    from lightning.pytorch.trainer.states import RunningStage, TrainerFn
except ImportError as exc:  # pragma: no cover - depends on the installed extras
    raise ImportError("actcache_client.integrations.lightning needs Lightning: "
                      "pip install 'actcache[lightning]'") from exc
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from actcache.errors import ConfigError
from actcache_client._connection import Connection
from actcache_client._dropin import ActCache, WrappedLoader, _layout

__all__ = ["ActCacheCallback"]


class ActCacheCallback(pl.Callback):
    """Freezes ``depth`` stages of the module's network from epoch ``freeze_at_epoch`` on and serves them.

    ``module``: the LightningModule attribute holding the network (dotted paths work), found
    among its children when not given. ``connection`` defaults to this node's daemon
    (``connect()``), shared by the ranks of a node. ``variants`` and ``targets`` are
    ``ActCache.wrap``'s; ``options`` are ``ActCache``'s (``stages=``, ``store_dtype=``, ...).
    ``cache`` is the ActCache once ``fit`` has set it up (its ``model`` has the counters).
    """

    def __init__(self, *, depth: int, freeze_at_epoch: int = 0, module: str | None = None,
                 connection: Connection | None = None, variants: int | None = None,
                 targets: Sequence[Any] | Callable[[int], Any] | None = None, **options: Any) -> None:
        if depth < 1:
            raise ConfigError(f"ActCacheCallback depth must be >= 1 (stages to freeze), got {depth}")
        if freeze_at_epoch < 0:
            raise ConfigError(f"ActCacheCallback freeze_at_epoch must be >= 0, got {freeze_at_epoch}")
        self.depth = depth
        self.freeze_at_epoch = freeze_at_epoch
        self.module = module
        self.connection = connection
        self.variants = variants
        self.targets = targets
        self.options = options
        self.cache: ActCache | None = None
        self.loader: WrappedLoader | None = None
        self._patched: Any = None  # the strategy whose process_dataloader setup replaced
        self._previous: Callable[[object], object] | None = None  # its instance's own one, if it had one
        self._closed = False  # teardown closed the cache's connection (opened by setup)
        self._frozen_once = False  # this fit reached freeze_at_epoch (a FreezeController may change it after)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != TrainerFn.FITTING:
            return
        net = _find_net(pl_module, self.module)
        if self.cache is None or self.cache.net is not net or self._closed:
            self.cache, self._closed = ActCache(net, self.connection, **self.options), False
        self._frozen_once = False
        strategy = trainer.strategy
        self._patched, self._previous = strategy, vars(strategy).get("process_dataloader")
        strategy.process_dataloader = partial(self._process_dataloader, trainer, strategy.process_dataloader)

    def _process_dataloader(self, trainer: pl.Trainer, original: Callable[[object], object],
                            dataloader: object) -> object:
        dataloader = original(dataloader)
        if trainer.state.stage != RunningStage.TRAINING or not isinstance(dataloader, DataLoader):
            return dataloader
        assert self.cache is not None
        if dataloader.worker_init_fn is None and int(os.environ.get("PL_SEED_WORKERS", 0)):
            # What Lightning does for a DataLoader after this hook (seed_everything(workers=True)).
            dataloader.worker_init_fn = partial(pl_worker_init_function, rank=trainer.global_rank)
        self.loader = self.cache.wrap(dataloader, variants=self.variants, targets=self.targets)
        return self.loader

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        model = trainer.strategy.model
        if isinstance(model, DistributedDataParallel) and not model.find_unused_parameters:
            raise ConfigError(
                f"ActCacheCallback freezes {self.depth} stages at epoch {self.freeze_at_epoch}, and "
                "DistributedDataParallel fails at the next step when parameters stop receiving gradients unless "
                "it finds unused parameters; use Trainer(strategy=\"ddp_find_unused_parameters_true\") "
                "(or DDPStrategy(find_unused_parameters=True))"
            )

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._follow(trainer)  # a run resumed mid-epoch gets no on_train_epoch_start for that epoch

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._follow(trainer)

    def _follow(self, trainer: pl.Trainer) -> None:
        """The loader's epoch is the trainer's; from ``freeze_at_epoch`` on, ``depth`` stages are frozen (once)."""
        assert self.cache is not None  # set in setup, which Lightning calls first
        if self.loader is not None:
            self.loader.set_epoch(trainer.current_epoch)
        if trainer.current_epoch >= self.freeze_at_epoch and not self._frozen_once:
            self.cache.freeze(self.depth)
            self._frozen_once = True

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._restore()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == TrainerFn.FITTING:
            self._restore()

    def _restore(self) -> None:
        """The strategy's own process_dataloader back, and the node daemon's connection (opened in setup) closed."""
        if self._patched is None:
            return
        if self._previous is None:
            del self._patched.process_dataloader
        else:
            self._patched.process_dataloader = self._previous
        self._patched = self._previous = None
        if self.connection is None and self.cache is not None:
            self.cache.close()
            self._closed = True


def _find_net(pl_module: pl.LightningModule, name: str | None) -> nn.Module:
    """The network ``pl_module.<name>``, or its one child whose stages actcache can tell."""
    if name is not None:
        net: Any = pl_module
        for part in name.split("."):
            if not hasattr(net, part):
                raise ConfigError(f"ActCacheCallback(module={name!r}): {type(pl_module).__name__} has no "
                                  f"attribute {part!r}")
            net = getattr(net, part)
        if not isinstance(net, nn.Module):
            raise ConfigError(f"ActCacheCallback(module={name!r}) is a {type(net).__name__}, not an nn.Module")
        return net
    found = []
    for child_name, child in pl_module.named_children():
        try:
            _layout(child)
        except ConfigError:
            continue
        found.append(child_name)
    if len(found) != 1:
        children = ", ".join(f"{n} ({type(c).__name__})" for n, c in pl_module.named_children()) or "none"
        which = "several" if found else "none"
        raise ConfigError(f"ActCacheCallback could not tell which network to serve: {which} of "
                          f"{type(pl_module).__name__}'s children ({children}) is a ResNet, a BERT classifier or an "
                          "nn.Sequential; pass module=\"<attribute>\" (and stages=StagedModel([...]) for other "
                          "networks)")
    return getattr(pl_module, found[0])
