"""Lightning: a callback that freezes a LightningModule's first stages and serves them from actcache.

    from actcache_client.integrations.lightning import ActCacheCallback
    trainer = L.Trainer(max_epochs=10, callbacks=[ActCacheCallback()])   # a FreezeController decides
    trainer = L.Trainer(max_epochs=10, callbacks=[ActCacheCallback(freeze_at_epoch=2, depth=4)])  # by hand

The LightningModule, its ``training_step`` and its batches stay as they are.
The callback finds the network among the module's children (or takes
``module="attr"``), builds an ActCache over it in ``setup``, and wraps the
train dataloader where Lightning lets a strategy wrap it
(``Strategy.process_dataloader``: after Lightning has added its
DistributedSampler, before it iterates or restores the loader), so each rank
caches the samples it consumes and a checkpoint carries the loader's state.
At the start of every training epoch it tells the loader the epoch (a
resumed run goes on where it stopped) and, from ``freeze_at_epoch`` on,
freezes ``depth`` stages. Without ``depth``, a ``FreezeController`` built at
``on_train_start`` (the module's optimizer, ``total_steps`` =
``trainer.estimated_stepping_batches``; its default policy, or ``policy`` and
``eval_every``) is given every optimizer step with the step's training loss,
and decides; its state goes into Lightning's checkpoints. Validation runs in
eval mode and never touches the cache.

Under ``strategy="ddp"`` PyTorch's DistributedDataParallel cannot follow
parameters that stop receiving gradients mid-run, with or without actcache;
``strategy="ddp_find_unused_parameters_true"`` can, and ``on_fit_start``
says so before the first step.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from functools import partial
from typing import Any, Callable, Sequence

try:
    import lightning.pytorch as pl
    from lightning.fabric.utilities.seed import pl_worker_init_function
    from lightning.pytorch.trainer.states import RunningStage, TrainerFn
except ImportError as exc:  # pragma: no cover - depends on the installed extras
    raise ImportError("actcache_client.integrations.lightning needs Lightning: "
                      "pip install 'actcache[lightning]'") from exc
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from actcache.errors import ConfigError
from actcache_client._dropin import ActCache, WrappedLoader
from actcache_client.freeze.controller import FreezeController
from actcache_client.freeze.policy import FreezePolicy
from actcache_client.integrations._choice import check_freeze_choice
from actcache_client.layouts import find_layout, layout_families
from actcache_client.transport._connection import Connection

__all__ = ["ActCacheCallback"]


class ActCacheCallback(pl.Callback):
    """Serves the frozen stages of the module's network; a FreezeController decides, or ``depth`` does.

    Without ``depth``, ``controller`` is the FreezeController once training has started. ``cache`` is the
    ActCache once ``fit`` has set it up (its ``model`` has the counters).

    Args:
        depth: Stages frozen by hand (a count, or a stage's name: the stages through it); default: a
            FreezeController decides.
        freeze_at_epoch: The epoch ``depth`` freezes from (default 0).
        policy: The FreezeController's policy (without ``depth``); default: from the run's length.
        eval_every: The FreezeController's steps between evaluations (without ``depth``); default: from the
            run's length.
        module: The LightningModule attribute holding the network (dotted paths work); default: found
            among its children.
        connection: The daemon's connection; default: this node's daemon (``connect()``), shared by the
            ranks of a node.
        variants: ``ActCache.wrap``'s.
        targets: ``ActCache.wrap``'s.
        **options: ``ActCache``'s keyword arguments (``stages=``, ``store_dtype=``, ...).

    Raises:
        ConfigError: ``depth`` below 1, ``freeze_at_epoch`` negative or without ``depth``, or ``depth``
            with ``policy`` or ``eval_every``.
    """

    def __init__(self, *, depth: int | str | None = None, freeze_at_epoch: int | None = None,
                 policy: FreezePolicy | None = None, eval_every: int | None = None, module: str | None = None,
                 connection: Connection | None = None, variants: int | None = None,
                 targets: Sequence[Any] | Callable[[int], Any] | None = None, **options: Any) -> None:
        check_freeze_choice("ActCacheCallback", depth=depth, at_name="freeze_at_epoch", at=freeze_at_epoch,
                            policy=policy, eval_every=eval_every)
        if depth is not None and not isinstance(depth, str) and (isinstance(depth, bool) or not isinstance(depth, int)
                                                                 or depth < 1):
            raise ConfigError(f"ActCacheCallback depth must be >= 1 (a count of stages to freeze) or a stage's name "
                              f"(the stages through it), got {depth!r}")
        if freeze_at_epoch is not None and freeze_at_epoch < 0:
            raise ConfigError(f"ActCacheCallback freeze_at_epoch must be >= 0, got {freeze_at_epoch}")
        self.depth = depth
        self.freeze_at_epoch = freeze_at_epoch or 0
        self.policy = policy
        self.eval_every = eval_every
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
        self.controller: FreezeController | None = None
        self._loss: torch.Tensor | None = None  # the training loss of the optimizer step in progress
        self._global_step = 0  # trainer.global_step when the controller last stepped
        self._saved: dict[str, Any] | None = None  # the controller's state from a checkpoint being resumed

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != TrainerFn.FITTING:
            return
        net = _find_net(pl_module, self.module)
        if self.cache is None or self.cache.net is not net or self._closed:
            self.cache, self._closed = ActCache(net, self.connection, **self.options), False
        self._frozen_once = False
        strategy = trainer.strategy
        self._patched, self._previous = strategy, vars(strategy).get("process_dataloader")
        strategy.process_dataloader = partial(  # type: ignore[method-assign]  # this strategy's, restored after
            self._process_dataloader, trainer, strategy.process_dataloader)

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
                "ActCacheCallback freezes stages during the run, and "
                "DistributedDataParallel fails at the next step when parameters stop receiving gradients unless "
                "it finds unused parameters; use Trainer(strategy=\"ddp_find_unused_parameters_true\") "
                "(or DDPStrategy(find_unused_parameters=True))"
            )

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert self.cache is not None  # set in setup, which Lightning calls first
        if trainer.max_epochs is not None and trainer.max_epochs > 0:  # -1: no limit; max_steps may end it sooner
            self.cache.expect_epochs(trainer.max_epochs)
        if self.depth is None:
            self._start_controller(trainer)
        self._follow(trainer)  # a run resumed mid-epoch gets no on_train_epoch_start for that epoch

    def _start_controller(self, trainer: pl.Trainer) -> None:
        """A FreezeController over the module's optimizer, paced by the run's length (resumed from a checkpoint)."""
        assert self.cache is not None  # set in setup, which Lightning calls first
        if len(trainer.optimizers) != 1:
            raise ConfigError(f"ActCacheCallback's FreezeController drives one optimizer; configure_optimizers "
                              f"gave {len(trainer.optimizers)}: pass depth= to freeze by hand")
        if self.controller is not None:
            self.controller.close()
        length = trainer.estimated_stepping_batches
        self.controller = FreezeController(self.cache.model, trainer.optimizers[0], self.policy,
                                           eval_every=self.eval_every,
                                           total_steps=int(length) if math.isfinite(length) else None,
                                           ddp=False)  # the strategy wraps the whole module itself
        if self._saved is not None:
            self.controller.load_state_dict(self._saved)
            self._saved = None
        self._loss, self._global_step = None, trainer.global_step

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.controller is None:
            return
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs  # divided by accumulation's steps
        if isinstance(loss, torch.Tensor):
            self._loss = loss.detach() if self._loss is None else self._loss + loss.detach()
        if trainer.global_step != self._global_step:  # the optimizer stepped after this batch
            self._global_step = trainer.global_step
            self.controller.step(self._loss, epoch=trainer.current_epoch)
            self._loss = None

    def state_dict(self) -> dict[str, Any]:
        return {"controller": self.controller.state_dict()} if self.controller is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._saved = state_dict.get("controller")

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._follow(trainer)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Each rank stores the samples it consumed, and the next epoch's order asks which samples are stored,
        # those of the other ranks too: every rank's entries are in the daemon before any rank pushes that order
        # (else it finds some missing, and computes and stores them again).
        if trainer.world_size > 1 and self.cache is not None:
            self.cache.flush()
            trainer.strategy.barrier("actcache: the epoch's entries are stored")

    def _follow(self, trainer: pl.Trainer) -> None:
        """The loader's epoch is the trainer's; from ``freeze_at_epoch`` on, ``depth`` stages are frozen (once)."""
        assert self.cache is not None  # set in setup, which Lightning calls first
        if self.loader is not None:
            self.loader.set_epoch(trainer.current_epoch)
        if self.depth is not None and trainer.current_epoch >= self.freeze_at_epoch and not self._frozen_once:
            self.cache.freeze(self.depth)
            self._frozen_once = True

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._restore()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == TrainerFn.FITTING:
            self._restore()
            if self.controller is not None:
                self.controller.close()  # its hook off the optimizer; it keeps its state and the frozen depth

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
            find_layout(child)
        except ConfigError:
            continue
        found.append(child_name)
    if len(found) != 1:
        children = ", ".join(f"{n} ({type(c).__name__})" for n, c in pl_module.named_children()) or "none"
        which = "several" if found else "none"
        raise ConfigError(f"ActCacheCallback could not tell which network to serve: {which} of "
                          f"{type(pl_module).__name__}'s children ({children}) is taken by a registered layout family "
                          f"({', '.join(layout_families())}); pass module=\"<attribute>\" (and blocks=\"<dotted "
                          "path>\" or stages=StagedModel([...]) for other networks, or register a layout with "
                          "actcache_client.layouts.register_layout)")
    return getattr(pl_module, found[0])
