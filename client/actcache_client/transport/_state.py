"""A stage's state: a tensor or a tuple of tensors (a BERT layer carries ``(hidden, attention_mask)``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Union

from torch import Tensor

__all__ = ["State", "map_state", "state_bytes", "tensors_of"]

State = Union[Tensor, tuple[Tensor, ...]]


def tensors_of(state: State) -> tuple[Tensor, ...]:
    """The tensors of ``state``, as a tuple."""
    return state if isinstance(state, tuple) else (state,)


def map_state(state: State, fn: Callable[[Tensor], Tensor]) -> State:
    """``fn`` applied to every tensor of ``state``, in the same form (a tensor or a tuple)."""
    return tuple(fn(t) for t in state) if isinstance(state, tuple) else fn(state)


def state_bytes(state: State) -> int:
    """The bytes of ``state``'s tensors."""
    return sum(t.numel() * t.element_size() for t in tensors_of(state))
