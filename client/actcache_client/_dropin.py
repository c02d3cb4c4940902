"""``ActCache``: the cache added to a plain training loop without changing the loop.

The wrapped loader yields what the user's DataLoader yields. Where the cache will serve a sample's prefix
and the dataset gives its target without loading it (``dataset.targets``), its input is not loaded: the
row holds zeros of the input's shape (a placeholder) that the model never reads.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader
from torch.utils.data._utils.collate import default_collate

from actcache.errors import ConfigError
from actcache_client._batch import Batch
from actcache_client._cached_forward import CachedForward
from actcache_client._connection import Connection
from actcache_client._inplace import InPlacePrefix
from actcache_client._loader import CachedLoader, IndexedDataset, worker_options
from actcache_client._node_daemon import connect
from actcache_client._planner import CachePlanner
from actcache_client._stages import (StagedModel, State, from_bert, from_resnet, from_sequential, from_transformers,
                                     is_transformers_model, tensors_of)
from actcache_client._tensors import VarLen
from actcache_client._wrap_checks import check_loader, uncontrolled_randomness

__all__ = ["ActCache", "WrappedLoader"]


def _first_field(data: Any) -> Any:
    if isinstance(data, Mapping):
        raise ConfigError(f"the loader yields dicts (keys {sorted(data)}); say which field is the network's input: "
                          "ActCache(net, inputs=lambda batch: batch['image'])")
    return data[0] if isinstance(data, (list, tuple)) else data


@dataclass(frozen=True)
class _Layout:
    """How a network's stages are found, and how its batches and states map to theirs."""

    stages: StagedModel
    varlen: VarLen | None = None
    inputs_of: Callable[[Any], State] = _first_field
    output_of: Callable[[State, Tensor], Any] = lambda state, _: state


def _bert_inputs(data: Any) -> State:
    if isinstance(data, Mapping):  # a dict, or transformers' BatchEncoding
        if "input_ids" not in data:
            raise ConfigError(f"a BERT batch needs 'input_ids'; the collate gave keys {sorted(data)}")
        ids = data["input_ids"]
        mask = data.get("attention_mask")
        if mask is None and isinstance(ids, Tensor):
            mask = torch.ones_like(ids)
        types = data.get("token_type_ids")
        return (ids, mask) if types is None else (ids, mask, types)
    if isinstance(data, (list, tuple)) and data and isinstance(data[0], (list, tuple, Mapping)):
        return _bert_inputs(data[0])  # ((input_ids, attention_mask[, token_type_ids]), labels)
    return tuple(data[:3]) if isinstance(data, (list, tuple)) else data


def _bert_hidden(state: State, input_ids: Tensor) -> Tensor:
    """The served ``(hidden, mask)`` as the encoder's next layer takes it: hidden padded to the batch's length."""
    hidden = state[0]
    missing = input_ids.shape[1] - hidden.shape[1]
    return hidden if missing <= 0 else nn.functional.pad(hidden, (0, 0, 0, missing))


def _layout(net: nn.Module) -> _Layout:
    if isinstance(net, nn.Sequential):
        return _Layout(from_sequential(net))
    if hasattr(net, "conv1") and hasattr(net, "layer1"):
        return _Layout(from_resnet(net))
    if is_transformers_model(net):
        return _Layout(from_transformers(net), VarLen(), _bert_inputs, _bert_hidden)
    if hasattr(getattr(net, "bert", net), "embeddings") and hasattr(net, "classifier"):
        return _Layout(from_bert(net), VarLen(), _bert_inputs, _bert_hidden)
    raise ConfigError(
        f"actcache cannot tell the stages of a {type(net).__name__}: it knows nn.Sequential, ResNets "
        "(conv1, bn1, relu, layer1..) and BERT classifiers (.bert.embeddings/.encoder.layer, .classifier); "
        "pass stages=StagedModel([...]) built from the network's own modules, in the order it calls them"
    )


