"""The random draws of a dataset's ``__getitem__``, seeded per ``(sample_id, variant)``.

A dataset that augments with torch's, Python's or NumPy's global generators gives the same input for the
same seed. Seeding costs about 10 us an item (the generators' own ``manual_seed``/``seed``; ``torch.manual_seed``
would also visit every accelerator's generators, 130 us); saving and restoring the three generators costs about
100 us, so a batch saves them once (``generators_kept``) and seeds each of its items (``seed_generators``).
"""

from __future__ import annotations

import hashlib
import random
from contextlib import contextmanager
from typing import Any, Iterator

import numpy as np
import torch

__all__ = ["generators_kept", "sample_seed", "seed_generators", "seeded_item"]


def sample_seed(sample_id: int, variant: int) -> int:
    """The seed of the random transforms of ``(sample_id, variant)``: stable across processes and runs."""
    digest = hashlib.blake2b(f"{sample_id}/{variant}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def seed_generators(seed: int) -> None:
    """Seed torch's (CPU), Python's and NumPy's global generators with ``seed``."""
    torch.default_generator.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)


@contextmanager
def generators_kept() -> Iterator[None]:
    """Torch's (CPU), Python's and NumPy's global generators restored on exit to their state on entry."""
    torch_state, py_state, np_state = torch.default_generator.get_state(), random.getstate(), np.random.get_state()
    try:
        yield
    finally:
        torch.default_generator.set_state(torch_state)
        random.setstate(py_state)
        np.random.set_state(np_state)


def seeded_item(dataset: Any, index: int, seed: int) -> Any:
    """``dataset[index]`` with the global generators seeded by ``seed`` (transforms in ``__getitem__``),
    restored after."""
    with generators_kept():
        seed_generators(seed)
        return dataset[index]
