"""Batch rows: the raw inputs a batch carries (all, or those the loader loaded), selecting rows, merging parts.

A step splits a batch into parts by where each row's prefix output comes
from (served, seeded, computed); ``merge`` puts the parts back in batch
order, padding variable-length text states to the longest part.
"""

from __future__ import annotations

from typing import Callable

import torch

from actcache.errors import ConfigError
from actcache_client.transport._state import State, map_state, tensors_of
from actcache_client.transport._tensors import VarLen

__all__ = ["RawInputs", "merge"]


class RawInputs:
    """The raw inputs of a batch's rows: those the loader loaded, and an on-the-spot load for the rest;
    ``rows`` hands them out on ``device`` (where the stages compute), wherever the loader left them."""

    def __init__(self, inputs: State | None, size: int, loaded: list[int] | None,
                 load: Callable[[list[int]], State] | None, device: torch.device | None = None) -> None:
        self.inputs, self.size, self.load, self.device = inputs, size, load, device
        self._at = None if loaded is None else {row: i for i, row in enumerate(loaded)}
        self.loaded_now = 0  # rows loaded on the spot

    @property
    def partial(self) -> bool:
        return self._at is not None

    def has(self, row: int) -> bool:
        return self._at is None or row in self._at

    def length(self) -> int | None:
        """The inputs' second dimension (a text batch's padded length), if they are known and have one."""
        first = None if self.inputs is None else tensors_of(self.inputs)[0]
        return first.shape[1] if first is not None and first.dim() >= 2 else None

    def count(self) -> int:
        """Raw items this batch loaded (by the loader or on the spot)."""
        return (self.size if self._at is None else len(self._at)) + self.loaded_now

    def rows(self, rows: list[int]) -> State:
        """The inputs of ``rows``, in that order, on ``device``."""
        if self._at is None or all(r in self._at for r in rows):
            inputs = self.inputs
            assert inputs is not None, "the loader loaded these rows"
            if self._at is None:
                state = inputs if rows == list(range(self.size)) else _select(inputs, rows)
            else:
                state = _select(inputs, [self._at[r] for r in rows])
        elif self.load is None:
            raise ConfigError("this batch carries only some rows' inputs and no loader to load the others")
        else:
            self.loaded_now += len(rows)  # an entry the loader expected was not served: load it now
            state = self.load(rows)
        return state if self.device is None else map_state(state, lambda t: t.to(self.device, non_blocking=True))


def _select(state: State, rows: list[int]) -> State:
    index = torch.tensor(rows)
    return map_state(state, lambda t: t.index_select(0, index.to(t.device)))


def merge(batch: int, parts: list[tuple[list[int], State]], varlen: VarLen | None) -> State:
    """Put part states back in batch order; with VarLen, pad to the longest part and rebuild the mask."""
    if len(parts) == 1:
        return parts[0][1]
    merged = []
    for pieces in zip(*(tensors_of(state) for _, state in parts)):
        shape = [batch, *pieces[0].shape[1:]]
        if varlen is not None:
            shape[1] = max(p.shape[1] for p in pieces)
        out = pieces[0].new_zeros(shape)
        for (rows, _), piece in zip(parts, pieces):
            index = torch.tensor(rows, device=out.device)
            if varlen is not None:
                out[index, : piece.shape[1]] = piece
            else:
                out.index_copy_(0, index, piece)
        merged.append(out)
    return merged[0] if len(merged) == 1 and not isinstance(parts[0][1], tuple) else tuple(merged)
