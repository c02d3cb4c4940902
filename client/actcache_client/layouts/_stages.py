"""Split a model into an ordered list of stages, each mapping a state to a state.

A *state* is a tensor or a tuple of tensors (a BERT layer carries ``(hidden, attention_mask)``).
The frozen prefix ``stages[:k]`` is what the cache serves; ``run(state, k)`` finishes the forward
pass from a cached state. Adapters hold the model's own submodules, never copies, and call them in
the order its ``forward`` does (torchvision ResNet, HF BERT); the tests check bit-identical outputs.
"""

from __future__ import annotations

import bisect
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, cast, overload

import torch
from torch import Tensor, nn

from actcache.errors import ConfigError
from actcache_client.transport._state import State, tensors_of

__all__ = [
    "Stage",
    "StagedModel",
    "additive_mask",
    "auto_partition",
    "call_sites",
    "from_bert",
    "from_resnet",
    "from_sequential",
    "from_transformers",
    "is_transformers_model",
]

_FALLBACK = "pass an nn.Sequential or build stages with StagedModel([...])"


class Stage(nn.Module):
    """A named ``state -> state`` step; ``module`` is called with the state as its only argument.

    A stage whose module runs what the network computes before its first block names that block in
    ``sites``: the network runs the rest itself.

    Args:
        name: The stage's name, unique in its StagedModel.
        module: Called with the state as its only argument.
        sites: The network's modules where the frozen prefix is served in place, in the order the network
            calls them (default: the topmost of the network's modules in ``module``).

    Raises:
        ConfigError: An empty name, a module that is not an nn.Module, or sites that are empty or outside
            ``module``.
    """

    def __init__(self, name: str, module: nn.Module, *, sites: Sequence[nn.Module] | None = None) -> None:
        super().__init__()
        if not isinstance(name, str) or not name:
            raise ConfigError(f"stage name must be a non-empty str, got {name!r}")
        if not isinstance(module, nn.Module):
            raise ConfigError(f"stage {name!r}: module must be an nn.Module, got {type(module).__name__}")
        self.name = name
        self.module = module
        inside = {id(m) for m in module.modules()}
        if sites is not None and (not sites or any(id(m) not in inside for m in sites)):
            raise ConfigError(f"stage {name!r}: sites must be a non-empty list of modules inside the stage's module")
        self.sites: list[nn.Module] | None = None if sites is None else list(sites)  # a list: not registered

    def forward(self, state: State) -> State:
        """Run the stage.

        Args:
            state: The stage's input state.
        """
        return self.module(state)

    def extra_repr(self) -> str:
        return f"name={self.name!r}"


if TYPE_CHECKING:
    class _StageList(nn.ModuleList):
        """StagedModel.stages as the type checker sees it: a ModuleList of Stages."""

        def __iter__(self) -> Iterator[Stage]: ...
        @overload
        def __getitem__(self, idx: slice) -> _StageList: ...
        @overload
        def __getitem__(self, idx: int) -> Stage: ...
        def __getitem__(self, idx: int | slice) -> Stage | _StageList: ...


