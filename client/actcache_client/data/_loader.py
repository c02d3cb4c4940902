"""Sample ids with every batch, and the epoch's order known before the epoch starts.

``IndexedDataset`` yields ``(sample_id, item)``, its random augmentation seeded by ``(sample_id, variant)`` so
a cached entry always matches the exact input it was computed from. ``CachedLoader`` wraps a DataLoader: at
each epoch start (and halfway through the previous epoch, where drawing early cannot change the order or
anyone's random numbers) it draws this rank's batches from the loader's own batch sampler, hands them to the
model (which pushes them to the daemon to read ahead), and has an inner DataLoader with the same settings load
exactly those batches.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from functools import partial
from operator import itemgetter
from typing import Any, Callable, Iterator, Sequence, cast

import torch
from torch.utils.data import DataLoader, Dataset, SequentialSampler
from torch.utils.data._utils.collate import default_collate

from actcache.errors import ConfigError
from actcache_client.data._identity import data_fingerprint
from actcache_client.data._seeding import sample_seed, seed_generators, seeded_item, with_seeds
from actcache_client.engine._batch import Batch, Skipped
from actcache_client.engine._cached_forward import LoaderModel

__all__ = ["Batch", "CachedLoader", "IndexedDataset", "UncacheableDataWarning", "seeded_item", "worker_options"]

# The fields of a replayed key ``(index, variant, load)``.
_INDEX, _LOAD = itemgetter(0), itemgetter(2)


class UncacheableDataWarning(UserWarning):
    """The data cannot be cached safely (e.g. uncontrolled random augmentation); recomputing."""


class IndexedDataset(Dataset):
    """``dataset[i]`` as ``(sample_id, item)``.

    The data fingerprint covers ``data_id``, the dataset's type, length, id mapping and the content of a
    spread of items (actcache_client.data._identity says what it cannot see).

    Args:
        dataset: The map-style dataset.
        augment: ``augment(item, generator)`` applies random transforms drawing only from ``generator``,
            which is seeded by ``(sample_id, variant)``.
        sample_ids: Each item's sample id (default: its index).
        random_transforms: ``dataset`` itself draws randomness that actcache cannot control: such data is
            never cached.
        data_id: Names a dataset version; part of the data fingerprint.
        targets: Each item's target without loading it (a sequence, e.g. torchvision's ``dataset.targets``,
            or a function of the index): items are then ``(input, target)`` pairs, and the loader does not
            load the inputs of samples whose frozen-prefix output the cache will serve.
        seeded: ``dataset[i]`` draws its random transforms from the global generators (torchvision
            transforms in ``__getitem__``); they are seeded by ``(sample_id, variant)`` around each load, so
            each variant of a sample is always the same input.

    Raises:
        ConfigError: ``sample_ids`` or ``targets`` has not one entry per item.
    """

    def __init__(self, dataset: Dataset, *, augment: Callable[[Any, torch.Generator], Any] | None = None,
                 sample_ids: Sequence[int] | None = None, random_transforms: bool = False, data_id: str | None = None,
                 targets: Sequence[Any] | Callable[[int], Any] | None = None, seeded: bool = False) -> None:
        for name, values in (("sample ids", sample_ids), ("targets", None if callable(targets) else targets)):
            if values is not None and len(values) != _size(dataset):
                raise ConfigError(f"{len(values)} {name} for a dataset of {_size(dataset)} items")
        self.dataset, self.augment, self.targets, self.seeded = dataset, augment, targets, seeded
        self.sample_ids = list(sample_ids) if sample_ids is not None else None
        self.random_transforms, self.data_id = random_transforms, data_id
        self._fingerprints: dict[int, bytes] = {}
        self._seeding = frozenset({"torch"})  # with ``seeded``: the global generators items were seen drawing from

    def fingerprint(self, variants: int = 1) -> bytes:
        """The data fingerprint over variants ``0..variants-1`` (computed once, then remembered).

        Args:
            variants: The number of variants of each sample.
        """
        if variants not in self._fingerprints:
            self._fingerprints[variants] = data_fingerprint(self, variants)
        return self._fingerprints[variants]

    @property
    def augments(self) -> bool:
        """Whether items differ by variant (``augment``, or seeded transforms in the dataset)."""
        return self.augment is not None or self.seeded

    def __len__(self) -> int:
        return _size(self.dataset)

    def sample_id(self, index: int) -> int:
        """The sample id of item ``index``.

        Args:
            index: The item's index in ``dataset``.
        """
        return self.sample_ids[index] if self.sample_ids is not None else index

    def target(self, index: int) -> Any:
        """The target of item ``index``, without loading the item.

        Args:
            index: The item's index in ``dataset``.

        Raises:
            ConfigError: No ``targets`` were given.
        """
        if self.targets is None:
            raise ConfigError("IndexedDataset(targets=...) is needed to skip loading items")
        return self.targets(index) if callable(self.targets) else self.targets[index]

    def __getitem__(self, key: int | tuple[int, int] | tuple[int, int, bool]) -> tuple[int, Any]:
        """``(sample_id, item)``; for ``(index, variant, False)`` the item is not loaded: ``(sample_id, Skipped(target))``."""
        return self._load([key])[0]

    def _item(self, index: int, variant: int, seeding: frozenset[str]) -> tuple[int, Any]:
        """``(sample_id, item)``, loaded with the global generators in ``seeding`` seeded (not restored)."""
        sample_id = index if self.sample_ids is None else self.sample_ids[index]
        if seeding:
            seed_generators(sample_seed(sample_id, variant), seeding)
        item = self.dataset[index]
        if self.augment is not None:
            item = self.augment(item, torch.Generator().manual_seed(sample_seed(sample_id, variant)))
        return sample_id, item

    def __getitems__(self, keys: list) -> "list[tuple[int, Any]] | _Loaded | _Unloaded":
        """The items of one batch: one ``_Loaded`` (ids and items) for a replayed batch loading every input, one
        ``_Unloaded`` (ids and targets, gathered at once) for one loading none, else ``(sample_id, item)`` pairs."""
        replayed = bool(keys) and type(keys[0]) is tuple and len(keys[0]) == 3
        if replayed and all(map(_LOAD, keys)):
            indices = list(map(_INDEX, keys))
            ids = indices if self.sample_ids is None else [self.sample_ids[i] for i in indices]
            if self.seeded or self.augment is not None:
                return _Loaded(ids, [item for _, item in self._load(keys)])
            return _Loaded(ids, [self.dataset[i] for i in indices])
        if replayed and self.targets is not None and not any(map(_LOAD, keys)):
            indices = list(map(_INDEX, keys))
            targets = (self.targets[torch.tensor(indices, dtype=torch.int64)] if isinstance(self.targets, torch.Tensor)
                       else default_collate([self.target(i) for i in indices]))
            return _Unloaded([self.sample_id(i) for i in indices], targets)
        return self._load(keys)

    def _load(self, keys: list) -> list[tuple[int, Any]]:
        """``self[key]`` for each key; with ``seeded``, the generators saved once for them all and restored."""
        if not self.seeded:
            return self._load_keys(keys, frozenset())
        items, self._seeding = with_seeds(partial(self._load_keys, keys), self._seeding)
        return items

    def _load_keys(self, keys: list, seeding: frozenset[str]) -> list[tuple[int, Any]]:
        out = []
        for key in keys:
            index, variant, load = (*key, True)[:3] if isinstance(key, tuple) else (key, 0, True)
            out.append(self._item(index, variant, seeding) if load else (self.sample_id(index), Skipped(self.target(index))))
        return out


@dataclass(frozen=True)
class _Loaded:
    """A batch of which every input is loaded: its sample ids and its items."""

    sample_ids: list[int]
    items: list[Any]


@dataclass(frozen=True)
class _Unloaded:
    """A batch of which no input is loaded: its sample ids and its collated targets."""

    sample_ids: list[int]
    targets: Any


def _collate(collate: Callable[[list], Any], samples: list[tuple[int, Any]] | _Loaded | _Unloaded,
             ) -> tuple[torch.Tensor, torch.Tensor | None, Any]:
    """A batch's items (``IndexedDataset.__getitems__``) collated into ``(ids, loaded rows or None, data)`` (in
    the workers); with skipped items, ``data`` is ``(inputs of the loaded rows, targets of all rows)``."""
    if isinstance(samples, _Loaded):
        return torch.tensor(samples.sample_ids, dtype=torch.int64), None, collate(samples.items)
    if isinstance(samples, _Unloaded):
        return torch.tensor(samples.sample_ids, dtype=torch.int64), torch.empty(0, dtype=torch.int64), (None, samples.targets)
    ids = torch.tensor([s for s, _ in samples], dtype=torch.int64)
    loaded = [i for i, (_, item) in enumerate(samples) if not isinstance(item, Skipped)]
    if len(loaded) == len(samples):
        return ids, None, collate([item for _, item in samples])
    inputs = collate([samples[i][1] for i in loaded])[0] if loaded else None
    targets = default_collate([item.target if isinstance(item, Skipped) else item[1] for _, item in samples])
    return ids, torch.tensor(loaded, dtype=torch.int64), (inputs, targets)


class _Replay:
    """The inner loader's batch sampler: replays this epoch's batches as ``(index, variant, load)`` keys.

    ``skipped(position)`` (sample ids not to load) is asked as each batch is dispatched, so a freeze change
    after the epoch started reaches the batches not yet dispatched."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.first = self.variant = 0
        self.sample_id: Callable[[int], int] = int
        self.skipped: Callable[[int], frozenset[int]] | None = None

    def __iter__(self) -> Iterator[list[tuple[int, int, bool]]]:
        for position, batch in enumerate(list(self.batches), start=self.first):
            skip = self.skipped(position) if self.skipped is not None else frozenset()
            variant = self.variant
            yield ([(i, variant, self.sample_id(i) not in skip) for i in batch] if skip
                   else [(i, variant, True) for i in batch])

    def __len__(self) -> int:
        return len(self.batches)


