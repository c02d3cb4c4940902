"""The data fingerprint: what it sees (content, transform, augmentation, ids, length, data_id) and what it cannot."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset, TensorDataset

import actcache_client as ac
from actcache_client.data._identity import SPREAD_ITEMS, data_fingerprint, spread


def images(n: int = 200, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 3, 4, 4, generator=g), torch.randint(0, 10, (n,), generator=g))


class Scaled(Dataset):
    """A deterministic transform: every image times ``factor``."""

    def __init__(self, base: TensorDataset, factor: float) -> None:
        self.base, self.factor = base, factor

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int):
        x, y = self.base[i]
        return x * self.factor, y


def fp(dataset, **kwargs) -> bytes:
    return data_fingerprint(ac.IndexedDataset(dataset, **kwargs))


def test_spread_covers_the_ends_evenly_and_all_of_a_small_dataset():
    assert spread(10) == list(range(10))
    picks = spread(10_000)
    assert len(picks) == SPREAD_ITEMS and picks[0] == 0 and picks[-1] == 9_999
    gaps = {b - a for a, b in zip(picks, picks[1:])}
    assert max(gaps) - min(gaps) <= 1


def test_the_same_data_gives_the_same_fingerprint_in_a_fresh_object():
    assert fp(images()) == fp(images())
    assert len(fp(images())) == 16


def test_other_content_length_transform_ids_or_data_id_change_it():
    base = fp(images())
    assert fp(images(seed=1)) != base  # other samples
    assert fp(images(n=199)) != base  # other length
    assert fp(Scaled(images(), 1.0)) != base  # another dataset type
    assert fp(Scaled(images(), 2.0)) != fp(Scaled(images(), 1.0))  # another preprocessing
    assert fp(images(), sample_ids=list(range(1, 201))) != base  # another id mapping
    assert fp(images(), data_id="v2") != base


def test_augmentation_variants_are_covered():
    def flip(item, g):
        x, y = item
        return (x.flip(-1) if torch.rand((), generator=g) < 0.5 else x), y

    dataset = ac.IndexedDataset(images(), augment=flip)
    assert data_fingerprint(dataset, 1) != data_fingerprint(dataset, 2)
    assert data_fingerprint(ac.IndexedDataset(images()), 1) != data_fingerprint(dataset, 1)


def test_an_item_outside_the_spread_is_not_seen():
    """The documented blind spot: data_id (or an audit) is what catches this."""
    data = images()
    changed = images()
    outside = next(i for i in range(len(data)) if i not in set(spread(len(data))))
    changed.tensors[0][outside] += 1
    assert fp(changed) == fp(data)
    assert fp(changed, data_id="fixed-labels") != fp(data)


def test_a_loader_binds_the_model_to_its_data():
    torch.manual_seed(0)
    staged = ac.from_sequential(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(48, 8), torch.nn.Linear(8, 2)))
    a, b = ac.CachedForward(staged), ac.CachedForward(staged)
    for model, seed in ((a, 0), (b, 1)):
        ac.CachedLoader(torch.utils.data.DataLoader(ac.IndexedDataset(images(seed=seed)), batch_size=8), model)
        model.set_frozen(2)
    assert a.weights_fingerprint() == b.weights_fingerprint()
    assert a.fingerprint() != b.fingerprint()
