"""Dict batches: ``ActCache(net, inputs=...)`` says which field of a batch is the network's input.

A dataset of ``{"image": ..., "label": ...}`` items; the default collate makes batches of the same keys.
The first two modules freeze after the first epoch and are served from the cache from then on.
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

import actcache_client as ac


class Images(Dataset):
    def __init__(self, n: int = 64) -> None:
        g = torch.Generator().manual_seed(0)
        self.images = torch.randn(n, 3, 8, 8, generator=g)
        self.labels = torch.randint(0, 10, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict:
        return {"image": self.images[i], "label": self.labels[i]}


def train(epochs: int = 3, cached: bool = True) -> tuple[list[float], int]:
    """The losses of every step, and how many frozen-prefix outputs the cache served."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 64, 10))
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    loader = DataLoader(Images(), batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(1))
    # planner=None: this small a prefix is cheaper to recompute than to fetch (the default cost model would
    # find so); the example shows the cache serving
    cache = ac.ActCache(net, inputs=lambda batch: batch["image"], planner=None) if cached else None
    if cache is not None:
        loader = cache.wrap(loader)
    losses = []
    for epoch in range(epochs):
        if epoch == 1:
            if cache is not None:
                cache.freeze(2)  # the convolution and its ReLU
            else:
                net[:2].requires_grad_(False)
        for batch in loader:
            loss = F.cross_entropy(net(batch["image"]), batch["label"])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    hits = 0
    if cache is not None:
        hits = cache.connection.stats.hits
        cache.close()
    return losses, hits


if __name__ == "__main__":
    print(train())
