"""Any network whose blocks are an nn.ModuleList or nn.Sequential: ``ActCache(net, blocks="encoder.layers")``.

Stage 0 is what the network computes before its first block (its own ``forward``, stopped at the block:
embeddings, a class token, a position embedding, glue) and the first block; then one stage per block, and
``head``, the rest. The frozen prefix is served where the network calls its first block, so whatever it
computes before it keeps running as written. Stage 0 owns the modules and parameters registered before
the blocks (on the way down the path to them); the check on the first batch compares each stage with
the network's own forward.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from actcache.errors import ConfigError
from actcache_client.layouts._base import Layout, module_at, rest_of
from actcache_client.layouts._calls import arguments_at
from actcache_client.layouts._stages import Stage, StagedModel
from actcache_client.transport._state import State, tensors_of

__all__ = ["stage_blocks"]


class _Stem(nn.Module):
    """The network's input -> the first block's output: the network's own forward up to the block, then it."""

    net: nn.Module

    def __init__(self, net: nn.Module, modules: list[nn.Module], params: list[nn.Parameter], block: nn.Module,
                 name: str) -> None:
        super().__init__()
        self.parts = nn.ModuleList(modules)
        self.params = nn.ParameterList(params)
        self.block = block
        object.__setattr__(self, "net", net)  # called, not owned: its other modules belong to other stages
        self.name = name

    def forward(self, state: State) -> Any:
        inputs = tensors_of(state)
        args, kwargs = arguments_at(lambda: self.net(*inputs), self.block, self.name)
        return self.block(*args, **kwargs)


class _Block(nn.Module):
    """``hidden -> block(hidden)``."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, state: State) -> Any:
        return self.block(state)


def _before(net: nn.Module, path: str) -> tuple[list[nn.Module], list[nn.Parameter]]:
    """The modules registered before the blocks at each level down ``path``, and the parameters held there."""
    modules: list[nn.Module] = []
    params: list[nn.Parameter] = []
    level = net
    for part in path.split("."):
        params.extend(level.parameters(recurse=False))
        for name, child in level.named_children():
            if name == part:
                break
            modules.append(child)
        level = getattr(level, part)
    return modules, params


def stage_blocks(net: nn.Module, path: str) -> Layout:
    """The layout of ``net`` by its blocks: a stage per block (the first runs what precedes it too), a head.

    Args:
        net: The network.
        path: The dotted path to its blocks, an nn.ModuleList or nn.Sequential of at least 2.

    Raises:
        ConfigError: ``path`` names no such container.
    """
    if not isinstance(path, str) or not path:
        raise ConfigError(f"blocks= is the dotted path of the network's blocks (\"encoder.layers\"), got {path!r}")
    container = module_at(net, path)
    if not isinstance(container, (nn.ModuleList, nn.Sequential)) or len(container) < 2:
        raise ConfigError(f"blocks={path!r} is a {type(container).__name__} of {len(list(container.children()))} "
                          "modules; name an nn.ModuleList or nn.Sequential of at least 2 blocks")
    blocks = list(container)
    modules, params = _before(net, path)
    stem = _Stem(net, modules, params, blocks[0], f"{path}.0")
    stages = [Stage(f"{path}.0", stem, sites=[blocks[0]])]
    stages += [Stage(f"{path}.{i}", _Block(block)) for i, block in enumerate(blocks[1:], 1)]
    stages.append(Stage("head", rest_of(net, [s.module for s in stages])))
    return Layout(StagedModel(stages), family="blocks")
