"""``ActCache``: the cache added to a plain training loop without changing the loop.

The wrapped loader yields what the user's DataLoader yields. Where the cache will serve a sample's prefix
and the dataset gives its target without loading it (``dataset.targets``), its input is not loaded: the
row holds zeros of the input's shape (a placeholder) that the model never reads.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader
from torch.utils.data._utils.collate import default_collate

from actcache.errors import ConfigError
from actcache_client._inplace import InPlacePrefix
from actcache_client._options import CacheOptions
from actcache_client.data._loader import CachedLoader, IndexedDataset, worker_options
from actcache_client.data._wrap_checks import check_loader, uncontrolled_randomness
from actcache_client.engine._batch import Batch
from actcache_client.engine._cached_forward import CachedForward
from actcache_client.layouts import Layout, blocks_layout, check_layout, find_layout
from actcache_client.layouts._stages import Stage, StagedModel
from actcache_client.transport._connection import Connection
from actcache_client.transport._node_daemon import connect
from actcache_client.transport._state import State, tensors_of
from actcache_client.transport._tensors import VarLen

__all__ = ["ActCache", "StageInfo", "WrappedLoader"]


@dataclass(frozen=True)
class StageInfo:
    """One stage of the network as ActCache found it.

    Attributes:
        name: What ``freeze`` takes.
        modules: The modules and parameters of the network it holds (dotted paths).
        parameters: Its number of parameters.
    """

    name: str
    modules: tuple[str, ...]
    parameters: int


def _stage_info(net: nn.Module, stage: Stage) -> StageInfo:
    paths = {id(m): name for name, m in net.named_modules()}
    params = {id(p): name for name, p in net.named_parameters()}
    found: list[str] = []
    inside: set[int] = set()
    for module in stage.modules():
        if id(module) in paths and id(module) not in inside:
            found.append(paths[id(module)] or "(the network)")
            inside.update(id(m) for m in module.modules())
    owned = {id(p) for m in stage.modules() if id(m) in inside for p in m.parameters()}
    found += [params[id(p)] for p in stage.parameters() if id(p) in params and id(p) not in owned]
    return StageInfo(stage.name, tuple(found), sum(p.numel() for p in stage.parameters()))


class ActCache:
    """Serves ``net``'s frozen prefix from the cache inside ``net`` itself.

    The stages come from the registry of layouts (``actcache_client.layouts``: nn.Sequential, ResNets,
    BERT, RoBERTa, ELECTRA, DistilBERT, Llama, Qwen2, Mistral, ViT, CLIP, ...) unless ``blocks`` or
    ``stages`` gives them. They are checked against ``net``'s own forward on the first batch. ``model``
    is the CachedForward serving the prefix: give it to a FreezeController. A network in
    DistributedDataParallel works either way round (``ActCache(ddp)``, or ``DistributedDataParallel(net)``
    after ``ActCache(net)``); DDP needs ``find_unused_parameters=True`` to follow parameters that stop
    receiving gradients when stages freeze.

    Args:
        net: The network; a DistributedDataParallel or DataParallel wrapper is unwrapped.
        connection: The daemon's connection; default: this node's daemon (``connect()``).
        stages: A StagedModel over ``net``'s own modules.
        blocks: The dotted path of the network's blocks (``"encoder.layers"``), an nn.ModuleList or
            nn.Sequential.
        inputs: Picks the network's input out of a batch as the loader yields it (default: its first field;
            for text ``input_ids``, ``attention_mask`` and ``token_type_ids``).
        options: How entries are stored and served (by default a CachePlanner decides whether serving
            beats recomputing; ``planner=None``: always serve).
        **given: CacheOptions fields as keywords, instead of ``options``.

    Raises:
        ConfigError: Both ``stages`` and ``blocks`` are given.
    """

    def __init__(self, net: nn.Module, connection: Connection | None = None, *,
                 stages: StagedModel | None = None, blocks: str | None = None,
                 inputs: Callable[[Any], State] | None = None, options: CacheOptions | None = None,
                 **given: Any) -> None:
        while isinstance(net, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            net = net.module
        self.net = net
        self.options = CacheOptions.of(options, **given)
        if stages is not None and blocks is not None:
            raise ConfigError("ActCache takes stages= or blocks=, not both: blocks= finds the stages from the "
                              "network's blocks, stages= gives them")
        if stages is not None:
            layout = Layout(stages)
        elif blocks is not None:
            layout = blocks_layout(net, blocks)
        else:
            layout = find_layout(net)
        if inputs is not None:
            layout = replace(layout, inputs_of=inputs)
        self.connection = connection if connection is not None else connect()
        self.model = CachedForward(layout.stages, self.connection, **self.options.forward_options(layout.varlen))
        self.layout = layout
        self.prefix = InPlacePrefix(self.model, self.net, output_of=layout.output_of)
        self._checked = not self.options.check  # the layout has been compared with the network's own forward

    @property
    def frozen(self) -> int:
        return self.model.frozen

    @property
    def stages(self) -> list[StageInfo]:
        """The stages found, in order: name, the network's modules each holds, parameters."""
        return [_stage_info(self.net, stage) for stage in self.model.model.stages]

    def freeze(self, depth: int | str) -> None:
        """Freeze a prefix of the stages; the next training step serves them.

        Args:
            depth: The number of stages to freeze (0 unfreezes all), or the name of the last stage to freeze.

        Raises:
            ConfigError: ``depth`` is out of range, names no stage, or names the head (which always trains).
        """
        depth = self._depth(depth)
        if depth != self.model.frozen:
            self.model.set_frozen(depth)
        self.prefix.sync()

    def _depth(self, depth: int | str) -> int:
        names = self.model.model.stage_names
        choices = f"a count of stages, 0..{len(names) - 1}, or a stage name: {', '.join(names[:-1])}"
        if isinstance(depth, str):
            if depth in names[:-1]:
                return names.index(depth) + 1
            head = f" ({depth!r} is the head, which always trains)" if depth == names[-1] else ""
            raise ConfigError(f"freeze({depth!r}): no stage of that name can freeze{head}; freeze takes {choices}")
        if isinstance(depth, bool) or not isinstance(depth, int) or not 0 <= depth < len(names):
            raise ConfigError(f"freeze({depth!r}): freeze takes {choices} (the head, {names[-1]!r}, always trains)")
        return depth

    def check(self, data: Any, loaded: Tensor | None = None) -> None:
        """Compare the stages with the network's own forward once, on the first batch (the wrapped loader calls
        it): a wrong layout is an error in the first step, not at a freeze hours later.

        Args:
            data: A batch as the loader yields it.
            loaded: The rows of the batch whose inputs were loaded (None: all).

        Raises:
            ConfigError: The stages and the network's forward part; it names the stage.
        """
        if self._checked or (loaded is not None and len(loaded) == 0):
            return
        _check_right_padding(self.model.varlen, self.layout.inputs_of(data))
        check_layout(self.net, self.layout, data, loaded)
        self._checked = True

    def wrap(self, loader: DataLoader, *, variants: int | None = None,
             targets: Sequence[Any] | Callable[[int], Any] | None = None, skip_loads: bool = True,
             epochs: float | None = None) -> "WrappedLoader":
        """``loader``'s batches, with the sample ids the cache needs kept on the side.

        Args:
            loader: The training DataLoader.
            variants: K when the dataset augments at random in ``__getitem__``: the cache keeps K augmented
                versions of each sample (epoch e sees version e % K), their random draws seeded by (sample,
                version), so it serves exactly what the model would compute; without it such a dataset is
                not cached (a warning says so).
            targets: The samples' targets (default: ``dataset.targets``): they let the loader skip loading
                the inputs the cache serves (their rows hold zeros).
            skip_loads: False loads every input.
            epochs: The run's epochs, where known (``expect_epochs``).

        Returns:
            A WrappedLoader yielding what ``loader`` yields.
        """
        check_loader(loader)
        if epochs is not None:
            self.expect_epochs(epochs)
        if skip_loads and targets is None:
            targets = getattr(loader.dataset, "targets", None)
        return WrappedLoader(self, loader, variants=variants, targets=targets if skip_loads else None)

    def expect_epochs(self, epochs: float) -> None:
        """Tell the cost model the run's length: it weighs the epoch that stores the entries against the epochs
        left to serve them (unknown, it assumes ``PlannerConfig.assume_remaining_epochs``; a ``total_epochs``
        configured is kept). The integrations tell it from the Trainer's settings.

        Args:
            epochs: The run's epochs.
        """
        if isinstance(epochs, bool) or not isinstance(epochs, (int, float)) or epochs <= 0:
            raise ConfigError(f"epochs is the run's number of epochs (> 0), got {epochs!r}")
        if self.model.planner is not None:
            self.model.planner.expect_epochs(epochs)

    def flush(self, timeout_s: float | None = None) -> None:
        """Store what the steps so far computed, and wait until the daemon has it: the outputs held until
        their step ended are sent. Call it while no step runs, e.g. at an epoch's end before a barrier of the
        ranks, so that no rank's next epoch finds another rank's last entries missing (and stores them again).

        Args:
            timeout_s: The longest wait (default: the connection's ``timeout_s``).
        """
        self.model.loader_side.steps_ended()
        self.connection.flush(timeout_s=self.connection.config.timeout_s if timeout_s is None else timeout_s)

    def close(self) -> None:
        self.model.loader_side.steps_ended()  # the puts held until the step ended
        self.connection.close()


