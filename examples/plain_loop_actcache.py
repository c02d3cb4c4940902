"""``plain_loop.py`` with actcache: the frozen stem and first residual layer are served from the cache."""

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, Dataset

import actcache_client as ac
from actcache_client.models import resnet20

FREEZE_EPOCH = 1


class Digits(Dataset):
    """The 1,797 8x8 digits as 3-channel images, with a ``targets`` list as torchvision datasets have."""

    def __init__(self, size: int | None = None) -> None:
        digits = load_digits()
        self.images = torch.tensor(digits.images[:size], dtype=torch.float32).div(16).unsqueeze(1).repeat(1, 3, 1, 1)
        self.targets = digits.target[:size].tolist()

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.images[i], self.targets[i]


def train(epochs: int = 4, size: int | None = None, seed: int = 0) -> list[float]:
    torch.manual_seed(seed)
    net = resnet20()
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    cache = ac.ActCache(net)  # this node's daemon, started on first use
    loader = cache.wrap(DataLoader(Digits(size), batch_size=64, shuffle=True))
    losses = []
    for epoch in range(epochs):
        net.train()
        if epoch >= FREEZE_EPOCH:
            cache.freeze(4)  # conv1, bn1 and layer1's three blocks
        for x, y in loader:
            loss = F.cross_entropy(net(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        net.eval()
        with torch.no_grad():
            correct = sum((net(x).argmax(1) == y).sum().item() for x, y in DataLoader(Digits(size), batch_size=256))
        print(f"epoch {epoch}: loss {losses[-1]:.4f}, train accuracy {correct / len(loader.dataset):.3f}")
    return losses


if __name__ == "__main__":
    train()
