"""What CachedLoader yields: a batch with its sample ids, and the inputs it did not load."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

__all__ = ["Batch", "Skipped"]


@dataclass(frozen=True)
class Skipped:
    """The place of an item whose input was not loaded (the cache serves its prefix output)."""

    target: Any


@dataclass(frozen=True)
class Batch:
    """One batch: sample ids, the augmentation variant, the collated items, and where it sits.

    When the loader skipped loading some inputs, ``data`` is ``(inputs, targets)``
    with the inputs of the ``loaded`` rows only (None if none) and the targets
    of every row; pass the whole batch to the model, ``model(batch)``, which
    serves the other rows from the cache (and loads any it cannot serve with
    ``load``).

    Attributes:
        ids: The rows' sample ids: an int64 tensor on the host, made by the loader's collate (reading it
            never syncs with a device).
        data: The collated items (with skipped loads: ``(inputs of the loaded rows, targets)``).
        variant: The augmentation variant.
        epoch: The epoch.
        position: The batch's index in the epoch.
        loaded: The rows whose inputs were loaded; None when every row was.
        load: Loads the inputs of the given rows, for rows the cache cannot serve.
    """

    ids: torch.Tensor
    data: Any
    variant: int
    epoch: int
    position: int
    loaded: torch.Tensor | None = None
    load: Callable[[list[int]], Any] | None = None

    def with_data(self, data: Any) -> "Batch":
        """This batch with ``data`` in place of its own (``dataclasses.replace`` without its per-call work)."""
        return Batch(self.ids, data, self.variant, self.epoch, self.position, self.loaded, self.load)
