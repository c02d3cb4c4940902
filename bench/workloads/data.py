"""Readers for the benchmark data in ``../shared/data`` (never committed): CIFAR-10 subset, SST-2, CoLA.

The directory comes from ``--data-dir``, else ``$ACTCACHE_DATA``, else
``../shared/data`` beside the repository when it exists. Formats, licences
and sizes are in each data set's README.md there. Subsets are drawn with a
fixed seed, so every mode of a benchmark trains on the same samples.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

__all__ = [
    "CIFAR_MEAN",
    "CIFAR_STD",
    "DataNotFound",
    "GLUE_TASKS",
    "ImageSet",
    "JpegSet",
    "TextSet",
    "crop_flip",
    "pad_collate",
    "read_cifar10",
    "read_glue",
    "resolve_data_dir",
    "subset",
    "tokenize",
]

REPO = Path(__file__).resolve().parents[2]
CIFAR_MEAN = (0.4926, 0.4828, 0.4471)  # of the decoded 20k train images (cifar10/README.md)
CIFAR_STD = (0.2457, 0.2435, 0.2611)
CIFAR_FILES = {"train": "train_2000_per_class.npz", "test": "test.npz"}
#: task -> (directory, has a header line, label column, sentence column)
GLUE_TASKS = {"sst2": ("sst2", True, 1, 0), "cola": ("cola", False, 1, 3)}


class DataNotFound(FileNotFoundError):
    """A benchmark's data files are not where we looked."""


def resolve_data_dir(arg: str | os.PathLike | None = None) -> Path:
    """``arg``, else ``$ACTCACHE_DATA``, else ``<repo>/../shared/data`` if it exists."""
    looked = []
    for source, value in (("--data-dir", arg), ("ACTCACHE_DATA", os.environ.get("ACTCACHE_DATA"))):
        if value:
            path = Path(value).expanduser()
            if path.is_dir():
                return path
            looked.append(f"{source}={path} (not a directory)")
    default = REPO.parent / "shared" / "data"
    if default.is_dir():
        return default
    looked.append(f"{default} (absent)")
    raise DataNotFound(f"no benchmark data directory: looked at {'; '.join(looked)}. "
                       "Pass --data-dir DIR or set ACTCACHE_DATA=DIR (a directory holding cifar10/, sst2/, cola/).")


def _need(path: Path, what: str) -> Path:
    if not path.is_file():
        present = sorted(p.name for p in path.parent.iterdir()) if path.parent.is_dir() else "directory absent"
        raise DataNotFound(f"{what}: {path} is missing (in {path.parent}: {present}); see its README.md "
                           "for the expected files, or point --data-dir / ACTCACHE_DATA elsewhere")
    return path


def subset(total: int, n: int | None, seed: int = 0) -> list[int]:
    """``n`` of ``range(total)`` drawn with ``seed`` (all of them, in order, when ``n`` is None or >= total)."""
    if n is None or n >= total:
        return list(range(total))
    return sorted(np.random.default_rng(seed).permutation(total)[:n].tolist())


def read_cifar10(data_dir: Path, split: str, limit: int | None = None, seed: int = 0) -> tuple[Tensor, Tensor]:
    """Decoded images ``uint8 (N, 3, 32, 32)`` and labels ``int64 (N,)``; ``limit`` draws a fixed-seed subset."""
    from PIL import Image

    if split not in CIFAR_FILES:
        raise ValueError(f"CIFAR-10 split must be one of {sorted(CIFAR_FILES)}, got {split!r}")
    path = _need(data_dir / "cifar10" / CIFAR_FILES[split], f"CIFAR-10 {split} split")
    with np.load(path, allow_pickle=False) as npz:
        blob, offsets, labels = npz["jpeg_bytes"], npz["offsets"], npz["labels"]
    rows = subset(len(labels), limit, seed)
    images = np.empty((len(rows), 32, 32, 3), dtype=np.uint8)
    for out, i in enumerate(rows):
        data = blob[offsets[i] : offsets[i + 1]].tobytes()
        images[out] = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    return torch.from_numpy(images).permute(0, 3, 1, 2).contiguous(), torch.from_numpy(labels[rows].astype(np.int64))


