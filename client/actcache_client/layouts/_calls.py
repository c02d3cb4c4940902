"""Running a network's own ``forward`` up to one of its modules: the arguments that module is called with.

This is how a stage gets what the network computes between its modules (embeddings, a class token, an
attention mask, rotary position embeddings) from the network's own code rather than a copy of it.
"""

from __future__ import annotations

from typing import Any, Callable

from torch import Tensor, nn

from actcache.errors import ConfigError

__all__ = ["arguments_at", "hidden_of"]


class _Reached(Exception):
    """Raised by a pre-hook to stop a forward at the module it is on, carrying that module's arguments."""

    def __init__(self, args: tuple, kwargs: dict) -> None:
        super().__init__("reached")
        self.call = (args, kwargs)


def _stop(module: nn.Module, args: tuple, kwargs: dict) -> None:
    raise _Reached(args, kwargs)


def arguments_at(run: Callable[[], Any], module: nn.Module, what: str) -> tuple[tuple, dict]:
    """The ``(args, kwargs)`` that ``run()`` (a forward) calls ``module`` with; it stops there."""
    handle = module.register_forward_pre_hook(_stop, with_kwargs=True)
    try:
        run()
    except _Reached as reached:
        return reached.call
    finally:
        handle.remove()
    raise ConfigError(f"the network's forward returned without calling {what}; name the blocks it calls "
                      "(blocks=...) or pass stages=StagedModel([...])")


def hidden_of(args: tuple, kwargs: dict) -> tuple[Tensor, tuple, dict]:
    """A block's input (its first argument), and the other arguments it was called with."""
    if args:
        return args[0], args[1:], kwargs
    if kwargs:
        name = next(iter(kwargs))
        return kwargs[name], (), {k: v for k, v in kwargs.items() if k != name}
    raise ConfigError("a block was called without arguments; actcache serves blocks that take the hidden state")
