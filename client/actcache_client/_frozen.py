"""The frozen prefix of a StagedModel: which stages are frozen, the fingerprints cache keys carry, and those
this process wrote entries under.

The fingerprints (actcache_client._fingerprint) cover the frozen weights, the
data fingerprint bound by the loader and the stored precision. Depths that stay
frozen with unchanged weights keep their entries as seeds for deeper ones. A
fingerprint written is superseded when its prefix was unfrozen and trained
further: ``Generations.superseded`` hands it back once, so that its entries can
be dropped; the samples stored per depth are told to the planner.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from torch import nn

from actcache.errors import ConfigError
from actcache_client._fingerprint import cache_fingerprints, prefix_fingerprints
from actcache_client._stages import StagedModel

if TYPE_CHECKING:
    from actcache_client._planner import CachePlanner

__all__ = ["FrozenPrefix", "Generations"]


class FrozenPrefix:
    """The frozen depth of ``model``, its modules, and the fingerprints per depth 0..frozen depth:
    ``fingerprints[d]`` is what cache keys carry for stages[:d], ``weights[d]`` their weights' alone."""

    def __init__(self, model: StagedModel, key_tag: bytes) -> None:
        self.model = model
        self._key_tag = key_tag  # entries stored in another precision carry other keys
        self.depth = 0
        self._modules: list[nn.Module] = []  # every module of the frozen stages (kept in eval mode)
        self.data = b""  # the data fingerprint folded into cache keys (empty: unknown)
        self.weights: list[bytes] = prefix_fingerprints(list(model.stages), 0)
        self.fingerprints: list[bytes] = self.keyed(self.weights, self.data)
        self.seed_depths: list[int] = []  # frozen depths whose entries may seed deeper ones

    def keyed(self, weights: list[bytes], data: bytes) -> list[bytes]:
        """The fingerprints cache keys carry: weights, data, and the stored precision."""
        return cache_fingerprints(weights, data + self._key_tag)

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
        if not 0 <= depth < len(stages):
            raise ConfigError(f"set_frozen depth must be in 0..{len(stages) - 1} (the head always trains), got {depth}")
        old, old_fps = self.depth, self.fingerprints
        for i, stage in enumerate(stages):
            stage.requires_grad_(i >= depth)
            stage.train(self.model.training if i >= depth else False)
        weights = prefix_fingerprints(stages, max(depth, fingerprint_depth))
        self.weights = weights[: depth + 1]
        self.fingerprints = self.keyed(self.weights, self.data)
        # Depths still frozen with unchanged weights keep their entries as seeds.
        self.seed_depths = sorted((d for d in {*self.seed_depths, old} if 0 < d <= depth and d < len(old_fps)
                                   and old_fps[d] == self.fingerprints[d]), reverse=True)
        self.depth = depth
        self._modules = [m for stage in stages[:depth] for m in stage.modules()]
        return weights

    def keep_eval(self) -> None:
        """Put the frozen stages back in eval mode if a user's ``net.train()`` switched them."""
        if any(m.training for m in self._modules):
            for stage in self.model.stages[: self.depth]:
                stage.train(False)


class Generations:
    """Fingerprints written -> (depth, data fingerprint), and the sample ids stored (or found) under each."""

    def __init__(self, planner: CachePlanner | None) -> None:
        self._planner = planner
        self._written_at: dict[bytes, tuple[int, bytes]] = {}  # fingerprint written -> (depth, data fingerprint)
        self._samples: dict[bytes, set[int]] = {}  # fingerprint -> sample ids stored (or found) under it

    def deepest(self) -> int:
        """The deepest depth written at (0: none)."""
        return max((depth for depth, _ in self._written_at.values()), default=0)

    def wrote(self, fingerprint: bytes, depth: int, data: bytes) -> None:
        """Entries of ``data`` were written under ``fingerprint`` at ``depth``."""
        self._written_at.setdefault(fingerprint, (depth, data))

    def mark(self, fingerprint: bytes, depth: int, ids: list[int]) -> None:
        """The samples ``ids`` are stored under ``fingerprint`` at ``depth``."""
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
