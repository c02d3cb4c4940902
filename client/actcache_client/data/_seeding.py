"""The random draws of a dataset's ``__getitem__``, seeded per ``(sample_id, variant)``.

A dataset that augments with torch's, Python's or NumPy's global generators gives the same input for the same
seed. Saving and restoring the generators costs far more than seeding one (docs/design/step.md), so a batch
saves them once (``SavedGenerators``) and seeds, for each of its items, only the generators the dataset was
seen drawing from (torch's to begin with); ``torch.manual_seed`` is not used (it also visits every
accelerator's generators). A batch that drew from another one is loaded again with that one seeded too, so every
item comes out as if all three were seeded.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any, Callable, TypeVar

import numpy as np
import torch

__all__ = ["ALL_GENERATORS", "SavedGenerators", "sample_seed", "seed_generators", "seeded_item", "with_seeds"]

T = TypeVar("T")

#: The global generators ``seed_generators`` can seed.
ALL_GENERATORS = frozenset({"torch", "python", "numpy"})


def sample_seed(sample_id: int, variant: int) -> int:
    """The seed of the random transforms of ``(sample_id, variant)``: stable across processes and runs."""
    digest = hashlib.blake2b(f"{sample_id}/{variant}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def seed_generators(seed: int, which: frozenset[str] = ALL_GENERATORS) -> None:
    """Seed the global generators named in ``which`` (torch's CPU one, Python's, NumPy's) with ``seed``."""
    if "torch" in which:
        torch.default_generator.manual_seed(seed)
    if "python" in which:
        random.seed(seed)
    if "numpy" in which:
        np.random.seed(seed % 2**32)


class SavedGenerators:
    """The three global generators' states when made: ``restore`` puts them back, ``drawn`` says which of the
    others were drawn from since."""

    def __init__(self) -> None:
        self.torch, self.python, self.numpy = torch.default_generator.get_state(), random.getstate(), np.random.get_state()

    def drawn(self, others: frozenset[str]) -> frozenset[str]:
        """Those of ``others`` whose state changed since these were saved."""
        changed = set()
        if "torch" in others and not torch.equal(torch.default_generator.get_state(), self.torch):
            changed.add("torch")
        if "python" in others and random.getstate() != self.python:
            changed.add("python")
        if "numpy" in others:
            now = np.random.get_state()
            # numpy's stub types get_state() as the dict form; called with no argument it returns the legacy tuple
            if now[2] != self.numpy[2] or not np.array_equal(now[1], self.numpy[1]):  # type: ignore[index]
                changed.add("numpy")
        return frozenset(changed)

    def restore(self) -> None:
        torch.default_generator.set_state(self.torch)
        random.setstate(self.python)
        np.random.set_state(self.numpy)


def with_seeds(load: Callable[[frozenset[str]], T], seeded: frozenset[str]) -> tuple[T, frozenset[str]]:
    """``load(generators to seed)`` with the global generators restored after, and the generators it needs
    seeded: ``seeded`` and any other it drew from (then it is loaded again with those seeded too)."""
    while True:
        saved = SavedGenerators()
        try:
            out = load(seeded)
            drawn = saved.drawn(ALL_GENERATORS - seeded)
        finally:
            saved.restore()
        if not drawn:
            return out, seeded
        seeded |= drawn


def seeded_item(dataset: Any, index: int, seed: int) -> Any:
    """``dataset[index]`` with the global generators seeded by ``seed`` (transforms in ``__getitem__``),
    restored after."""
    saved = SavedGenerators()
    try:
        seed_generators(seed)
        return dataset[index]
    finally:
        saved.restore()