class WrappedLoader:
    """Yields what the wrapped DataLoader yields, and tells the network's served prefix which samples they are.

    Made by ``ActCache.wrap``, whose arguments it takes.

    Args:
        cache: The ActCache serving the prefix.
        loader: The training DataLoader.
        variants: Augmented versions kept per sample (``ActCache.wrap``).
        targets: The samples' targets, to skip loading the inputs the cache serves.
    """

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
        """Set the epoch (forwarded to the sampler's ``set_epoch`` when it has one).

        Args:
            epoch: The epoch about to start.
        """
        self.cached.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        """Epoch, position and this epoch's batches: restored with ``load_state_dict``, a run resumes mid-epoch."""
        return self.cached.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume where ``state_dict`` was taken: the same epoch, position and batches.

        Args:
            state: A ``state_dict()`` of this class.
        """
        self.cached.load_state_dict(state)

    def __iter__(self) -> Iterator[Any]:
        prefix, inputs_of = self.cache.prefix, self.cache.layout.inputs_of
        try:
            for batch in self.cached:
                # with skipped loads: the rows the loader loaded, and placeholders for the others
                data = batch.data if batch.loaded is None else self._fill(batch)
                given = inputs_of(data)
                raw = _splittable(given, len(batch.ids)) if batch.loaded is None else batch.data[0]
                self.cache.check(data, batch.loaded)
                prefix.begin(batch.with_data((raw, None)), given[0] if isinstance(given, tuple) else given)
                yield data
        finally:
            prefix.end()

    def _fill(self, batch: Batch) -> Any:
        """The batch as the user's collate would give it, with placeholder rows for the inputs not loaded."""
        inputs, targets = batch.data
        placeholder = self._placeholder
        assert placeholder is not None, "only batches whose loads were skipped are filled"
        shape = (len(batch.ids), *placeholder.shape)
        if inputs is None or not len(inputs):
            full = self._all_zeros(shape, placeholder.dtype)
        else:
            full = torch.zeros(shape, dtype=placeholder.dtype, pin_memory=self._pin)
            full[batch.loaded] = inputs
        return [full, targets] if self._as_list else (full, targets)

    def _all_zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        """Zeros of ``shape``: the buffer kept from the last such batch when it is still zeros (writing a
        batch of zeros every step costs as much as copying the entries in)."""
        if self._zeros is not None and self._zeros[0].shape == shape:
            zeros, version = self._zeros
            if zeros._version != version:
                zeros.zero_()
        else:
            zeros = torch.zeros(shape, dtype=dtype, pin_memory=self._pin)
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


def _check_right_padding(varlen: VarLen | None, inputs: State) -> None:
    """A ConfigError if text stored at each sample's own length (VarLen) comes padded on the left."""
    tensors = tensors_of(inputs)
    if varlen is None or len(tensors) <= varlen.mask_index:
        return
    mask = tensors[varlen.mask_index]
    if isinstance(mask, Tensor) and mask.dim() == 2 and mask.shape[1] > 0 and \
            bool(((mask[:, 0] == 0) & (mask != 0).any(dim=1)).any()):
        raise ConfigError(
            "the batches are padded on the left, and text is stored at each sample's own length only with right "
            "padding: pad on the right (tokenizer.padding_side = 'right'), or pad every batch to one length "
            "(padding='max_length') and store it whole with varlen=None (CacheOptions(varlen=None))")
