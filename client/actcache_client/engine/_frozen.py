"""The frozen prefix of a StagedModel: which stages are frozen, the fingerprints cache keys carry, and those
this process wrote entries under.

``prefix_fingerprints(stages, d)[d]`` identifies the weights of ``stages[:d]``: it changes when any of them
changes (a retrained prefix is never served stale entries) and not when more stages are frozen behind them
(entries at depth d can seed deeper ones). Cache keys fold in the data fingerprint bound by the loader and
the stored precision. A fingerprint written is superseded when its prefix was unfrozen and trained further:
``WrittenFingerprints.superseded`` hands it back once, so that its entries can be dropped.
"""

from __future__ import annotations

import copy
import hashlib
from typing import TYPE_CHECKING, Callable, Sequence

import torch
from torch import nn

from actcache.errors import ConfigError
from actcache_client.layouts._stages import StagedModel

if TYPE_CHECKING:
    from actcache_client.engine._planner import CachePlanner

__all__ = ["FrozenPrefix", "WrittenFingerprints", "prefix_fingerprints"]


def _stage_digest(stage: nn.Module) -> bytes:
    """blake2b-128 of a stage's class, parameter and buffer names, dtypes, shapes and bytes."""
    h = hashlib.blake2b(digest_size=16)
    h.update(type(stage).__qualname__.encode())
    for name, tensor in [*stage.named_parameters(), *stage.named_buffers()]:
        h.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)};".encode())
        data = tensor.detach().to("cpu").contiguous().reshape(-1)
        if data.numel():
            h.update(data.view(torch.uint8).numpy().data)
    return h.digest()


def prefix_fingerprints(stages: Sequence[nn.Module], depth: int) -> list[bytes]:
    """Fingerprints of depths 0..depth (index d covers ``stages[:d]``); 16 bytes each."""
    out = [hashlib.blake2b(b"actcache/prefix/v1", digest_size=16).digest()]
    for stage in stages[:depth]:
        out.append(hashlib.blake2b(out[-1] + _stage_digest(stage), digest_size=16).digest())
    return out


