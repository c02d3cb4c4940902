"""A layout's guess checked against the network before it is trusted.

On the first rows of the first batch the wrapped loader yields, every stage but the head runs from the batch's input and its
output is compared with what the network's own ``forward`` gives at the same place (the output of the
stage's last module the network calls, taken by a forward hook), in eval mode and without gradient. A
difference is a ConfigError naming the stage where they part: a wrong guess never trains differently.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import ExitStack
from typing import Any

import torch
from torch import Tensor, nn

from actcache.errors import ConfigError
from actcache_client.layouts._base import Layout, pixel_inputs, text_inputs
from actcache_client.layouts._stages import call_sites
from actcache_client.transport._state import State

__all__ = ["check_layout"]

_LABELS = ("labels", "label")
_CHECK_ROWS = 2  # rows of the batch checked (two, not one: a squeeze in the network keeps the batch dimension)
_FIX = ("pass stages=StagedModel([...]) built from its modules in the order its forward calls them, or "
        "blocks=\"<dotted path>\" if its blocks are an nn.ModuleList, or register a layout for it "
        "(actcache_client.layouts.register_layout)")


def _first(value: Any) -> Tensor | None:
    if isinstance(value, Tensor):
        return value
    if isinstance(value, (tuple, list)):
        return next((t for t in (_first(v) for v in value) if t is not None), None)
    if isinstance(value, Mapping):
        return next((t for t in (_first(v) for v in value.values()) if t is not None), None)
    return None


def _call(net: nn.Module, layout: Layout, data: Any, given: State) -> None:
    if isinstance(data, Mapping) and layout.inputs_of in (text_inputs, pixel_inputs):  # a model's own keywords
        net(**{k: v for k, v in data.items() if k not in _LABELS})
    elif isinstance(given, tuple):
        net(*given)
    else:
        net(given)


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, Tensor):
        return value.to(device)
    if isinstance(value, tuple):
        return tuple(_to(v, device) for v in value)
    if isinstance(value, list):
        return [_to(v, device) for v in value]
    if isinstance(value, Mapping):
        return {k: _to(v, device) for k, v in value.items()}
    return value


def _rows(state: State, rows: Tensor) -> State:
    return tuple(t[rows] for t in state) if isinstance(state, tuple) else state[rows]


def _first_rows(value: Any, batch: int) -> Any:
    """``value`` with each tensor of ``batch`` rows cut to its first ``_CHECK_ROWS``."""
    if isinstance(value, Tensor):
        return value[:_CHECK_ROWS] if value.dim() and value.shape[0] == batch else value
    if isinstance(value, (tuple, list)):
        return type(value)(_first_rows(v, batch) for v in value)
    if isinstance(value, Mapping):
        return {k: _first_rows(v, batch) for k, v in value.items()}
    return value


def check_layout(net: nn.Module, layout: Layout, data: Any, loaded: Tensor | None = None) -> None:
    """Check that every stage of ``layout`` computes what ``net`` computes on a batch.

    Args:
        net: The network.
        layout: Its layout.
        data: A batch as the loader yields it.
        loaded: The rows the loader loaded, when the others hold placeholders.

    Raises:
        ConfigError: A stage computes other than ``net``.
    """
    stages = list(layout.stages.stages)
    sites = call_sites(net, stages)
    paths = {id(m): name for name, m in net.named_modules()}
    given = layout.inputs_of(data)
    if loaded is not None:
        given, data = _rows(given, loaded), None
    first = _first(given)
    if first is not None and first.dim():  # a few rows show a wrong guess as well as the batch, for less
        batch = first.shape[0]
        given, data = _first_rows(given, batch), _first_rows(data, batch)
    device = next((p.device for p in net.parameters()), torch.device("cpu"))  # where the loop moves its batch
    given, data = _to(given, device), _to(data, device)
    outputs: dict[int, tuple[int, Tensor | None]] = {}  # id(site) -> (call order, first tensor of its first call)

    def record(module: nn.Module, args: Any, output: Any) -> None:
        if id(module) not in outputs:  # a copy: the next module may change its input in place (ReLU(inplace=True))
            first = _first(output)
            outputs[id(module)] = (len(outputs), first.clone() if first is not None else None)

    modes = [(m, m.training) for m in (*net.modules(), *layout.stages.modules())]
    devices = sorted({p.device.index or 0 for p in net.parameters() if p.device.type == "cuda"})
    patched = {id(m): m for stage in sites for m in stage}
    with ExitStack() as stack:
        stack.enter_context(torch.random.fork_rng(devices=devices))
        stack.enter_context(torch.no_grad())
        for module in patched.values():  # the network's own forward, not a served prefix
            own = module.__dict__.pop("forward", None)
            if own is not None:
                stack.callback(setattr, module, "forward", own)
            stack.enter_context(module.register_forward_hook(record))
        stack.callback(lambda: [m.train(mode) for m, mode in modes])
        net.eval()
        layout.stages.eval()
        try:
            _call(net, layout, data, given)
        except Exception as exc:
            raise ConfigError(
                f"actcache checks the stages found in a {type(net).__name__} against its own forward on the first "
                f"batch, calling it on the batch's input, and that call failed ({type(exc).__name__}: {exc}); "
                "pass inputs= so that net(inputs(batch)) is the network's forward, or check=False "
                "(CacheOptions(check=False)) to skip the check") from exc
        state: State = given
        for stage, stage_sites in zip(stages[:-1], sites):
            try:
                state = stage(state)
            except ConfigError:
                raise
            except Exception as exc:
                raise ConfigError(f"stage {stage.name!r} of the {layout.family or 'given'} layout fails on this "
                                  f"batch ({type(exc).__name__}: {exc}); {_FIX}") from exc
            _compare(net, layout, stage.name, stage_sites, outputs, paths, layout.output_of(state, _first(given)))


def _compare(net: nn.Module, layout: Layout, name: str, sites: list[nn.Module], outputs: dict[int, tuple[int, Tensor | None]],
             paths: dict[int, str], served: Any) -> None:
    where = ", ".join(paths.get(id(m), type(m).__name__) for m in sites) or "no module of the network"
    called = [outputs[id(m)] for m in sites if id(m) in outputs]
    family = f"the {layout.family} layout" if layout.family else "the stages given"
    if not called:
        raise ConfigError(f"{family} of a {type(net).__name__} serves stage {name!r} where the network calls "
                          f"{where}, and its forward never called it on this batch; {_FIX}")
    expected, got = _first(max(called, key=lambda c: c[0])[1]), _first(served)
    if expected is None or got is None or expected.shape != got.shape:
        shapes = f"{None if got is None else list(got.shape)} against {None if expected is None else list(expected.shape)}"
        raise ConfigError(f"{family} of a {type(net).__name__} parts from its own forward at stage {name!r} "
                          f"({where}): the stage gives a {shapes} from the network; {_FIX}")
    eps = torch.finfo(expected.dtype).eps if expected.is_floating_point() else 0.0
    if not torch.allclose(got.to(expected.dtype), expected, rtol=max(1e-4, 64 * eps), atol=max(1e-5, 64 * eps)):
        diff = (got.to(expected.dtype) - expected).abs().max().item()
        raise ConfigError(f"{family} of a {type(net).__name__} parts from its own forward at stage {name!r} "
                          f"({where}): the outputs differ by up to {diff:.3g} on this batch, so the network would "
                          f"train differently with the cache; {_FIX}")
