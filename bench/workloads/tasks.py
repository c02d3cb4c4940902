"""The workloads: CIFAR-10 ResNet-20 from scratch, MiniLM fine-tuning on SST-2 / CoLA, and the demo's digits.

Each builder returns a :class:`Workload` with its data loaded, its recipe
and its static freeze point. ``quick=True`` shrinks the data and epochs to
a run of a minute or two; explicit keyword arguments override either size.

Stages (what a freeze policy judges and what the cache stores the output
of) balance parameters as Egeria does (§4.2.1; §6.3 splits ResNet-56 into
~7 modules of similar size, layer1 and layer2 as a whole): ``balanced``
merges consecutive blocks with ``auto_partition`` and keeps the head on its
own (it always trains). ResNet-20, ``auto_partition(max_stages=6)``:
stem..layer2.0 (28k parameters), layer2.1..layer2.2 (37k), one stage per
layer3 block (56k, 74k, 74k) and the head; one stage per block instead gave
the stem (464 parameters, 0.2%) a whole freezing period of its own. MiniLM
keeps from_bert's split (embeddings, one stage per encoder layer, head):
the layers are of equal size and the embeddings (12M parameters, a lookup)
cannot be split; auto_partition would only merge the head into layer 5.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

import actcache_client as ac
from actcache.errors import ConfigError
from actcache_client.models import CifarResNet

from .data import (
    CIFAR_MEAN,
    CIFAR_STD,
    GLUE_TASKS,
    DataNotFound,
    ImageSet,
    TextSet,
    crop_flip,
    pad_collate,
    read_cifar10,
    read_glue,
    subset,
    tokenize,
)
from .trainer import Workload

__all__ = ["WORKLOADS", "balanced", "cifar", "digits", "glue", "make_workload", "step_schedule", "warmup_linear"]

WORKLOADS = ("cifar", "digits", "sst2", "cola", "mrpc")


def balanced(stage: Callable[[nn.Module], ac.StagedModel], stages: int) -> Callable[[nn.Module], ac.StagedModel]:
    """``stage``'s stages merged by ``auto_partition(max_stages=stages)``; the head must stay a stage of its own."""

    def make(model: nn.Module) -> ac.StagedModel:
        staged = ac.auto_partition(stage(model), max_stages=stages)
        if staged.stage_names[-1] != "head":
            raise ConfigError(f"auto_partition merged the head into {staged.stage_names[-1]!r}; the head always "
                              "trains, so pass more stages")
        return staged

    return make


def step_schedule(milestones: tuple[float, ...] = (0.5, 0.75), gamma: float = 0.1):
    """LR x gamma at each milestone (a fraction of the run's steps); Egeria unfreezes on such drops."""

    def make(opt: torch.optim.Optimizer, total: int, per_epoch: int) -> Any:
        steps = [int(m * total) for m in milestones]
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: gamma ** sum(s >= m for m in steps))

    return make


def warmup_linear(warmup: float = 0.06):
    """Linear warm-up over ``warmup`` of the steps, then linear decay to 0 (BERT fine-tuning)."""

    def make(opt: torch.optim.Optimizer, total: int, per_epoch: int) -> Any:
        ramp = max(1, int(warmup * total))
        return torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: (s + 1) / ramp if s < ramp else max(0.0, (total - s) / max(1, total - ramp)))

    return make


def _sgd(lr: float):
    return lambda params: torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=5e-4)


def cifar(data_dir: Path, *, quick: bool = False, train_size: int | None = None, eval_size: int | None = None,
          epochs: int | None = None, batch_size: int = 128) -> Workload:
    """ResNet-20 from scratch on the 20k-image CIFAR-10 subset, crop+flip with 2 cached variants, step LR."""
    images, labels = read_cifar10(data_dir, "train", train_size or (2000 if quick else None))
    test_images, test_labels = read_cifar10(data_dir, "test", eval_size or (1000 if quick else None))
    epochs = epochs or (4 if quick else 10)
    return Workload(
        name="cifar", metric="accuracy", build=lambda: CifarResNet(3, 10), stage=balanced(ac.from_resnet, 6),
        train_set=ImageSet(images, labels, CIFAR_MEAN, CIFAR_STD),
        eval_set=ImageSet(test_images, test_labels, CIFAR_MEAN, CIFAR_STD),
        batch_size=batch_size, epochs=epochs, optimizer=_sgd(0.1), schedule=step_schedule(),
        augment=crop_flip(4), variants=2,
        static_depth=2, static_at_epoch=0.3 * epochs,  # stem + layer1 + layer2: about 2/3 of the forward FLOPs
    )