class StagedModel(nn.Module):
    """An ordered, non-empty list of uniquely named stages; ``forward(x)`` runs them all.

    Args:
        stages: The stages, in order.

    Raises:
        ConfigError: No stages, an item that is not a Stage, or repeated names.
    """

    stages: _StageList

    def __init__(self, stages: Iterable[Stage]) -> None:
        super().__init__()
        stages = list(stages)
        if not stages:
            raise ConfigError("StagedModel needs at least one stage, got an empty list")
        for i, s in enumerate(stages):
            if not isinstance(s, Stage):
                raise ConfigError(f"stage {i} is a {type(s).__name__}, not a Stage; wrap it as Stage(name, module)")
        names = [s.name for s in stages]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ConfigError(f"stage names must be unique; repeated: {dupes}; rename them in Stage(name, module)")
        self.stages = cast("_StageList", nn.ModuleList(stages))  # every item is a Stage (checked above)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def stage_names(self) -> list[str]:
        return [s.name for s in self.stages]

    def param_counts(self) -> list[int]:
        """Number of parameter elements in each stage (a tensor shared by two stages counts in both)."""
        return [sum(p.numel() for p in s.parameters()) for s in self.stages]

    def run(self, state: State, start: int = 0, stop: int | None = None) -> State:
        """Run ``stages[start:stop]`` on ``state``; ``start == stop`` returns ``state`` unchanged.

        Args:
            state: The input of stage ``start``.
            start: The first stage to run.
            stop: The stage to stop before (default: all the rest).

        Raises:
            ConfigError: Not ``0 <= start <= stop <= num_stages``.
        """
        n = self.num_stages
        stop = n if stop is None else stop
        if not 0 <= start <= stop <= n:
            raise ConfigError(
                f"StagedModel.run needs 0 <= start <= stop <= {n} (num_stages), got start={start}, stop={stop}; "
                "pass start and stop within the model's stages"
            )
        for stage in self.stages[start:stop]:
            state = stage(state)
        return state

    def forward(self, x: State) -> State:
        """Run every stage.

        Args:
            x: The model's input state.
        """
        return self.run(x)

    def suffix(self, start: int) -> StagedModel:
        """The active stages ``stages[start:]`` as a model of their own, e.g. to wrap in DistributedDataParallel.

        It holds this model's own Stage objects: its parameters are this model's, without the frozen prefix.

        Args:
            start: The first active stage.

        Raises:
            ConfigError: ``start`` is not in ``0..num_stages - 1``.
        """
        if not 0 <= start < self.num_stages:
            raise ConfigError(
                f"StagedModel.suffix(start) needs start in 0..{self.num_stages - 1} (num_stages - 1), got {start}"
            )
        return StagedModel(self.stages[start:])


def call_sites(net: nn.Module, stages: Sequence[nn.Module]) -> list[list[nn.Module]]:
    """For each stage, the topmost modules of ``net`` in it (a residual block; a ResNet stem's ``conv1, bn1,
    relu``), in registration order, which the adapters keep in the order ``net`` calls them; or the sites a
    Stage names (``Stage(..., sites=[block])``)."""
    owned = {id(m) for m in net.modules()}
    sites: list[list[nn.Module]] = []
    for stage in stages:
        found: list[nn.Module] = []
        inside: set[int] = set()
        for module in stage.modules():
            if id(module) in inside:
                continue
            named = getattr(module, "sites", None) if isinstance(module, Stage) else None
            if named is not None or id(module) in owned:  # a Stage naming its sites: those, in its place
                found.extend([module] if named is None else named)
                inside.update(id(m) for m in module.modules())
        sites.append(found)
    return sites


def _merge(stages: Sequence[Stage]) -> Stage:
    """One stage running ``stages`` in order, named ``"first..last"`` (or the single stage itself)."""
    if len(stages) == 1:
        return stages[0]
    first, last = stages[0].name.split("..")[0], stages[-1].name.split("..")[-1]
    return Stage(f"{first}..{last}", nn.Sequential(*stages))


def from_sequential(seq: nn.Sequential, groups: Sequence[int] | None = None) -> StagedModel:
    """One stage per child of ``seq``, or per run of ``groups[i]`` consecutive children.

    Stages are named after the children (``"0"``, ``"1"``, or the OrderedDict keys); a group of several
    children is named ``"first..last"``.

    Args:
        seq: The network.
        groups: The number of consecutive children in each stage (positive, summing to the children's
            count); default: one child per stage.

    Raises:
        ConfigError: ``seq`` is not a non-empty nn.Sequential, or ``groups`` does not fit it.
    """
    if not isinstance(seq, nn.Sequential):
        raise ConfigError(
            f"from_sequential expects an nn.Sequential, got {type(seq).__name__}; "
            "use from_resnet / from_bert, or build stages with StagedModel([...])"
        )
    children = [Stage(name, child) for name, child in seq.named_children()]
    if not children:
        raise ConfigError("from_sequential got an empty nn.Sequential; it has no stages to split")
    groups = [1] * len(children) if groups is None else list(groups)
    if any(not isinstance(g, int) or g < 1 for g in groups) or sum(groups) != len(children):
        raise ConfigError(
            f"from_sequential: groups must be positive ints summing to {len(children)} (the number of children), "
            f"got {groups}"
        )
    bounds = [sum(groups[:i]) for i in range(len(groups) + 1)]
    return StagedModel(_merge(children[a:b]) for a, b in zip(bounds, bounds[1:]))


