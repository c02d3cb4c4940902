"""A small data directory in the layout of ../shared/data (see each README.md there), generated."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest

WORDS = "a good bad film movie plot dull great fine the was not very".split()


def _npz(path: Path, n: int, seed: int) -> None:
    from PIL import Image

    rng = np.random.default_rng(seed)
    blobs, labels = [], np.sort(rng.integers(0, 10, n)).astype(np.uint8)
    for label in labels:
        pixels = (rng.integers(0, 64, (32, 32, 3)) + 19 * label).astype(np.uint8)
        out = io.BytesIO()
        Image.fromarray(pixels).save(out, format="JPEG", quality=75)
        blobs.append(np.frombuffer(out.getvalue(), np.uint8))
    offsets = np.concatenate([[0], np.cumsum([len(b) for b in blobs])]).astype(np.int64)
    np.savez(path, jpeg_bytes=np.concatenate(blobs), offsets=offsets, labels=labels,
             index_in_class=np.arange(n, dtype=np.int16), classes=np.array([f"c{i}" for i in range(10)]))


def _sentences(n: int, seed: int) -> list[tuple[str, int]]:
    rng = np.random.default_rng(seed)
    return [(" ".join(rng.choice(WORDS, rng.integers(2, 9))), int(rng.integers(0, 2))) for _ in range(n)]


def make_data_dir(root: Path, *, images: int = 48, sentences: int = 24) -> Path:
    pytest.importorskip("PIL", reason="Pillow not installed (the bench extra: pip install -e '.[bench]')")
    for name in ("cifar10", "sst2", "cola"):
        (root / name).mkdir(parents=True, exist_ok=True)
    _npz(root / "cifar10" / "train_2000_per_class.npz", images, 0)
    _npz(root / "cifar10" / "test.npz", images // 2, 1)
    for split, n in (("train", sentences), ("dev", sentences // 2)):
        rows = _sentences(n, len(split))
        (root / "sst2" / f"{split}.tsv").write_text("sentence\tlabel\n" + "".join(f"{s} \t{y}\n" for s, y in rows))
        (root / "cola" / f"{split}.tsv").write_text("\n".join(f"src\t{y}\t{'' if y else '*'}\t{s}." for s, y in rows))
    return root