def glue(task: str, data_dir: Path, *, quick: bool = False, train_size: int | None = None,
         eval_size: int | None = None, epochs: int | None = None, batch_size: int = 32, seed: int = 0) -> Workload:
    """all-MiniLM-L6-v2 fine-tuned on SST-2 (fixed-seed subset) or CoLA; AdamW, warm-up + linear decay."""
    from actcache_client.bert import load_minilm

    if task not in GLUE_TASKS:
        present = sorted(p.name for p in data_dir.iterdir()) if data_dir.is_dir() else []
        where = ("is there, but its sentence-pair reader is not written yet" if task in present
                 else f"is not in {data_dir} (it holds {present})")
        raise DataNotFound(f"workload {task!r}: {task.upper()} {where}; runnable text workloads: "
                           f"{', '.join(GLUE_TASKS)}")
    sentences, labels = read_glue(data_dir, task, "train")
    dev_sentences, dev_labels = read_glue(data_dir, task, "dev")
    default_train = {"sst2": 8000, "cola": 6000}[task]  # x 2 and x 3 epochs: about 8 minutes a run on 2 cores
    rows = subset(len(labels), train_size or (800 if quick else default_train), seed)
    dev_rows = subset(len(dev_labels), eval_size or (300 if quick else None), seed)
    _, tokenizer = load_minilm(2, seed=seed, max_length=64)  # max 64: see the data READMEs
    train_set = TextSet(tokenize(tokenizer, [sentences[i] for i in rows]), [labels[i] for i in rows])
    eval_set = TextSet(tokenize(tokenizer, [dev_sentences[i] for i in dev_rows]), [dev_labels[i] for i in dev_rows])
    epochs = epochs or {"sst2": 2, "cola": 3}[task]
    return Workload(
        name=task, metric="mcc" if task == "cola" else "accuracy",
        build=lambda: load_minilm(2, seed=seed)[0], stage=ac.from_bert,
        train_set=train_set, eval_set=eval_set, batch_size=batch_size, epochs=epochs,
        optimizer=lambda params: torch.optim.AdamW(params, lr=5e-5, weight_decay=0.01),
        schedule=warmup_linear(), collate=pad_collate, varlen=ac.VarLen(), eval_batch_size=128,
        evals_per_epoch=2 if quick else 4,
        # embeddings + 3 of 6 layers, early enough that most of the later epochs are served from the cache
        static_depth=4, static_at_epoch=0.25 if task == "sst2" else 0.5,
    )


def digits(*, quick: bool = False, epochs: int | None = None, size: int = 32, blocks: int = 3,
           limit: int | None = None, batch_size: int = 64, stages: int | None = None) -> Workload:
    """scikit-learn's 1,797 8x8 handwritten digits, upsampled to ``size``, ResNet-(6*blocks+2); 80/20 split.

    Nothing to download (the data ships with scikit-learn). 1,437 training
    images are 23 steps of 64 per epoch; ``quick``: 10 epochs (about a
    minute per run on one core), else 30. SGD 0.05, momentum 0.9, LR x0.1
    at 50% and 75% of the steps (so Egeria's unfreezing is exercised), dev
    accuracy 4 times per epoch on the 360 held-out images. Stages: one per
    residual block (the demo's fixed schedule), or at most ``stages``
    balanced ones (bench_train: 6). The static freeze covers stem..layer2.
    """
    try:
        from sklearn.datasets import load_digits
    except ModuleNotFoundError:
        raise ModuleNotFoundError("the digits workload needs scikit-learn: pip install -e '.[demo]' "
                                  "(make demo does it)") from None
    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32)[:, None] / 16
    x = nn.functional.interpolate(x, size=(size, size), mode="bilinear", align_corners=False).expand(-1, 3, -1, -1)
    y = torch.tensor(data.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    if limit is not None:
        order = order[:limit]
    cut = int(0.8 * len(order))
    train, test = order[:cut], order[cut:]
    mean, std = [float(x[train].mean())] * 3, [float(x[train].std())] * 3
    epochs = epochs or (10 if quick else 30)
    stage = ac.from_resnet if stages is None else balanced(ac.from_resnet, stages)
    names = stage(CifarResNet(blocks, 10)).stage_names
    return Workload(
        name="digits", metric="accuracy", build=lambda: CifarResNet(blocks, 10), stage=stage,
        train_set=ImageSet(x[train], y[train], mean, std), eval_set=ImageSet(x[test], y[test], mean, std),
        batch_size=batch_size, epochs=epochs, optimizer=_sgd(0.05), schedule=step_schedule(),
        evals_per_epoch=4 if stages is not None else 1,
        static_depth=next(i for i, n in enumerate(names) if n.startswith("layer3")),  # stem..layer2
        static_at_epoch=0.3 * epochs,
    )


def make_workload(name: str, data_dir: Path | None, *, quick: bool = False, **sizes: Any) -> Workload:
    """A benchmark workload by name (:data:`WORKLOADS`); ``mrpc`` explains that its data is absent.

    ``digits`` needs no data directory and takes only ``epochs`` (its split is fixed).
    """
    if name == "digits":
        fixed = sorted(k for k in sizes if k != "epochs")
        if fixed:
            raise ConfigError(f"the digits workload has a fixed 1,437 / 360 split; drop {', '.join(fixed)} "
                              "(only --epochs applies)")
        return digits(quick=quick, stages=6, **sizes)
    if data_dir is None:
        raise DataNotFound(f"workload {name!r} reads its data from a data directory; pass --data-dir")
    if name == "cifar":
        return cifar(data_dir, quick=quick, **sizes)
    if name in WORKLOADS:
        return glue(name, data_dir, quick=quick, **sizes)
    raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
