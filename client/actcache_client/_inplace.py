"""The frozen prefix served inside the user's own network.

While stages[:k] are frozen, the first module the network calls in stage 0 (the *head*) returns the
prefix's state, from a CachedForward, for a batch the wrapped loader yielded; every other module of the
frozen stages passes its input on. A training forward is matched to the batches yielded and not yet run
(several under gradient accumulation) by the loader's token, never by the input's values (reading them
would cost a device copy and a host sync in every step): on the device the loader yields to, the input
must be the very tensor yielded, unmodified (its version counter); on another device (``x.to("cuda")``)
the oldest pending batch of the input's shape is taken. A matched batch of which nothing is served or
stored (a plan that recomputes; ``CachedForward.recompute_in_place``) runs the modules' own ``forward``, as
without the cache, except in the few steps the cost model times; so does a batch of a write epoch stored
whole (``CachedForward.fill_in_place``), whose state is stored as the last frozen module returns it (only
where the layout passes the state on as it is; in the steps the cost model times, each frozen stage is
timed from its first module's call to its last module's return). The batch served last is served again for
another forward on the same input tensor (a metric under ``no_grad``). Anything else (evaluation, an
input the loop changed: an error on placeholder rows) runs the modules' own ``forward``. A stage 0 that
names its sites (``Stage(..., sites=[block])``: a ``blocks=`` layout) is served at that block, after the
network's own code before it; its batches are matched by the network's input (a forward pre-hook on it).

Modules are patched by setting ``forward`` on the instance (removed on unfreezing), so the network's
``forward``, parameters and ``state_dict`` keys stay as they are, also under DistributedDataParallel.
"""

from __future__ import annotations

import abc
import copy
import sys
import types
import warnings
import weakref
from collections import deque
from typing import Any, Callable

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from actcache.errors import ConfigError
from actcache_client.engine._batch import Batch
from actcache_client.engine._cached_forward import CachedForward, InPlaceFill
from actcache_client.layouts._base import served_as_is
from actcache_client.layouts._stages import Stage, call_sites
from actcache_client.transport._state import State

__all__ = ["ChangedInputWarning", "InPlacePrefix"]


class ChangedInputWarning(UserWarning):
    """The model was called in training mode on an input other than the one the loader yielded."""


class _EagerCall(abc.ABC):
    """Calls ``self._run``; while torch.compile traces it (once ``eager()`` was called), through a
    ``torch.compiler.disable`` copy: a clean graph break, so that the served prefix runs eagerly beside the
    compiled rest of the network. Eager calls pay no dynamo wrapper. (Importing dynamo costs seconds: it is
    only asked for once the program has imported it itself.)"""

    _disabled: Callable[..., Any] | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._disabled is not None and torch.compiler.is_compiling():
            return self._disabled(*args, **kwargs)
        return self._run(*args, **kwargs)

    @abc.abstractmethod
    def _run(self, *args: Any, **kwargs: Any) -> Any:
        """The call itself."""

    def eager(self) -> None:
        self._disabled = torch.compiler.disable(self._run)


def _compiling_possible() -> bool:
    """Whether torch.compile may trace the network (dynamo is imported; torch.compile imports it)."""
    return "torch._dynamo" in sys.modules


