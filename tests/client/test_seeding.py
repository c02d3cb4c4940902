"""Seeded loads: each item as if every global generator were seeded by its (sample, variant), generators restored."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

from actcache_client import IndexedDataset
from actcache_client.data._seeding import sample_seed, seeded_item


class Draws(Dataset):
    """Item i: draws from the global generators named, every third item also from Python's."""

    def __init__(self, *generators: str) -> None:
        self.generators = generators

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> tuple:
        out = [i]
        if "torch" in self.generators:
            out.append(torch.rand(()).item())
        if "python" in self.generators or i % 3 == 2:
            out.append(random.random())
        if "numpy" in self.generators:
            out.append(float(np.random.rand()))
        return tuple(out)


def _states() -> tuple:
    return torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()


@pytest.mark.parametrize("generators", [("torch",), ("python",), ("numpy",), ("torch", "python", "numpy"), ()])
def test_seeded_items_are_those_of_all_generators_seeded_and_the_generators_are_restored(generators):
    data = Draws(*generators)
    indexed = IndexedDataset(data, seeded=True)
    before = _states()
    batch = indexed.__getitems__([(i, 1, True) for i in range(12)])
    one = indexed[5, 1]
    after = _states()
    assert torch.equal(before[0], after[0]) and before[1] == after[1] and np.array_equal(before[2], after[2])
    expected = [(i, seeded_item(data, i, sample_seed(i, 1))) for i in range(12)]
    assert list(zip(batch.sample_ids, batch.items)) == expected and one == expected[5]
    assert indexed[5, 0] != one or not generators  # another variant draws other numbers