def worker_options(loader: DataLoader) -> dict[str, Any]:
    """``loader``'s worker settings, for a DataLoader built in its place."""
    names = ["num_workers", "pin_memory", "timeout", "worker_init_fn", "multiprocessing_context", "persistent_workers"]
    if loader.num_workers > 0:
        names.append("prefetch_factor")
    return {name: getattr(loader, name) for name in names}


def _size(dataset: Dataset) -> int:
    """``len(dataset)``: a map-style dataset has one (torch's Dataset type declares no ``__len__``)."""
    return len(dataset)  # type: ignore[arg-type]


class CachedLoader:
    """Wraps a DataLoader over an IndexedDataset; yields Batch objects and feeds the cache its order.

    Works with any sampler and batch sampler (``RandomSampler``, ``DistributedSampler`` — call ``set_epoch``
    as usual —, ``drop_last``), ``num_workers > 0`` and persistent workers.

    Args:
        loader: A DataLoader over an IndexedDataset, with automatic batching.
        model: A CachedForward (or a CachedTeacher: a LoaderModel), or a list of them (``models``) fed by the
            same batches (a student and its teacher): each one's ``loader_side`` gets the data's fingerprint
            and every epoch's order, and the loader leaves out an input only when every one of them can do
            without it (the intersection of their ``skipped``).
        variants: K augmented versions of each sample are cached (epoch e sees version e % K); needed to
            cache a dataset that augments.

    Raises:
        ConfigError: The DataLoader is not over an IndexedDataset, has no automatic batching, or
            ``variants`` is below 1.
    """

    def __init__(self, loader: DataLoader, model: LoaderModel | Sequence[LoaderModel] | None = None, *,
                 variants: int | None = None) -> None:
        if not isinstance(loader.dataset, IndexedDataset):
            raise ConfigError("CachedLoader needs a DataLoader over an IndexedDataset (items paired with sample ids)")
        if loader.batch_sampler is None:
            raise ConfigError("CachedLoader needs automatic batching (a batch_size or batch_sampler on the DataLoader)")
        if variants is not None and variants < 1:
            raise ConfigError(f"variants must be >= 1, got {variants}")
        self.models = cast("list[LoaderModel]",
                           [] if model is None else list(model) if isinstance(model, (list, tuple)) else [model])
        self.loader, self.variants = loader, variants
        self._dataset: IndexedDataset = loader.dataset
        self.epoch = self._position = 0
        self._order: list[list[int]] | None = None  # indices of the current epoch's batches
        self._next_order: tuple[int, list[list[int]]] | None = None  # (epoch, its batches), drawn ahead
        self._replay = _Replay()
        self._drawn = False  # an order was drawn (persistent workers draw their base seed once)
        self._generator_after: dict[int, torch.Tensor] = {}  # epoch -> the loader generator's state after its draw
        #: Raw items the loader loaded (the inputs of skipped samples are not loaded).
        self.raw_items_loaded = 0
        dataset: IndexedDataset = loader.dataset
        self.cacheable = not dataset.random_transforms and (not dataset.augments or variants is not None)
        if not self.cacheable and self.models:
            why = ("the dataset declares random transforms actcache cannot control" if dataset.random_transforms
                   else "the dataset has random augmentation but no variants=K was given")
            warnings.warn(f"actcache: not caching: {why}; the frozen prefix is recomputed every step. "
                          "Pass augment= to IndexedDataset and variants=K to CachedLoader to cache K variants.",
                          UncacheableDataWarning, stacklevel=2)
            for m in self.models:
                m.loader_side.disable(why)
        self.data_identity = b""
        if self.models and self.cacheable:
            self.data_identity = dataset.fingerprint(variants if dataset.augments and variants is not None else 1)
            for m in self.models:
                m.loader_side.bind_data(self.data_identity, dataset.data_id or "")
        self._collate = loader.collate_fn if loader.collate_fn is not None else default_collate
        # Its own generator: the wrapped loader's one draws exactly what the wrapped loader would (_draw).
        generator = torch.Generator().manual_seed(loader.generator.initial_seed() if loader.generator else 0)
        self._inner = DataLoader(dataset, batch_sampler=self._replay, collate_fn=partial(_collate, self._collate),
                                 generator=generator, **worker_options(loader))

    @property
    def variant(self) -> int:
        """The augmentation variant of the current epoch (0 without augmentation)."""
        return self._variant_of(self.epoch)  # without variants (not cached): a fresh augmentation every epoch

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch (forwarded to the sampler's ``set_epoch`` when it has one).

        Args:
            epoch: The epoch about to start.
        """
        if epoch != self.epoch:
            self.epoch, self._position, self._order = epoch, 0, None

    def __len__(self) -> int:
        return len(self.loader.batch_sampler)  # type: ignore[arg-type]  # torch types it as any Sampler: it has one

    def _draw(self, epoch: int) -> list[list[int]]:
        """The batches (dataset indices) the wrapped loader's sampler gives for ``epoch``.

        A DataLoader draws its workers' base seed from its generator (or the global RNG) before its
        sampler draws the order; the same draw is made here first, so the order is the same as without
        actcache."""
        loader = self.loader
        if loader.num_workers == 0 or not loader.persistent_workers or not self._drawn:
            torch.empty((), dtype=torch.int64).random_(generator=loader.generator)
        self._drawn = True
        sampler = getattr(loader.batch_sampler, "sampler", None)
        set_epoch = getattr(sampler, "set_epoch", None)
        if set_epoch is not None:
            set_epoch(epoch)
        batches = loader.batch_sampler
        assert batches is not None, "checked when wrapped"
        order = [list(b) for b in batches]
        if loader.generator is not None:
            self._generator_after = {e: s for e, s in self._generator_after.items() if e >= self.epoch}
            self._generator_after[epoch] = loader.generator.get_state()
        return order

    def _variant_of(self, epoch: int) -> int:
        if not self._dataset.augments:
            return 0
        return epoch if self.variants is None else epoch % self.variants

    def _load(self, indices: list[int], variant: int, rows: list[int]) -> Any:
        """Load rows of one batch on the spot (in the training process) and collate their inputs."""
        return self._collate([self.loader.dataset[indices[r], variant][1] for r in rows])[0]

    def _skipped(self, position: int) -> frozenset[int]:
        """Sample ids of batch ``position`` whose inputs no model needs."""
        return frozenset.intersection(*(m.loader_side.skipped(position) for m in self.models))

    def _ids(self, order: list[list[int]]) -> list[list[int]]:
        ids = self._dataset.sample_ids
        return [list(batch) for batch in order] if ids is None else [[ids[i] for i in batch] for batch in order]

    def __iter__(self) -> Iterator[Batch]:
        if self._order is None:
            ahead, self._next_order = self._next_order, None
            self._order = ahead[1] if ahead is not None and ahead[0] == self.epoch else self._draw(self.epoch)
            self._position = 0
        start, variant = self._position, self.variant
        dataset = self._dataset
        streaming = bool(self.models) and self.cacheable
        skipping = streaming and dataset.targets is not None
        for m in self.models if streaming else ():
            m.loader_side.begin_epoch(self._ids(self._order), variant, start, epoch=self.epoch,
                                      data=self.data_identity, skip_loads=skipping)
        sampler = getattr(self.loader.batch_sampler, "sampler", None)
        deterministic = (hasattr(sampler, "set_epoch") or self.loader.generator is not None
                         or isinstance(sampler, SequentialSampler))
        ahead_at = len(self._order) // 2 if streaming and deterministic else -1
        replay = self._replay
        replay.batches, replay.first, replay.variant = self._order[start:], start, variant
        replay.sample_id, replay.skipped = dataset.sample_id, (self._skipped if skipping else None)
        sides = [m.loader_side for m in self.models]
        try:
            for position, (ids, loaded, data) in enumerate(self._inner, start=start):
                for side in sides:  # the loop asks for a batch: its last step is over
                    side.steps_ended()
                self._position = position + 1
                self.raw_items_loaded += ids.shape[0] if loaded is None else loaded.shape[0]
                if position == ahead_at and self._next_order is None:
                    self._next_order = (self.epoch + 1, self._draw(self.epoch + 1))
                    for m in self.models:
                        m.loader_side.prepare_next_epoch(self._ids(self._next_order[1]),
                                                         self._variant_of(self.epoch + 1))
                load = partial(self._load, self._order[position], variant) if loaded is not None else None
                yield Batch(ids=ids, data=data, variant=variant, epoch=self.epoch, position=position, loaded=loaded,
                            load=load)
        finally:
            # A bound method of this loader: kept, it would make the loader a cycle, freed (its DataLoader workers
            # shut down, for seconds when stopped mid-epoch) by the cycle collector on whichever thread runs it.
            replay.skipped = None
            for side in sides:
                side.steps_ended()
        self.epoch, self._position, self._order = self.epoch + 1, 0, None

    def state_dict(self) -> dict[str, Any]:
        """Epoch, position, this epoch's batches and the loader generator's state after drawing them:
        a run restored with ``load_state_dict`` goes on with the batches the uninterrupted run would see."""
        order = self._order
        if order is None and self._next_order is not None and self._next_order[0] == self.epoch:
            order = self._next_order[1]
        after = self._generator_after.get(self.epoch) if order is not None else None
        if after is None and self.loader.generator is not None:
            after = self.loader.generator.get_state()
        return {"epoch": self.epoch, "position": self._position, "order": order, "generator": after}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume where ``state_dict`` was taken: the same epoch, position and batches.

        Args:
            state: A ``state_dict()`` of this class.
        """
        self.epoch, self._position, self._order = state["epoch"], state["position"], state["order"]
        self._next_order = None
        if state.get("generator") is not None and self.loader.generator is not None:
            self.loader.generator.set_state(state["generator"])
