"""The plain training loop the integration tests run through a CachedForward."""

from __future__ import annotations

import torch
from torch import nn

import actcache_client as ac


def fit(model: ac.CachedForward, loader: ac.CachedLoader, opt: torch.optim.Optimizer, epochs: int,
        connection: ac.Connection | None) -> tuple[list[float], list[int]]:
    """``epochs`` of ``model(ids, x, variant=...)``, cross-entropy and an optimizer step per batch: the loss of
    every step, and the rows served from the cache in each epoch (the puts are flushed after each epoch)."""
    losses, hits = [], []
    for _ in range(epochs):
        before = model.times.cached_samples
        for batch in loader:
            x, y = batch.data
            loss = nn.functional.cross_entropy(model(batch.ids, x, variant=batch.variant), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        hits.append(model.times.cached_samples - before)
        if connection is not None:
            connection.flush(timeout_s=30)
    return losses, hits
