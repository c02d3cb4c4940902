"""The frozen prefix served inside the user's own network.

While stages[:k] are frozen, the first module the network calls in stage 0
(the *head*) returns the prefix's state for the batch the wrapped loader
yielded last, taken from a CachedForward (served from the cache, or computed
and stored), and every other module of the frozen stages passes its input on
unchanged. Everything else runs the modules' own ``forward``: evaluation
(``net.eval()``), a forward with no batch from the loader, a second forward
on the same batch, and a forward whose input is not the tensor the loader
yielded (the loop changed it; the cache could not know how).

The modules are patched by setting ``forward`` on the instance (removed when
the stage is unfrozen), so the network's own ``forward``, its parameters and
its ``state_dict`` keys stay as they are; a wrapper around the whole network
(DistributedDataParallel) calls the patched modules like any others.
"""

from __future__ import annotations

import copy
import types
import warnings
from collections import deque
from typing import Any, Callable

import torch
from torch import Tensor, nn

from actcache_client._batch import Batch
from actcache_client._cached_forward import CachedForward
from actcache_client._stages import State

__all__ = ["InPlacePrefix", "ChangedInputWarning", "call_sites"]


class ChangedInputWarning(UserWarning):
    """The model was called in training mode on an input other than the one the loader yielded."""


def call_sites(net: nn.Module, stages: list[nn.Module]) -> list[list[nn.Module]]:
    """For each stage, the modules of ``net`` it is made of, in the order ``net`` calls them.

    A stage adapter either is one of ``net``'s modules (a residual block, a BERT layer) or holds
    some of them (a ResNet stem's ``conv1, bn1, relu``; a BERT embeddings wrapper): the topmost
    modules of ``net`` inside it, in registration order, which the adapters keep in call order.
    """
    owned = {id(m) for m in net.modules()}
    sites: list[list[nn.Module]] = []
    for stage in stages:
        found: list[nn.Module] = []
        inside: set[int] = set()
        for module in stage.modules():
            if id(module) in inside:
                continue
            if id(module) in owned:
                found.append(module)
                inside.update(id(m) for m in module.modules())
        sites.append(found)
    return sites


class _Patched:
    """A module's ``forward`` replaced by ``role(module, original, *args, **kwargs)``.

    A deep copy of the module (an EMA copy, a reference model) gets its class's own forward back.
    """

    def __init__(self, module: nn.Module, role: Callable[..., Any]) -> None:
        self.module = module
        self.role = role
        self.original = types.MethodType(type(module).forward, module)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.role(self.module, self.original, *args, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return types.MethodType(type(self.module).forward, memo.get(id(self.module), copy.deepcopy(self.module, memo)))


class InPlacePrefix:
    """Patches the modules of ``net``'s frozen stages so that they serve ``cached``'s prefix.

    ``inputs_of(data)`` maps a batch as the loader yields it to the stages' input state;
    ``output_of(state, given)`` maps the prefix's state to what the network's next module expects
    (``given`` is the head's first tensor argument). Invariant: the patched modules are exactly
    the call sites of ``cached.model.stages[:patched_depth]``; ``sync`` brings ``patched_depth``
    to ``cached.frozen`` (a FreezeController may change it between steps).
    """

    def __init__(self, cached: CachedForward, net: nn.Module, *,
                 inputs_of: Callable[[Any], State], output_of: Callable[[State, Tensor], Any]) -> None:
        self.cached = cached
        self.net = net
        self.sites = call_sites(net, list(cached.model.stages))
        self.inputs_of = inputs_of
        self.output_of = output_of
        self.patched_depth = 0
        self._batch: Batch | None = None  # the batch yielded last, until a forward consumes it
        self._given: Tensor | None = None  # the first input tensor of that batch, as yielded
        self._tails: deque[nn.Module] = deque()  # modules still to pass the served state on, in call order
        self._warned = False

    def begin(self, batch: Batch, given: Tensor | None) -> None:
        """The loader yielded ``batch`` (``given``: its first input tensor as the user received it)."""
        self.sync()
        self._batch, self._given, self._tails = batch, given, deque()

    def end(self) -> None:
        self._batch, self._given, self._tails = None, None, deque()

    def sync(self) -> None:
        depth = self.cached.frozen
        if depth == self.patched_depth:
            return
        for module in (m for stage in self.sites for m in stage):
            module.__dict__.pop("forward", None)
        modules = [m for stage in self.sites[:depth] for m in stage]
        for i, module in enumerate(modules):
            module.forward = _Patched(module, self._head if i == 0 else self._tail)
        self.patched_depth = depth

    def _head(self, module: nn.Module, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        batch, given = self._batch, self._given
        self._batch = None  # one forward per batch is served; any other runs the modules
        given_now = _first_tensor(args, kwargs)
        if not self.net.training:
            return original(*args, **kwargs)
        frozen = self.cached.model.stages[: self.patched_depth]
        if any(m.training for stage in frozen for m in stage.modules()):  # net.train() must not train frozen stages
            for stage in frozen:
                stage.train(False)
        if batch is None or not torch.is_grad_enabled():
            return original(*args, **kwargs)
        if not _same(given_now, given):
            if not self._warned:
                self._warned = True
                warnings.warn("actcache: the model's input is not the batch the loader yielded (the loop changed it); "
                              "the frozen prefix is computed for it, not served. Move input transforms into the "
                              "dataset to cache them.", ChangedInputWarning, stacklevel=3)
            return original(*args, **kwargs)
        state = self.cached.prefix(batch)
        self._tails = deque(m for stage in self.sites[: self.patched_depth] for m in stage)
        self._tails.popleft()  # the head itself
        return self.output_of(state, given_now)

    def _tail(self, module: nn.Module, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self._tails and self._tails[0] is module:
            self._tails.popleft()
            return args[0] if args else _first_tensor(args, kwargs)
        return original(*args, **kwargs)


def _first_tensor(args: tuple, kwargs: dict) -> Tensor | None:
    return next((a for a in (*args, *kwargs.values()) if isinstance(a, Tensor)), None)


def _same(now: Tensor | None, given: Tensor | None) -> bool:
    if now is None or given is None:
        return now is given
    if now is given:
        return True
    return now.shape == given.shape and now.dtype == given.dtype and torch.equal(now, given.to(now.device))
