"""The precision a frozen prefix's outputs are stored in (``store_dtype``), and the casts to and from it.

Masks and ids stay as they are. Entries stored in 16 bits are another
computation's: their keys carry ``key_tag``.
"""

from __future__ import annotations

import torch

from actcache.errors import ConfigError
from actcache_client._stages import State, map_state

__all__ = ["StorePrecision"]


class StorePrecision:
    """``store_dtype`` (None: as computed) and ``compute_dtype`` (the stages'), and casts between them."""

    def __init__(self, store_dtype: torch.dtype | None, compute_dtype: torch.dtype) -> None:
        if store_dtype not in (None, torch.float16, torch.bfloat16):
            raise ConfigError(f"store_dtype must be torch.float16, torch.bfloat16 or None, got {store_dtype}")
        self.store_dtype = store_dtype
        self.compute_dtype = compute_dtype
        self.key_tag = b"" if store_dtype is None else f"store:{store_dtype}".encode()

    def to_stored(self, state: State) -> State:
        """``state`` as it is stored (computed outputs cast to ``store_dtype``)."""
        return self._cast(state, self.compute_dtype, self.store_dtype)

    def to_compute(self, state: State) -> State:
        """A served ``state`` back in the precision the stages compute in."""
        return self._cast(state, self.store_dtype, self.compute_dtype)

    def _cast(self, state: State, source: torch.dtype, target: torch.dtype) -> State:
        if self.store_dtype is None:
            return state
        return map_state(state, lambda t: t.to(target) if t.dtype == source else t)
