"""What the model's stage-0 input is: a fingerprint of the data, folded into every cache key.

Two jobs that start from the same pretrained weights must never read each other's entries, so the key covers
the data as well as the weights. ``data_fingerprint`` digests the dataset's type, length and sample-id
mapping, the ``data_id`` that names a dataset version, and the content of ``SPREAD_ITEMS`` items spread evenly
across the index range *exactly as the model receives them* (after the dataset's transform and the seeded
augmentation of every variant). So a change to the data, its preprocessing, a tokenizer setting or the id
mapping gives new keys. What it cannot see: a change to items outside the spread that leaves the spread, the
length and the type as they were (a few relabelled files). Name such versions with ``data_id``; audits
(actcache_client.engine._audit) recompute a share of hits to catch what a key cannot.
"""

from __future__ import annotations

import hashlib
import pickle
import struct
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

__all__ = ["SPREAD_ITEMS", "data_fingerprint", "spread"]

#: Items whose content goes into a data fingerprint.
SPREAD_ITEMS = 64
_ROOT = b"actcache/data/v1"


def spread(length: int, count: int = SPREAD_ITEMS) -> list[int]:
    """``count`` indices evenly across ``range(length)``, first and last included (all of them if fewer)."""
    if length <= count:
        return list(range(length))
    return sorted({round(i * (length - 1) / (count - 1)) for i in range(count)})


def data_fingerprint(dataset: Any, variants: int = 1) -> bytes:
    """16-byte fingerprint of what ``dataset`` (an IndexedDataset: ``dataset[index, variant]`` is ``(sample_id,
    item as the model receives it)``) gives the model, over augmentation variants ``0..variants-1``."""
    h = hashlib.blake2b(_ROOT, digest_size=16)
    inner = dataset.dataset
    _text(h, f"{type(inner).__module__}.{type(inner).__qualname__}")
    _text(h, dataset.data_id or "")
    h.update(struct.pack("<QQ", len(dataset), variants))
    if dataset.sample_ids is not None:
        h.update(np.asarray(dataset.sample_ids, dtype=np.int64).tobytes())
    for index in spread(len(dataset)):
        for variant in range(variants):
            sample_id, item = dataset[index, variant]
            h.update(struct.pack("<q", sample_id))
            _digest(h, item)
    return h.digest()


def _text(h, text: str) -> None:
    data = text.encode()
    h.update(struct.pack("<Q", len(data)) + data)


def _digest(h, obj: Any) -> None:
    """Feed ``obj`` to ``h``: type tag, then dtype, shape and bytes for arrays, recursing into containers."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().to("cpu").contiguous()
        _text(h, f"tensor:{t.dtype}:{tuple(t.shape)}")
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy().data)
    elif isinstance(obj, np.ndarray):
        _text(h, f"ndarray:{obj.dtype.str}:{obj.shape}")
        h.update(np.ascontiguousarray(obj).tobytes())
    elif isinstance(obj, (bool, int, float, complex, str, bytes, type(None))):
        _text(h, f"{type(obj).__name__}:{obj!r}")
    elif isinstance(obj, (tuple, list)):
        _text(h, f"{type(obj).__name__}:{len(obj)}")
        for x in obj:
            _digest(h, x)
    elif isinstance(obj, Mapping):
        _text(h, f"mapping:{len(obj)}")
        for key in sorted(obj, key=repr):
            _text(h, repr(key))
            _digest(h, obj[key])
    elif hasattr(obj, "tobytes") and hasattr(obj, "mode") and hasattr(obj, "size"):  # a PIL image
        _text(h, f"image:{obj.mode}:{obj.size}")
        h.update(obj.tobytes())
    else:  # its pickle (deterministic for plain data objects); unpicklable: its type only
        try:
            data = pickle.dumps(obj, protocol=4)
        except Exception:
            data = b""
        _text(h, f"object:{type(obj).__module__}.{type(obj).__qualname__}")
        h.update(data)