class ActCache:
    """Serves ``net``'s frozen prefix from the cache inside ``net`` itself.

    ``connection`` defaults to this node's daemon (``connect()``). ``stages`` (a StagedModel over
    ``net``'s own modules) overrides the layout found from ``net`` (a ResNet, a BERT classifier, an
    nn.Sequential). ``inputs(batch)`` picks the network's input out of a batch as the loader yields it
    (default: its first field; for BERT ``input_ids``, ``attention_mask`` and ``token_type_ids``).
    ``options`` are CachedForward's (``store_dtype``, ``audit``, ``planner``, ...); ``planner`` defaults to a
    ``CachePlanner()`` (the cost model decides whether serving beats recomputing; ``planner=None``: always
    serve). ``model`` is that
    CachedForward: give it to a FreezeController. A network in DistributedDataParallel works either way
    round (``ActCache(ddp)``, or ``DistributedDataParallel(net)`` after ``ActCache(net)``); DDP needs
    ``find_unused_parameters=True`` to follow parameters that stop receiving gradients when stages freeze.
    """

    def __init__(self, net: nn.Module, connection: Connection | None = None, *,
                 stages: StagedModel | None = None, inputs: Callable[[Any], State] | None = None,
                 **options: Any) -> None:
        while isinstance(net, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            net = net.module
        self.net = net
        layout = _layout(net) if stages is None else _Layout(stages, options.pop("varlen", None))
        if inputs is not None:
            layout = replace(layout, inputs_of=inputs)
        options.setdefault("varlen", layout.varlen)
        # By default the cost model decides whether serving the prefix beats recomputing it (planner=None: always serve).
        options.setdefault("planner", CachePlanner())
        self.connection = connection if connection is not None else connect()
        self.model = CachedForward(layout.stages, self.connection, **options)
        self.layout = layout
        self.prefix = InPlacePrefix(self.model, self.net, output_of=layout.output_of)

    @property
    def frozen(self) -> int:
        return self.model.frozen

    def freeze(self, depth: int) -> None:
        """Freeze the first ``depth`` stages (0 unfreezes all); the next training step serves them."""
        if depth != self.model.frozen:
            self.model.set_frozen(depth)
        self.prefix.sync()

    def wrap(self, loader: DataLoader, *, variants: int | None = None,
             targets: Sequence[Any] | Callable[[int], Any] | None = None, skip_loads: bool = True) -> "WrappedLoader":
        """``loader``'s batches, with the sample ids the cache needs kept on the side.

        ``variants=K``: the dataset augments at random in ``__getitem__``; the cache keeps K augmented
        versions of each sample (epoch e sees version e % K), their random draws seeded by (sample,
        version), so it serves exactly what the model would compute; without it such a dataset is not
        cached (a warning says so). ``targets`` (default: ``dataset.targets``) lets the loader skip loading
        the inputs the cache serves (their rows hold zeros); ``skip_loads=False`` loads every input.
        """
        check_loader(loader)
        if skip_loads and targets is None:
            targets = getattr(loader.dataset, "targets", None)
        return WrappedLoader(self, loader, variants=variants, targets=targets if skip_loads else None)

    def close(self) -> None:
        self.connection.close()


class WrappedLoader:
    """Yields what the wrapped DataLoader yields, and tells the network's served prefix which samples they are."""

    def __init__(self, cache: ActCache, loader: DataLoader, *, variants: int | None,
                 targets: Sequence[Any] | Callable[[int], Any] | None) -> None:
        check_loader(loader)
        dataset = loader.dataset
        example = dataset[0]
        skippable = (targets is not None and loader.collate_fn is default_collate and isinstance(example, tuple)
                     and len(example) == 2 and isinstance(example[0], Tensor))
        random = uncontrolled_randomness(dataset, variants)
        indexed = IndexedDataset(dataset, targets=targets if skippable else None, seeded=variants is not None,
                                 random_transforms=random)
        inner = DataLoader(indexed, batch_sampler=loader.batch_sampler, collate_fn=loader.collate_fn,
                           generator=loader.generator, **worker_options(loader))
        self.cache = cache
        self.loader = loader
        with warnings.catch_warnings():  # said above, in the user's terms
            warnings.simplefilter("ignore")
            self.cached = CachedLoader(inner, cache.model, variants=variants)
        self._placeholder = example[0] if skippable else None
        self._pin = bool(loader.pin_memory) and torch.cuda.is_available()
        # A batch whose inputs were all skipped yields this buffer of zeros (made once per batch size, pinned
        # like the loader's batches), and its version: it is zeroed again only if the loop wrote into it.
        self._zeros: tuple[Tensor, int] | None = None
        self._as_list = isinstance(default_collate([example]), list)

    def __len__(self) -> int:
        return len(self.cached)

    @property
    def dataset(self) -> Any:
        """The wrapped DataLoader's dataset."""
        return self.loader.dataset

    @property
    def batch_size(self) -> int | None:
        return self.loader.batch_size

    @property
    def epoch(self) -> int:
        return self.cached.epoch

    def set_epoch(self, epoch: int) -> None:
        self.cached.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        """Epoch, position and this epoch's batches: restored with ``load_state_dict``, a run resumes mid-epoch."""
        return self.cached.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.cached.load_state_dict(state)

    def __iter__(self) -> Iterator[Any]:
        prefix, inputs_of = self.cache.prefix, self.cache.layout.inputs_of
        try:
            for batch in self.cached:
                # with skipped loads: the rows the loader loaded, and placeholders for the others
                data = batch.data if batch.loaded is None else self._fill(batch)
                given = inputs_of(data)
                raw = _splittable(given, len(batch.ids)) if batch.loaded is None else batch.data[0]
                prefix.begin(replace(batch, data=(raw, None)), given[0] if isinstance(given, tuple) else given)
                yield data
        finally:
            prefix.end()

    def _fill(self, batch: Batch) -> Any:
        """The batch as the user's collate would give it, with placeholder rows for the inputs not loaded."""
        inputs, targets = batch.data
        shape = (len(batch.ids), *self._placeholder.shape)
        if inputs is None or not len(inputs):
            full = self._all_zeros(shape)
        else:
            full = torch.zeros(shape, dtype=self._placeholder.dtype, pin_memory=self._pin)
            full[batch.loaded] = inputs
        return [full, targets] if self._as_list else (full, targets)

    def _all_zeros(self, shape: tuple[int, ...]) -> Tensor:
        """Zeros of ``shape``: the buffer kept from the last such batch when it is still zeros (writing a
        batch of zeros every step costs as much as copying the entries in)."""
        if self._zeros is not None and self._zeros[0].shape == shape:
            zeros, version = self._zeros
            if zeros._version != version:
                zeros.zero_()
        else:
            zeros = torch.zeros(shape, dtype=self._placeholder.dtype, pin_memory=self._pin)
        self._zeros = (zeros, zeros._version)
        return zeros


def _splittable(state: Any, rows: int) -> State:
    """``state`` if the cache can split it into one entry per sample: tensors whose first dimension is the batch."""
    tensors = tensors_of(state)
    if all(isinstance(t, Tensor) and t.dim() > 0 and t.shape[0] == rows for t in tensors):
        return state
    found = ", ".join(f"{type(t).__name__}{list(t.shape) if isinstance(t, Tensor) else ''}" for t in tensors)
    raise ConfigError(
        f"actcache cannot split this batch's inputs into its {rows} samples: the model's inputs are {found}; "
        f"the cache needs tensors whose first dimension is the batch ({rows}): return tensors from the collate_fn "
        "(a transformers collator: return_tensors='pt'), one row per sample, no packing"
    )
