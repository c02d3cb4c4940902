"""Fingerprints of frozen prefixes: a chain of per-stage digests of parameters and buffers.

``fingerprints[d]`` identifies the weights of ``stages[:d]``: it changes when any
of them changes (a retrained prefix is never served stale entries) and not when
more stages are frozen behind them (entries at depth d can seed deeper ones).
``cache_fingerprints`` folds in the data's fingerprint (actcache_client._identity).
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn

__all__ = ["cache_fingerprints", "prefix_fingerprints", "stage_digest"]

_ROOT = b"actcache/prefix/v1"
_KEY_ROOT = b"actcache/key/v1"


def stage_digest(stage: nn.Module) -> bytes:
    """blake2b-128 of a stage's class, parameter and buffer names, dtypes, shapes and bytes."""
    h = hashlib.blake2b(digest_size=16)
    h.update(type(stage).__qualname__.encode())
    tensors = [*stage.named_parameters(), *stage.named_buffers()]
    for name, tensor in tensors:
        h.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)};".encode())
        data = tensor.detach().to("cpu").contiguous().reshape(-1)
        if data.numel():
            h.update(memoryview(data.view(torch.uint8).numpy()))
    return h.digest()


def prefix_fingerprints(stages: list[nn.Module], depth: int) -> list[bytes]:
    """Fingerprints of depths 0..depth (index d covers ``stages[:d]``); 16 bytes each."""
    out = [hashlib.blake2b(_ROOT, digest_size=16).digest()]
    for stage in stages[:depth]:
        out.append(hashlib.blake2b(out[-1] + stage_digest(stage), digest_size=16).digest())
    return out


def cache_fingerprints(weights: list[bytes], data: bytes) -> list[bytes]:
    """The fingerprints cache keys carry: each prefix fingerprint combined with the data fingerprint
    (``data`` empty, no data identity known: the weights' fingerprints as they are)."""
    if not data:
        return list(weights)
    return [hashlib.blake2b(_KEY_ROOT + data + fp, digest_size=16).digest() for fp in weights]