class _EvalOnly:
    """A frozen module's ``train``: it stays in eval mode whatever mode its parents are put in, so that a
    user's ``net.train()`` neither trains it nor costs a re-moding in every forward. A deep copy of the
    module (an EMA copy, a reference model) gets its class's own ``train`` back."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, mode: bool = True) -> nn.Module:
        return self.module

    def __deepcopy__(self, memo: dict[int, object]) -> object:
        twin = copy.deepcopy(self.module, memo)
        return type(twin).train.__get__(twin)


def _pin_eval(modules: list[nn.Module]) -> None:
    for module in modules:
        nn.Module.train(module, False)
        module.train = _EvalOnly(module)  # type: ignore[method-assign]  # this instance's train(), on purpose


def _unpin_eval(modules: list[nn.Module]) -> None:
    for module in modules:
        if isinstance(module.__dict__.get("train"), _EvalOnly):
            del module.train


class FrozenPrefix:
    """The frozen depth of ``model``, its modules, and the fingerprints per depth 0..frozen depth:
    ``fingerprints[d]`` is what cache keys carry for stages[:d], ``weights[d]`` their weights' alone.
    Invariant: the modules of stages[:depth] report and run in eval mode (their ``train`` is pinned)."""

    def __init__(self, model: StagedModel, key_tag: bytes) -> None:
        self.model = model
        self._key_tag = key_tag  # entries stored in another precision carry other keys
        self.depth = 0
        self._modules: list[nn.Module] = []  # every module of the frozen stages (kept in eval mode)
        self.data = b""  # the data fingerprint folded into cache keys (empty: unknown)
        self.weights: list[bytes] = prefix_fingerprints(list(model.stages), 0)
        self.fingerprints: list[bytes] = self.keyed(self.weights, self.data)
        self.seed_depths: list[int] = []  # frozen depths whose entries may seed deeper ones
        self._trainable = {id(p) for p in model.parameters() if p.requires_grad}  # what unfreezing gives back

    def keyed(self, weights: list[bytes], data: bytes) -> list[bytes]:
        """The fingerprints cache keys carry: weights, data, and the stored precision (none: the weights')."""
        data += self._key_tag
        if not data:
            return list(weights)
        return [hashlib.blake2b(b"actcache/key/v1" + data + fp, digest_size=16).digest() for fp in weights]

    def bind_data(self, data: bytes) -> bool:
        """Key entries by this data fingerprint from now on; False if it is the one already bound."""
        if data == self.data:
            return False
        self.data = data
        self.fingerprints = self.keyed(self.weights, data)
        self.seed_depths = []  # seeds were entries of the other data
        return True

    def freeze(self, depth: int, fingerprint_depth: int = 0) -> list[bytes]:
        """Freeze stages[:depth] (eval mode, no grad) and give the rest their grad and the model's mode back;
        the weights' fingerprints of depths 0..max(depth, fingerprint_depth) (to check deeper entries)."""
        stages = list(self.model.stages)
        if isinstance(depth, bool) or not isinstance(depth, int) or not 0 <= depth < len(stages):
            names = self.model.stage_names
            raise ConfigError(f"the frozen depth is a count of stages in 0..{len(stages) - 1} (the head, {names[-1]!r}, "
                              f"always trains), got {depth!r}; the stages: {', '.join(names)} (ActCache.freeze also "
                              "takes a stage's name)")
        old, old_fps = self.depth, self.fingerprints
        _unpin_eval(self._modules)
        for i, stage in enumerate(stages):
            for p in stage.parameters():  # unfrozen: as the user left them (a LoRA model's base stays frozen)
                p.requires_grad_(i >= depth and id(p) in self._trainable)
            stage.train(self.model.training if i >= depth else False)
        weights = prefix_fingerprints(stages, max(depth, fingerprint_depth))
        self.weights = weights[: depth + 1]
        self.fingerprints = self.keyed(self.weights, self.data)
        # Depths still frozen with unchanged weights keep their entries as seeds.
        self.seed_depths = sorted((d for d in {*self.seed_depths, old} if 0 < d <= depth and d < len(old_fps)
                                   and old_fps[d] == self.fingerprints[d]), reverse=True)
        self.depth = depth
        self._modules = [m for stage in stages[:depth] for m in stage.modules()]
        _pin_eval(self._modules)
        return weights


class WrittenFingerprints:
    """Fingerprints written -> (depth, data fingerprint), and the sample ids stored (or found) under each."""

    def __init__(self, planner: CachePlanner | None) -> None:
        self._planner = planner
        self._written_at: dict[bytes, tuple[int, bytes]] = {}  # fingerprint written -> (depth, data fingerprint)
        self._samples: dict[bytes, set[int]] = {}  # fingerprint -> sample ids stored (or found) under it

    def deepest(self) -> int:
        """The deepest depth written at (0: none)."""
        return max((depth for depth, _ in self._written_at.values()), default=0)

    def mark(self, fingerprint: bytes, depth: int, ids: list[int], written: bytes | None = None) -> None:
        """The samples ``ids`` are stored under ``fingerprint`` at ``depth``; ``written``: the data fingerprint
        of the entries if this process wrote them."""
        if written is not None:
            self._written_at.setdefault(fingerprint, (depth, written))
        samples = self._samples.setdefault(fingerprint, set())
        samples.update(ids)
        if self._planner is not None:
            self._planner.set_written(depth, len(samples))

    def count(self, fingerprint: bytes) -> int:
        """How many samples are known to be stored under ``fingerprint``."""
        return len(self._samples.get(fingerprint, ()))

    def forget(self, fingerprint: bytes) -> None:
        """The daemon dropped ``fingerprint``'s entries."""
        self._samples.pop(fingerprint, None)

    def superseded(self, keyed: Callable[[int, bytes], bytes]) -> list[bytes]:
        """Forget and return the fingerprints written that ``keyed(depth, data)`` no longer gives."""
        gone = [fp for fp, (depth, data) in self._written_at.items() if keyed(depth, data) != fp]
        for fingerprint in gone:
            del self._written_at[fingerprint]
            self._samples.pop(fingerprint, None)
        return gone
