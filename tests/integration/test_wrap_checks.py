"""What ActCache.wrap says about a loader or a dataset it cannot cache: the fix, in the project's warning classes."""

from __future__ import annotations

import uuid

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import actcache_client as ac
from actcache.errors import ConfigError


class Flips(Dataset):
    """3x4x4 images flipped at random: from torch's global generator, or from a ``torch.Generator`` of its own."""

    def __init__(self, own_generator: bool = False) -> None:
        self.images = torch.randn(16, 3, 4, 4, generator=torch.Generator().manual_seed(0))
        self.generator = torch.Generator().manual_seed(1) if own_generator else None

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        flip = torch.rand((), generator=self.generator) < 0.5
        return (self.images[i].flip(-1) if flip else self.images[i]), i % 2


@pytest.fixture
def cache(daemon):
    net = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(64, 2))
    cache = ac.ActCache(net, ac.connect(daemon.socket, namespace=f"wrap-{uuid.uuid4().hex[:8]}", strict=True), planner=None)
    yield cache
    cache.close()


@pytest.mark.parametrize("given", [Flips(), torch.zeros(8, 3), [(torch.zeros(2, 3), torch.zeros(2))]],
                         ids=["dataset", "tensor", "list of batches"])
def test_wrapping_anything_but_a_data_loader_names_the_fix(cache, given):
    with pytest.raises(ConfigError, match=r"takes the torch DataLoader .*cache\.wrap\(DataLoader\(dataset, batch_size="):
        cache.wrap(given)


def test_wrapping_twice_says_so(cache):
    loader = cache.wrap(DataLoader(Flips(), batch_size=4), variants=2)
    with pytest.raises(ConfigError, match="already wrapped by ActCache.wrap"):
        cache.wrap(loader)


def test_random_augmentation_without_variants_is_an_uncacheable_data_warning(cache):
    with pytest.warns(ac.UncacheableDataWarning, match=r"pass variants=K to ActCache\.wrap"):
        loader = cache.wrap(DataLoader(Flips(), batch_size=4))
    assert not loader.cached.cacheable


def test_a_dataset_drawing_from_its_own_generator_is_not_cached_and_the_warning_says_why_at_wrap(cache):
    with pytest.warns(ac.UncacheableDataWarning, match=r"generator of its own .*draw from the global generators"):
        loader = cache.wrap(DataLoader(Flips(own_generator=True), batch_size=4), variants=2)
    assert not loader.cached.cacheable
    assert cache.model.disabled_reason


def test_augmentation_from_the_global_generators_with_variants_is_cached_without_a_warning(cache):
    loader = cache.wrap(DataLoader(Flips(), batch_size=4), variants=2)
    assert loader.cached.cacheable
    first, again = ([x for x, _ in loader] for _ in range(2))  # epochs 0 and 1: variants 0 and 1
    third = [x for x, _ in loader]  # epoch 2: variant 0 again, the same draws
    assert all(torch.equal(a, b) for a, b in zip(first, third))
    assert not all(torch.equal(a, b) for a, b in zip(first, again))


class Sentences(Dataset):
    """Token-id lists of 4-16 tokens, tokenized (padded, truncated) only by the collate_fn."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(3)
        lengths = torch.randint(4, 17, (64,), generator=g).tolist()
        self.sentences = [torch.randint(1, 50, (n,), generator=g).tolist() for n in lengths]
        self.labels = torch.randint(0, 4, (64,), generator=g).tolist()

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[list[int], int]:
        return self.sentences[i], self.labels[i]


def tokenize(max_length: int):
    def collate(items):
        ids = torch.zeros(len(items), max_length, dtype=torch.int64)
        for row, (tokens, _) in enumerate(items):
            ids[row, :min(len(tokens), max_length)] = torch.tensor(tokens[:max_length])
        return ids, torch.tensor([label for _, label in items])
    return collate


class MeanPool(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=1)


def test_tokenizing_in_collate_fn_then_a_new_max_length_is_caught_and_the_hint_says_tokenize_in_the_dataset(daemon):
    namespace = f"wrap-{uuid.uuid4().hex[:8]}"
    for max_length, caught in ((8, False), (12, True)):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Embedding(50, 16), MeanPool(), nn.Linear(16, 4))
        cache = ac.ActCache(net, ac.connect(daemon.socket, namespace=namespace), planner=None)
        loader = cache.wrap(DataLoader(Sentences(), batch_size=16, collate_fn=tokenize(max_length)))
        cache.freeze(2)

        def epochs(n: int, net=net, loader=loader, cache=cache) -> None:
            for _ in range(n):
                for x, _ in loader:
                    net(x)
            cache.connection.flush()

        if caught:
            with pytest.warns(ac.CacheMismatchWarning, match=r"tokenize, pad and transform in the dataset .*not in "
                                                              r"collate_fn, so that a change \(a new max_length\)"):
                epochs(1)
        else:
            epochs(2)
        cache.close()