class _Patched(_EagerCall):
    """A module's ``forward`` replaced by ``role(module, original, *args, **kwargs)``; a deep copy of the
    module (an EMA copy, a reference model) gets its class's own forward back."""

    def __init__(self, module: nn.Module, role: Callable[..., Any]) -> None:
        self.module = module
        self.role = role
        self.original = types.MethodType(type(module).forward, module)

    def _run(self, *args: Any, **kwargs: Any) -> Any:
        return self.role(self.module, self.original, *args, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return types.MethodType(type(self.module).forward, copy.deepcopy(self.module, memo))


class _RunObserver(_EagerCall):
    """A forward pre-hook on the head: a training forward while nothing is served still consumes its pending
    batch, so that none is left over to match a later forward. A deep copy of the network gets a no-op."""

    def __init__(self, prefix: "InPlacePrefix") -> None:
        self.prefix = prefix

    def _run(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.prefix._observe(args, kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> Callable[..., None]:
        return _no_hook


def _no_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
    return None


class InPlacePrefix:
    """Patches the modules of ``net``'s frozen stages so that they serve ``cached``'s prefix.

    ``output_of(state, given)`` maps the prefix's state to what the network's next module expects (``given``:
    the head's first tensor argument). Invariant: the patched modules are exactly the call sites of
    ``cached.model.stages[:patched_depth]``; ``sync`` brings ``patched_depth`` to ``cached.frozen``.
    """

    def __init__(self, cached: CachedForward, net: nn.Module, *,
                 output_of: Callable[[State, Tensor | None], Any]) -> None:
        self.cached = cached
        self.net = net
        self.sites = call_sites(net, list(cached.model.stages))
        self.output_of = output_of
        self.patched_depth = 0
        # Batches yielded and not yet run, oldest first, with the token of their first input tensor: a loop
        # accumulating gradients (transformers.Trainer) takes several batches, at most 16, before running them.
        self._pending: deque[tuple[Batch, _Token | None]] = deque(maxlen=16)
        self._served: tuple[Batch, _Token | None] | None = None  # the batch served last, and its input's token
        self._computing = False  # inside cached.prefix: the patched modules run their own forward
        self._tails: deque[nn.Module] = deque()  # modules still to pass the served state on, in call order
        # A write step computed by the network's own modules: stores the output of the frozen stages' last call
        # site. Only where that output is the state the stages give (a layout whose output_of passes it on).
        self._fills_in_place = output_of is served_as_is
        self._fill: InPlaceFill | None = None
        self._last_site: nn.Module | None = None
        self._stage_ends: dict[nn.Module, int] = {}  # the last call site of each frozen stage -> its index
        self._timeable = False  # every frozen stage has call sites: a fill step can time each in place
        self._warned = False
        # A stage 0 that names its sites (a blocks= layout) is served at its first block, after the network's
        # own code before it: its batches are matched where the network is called, by the network's input.
        self._at_net = any(isinstance(m, Stage) and m.sites is not None for m in cached.model.stages[0].modules())
        self._net_input: Tensor | None = None  # the input of the network's forward in progress (at_net)
        entry = net if self._at_net else self.sites[0][0] if self.sites and self.sites[0] else None
        self._patches: list[_EagerCall] = []
        self._entry = entry
        self._observing: RemovableHandle | None = None  # the observer's hook on ``entry``, while it is needed
        if entry is not None:
            self._observer = _RunObserver(self)
            self._patches.append(self._observer)
            self._observe_runs(True)
        self._eager = False  # the patches are graph breaks for torch.compile

    def begin(self, batch: Batch, given: Tensor | None) -> None:
        """The loader yielded ``batch`` (``given``: its first input tensor as the user received it)."""
        self.sync()
        if self.patched_depth == 0 and batch.loaded is None:  # stage 0's input: the batch as yielded
            self.cached._training_input(batch.data[0])
        self._pending.append((batch, _Token.of(given)))
        self._tails = deque()

    def end(self) -> None:
        """The loader's iteration ended (batches it yielded may still be run)."""
        self._tails = deque()

    def sync(self) -> None:
        """Patch the call sites of the frozen stages (and make the patches graph breaks once torch.compile
        is in use: ``torch.compile(net)`` comes before the loader's first batch)."""
        if not self._eager and _compiling_possible():
            self._eager = True
            for patch in self._patches:
                patch.eager()
        depth = self.cached.frozen
        if depth == self.patched_depth:
            return
        for module in (m for stage in self.sites for m in stage):
            module.__dict__.pop("forward", None)
        self._patches = self._patches[:1]
        for i, module in enumerate(m for stage in self.sites[:depth] for m in stage):
            module.forward = patch = _Patched(module, self._head if i == 0 else self._tail)
            if self._eager:
                patch.eager()
            self._patches.append(patch)
        self.patched_depth = depth
        self._observe_runs(depth == 0 or self._at_net)
        self._last_site = self.sites[depth - 1][-1] if depth and self.sites[depth - 1] else None
        self._stage_ends = {stage[-1]: d for d, stage in enumerate(self.sites[:depth]) if stage}
        self._timeable = all(self.sites[:depth])
        self._fill = None

    def _observe_runs(self, on: bool) -> None:
        """Hook the observer on the entry module, or unhook it: while stages are patched (and the batches are not
        matched at the network's input) their head matches the forwards, and a hooked module's every call takes
        torch's slower dispatch."""
        if self._entry is None or on == (self._observing is not None):
            return
        if on:
            self._observing = self._entry.register_forward_pre_hook(self._observer, with_kwargs=True)
        else:
            assert self._observing is not None
            self._observing.remove()
            self._observing = None

    def _take(self, given_now: Tensor | None) -> tuple[Batch, bool] | None:
        """The pending batch whose input ``given_now`` is (dropping the ones yielded before it), and whether
        ``given_now`` is the very tensor yielded (not a copy on another device, taken on trust); else None."""
        for i, (batch, token) in enumerate(self._pending):
            if token is not None and token.matches(given_now):
                for _ in range(i + 1):
                    self._pending.popleft()
                return batch, token.is_exactly(given_now)
        return None

    def _observe(self, args: tuple, kwargs: dict) -> None:
        if self._computing:
            return
        given = _first_tensor(args, kwargs)
        if self._at_net:
            self._net_input = given
        if self.patched_depth == 0 and self.net.training and torch.is_grad_enabled():
            self._take(given)

    def _head(self, module: nn.Module, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self._computing:  # the CachedForward runs the stages' own modules for the rows it computes
            return original(*args, **kwargs)
        self._fill = None  # a forward that stopped before the last frozen module stores nothing
        given_now = _first_tensor(args, kwargs)
        matched = given_now  # what identifies the batch: the head's input, or the network's (at_net)
        if self._at_net:
            matched, self._net_input = self._net_input, None
        training = self.net.training and torch.is_grad_enabled()
        taken = self._take(matched) if training else None
        batch, exact = taken if taken is not None else (None, False)
        if batch is None and self._served is not None and self._served[1] is not None \
                and self._served[1].is_exactly(matched):
            batch = self._served[0]  # the batch just trained on, run again (a metric, a second loss)
        if batch is not None:
            self._served = (batch, _Token.of(matched))
            if training and self.cached.recompute_in_place(batch):
                self._tails = deque()
                return original(*args, **kwargs)  # nothing served: the modules run as without the cache
            # only from the very tensor yielded: a copy on another device is this batch on trust alone
            fill = (self.cached.fill_in_place(batch, timeable=self._timeable)
                    if training and exact and self._fills_in_place else None)
            if fill is not None:  # the modules compute the prefix as without the cache; its output is stored
                self._tails = deque()
                self._fill = fill
                fill.begin()
                out = original(*args, **kwargs)
                self._filled(module, out)
                return out
            self._computing = True
            try:
                state = self.cached.prefix(batch)
            finally:
                self._computing = False
            if training:
                self.cached._training_input(state)
            self._tails = deque(m for stage in self.sites[: self.patched_depth] for m in stage)
            self._tails.popleft()  # the head itself
            return self.output_of(state, given_now)
        if training and self._pending:
            rows = matched.shape[0] if isinstance(matched, Tensor) and matched.dim() else -1
            placeholders = any(batch.loaded is not None and len(batch.ids) == rows for batch, _ in self._pending)
            self._pending.clear()
            if placeholders:  # the rows the loader did not load cannot be computed
                raise ConfigError(
                    "the loop changed the model's input on a batch whose inputs the loader did not load (the cache "
                    "serves their prefix, their rows are placeholders): move the input transform into the dataset, "
                    "or wrap the loader with ActCache.wrap(loader, skip_loads=False)")
            if not self._warned:
                self._warned = True
                warnings.warn("actcache: the model's input is not the batch the loader yielded (the loop changed it); "
                              "the frozen prefix is computed for it, not served. Move input transforms into the "
                              "dataset to cache them.", ChangedInputWarning, stacklevel=3)
        return original(*args, **kwargs)

    def _tail(self, module: nn.Module, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self._tails and self._tails[0] is module and not self._computing:
            self._tails.popleft()
            return args[0] if args else _first_tensor(args, kwargs)
        out = original(*args, **kwargs)
        if self._fill is not None and not self._computing:
            self._filled(module, out)
        return out

    def _filled(self, module: nn.Module, out: Any) -> None:
        """A frozen module of a fill step returned ``out``: the end of its stage is timed in a timed step;
        after the last frozen module, ``out`` (the frozen prefix's output, as the network computed it) is
        stored."""
        fill = self._fill
        assert fill is not None
        if fill.timed and (stage := self._stage_ends.get(module)) is not None:
            fill.stage_done(stage, out)
        if module is self._last_site:
            self._fill = None
            fill.store(out)


def _first_tensor(args: tuple, kwargs: dict) -> Tensor | None:
    return next((a for a in (*args, *kwargs.values()) if isinstance(a, Tensor)), None)


class _Token:
    """What identifies a batch's input tensor without reading its values: the tensor itself (held weakly),
    its version counter (in-place changes), its shape and device."""

    __slots__ = ("_ref", "version", "shape", "device")

    def __init__(self, tensor: Tensor) -> None:
        self._ref = weakref.ref(tensor)
        self.version = tensor._version
        self.shape = tensor.shape
        self.device = tensor.device

    @classmethod
    def of(cls, tensor: Tensor | None) -> "_Token | None":
        return cls(tensor) if isinstance(tensor, Tensor) else None

    def is_exactly(self, now: Tensor | None) -> bool:
        """``now`` is the tensor this token was taken of, unchanged since."""
        return now is not None and self._ref() is now and now._version == self.version

    def matches(self, now: Tensor | None) -> bool:
        """``now`` is this batch's input: the tensor itself, unchanged, or a copy of it on another device
        (taken on trust: a transform after the device copy is not seen; the docs say to move it into the
        dataset). A new tensor on the same device is one the loop computed: no match."""
        if not isinstance(now, Tensor) or now.shape != self.shape:
            return False
        return self.is_exactly(now) if now.device == self.device else True
