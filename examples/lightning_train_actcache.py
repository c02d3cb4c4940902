"""ResNet-20 on scikit-learn's digits through a Lightning Trainer, its stem and first residual layer frozen
from epoch 1. ``lightning_train.py`` freezes them with a callback of its own; ``lightning_train_actcache.py``
(2 lines differ) serves them from actcache. ``--devices 2 --strategy ddp_find_unused_parameters_true`` trains
on two CPU processes.
"""

import argparse
import json

import lightning as L
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, Dataset, Sampler

from actcache_client.integrations.lightning import ActCacheCallback
from actcache_client.models import resnet20


class Digits(Dataset):
    """8x8 digits as 3-channel images, with a ``targets`` list as torchvision datasets have."""

    def __init__(self, part: slice) -> None:
        digits = load_digits()
        self.images = torch.tensor(digits.images[part], dtype=torch.float32).div(16).unsqueeze(1).repeat(1, 3, 1, 1)
        self.targets = digits.target[part].tolist()

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.images[i], self.targets[i]


class EpochShuffle(Sampler):
    """A new order every epoch drawn from (seed, epoch) alone, so a resumed run sees the orders it would have."""

    def __init__(self, n: int, seed: int = 0) -> None:
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, epoch: int) -> None:  # Lightning calls it at every epoch
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        return iter(torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist())


class FreezeStem(L.Callback):
    """From epoch ``at`` on, the stem and layer1 stop training (no gradients, batch norm statistics kept)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch >= self.at:
            for m in (pl_module.net.conv1, pl_module.net.bn1, pl_module.net.layer1):
                m.requires_grad_(False).eval()


class DigitsModule(L.LightningModule):
    def __init__(self, size: int, batch_size: int = 64, lr: float = 0.05) -> None:
        super().__init__()
        self.net = resnet20()
        self.size, self.batch_size, self.lr = size, batch_size, lr
        self.losses: list[float] = []  # every training step's loss, in order
        self.val_losses: list[float] = []  # every validation batch's loss, in order

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.losses.append(loss.item())
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        loss = F.cross_entropy(logits, y)
        self.val_losses.append(loss.item())
        self.log_dict({"val_loss": loss, "val_acc": (logits.argmax(1) == y).float().mean()})

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)]

    def train_dataloader(self):
        data = Digits(slice(0, self.size))
        return DataLoader(data, batch_size=self.batch_size, sampler=EpochShuffle(len(data)))

    def val_dataloader(self):
        return DataLoader(Digits(slice(self.size, self.size + self.size // 4)), batch_size=256)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--size", type=int, default=1400, help="training samples (the next quarter validates)")
    parser.add_argument("--freeze-at", type=int, default=1)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--strategy", default="auto")
    parser.add_argument("--root", default="lightning_logs", help="where checkpoints go")
    parser.add_argument("--resume", default=None, help="a checkpoint to resume from")
    parser.add_argument("--out", default=None, help="write this rank's losses as JSON (RANK in the name)")
    args = parser.parse_args(argv)

    L.seed_everything(0, verbose=False)
    model = DigitsModule(args.size)
    trainer = L.Trainer(
        max_epochs=args.epochs, accelerator="cpu", devices=args.devices, strategy=args.strategy,
        default_root_dir=args.root, logger=False, enable_progress_bar=False, enable_model_summary=False,
        log_every_n_steps=1,
        callbacks=[ActCacheCallback(freeze_at_epoch=args.freeze_at, depth=4)],
    )
    trainer.fit(model, ckpt_path=args.resume)
    if args.out:
        result = {"losses": model.losses, "val_losses": model.val_losses,
                  "val_acc": float(trainer.callback_metrics["val_acc"])}
        with open(args.out.replace("RANK", str(trainer.global_rank)), "w") as f:
            json.dump(result, f)
    return trainer, model


if __name__ == "__main__":
    main()