class JpegSet(Dataset):
    """CIFAR-10 JPEGs decoded and normalized on every access, as a data loader over image files does."""

    def __init__(self, data_dir: Path, split: str = "train", limit: int | None = None, seed: int = 0) -> None:
        path = _need(data_dir / "cifar10" / CIFAR_FILES[split], f"CIFAR-10 {split} split")
        with np.load(path, allow_pickle=False) as npz:
            blob, offsets, labels = npz["jpeg_bytes"], npz["offsets"], npz["labels"]
        rows = subset(len(labels), limit, seed)
        self.jpegs = [blob[offsets[i] : offsets[i + 1]].tobytes() for i in rows]
        self.labels = torch.from_numpy(labels[rows].astype(np.int64))
        self.mean = torch.tensor(CIFAR_MEAN)[:, None, None]
        self.std = torch.tensor(CIFAR_STD)[:, None, None]

    def __len__(self) -> int:
        return len(self.jpegs)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        from PIL import Image

        pixels = np.array(Image.open(io.BytesIO(self.jpegs[i])).convert("RGB"))  # writable: torch needs it
        x = torch.from_numpy(pixels).permute(2, 0, 1).float().div_(255)
        return (x - self.mean) / self.std, self.labels[i]


def read_glue(data_dir: Path, task: str, split: str) -> tuple[list[str], list[int]]:
    """Sentences and 0/1 labels of a GLUE single-sentence task's ``train`` or ``dev`` split."""
    if task not in GLUE_TASKS:
        raise DataNotFound(f"GLUE task {task!r} is not in the benchmark data (have {sorted(GLUE_TASKS)}); "
                           f"MRPC, for one, is not in {data_dir}")
    folder, header, label_col, text_col = GLUE_TASKS[task]
    if split not in ("train", "dev"):
        raise ValueError(f"split must be 'train' or 'dev' (the test split has no labels), got {split!r}")
    lines = _need(data_dir / folder / f"{split}.tsv", f"{task} {split} split").read_text("utf-8").splitlines()
    sentences, labels = [], []
    for number, line in enumerate(lines[1:] if header else lines, start=2 if header else 1):
        cols = line.split("\t")  # no CSV quoting: sentences contain quotes
        if len(cols) <= max(label_col, text_col) or cols[label_col] not in ("0", "1"):
            raise ValueError(f"{data_dir / folder / split}.tsv line {number}: unexpected row {line[:80]!r}")
        sentences.append(cols[text_col].strip())
        labels.append(int(cols[label_col]))
    return sentences, labels


def tokenize(tokenizer: Any, sentences: Sequence[str]) -> list[Tensor]:
    """Token ids per sentence ([CLS] ... [SEP], truncated as the tokenizer is set up), unpadded."""
    return [torch.tensor(e.ids, dtype=torch.int64) for e in tokenizer.encode_batch(list(sentences))]


class ImageSet(Dataset):
    """Normalized float images and labels: ``(image (C, H, W), label)``."""

    def __init__(self, images: Tensor, labels: Tensor, mean: Sequence[float], std: Sequence[float]) -> None:
        x = images.float() / 255 if images.dtype == torch.uint8 else images.float()
        self.images = (x - torch.tensor(mean)[:, None, None]) / torch.tensor(std)[:, None, None]
        self.labels = labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        return self.images[i], self.labels[i]


def crop_flip(pad: int = 4) -> Callable[[tuple[Tensor, Tensor], torch.Generator], tuple[Tensor, Tensor]]:
    """Random crop after zero padding and horizontal flip, drawn from the generator actcache seeds."""

    def augment(item: tuple[Tensor, Tensor], generator: torch.Generator) -> tuple[Tensor, Tensor]:
        x, y = item
        h, w = x.shape[-2:]
        dy, dx = torch.randint(0, 2 * pad + 1, (2,), generator=generator).tolist()
        x = torch.nn.functional.pad(x, (pad, pad, pad, pad))[:, dy : dy + h, dx : dx + w]
        if torch.rand((), generator=generator) < 0.5:
            x = x.flip(-1)
        return x, y

    return augment


class TextSet(Dataset):
    """Token id tensors of varying length and labels: ``(ids (L,), label)``."""

    def __init__(self, token_ids: Sequence[Tensor], labels: Sequence[int]) -> None:
        if len(token_ids) != len(labels):
            raise ValueError(f"{len(token_ids)} token sequences for {len(labels)} labels")
        self.token_ids = list(token_ids)
        self.labels = torch.tensor(labels, dtype=torch.int64)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        return self.token_ids[i], self.labels[i]


def pad_collate(items: Sequence[tuple[Tensor, Tensor]], pad_id: int = 0) -> tuple[tuple[Tensor, Tensor], Tensor]:
    """``((ids, mask), labels)`` right-padded to the batch's longest sequence (what VarLen expects)."""
    longest = max(len(ids) for ids, _ in items)
    ids = torch.full((len(items), longest), pad_id, dtype=torch.int64)
    mask = torch.zeros(len(items), longest, dtype=torch.int64)
    for row, (seq, _) in enumerate(items):
        ids[row, : len(seq)] = seq
        mask[row, : len(seq)] = 1
    return (ids, mask), torch.stack([y for _, y in items])