def _require(model: object, path: str, expected: str) -> nn.Module:
    if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        raise ConfigError(
            f"the model is wrapped in {type(model).__name__}; stage the network inside it ({type(model).__name__}"
            "(net).module) and wrap the active stages with CachedForward.set_suffix_wrapper, or use ActCache(net), "
            "which serves the frozen prefix inside the wrapped network")
    obj = model
    for part in path.split("."):
        obj = getattr(obj, part, None)
    if not isinstance(obj, nn.Module):
        raise ConfigError(f"model has no attribute {path!r}; expected {expected}; {_FALLBACK}")
    return obj


_RESNET = "a torchvision-style ResNet (conv1, bn1, relu, layer1.., avgpool, fc)"


def from_resnet(model: nn.Module) -> StagedModel:
    """Stages ``stem``, ``layer1.0`` .. ``layerN.M`` (one per residual block), ``head``.

    The stem is ``conv1, bn1, relu`` plus ``maxpool`` if the model has one (CIFAR-style ResNets have none);
    ``layer1``, ``layer2``, ... are taken while they exist (up to ``layer4``); the head is ``avgpool,
    flatten(1), fc``.

    Args:
        model: A torchvision-style ResNet (conv1, bn1, relu, layer1.., avgpool, fc), not wrapped in DDP.

    Raises:
        ConfigError: The model lacks one of those parts, or is wrapped in (Distributed)DataParallel.
    """
    stem = [_require(model, name, _RESNET) for name in ("conv1", "bn1", "relu")]
    maxpool = getattr(model, "maxpool", None)
    if isinstance(maxpool, nn.Module):
        stem.append(maxpool)
    stages = [Stage("stem", nn.Sequential(*stem))]
    _require(model, "layer1", _RESNET)
    for i in range(1, 5):
        layer = getattr(model, f"layer{i}", None)
        if layer is None:
            break
        if not isinstance(layer, nn.Sequential) or len(layer) == 0:
            raise ConfigError(
                f"model.layer{i} is a {type(layer).__name__}; expected a non-empty nn.Sequential of "
                f"residual blocks as in {_RESNET}; {_FALLBACK}"
            )
        stages += [Stage(f"layer{i}.{name}", block) for name, block in layer.named_children()]
    head = [_require(model, "avgpool", _RESNET), nn.Flatten(1), _require(model, "fc", _RESNET)]
    stages.append(Stage("head", nn.Sequential(*head)))
    return StagedModel(stages)


_BERT = "an HF-style BERT classifier (.bert or .embeddings/.encoder.layer/.pooler, and .classifier)"


class _Embeddings(nn.Module):
    """``(input_ids[, attention_mask[, token_type_ids]]) -> (hidden, attention_mask)``; the layers after it
    need only the mask (the segments are in ``hidden``)."""

    def __init__(self, embeddings: nn.Module, needs_mask: bool = False) -> None:
        super().__init__()
        self.embeddings = embeddings
        self.needs_mask = needs_mask

    def forward(self, state: State) -> tuple[Tensor, Tensor]:
        state = tensors_of(state)
        if self.needs_mask and not 2 <= len(state) <= 3:
            raise ConfigError("a transformers encoder's state is (input_ids, attention_mask[, token_type_ids]); "
                              "give the batch an attention_mask (DataCollatorWithPadding does)")
        if not 1 <= len(state) <= 3:
            raise ConfigError(
                f"a BERT state is input_ids, (input_ids, attention_mask) or (input_ids, attention_mask, "
                f"token_type_ids); got a tuple of {len(state)} tensors: return one of those from the collate_fn"
            )
        input_ids = state[0]
        mask = state[1] if len(state) > 1 else torch.ones_like(input_ids)
        token_types = state[2] if len(state) > 2 else torch.zeros_like(input_ids)
        return self.embeddings(input_ids=input_ids, token_type_ids=token_types), mask


def additive_mask(hidden: Tensor, mask: Tensor) -> Tensor:
    """HF's extended mask for eager attention: ``(1 - mask[:, None, None, :]) * finfo(dtype).min``."""
    return (1.0 - mask[:, None, None, :].to(dtype=hidden.dtype)) * torch.finfo(hidden.dtype).min


def _bidirectional_mask(config: object, hidden: Tensor, mask: Tensor) -> Tensor:
    from transformers.masking_utils import create_bidirectional_mask

    return create_bidirectional_mask(config=config, inputs_embeds=hidden, attention_mask=mask)


