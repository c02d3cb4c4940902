"""What a layout is: a network's stages, and how its batches and states map to theirs.

The helpers here are shared by the families: matching a module by its type's qualified name (no import of
the library that defines it), batches of text or images, the served state as the next module takes it, and
the stage that owns what runs after the frozen prefix in the network's own ``forward``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor, nn

from actcache.errors import ConfigError
from actcache_client.layouts._stages import StagedModel
from actcache_client.transport._state import State
from actcache_client.transport._tensors import VarLen

__all__ = ["Layout", "first_field", "module_at", "of_type", "padded_hidden", "pixel_inputs", "rest_of", "served_as_is",
           "text_inputs"]


def first_field(data: Any) -> Any:
    """The network's input in a batch: its first field (the whole batch if it is a tensor)."""
    if isinstance(data, Mapping):
        raise ConfigError(f"the loader yields dicts (keys {sorted(data)}); say which field is the network's input: "
                          "ActCache(net, inputs=lambda batch: batch['image'])")
    return data[0] if isinstance(data, (list, tuple)) else data


def served_as_is(state: State, given: Tensor | None) -> State:
    """The served state, unchanged: what the network's next module takes."""
    return state


@dataclass(frozen=True)
class Layout:
    """A network's stages and how its batches and states map to theirs.

    Attributes:
        stages: A StagedModel over the network's own modules, in the order its ``forward`` calls them
            (at least 2: a prefix to freeze and a head that trains).
        varlen: How padded text is stored (None: every sample at one shape).
        inputs_of: ``inputs_of(batch)``: the first stage's input in a batch as the loader yields it.
        output_of: ``output_of(state, given)``: the served state as the network's next module takes it
            (``given``: the first tensor of the batch's input).
        family: The registered family that built it (empty: built by hand).

    Raises:
        ConfigError: ``stages`` is not a StagedModel of at least 2 stages.
    """

    stages: StagedModel
    varlen: VarLen | None = None
    inputs_of: Callable[[Any], State] = first_field
    output_of: Callable[[State, Tensor | None], Any] = served_as_is
    family: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.stages, StagedModel):
            raise ConfigError(f"Layout(stages=...) is a StagedModel, got {type(self.stages).__name__}")
        if self.stages.num_stages < 2:
            raise ConfigError(f"a layout needs at least 2 stages (a prefix to freeze and a head that trains), got "
                              f"{self.stages.num_stages}: {self.stages.stage_names}")


def of_type(module: object, *names: str) -> bool:
    """Whether ``module``'s class (or a base class) is one of ``names`` (``"package.module.Class"``)."""
    return any(f"{cls.__module__}.{cls.__qualname__}" in names for cls in type(module).__mro__)


def module_at(root: nn.Module, path: str) -> nn.Module:
    """``root``'s submodule at the dotted ``path`` (``""``: root itself); a ConfigError naming the path if none."""
    module: Any = root
    for part in path.split(".") if path else []:
        module = getattr(module, part, None)
        if not isinstance(module, nn.Module):
            raise ConfigError(f"{type(root).__name__} has no module at {path!r} (no {part!r}); name a dotted path "
                              f"of its modules, e.g. one of {[n for n, _ in root.named_children()]}")
    return module


def text_inputs(data: Any) -> State:
    """``(input_ids, attention_mask[, token_type_ids])`` of a text batch: a dict or BatchEncoding, a tuple of
    them, or ``((input_ids, attention_mask[, ...]), labels)``."""
    if isinstance(data, Mapping):
        if "input_ids" not in data:
            raise ConfigError(f"a text batch needs 'input_ids'; the collate gave keys {sorted(data)}")
        ids = data["input_ids"]
        mask: Any = data.get("attention_mask")
        if mask is None and isinstance(ids, Tensor):
            mask = torch.ones_like(ids)
        types: Any = data.get("token_type_ids")
        return (ids, mask) if types is None else (ids, mask, types)
    if isinstance(data, (list, tuple)) and data and isinstance(data[0], (list, tuple, Mapping)):
        return text_inputs(data[0])
    return tuple(data[:3]) if isinstance(data, (list, tuple)) else data


def pixel_inputs(data: Any) -> Tensor:
    """``pixel_values`` of an image batch: a dict's, else the batch's first field."""
    if isinstance(data, Mapping):
        if "pixel_values" not in data:
            raise ConfigError(f"an image batch needs 'pixel_values'; the collate gave keys {sorted(data)}")
        return data["pixel_values"]
    return first_field(data)


def padded_hidden(state: State, given: Tensor | None) -> Tensor:
    """The served ``(hidden, mask)`` as the next layer takes it: hidden padded to the batch's length."""
    hidden = state[0]
    missing = 0 if given is None else given.shape[1] - hidden.shape[1]
    return hidden if missing <= 0 else nn.functional.pad(hidden, (0, 0, 0, missing))


class _Rest(nn.Module):
    """The modules and parameters of a network that no frozen stage holds: they run in its own ``forward``."""

    def __init__(self, modules: Iterable[nn.Module], params: Iterable[nn.Parameter]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(modules)
        self.params = nn.ParameterList(params)

    def forward(self, state: State) -> State:
        raise ConfigError("this stage runs inside the network's own forward, not on its own: call the network "
                          "(ActCache(net) serves its frozen prefix in place)")


def rest_of(net: nn.Module, taken: Iterable[nn.Module]) -> nn.Module:
    """A module holding every topmost module and parameter of ``net`` outside the modules ``taken``."""
    inside = {id(m) for t in taken for m in t.modules()}
    owned = {id(p) for t in taken for p in t.parameters()}
    modules: list[nn.Module] = []
    params: list[nn.Parameter] = []

    def walk(module: nn.Module) -> None:
        params.extend(p for p in module.parameters(recurse=False) if id(p) not in owned)
        for child in module.children():
            if id(child) in inside:
                continue
            if any(id(m) in inside for m in child.modules()):
                walk(child)
            else:
                modules.append(child)

    walk(net)
    return _Rest(modules, params)