class SharedMask:
    """``extend(hidden, mask)`` computed once per forward and shared by the layers of one model, as the
    model's own forward does (the mask state passes from layer to layer unchanged): the last result is kept
    for the mask tensor it came from, unchanged since (its version), and the hidden state's dtype, device and
    leading shape. Pickled (for the reference process) without it."""

    def __init__(self, extend: Callable[[Tensor, Tensor], Tensor] = additive_mask) -> None:
        self.extend = extend
        self._last: tuple[weakref.ref, int, tuple, Tensor] | None = None

    def __call__(self, hidden: Tensor, mask: Tensor) -> Tensor:
        key = (hidden.dtype, hidden.device, tuple(hidden.shape[:2]))
        last = self._last
        if last is not None and last[0]() is mask and last[1] == mask._version and last[2] == key:
            return last[3]
        extended = self.extend(hidden, mask)
        self._last = (weakref.ref(mask), mask._version, key, extended)
        return extended

    def __getstate__(self) -> dict[str, Any]:
        return {"extend": self.extend, "_last": None}


class EncoderLayer(nn.Module):
    """``(hidden, mask) -> (hidden, mask)``; the layer gets ``extend(hidden, mask)``, the mask its model
    builds (a module-level callable or a SharedMask: stages are pickled for the reference process)."""

    def __init__(self, layer: nn.Module, extend: Callable[[Tensor, Tensor], Tensor] = additive_mask) -> None:
        super().__init__()
        self.layer = layer
        self.extend = extend

    def forward(self, state: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        hidden, mask = state
        out = self.layer(hidden, self.extend(hidden, mask))
        return (out[0] if isinstance(out, tuple) else out), mask


class ClassifierHead(nn.Module):
    """``(hidden, mask) -> logits``: pooler (reads the [CLS] token), dropout if any, classifier; without
    a pooler (RoBERTa) the classifier reads the first token itself."""

    def __init__(self, pooler: nn.Module | None, dropout: nn.Module | None, classifier: nn.Module) -> None:
        super().__init__()
        self.pooler = pooler
        self.dropout = dropout
        self.classifier = classifier

    def forward(self, state: tuple[Tensor, Tensor]) -> Tensor:
        if self.pooler is None:
            return self.classifier(state[0])
        pooled = self.pooler(state[0])
        return self.classifier(pooled if self.dropout is None else self.dropout(pooled))


def _encoder_stages(model: Any, body: Any, layers: Iterable[nn.Module], extend: Callable[..., Tensor],
                    needs_mask: bool) -> StagedModel:
    pooler, dropout = getattr(body, "pooler", None), getattr(model, "dropout", None)
    head = ClassifierHead(pooler if isinstance(pooler, nn.Module) else None,
                          dropout if isinstance(dropout, nn.Module) else None, model.classifier)
    stages = [Stage("embeddings", _Embeddings(body.embeddings, needs_mask))]
    shared = SharedMask(extend)  # one extended mask per forward, as the model computes it
    stages += [Stage(f"encoder.layer.{i}", EncoderLayer(layer, shared)) for i, layer in enumerate(layers)]
    return StagedModel([*stages, Stage("head", head)])


def from_bert(model: nn.Module) -> StagedModel:
    """Stages ``embeddings``, ``encoder.layer.0`` .. ``encoder.layer.L-1``, ``head`` of an HF-style BERT classifier.

    Accepts ``model.bert.{embeddings,encoder,pooler}`` (or the same on ``model``) and ``model.classifier``,
    with ``model.dropout`` before it if present. The input state is ``(input_ids, attention_mask[,
    token_type_ids])`` (token types: the segments of a sentence pair, else all 0); after the embeddings
    it is ``(hidden, attention_mask)``.

    Args:
        model: An HF-style BERT classifier, not wrapped in DDP.

    Raises:
        ConfigError: The model lacks one of those parts, or is wrapped in (Distributed)DataParallel.
    """
    body = getattr(model, "bert", model)
    _require(body, "embeddings", _BERT)
    layers = _require(body, "encoder.layer", _BERT)
    if not isinstance(layers, (nn.ModuleList, nn.Sequential)) or len(layers) == 0:
        raise ConfigError(
            f"model.encoder.layer is a {type(layers).__name__}; expected a non-empty nn.ModuleList "
            f"as in {_BERT}; {_FALLBACK}"
        )
    _require(body, "pooler", _BERT)
    _require(model, "classifier", _BERT)
    return _encoder_stages(model, body, layers, additive_mask, needs_mask=False)


_BODIES = ("bert", "roberta")


def is_transformers_model(net: nn.Module) -> bool:
    return type(net).__module__.startswith("transformers.")


def from_transformers(model: nn.Module) -> StagedModel:
    """``from_bert`` for a transformers encoder classifier (body ``.bert`` or ``.roberta``, a ``.classifier``).

    Each layer gets the mask the model itself builds for its attention implementation
    (``create_bidirectional_mask``), so the prefix is the model's own computation, bit for bit.
    """
    body = next((getattr(model, name) for name in _BODIES if isinstance(getattr(model, name, None), nn.Module)), None)
    layers = getattr(getattr(body, "encoder", None), "layer", None)
    if body is None or not isinstance(getattr(body, "embeddings", None), nn.Module) \
            or not isinstance(layers, nn.ModuleList) or not isinstance(getattr(model, "classifier", None), nn.Module):
        raise ConfigError(
            f"actcache cannot stage a {type(model).__name__}: it knows transformers classifiers whose body "
            f"(.{' or .'.join(_BODIES)}) has .embeddings and .encoder.layer, with a .classifier "
            "(BertForSequenceClassification, RobertaForSequenceClassification); pass "
            "stages=StagedModel([...]) built from the model's own modules, in the order it calls them"
        )
    if getattr(body.config, "is_decoder", False):
        raise ConfigError(f"{type(model).__name__} is configured as a decoder (causal attention); actcache stages "
                          "encoders: set is_decoder=False or pass stages=StagedModel([...])")
    return _encoder_stages(model, body, layers, partial(_bidirectional_mask, body.config), needs_mask=True)


def _greedy(counts: Sequence[int], capacity: int) -> list[list[int]]:
    """Fill groups front to back; see :func:`auto_partition` for when a new group starts."""
    groups: list[list[int]] = [[]]
    load = 0
    for i, c in enumerate(counts):
        if load > 0 and c > 0 and load + c > capacity:
            groups.append([])
            load = 0
        groups[-1].append(i)
        load += c
    return groups


def auto_partition(
    staged: StagedModel, max_stages: int | None = None, target_params: int | None = None
) -> StagedModel:
    """Merge consecutive stages into groups of similar parameter count (Egeria-style).

    The rule: pick a capacity, then walk the stages in order; a stage starts a new group only if it has
    parameters, the current group has parameters, and adding it would push the group past the capacity.
    So a stage larger than the capacity gets a group of its own, and parameter-free stages (activations,
    pooling) join the group before them.

    The capacity is ``target_params`` if given, else ``ceil(total / max_stages)``; with ``max_stages`` it
    is then raised to the smallest value that yields at most ``max_stages`` groups. Stages are never
    reordered or split; a merged stage is named ``"first..last"`` and shares parameters.

    Args:
        staged: The stages to merge.
        max_stages: The most groups.
        target_params: The capacity of a group, in parameter elements.

    Raises:
        ConfigError: Neither ``max_stages`` nor ``target_params`` is given, or one is below 1.
    """
    if max_stages is None and target_params is None:
        raise ConfigError("auto_partition needs max_stages or target_params (or both); got neither")
    if max_stages is not None and max_stages < 1:
        raise ConfigError(f"auto_partition: max_stages must be >= 1, got {max_stages}")
    if target_params is not None and target_params < 1:
        raise ConfigError(f"auto_partition: target_params must be >= 1 parameter, got {target_params}")
    counts = staged.param_counts()
    total = sum(counts)
    if target_params is not None:
        capacity = target_params
    elif max_stages is not None:
        capacity = -(-total // max_stages)
    if max_stages is not None:  # the smallest capacity giving at most max_stages groups (total gives one)
        capacity += bisect.bisect_left(range(capacity, total + 1), True,
                                       key=lambda c: len(_greedy(counts, c)) <= max_stages)
    return StagedModel(_merge([staged.stages[i] for i in group]) for group in _greedy(counts, capacity))
